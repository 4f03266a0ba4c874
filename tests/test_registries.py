"""The framework and schedule registries: consistent entries, and one-line errors for names
they do not hold."""

from __future__ import annotations

import pytest

import planner
from planner.costs.memory import reduce_bucket_bytes
from planner.errors import PlannerError
from planner.frameworks import FRAMEWORKS, LAUNCHERS, framework, target
from planner.schedules import DEFAULT_SCHEDULE, SCHEDULES, schedule_of


@pytest.mark.parametrize("name", list(FRAMEWORKS), ids=str)
def test_each_framework_names_itself_and_known_schedules(name: str) -> None:
    entry = framework(name)
    assert entry.name == name
    if entry.launcher is not None:
        runs = entry.launcher.schedules
        assert DEFAULT_SCHEDULE in runs  # every launcher can fall back to it
        assert set(runs) <= set(SCHEDULES)
        for other in SCHEDULES:  # each schedule maps to one the launcher runs
            assert entry.launcher.runs_instead(other) in runs


@pytest.mark.parametrize("name", list(SCHEDULES), ids=str)
def test_each_schedule_holds_what_its_chunks_say(name: str) -> None:
    """A rank holds ``virtual_stages`` chunks (DualPipe's two copies: 2 of pp stages), each
    stage on ``copies`` ranks, and the holder of a stage holds it."""
    entry = schedule_of(name)
    pp = 4
    v = entry.default_virtual_stages
    held = [entry.chunks(pp, v, r) for r in range(pp)]
    stages = pp * v
    counts = [sum(s in chunks for chunks in held) for s in range(stages)]
    assert counts == [entry.copies] * stages
    for s in range(stages):
        assert s in held[entry.holder(pp, s, 0)]


def test_unknown_names_are_one_line_errors() -> None:
    with pytest.raises(PlannerError, match=r"^TrainingJob.framework='mxnet': use one of megatron"):
        planner.TrainingJob(seq_len=8, global_batch=1, framework="mxnet")
    with pytest.raises(PlannerError, match=r"^Layout.schedule='zb-v': use one of gpipe, 1f1b"):
        planner.Layout(schedule="zb-v", stages=[])
    with pytest.raises(PlannerError, match=r"^SearchSpace.framework='torch': use one of any, "):
        planner.SearchSpace(target="torch")
    with pytest.raises(PlannerError, match=r"^target='torch': torch has no launcher"):
        target("torch")
    assert "torch" not in LAUNCHERS


def test_the_reduce_bucket_divides_experts_over_expert_tensor_parallel_ranks() -> None:
    """ZeRO-2's reduce bucket is the largest block's gradients on one rank. Mixtral 8x7B
    (config.json: h 4096, 32 heads of 128, 8 kv heads, 8 experts of 14,336, vocabulary
    32,000) at tp 1, ep 4, etp 2: an MoE layer holds q and o (4096 x 4096 each), k and v
    (4096 x 1024 each), its 8 x 3 x 4096 x 14,336 expert elements split over ep*etp = 8
    ranks, the router (4096 x 8) and two norms (4096 each): 218,144,768 elements, above the
    embedding's 131,072,000, at 4 B each (FP32 gradients under Megatron-LM)."""
    model = planner.load_model("mixtral-8x7b")
    job = planner.TrainingJob(seq_len=4096, global_batch=64)
    layout = planner.Layout.uniform(model, tp=1, dp=8, ep=4, etp=2, zero=2)
    attention = 2 * 4096 * 4096 + 2 * 4096 * 1024
    experts = 8 * 3 * 4096 * 14336 // (4 * 2)
    elements = attention + experts + 4096 * 8 + 2 * 4096
    assert elements == 218_144_768
    assert reduce_bucket_bytes(model, job, layout) == elements * 4


def test_no_module_compares_schedule_or_framework_names() -> None:
    """What a schedule or a framework does is its registry entry's; a comparison of its
    name anywhere else is a rule the registry does not hold."""
    import re
    from pathlib import Path

    schedules = "|".join(re.escape(n) for n in SCHEDULES)
    frameworks = "|".join(re.escape(n) for n in FRAMEWORKS)
    compare = r"(==|!=|\bin\b)\s*[\(\[\{]?\s*"
    patterns = [
        re.compile(compare + rf'"({schedules})"'),
        re.compile(rf"(framework|target)\w*\s*{compare}" + rf'"({frameworks})"'),
    ]
    root = Path(planner.__file__).parent
    registries = {root / "frameworks.py", root / "schedules.py"}
    found = [
        f"{path.relative_to(root)}:{number}: {line.strip()}"
        for path in sorted(root.rglob("*.py"))
        if path not in registries
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if any(p.search(line) for p in patterns)
    ]
    assert not found, "\n".join(found)


def test_every_launcher_has_an_exporter() -> None:
    """A framework with a launcher is an export target: ``planner export --target`` offers
    the registry's launchers, and each needs a writer."""
    assert set(planner.export.EXPORTERS) == set(LAUNCHERS)
