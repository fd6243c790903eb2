"""Pair configuration: every shipped pair validates; a bad model config names its field."""

from __future__ import annotations

import copy

import pytest
import yaml

from semspec.models.lm.pair import PairConfig
from semspec.models.project.pairs import list_pairs, load_pair, pairs_dir


def test_shipped_pairs_validate():
    names = list_pairs()
    assert {"embedded", "r1-distill-1.5b-32b", "r1-distill-1.5b-qwq-32b"} <= set(names)
    for n in names:
        cfg = load_pair(n)
        assert cfg.name == n
        assert cfg.draft.delimiter == "\n\n"
    real = load_pair("r1-distill-1.5b-32b")
    assert real.target.model_id == "deepseek-ai/DeepSeek-R1-Distill-Qwen-32B"
    assert real.target.path == real.target.model_id and real.target.uses_cuda
    assert real.judge.kind == "nli" and real.judge.model_id == "microsoft/deberta-large-mnli"
    assert load_pair("r1-distill-1.5b-qwq-32b").target.model_id == "Qwen/QwQ-32B"
    emb = load_pair("embedded")
    assert emb.draft.source == emb.target.source == "package" and emb.judge.kind == "embedding"


BASE = yaml.safe_load((pairs_dir() / "embedded.yaml").read_text())


@pytest.mark.parametrize(
    "path, value, field",
    [
        (("draft", "source"), "ftp", "source"),
        (("draft", "model_id"), "", "model_id"),
        (("target", "dtype"), "float8", "dtype"),
        (("target", "device"), "gpu0", "device"),
        (("draft", "prompt"), "fancy", "prompt"),
        (("draft", "plain_template"), "no placeholder", "plain_template"),
        (("draft", "delimiter"), "", "delimiter"),
        (("draft", "max_step_tokens"), 0, "max_step_tokens"),
        (("draft", "gguf_file"), "weights.bin", "gguf_file"),
        (("judge", "kind"), "vibes", "kind"),
        (("judge", "threshold"), 1.5, "threshold"),
        (("judge", "nli_mode"), "loose", "nli_mode"),
        (("name",), "bad name!", "name"),
        (("pooling",), "mean", "pooling"),
    ],
)
def test_bad_field_is_named(path, value, field):
    data = copy.deepcopy(BASE)
    node = data
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value
    with pytest.raises(ValueError, match=f"'{field}'"):
        PairConfig.from_dict(data)


def test_unknown_and_missing_fields(tmp_path):
    data = copy.deepcopy(BASE)
    data["draft"]["temprature"] = 0.5
    with pytest.raises(ValueError, match=r"unknown field.*temprature"):
        PairConfig.from_dict(data)
    data = copy.deepcopy(BASE)
    del data["target"]
    with pytest.raises(ValueError, match=r"missing field.*target"):
        PairConfig.from_dict(data)
    data = copy.deepcopy(BASE)
    data["draft"]["source"] = "local"
    data["draft"]["path"] = ""
    with pytest.raises(ValueError, match="'path' is required"):
        PairConfig.from_dict(data)
    data = copy.deepcopy(BASE)
    data["draft"]["split"] = "sentence"  # params.yaml's split_strategy decides, for both models at once
    with pytest.raises(ValueError, match=r"unknown field.*split"):
        PairConfig.from_dict(data)
    data = copy.deepcopy(BASE)
    data["draft"]["pooling"] = "tokens"  # a pair setting: both models pool alike
    with pytest.raises(ValueError, match=r"unknown field.*pooling"):
        PairConfig.from_dict(data)
    data = copy.deepcopy(BASE)
    data["pooling"] = "tokens"
    cfg = PairConfig.from_dict(data)
    assert cfg.pooling == cfg.draft.pooling == cfg.target.pooling == "tokens"
    assert PairConfig.from_dict(copy.deepcopy(BASE)).target.pooling == "predict"


def test_load_pair_errors(tmp_path):
    with pytest.raises(ValueError, match=r"unknown model pair 'nope'.*embedded"):
        load_pair("nope")
    bad = tmp_path / "x.yaml"
    bad.write_text("name: [unclosed")
    with pytest.raises(ValueError, match="not valid YAML"):
        load_pair(bad)
    cfg = load_pair(pairs_dir() / "embedded.yaml")
    with pytest.raises(ValueError, match="role must be"):
        cfg.role("judge")


def test_trust_remote_code_is_warned_about_naming_the_pair_and_model(tmp_path, caplog):
    import logging

    import yaml

    from semspec.models.project.pairs import load_pair

    model_cfg = {"source": "local", "path": str(tmp_path), "prompt": "plain"}
    pair = {
        "name": "remote",
        "draft": {"model_id": "org/safe", **model_cfg},
        "target": {"model_id": "org/custom-code", "trust_remote_code": True, **model_cfg},
    }
    (tmp_path / "remote.yaml").write_text(yaml.safe_dump(pair))
    with caplog.at_level(logging.WARNING, logger="semspec.models.project.pairs"):
        load_pair("remote", directory=tmp_path)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "pair remote: org/custom-code sets trust_remote_code" in warned[0]


@pytest.mark.parametrize("name", ["../secrets", "a/b", ".hidden", "x y"])
def test_pair_names_cannot_escape_conf_pairs(name, tmp_path):
    from semspec.models.project.pairs import load_pair

    with pytest.raises(ValueError, match="must be a file name in conf/pairs"):
        load_pair(name, directory=tmp_path)
