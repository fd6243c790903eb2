"""The LM adapter: load a causal LM from a spec, prompt it, sample reasoning steps and pool hidden states.

One code path serves the Hub, a local folder and the GGUF files shipped in PyPI packages.

Hidden-state pooling (shared by sampling, training and decoding; the pair's ``pooling``):
a step with tokens ``s_0 .. s_{k-1}`` written after a context ``c_0 .. c_{m-1}`` is summarised by
the mean of every layer's hidden state over

* ``predict``: the positions whose outputs *predict* the step's tokens — the last context position
  ``c_{m-1}`` and the step tokens ``s_0 .. s_{k-2}`` (all known when the step ends);
* ``tokens``: the step's own tokens ``s_0 .. s_{k-1}`` (the paper's wording). The output at ``s_{k-1}``
  exists only once that token is fed, which generation does at the start of the next step (or in one
  extra batched forward when there is none). An EOS token is not a step token and is not pooled.

From the pooled ``(L+1, D)`` matrix (embeddings + L blocks) we keep:

* ``h_last``   ``[D]``: the last layer (after the final norm);
* ``h_mean``   ``[D]``: the mean over the L block outputs (the paper's all-layer feature);
* ``h_layers`` ``[(L+1), D]``: every layer, for layer-mixing probes.

Generation and prefill pool over the same positions, so the same text gives the same vector.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers
from huggingface_hub import try_to_load_from_cache
from safetensors import SafetensorError
from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer, DynamicSlidingWindowLayer
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopPLogitsWarper,
)

from semspec.models.formats import Format, quantize_model, resolve_format
from semspec.models.names import FEATURE_COLUMNS
from semspec.models.pair import ModelSpec
from semspec.models.steps import step_end
from semspec.models.weights import (
    converted_cache_path,
    converted_enabled,
    converted_key,
    resolve_spec,
    stale_converted,
)

log = logging.getLogger(__name__)


def pick_device(device: str) -> torch.device:
    """``auto`` -> cuda when available, else cpu."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


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


def fits_window(cache: Cache | None, length: int) -> bool:
    """Whether ``cache`` can hold ``length`` positions with every one still in it: no sliding-window layer
    would have dropped any, so a crop can bring back any shorter context."""
    for layer in getattr(cache, "layers", []):
        window = getattr(layer, "sliding_window", None)
        if window is not None and length >= int(window) - 1:
            return False
    return True


def crop_to(cache: Cache, length: int) -> None:
    """Cut ``cache`` back to its first ``length`` positions (nothing when it is not longer)."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


@dataclass
class StepSample:
    """One sampled step."""

    text: str  # the step up to and including the delimiter (EOS text excluded)
    token_ids: list[int]  # the tokens sampled (the EOS id included when it ended the step)
    finish_reason: str  # delimiter | eos | length
    pooled: Pooled
    logprob: float  # sum of the sampled tokens' log-probabilities (after temperature / top-p)
    # ``tokens`` pooling still owed the output at the last token: (sum over the others (L+1, D), count)
    pending: tuple[torch.Tensor, int] | None = field(default=None, repr=False, compare=False)

    @property
    def num_tokens(self) -> int:
        """Number of tokens the model produced for this step."""
        return len(self.token_ids)

    def close_pooling(self, last_hidden: torch.Tensor) -> None:
        """``tokens`` pooling: add the output at the step's last token, ``(L+1, D)``, once it was fed."""
        if self.pending is not None:
            rest, count = self.pending
            self.pooled, self.pending = Pooled((rest + last_hidden) / count), None


def _pool_tokens(sample: StepSample, rest: torch.Tensor, count: int) -> None:
    """Switch ``sample`` to ``tokens`` pooling. ``rest`` (L+1, D): the summed outputs at its first
    ``count - 1`` new tokens. An EOS step is complete already (EOS is no step token); otherwise the output
    at the last token is owed (``StepSample.close_pooling``)."""
    if sample.finish_reason == "eos":
        if count > 1:
            sample.pooled = Pooled(rest / (count - 1))
        return
    sample.pending = (rest, count)


NextBudget = Callable[[int, list[StepSample]], int | None]
"""(row, its steps so far) -> the token budget of the row's next step in the same decode loop, or None."""


@dataclass
class _Run:
    """One row's output of a decode loop: its steps and its own cache."""

    samples: list[StepSample]
    cache: Cache | None = None
    # (positions, logits (V,), hidden (L+1, D)) right after the last step the loop fed; None when none
    boundary: tuple[int, torch.Tensor, torch.Tensor] | None = None
    dropped: bool = False  # the loop ended inside a lookahead step: its tokens leave the cache
    partial: Partial | None = None  # that step, for a later loop to go on with


def _for_row(more: NextBudget | None, i: int) -> NextBudget | None:
    """``more`` for a loop of row ``i`` alone."""
    return None if more is None else (lambda _b, done: more(i, done))


@dataclass
class StepScore:
    """One prefill of a step on top of its context."""

    pooled: Pooled
    token_ids: list[int]
    logprobs: torch.Tensor  # (k,) log p(s_i | context, s_<i) under the model (empty when not asked for)
    state: LMState  # the context extended by the step
    pred_hidden: torch.Tensor | None = None  # (k, L+1, D) outputs at the positions predicting each token


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


class LM:
    """A causal LM plus its tokenizer, with step-level sampling and hidden-state pooling."""

    def __init__(self, model: PreTrainedModel, tokenizer, spec: ModelSpec, fmt: Format | None = None) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.spec = spec
        self.device = next(model.parameters()).device
        # what the model runs in (``load_lm`` resolves and applies it; a model built in memory: its dtype)
        self.format: Format = fmt or _dense_format(model)
        text_cfg = model.config.get_text_config()
        self.num_layers: int = int(text_cfg.num_hidden_layers)
        self.hidden_size: int = int(text_cfg.hidden_size)
        self.eos_ids: set[int] = _eos_ids(model, tokenizer)
        self.load_seconds: float = 0.0
        # an empty cache of this model's layer types, built once: its sliding windows bound padded batches
        self._layout = DynamicCache(config=model.config)
        self._check_delimiter()
        window = getattr(text_cfg, "max_position_embeddings", None)
        self.context_window: int | None = int(window) if window else None  # positions the model was built for

    def _check_delimiter(self) -> None:
        """The step delimiter must survive this tokenizer (encoded, then decoded); otherwise no step
        would ever end at it and every step would run to its token budget."""
        mark = self.spec.delimiter if self.spec.split == "paragraph" else ". "
        ids = self.tokenizer.encode(f"a{mark}b", add_special_tokens=False)
        if mark not in self.tokenizer.decode(ids, skip_special_tokens=True):
            raise ValueError(
                f"{self.spec.model_id}: its tokenizer cannot write the step delimiter {mark!r} (it does not "
                f"survive encoding and decoding); set another `delimiter` in the pair file"
            )

    @property
    def model_id(self) -> str:
        """The spec's stable identity."""
        return self.spec.model_id

    @property
    def dtype_name(self) -> str:
        """The format the model runs in (e.g. ``bfloat16``, ``int8 (bfloat16 above 4 rows)``), printed
        beside every speed figure."""
        return self.format.label()

    def describe(self) -> dict[str, str]:
        """``{model_id, dtype, format, device, why}``: what every speed figure is printed beside (``format``
        is the short name probes are tagged with, ``why`` the format's choice on this machine)."""
        return {
            "model_id": self.model_id,
            "dtype": self.dtype_name,
            "format": self.format.name,
            "device": str(self.device),
            "why": self.format.describe(),
        }

    def __str__(self) -> str:
        return "{model_id} ({dtype}, {device})".format(**self.describe())

    # ----------------------------------------------------------------------------------- prompts
    def uses_chat_template(self) -> bool:
        """Whether prompts are built with the tokenizer's chat template."""
        has = bool(getattr(self.tokenizer, "chat_template", None))
        if self.spec.prompt == "chat" and not has:
            raise ValueError(
                f"{self.model_id}: spec says prompt: chat but the tokenizer has no chat template; "
                f"use prompt: plain or auto"
            )
        return self.spec.prompt == "chat" or (self.spec.prompt == "auto" and has)

    def format_prompt(self, question: str) -> str:
        """The text that precedes the first reasoning step."""
        if not question or not question.strip():
            raise ValueError("question must be a non-empty string")
        if not self.uses_chat_template():
            return self.spec.plain_template.format(question=question.strip())
        messages = [{"role": "user", "content": question.strip()}]
        if self.spec.system_prompt:
            messages.insert(0, {"role": "system", "content": self.spec.system_prompt})
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    def next_turn(self, instruction: str, reply_start: str) -> str:
        """The text that closes the assistant's turn, asks ``instruction`` as a new user turn and opens
        the assistant's reply with ``reply_start`` (SpecReason's verification). With a chat template the
        turns are the template's own; without one, plain lines."""
        if not self.uses_chat_template():
            return f"\n\n{instruction}\n{reply_start}"
        mark = "\x00semspec-turn\x00"
        messages = [
            {"role": "user", "content": "question"},
            {"role": "assistant", "content": mark},
            {"role": "user", "content": instruction},
            {"role": "assistant", "content": reply_start},
        ]
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, continue_final_message=True)
        if text.count(mark) != 1:
            raise ValueError(f"{self.model_id}: the chat template does not keep assistant turns verbatim")
        return text.split(mark, 1)[1]

    def encode(self, text: str) -> list[int]:
        """Token ids of a full context (special tokens added unless the text already starts with BOS)."""
        bos = self.tokenizer.bos_token
        add = not (bos and text.startswith(bos))
        return list(self.tokenizer(text, add_special_tokens=add)["input_ids"])

    def continuation_ids(self, prev_text: str, prev_ids: list[int], new_text: str) -> list[int]:
        """Ids of ``new_text`` as it tokenizes after ``prev_text`` (falls back to standalone tokenization
        when the boundary would merge tokens with the cached context)."""
        full = self.encode(prev_text + new_text)
        if full[: len(prev_ids)] == prev_ids:
            return full[len(prev_ids) :]
        return list(self.tokenizer(new_text, add_special_tokens=False)["input_ids"])

    # ----------------------------------------------------------------------------------- forward
    @torch.inference_mode()
    def forward(
        self,
        ids: torch.Tensor,
        cache: Cache | None,
        all_logits: bool = False,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, Cache]:
        """One forward pass. ``ids`` (B, T) -> logits (B, T or 1, V) float32, hidden (B, T, L+1, D) float32, cache.

        Logits are computed for the last position only unless ``all_logits``: with a large vocabulary
        (Gemma: 262k) the output head costs as much as the rest of the model per position. A padded
        batch passes its ``attention_mask`` (B, cached + T) and ``position_ids`` (B, T).
        """
        if cache is None:
            cache = DynamicCache(config=self.model.config)
        extra = {}
        if attention_mask is not None:
            extra = {
                "attention_mask": attention_mask.to(self.device),
                "position_ids": position_ids.to(self.device),
            }
        out = self.model(
            ids.to(self.device),
            cache=cache,
            use_cache=True,
            output_hidden_states=True,
            logits_to_keep=0 if all_logits else 1,
            **extra,
        )
        hidden = torch.stack(out.hidden_states, dim=2).float()  # (B, T, L+1, D)
        return out.logits.float(), hidden, out.cache

    def head(self, last_hidden: torch.Tensor) -> torch.Tensor:
        """Next-token logits from final-layer hidden states (after the final norm): (N, D) -> (N, V) float32."""
        head = self.model.get_output_embeddings()
        logits = head(last_hidden.to(self.format.activations).to(self.device)).float().cpu()
        cap = getattr(self.model.config.get_text_config(), "final_logit_softcapping", None)
        return torch.tanh(logits / cap) * cap if cap else logits

    @torch.inference_mode()
    def forward_rows(
        self, caches: list[Cache | None], new_ids: list[list[int]], all_logits: bool = False
    ) -> list[tuple[torch.Tensor, torch.Tensor, Cache]]:
        """Feed ``new_ids[b]`` after ``caches[b]`` for every row, in one padded forward.

        Each row keeps its own cache: they are stacked left-padded for the forward (the new ids
        right-padded) and split again after it, so no row ever sees another's positions. Returns, per row,
        logits (k_b, V) with ``all_logits`` else (1, V) at its last new position, hidden (k_b, L+1, D) and
        its cache (the old one extended in place when the row ran alone).
        """
        if any(not ids for ids in new_ids):
            raise ValueError("every row needs at least one new token")
        lens = [0 if c is None else c.get_seq_length() for c in caches]
        width, k = max(lens), max(len(ids) for ids in new_ids)
        if len(caches) == 1 or not self._stackable(caches, width + k):
            rows = []
            for cache, ids in zip(caches, new_ids, strict=True):
                logits, hidden, cache = self.forward(torch.tensor([ids]), cache, all_logits)
                rows.append((logits[0], hidden[0], cache))
            return rows
        stacked = self._stack(caches, lens, width)
        ids = torch.zeros(len(caches), k, dtype=torch.long)  # (B, k) right-padded
        mask = torch.zeros(len(caches), width + k, dtype=torch.long)  # (B, width + k)
        for b, row in enumerate(new_ids):
            ids[b, : len(row)] = torch.tensor(row)
            mask[b, width - lens[b] : width + len(row)] = 1
        pos = torch.tensor(lens)[:, None] + torch.arange(k)[None]  # (B, k)
        logits, hidden, stacked = self.forward(ids, stacked, all_logits, mask, pos)
        sizes = torch.tensor([len(row) for row in new_ids])
        last = (
            self.head(hidden[torch.arange(len(caches)), sizes - 1, -1]) if not all_logits else None
        )  # (B, V)
        out = []
        for b, n in enumerate(sizes.tolist()):
            row_logits = logits[b, :n] if last is None else last[b : b + 1]
            out.append((row_logits, hidden[b, :n], self._row_cache(stacked, b, width - lens[b], width + n)))
        return out

    def _stackable(self, caches: list[Cache | None], length: int) -> bool:
        """Whether these caches can be stacked into one padded batch of ``length`` positions: plain or
        sliding-window attention layers only, and no window that padding would overflow."""
        for cache in caches:
            if cache is None:
                continue
            if any(type(layer) not in (DynamicLayer, DynamicSlidingWindowLayer) for layer in cache.layers):
                return False
            if not fits_window(cache, length):
                return False
        return fits_window(self._layout, length)

    def _stack(self, caches: list[Cache | None], lens: list[int], width: int) -> Cache:
        """One cache holding every row left-padded to ``width`` positions: (B, H, width, Dh) per layer."""
        stacked = DynamicCache(config=self.model.config)
        ref = next((c for c, n in zip(caches, lens, strict=True) if n), None)
        if ref is None:
            return stacked
        for i, layer in enumerate(ref.layers):
            keys, values = [], []
            for cache, n in zip(caches, lens, strict=True):
                k = cache.layers[i].keys if n else layer.keys[:1, :, :0]  # (1, H, n, Dh)
                v = cache.layers[i].values if n else layer.values[:1, :, :0]
                keys.append(torch.nn.functional.pad(k, (0, 0, width - n, 0)))
                values.append(torch.nn.functional.pad(v, (0, 0, width - n, 0)))
            stacked.update(torch.cat(keys), torch.cat(values), i)
        return stacked

    def _row_cache(self, stacked: Cache, b: int, start: int, end: int) -> Cache:
        """Row ``b`` of a stacked cache, positions ``start:end`` (its own tokens), as a cache of its own."""
        cache = DynamicCache(config=self.model.config)
        for i, layer in enumerate(stacked.layers):
            cache.update(layer.keys[b : b + 1, :, start:end], layer.values[b : b + 1, :, start:end], i)
        return cache

    def prefill(self, text: str, state: LMState | None = None) -> LMState:
        """Cache ``text`` (a full context), or extend ``state`` by ``text`` (a continuation)."""
        return self.extend(state, text)[0] if state is not None else self.prefill_many([text])[0]

    def prefill_many(self, texts: list[str]) -> list[LMState]:
        """Cache each full context in ``texts``, all in one padded forward."""
        ids = [self.encode(text) for text in texts]
        if any(not row for row in ids):
            raise ValueError("cannot prefill an empty context")
        for row in ids:
            if self.context_window is not None and len(row) >= self.context_window:
                raise ValueError(  # refused, never silently cut: the start of a question matters
                    f"{self.model_id}: the prompt is {len(row)} tokens and the model's context holds "
                    f"{self.context_window}; shorten the question (it is not truncated)"
                )
        outs = self.forward_rows([None] * len(texts), ids)
        return [
            LMState(text, row, cache, logits[-1], hidden[-1])
            for text, row, (logits, hidden, cache) in zip(texts, ids, outs, strict=True)
        ]

    def extend(
        self, state: LMState, text: str, all_logits: bool = False
    ) -> tuple[LMState, list[int], torch.Tensor, torch.Tensor]:
        """Append ``text`` to ``state`` in one prefill (mutates ``state.cache``; clone first to keep it).

        Returns the new state, the appended ids, and the outputs at the appended positions:
        logits (k, V) with ``all_logits`` else (1, V) for the last one, and hidden (k, L+1, D).
        """
        return self.extend_many([state], [text], all_logits)[0]

    def extend_many(
        self, states: list[LMState], texts: list[str], all_logits: bool = False
    ) -> list[tuple[LMState, list[int], torch.Tensor, torch.Tensor]]:
        """``extend`` for many rows in one padded forward; each row's cache is its own."""
        new_ids = [
            self.continuation_ids(st.text, st.ids, text) for st, text in zip(states, texts, strict=True)
        ]
        if any(not ids for ids in new_ids):
            raise ValueError("cannot extend a context by an empty string")
        outs = self.forward_rows([st.cache for st in states], new_ids, all_logits)
        return [
            (LMState(st.text + text, st.ids + ids, cache, logits[-1], hidden[-1]), ids, logits, hidden)
            for st, text, ids, (logits, hidden, cache) in zip(states, texts, new_ids, outs, strict=True)
        ]

    def score_step(
        self, context: str | LMState, step_text: str, inplace: bool = False, logprobs: bool = True
    ) -> StepScore:
        """Prefill ``step_text`` after ``context`` and pool hidden states as generation does.

        A given ``LMState`` is reused: its cache is cloned, or with ``inplace`` extended in place (the
        decoder then keeps the returned state, or crops back via ``LMState.checkpoint``). A string is
        prefilled first. ``logprobs=False`` skips the per-token log-probs (and the output head for all but
        the last position), which is all a verifier needs.
        """
        if isinstance(context, str):
            base = self.prefill(context)
        else:
            base = context if inplace else context.clone()
        return self.score_steps([base], [step_text], logprobs)[0]

    def score_steps(self, states: list[LMState], texts: list[str], logprobs: bool = False) -> list[StepScore]:
        """``score_step`` in place for many rows (each its own context) in one padded prefill."""
        scores = []
        for base, (state, ids, logits, hidden) in zip(
            states, self.extend_many(states, texts, all_logits=logprobs), strict=True
        ):
            # 1. positions predicting the step: last context position + step tokens but the last
            pos_hidden = torch.cat([base.hidden[None], hidden[:-1]], dim=0)  # (k, L+1, D)
            lp = torch.empty(0)
            if logprobs:
                # 2. per-token log-probs of the step's tokens
                pos_logits = torch.cat([base.logits[None], logits[:-1]], dim=0)  # (k, V)
                lp = torch.log_softmax(pos_logits, dim=-1).gather(1, torch.tensor(ids)[:, None])[:, 0]
            at = hidden if self.spec.pooling == "tokens" else pos_hidden  # (k, L+1, D)
            scores.append(StepScore(Pooled(at.mean(dim=0)), ids, lp, state, pos_hidden))
        return scores

    @torch.inference_mode()
    def greedy_agreement(self, score: StepScore) -> int:
        """How many leading tokens of a scored step are the model's own greedy choices: the output head
        runs over the positions that predicted the step's tokens (only when asked: it costs a head pass
        per token)."""
        if score.pred_hidden is None or not score.token_ids:
            return 0
        argmax = self.head(score.pred_hidden[:, -1]).argmax(-1)  # (k,): the final layer, after its norm
        same = argmax == torch.tensor(score.token_ids)
        return int(same.long().cumprod(0).sum())

    @torch.inference_mode()
    def resume_after(
        self, context: LMState, score: StepScore, keep: int, max_tokens: int, seed: int | None = None
    ) -> StepStart | None:
        """Where to greedily write the step that starts with the first ``keep`` tokens of the scored step
        (the model's own greedy choices, see ``greedy_agreement``), reusing the cache the scoring filled:
        ``score.state`` is consumed. Decoding the returned start writes what ``decode_step(context)``
        would write greedily, token for token (the stop rules see the kept tokens too). None, with the
        cache untouched, when a sliding-window layer may have dropped positions (restore and decode)."""
        st, n, ids = score.state, len(context.ids), score.token_ids[:keep]
        if score.pred_hidden is None or not fits_window(st.cache, len(st.ids)):
            return None
        at = score.pred_hidden  # (k, L+1, D): the pooled positions of the scored step, as it pools
        if self.spec.pooling == "tokens":
            at = torch.cat([score.pred_hidden[1:], st.hidden[None]])  # outputs at the step's own tokens
        # 1. the kept tokens may already end the step (a delimiter, EOS, the budget)
        for i in range(1, min(keep, max_tokens) + 1):
            done = self._check_stop(ids[:i])
            if done is not None or i == max_tokens:
                text, reason = done or (self.tokenizer.decode(ids[:i], skip_special_tokens=True), "length")
                crop_to(st.cache, n + i - 1)
                sample = StepSample(text, ids[:i], reason, Pooled(at[:i].mean(0)), 0.0)
                return StepStart(
                    context,
                    0,
                    seed,
                    LMState(context.text, context.ids, st.cache, context.logits, context.hidden),
                    done=sample,
                )
        # 2. continue after them: outputs at the position predicting token ``keep``
        crop_to(st.cache, n + keep)
        if keep < len(score.token_ids):
            hidden = score.pred_hidden[keep]  # (L+1, D)
            logits = self.head(hidden[-1][None])[0]  # (V,)
        else:
            logits, hidden = st.logits, st.hidden
        return StepStart(
            context,
            max_tokens - keep,
            seed,
            LMState(context.text, context.ids, st.cache, logits, hidden),
            ids,
        )

    # ----------------------------------------------------------------------------------- sampling
    @torch.inference_mode()
    def generate_step(
        self,
        context: str | LMState,
        n: int = 1,
        temperature: float = 0.6,
        top_p: float = 0.95,
        max_tokens: int | None = None,
        seed: int | None = None,
    ) -> list[StepSample]:
        """Sample ``n`` continuations of ``context``, each up to and including the step delimiter, EOS
        or ``max_tokens``, in one batched decode loop (finished rows leave the batch).

        ``temperature == 0`` is greedy. The context's cache is shared (copied, not re-prefilled).
        """
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        _check_sampling(temperature, top_p)
        max_tokens = self.spec.max_step_tokens if max_tokens is None else max_tokens
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        state = self.prefill(context) if isinstance(context, str) else context
        gen = _generator(seed)
        starts = [
            StepStart(
                state,
                max_tokens,
                state=LMState(state.text, state.ids, copy.deepcopy(state.cache), state.logits, state.hidden),
            )
            for _ in range(n)
        ]
        runs = self._sample_rows(starts, temperature, top_p, [gen] * n)
        samples = [run.samples[0] for run in runs]
        self._close_pooling(samples, [run.cache for run in runs])
        return samples

    def _close_pooling(self, samples: list[StepSample], caches: list[Cache]) -> None:
        """``tokens`` pooling of steps whose last token no loop fed: feed it after each row's cache (which
        holds everything but that token; extended here) in one padded forward, and pool its output."""
        owed = [b for b, s in enumerate(samples) if s.pending is not None]
        if not owed:
            return
        fed = self.forward_rows([caches[b] for b in owed], [[samples[b].token_ids[-1]] for b in owed])
        for b, (_, hidden, _) in zip(owed, fed, strict=True):
            samples[b].close_pooling(hidden[-1])  # (L+1, D) at the step's last token

    @torch.inference_mode()
    def decode_step(
        self,
        state: LMState,
        temperature: float = 0.0,
        top_p: float = 1.0,
        max_tokens: int | None = None,
        seed: int | None = None,
    ) -> tuple[StepSample, LMState]:
        """Write one step after ``state`` reusing its KV cache in place (no copy, no re-prefill).

        Returns the step and the state extended by the step's text; ``state`` itself must not be used
        afterwards (its cache now belongs to the returned state).
        """
        max_tokens = self.spec.max_step_tokens if max_tokens is None else max_tokens
        return self.decode_steps([StepStart(state, max_tokens, seed)], temperature, top_p)[0]

    @torch.inference_mode()
    def decode_steps(
        self, starts: list[StepStart], temperature: float = 0.0, top_p: float = 1.0
    ) -> list[tuple[StepSample, LMState]]:
        """Write one step per row, all rows in one batched decode loop (each stops at its own delimiter,
        EOS or budget and leaves the batch), reusing each row's cache in place. Returns, per row, the step
        and its context extended by the step's text."""
        return [(steps[0], state) for steps, state in self.decode_runs(starts, temperature, top_p)]

    @torch.inference_mode()
    def decode_runs(
        self,
        starts: list[StepStart],
        temperature: float = 0.0,
        top_p: float = 1.0,
        min_steps: int = 1,
        more: NextBudget | None = None,
    ) -> list[tuple[list[StepSample], LMState]]:
        """Write consecutive steps per row, all rows in one batched decode loop, reusing each row's cache
        in place. Each row writes ``min_steps`` steps (fewer after EOS, an empty step or when ``more`` says
        stop); while some row still owes one, the rows that are done may write *lookahead* steps instead of
        idling, as long as ``more(row, steps so far)`` gives the next step's token budget (None: stop). A
        lookahead step still unfinished when the loop ends leaves the cache, and the returned state keeps
        it (``LMState.partial``): a later call that starts the same step (same seed) from that state goes on
        with it, when its tokens fit that call's budget. Step ``j`` of a row samples with ``seed + j``, so a
        row writes the same steps whatever the rest of the batch does. Returns, per row, its steps and its
        context extended by all of them."""
        _check_sampling(temperature, top_p)
        if min_steps < 1:
            raise ValueError(f"min_steps must be >= 1, got {min_steps}")
        if any(st.done is None and st.max_tokens < 1 for st in starts):
            raise ValueError("max_tokens must be >= 1")
        starts = self._resume_partials(starts)
        runs = [_Run([st.done], st.source.cache) if st.done is not None else None for st in starts]
        live = [i for i, st in enumerate(starts) if st.done is None]
        sub = None if more is None else (lambda b, done: more(live[b], done))
        gens = [starts[i].partial.gen if starts[i].partial else _generator(starts[i].seed) for i in live]
        sampled = self._sample_rows([starts[i] for i in live], temperature, top_p, gens, min_steps, sub)
        for i, run in zip(live, sampled, strict=True):
            runs[i] = run
        out: list[tuple[list[StepSample], LMState] | None] = [None] * len(starts)
        tails = []  # rows whose last step ends in the loop's final tokens: finished below, batched
        for i, (st, run) in enumerate(zip(starts, runs, strict=True)):
            ctx = st.context
            if run.boundary is None:
                tails.append((i, ctx))
                continue
            # the row fed its last complete step inside the loop: outputs after it were kept there
            length, logits, hidden = run.boundary
            done = run.samples if run.dropped else run.samples[:-1]
            state = LMState(
                ctx.text + "".join(x.text for x in done),
                ctx.ids + [t for x in done for t in x.token_ids],
                run.cache,
                logits,
                hidden,
            )
            if run.dropped:
                crop_to(run.cache, length)
                state.partial = run.partial
                out[i] = (run.samples, state)
            else:
                tails.append((i, state))
        finished = self._finish_steps(
            [ctx for _, ctx in tails],
            [runs[i].samples[-1] for i, _ in tails],
            [runs[i].cache for i, _ in tails],
        )
        for (i, _), (_, state) in zip(tails, finished, strict=True):
            runs[i].samples[-1].close_pooling(state.hidden)  # ``tokens`` pooling: the last token's output
            out[i] = (runs[i].samples, state)
        return out

    def _resume_partials(self, starts: list[StepStart]) -> list[StepStart]:
        """``starts`` where each row whose context holds the partial step it is about to write (same seed,
        tokens within its budget) goes on with it: the partial tokens are fed after each such context, all
        in one padded prefill, and the row's loop starts after them."""
        take = [
            i
            for i, st in enumerate(starts)
            if st.done is None
            and st.state is None
            and not st.prefix
            and (p := st.context.partial) is not None
            and p.seed == st.seed
            and len(p.tokens) < st.max_tokens
        ]
        if not take:
            return starts
        out = list(starts)
        fed = self.forward_rows(
            [starts[i].context.cache for i in take], [starts[i].context.partial.tokens for i in take]
        )
        for i, (logits, hidden, cache) in zip(take, fed, strict=True):
            st = starts[i]
            ctx = st.context
            state = LMState(ctx.text, ctx.ids, cache, logits[-1], hidden[-1])
            out[i] = StepStart(ctx, st.max_tokens, st.seed, state, partial=ctx.partial)
        return out

    def _finish_steps(
        self, contexts: list[LMState], samples: list[StepSample], caches: list[Cache]
    ) -> list[tuple[StepSample, LMState]]:
        """Each context extended by its step, given caches that hold ``context.ids + step.token_ids[:-1]``:
        the last token is fed when the step is exactly its tokens; otherwise (EOS, a delimiter cut inside a
        token, special tokens) the cache rolls back and the text is prefilled. Batched over rows."""
        out: list[LMState | None] = [None] * len(samples)
        feed, refill = [], []
        for i, (ctx, s, cache) in enumerate(zip(contexts, samples, caches, strict=True)):
            exact = (
                s.finish_reason != "eos"
                and self.tokenizer.decode(s.token_ids, skip_special_tokens=True) == s.text
            )
            if exact:
                feed.append(i)
                continue
            crop_to(cache, len(ctx.ids))
            out[i] = LMState(ctx.text, ctx.ids, cache, ctx.logits, ctx.hidden)
            if s.text:
                refill.append(i)
        fed = (
            self.forward_rows([caches[i] for i in feed], [[samples[i].token_ids[-1]] for i in feed])
            if feed
            else []
        )
        for i, (logits, hidden, cache) in zip(feed, fed, strict=True):
            ctx, s = contexts[i], samples[i]
            out[i] = LMState(ctx.text + s.text, ctx.ids + s.token_ids, cache, logits[-1], hidden[-1])
        if refill:
            extended = self.extend_many([out[i] for i in refill], [samples[i].text for i in refill])
            for i, ext in zip(refill, extended, strict=True):
                out[i] = ext[0]
        return list(zip(samples, out, strict=True))

    def _sample_rows(
        self,
        starts: list[StepStart],
        temperature: float,
        top_p: float,
        gens: list[torch.Generator],
        min_steps: int = 1,
        more: NextBudget | None = None,
    ) -> list[_Run]:
        """The batched decode loop: every row samples until its own stop, the finished ones leave the
        batch (or, see ``decode_runs``, go on with their next step). Row caches are stacked left-padded for
        the loop (or, when they cannot be, rows run one after another); each row gets back its own cache
        holding its context, prefix and sampled tokens but the last. Pooled states cover the positions
        predicting each step's newly sampled tokens, or with ``tokens`` pooling those tokens' own (a step
        that ends the loop owes its last one: ``StepSample.pending``)."""
        if not starts:
            return []
        caches = [st.source.cache for st in starts]
        lens = [c.get_seq_length() for c in caches]
        width, n = max(lens), len(starts)
        # the loop ends once no row owes a step: it runs at most min_steps budgets (budgets never grow)
        if n > 1 and not self._stackable(caches, width + min_steps * max(st.max_tokens for st in starts)):
            return [
                self._sample_rows([st], temperature, top_p, [g], min_steps, _for_row(more, i))[0]
                for i, (st, g) in enumerate(zip(starts, gens, strict=True))
            ]
        cache = self._stack(caches, lens, width) if n > 1 else caches[0]
        pads = [width - length for length in lens]
        warpers = _warpers(temperature, top_p)
        logits = torch.stack([st.source.logits for st in starts])  # (B, V)
        hidden = torch.stack([st.source.hidden for st in starts])  # (B, L+1, D)
        rows = list(range(n))  # batch row -> start index
        hsum = torch.zeros(n, self.num_layers + 1, self.hidden_size)  # (n, L+1, D)
        # ``tokens`` pooling: (n, L+1, D) the output predicting a step's first token, which it leaves out
        hfirst = torch.zeros_like(hsum) if self.spec.pooling == "tokens" else None
        lp_sum = torch.zeros(n)
        tokens = [list(st.prefix) for st in starts]
        plen, budget = [len(st.prefix) for st in starts], [st.max_tokens for st in starts]
        for i, st in enumerate(starts):
            if st.partial is not None:  # go on with a step an earlier loop began: its tokens count
                p = st.partial
                tokens[i], plen[i], hsum[i], lp_sum[i] = list(p.tokens), 0, p.hsum, p.lp_sum
                if hfirst is not None and p.hfirst is not None:
                    hfirst[i] = p.hfirst
        runs = [_Run([]) for _ in starts]
        fed = 0
        while True:
            # 1. pool the position that predicts the token about to be sampled
            idx = torch.tensor(rows)
            hsum[idx] += hidden
            if hfirst is not None:
                for b, i in enumerate(rows):
                    if len(tokens[i]) == plen[i]:
                        hfirst[i] = hidden[b]
            # 2. sample one token per live row; sort the rows: still in their step, on to the next, leaving
            nxt, lp = _sample(logits, warpers, [gens[i] for i in rows], temperature)  # (B,), (B,)
            lp_sum[idx] += lp
            going, turning, leaving = [], {}, []
            for b, i in enumerate(rows):
                tokens[i].append(int(nxt[b]))
                done = self._check_stop(tokens[i])
                if done is None and len(tokens[i]) - plen[i] < budget[i]:
                    going.append(b)
                    continue
                whole = None if done else self.tokenizer.decode(tokens[i], skip_special_tokens=True)
                text, reason = done or (whole, "length")
                count = len(tokens[i]) - plen[i]
                sample = StepSample(
                    text, tokens[i], reason, Pooled(hsum[i] / max(1, count)), float(lp_sum[i])
                )
                if hfirst is not None:
                    _pool_tokens(sample, hsum[i] - hfirst[i], count)
                runs[i].samples.append(sample)
                # a next step continues the cache as is only when the step is exactly its tokens
                if reason not in ("length", "eos") and text:
                    whole = self.tokenizer.decode(tokens[i], skip_special_tokens=True)
                exact = reason != "eos" and bool(text) and whole == text
                nxt_budget = more(i, runs[i].samples) if more is not None and exact else None
                if nxt_budget is None or nxt_budget < 1:
                    leaving.append(b)
                else:
                    turning[b] = nxt_budget
            if not any(len(runs[rows[b]].samples) < min_steps for b in going + list(turning)):
                # nobody owes a step: the loop ends; lookahead steps under way leave the cache, kept
                # aside for the next loop of these rows
                for b in going:
                    i = rows[b]
                    seed = starts[i].seed
                    runs[i].dropped = True
                    runs[i].partial = Partial(
                        list(tokens[i]),
                        hsum[i].clone(),
                        None if hfirst is None else hfirst[i].clone(),
                        float(lp_sum[i]),
                        gens[i],
                        None if seed is None else seed + len(runs[i].samples),
                    )
                leaving += going + list(turning)
                going, turning = [], {}
            for b in leaving:
                i = rows[b]
                runs[i].cache = self._row_cache(cache, b, pads[i], width + fed) if n > 1 else cache
            keep = sorted(going + list(turning))
            if not keep:
                break
            for b, nb in turning.items():  # a new step: fresh tokens, pooling and generator
                i = rows[b]
                tokens[i], plen[i], budget[i] = [], 0, nb
                hsum[i], lp_sum[i] = 0.0, 0.0
                seed = starts[i].seed
                gens[i] = _generator(None if seed is None else seed + len(runs[i].samples))
            # 3. drop finished rows and feed the live ones
            turned = {rows[b] for b in turning}
            if len(keep) < len(rows):
                cache.batch_select_indices(torch.tensor(keep))
                rows = [rows[b] for b in keep]
                nxt = nxt[keep]
            mask = pos = None
            if any(pads[i] for i in rows):
                mask = (
                    torch.arange(width + fed + 1)[None] >= torch.tensor([pads[i] for i in rows])[:, None]
                ).long()
                pos = torch.tensor([lens[i] + fed for i in rows])[:, None]
            out_logits, out_hidden, cache = self.forward(nxt[:, None], cache, False, mask, pos)
            logits, hidden = out_logits[:, -1], out_hidden[:, -1]
            fed += 1
            # the outputs right after a row's finished step: where a dropped lookahead step rolls back to
            for b, i in enumerate(rows):
                if i in turned:
                    runs[i].boundary = (lens[i] + fed, logits[b].clone(), hidden[b].clone())
                    runs[i].samples[-1].close_pooling(hidden[b])  # the output at its step's last token
        return runs

    def _check_stop(self, toks: list[int]) -> tuple[str, str] | None:
        """(text, reason) when ``toks`` ends the step, else None."""
        if toks[-1] in self.eos_ids:
            return self.tokenizer.decode(toks[:-1], skip_special_tokens=True), "eos"
        # decoding only the tail keeps this O(1) per token; an end earlier would have stopped us
        split, delimiter = self.spec.split, self.spec.delimiter
        tail = self.tokenizer.decode(toks[-8:], skip_special_tokens=True)
        if step_end(tail, split, delimiter) is None:
            return None
        text = self.tokenizer.decode(toks, skip_special_tokens=True)
        cut = step_end(text, split, delimiter)
        return None if cut is None else (text[:cut], "delimiter")


def _eos_ids(model: PreTrainedModel, tokenizer) -> set[int]:
    ids: set[int] = set()
    gen_eos = getattr(model.generation_config, "eos_token_id", None) if model.generation_config else None
    for v in (gen_eos, tokenizer.eos_token_id):
        if isinstance(v, int):
            ids.add(v)
        elif isinstance(v, list | tuple):
            ids.update(int(x) for x in v)
    return ids


def _warpers(temperature: float, top_p: float) -> LogitsProcessorList:
    procs = LogitsProcessorList()
    if temperature > 0:
        if temperature != 1.0:
            procs.append(TemperatureLogitsWarper(temperature))
        if top_p < 1.0:
            procs.append(TopPLogitsWarper(top_p))
    return procs


def _check_sampling(temperature: float, top_p: float) -> None:
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


def _generator(seed: int | None) -> torch.Generator:
    """A CPU generator seeded with ``seed`` (a fresh random seed when None)."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed if seed is not None else torch.seed() % (2**63))
    return gen


def _sample(
    logits: torch.Tensor, warpers: LogitsProcessorList, gens: list[torch.Generator], temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (B, V) -> (token ids (B,), their log-probs (B,)) under the warped distribution; row b
    draws from ``gens[b]`` (rows may share a generator)."""
    if temperature == 0:
        logp = torch.log_softmax(logits, dim=-1)
        nxt = logits.argmax(dim=-1)
    else:
        scores = warpers(None, logits.clone())
        logp = torch.log_softmax(scores, dim=-1)
        probs = logp.exp().cpu()
        nxt = torch.stack([torch.multinomial(probs[b], 1, generator=g)[0] for b, g in enumerate(gens)])
        nxt = nxt.to(logits.device)
    return nxt, logp.gather(1, nxt[:, None])[:, 0].cpu()


class _NotShardedNoise(logging.Filter):
    """transformers 5 checks a model's tensor-parallel plan at every load and warns that its layers "were
    not sharded", although nothing here shards a model: that line is dropped, every other one kept."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "were not sharded" not in record.getMessage()


_TP_LOGGER = "transformers.distributed.tensor_parallel"


_SOURCE = "semspec-source.json"  # in a converted copy: the key of the GGUF file it was made from


def _gguf_path(where: str, gguf_file: str) -> Path | None:
    """The GGUF file on disk: in a folder, or in the local Hub cache (None when not downloaded yet)."""
    local = Path(where) / gguf_file
    if local.is_file():
        return local
    cached = try_to_load_from_cache(where, gguf_file)
    return Path(cached) if isinstance(cached, str) else None


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dense_format(model: PreTrainedModel) -> Format:
    """The format of a model built in memory: its parameters' dtype."""
    return resolve_format(
        _dtype_name(next(model.parameters()).dtype), "cuda" if model.device.type == "cuda" else "cpu"
    )


def _converted_folder(spec: ModelSpec, where: str, dtype: torch.dtype) -> tuple[Path, dict] | None:
    """(folder, key) of the converted copy of ``spec``'s GGUF file in ``dtype``, or None without one
    (cache off, or the file not on disk yet)."""
    if not (spec.gguf_file and converted_enabled()):
        return None
    path = _gguf_path(where, spec.gguf_file)
    if path is None:
        return None
    verified = spec.sha256 if spec.source != "hub" else None  # resolve_spec checked it (not a Hub file)
    key = converted_key(path, _dtype_name(dtype), verified, f"transformers=={transformers.__version__}")
    return converted_cache_path(spec.model_id, key), key


def _load_converted(folder: Path, key: dict, spec: ModelSpec, dtype: torch.dtype) -> tuple | None:
    """(tokenizer, model) from a converted copy made for ``key``; None when there is none. A copy that does
    not load (cut by a full disk, edited) is deleted, so the caller converts the GGUF file again."""
    if not (folder / _SOURCE).is_file():
        return None
    try:
        if json.loads((folder / _SOURCE).read_text()) != key:
            raise ValueError("it was made from another file")
        tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=spec.trust_remote_code)
        model = AutoModelForCausalLM.from_pretrained(
            folder, dtype=dtype, trust_remote_code=spec.trust_remote_code
        )
    except (ValueError, RuntimeError, OSError, KeyError, SafetensorError) as e:
        log.warning(
            "%s: converted copy %s unusable (%s): deleting it, converting the GGUF file again",
            spec.model_id,
            folder,
            e,
        )
        shutil.rmtree(folder, ignore_errors=True)
        return None
    log.info("%s: loaded the converted copy of its GGUF file from %s", spec.model_id, folder)
    return tokenizer, model


def _save_converted(folder: Path, key: dict, tokenizer, model: PreTrainedModel) -> None:
    """Keep ``model`` and ``tokenizer`` (just converted from GGUF) in ``folder``: written under a temporary
    name and renamed when complete, so a crash or a full disk never leaves a half copy that looks whole.
    Older copies of the same model and dtype are removed. A failure only costs the next load its speed."""
    tmp = folder.with_name(f"{folder.name}.tmp{os.getpid()}")
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / _SOURCE).write_text(json.dumps(key))
        for old in stale_converted(folder):
            shutil.rmtree(old, ignore_errors=True)
        if not folder.exists():  # another process may have kept the same copy meanwhile
            os.rename(tmp, folder)
        log.info("kept the converted GGUF model in %s (SEMSPEC_GGUF_CACHE=0 turns this off)", folder)
    except OSError as e:
        log.warning(
            "could not keep a converted copy in %s (%s): the next load converts the GGUF file again",
            folder,
            e,
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def load_lm(spec: ModelSpec) -> LM:
    """Load tokenizer + causal LM described by ``spec`` (Hub id, local folder or packaged GGUF), in the
    format its ``dtype`` resolves to on this machine (``semspec.models.formats``).

    A GGUF model is converted (dequantized to the format's load dtype) once and kept in the cache in the
    Hugging Face format, keyed by the file and the dtype: later loads read that copy, bit for bit the same
    model, in seconds instead of re-parsing the GGUF file (about a minute for the embedded target here).
    The int formats quantize the loaded linear layers (seconds; logged)."""
    t0 = time.perf_counter()
    tp_log = logging.getLogger(_TP_LOGGER)
    if not any(isinstance(f, _NotShardedNoise) for f in tp_log.filters):
        tp_log.addFilter(_NotShardedNoise())
    fmt = resolve_format(spec.dtype, spec.device)
    where = resolve_spec(spec)
    converted = _converted_folder(spec, where, fmt.load_dtype)
    loaded = _load_converted(*converted, spec, fmt.load_dtype) if converted else None
    if loaded is None:
        loaded = _load_pretrained(spec, where, fmt.load_dtype)
        converted = converted or _converted_folder(spec, where, fmt.load_dtype)  # a Hub GGUF is on disk now
        if converted:
            _save_converted(*converted, *loaded)
    tokenizer, model = loaded
    model.to(pick_device(spec.device))
    if fmt.quantized:
        tq = time.perf_counter()
        n = quantize_model(model, fmt)
        log.info(
            "%s: %d linear layers quantized to %s in %.1f s",
            spec.model_id,
            n,
            fmt.name,
            time.perf_counter() - tq,
        )
    lm = LM(model, tokenizer, spec, fmt)
    lm.load_seconds = time.perf_counter() - t0
    log.info("%s runs in %s", spec.model_id, fmt.describe())
    return lm


def _load_pretrained(spec: ModelSpec, where: str, dtype: torch.dtype) -> tuple:
    """(tokenizer, model) by ``from_pretrained`` from ``where`` (a Hub id or a folder, with the GGUF file)."""
    kw: dict = {"trust_remote_code": spec.trust_remote_code}
    if spec.gguf_file:
        kw["gguf_file"] = spec.gguf_file
    log.info("loading %s from %s", spec.model_id, where)
    try:
        tokenizer = AutoTokenizer.from_pretrained(where, **kw)
        # GGUF weights are unpacked into dense ``dtype`` tensors: said explicitly, so transformers does not
        # warn that packed weights would run in float32 (they are not kept packed for these architectures,
        # nor without `kernels`); the int formats quantize them again afterwards (``quantize_model``)
        extra = {"quantization_config": GgufConfig(dequantize=True)} if spec.gguf_file else {}
        model = AutoModelForCausalLM.from_pretrained(where, dtype=dtype, **kw, **extra)
    except (ValueError, RuntimeError, OSError, KeyError, IndexError) as e:
        if not spec.gguf_file:
            raise
        # a cut GGUF file surfaces as a reshape or read error deep in the converter: name the file
        path = Path(where) / spec.gguf_file
        raise ValueError(
            f"{spec.model_id}: cannot read the GGUF file {path} ({type(e).__name__}: {e}); it is probably "
            f"truncated or corrupt: pin its sha256 in the pair file to have it checked, or reinstall the "
            f"package that provides it"
        ) from e
    return tokenizer, model
