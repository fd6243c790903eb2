"""The `semspec` CLI: help on every command, data check, grade, models check on a tiny local pair."""

from __future__ import annotations

import pytest
import yaml
from typer.testing import CliRunner

from flows.cli import app
from tests.helpers.tiny import char_tokenizer, tiny_llama

runner = CliRunner()


@pytest.mark.parametrize(
    "args", [[], ["models"], ["models", "check"], ["data"], ["data", "check"], ["grade"], ["env"]]
)
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
    tok = char_tokenizer()
    for role, seed in (("draft", 0), ("target", 1)):
        d = tmp_path / role
        tiny_llama(len(tok), seed=seed, hidden=32 * (seed + 1)).save_pretrained(d)
        tok.save_pretrained(d)
    spec = {"source": "local", "prompt": "plain", "max_step_tokens": 8}
    pair = {
        "name": "tiny",
        "draft": {"model_id": "tiny-d", "path": str(tmp_path / "draft"), **spec},
        "target": {"model_id": "tiny-t", "path": str(tmp_path / "target"), **spec},
    }
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(pair))
    res = runner.invoke(app, ["models", "check", "--pair", str(tmp_path / "tiny.yaml"), "--tokens", "4"])
    assert res.exit_code == 0, res.output
    assert "[draft] id=tiny-d layers=2 hidden_size=32" in res.output
    assert "[target] id=tiny-t layers=2 hidden_size=64" in res.output


def test_models_check_unknown_pair():
    res = runner.invoke(app, ["models", "check", "--pair", "nope"])
    assert res.exit_code == 2 and "unknown model pair" in res.output


def test_env_prints_exports():
    res = runner.invoke(app, ["env"])
    assert res.exit_code == 0
    assert "export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}" in res.output
    assert "PREFECT_API_URL" in res.output and "127.0.0.1" in res.output
