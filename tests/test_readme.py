"""The README's Python snippets run as written: each as its own script (a user may paste any
one of them alone), and all of them in order in one script."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).parent.parent / "README.md"


def snippets() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)


def test_the_readme_has_its_snippets() -> None:
    assert len(snippets()) >= 3


@pytest.mark.slow
def test_the_readme_python_runs_as_a_script(tmp_path: Path) -> None:
    script = tmp_path / "readme.py"
    script.write_text("\n".join(snippets()))
    out = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "BlockPlacement" not in out.stdout  # degrees, not every block's repr
    assert (tmp_path / "trace.json").exists() and (tmp_path / "sweep.sqlite").exists()
    assert "--pipeline-model-parallel-size" in out.stdout  # the export's arguments


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(snippets())))
def test_each_readme_snippet_runs_alone(tmp_path: Path, index: int) -> None:
    script = tmp_path / f"snippet{index}.py"
    script.write_text(snippets()[index])
    out = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
