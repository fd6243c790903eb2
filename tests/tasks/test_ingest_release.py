"""Ingest as the release run uses it: no evaluation problem becomes a training prefix, chains are written
in batches and a run killed midway keeps every chain it wrote."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from semspec.tasks import ingest, traces
from semspec.tasks.config import load_params
from semspec.tasks.data import Problem
from semspec.tasks.decontaminate import benchmark_ngrams, drop_benchmark_questions, ngrams
from semspec.tasks.ingest import run_ingest, trace_cache_path
from semspec.tasks.sources import load_source
from tests.helpers.pipeline import write_tiny_pair


def test_a_question_sharing_eight_words_with_a_benchmark_problem_is_dropped(data_dir):
    grams = benchmark_ngrams(data_dir)
    math = load_source("math500", data_dir=data_dir)[:3]
    copied = Problem("x", "s1k", "unknown", "Here is one: " + math[0].question, "")
    unrelated = Problem("y", "s1k", "unknown", "A farmer has 17 sheep and buys 5 more. How many?", "22")
    kept = drop_benchmark_questions([copied, unrelated, *math], grams, "s1k")
    assert kept == [unrelated]
    assert len(ngrams("one two three four five six seven eight nine")) == 2


def test_s1k_prefixes_never_hold_a_benchmark_question(data_dir, tmp_path, monkeypatch):
    grams = benchmark_ngrams(data_dir)
    picked = ingest.select_problems(
        load_params(
            overrides=["ingest.source=s1k", "ingest.max_questions=1000", f"ingest.data_dir={data_dir}"]
        ).ingest
    )
    assert picked and not any(ngrams(p.question) & grams for p in picked)
    assert len(picked) < len(load_source("s1k", data_dir=data_dir))  # some were dropped


def test_a_killed_ingest_keeps_its_chains_and_writes_only_the_rest(tmp_path, monkeypatch):
    pair = write_tiny_pair(tmp_path / "pair")
    written: list[str] = []

    def chains(lm, role, questions, max_tokens, keep):
        for i, q in enumerate(questions):
            if len(written) == 3:
                raise KeyboardInterrupt  # killed after three chains
            written.append(q)
            keep(i, f"{role} one ({q[:6]}).\n\n{role} two.\n\n{role} three.")

    monkeypatch.setattr(ingest, "load_lm", lambda model_cfg: object())
    monkeypatch.setattr(traces, "write_chains", chains)
    p = load_params(overrides=["ingest.max_questions=5", "ingest.trace_author=[target,draft]"])
    out = tmp_path / "prefixes.parquet"
    with pytest.raises(KeyboardInterrupt):
        run_ingest(p.ingest, pair, out)
    assert len(trace_cache_path(out).read_text().splitlines()) == 3 and not out.exists()
    first = list(written)
    written.clear()
    monkeypatch.setattr(traces, "write_chains", lambda lm, role, qs, n, keep: [
        (written.append(q), keep(i, f"{role} one ({q[:6]}).\n\n{role} two.\n\n{role} three.")) for i, q in enumerate(qs)
    ])  # fmt: skip
    rows = pq.read_table(run_ingest(p.ingest, pair, out)).to_pylist()
    assert len(written) == 10 - 3, "only the chains the killed run had not written"
    assert set(first) <= {r["question"] for r in rows}
    assert {r["context"].split(" ")[0] for r in rows if r["step_index"] > 0} == {"target", "draft"}


def test_a_trace_line_cut_by_a_kill_does_not_swallow_the_next(tmp_path):
    pair = write_tiny_pair(tmp_path / "pair")
    cfg = load_params().ingest
    path = tmp_path / "traces.jsonl"
    cache = traces.TraceCache(path, cfg, pair)
    cache.put("target", "q1", "one")
    path.write_text(path.read_text() + '{"key": "cut sho')  # a kill mid-write
    again = traces.TraceCache(path, cfg, pair)
    again.put("target", "q2", "two")
    third = traces.TraceCache(path, cfg, pair)
    assert ("target", "q1") in third and ("target", "q2") in third
    assert third.key("target", "q1") != third.key("draft", "q1")
