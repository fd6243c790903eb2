"""pass@1 against mean time per problem, one labelled point per method: an evaluation as one figure.

Reads what the evaluate stage writes (``tasks/evaluate/``):

* a summary, ``eval/<pair>/metrics.json`` (or the copy DVC tracks, ``reports/<pair>/eval_metrics.json``):
  ``{benchmark: {method: {"pass@1", "pass@1_ci95", "cost_s", "latency_s", ...}}, "_overall": {...},
  "_models": {role: {"model_id", "dtype", "why", ...}}}``; the figure plots ``_overall`` (every benchmark
  together) unless ``--benchmark`` names one;
* or a folder of per-problem rows, ``<folder>/<benchmark>/<method>.jsonl`` (one JSON object per problem
  with ``correct``, ``seed``, ``cost_s`` and ``latency_s``), pooled over the benchmarks the same way.

The x axis is ``cost_s`` by default, the time the evaluation's speed-ups use (a problem's latency when
decoded alone, its share of the batch's time when batched); ``--x latency_s`` plots the latency from
joining the batch to the last step. A method labelled ``llamacpp...`` (llama.cpp's runs beside semspec's)
is drawn as a square. The CPU in the title comes from ``--cpu``, else the summary's optional ``_cpu``, else
the format choice the summary records under ``_models`` (e.g. ``AVX512, native bf16``).

Usage (from the project's venv, after ``scripts/demo`` or ``dvc repro evaluate``):
    python benchmarks/figure.py --metrics eval/qwen-coder/metrics.json --out reports/qwen-coder/pareto.png \
        [--title TEXT] [--cpu TEXT] [--benchmark NAME] [--x cost_s|latency_s]
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import re
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("semspec.benchmarks.figure")

X_FIELDS = ("cost_s", "latency_s")
OVERALL = "_overall"
_CPU_RE = re.compile(
    r"\b(AVX\w*(?:, [^:;]+)?)"
)  # the capability a format's `why` names: "AVX512, native bf16"


@dataclass(frozen=True)
class Point:
    """One method's figures."""

    method: str
    pass_at_1: float
    seconds: float
    ci95: tuple[float, float] | None = None


def _number(value: Any, where: str, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{where}: field {name!r} must be a finite number, got {value!r}")
    return float(value)


def _ci(value: Any, where: str) -> tuple[float, float] | None:
    if value is None:
        return None
    if not isinstance(value, list | tuple) or len(value) != 2:
        raise ValueError(f"{where}: field 'pass@1_ci95' must be [low, high] or null, got {value!r}")
    low, high = (_number(v, where, "pass@1_ci95") for v in value)
    return low, high


def points_from_summary(section: Any, x: str, where: str) -> list[Point]:
    """Points of one summary section (``{method: metrics}``); a field missing or of the wrong type is a
    ValueError naming the file, the method and the field."""
    if not isinstance(section, dict) or not section:
        raise ValueError(f"{where}: expected a mapping of method -> metrics, got {type(section).__name__}")
    points = []
    for method, m in section.items():
        at = f"{where}: method {method!r}"
        if not isinstance(m, dict):
            raise ValueError(f"{at}: expected a mapping of metrics, got {type(m).__name__}")
        if "pass@1" not in m:
            raise ValueError(f"{at}: field 'pass@1' is missing")
        seconds = m.get(x, m.get("latency_s")) if x == "cost_s" else m.get(x)
        if seconds is None:
            raise ValueError(f"{at}: field {x!r} is missing")
        p = _number(m["pass@1"], at, "pass@1")
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"{at}: field 'pass@1' must be in [0, 1], got {p}")
        s = _number(seconds, at, x)
        if s <= 0:
            raise ValueError(f"{at}: field {x!r} must be positive, got {s}")
        points.append(Point(str(method), p, s, _ci(m.get("pass@1_ci95"), at)))
    return points


def points_from_rows(folder: Path, x: str, benchmark: str | None) -> list[Point]:
    """Points from per-problem rows, ``<folder>/<benchmark>/<method>.jsonl``: pass@1 (the mean over seeds
    of each seed's share correct, as the summary computes it) and the mean ``x`` per problem."""
    files = sorted(folder.glob(f"{benchmark or '*'}/*.jsonl"))
    if not files:
        raise ValueError(f"{folder}: no per-problem rows (<benchmark>/<method>.jsonl) and no metrics.json")
    rows: dict[str, list[dict[str, Any]]] = {}
    for path in files:
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not JSON ({e.msg})") from None
            if not isinstance(row, dict) or "correct" not in row:
                raise ValueError(f"{path}:{n}: expected a problem row with field 'correct'")
            rows.setdefault(path.stem, []).append({**row, "_at": f"{path}:{n}"})
    points = []
    for method, rs in rows.items():
        by_seed: dict[Any, list[bool]] = {}
        seconds = []
        for r in rs:
            by_seed.setdefault(r.get("seed", 0), []).append(bool(r["correct"]))
            value = r.get(x, r.get("latency_s")) if x == "cost_s" else r.get(x)
            if value is None:
                raise ValueError(f"{r['_at']}: field {x!r} is missing")
            seconds.append(_number(value, r["_at"], x))
        p = statistics.mean(statistics.mean(v) for v in by_seed.values())
        points.append(Point(method, p, statistics.mean(seconds)))
    return points


def load(path: Path, x: str = "cost_s", benchmark: str | None = None) -> tuple[list[Point], str | None]:
    """The points to plot and the CPU the summary names (None when it names none). ``path`` is a summary
    file or an evaluation folder (its ``metrics.json``, else its per-problem rows)."""
    if x not in X_FIELDS:
        raise ValueError(f"x must be one of {X_FIELDS}, got {x!r}")
    if path.is_dir():
        if not (path / "metrics.json").is_file():
            return points_from_rows(path, x, benchmark), None
        path = path / "metrics.json"
    if not path.is_file():
        raise ValueError(f"{path}: no such metrics file or evaluation folder")
    try:
        metrics = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(metrics, dict):
        raise ValueError(f"{path}: expected a JSON object of benchmark -> method -> metrics")
    benches = [b for b in metrics if not b.startswith("_")]
    key = benchmark or (OVERALL if OVERALL in metrics else (benches[0] if len(benches) == 1 else None))
    if key is None:
        raise ValueError(f"{path}: no '{OVERALL}' section; pick a benchmark with --benchmark ({benches})")
    if key not in metrics:
        raise ValueError(f"{path}: no section {key!r}; it has {sorted(metrics)}")
    return points_from_summary(metrics[key], x, f"{path} [{key}]"), cpu_of(metrics)


def cpu_of(metrics: dict[str, Any]) -> str | None:
    """The CPU a summary names: its ``_cpu``, else the capability in a model's format choice."""
    if isinstance(metrics.get("_cpu"), str) and metrics["_cpu"].strip():
        return metrics["_cpu"].strip()
    models = metrics.get("_models")
    for d in models.values() if isinstance(models, dict) else ():
        if isinstance(d, dict) and (m := _CPU_RE.search(str(d.get("why", "")))):
            return m.group(1)
    return None


def _style(method: str) -> dict[str, str]:
    if method.startswith("llamacpp"):
        return {"color": "tab:pink", "marker": "s"}
    from semspec.tasks.evaluate.plots import method_style

    return method_style(method)


_FONT = 8  # label size, points
# where a label may go, in points from its marker, tried in this order: nearest first, right before left
_OFFSETS = tuple(
    (round(d * math.cos(math.radians(a))), round(d * math.sin(math.radians(a))))
    for d in (9, 22, 36, 50)
    for a in (20, -20, 160, -160, 60, -60, 120, -120)
)


def _label(fig: Any, ax: Any, points: list[Point]) -> None:
    """Name each point at the nearest offset whose (estimated) text box overlaps no marker and no label
    placed before, joined to its marker by a thin line."""
    to_px = ax.transData.transform
    scale = fig.dpi / 72  # points -> pixels
    r = 5 * scale  # a marker's half-width
    placed = [(x - r, y - r, x + r, y + r) for x, y in (to_px((p.seconds, p.pass_at_1)) for p in points)]
    for pt in sorted(points, key=lambda p: (p.seconds, -p.pass_at_1)):
        x0, y0 = to_px((pt.seconds, pt.pass_at_1))
        w, h = 0.6 * _FONT * len(pt.method) * scale, 1.2 * _FONT * scale
        for dx, dy in _OFFSETS:
            ha, va = ("left" if dx >= 0 else "right"), ("bottom" if dy >= 0 else "top")
            left = x0 + dx * scale - (w if ha == "right" else 0)
            bottom = y0 + dy * scale - (h if va == "top" else 0)
            box = (left, bottom, left + w, bottom + h)
            if not any(b[0] < box[2] and box[0] < b[2] and b[1] < box[3] and box[1] < b[3] for b in placed):
                break
        placed.append(box)
        ax.annotate(
            pt.method,
            (pt.seconds, pt.pass_at_1),
            xytext=(dx, dy),
            textcoords="offset points",
            fontsize=_FONT,
            ha=ha,
            va=va,
            arrowprops={"arrowstyle": "-", "lw": 0.6, "color": "0.5", "shrinkA": 1, "shrinkB": 4},
        )


def plot(points: list[Point], out: Path, title: str, cpu: str | None, x: str = "cost_s") -> Path:
    """Write the figure to ``out`` (PNG) and return its path."""
    if not points:
        raise ValueError("nothing to plot: no method has figures")
    import matplotlib  # imported here: the headless backend is chosen before pyplot loads

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from semspec.tasks.io import close_figure, save_figure_atomic

    fig, ax = plt.subplots(figsize=(8, 4.8))
    try:
        for pt in sorted(points, key=lambda p: p.seconds):
            style = _style(pt.method)
            if pt.ci95 is not None:
                low, high = pt.ci95
                yerr = [[max(pt.pass_at_1 - low, 0.0)], [max(high - pt.pass_at_1, 0.0)]]
                ax.errorbar(pt.seconds, pt.pass_at_1, yerr=yerr, color=style["color"], alpha=0.35, lw=1)
            ax.scatter(pt.seconds, pt.pass_at_1, s=55, zorder=3, **style)
        ax.set_xlim(0, max(p.seconds for p in points) * 1.25)
        ax.set_ylim(-0.05, 1.05)
        _label(fig, ax, points)
        what = "mean time per problem (s)" if x == "cost_s" else "mean latency per problem (s)"
        ax.set(xlabel=f"{what}, lower is faster", ylabel="pass@1 (bars: 95% bootstrap interval)")
        ax.set_title(f"{title}\nCPU: {cpu or 'not recorded'}", fontsize=10)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        out.parent.mkdir(parents=True, exist_ok=True)
        return save_figure_atomic(fig, out, dpi=110)
    finally:
        close_figure(fig)


def main(argv: list[str] | None = None) -> int:
    """The command line; a bad input is one logged line and exit status 2."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--metrics", type=Path, required=True, help="metrics.json, or an evaluation folder")
    ap.add_argument("--out", type=Path, required=True, help="the PNG to write")
    ap.add_argument("--title", default="pass@1 against time per problem", help="the figure's title")
    ap.add_argument("--cpu", default=None, help="the CPU named in the title (default: from the metrics)")
    ap.add_argument("--benchmark", default=None, help="one benchmark's section (default: _overall)")
    ap.add_argument("--x", choices=X_FIELDS, default="cost_s", help="the time on the x axis")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        points, cpu = load(args.metrics, args.x, args.benchmark)
        out = plot(points, args.out, args.title, args.cpu or cpu, args.x)
    except ValueError as e:
        log.error("%s", e)
        return 2
    log.info("wrote %s (%d methods)", out, len(points))
    return 0


if __name__ == "__main__":
    sys.exit(main())
