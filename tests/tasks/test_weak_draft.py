"""benchmarks/weak_draft.py: the probe-free methods' rows are decoded once and shared between the two probe
sets' evaluations, and the shared rows are what the evaluation resumes (same run key); the learning curve
prints each run's variants and the oracle (the same in every run) once."""

from __future__ import annotations

import json

import pytest

from benchmarks.weak_draft import by_depth, by_kept, print_curve, share_baselines
from semspec.tasks.config import load_params
from semspec.tasks.evaluate.runs import resume_rows, run_key
from tests.helpers.pipeline import write_tiny_pair


def _rows(path, label, key, n=2):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        "".join(
            json.dumps({"question_id": f"q{i}", "method": label, "run_key": key}) + "\n" for i in range(n)
        )
    )


def test_the_baselines_are_shared_and_resumed_but_no_probe_method(tmp_path):
    cfg, pair = load_params(profile="tiny").evaluate, write_tiny_pair(tmp_path)
    done, todo = tmp_path / "own", tmp_path / "both"
    for label in ("target", "draft", "semanticspec-all"):
        _rows(done / "arith" / f"{label}.jsonl", label, run_key(cfg, pair, label, None))
    _rows(todo / "arith" / "draft.jsonl", "draft", run_key(cfg, pair, "draft", None), n=1)  # q0 there already
    share_baselines(done, todo)
    assert sorted(p.name for p in (todo / "arith").iterdir()) == ["draft.jsonl", "target.jsonl"]
    # the rows it lacked were appended, none twice; a second call adds nothing
    ids = [json.loads(x)["question_id"] for x in (todo / "arith" / "draft.jsonl").read_text().splitlines()]
    assert ids == ["q0", "q1"]
    share_baselines(done, todo)
    assert len((todo / "arith" / "draft.jsonl").read_text().splitlines()) == 2
    # the evaluation of the next probe set keeps the copied rows: its target rows have the same key
    key = run_key(cfg, pair, "target", None)
    assert len(resume_rows(todo / "arith" / "target.jsonl", key)) == 2


@pytest.mark.parametrize(
    "rule",
    [
        "evaluate.decode.min_ratio=auto",
        "evaluate.decode.max_rejections=1",
        "evaluate.decode.min_token_p=0.01",
    ],
)
def test_a_floor_on_p_over_q_keys_only_semanticspec_rows(tmp_path, rule):
    """``evaluate.decode.min_ratio`` and ``max_rejections`` are read by SemanticSpec alone: the baselines' rows
    keep their run key under them (so the ``+floor`` and ``+hN`` evaluations resume the shared ones),
    SemanticSpec's get another."""
    pair = write_tiny_pair(tmp_path)
    plain = load_params(profile="tiny").evaluate
    floor = load_params(profile="tiny", overrides=[rule]).evaluate
    for label in ("target", "draft"):
        assert run_key(plain, pair, label, None) == run_key(floor, pair, label, None)
    assert run_key(plain, pair, "semanticspec-all", None) != run_key(floor, pair, "semanticspec-all", None)


def test_llama_cpp_s_binary_keys_only_its_own_rows(tmp_path):
    """The study runs the target with and without ``evaluate.llamacpp_bin`` into one folder: its rows
    must keep their key, or the second run would drop and decode them again."""
    pair = write_tiny_pair(tmp_path)
    plain = load_params(profile="tiny").evaluate
    with_bin = load_params(profile="tiny", overrides=["evaluate.llamacpp_bin=/opt/llama/bin"]).evaluate
    for label in ("target", "draft", "semanticspec-all"):
        assert run_key(plain, pair, label, None) == run_key(with_bin, pair, label, None)
    assert run_key(plain, pair, "llamacpp", None) != run_key(with_bin, pair, "llamacpp", None)


def test_each_rule_suffix_evaluates_under_its_settings():
    from benchmarks.weak_draft import rule_settings

    assert rule_settings("+floor") == [
        "--set",
        "evaluate.decode.min_ratio=auto",
        "--set",
        "evaluate.probe_variants=[all]",
    ]
    assert rule_settings("+h2") == [
        "--set", "evaluate.decode.max_rejections=2", "--set", "evaluate.probe_variants=[all,random]",
    ]  # fmt: skip
    assert rule_settings("+t0.01+h1") == [
        "--set", "evaluate.decode.min_token_p=0.01", "--set", "evaluate.decode.max_rejections=1",
        "--set", "evaluate.probe_variants=[all,random]",
    ]  # fmt: skip
    for bad in ("+hx", "+t2", "+tx"):
        with pytest.raises(KeyError):
            rule_settings(bad)


def test_the_learning_curve_prints_the_oracle_once(capsys):
    def m(true_accept):
        return {
            "true_accept": true_accept,
            "false_accept": 0.1,
            "auroc": 0.5,
            "n_shared": 1,
            "n_not_shared": 2,
        }

    print_curve(
        {(ex, frac): {"all": m(frac / 2), "oracle": m(0.5)} for ex in ("own", "both") for frac in (0.25, 1.0)}
    )
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[:3] for line in lines[1:-1]] == [
        ["own", "25%", "all"],
        ["own", "100%", "all"],
        ["both", "25%", "all"],
        ["both", "100%", "all"],
    ]
    assert lines[-1].split()[2:4] == ["oracle", "0.500"] and sum("oracle" in line for line in lines) == 1


def test_acceptance_by_depth_bins_each_answers_steps_by_position(tmp_path):
    steps = [
        {"author": "target", "p": 0.1, "q": 0.4},  # position 0: rejected
        {"author": "draft", "p": 0.2, "q": 0.1},  # 1
        {"author": "draft", "p": 0.3, "q": 0.6},  # 2
        *({"author": "draft", "p": 0.5, "q": 0.05} for _ in range(9)),  # 3..11
    ]
    rows = [{"question_id": "q0", "steps": steps}, {"question_id": "q1", "steps": steps[:1]}]
    path = tmp_path / "arith" / "semanticspec-all.jsonl"
    path.parent.mkdir()
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "arith" / "target.jsonl").write_text(json.dumps({"question_id": "q0", "steps": []}) + "\n")
    table = by_depth(tmp_path)
    assert list(table) == ["semanticspec-all"]  # the baselines judge no step
    bins = {b["depth"]: b for b in table["semanticspec-all"]}
    assert list(bins) == ["0", "1", "2", "3-5", "6-9", "10-"]
    assert bins["0"]["n"] == 2 and bins["0"]["accepted"] == 0 and bins["0"]["ratio_ge_1"] == 0
    assert bins["1"]["accepted"] == 1 and bins["1"]["ratio_ge_1"] == 1
    assert bins["2"]["ratio_ge_1"] == 0 and bins["2"]["p"] == 0.3
    assert [bins[k]["n"] for k in ("3-5", "6-9", "10-")] == [3, 4, 2]
    assert bins["10-"]["q"] == 0.05


def test_answers_are_grouped_by_what_the_draft_kept(tmp_path):
    rej, acc, handed = {"author": "target", "p": 0.0}, {"author": "draft", "p": 0.9}, {"author": "target"}
    rows = [
        {"question_id": "q0", "seed": 0, "correct": True, "steps": [rej, handed, handed]},  # no step kept
        {"question_id": "q1", "seed": 0, "correct": False, "steps": [acc, rej, handed]},  # one kept
        {"question_id": "q2", "seed": 0, "correct": True, "steps": [acc, acc]},  # every step, no rejection
        {"question_id": "q3", "seed": 0, "correct": False, "steps": [rej]},
    ]
    (tmp_path / "arith").mkdir()
    (tmp_path / "arith" / "semanticspec-all.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    target = [{"question_id": f"q{i}", "seed": 0, "correct": i in (1, 3)} for i in range(4)]
    (tmp_path / "arith" / "target.jsonl").write_text("".join(json.dumps(r) + "\n" for r in target))
    table = by_kept(tmp_path)["semanticspec-all"]
    assert table["no step"] == {"n": 2, "correct": 1, "target": 1}
    assert table["one step or more"] == {"n": 1, "correct": 0, "target": 1}
    assert table["every step"] == {"n": 1, "correct": 1, "target": 0}
