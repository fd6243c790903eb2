"""Token-level speculative decoding, the baselines SemanticSpec is compared with: speculative sampling
(Leviathan et al. 2023, ``specsampling``) for pairs that share a vocabulary, and transformers' assisted
generation (``assisted``). Both return the same ``DecodeResult`` as every decoder."""

from __future__ import annotations

import time

import torch
from transformers.cache_utils import DynamicCache

from semspec.models.lm import LM
from semspec.models.spec.results import DecodeResult, StepCallback, StepRecord, finish_result
from semspec.models.spec.settings import DecodeSettings, MethodNotApplicable


class TokenSpecDecoder:
    """Token-level speculative sampling (Leviathan et al.) for pairs that share a vocabulary."""

    method = "specsampling"

    def __init__(self, draft: LM, target: LM, settings: DecodeSettings, draft_tokens: int = 4) -> None:
        if draft_tokens < 1:
            raise ValueError(f"draft_tokens must be >= 1, got {draft_tokens}")
        if not same_vocabulary(draft, target):
            raise MethodNotApplicable(
                f"token-level speculative sampling needs one vocabulary; {draft.model_id} and "
                f"{target.model_id} have different tokenizers (use method 'assisted')"
            )
        self.draft, self.target, self.settings = draft, target, settings
        self.draft_tokens = draft_tokens  # tokens the draft proposes in the first round (then adaptive)

    def decode(self, question: str, on_step: StepCallback | None = None) -> DecodeResult:
        """Sample the answer token by token with draft proposals verified by the target."""
        s, t0 = self.settings, time.perf_counter()
        res = DecodeResult(self.method, "", None, on_step=on_step)
        ids = self.target.encode(self.target.format_prompt(question))
        new, stats = speculative_sample(
            self.draft.model,
            self.target.model,
            ids,
            s.max_new_tokens,
            self.draft_tokens,
            s.temperature,
            torch.Generator().manual_seed(s.seed),
            self.target.eos_ids,
        )
        res.output_tokens = len(new)
        res.finish_reason = "eos" if new and new[-1] in self.target.eos_ids else "length"
        res.timings.target = time.perf_counter() - t0
        res.add(StepRecord("target", self.target.decode(new), 0, len(new)))
        res.extra = {**stats, "token_acceptance_rate": stats["accepted"] / max(1, stats["proposed"])}
        return finish_result(self.method, res, t0, s)


def same_vocabulary(draft: LM, target: LM) -> bool:
    """Whether the two models share one vocabulary (token ids mean the same text and logits align)."""
    dv = draft.model.get_output_embeddings().out_features  # nn.Linear and QuantLinear alike
    tv = target.model.get_output_embeddings().out_features
    return dv == tv and draft.tokenizer.get_vocab() == target.tokenizer.get_vocab()


class AssistedDecoder:
    """transformers' assisted generation (universal assisted generation when the tokenizers differ):
    the industry token-level baseline. Greedy only across different tokenizers."""

    method = "assisted"

    def __init__(self, draft: LM, target: LM, settings: DecodeSettings) -> None:
        self.draft, self.target, self.settings = draft, target, settings
        self.same_vocab = same_vocabulary(draft, target)
        if settings.temperature > 0 and not self.same_vocab:
            raise ValueError(
                "assisted generation across different tokenizers is greedy only: use temperature 0"
            )

    @torch.inference_mode()
    def decode(self, question: str, on_step: StepCallback | None = None) -> DecodeResult:
        """One ``generate`` call with the draft as assistant; counts forward passes of each model."""
        s, t0 = self.settings, time.perf_counter()
        res = DecodeResult(self.method, "", None, on_step=on_step)
        calls = {"draft": 0, "target": 0}
        hooks = [
            m.model.register_forward_hook(lambda *_, r=r: calls.__setitem__(r, calls[r] + 1))
            for r, m in (("draft", self.draft), ("target", self.target))
        ]
        ids = torch.tensor(
            [self.target.encode(self.target.format_prompt(question))], device=self.target.device
        )
        kw = {
            "max_new_tokens": s.max_new_tokens,
            "assistant_model": self.draft.model,
            "do_sample": s.temperature > 0,
            "pad_token_id": self.target.tokenizer.pad_token_id or self.target.tokenizer.eos_token_id,
        }
        if s.temperature > 0:
            kw.update(temperature=s.temperature, top_p=s.top_p)
        if not self.same_vocab:
            kw.update(tokenizer=self.target.tokenizer, assistant_tokenizer=self.draft.tokenizer)
        try:
            out = self.target.model.generate(ids, **kw)
        finally:
            for h in hooks:
                h.remove()
        new = out[0, ids.shape[1] :].tolist()
        eos = bool(new) and new[-1] in self.target.eos_ids
        text = self.target.decode(new)
        res.output_tokens = len(new)
        res.finish_reason = "eos" if eos else "length"
        res.timings.target = time.perf_counter() - t0
        res.add(StepRecord("target", text, 0, len(new)))
        # each target pass verifies a block of draft tokens; accepted = emitted - one token per pass
        res.extra = {
            "target_forward_passes": calls["target"],
            "draft_forward_passes": calls["draft"],
            "tokens_per_target_pass": len(new) / max(1, calls["target"]),
            "token_acceptance_rate": max(0, len(new) - calls["target"]) / max(1, calls["draft"]),
        }
        return finish_result(self.method, res, t0, s)


class _TokenSampler:
    """Distributions and draws for token-level speculation: one-hot argmax when greedy, else softmax at
    ``temperature`` with draws from ``gen``."""

    def __init__(self, temperature: float, gen: torch.Generator) -> None:
        self.greedy, self.temperature, self.gen = temperature == 0, temperature, gen

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """(..., V) logits -> (..., V) float64 distribution."""
        if self.greedy:
            return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).double()
        return torch.softmax(logits.double() / self.temperature, dim=-1)

    def pick(self, p: torch.Tensor) -> int:
        """A token drawn from ``p`` (V,) (its argmax when greedy)."""
        return int(p.argmax()) if self.greedy else int(torch.multinomial(p.float(), 1, generator=self.gen))

    def accepts(self, ratio: float) -> bool:
        """Whether a proposal with ``p(x) / q(x) = ratio`` is kept."""
        return ratio >= 1.0 or (not self.greedy and torch.rand(1, generator=self.gen).item() < ratio)


def _logits(model, ids: list[int], cache: DynamicCache, keep: int = 1) -> torch.Tensor:
    """Feed ``ids`` (T,) on ``cache``; the logits of the last ``keep`` positions (keep, V)."""
    return model(torch.tensor([ids]), cache=cache, use_cache=True, logits_to_keep=keep).logits[0]


def _draft_tokens(
    draft_model, unread: list[int], cache: DynamicCache, k: int, sampler: _TokenSampler, eos_ids: set[int]
) -> tuple[list[int], list[torch.Tensor]]:
    """The draft reads ``unread`` (committed tokens not in its cache yet) and proposes up to ``k`` tokens
    (stopping at EOS); returns them with the distribution each was drawn from. The last proposal is not fed
    to the draft."""
    logits = _logits(draft_model, unread, cache)[-1]  # (V,)
    xs, qs = [], []
    for i in range(k):
        q = sampler.probs(logits)
        xs.append(sampler.pick(q))
        qs.append(q)
        if xs[-1] in eos_ids or i == k - 1:
            break
        logits = _logits(draft_model, [xs[-1]], cache)[-1]
    return xs, qs


def _accept_prefix(
    xs: list[int], qs: list[torch.Tensor], ps: list[torch.Tensor], sampler: _TokenSampler
) -> tuple[int, int]:
    """Leviathan's test: keep x_i with probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection
    draw the next token from (p_i - q_i)+, else the bonus token from p_k. Returns (kept, next token)."""
    for i, x in enumerate(xs):
        if not sampler.accepts(float(ps[i][x] / qs[i][x])):
            resid = (ps[i] - qs[i]).clamp_min(0)
            return i, sampler.pick(resid / resid.sum())
    return len(xs), sampler.pick(ps[len(xs)])


def _first_eos(out: list[int], eos_ids: set[int]) -> list[int]:
    for i, t in enumerate(out):
        if t in eos_ids:
            return out[: i + 1]
    return out


def _check_arguments(
    prompt_ids: list[int], max_new_tokens: int, draft_tokens: int, max_draft_tokens: int, temperature: float
) -> None:
    """ValueError unless ``speculative_sample`` can run with these arguments."""
    if draft_tokens < 1 or max_new_tokens < 1 or temperature < 0 or max_draft_tokens < draft_tokens:
        raise ValueError(
            "draft_tokens, max_new_tokens >= 1, max_draft_tokens >= draft_tokens and temperature >= 0"
        )
    if not prompt_ids:
        raise ValueError("prompt_ids must not be empty")


def _keep_accepted(tcache: DynamicCache, dcache: DynamicCache, rejected: int, d_len: int, keep: int) -> int:
    """Crop the ``rejected`` proposals off the target's cache and the draft's cache (``d_len`` positions)
    back to ``keep`` positions at most; returns the draft cache's length."""
    if rejected:
        tcache.crop(-rejected)  # target cache: committed + the accepted proposals
    if d_len > keep:
        dcache.crop(-(d_len - keep))
        d_len = keep
    return d_len


@torch.inference_mode()
def speculative_sample(
    draft_model,
    target_model,
    prompt_ids: list[int],
    max_new_tokens: int,
    draft_tokens: int = 4,
    temperature: float = 1.0,
    generator: torch.Generator | None = None,
    eos_ids: set[int] | None = None,
    adaptive: bool = True,
    max_draft_tokens: int = 16,
) -> tuple[list[int], dict[str, int]]:
    """Token-level speculative sampling (Leviathan et al. 2023) for two models sharing a vocabulary.

    The output is distributed exactly as sampling from the target at ``temperature``; with
    ``temperature == 0`` it is the target's greedy output, token for token (a proposal is kept when it is
    the target's argmax). One target forward per round: the token the last round added (correction or
    bonus) is fed together with the next proposals. The draft proposes ``draft_tokens`` per round; with
    ``adaptive`` that number follows transformers' heuristic schedule (+2 after a fully accepted round, -1
    otherwise, within 1..``max_draft_tokens``, as its ``num_assistant_tokens``); it
    depends only on past rounds, so the output distribution stays exact. Returns the new ids and counts
    (proposed, accepted, target forward passes).
    """
    _check_arguments(prompt_ids, max_new_tokens, draft_tokens, max_draft_tokens, temperature)
    sampler = _TokenSampler(temperature, generator or torch.Generator().manual_seed(0))
    eos_ids = eos_ids or set()
    # invariant: the target cache holds committed[:-1]; the draft cache holds committed[:d_len]
    committed = list(prompt_ids)
    n_prompt = len(committed)
    dcache, tcache = DynamicCache(config=draft_model.config), DynamicCache(config=target_model.config)
    if n_prompt > 1:
        _logits(target_model, committed[:-1], tcache)
    d_len = 0
    stats = {"proposed": 0, "accepted": 0, "target_passes": 0}
    k_next = draft_tokens
    while len(committed) - n_prompt < max_new_tokens:
        base = len(committed)
        # 1. the draft catches up on the committed tokens and proposes up to k
        k = min(k_next, max_new_tokens - (base - n_prompt))
        xs, qs = _draft_tokens(draft_model, committed[d_len:], dcache, k, sampler, eos_ids)
        d_len, k = base + len(xs) - 1, len(xs)
        # 2. one target pass over [last committed token, x_0 .. x_{k-1}] gives p_0 .. p_k
        t_logits = _logits(target_model, [committed[-1], *xs], tcache, keep=k + 1)  # (k+1, V)
        stats["target_passes"] += 1
        n_ok, new = _accept_prefix(xs, qs, [sampler.probs(t_logits[i]) for i in range(k + 1)], sampler)
        stats["proposed"] += k
        stats["accepted"] += n_ok
        if adaptive:
            k_next = min(max_draft_tokens, k_next + 2) if n_ok == k else max(1, k_next - 1)
        # 3. keep the accepted prefix in both caches; `new` is fed with the next round
        d_len = _keep_accepted(tcache, dcache, k - n_ok, d_len, base + n_ok)
        committed += xs[:n_ok]
        if any(t in eos_ids for t in xs[:n_ok]) or len(committed) - n_prompt >= max_new_tokens:
            break
        committed.append(new)
        if new in eos_ids:
            break
    return _first_eos(committed[n_prompt:], eos_ids)[:max_new_tokens], stats
