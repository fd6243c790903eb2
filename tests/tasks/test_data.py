"""Loaders, bad-input handling, the arithmetic generator, step splitting and prefixes."""

from __future__ import annotations

import io
import json
import random
import re
import zipfile

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from semspec.models.spec.steps import split_steps
from semspec.tasks import data as D
from semspec.tasks import sources as S

EXPECTED = {"s1k": 1000, "math500": 500, "aime24": 30, "amc23": 40, "gpqa": 198}


@pytest.mark.parametrize("name", list(EXPECTED))
def test_every_loader_reads_the_local_copy(data_dir, name):
    rep = S.LOADERS[name](data_dir=data_dir)
    assert len(rep) == EXPECTED[name] and not rep.skipped
    ids = [p.question_id for p in rep.problems]
    assert len(set(ids)) == len(ids), "question ids must be unique"
    for p in rep.problems:
        assert p.source == name and p.question.strip()
        if name != "s1k":
            assert p.answer.strip()


def test_numeric_answers_are_normalised(data_dir):
    amc = S.load_amc23(data_dir=data_dir).problems
    assert all(not a.answer.endswith(".0") for a in amc)
    aime = S.load_aime24(data_dir=data_dir).problems
    assert all(a.answer.isdigit() for a in aime)


def test_gpqa_shuffles_choices_with_a_fixed_seed(data_dir):
    a = S.load_gpqa(data_dir=data_dir).problems
    b = S.load_gpqa(data_dir=data_dir).problems
    assert [p.answer for p in a] == [p.answer for p in b]
    letters = {p.answer for p in a}
    assert letters == set("ABCD"), "correct answers should not all share one letter after shuffling"
    for p in a[:20]:
        assert len(p.choices) == 4 and f"({p.answer}) {p.choices['ABCD'.index(p.answer)]}" in p.question


def test_gpqa_letter_points_at_the_correct_answer():
    row = {
        "Question": "Pick",
        "Correct Answer": "right",
        "Record ID": "r1",
        **{f"Incorrect Answer {k}": f"wrong{k}" for k in (1, 2, 3)},
    }
    p = S.gpqa_problem(1, row)
    assert p.choices["ABCD".index(p.answer)] == "right"
    letters = {S.gpqa_problem(1, {**row, "Record ID": f"r{i}"}).answer for i in range(40)}
    assert len(letters) == 4


def test_gpqa_bad_zip_is_a_clear_error(tmp_path):
    (tmp_path / "gpqa").mkdir()
    (tmp_path / "gpqa" / "gpqa_diamond.zip").write_bytes(b"not a zip")
    with pytest.raises(ValueError, match="not a zip"):
        S.load_gpqa(data_dir=tmp_path)
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("readme.txt", "no csv")
    (tmp_path / "gpqa" / "gpqa_diamond.zip").write_bytes(buf.getvalue())
    with pytest.raises(ValueError, match="no CSV"):
        S.load_gpqa(data_dir=tmp_path)


def _write_math(tmp_path, lines: list[bytes]):
    (tmp_path / "math500").mkdir(exist_ok=True)
    f = tmp_path / "math500" / "test.jsonl"
    f.write_bytes(b"\n".join(lines) + b"\n")
    return f


GOOD = json.dumps({"problem": "1+1?", "answer": "2", "unique_id": "a"}).encode()


@pytest.mark.parametrize(
    "bad, msg",
    [
        (b'{"problem": "x", "answer": ', "malformed JSON"),
        (json.dumps({"problem": "no answer"}).encode(), "missing field 'answer'"),
        (b'{"problem": "caf\xe9", "answer": "1"}', "not valid UTF-8"),
        (b"[1, 2]", "expected a JSON object"),
    ],
)
def test_bad_rows_raise_naming_file_and_line(tmp_path, bad, msg):
    f = _write_math(tmp_path, [GOOD, bad, GOOD.replace(b'"a"', b'"c"')])
    with pytest.raises(ValueError, match=re.escape(f"{f}:2: ") + ".*" + re.escape(msg)):
        S.load_math500(data_dir=tmp_path)
    rep = S.load_math500(data_dir=tmp_path, on_error="skip")
    assert len(rep) == 2 and len(rep.skipped) == 1 and rep.skipped[0].startswith(f"{f}:2:")


def test_empty_and_missing_files(tmp_path):
    _write_math(tmp_path, [b"", b"  "])
    with pytest.raises(ValueError, match="empty"):
        S.load_math500(data_dir=tmp_path)
    with pytest.raises(ValueError, match="file not found"):
        S.load_aime24(data_dir=tmp_path)
    with pytest.raises(ValueError, match="does not exist"):
        S.load_aime24(data_dir=tmp_path / "nope")
    with pytest.raises(ValueError, match="on_error"):
        S.load_math500(data_dir=tmp_path, on_error="ignore")


def test_all_rows_bad_is_an_error_even_when_skipping(tmp_path):
    _write_math(tmp_path, [b"{", b"}"])
    with pytest.raises(ValueError, match="no usable rows"):
        S.load_math500(data_dir=tmp_path, on_error="skip")


def test_s1k_uses_trace_and_cot_type_when_present(tmp_path):
    (tmp_path / "s1k").mkdir()
    rows = [
        {
            "question": "q1",
            "solution": "so \\boxed{3}",
            "cot_type": "math",
            "thinking_trajectories": ["a\n\nb"],
        },
        {"question": "q2", "solution": "text", "deepseek_thinking_trajectory": "c\n\nd"},
        {"question": "q3", "solution": "plain"},
    ]
    (tmp_path / "s1k" / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    p = S.load_s1k(data_dir=tmp_path).problems
    assert (p[0].domain, p[0].trace, p[0].answer) == ("math", "a\n\nb", "3")
    assert (p[1].domain, p[1].trace) == ("unknown", "c\n\nd")
    assert p[2].trace is None


def test_a_domain_filter_on_s1k_without_cot_type_names_the_column(tmp_path):
    from semspec.tasks.config import IngestConfig
    from semspec.tasks.ingest import select_problems

    (tmp_path / "s1k").mkdir()
    rows = [{"question": f"q{i}", "solution": "s"} for i in range(3)]
    (tmp_path / "s1k" / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    cfg = IngestConfig(source="s1k", domains=["math"], data_dir=str(tmp_path))
    with pytest.raises(ValueError, match="'cot_type' column"):
        select_problems(cfg)
    cfg.domains = None
    assert len(select_problems(cfg)) == 3


def test_several_sources_each_give_their_questions_with_the_source_as_domain(data_dir):
    """ingest.source [arith, math500] with domain_by source: two domains offline (the paper's 5.4 study),
    max_questions from each source; with domain_by data both are 'math'."""
    from semspec.tasks.config import IngestConfig
    from semspec.tasks.ingest import select_problems, source_fingerprint

    cfg = IngestConfig(
        source=["arith", "math500"], domain_by="source", max_questions=3, data_dir=str(data_dir)
    )
    probs = select_problems(cfg)
    assert [p.domain for p in probs] == ["arith"] * 3 + ["math500"] * 3
    assert all(p.solution for p in probs) and len({p.question_id for p in probs}) == 6
    assert {p.domain for p in select_problems(IngestConfig(**{**cfg.__dict__, "domain_by": "data"}))} == {
        "math"
    }
    assert source_fingerprint(cfg).startswith("generated:arith,md5:")


# ----------------------------------------------------------------------------- arithmetic generator
def test_arith_train_and_test_never_share_a_problem():
    train = D.generate_arith(400, "train", seed=0)
    test = D.generate_arith(100, "test", seed=0)
    test_other_seed = D.generate_arith(100, "test", seed=5)
    tq = {p.question for p in train}
    assert len(tq) == 400
    assert not tq & {p.question for p in test}
    assert not tq & {p.question for p in test_other_seed}


def test_arith_is_seeded_and_its_solutions_are_exact():
    a, b = D.generate_arith(30, "train", seed=3), D.generate_arith(30, "train", seed=3)
    assert [p.question for p in a] == [p.question for p in b]
    assert [p.question for p in a] != [p.question for p in D.generate_arith(30, "train", seed=4)]
    for p in a:
        steps = split_steps(p.solution)
        assert 3 <= len(steps) <= 6
        for expr, rhs in re.findall(r"(\d+(?: [-+*/] \d+)+) = (\d+)", p.solution):
            assert eval(expr.replace("/", "//")) == int(rhs), (expr, rhs)
        assert f"\\boxed{{{p.answer}}}" in steps[-1]


def test_arith_bad_arguments():
    with pytest.raises(ValueError, match="split"):
        D.generate_arith(1, "dev")
    with pytest.raises(ValueError, match="n must"):
        D.generate_arith(-1)


# ----------------------------------------------------------------------------- steps and prefixes
def test_split_steps_paragraph_and_sentence():
    text = "First 3.5 apples.\n\n\n  \nSecond: x! Third?\n \nLast"
    assert split_steps(text) == ["First 3.5 apples.", "Second: x! Third?", "Last"]
    assert split_steps(text, "sentence") == ["First 3.5 apples.", "Second: x!", "Third?", "Last"]
    with pytest.raises(ValueError, match="split_strategy"):
        split_steps(text, "words")


def test_build_prefixes_contexts_and_limits():
    prob = D.generate_arith(1, "train")[0]
    steps = split_steps(prob.solution)
    pre = D.build_prefixes(prob, steps)
    assert [p.step_index for p in pre] == list(range(len(steps)))
    assert pre[0].context == "" and pre[2].context == steps[0] + "\n\n" + steps[1] + "\n\n"
    assert len({p.prefix_id for p in pre}) == len(pre)
    few = D.build_prefixes(prob, steps, max_prefixes=2, rng=random.Random(1))
    assert len(few) == 2 and few[0].step_index < few[1].step_index
    assert D.build_prefixes(prob, ["s"] * 200) == []
    assert D.build_prefixes(prob, []) == []


@settings(max_examples=300, deadline=None)
@given(st.text(), st.sampled_from(["paragraph", "sentence"]))
def test_step_splitting_never_raises_and_loses_nothing(text, strategy):
    steps = split_steps(text, strategy)
    assert all(s and s == s.strip() for s in steps)
    assert "".join("".join(steps).split()) == "".join(text.split())
