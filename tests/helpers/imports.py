"""The project's import graph: every module of ``semspec``, ``semspec.models``, ``semspec.tasks`` and
``semspec.flows`` and the project modules it imports (at the top, inside functions and under
``TYPE_CHECKING`` alike), its cycles, and its layers as docs/development.md draws them.

    python -m tests.helpers.imports    # prints the layer diagram (mermaid) docs/development.md holds
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# import name -> folder; ``semspec`` itself holds the core (the API, the server's engine)
PACKAGES = {
    "semspec.models": "models",
    "semspec.tasks": "tasks",
    "semspec.flows": "flows",
    "semspec": "semspec",
}
# the floors, lowest first: a module imports only from its own floor or those below (the longest prefix
# that names a module gives its floor; the algorithm's leaves sit below the LM adapter, which reads them;
# ``semspec.models`` itself is an empty package)
LAYERS = [
    ("environment", ("semspec.models.project.settings", "semspec.models")),
    ("cpu runtime", ("semspec.models.cpu",)),
    (
        "algorithm leaves",
        tuple(f"semspec.models.spec.{m}" for m in ("names", "steps", "rules", "grading")),
    ),
    ("LM adapter", ("semspec.models.lm",)),
    ("algorithm", ("semspec.models.spec",)),
    ("project", ("semspec.models.project",)),
    ("pipeline stages", ("semspec.tasks",)),
    ("core API", ("semspec",)),
    ("CLI, server, flows", ("semspec.flows",)),
]


def modules() -> dict[str, Path]:
    """Every project module by its import name."""
    out = {}
    for name, folder in PACKAGES.items():
        base = ROOT / folder
        for path in sorted(base.rglob("*.py")):
            parts = path.relative_to(base).with_suffix("").parts
            if name == "semspec" and parts[0] in ("models", "tasks", "flows", "probes", "conf"):
                continue  # the package's links to the other folders
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            out[".".join((name, *parts))] = path
    return out


def _imported(path: Path, package: str) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, up level - 1
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            names |= {base, *(f"{base}.{a.name}" for a in node.names)}
        elif isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
    return names


def graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports (``from a import b`` counts ``a.b`` where that is a
    module, else ``a``; a module's own packages are not counted)."""
    mods = modules()

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    out = {}
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        found = {resolve(n) for n in _imported(path, package)}
        out[mod] = {m for m in found if m and m != mod and not mod.startswith(m + ".")}
    return out


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found = []
    for root in sorted(g):
        if root in index:
            continue
        work = [(root, iter(sorted(g[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, edges = work[-1]
            w = next(edges, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(g.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def floor(mod: str) -> int:
    """The layer ``mod`` sits on (an index into ``LAYERS``): that of the longest prefix naming it."""
    best = max(
        (
            (len(p), i)
            for i, (_, prefixes) in enumerate(LAYERS)
            for p in prefixes
            if mod == p or mod.startswith(p + ".")
        ),
        default=None,
    )
    if best is None:
        raise ValueError(f"{mod} is on no floor of LAYERS: add its package there")
    return best[1]


def upward(g: dict[str, set[str]]) -> list[str]:
    """Every import from a lower floor to a higher one."""
    return sorted(f"{m} -> {w}" for m, ws in g.items() for w in ws if floor(w) > floor(m))


def diagram(g: dict[str, set[str]]) -> str:
    """The floors and the imports between them (module pairs counted), as a mermaid flowchart."""
    counts: dict[tuple[int, int], int] = defaultdict(int)
    for m, ws in g.items():
        for w in ws:
            if floor(m) != floor(w):
                counts[floor(m), floor(w)] += 1
    lines = ["flowchart BT"]
    lines += [f'  L{i}["{name}"]' for i, (name, _) in enumerate(LAYERS)]
    lines += [f"  L{a} -->|{n}| L{b}" for (a, b), n in sorted(counts.items())]
    return "\n".join(lines)


if __name__ == "__main__":
    print(diagram(graph()))
