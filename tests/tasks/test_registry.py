"""The pair's MLflow experiment."""

from __future__ import annotations


def test_the_experiment_opens_as_model_training_with_a_description(tmp_path, monkeypatch):
    import mlflow

    from semspec.tasks.probe_registry import setup_experiment

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlruns.db")
    monkeypatch.setenv("SEMSPEC_MLFLOW_ARTIFACTS", str(tmp_path / "artifacts"))
    exp_id = setup_experiment("tiny")
    assert setup_experiment("tiny") == exp_id
    tags = mlflow.get_experiment(exp_id).tags
    assert (
        tags["mlflow.experimentKind"] == "custom_model_development"
        and "`tiny`" in tags["mlflow.note.content"]
    )
