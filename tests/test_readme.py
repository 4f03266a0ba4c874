"""The README's Python snippets run as written, each as its own script: a user may paste any
one of them alone."""

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
def test_each_readme_snippet_runs_alone(tmp_path: Path) -> None:
    """Each snippet in its own process (nothing defined by another is in scope), one after
    another in one folder; together they write the trace and the sweep database and print
    the export's arguments."""
    printed = []
    for index, snippet in enumerate(snippets()):
        script = tmp_path / f"snippet{index}.py"
        script.write_text(snippet)
        out = subprocess.run(
            [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600
        )
        assert out.returncode == 0, (index, out.stderr[-3000:])
        assert "BlockPlacement" not in out.stdout  # degrees, not every block's repr
        printed.append(out.stdout)
    assert (tmp_path / "trace.json").exists() and (tmp_path / "sweep.sqlite").exists()
    assert any("--pipeline-model-parallel-size" in text for text in printed)  # the export
