"""The import rules of docs/development.md, checked on every module's direct imports (those inside
functions included): the model layer stays free of the orchestration, the algorithm of the runtime."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.helpers.imports import LAYERS, cycles, diagram, floor, graph, upward

ROOT = Path(__file__).resolve().parents[1]
ORCHESTRATION = ("prefect", "mlflow", "ray", "dvc", "semspec.tasks", "semspec.flows")
# (folder or file, what its modules never import, why)
RULES = [
    ("models", ORCHESTRATION, "the model layer runs without the pipeline's services"),
    (
        "models/spec",
        ("semspec.models.cpu", "semspec.models.project"),
        "the algorithm runs on any LM, in any project",
    ),
    ("models/spec/rules.py", ("semspec", "torch", "numpy"), "the rule is arithmetic on p, q, u"),
    ("models/cpu", ("semspec.models.lm", "semspec.models.spec"), "the runtime is below the models"),
    ("tasks", ("prefect",), "a stage runs under DVC, Prefect or a test alike: Prefect lives in flows/"),
    (
        "semspec",
        ("prefect", "mlflow", "ray", "dvc", "lightning"),
        "the core package installs and runs without the pipeline's services",
    ),
]
# the algorithm's leaves: the vocabulary, what a step is, the rule and answer grading; the LM adapter may
# read these and nothing else of models/spec, so the algorithm sits on the adapter and not the other way
SPEC_LEAVES = ("names", "steps", "rules", "grading")
# within models/, only these import the CPU runtime: the LM adapter (it loads and runs models on it, and
# its pair schema names the formats) and the probe card (the format a probe was trained in)
CPU_USERS = ("models/lm", "models/cpu", "models/project/probe_card.py")


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


def _files(where: str) -> list[Path]:
    path = ROOT / where
    return [path] if path.is_file() else sorted(path.rglob("*.py"))


@pytest.mark.parametrize("where, banned, why", RULES, ids=[r[0] for r in RULES])
def test_each_layer_imports_only_what_it_may(where, banned, why):
    bad = {str(p.relative_to(ROOT)): hits for p in _files(where) if (hits := _hits(imports(p), banned))}
    assert not bad, f"{where} must not import {banned} ({why}): {bad}"


def test_the_adapter_reads_only_the_algorithm_s_leaves_and_they_import_nothing_of_the_project_s():
    spec = "semspec.models.spec"
    leaves = tuple(f"{spec}.{m}" for m in SPEC_LEAVES)
    for path in _files("models/lm"):
        beyond = [n for n in _hits(imports(path), (spec,)) if n != spec and not n.startswith(leaves)]
        assert not beyond, f"{path.relative_to(ROOT)} imports {beyond}: the adapter may read only {leaves}"
    for leaf in SPEC_LEAVES:
        path = ROOT / "models/spec" / f"{leaf}.py"
        project = [n for n in _hits(imports(path), ("semspec",)) if not n.startswith(leaves)]
        assert not project, f"{path.relative_to(ROOT)} imports {project}: a leaf imports only other leaves"


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


def test_models_is_four_subsystems_and_nothing_loose():
    loose = sorted(p.name for p in (ROOT / "models").glob("*.py") if p.name != "__init__.py")
    assert not loose, f"models/ holds spec/, lm/, cpu/ and project/ only; move {loose} into one of them"
    assert {p.name for p in (ROOT / "models").iterdir() if (p / "__init__.py").is_file()} == {
        "spec",
        "lm",
        "cpu",
        "project",
    }


def test_no_module_imports_itself_back_through_others():
    """No import circle anywhere in the project: lazy and type-only imports count, as they tie the
    modules together all the same."""
    g = graph()
    assert len(g) > 100 and "semspec.flows.serve.run" in g, "the walk sees every package"
    assert not cycles(g), f"import circles: {cycles(g)}"


def test_the_cycle_check_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_every_module_imports_from_its_floor_or_below():
    """The floors of docs/development.md, lowest first: the environment, the CPU runtime, the algorithm's
    leaves, the LM adapter, the algorithm, the project's files, the pipeline stages, the core API, the
    CLI and server."""
    g = graph()
    assert not upward(g), f"imports from a lower floor to a higher one: {upward(g)}"
    assert floor("semspec.models.spec.rules") < floor("semspec.models.lm.adapter") < floor("semspec.api")
    assert [name for name, _ in LAYERS][-1] == "CLI, server, flows" and floor("semspec.flows.cli") == 8


def test_the_layer_picture_in_the_docs_is_drawn_from_the_code():
    """docs/development.md shows ``python -m tests.helpers.imports``'s diagram as it is now."""
    text = (ROOT / "docs/development.md").read_text(encoding="utf-8")
    assert f"```mermaid\n{diagram(graph())}\n```" in text, (
        "the layer diagram is stale: paste `python -m tests.helpers.imports` into docs/development.md"
    )
