"""What a decoder keeps of a row between rounds is its own: a rewrite it owes waits in the decoder, not on
the row; a row leaves through ``hand_over`` or ``release``, and nothing of a finished or failed call stays."""

from __future__ import annotations

import pytest

from semspec.models.spec.batching import Job
from semspec.models.spec.semanticspec import SemanticSpecDecoder
from semspec.models.spec.settings import DecodeSettings
from tests.helpers.tiny import tiny_lm

QUESTIONS = ["What is 2 + 3?", "Add 17 and 25, then double it.", "Is 91 prime?"]


@pytest.fixture(scope="module")
def pair():
    draft = tiny_lm(merged=True, seed=0, boost=2.0, eos_bias=-2.0, init=0.2, max_step_tokens=8)
    target = tiny_lm(merged=False, seed=1, boost=2.0, eos_bias=-2.0, hidden=64, init=0.2, max_step_tokens=8)
    return draft, target


def _decoder(pair, ps):
    """SemanticSpec whose target probe gives the values of ``ps`` in turn (q = 0.5: p 0 rejects, 0.9
    keeps), with rejected rows waiting up to 5 rounds for a shared rewrite."""
    values = iter(ps)
    s = DecodeSettings(max_new_tokens=40, step_tokens=8, seed=3, rewrite_wait=5)
    return SemanticSpecDecoder(*pair, lambda h: 0.5, lambda h: next(values), s)


def test_a_rejected_row_waits_in_its_decoder_and_stays_when_the_others_are_handed_over(pair):
    dec = _decoder(pair, [0.0, 0.9, 0.9] + [0.9] * 100)  # the first row's first step is rejected
    rows = dec.admit([Job(i, q) for i, q in enumerate(QUESTIONS)])
    dec.round(rows)
    assert [dec.waiting(r) for r in rows] == [True, False, False], "one of three waits: no rewrite yet"
    assert not any(hasattr(r, "queued") for r in rows), "the row carries no decoder's state"
    moved = dec.hand_over(rows)
    assert moved == rows[1:] and all(r.draft is None for r in moved), "the draft reads no more of them"
    assert rows[0].draft is not None and dec.waiting(rows[0]), "a waiting row leaves after its rewrite"
    dec.release([rows[0]])
    assert not dec.waiting(rows[0]), "a released row is forgotten"


def test_a_call_leaves_nothing_of_its_rows_behind(pair):
    dec = _decoder(pair, [0.0, 0.9] * 200)
    results = dec.decode_batch(QUESTIONS, batch_size=3)
    assert any(s.proposal is not None for r in results for s in r.steps), "this test needs a rewrite"
    assert not dec._owed, "finished rows are released"
    failing = _decoder(pair, [0.0, 0.9, 0.9])  # the probe runs dry after the first round: the call fails
    with pytest.raises(StopIteration):
        failing.decode_batch(QUESTIONS, batch_size=3)
    assert not failing._owed, "a failed call's rows are released too"


def test_charged_adds_a_call_s_time_to_each_row_it_was_given():
    """``charged`` declares what a model call's time is: every row passed in waited for all of it; with
    ``role`` the call's role argument names the phase; a function without rows, or a phase that is not one,
    cannot be charged."""
    import time
    from dataclasses import fields
    from types import SimpleNamespace

    from semspec.models.spec.results import PHASES, Timings, charged

    assert set(PHASES) == {f.name for f in fields(Timings)} - {"total", "share"}, "a phase is a Timings field"

    def row() -> SimpleNamespace:
        return SimpleNamespace(res=SimpleNamespace(timings=Timings()))

    @charged("verify")
    def read(rows: list, pause: float) -> int:
        time.sleep(pause)
        return len(rows)

    @charged("role")
    def write(row: SimpleNamespace, role: str) -> None:
        time.sleep(0.01)

    a, b, c = row(), row(), row()
    assert read([a, b], 0.02) == 2
    assert a.res.timings.verify >= 0.02 and a.res.timings.verify == b.res.timings.verify
    assert c.res.timings.verify == 0.0 and a.res.timings.draft == 0.0
    write(c, role="draft")
    assert c.res.timings.draft >= 0.01 and c.res.timings.target == 0.0
    with pytest.raises(TypeError, match="rows"):
        charged("draft")(lambda states: None)
    with pytest.raises(TypeError, match="a phase is"):
        charged("verfy")  # a misspelt phase is refused where it is declared, not at the first call

    @charged("probe")
    def fails(rows: list) -> None:
        raise RuntimeError("the model call failed")

    with pytest.raises(RuntimeError, match="the model call failed"):
        fails([a])
    assert a.res.timings.probe > 0.0  # a failed call's time is charged too
    with pytest.raises(TypeError):  # a call that cannot bind fails as the call would, before it runs
        fails()
