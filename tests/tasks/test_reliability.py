"""Faults: a stage killed mid-run loses only the work in flight (SIGKILL, then rerun)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from semspec.models.decoding import SingleModelDecoder
from semspec.tasks.config import EvaluateConfig
from semspec.tasks.evaluate import run_evaluate
from tests.helpers.pipeline import write_tiny_pair
from tests.helpers.project import ROOT

pytestmark = pytest.mark.reliability

EVALUATE_SCRIPT = """
import sys
from pathlib import Path
from semspec.models.project import load_pair
from semspec.tasks.config import EvaluateConfig
from semspec.tasks.evaluate import run_evaluate
tmp = Path(sys.argv[1])
cfg = EvaluateConfig(benchmarks={"arith": 12}, methods=["target"], max_new_tokens=48, batch_size=2)
run_evaluate(cfg, load_pair(tmp / "tiny.yaml"), tmp / "eval", log_mlflow=False)
"""


def test_evaluate_resumes_after_a_kill_and_redoes_only_the_lost_problems(tmp_path, monkeypatch):
    pair = write_tiny_pair(tmp_path, max_step_tokens=4, draft_hidden=128, target_hidden=128, layers=4)
    rows = tmp_path / "eval" / "arith" / "target.jsonl"
    proc = subprocess.Popen(
        [sys.executable, "-c", EVALUATE_SCRIPT, str(tmp_path)],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 240
    while (
        time.time() < deadline
        and proc.poll() is None
        and (not rows.exists() or len(rows.read_text().splitlines()) < 4)
    ):
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    before = [line for line in rows.read_text().splitlines() if line.endswith("}")]
    assert 4 <= len(before) < 12, f"the kill should land mid-stage, found {len(before)} rows"
    decoded = []
    real = SingleModelDecoder.decode_batch

    def counted(self, questions, *args, **kw):
        decoded.extend(questions)
        return real(self, questions, *args, **kw)

    monkeypatch.setattr(SingleModelDecoder, "decode_batch", counted)
    cfg = EvaluateConfig(benchmarks={"arith": 12}, methods=["target"], max_new_tokens=48, batch_size=2)
    out = run_evaluate(cfg, pair, tmp_path / "eval", log_mlflow=False)
    after = rows.read_text().splitlines()
    assert after[: len(before)] == before, "finished rows are kept as they were"
    assert len(decoded) == 12 - len(before), "only the problems without a row are decoded again"
    ids = [json.loads(line)["question_id"] for line in after]
    assert len(ids) == 12 == len(set(ids)) and out["arith"]["target"]["n"] == 12


@pytest.mark.parametrize("name", ["train", "evaluate"])
def test_a_stage_fails_in_seconds_when_mlflow_is_unreachable(name, tmp_path, monkeypatch):
    import importlib

    from semspec.models.project import load_pair
    from semspec.tasks.config import load_params
    from tests.helpers.project import free_port

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{free_port()}")
    paths = {
        "train": ("samples", "labels", "out", "metrics", "plots"),
        "evaluate": ("probes", "out", "plots", "metrics"),
    }[name]
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=r"MLflow tracking server http://127\.0\.0\.1:\d+ is not reachable"):
        importlib.import_module(f"semspec.tasks.{name}").stage(
            params=load_params(profile="tiny"),
            pair=load_pair("embedded"),
            **{p: tmp_path / p for p in paths},
        )
    assert time.perf_counter() - t0 < 10
    assert not any(tmp_path.iterdir()), "nothing written"


def _ray_sample_command(tmp_path) -> tuple[list[str], dict[str, str]]:
    """`semspec sample` on the Ray executor over 8 tiny-pair prefixes (long enough to stop mid-stage)."""
    from semspec.models.project import load_pair
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


def test_a_terminated_stage_stops_its_ray_processes(tmp_path):
    """SIGTERM (a cancelled run, a closed terminal) to `semspec sample` on Ray: the stage shuts Ray down
    itself, so every process Ray started for it is gone."""
    import psutil

    cmd, env = _ray_sample_command(tmp_path)
    proc = subprocess.Popen(
        cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        ray_procs = _ray_children_once_working(proc.pid, tmp_path / "samples" / "draft")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 128 + signal.SIGTERM
        _, alive = psutil.wait_procs(ray_procs, timeout=60)
        assert not alive, f"{len(alive)} Ray process(es) outlived the stage"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def test_a_killed_stage_run_by_the_flow_leaves_no_ray_process(tmp_path):
    """SIGKILL to a stage the flow runs (``stream_process``): the stage cannot clean up, so the flow stops
    what it left in its process group; no Ray process survives."""
    import threading

    import psutil

    from semspec.flows.stages import stream_process

    cmd, env = _ray_sample_command(tmp_path)
    lines, rc = [], []
    runner = threading.Thread(target=lambda: rc.append(stream_process(cmd, ROOT, env, lines.append)))
    runner.start()
    deadline = time.time() + 60
    while time.time() < deadline and not (me := psutil.Process().children()):
        time.sleep(0.05)
    stage = next(p for p in me if "semspec.flows.cli" in " ".join(p.cmdline()))
    ray_procs = _ray_children_once_working(stage.pid, tmp_path / "samples" / "draft")
    stage.send_signal(signal.SIGKILL)
    runner.join(timeout=120)
    assert rc == [-signal.SIGKILL]
    _, alive = psutil.wait_procs(ray_procs, timeout=30)
    assert not alive, f"{len(alive)} Ray process(es) outlived the stage"
