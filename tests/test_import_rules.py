"""The import rules of docs/development.md, checked on every module's direct imports (those inside
functions included): the model layer stays free of the orchestration, the algorithm of the runtime."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ORCHESTRATION = ("prefect", "mlflow", "ray", "dvc", "semspec.tasks", "semspec.flows")
# (folder, what its modules never import, why)
RULES = [
    ("models", ORCHESTRATION, "the model layer runs without the pipeline's services"),
    (
        "models/spec",
        ("semspec.models.cpu", "semspec.models.lm", "torch"),
        "the rule is arithmetic on p, q, u",
    ),
    ("models/cpu", ("semspec.models.lm", "semspec.models.spec", "semspec.models.decoding"), "runtime below"),
]
# within models/, only these import the CPU runtime: the LM adapter (it loads and runs models on it), the
# pair schema (the format names a pair file may give) and the probe card (the format a probe was trained in)
CPU_USERS = ("models/lm", "models/cpu", "models/pair.py", "models/probe_card.py")


def imports(path: Path) -> set[str]:
    """Every module ``path`` imports (``from a.b import c`` gives ``a.b`` and ``a.b.c``)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module:
            out |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return out


def _hits(names: set[str], banned: tuple[str, ...]) -> list[str]:
    return sorted(n for n in names if any(n == b or n.startswith(b + ".") for b in banned))


@pytest.mark.parametrize("folder, banned, why", RULES, ids=[r[0] for r in RULES])
def test_each_layer_imports_only_what_it_may(folder, banned, why):
    bad = {
        str(p.relative_to(ROOT)): hits
        for p in sorted((ROOT / folder).rglob("*.py"))
        if (hits := _hits(imports(p), banned))
    }
    assert not bad, f"{folder} must not import {banned} ({why}): {bad}"


def test_within_models_only_the_adapter_and_the_format_vocabulary_import_the_cpu_runtime():
    users = {
        str(p.relative_to(ROOT))
        for p in (ROOT / "models").rglob("*.py")
        if _hits(imports(p), ("semspec.models.cpu",)) or "from semspec.models import cpu" in p.read_text()
    }
    outside = sorted(u for u in users if not u.startswith(CPU_USERS))
    assert not outside, f"only {CPU_USERS} import models/cpu; also: {outside}"
    assert "models/lm/loading.py" in users, "the walk sees the adapter's imports"


def test_the_check_catches_a_banned_import(tmp_path):
    bad = tmp_path / "m.py"
    bad.write_text("def f():\n    from semspec.tasks.io import file_md5\n    import mlflow\n")
    assert _hits(imports(bad), ORCHESTRATION) == ["mlflow", "semspec.tasks.io", "semspec.tasks.io.file_md5"]
