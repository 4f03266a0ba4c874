"""The package installs with its catalogs: pyproject.toml ships every package and every catalog
file, and a wheel installed in a fresh virtual environment, run from outside the repository,
lists the catalogs, plans, and quotes the published-run accuracy."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

import planner
from planner.data import CATALOGS
from planner.estimate import expected_error

REPO = Path(__file__).resolve().parents[1]
SETUPTOOLS: dict[str, Any] = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"][
    "setuptools"
]


def test_every_package_is_listed() -> None:
    found = {
        ".".join(init.parent.relative_to(REPO).parts)
        for init in (REPO / "planner").rglob("__init__.py")
    }
    listed = {p for p in SETUPTOOLS["packages"] if not p.startswith("planner._catalog.")}
    assert listed == found


@pytest.mark.parametrize("kind", CATALOGS)
def test_package_data_holds_every_catalog_file(kind: str) -> None:
    package = f"planner._catalog.{kind}"
    assert package in SETUPTOOLS["packages"]
    assert SETUPTOOLS["package-dir"][package] == kind
    patterns = SETUPTOOLS["package-data"][package]
    folder = REPO / kind
    files = {p for p in folder.rglob("*") if p.is_file()}
    shipped = {p for pattern in patterns for p in folder.glob(pattern)}  # as setuptools globs
    assert files and sorted(files - shipped) == []


def test_package_data_holds_the_accuracy_tables() -> None:
    tables = ["accuracy.json", "memory_accuracy.json"]  # step time's and memory's errors
    assert all((REPO / "planner" / name).is_file() for name in tables)
    assert SETUPTOOLS["package-data"]["planner"] == tables


def _run(*command: str | Path, cwd: Path) -> str:
    """``command``'s stdout; its stderr on failure."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    done = subprocess.run(
        [str(c) for c in command], cwd=cwd, env=env, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, f"{command}: exit {done.returncode}\n{done.stderr[-3000:]}"
    return done.stdout


def _copy_source(to: Path) -> Path:
    """The files a build reads, copied to ``to``: the build leaves nothing in the checkout."""
    to.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, to / name)
    for name in ("planner", *CATALOGS):
        shutil.copytree(REPO / name, to / name, ignore=shutil.ignore_patterns("__pycache__"))
    return to


CHECK = """
import json, planner
from planner.catalog import HARDWARE_DIR, MODELS_DIR
from planner.estimate import expected_error
print(json.dumps({
    "file": planner.__file__,
    "dirs": [str(MODELS_DIR), str(HARDWARE_DIR)],
    "models": planner.model_names(),
    "error": expected_error("h100"),
}))
"""


@pytest.mark.slow
def test_a_wheel_installed_elsewhere_has_its_catalogs(tmp_path: Path) -> None:
    source = _copy_source(tmp_path / "source")
    wheels = tmp_path / "wheels"
    _run(sys.executable, "-m", "pip", "wheel", source, "-w", wheels, "--no-deps", "-q", cwd=source)
    (wheel,) = wheels.glob("planner-*.whl")
    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", venv, cwd=tmp_path)
    _run(venv / "bin" / "pip", "install", "-q", wheel, cwd=tmp_path)
    outside = tmp_path / "elsewhere"
    outside.mkdir()

    cli = venv / "bin" / "planner"
    names = [r["name"] for r in json.loads(_run(cli, "models", "--json", cwd=outside))]
    assert names == planner.model_names()
    machines = [r["name"] for r in json.loads(_run(cli, "clusters", "--json", cwd=outside))]
    assert machines == planner.cluster_names()
    recipes = [r["name"] for r in json.loads(_run(cli, "recipes", "--json", cwd=outside))]
    assert recipes == planner.recipe_names()
    flags = "--model llama3-8b --cluster h100 --gpus 8 --seq-len 4096 --global-batch 64"
    plan = json.loads(_run(cli, "plan", *flags.split(), "--time-limit", "3", "--json", cwd=outside))
    assert plan["layout"] is not None
    assert "published h100 runs" in plan["estimate"]["expected_error"]

    found = json.loads(_run(venv / "bin" / "python", "-c", CHECK, cwd=outside))
    site = str(venv.resolve())
    assert found["file"].startswith(site) and all(d.startswith(site) for d in found["dirs"])
    assert found["models"] == planner.model_names()
    assert found["error"] == expected_error("h100")
    assert not found["error"].startswith("no published")
