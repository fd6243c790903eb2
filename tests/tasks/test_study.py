"""benchmarks/study.py: the budget read from the budget run, the study's table (speed-ups against our target
and llama.cpp's), the operating curve's points and the figure's summary, from hand-made summaries."""

from __future__ import annotations

import pytest

from benchmarks.study import curve_points, curve_table, read_budget, report, table, with_curve


def _m(pass1: float, cost: float, **extra) -> dict:
    return {"pass@1": pass1, "pass@1_ci95": [pass1 - 0.1, pass1 + 0.1], "cost_s": cost, "n": 4, **extra}


def test_the_budget_is_the_target_s_budget_90_or_a_clear_error():
    assert read_budget({"_overall": {"target": {"budget_90": 612}}}) == 612
    for bad in ({}, {"_overall": {"target": {"budget_90": None}}}):
        with pytest.raises(ValueError, match="larger one"):
            read_budget(bad)


def test_the_table_gives_speed_ups_against_llamacpp_where_it_ran():
    overall = {
        "target": _m(0.5, 10.0, speedup_latency=1.0),
        "semanticspec-all": _m(0.5, 4.0, speedup_latency=2.5, delta_vs_target=0.0),
        "llamacpp": _m(0.5, 8.0),
    }
    rows = table(overall).splitlines()
    assert rows[0].startswith("| method | pass@1 | 95% CI |") and len(rows) == 5
    spec = next(r for r in rows if r.startswith("| semanticspec-all "))
    cells = [c.strip() for c in spec.split("|")[1:-1]]
    assert cells[1] == "0.500" and cells[2] == "[0.400, 0.600]" and cells[3] == "+0.000"
    assert cells[8] == "2.50" and cells[9] == "2.00", "x target 2.5, x llama.cpp 8 / 4"
    alone = [c.strip() for c in table({"target": _m(0.5, 10.0)}).splitlines()[2].split("|")[1:-1]]
    assert alone[0] == "target" and alone[9] == "", "no llama.cpp run: no speed-up against it"


def test_the_curve_has_one_point_per_floor_in_order_and_joins_the_figure():
    runs = {
        1.5: {"_overall": {"semanticspec-all": _m(0.6, 6.0, speedup_latency=1.6, step_acceptance=0.5)}},
        0.5: {"_overall": {"semanticspec-all": _m(0.4, 3.0, speedup_latency=3.2, step_acceptance=0.9)}},
        2.0: {"_overall": {"target": _m(0.7, 9.0)}},  # a run without the method: no point
    }
    points = curve_points(runs)
    assert [p["min_ratio"] for p in points] == [0.5, 1.5] and points[0]["step_acceptance"] == 0.9
    lines = curve_table(points).splitlines()
    assert len(lines) == 4 and lines[2].startswith("| 0.5 | 0.400 |")
    fig = with_curve({"_overall": {"target": _m(0.7, 9.0)}, "_models": {}}, runs)
    assert list(fig["_overall"]) == [
        "target",
        "semanticspec-all, min_ratio 0.5",
        "semanticspec-all, min_ratio 1.5",
    ]
    text = report(
        {
            "arith": {"target": _m(0.7, 9.0)},
            "_overall": fig["_overall"],
            "_models": {"target": {"model_id": "T", "dtype": "int4"}},
        },
        points,
        612,
        "AVX512 (amx_bf16)",
    )
    assert "Budget: 612 new tokens" in text and "target: T (int4)" in text and "arith: 4" in text


def test_a_budget_sample_keeps_each_benchmark_s_share(monkeypatch):
    import semspec.tasks.evaluate.problems as problems
    from benchmarks.study import sample_sets

    sizes = {"math500": 238, "arith": 100}
    monkeypatch.setattr(problems, "eval_problems", lambda name, *a, **k: [None] * sizes[name])
    assert sample_sets("budget", 80) == ["evaluate.benchmarks={math500: 56, arith: 24}"]
    assert sample_sets("budget", 2) == ["evaluate.benchmarks={math500: 1, arith: 1}"]
    for bad in (0, 338):
        with pytest.raises(ValueError, match="between 1 and the 338 problems"):
            sample_sets("budget", bad)


def test_the_token_run_s_methods_join_the_table_with_llama_cpp_bridged_through_the_target():
    from benchmarks.study import with_token_run

    main = {
        "_overall": {
            "target": _m(0.6, 10.0, speedup_latency=1.0),
            "semanticspec-all": _m(0.55, 5.0, speedup_latency=2.0),
        }
    }
    token = {
        "_overall": {
            "target": _m(0.5, 12.0, speedup_latency=1.0),  # the target on the subset
            "specsampling": _m(0.5, 15.0, speedup_latency=0.8),
            "llamacpp": _m(0.5, 6.0, speedup_latency=2.0),
            "semanticspec-all": _m(0.0, 1.0),  # not a token-level method: the main run's row stays
        }
    }
    merged = with_token_run(main, token, ["specsampling", "llamacpp"])["_overall"]
    assert merged["target"]["cost_s"] == 10.0 and merged["semanticspec-all"]["pass@1"] == 0.55
    assert merged["specsampling"]["cost_s"] == 15.0 and merged["llamacpp"]["cost_s"] == 6.0
    # llama.cpp is 2x our target on the subset: SemanticSpec at 2x our target is 1x llama.cpp
    assert merged["semanticspec-all"]["speedup_vs_llamacpp"] == pytest.approx(1.0)
    assert merged["llamacpp"]["speedup_vs_llamacpp"] == pytest.approx(1.0)
    assert "| semanticspec-all |" in table(merged) and "1.00" in table(merged)
