"""Training logs as measured runs: ``runs_from_logs(paths)``.

Each framework's reader (``megatron``, ``torchtitan``, ``deepspeed``) turns one log file into
a ``LoggedRun``: the model, job and layout the log states, and what it measured (the median
step time of the steady-state iterations, warm-up dropped; the allocated and reserved memory
peaks where the log has them). A log that does not state something the planner needs is
refused with one line naming the file and what is missing; a setting the log leaves out and
the reader took as the framework's default is listed in ``LoggedRun.notes``.

A log is recognised by its own lines (``READERS``, in order): Megatron-LM's argument block
or iteration lines, torchtitan's step lines, DeepSpeed's configuration or throughput lines.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from planner.errors import PlannerError
from planner.fit import Run
from planner.layout import Layout
from planner.specs import ModelSpec, TrainingJob


@dataclass(frozen=True)
class LoggedRun:
    """One training run as its log states it."""

    path: str  # the log file
    framework: str  # TrainingJob.framework
    model: ModelSpec
    job: TrainingJob
    layout: Layout
    step_s: float  # median seconds per step over ``iterations`` steady-state iterations
    iterations: int  # how many logged iteration times the median is taken over
    allocated_peak_bytes: int | None = None  # max over ranks of the allocator's allocated peak
    reserved_peak_bytes: int | None = None  # max over ranks of the allocator's reserved peak
    notes: tuple[str, ...] = field(default_factory=tuple)  # defaults taken, lines skipped

    @property
    def name(self) -> str:
        """The file's name: what tables call the run."""
        return Path(self.path).name

    def run(self) -> Run:
        """The run as ``planner.fit`` takes it (model, job, layout, measured seconds)."""
        return Run(self.model, self.job, self.layout, self.step_s, name=self.name)


# (name, recognises the text, reads it): the first reader that recognises a log reads it.
Reader = tuple[str, Callable[[str], bool], Callable[[str, str], LoggedRun]]


def _readers() -> list[Reader]:
    from planner.logs import deepspeed, megatron, torchtitan

    return [
        ("Megatron-LM", megatron.recognises, megatron.read),
        ("torchtitan", torchtitan.recognises, torchtitan.read),
        ("DeepSpeed", deepspeed.recognises, deepspeed.read),
    ]


def read_log(path: str | Path) -> LoggedRun:
    """One log file as a run (``PlannerError`` naming the file and what it lacks)."""
    file = Path(path)
    if not file.is_file():
        raise PlannerError(f"log={str(path)!r}: no such file")
    text = file.read_text(encoding="utf-8", errors="replace")
    for _, recognises, read in _readers():
        if recognises(text):
            return read(text, str(path))
    names = ", ".join(name for name, _, _ in _readers())
    raise PlannerError(
        f"log={str(path)!r}: not a training log the planner reads ({names}): none of their "
        "argument, configuration or iteration lines is in it"
    )


def runs_from_logs(paths: Iterable[str | Path]) -> list[LoggedRun]:
    """Every log file of ``paths`` as a measured run (``read_log``)."""
    runs = [read_log(p) for p in paths]
    if not runs:
        raise PlannerError("logs: give at least one log file")
    return runs
