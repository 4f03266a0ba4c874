"""Where the package's data files are, installed from a wheel or used from a checkout.

The catalogs live at the repository's top level (``models/``, ``hardware/``), outside the
package; the wheel ships them inside it, under ``planner/_catalog/`` (pyproject.toml maps the
folders there as package data). Every reader finds them here, through ``importlib.resources``,
so an installed planner never silently holds empty catalogs. A setuptools editable install
cannot import a namespace package nested in a regular one (its finder knows only the mapped
folders' ``__init__.py``), so in a checkout the folder is read where it is: beside the package,
next to the ``pyproject.toml`` that marks the checkout.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

from planner.errors import PlannerError

CATALOGS = ("models", "hardware")


def package_file(name: str) -> Path:
    """The package's own data file ``name`` (e.g. ``accuracy.json``), installed or not."""
    return _package() / name


def catalog_dir(kind: str) -> Path:
    """The folder of the ``kind`` catalog (``models`` or ``hardware``): the installed copy in
    the package, else the checkout's top-level folder; a one-line error if neither exists."""
    if kind not in CATALOGS:
        raise PlannerError(f"catalog={kind!r}: unknown; known: {', '.join(CATALOGS)}")
    installed, checkout = _candidates(kind)
    if installed.is_dir():
        return installed
    if checkout.is_dir() and (checkout.parent / "pyproject.toml").is_file():
        return checkout
    raise PlannerError(
        f"catalog {kind!r}: not found at {installed} (an installed wheel) nor at {checkout} "
        f"(a checkout); reinstall planner from a wheel built with its package data"
    )


def _candidates(kind: str) -> tuple[Path, Path]:
    """Where the wheel puts the ``kind`` catalog, and where a checkout has it."""
    package = _package()
    return package / "_catalog" / kind, package.parent / kind


def _package() -> Path:
    """The ``planner`` package's folder (a wheel's copy in site-packages, or the checkout's)."""
    return Path(str(files("planner")))
