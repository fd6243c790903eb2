"""Decoder invariants with tiny models (greedy): always-reject = target, always-accept = draft,
cache consistency across accepts and rejects, different tokenizers on the two sides."""

from __future__ import annotations

import pytest
import torch

from semspec.models.lm import StepStart
from semspec.models.lm.forward import Forwards
from semspec.models.lm.scoring import Scorer
from semspec.models.spec.batching import SingleModelDecoder
from semspec.models.spec.semanticspec import SemanticSpecDecoder
from semspec.models.spec.settings import DecodeSettings
from semspec.models.spec.specreason import SpecReasonDecoder
from tests.helpers.tiny import tiny_lm

Q = "What is 2 + 3?"


@pytest.fixture(scope="module")
def pair():
    # different tokenizers: the draft has tokens carrying the delimiter, the target is character-level
    draft = tiny_lm(merged=True, seed=0, boost=2.5, max_step_tokens=8)
    target = tiny_lm(merged=False, seed=1, boost=2.0, max_step_tokens=8)
    assert len(draft.tokenizer) != len(target.tokenizer)
    return draft, target


SETTINGS = DecodeSettings(max_new_tokens=40, step_tokens=8, temperature=0.0)


def test_always_reject_reproduces_the_target(pair):
    draft, target = pair
    ref = SingleModelDecoder(target, SETTINGS, "target").decode(Q)
    res = SemanticSpecDecoder(
        draft, target, q_probe=lambda h: 1.0, p_probe=lambda h: 0.0, settings=SETTINGS
    ).decode(Q)
    assert res.text == ref.text
    assert [s.text for s in res.steps] == [s.text for s in ref.steps]
    assert all(s.author == "target" for s in res.steps)
    assert res.target_share == 1.0 and res.acceptance_rate == 0.0
    assert res.output_tokens == ref.output_tokens


def test_always_accept_reproduces_the_draft_step_for_step(pair):
    draft, target = pair
    ref = SingleModelDecoder(draft, SETTINGS, "draft").decode(Q)
    res = SemanticSpecDecoder(
        draft, target, q_probe=lambda h: 0.1, p_probe=lambda h: 1.0, settings=SETTINGS
    ).decode(Q)
    assert [s.text for s in res.steps] == [s.text for s in ref.steps if s.text][: len(res.steps)]
    assert all(s.author == "draft" for s in res.steps)
    assert res.target_share == 0.0 and res.acceptance_rate == 1.0
    # every output token was prefilled by the target exactly once, never the whole context again
    assert res.prefill_per_output_token == pytest.approx(1.0)


@pytest.mark.parametrize("gamma", [1, 2, 3])
def test_mixed_decisions_keep_both_caches_consistent(pair, gamma, monkeypatch):
    """Accepts and rejects in every position of a round (with gamma > 1 the target scores a round's
    steps in one prefill and crops back to the last accepted one)."""
    draft, target = pair
    if gamma > 1:  # a draft whose steps end on a whole token: it writes a round's steps in one loop
        draft = tiny_lm(merged=False, seed=2, boost=2.5, max_step_tokens=8)
    probs = iter([0.9, 0.05, 0.9, 0.9, 0.05] * 50)
    settings = DecodeSettings(max_new_tokens=60, step_tokens=8, temperature=0.0, seed=3, gamma=gamma)
    runs, real = [], Scorer.score_runs
    monkeypatch.setattr(
        Scorer,
        "score_runs",
        lambda self, st, r, lp=False: (runs.extend(map(len, r)), real(self, st, r, lp))[1],
    )
    res = SemanticSpecDecoder(
        draft, target, q_probe=lambda h: 0.5, p_probe=lambda h: next(probs), settings=settings
    ).decode(Q)
    monkeypatch.undo()
    assert (max(runs) == gamma) if gamma > 1 else set(runs) == {1}
    authors = {s.author for s in res.steps}
    assert authors == {"draft", "target"}, "this test needs both accepts and rejects"
    for s in res.steps:
        assert (s.author == "draft") == (s.u < min(1.0, s.p / s.q))
    # each target-written step is what the target writes greedily from a fresh prefill of the text so far
    prompt = target.format_prompt(Q)
    for i, s in enumerate(res.steps):
        if s.author != "target" or not s.text:
            continue
        state = target.prefill(prompt + "".join(x.text for x in res.steps[:i]))
        budget = min(8, 60 - sum(x.target_tokens for x in res.steps[:i]))
        ((fresh, _),) = target.decode_steps([StepStart(state, budget)], 0.0, 1.0)
        assert fresh.text == s.text, f"step {i}: cached decoding diverged from a fresh prefill"
    assert (
        res.timings.total
        >= res.timings.draft + res.timings.verify + res.timings.target + res.timings.probe - 1e-6
    )


def test_min_ratio_rejects_low_ratios(pair):
    draft, target = pair
    settings = DecodeSettings(max_new_tokens=30, step_tokens=8, temperature=0.0, min_ratio=0.9)
    res = SemanticSpecDecoder(
        draft, target, q_probe=lambda h: 1.0, p_probe=lambda h: 0.5, settings=settings
    ).decode(Q)
    assert all(s.author == "target" for s in res.steps)
    # p/q = 0.5 < 0.9: the draw may pass (u < 0.5) and the floor reject, or the draw reject first
    assert {s.rejected_by for s in res.steps} <= {"ratio", "floor"}
    assert all(s.rejected_by == ("ratio" if s.u >= 0.5 else "floor") for s in res.steps)


def test_min_p_accepts_by_the_targets_probe_alone(pair):
    """The target's rule: a step is accepted iff p >= min_p, whatever q and the draw say."""
    draft, target = pair
    probs = iter([0.9, 0.2, 0.5] * 50)
    settings = DecodeSettings(max_new_tokens=60, step_tokens=8, temperature=0.0, seed=3, min_p=0.5)
    res = SemanticSpecDecoder(
        draft, target, q_probe=lambda h: 0.95, p_probe=lambda h: next(probs), settings=settings
    ).decode(Q)
    judged = [s for s in res.steps if s.p is not None]
    assert {s.author for s in judged} == {"draft", "target"}, "this test needs both accepts and rejects"
    for s in judged:  # p/q < 1 for every step: the paper's rule would reject some p >= 0.5 steps by draw
        assert (s.author == "draft") == (s.p >= 0.5)
        assert s.rejected_by == (None if s.author == "draft" else "target_rule")
    with pytest.raises(ValueError, match="set one of them"):
        DecodeSettings(min_p=0.5, min_ratio=0.2)
    with pytest.raises(ValueError, match="min_p must be"):
        DecodeSettings(min_p=-1)


@pytest.mark.parametrize("budget", [0, 1, 2])
def test_after_max_rejections_the_target_writes_the_rest(pair, budget):
    """The rejection budget: once an answer has had ``max_rejections`` draft steps rejected, the draft
    proposes no more and the target writes the rest alone, its own greedy steps; 0 is the target."""
    draft, target = pair
    settings = DecodeSettings(
        max_new_tokens=60, step_tokens=8, temperature=0.0, seed=3, max_rejections=budget
    )
    probs = iter([0.0, 0.9] * 100)  # p/q 0 or 1.8: the probes alone reject, accept, reject, accept, ...
    res = SemanticSpecDecoder(
        draft, target, q_probe=lambda h: 0.5, p_probe=lambda h: next(probs), settings=settings
    ).decode(Q)
    judged = [i for i, s in enumerate(res.steps) if s.p is not None]
    assert len(res.steps) > len(judged) + 2, "this test needs steps after the budget is spent"
    assert [res.steps[i].author for i in judged] == ["target", "draft"][:budget] + ["target"] * (budget > 1)
    assert res.rejections == budget
    after = res.steps[judged[-1] + 1 :] if judged else res.steps
    assert all(s.author == "target" and s.proposal is None and s.draft_tokens == 0 for s in after)
    assert all(s.rejected_by == "budget" for s in after), "the trace says why the target wrote them"
    assert all(res.steps[i].rejected_by == ("ratio" if res.steps[i].p == 0 else None) for i in judged)
    prompt = target.format_prompt(Q)
    for i in range(len(res.steps) - len(after), len(res.steps)):  # each is the target's own next step
        state = target.prefill(prompt + "".join(x.text for x in res.steps[:i]))
        budget_i = min(8, 60 - sum(x.target_tokens for x in res.steps[:i]))
        ((fresh, _),) = target.decode_steps([StepStart(state, budget_i)], 0.0, 1.0)
        assert fresh.text == res.steps[i].text, f"step {i}"
    if budget == 0:
        assert res.text == SingleModelDecoder(target, settings, "target").decode(Q).text
        assert res.acceptance_rate is None, "nothing was proposed"
    with pytest.raises(ValueError, match="max_rejections must be"):
        DecodeSettings(max_rejections=-1)


@pytest.mark.parametrize("gamma", [1, 2])
def test_the_token_check_rejects_steps_the_target_finds_unlikely(pair, gamma):
    """``min_token_p``: a step the probes accept is rejected all the same when the target gives one of its
    tokens a probability below the floor; ``tok``, recorded on every step the probes accepted, is that
    least probability as the target's own scoring of the step computes it."""
    draft, target = pair
    if gamma > 1:  # a draft whose steps end on a whole token: it writes a round's steps in one loop
        draft = tiny_lm(merged=False, seed=2, boost=2.5, max_step_tokens=8)

    def decode(floor: float):
        settings = DecodeSettings(
            max_new_tokens=48, step_tokens=8, temperature=0.0, gamma=gamma, min_token_p=floor
        )
        probs = iter([0.9, 0.9, 0.0] * 100)  # p/q 1.8 or 0: the probes accept two steps, reject one, ...
        return SemanticSpecDecoder(
            draft, target, q_probe=lambda h: 0.5, p_probe=lambda h: next(probs), settings=settings
        ).decode(Q)

    toks = [s.tok for s in decode(1e-12).steps if s.tok is not None]
    floor = sorted(toks)[len(toks) // 2]  # the median: some steps fall below it, some do not
    res = decode(floor)
    prompt = target.format_prompt(Q)
    checked = 0
    for i, s in enumerate(res.steps):
        if s.p is None or s.p < 0.5:  # handed over, or rejected by the probes: the check never ran
            assert s.tok is None
            continue
        step = s.text if s.author == "draft" else s.proposal
        state = target.prefill(prompt + "".join(x.text for x in res.steps[:i]))
        least = float(target.score_step(state, step, logprobs=True).logprobs.exp().min())
        assert s.tok == pytest.approx(least, rel=1e-3, abs=1e-6), f"step {i}"
        assert (s.author == "draft") == (s.tok >= floor), f"step {i}"
        assert s.rejected_by == (None if s.author == "draft" else "token_check"), f"step {i}"
        checked += 1
    authors = {s.author for s in res.steps if s.tok is not None}
    assert checked >= 3 and authors == {"draft", "target"}, "this test needs steps on both sides"
    for bad in (0, 1, -0.1, "auto", True):
        with pytest.raises(ValueError, match="min_token_p must be"):
            DecodeSettings(min_token_p=bad)


@pytest.mark.parametrize("gamma", [2, 3])
def test_gamma_drafts_several_steps_before_verifying(pair, gamma, monkeypatch):
    draft, target = pair
    settings = DecodeSettings(max_new_tokens=40, step_tokens=8, temperature=0.0, gamma=gamma)
    ref = SingleModelDecoder(draft, settings, "draft").decode(Q)
    prefills, real = [], Forwards.forward_rows

    def counting(self, caches, new_ids, all_logits=False, **kw):
        if self is target.forwards:
            prefills.append(len(new_ids))
        return real(self, caches, new_ids, all_logits, **kw)

    monkeypatch.setattr(Forwards, "forward_rows", counting)
    res = SemanticSpecDecoder(draft, target, lambda h: 0.1, lambda h: 1.0, settings).decode(Q)
    # a draft whose steps end on a whole token writes a round's gamma steps in one loop, and the target
    # reads them in one prefill: the prompt, then one per round
    plain = tiny_lm(merged=False, seed=2, boost=2.5, max_step_tokens=8)
    prefills.clear()
    whole = SemanticSpecDecoder(plain, target, lambda h: 0.1, lambda h: 1.0, settings).decode(Q)
    monkeypatch.undo()
    assert [s.text for s in res.steps] == [s.text for s in ref.steps if s.text][: len(res.steps)]
    assert len(whole.steps) > gamma and len(prefills) == 1 + -(-len(whole.steps) // gamma)
    assert whole.prefill_per_output_token == pytest.approx(1.0)
    rej = SemanticSpecDecoder(draft, target, lambda h: 1.0, lambda h: 0.0, settings).decode(Q)
    assert rej.text == SingleModelDecoder(target, settings, "target").decode(Q).text


def test_specreason_threshold_zero_accepts_everything(pair):
    draft, target = pair
    ref = SingleModelDecoder(draft, SETTINGS, "draft").decode(Q)
    settings = DecodeSettings(max_new_tokens=40, step_tokens=8, temperature=0.0, accept_threshold=0)
    res = SpecReasonDecoder(draft, target, settings).decode(Q)
    assert [s.text for s in res.steps] == [s.text for s in ref.steps if s.text][: len(res.steps)]
    assert all(s.author == "draft" and 0 <= s.score <= 9 for s in res.steps)


def test_specreason_low_scores_are_rewritten_by_the_target(pair, monkeypatch):
    draft, target = pair
    dec = SpecReasonDecoder(draft, target, SETTINGS)
    real = dec.verifier.rate
    monkeypatch.setattr(
        dec.verifier, "rate", lambda states, texts: [(0, *r[1:]) for r in real(states, texts)]
    )
    res = dec.decode(Q)
    assert res.text == SingleModelDecoder(target, SETTINGS, "target").decode(Q).text


def test_result_fields_and_answer_extraction(pair):
    _, target = pair
    res = SingleModelDecoder(target, DecodeSettings(max_new_tokens=12, step_tokens=4), "target").decode(Q)
    assert res.output_tokens <= 12 and res.method == "target"
    d = res.to_dict()
    assert {"text", "answer", "steps", "timings", "target_share", "tokens_per_second"} <= set(d)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_new_tokens": 0},
        {"gamma": 0},
        {"min_ratio": -1},
        {"min_ratio": "strict"},
        {"accept_threshold": 10},
        {"top_p": 0},
    ],
)
def test_bad_settings(kwargs):
    with pytest.raises(ValueError):
        DecodeSettings(**kwargs)


# ----------------------------------------------------------------------------------------- salvage
SALVAGE = DecodeSettings(max_new_tokens=40, step_tokens=8, temperature=0.0, salvage=True)


def _near_copy(noise: float):
    """The target's tiny model with its weights perturbed: its greedy steps agree with the target's for a
    while, then drift (a draft whose rejected steps have something to salvage)."""
    import torch

    lm = tiny_lm(merged=False, seed=1, boost=2.0, max_step_tokens=8)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in lm.model.parameters():
            p.add_(noise * torch.randn(p.shape, generator=gen))
    return lm


@pytest.mark.parametrize("noise", [0.0, 0.3])
def test_salvage_with_always_reject_still_reproduces_the_target_token_for_token(pair, noise):
    _, target = pair
    draft = _near_copy(noise)
    ref = SingleModelDecoder(target, SETTINGS, "target").decode(Q)
    res = SemanticSpecDecoder(draft, target, lambda h: 1.0, lambda h: 0.0, SALVAGE).decode(Q)
    assert [s.text for s in res.steps] == [s.text for s in ref.steps]
    assert res.output_tokens == ref.output_tokens and all(s.author == "target" for s in res.steps)
    salvaged = [s.salvaged for s in res.steps]
    if noise == 0.0:  # the draft is the target: every rejected step is kept whole
        assert salvaged == [s.target_tokens for s in res.steps]
    else:
        assert all(0 <= k <= s.target_tokens for k, s in zip(salvaged, res.steps, strict=True))


def test_salvage_keeps_part_of_a_step_and_the_target_writes_the_rest(pair):
    _, target = pair
    res = SemanticSpecDecoder(_near_copy(0.3), target, lambda h: 1.0, lambda h: 0.0, SALVAGE).decode(Q)
    partial = [s for s in res.steps if 0 < s.salvaged < s.target_tokens]
    assert partial, f"expected a partly kept step, got {[(s.salvaged, s.target_tokens) for s in res.steps]}"


def test_salvage_changes_no_output_with_mixed_decisions(pair):
    draft, target = pair
    out = []
    for salvage in (False, True):
        probs = iter([0.9, 0.05] * 50)
        settings = DecodeSettings(max_new_tokens=60, step_tokens=8, temperature=0.0, seed=3, salvage=salvage)
        p_probe = lambda h, probs=probs: next(probs)  # noqa: E731
        res = SemanticSpecDecoder(draft, target, lambda h: 0.5, p_probe, settings).decode(Q)
        out.append([(s.author, s.text) for s in res.steps])
    assert out[0] == out[1]


def test_salvage_is_off_when_sampling(pair):
    _, target = pair
    settings = DecodeSettings(max_new_tokens=24, step_tokens=8, temperature=0.8, salvage=True)
    res = SemanticSpecDecoder(_near_copy(0.0), target, lambda h: 1.0, lambda h: 0.0, settings).decode(Q)
    assert all(s.salvaged == 0 for s in res.steps)


def test_gamma_proposals_stay_within_the_output_budget():
    lm = tiny_lm(seed=0, boost=1.0, max_step_tokens=8)
    settings = DecodeSettings(max_new_tokens=20, step_tokens=8, gamma=3)
    for q in ("What is 2 + 3?", "Add 17 and 25.", "x"):
        res = SemanticSpecDecoder(lm, lm, lambda h: 0.1, lambda h: 1.0, settings).decode(q)
        assert res.output_tokens <= 20, "the round's later proposals must count what the earlier ones used"


def test_specreason_rewrites_with_the_target_step_budget(monkeypatch):
    draft = tiny_lm(merged=True, seed=0, max_step_tokens=8)
    target = tiny_lm(seed=1, max_step_tokens=3)
    dec = SpecReasonDecoder(draft, target, DecodeSettings(max_new_tokens=24))
    real = dec.verifier.rate
    monkeypatch.setattr(
        dec.verifier, "rate", lambda states, texts: [(0, *r[1:]) for r in real(states, texts)]
    )
    res = dec.decode(Q)
    assert res.steps and all(s.author == "target" and s.target_tokens <= 3 for s in res.steps)


def test_acceptance_draws_differ_between_problems(pair):
    draft, target = pair
    dec = SemanticSpecDecoder(draft, target, lambda h: 1.0, lambda h: 0.5, SETTINGS)
    first = [dec.decode(q).steps[0].u for q in ("What is 2 + 3?", "Add 17 and 25.")]
    assert first[0] != first[1]
    assert dec.decode("What is 2 + 3?").steps[0].u == first[0], "and stay the same for one problem"


CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% if not loop.last or add_generation_prompt %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_specreason_asks_in_a_new_user_turn_of_the_chat_template():
    target = tiny_lm(seed=1, prompt="auto")
    target.tokenizer.chat_template = CHATML
    dec = SpecReasonDecoder(target, target, SETTINGS)
    # the steps' assistant turn is closed, the instruction is a user turn, the reply starts with the lead
    assert dec.verifier.prompt.startswith("<|im_end|>\n<|im_start|>user\nEvaluate the last reasoning step")
    assert dec.verifier.prompt.endswith(
        "Assign a score from 0 to 9.<|im_end|>\n<|im_start|>assistant\nI think the quality score is: "
    )
    plain = SpecReasonDecoder(target, tiny_lm(seed=1), SETTINGS).verifier.prompt
    assert plain.startswith("\n\nEvaluate") and plain.endswith("\nI think the quality score is: ")


@pytest.mark.parametrize(("favoured", "score"), [("8", 8), ("3", 3), ("x", 0)])
def test_specreason_scores_the_greedy_token_and_a_non_digit_as_zero(favoured, score):
    from tests.helpers.tiny import boost_tokens

    draft = tiny_lm(merged=True, seed=0, boost=2.5, max_step_tokens=8)
    target = tiny_lm(seed=1, max_step_tokens=8)
    boost_tokens(target.model, [target.tokenizer.convert_tokens_to_ids(favoured)], 50.0)
    settings = DecodeSettings(max_new_tokens=16, step_tokens=8, accept_threshold=7)
    res = SpecReasonDecoder(draft, target, settings).decode(Q)
    proposed = [s for s in res.steps if s.score is not None]
    assert proposed and all(s.score == score for s in proposed)
    assert all((s.author == "draft") == (score >= 7) for s in proposed)


@pytest.mark.parametrize("window", [12, 64])
def test_specreason_rating_gives_back_the_step_state_when_the_turn_overflows_a_sliding_window(window):
    from semspec.models.spec.specreason import SpecReasonVerifier
    from tests.helpers.tiny import tiny_gemma_lm

    target = tiny_gemma_lm(sliding_window=window)
    verifier = SpecReasonVerifier(target)
    contexts = ["Q: what is 7 times 8, and then add 5 to it?\nA:", "Q: x\nA:"]
    rated = verifier.rate([target.prefill(c) for c in contexts], [" 7*8 = 56.\n\n", " so 61.\n\n"])
    for (score, state, k), ctx, step in zip(rated, contexts, [" 7*8 = 56.\n\n", " so 61.\n\n"], strict=True):
        ref, ids, _, _ = target.extend(target.prefill(ctx), step)
        assert 0 <= score <= 9 and k == len(ids) and state.ids == ref.ids
        torch.testing.assert_close(state.logits, ref.logits, atol=1e-4, rtol=1e-4)
        # the cache holds the step and nothing of the turn: the next token reads as after a fresh prefill
        after, _, _, _ = target.extend(state, " then")
        torch.testing.assert_close(
            after.logits, target.prefill(ctx + step + " then").logits, atol=1e-4, rtol=1e-4
        )
