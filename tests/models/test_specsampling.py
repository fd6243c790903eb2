"""Token-level speculative sampling: its output distribution equals the target's (chi-square test on a
tiny vocabulary), while the draft's own distribution is detectably different."""

from __future__ import annotations

import itertools

import pytest
import torch
from scipy.stats import chisquare
from transformers import LlamaConfig, LlamaForCausalLM

from semspec.models.spec.token_level import speculative_sample

V = 6
PROMPT = [1, 2, 3]


def _model(seed: int, scale: float) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=V,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
    )
    m = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        m.lm_head.weight.mul_(scale)  # sharpen the distributions so draft and target clearly differ
    return m


@torch.inference_mode()
def _exact_two_token(model) -> dict[tuple[int, int], float]:
    p0 = torch.softmax(model(torch.tensor([PROMPT])).logits[0, -1].double(), -1)
    out = {}
    for a in range(V):
        p1 = torch.softmax(model(torch.tensor([[*PROMPT, a]])).logits[0, -1].double(), -1)
        for b in range(V):
            out[(a, b)] = float(p0[a] * p1[b])
    return out


@pytest.fixture(scope="module")
def models():
    return _model(0, 30.0), _model(1, 30.0)


def _cells(exact, n):
    """Cells with an expected count of at least 5 (the chi-square approximation needs it); the rest pooled."""
    keys = sorted(k for k in exact if exact[k] * n >= 5)
    return keys, [k for k in exact if exact[k] * n < 5]


def _observed(counts, keys, rare):
    return [counts[k] for k in keys] + [sum(counts[k] for k in rare)]


def _expected(dist, n, keys, rare):
    return [dist[k] * n for k in keys] + [sum(dist[k] for k in rare) * n]


def _counts(samples):
    c = dict.fromkeys(itertools.product(range(V), repeat=2), 0)
    for s in samples:
        c[tuple(s)] += 1
    return c


def test_speculative_sampling_matches_the_target_distribution(models):
    draft, target = models
    n = 3000
    samples, accepted = [], 0
    for i in range(n):
        out, stats = speculative_sample(
            draft,
            target,
            PROMPT,
            max_new_tokens=2,
            draft_tokens=2,
            generator=torch.Generator().manual_seed(i),
        )
        assert len(out) == 2
        samples.append(out)
        accepted += stats["accepted"]
    exact = _exact_two_token(target)
    counts = _counts(samples)
    keys, rare = _cells(exact, n)
    chi = chisquare(_observed(counts, keys, rare), _expected(exact, n, keys, rare))
    assert chi.pvalue > 1e-3, f"speculative samples do not follow the target (p={chi.pvalue:.2e})"
    assert 0 < accepted < 2 * n, "both accepts and rejects must happen for the test to mean anything"
    # the same test rejects the draft's own distribution: it has the power to see a wrong sampler
    d_exact = _exact_two_token(draft)
    chi_d = chisquare(_expected(d_exact, n, keys, rare), _expected(exact, n, keys, rare))
    assert chi_d.pvalue < 1e-6


def test_speculative_sampling_arguments(models):
    draft, target = models
    with pytest.raises(ValueError):
        speculative_sample(draft, target, PROMPT, max_new_tokens=2, draft_tokens=0)
    out, stats = speculative_sample(draft, target, PROMPT, max_new_tokens=7, draft_tokens=3)
    assert len(out) == 7 and stats["target_passes"] >= 3


def test_greedy_speculation_is_the_target_token_for_token():
    from semspec.models.spec.batching import SingleModelDecoder
    from semspec.models.spec.settings import DecodeSettings
    from semspec.models.spec.token_level import TokenSpecDecoder
    from tests.helpers.tiny import tiny_lm

    # one character vocabulary; the draft is the target with a noisy output head: right on some tokens only
    draft, target = tiny_lm(seed=1), tiny_lm(seed=1)
    torch.manual_seed(0)
    with torch.no_grad():
        head = draft.model.lm_head.weight
        head.add_(torch.randn_like(head) * head.std() * 0.4)
    settings = DecodeSettings(max_new_tokens=40, step_tokens=8, temperature=0.0)
    for question in ("What is 2 + 3?", "Name a colour."):
        ref = SingleModelDecoder(target, settings, "target").decode(question)
        res = TokenSpecDecoder(draft, target, settings, draft_tokens=3).decode(question)
        assert res.method == "specsampling"
        assert res.text == ref.text and res.output_tokens == ref.output_tokens
        assert 0 < res.extra["accepted"] < res.extra["proposed"], "needs accepted and rejected proposals"


def test_token_speculation_refuses_two_vocabularies():
    from semspec.models.spec.settings import DecodeSettings, MethodNotApplicable
    from semspec.models.spec.token_level import TokenSpecDecoder
    from tests.helpers.tiny import tiny_lm

    with pytest.raises(MethodNotApplicable, match="different tokenizers"):
        TokenSpecDecoder(tiny_lm(merged=True), tiny_lm(merged=False, seed=1), DecodeSettings())
