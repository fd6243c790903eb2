"""Batched decoding: a problem's output in a batch (padded caches, rows leaving and joining) equals its
output alone, token for token; the sampled path keeps its acceptance rate."""

from __future__ import annotations

import math

import pytest
import torch

import semspec.models.lm.step_decoding as step_decoding
from semspec.models.lm import StepStart
from semspec.models.lm.step_decoding import StepWriter
from semspec.models.spec.batching import SingleModelDecoder, decode_all
from semspec.models.spec.proposer import DraftProposer
from semspec.models.spec.semanticspec import SemanticSpecDecoder
from semspec.models.spec.settings import DecodeSettings
from semspec.models.spec.specreason import SpecReasonDecoder
from tests.helpers.tiny import tiny_gemma_lm, tiny_lm

QUESTIONS = [
    "What is 2 + 3?",
    "Add 17 and 25, then double it.",
    "x",
    "A train leaves at noon and travels 60 km/h for three hours. How far does it go?",
    "Sum 1..4",
    "Is 91 prime?",
]


@pytest.fixture(scope="module")
def pair():
    # different tokenizers; the target sometimes ends a problem early (EOS) so rows leave at different rounds
    draft = tiny_lm(merged=True, seed=0, boost=2.0, eos_bias=0.5, init=0.2, max_step_tokens=8)
    target = tiny_lm(merged=False, seed=1, boost=2.0, eos_bias=1.0, hidden=64, init=0.2, max_step_tokens=8)
    return draft, target


def _trace(res):
    return [(s.author, s.text, s.draft_tokens, s.target_tokens, s.proposal, s.salvaged) for s in res.steps]


def _assert_same(batched, alone):
    assert _trace(batched) == _trace(alone)
    assert (batched.text, batched.output_tokens, batched.finish_reason) == (
        alone.text,
        alone.output_tokens,
        alone.finish_reason,
    )
    assert batched.target_prefill_tokens == alone.target_prefill_tokens
    for a, b in zip(batched.steps, alone.steps, strict=True):
        for name in ("p", "q", "u"):
            x, y = getattr(a, name), getattr(b, name)
            assert (x is None) == (y is None) and (x is None or x == pytest.approx(y, abs=1e-4))


def _lengths(results):
    return {r.output_tokens for r in results}


def test_forward_rows_equals_one_row_at_a_time():
    lm = tiny_lm(seed=3)
    texts = ["Q: a\nA:", "Q: a much longer question here\nA:", "Q: mid size\nA:"]
    states = [lm.prefill(t) for t in texts]
    alone = [lm.extend(st.clone(), " step one.\n\n", all_logits=True) for st in states]
    together = lm.extend_many(
        [st.clone() for st in states], [" step one.\n\n", " 2", " three, four"], all_logits=True
    )
    first = lm.extend_many([st.clone() for st in states], [" step one.\n\n"] * 3, all_logits=True)
    for (a_state, a_ids, a_logits, a_hidden), (b_state, b_ids, b_logits, b_hidden) in zip(
        alone, first, strict=True
    ):
        assert a_ids == b_ids and a_state.ids == b_state.ids
        torch.testing.assert_close(a_logits, b_logits, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(a_hidden, b_hidden, atol=1e-4, rtol=1e-4)
        assert b_state.cache.get_seq_length() == len(b_state.ids)
    # ragged new chunks: each row's last logits are its own last position's
    for st, text, (row_state, _, logits, _) in zip(
        states, [" step one.\n\n", " 2", " three, four"], together, strict=True
    ):
        ref = lm.prefill(st.text + text)
        torch.testing.assert_close(logits[-1], ref.logits, atol=1e-4, rtol=1e-4)
        assert row_state.ids == ref.ids


@pytest.mark.parametrize("window", [64, 12])
def test_sliding_window_rows_batch_or_fall_back_to_one_at_a_time(window):
    lm = tiny_gemma_lm(sliding_window=window)
    contexts = ["Q: a\nA:", "Q: something longer\nA:"]
    alone = [lm.decode_steps([StepStart(lm.prefill(c), 6)])[0] for c in contexts]
    together = lm.decode_steps([StepStart(lm.prefill(c), 6) for c in contexts])
    for (a, a_state), (b, b_state) in zip(alone, together, strict=True):
        assert a.token_ids == b.token_ids and a_state.ids == b_state.ids
        torch.testing.assert_close(a_state.logits, b_state.logits, atol=1e-4, rtol=1e-4)


SETTINGS = DecodeSettings(max_new_tokens=40, step_tokens=8, temperature=0.0, seed=3)


def _decoders(draft, target):
    return {
        "target": SingleModelDecoder(target, SETTINGS, "target"),
        "draft": SingleModelDecoder(draft, SETTINGS, "draft"),
        "always-accept": SemanticSpecDecoder(draft, target, lambda h: 0.1, lambda h: 1.0, SETTINGS),
        "always-reject": SemanticSpecDecoder(draft, target, lambda h: 1.0, lambda h: 0.0, SETTINGS),
        "mixed": SemanticSpecDecoder(draft, target, lambda h: 1.0, lambda h: 0.5, SETTINGS),
        "mixed-gamma2": SemanticSpecDecoder(
            draft,
            target,
            lambda h: 1.0,
            lambda h: 0.6,
            DecodeSettings(max_new_tokens=40, step_tokens=8, gamma=2),
        ),
        "specreason": SpecReasonDecoder(
            draft, target, DecodeSettings(max_new_tokens=40, step_tokens=8, accept_threshold=5)
        ),
    }


@pytest.mark.parametrize(
    "name", ["target", "draft", "always-accept", "always-reject", "mixed", "mixed-gamma2", "specreason"]
)
def test_a_batch_of_four_equals_each_problem_alone(pair, name, monkeypatch):
    decoder = _decoders(*pair)[name]
    alone = [decoder.decode(q) for q in QUESTIONS]
    rounds, loops = [], []
    real = decoder._advance
    decoder._advance = lambda rows: (rounds.append(len(rows)), real(rows))[1]
    real_loop = step_decoding.sample_rows

    def spy(*args):
        runs = real_loop(*args)
        loops.append([len(r.samples) for r in runs])
        return runs

    monkeypatch.setattr(step_decoding, "sample_rows", spy)
    seen = []
    batched = decoder.decode_batch(QUESTIONS, batch_size=4, on_result=lambda i, r: seen.append(i))
    del decoder._advance
    if name not in ("target", "specreason"):  # (the tiny target's steps all run to their budget)
        # rows done before the slowest wrote ahead
        assert any(n > decoder.settings.gamma for loop in loops for n in loop), "no row looked ahead"
    for b, a in zip(batched, alone, strict=True):
        _assert_same(b, a)
    assert sorted(seen) == list(range(len(QUESTIONS)))
    assert len(_lengths(alone)) > 1 or len({len(r.steps) for r in alone}) > 1, (
        "rows must finish at different rounds"
    )
    # continuous batching: queued problems joined as rows finished, so the batch stayed full while any waited
    waiting = len(QUESTIONS) - 4
    assert rounds[0] == 4 and max(rounds) == 4
    full_rounds = next(i for i, n in enumerate(rounds) if n < 4) if min(rounds) < 4 else len(rounds)
    assert seen[:waiting] and full_rounds >= 2, "the late problems joined a full batch"
    if name in ("mixed", "mixed-gamma2"):
        authors = {s.author for r in batched for s in r.steps}
        assert authors == {"draft", "target"}, "mixed decisions need accepts and rejects"


def _count_resumed(monkeypatch) -> list[int]:
    """Rows whose loop went on with a step an earlier loop had begun (``StepWriter._resume_partials``), per call."""
    resumed, real = [], StepWriter._resume_partials

    def counting(self, starts):
        out = real(self, starts)
        resumed.extend(i for i, st in enumerate(out) if st.partial is not None)
        return out

    monkeypatch.setattr(StepWriter, "_resume_partials", counting)
    return resumed


@pytest.mark.parametrize("name", ["draft", "always-accept", "mixed"])
def test_sampled_steps_do_not_depend_on_the_batch(pair, name, monkeypatch):
    """Step j of a row samples with its own seed, whether written ahead in a batch or in its own round:
    with float32 models a sampled problem's output in a batch of 4 equals its output alone."""
    draft, target = pair
    s = DecodeSettings(max_new_tokens=40, step_tokens=8, temperature=1.0, top_p=0.95, seed=5, lookahead=3)
    probes = {"always-accept": (lambda h: 0.1, lambda h: 1.0), "mixed": (lambda h: 1.0, lambda h: 0.5)}
    decoder = (
        SingleModelDecoder(draft, s, "draft")
        if name == "draft"
        else SemanticSpecDecoder(draft, target, *probes[name], s)
    )
    alone = [decoder.decode(q) for q in QUESTIONS]
    resumed = _count_resumed(monkeypatch)
    for b, a in zip(decoder.decode_batch(QUESTIONS, batch_size=4), alone, strict=True):
        _assert_same(b, a)
    assert len({r.text for r in alone}) == len(QUESTIONS)
    if name != "mixed":  # (rejections there discard what was written ahead)
        assert resumed, "a sampled step begun in one loop went on in the next, with its own generator"


@pytest.mark.parametrize("probes", ["mixed", "always-accept"])
def test_lookahead_never_changes_an_output(pair, probes, monkeypatch):
    """Rows written ahead give each problem the output it gets alone and without lookahead, whether the
    loop cut a lookahead step short, a later rejection discards it, or the draft wrote it under a budget
    that a round-by-round draft would not have had (two tokenizers count the output differently)."""
    _, target = pair
    # steps of 1 to 8 tokens: rows finish theirs far apart, so lookahead steps are often cut short
    draft = tiny_lm(merged=True, seed=0, boost=0.5, eos_bias=0.5, init=0.2, max_step_tokens=8)
    q, p = {"mixed": (1.0, 0.5), "always-accept": (0.1, 1.0)}[probes]
    dropped, invalid, real, real_valid = [], [], step_decoding.sample_rows, DraftProposer.valid
    monkeypatch.setattr(
        step_decoding,
        "sample_rows",
        lambda *a: (runs := real(*a), dropped.extend(r.dropped for r in runs))[0],
    )
    resumed = _count_resumed(monkeypatch)
    monkeypatch.setattr(DraftProposer, "valid", lambda *a: (ok := real_valid(*a), invalid.append(not ok))[0])
    alone = [
        SemanticSpecDecoder(draft, target, lambda h: q, lambda h: p, DecodeSettings(40, 8, seed=3)).decode(x)
        for x in QUESTIONS
    ]
    for lookahead in (0, 2, 6):
        s = DecodeSettings(max_new_tokens=40, step_tokens=8, seed=3, lookahead=lookahead)
        dec = SemanticSpecDecoder(draft, target, lambda h: q, lambda h: p, s)
        for b, a in zip(dec.decode_batch(QUESTIONS, batch_size=4), alone, strict=True):
            _assert_same(b, a)
    assert any(dropped), "some lookahead step was under way when its loop ended"
    if probes == "always-accept":
        assert any(invalid), "some step was written ahead under another budget"
        assert resumed, "a later loop went on with a step that an earlier loop had begun"
    with pytest.raises(ValueError, match="lookahead"):
        DecodeSettings(lookahead=-1)


def test_rejected_rows_wait_to_share_the_target_s_rewrite(pair, monkeypatch):
    """Rejected rows may wait a few rounds so the target rewrites several in one decode loop: fewer loops,
    and every problem's output unchanged."""
    draft, target = pair
    loops, real = [], SemanticSpecDecoder._rewrite
    monkeypatch.setattr(
        SemanticSpecDecoder, "_rewrite", lambda self, items: (loops.append(len(items)), real(self, items))[1]
    )
    alone = [
        SemanticSpecDecoder(
            draft, target, lambda h: 1.0, lambda h: 0.8, DecodeSettings(40, 8, seed=3)
        ).decode(x)
        for x in QUESTIONS
    ]
    counts = {}
    for wait in (0, 3):
        loops.clear()
        s = DecodeSettings(max_new_tokens=40, step_tokens=8, seed=3, rewrite_wait=wait)
        dec = SemanticSpecDecoder(draft, target, lambda h: 1.0, lambda h: 0.8, s)
        for b, a in zip(dec.decode_batch(QUESTIONS, batch_size=4), alone, strict=True):
            _assert_same(b, a)
        counts[wait] = (len(loops), sum(loops))
    assert counts[3][1] == counts[0][1], "the same steps were rewritten"
    assert counts[3][0] < counts[0][0], "waiting rows shared rewrite loops"
    with pytest.raises(ValueError, match="rewrite_wait"):
        DecodeSettings(rewrite_wait=-1)


def test_streaming_callbacks_see_each_problem_s_own_steps(pair):
    decoder = _decoders(*pair)["mixed"]
    streamed: dict[int, list] = {}
    results = decoder.decode_batch(
        QUESTIONS[:3], batch_size=3, on_step=lambda i, s: streamed.setdefault(i, []).append(s.text)
    )
    assert [streamed[i] for i in range(3)] == [[s.text for s in r.steps] for r in results]


def test_decode_all_runs_token_level_decoders_one_at_a_time(pair):
    _, target = pair

    class OneAtATime:
        method = "one"

        def __init__(self):
            self.calls = []

        def decode(self, question, on_step=None):
            self.calls.append(question)
            return SingleModelDecoder(target, SETTINGS, "target").decode(question)

    dec = OneAtATime()
    got = []
    results = decode_all(dec, QUESTIONS[:3], batch_size=8, on_result=lambda i, r: got.append(i))
    assert dec.calls == QUESTIONS[:3] and got == [0, 1, 2] and len(results) == 3


def test_bad_batch_size(pair):
    with pytest.raises(ValueError, match="batch_size"):
        _decoders(*pair)["target"].decode_batch(QUESTIONS, batch_size=0)


def test_sampling_keeps_the_acceptance_rate_in_a_batch(pair):
    """Sampled steps and content-dependent probes: the acceptance rate over many problems is the same
    in a batch of 4 as one at a time (a two-proportion z-test at 3.5 sigma)."""
    draft, target = pair
    settings = DecodeSettings(max_new_tokens=24, step_tokens=6, temperature=1.0, top_p=0.95, seed=0)

    def p_probe(pooled):
        return float(torch.sigmoid(pooled.h_last.sum() * 4.0))

    questions = [f"Problem {i}: add {i} and {2 * i}." for i in range(24)]
    rates = []
    for batch_size in (1, 4):
        accepted = proposed = 0
        for seed in range(3):
            s = DecodeSettings(**{**settings.__dict__, "seed": seed})
            dec = SemanticSpecDecoder(draft, target, lambda h: 0.6, p_probe, s)
            for res in dec.decode_batch(questions, batch_size=batch_size):
                steps = [st for st in res.steps if st.author == "draft" or st.proposal is not None]
                proposed += len(steps)
                accepted += sum(st.author == "draft" for st in steps)
        rates.append((accepted, proposed))
    (a1, n1), (a4, n4) = rates
    assert n1 > 100 and n4 > 100
    p = (a1 + a4) / (n1 + n4)
    assert 0.1 < p < 0.9, "the probes must accept some steps and reject others"
    z = abs(a1 / n1 - a4 / n4) / math.sqrt(p * (1 - p) * (1 / n1 + 1 / n4))
    assert z < 3.5


def test_each_problem_s_share_of_the_machine_adds_up_to_the_wall_time(pair):
    import time

    decoder = _decoders(*pair)["mixed"]
    t0 = time.perf_counter()
    results = decoder.decode_batch(QUESTIONS, batch_size=3)
    wall = time.perf_counter() - t0
    shares = [r.timings.share for r in results]
    assert sum(shares) == pytest.approx(wall, rel=0.05)
    assert all(0 < r.timings.share < r.timings.total for r in results), (
        "in a batch a problem waits for others"
    )
    alone = decoder.decode(QUESTIONS[0])
    assert alone.timings.share == pytest.approx(alone.timings.total, rel=0.05)


@pytest.mark.parametrize("gamma", [1, 2])
@pytest.mark.parametrize("pooling", ["predict", "tokens"])
def test_probes_read_what_a_prefill_of_the_proposal_pools(pooling, gamma):
    """Whatever the pooling, the draft's probe reads what a prefill of its proposal would pool (though
    batched decoding wrote it, often ahead, and a ``tokens`` step's last output came from the next
    step's loop or the final feed), and the target's probe what its prefill of the proposal pools (also
    when it read a round's gamma proposals in one prefill)."""
    kw = {"boost": 2.0, "init": 0.2, "max_step_tokens": 8, "pooling": pooling}
    draft = tiny_lm(seed=0, eos_bias=0.5, **kw)  # one character tokenizer: every text re-tokenises alike
    target = tiny_lm(seed=1, eos_bias=1.0, hidden=64, **kw)
    for lm in (draft, target):  # ... once no model writes <s> or <pad> (their text is empty)
        with torch.no_grad():
            lm.model.lm_head.bias[list(set(lm.tokenizer.all_special_ids) - lm.eos_ids)] = -1e4

    def q_probe(pooled):
        return float(torch.sigmoid(pooled.h_mean.sum() * 4.0))

    def p_probe(pooled):
        return float(torch.sigmoid(pooled.h_last.sum()))

    s = DecodeSettings(max_new_tokens=40, step_tokens=8, seed=3, lookahead=3, gamma=gamma)
    results = SemanticSpecDecoder(draft, target, q_probe, p_probe, s).decode_batch(QUESTIONS, batch_size=4)
    checked = 0
    for question, res in zip(QUESTIONS, results, strict=True):
        written = ""
        for st in res.steps:
            proposal = st.proposal if st.proposal is not None else st.text
            if st.q is not None and proposal:
                ctx = draft.format_prompt(question) + written
                assert st.q == pytest.approx(q_probe(draft.score_step(ctx, proposal).pooled), abs=1e-4)
                assert st.p == pytest.approx(p_probe(target.score_step(ctx, proposal).pooled), abs=1e-4)
                checked += 1
            written += st.text
    assert checked > 10
    assert {st.author for r in results for st in r.steps} == {"draft", "target"}
