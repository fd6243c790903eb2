"""The evaluate stage's arithmetic (both speed-ups, paired bootstrap) on hand-made rows, skipping a method
that cannot run on the pair, and resuming per problem."""

from __future__ import annotations

import json

import pytest

from semspec.models.lm.pair import ModelConfig, PairConfig
from semspec.models.spec.batching import SingleModelDecoder
from semspec.models.spec.results import DecodeResult, StepRecord
from semspec.models.spec.settings import DecodeSettings
from semspec.tasks.config import EvaluateConfig
from semspec.tasks.data import Problem
from semspec.tasks.evaluate import run_evaluate
from semspec.tasks.evaluate.stats import bootstrap_pass, finish_budget, problem_row, summarize_rows
from tests.helpers.tiny import tiny_lm


def _row(qid: str, latency: float, tokens: int, correct: bool, seed: int = 0) -> dict:
    return {
        "question_id": qid,
        "seed": seed,
        "correct": correct,
        "latency_s": latency,
        "output_tokens": tokens,
        "target_share": 1.0,
        "acceptance_rate": None,
    }


def test_a_problem_row_keeps_the_step_trace_and_the_token_check_where_it_ran():
    res = DecodeResult("semanticspec", "a\n\nb", "b")
    res.add(StepRecord("draft", "a\n\n", 2, 3, p=0.9, q=0.5, u=0.1, tok=0.02))
    res.add(StepRecord("target", "b", 1, 1, p=0.1, q=0.5, u=0.7, proposal="c", rejected_by="ratio"))
    prob = Problem("q1", "arith", "math", "What is b?", "b")
    row = json.loads(json.dumps(problem_row(prob, 0, "semanticspec-all", res, "b", True)))
    assert row["steps"] == [
        {"author": "draft", "p": 0.9, "q": 0.5, "u": 0.1, "target_tokens": 3, "tok": 0.02},
        {"author": "target", "p": 0.1, "q": 0.5, "u": 0.7, "target_tokens": 1, "rejected_by": "ratio"},
    ]
    assert row["correct"] is True and row["method"] == "semanticspec-all"


def test_the_summary_counts_rejections_by_what_rejected_them():
    steps = [{"author": "target", "rejected_by": w} for w in ("ratio", "ratio", "floor", "budget")]
    rows = [
        {**_row("a", 1.0, 10, True), "steps": steps[:3]},
        {**_row("b", 1.0, 10, True), "steps": steps[3:]},
    ]
    rows.append({**_row("c", 1.0, 10, True), "steps": [{"author": "draft"}]})  # kept: counted nowhere
    m = summarize_rows(rows)
    assert {k: v for k, v in m.items() if k.startswith("rejected_")} == {
        "rejected_budget": 1,
        "rejected_floor": 1,
        "rejected_ratio": 2,
    }
    assert not any(k.startswith("rejected_") for k in summarize_rows([_row("d", 1.0, 10, True)]))


def test_batched_rows_compare_by_their_share_of_the_machine():
    """A batched target waits 40 s per problem but costs 10 s of machine time each; a one-at-a-time method
    taking 20 s per problem is then 2x slower, not 2x faster."""
    target = [{**_row(q, 40.0, 100, True), "cost_s": 10.0} for q in "ab"]
    alone = [{**_row(q, 20.0, 100, True), "cost_s": 20.0} for q in "ab"]
    m = summarize_rows(alone, target)
    assert m["speedup_latency"] == pytest.approx(0.5) and m["speedup_per_token"] == pytest.approx(0.5)
    assert summarize_rows(target)["latency_s"] == 40.0 and summarize_rows(target)["cost_s"] == 10.0


def test_both_speedups_on_hand_made_rows():
    target = [_row("a", 10.0, 100, True), _row("b", 30.0, 100, False)]
    # faster per problem (2x by mean latency) but with shorter outputs: per token only 1.6x
    method = [_row("a", 4.0, 50, True), _row("b", 16.0, 200, True), _row("c", 99.0, 1, True)]
    m = summarize_rows(method, target)
    assert m["speedup_latency"] == pytest.approx((10 + 30) / (4 + 16))  # problem c has no target row
    assert m["speedup_per_token"] == pytest.approx((40 / 200) / (20 / 250))
    assert m["n"] == 3 and m["latency_s"] == pytest.approx((4 + 16 + 99) / 3)
    assert m["delta_vs_target"] == pytest.approx(1.0 - 0.5)
    t = summarize_rows(target, target)
    assert t["speedup_latency"] == pytest.approx(1.0) and t["speedup_per_token"] == pytest.approx(1.0)
    assert t["delta_vs_target_ci95"] == [0.0, 0.0]
    assert summarize_rows(method)["speedup_latency"] is None  # no target in the run


def test_the_study_columns_pair_each_method_with_the_target_and_the_draft():
    """Cut answers, the paired difference to the draft and how often an answer is the target's or the
    draft's, on hand-made rows (problem c has no draft row: it counts for the target only)."""

    def row(q: str, answer: str | None, correct: bool, finish: str = "eos") -> dict:
        return {**_row(q, 1.0, 10, correct), "answer": answer, "finish_reason": finish}

    target = [row("a", "1", True), row("b", "2", True), row("c", "3", True), row("d", None, False, "length")]
    draft = [row("a", "1", True), row("b", "5", False), row("d", None, False, "length")]
    spec = [row("a", "1", True), row("b", "2", True), row("c", "4", False), row("d", None, False, "length")]
    m = summarize_rows(spec, target, draft)
    assert m["cut"] == pytest.approx(1 / 4)
    assert m["same_answer_as_target"] == pytest.approx(2 / 4)  # a and b; d has no answer to share
    assert m["same_answer_as_draft"] == pytest.approx(1 / 3)  # a of a, b, d
    assert m["delta_vs_draft"] == pytest.approx(2 / 3 - 1 / 3) and len(m["delta_vs_draft_ci95"]) == 2
    assert m["delta_vs_target"] == pytest.approx(2 / 4 - 3 / 4)
    alone = summarize_rows(spec)
    assert "delta_vs_draft" not in alone and "same_answer_as_target" not in alone
    itself = summarize_rows(draft, target, draft)  # the draft's own row: no difference to itself
    assert "delta_vs_draft" not in itself and itself["same_answer_as_target"] == pytest.approx(1 / 3)


def test_the_budget_that_lets_90_percent_finish_is_read_from_one_long_run():
    lengths = [40, 90, 120, 300, 310, 500, 700, 800, 950]  # ended by EOS; one more is cut at 1024
    rows = [{**_row(str(i), 1.0, k, True), "finish_reason": "eos"} for i, k in enumerate(lengths)]
    rows.append({**_row("cut", 1.0, 1024, False), "finish_reason": "length"})
    assert finish_budget(rows, 0.9) == 950  # 9 of 10 end within 950 tokens
    assert finish_budget(rows, 0.5) == 310
    assert finish_budget(rows, 1.0) is None, "one answer never ended: no budget in this run lets all finish"
    assert summarize_rows(rows)["budget_90"] == 950
    with pytest.raises(ValueError, match="share"):
        finish_budget(rows, 0.0)


def test_paired_bootstrap_interval():
    base = [True, False] * 20
    better = [True] * 40
    out = bootstrap_pass(better, base)
    lo, hi = out["delta_vs_target_ci95"]
    assert out["delta_vs_target"] == pytest.approx(0.5) and 0.3 < lo < 0.5 < hi <= 0.7
    lo, hi = out["pass@1_ci95"]
    assert lo == hi == 1.0
    same = bootstrap_pass(base, base)
    assert (
        same["delta_vs_target_ci95"] == [0.0, 0.0] and same["pass@1_ci95"][0] < 0.5 < same["pass@1_ci95"][1]
    )
    assert bootstrap_pass([True])["pass@1_ci95"] is None
    with pytest.raises(ValueError, match="same problems"):
        bootstrap_pass([True, False], [True])


def _pair() -> PairConfig:
    model_cfg = {"source": "local", "path": "/nonexistent", "prompt": "plain"}
    return PairConfig("tiny-eval", ModelConfig("tiny-d", **model_cfg), ModelConfig("tiny-t", **model_cfg))


def test_specsampling_is_skipped_across_vocabularies_with_the_reason(tmp_path):
    lms = {"draft": tiny_lm(merged=True, max_step_tokens=4), "target": tiny_lm(seed=1, max_step_tokens=4)}
    cfg = EvaluateConfig(
        benchmarks={"arith": 1}, methods=["target", "specsampling"], decode=DecodeSettings(max_new_tokens=8)
    )
    res = run_evaluate(cfg, _pair(), tmp_path, lms=lms, log_mlflow=False)
    assert list(res["arith"]) == ["target"]
    assert "different tokenizers" in res["_skipped_methods"]["specsampling"]
    assert res["_models"]["target"]["dtype"] == "float32"
    assert not (tmp_path / "arith" / "specsampling.jsonl").exists()


def test_evaluate_resumes_per_problem(tmp_path, monkeypatch):
    lms = {"draft": tiny_lm(max_step_tokens=4), "target": tiny_lm(seed=1, max_step_tokens=4)}
    cfg = EvaluateConfig(
        benchmarks={"arith": 3},
        methods=["target", "draft", "specsampling"],
        decode=DecodeSettings(max_new_tokens=8),
    )
    first = run_evaluate(cfg, _pair(), tmp_path, lms=lms, log_mlflow=False)
    row = first["arith"]["specsampling"]  # one vocabulary: the Leviathan decoder runs
    assert row["n"] == 3 and row["speedup_latency"] > 0 and "_skipped_methods" not in first
    # greedy token-level speculation writes exactly the target's text
    target_rows = (tmp_path / "arith" / "target.jsonl").read_text().splitlines()
    spec_rows = (tmp_path / "arith" / "specsampling.jsonl").read_text().splitlines()
    assert [json.loads(r)["text"] for r in spec_rows] == [json.loads(r)["text"] for r in target_rows]
    path = tmp_path / "arith" / "draft.jsonl"
    rows = path.read_text().splitlines()
    # a crash after the first problem of `draft`: one row kept, and half a line
    path.write_text(rows[0] + "\n" + rows[1][:20])
    calls = []
    real = SingleModelDecoder.decode_batch

    def counted(self, questions, *args, **kw):
        calls.extend([self.role] * len(questions))
        return real(self, questions, *args, **kw)

    monkeypatch.setattr(SingleModelDecoder, "decode_batch", counted)
    again = run_evaluate(cfg, _pair(), tmp_path, lms=lms, log_mlflow=False)
    assert calls == ["draft", "draft"], "only the two lost draft problems are decoded again"
    assert len(path.read_text().splitlines()) == 3
    assert again["arith"]["draft"]["pass@1"] == first["arith"]["draft"]["pass@1"]
    # other settings: the old rows are stale and every problem is decoded again
    calls.clear()
    cfg2 = EvaluateConfig(
        benchmarks={"arith": 3}, methods=["target", "draft"], decode=DecodeSettings(max_new_tokens=6)
    )
    run_evaluate(cfg2, _pair(), tmp_path, lms=lms, log_mlflow=False)
    assert sorted(calls) == ["draft"] * 3 + ["target"] * 3
    keys = {json.loads(line)["run_key"] for line in path.read_text().splitlines()}
    assert len(keys) == 1


def test_bench_runs_token_speculation_or_says_why_not():
    from semspec.tasks.bench import format_bench, run_bench

    settings = DecodeSettings(max_new_tokens=8, step_tokens=4)
    same = {"draft": tiny_lm(max_step_tokens=4), "target": tiny_lm(seed=1, max_step_tokens=4)}
    out = run_bench(_pair(), same, 2, settings, with_assisted=False, variants=())
    assert set(out) == {"target", "specsampling", "_models", "_formats"}
    assert out["specsampling"]["token_acceptance"] is not None and out["specsampling"]["speedup_latency"] > 0
    assert out["target"]["speedup_latency"] == pytest.approx(1.0)
    assert "x latency" in format_bench(out) and "float32" in format_bench(out)
    other = {"draft": tiny_lm(merged=True, max_step_tokens=4), "target": same["target"]}
    out = run_bench(_pair(), other, 1, settings, with_assisted=False, variants=())
    assert "specsampling" not in out and "different tokenizers" in out["_skipped"]["specsampling"]


def test_bench_runs_semanticspec_with_each_gamma_in_the_same_run(monkeypatch):
    """``also_gammas``: each SemanticSpec variant once more per gamma, labelled, with that gamma only,
    and the table stays aligned with the longer labels."""
    import semspec.tasks.bench as bench_task
    from semspec.models.spec.semanticspec import SemanticSpecDecoder

    lms = {"draft": tiny_lm(max_step_tokens=4), "target": tiny_lm(seed=1, max_step_tokens=4)}
    real = bench_task.build_decoder

    def build(method, pair, lms, settings, variant=None):
        if method != "semanticspec":
            return real(method, pair, lms, settings)
        return SemanticSpecDecoder(lms["draft"], lms["target"], lambda h: 0.1, lambda h: 1.0, settings)

    monkeypatch.setattr(bench_task, "build_decoder", build)
    settings = DecodeSettings(max_new_tokens=8, step_tokens=4)
    methods, _ = bench_task.bench_methods(_pair(), lms, settings, False, ("all",), also_gammas=(2, 3))
    gammas = {label: dec.settings.gamma for label, dec in methods}
    assert gammas == {
        "target": 1,
        "specsampling": 1,
        "semanticspec-all": 1,
        "semanticspec-all/gamma2": 2,
        "semanticspec-all/gamma3": 3,
    }
    out = bench_task.run_bench(
        _pair(), lms, 1, settings, with_assisted=False, variants=("all",), also_gammas=(2,)
    )
    lines = bench_task.format_bench(out).splitlines()
    rows = [line for line in lines if line.startswith(("method", "target", "semanticspec"))]
    assert len(rows) == 4 and len({len(line) for line in rows}) == 1, "columns out of line"


def test_evaluate_in_batches_writes_the_same_answers(tmp_path):
    """Batched evaluation (continuous batching over 5 problems, 2 at a time) gives every problem the answer
    it gets alone; the batch size is part of the run key (latencies differ) and of each row."""
    lms = {"draft": tiny_lm(max_step_tokens=4), "target": tiny_lm(seed=1, max_step_tokens=4)}
    texts = {}
    for batch_size in (1, 2):
        cfg = EvaluateConfig(
            benchmarks={"arith": 5},
            methods=["target", "draft"],
            decode=DecodeSettings(max_new_tokens=12),
            batch_size=batch_size,
        )
        out = tmp_path / str(batch_size)
        run_evaluate(cfg, _pair(), out, lms=lms, log_mlflow=False)
        rows = [json.loads(line) for line in (out / "arith" / "target.jsonl").read_text().splitlines()]
        assert {r["batch_size"] for r in rows} == {batch_size} and len(rows) == 5
        texts[batch_size] = ({r["question_id"]: r["text"] for r in rows}, {r["run_key"] for r in rows})
    assert texts[1][0] == texts[2][0]
    assert texts[1][1] != texts[2][1]
    with pytest.raises(ValueError, match="batch_size"):
        EvaluateConfig(batch_size=0)


def test_batch_bench_reports_each_batch_size_beside_the_target(monkeypatch):
    from semspec.models.spec.semanticspec import SemanticSpecDecoder
    from semspec.tasks import bench

    lms = {"draft": tiny_lm(max_step_tokens=4), "target": tiny_lm(seed=1, max_step_tokens=4)}
    settings = DecodeSettings(max_new_tokens=8, step_tokens=4)
    real = bench.build_decoder

    def build(method, pair, lms, settings, variant="all", pins=None):  # probes without a registry
        if method == "semanticspec":
            return SemanticSpecDecoder(lms["draft"], lms["target"], lambda h: 1.0, lambda h: 0.5, settings)
        return real(method, pair, lms, settings, variant, pins)

    monkeypatch.setattr(bench, "build_decoder", build)
    out = bench.run_batch_bench(_pair(), lms, 3, settings, batches=(1, 2))
    rows = [v for k, v in out.items() if not k.startswith("_")]
    assert [(r["method"], r["batch"]) for r in rows] == [
        ("target", 1),
        ("target", 2),
        ("semanticspec-all", 1),
        ("semanticspec-all", 2),
    ]
    assert all(r["throughput_tps"] > 0 and r["output_tokens"] > 0 for r in rows)
    assert out["target@2"]["x_target_throughput"] == pytest.approx(1.0)
    row = out["semanticspec-all@2"]
    assert row["x_target_throughput"] == pytest.approx(
        row["throughput_tps"] / out["target@2"]["throughput_tps"]
    )
    assert "token-level" in out["_notes"] and "float32" in bench.format_batch_bench(out)
    with pytest.raises(ValueError, match="batch"):
        bench.run_batch_bench(_pair(), lms, 3, settings, batches=(0,))


def test_evaluate_spreads_problems_over_two_ray_actors(tmp_path, monkeypatch):
    """Two CPU actors, each a replica of the pair running a batched decoder: every problem is decoded
    once, the rows equal an in-process run's, and resuming in-process finds nothing left to decode."""
    from tests.helpers.pipeline import write_tiny_pair

    pair = write_tiny_pair(tmp_path, max_step_tokens=4)
    common = {
        "benchmarks": {"arith": 6},
        "methods": ["target", "draft"],
        "decode": DecodeSettings(max_new_tokens=8),
        "batch_size": 2,
    }
    out = {}
    for actors in (2, 0):
        run_evaluate(EvaluateConfig(**common, actors=actors), pair, tmp_path / str(actors), log_mlflow=False)
        lines = (tmp_path / str(actors) / "arith" / "target.jsonl").read_text().splitlines()
        out[actors] = {json.loads(x)["question_id"]: json.loads(x) for x in lines}
        assert len(lines) == 6 == len(out[actors]), "each problem exactly once"
    assert {q: r["text"] for q, r in out[0].items()} == {q: r["text"] for q, r in out[2].items()}
    calls = []
    monkeypatch.setattr(SingleModelDecoder, "decode_batch", lambda self, qs, *a, **k: calls.append(qs) or [])
    again = run_evaluate(EvaluateConfig(**common, actors=0), pair, tmp_path / "2", log_mlflow=False)
    assert calls == [] and again["arith"]["target"]["n"] == 6


def test_evaluate_decodes_with_the_configured_top_p():
    from semspec.tasks.evaluate.workers import method_decoders

    lms = {"draft": tiny_lm(max_step_tokens=4), "target": tiny_lm(seed=1, max_step_tokens=4)}
    cfg = EvaluateConfig(
        benchmarks={"arith": 1},
        methods=["target", "draft"],
        decode=DecodeSettings(temperature=0.7, top_p=0.8),
    )
    decoders, _ = method_decoders(cfg, _pair(), lms, "arith", 0)
    assert {(d.settings.temperature, d.settings.top_p) for d in decoders.values()} == {(0.7, 0.8)}
    with pytest.raises(ValueError, match="top_p"):
        EvaluateConfig(decode={"top_p": 0.0})


def test_every_method_has_its_own_fixed_colour():
    from semspec.models.spec.names import METHODS, PROBE_METHOD, PROBE_VARIANTS, method_label
    from semspec.tasks.evaluate.plots import method_style

    labels = [m for m in METHODS if m != PROBE_METHOD] + [
        method_label(PROBE_METHOD, v) for v in PROBE_VARIANTS
    ]
    colours = [method_style(label)["color"] for label in labels]
    assert len(set(colours)) == len(labels), dict(zip(labels, colours, strict=True))
    assert method_style("semanticspec-all@math") == {
        "color": method_style("semanticspec-all")["color"],
        "marker": "^",
    }
