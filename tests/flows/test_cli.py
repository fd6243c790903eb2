"""The `semspec` CLI: help on every command, data check, grade, models check on a tiny local pair."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from semspec.flows.cli import app
from tests.helpers.pipeline import write_tiny_pair

runner = CliRunner()


def _command_paths(typer_app, prefix=()):
    """Every command and group of a Typer app, as argument lists."""
    yield list(prefix)
    for cmd in typer_app.registered_commands:
        yield [*prefix, cmd.name or cmd.callback.__name__.replace("_", "-")]
    for group in typer_app.registered_groups:
        yield from _command_paths(group.typer_instance, (*prefix, group.name))


COMMANDS = list(_command_paths(app))


def test_every_named_command_exists():
    names = {" ".join(c) for c in COMMANDS}
    for required in (
        "ingest",
        "sample",
        "cluster",
        "train",
        "evaluate",
        "decode",
        "bench",
        "grade",
        "data check",
        "models check",
        "services up",
        "services down",
        "services status",
        "serve",
        "deployments serve",
        "report",
        "pairs status",
        "probes export",
        "probes import",
    ):
        assert required in names


@pytest.mark.parametrize("args", COMMANDS, ids=lambda a: " ".join(a) or "semspec")
def test_help(args):
    res = runner.invoke(app, [*args, "--help"])
    assert res.exit_code == 0, res.output
    assert "Usage" in res.output


def test_data_check_counts(data_dir):
    res = runner.invoke(app, ["data", "check", "--data-dir", str(data_dir)])
    assert res.exit_code == 0, res.output
    counts = {line.split()[0]: line.split()[1] for line in res.output.splitlines() if line.strip()}
    assert counts["s1k"] == "1000" and counts["math500"] == "500" and counts["aime24"] == "30"
    assert counts["amc23"] == "40" and counts["gpqa"] == "198"


def test_data_check_fails_on_unreadable_set(tmp_path, data_dir):
    (tmp_path / "math500").mkdir()
    (tmp_path / "math500" / "test.jsonl").write_text("{broken\n")
    res = runner.invoke(app, ["data", "check", "--data-dir", str(tmp_path)])
    assert res.exit_code == 1
    assert "math500" in res.output and "malformed JSON" in res.output


@pytest.mark.parametrize(
    "bench, gold, pred, out",
    [
        ("math500", "\\frac12", "so \\boxed{0.5}", "correct"),
        ("gpqa", "B", "(C)", "wrong"),
        ("aime24", "025", "25", "correct"),
    ],
)
def test_grade(bench, gold, pred, out):
    res = runner.invoke(app, ["grade", "--benchmark", bench, "--gold", gold, "--pred", pred])
    assert res.exit_code == 0 and res.output.strip() == out


def test_grade_bad_benchmark_exits_nonzero():
    res = runner.invoke(app, ["grade", "--benchmark", "mmlu", "--gold", "1", "--pred", "1"])
    assert res.exit_code != 0


def test_models_check_on_a_local_tiny_pair(tmp_path):
    write_tiny_pair(tmp_path, draft_hidden=32, target_hidden=64)
    res = runner.invoke(app, ["models", "check", "--pair", str(tmp_path / "tiny.yaml"), "--tokens", "4"])
    assert res.exit_code == 0, res.output
    assert "[draft] id=tiny-draft float32 on cpu layers=2 hidden_size=32" in res.output
    assert "[target] id=tiny-target float32 on cpu layers=2 hidden_size=64" in res.output


def test_models_check_unknown_pair():
    res = runner.invoke(app, ["models", "check", "--pair", "nope"])
    assert res.exit_code == 2 and "unknown model pair" in res.output


def test_env_prints_exports():
    res = runner.invoke(app, ["env"])
    assert res.exit_code == 0
    assert "export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}" in res.output
    assert "PREFECT_API_URL" in res.output and "127.0.0.1" in res.output


def test_decode_without_registered_probes_says_how_to_train(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/empty.db")
    pair = write_tiny_pair(tmp_path)
    res = runner.invoke(
        app, ["decode", "--pair", str(tmp_path / "tiny.yaml"), "--method", "semanticspec", "hi"]
    )
    assert res.exit_code == 2
    assert (
        "no registered probe semspec-tiny-draft-all@champion" in res.output and "semspec train" in res.output
    )
    assert pair.name == "tiny"


def test_decode_target_streams_steps_and_json(tmp_path):
    write_tiny_pair(tmp_path)
    res = runner.invoke(
        app,
        [
            "decode",
            "--pair",
            str(tmp_path / "tiny.yaml"),
            "--method",
            "target",
            "--max-new-tokens",
            "12",
            "hi",
        ],
    )
    assert res.exit_code == 0, res.output
    assert "[target]" in res.output and "tokens in" in res.output
    res = runner.invoke(
        app,
        [
            "decode",
            "--pair",
            str(tmp_path / "tiny.yaml"),
            "--method",
            "target",
            "--max-new-tokens",
            "6",
            "--json",
            "hi",
        ],
    )
    import json

    trace = json.loads(res.output[res.output.index("{") :])
    assert trace["method"] == "target" and trace["output_tokens"] <= 6 and trace["steps"]


def test_decode_rejects_unknown_method():
    res = runner.invoke(app, ["decode", "--method", "beam", "hi"])
    assert res.exit_code != 0


@pytest.mark.parametrize(
    "args, says",
    [
        (["   "], "the question is empty"),
        (["--probe", "best", "hi"], "expected one of"),
        (["--probe", "all@x-y", "hi"], "domain 'x-y'"),
        (["--probe", "all@science", "hi"], "semspec-tiny-draft-all-science"),
        (["--max-new-tokens", "0", "hi"], "max_new_tokens must be a count >= 1"),
        (["--method", "semanticspec", "hi"], "no registered probe"),
    ],
)
def test_decode_checks_every_argument_before_loading_a_model(args, says, tmp_path, monkeypatch):
    import semspec.models.lm as lm

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/empty.db")
    monkeypatch.setattr(
        lm, "load_lm", lambda model_cfg: pytest.fail("a model was loaded before the arguments were checked")
    )
    write_tiny_pair(tmp_path)
    res = runner.invoke(app, ["decode", "--pair", str(tmp_path / "tiny.yaml"), *args])
    assert res.exit_code == 2 and says in res.output


@pytest.mark.parametrize(
    "stage, option",
    [("ingest", "--out"), ("train", "--metrics"), ("evaluate", "--plots"), ("sample", "--out")],
)
def test_an_unwritable_output_fails_before_any_work(stage, option, tmp_path, monkeypatch):
    """An output under a regular file (unwritable even for root): exit 2 naming the option and path,
    before the stage runs, and nothing is written."""
    import importlib

    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    target = blocker / ("x.json" if option == "--metrics" else "out")
    module = importlib.import_module(f"semspec.tasks.{stage}")
    monkeypatch.setattr(module, "stage", lambda **kw: pytest.fail("the stage ran"))
    res = runner.invoke(app, [stage, "--profile", "tiny", option, str(target)])
    assert res.exit_code == 2 and f"{option} {target}: cannot write there" in res.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


def test_pairs_prune_lists_then_deletes_what_removed_pairs_left(tmp_path, monkeypatch):
    import mlflow

    (tmp_path / "conf" / "pairs").mkdir(parents=True)
    (tmp_path / "conf" / "pairs" / "tiny.yaml").write_text("name: tiny\n")
    monkeypatch.setenv("SEMSPEC_PROJECT_DIR", str(tmp_path))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlruns.db")
    client = mlflow.MlflowClient()
    for name in (
        "semspec-tiny-draft-all",
        "semspec-gone-pair-target-last",
        "semspec-gone-pair-draft-all-math",
    ):
        client.create_registered_model(name)
    for name in ("semspec-tiny", "semspec-gone-pair"):
        client.create_experiment(name, artifact_location=str(tmp_path / "art" / name))
    for folder in ("data/tiny", "data/gone-pair", "eval/tiny-accuracy", "reports/gone-pair"):
        (tmp_path / folder).mkdir(parents=True)
    listed = runner.invoke(app, ["pairs", "prune"])
    assert listed.exit_code == 0 and "semspec pairs prune --yes" in listed.output
    gone = [
        "registered models: semspec-gone-pair-draft-all-math",
        "registered models: semspec-gone-pair-target-last",
        "experiments: semspec-gone-pair",
        "folders: data/gone-pair",
        "folders: reports/gone-pair",
    ]
    assert [line for line in listed.output.splitlines() if ": " in line and "prune" not in line] == gone
    assert (tmp_path / "data" / "gone-pair").is_dir(), "listing deletes nothing"
    assert runner.invoke(app, ["pairs", "prune", "--yes"]).exit_code == 0
    assert [m.name for m in client.search_registered_models()] == ["semspec-tiny-draft-all"]
    assert client.get_experiment_by_name("semspec-gone-pair").lifecycle_stage == "deleted"
    assert (
        not (tmp_path / "data" / "gone-pair").exists() and not (tmp_path / "reports" / "gone-pair").exists()
    )
    assert (tmp_path / "data" / "tiny").is_dir() and (tmp_path / "eval" / "tiny-accuracy").is_dir()
    assert "nothing to prune" in runner.invoke(app, ["pairs", "prune"]).output


def test_bench_refuses_a_negative_lookahead():
    res = runner.invoke(app, ["bench", "--lookahead", "-1"])
    assert res.exit_code == 2 and "lookahead must be a count >= 0, got -1" in res.output


def test_bench_takes_one_gamma_with_batches():
    res = runner.invoke(app, ["bench", "--batch", "4", "--gamma", "1", "--gamma", "2"])
    assert res.exit_code == 2 and "--gamma" in res.output and "one gamma with --batch" in res.output


def test_bench_refuses_a_token_check_that_is_no_probability():
    res = runner.invoke(app, ["bench", "--min-token-p", "2"])
    assert res.exit_code != 0 and "min_token_p must be null or a probability in (0, 1)" in res.output
