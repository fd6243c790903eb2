"""SemanticSpec with speculation switched off (a server under load): the target writes every row's next
step alone, as the target alone would; switched on again, each draft first reads what the target wrote."""

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
        assert row.draft_behind and "".join(row.draft_behind) == row.res.text  # the draft read none of it


def test_switched_back_on_each_draft_reads_the_target_steps_first(pair):
    draft, target = pair
    dec = SemanticSpecDecoder(draft, target, lambda h: 1.0, lambda h: 0.5, SETTINGS)
    caught_up, catch_up = [], dec._caught_up

    def checked(rows):
        behind = {r.index: bool(r.draft_behind) for r in rows}
        rows = catch_up(rows)
        for row in rows:  # before it proposes, every draft has read the whole answer so far
            so_far = "".join(s.text for s in row.res.steps)
            assert row.draft.text == draft.format_prompt(QUESTIONS[row.index]) + so_far
            caught_up.append(behind[row.index])
        return rows

    dec._caught_up = checked
    rows = _run(dec, lambda n: setattr(dec, "speculate", n >= 2))  # the first two rounds by the target alone
    assert any(caught_up)  # some drafts had steps to read
    for row in rows:
        assert [s.proposal for s in row.res.steps[:2]] == [None, None]
        assert all(s.author == "target" for s in row.res.steps[:2])
        assert any(s.author == "draft" or s.proposal is not None for s in row.res.steps[2:])  # it speculated
