"""The Prefect flow's logic on a temporary Prefect server, with the stage runner and the decode smoke
test replaced by recorders (the real stages run in tests/integration)."""

from __future__ import annotations

import pytest
from prefect import task

import semspec.flows.pipeline as pipeline
from semspec.flows.stages import StageRun
from semspec.models.project.names import STAGES


@pytest.fixture(scope="module")
def harness():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


smoke_seen: list = []  # the settings each decode smoke test got


@pytest.fixture
def recorded(monkeypatch, tmp_path, harness):
    calls: list[tuple] = []
    smoke_seen.clear()

    def fake_run_stage(req, on_line):
        on_line(f"running {req.stage}")
        calls.append((req.stage, req.pair, req.profile, req.overrides, req.force))
        return StageRun(req.stage, req.pair, "direct", False, 0.01, f"semspec {req.stage}")

    @task(name="decode-smoke")
    def fake_smoke(pair: str, variant: str, split_strategy: str, settings):
        calls.append(("decode", pair, variant))
        smoke_seen.append(settings)
        return {
            "question": "q",
            "probe": variant,
            "steps": 2,
            "output_tokens": 9,
            "target_share": 0.5,
            "answer": None,
            "trace": [{"author": "draft", "text": "2 + 2 = 4."}, {"author": "target", "text": "So 7."}],
            "seconds": 1.5,
        }

    monkeypatch.setattr(pipeline, "run_stage", fake_run_stage)
    monkeypatch.setattr(pipeline, "decode_smoke", fake_smoke)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlruns.db")
    return calls


def test_full_runs_every_stage_in_order_then_the_smoke_test(recorded):
    out = pipeline.semspec(pair="embedded", profile="tiny")
    assert [c[0] for c in recorded] == [*STAGES, "decode"]
    assert all(c[1:4] == ("embedded", "tiny", ()) and c[4] is False for c in recorded[:-1])
    assert recorded[-1] == ("decode", "embedded", "all")
    assert smoke_seen == [pipeline.smoke_settings(pipeline.load_params(None, "tiny"))]  # the evaluation's
    assert [r["stage"] for r in out["embedded"]["stages"]] == list(STAGES)


def test_stage_subset_and_overrides(recorded):
    pipeline.semspec(pair="embedded", profile="tiny", stages=["train", "ingest"], overrides=["train.seed=4"])
    assert recorded == [  # pipeline order, whatever order was asked
        ("ingest", "embedded", "tiny", ("train.seed=4",), False),
        ("train", "embedded", "tiny", ("train.seed=4",), False),
    ]


def test_bad_stage_or_setting_fails_before_any_work(recorded):
    state = pipeline.semspec(pair="embedded", stages=["deploy"], return_state=True)
    assert state.is_failed() and "unknown stage" in str(state.result(raise_on_failure=False))
    state = pipeline.semspec(overrides=["sample.n=0"], return_state=True)
    assert state.is_failed() and "'n'" in str(state.result(raise_on_failure=False))
    assert recorded == []


def test_retrain_runs_only_the_pairs_that_need_it(recorded, monkeypatch):
    monkeypatch.setattr(
        pipeline,
        "pair_statuses",
        lambda params, eval_metrics=None: {
            "embedded": None,
            "fresh": "no champion probe semspec-fresh-draft-last",
            "edited": "config changed: ...",
            "unevaluated": "not evaluated: no finished evaluation",
            "big": "unavailable: needs a CUDA device",
            "broken": "invalid: missing field",
        },
    )
    out = pipeline.semspec(profile="tiny", retrain=True)
    assert sorted(out) == ["_skipped", "edited", "fresh", "unevaluated"]
    assert out["_skipped"] == {"big": "unavailable: needs a CUDA device", "broken": "invalid: missing field"}
    ran = [c for c in recorded if c[0] != "decode"]
    assert {c[1] for c in ran} == {"edited", "fresh", "unevaluated"}
    assert all(c[4] is True for c in ran)  # forced: the registry, not DVC, said they are stale
    assert [c[0] for c in ran if c[1] == "fresh"] == list(STAGES)
    assert [c[0] for c in ran if c[1] == "unevaluated"] == ["evaluate"]  # its probes are current
    assert not any(c[0] == "decode" for c in recorded)  # params.yaml's retrain.stages


def test_report_artifact_holds_the_stage_table(recorded):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
    from prefect.client.schemas.sorting import ArtifactSort

    pipeline.semspec(pair="embedded", profile="tiny", stages=["ingest"])
    with get_client(sync_client=True) as client:
        arts = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["semspec-embedded"]))
        )
    assert arts and arts[0].type == "markdown"
    assert (
        "| ingest | direct | ran |" in arts[0].data and "# semspec: embedded (tiny profile)" in arts[0].data
    )
    pipeline.semspec(pair="embedded", profile="tiny", stages=["decode"])
    with get_client(sync_client=True) as client:
        data = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["semspec-embedded"])),
            sort=ArtifactSort.CREATED_DESC,
        )[0].data
    assert "| decode | registry | ran | 1.5 |" in data and "answer none within the smoke budget" in data
    assert "1. draft, accepted: `2 + 2 = 4.`" in data and "2. target, rewritten: `So 7.`" in data


def test_deployments_full_and_retrain_on_the_configured_cron():
    full, retrain = pipeline.deployments()
    assert (full.name, retrain.name) == ("full", "retrain")
    assert full.flow_name == retrain.flow_name == "semspec"
    assert not full.schedules and retrain.parameters == {"retrain": True}
    assert retrain.schedules[0].schedule.cron == "0 3 * * 1"
    assert full.entrypoint == "semspec.flows.pipeline.semspec"


def test_one_failing_pair_does_not_stop_the_retrain_of_the_others(recorded, monkeypatch):
    monkeypatch.setattr(
        pipeline, "pair_statuses", lambda params, eval_metrics=None: {"a": "no champion", "b": "no champion"}
    )
    real = pipeline.run_stage

    def failing(req, on_line):
        if req.pair == "a" and req.stage == "sample":
            raise RuntimeError("stage sample (a) failed with exit code 1")
        return real(req, on_line)

    monkeypatch.setattr(pipeline, "run_stage", failing)
    state = pipeline.semspec(profile="tiny", retrain=True, return_state=True)
    assert state.is_failed() and "retrain failed for 1 pair(s)" in str(state.result(raise_on_failure=False))
    assert [c[0] for c in recorded if c[1] == "a"] == ["ingest"]
    assert [c[0] for c in recorded if c[1] == "b"] == list(STAGES)
