"""Nucleus sampling without a full sort: the same kept set and probabilities as transformers' warpers."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

from semspec.models.lm import sampling
from semspec.models.lm.sampling import draw, nucleus, sample_tokens


def _reference(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """transformers' temperature + top-p warpers, then log-softmax: (B, V)."""
    scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
    scores = TopPLogitsWarper(top_p)(None, scores)
    return torch.log_softmax(scores, dim=-1)


def _scatter(ids: torch.Tensor, logp: torch.Tensor, n_vocab: int) -> torch.Tensor:
    full = torch.full((ids.shape[0], n_vocab), float("-inf"))
    return full.scatter(1, ids, logp)


@pytest.mark.parametrize(
    ("scale", "temperature", "top_p"),
    [(8.0, 0.6, 0.95), (1.0, 0.6, 0.95), (0.05, 1.0, 0.9), (3.0, 1.3, 0.5), (2.0, 0.7, 1.0)],
)
def test_nucleus_equals_the_full_sort(scale: float, temperature: float, top_p: float) -> None:
    # scale 0.05: nearly flat rows, whose nucleus reaches far past the first candidates (the search grows)
    logits = torch.randn(6, 3000, generator=torch.Generator().manual_seed(1)) * scale
    ids, logp = nucleus(logits, temperature, top_p)
    got, want = _scatter(ids, logp, 3000), _reference(logits, temperature, top_p)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    kept = ~torch.isinf(want)
    torch.testing.assert_close(got[kept], want[kept], atol=1e-5, rtol=1e-5)


def test_the_search_grows_past_the_first_candidates() -> None:
    logits = torch.zeros(2, 1000)  # flat: a token is kept while the mass above it (0.001 each) < 0.9455
    ids, logp = nucleus(logits, 1.0, 0.9455)
    assert ids.shape[1] > sampling.FIRST_K
    assert (~torch.isinf(logp)).sum(dim=1).tolist() == [946, 946]


def test_draws_follow_the_nucleus_distribution() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    ids, logp = nucleus(logits, 1.0, 0.9)  # keeps 0.5, 0.3, 0.15 (mass above the 0.05 token is 0.95)
    gen = torch.Generator().manual_seed(0)
    picks = [int(draw(ids, logp, [gen])[0][0]) for _ in range(4000)]
    freq = torch.bincount(torch.tensor(picks), minlength=4).float() / len(picks)
    assert freq[3] == 0
    torch.testing.assert_close(freq[:3], torch.tensor([0.5, 0.3, 0.15]) / 0.95, atol=0.03, rtol=0)


def test_a_draw_at_the_top_of_the_cdf_stays_inside_the_nucleus(monkeypatch) -> None:
    """A uniform draw times the nucleus' mass can round up to the mass itself: the pick is then the last
    kept candidate, not one outside the nucleus (whose log-prob is -inf)."""
    ids, logp = nucleus(torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])), 1.0, 0.9)
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.tensor(1.0))  # the extreme of rounding
    tok, lp = draw(ids, logp, [torch.Generator()])
    assert int(tok[0]) == 2 and torch.isfinite(lp).all()


def test_draws_are_reproducible_per_row_generator() -> None:
    logits = torch.randn(3, 500, generator=torch.Generator().manual_seed(2))
    runs = []
    for _ in range(2):
        gens = [torch.Generator().manual_seed(s) for s in (5, 6, 7)]
        runs.append(sample_tokens(logits, gens, 0.8, 0.95))
    assert torch.equal(runs[0][0], runs[1][0])
    torch.testing.assert_close(runs[0][1], runs[1][1])


def test_greedy_is_the_argmax_with_its_log_softmax() -> None:
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(3))
    nxt, lp = sample_tokens(logits, [torch.Generator()] * 4, 0.0, 0.95)
    assert torch.equal(nxt, logits.argmax(-1))
    torch.testing.assert_close(lp, torch.log_softmax(logits, -1).max(-1).values)


def test_bad_settings_and_generators_are_refused() -> None:
    with pytest.raises(ValueError, match="top_p"):
        nucleus(torch.zeros(1, 4), 1.0, 0.0)
    ids, logp = nucleus(torch.zeros(2, 4), 1.0, 0.9)
    with pytest.raises(ValueError, match="one generator per row"):
        draw(ids, logp, [torch.Generator()])
