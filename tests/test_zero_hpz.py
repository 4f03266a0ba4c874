"""ZeRO++'s hierarchical partitioning (``Layout.zero_hpz``; DeepSpeed's
``zero_optimization.zero_hpz_partition_size``).

Golden behaviour from DeepSpeed's source (deepspeedai/DeepSpeed at edaa7221), not from this
code's output:
- every rank keeps, beside its ZeRO-3 shard, a secondary shard of each parameter over a group
  of hpz consecutive global ranks: aligned numel / hpz elements in the parameter's own dtype
  (``runtime/zero/partition_parameters.py`` ``_partition_param_sec``; ``utils/groups.py``
  ``_create_zero_param_parallel_group``), from a step's first forward gather until the
  optimizer step clears it (``stage3.py`` ``_post_step``);
- a gather runs over the secondary group wherever that shard exists, so of a step's 2m
  gathers (a forward and a backward per micro-batch) only the first forward's crosses the
  whole data-parallel group (``all_gather_coalesced``: ``use_secondary_tensor``);
- gradients are still reduce-scattered over the whole group.
"""

from __future__ import annotations

import json

import pytest

import planner
from planner.costs.blocks import model_param_count
from planner.costs.comm import Network
from planner.costs.memory import stage_memory
from planner.errors import PlannerError

LLAMA = planner.load_model("llama3-8b")
H100 = planner.load_cluster("h100", gpus=64)
JOB = planner.TrainingJob(seq_len=4096, global_batch=256, framework="deepspeed")


def layout(**kw: object) -> planner.Layout:
    return planner.Layout.uniform(LLAMA, dp=64, zero=3, micro_batch=2, **kw)  # type: ignore[arg-type]


def test_each_rank_keeps_a_secondary_shard_of_every_weight() -> None:
    plain = stage_memory(LLAMA, JOB, layout(), num_microbatches=2)[0]
    hpz = stage_memory(LLAMA, JOB, layout(zero_hpz=8), num_microbatches=2)[0]
    params = model_param_count(LLAMA)  # 8,030,261,248: tests/test_golden_params.py
    assert hpz.buckets["weights"] - plain.buckets["weights"] == pytest.approx(params * 2 / 8)
    for bucket in ("grads", "optimizer", "activations"):
        assert hpz.buckets[bucket] == plain.buckets[bucket]


def test_all_but_one_gather_a_step_stay_on_the_node() -> None:
    """Two micro-batches, four gathers a stage: one over the 64 ranks of 8 nodes, three over
    8 ranks of one node; the reduce-scatters stay on the 64."""
    net = Network.of(H100)
    plain = planner.evaluate(LLAMA, H100, JOB, layout())
    hpz = planner.evaluate(LLAMA, H100, JOB, layout(zero_hpz=8))
    times = {
        lay.zero_hpz: planner.costs.timing.stage_times(LLAMA, H100, JOB, lay, net)[0]
        for lay in (layout(), layout(zero_hpz=8))
    }
    gather = lambda ranks: net.all_gather_time(2**30, ranks)  # noqa: E731
    whole, node = gather(list(range(64))), gather(list(range(8)))
    ratio = times[8].zero_gather.seconds / times[1].zero_gather.seconds
    assert ratio == pytest.approx((whole + 3 * node) / 4 / whole, rel=0.02)
    assert times[8].zero_reduce == times[1].zero_reduce
    assert hpz.step_time_s <= plain.step_time_s


def test_only_deepspeed_states_it_and_only_under_zero_3() -> None:
    with pytest.raises(PlannerError, match=r"Layout.zero_hpz=8: .*zero=3 \(has 1\)"):
        planner.Layout.uniform(LLAMA, dp=64, zero=1, zero_hpz=8)
    with pytest.raises(PlannerError, match=r"Layout.zero_hpz=3: .*dividing dp\*cp=64"):
        layout(zero_hpz=3)
    megatron = planner.TrainingJob(seq_len=4096, global_batch=256, framework="megatron")
    with pytest.raises(PlannerError, match=r"Layout.zero_hpz=8: .*framework='deepspeed'"):
        planner.evaluate(LLAMA, H100, megatron, layout(zero_hpz=8))


def test_the_search_weighs_it_and_deepspeed_exports_it() -> None:
    space = planner.SearchSpace(zero=[3], tp=[1], pp=[1], cp=[1], micro_batch=[2])
    plans = {
        str(h): planner.plan(
            LLAMA, H100, JOB, space.model_copy(update={"zero_hpz": h}), time_limit_s=5
        )
        for h in ([1], [8], None)
    }
    for p in plans.values():
        assert p.layout is not None and p.estimate is not None and p.status == "optimal"
    best = min(plans[k].estimate.step_time_s for k in ("[1]", "[8]"))  # type: ignore[union-attr]
    assert plans["None"].estimate.step_time_s == pytest.approx(best, rel=1e-9)  # type: ignore[union-attr]
    config = json.loads(planner.export.deepspeed(plans["[8]"]).files["ds_config.json"])
    assert config["zero_optimization"]["zero_hpz_partition_size"] == 8
    titan = planner.TrainingJob(seq_len=4096, global_batch=256, framework="torchtitan")
    assert planner.plan(LLAMA, H100, titan, space, time_limit_s=5).layout.zero_hpz == 1  # type: ignore[union-attr]
    pinned = space.model_copy(update={"zero_hpz": [8]})
    with pytest.raises(PlannerError, match=r"SearchSpace.zero_hpz=\[8\]: .*framework='deepspeed'"):
        planner.plan(LLAMA, H100, titan, pinned, time_limit_s=5)


def test_a_secondary_shard_that_does_not_fit_leaves_the_layout_without_it() -> None:
    """Llama 3 70B under ZeRO-3 on 24 H100: its 17.6 GB secondary shard (70.6B x 2 B / 8)
    puts a rank over the cap, the plain layout fits: the search returns the plain one."""
    model = planner.load_model("llama3-70b")
    cluster = planner.load_cluster("h100", gpus=24)
    job = planner.TrainingJob(seq_len=4096, global_batch=24, framework="deepspeed")
    lay = planner.Layout.uniform(model, dp=24, zero=3, micro_batch=1, recompute="full")
    assert planner.evaluate(model, cluster, job, lay).fits
    big = lay.model_copy(update={"zero_hpz": 8})
    assert not planner.evaluate(model, cluster, job, big).fits
    space = planner.SearchSpace(zero=[3], tp=[1], pp=[1], cp=[1], micro_batch=[1])
    plan = planner.plan(model, cluster, job, space, time_limit_s=5)
    assert plan.layout is not None and plan.layout.zero_hpz == 1


# -- ZeRO-3's weight shards on the host (Layout.param_offload; DeepSpeed offload_param) --------
# DeepSpeed keeps each parameter's ZeRO-3 shard (ds_tensor) in pinned host memory and copies
# it to the GPU before the all-gather (runtime/zero/partition_parameters.py); the secondary
# ZeRO++ shards sit on the same remote device (partition_parameters.py:1887-1891). The
# optimizer's updated weights go back to the host.


def test_offloaded_weights_leave_hbm_and_each_gather_copies_its_shard_in() -> None:
    model = planner.load_model("llama3-70b")
    cluster = planner.load_cluster("h100", gpus=16)
    job = planner.TrainingJob(seq_len=4096, global_batch=16, framework="deepspeed")
    base = planner.Layout.uniform(model, dp=16, zero=3, micro_batch=1, recompute="full")
    off = base.model_copy(update={"param_offload": True})
    a, b = (stage_memory(model, job, lay, num_microbatches=1)[0] for lay in (base, off))
    shard = model_param_count(model) * 2 / 16  # BF16 weights over 16 ranks
    assert a.buckets["weights"] == pytest.approx(shard)
    assert b.buckets["weights"] == 0.0
    assert b.host_bytes - a.host_bytes == pytest.approx(shard)
    net = Network.of(cluster)
    pcie = planner.costs.compute.Rates.of(cluster, job).pcie_Bps
    ta, tb = (
        planner.costs.timing.stage_times(model, cluster, job, lay, net)[0] for lay in (base, off)
    )
    gathered = ta.zero_gather.seconds  # the same gather, plus the shard's copy over PCIe
    per_byte = (tb.zero_gather.seconds - gathered) / (shard / pcie)
    assert per_byte == pytest.approx(1.0, rel=1e-6)
    with pytest.raises(PlannerError, match=r"Layout.param_offload=True: .*zero=3 \(has 2\)"):
        planner.Layout.uniform(model, dp=16, zero=2, param_offload=True)
    config = json.loads(
        planner.export.deepspeed(
            planner.plan(
                model,
                cluster,
                job,
                planner.SearchSpace(
                    zero=[3],
                    tp=[1],
                    pp=[1],
                    micro_batch=[1],
                    param_offload=[True],
                    optimizer_offload=[1.0],
                ),
                time_limit_s=5,
            )
        ).files["ds_config.json"]
    )
    assert config["zero_optimization"]["offload_param"] == {"device": "cpu", "pin_memory": True}
