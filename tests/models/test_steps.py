"""What a step is: one rule for ingest (``split_steps``), the decoders' stop rule (``step_end``) and the
contexts (``joiner``), under both split strategies."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from semspec.models.spec.steps import joiner, split_steps, step_end
from tests.helpers.tiny import boost_tokens, char_tokenizer, tiny_lm


def test_step_end_paragraph_and_sentence():
    assert step_end("x = 3.5 so", "paragraph") is None
    assert step_end("x = 3.\n\nThen", "paragraph") == len("x = 3.\n\n")
    assert step_end("x = 3.\n  \nThen", "paragraph") == len("x = 3.\n  \n"), "spaces on the blank line"
    assert step_end("x = 3.\n\n\nThen", "paragraph") == len("x = 3.\n\n\n")
    assert step_end("x = 3.\n\n\nThen", "paragraph", "\n\n\n") == len("x = 3.\n\n\n")
    assert step_end("x\n\ny", "paragraph", "\n---\n") is None, "another delimiter is matched as written"
    # a sentence ends at . ? ! followed by whitespace, once the next step's first character is there
    assert step_end("It costs 3.5 dollars", "sentence") is None
    assert step_end("It costs 3.5 dollars. ", "sentence") is None
    assert step_end("It costs 3.5 dollars.  So", "sentence") == len("It costs 3.5 dollars.  ")
    assert step_end("Why? Because", "sentence") == len("Why? ")
    assert step_end("a blank line\n\nends it too", "sentence") == len("a blank line\n\n")
    assert joiner("paragraph") == "\n\n" and joiner("sentence") == " "
    # the number that opens a list item is no sentence end (models write "1. First, ..."); a number that
    # ends a sentence inside a line is
    assert step_end("1. ", "sentence") is None and step_end("1. Omar", "sentence") is None
    assert step_end("  12. Omar has 2. So", "sentence") == len("  12. Omar has 2. ")
    assert step_end("He has 1. So", "sentence") == len("He has 1. ")
    assert step_end("1.\n\nSo", "sentence") == len("1.\n\n"), "a blank line always ends a step"
    chain = "1. Omar has 2 boxes. So 2 * 6 = 12.\n2. Then 3.5 more. Done!"
    assert split_steps(chain, "sentence") == [
        "1. Omar has 2 boxes.",
        "So 2 * 6 = 12.",
        "2. Then 3.5 more.",
        "Done!",
    ]
    with pytest.raises(ValueError, match="split_strategy"):
        step_end("x. y", "words")


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="ab3.5?! \n", max_size=40), st.sampled_from(["paragraph", "sentence"]))
def test_the_decoders_first_step_is_ingests_first_step(text, strategy):
    """Where the stop rule ends a generated text's first step, ingest's split finds the same step."""
    cut = step_end(text, strategy)
    if cut is None or not text[:cut].strip():
        return
    assert split_steps(text[:cut], strategy) == [text[:cut].strip()]
    assert split_steps(text, strategy)[0] == text[:cut].strip()


def test_lm_stops_at_a_sentence_end_in_sentence_mode():
    """With '.' and ' ' boosted, the tiny model writes sentences: in sentence mode each step ends at its
    first sentence end (text cut before the next step's first character); in paragraph mode it goes on."""
    tok = char_tokenizer()
    steps = {}
    for split in ("sentence", "paragraph"):
        lm = tiny_lm(max_step_tokens=40)
        boost_tokens(lm.model, tok.convert_tokens_to_ids([".", " "]), 3.0)
        lm.config.split = split
        steps[split] = lm.generate_step("Q: 1+1? A:", n=8, temperature=1.0, top_p=1.0, seed=0)
    ended = [s for s in steps["sentence"] if s.finish_reason == "delimiter"]
    assert len(ended) >= 4
    for s in ended:
        assert s.text.rstrip()[-1] in ".!?" and s.text != s.text.rstrip()
        assert split_steps(s.text, "sentence") == [s.text.strip()]
        assert len(s.token_ids) > len(tok(s.text, add_special_tokens=False)["input_ids"])  # one past the end
    assert all(s.finish_reason != "delimiter" for s in steps["paragraph"])
