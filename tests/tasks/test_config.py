"""params.yaml + profile + overrides -> typed, validated stage configs."""

from __future__ import annotations

import pytest

from semspec.models.project.pairs import load_pair
from semspec.tasks.config import load_params


def test_default_params_are_the_demo_profile():
    p = load_params()
    assert p.pair == "qwen-coder" and p.profile == "demo"
    assert p.sample.n == 8 and p.sample.max_step_tokens is None  # the pair's budget, as in decoding
    pair = load_pair(p.pair)
    assert pair.draft.max_step_tokens == pair.target.max_step_tokens == 48
    assert pair.draft.dtype == pair.target.dtype == "auto"
    assert p.ingest.max_questions * p.ingest.max_prefixes_per_question == 16
    assert p.evaluate.decode.max_new_tokens >= 150 and "specsampling" in p.evaluate.methods
    assert p.retrain.cron == "0 3 * * 1" and p.retrain.stages[0] == "ingest"
    assert p.train.variants == ["last", "all", "mix", "random"]
    assert p.train.hidden("target") == [2048, 512] and p.train.hidden("draft") == [512, 256]


def test_every_shipped_pair_picks_its_format_for_the_machine():
    from semspec.models.project.pairs import list_pairs

    for name in list_pairs():
        pair = load_pair(name)
        assert pair.draft.dtype == pair.target.dtype == "auto", name


def test_profiles_and_overrides():
    acc = load_params(profile="accuracy")
    assert set(acc.evaluate.benchmarks) == {"arith", "math500", "aime24", "amc23", "gpqa"}
    assert acc.evaluate.decode.max_new_tokens == 512 and acc.evaluate.levels == [1, 2]
    paper = load_params(profile="paper")
    assert paper.ingest.source == "s1k" and paper.sample.max_step_tokens is None and paper.sample.n == 20
    tiny = load_params(profile="tiny", overrides=["sample.n=3", "train.variants=[all, random]"])
    assert tiny.sample.n == 3 and tiny.train.variants == ["all", "random"]


@pytest.mark.parametrize(
    "override, msg",
    [
        ("sample.n=0", "'n'"),
        ("sample.n=1", "'n' must be at least 2"),
        ("train.hidden_target=[0]", "hidden_target"),
        ("train.hidden_draft=[64, -1]", "hidden_draft"),
        ("sample.max_step_tokens=0", "max_step_tokens"),
        ("sample.top_p=1.5", "top_p"),
        ("sample.roles=[judge]", "roles"),
        ("sample.executor=dask", "executor"),
        ("cluster.noise=2", "noise"),
        ("train.variants=[best]", "variants"),
        ("train.test_fraction=0.9", "test_fraction"),
        ("ingest.source=web", "source"),
        ("ingest.source=[arith, gpqa]", "source"),
        ("ingest.source=[arith, arith]", "distinct"),
        ("ingest.source=[]", "source"),
        ("ingest.domain_by=topic", "domain_by"),
        ("sample.temprature=1", "unknown field"),
        ("nonsense", "section.key=value"),
        ("retrain.cron=weekly", "cron"),
        ("retrain.stages=[deploy]", "stages"),
        ("split_strategy=words", "split_strategy must be one of"),
        ("ingest.split_strategy=sentence", "moved to the top level"),
        ("train.domains=[]", "'domains' must be 'all' or a non-empty list"),
        ("train.domains=math", "'domains' must be 'all' or a non-empty list"),
        ("train.domains=[math, a-b]", "domain 'a-b'"),
        ("evaluate.probe_domain=x/y", "domain 'x/y'"),
        ("evaluate.decode.lookahead=-1", "evaluate.decode: lookahead must be a count"),
        ("evaluate.decode.rewrite_wait=x", "evaluate.decode: rewrite_wait must be a count"),
        (
            "evaluate.decode.min_ratio=strict",
            "evaluate.decode: min_ratio must be null, a number >= 0 or 'auto'",
        ),
        ("evaluate.decode.min_ratio=-0.5", "evaluate.decode: min_ratio"),
        ("evaluate.decode.min_p=high", "evaluate.decode: min_p must be null, a number >= 0 or 'auto'"),
        ("evaluate.decode.max_rejections=-1", "evaluate.decode: max_rejections must be null or a count >= 0"),
        (
            "evaluate.decode.max_rejections=many",
            "evaluate.decode: max_rejections must be null or a count >= 0",
        ),
        ("evaluate.decode.min_token_p=0", "evaluate.decode: min_token_p must be null or a probability"),
        ("evaluate.decode.min_token_p=1.5", "evaluate.decode: min_token_p must be null or a probability"),
        ("evaluate.decode.min_token_p=auto", "evaluate.decode: min_token_p must be null or a probability"),
        ("ingest.trace_author=[data, judge]", "'trace_author'"),
    ],
)
def test_bad_values_name_the_field(override, msg):
    with pytest.raises(ValueError, match=msg):
        load_params(overrides=[override])


def test_min_ratio_takes_auto_and_numbers():
    assert load_params(overrides=["evaluate.decode.min_p=auto"]).evaluate.decode.min_p == "auto"
    with pytest.raises(ValueError, match="two acceptance rules"):
        load_params(overrides=["evaluate.decode.min_p=auto", "evaluate.decode.min_ratio=0.3"])
    assert load_params(overrides=["evaluate.decode.min_ratio=auto"]).evaluate.decode.min_ratio == "auto"
    assert load_params(overrides=["evaluate.decode.min_ratio=0.4"]).evaluate.decode.min_ratio == 0.4


def test_unknown_profile_and_missing_file(tmp_path):
    with pytest.raises(ValueError, match="unknown profile 'huge'"):
        load_params(profile="huge")
    with pytest.raises(ValueError, match="not found"):
        load_params(tmp_path / "params.yaml")


def test_a_profile_replaces_a_dict_setting_whole(tmp_path):
    import yaml

    from semspec.models.project.pairs import project_root

    base = yaml.safe_load((project_root() / "params.yaml").read_text())
    assert len(base["evaluate"]["benchmarks"]) > 1, "params.yaml evaluates more than one benchmark"
    p = load_params(profile="tiny")
    assert p.evaluate.benchmarks == {"arith": 2}, "tiny's benchmarks replace the base's, not add to them"
    assert p.evaluate.decode.max_new_tokens == 16 and p.evaluate.levels == base["evaluate"]["levels"]
