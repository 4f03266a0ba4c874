"""``planner.plots``: the format follows the suffix, axis labels carry units and are text in an
SVG, a sweep case without a layout is marked (not dropped, not drawn as 0), a bad suffix is a
one-line error naming the option."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest

import planner
from planner.errors import PlannerError
from planner.plots import picture_format, picture_paths, plot_memory, plot_step_time, plot_sweep

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"  # PNG specification (W3C, 2003), section 5.2
MODEL = planner.load_model("llama3-8b").model_copy(update={"num_layers": 4, "name": "llama4l"})


def svg_texts(path: Path) -> list[str]:
    """Every text run of an SVG file (it must parse as XML)."""
    root = ET.parse(path).getroot()
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    return ["".join(e.itertext()) for e in root.iter("{http://www.w3.org/2000/svg}text")]


def row(gpus: int, step_time_s: float | None, status: str = "optimal") -> dict[str, Any]:
    r: dict[str, Any] = {"model": "llama4l", "gpu": "h100", "gpus": gpus, "status": status}
    r.update(seq_len=1024, global_batch=32)
    if step_time_s is not None:
        r.update(step_time_s=step_time_s, mfu=0.4, tokens_per_s=1024 * 32 / step_time_s)
    return r


def test_memory_and_step_time_as_svg_and_png(tmp_path: Path) -> None:
    cluster = planner.load_cluster("h100", gpus=8)
    job = planner.TrainingJob(seq_len=1024, global_batch=16)
    est = planner.evaluate(MODEL, cluster, job, planner.Layout.uniform(MODEL, pp=2, dp=4))
    texts = svg_texts(plot_memory(est, tmp_path / "m.svg", title="llama4l: memory"))
    usable = f"usable HBM {est.usable_hbm_bytes / 2**30:.2f} GiB"
    assert {"memory per rank (GiB)", "pipeline rank (index)", "llama4l: memory", usable} <= set(
        texts
    )
    texts = svg_texts(plot_step_time(est, tmp_path / "t.svg"))
    assert "time into the optimizer step (s)" in texts and "compute" in texts
    assert f"step time {est.step_time_s:.3f} s" in texts
    png = plot_memory(est, tmp_path / "m.png").read_bytes()
    assert png.startswith(PNG_SIGNATURE)


def test_an_infeasible_sweep_case_is_marked_not_dropped(tmp_path: Path) -> None:
    rows = [row(8, None, "infeasible"), row(16, 2.0), row(32, 1.0), row(64, None, "failed")]
    texts = svg_texts(plot_sweep(rows, tmp_path / "s.svg"))
    assert "infeasible: no layout found" in texts and "failed: planning raised an error" in texts
    assert {"step time (s)", "throughput (tokens/s)", "GPUs (log2 scale)"} <= set(texts)
    assert {"8", "16", "32", "64"} <= set(texts)  # the GPU counts without a layout keep a tick
    texts = svg_texts(plot_sweep(rows[1:3], tmp_path / "ok.svg"))
    assert not any("infeasible" in t for t in texts)  # the legend entry only when one is there


def test_the_format_follows_the_suffix(tmp_path: Path) -> None:
    assert plot_sweep([row(8, 1.0)], tmp_path / "s.png").read_bytes().startswith(PNG_SIGNATURE)
    assert plot_sweep([row(8, 1.0)], tmp_path / "s.pdf").read_bytes().startswith(b"%PDF-")
    assert picture_paths("out/run") == (Path("out/run-memory.svg"), Path("out/run-time.svg"))
    assert picture_paths("run.PNG")[1] == Path("run-time.png")
    assert picture_format("curves.Svg") == "svg"


@pytest.mark.parametrize("path", ["out.gif", "curves", "run.v2/x.jpeg"])
def test_a_bad_suffix_is_a_one_line_error_naming_the_option(path: str) -> None:
    with pytest.raises(PlannerError) as err:
        picture_format(path, option="--plot")
    assert str(err.value) == f"--plot={path!r}: the suffix must be .png, .svg or .pdf"
    with pytest.raises(PlannerError, match="suffix must be"):
        plot_sweep([row(8, 1.0)], path)
