"""The LM adapter's values: pooled hidden states, a context in the KV cache, a sampled or scored step,
where a row of a decode loop starts, and a lookahead step a loop ended inside."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache

from semspec.models.lm.cache import crop_to, fits_window
from semspec.models.spec.names import FEATURE_COLUMNS


@dataclass
class Pooled:
    """Hidden states pooled over a step's positions (see the module docstring)."""

    h_layers: torch.Tensor  # (L+1, D) float32, layer 0 = embeddings

    @property
    def h_last(self) -> torch.Tensor:
        """Last layer, ``[D]``."""
        return self.h_layers[-1]

    @property
    def h_mean(self) -> torch.Tensor:
        """Mean over the L transformer blocks (embeddings excluded), ``[D]``."""
        return self.h_layers[1:].mean(dim=0)

    def feature(self, name: str) -> torch.Tensor:
        """The input of a probe of variant ``name``: ``last`` ``[D]``, ``all`` ``[D]``, ``mix`` ``[L+1, D]``."""
        if name not in FEATURE_COLUMNS:
            raise ValueError(f"unknown feature {name!r}; expected one of {tuple(FEATURE_COLUMNS)}")
        return getattr(self, FEATURE_COLUMNS[name])


@dataclass
class Partial:
    """A lookahead step that a decode loop ended inside (``LM.decode_runs``): its tokens so far and the
    state of its sampling, so that the next loop that writes this step goes on with it instead of writing
    it again. It is the step sampled with ``seed``; the next loop takes it only for that seed and only
    when its tokens fit that loop's budget, so the step comes out as if written in one go."""

    tokens: list[int]
    hsum: torch.Tensor  # (L+1, D): summed outputs at the positions that predicted each token
    hfirst: torch.Tensor | None  # (L+1, D): ``tokens`` pooling only, the output predicting the first token
    lp_sum: float  # summed log-probabilities of the tokens
    gen: torch.Generator | None  # the step's generator, as far as it has drawn
    seed: int | None


@dataclass
class LMState:
    """A context held in the KV cache: every id is in ``cache``; ``logits``/``hidden`` are the outputs
    at the last position (they predict the next token)."""

    text: str
    ids: list[int]
    cache: Cache
    logits: torch.Tensor  # (V,)
    hidden: torch.Tensor  # (L+1, D)
    # the step a decode loop had begun after this context (only on the state that loop returned: any
    # state made from it, by extending, cropping or copying, has none)
    partial: Partial | None = field(default=None, repr=False, compare=False)

    def clone(self) -> LMState:
        """A deep copy whose cache can be extended without touching this one."""
        return LMState(self.text, list(self.ids), copy.deepcopy(self.cache), self.logits, self.hidden)

    def checkpoint(self, extra_tokens: int) -> Callable[[], LMState]:
        """Remember this state before its cache is extended by up to ``extra_tokens``; the returned
        function restores it by cropping the cache (or from a copy when a sliding-window layer would
        have dropped positions that a crop cannot bring back)."""
        n = len(self.ids)
        if not fits_window(self.cache, n + extra_tokens):
            saved = self.clone()
            return lambda: saved
        text, ids, logits, hidden, cache = self.text, list(self.ids), self.logits, self.hidden, self.cache

        def restore() -> LMState:
            crop_to(cache, n)
            return LMState(text, ids, cache, logits, hidden)

        return restore


@dataclass
class StepSample:
    """One sampled step."""

    text: str  # the step up to and including the delimiter (EOS text excluded)
    token_ids: list[int]  # the tokens sampled (the EOS id included when it ended the step)
    finish_reason: str  # delimiter | eos | length
    pooled: Pooled
    logprob: float  # sum of the sampled tokens' log-probabilities (after temperature / top-p)
    # ``tokens`` pooling still owed the output at the last token: (sum over the others (L+1, D), count)
    owed: tuple[torch.Tensor, int] | None = field(default=None, repr=False, compare=False)

    @property
    def num_tokens(self) -> int:
        """Number of tokens the model produced for this step."""
        return len(self.token_ids)

    def close_pooling(self, last_hidden: torch.Tensor) -> None:
        """``tokens`` pooling: add the output at the step's last token, ``(L+1, D)``, once it was fed."""
        if self.owed is not None:
            rest, count = self.owed
            self.pooled, self.owed = Pooled((rest + last_hidden) / count), None


def pool_tokens(sample: StepSample, rest: torch.Tensor, count: int) -> None:
    """Switch ``sample`` to ``tokens`` pooling. ``rest`` (L+1, D): the summed outputs at its first
    ``count - 1`` new tokens. An EOS step is complete already (EOS is no step token); otherwise the output
    at the last token is owed (``StepSample.close_pooling``)."""
    if sample.finish_reason == "eos":
        if count > 1:
            sample.pooled = Pooled(rest / (count - 1))
        return
    sample.owed = (rest, count)


NextBudget = Callable[[int, list[StepSample]], int | None]
"""(row, its steps so far) -> the token budget of the row's next step in the same decode loop, or None."""


@dataclass
class StepScore:
    """One prefill of a step on top of its context."""

    pooled: Pooled
    token_ids: list[int]
    logprobs: torch.Tensor  # (k,) log p(s_i | context, s_<i) under the model (empty when not asked for)
    state: LMState  # the context extended by the step
    pred_hidden: torch.Tensor | None = None  # (k, L+1, D) outputs at the positions predicting each token
    # filled by ``LM.read_tokens`` (one head pass over the positions that predicted the step's tokens):
    token_p: torch.Tensor | None = None  # (k,) p(s_i | context, s_<i) under the model
    greedy: torch.Tensor | None = None  # (k,) the model's argmax at each of those positions


@dataclass
class StepStart:
    """One row of a batched decode loop: a step written after ``context``, from ``state`` (default
    ``context``): its cache holds the context plus ``prefix`` (tokens of the step already decided) and its
    outputs predict the next token. ``done``: the prefix already ends the step (the cache then holds
    the context plus all of its tokens but the last)."""

    context: LMState
    max_tokens: int  # new tokens this row may sample
    seed: int | None = None
    state: LMState | None = None
    prefix: list[int] = field(default_factory=list)
    done: StepSample | None = None
    partial: Partial | None = None  # the step goes on from here (its tokens are in ``state``'s cache)

    @property
    def source(self) -> LMState:
        """The state the loop starts from."""
        return self.state if self.state is not None else self.context
