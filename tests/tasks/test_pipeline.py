"""Stage contracts in tmp dirs with tiny models: ingest -> sample -> cluster -> train -> registry."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
import yaml

from semspec.models.lm import load_lm
from semspec.models.spec.judges import EmbeddingJudge
from semspec.tasks.cluster import run_cluster
from semspec.tasks.config import ClusterConfig, load_params
from semspec.tasks.cross import run_cross
from semspec.tasks.ingest import run_ingest
from semspec.tasks.io import read_shards
from semspec.tasks.labelling import inject_noise, label_prefix
from semspec.tasks.sample import run_sample
from semspec.tasks.train.data import split_by_question
from tests.helpers.pipeline import write_tiny_pair
from tests.helpers.project import kill_mid_run
from tests.helpers.tiny import boost_tokens


def _judge():
    # texts -> 2-d embeddings by length bucket: enough to give several clusters of several sizes
    return EmbeddingJudge(lambda ts: torch.tensor([[1.0, float(len(t) // 3)] for t in ts]), threshold=0.999)


OVERRIDES = [
    "sample.executor=local",
    "cluster.executor=local",
    "sample.max_step_tokens=10",
    "ingest.max_questions=8",
    "sample.n=6",  # enough valid steps per question that every split has draft steps to route
]


@pytest.fixture(scope="module")
def stages(tmp_path_factory):
    """Run ingest, sample (local executor, delimiter-boosted tiny models) and cluster once."""
    tmp = tmp_path_factory.mktemp("pipe")
    pair = write_tiny_pair(tmp)
    p = load_params(profile="tiny", overrides=OVERRIDES)
    lms = {}
    for role in ("draft", "target"):
        lms[role] = load_lm(pair.role(role))
        boost_tokens(lms[role].model, [lms[role].tokenizer.convert_tokens_to_ids("\n")], 3.0)
    prefixes = run_ingest(p.ingest, pair, tmp / "prefixes.parquet")
    run_sample(p.sample, pair, prefixes, tmp / "samples", lms=lms)
    run_cross(p.sample, pair, prefixes, tmp / "samples", tmp / "cross", lms=lms)
    run_cluster(p.cluster, pair, tmp / "samples", tmp / "labels", prefixes, judge=_judge())
    return {"tmp": tmp, "pair": pair, "params": p, "prefixes": prefixes, "lms": lms}


def test_ingest_writes_the_prefix_schema(stages):
    t = pq.read_table(stages["prefixes"])
    assert t.column_names == [
        "prefix_id",
        "question_id",
        "source",
        "domain",
        "step_index",
        "question",
        "context",
    ]
    assert t.num_rows == 8 and len(set(t.column("prefix_id").to_pylist())) == 8


def test_samples_have_exactly_n_rows_per_prefix_and_role(stages):
    n = stages["params"].sample.n
    pids = set(pq.read_table(stages["prefixes"]).column("prefix_id").to_pylist())
    for role, d in (("draft", 32), ("target", 64)):
        t = read_shards(stages["tmp"] / "samples" / role)
        rows = t.select(["prefix_id", "sample_idx"]).to_pylist()
        assert len(rows) == n * len(pids)
        assert len({(r["prefix_id"], r["sample_idx"]) for r in rows}) == len(rows)
        assert set(t.column("prefix_id").to_pylist()) == pids
        assert t.schema.field("h_last").type.list_size == d
        assert t.schema.field("h_layers").type.list_size == 3 * d  # (L+1) * D with L = 2
        assert set(t.column("finish_reason").to_pylist()) <= {"delimiter", "eos", "length"}
        assert set(t.column("role").to_pylist()) == {role}


def test_label_cluster_sizes_sum_to_valid_count(stages):
    for role in ("draft", "target"):
        labels = pq.read_table(stages["tmp"] / "labels" / f"{role}.parquet").to_pylist()
        assert labels
        by_prefix: dict[str, list[dict]] = {}
        for r in labels:
            by_prefix.setdefault(r["prefix_id"], []).append(r)
        n = stages["params"].sample.n
        for rows in by_prefix.values():
            sizes = {r["cluster_id"]: r["cluster_size"] for r in rows}
            assert sum(sizes.values()) == rows[0]["n_valid"] == len(rows)
            assert rows[0]["n_valid"] + rows[0]["n_invalid"] == n
            for r in rows:
                assert r["semantic_prob"] == pytest.approx(r["cluster_size"] / r["n_valid"])
                assert r["in_largest"] == (r["cluster_size"] == max(sizes.values()))


@pytest.mark.parametrize("label_length_cut, labelled", [(True, [0, 1, 3]), (False, [0, 3])])
def test_length_cut_samples_are_labelled_unless_switched_off(label_length_cut, labelled):
    group = {
        "prefix_id": "p",
        "question_id": "q",
        "role": "draft",
        "sample_idx": [0, 1, 2, 3],
        "text": ["abc", "abc def ghi", "  ", "abd"],
        "finish_reason": ["delimiter", "length", "eos", "delimiter"],
    }
    rows = label_prefix(_judge(), group, ClusterConfig(label_length_cut=label_length_cut))
    assert [r["sample_idx"] for r in rows] == labelled
    assert all(r["n_valid"] == len(labelled) and r["n_invalid"] == 4 - len(labelled) for r in rows)
    assert [r["semantic_prob"] for r in rows if r["sample_idx"] != 1] == [2 / len(labelled)] * 2


def test_noise_injection_moves_the_requested_share():
    import random

    ids = [0] * 10 + [1] * 10
    noisy = inject_noise(ids, 0.2, random.Random(0))
    assert sum(a != b for a, b in zip(ids, noisy, strict=True)) == 4
    assert inject_noise([0, 0, 0, 0], 0.5, random.Random(0)).count(1) == 2  # one cluster: moved to a new one


def test_split_by_question_never_shares_a_question():
    q = np.array([f"q{i % 10}" for i in range(200)])
    m = split_by_question(q, 0.2, 0.2, seed=0)
    assert (m["train"].astype(int) + m["val"] + m["test"] == 1).all()
    sets = {k: set(q[v]) for k, v in m.items()}
    assert (
        not sets["train"] & sets["test"]
        and not sets["train"] & sets["val"]
        and not sets["val"] & sets["test"]
    )
    assert len(sets["test"]) == 2 and len(sets["val"]) == 2
    with pytest.raises(ValueError, match="at least 3"):
        split_by_question(np.array(["a", "b"]), 0.2, 0.2, 0)


@pytest.fixture(scope="module")
def trained(stages, tmp_path_factory):
    """Train all 8 probes into a private MLflow store, tagged with the pipeline fingerprint."""
    from semspec.tasks.fingerprint import pipeline_fingerprint
    from semspec.tasks.train import run_train

    tmp = stages["tmp"]
    env = {
        "MLFLOW_TRACKING_URI": f"sqlite:///{tmp}/mlruns.db",
        "SEMSPEC_MLFLOW_ARTIFACTS": str(tmp / "mlartifacts"),
    }
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        res = run_train(
            stages["params"].train,
            stages["pair"],
            tmp / "samples",
            tmp / "labels",
            tmp / "probes",
            tmp / "metrics.json",
            tmp / "plots",
            None,
            pipeline_fingerprint(stages["params"], stages["pair"]),
            tmp / "cross",
        )
        yield res
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def test_train_registers_eight_champion_probes(stages, trained):
    import mlflow

    tmp = stages["tmp"]
    assert set(trained) == {"draft", "target", "_routing"}
    for role in ("draft", "target"):
        assert set(trained[role]) == {"last", "all", "mix", "random"}
        for m in trained[role].values():
            assert {"mse", "mae", "spearman", "brier", "ece", "auroc"} <= set(m)
    assert (
        json.loads((tmp / "metrics.json").read_text())["draft"]["all"]["mse"]
        == trained["draft"]["all"]["mse"]
    )
    assert len(list((tmp / "plots").glob("calibration-*.png"))) == 8
    client = mlflow.MlflowClient(f"sqlite:///{tmp}/mlruns.db")
    for role, d in (("draft", 32), ("target", 64)):
        for v in ("last", "all", "mix", "random"):
            mv = client.get_model_version_by_alias(f"semspec-tiny-{role}-{v}", "champion")
            assert mv.tags["model_id"] == f"tiny-{role}" and mv.tags["hidden_size"] == str(d)
            assert mv.tags["variant"] == v and mv.tags["pair"] == "tiny" and mv.tags["git_commit"]
            assert mv.tags["samples_hash"].startswith(("md5:", "dvc:"))
            run = client.get_run(mv.run_id)  # version tags use the run's param names and values
            for key in ("variant", "feature", "samples_hash", "labels_hash", "domain"):
                assert mv.tags[key] == run.data.params[key], key
            assert float(mv.tags["test_mse"]) == pytest.approx(trained[role][v]["mse"], rel=1e-3)
            desc = client.get_registered_model(f"semspec-tiny-{role}-{v}").description
            assert f"role {role} (tiny-{role})" in desc and "semantic probability" in desc
    everything = mlflow.search_runs(experiment_names=["semspec-tiny"])  # the fixture points MLflow at tmp
    (parent,) = everything[everything["tags.stage"] == "train-summary"]["run_id"]
    runs = everything[everything["tags.stage"] == "train"]
    assert len(runs) == 8 and runs["metrics.test_mse"].notna().all()
    assert (runs["tags.mlflow.parentRunId"] == parent).all(), "the probes nest under one train run"
    assert [a.path for a in client.list_artifacts(parent)] == ["probe-variants.png"]
    assert (tmp / "plots" / "probe-variants.png").is_file()
    trained_runs = runs[runs["tags.variant"] != "random"]
    assert trained_runs["metrics.val_mse"].notna().all(), "per-epoch validation MSE must be logged"
    assert trained_runs["metrics.train_mse"].notna().all(), "per-epoch training MSE must be logged"
    history = client.get_metric_history(trained_runs["run_id"].iloc[0], "val_mse")
    assert len(history) > 1 and [h.step for h in history] == sorted(h.step for h in history)


def test_per_domain_probes_train_register_and_load(stages, tmp_path, monkeypatch):
    """train.domains [math, science]: one probe per (role, variant, domain) on that domain's questions only,
    registered as semspec-<pair>-<role>-<variant>-<domain>, recorded as <variant>@<domain>, loadable by
    evaluation's probe_domain; an absent domain fails before any fit, naming the domains present."""
    import mlflow
    import pyarrow as pa

    from semspec.tasks.config import TrainConfig
    from semspec.tasks.decoders import probe_fn
    from semspec.tasks.probe_registry import read_pointers
    from semspec.tasks.train import run_train

    src = stages["tmp"]
    labels = tmp_path / "labels"
    labels.mkdir()
    per_role = [
        {r["question_id"] for r in pq.read_table(src / "labels" / f"{role}.parquet").to_pylist()}
        for role in ("draft", "target")
    ]
    qids = sorted(per_role[0] & per_role[1])
    assert len(qids) >= 6, per_role
    science = set(qids[:3])
    for role in ("draft", "target"):
        t = pq.read_table(src / "labels" / f"{role}.parquet")
        assert set(t.column("domain").to_pylist()) == {"math"}  # cluster keeps the question's domain
        dom = ["science" if q in science else "math" for q in t.column("question_id").to_pylist()]
        pq.write_table(
            t.set_column(t.schema.get_field_index("domain"), "domain", pa.array(dom)),
            labels / f"{role}.parquet",
        )
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlruns.db")
    monkeypatch.setenv("SEMSPEC_MLFLOW_ARTIFACTS", str(tmp_path / "mlartifacts"))
    cfg = TrainConfig(variants=["all", "random"], domains=["math", "science"], max_epochs=2, batch_size=16)
    args = (
        stages["pair"],
        src / "samples",
        labels,
        tmp_path / "probes",
        tmp_path / "m.json",
        tmp_path / "plots",
    )
    with pytest.raises(ValueError, match=r"domain 'physics'.*\['math', 'science'\]"):
        run_train(TrainConfig(variants=["random"], domains=["physics"]), *args)
    res = run_train(cfg, *args)
    assert set(res["draft"]) == {"all@math", "all@science", "random@math", "random@science"}
    pins = read_pointers(tmp_path / "probes")
    assert set(pins) == {f"{r}-{k}" for r in ("draft", "target") for k in res["draft"]}
    client = mlflow.MlflowClient()
    mv = client.get_model_version_by_alias("semspec-tiny-target-all-science", "champion")
    assert mv.tags["domain"] == "science" and mv.tags["variant"] == "all"
    runs = mlflow.search_runs(experiment_names=["semspec-tiny"])
    runs = runs[runs["tags.role"] == "draft"]
    per_domain = runs.groupby("params.domain")[["params.n_train", "params.n_val", "params.n_test"]].first()
    rows = pq.read_table(labels / "draft.parquet").to_pylist()
    for domain in ("math", "science"):
        n = sum(int(per_domain.loc[domain, f"params.n_{k}"]) for k in ("train", "val", "test"))
        assert n == sum(r["domain"] == domain for r in rows)  # that domain's samples, no other
    lm = load_lm(stages["pair"].role("draft"))
    fn, sha = probe_fn("tiny", "draft", "all@math", lm, pins["draft-all@math"])
    from semspec.models.lm import Pooled

    assert 0.0 <= fn(Pooled(torch.randn(lm.num_layers + 1, lm.hidden_size))) <= 1.0
    assert (
        sha == client.get_model_version("semspec-tiny-draft-all-math", pins["draft-all@math"]).tags["sha256"]
    )
    p = load_params(
        profile="tiny", overrides=["evaluate.probe_domain=science", "evaluate.probe_variants=[all]"]
    )
    assert "semanticspec-all@science" in p.evaluate.method_labels()


def test_registry_round_trip_and_mismatch(stages, trained):
    from semspec.models.lm import Pooled
    from semspec.models.spec.probe import probe_probability
    from semspec.tasks.probe_registry import load_probe, read_pointers

    probe, ref = load_probe("tiny", "target", "mix", "tiny-target", 64)
    pooled = Pooled(torch.randn(3, 64))
    assert 0 < probe_probability(probe, pooled) < 1
    pointers = json.loads((stages["tmp"] / "probes" / "probes.json").read_text())["probes"]
    assert len(pointers) == 8 and pointers["target-mix"]["sha256"] == ref.sha256
    assert read_pointers(stages["tmp"] / "probes")["target-mix"] == ref.version  # DVC out -> registry
    assert not list((stages["tmp"] / "probes").glob("*.pt")), "weights live in one store, MLflow"
    pinned, pinned_ref = load_probe("tiny", "target", "mix", "tiny-target", 64, version=ref.version)
    assert pinned_ref == ref and torch.equal(pinned(pooled.h_layers[None]), probe(pooled.h_layers[None]))
    with pytest.raises(ValueError, match="trained on 'tiny-target', not on 'other-model'"):
        load_probe("tiny", "target", "all", "other-model", 64)
    with pytest.raises(ValueError, match="expects hidden size 64, the model has 640"):
        load_probe("tiny", "target", "all", "tiny-target", 640)
    with pytest.raises(ValueError, match="pooled by 'predict', the pair pools by 'tokens': retrain"):
        load_probe("tiny", "target", "all", "tiny-target", 64, pooling="tokens")
    # probes are per format: these read float32 models (the tiny pair's dtype), and are refused for int8
    assert load_probe("tiny", "target", "all", "tiny-target", 64, fmt="float32")[1].version
    with pytest.raises(ValueError, match=r"run in float32, and the model runs in int8 here.*retrain"):
        load_probe("tiny", "target", "all", "tiny-target", 64, fmt="int8")
    with pytest.raises(
        ValueError, match=r"no registered probe semspec-nope-draft-all@champion.*semspec train"
    ):
        load_probe("nope", "draft", "all", "x", 1)


def test_a_tampered_registered_probe_fails_cleanly(stages, trained):
    from semspec.tasks.probe_registry import load_probe

    _, ref = load_probe("tiny", "draft", "last", "tiny-draft", 32)
    stored = Path(ref.source.removeprefix("file://")) / "probe.safetensors"
    original = stored.read_bytes()
    try:
        stored.write_bytes(original[:-4] + b"\x00\x00\x00\x00")
        with pytest.raises(
            ValueError, match=r"semspec-tiny-draft-last v\d+.*does not match its recorded sha256"
        ):
            load_probe("tiny", "draft", "last", "tiny-draft", 32)
    finally:
        stored.write_bytes(original)


def test_an_old_pickle_format_version_is_refused_with_how_to_retrain(stages, trained):
    import mlflow
    from torch import nn

    from semspec.tasks.probe_registry import load_probe

    client = mlflow.MlflowClient()
    name = "semspec-tiny-draft-all"
    with mlflow.start_run(run_name="old-format"):
        info = mlflow.pytorch.log_model(nn.Linear(32, 1), name="probe", serialization_format="pickle")
    mv = client.create_model_version(
        name, info.model_uri, tags={"model_id": "tiny-draft", "hidden_size": "32"}
    )
    with pytest.raises(ValueError, match=r"pickle-format probe.*retrain"):
        load_probe("tiny", "draft", "all", "tiny-draft", 32, version=mv.version)
    client.delete_model_version(name, mv.version)


def test_sample_stage_through_ray_actors(tmp_path):
    pair = write_tiny_pair(tmp_path, max_step_tokens=4)
    p = load_params(profile="tiny", overrides=["sample.executor=ray", "ingest.max_questions=4", "sample.n=3"])
    prefixes = run_ingest(p.ingest, pair, tmp_path / "prefixes.parquet")
    run_sample(p.sample, pair, prefixes, tmp_path / "samples")
    for role in ("draft", "target"):
        t = read_shards(tmp_path / "samples" / role)
        assert t.num_rows == 4 * 3 and set(t.column("model_id").to_pylist()) == {f"tiny-{role}"}


def test_samples_of_other_feature_code_or_format_are_made_again(tmp_path, monkeypatch):
    """A resumed sample stage keeps shards only when the code that computed their features and the format
    the model ran in are the same: hidden states of two versions are not alike."""
    import semspec.tasks.sample as sample_module

    pair = write_tiny_pair(tmp_path, max_step_tokens=4)
    p = load_params(
        profile="tiny", overrides=["sample.executor=local", "ingest.max_questions=2", "sample.n=2"]
    )
    prefixes = run_ingest(p.ingest, pair, tmp_path / "prefixes.parquet")
    run_sample(p.sample, pair, prefixes, tmp_path / "samples")
    shards = sorted((tmp_path / "samples" / "draft").glob("part-*.parquet"))
    t = read_shards(tmp_path / "samples" / "draft")
    assert set(t.column("format").to_pylist()) == {"float32"}, "each row says what its model ran in"
    stamp = {f: f.stat().st_mtime_ns for f in shards}
    run_sample(p.sample, pair, prefixes, tmp_path / "samples")
    assert {f: f.stat().st_mtime_ns for f in shards} == stamp, "same code and format: resumed, kept"
    monkeypatch.setattr(sample_module, "source_md5", lambda *mods: "other code")
    run_sample(p.sample, pair, prefixes, tmp_path / "samples")
    assert all(f.stat().st_mtime_ns != stamp.get(f) for f in (tmp_path / "samples" / "draft").glob("part-*"))


SAMPLE_SCRIPT = """
import sys
from pathlib import Path
from semspec.models.project.pairs import load_pair
from semspec.tasks.config import load_params
from semspec.tasks.sample import run_sample
tmp = Path(sys.argv[1])
p = load_params(profile="tiny", overrides=["sample.executor=local", "sample.batch_prefixes=1", "sample.n=16",
                                           "sample.max_step_tokens=48"])
run_sample(p.sample, load_pair(tmp / "tiny.yaml"), tmp / "prefixes.parquet", tmp / "samples")
"""


@pytest.mark.reliability
def test_sample_resumes_after_a_kill(tmp_path, observed):
    pair = write_tiny_pair(tmp_path, draft_hidden=128, target_hidden=128, layers=4)
    p = load_params(profile="tiny", overrides=["ingest.max_questions=8"])
    run_ingest(p.ingest, pair, tmp_path / "prefixes.parquet")
    shards = tmp_path / "samples" / "draft"
    kill_mid_run(SAMPLE_SCRIPT, tmp_path, lambda: len(list(shards.glob("part-*.parquet"))) >= 2, 120)
    before = {f.name: f.stat().st_mtime_ns for f in shards.glob("part-*.parquet")}
    assert 2 <= len(before) < 8, f"the kill should land mid-stage, found {len(before)} shards"
    # rerun in-process: only the missing prefixes are sampled, finished shards are not rewritten
    p2 = load_params(
        profile="tiny",
        overrides=[
            "sample.executor=local",
            "sample.batch_prefixes=1",
            "sample.n=16",
            "sample.max_step_tokens=48",
        ],
    )
    run_sample(p2.sample, pair, tmp_path / "prefixes.parquet", tmp_path / "samples")
    after = {f.name: f.stat().st_mtime_ns for f in shards.glob("part-*.parquet")}
    assert all(after[k] == v for k, v in before.items())
    for role in ("draft", "target"):
        t = read_shards(tmp_path / "samples" / role, columns=["prefix_id", "sample_idx"]).to_pylist()
        assert len(t) == 8 * 16 and len({(r["prefix_id"], r["sample_idx"]) for r in t}) == len(t)
    assert not list(shards.glob("*.tmp")), "no temp file may survive"
    observed(
        f"sample SIGKILLed with {len(before)} of 8 draft shards written; the rerun left them untouched and "
        f"wrote {len(after) - len(before)}; {len(t)} rows per role, no duplicate"
    )


def test_semanticspec_decoder_uses_the_registered_probes(stages, trained):
    from semspec.models.spec.settings import DecodeSettings
    from semspec.tasks.decoders import build_decoder

    pair = stages["pair"]
    lms = {r: load_lm(pair.role(r)) for r in ("draft", "target")}
    settings = DecodeSettings(max_new_tokens=16, step_tokens=4)
    for variant in ("random", "all", "mix"):
        res = build_decoder("semanticspec", pair, lms, settings, variant).decode("What is 1 + 1?")
        assert res.output_tokens > 0 and all(
            (0 <= s.p <= 1 and 0 < s.q < 1) or variant == "random" for s in res.steps
        )
    with pytest.raises(ValueError, match="unknown probe variant"):
        build_decoder("semanticspec", pair, lms, settings, "best")
    with pytest.raises(ValueError, match="unknown method"):
        build_decoder("beam", pair, lms, settings)


def test_evaluate_writes_rows_metrics_and_plots(stages, trained):
    from semspec.tasks.evaluate import run_evaluate

    tmp = stages["tmp"]
    pair = stages["pair"]
    cfg = load_params(
        profile="tiny", overrides=["evaluate.benchmarks={arith: 2}", "evaluate.seeds=[0, 1]"]
    ).evaluate
    lms = {r: load_lm(pair.role(r)) for r in ("draft", "target")}

    import mlflow

    from semspec.tasks.evaluate.tracking import LiveRuns

    seen, real_done = [], LiveRuns.problem_done

    def watched(self, label, correct):  # while decoding: the method's run is open and shows progress
        real_done(self, label, correct)
        run = mlflow.MlflowClient().get_run(self.methods[label])
        seen.append((label, run.info.status, run.data.metrics.get("problems_decoded"), time.time() * 1000))

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(LiveRuns, "problem_done", watched)
        res = run_evaluate(cfg, pair, tmp / "eval", tmp / "eval_plots", lms=lms)
    labels = ["target", "draft", "semanticspec-random", "semanticspec-all"]
    assert len(seen) == 4 * len(labels) and {status for _, status, _, _ in seen} == {"RUNNING"}
    assert sorted(n for label, _, n, _ in seen if label == "target") == [1, 2, 3, 4]
    assert list(res["arith"]) == labels
    for label in labels:
        rows = [
            json.loads(line) for line in (tmp / "eval" / "arith" / f"{label}.jsonl").read_text().splitlines()
        ]
        assert len(rows) == 2 * 2 and {r["seed"] for r in rows} == {0, 1}
        m = res["arith"][label]
        assert m["pass@1"] == pytest.approx(sum(r["correct"] for r in rows) / 4)
        assert m["n"] == 4 and m["tps"] > 0
    assert res["arith"]["target"]["speedup_latency"] == pytest.approx(1.0)
    assert res["arith"]["target"]["speedup_per_token"] == pytest.approx(1.0)
    assert res["arith"]["target"]["target_share"] == 1.0 and res["arith"]["draft"]["target_share"] == 0.0
    assert json.loads((tmp / "eval" / "metrics.json").read_text()) == json.loads(json.dumps(res))
    assert {p.name for p in (tmp / "eval_plots").glob("*.png")} == {
        "pass_vs_latency-arith.png",
        "tps.png",
        "acceptance_vs_ratio.png",
    }

    runs = mlflow.search_runs(experiment_names=["semspec-tiny"], filter_string="tags.stage = 'evaluate'")
    assert sorted(runs["tags.mlflow.runName"]) == sorted(f"eval-{x}" for x in labels)
    assert runs["metrics.arith_pass_at_1"].notna().all() and runs["metrics.arith_tps"].notna().all()
    parents = mlflow.search_runs(
        experiment_names=["semspec-tiny"], filter_string="tags.stage = 'evaluate-summary'"
    )
    parent = parents["run_id"].iloc[0]  # the latest evaluation: its methods nest under it, plots once
    assert set(runs["tags.mlflow.parentRunId"]) == {parent}
    for frame in (runs, parents):  # the UI's Source and User columns, as for the fluent train runs
        assert frame["tags.mlflow.source.name"].notna().all() and frame["tags.mlflow.user"].notna().all()
    client = mlflow.MlflowClient()
    assert sorted(a.path for a in client.list_artifacts(parent, "plots")) == sorted(
        f"plots/{p}" for p in ("pass_vs_latency-arith.png", "tps.png", "acceptance_vs_ratio.png")
    )
    assert all(not client.list_artifacts(r) for r in runs["run_id"]), "no plot copied into each method run"
    # each run lasts from before its first problem to after its last, and is finished
    for label, run_id in zip(runs["tags.mlflow.runName"], runs["run_id"], strict=True):
        info = client.get_run(run_id).info
        times = [t for lab, _, _, t in seen if f"eval-{lab}" == label]
        assert info.status == "FINISHED" and info.start_time <= min(times) <= max(times) <= info.end_time
        assert [m.value for m in client.get_metric_history(run_id, "problems_decoded")] == [1, 2, 3, 4]


def test_an_evaluation_that_fails_marks_its_mlflow_runs_failed(stages, trained, monkeypatch):
    import mlflow

    import semspec.tasks.evaluate as E

    def broken(*args, **kw):
        raise RuntimeError("decoding broke")

    monkeypatch.setattr(E, "_decode_missing", broken)
    pair = stages["pair"]
    cfg = load_params(profile="tiny", overrides=["evaluate.benchmarks={arith: 1}"]).evaluate
    lms = {r: load_lm(pair.role(r)) for r in ("draft", "target")}
    t0 = int(time.time() * 1000)
    with pytest.raises(RuntimeError, match="decoding broke"):
        E.run_evaluate(cfg, pair, stages["tmp"] / "eval-broken", lms=lms)
    runs = mlflow.search_runs(
        experiment_names=["semspec-tiny"], filter_string=f"attributes.start_time >= {t0}"
    )
    assert len(runs) == 1 + len(cfg.method_labels()) and set(runs["status"]) == {"FAILED"}


def test_random_probes_of_the_two_roles_draw_different_numbers(stages, trained):
    from semspec.models.lm import Pooled
    from semspec.models.spec.probe import probe_probability
    from semspec.tasks.probe_registry import load_probe

    q, _ = load_probe("tiny", "draft", "random", "tiny-draft", 32)
    p, _ = load_probe("tiny", "target", "random", "tiny-target", 64)
    qs = [probe_probability(q, Pooled(torch.zeros(3, 32))) for _ in range(20)]
    ps = [probe_probability(p, Pooled(torch.zeros(3, 64))) for _ in range(20)]
    assert qs != ps, "p == q would accept every step: the Random ablation must draw independently"
    ratios = [min(1.0, a / b) for a, b in zip(ps, qs, strict=True)]
    assert 0.4 < sum(ratios) / len(ratios) < 0.95


def test_ingest_has_the_target_write_missing_traces(tmp_path):
    from semspec.tasks.ingest import write_trace
    from tests.helpers.tiny import tiny_lm

    target = tiny_lm(boost=2.0, max_step_tokens=6)
    trace = write_trace(target, "What is 2+2?", max_tokens=20)
    assert trace and len(target.tokenizer(trace, add_special_tokens=False)["input_ids"]) <= 24
    (tmp_path / "s1k").mkdir()
    (tmp_path / "s1k" / "train.jsonl").write_text(
        json.dumps({"question": "What is 2+2?", "solution": "4"})
        + "\n"
        + json.dumps({"question": "What is 3+3?", "solution": "6"})
        + "\n"
    )
    pair = write_tiny_pair(tmp_path / "pair")
    p = load_params(
        overrides=[
            "ingest.source=s1k",
            "ingest.generate_traces=true",
            "ingest.trace_max_tokens=16",
            f"ingest.data_dir={tmp_path}",
            "ingest.max_prefixes_per_question=50",
        ]
    )
    out = run_ingest(p.ingest, pair, tmp_path / "prefixes.parquet", writer=target)
    rows = pq.read_table(out).to_pylist()
    assert {r["question_id"] for r in rows} == {"s1k-1", "s1k-2"}
    assert all(r["domain"] == "unknown" for r in rows)


def chains_of(trace):
    """A stand-in for ``ingest.write_chains`` (the batched writer) that writes each chain with ``trace``."""

    def chains(lm, role, questions, max_tokens, keep):
        for i, q in enumerate(questions):
            keep(i, trace(lm, q, max_tokens))

    return chains


def test_ingest_can_have_the_draft_write_every_trace(tmp_path, monkeypatch):
    """``trace_author: draft``: the draft writes each question's chain, in place of the data's, so the
    prefixes are contexts the draft wrote; a chain it leaves empty drops the question (the data's
    solution does not stand in); a bad value names the field."""
    from semspec.tasks import ingest, traces

    pair = write_tiny_pair(tmp_path / "pair")
    loaded, draft = [], object()

    def load(model_cfg):
        loaded.append(model_cfg.model_id)
        return draft

    def trace(lm, question: str, max_tokens: int) -> str:
        assert lm is draft and max_tokens == 16
        return "" if "Omar" in question else f"Draft one ({question[:8]}).\n\nDraft two.\n\nDraft three."

    monkeypatch.setattr(ingest, "load_lm", load)
    monkeypatch.setattr(ingest, "write_trace", trace)
    monkeypatch.setattr(traces, "write_chains", chains_of(trace))
    base = ["ingest.max_questions=6", "ingest.max_prefixes_per_question=50", "ingest.trace_max_tokens=16"]
    own = pq.read_table(run_ingest(load_params(overrides=base).ingest, pair, tmp_path / "a.parquet"))
    assert loaded == [], "the data's traces need no model"
    p = load_params(overrides=[*base, "ingest.trace_author=draft"])
    rows = pq.read_table(run_ingest(p.ingest, pair, tmp_path / "b.parquet")).to_pylist()
    assert loaded == [pair.draft.model_id], "the draft, loaded once"
    omar = {r["question_id"] for r in own.to_pylist() if "Omar" in r["question"]}
    assert {r["question_id"] for r in rows} == set(own.column("question_id").to_pylist()) - omar
    for r in rows:  # k = 0, 1, 2 draft steps of the question's own chain
        chain = trace(draft, r["question"], 16)
        assert r["context"] == "\n\n".join([*chain.split("\n\n")[: r["step_index"]], ""])
    assert {r["step_index"] for r in rows} == {0, 1, 2}
    with pytest.raises(ValueError, match="field 'trace_author'"):
        load_params(overrides=["ingest.trace_author=judge"])


def test_ingest_mixes_contexts_from_several_trace_authors(tmp_path, monkeypatch):
    """``trace_author: [data, draft]``: every question gives prefixes of its data chain and of the draft's
    chain, the data's with the ids a single author gives them and the draft's with ids of their own; a
    repeated author is an error naming the field."""
    from semspec.tasks import ingest, traces

    pair = write_tiny_pair(tmp_path / "pair")
    monkeypatch.setattr(ingest, "load_lm", lambda model_cfg: model_cfg.model_id)
    monkeypatch.setattr(ingest, "write_trace", lambda lm, q, n: f"Draft one.\n\nDraft two ({q[:6]}).")
    monkeypatch.setattr(traces, "write_chains", chains_of(ingest.write_trace))
    base = ["ingest.max_questions=4", "ingest.max_prefixes_per_question=50", "ingest.trace_max_tokens=16"]
    data = pq.read_table(run_ingest(load_params(overrides=base).ingest, pair, tmp_path / "a.parquet"))
    p = load_params(overrides=[*base, "ingest.trace_author=[data, draft]"])
    rows = pq.read_table(run_ingest(p.ingest, pair, tmp_path / "b.parquet")).to_pylist()
    ids = [r["prefix_id"] for r in rows]
    assert len(set(ids)) == len(ids)
    data_rows = [r for r in rows if "Draft one." not in r["context"] and r["step_index"] > 0]
    draft_rows = [r for r in rows if r["context"].startswith("Draft one.")]
    assert set(data.column("prefix_id").to_pylist()) <= set(ids), "the data chain's prefixes, ids unchanged"
    # plus k = 1 of each question's draft chain; its k = 0 (the question alone) is the data chain's
    assert len(rows) == data.num_rows + 4
    assert data_rows and {r["step_index"] for r in draft_rows} == {1}
    assert sum(r["context"] == "" for r in rows) == 4, "one prefix of the question alone per question"
    with pytest.raises(ValueError, match="field 'trace_author'"):
        load_params(overrides=["ingest.trace_author=[draft, draft]"])


def test_ingest_cuts_contexts_from_the_semanticspec_decoders_own_chains(tmp_path, monkeypatch):
    """``trace_author: semanticspec``: the chains are what the SemanticSpec decoder writes (greedy, within
    ``trace_max_tokens``, the champion ``all`` probes), built once for every question; a pair without
    registered probes is an error that says so."""
    from semspec.models.spec.results import DecodeResult
    from semspec.tasks import ingest

    pair = write_tiny_pair(tmp_path / "pair")
    monkeypatch.setattr(ingest, "load_lm", lambda model_cfg: model_cfg.model_id)
    built = []

    class Decoder:
        def decode(self, question):
            return DecodeResult(
                "semanticspec-all", f"Spec one ({question[:6]}).\n\nSpec two.\n\nSpec three.", None
            )

    def build(method, pair_, lms, settings, variant):
        built.append((method, sorted(lms.values()), settings.max_new_tokens, settings.temperature, variant))
        return Decoder()

    monkeypatch.setattr(ingest, "build_decoder", build)
    base = ["ingest.max_questions=4", "ingest.max_prefixes_per_question=50", "ingest.trace_max_tokens=24"]
    p = load_params(overrides=[*base, "ingest.trace_author=semanticspec"])
    rows = pq.read_table(run_ingest(p.ingest, pair, tmp_path / "a.parquet")).to_pylist()
    assert built == [("semanticspec", sorted([pair.draft.model_id, pair.target.model_id]), 24, 0.0, "all")]
    assert len(rows) == 3 * 4 and {r["step_index"] for r in rows} == {0, 1, 2}
    assert all(r["context"].startswith(f"Spec one ({r['question'][:6]}).") for r in rows if r["step_index"])

    def unregistered(*args):
        raise ValueError("no registered probe semspec-tiny-target-all@champion")

    monkeypatch.setattr(ingest, "build_decoder", unregistered)
    with pytest.raises(
        ValueError, match="trace_author 'semanticspec' decodes with the pair's registered probes"
    ):
        run_ingest(p.ingest, pair, tmp_path / "b.parquet")


def test_sentence_split_reaches_ingest_sampling_and_labels(tmp_path):
    """``split_strategy: sentence`` is one setting every stage reads: ingest's contexts are whole sentences
    joined by a space (more steps than paragraphs), the models end their samples at sentence ends, and
    the labels cover those samples."""
    from semspec.models.project.pairs import load_pair
    from semspec.models.spec.steps import split_steps

    write_tiny_pair(tmp_path)
    pair = load_pair(tmp_path / "tiny.yaml", split_strategy="sentence")
    assert pair.draft.split == pair.target.split == "sentence"
    p = load_params(
        profile="tiny",
        overrides=[*OVERRIDES, "split_strategy=sentence", "sample.max_step_tokens=30", "sample.n=4"],
    )
    assert p.split_strategy == "sentence"
    prefixes = run_ingest(p.ingest, pair, tmp_path / "prefixes.parquet")
    rows = pq.read_table(prefixes).to_pylist()
    assert max(r["step_index"] for r in rows) >= 4  # a paragraph of two sentences gives two steps
    for r in rows:
        assert r["context"] == "" or r["context"].endswith(". ")
        assert len(split_steps(r["context"], "sentence")) == r["step_index"]
    lms = {}
    for role in ("draft", "target"):
        lms[role] = load_lm(pair.role(role))
        tok = lms[role].tokenizer
        boost_tokens(lms[role].model, tok.convert_tokens_to_ids([".", " "]), 3.0)
    run_sample(p.sample, pair, prefixes, tmp_path / "samples", lms=lms)
    samples = read_shards(tmp_path / "samples" / "draft").to_pylist()
    ended = [s for s in samples if s["finish_reason"] == "delimiter"]
    assert ended, "boosted '.' and ' ' must end some samples at a sentence end"
    for s in ended:
        assert s["text"].rstrip()[-1] in ".!?" and split_steps(s["text"], "sentence") == [s["text"].strip()]
    run_cluster(p.cluster, pair, tmp_path / "samples", tmp_path / "labels", prefixes, judge=_judge())
    labels = pq.read_table(tmp_path / "labels" / "draft.parquet").to_pylist()
    assert {r["prefix_id"] for r in labels} == {r["prefix_id"] for r in rows}


ALL_ROLES, ALL_VARIANTS = ["draft", "target"], ["last", "all", "mix", "random"]


def test_champion_status_tracks_config_and_data(stages, trained, monkeypatch):
    from semspec.tasks.fingerprint import pipeline_fingerprint
    from semspec.tasks.retrain import champion_status

    pair, params = stages["pair"], stages["params"]
    fp = pipeline_fingerprint(params, pair)
    assert champion_status("tiny", ALL_ROLES, ALL_VARIANTS, fp) is None
    same = load_params(
        profile="tiny", overrides=[*OVERRIDES, "sample.batch_prefixes=7", "ingest.data_dir=/x"]
    )
    assert pipeline_fingerprint(same, pair) == fp  # execution details do not count
    more = load_params(profile="tiny", overrides=[*OVERRIDES, "sample.n=8"])
    why = champion_status("tiny", ALL_ROLES, ALL_VARIANTS, pipeline_fingerprint(more, pair))
    assert why.startswith("config changed: semspec-tiny-draft-last")
    why = champion_status("tiny", ALL_ROLES, ALL_VARIANTS, {**fp, "source_hash": "md5:0"})
    assert why.startswith("data changed")
    # the same pair file on a machine where its `dtype: auto` resolves to another format: probes are per
    # format, so the retrain trains them again there
    auto = dataclasses.replace(
        pair,
        draft=dataclasses.replace(pair.draft, dtype="auto"),
        target=dataclasses.replace(pair.target, dtype="auto"),
    )
    from semspec.models.cpu import formats

    monkeypatch.setattr(formats, "cpu_info", lambda: formats.CpuInfo("AVX2", frozenset({"avx2"})))
    avx2 = pipeline_fingerprint(params, auto)
    monkeypatch.setattr(formats, "cpu_info", lambda: formats.CpuInfo("AVX512", frozenset({"amx_bf16"})))
    assert pipeline_fingerprint(params, auto) == avx2, "both resolve auto to int8"
    monkeypatch.setattr(
        "semspec.tasks.fingerprint.resolve_format", lambda *a: formats.Format("bfloat16", torch.bfloat16)
    )
    assert pipeline_fingerprint(params, auto) != avx2, "another format is another config"
    assert (
        champion_status("other", ALL_ROLES, ALL_VARIANTS, fp) == "no champion probe semspec-other-draft-last"
    )


def test_pair_statuses_covers_every_pair_file(stages, trained, tmp_path, monkeypatch):
    from semspec.tasks.retrain import pair_statuses

    pairs = tmp_path / "conf" / "pairs"
    pairs.mkdir(parents=True)
    tiny = yaml.safe_load((stages["tmp"] / "tiny.yaml").read_text())
    (pairs / "tiny.yaml").write_text(yaml.safe_dump(tiny))  # the trained pair, moved: still up to date
    (pairs / "fresh.yaml").write_text(yaml.safe_dump({**tiny, "name": "fresh"}))
    gone = {**tiny, "name": "gone", "target": {**tiny["target"], "path": str(tmp_path / "missing")}}
    (pairs / "gone.yaml").write_text(yaml.safe_dump(gone))
    (pairs / "broken.yaml").write_text("name: broken\n")
    monkeypatch.setenv("SEMSPEC_PROJECT_DIR", str(tmp_path))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)  # the tiny pair's judge is a Hub id
    st = pair_statuses(stages["params"])
    assert sorted(st) == ["broken", "fresh", "gone", "tiny"]
    assert st["tiny"] is None
    assert st["fresh"] == "no champion probe semspec-fresh-draft-last"
    assert st["gone"].startswith("unavailable: local model folder") and "missing" in st["gone"]
    assert st["broken"].startswith("invalid:") and "missing field" in st["broken"]


def test_status_says_not_evaluated_until_an_evaluation_of_the_champions_finishes(stages, trained, tmp_path):
    """Probes registered but the evaluation failed (no metrics file: the stage writes it last), ran with
    other settings, or evaluated older champions: `pairs status` says so, and the retrain reruns only
    evaluate and the decode smoke; invalid and unavailable pairs are listed as skipped with the reason."""
    import semspec.tasks.evaluate as ev
    from semspec.flows.pipeline import retrain_plan
    from semspec.tasks.probe_registry import read_pointers
    from semspec.tasks.retrain import evaluation_status

    params, pair = stages["params"], stages["pair"]
    metrics = tmp_path / "eval_metrics.json"
    assert evaluation_status(params, pair, metrics).startswith("not evaluated: no finished evaluation")
    pins = read_pointers(stages["tmp"] / "probes")

    def failing(*a, **kw):
        raise RuntimeError("killed mid-evaluation")

    kw = {"probes": stages["tmp"] / "probes", "out": tmp_path / "eval", "plots": tmp_path / "plots"}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ev, "check_tracking", lambda: None)
        mp.setattr(ev, "run_evaluate", failing)
        with pytest.raises(RuntimeError):
            ev.stage(params=params, pair=pair, metrics=metrics, **kw)
        assert not metrics.exists()
        mp.setattr(ev, "run_evaluate", lambda *a, **k: {"arith": {}})
        ev.stage(params=params, pair=pair, metrics=metrics, **kw)
    assert json.loads(metrics.read_text())["_run"]["probes"] == dict(sorted(pins.items()))
    assert evaluation_status(params, pair, metrics) is None
    other = load_params(profile="tiny", overrides=[*OVERRIDES, "evaluate.decode.max_new_tokens=7"])
    assert "other settings (evaluate_hash)" in evaluation_status(other, pair, metrics)
    record = json.loads(metrics.read_text())
    record["_run"]["probes"]["target-all"] = "0"
    metrics.write_text(json.dumps(record))
    assert "semspec-tiny-target-all's champion" in evaluation_status(params, pair, metrics)

    statuses = {"a": None, "b": "not evaluated: x", "c": "config changed: y", "d": "unavailable: no GPU"}
    todo, skipped = retrain_plan(statuses, ["ingest", "sample", "train", "evaluate", "decode"])
    assert todo == {"b": ["evaluate", "decode"], "c": ["ingest", "sample", "train", "evaluate", "decode"]}
    assert skipped == {"d": "unavailable: no GPU"}


def test_mlflow_lost_mid_train_keeps_the_probes_and_registers_them_later(
    stages, tmp_path, monkeypatch, observed
):
    """MLflow goes away after two of four probes: every probe is still trained and tested, the other two
    are kept locally with what registering them needs, the error gives the one command; that command
    registers them (no retraining) and writes the stage's outputs."""
    import mlflow
    from mlflow.exceptions import MlflowException

    import semspec.tasks.train as T
    from semspec.tasks.config import TrainConfig
    from semspec.tasks.probe_registry import read_pointers
    from semspec.tasks.train import registry

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlruns.db")
    monkeypatch.setenv("SEMSPEC_MLFLOW_ARTIFACTS", str(tmp_path / "mlartifacts"))
    real, calls = registry.register_probe, []

    def flaky(*args, **kw):
        calls.append(args[3])
        if len(calls) > 2:
            raise MlflowException("API request to http://127.0.0.1:5000 failed: Connection refused")
        return real(*args, **kw)

    monkeypatch.setattr(registry, "register_probe", flaky)
    src, out = stages["tmp"], tmp_path / "probes"
    cfg = TrainConfig(variants=["all", "random"], max_epochs=2, batch_size=16)
    args = (stages["pair"], src / "samples", src / "labels", out, tmp_path / "m.json", tmp_path / "plots")
    with pytest.raises(ValueError, match=r"2 trained probe\(s\) are kept .*semspec register --pair tiny"):
        T.run_train(cfg, *args)
    assert len(calls) == 3, "no registration is tried once MLflow is gone"
    assert not (out / "probes.json").exists() and not (tmp_path / "m.json").exists()
    kept = json.loads((out / "pending.json").read_text())["pending"]
    assert [(p["role"], p["key"]) for p in kept] == [("target", "all"), ("target", "random")]
    assert all((Path(p["folder"]) / "probe.safetensors").is_file() for p in kept)

    monkeypatch.setattr(registry, "register_probe", real)
    metrics = registry.register_pending(out)
    pins = read_pointers(out)
    assert set(pins) == {"draft-all", "draft-random", "target-all", "target-random"}
    mv = mlflow.MlflowClient().get_model_version_by_alias("semspec-tiny-target-all", "champion")
    assert str(mv.version) == pins["target-all"] and mv.tags["variant"] == "all"
    assert float(mv.tags["test_mse"]) == pytest.approx(metrics["target"]["all"]["mse"], rel=1e-3)
    assert json.loads((tmp_path / "m.json").read_text())["target"]["random"]["registered_version"] >= 1
    assert not (out / "pending").exists() and not (out / "pending.json").exists()
    observed(
        f"MLflow lost after 2 of 4 registrations: all 4 probes trained and tested, {len(kept)} kept locally, "
        f"then `semspec register` registered them without retraining ({len(pins)} champions)"
    )


def test_the_pooling_study_repools_the_stored_steps_and_trains_both(stages):
    """benchmarks/pooling.py: prefilling a stored step after its prefix pools as sampling did
    (``predict``), the ``tokens`` features differ from those, and both are trained on every split."""
    from benchmarks.pooling import POOLINGS, role_data, study

    pair, tmp = stages["pair"], stages["tmp"]
    lm = load_lm(pair.role("target"))
    data, cos = role_data(lm, tmp, "target", ["all"])
    assert cos > 0.999, "prefill and generation pool the same positions"
    assert data["predict"].y.shape == data["tokens"].y.shape and len(data["predict"].y) > 0
    assert not np.allclose(data["predict"].x["all"], data["tokens"].x["all"])
    res = study(data, "target", ["all"], stages["params"].train, splits=2)
    for pooling in POOLINGS:
        mse = res["all"][pooling]["mse"]
        assert len(mse) == 2 and all(np.isfinite(mse))


def test_routing_metrics_on_hand_made_predictions():
    from semspec.tasks.train.metrics import routing_metrics

    shared = np.array([True, True, True, False, False])
    perfect = routing_metrics(np.array([0.9, 0.8, 0.9, 0.0, 0.1]), np.full(5, 0.5), shared)
    assert perfect["true_accept"] == 1.0 and perfect["false_accept"] == pytest.approx(0.1)
    assert perfect["auroc"] == 1.0 and (perfect["n_shared"], perfect["n_not_shared"]) == (3, 2)
    inverted = routing_metrics(np.array([0.0, 0.1, 0.0, 0.9, 0.8]), np.full(5, 0.5), shared)
    assert inverted["auroc"] == 0.0 and inverted["true_accept"] < inverted["false_accept"] == 1.0
    constant = routing_metrics(np.full(5, 0.3), np.full(5, 0.6), shared)
    assert constant["true_accept"] == constant["false_accept"] == pytest.approx(0.5)
    assert constant["auroc"] == 0.5, "a constant ratio cannot tell the two apart"
    one_side = routing_metrics(np.ones(2), np.ones(2), np.array([True, True]))
    assert (
        one_side["true_accept"] == 1.0 and np.isnan(one_side["false_accept"]) and np.isnan(one_side["auroc"])
    )
    assert routing_metrics(np.zeros(1), np.zeros(1), np.array([False]))["false_accept"] == 0.0
    # p alone ranks these perfectly; the draft's q (high on the shared ones) makes p/q rank them worse
    shared = np.array([True, True, False, False])
    m = routing_metrics(np.array([0.8, 0.7, 0.3, 0.2]), np.array([0.9, 0.9, 0.2, 0.9]), shared)
    assert m["auroc_p"] == 1.0 and m["auroc"] == 0.5
    p = np.array([0.8, 0.7, 0.3, 0.2])  # p/q 1.6, 1.4 (shared); 0.6, 0.4 (not)
    plain, floor = (routing_metrics(p, np.full(4, 0.5), shared, min_ratio=f) for f in (0.0, 1.0))
    assert plain["true_accept"] == floor["true_accept"] == 1.0
    assert plain["false_accept"] == pytest.approx(0.5) and floor["false_accept"] == 0.0, "refused below 1.0"


def test_the_min_ratio_is_the_floor_that_best_separates_the_steps():
    from semspec.tasks.train.metrics import choose_min_ratio

    shared = np.array([True, True, True, False, False, False])
    q = np.full(6, 0.5)
    # the not-shared steps reach p/q 1.0 and 0.8, the shared ones 1.6 to 1.2: a floor at 1.2 refuses them all
    p = np.array([0.8, 0.7, 0.6, 0.5, 0.4, 0.1])
    assert choose_min_ratio(p, q, shared) == pytest.approx(1.2)
    # separated already by min(1, p/q) (the not-shared ones near 0): no floor does better than 0
    assert choose_min_ratio(np.array([0.8, 0.7, 0.6, 0.0, 0.0, 0.0]), q, shared) == 0.0
    assert choose_min_ratio(p, q, np.ones(6, dtype=bool)) is None, "no side to refuse"


def test_the_min_p_is_the_floor_on_p_that_best_separates_the_steps():
    from semspec.tasks.train.metrics import choose_min_p, p_rule_rates

    shared = np.array([True, True, True, False, False, False])
    p = np.array([0.9, 0.6, 0.2, 0.3, 0.25, 0.05])  # a floor at 0.6 keeps 2 of 3 shared and no other
    assert choose_min_p(p, shared) == pytest.approx(0.6)
    rates = p_rule_rates(p, shared, 0.6)
    assert rates["true_accept_at_min_p"] == pytest.approx(2 / 3) and rates["false_accept_at_min_p"] == 0.0
    assert choose_min_p(np.array([0.9, 0.8, 0.7, 0.3, 0.2, 0.1]), shared) == pytest.approx(0.7)
    assert choose_min_p(p, np.zeros(6, dtype=bool)) is None, "no side to accept"


def test_gamma_auto_decodes_with_the_rounds_the_probes_acceptance_keeps(stages, trained):
    """The train run tags each trained variant's probes with the pair's step acceptance on the held-out
    steps; ``gamma: auto`` resolves to ``gamma_for`` that rate (Random: 1)."""
    import mlflow

    from semspec.models.spec.settings import DecodeSettings, gamma_for
    from semspec.tasks.decoders import build_decoder

    client = mlflow.MlflowClient(f"sqlite:///{stages['tmp']}/mlruns.db")
    routing = trained["_routing"]
    mv = client.get_model_version_by_alias("semspec-tiny-target-all", "champion")
    assert float(mv.tags["accept_rate"]) == pytest.approx(routing["all"]["accept_rate"], rel=1e-5)
    assert 0 <= routing["all"]["accept_rate"] <= 1
    auto = DecodeSettings(max_new_tokens=8, step_tokens=4, gamma="auto")
    pair, lms = stages["pair"], stages["lms"]
    dec = build_decoder("semanticspec", pair, lms, auto, "all")
    assert dec.settings.gamma == gamma_for(routing["all"]["accept_rate"])
    assert build_decoder("semanticspec", pair, lms, auto, "random").settings.gamma == 1


def test_min_ratio_auto_decodes_with_the_floor_the_train_run_chose(stages, trained):
    """The train run tags both probes of each variant with the ``min_ratio`` it chose on validation;
    ``min_ratio: auto`` resolves to that tag when the decoder is built (Random keeps the paper's rule),
    and a decoder handed an unresolved ``auto`` refuses it."""
    import mlflow

    from semspec.models.spec.semanticspec import SemanticSpecDecoder
    from semspec.models.spec.settings import DecodeSettings
    from semspec.tasks.decoders import build_decoder

    client = mlflow.MlflowClient(f"sqlite:///{stages['tmp']}/mlruns.db")
    routing = trained["_routing"]
    versions = {}
    for variant in ("last", "all", "mix"):
        for role in ("draft", "target"):
            mv = client.get_model_version_by_alias(f"semspec-tiny-{role}-{variant}", "champion")
            versions[role, variant] = mv
            for name in ("min_ratio", "min_p"):
                chosen, tag = routing[variant].get(name), mv.tags.get(name)
                assert (tag is None) == (chosen is None), (variant, role, name, tag, chosen)
                assert tag is None or float(tag) == pytest.approx(chosen, rel=1e-5)
    for role in ("draft", "target"):  # Random keeps the paper's rule: its probes carry no floor
        tags = client.get_model_version_by_alias(f"semspec-tiny-{role}-random", "champion").tags
        assert "min_ratio" not in tags and "min_p" not in tags
    pair, lms = stages["pair"], stages["lms"]
    auto = DecodeSettings(max_new_tokens=8, step_tokens=4, min_ratio="auto")
    mv = versions["target", "all"]
    client.set_model_version_tag(mv.name, mv.version, "min_ratio", "0.25")
    try:
        dec = build_decoder("semanticspec", pair, lms, auto, "all")
        assert dec.settings.min_ratio == 0.25 and dec.run_identity["min_ratio"] == 0.25
        client.delete_model_version_tag(mv.name, mv.version, "min_ratio")
        assert build_decoder("semanticspec", pair, lms, auto, "all").settings.min_ratio is None
    finally:
        if "min_ratio" in mv.tags:
            client.set_model_version_tag(mv.name, mv.version, "min_ratio", mv.tags["min_ratio"])
    assert build_decoder("semanticspec", pair, lms, auto, "random").settings.min_ratio is None
    assert "min_ratio" not in build_decoder("semanticspec", pair, lms, auto, "random").run_identity
    with pytest.raises(ValueError, match="resolve it"):
        SemanticSpecDecoder(lms["draft"], lms["target"], dec.q_probe, dec.p_probe, auto)
    # min_p: auto resolves the same way, from its own tag
    auto_p = DecodeSettings(max_new_tokens=8, step_tokens=4, min_p="auto")
    client.set_model_version_tag(mv.name, mv.version, "min_p", "0.125")
    try:
        dec = build_decoder("semanticspec", pair, lms, auto_p, "all")
        assert dec.settings.min_p == 0.125 and dec.run_identity["min_p"] == 0.125
        assert dec.settings.min_ratio is None and "min_ratio" not in dec.run_identity
    finally:
        if "min_p" in mv.tags:
            client.set_model_version_tag(mv.name, mv.version, "min_p", mv.tags["min_p"])
        else:
            client.delete_model_version_tag(mv.name, mv.version, "min_p")
    with pytest.raises(ValueError, match="min_p 'auto'"):
        SemanticSpecDecoder(lms["draft"], lms["target"], dec.q_probe, dec.p_probe, auto_p)


def test_train_reports_routing_of_every_variant_and_the_oracle(stages, trained):
    import mlflow

    routing = trained["_routing"]
    assert set(routing) == {"last", "all", "mix", "random", "oracle"}
    for m in routing.values():
        assert m["n_shared"] + m["n_not_shared"] > 0
        rates = ("true_accept", "false_accept", "true_accept_at_min_ratio", "false_accept_at_min_ratio")
        for k in (*rates, "true_accept_at_min_p", "false_accept_at_min_p"):
            assert np.isnan(m.get(k, np.nan)) or 0 <= m[k] <= 1
        if "min_ratio" in m:  # chosen on the validation questions' steps where they have both kinds
            assert m["min_ratio"] >= 0 and m["true_accept_at_min_ratio"] <= m["true_accept"]
        assert ("min_p" in m) == ("min_ratio" in m)  # both chosen on the same steps
    oracle = routing["oracle"]
    # the oracle accepts every shared step with its true ratio and never a step the target does not say
    assert oracle["false_accept"] == 0.0 or np.isnan(oracle["false_accept"])
    saved = json.loads((stages["tmp"] / "metrics.json").read_text())["_routing"]
    assert saved["all"]["n_shared"] == routing["all"]["n_shared"]
    client = mlflow.MlflowClient(f"sqlite:///{stages['tmp']}/mlruns.db")
    mv = client.get_model_version_by_alias("semspec-tiny-target-all", "champion")
    run = client.get_run(mv.run_id)
    assert "test_mse" in run.data.metrics and "routing_true_accept" in run.data.metrics, "side by side"
    from semspec.flows.report import metrics_table

    table = metrics_table(saved and json.loads((stages["tmp"] / "metrics.json").read_text()))
    assert "| routing (test draft steps) |" in table and "| oracle |" in table


def test_training_on_both_authors_uses_each_models_reading_of_the_other(stages, tmp_path):
    from semspec.tasks.train.data import load_joint_probe_data, load_probe_data

    tmp = stages["tmp"]
    joint = pq.read_table(tmp / "labels" / "joint.parquet").to_pylist()
    for role, other in (("draft", "target"), ("target", "draft")):
        own = load_probe_data(tmp / "samples" / role, tmp / "labels" / f"{role}.parquet", ["all", "last"])
        both = load_joint_probe_data(
            role, tmp / "samples", tmp / "cross", tmp / "labels" / "joint.parquet", ["all"]
        )
        assert set(both.author.tolist()) == {role, other} and len(both.y) > len(own.y)
        labelled = [r for r in joint if r[f"share_{role}"] is not None]
        assert len(both.y) == len(labelled)
        assert both.y.tolist() == pytest.approx([r[f"share_{role}"] for r in labelled])
        # the other model's steps are read by this model: its width, not the author's
        assert both.x["all"].shape[1] == own.x["all"].shape[1]
    from semspec.tasks.config import TrainConfig
    from semspec.tasks.train import run_train

    cfg = TrainConfig(
        variants=["all", "random"],
        hidden_target=[8],
        hidden_draft=[8],
        max_epochs=3,
        examples="both",
        search=[{"hidden": []}, {"hidden": [8], "weight_decay": 0.1}],
        register=False,
    )
    import os

    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{tmp_path}/mlruns.db"
    try:
        res = run_train(
            cfg,
            stages["pair"],
            tmp / "samples",
            tmp / "labels",
            tmp_path / "probes",
            tmp_path / "m.json",
            tmp_path / "plots",
            None,
            None,
            tmp / "cross",
        )
    finally:
        os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{tmp}/mlruns.db"
    assert set(res["draft"]) == {"all", "random"} and "_routing" in res
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlruns.db")
    exp = client.get_experiment_by_name("semspec-tiny")
    (run,) = client.search_runs([exp.experiment_id], "tags.role = 'target' and tags.variant = 'all'")
    assert run.data.params["examples"] == "both"
    assert run.data.params["chosen_hidden"] in ("[]", "[8]"), "the shape kept on validation is logged"


def test_a_resumed_sample_stage_batches_each_prefix_as_an_unbroken_run_does():
    """Shards are fixed groups of consecutive prefixes: a prefix's shard neighbours (padding rounds with
    them) are the same whichever shards a killed run finished; a group an older run split is completed."""
    from semspec.tasks.sample import groups

    rows = [{"prefix_id": f"p{i}"} for i in range(7)]

    def ids(done: set[str]) -> list[list[str]]:
        return [[r["prefix_id"] for r in g] for g in groups(rows, 3, done)]

    assert ids(set()) == [["p0", "p1", "p2"], ["p3", "p4", "p5"], ["p6"]]
    assert ids({"p0", "p1", "p2"}) == [["p3", "p4", "p5"], ["p6"]]  # the unbroken run's groups, less one
    assert ids({"p3"}) == [["p0", "p1", "p2"], ["p4", "p5"], ["p6"]]
    assert ids({r["prefix_id"] for r in rows}) == []


def test_auroc_gap_resamples_questions_and_finds_a_real_gap():
    from semspec.tasks.train.metrics import auroc_gap

    rng = np.random.default_rng(0)
    label = rng.random(600) < 0.5
    groups = np.repeat(np.arange(60), 10)
    informed = label + rng.normal(0, 0.8, 600)  # AUROC ~0.8
    noise = rng.normal(0, 1, 600)  # AUROC ~0.5
    found = auroc_gap(label, informed, noise, groups)
    assert (
        found["groups"] == 60
        and 0.15 < found["gap"] < 0.45
        and found["lo"] > 0
        and found["lo"] < found["gap"] < found["hi"]
    )
    same = auroc_gap(label, noise, noise + rng.normal(0, 1e-3, 600), groups)
    assert same["lo"] < 0 < same["hi"]
    with pytest.raises(ValueError, match="both classes"):
        auroc_gap(np.ones(4, bool), noise[:4], noise[:4], groups[:4])
