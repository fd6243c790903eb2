"""dvc.yaml's code deps cannot rot: every project module a stage imports (transitively) is a dep of that
stage, and the committed dvc.lock was recorded with the committed code."""

from __future__ import annotations

import ast
import hashlib
from pathlib import Path

import pytest
import yaml

from semspec.models.project.names import STAGES

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"semspec.models": "models", "semspec.tasks": "tasks", "semspec.flows": "flows"}


def module_file(name: str) -> Path | None:
    """The repository file of a project module (``semspec.tasks.io`` -> ``tasks/io.py``)."""
    for prefix, folder in PACKAGES.items():
        if name.startswith(prefix + "."):
            stem = ROOT / folder / name.removeprefix(prefix + ".").replace(".", "/")
            for path in (stem.with_name(stem.name + ".py"), stem / "__init__.py"):  # a module or a package
                if path.is_file():
                    return path
            return None
    return None


def project_imports(module: str) -> set[Path]:
    """Files of ``module`` and of every project module it imports, directly or not (imports inside
    functions included)."""
    seen: set[Path] = set()
    todo = [module]
    while todo:
        path = module_file(todo.pop())
        if path is None or path in seen:
            continue
        seen.add(path)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module:
                todo.append(node.module)
                todo += [f"{node.module}.{a.name}" for a in node.names]  # `from pkg import module`
            elif isinstance(node, ast.Import):
                todo += [a.name for a in node.names]
    return seen


def stage_deps() -> dict[str, set[Path]]:
    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text(encoding="utf-8"))["stages"]
    return {name: {ROOT / d for d in st.get("deps", []) if d.endswith(".py")} for name, st in stages.items()}


def test_the_import_walk_follows_project_modules_only():
    files = project_imports("semspec.tasks.train")
    assert ROOT / "tasks/train/__init__.py" in files and ROOT / "models/spec/probe.py" in files
    assert ROOT / "tasks/io.py" in files  # through a `from semspec.tasks.io import ...`
    # a package's __init__ and, through it, its modules
    assert ROOT / "models/lm/step_loop.py" in files and ROOT / "models/lm/__init__.py" in files
    assert all(f.is_relative_to(ROOT) for f in files)


@pytest.mark.parametrize("stage", STAGES)
def test_every_module_a_stage_imports_is_one_of_its_deps(stage):
    deps = stage_deps()[stage]
    missing = sorted(str(f.relative_to(ROOT)) for f in project_imports(f"semspec.tasks.{stage}") - deps)
    assert not missing, f"dvc.yaml stage {stage} lacks deps {missing}: a change there would not rerun it"
    extra = sorted(str(f.relative_to(ROOT)) for f in deps if not f.is_file())
    assert not extra, f"dvc.yaml stage {stage} names deps that do not exist: {extra}"


def test_the_committed_dvc_lock_matches_the_code():
    """dvc.lock records, per stage, the same code deps as dvc.yaml with the md5 of the files as they are
    (what ``dvc status`` compares): a lock recorded with other code is stale and must be re-recorded
    by running the pipeline (``dvc repro`` or ``scripts/demo``)."""
    lock = yaml.safe_load((ROOT / "dvc.lock").read_text(encoding="utf-8"))["stages"]
    for stage, deps in stage_deps().items():
        recorded = {d["path"]: d["md5"] for d in lock[stage]["deps"] if d["path"].endswith(".py")}
        assert set(recorded) == {str(f.relative_to(ROOT)) for f in deps}, f"dvc.lock: {stage} has other deps"
        stale = sorted(
            p for p, md5 in recorded.items() if hashlib.md5((ROOT / p).read_bytes()).hexdigest() != md5
        )
        assert not stale, (
            f"dvc.lock's {stage} was recorded with other versions of {stale}: rerun the pipeline"
        )
