"""The size limits of docs/development.md: a module is read in one sitting, a function on one screen.

No file in models/, tasks/ or flows/ over 500 lines, none over 350 outside the CPU runtime (models/cpu,
whose kernels' wrappers carry their layouts); no class over 300 lines, no function over 60."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("models", "tasks", "flows", "semspec")
RUNTIME = "models/cpu"
MAX_FILE, MAX_RUNTIME_FILE, MAX_CLASS, MAX_FUNCTION = 350, 500, 300, 60


def sources() -> list[Path]:
    return sorted(p for folder in FOLDERS for p in (ROOT / folder).rglob("*.py"))


def oversized(path: Path, root: Path = ROOT) -> list[str]:
    """What in ``path`` is over its limit: the file, a class or a function, with its length."""
    text = path.read_text(encoding="utf-8")
    rel = path.relative_to(root).as_posix()
    limit = MAX_RUNTIME_FILE if rel.startswith(RUNTIME) else MAX_FILE
    out = [f"{rel}: {n} lines > {limit}"] if (n := text.count("\n")) > limit else []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            most = MAX_CLASS if isinstance(node, ast.ClassDef) else MAX_FUNCTION
            if (n := node.end_lineno - node.lineno + 1) > most:
                out.append(f"{rel}:{node.lineno} {node.name}: {n} lines > {most}")
    return out


@pytest.mark.parametrize("folder", FOLDERS)
def test_files_classes_and_functions_stay_within_their_limits(folder):
    over = [o for p in sources() if p.relative_to(ROOT).parts[0] == folder for o in oversized(p)]
    assert not over, "split these (docs/development.md, Layout):\n" + "\n".join(over)


def test_the_check_sees_a_long_function_and_a_long_file(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION))
    (tmp_path / "tasks").mkdir()
    path = tmp_path / "tasks" / "m.py"
    path.write_text(f"def f():\n{body}\n" + "\n" * MAX_FILE)
    assert oversized(path, tmp_path) == [
        f"tasks/m.py: {MAX_FUNCTION + 1 + MAX_FILE} lines > {MAX_FILE}",
        f"tasks/m.py:1 f: {MAX_FUNCTION + 1} lines > {MAX_FUNCTION}",
    ]
