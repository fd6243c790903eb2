"""Faults: a stage killed mid-run loses only the work in flight (SIGKILL, then rerun)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from semspec.models.spec.batching import SingleModelDecoder
from semspec.models.spec.settings import DecodeSettings
from semspec.tasks.config import EvaluateConfig
from semspec.tasks.evaluate import run_evaluate
from tests.helpers.pipeline import write_tiny_pair
from tests.helpers.project import ROOT, kill_mid_run

pytestmark = pytest.mark.reliability

EVALUATE_SCRIPT = """
import sys
from pathlib import Path
from semspec.models.project.pairs import load_pair
from semspec.models.spec.settings import DecodeSettings
from semspec.tasks.config import EvaluateConfig
from semspec.tasks.evaluate import run_evaluate
tmp = Path(sys.argv[1])
cfg = EvaluateConfig(benchmarks={"arith": 12}, methods=["target"], decode=DecodeSettings(max_new_tokens=48), batch_size=2)
run_evaluate(cfg, load_pair(tmp / "tiny.yaml"), tmp / "eval", log_mlflow=False)
"""


def test_evaluate_resumes_after_a_kill_and_redoes_only_the_lost_problems(tmp_path, monkeypatch, observed):
    pair = write_tiny_pair(tmp_path, max_step_tokens=4, draft_hidden=128, target_hidden=128, layers=4)
    rows = tmp_path / "eval" / "arith" / "target.jsonl"
    kill_mid_run(
        EVALUATE_SCRIPT, tmp_path, lambda: rows.exists() and len(rows.read_text().splitlines()) >= 4, 240
    )
    before = [line for line in rows.read_text().splitlines() if line.endswith("}")]
    assert 4 <= len(before) < 12, f"the kill should land mid-stage, found {len(before)} rows"
    decoded = []
    real = SingleModelDecoder.decode_batch

    def counted(self, questions, *args, **kw):
        decoded.extend(questions)
        return real(self, questions, *args, **kw)

    monkeypatch.setattr(SingleModelDecoder, "decode_batch", counted)
    cfg = EvaluateConfig(
        benchmarks={"arith": 12}, methods=["target"], decode=DecodeSettings(max_new_tokens=48), batch_size=2
    )
    out = run_evaluate(cfg, pair, tmp_path / "eval", log_mlflow=False)
    after = rows.read_text().splitlines()
    assert after[: len(before)] == before, "finished rows are kept as they were"
    assert len(decoded) == 12 - len(before), "only the problems without a row are decoded again"
    ids = [json.loads(line)["question_id"] for line in after]
    assert len(ids) == 12 == len(set(ids)) and out["arith"]["target"]["n"] == 12
    observed(
        f"evaluate SIGKILLed with {len(before)} of 12 rows written; the rerun kept them, decoded "
        f"{len(decoded)} problems, and wrote {len(after)} rows, {len(set(ids))} distinct"
    )


def test_a_retrain_fails_in_seconds_when_mlflow_is_unreachable(tmp_path, monkeypatch, observed):
    """The retrain asks the registry which pairs are trained: with MLflow down that is one line within
    seconds, not minutes of HTTP retries (nor every pair looking untrained)."""
    from semspec.tasks.config import load_params
    from semspec.tasks.retrain import pair_statuses
    from tests.helpers.project import free_port

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{free_port()}")
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=r"MLflow tracking server http://127\.0\.0\.1:\d+ is not reachable"):
        pair_statuses(load_params(profile="tiny"))
    took = time.perf_counter() - t0
    assert took < 10
    observed(f"retrain with MLflow unreachable failed in {took:.1f} s with one line")


@pytest.mark.parametrize("name", ["train", "evaluate"])
def test_a_stage_fails_in_seconds_when_mlflow_is_unreachable(name, tmp_path, monkeypatch, observed):
    import importlib

    from semspec.models.project.pairs import load_pair
    from semspec.tasks.config import load_params
    from tests.helpers.project import free_port

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{free_port()}")
    paths = {
        "train": ("samples", "cross", "labels", "out", "metrics", "plots"),
        "evaluate": ("probes", "out", "plots", "metrics"),
    }[name]
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=r"MLflow tracking server http://127\.0\.0\.1:\d+ is not reachable"):
        importlib.import_module(f"semspec.tasks.{name}").stage(
            params=load_params(profile="tiny"),
            pair=load_pair("embedded"),
            **{p: tmp_path / p for p in paths},
        )
    took = time.perf_counter() - t0
    assert took < 10
    assert not any(tmp_path.iterdir()), "nothing written"
    observed(f"{name} with MLflow unreachable failed in {took:.1f} s with one line, nothing written")


def _ray_sample_command(tmp_path) -> tuple[list[str], dict[str, str]]:
    """`semspec sample` on the Ray executor over 8 tiny-pair prefixes (long enough to stop mid-stage)."""
    from semspec.models.project.pairs import load_pair
    from semspec.tasks.config import load_params
    from semspec.tasks.ingest import run_ingest

    write_tiny_pair(tmp_path, draft_hidden=128, target_hidden=128, layers=4)
    pair_file = tmp_path / "tiny.yaml"
    p = load_params(profile="tiny", overrides=["ingest.max_questions=8"])
    run_ingest(p.ingest, load_pair(pair_file), tmp_path / "prefixes.parquet")
    sets = ["sample.executor=ray", "sample.n=16", "sample.max_step_tokens=48", "sample.batch_prefixes=1"]
    cmd = [sys.executable, "-m", "semspec.flows.cli", "sample", "--pair", str(pair_file), "--profile", "tiny"]
    cmd += ["--prefixes", str(tmp_path / "prefixes.parquet"), "--out", str(tmp_path / "samples")]
    cmd += [arg for s in sets for arg in ("--set", s)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("RAY_ADDRESS", None)
    return cmd, env


def _ray_children_once_working(pid: int, shards) -> list:
    """The processes under ``pid`` once its first shard is written (Ray's GCS, raylet, agents, actors)."""
    import psutil

    deadline = time.time() + 240
    while time.time() < deadline and psutil.pid_exists(pid) and not list(shards.glob("part-*.parquet")):
        time.sleep(0.1)
    procs = psutil.Process(pid).children(recursive=True)
    assert len(procs) >= 2, "Ray runs its GCS, raylet and actors as child processes"
    return procs


def test_a_terminated_stage_stops_its_ray_processes(tmp_path, observed):
    """SIGTERM (a cancelled run, a closed terminal) to `semspec sample` on Ray: the stage shuts Ray down
    itself, so every process Ray started for it is gone."""
    import psutil

    cmd, env = _ray_sample_command(tmp_path)
    proc = subprocess.Popen(
        cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        ray_procs = _ray_children_once_working(proc.pid, tmp_path / "samples" / "draft")
        t0 = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 128 + signal.SIGTERM
        _, alive = psutil.wait_procs(ray_procs, timeout=60)
        assert not alive, f"{len(alive)} Ray process(es) outlived the stage"
        observed(
            f"sample SIGTERMed: its {len(ray_procs)} Ray processes gone {time.perf_counter() - t0:.1f} s later"
        )
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def _child_running(parent, marker: str, timeout: float):
    """The first child of ``parent`` whose command line contains ``marker``, waited for (a child just
    forked still shows its parent's command line until it execs)."""
    import psutil

    deadline = time.time() + timeout
    while time.time() < deadline:
        for child in parent.children():
            try:
                if marker in " ".join(child.cmdline()):
                    return child
            except psutil.Error:  # gone or not readable yet
                continue
        time.sleep(0.05)
    raise AssertionError(f"no child process running {marker!r} within {timeout} s")


def test_a_killed_stage_run_by_the_flow_leaves_no_ray_process(tmp_path, observed):
    """SIGKILL to a stage the flow runs (``stream_process``): the stage cannot clean up, so the flow stops
    what it left in its process group; no Ray process survives."""
    import threading

    import psutil

    from semspec.flows.stages import stream_process

    cmd, env = _ray_sample_command(tmp_path)
    lines, rc = [], []
    runner = threading.Thread(target=lambda: rc.append(stream_process(cmd, ROOT, env, lines.append)))
    runner.start()
    stage = _child_running(psutil.Process(), "semspec.flows.cli", timeout=60)
    ray_procs = _ray_children_once_working(stage.pid, tmp_path / "samples" / "draft")
    t0 = time.perf_counter()
    stage.send_signal(signal.SIGKILL)
    runner.join(timeout=120)
    assert rc == [-signal.SIGKILL]
    _, alive = psutil.wait_procs(ray_procs, timeout=30)
    assert not alive, f"{len(alive)} Ray process(es) outlived the stage"
    observed(
        f"sample SIGKILLed under the flow: its {len(ray_procs)} Ray processes gone "
        f"{time.perf_counter() - t0:.1f} s later"
    )


def test_a_stage_killed_by_hand_leaves_no_ray_process_within_seconds(tmp_path, observed):
    """SIGKILL to the stage's process alone (``kill -9 <pid>``, outside the flow): Ray's reaper stops its
    GCS and raylet, and our watchdog the rest (Ray's agents alone linger for one to two minutes)."""
    import psutil

    cmd, env = _ray_sample_command(tmp_path)
    proc = subprocess.Popen(
        cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        ray_procs = _ray_children_once_working(proc.pid, tmp_path / "samples" / "draft")
        assert any(p.name().startswith("ray::") for p in ray_procs)
        t0 = time.perf_counter()
        proc.kill()
        proc.wait(timeout=30)
        _, alive = psutil.wait_procs(ray_procs, timeout=20)
        assert not alive, f"{[p.name() for p in alive]} outlived the stage by 20 s"
        observed(
            f"sample SIGKILLed by hand: its {len(ray_procs)} Ray processes gone "
            f"{time.perf_counter() - t0:.1f} s later"
        )
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


CLUSTER_SCRIPT = """
import sys, time
from pathlib import Path
import torch
from semspec.models.spec.judges import EmbeddingJudge
from semspec.models.project.pairs import load_pair
from semspec.tasks.cluster import run_cluster
from semspec.tasks.config import ClusterConfig
tmp = Path(sys.argv[1])
def slow(texts):
    time.sleep(0.25)
    return torch.tensor([[1.0, float(len(t) // 3)] for t in texts])
cfg = ClusterConfig(executor="local", batch_prefixes=1)
run_cluster(cfg, load_pair(tmp / "tiny.yaml"), tmp / "samples", tmp / "labels", tmp / "prefixes.parquet",
            judge=EmbeddingJudge(slow, threshold=0.999))
"""


def _fake_samples(tmp_path, n_prefixes: int = 10, n: int = 4) -> None:
    """Sample shards and prefixes as the sample and ingest stages write them (the fields cluster reads);
    prefix p3 has only empty samples (no valid sample: no label rows, but done)."""
    import pyarrow as pa

    from semspec.tasks.io import shard_name, write_parquet_atomic

    prefixes = [
        {"prefix_id": f"p{i}", "question": f"q{i}", "context": "", "domain": "math"}
        for i in range(n_prefixes)
    ]
    write_parquet_atomic(pa.Table.from_pylist(prefixes), tmp_path / "prefixes.parquet")
    for role in ("draft", "target"):
        for p in prefixes:
            rows = [
                {
                    "prefix_id": p["prefix_id"],
                    "question_id": p["question"],
                    "role": role,
                    "sample_idx": k,
                    "text": "" if p["prefix_id"] == "p3" else "x" * (3 * (k % 2) + len(p["prefix_id"])),
                    "finish_reason": "delimiter",
                }
                for k in range(n)
            ]
            write_parquet_atomic(
                pa.Table.from_pylist(rows), tmp_path / "samples" / role / shard_name([p["prefix_id"]])
            )


def test_cluster_resumes_after_a_kill_and_labels_only_the_rest(tmp_path, observed):
    import pyarrow.parquet as pq
    import torch

    from semspec.models.project.pairs import load_pair
    from semspec.models.spec.judges import EmbeddingJudge
    from semspec.tasks.cluster import labelled_prefixes, run_cluster
    from semspec.tasks.config import ClusterConfig

    write_tiny_pair(tmp_path)
    _fake_samples(tmp_path)
    parts = tmp_path / "labels" / ".parts"
    kill_mid_run(CLUSTER_SCRIPT, tmp_path, lambda: len(list(parts.glob("*/part-*.parquet"))) >= 5, 120)
    n_parts = len(list(parts.glob("*/part-*.parquet")))
    assert 5 <= n_parts < 30, f"the kill should land mid-stage, found {n_parts} parts"
    kinds = ("draft", "target", "joint")  # joint: both roles' samples of a prefix clustered together
    done = {r: labelled_prefixes(parts / r) for r in kinds}
    judged = []

    def embed(texts):
        judged.append(len(texts))
        return torch.tensor([[1.0, float(len(t) // 3)] for t in texts])

    cfg = ClusterConfig(executor="local", batch_prefixes=1)
    pair = load_pair(tmp_path / "tiny.yaml")
    out = run_cluster(
        cfg,
        pair,
        tmp_path / "samples",
        tmp_path / "labels",
        tmp_path / "prefixes.parquet",
        judge=EmbeddingJudge(embed, threshold=0.999),
    )
    # p3 has no valid sample, so it is never judged; every other prefix is judged once, in one call
    todo = [(r, f"p{i}") for r in kinds for i in range(10) if f"p{i}" not in done[r]]
    assert len(judged) == sum(p != "p3" for _, p in todo), "finished parts are not labelled again"
    for role in ("draft", "target"):
        rows = pq.read_table(out[role]).to_pylist()
        keys = {(r["prefix_id"], r["sample_idx"]) for r in rows}
        assert len(rows) == len(keys) == 9 * 4, "every valid sample labelled exactly once"
        assert {r["prefix_id"] for r in rows} == {f"p{i}" for i in range(10)} - {"p3"}
    joint = pq.read_table(out["joint"]).to_pylist()
    assert len(joint) == len({(r["prefix_id"], r["author"], r["sample_idx"]) for r in joint}) == 2 * 9 * 4
    assert not parts.exists(), "the parts are removed once the labels are whole"
    observed(
        f"cluster SIGKILLed with {n_parts} of 30 (role or joint, prefix) parts labelled; the rerun judged "
        f"{len(judged)} prefixes (p3 has no valid sample), 36 rows per role, no duplicate"
    )
    # a rerun with other settings does not reuse stale parts
    parts.mkdir()
    (parts / "_manifest.json").write_text("{}")
    judged.clear()
    run_cluster(
        cfg,
        pair,
        tmp_path / "samples",
        tmp_path / "labels",
        tmp_path / "prefixes.parquet",
        judge=EmbeddingJudge(embed, threshold=0.999),
    )
    assert len(judged) == 27, "each role's 9 valid prefixes and the 9 joint ones, judged again"


def _kill_actors(title: str, times: int, stop: threading.Event, killed: list[int]) -> None:
    """SIGKILL this test's processes running ``title`` (Ray names an actor's process after the call it
    runs; only our own descendants: another run's actors on this machine are left alone) until ``times``
    were killed or ``stop`` is set."""
    import psutil

    me = psutil.Process()
    while not stop.is_set() and len(killed) < times:
        for p in me.children(recursive=True):
            with contextlib.suppress(psutil.Error):
                cmdline = p.cmdline()
                if cmdline and cmdline[0].startswith(title) and p.pid not in killed:
                    p.kill()
                    killed.append(p.pid)
        time.sleep(0.05)


@pytest.mark.parametrize("kills", [1, 3])
def test_a_killed_ray_actor_is_replaced_and_its_batch_redone_then_a_clear_failure(tmp_path, kills, observed):
    from semspec.tasks.config import load_params
    from semspec.tasks.ingest import run_ingest
    from semspec.tasks.io import read_shards
    from semspec.tasks.ray_utils import shutdown_ray
    from semspec.tasks.sample import run_sample

    pair = write_tiny_pair(tmp_path, draft_hidden=128, target_hidden=128, layers=4)
    overrides = ["ingest.max_questions=6", "sample.executor=ray", "sample.batch_prefixes=2", "sample.n=8"]
    p = load_params(
        profile="tiny", overrides=[*overrides, "sample.max_step_tokens=48", "sample.roles=[draft]"]
    )
    prefixes = run_ingest(p.ingest, pair, tmp_path / "prefixes.parquet")
    stop, killed = threading.Event(), []
    killer = threading.Thread(target=_kill_actors, args=("ray::SamplerActor.sample", kills, stop, killed))
    killer.start()
    try:
        if kills == 1:
            run_sample(p.sample, pair, prefixes, tmp_path / "samples")
            rows = read_shards(tmp_path / "samples" / "draft", ["prefix_id", "sample_idx"]).to_pylist()
            n = len({r["prefix_id"] for r in rows})
            assert len(rows) == len({(r["prefix_id"], r["sample_idx"]) for r in rows}) == n * 8
            observed(
                f"1 sample actor SIGKILLed mid-batch: replaced; {len(rows)} rows for {n} prefixes, unique"
            )
        else:  # one more death than the actor may be replaced: the error names the batch's prefixes
            died = r"sample\[draft\] of prefixes .+: the Ray actor died and could not be replaced \(at most 2"
            with pytest.raises(RuntimeError, match=died) as err:
                run_sample(p.sample, pair, prefixes, tmp_path / "samples")
            observed(f"3 sample actor deaths: {err.value}")
    finally:
        stop.set()
        killer.join()
        shutdown_ray()
    assert len(killed) == kills, "the actor must have been killed mid-batch"
