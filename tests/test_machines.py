"""The rack-scale and AMD machines: GB200 NVL72 and GB300 NVL72 (trays of 4 GPUs joined into a
72-GPU NVLink domain), HGX B300, and AMD Instinct MI300X and MI355X (a full mesh of Infinity
Fabric links in the node). Expected figures are derived by hand from the machine YAMLs'
numbers (hardware/*.yaml), not read back from the code."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml

import planner
from planner.catalog import HARDWARE_DIR, cluster_yaml
from planner.check import check_degrees
from planner.cli.render import groups_line
from planner.costs.comm import Network, group, placements
from planner.solve.space import enumerate_configs
from planner.topology import path_bandwidth_Bps

GiB = 2**30
NEW = ("gb200", "gb300", "b300", "mi300x", "mi355x")
# GPUs per node, NVLink domain, SMs (CUs on AMD): each file's own figures
SHAPES = {
    "gb200": (4, 72, 152),
    "gb300": (4, 72, 152),
    "b300": (8, None, 148),
    "mi300x": (8, None, 304),
    "mi355x": (8, None, 256),
}


def numbers(data: dict, prefix: str = "") -> list[str]:
    """Every key of ``data`` (nested sections as ``section.key``) whose value is a number."""
    out = []
    for key, value in data.items():
        if key == "sources":
            continue
        if isinstance(value, dict):
            out += numbers(value, f"{prefix}{key}.")
        elif isinstance(value, int | float) and not isinstance(value, bool):
            out.append(f"{prefix}{key}")
    return out


@pytest.mark.parametrize("name", NEW)
def test_each_new_machine_loads_and_cites_every_number(name: str) -> None:
    raw = yaml.safe_load((HARDWARE_DIR / f"{name}.yaml").read_text())
    missing = [k for k in numbers(raw) if not str(raw["sources"].get(k, "")).strip()]
    assert not missing, f"{name}: no source for {missing}"
    per_node, domain, sms = SHAPES[name]
    cluster = planner.load_cluster(name, gpus=8 * per_node)
    assert (cluster.gpus_per_node, cluster.nvlink_domain_gpus, cluster.sm_count) == (
        per_node,
        domain,
        sms,
    )
    assert cluster.usable_hbm_bytes < cluster.hbm_bytes


def test_gb200_figures_are_the_racks_divided_by_72() -> None:
    gb200 = planner.load_cluster("gb200", gpus=72)
    assert gb200.bf16_flops == 360e15 / 72 / 2  # 360 PFLOPS per rack with sparsity
    assert gb200.fp8_flops == 720e15 / 72 / 2
    assert gb200.hbm_bandwidth_Bps == 576e12 / 72
    assert gb200.nvlink_Bps == 1.8e12 / 2  # both directions together, per GPU
    assert gb200.nic_Bps * gb200.nics_per_node / gb200.gpus_per_node == 50e9  # 400 Gb/s each
    assert gb200.host_ram_bytes == 2 * 480 * GiB  # two Grace CPUs per tray


# -- the NVLink domain as jobs are placed --------------------------------------------------


@pytest.mark.parametrize(
    ("gpus", "domain"),
    [
        (16, 16),  # one rack holds the job
        (64, 64),  # 16 trays: NVIDIA's GB200 runs of 64 GPUs
        (72, 72),  # a whole rack
        (128, 64),  # 32 trays in segments of 16 (the largest divisor of 32 up to 18)
        (256, 64),  # 64 trays: segments of 16
        (144, 72),  # 36 trays: segments of 18
        (96, 48),  # 24 trays: segments of 12
        (76, 4),  # 19 trays: no segment but one tray divides 19
    ],
)
def test_a_job_fills_nvlink_domains_in_segments_that_divide_it(gpus: int, domain: int) -> None:
    assert planner.load_cluster("gb200", gpus=gpus).domain_gpus == domain


def test_existing_machines_keep_their_node_as_the_nvlink_domain() -> None:
    for name in ("a100", "h100", "h100-96gb", "h800", "h200", "b200"):
        cluster = planner.load_cluster(name, gpus=64)
        assert cluster.nvlink_domain_gpus is None and cluster.nvlink_peer_Bps is None
        assert (cluster.domain_gpus, cluster.num_nodes) == (8, 8)
        assert Network.of(cluster).gpus_per_node == 8


def test_h100_all_reduce_across_two_nodes_is_unchanged() -> None:
    """1 GiB all-reduced over 16 H100s (2 nodes), from h100.yaml's figures: 450 GB/s NVLink at
    0.82, 8 x 400 Gb/s NICs for 8 GPUs (50 GB/s each) at 0.94, 2 us and 5 us latencies. A
    reduce-scatter inside the node, the inter-node half over 2 nodes (one tree level), and
    the all-gather mirroring both."""
    net = Network.of(planner.load_cluster("h100", gpus=64))
    intra = 7 / 8 * GiB / (450e9 * 0.82) + 7 * 2e-6
    inter = 1 / 2 * (GiB / 8) / (50e9 * 0.94) + 1 * 5e-6
    assert net.all_reduce_time(GiB, range(16)) == pytest.approx(2 * (intra + inter), rel=1e-12)


def test_64_gpus_in_an_nvl72_domain_run_at_nvlink_bandwidth() -> None:
    """The same 64-GPU all-reduce: all NVLink on GB200 (one domain), NVLink and InfiniBand on
    B200 (8 nodes of 8)."""
    nbytes = GiB
    gb200 = Network.of(planner.load_cluster("gb200", gpus=256))
    nvlink = 2 * 63 / 64 * nbytes / (900e9 * 0.756) + 2 * 63 * 2e-6
    assert gb200.all_reduce_time(nbytes, range(64)) == pytest.approx(nvlink, rel=1e-12)
    assert gb200.all_reduce(nbytes, range(64)).ib == 0.0
    b200 = Network.of(planner.load_cluster("b200", gpus=256))
    intra = 7 / 8 * nbytes / (900e9 * 0.76) + 7 * 2e-6
    inter = 7 / 8 * (nbytes / 8) / (50e9 * 0.94) + math.ceil(math.log2(8)) * 5e-6
    across = b200.all_reduce(nbytes, range(64))
    assert across.seconds == pytest.approx(2 * (intra + inter), rel=1e-12)
    assert across.ib > 0 and across.seconds > nvlink
    # The second rack's 64 ranks are a domain of their own; a group over both crosses IB.
    assert gb200.all_reduce(nbytes, range(64, 128)).ib == 0.0
    assert gb200.all_reduce(nbytes, range(32, 96)).ib > 0


def test_an_expert_all_to_all_over_an_nvl72_domain_stays_on_nvlink() -> None:
    nbytes = GiB
    gb200 = Network.of(planner.load_cluster("gb200", gpus=256))
    inside = gb200.all_to_all(nbytes, range(64))
    assert inside.seconds == pytest.approx(nbytes * 63 / 64 / (900e9 * 0.756) + 2e-6)
    assert inside.ib == 0.0
    b200 = Network.of(planner.load_cluster("b200", gpus=256))
    # 56 of 64 shares leave each B200 node at its GPU's 50 GB/s NIC share
    off = b200.all_to_all(nbytes, range(64))
    assert off.seconds == pytest.approx(nbytes * 56 / 64 / (50e9 * 0.94) + 5e-6)


def test_the_topology_joins_trays_through_the_racks_switch() -> None:
    cluster = planner.load_cluster("gb200", gpus=128)
    graph = cluster.topology()
    assert sum(1 for _, d in graph.nodes(data=True) if d["kind"] == "nvswitch") == 2
    assert sum(1 for _, d in graph.nodes(data=True) if d["kind"] == "nic") == 32 * 4  # 4 a tray
    assert path_bandwidth_Bps(graph, 0, 63) == 900e9  # trays 0 and 15, one domain
    assert path_bandwidth_Bps(graph, 0, 64) == 50e9  # the next rack: the tray's NIC
    b300 = Network.of(planner.load_cluster("b300", gpus=16))
    assert b300.ib_Bps == 100e9  # 800 Gb/s ConnectX-8 fed at PCIe Gen6, not the Gen5 host link


# -- a full-mesh node (AMD Infinity Fabric) ------------------------------------------------


def test_a_mesh_gives_a_group_one_link_per_peer() -> None:
    """MI300X: 7 links of 64 GB/s a GPU (448 GB/s in all), RCCL at 0.70 of it."""
    net = Network.of(planner.load_cluster("mi300x", gpus=16))
    bus = 0.70
    two = 2 * 1 / 2 * GiB / (64e9 * bus) + 2 * 1 * 2e-6
    eight = 2 * 7 / 8 * GiB / (448e9 * bus) + 2 * 7 * 2e-6
    four = 2 * 3 / 4 * GiB / (3 * 64e9 * bus) + 2 * 3 * 2e-6
    assert net.all_reduce_time(GiB, range(2)) == pytest.approx(two, rel=1e-12)
    assert net.all_reduce_time(GiB, range(4)) == pytest.approx(four, rel=1e-12)
    assert net.all_reduce_time(GiB, range(8)) == pytest.approx(eight, rel=1e-12)
    assert eight < two  # measured: 312.9 against 47.7 GB/s of bus bandwidth
    assert net.p2p_time(GiB, 0, 1) == pytest.approx(2e-6 + GiB / (64e9 * bus))
    assert net.all_to_all_time(GiB, range(8)) == pytest.approx(7 / 8 * GiB / (448e9 * bus) + 2e-6)
    mi355x = Network.of(planner.load_cluster("mi355x", gpus=16))
    assert (mi355x.nvlink_Bps, mi355x.nvlink_peer_Bps) == (7 * 76.5e9, 76.5e9)


def test_a_mesh_or_domain_out_of_rule_is_a_one_line_error() -> None:
    gb200 = planner.load_cluster("gb200", gpus=64).model_dump()
    with pytest.raises(planner.PlannerError) as info:
        planner.ClusterSpec(**{**gb200, "nvlink_domain_gpus": 70})
    assert str(info.value) == (
        "ClusterSpec.nvlink_domain_gpus=70: must be a whole number of nodes (a multiple of "
        "gpus_per_node=4)"
    )
    mi300x = planner.load_cluster("mi300x", gpus=8).model_dump()
    with pytest.raises(planner.PlannerError, match=r"^ClusterSpec.nvlink_peer_Bps=5e\+11: one"):
        planner.ClusterSpec(**{**mi300x, "nvlink_peer_Bps": 500e9})
    with pytest.raises(planner.PlannerError, match=r"^ClusterSpec.nvlink_peer_Bps=6.4e\+10: a"):
        planner.ClusterSpec(**{**gb200, "nvlink_peer_Bps": 64e9})


def test_new_fields_round_trip_through_a_machine_yaml(tmp_path: Path) -> None:
    for name in ("gb200", "mi300x", "b300"):
        cluster = planner.load_cluster(name, gpus=64)
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(cluster_yaml(cluster)))
        again = planner.load_cluster(str(path), gpus=64)
        fields = ("nvlink_domain_gpus", "nvlink_peer_Bps", "gpu_nic_Bps", "domain_gpus")
        assert [getattr(again, f) for f in fields] == [getattr(cluster, f) for f in fields]


# -- the search and the explanation --------------------------------------------------------


def tp_degrees(cluster: planner.ClusterSpec) -> set[int]:
    model = planner.load_model("gpt3-175b")  # 96 heads: tp up to 32 divides them and 64 GPUs
    job = planner.TrainingJob(seq_len=8192, global_batch=64)
    space = planner.SearchSpace(
        pp=[1], cp=[1], micro_batch=[1], zero=[1], schedules=["1f1b"], recompute=["full"]
    )
    return {c.tp for c in enumerate_configs(model, cluster, job, space)}


def test_tensor_parallelism_is_searched_across_the_whole_nvlink_domain() -> None:
    assert tp_degrees(planner.load_cluster("gb200", gpus=64)) == {1, 2, 4, 8, 16, 32}
    assert tp_degrees(planner.load_cluster("b200", gpus=64)) == {1, 2, 4, 8}
    model = planner.load_model("gpt3-175b")
    job = planner.TrainingJob(seq_len=2048, global_batch=64)
    layout = planner.Layout.uniform(model, tp=16, dp=4)
    assert check_degrees(model, planner.load_cluster("gb200", gpus=64), job, layout) == []
    problems = check_degrees(model, planner.load_cluster("b200", gpus=64), job, layout)
    assert "tp=16 spans more than a node of 8 GPUs" in problems


def test_the_groups_line_says_which_group_stays_in_the_domain() -> None:
    model = planner.load_model("deepseek-v3")
    cluster = planner.load_cluster("gb200", gpus=256)
    layout = planner.Layout.uniform(model, pp=4, dp=64, ep=64)
    where = {p.kind: p for p in placements(layout, cluster)}
    assert (where["ep"].domains, where["ep"].link) == (1, "NVLink")
    assert (where["pp"].domains, where["pp"].link) == (4, "InfiniBand")
    assert group(layout, "ep", 0) == list(range(64))
    line = groups_line(layout, cluster)
    assert "NVLink domain: 64 GPUs as placed, 16 nodes of 4" in line
    assert "ep 64: inside one NVLink domain of 64 GPUs (NVLink)" in line
    assert "pp 4: across 4 NVLink domains, 1 in each (InfiniBand)" in line
    b200 = groups_line(layout, planner.load_cluster("b200", gpus=256))
    assert "ep 64: across 8 NVLink domains, 8 in each (InfiniBand, NVLink inside each)" in b200
