"""The error type users see: a mistake in their input, named by field, value and rule."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError


class PlannerError(Exception):
    """A user's mistake: the message names the field, the value and the rule it breaks.

    Deliberately not a ``ValueError``: pydantic wraps ``ValueError`` raised inside validators
    into its own multi-line ``ValidationError``, while this error must reach the user as the
    one line it was written as. The CLI prints it and exits with code 2; internal invariants
    use ``assert`` and are bugs, not user errors.
    """


class UnknownNameError(PlannerError):
    """A catalog name (model or machine type) that the catalog does not hold."""


def one_line(exc: ValidationError, owner: str) -> PlannerError:
    """Turn pydantic's report into one line: ``Owner.field=value: rule`` (first error only,
    with a count of the others, so the user fixes one thing at a time)."""
    # A misspelled key also makes the real one "missing": report the misspelling first.
    errors = sorted(exc.errors(), key=lambda e: e["type"] != "extra_forbidden")
    first = errors[0]
    field = ".".join(str(p) for p in first["loc"]) or "(input)"
    value: Any = first.get("input")
    shown = repr(value) if not isinstance(value, dict) else "{...}"
    if len(shown) > 60:
        shown = shown[:57] + "..."
    rule = first["msg"]
    if first["type"] == "extra_forbidden":
        rule = "unknown field (check the spelling; extra fields are not allowed)"
    elif first["type"] == "missing":
        return PlannerError(f"{owner}.{field}: required field is missing")
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return PlannerError(f"{owner}.{field}={shown}: {rule}{more}")
