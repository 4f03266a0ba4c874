"""Measured step times from Megatron-LM's functional tests, as rows the planner can state.

Megatron-LM keeps, for every functional test case, its run's arguments
(``tests/functional_tests/test_cases/<model>/<case>/model_config.yaml``: ENV_VARS and
MODEL_ARGS) and the values each CI platform logged per iteration
(``golden_values_<env>_<platform>.json``: ``iteration-time`` in seconds,
``mem-allocated-bytes``, ``mem-max-allocated-bytes``, ...). The GPU count of a run is its
recipe's (``tests/test_utils/recipes/<platform dir>/<model>.yaml``: ``nodes`` x ``gpus``).

One CSV row per (test case, golden file) that is a training run the planner can state, in
the columns of ``benchmarks/published_runs.csv`` plus ``EXTRA_COLUMNS``. ``value`` is the
median ``iteration-time`` after the first ``WARMUP`` logged values (warm-up and compile),
'nan' entries ignored; the memory columns are medians over the same iterations. Settings the
planner does not model but which can matter for speed are listed in ``flags``; a value not
stated in the config is Megatron-LM's default (megatron/training/arguments.py and the
config dataclasses) and is said so in ``notes``. The GPU count is that of the recipe that
lists the case for the golden file's environment and platform, else of one that lists it for
the platform's recipe folder, else the folder's ``<model>.yaml`` default (``gpu_count``; the
row's notes say which). Golden files are skipped, with the reason counted, where the planner
cannot state the run: inference, RL and release tests, other model families (BERT, T5,
multimodal, hybrid/Mamba, MIMO, Nemotron, converters), features without a column or GPT spec
key (``UNSTATED`` and the checks in ``build_row``), and golden files without a platform in
their name or without ``iteration-time``.

Run: ``.venv/bin/python benchmarks/harvest_megatron_ci.py --repo MEGATRON_LM_GIT_DIR
[--commit REV] [--out CSV]`` (the committed CSV: commit d98e8a64).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import re
import statistics
import subprocess
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from planner.logs.megatron import Args, Unstated, as_list, row_of

HERE = Path(__file__).resolve().parent
CASES = "tests/functional_tests/test_cases"
RECIPES = "tests/test_utils/recipes"
WARMUP = 3  # logged iteration times left out before the median
MIN_STEADY = 3  # fewest iteration times a median is taken over

# the columns of benchmarks/published_runs.csv (its header has no quoted names)
PUBLISHED_COLUMNS = (HERE / "published_runs.csv").read_text().splitlines()[0].split(",")
EXTRA_COLUMNS = [
    "etp",
    "zero",
    "mem_allocated_bytes",
    "mem_max_allocated_bytes",
    "iterations",
    "platform",
    "environment",
    "test_case",
    "flags",
]
COLUMNS = PUBLISHED_COLUMNS + EXTRA_COLUMNS

# Model directories that hold no GPT/MoE training run the planner states.
OTHER_FAMILIES = {
    "bert": "BERT",
    "t5": "T5",
    "multimodal-llava": "multimodal",
    "hybrid": "hybrid/Mamba",
    "mimo": "MIMO",
    "nemotron": "Nemotron (hybrid)",
    "common": "checkpoint converter / module tests",
    "gpt-nemo": "NeMo recipe (no Megatron-LM arguments)",
}

# Arguments a column or the GPT spec states: not repeated in ``flags``.
STATED = {
    "--num-layers",
    "--grad-reduce-in-bf16",
    "--hidden-size",
    "--num-attention-heads",
    "--ffn-hidden-size",
    "--group-query-attention",
    "--num-query-groups",
    "--kv-channels",
    "--swiglu",
    "--normalization",
    "--position-embedding-type",
    "--use-rotary-position-embeddings",
    "--disable-bias-linear",
    "--untie-embeddings-and-output-weights",
    "--hidden-dropout",
    "--attention-dropout",
    "--max-position-embeddings",
    "--seq-length",
    "--micro-batch-size",
    "--global-batch-size",
    "--tensor-model-parallel-size",
    "--pipeline-model-parallel-size",
    "--context-parallel-size",
    "--expert-model-parallel-size",
    "--expert-tensor-parallel-size",
    "--num-layers-per-virtual-pipeline-stage",
    "--num-virtual-stages-per-pipeline-rank",
    "--virtual-pipeline-model-parallel-size",
    "--sequence-parallel",
    "--use-distributed-optimizer",
    "--bf16",
    "--fp16",
    "--fp8-format",
    "--tp-comm-overlap",
    "--num-experts",
    "--moe-router-topk",
    "--moe-ffn-hidden-size",
    "--moe-shared-expert-intermediate-size",
    "--moe-shared-expert-gate",
    "--moe-layer-freq",
    "--moe-router-score-function",
    "--moe-router-enable-expert-bias",
    "--moe-router-num-groups",
    "--moe-router-group-topk",
    "--moe-router-topk-scaling-factor",
    "--recompute-granularity",
    "--recompute-modules",
    "--recompute-activations",
    "--tokenizer-type",
    "--vocab-size",
    "--padded-vocab-size",
    "--make-vocab-size-divisible-by",
    "--data-parallel-sharding-strategy",
    "--overlap-grad-reduce",
    "--train-iters",
    "--exit-interval",
}
# Arguments that leave a training step's time alone: optimiser hyperparameters, paths,
# logging destinations, data and checkpoint housekeeping.
NO_SPEED = {
    "--lr",
    "--min-lr",
    "--lr-decay-iters",
    "--lr-decay-samples",
    "--lr-decay-style",
    "--lr-warmup-fraction",
    "--lr-warmup-samples",
    "--lr-warmup-init",
    "--lr-warmup-iters",
    "--decoupled-lr",
    "--decoupled-min-lr",
    "--weight-decay",
    "--clip-grad",
    "--adam-beta1",
    "--adam-beta2",
    "--adam-eps",
    "--init-method-std",
    "--seed",
    "--split",
    "--data-path",
    "--vocab-file",
    "--merge-file",
    "--tokenizer-model",
    "--tiktoken-pattern",
    "--data-cache-path",
    "--save",
    "--load",
    "--tensorboard-dir",
    "--log-interval",
    "--tensorboard-log-interval",
    "--eval-interval",
    "--eval-iters",
    "--log-validation-ppl-to-tensorboard",
    "--log-timers-to-tensorboard",
    "--log-memory-to-tensorboard",
    "--distributed-backend",
    "--use-mcore-models",
    "--ckpt-format",
    "--dist-ckpt-strictness",
    "--use-checkpoint-opt_param-scheduler",
    "--dist-ckpt-optim-fully-reshardable",
    "--ckpt-fully-parallel-load",
    "--ckpt-fully-parallel-save",
    "--no-ckpt-fully-parallel-save",
    "--ckpt-assume-constant-structure",
    "--auto-detect-ckpt-format",
    "--no-load-optim",
    "--no-load-rng",
    "--async-strategy",
    "--use-persistent-ckpt-worker",
    "--distributed-timeout-minutes",
    "--wandb-project",
    "--wandb-exp-name",
    "--wandb-save-dir",
    "--wandb-entity",
    "--logging-level",
    "--log-progress",
    "--log-throughput",
    "--num-workers",
    "--exit-duration-in-mins",
    "--save-retain-interval",
    "--dist-ckpt-save-pre-mcore-014",
    "--override-opt_param-scheduler",
    "--no-use-tokenizer-model-from-checkpoint-args",
    "--max-tokens-to-oom",
    "--straggler-minmax-count",
    "--verify-integrity",
    "--mock-data",
    "--async-save",
    "--fim-data",
    "--fim-rate",
    "--fim-spm-rate",
}
# Environment variables that leave a step's time alone.
ENV_NO_SPEED = {
    "N_REPEAT",
    "N_REPEATS",
    "SKIP_PYTEST",
    "NON_DETERMINSTIC_RESULTS",
    "ARTIFACTS_ROOT",
    "HF_HOME",
    "PYTHONWARNINGS",
    "NCCL_DEBUG",
    "THROUGHPUT_START_STEP",
}

Skip = Unstated  # a case or golden file that gives no row; the message is the reason counted


@dataclass(frozen=True)
class Golden:
    """What a golden file's name says: ``golden_values_<env>_<platform>[_2nd].json``."""

    environment: str
    platform: str
    second: bool  # the resumed (second) run of a checkpoint-resume test


def golden_name(name: str) -> Golden:
    """Environment, platform and run of a golden file from its name."""
    match = re.fullmatch(r"golden_values_(dev|lts)(?:_(.+?))?(_2nd)?\.json", name)
    if not match:
        raise Skip("golden file name not golden_values_<env>_<platform>.json")
    if not match.group(2):
        raise Skip("golden file names no platform")
    return Golden(match.group(1), match.group(2), bool(match.group(3)))


def gpu_of(platform: str) -> str:
    """The planner's GPU name for a CI platform (dgx_a100, dgxa100_dracooci, dgx_gb200, ...)."""
    for gpu in ("gb200", "h100", "a100"):
        if gpu in platform:
            return gpu
    raise Skip(f"platform {platform}: GPU not known")


def platform_dir(platform: str) -> str:
    """The recipes folder of a platform: gb200 has its own, the others share h100's."""
    return "gb200" if "gb200" in platform else "h100"


# -- parsing: text in, values out ------------------------------------------------------------


def read_config(text: str) -> dict[str, Any]:
    """A model_config.yaml as a dict (ENV_VARS, MODEL_ARGS, TEST_TYPE, MODE, ...)."""
    config = yaml.safe_load(text) or {}
    if not isinstance(config, dict):
        raise Skip("model_config.yaml is not a mapping")
    return config


def steady_values(series: dict[str, Any] | None) -> list[tuple[int, float]]:
    """(iteration, value) of a golden series in iteration order, 'nan' entries dropped."""
    if not series:
        return []
    out = []
    for step, value in series.get("values", {}).items():
        number = float(value)
        if math.isfinite(number):
            out.append((int(step), number))
    return sorted(out)


@dataclass(frozen=True)
class Measured:
    step_s: float
    iterations: int  # how many iteration times the median used
    first: int  # first iteration in the median
    mem_allocated: float | None
    mem_max_allocated: float | None
    low: float  # 10th and 90th percentiles of the iteration times the median used
    high: float


def measure(golden_text: str) -> Measured:
    """Median iteration time after the first ``WARMUP`` logged values, and the memory
    medians over the same iterations."""
    try:
        golden = json.loads(golden_text)
    except json.JSONDecodeError:
        raise Skip("golden file is not JSON") from None
    times = steady_values(golden.get("iteration-time"))
    if not times:
        raise Skip("golden file has no iteration-time")
    kept = times[WARMUP:]
    if len(kept) < MIN_STEADY:
        raise Skip(f"fewer than {MIN_STEADY} iteration times after the first {WARMUP}")
    first = kept[0][0]

    def memory(key: str) -> float | None:
        values = [v for step, v in steady_values(golden.get(key)) if step >= first]
        return statistics.median(values) if values else None

    seconds = [v for _, v in kept]
    deciles = statistics.quantiles(seconds, n=10, method="inclusive")
    return Measured(
        statistics.median(seconds),
        len(kept),
        first,
        memory("mem-allocated-bytes"),
        memory("mem-max-allocated-bytes"),
        deciles[0],
        deciles[-1],
    )


def check_case(model_dir: str, config: dict[str, Any]) -> None:
    """Skip a case that is no GPT/MoE training run with a stated GPU count."""
    if model_dir in OTHER_FAMILIES:
        raise Skip(f"model family {OTHER_FAMILIES[model_dir]}")
    mode = config.get("MODE")
    if mode in ("inference", "rl"):
        raise Skip(f"{mode} test")
    if config.get("TEST_TYPE") == "release":
        raise Skip("release test: no recipe at this commit states its GPU count")


def run_flags(args: Args, env: dict[str, Any], test_type: str | None) -> list[str]:
    """Settings that can matter for speed which neither a column nor the GPT spec states:
    the gradient and parameter overlaps (on or off), every other stated argument not in
    ``STATED`` or ``NO_SPEED``, the environment variables and the test type."""
    flags = [
        f"overlap-grad-reduce={'on' if args.get('--overlap-grad-reduce') else 'off'}",
        f"overlap-param-gather={'on' if args.get('--overlap-param-gather') else 'off'}",
    ]
    for key, value in args.values.items():
        if key in STATED or key in NO_SPEED:
            continue
        if key == "--save-interval" and int(value) >= int(args.get("--train-iters", 0)):
            continue  # no checkpoint is saved within the run
        if key == "--timing-log-level" and int(value) == 0:
            continue
        if key == "--transformer-impl" and value == "transformer_engine":
            continue
        name = key.removeprefix("--")
        if value is not True:
            text = " ".join(as_list(value)) if isinstance(value, list) else str(value)
            name += "=" + text.replace(";", ",")
        flags.append(name)
    flags += [f"{key}={value}" for key, value in env.items() if key not in ENV_NO_SPEED]
    if test_type not in (None, "regular"):
        flags.append(f"test-type={test_type}")
    return flags


def build_row(
    model_dir: str,
    case: str,
    config: dict[str, Any],
    golden: Golden,
    measured: Measured,
    gpus: int,
    gpus_note: str,
    source: str,
) -> dict[str, str]:
    """One CSV row from a case's config and a golden file's figures (Skip where the planner
    cannot state the run)."""
    check_case(model_dir, config)
    values = dict(config.get("MODEL_ARGS") or {})
    if golden.second and config.get("MODEL_ARGS_2"):  # the resumed run's own arguments
        values.update(config["MODEL_ARGS_2"])
    args = Args(values)
    notes: list[str] = []
    columns = row_of(args, gpus, notes)

    if args.defaults:
        notes.insert(0, "Megatron-LM defaults (not in the config): " + ", ".join(args.defaults))
    if golden.second:
        notes.append("second run of the checkpoint-resume test, resumed from its checkpoint")
    notes.append(gpus_note)
    notes.append(
        f"median of {measured.iterations} iteration times from iteration {measured.first} "
        f"(first {WARMUP} logged values left out)"
    )
    if measured.high > 1.5 * measured.low:
        notes.append(
            f"iteration times vary: 10th-90th percentile {measured.low:.4g}-{measured.high:.4g} s"
        )
    suffix = "-2nd" if golden.second else ""

    def number(x: float | None) -> str:
        return "" if x is None else f"{x:.0f}"

    row = {
        "id": f"mcore-ci-{golden.platform}-{golden.environment}-{model_dir}-{case}{suffix}",
        **columns,
        "gpu": gpu_of(golden.platform),
        "metric": "step_s",
        "value": f"{measured.step_s:.6g}",
        "source": source,
        "notes": "; ".join(notes),
        "mem_allocated_bytes": number(measured.mem_allocated),
        "mem_max_allocated_bytes": number(measured.mem_max_allocated),
        "iterations": str(measured.iterations),
        "platform": golden.platform,
        "environment": golden.environment,
        "test_case": f"{model_dir}/{case}",
        "flags": ";".join(
            run_flags(args, dict(config.get("ENV_VARS") or {}), config.get("TEST_TYPE"))
        ),
    }
    # published_runs.csv's columns a Megatron-LM run does not state (compiled_model) are empty
    return {column: row.get(column, "") for column in COLUMNS}


# -- recipes: GPU counts ---------------------------------------------------------------------


@dataclass(frozen=True)
class Entry:
    recipe: str  # path under tests/test_utils/recipes
    model: str
    case: str
    environment: str
    platform: str
    gpus: int  # nodes x gpus per node


def recipe_entries(path: str, text: str) -> list[Entry]:
    """Every (case, environment, platform) a recipe runs, with its GPU count."""
    recipe = yaml.safe_load(text) or {}
    spec = recipe.get("spec") or {}
    if "model" not in spec or "nodes" not in spec or "gpus" not in spec:
        return []
    out = []
    for product in recipe.get("products") or []:
        nodes = int(product.get("nodes", spec["nodes"]))
        per_node = int(product.get("gpus", spec["gpus"]))
        for case in product.get("test_case", []):
            for variant in product.get("products") or [{}]:
                platforms = variant.get("platforms", [spec.get("platforms")])
                for env in variant.get("environment", []):
                    for platform in platforms:
                        out.append(
                            Entry(path, spec["model"], case, env, platform, nodes * per_node)
                        )
    return out


def recipe_defaults(path: str, text: str) -> tuple[str, str, int] | None:
    """(folder, model, GPU count) of a recipe's spec."""
    spec = (yaml.safe_load(text) or {}).get("spec") or {}
    if "model" not in spec or "nodes" not in spec or "gpus" not in spec:
        return None
    return path.split("/")[0], str(spec["model"]), int(spec["nodes"]) * int(spec["gpus"])


def gpu_count(
    entries: list[Entry], defaults: dict[tuple[str, str], int], model: str, case: str, g: Golden
) -> tuple[int, str]:
    """The GPU count of a case's run on a platform, and where it comes from: the recipe that
    lists the case for that environment and platform; else the one that lists the case for the
    platform's recipe folder; else that folder's ``<model>.yaml`` default."""
    folder = platform_dir(g.platform)
    mine = [e for e in entries if e.model == model and e.case == case]
    exact = [e for e in mine if (e.environment, e.platform) == (g.environment, g.platform)]
    near = [e for e in mine if e.recipe.startswith(folder + "/")]
    tries = [
        (exact, "lists the case for this environment and platform"),
        (near, f"lists the case (not for {g.environment} {g.platform})"),
    ]
    for found, how in tries:
        counts = {e.gpus for e in found}
        if len(counts) == 1:
            count = counts.pop()
            names = ", ".join(sorted({e.recipe for e in found}))
            return count, f"{count} GPUs: recipe {names} {how}"
        if len(counts) > 1:
            raise Skip("recipes disagree on the GPU count")
    if (folder, model) in defaults:
        count = defaults[(folder, model)]
        return count, (
            f"{count} GPUs: no recipe lists the case at this commit; {folder}/{model}.yaml's "
            "spec default"
        )
    raise Skip("no recipe states the GPU count")


# -- the mirror ------------------------------------------------------------------------------


class Repo:
    """Files of one commit of a bare git mirror."""

    def __init__(self, path: Path, commit: str) -> None:
        self.path = path
        self.commit = self.git("rev-parse", commit).strip()

    def git(self, *args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(self.path), *args], capture_output=True, text=True, check=True
        ).stdout

    def files(self, under: str) -> list[str]:
        return self.git("ls-tree", "-r", "--name-only", self.commit, under).split()

    def read(self, path: str) -> str:
        return self.git("show", f"{self.commit}:{path}")


def harvest(repo: Repo) -> tuple[list[dict[str, str]], Counter[str], dict[str, set[str]]]:
    """The rows of every golden file at the commit, the skipped golden files by reason and the
    cases behind each reason."""
    entries: list[Entry] = []
    defaults: dict[tuple[str, str], int] = {}
    for path in repo.files(RECIPES):
        if not path.endswith(".yaml"):
            continue
        text = repo.read(path)
        name = path.removeprefix(RECIPES + "/")
        entries += recipe_entries(name, text)
        found = recipe_defaults(name, text)
        if found and Path(name).stem == found[1]:
            defaults[(found[0], found[1])] = found[2]
    cases: dict[tuple[str, str], list[str]] = {}
    for path in repo.files(CASES):
        parts = path.split("/")
        if len(parts) == 6:
            cases.setdefault((parts[3], parts[4]), []).append(parts[5])
    rows: list[dict[str, str]] = []
    skipped: Counter[str] = Counter()
    skipped_cases: dict[str, set[str]] = {}
    for (model, case), names in sorted(cases.items()):
        goldens = sorted(n for n in names if n.startswith("golden_values_"))
        config: dict[str, Any] | None = None
        for name in goldens:
            path = f"{CASES}/{model}/{case}/{name}"
            try:
                check_case(model, {})
                if "model_config.yaml" not in names:
                    raise Skip("no model_config.yaml")
                g = golden_name(name)
                if config is None:
                    config = read_config(repo.read(f"{CASES}/{model}/{case}/model_config.yaml"))
                check_case(model, config)
                measured = measure(repo.read(path))
                gpus, note = gpu_count(entries, defaults, model, case, g)
                source = f"https://github.com/NVIDIA/Megatron-LM/blob/{repo.commit}/{path}"
                rows.append(build_row(model, case, config, g, measured, gpus, note, source))
            except Skip as why:
                skipped[str(why)] += 1
                skipped_cases.setdefault(str(why), set()).add(f"{model}/{case}")
    ids = Counter(r["id"] for r in rows)
    assert max(ids.values(), default=1) == 1, [i for i, n in ids.items() if n > 1]
    return rows, skipped, skipped_cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--repo",
        type=Path,
        required=True,
        help="a Megatron-LM git directory (a clone, or a bare one: it is read with git show)",
    )
    parser.add_argument("--commit", default="HEAD")
    parser.add_argument("--out", type=Path, default=HERE / "megatron_ci_runs.csv")
    args = parser.parse_args()
    rows, skipped, skipped_cases = harvest(Repo(args.repo, args.commit))
    with args.out.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, COLUMNS, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
    by = Counter(f"{r['gpu']} {r['test_case'].split('/')[0]}" for r in rows)
    print(f"wrote {len(rows)} rows to {args.out}")
    for key, n in sorted(by.items()):
        print(f"  {n:4} {key}")
    print(f"skipped {sum(skipped.values())} golden files:")
    for reason, n in skipped.most_common():
        print(f"  {n:4} ({len(skipped_cases[reason])} cases) {reason}")


if __name__ == "__main__":
    main()
