"""``planner calibrate`` and what ``planner validate`` does with its profile: step-time
predictions, their ranking, and the memory-cap demonstration (real runs on CPU)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from planner.catalog import load_cluster  # noqa: E402
from planner.cli import main  # noqa: E402
from planner.costs.compute import work_time  # noqa: E402
from planner.run.calibrate import _PHASES, _phase_work, _rates, fit_overhead  # noqa: E402
from planner.run.validate import Bucket, Entry, cap_demo, ranking  # noqa: E402


@pytest.fixture(scope="module")
def profile_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("profile") / "cpu.yaml"
    assert main(["calibrate", "--processes", "2", "--out", str(path)]) == 0
    return path


@pytest.mark.slow
def test_profile_is_a_cluster_the_planner_reads(profile_path: Path) -> None:
    cluster = load_cluster(profile_path, gpus=2)
    assert cluster.gpus_per_node == 2
    assert cluster.bf16_flops > 1e9  # any CPU core multiplies faster than 1 GFLOP/s
    assert cluster.hbm_bandwidth_Bps > 1e9
    assert 0 < cluster.achieved["attention"] <= 1
    assert cluster.kernel_overhead_s >= 0


def test_overhead_fit_recovers_a_known_overhead() -> None:
    """Block times made by the cost model with 80 us per operator: the fit finds 80 us."""
    rates = {"gemm_flops": 5e10, "attention_flops": 2e10, "memory_Bps": 1e10}
    true = _rates(rates, 80e-6)
    blocks: dict[str, dict[str, float]] = {}
    for name, keys in (("embedding", ("fwd_s", "bwd_s")), ("layer.0", tuple(_PHASES))):
        for key in keys:
            _, work = _phase_work(name, _PHASES[key])
            seconds = work_time(work, true)
            blocks.setdefault(name, {})[key] = seconds
    found = {"processes": 2, "rates": rates, "blocks": blocks}
    assert fit_overhead(found) == pytest.approx(80e-6, rel=1e-6)


def _entry(layout: dict[str, int], measured: float, predicted: float) -> Entry:
    full = {"tp": 1, "pp": 1, "dp": 1, "ep": 1, "zero": 0, "schedule": "1f1b"} | layout
    full.setdefault("recompute", "none")
    zero = Bucket(predicted_bytes=1, measured_bytes=1, error=0.0, agrees=True)
    return Entry(
        model="m",
        layout=full,
        rank=0,
        pp_rank=0,
        predicted_peak_bytes=1,
        measured_peak_bytes=1,
        peak_error=0.0,
        buckets={"weights": zero},
        predicted_step_s=predicted,
        measured_step_s=measured,
        losses=[],
    )


def test_ranking_counts_swapped_pairs_and_says_what_it_leaves_out() -> None:
    entries = [
        _entry({"recompute": "none"}, 1.0, 1.1),
        _entry({"recompute": "full"}, 2.0, 1.0),  # predicted faster than the first: swapped
        _entry({"recompute": "moe"}, 3.0, 3.0),
        _entry({"dp": 2}, 0.5, 0.4),
        _entry({"pp": 4}, 0.5, 0.4),
    ]
    r = ranking(entries, cores=2)
    assert r.layouts[0].startswith("pp1 dp2") and len(r.layouts) == 4
    assert r.discordant_pairs == 1 and not r.same_order
    assert r.mean_abs_error == pytest.approx((0.2 + 0.1 + 0.5 + 0.0) / 4)
    assert set(r.left_out) == {"pp4 dp1 ep1 z0 1f1b none"}  # 4 ranks on 2 cores


@pytest.mark.slow
def test_validate_cli_prints_one_entry_per_rank(
    profile_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["validate", "--only", "9", "--steps", "1", "--json", "--cluster", str(profile_path)]
    assert main(args) == 0
    entries = json.loads(capsys.readouterr().out)
    assert len(entries) == 1
    e = entries[0]
    for key in (
        "layout",
        "rank",
        "predicted_peak_bytes",
        "measured_peak_bytes",
        "buckets",
        "predicted_step_s",
        "measured_step_s",
    ):
        assert key in e
    assert e["layout"]["zero"] == 1 and e["model"].endswith("tied")
    assert set(e["buckets"]) >= {"weights", "grads", "optimizer", "activations"}
    assert all({"predicted_bytes", "measured_bytes"} <= set(b) for b in e["buckets"].values())
    assert abs(e["measured_peak_bytes"] / e["predicted_peak_bytes"] - 1) < 0.05
    assert e["predicted_step_s"] > 0


@pytest.mark.slow
def test_a_layout_over_the_cap_really_peaks_over_it(profile_path: Path) -> None:
    """The planner's fastest layout of the small model on 2 ranks needs more than 62 MiB per
    rank; under a 62 MiB cap it plans another. Run for real, the first peaks above 62 MiB
    and the second below."""
    cap = 62 * 2**20
    demo = cap_demo(load_cluster(profile_path, gpus=2), cap)
    assert demo.rejected.predicted_peak_bytes > cap >= demo.accepted.predicted_peak_bytes
    assert demo.rejected.layout != demo.accepted.layout
    assert min(demo.rejected.measured_peak_bytes) > cap
    assert max(demo.accepted.measured_peak_bytes) <= cap
    assert demo.shown


def test_calibrate_rejects_one_process(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["calibrate", "--processes", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("planner: --processes=1") and "\n" not in err
