"""The ranking figures of ``benchmarks/rankings.py``: Kendall's tau and the regret, on
orders worked by hand, and the source key leave-one-source-out groups rows by."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _rankings():  # type: ignore[no-untyped-def]
    sys.path.insert(0, str(BENCH))  # it imports its sibling benchmarks by name
    spec = importlib.util.spec_from_file_location("rankings", BENCH / "rankings.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


rankings = _rankings()


def test_kendall_counts_agreeing_and_backward_pairs() -> None:
    assert rankings.kendall([1, 2, 3], [10, 20, 30]) == (1.0, 0, 3)
    assert rankings.kendall([1, 2, 3], [30, 20, 10]) == (-1.0, 3, 3)
    # one of three pairs backwards: (2 - 1) / 3
    tau, backwards, pairs = rankings.kendall([1, 2, 3], [10, 30, 20])
    assert (backwards, pairs) == (1, 3) and tau == pytest.approx(1 / 3)
    # a tie in the measured times is neither agreement nor disagreement
    assert rankings.kendall([1, 1], [1, 2]) == (0.0, 0, 1)


def test_regret_is_the_measured_cost_of_the_predicted_favourite() -> None:
    assert rankings.regret([1.0, 1.2, 1.5], [0.9, 1.0, 1.1]) == 0.0
    # the model favours the third layout, measured 50% slower than the best
    assert rankings.regret([1.0, 1.2, 1.5], [0.9, 1.0, 0.5]) == pytest.approx(0.5)


def test_source_key_names_the_publication() -> None:
    key = rankings.source_key
    assert key("https://arxiv.org/abs/2504.14960 Appendix Table 3") == "arxiv:2504.14960"
    assert key("https://arxiv.org/abs/2104.04473v5") == "arxiv:2104.04473"
    url = "https://github.com/NVIDIA/Megatron-LM/blob/abc/tests/x.json"
    assert key(url) == "github:NVIDIA/Megatron-LM"


def _residuals():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("residuals", BENCH / "residuals.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_residuals_group_by_ranges_and_by_each_flag() -> None:
    residuals = _residuals()
    assert residuals.bucket("gpus", 8) == "<= 8"
    assert residuals.bucket("gpus", 9) == "(8, 64]"
    assert residuals.bucket("gpus", 10_000) == "> 4096"
    assert residuals.bucket("gpu", "h100") == "h100"

    def item(error: float, flags: tuple[str, ...]) -> object:
        return rankings.Item("g", "id", "layout", 1.0, 1.0 + error, {"flags": flags})

    rows = [item(-0.5, ("a",)), item(-0.1, ("a", "b")), item(0.2, ())]
    lines = {line["value"]: line for line in residuals.table(rows, "flags")}
    # each flag splits the rows into those with it and those without
    assert lines["a: with"]["rows"] == 2 and lines["a: without"]["rows"] == 1
    assert lines["a: with"]["bias"] == pytest.approx(-0.3)
    assert lines["b: with"]["mape"] == pytest.approx(0.1)
    assert lines["b: without"]["bias"] == pytest.approx(-0.15)


def test_a_layout_measured_twice_is_one_layout_in_the_ranking() -> None:
    def item(layout: str, measured: float, predicted: float) -> object:
        return rankings.Item("g", layout, layout, measured, predicted)

    items = [item("a", 1.0, 0.5), item("b", 2.0, 0.9), item("a", 3.0, 0.7)]
    measured, predicted = rankings.by_layout(items)
    # "a" measured twice: the means of its rows, in order of first appearance
    assert measured == pytest.approx([2.0, 2.0]) and predicted == pytest.approx([0.6, 0.9])


def test_layout_ceiling_is_what_the_mean_of_each_layout_can_order() -> None:
    def item(layout: str, measured: float) -> object:
        return rankings.Item("g", layout, layout, measured, 1.0)

    # one layout's rows straddle the other's: "a" (1 and 3, mean 2) against "b" (2.5): of the
    # two cross pairs, (1, 2.5) agrees with the means and (3, 2.5) disagrees
    tau, regret = rankings.layout_ceiling([item("a", 1.0), item("a", 3.0), item("b", 2.5)])
    assert tau == pytest.approx(0.0)
    assert regret == pytest.approx(1.0)  # the best mean (2) over the fastest row (1)
    # repeats close together leave the order intact
    tau, regret = rankings.layout_ceiling([item("a", 1.0), item("a", 1.02), item("b", 2.0)])
    assert tau == 1.0 and regret == pytest.approx(0.01)


def test_a_group_ranks_its_distinct_layouts() -> None:
    def item(layout: str, measured: float, predicted: float) -> object:
        return rankings.Item("g", layout, layout, measured, predicted)

    # "a" measured twice (1.0 and 1.4, mean 1.2) against "b" (1.3): a is faster, and the
    # model (0.5 and 0.7 against 0.9) agrees; counted row by row, one pair would disagree
    g = rankings.ranked("g", "ci", [item("a", 1.0, 0.5), item("a", 1.4, 0.7), item("b", 1.3, 0.9)])
    assert (g.tau, g.backwards, g.pairs, g.regret) == (1.0, 0, 1, 0.0)
    assert g.ceiling is not None  # a layout repeats: the layout-only ceiling is reported
    one = rankings.ranked("g", "ci", [item("a", 1.0, 0.5), item("a", 1.4, 0.7)])
    assert one.tau is None and one.note.startswith("one layout")
