"""The package installs with its catalogs: pyproject.toml ships every package and every catalog
file, and a wheel installed in a fresh virtual environment, run from outside the repository,
lists the catalogs, plans, and quotes the published-run accuracy."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement

import planner
from planner.data import CATALOGS
from planner.estimate import expected_error

REPO = Path(__file__).resolve().parents[1]
PYPROJECT: dict[str, Any] = tomllib.loads((REPO / "pyproject.toml").read_text())
PROJECT, SETUPTOOLS = PYPROJECT["project"], PYPROJECT["tool"]["setuptools"]


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


def _run(*command: str | Path, cwd: Path, bytecode: bool = False) -> str:
    """``command``'s stdout; its stderr on failure. ``bytecode``: the command's Python writes
    the bytecode of what it imports, whatever PYTHONDONTWRITEBYTECODE says here."""
    dropped = ("PYTHONPATH", "VIRTUAL_ENV", *(["PYTHONDONTWRITEBYTECODE"] if bytecode else []))
    env = {k: v for k, v in os.environ.items() if k not in dropped}
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
    with zipfile.ZipFile(wheel) as z:  # the dependencies it asks an installer for
        (meta,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        lines = z.read(meta).decode().splitlines()
    required = {
        str(Requirement(line.split(": ", 1)[1]))
        for line in lines
        if line.startswith("Requires-Dist: ") and "extra ==" not in line
    }
    assert required == {str(Requirement(r)) for r in PROJECT["dependencies"]}
    venv = tmp_path / "venv"
    # An environment without pip of its own, given the wheel alone by this interpreter's pip
    # (--python), uncompiled; its dependencies are this interpreter's, read from its
    # site-packages after the environment's own (a path in a .pth file: the editable install
    # of the checkout that those site-packages hold is not processed), so the planner that
    # runs is the wheel's.
    _run(sys.executable, "-m", "venv", "--without-pip", venv, cwd=tmp_path)
    python = venv / "bin" / "python"
    pip = (sys.executable, "-m", "pip", "--python", python)
    _run(*pip, "install", "-q", "--no-compile", "--no-deps", wheel, cwd=tmp_path)
    (own,) = {sysconfig.get_path("purelib", vars={"base": str(venv)})}
    ours = {sysconfig.get_path(k) for k in ("purelib", "platlib")}
    (Path(own) / "dependencies.pth").write_text("".join(f"{d}\n" for d in sorted(ours)))
    outside = tmp_path / "elsewhere"
    outside.mkdir()

    def cli(*args: str) -> Any:
        out = _run(venv / "bin" / "planner", *args, "--json", cwd=outside, bytecode=True)
        return json.loads(out)

    assert [r["name"] for r in cli("models")] == planner.model_names()
    assert [r["name"] for r in cli("clusters")] == planner.cluster_names()
    assert [r["name"] for r in cli("recipes")] == planner.recipe_names()
    flags = "--model llama3-8b --cluster h100 --gpus 8 --seq-len 4096 --global-batch 64"
    plan = cli("plan", *flags.split(), "--time-limit", "3")
    assert plan["layout"] is not None
    assert "published h100 runs" in plan["estimate"]["expected_error"]

    found = json.loads(_run(python, "-c", CHECK, cwd=outside, bytecode=True))
    site = str(venv.resolve())
    assert found["file"].startswith(site) and all(d.startswith(site) for d in found["dirs"])
    assert found["models"] == planner.model_names()
    assert found["error"] == expected_error("h100")
    assert not found["error"].startswith("no published")
