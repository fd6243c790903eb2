"""Answer extraction and equivalence (math-verify plus our additions)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from semspec.models.spec.grading import extract_answer, grade, is_equiv, last_boxed

# (gold, prediction): equivalent pairs, checked in both directions
EQUIVALENT = [
    ("\\frac{1}{2}", "0.5"),
    ("\\frac{1}{2}", "1/2"),
    ("\\dfrac{3}{4}", "\\frac34"),
    ("\\tfrac{2}{3}", "2/3"),
    ("0.3333333", "0.33333"),
    ("25", "025"),
    ("7", "007"),
    ("1000", "1,000"),
    ("1000", "1000.0"),
    ("27", "27.0"),
    ("\\sqrt{2}/2", "\\frac{\\sqrt{2}}{2}"),
    ("2\\sqrt{3}", "\\sqrt{12}"),
    ("\\pi", "3.14159265"),
    ("2\\pi", "6.2831853"),
    ("\\frac{\\pi}{4}", "\\pi/4"),
    ("(1,2)", "(1, 2)"),
    ("(3, -1)", "\\left(3,-1\\right)"),
    ("[0,1)", "[0, 1)"),
    ("(-\\infty, 2]", "(-\\infty,2]"),
    ("50\\%", "50"),
    ("12.5\\%", "12.5"),
    ("30^\\circ", "30"),
    ("45^{\\circ}", "45"),
    ("10\\text{ cm}", "10"),
    ("\\$5", "5"),
    ("x=3", "3"),
    ("\\text{Evelyn}", "Evelyn"),
    ("\\text{(C)}", "(C)"),
    ("x^2+2x+1", "(x+1)^2"),
    ("2x+3", "3+2x"),
    ("\\frac{a}{b}", "a/b"),
    ("-\\frac{1}{3}", "-1/3"),
    ("\\frac{-1}{3}", "-\\frac{1}{3}"),
    ("3\\sqrt{2}", "\\sqrt{18}"),
    ("1.5", "\\frac{3}{2}"),
    ("100", "1e2"),
    ("0.0001", "1/10000"),
    ("1234567", "1234567.0001"),
    ("\\infty", "\\infty"),
    ("\\{1,2,3\\}", "\\{3,2,1\\}"),
    ("5", "5."),
    ("\\mathrm{5}", "5"),
    ("3/2", "1\\frac{1}{2}"),
]

# pairs that must NOT be equal, in both directions
DIFFERENT = [
    ("\\frac{1}{2}", "0.4"),
    ("25", "52"),
    ("(1,2)", "(2,1)"),
    ("[0,1)", "[0,1]"),
    ("\\sqrt{2}", "2"),
    ("2\\pi", "\\pi"),
    ("x+1", "x-1"),
    ("10", "10.01"),
    ("1000", "1001"),
    ("-3", "3"),
    ("\\text{Evelyn}", "Bob"),
    ("0.001", "0.002"),
]


@pytest.mark.parametrize("gold, pred", EQUIVALENT)
def test_equivalent_both_directions(gold, pred):
    assert is_equiv(gold, pred), f"{gold!r} should equal {pred!r}"
    assert is_equiv(pred, gold), f"{pred!r} should equal {gold!r}"


@pytest.mark.parametrize("gold, pred", DIFFERENT)
def test_different_both_directions(gold, pred):
    assert not is_equiv(gold, pred)
    assert not is_equiv(pred, gold)


def test_at_least_sixty_equivalence_cases():
    assert 2 * (len(EQUIVALENT) + len(DIFFERENT)) >= 60


@pytest.mark.parametrize(
    "text, expected",
    [
        ("so \\boxed{5}.", "5"),
        ("\\boxed{\\frac{1}{2}} and later \\boxed{\\frac{3}{4}}", "\\frac{3}{4}"),
        ("nested \\boxed{\\{1, \\{2\\}\\}}", "\\{1, \\{2\\}\\}"),
        ("\\boxed{x^{2}+\\sqrt{y_{1}}}", "x^{2}+\\sqrt{y_{1}}"),
        ("\\fbox{7}", "7"),
        ("\\boxed 9 is it", "9"),
        ("\\boxed{3} then unbalanced \\boxed{4", "3"),
        ("no box here", None),
    ],
)
def test_last_boxed(text, expected):
    assert last_boxed(text) == expected


@pytest.mark.parametrize(
    "text, bench, expected",
    [
        ("Therefore the answer is 42.", "math", "42"),
        ("The answer is: $\\frac{1}{2}$.\nDone", "math", "\\frac{1}{2}"),
        ("So the final answer is \\boxed{12}. The answer is 13.", "math", "12"),
        ("The answer is (B).", "gpqa", "B"),
        ("\\boxed{C}", "gpqa", "C"),
        ("\\boxed{\\text{(D)}}", "gpqa", "D"),
        ("I pick (A) over (C), final: (C)", "gpqa", "C"),
        ("The answer is 42", "gpqa", None),
        ("", "math", None),
    ],
)
def test_extract_answer(text, bench, expected):
    assert extract_answer(text, bench) == expected


def test_letters_for_gpqa():
    assert grade("gpqa", "B", "Thus the answer is \\boxed{B}.") == ("B", True)
    assert grade("gpqa", "B", "answer is (b)")[1]
    assert not grade("gpqa", "B", "\\boxed{A}")[1]
    assert grade("gpqa", "D", "D")[1]


def test_grade_completion_and_bare_answers():
    assert grade("math500", "\\frac{1}{2}", "We get $x = 1/2$, so \\boxed{0.5}.") == ("0.5", True)
    assert grade("aime24", "025", "\\boxed{25}")[1]
    assert grade("arith", "96", "96")[1]
    assert not grade("amc23", "27", "no answer at all in this long completion\nreally")[1]
    with pytest.raises(ValueError, match="unknown benchmark"):
        grade("nope", "1", "1")


def test_every_math500_reference_solution_grades_correct(data_dir):
    from semspec.tasks.sources import load_math500

    problems = load_math500(data_dir=data_dir).problems
    assert len(problems) == 500
    wrong = [p.question_id for p in problems if not grade("math500", p.answer, p.solution)[1]]
    assert not wrong, f"{len(wrong)} of 500 self-checks failed, e.g. {wrong[:5]}"


@pytest.mark.parametrize(
    "completion, correct",
    [
        ("an answer: about 6 and 7", False),  # names two candidates: committed to neither
        ("my answer here, about 6 and 7", False),
        ("The answer is 6 or 7.", False),
        ("The answer is about 6.", False),
        ("answer 6 7", False),
        ("The answer is 6.", True),
        ("Final answer: 6", True),
        ("answer: $6$", True),
        ("So x = 3 and the answer is \\boxed{6}.", True),
        ("6", True),
        ("x = 6", True),
    ],
)
def test_only_one_committed_expression_is_an_answer(completion, correct):
    assert grade("math500", "6", completion)[1] is correct


@settings(max_examples=300, deadline=None)
@given(st.text(), st.sampled_from(["math", "gpqa"]))
def test_no_string_breaks_extraction(text, bench):
    extract_answer(text, bench)  # never raises
    assert extract_answer("", bench) is None


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.characters(blacklist_characters="{}\\"), min_size=1).filter(lambda t: t.strip()))
def test_a_boxed_answer_comes_back_whole(content):
    assert extract_answer(f"so we get \\boxed{{{content}}} at the end") == content.strip()


@settings(max_examples=100, deadline=None)
@given(st.text(max_size=200), st.text(max_size=40))
def test_grading_never_raises(completion, gold):
    grade("math500", gold or "1", completion)
