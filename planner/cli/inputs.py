"""The command line's flags turned into the library's inputs: the model, the cluster, the
training job and a stated layout (by flags, a layout or plan file, or a published recipe), with
each bad value refused in one line that names its flag."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

from planner.catalog import language_model_only, load_cluster, load_model
from planner.cli.arguments import JOB_FLAGS, LAYOUT_DEFAULTS
from planner.errors import PlannerError
from planner.layout import Layout
from planner.recipes import Recipe, load_recipe
from planner.specs import ClusterSpec, ModelSpec, TrainingJob


def training_job(args: argparse.Namespace, seq_len: int, global_batch: int) -> TrainingJob:
    """The job the dtype flags describe, at this sequence length and global batch."""
    return TrainingJob(
        seq_len=seq_len,
        global_batch=global_batch,
        moment_dtype=args.moment_dtype,
        compute_dtype=args.compute_dtype,
        ema=args.ema,
        **({"grad_dtype": args.grad_dtype} if args.grad_dtype else {}),
        **({"framework": args.framework} if getattr(args, "framework", None) else {}),
        **({"compiled_loss": True} if getattr(args, "compiled_loss", False) else {}),
        **({"compiled_model": True} if getattr(args, "compiled_model", False) else {}),
        **({"eager_norm": True} if getattr(args, "eager_norm", False) else {}),
        **({"loss_fusion": args.loss_fusion} if getattr(args, "loss_fusion", None) else {}),
        **({"loss_chunks": args.loss_chunks} if getattr(args, "loss_chunks", None) else {}),
        **(
            {"moe_dispatcher": args.moe_dispatcher} if getattr(args, "moe_dispatcher", None) else {}
        ),
        **({"tp_comm_overlap": False} if getattr(args, "tp_comm_overlap", None) is False else {}),
        **({"moe_grouped_tensor": True} if getattr(args, "moe_grouped_tensor", None) else {}),
        **({"exposed_grad_reduce": True} if getattr(args, "exposed_grad_reduce", None) else {}),
        **(
            {"attention_kernel": args.attention_kernel}
            if getattr(args, "attention_kernel", None)
            else {}
        ),
        **(
            {"memory_margin": args.memory_margin}
            if getattr(args, "memory_margin", None) is not None
            else {}
        ),
    )


def _recipe(args: argparse.Namespace) -> Recipe | None:
    """The recipe ``--recipe`` names, if any; the job flags must then be left out."""
    given = [f"--{f.replace('_', '-')}" for f in JOB_FLAGS if getattr(args, f) is not None]
    # The job's software settings are the recipe's too (the precisions have defaults, so
    # they cannot tell given from left out).
    flags = {
        "framework": "--framework",
        "moe_dispatcher": "--moe-dispatcher",
        "tp_comm_overlap": "--no-tp-comm-overlap",
        "moe_grouped_tensor": "--moe-grouped-tensor",
        "exposed_grad_reduce": "--exposed-grad-reduce",
        "attention_kernel": "--attention-kernel",
        "loss_fusion": "--loss-fusion",
    }
    given += [flag for f, flag in flags.items() if getattr(args, f, None) is not None]
    if args.recipe is None:
        missing = [f"--{f.replace('_', '-')}" for f in JOB_FLAGS if getattr(args, f) is None]
        if missing:
            raise PlannerError(f"{missing[0]}: required (or --recipe NAME; see planner recipes)")
        return None
    if given:
        raise PlannerError(
            f"{given[0]}: --recipe={args.recipe} sets the model, machine, GPUs and job; "
            "leave it out"
        )
    return load_recipe(args.recipe)


def model_cluster_job(
    args: argparse.Namespace, recipe: Recipe | None = None
) -> tuple[ModelSpec, ClusterSpec, TrainingJob]:
    """The model, cluster and job the flags or ``--recipe`` state."""
    recipe = recipe or _recipe(args)
    if recipe is not None:
        return recipe.model, recipe.cluster, with_margin(args, recipe.job)
    model = load_model(args.model)
    if language_model_only(args.model):
        print(
            f"planner: {model.name}: the language model of a multimodal config (its "
            "text_config); its vision tower is not planned: neither its parameters, its work "
            "nor its memory are counted",
            file=sys.stderr,
        )
    cluster = load_cluster(args.cluster, gpus=args.gpus)
    job = training_job(args, args.seq_len, args.global_batch)
    return model, cluster, job


def with_margin(args: argparse.Namespace, job: TrainingJob) -> TrainingJob:
    """``job`` with ``--memory-margin`` where given (a recipe's job too: the margin is how
    much the planner keeps free, not part of the published run)."""
    margin = getattr(args, "memory_margin", None)
    if margin is None:
        return job
    return TrainingJob.model_validate({**job.model_dump(), "memory_margin": margin})


def build(args: argparse.Namespace) -> tuple[ModelSpec, ClusterSpec, TrainingJob, Layout]:
    """The model, cluster, job and layout: from ``--recipe``, a ``--layout`` file, or the
    layout flags."""
    recipe = _recipe(args)
    model, cluster, job = model_cluster_job(args, recipe)
    if args.layout or recipe is not None:
        source = f"--layout={args.layout!r}" if args.layout else f"--recipe={args.recipe}"
        for dest, default in LAYOUT_DEFAULTS.items():
            if getattr(args, dest, default) != default:
                flag = "--" + dest.replace("_", "-")
                raise PlannerError(
                    f"{flag}={getattr(args, dest)}: {source} states the whole layout; leave "
                    "the layout flags out"
                )
    if recipe is not None and not args.layout:
        return model, cluster, job, recipe.layout
    if args.layout:
        layout = _layout_file(args.layout)
        if layout.world_size != cluster.num_gpus:
            raise PlannerError(
                f"--layout={args.layout!r}: its tp*cp*pp*dp={layout.world_size} must equal "
                f"--gpus={cluster.num_gpus}"
            )
        return model, cluster, job, layout
    return model, cluster, job, _flag_layout(args, model)


def _flag_layout(args: argparse.Namespace, model: ModelSpec) -> Layout:
    """The uniform layout the degree, schedule and recompute flags state."""
    for degree in ("tp", "cp", "pp", "ep", "etp"):
        if getattr(args, degree) <= 0:
            raise PlannerError(f"--{degree}={getattr(args, degree)}: must be a positive degree")
    if args.virtual_stages is not None and args.virtual_stages <= 0:
        raise PlannerError(
            f"--virtual-stages={args.virtual_stages}: must be a positive number of chunks per rank"
        )
    world = args.tp * args.cp * args.pp
    if args.gpus % world:
        raise PlannerError(f"--gpus={args.gpus}: must be a multiple of tp*cp*pp={world}")
    return Layout.uniform(
        model,
        pp=args.pp,
        tp=args.tp,
        cp=args.cp,
        cp_comm_type=args.cp_comm_type,
        cp_a2a_size=args.cp_a2a_size,
        zero_hpz=args.zero_hpz,
        optimizer_instances=args.optimizer_instances,
        param_offload=args.param_offload,
        dp=args.gpus // world,
        ep=args.ep,
        etp=args.etp,
        zero=args.zero,
        micro_batch=args.micro_batch,
        schedule=args.schedule,
        virtual_stages=args.virtual_stages,
        recompute=_offload_layers(model, args.recompute, args.offload_layers),
        ema="host" if args.ema_on_host else "hbm",
        fp8_cache=args.fp8_cache,
        sequence_parallel=not args.no_sequence_parallel,
        optimizer_offload=args.optimizer_offload,
    )


def writable_file(flag: str, value: str | None) -> Path | None:
    """The output file ``value`` of ``flag``, refused in one line before any work when it
    cannot be written: its folder missing or read-only, the file a folder or read-only."""
    if value is None:
        return None
    path = Path(value)
    folder = path.parent
    if path.is_dir():
        raise PlannerError(f"{flag}={value!r}: is a directory; give a file name")
    if not folder.is_dir():
        raise PlannerError(f"{flag}={value!r}: cannot write (no such directory {str(folder)!r})")
    if not os.access(folder, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise PlannerError(f"{flag}={value!r}: cannot write (permission denied)")
    return path


def positive_seconds(value: float) -> None:
    """Refuse a ``--time-limit`` that is not a finite positive number of seconds."""
    if not (math.isfinite(value) and value > 0):
        raise PlannerError(f"--time-limit={value:g}: must be a positive number of seconds")


def _offload_layers(model: ModelSpec, recompute: str, n: int) -> str | dict[str, str]:
    """``--recompute`` for every layer, or with ``--offload-layers N`` the first N layers
    offloaded and the rest at ``--recompute``."""
    if n == 0:
        return recompute
    if not 0 < n < model.num_layers:
        raise PlannerError(
            f"--offload-layers={n}: must be between 1 and {model.num_layers - 1} (the model "
            f"has {model.num_layers} layers; one at least stays in HBM)"
        )
    return {f"layer.{i}": "offload" if i < n else recompute for i in range(model.num_layers)}


def _layout_file(path: str) -> Layout:
    """A layout from a JSON file: a ``Layout``, or a plan (``planner plan --json``)."""

    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise PlannerError(f"--layout={path!r}: cannot read ({exc.strerror})") from None
    except ValueError as exc:
        raise PlannerError(f"--layout={path!r}: not JSON ({exc})") from None
    if isinstance(data, dict) and "status" in data and "layout" in data:
        if data["layout"] is None:
            raise PlannerError(f"--layout={path!r}: the plan is infeasible; it has no layout")
        data = data["layout"]
    if not isinstance(data, dict):
        raise PlannerError(f"--layout={path!r}: expected a JSON object (a layout or a plan)")
    return Layout(**data)
