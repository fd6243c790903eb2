"""The distribution installs one import namespace, ``semspec``, and no generic top-level package."""

from __future__ import annotations

import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel_venv(tmp_path_factory) -> Path:
    """A fresh venv with only the wheel built from this repository installed (its dependencies are
    borrowed from the test venv's site-packages through a path file, as a plain directory: the test
    venv's editable install is not activated there)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"  # built from a copy: setuptools leaves build/ beside the sources
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for pkg in ("semspec", "models", "tasks", "flows"):
        shutil.copytree(ROOT / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", tmp, src],
        check=True,
        cwd=tmp,
    )
    (wheel,) = tmp.glob("semspec-*.whl")
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True)
    py = venv / "bin" / "python"
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", py, "install", "-q", "--no-deps", wheel], check=True
    )
    purelib = subprocess.run(
        [py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    (Path(purelib) / "deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    return py


def _run(py: Path, code: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([py, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=300)


def test_the_wheel_installs_the_semspec_namespace_only(wheel_venv, tmp_path):
    ok = _run(
        wheel_venv,
        "import semspec, semspec.models.lm, semspec.flows.cli; print(semspec.models.lm.__file__); "
        "print(semspec.load.__module__, semspec.__file__); "
        "from semspec.models.cpu import build; print(sorted(p.name for p in build.CSRC.iterdir()))",
        tmp_path,
    )
    assert ok.returncode == 0, ok.stderr
    assert "site-packages/semspec/models/lm/__init__.py" in ok.stdout
    api_module, package_file = ok.stdout.splitlines()[1].split(" ")
    assert api_module == "semspec.api" and package_file.endswith("site-packages/semspec/__init__.py")
    sources = ok.stdout.splitlines()[2]
    for name in ("simd.h", "int8.cpp", "int4.cpp", "attention.cpp", "layer.h", "decode_layer_int4.cpp"):
        assert name in sources, f"the kernels' C++ sources travel in the wheel: {name} missing from {sources}"
    for generic in ("models", "tasks", "flows"):
        res = _run(wheel_venv, f"import {generic}", tmp_path)
        assert res.returncode != 0 and "No module named" in res.stderr, f"`import {generic}` worked"
