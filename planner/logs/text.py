"""What the torchtitan and DeepSpeed readers share: a log's lines split by the writer that
printed them (launcher prefixes), multi-line JSON blocks, and the settings a log states, each
with the line that states it."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from planner.errors import PlannerError

ANSI = re.compile(r"\x1b\[[0-9;]*m")  # terminal colour codes (torchtitan's step lines)


@dataclass(frozen=True)
class Line:
    no: int  # 1-based line number in the file
    text: str  # the message, launcher and logging prefixes removed


def streams(
    text: str, launcher: re.Pattern[str], message: Callable[[str], str]
) -> tuple[dict[str, list[Line]], list[str]]:
    """The log's lines per writer, and notes on what was skipped (a last line cut off).
    ``launcher`` matches a line's launcher prefix with optional groups ``label`` (srun's task,
    pdsh's host) and ``header`` (torchrun's ``[rank0]:``), which name the writer (``""`` for
    unprefixed lines); ``message`` strips the framework's logging prefix from the rest."""
    notes: list[str] = []
    raw = text.splitlines(keepends=True)
    if raw and not raw[-1].endswith(("\n", "\r")):
        notes.append(f"line {len(raw)}: the log stops mid-line; that line is skipped")
        raw.pop()
    out: dict[str, list[Line]] = {}
    for no, line in enumerate(raw, start=1):
        plain = ANSI.sub("", line.rstrip("\r\n"))
        m = launcher.match(plain)
        assert m is not None  # every group is optional
        key = (m["label"] or "").strip() + (m["header"] or "")
        out.setdefault(key, []).append(Line(no, message(plain[m.end() :])))
    return out, notes


def json_block(lines: list[Line], i: int, first: str) -> tuple[Any, int]:
    """The JSON object that starts with ``first`` on line ``i`` and ends at the first later
    line that is ``}`` alone (json.dumps' closing brace at indent 0), parsed (None where the
    block is cut off or is not JSON), and the index of that closing line."""
    parts = [first]
    j = i
    while first.rstrip() != "{}" and j + 1 < len(lines):
        j += 1
        parts.append(lines[j].text)
        if lines[j].text.rstrip() == "}":
            break
    try:
        return json.loads("\n".join(parts)), j
    except (ValueError, RecursionError):
        return None, j


class Settings:
    """What the log states, each with the line that states it; a second line stating
    another value for the same setting is refused."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.values: dict[str, tuple[Any, int]] = {}

    def put(self, key: str, value: Any, no: int) -> None:
        """Record that line ``no`` states ``key`` = ``value`` (refused if another line states
        another value)."""
        old = self.values.get(key)
        if old is not None and old[0] != value:
            raise PlannerError(
                f"{self.where}: line {no} states {key}={short(value)} but line {old[1]} "
                f"states {short(old[0])}; a log must hold one run's settings"
            )
        self.values.setdefault(key, (value, no))

    def get(self, key: str) -> Any:
        """The value stated for ``key`` (None where no line states it)."""
        found = self.values.get(key)
        return None if found is None else found[0]

    def line(self, key: str) -> int:
        """The line that states ``key``."""
        return self.values[key][1]

    def __contains__(self, key: str) -> bool:
        return key in self.values


def short(value: Any) -> str:
    """``value``'s repr, cut to 60 characters for a one-line error."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


T = TypeVar("T")


def naming_the_log(path: str, body: Callable[[str], T]) -> T:
    """``body(where)``, ``where`` being how a refusal names the log (``log='PATH'``), with
    every refusal one line that names it, whether ``body`` already did or not."""
    where = f"log={path!r}"
    try:
        return body(where)
    except PlannerError as exc:
        if str(exc).startswith(where):
            raise
        raise PlannerError(f"{where}: {exc}") from None
