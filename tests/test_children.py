"""Children of the planner end with it: a sweep's workers and the search's lanes ask the
kernel to stop them when their parent dies (``planner.children``), so ``kill -9`` of a sweep
leaves nothing computing behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

PARENT = """
import multiprocessing, sys, time
from planner.children import die_with_parent

def child() -> None:
    die_with_parent()
    time.sleep(120)

if __name__ == "__main__":
    p = multiprocessing.get_context("spawn").Process(target=child)
    p.start()
    print(p.pid, flush=True)
    time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().split(")")[-1].split()[0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_child_ends_when_its_parent_is_killed(tmp_path: Path) -> None:
    script = tmp_path / "parent.py"  # spawn finds the child's function in a real file
    script.write_text(PARENT)
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        assert _alive(child)
        # killed at once: whether the child has asked for the signal yet or not, it ends
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 30  # a kernel signal: the wait is generous, not tight
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(child)
    finally:
        parent.kill()
