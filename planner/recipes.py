"""Published training layouts as data: ``models/recipes/<name>.yaml``.

A recipe is a layout a team published and ran, with the job it ran: the model (a catalog
name), the machine and GPU count, the job's sequence, batch and dtypes, and the layout's
degrees, schedule and recompute. Each file cites its source and says what the source left
unstated and was assumed. ``load_recipe`` returns the planner's objects, ready for
``evaluate`` (``planner evaluate --recipe NAME``) or as the job to search
(``planner plan --recipe NAME``).

Layout keys: ``tp``, ``pp``, ``dp``, ``ep``, ``zero``, ``micro_batch``, ``schedule``,
``virtual_stages``, ``recompute``, ``fp8_cache``, and optionally ``counts``: a list of layers
per chunk, or ``first_last_alone`` (the embedding and the head each alone in a chunk, one
layer per chunk between them, as Llama 3's interleaved schedule, arXiv 2407.21783 section
3.3.2).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from planner.catalog import (
    MODELS_DIR,
    check_keys,
    load_cluster,
    load_model,
    load_yaml,
    resolve_source,
)
from planner.errors import PlannerError
from planner.frameworks import framework
from planner.layout import Layout
from planner.specs import ClusterSpec, ModelSpec, TrainingJob

RECIPES_DIR = MODELS_DIR / "recipes"
LAYOUT_KEYS = (
    "tp",
    "pp",
    "dp",
    "ep",
    "zero",
    "micro_batch",
    "schedule",
    "virtual_stages",
    "recompute",
    "fp8_cache",
    "counts",
)
# A recipe's keys; ``job`` is a ``TrainingJob``'s fields, which it checks itself.
RECIPE_KEYS = (
    "name",
    "description",
    "model",
    "cluster",
    "job",
    "layout",
    "source",
    "assumed",
    "measured",
)
CLUSTER_KEYS = ("machine", "gpus")


@dataclass(frozen=True)
class Recipe:
    """A published layout and the job it ran."""

    name: str
    description: str
    model: ModelSpec
    cluster: ClusterSpec
    job: TrainingJob
    layout: Layout
    source: str
    assumed: str
    measured: str


def recipe_names() -> list[str]:
    """Names of the published recipes."""
    return sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))


def load_recipe(source: str | Path) -> Recipe:
    """A ``Recipe`` from its name (``models/recipes/<name>.yaml``) or a path to a YAML."""
    path = resolve_source(source, RECIPES_DIR, ".yaml", "recipe", recipe_names())
    try:
        data = load_yaml(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise PlannerError(f"recipe file {path}: unreadable ({exc.__class__.__name__})") from None
    if not isinstance(data, dict):
        raise PlannerError(f"recipe file {path}: expected a mapping at the top level")
    _check(data, path)
    try:
        return _recipe(data, path)
    except KeyError as exc:
        raise PlannerError(f"recipe file {path}: missing key {exc.args[0]!r}") from None
    except PlannerError as exc:
        raise PlannerError(f"recipe file {path}: {exc}") from None
    except (TypeError, ValueError) as exc:
        first = str(exc).splitlines()[0]
        raise PlannerError(f"recipe file {path}: malformed ({first})") from None


def _check(data: dict[str, Any], path: Path) -> None:
    """Every key is one the recipe's reader knows: a typo fails rather than reading as left
    out (a default layout degree, say)."""
    file = f"recipe file {path}"
    check_keys(data, RECIPE_KEYS, file=file)
    for section, allowed in (("cluster", CLUSTER_KEYS), ("layout", LAYOUT_KEYS)):
        if section in data:
            check_keys(data[section], allowed, file=file, where=section)


def _recipe(data: dict[str, Any], path: Path) -> Recipe:
    model = load_model(data["model"])
    machine = data["cluster"]
    cluster = load_cluster(machine["machine"], gpus=machine["gpus"])
    job = TrainingJob(**data["job"])
    spec = dict(data["layout"])
    counts = spec.pop("counts", None)
    pp = spec.pop("pp", 1)
    if counts == "first_last_alone":
        v = spec.get("virtual_stages") or 1
        inner = pp * v - 2
        if inner != model.num_layers:
            raise PlannerError(
                f"layout.counts=first_last_alone: pp*virtual_stages-2={inner} chunks must hold "
                f"the {model.num_layers} layers one each"
            )
        counts = [0] + [1] * inner + [0]
    layout = (
        Layout.from_counts(model, counts=counts, pp=pp, **spec)
        if counts is not None
        else Layout.uniform(model, pp=pp, **spec)
    )
    if layout.world_size != cluster.num_gpus:
        raise PlannerError(
            f"layout: tp*pp*dp={layout.world_size} must equal cluster.gpus={cluster.num_gpus}"
        )
    return Recipe(
        name=str(data.get("name", path.stem)),
        description=str(data.get("description", "")),
        model=model,
        cluster=cluster,
        job=job,
        layout=layout,
        source=str(data["source"]),
        assumed=str(data.get("assumed", "")),
        measured=str(data.get("measured", "")),
    )


def known_layouts(model: ModelSpec, cluster: ClusterSpec, job: TrainingJob) -> list[Layout]:
    """The layouts of the catalog's recipes for this model (its architecture, whatever its
    name) on this machine, each with the schedule the job's framework runs in its place
    where its launcher does not run the recipe's (DeepSeek-V3's DualPipe becomes Megatron-LM's
    1F1B on the same stages): warm starts for ``plan``, which restates their data-parallel
    degree and micro-batch for the job's GPU count and batch (``solve.first.hinted_layouts``)."""
    launcher = framework(job.framework).launcher
    same = model.model_dump(exclude={"name"})
    out: list[Layout] = []
    for recipe in _catalog_recipes():
        if recipe.cluster.name != cluster.name or recipe.model.model_dump(exclude={"name"}) != same:
            continue
        layout = recipe.layout
        if launcher is not None and layout.schedule not in launcher.schedules:
            layout = layout.model_copy(update={"schedule": launcher.runs_instead(layout.schedule)})
        out.append(layout)
    return out


@functools.lru_cache(maxsize=1)
def _catalog_recipes() -> tuple[Recipe, ...]:
    """Every recipe of the catalog that reads, read once a process (a sweep plans many
    jobs); one that no longer reads is passed over: the catalog's own tests read each."""
    out = []
    for name in recipe_names():
        try:
            out.append(load_recipe(name))
        except PlannerError:
            continue
    return tuple(out)
