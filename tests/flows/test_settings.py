"""One mapping from params to decoder settings: the evaluation, `semspec decode`, `semspec bench` and the
flow's decode smoke test build their ``DecodeSettings`` from the same params, and differ only in the fields
each is asked to set (its own budget, its command-line options, the seed, how answers are read)."""

from __future__ import annotations

from dataclasses import asdict, replace
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

import semspec.models.lm as lm_module
import semspec.models.project.pairs as project
import semspec.tasks.bench as bench
import semspec.tasks.config as config
import semspec.tasks.decoders as decoders
import semspec.tasks.evaluate.workers as eval_workers
from semspec.flows.cli import app
from semspec.flows.pipeline import SMOKE_TOKENS, smoke_settings
from semspec.models.spec.settings import DecodeSettings

# every knob away from DecodeSettings' own defaults, so a call site that forgets one shows
PARAMS = [
    "evaluate.decode.temperature=0.7",
    "evaluate.decode.top_p=0.8",
    "evaluate.decode.gamma=2",
    "evaluate.decode.min_ratio=0.5",
    "evaluate.decode.lookahead=2",
    "evaluate.decode.rewrite_wait=3",
    "evaluate.decode.max_new_tokens=200",
]


class _Stop(ValueError):
    """Raised by the fakes once the settings are captured (the CLI turns a ValueError into exit 2)."""


@pytest.fixture
def captured(monkeypatch):
    """Params with ``PARAMS``; model loading faked; every decoder construction records its settings."""
    params = config.load_params(None, "tiny", PARAMS)
    seen: list[DecodeSettings] = []

    def record(method, pair, lms, settings, *rest):
        seen.append(settings)
        raise _Stop("captured")

    def record_bench(pair, lms, n, settings, *rest):
        seen.append(settings)
        raise _Stop("captured")

    monkeypatch.setattr(config, "load_params", lambda *a, **k: params)
    monkeypatch.setattr(project, "load_pair", lambda *a, **k: SimpleNamespace(role=lambda role: None))
    monkeypatch.setattr(lm_module, "load_lm", lambda model_cfg: None)
    monkeypatch.setattr(decoders, "build_decoder", record)
    monkeypatch.setattr(eval_workers, "build_decoder", record)
    monkeypatch.setattr(bench, "run_bench", record_bench)
    monkeypatch.setattr(bench, "run_batch_bench", record_bench)
    return params, seen


def test_the_four_callers_decode_with_the_evaluations_settings(captured):
    params, seen = captured
    with pytest.raises(_Stop):
        eval_workers.method_decoders(params.evaluate, None, {}, "math", seed=0)
    runner = CliRunner()
    res = runner.invoke(
        app, ["decode", "What is 2+2?", "--method", "target", "--temperature", "0.7", "--gamma", "2"]
    )
    assert res.exit_code == 2 and "captured" in res.output, res.output
    assert runner.invoke(app, ["bench", "--max-new-tokens", "200"]).exit_code == 2
    assert runner.invoke(app, ["bench", "--max-new-tokens", "200", "--batch", "2"]).exit_code == 2
    smoke = smoke_settings(params)
    assert len(seen) == 4
    ev, dec, bench_one, bench_batch = seen
    # the evaluation's settings are the params' (none left at DecodeSettings' defaults)
    assert ev == replace(params.evaluate.decode, seed=0, benchmark="math")
    defaults = asdict(DecodeSettings())
    for key in ("temperature", "top_p", "gamma", "min_ratio", "lookahead", "rewrite_wait", "max_new_tokens"):
        assert asdict(ev)[key] != defaults[key], key
    # each caller differs from it only in what it sets itself: no command has defaults of its own
    assert dec == bench_one == bench_batch == ev
    assert smoke == replace(ev, max_new_tokens=SMOKE_TOKENS)


def test_a_command_line_option_replaces_the_params_value(captured):
    params, seen = captured
    runner = CliRunner()
    res = runner.invoke(app, ["decode", "2+2?", "--method", "target", "--max-new-tokens", "9", "--seed", "4"])
    assert res.exit_code == 2 and "captured" in res.output, res.output
    assert runner.invoke(app, ["bench", "--no-salvage", "--lookahead", "0"]).exit_code == 2
    assert seen == [
        replace(params.evaluate.decode, max_new_tokens=9, seed=4),
        replace(params.evaluate.decode, salvage=False, lookahead=0),
    ]


def test_every_decode_setting_is_in_params_yaml_and_the_api():
    """A setting is a DecodeSettings field and a line of params.yaml's evaluate.decode: the API, the CLI's
    defaults and the evaluation read it from there."""
    import yaml

    from semspec.api import SETTINGS
    from semspec.models.project.pairs import project_root
    from semspec.models.spec.settings import PER_RUN

    raw = yaml.safe_load((project_root() / "params.yaml").read_text())["evaluate"]["decode"]
    assert set(raw) == set(DecodeSettings().configured()) and not set(raw) & set(PER_RUN)
    assert set(SETTINGS) == set(asdict(DecodeSettings()))


def test_a_bad_decode_setting_in_the_params_names_its_place():
    with pytest.raises(ValueError, match=r"evaluate\.decode: lookahead must be a count >= 0"):
        config.load_params(None, "tiny", ["evaluate.decode.lookahead=-1"])
    with pytest.raises(ValueError, match=r"evaluate\.decode: unknown setting\(s\) \['seed'\] \(set per run"):
        config.load_params(None, "tiny", ["evaluate.decode.seed=3"])
    with pytest.raises(ValueError, match="unknown setting"):
        config.load_params(None, "tiny", ["evaluate.decode.gama=3"])
    # a profile overlays the decode settings key by key: tiny sets the budget and keeps the base's gamma
    assert config.load_params(None, "tiny", []).evaluate.decode.max_new_tokens == 16
    assert config.load_params(None, "tiny", ["evaluate.decode.gamma=3"]).evaluate.decode.gamma == 3


def test_an_override_replaces_one_field_and_a_bad_value_names_it():
    ev = config.load_params(None, "tiny", ["evaluate.decode.top_p=0.8"]).evaluate
    assert decoders.decode_settings(ev, seed=5) == replace(decoders.decode_settings(ev), seed=5)
    assert decoders.decode_settings(ev).top_p == 0.8
    with pytest.raises(ValueError, match="lookahead"):
        decoders.decode_settings(ev, lookahead=-1)
