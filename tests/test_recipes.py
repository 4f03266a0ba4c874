"""Published layouts as data (``models/recipes``): each loads as the planner's objects and
states what its source states; the CLI reads them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

import planner
from planner.cli import main
from planner.recipes import CLUSTER_KEYS, LAYOUT_KEYS, RECIPE_KEYS


@pytest.mark.parametrize("name", planner.recipe_names(), ids=planner.recipe_names())
def test_every_recipe_loads_and_cites_its_source(name: str) -> None:
    r = planner.load_recipe(name)
    assert r.layout.world_size == r.cluster.num_gpus
    assert r.source and r.measured
    est = planner.evaluate(r.model, r.cluster, r.job, r.layout)
    assert est.step_time_s > 0


def test_recipes_state_their_sources_figures() -> None:
    # Llama 3 (arXiv 2407.21783) Table 4: TP 8, PP 16, DP 64 / 128 on 8,192 / 16,384 GPUs,
    # sequence 8,192, 16M tokens per batch; section 3.3.2: embedding and head alone.
    for gpus, dp in ((8192, 64), (16384, 128)):
        r = planner.load_recipe(f"llama3-405b-{gpus}")
        assert (r.layout.tp, r.layout.pp, r.layout.dp) == (8, 16, dp)
        assert r.job.seq_len == 8192
        assert r.job.tokens_per_step == pytest.approx(16e6, rel=0.05)
        first, last = r.layout.stages[0].blocks, r.layout.stages[-1].blocks
        assert [b.block for b in first] == ["embedding"]
        assert [b.block for b in last] == ["head"]
    # DeepSeek-V3 report (arXiv 2412.19437) sections 3.2-3.3 and 4.2.
    d = planner.load_recipe("deepseek-v3-pretraining")
    assert (d.layout.tp, d.layout.pp, d.layout.ep, d.layout.zero) == (1, 16, 64, 1)
    assert d.layout.schedule == "dualpipe" and d.job.compute_dtype == "fp8"
    assert (d.job.seq_len, d.job.global_batch, d.cluster.num_gpus) == (4096, 15360, 2048)


def test_bad_recipes_get_one_line(tmp_path: Path) -> None:
    with pytest.raises(planner.PlannerError, match="unknown recipe name"):
        planner.load_recipe("no-such-recipe")
    path = tmp_path / "r.yaml"
    path.write_text(
        "model: llama3-8b\ncluster: {machine: h100, gpus: 8}\njob: {seq_len: 4096, "
        "global_batch: 8}\nlayout: {dp: 8, tensor: 2}\nsource: x\n"
    )
    with pytest.raises(planner.PlannerError, match="unknown key 'tensor'"):
        planner.load_recipe(path)
    path.write_text(
        "model: llama3-8b\ncluster: {machine: h100, gpus: 8}\njob: {seq_len: 4096, "
        "global_batch: 8}\nlayout: {dp: 4}\nsource: x\n"
    )
    with pytest.raises(planner.PlannerError, match=r"tp\*pp\*dp=4 must equal cluster.gpus=8"):
        planner.load_recipe(path)


GOOD = {
    "model": "llama3-8b",
    "cluster": {"machine": "h100", "gpus": 8},
    "job": {"seq_len": 4096, "global_batch": 8},
    "layout": {"dp": 8},
    "source": "x",
}


@pytest.mark.parametrize(
    ("recipe", "key", "where", "allowed"),
    [
        ({**GOOD, "sorce": "x"}, "sorce", "", RECIPE_KEYS),
        ({**GOOD, "cluster": {"machine": "h100", "gpu": 8}}, "gpu", " in cluster", CLUSTER_KEYS),
        ({**GOOD, "layout": {"dp": 8, "tensor": 1}}, "tensor", " in layout", LAYOUT_KEYS),
    ],
    ids=["top", "cluster", "layout"],
)
def test_a_misspelt_recipe_key_is_one_line_naming_file_key_and_allowed(
    tmp_path: Path, recipe: dict[str, Any], key: str, where: str, allowed: tuple[str, ...]
) -> None:
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(GOOD))
    assert planner.load_recipe(path).layout.dp == 8
    path.write_text(yaml.safe_dump(recipe))
    with pytest.raises(planner.PlannerError) as info:
        planner.load_recipe(path)
    assert str(info.value) == (
        f"recipe file {path}: unknown key {key!r}{where}; allowed: {', '.join(allowed)}"
    )


def test_a_recipe_job_key_is_checked_by_the_job(tmp_path: Path) -> None:
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({**GOOD, "job": {**GOOD["job"], "seq_length": 4096}}))
    with pytest.raises(planner.PlannerError, match=f"recipe file {path}: .*seq_length") as info:
        planner.load_recipe(path)
    assert "\n" not in str(info.value)


def test_cli_lists_and_evaluates_recipes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["recipes", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in rows] == planner.recipe_names()
    assert main(["evaluate", "--recipe", "mixtral-8x7b-megatron", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["estimate"]["step_time_s"] > 0
    assert main(["evaluate", "--recipe", "mixtral-8x7b-megatron", "--gpus", "8"]) == 2
    assert "leave it out" in capsys.readouterr().err
    assert main(["evaluate", "--model", "llama3-8b"]) == 2
    assert "--cluster: required" in capsys.readouterr().err
