"""The planner's caches, of one kind: bounded, named, and keyed by what a piece depends on.

A search costs thousands of configurations that share most of their pieces (every schedule
of the same degrees shares its block costs, say). Each cached piece is a ``Memo``; its key
is built from frozen inputs only (specs, frozen dataclasses, numbers), never from an
object's identity. A configuration's part of a key is ``planner.solve.tables.Config.key``:
every field but those a piece declares it does not depend on, so a field added later keys
every cache until someone shows a piece does not need it.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any, Generic, TypeVar

T = TypeVar("T")
_ALL: list[Memo[Any]] = []  # every cache, for clear_all


class Memo(Generic[T]):
    """A bounded cache (cleared whole when it reaches ``limit`` entries: a long sweep must
    not grow without bound, and the pieces are cheap to make again)."""

    def __init__(self, name: str, limit: int = 20_000) -> None:
        self.name, self.limit = name, limit
        self._store: dict[Hashable, T] = {}
        _ALL.append(self)

    def get(self, key: Hashable, make: Callable[[], T]) -> T:
        """The piece under ``key``, made by ``make`` the first time."""
        try:
            return self._store[key]
        except KeyError:
            if len(self._store) >= self.limit:
                self._store.clear()
            value = self._store[key] = make()
            return value


def clear_all() -> None:
    """Empty every cache: after a change the keys do not see (a framework registry entry's
    constant replaced by a benchmark that sweeps it)."""
    for memo in _ALL:
        memo._store.clear()
