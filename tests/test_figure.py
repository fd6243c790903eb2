"""``benchmarks/figure.py``: pass@1 against time per problem from an evaluation's outputs."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from benchmarks import figure

ROOT = Path(__file__).resolve().parents[1]


def _metrics(path: Path) -> Path:
    """A summary in the evaluate stage's schema (tasks/evaluate/): benchmarks, _overall, _models."""
    methods = {
        "target": {"pass@1": 0.5, "pass@1_ci95": [0.3, 0.7], "cost_s": 10.0, "latency_s": 12.0},
        "semanticspec-all": {"pass@1": 0.45, "pass@1_ci95": None, "cost_s": 6.0, "latency_s": 7.0},
        "llamacpp": {"pass@1": 0.5, "cost_s": 9.5, "latency_s": 9.5},
    }
    path.write_text(
        json.dumps(
            {
                "arith": methods,
                "_overall": methods,
                "_models": {
                    "target": {"model_id": "m", "why": "auto -> int4: AVX512, native bf16: int4 ..."}
                },
            }
        )
    )
    return path


def test_the_figure_is_written_from_a_metrics_file(tmp_path):
    out = tmp_path / "fig" / "pareto.png"
    assert figure.main(["--metrics", str(_metrics(tmp_path / "metrics.json")), "--out", str(out)]) == 0
    assert out.is_file() and out.stat().st_size > 1000
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_cpu_comes_from_the_argument_or_the_metrics(tmp_path):
    points, cpu = figure.load(_metrics(tmp_path / "metrics.json"))
    assert cpu == "AVX512, native bf16"
    assert {p.method for p in points} == {"target", "semanticspec-all", "llamacpp"}
    assert next(p for p in points if p.method == "target").seconds == 10.0  # cost_s by default
    points, _ = figure.load(tmp_path / "metrics.json", x="latency_s")
    assert next(p for p in points if p.method == "target").seconds == 12.0


def test_per_problem_rows_are_read_when_there_is_no_summary(tmp_path):
    for method, rows in {
        "target": [(True, 4.0), (False, 6.0)],
        "draft": [(False, 1.0), (False, 3.0)],
    }.items():
        (tmp_path / "arith").mkdir(exist_ok=True)
        (tmp_path / "arith" / f"{method}.jsonl").write_text(
            "\n".join(json.dumps({"seed": 0, "correct": c, "cost_s": s, "latency_s": s}) for c, s in rows)
        )
    points, cpu = figure.load(tmp_path)
    got = {p.method: (p.pass_at_1, p.seconds) for p in points}
    assert got == {"target": (0.5, 5.0), "draft": (0.0, 2.0)}
    assert cpu is None
    out = tmp_path / "rows.png"
    assert figure.main(["--metrics", str(tmp_path), "--out", str(out), "--cpu", "test CPU"]) == 0
    assert out.stat().st_size > 0


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{not json", "not JSON"),
        ("[1, 2]", "expected a JSON object"),
        (json.dumps({"_overall": {"target": {"cost_s": 3.0}}}), "'pass@1' is missing"),
        (json.dumps({"_overall": {"target": {"pass@1": 0.5}}}), "'cost_s' is missing"),
        (json.dumps({"_overall": {"target": {"pass@1": "high", "cost_s": 3.0}}}), "finite number"),
        (json.dumps({"_overall": {"target": {"pass@1": 1.5, "cost_s": 3.0}}}), "in [0, 1]"),
        (json.dumps({"a": {}, "b": {}}), "--benchmark"),
    ],
)
def test_a_malformed_metrics_file_is_a_clear_error(tmp_path, text, message):
    bad = tmp_path / "metrics.json"
    bad.write_text(text)
    with pytest.raises(ValueError, match=re.escape(message)):
        figure.load(bad)
    out = tmp_path / "never.png"
    assert figure.main(["--metrics", str(bad), "--out", str(out)]) == 2
    assert not out.exists()


def test_the_published_figure_data_reads(tmp_path):
    """docs/assets/pareto.json (the README's figure) is in the schema the script reads."""
    points, cpu = figure.load(ROOT / "docs" / "assets" / "pareto.json")
    assert cpu and "AVX512" in cpu
    assert {"target", "semanticspec-all"} <= {p.method for p in points}
