"""SemanticSpec with speculation switched off (a server under load): the target writes every row's next
steps alone, as the target alone would, and such a row finishes that way; rows that join later speculate
beside it."""

from __future__ import annotations

import pytest

from semspec.models.decoding import DecodeSettings, Job, SemanticSpecDecoder, SingleModelDecoder
from tests.helpers.tiny import tiny_lm

QUESTIONS = ["What is 2 + 3?", "Add 17 and 25, then double it.", "Is 91 prime?"]
SETTINGS = DecodeSettings(max_new_tokens=40, gamma=2)


@pytest.fixture(scope="module")
def pair():
    draft = tiny_lm(merged=True, seed=0, boost=2.0, eos_bias=-2.0, init=0.2, max_step_tokens=8)
    target = tiny_lm(merged=False, seed=1, boost=2.0, eos_bias=-2.0, hidden=64, init=0.2, max_step_tokens=8)
    return draft, target


def _run(dec, switch) -> list:
    """Decode QUESTIONS together, calling ``switch(round)`` before each round."""
    live, done, n = dec.admit([Job(i, q) for i, q in enumerate(QUESTIONS)]), {}, 0
    while live:
        switch(n)
        for row in dec.step(live):
            done[row.index] = row
        live, n = [r for r in live if r.index not in done], n + 1
    return [done[i] for i in range(len(QUESTIONS))]


def test_without_speculation_the_target_writes_what_it_writes_alone(pair):
    draft, target = pair
    dec = SemanticSpecDecoder(draft, target, lambda h: 1.0, lambda h: 0.5, SETTINGS)
    rows = _run(dec, lambda n: setattr(dec, "speculate", False))
    alone = SingleModelDecoder(target, SETTINGS).decode_batch(QUESTIONS, batch_size=3)
    for row, ref in zip(rows, alone, strict=True):
        assert row.res.text == ref.text
        assert all(s.author == "target" and s.proposal is None for s in row.res.steps)
        assert row.solo


def test_a_row_that_ran_alone_finishes_alone_and_new_rows_speculate_beside_it(pair):
    draft, target = pair
    dec = SemanticSpecDecoder(draft, target, lambda h: 1.0, lambda h: 0.5, SETTINGS)
    live = dec.admit([Job(i, q) for i, q in enumerate(QUESTIONS[:2])])
    dec.speculate = False
    dec.step(live)  # a full batch: one round by the target alone
    dec.speculate = True
    live += dec.admit([Job(2, QUESTIONS[2])])
    done = {}
    while live:
        for row in dec.step(live):
            done[row.index] = row
        live = [r for r in live if r.index not in done]
    alone = SingleModelDecoder(target, SETTINGS).decode_batch(QUESTIONS[:2], batch_size=2)
    for i in (0, 1):
        assert done[i].solo and done[i].res.text == alone[i].text
        assert all(s.author == "target" and s.proposal is None for s in done[i].res.steps)
    assert not done[2].solo
    assert any(s.author == "draft" or s.proposal is not None for s in done[2].res.steps)  # it speculated
