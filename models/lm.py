"""The LM adapter: load a causal LM from a spec, prompt it, sample reasoning steps and pool hidden states.

One code path serves the Hub, a local folder and the GGUF files shipped in PyPI packages.

Hidden-state pooling (shared by sampling, training and decoding):
a step with tokens ``s_0 .. s_{k-1}`` written after a context ``c_0 .. c_{m-1}`` is summarised by
the mean, over the positions whose outputs *predict* the step's tokens — the last context position
``c_{m-1}`` and the step tokens ``s_0 .. s_{k-2}`` — of every layer's hidden state. From the pooled
``(L+1, D)`` matrix (embeddings + L blocks) we keep:

* ``h_last``   ``[D]``: the last layer (after the final norm);
* ``h_mean``   ``[D]``: the mean over the L block outputs (the paper's all-layer feature);
* ``h_layers`` ``[(L+1), D]``: every layer, for layer-mixing probes.

Generation and prefill pool over the same positions, so the same text gives the same vector.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopPLogitsWarper,
)

from semspec.models.pair import ModelSpec
from semspec.models.weights import resolve_spec

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "auto": "auto"}


def pick_device(device: str) -> torch.device:
    """``auto`` -> cuda when available, else cpu."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


@dataclass
class Pooled:
    """Hidden states pooled over the positions that predict a step's tokens."""

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
        """The probe input named ``name``: ``last`` ``[D]``, ``all``/``mean`` ``[D]``, ``layers`` ``[L+1, D]``."""
        if name == "last":
            return self.h_last
        if name in ("all", "mean"):
            return self.h_mean
        if name in ("layers", "mix"):
            return self.h_layers
        raise ValueError(f"unknown feature {name!r}; expected last, all or mix")


@dataclass
class LMState:
    """A context held in the KV cache: every id is in ``cache``; ``logits``/``hidden`` are the outputs
    at the last position (they predict the next token)."""

    text: str
    ids: list[int]
    cache: Cache
    logits: torch.Tensor  # (V,)
    hidden: torch.Tensor  # (L+1, D)

    def clone(self) -> LMState:
        """A deep copy whose cache can be extended without touching this one."""
        return LMState(self.text, list(self.ids), copy.deepcopy(self.cache), self.logits, self.hidden)

    def checkpoint(self, extra_tokens: int) -> Callable[[], LMState]:
        """Remember this state before its cache is extended by up to ``extra_tokens``; the returned
        function restores it by cropping the cache (or from a copy when a sliding-window layer would
        have dropped positions that a crop cannot bring back)."""
        n = len(self.ids)
        windows = [getattr(layer, "sliding_window", None) for layer in getattr(self.cache, "layers", [])]
        if any(w is not None and n + extra_tokens >= int(w) - 1 for w in windows):
            saved = self.clone()
            return lambda: saved
        text, ids, logits, hidden, cache = self.text, list(self.ids), self.logits, self.hidden, self.cache

        def restore() -> LMState:
            extra = cache.get_seq_length() - n
            if extra > 0:
                cache.crop(-extra)
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

    @property
    def num_tokens(self) -> int:
        """Number of tokens the model produced for this step."""
        return len(self.token_ids)


@dataclass
class StepScore:
    """One prefill of a step on top of its context."""

    pooled: Pooled
    token_ids: list[int]
    logprobs: torch.Tensor  # (k,) log p(s_i | context, s_<i) under the model (empty when not asked for)
    state: LMState  # the context extended by the step
    pred_hidden: torch.Tensor | None = None  # (k, L+1, D) outputs at the positions predicting each token


class LM:
    """A causal LM plus its tokenizer, with step-level sampling and hidden-state pooling."""

    def __init__(self, model: PreTrainedModel, tokenizer, spec: ModelSpec) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.spec = spec
        self.device = next(model.parameters()).device
        text_cfg = model.config.get_text_config()
        self.num_layers: int = int(text_cfg.num_hidden_layers)
        self.hidden_size: int = int(text_cfg.hidden_size)
        self.eos_ids: set[int] = _eos_ids(model, tokenizer)
        self.load_seconds: float = 0.0

    @property
    def model_id(self) -> str:
        """The spec's stable identity."""
        return self.spec.model_id

    @property
    def dtype_name(self) -> str:
        """The dtype the weights run in (e.g. ``bfloat16``), printed beside every speed figure."""
        return str(next(self.model.parameters()).dtype).removeprefix("torch.")

    def describe(self) -> dict[str, str]:
        """``{model_id, dtype, device}``: what every speed figure is printed beside."""
        return {"model_id": self.model_id, "dtype": self.dtype_name, "device": str(self.device)}

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
        self, ids: torch.Tensor, cache: Cache | None, all_logits: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, Cache]:
        """One forward pass. ``ids`` (B, T) -> logits (B, T or 1, V) float32, hidden (B, T, L+1, D) float32, cache.

        Logits are computed for the last position only unless ``all_logits``: with a large vocabulary
        (Gemma: 262k) the output head costs as much as the rest of the model per position.
        """
        if cache is None:
            cache = DynamicCache(config=self.model.config)
        out = self.model(
            ids.to(self.device),
            cache=cache,
            use_cache=True,
            output_hidden_states=True,
            logits_to_keep=0 if all_logits else 1,
        )
        hidden = torch.stack(out.hidden_states, dim=2).float()  # (B, T, L+1, D)
        return out.logits.float(), hidden, out.cache

    def prefill(self, text: str, state: LMState | None = None) -> LMState:
        """Cache ``text`` (a full context), or extend ``state`` by ``text`` (a continuation)."""
        return self.extend(state, text)[0] if state is not None else self._prefill_full(text)

    def _prefill_full(self, text: str) -> LMState:
        ids = self.encode(text)
        if not ids:
            raise ValueError("cannot prefill an empty context")
        logits, hidden, cache = self.forward(torch.tensor([ids]), None)
        return LMState(text, ids, cache, logits[0, -1], hidden[0, -1])

    def extend(
        self, state: LMState, text: str, all_logits: bool = False
    ) -> tuple[LMState, list[int], torch.Tensor, torch.Tensor]:
        """Append ``text`` to ``state`` in one prefill (mutates ``state.cache``; clone first to keep it).

        Returns the new state, the appended ids, and the outputs at the appended positions:
        logits (k, V) with ``all_logits`` else (1, V) for the last one, and hidden (k, L+1, D).
        """
        new_ids = self.continuation_ids(state.text, state.ids, text)
        if not new_ids:
            raise ValueError("cannot extend a context by an empty string")
        logits, hidden, cache = self.forward(torch.tensor([new_ids]), state.cache, all_logits)
        new_state = LMState(state.text + text, state.ids + new_ids, cache, logits[0, -1], hidden[0, -1])
        return new_state, new_ids, logits[0], hidden[0]

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
        state, ids, logits, hidden = self.extend(base, step_text, all_logits=logprobs)
        # 1. positions predicting the step: last context position + step tokens but the last
        pos_hidden = torch.cat([base.hidden[None], hidden[:-1]], dim=0)  # (k, L+1, D)
        lp = torch.empty(0)
        if logprobs:
            # 2. per-token log-probs of the step's tokens
            pos_logits = torch.cat([base.logits[None], logits[:-1]], dim=0)  # (k, V)
            lp = torch.log_softmax(pos_logits, dim=-1).gather(1, torch.tensor(ids)[:, None])[:, 0]
        return StepScore(Pooled(pos_hidden.mean(dim=0)), ids, lp, state, pos_hidden)

    @torch.inference_mode()
    def greedy_agreement(self, score: StepScore) -> int:
        """How many leading tokens of a scored step are the model's own greedy choices: the output head
        runs over the positions that predicted the step's tokens (only when asked: it costs a head pass
        per token)."""
        if score.pred_hidden is None or not score.token_ids:
            return 0
        head = self.model.get_output_embeddings()
        last = score.pred_hidden[:, -1].to(head.weight.dtype)  # (k, D): the final layer, after its norm
        argmax = head(last.to(self.device)).argmax(-1).cpu()  # (k,)
        same = argmax == torch.tensor(score.token_ids)
        return int(same.long().cumprod(0).sum())

    @torch.inference_mode()
    def continue_after(
        self,
        context: LMState,
        score: StepScore,
        keep: int,
        max_tokens: int,
        seed: int | None = None,
    ) -> tuple[StepSample, LMState] | None:
        """Greedily write the step that starts with the first ``keep`` tokens of the scored step (the
        model's own greedy choices, see ``greedy_agreement``) and continues from there, reusing the cache
        the scoring filled: ``score.state`` is consumed. The result is what ``decode_step(context)`` would
        write greedily, token for token (the stop rules see the kept tokens too). None, with the cache
        untouched, when a sliding-window layer may have dropped positions (restore and decode instead)."""
        st, n, ids = score.state, len(context.ids), score.token_ids[:keep]
        windows = [getattr(layer, "sliding_window", None) for layer in getattr(st.cache, "layers", [])]
        if score.pred_hidden is None or any(w is not None and len(st.ids) >= int(w) - 1 for w in windows):
            return None
        # 1. the kept tokens may already end the step (a delimiter, EOS, the budget)
        for i in range(1, min(keep, max_tokens) + 1):
            done = self._check_stop(ids[:i])
            if done is not None or i == max_tokens:
                text, reason = done or (self.tokenizer.decode(ids[:i], skip_special_tokens=True), "length")
                self._crop_to(st.cache, n + i - 1)
                sample = StepSample(text, ids[:i], reason, Pooled(score.pred_hidden[:i].mean(0)), 0.0)
                return self._step_state(context, sample, st.cache)
        # 2. continue after them: outputs at the position predicting token ``keep``
        self._crop_to(st.cache, n + keep)
        if keep < len(score.token_ids):
            hidden = score.pred_hidden[keep]  # (L+1, D)
            head = self.model.get_output_embeddings()
            logits = head(hidden[-1].to(head.weight.dtype).to(self.device)).float().cpu()  # (V,)
        else:
            logits, hidden = st.logits, st.hidden
        start = LMState(context.text, context.ids, st.cache, logits, hidden)
        samples, cache = self._sample_loop(start, st.cache, 1, 0.0, 1.0, max_tokens - keep, seed, prefix=ids)
        return self._step_state(context, samples[0], cache)

    @staticmethod
    def _crop_to(cache: Cache, length: int) -> None:
        extra = cache.get_seq_length() - length
        if extra > 0:
            cache.crop(-extra)

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
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        max_tokens = self.spec.max_step_tokens if max_tokens is None else max_tokens
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        state = self.prefill(context) if isinstance(context, str) else context
        cache = copy.deepcopy(state.cache)
        if n > 1:
            cache.batch_repeat_interleave(n)
        return self._sample_loop(state, cache, n, temperature, top_p, max_tokens, seed)[0]

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
        if temperature < 0 or not 0.0 < top_p <= 1.0:
            raise ValueError(f"temperature must be >= 0 and top_p in (0, 1], got {temperature}, {top_p}")
        max_tokens = self.spec.max_step_tokens if max_tokens is None else max_tokens
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        samples, cache = self._sample_loop(state, state.cache, 1, temperature, top_p, max_tokens, seed)
        return self._step_state(state, samples[0], cache)

    def _step_state(self, state: LMState, s: StepSample, cache: Cache) -> tuple[StepSample, LMState]:
        """``state`` extended by step ``s``, given a ``cache`` that holds ``state.ids + s.token_ids[:-1]``."""
        k = len(s.token_ids)
        exact = (
            s.finish_reason != "eos"
            and self.tokenizer.decode(s.token_ids, skip_special_tokens=True) == s.text
        )
        if exact:
            # 1. the step is exactly the sampled tokens: feed the last one
            logits, hidden, cache = self.forward(torch.tensor([[s.token_ids[-1]]]), cache)
            return s, LMState(
                state.text + s.text, state.ids + s.token_ids, cache, logits[0, -1], hidden[0, -1]
            )
        # 2. EOS, a delimiter cut inside a token, or special tokens: roll back and prefill the text
        if k > 1:
            cache.crop(-(k - 1))
        base = LMState(state.text, state.ids, cache, state.logits, state.hidden)
        return s, (self.extend(base, s.text)[0] if s.text else base)

    def _sample_loop(
        self,
        state: LMState,
        cache: Cache,
        n: int,
        temperature: float,
        top_p: float,
        max_tokens: int,
        seed: int | None,
        prefix: list[int] | None = None,
    ) -> tuple[list[StepSample], Cache]:
        """The batched decode loop behind ``generate_step`` and ``decode_step``; ``cache`` holds the
        context ``n`` times and is advanced in place. ``prefix``: tokens of the step already in the cache
        (after ``state.ids``; ``state``'s outputs are those at the last of them): the stop rules and the
        returned tokens include them, ``max_tokens`` counts the new ones."""
        gen = torch.Generator(device="cpu")
        gen.manual_seed(seed if seed is not None else torch.seed() % (2**63))
        warpers = _warpers(temperature, top_p)
        logits = state.logits[None].expand(n, -1)  # (B, V)
        hidden = state.hidden[None].expand(n, -1, -1)  # (B, L+1, D)
        rows = list(range(n))  # batch row -> sample index
        hsum = torch.zeros(n, self.num_layers + 1, self.hidden_size)  # (n, L+1, D)
        lp_sum = torch.zeros(n)
        tokens: list[list[int]] = [list(prefix or []) for _ in range(n)]
        texts, reasons = [""] * n, ["length"] * n
        for t in range(max_tokens):
            # 1. pool the position that predicts the token about to be sampled
            idx = torch.tensor(rows)
            hsum[idx] += hidden
            # 2. sample one token per live row
            nxt, lp = _sample(logits, warpers, gen, temperature)  # (B,), (B,)
            lp_sum[idx] += lp
            keep = []
            for b, i in enumerate(rows):
                tokens[i].append(int(nxt[b]))
                done = self._check_stop(tokens[i])
                if done is None:
                    keep.append(b)
                else:
                    texts[i], reasons[i] = done
            if not keep or t == max_tokens - 1:
                break
            # 3. drop finished rows and feed the live ones
            if len(keep) < len(rows):
                cache.batch_select_indices(torch.tensor(keep))
                rows = [rows[b] for b in keep]
                nxt = nxt[keep]
            out_logits, out_hidden, cache = self.forward(nxt[:, None], cache)
            logits, hidden = out_logits[:, -1], out_hidden[:, -1]
        samples = []
        for i in range(n):
            if reasons[i] == "length":
                texts[i] = self.tokenizer.decode(tokens[i], skip_special_tokens=True)
            pooled = Pooled(hsum[i] / max(1, len(tokens[i]) - len(prefix or [])))
            samples.append(StepSample(texts[i], tokens[i], reasons[i], pooled, float(lp_sum[i])))
        return samples, cache

    def _check_stop(self, toks: list[int]) -> tuple[str, str] | None:
        """(text, reason) when ``toks`` ends the step, else None."""
        if toks[-1] in self.eos_ids:
            return self.tokenizer.decode(toks[:-1], skip_special_tokens=True), "eos"
        # decoding only the tail keeps this O(1) per token; a delimiter earlier would have stopped us
        tail = self.tokenizer.decode(toks[-4:], skip_special_tokens=True)
        if self.spec.delimiter not in tail:
            return None
        text = self.tokenizer.decode(toks, skip_special_tokens=True)
        cut = text.find(self.spec.delimiter)
        return text[: cut + len(self.spec.delimiter)], "delimiter"


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


def _sample(
    logits: torch.Tensor, warpers: LogitsProcessorList, gen: torch.Generator, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (B, V) -> (token ids (B,), their log-probs (B,)) under the warped distribution."""
    if temperature == 0:
        logp = torch.log_softmax(logits, dim=-1)
        nxt = logits.argmax(dim=-1)
    else:
        scores = warpers(None, logits.clone())
        logp = torch.log_softmax(scores, dim=-1)
        nxt = torch.multinomial(logp.exp().cpu(), 1, generator=gen)[:, 0].to(logits.device)
    return nxt, logp.gather(1, nxt[:, None])[:, 0].cpu()


def load_lm(spec: ModelSpec) -> LM:
    """Load tokenizer + causal LM described by ``spec`` (Hub id, local folder or packaged GGUF)."""
    t0 = time.perf_counter()
    where = resolve_spec(spec)
    kw: dict = {"trust_remote_code": spec.trust_remote_code}
    if spec.gguf_file:
        kw["gguf_file"] = spec.gguf_file
    log.info("loading %s from %s", spec.model_id, where)
    tokenizer = AutoTokenizer.from_pretrained(where, **kw)
    model = AutoModelForCausalLM.from_pretrained(where, dtype=_DTYPES[spec.dtype], **kw)
    model.to(pick_device(spec.device))
    lm = LM(model, tokenizer, spec)
    lm.load_seconds = time.perf_counter() - t0
    return lm
