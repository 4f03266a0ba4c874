"""Generated bad and unusual command lines (``benchmarks/fuzz_inputs.py``): every one ends in
a layout that fits (exit 0), one line naming what is wrong (exit 2), or a layout that does
not fit with its reason on stderr (exit 3)."""

from __future__ import annotations

import importlib.util
import sys
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "fuzz_inputs.py"


def _fuzz():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("fuzz_inputs", BENCH)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


fuzz = _fuzz()


def test_generated_command_lines_end_in_one_of_three_ways(tmp_path_factory) -> None:  # type: ignore[no-untyped-def]
    folder = tmp_path_factory.mktemp("fuzz")
    files, layouts = fuzz.config_files(folder), fuzz.layout_files(folder)
    clusters = fuzz.cluster_files(folder)
    tally: Counter[str] = Counter()

    @settings(
        max_examples=150,
        derandomize=True,  # the same command lines every run
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(fuzz.commands(files, layouts, clusters))
    def run(argv: list[str]) -> None:
        fuzz.check(argv, tally)

    run()
    # the draws reach every outcome, not only the one-line refusals
    assert {"0", "2", "3"} <= set(tally)


@pytest.mark.parametrize(
    "behaviour", ["raises", "silent exit 2", "exit 3 without a reason", "exit 1"]
)
def test_the_rules_fail_on_what_they_are_there_to_catch(
    monkeypatch: pytest.MonkeyPatch, behaviour: str
) -> None:
    def main(argv: list[str]) -> int:
        if behaviour == "raises":
            raise ValueError("an unhandled error")
        return {"silent exit 2": 2, "exit 3 without a reason": 3, "exit 1": 1}[behaviour]

    monkeypatch.setattr(fuzz, "main", main)
    with pytest.raises((AssertionError, ValueError)):
        fuzz.check(["memory"])
