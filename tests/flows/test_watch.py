"""What the terminal shows while a flow runs, and the links it ends with."""

from __future__ import annotations

import json
from urllib.parse import parse_qs

from semspec.flows.report import compare_url, experiment_url
from semspec.flows.stages import clean_line
from semspec.flows.watch import flow_run_url


def test_log_lines_lose_ansi_codes_redraws_and_dvc_hints():
    assert clean_line("\x1b[36m(SamplerActor pid=7)\x1b[0m loading") == "(SamplerActor pid=7) loading"
    bar = "sample:  10%|#   | 1/10 [00:05<00:45]\rsample:  20%|##  | 2/10 [00:10<00:40, 5.0s/prefix]"
    assert clean_line(bar) == "sample:  20%|##  | 2/10 [00:10<00:40, 5.0s/prefix]"
    assert clean_line("To track the changes with git, run:\n\n\tgit add dvc.lock") is None
    assert clean_line("To enable auto staging, run:") is None
    assert clean_line("\tdvc config core.autostage true") is None
    assert clean_line("\x1b[2K   ") is None


def test_flow_run_url_points_at_the_prefect_ui(monkeypatch):
    monkeypatch.setenv("SEMSPEC_PREFECT_PORT", "4321")
    assert flow_run_url("abc") == "http://127.0.0.1:4321/runs/flow-run/abc"


def test_compare_url_names_the_latest_probe_run_of_each_variant(tmp_path, monkeypatch):
    import mlflow

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlruns.db")
    monkeypatch.setenv("SEMSPEC_MLFLOW_PORT", "5055")
    assert compare_url("cmp") is None
    exp = mlflow.create_experiment("semspec-cmp", artifact_location=str(tmp_path / "art"))
    ids = {}
    for name in ("probe-draft-all", "probe-draft-random", "probe-draft-all", "eval-target"):
        stage = "evaluate" if name.startswith("eval") else "train"
        with mlflow.start_run(experiment_id=exp, run_name=name, tags={"stage": stage}) as r:
            ids[name] = r.info.run_id  # the second probe-draft-all is the latest
    url = compare_url("cmp")
    assert url.startswith("http://127.0.0.1:5055/#/compare-runs?runs=")
    query = parse_qs(url.split("?", 1)[1])
    assert sorted(json.loads(query["runs"][0])) == sorted([ids["probe-draft-all"], ids["probe-draft-random"]])
    assert json.loads(query["experiments"][0]) == [exp]
    # MLflow 3's UI would open its GenAI view; the link asks for the model-training one
    assert query["workflowType"] == ["machine_learning"]
    assert experiment_url("cmp") == f"http://127.0.0.1:5055/#/experiments/{exp}?workflowType=machine_learning"


def test_stage_output_is_logged_at_its_level_once_and_clean():
    import logging

    from semspec.flows.stages import stage_line_logger

    got = []

    class Logger:
        def log(self, level, fmt, text):
            got.append((level, text))

    emit = stage_line_logger(Logger())
    for line in [
        "\x1b[33mWARNING\x1b[0m mlflow: something old",
        "GPU available: False, used: False",
        "GPU available: False, used: False",  # Lightning prints it twice
        "Traceback (most recent call last):",
        "ValueError: bad input",
        "  /x.py:3: FutureWarning: deprecated",
        "To track the changes with git, run:",
        "sample:  50%|##   | 4/8 [00:10<00:10, 2.5s/prefix]",
    ]:
        emit(line)
    assert got == [
        (logging.WARNING, "WARNING mlflow: something old"),
        (logging.INFO, "GPU available: False, used: False"),
        (logging.ERROR, "Traceback (most recent call last):"),
        (logging.ERROR, "ValueError: bad input"),
        (logging.WARNING, "  /x.py:3: FutureWarning: deprecated"),
        (logging.INFO, "sample:  50%|##   | 4/8 [00:10<00:10, 2.5s/prefix]"),
    ]
