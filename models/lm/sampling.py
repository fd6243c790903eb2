"""Token draws for sampled decoding: temperature and nucleus (top-p) sampling, one generator per row.

Nucleus sampling keeps, in each row, the most probable tokens until their mass reaches ``top_p``
(a token is kept while the mass of the tokens above it is below ``top_p``: the rule of transformers'
``TopPLogitsWarper`` and vLLM's sampler) and draws from them renormalized. The usual way sorts the
whole vocabulary every token; with 150k-token vocabularies that sort and the full-vocabulary
``multinomial`` per row cost as much as a small model's forward. Here the nucleus is searched among the
``top-k`` first (64 tokens, grown eightfold while some row's nucleus reaches past it), which is exact:
the same kept set and the same renormalized probabilities as the full sort, found without it.
"""

from __future__ import annotations

import torch

FIRST_K = 64  # candidates searched first; a row whose nucleus reaches past them makes the search grow


def nucleus(logits: torch.Tensor, temperature: float, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (B, V) -> (candidate ids (B, K), their log-probs (B, K)) under the distribution at
    ``temperature`` cut to its top-``top_p`` nucleus and renormalized; candidates outside a row's nucleus
    have log-prob ``-inf``. Candidates are in descending probability. With ``top_p == 1`` every token is a
    candidate (K = V, in vocabulary order)."""
    if temperature <= 0 or not 0.0 < top_p <= 1.0:
        raise ValueError(
            f"nucleus sampling needs temperature > 0 and top_p in (0, 1], got {temperature}, {top_p}"
        )
    scaled = logits.float() / temperature  # (B, V)
    logz = torch.logsumexp(scaled, dim=-1, keepdim=True)  # (B, 1)
    n_vocab = scaled.shape[-1]
    if top_p >= 1.0:
        ids = torch.arange(n_vocab, device=scaled.device).expand_as(scaled)  # (B, V)
        return ids, scaled - logz
    k = min(FIRST_K, n_vocab)
    while True:
        vals, ids = scaled.topk(k, dim=-1)  # (B, k), descending
        logp = vals - logz  # (B, k): log-probs before the cut
        p = logp.exp()
        keep = (p.cumsum(dim=-1) - p) < top_p  # (B, k): the mass above each candidate is below top_p
        if k == n_vocab or not bool(keep[:, -1].any()):
            break  # every row's nucleus ends inside the k candidates
        k = min(n_vocab, k * 8)
    keep[:, 0] = True  # the most probable token always stays
    mass = (p * keep).sum(dim=-1, keepdim=True)  # (B, 1)
    return ids, torch.where(keep, logp - mass.log(), torch.full_like(logp, float("-inf")))


def draw(
    ids: torch.Tensor, logp: torch.Tensor, gens: list[torch.Generator]
) -> tuple[torch.Tensor, torch.Tensor]:
    """One draw per row from candidates ``ids`` (B, K) with log-probs ``logp`` (B, K); row b draws one
    uniform number from ``gens[b]`` (rows may share a generator, drawn in row order). Returns the tokens
    (B,) and their log-probs (B,)."""
    if len(gens) != ids.shape[0]:
        raise ValueError(f"one generator per row: {len(gens)} generators for {ids.shape[0]} rows")
    p = logp.exp()  # (B, K)
    cdf = p.cumsum(dim=-1)  # (B, K)
    u = torch.stack([torch.rand((), generator=g) for g in gens]).to(cdf)  # (B,)
    pick = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)  # (B, 1)
    # u * total may round up to the total: keep the pick on the last candidate with mass, never on one
    # outside the nucleus
    last = (p > 0).cumsum(dim=-1).argmax(dim=-1, keepdim=True)  # (B, 1)
    pick = torch.minimum(pick, last)
    return ids.gather(1, pick)[:, 0], logp.gather(1, pick)[:, 0]


def sample_tokens(
    logits: torch.Tensor, gens: list[torch.Generator], temperature: float, top_p: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (B, V) -> (token ids (B,), their log-probs (B,)): the argmax and its log-softmax when
    ``temperature`` is 0, else a draw from each row's nucleus (``nucleus``) with ``gens[b]``."""
    if temperature == 0:
        nxt = logits.argmax(dim=-1)  # (B,)
        return nxt, torch.log_softmax(logits.float(), dim=-1).gather(1, nxt[:, None])[:, 0].cpu()
    ids, logp = nucleus(logits, temperature, top_p)
    nxt, lp = draw(ids.cpu(), logp.cpu(), gens)
    return nxt.to(logits.device), lp
