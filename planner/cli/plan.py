"""``planner plan``: the fastest layout that fits, or why none does."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console

from planner.cli.inputs import model_cluster_job, positive_seconds
from planner.cli.render import (
    cli_words,
    plot_estimate,
    print_decisions,
    print_groups,
    print_memory,
    print_runners_up,
    print_time,
)
from planner.errors import PlannerError
from planner.layout import Layout
from planner.plots import picture_paths
from planner.solve import plan
from planner.solve.result import Plan
from planner.specs import ModelSpec, SearchSpace, TrainingJob


def plan_command(args: argparse.Namespace) -> bool:
    """Plan and print; whether a layout that fits was found."""
    if args.plot:
        picture_paths(args.plot, option="--plot")  # a bad suffix fails before the search
    positive_seconds(args.time_limit)
    earlier = earlier_plan(args) if args.from_plan else None
    if earlier is not None:
        assert earlier.model and earlier.cluster and earlier.job  # earlier_plan checked them
        model, job = earlier.model, earlier.job
        gpus = args.gpus or earlier.cluster.num_gpus
        cluster = earlier.cluster.model_copy(update={"num_gpus": gpus})
    else:
        model, cluster, job = model_cluster_job(args)
    space = _search_space(args)
    if earlier is not None and space == SearchSpace() and earlier.space is not None:
        space = earlier.space.model_copy(update={"dp": None})  # the degrees follow the GPUs
    hints = [earlier.layout] if earlier is not None and earlier.layout is not None else []
    console = Console(width=max(Console().width, 132), stderr=True)
    for path in args.hints or []:
        given = hint_layouts(path)
        hints += [h for h in given if h not in hints]
        console.print(f"{len(given)} layouts from {path} offered to the search")
    with console.status(f"planning {model.name} on {cluster.num_gpus} x {cluster.name} ..."):
        result = plan(model, cluster, job, space, time_limit_s=args.time_limit, hints=hints)
    if args.plot and result.estimate is not None:
        plot_estimate(args.plot, result.estimate, model.name)
    found = result.layout is not None and result.estimate is not None
    if args.json:
        print(result.model_dump_json(indent=1))
        return found
    if not found:
        _print_infeasible(result)
        return False
    _print_plan(result, model, job)
    if earlier is not None:
        _print_changes(earlier, result)
    return True


def hint_layouts(path: str) -> list[Layout]:
    """The layouts of a saved plan (``planner plan --json``) or of every planned case of a
    sweep database (``planner sweep --db``); a one-line error for anything else."""
    from planner.sweep import layouts_in

    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise PlannerError(f"--hints={path!r}: cannot read ({exc.strerror})") from None
    if data.startswith(b"SQLite format 3"):
        return layouts_in(path)
    try:
        found = Plan.model_validate_json(data)
    except (ValueError, PlannerError) as exc:
        first = str(exc).splitlines()[0]
        raise PlannerError(
            f"--hints={path!r}: neither a plan (planner plan --json) nor a sweep database: {first}"
        ) from None
    return [found.layout] if found.layout is not None else []


def earlier_plan(args: argparse.Namespace) -> Plan:
    """The plan ``--from`` names, with the model, machine and job it was made for; the flags
    that would state another job refused beside it (``--gpus`` aside)."""
    path = args.from_plan
    given = [
        f for f in ("model", "cluster", "seq_len", "global_batch", "recipe") if getattr(args, f)
    ]
    if given:
        flag = "--" + given[0].replace("_", "-")
        raise PlannerError(
            f"{flag}: --from={path!r} states the model, machine and job (only --gpus may "
            "change); leave it out"
        )
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise PlannerError(f"--from={path!r}: cannot read ({exc.strerror})") from None
    try:
        found = Plan.model_validate_json(text)
    except (ValueError, PlannerError) as exc:
        first = str(exc).splitlines()[0]
        raise PlannerError(f"--from={path!r}: not a plan (planner plan --json): {first}") from None
    if found.model is None or found.cluster is None or found.job is None:
        raise PlannerError(f"--from={path!r}: the plan does not say its model, machine and job")
    return found


def _print_changes(earlier: Plan, result: Plan) -> None:
    """What the re-plan changed: GPUs, layout, step time and throughput per GPU."""
    out = Console(width=max(Console().width, 132))
    assert earlier.cluster is not None and result.layout and result.estimate
    new = f"{result.layout.shape()} on {result.layout.world_size} GPUs"
    if earlier.layout is None or earlier.estimate is None:
        out.print(f"Since the earlier plan (infeasible on {earlier.cluster.num_gpus} GPUs): {new}.")
        return
    old, est = earlier.estimate, result.estimate
    same = earlier.layout.shape() == result.layout.shape()
    out.print(
        f"Since the earlier plan on {earlier.cluster.num_gpus} GPUs: "
        + ("the same degrees and schedule" if same else f"{earlier.layout.shape()} -> {new}")
        + f"; step {old.step_time_s:.3f} s -> {est.step_time_s:.3f} s; "
        f"{old.tokens_per_s / earlier.layout.world_size:,.0f} -> "
        f"{est.tokens_per_s / result.layout.world_size:,.0f} tokens/s per GPU."
    )


def _search_space(args: argparse.Namespace) -> SearchSpace:
    """The choices the flags allow; a flag left out leaves the library's default."""
    return SearchSpace(
        tp=args.tp,
        cp=args.cp,
        cp_comm_type=args.cp_comm_type,
        zero_hpz=args.zero_hpz,
        param_offload=[False, True] if args.param_offload else None,
        pp=args.pp,
        ep=args.ep,
        etp=args.etp,
        micro_batch=args.micro_batch,
        zero=args.zero,
        schedules=args.schedule,
        recompute=args.recompute,
        fp8_cache=[False, True] if args.fp8_cache else None,
        optimizer_offload=args.optimizer_offload,
        sequence_parallel=(
            [v == "on" for v in args.sequence_parallel] if args.sequence_parallel else None
        ),
        framework=_target(args.target),
    )


def _target(names: list[str] | None) -> str | list[str] | None:
    """``--target``'s names as ``SearchSpace.framework``: none, one, 'any', or a list."""
    if not names:
        return None
    if "any" in names:
        if len(names) > 1:
            raise PlannerError(f"--target {' '.join(names)}: 'any' stands alone")
        return "any"
    return names[0] if len(names) == 1 else names


def _print_infeasible(result: Plan) -> None:
    """Why no layout fits: the binding constraints, and the fixes in the CLI's flags."""
    out = Console(width=max(Console().width, 132))
    out.print(
        f"[bold red]infeasible[/]: {result.explanation.summary if result.explanation else ''}"
    )
    if result.explanation:
        for b in result.explanation.binding:
            out.print(f"  binds: {b.family} on {b.where}: {b.excess}")
        for fix in result.explanation.fixes:
            out.print(f"  fix: {cli_words(fix)}")


def _print_plan(result: Plan, model: ModelSpec, job: TrainingJob) -> None:
    """The plan's memory and time, the proof of its quality, and each decision made."""
    out = Console(width=max(Console().width, 132))
    lay, est = result.layout, result.estimate
    assert lay is not None and est is not None  # the caller printed the infeasible case
    layers = [sum(b.block.startswith("layer.") for b in s.blocks) for s in lay.stages]
    print_memory(model.name, lay, est, job.memory_margin)
    print_time(est, result.job or job, lay, result.cluster)
    gap = (
        f"gap {result.gap:.1%} to the proven bound {result.lower_bound_s:.3f} s"
        if result.gap
        else "proven optimal"
    )
    out.print(
        f"[bold]{result.status}[/] ({gap}) after {result.solve_time_s:.1f} s over "
        f"{result.configurations} degree/schedule combinations. Layout: {lay.degrees()} "
        f"ZeRO-{lay.zero}{f' (ZeRO++ hpZ {lay.zero_hpz})' if lay.zero_hpz > 1 else ''} "
        f"micro-batch {lay.micro_batch} x"
        f"{est.num_microbatches} {lay.schedule}"
        + (f" v={lay.virtual_stages}" if lay.virtual_stages > 1 else "")
        + (", SwiGLU inputs kept in FP8" if lay.fp8_cache else "")
        + (", ZeRO-3 weights on the host" if lay.param_offload else "")
        + (", sequence parallelism off" if lay.tp > 1 and not lay.sequence_parallel else "")
        + (
            f", {lay.optimizer_offload:.0%} of the optimizer state on the host"
            if lay.optimizer_offload
            else ""
        )
        + f", layers per stage {layers}."
    )
    if result.cluster is not None:
        print_groups(lay, result.cluster)
    runs = (result.job or job).framework
    out.print(f"Run by {runs}: only layouts it runs, priced as it runs them.")
    sim = result.simulation
    if sim is not None:
        verdict = (
            "within"
            if sim.agrees
            else "[bold yellow]beyond[/] (the two price overlap differently: treat the step as "
            "uncertain by that much)"
        )
        out.print(
            f"Simulated step: {sim.step_time_s:.3f} s, {sim.difference:+.1%} from the estimate, "
            f"{verdict} the {sim.tolerance:.0%} the two models are taken to agree within. The "
            f"simulator runs each rank's kernels and transfers on shared streams, SMs and links "
            f"(planner.simulate); the estimate prices overlap by a rule per schedule."
        )
        if sim.chosen:
            out.print(f"Chosen by both models: {sim.chosen}.")
    for each in result.frameworks:  # several target frameworks: the best of each
        figure = f"{each.step_time_s:.3f} s per step" if each.step_time_s else "no layout"
        gap = f", gap {each.gap:.1%}" if each.gap else ""
        out.print(f"  {each.framework}: {figure} ({each.status}{gap})")
    print_decisions(lay, est, result.job or job)
    print_runners_up(result)
