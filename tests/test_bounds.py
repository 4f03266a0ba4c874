"""The search's lower bounds hold: no layout of a configuration beats them.

For every configuration of small search spaces (dense and MoE models, every schedule, ZeRO
1-3, tight and loose HBM), the exhaustive optimum of that configuration alone
(``bruteforce.best_layout``, each layout's step time the timeline's, as ``simulate`` reports
it) is at least every bound the search prunes with: the per-degrees ``degrees_bound``, the
mean-rank ``lower_bound`` (with the busiest rank's whole layers, ``busiest_rank``), the
pipeline's fill and drain over the schedule's chains (``fill_and_drain``) and the linear
relaxation ``lp_bound``; and the bounds with every layer at one recompute choice (a target
launcher's rule: ``choice_bound`` for the choice of the fastest such layout, ``lower_bound``,
``one_choice_bound`` (each choice's crowded rank) and ``lp_bound`` over all of them) are at
most that layout's step. A bound that
cut off a better layout would make the planner call a worse layout optimal.
"""

from __future__ import annotations

import math

import pytest
from bruteforce import best_layout, best_layouts

import planner
from planner.costs.cap import memory_cap
from planner.solve.bounds import (
    bound_tables,
    busiest_rank,
    crowded_rank,
    degrees_bound,
    fill_and_drain,
    lower_bound,
    one_choice_bound,
)
from planner.solve.lpbound import choice_bound, lp_bound
from planner.solve.space import enumerate_configs
from planner.solve.tables import Config

GiB = 2**30
H100x8 = planner.load_cluster("h100", gpus=8)


def _pinned(c: Config) -> planner.SearchSpace:
    return planner.SearchSpace(
        tp=[c.tp],
        pp=[c.pp],
        dp=[c.dp],
        ep=[c.ep],
        etp=[c.etp],
        cp=[c.cp],
        sequence_parallel=[c.sequence_parallel],
        zero=[c.zero],
        micro_batch=[c.micro_batch],
        schedules=[c.schedule],
        virtual_stages=[c.virtual_stages],
        ema=[c.ema],  # type: ignore[list-item]
        recompute=["none", "full"],
    )


CASES = [  # model, layers, global batch, HBM GiB, schedules, ZeRO stages
    ("llama3-8b", 6, 16, 20, ["interleaved"], [1, 3]),
    ("llama3-8b", 5, 16, 20, ["1f1b", "zb-h1"], [1, 3]),
    ("llama3-8b", 4, 16, 10, ["1f1b", "zb-h1", "dualpipe", "dualpipev"], [1, 2, 3]),
    ("mixtral-8x7b", 4, 16, 40, ["1f1b", "interleaved", "dualpipev"], [1, 3]),
    ("mixtral-8x7b", 4, 16, 80, ["zb-h1", "dualpipe"], [1, 2, 3]),
]


@pytest.mark.slow
@pytest.mark.parametrize(("name", "layers", "batch", "hbm_gib", "schedules", "zero"), CASES)
def test_bounds_never_exceed_the_exhaustive_optimum(
    name: str, layers: int, batch: int, hbm_gib: int, schedules: list[str], zero: list[int]
) -> None:
    model = planner.load_model(name).model_copy(update={"num_layers": layers})
    cluster = H100x8.model_copy(update={"hbm_bytes": hbm_gib * GiB})
    # The eager runtime's framework runs every schedule the planner knows (no launcher
    # narrows them); HBM sizes set for it.
    job = planner.TrainingJob(
        seq_len=2048, global_batch=batch, grad_dtype="bf16", framework="torch"
    )
    space = planner.SearchSpace(
        tp=[1, 2], pp=[2, 4], zero=zero, micro_batch=[1, 2], schedules=schedules
    )
    if layers > 4:  # a smaller space where the exhaustive search is slow
        space = space.model_copy(update={"tp": [2], "micro_batch": [1]})
    elif model.num_experts:  # the MoE layers' many options: one micro-batch size
        space = space.model_copy(update={"micro_batch": [1]})
    checked = binding = drained = crowded = lifted = crowds = 0
    for config in enumerate_configs(model, cluster, job, space):
        mean = lower_bound(model, cluster, job, config)
        tables = bound_tables(model, cluster, job, config)
        rank = busiest_rank(tables, config) if tables is not None else 0.0
        drain = fill_and_drain(tables, config) if tables is not None else 0.0
        cap = memory_cap(cluster, job)
        crowd = crowded_rank(tables, config, cap) if tables is not None else 0.0
        degrees = degrees_bound(model, cluster, job, config)
        relaxed = lp_bound(model, cluster, job, config)
        best, uniform = best_layouts(model, cluster, job, _pinned(config))
        if uniform:
            # The choice of the fastest such layout, by itself (the one a bound must not pass
            # for the least over the choices to hold)
            choice, (_, est) = min(uniform.items(), key=lambda kv: kv[1][1].step_time_s)
            one = choice_bound(model, cluster, job, config, choice)
            assert one is not None and one <= est.step_time_s * (1 + 1e-9), (config, choice, one)
            lifted += one > (relaxed or 0.0) * (1 + 1e-9)
            fastest = est.step_time_s
            cheap = lower_bound(model, cluster, job, config, one_choice=True)
            assert cheap is not None and cheap <= fastest * (1 + 1e-9), (config, cheap, fastest)
            both = lp_bound(model, cluster, job, config, one_choice=True)
            assert both is not None and both <= fastest * (1 + 1e-9), (config, both, fastest)
            each = one_choice_bound(model, cluster, job, config)
            assert each is not None and each <= fastest * (1 + 1e-9), (config, each, fastest)
            crowds += each > cheap * (1 + 1e-9)
        if best is None:
            continue
        assert mean is not None, config  # "no layout fits" would be wrong: one does
        optimum = best[1].step_time_s
        assert mean <= optimum * (1 + 1e-9), (config, mean, optimum)
        assert degrees is not None and degrees <= optimum * (1 + 1e-9), (config, degrees, optimum)
        assert relaxed is not None and relaxed <= optimum * (1 + 1e-9), (config, relaxed, optimum)
        assert rank <= optimum * (1 + 1e-9), (config, rank, optimum)
        assert drain <= optimum * (1 + 1e-9), (config, drain, optimum)
        assert crowd <= optimum * (1 + 1e-9), (config, crowd, optimum)
        crowded += crowd > max(mean, rank) * (1 + 1e-9)
        checked += 1
        binding += rank >= mean * (1 - 1e-12)
        drained += drain >= mean * (1 - 1e-12)
    assert checked >= 5
    # The busiest rank with whole layers is what the bound is somewhere (it lifts the mean
    # rank's share), so the checks above test it.
    assert binding >= 1, (name, schedules)
    print(
        name,
        schedules,
        "fill and drain binds",
        drained,
        "crowded lifts",
        crowded,
        "one choice lifts",
        lifted,
        "its crowded rank lifts",
        crowds,
        "of",
        checked,
    )


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_one_micro_batch_s_chain_holds_with_fewer_micro_batches_than_stages(
    schedule: str,
) -> None:
    """One micro-batch on a 4-deep pipeline: the mean rank's share of the work is a quarter
    of that micro-batch's, while the step holds its forward and backward through every
    stage, one after another. The cheap bound stays under the exhaustive optimum and, with
    that chain, above 0.6 of it (without it, near 0.25: the rest of the step is the
    eager runtime's optimizer step and, under ZB-H1, the deferred weight gradients)."""
    model = planner.load_model("llama3-8b").model_copy(update={"num_layers": 4})
    cluster = planner.load_cluster("h100", gpus=4)
    job = planner.TrainingJob(seq_len=2048, global_batch=1, framework="torch")
    space = planner.SearchSpace(tp=[1], pp=[4], zero=[1], micro_batch=[1], schedules=[schedule])
    configs = list(enumerate_configs(model, cluster, job, space))
    assert configs
    for config in configs:
        assert config.num_microbatches == 1
        bound = lower_bound(model, cluster, job, config)
        best = best_layout(model, cluster, job, _pinned(config))
        assert bound is not None and best is not None
        optimum = best[1].step_time_s
        assert 0.6 * optimum <= bound <= optimum * (1 + 1e-9), (config, bound, optimum)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "interleaved", "zb-h1", "dualpipev"])
def test_fill_and_drain_holds_where_it_binds(schedule: str) -> None:
    """Few micro-batches on a 4-deep pipeline, where the fill and drain are a large part of
    the step: the bound over the schedule's chains is under the exhaustive optimum, and on
    the one-chunk schedules well above the busiest rank's work alone."""
    model = planner.load_model("llama3-8b").model_copy(update={"num_layers": 12})
    cluster = planner.load_cluster("h100", gpus=4)
    job = planner.TrainingJob(
        seq_len=2048, global_batch=8 if schedule == "dualpipev" else 4, framework="torch"
    )  # a framework that runs every schedule
    space = planner.SearchSpace(
        tp=[1], pp=[4], zero=[1], micro_batch=[1], schedules=[schedule], recompute=["none"]
    )
    configs = list(enumerate_configs(model, cluster, job, space))
    assert configs
    for config in configs:
        tables = bound_tables(model, cluster, job, config)
        assert tables is not None
        drain = fill_and_drain(tables, config)
        pinned = _pinned(config).model_copy(update={"recompute": ["none"]})
        best = best_layout(model, cluster, job, pinned)
        assert best is not None
        optimum = best[1].step_time_s
        assert drain <= optimum * (1 + 1e-9), (config, drain, optimum)
        if schedule in ("1f1b", "zb-h1"):
            # well above: the fill and drain of 4 stages at 4 micro-batches is 3/7 of the
            # step under 1F1B. ZB-H1 fills most of it with weight-gradient work (the eager
            # runtime's gradient accumulation among it), so its chains stand only just above
            # the busiest rank (0.2% here at the Hopper's sustained tensor rate). Both figures
            # end with the rank's optimizer step, the eager runtime's single-tensor AdamW (20
            # passes an element), which narrows the ratio further.
            busiest = busiest_rank(tables, config)
            if schedule == "1f1b":
                assert drain >= 1.05 * busiest, (config, drain, busiest)
            else:
                assert drain > busiest, (config, drain, busiest)


def test_the_host_check_from_the_state_alone_is_the_tables_own() -> None:
    """``plan`` decides where the EMA may live from ``tables.states`` (no recompute option
    priced); it must say what the full tables say, on configurations either side of the
    host's RAM."""
    from planner.solve.bounds import host_fits
    from planner.solve.tables import states

    model = planner.load_model("llama3-70b").model_copy(update={"num_layers": 8})
    cluster = planner.load_cluster("h100", gpus=16)
    job = planner.TrainingJob(seq_len=2048, global_batch=32, ema="fp32")
    verdicts = set()
    for ram in (2**31, 2**36):
        small = cluster.model_copy(update={"host_ram_bytes": ram})
        for config in enumerate_configs(model, small, job, planner.SearchSpace(micro_batch=[1])):
            tables = bound_tables(model, small, job, config)
            if tables is None:
                continue
            layers = [tables.kinds[k].state for k in tables.layer_kinds]
            assert states(model, job, config) == (layers, tables.fixed_state), config
            full = host_fits(layers, tables.fixed_state, small, config)
            assert host_fits(*states(model, job, config), small, config) == full, config
            verdicts.add(full)
    assert verdicts == {True, False}


def test_the_bound_tables_price_every_choice_the_space_lists() -> None:
    """A choice the space lists that no block's menu holds and no menu choice beats on both
    bytes kept and time (Llama's core_attn+layernorm: the menu has each module and the
    greedy combinations from mlp) is priced by the bound tables too: a bound over fewer
    options than the search takes could cut off its best layout."""
    from planner.costs.comm import Network
    from planner.solve.tables import build

    model = planner.load_model("llama3-8b").model_copy(update={"num_layers": 4})
    job = planner.TrainingJob(seq_len=4096, global_batch=8)
    listed = ["none", "core_attn+layernorm"]
    space = planner.SearchSpace(recompute=listed, tp=[1], pp=[2], zero=[1], micro_batch=[1])
    config = next(c for c in enumerate_configs(model, H100x8, job, space) if c.schedule == "1f1b")
    assert config.recompute_extra == {"none", "core_attn+layernorm"}
    searched = build(model, H100x8, job, config, Network.of(H100x8), choices=listed)
    (choice,) = [o for o in searched.kinds["dense"].options if o.name == "core_attn+layernorm"]
    t = bound_tables(model, H100x8, job, config)
    assert t is not None
    assert any(o.saved <= choice.saved and o.time <= choice.time for o in t.kinds["dense"].options)


def test_one_choice_bounds_hold_as_the_memory_tightens() -> None:
    """As HBM shrinks toward what each recompute choice needs, the relaxation with every
    layer at that choice (the rebuild of its backward counted) stays under the fastest such
    layout, and calls no fitting choice infeasible."""
    model = planner.load_model("llama3-8b").model_copy(update={"num_layers": 4})
    job = planner.TrainingJob(seq_len=2048, global_batch=8, grad_dtype="bf16", framework="torch")
    checked = 0
    # One stage: it surely holds every layer, so the choice's rebuild is in its rows; from
    # 28 GiB a choice fits (full recompute at 28, none from 30).
    for hbm in (27, 28, 29, 30, 31, 34):
        cluster = H100x8.model_copy(update={"hbm_bytes": hbm * GiB, "num_gpus": 2})
        space = planner.SearchSpace(tp=[1], pp=[1], zero=[1], micro_batch=[2], schedules=["1f1b"])
        for config in enumerate_configs(model, cluster, job, space):
            fastest = math.inf
            for choice in ("none", "full"):
                pinned = _pinned(config).model_copy(update={"recompute": [choice]})
                best = best_layout(model, cluster, job, pinned)
                if best is None:
                    continue
                fastest = min(fastest, best[1].step_time_s)
                bound = choice_bound(model, cluster, job, config, choice)
                assert bound is not None and bound <= best[1].step_time_s * (1 + 1e-9), (
                    hbm,
                    choice,
                    bound,
                    best[1].step_time_s,
                )
                checked += 1
            # each choice's crowded rank: the rank's own memory at that choice
            each = one_choice_bound(model, cluster, job, config)
            if math.isfinite(fastest):
                assert each is not None and each <= fastest * (1 + 1e-9), (hbm, each, fastest)
    assert checked >= 4


def test_the_relaxation_is_worth_taking_where_a_pair_hid_the_all_to_alls() -> None:
    """The lanes skip a configuration's relaxation where it could not lift the cheap bound
    to the best step (``_relaxation_may_prune``): it adds the pipeline's fill and drain and,
    under a schedule that pairs chunks (here the expert all-to-alls' overlap), the
    communication the cheap bound took as hidden. DeepSeek-V2 on 512 H800 at ep 32: the
    relaxation lifts the bound past the fill and drain alone (so a rule without the hidden
    part skips a relaxation that proves the configuration slow), and within the estimate
    with it."""
    from planner.solve.bounds import communication_floor
    from planner.solve.lanesearch import _relaxation_may_prune

    model = planner.load_model("deepseek-v2")
    cluster = planner.load_cluster("h800", gpus=512)
    job = planner.TrainingJob(seq_len=4096, global_batch=2304, framework="megatron")
    space = planner.SearchSpace(
        tp=[2],
        pp=[4],
        ep=[32],
        etp=[1],
        zero=[2],
        micro_batch=[1],
        virtual_stages=[2],
        schedules=["interleaved-ep-overlap"],
    )
    (config,) = [c for c in enumerate_configs(model, cluster, job, space) if c.zero == 2]
    assert config.pipeline.paired
    cheap = lower_bound(model, cluster, job, config, one_choice=True)
    relaxed = lp_bound(model, cluster, job, config, one_choice=True)
    assert cheap is not None and relaxed is not None
    fill = 1 + 2 * (config.stages - 1) / config.num_microbatches
    hidden = 2 * communication_floor(model, cluster, job, config)
    assert relaxed > cheap * fill  # past the fill and drain alone
    assert relaxed <= (cheap + hidden) * fill
    assert not _relaxation_may_prune(config, cheap, relaxed, 0.0)
    assert _relaxation_may_prune(config, cheap, relaxed, hidden)
