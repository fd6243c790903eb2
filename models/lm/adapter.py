"""``LM``: a causal LM and its tokenizer as the decoders and stages use it: prompts, encoding, (padded)
forwards, prefill, extend and scoring of steps, greedy agreement, and step sampling (the loop itself is
``step_loop``)."""

from __future__ import annotations

import copy

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache

from semspec.models.cpu import attention, decode_layer, int4_kernel, int8_kernel
from semspec.models.cpu.formats import Format, resolve_format
from semspec.models.lm.cache import crop_to, fits_window, row_cache, stack_caches, stackable
from semspec.models.lm.pair import ModelSpec
from semspec.models.lm.prompts import Prompt, RawPrompt, check_messages, neutralize, plain_chat
from semspec.models.lm.step_loop import LoopRun, check_sampling, generator, sample_rows
from semspec.models.lm.types import (
    LMState,
    NextBudget,
    Pooled,
    StepSample,
    StepScore,
    StepStart,
)
from semspec.models.spec.steps import step_end


class LM:
    """A causal LM plus its tokenizer, with step-level sampling and hidden-state pooling."""

    def __init__(self, model: PreTrainedModel, tokenizer, spec: ModelSpec, fmt: Format | None = None) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.spec = spec
        self.device = next(model.parameters()).device
        if self.device.type == "cpu":  # decoding calls through semspec's kernels
            attention.use_decode_attention(model)  # one query per row attends (models/cpu/attention.py)
            decode_layer.install(model)  # int8 Llama/Qwen2 layers, whole (models/cpu/decode_layer.py)
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
            "why": self.format.describe()
            + {"int8": f"; {int8_kernel.describe()}", "int4": f"; {int4_kernel.describe()}"}.get(
                self.format.name, ""
            )
            + f"; {attention.describe(self.model)}"
            + (f"; {layers}" if (layers := decode_layer.describe(self.model)) else ""),
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

    def format_prompt(self, question: Prompt) -> str:
        """The text that precedes the first reasoning step: ``question`` in the pair's template (a chat
        template's user turn, else ``plain_template``); a list of messages rendered by the chat template
        (or as plain paragraphs); a ``RawPrompt`` as it is. Control-token strings inside user text are
        neutralized (``models/lm/prompts.py``)."""
        if isinstance(question, RawPrompt):
            if not question:
                raise ValueError("the prompt is empty")
            return str(question)
        if isinstance(question, str):
            if not question.strip():
                raise ValueError("question must be a non-empty string")
            messages = [{"role": "user", "content": question.strip()}]
        else:
            messages = check_messages(question)
        specials = self._control_tokens()
        messages = [{**m, "content": neutralize(m["content"], specials)} for m in messages]
        if not self.uses_chat_template():
            return plain_chat(messages, self.spec.plain_template)
        if self.spec.system_prompt and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": self.spec.system_prompt})
        reply = messages[-1]["role"] == "assistant"  # a prefilled reply: continue it
        try:
            return self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=not reply, continue_final_message=reply, tokenize=False
            )
        except Exception as e:  # jinja's TemplateError: the template's own rules (alternating roles, ...)
            raise ValueError(f"{self.model_id}'s chat template refuses these messages: {e}") from None

    def _control_tokens(self) -> list[str]:
        """Every special or added control-token string of the tokenizer."""
        added = getattr(self.tokenizer, "added_tokens_decoder", {}) or {}
        return sorted({*self.tokenizer.all_special_tokens, *(t.content for t in added.values() if t.special)})

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
        if (
            attention_mask is None
            and (whole := decode_layer.decode_model(self.model, ids, cache)) is not None
        ):
            logits, hidden = whole  # a decoding call of unpadded rows, the model's layers all in the kernel
            return logits.float(), hidden.to(torch.float32, memory_format=torch.contiguous_format), cache
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
        if len(caches) == 1 or not stackable(caches, self._layout, width + k):
            rows = []
            for cache, ids in zip(caches, new_ids, strict=True):
                logits, hidden, cache = self.forward(torch.tensor([ids]), cache, all_logits)
                rows.append((logits[0], hidden[0], cache))
            return rows
        stacked = stack_caches(self.model.config, caches, lens, width)
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
            out.append(
                (
                    row_logits,
                    hidden[b, :n],
                    row_cache(self.model.config, stacked, b, width - lens[b], width + n),
                )
            )
        return out

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
        return [run[0] for run in self.score_runs(states, [[text] for text in texts], logprobs)]

    @torch.inference_mode()
    def score_runs(
        self, states: list[LMState], runs: list[list[str]], logprobs: bool = False
    ) -> list[list[StepScore]]:
        """Score each row's consecutive steps ``runs[b]`` after ``states[b]``, all of them in one padded
        prefill (mutates each ``states[b].cache``): one pass over the weights for a row's whole run, where
        scoring step by step makes one per step.

        Step ``j``'s score is what ``score_steps`` gives for it after the steps before it (the same
        positions, ids and pooling; the prefill's shape may round bfloat16 otherwise). Its ``state`` is the
        context up to and including the step; every state of a row shares the row's cache, which holds
        the whole run: a caller that keeps an earlier step's state crops the cache to that state's ids
        (``crop_to``; ``LMState.checkpoint`` and ``resume_after`` crop to what they restore).
        """
        if len(states) != len(runs) or any(not run for run in runs):
            raise ValueError("score_runs needs one non-empty run of steps per state")
        new_ids: list[list[int]] = []  # row -> the ids of its whole run
        ends: list[list[int]] = []  # row -> where each of its steps ends in ``new_ids[b]``
        for st, run in zip(states, runs, strict=True):
            text, ids, row_ends = st.text, list(st.ids), []
            for step in run:
                new = self.continuation_ids(text, ids, step)
                if not new:
                    raise ValueError("cannot score an empty step")
                text, ids = text + step, ids + new
                row_ends.append(len(ids) - len(st.ids))
            new_ids.append(ids[len(st.ids) :])
            ends.append(row_ends)
        outs = self.forward_rows([st.cache for st in states], new_ids, logprobs)
        # the outputs at each step's last token but the run's last predict the next step: one head call
        # for every such position of every row (the forward computed the run's last only)
        inner = [outs[b][1][e - 1, -1] for b, row_ends in enumerate(ends) for e in row_ends[:-1]]
        mid_logits = iter(self.head(torch.stack(inner)) if inner and not logprobs else [])  # (len(inner), V)
        scores = []
        for st, run, row_ends, ids, (logits, hidden, cache) in zip(
            states, runs, ends, new_ids, outs, strict=True
        ):
            text, prev_logits, prev_hidden, at, out = st.text, st.logits, st.hidden, 0, []
            for j, (step, end) in enumerate(zip(run, row_ends, strict=True)):
                new, seg = ids[at:end], hidden[at:end]  # seg (k, L+1, D): outputs at the step's own tokens
                # 1. positions predicting the step: the position before it + its tokens but the last
                pos_hidden = torch.cat([prev_hidden[None], seg[:-1]], dim=0)  # (k, L+1, D)
                lp = torch.empty(0)
                if logprobs:  # 2. per-token log-probs of the step's tokens
                    seg_logits = logits[at:end]  # (k, V)
                    pos_logits = torch.cat([prev_logits[None], seg_logits[:-1]], dim=0)  # (k, V)
                    lp = torch.log_softmax(pos_logits, dim=-1).gather(1, torch.tensor(new)[:, None])[:, 0]
                    end_logits = seg_logits[-1]
                else:
                    end_logits = logits[-1] if j == len(run) - 1 else next(mid_logits)
                text, prev_logits, prev_hidden = text + step, end_logits, seg[-1]
                pooled = Pooled((seg if self.spec.pooling == "tokens" else pos_hidden).mean(dim=0))
                state = LMState(text, st.ids + ids[:end], cache, end_logits, seg[-1])
                out.append(StepScore(pooled, new, lp, state, pos_hidden))
                at = end
            scores.append(out)
        return scores

    @torch.inference_mode()
    def read_tokens(self, scores: list[StepScore]) -> None:
        """Fill each scored step's ``token_p`` (the probability the model gives each of its tokens) and
        ``greedy`` (the model's argmax at each position): the output head runs once over the positions
        that predicted the tokens of every step (rows together), where the scoring prefill ran it only at
        each step's end. A score already read is left alone."""
        todo = [sc for sc in scores if sc.token_p is None and sc.pred_hidden is not None and sc.token_ids]
        if not todo:
            return
        logits = self.head(torch.cat([sc.pred_hidden[:, -1] for sc in todo]))  # (sum k, V) float32
        ids = torch.tensor([t for sc in todo for t in sc.token_ids])  # (sum k,)
        token_p = (logits.gather(1, ids[:, None])[:, 0] - torch.logsumexp(logits, dim=-1)).exp()  # (sum k,)
        greedy = logits.argmax(-1)  # (sum k,)
        at = 0
        for sc in todo:
            k = len(sc.token_ids)
            sc.token_p, sc.greedy = token_p[at : at + k], greedy[at : at + k]
            at += k

    def greedy_agreement(self, score: StepScore) -> int:
        """How many leading tokens of a scored step are the model's own greedy choices (``read_tokens``:
        a head pass over the step's positions, only when asked)."""
        self.read_tokens([score])
        if score.greedy is None:
            return 0
        same = score.greedy == torch.tensor(score.token_ids)
        return int(same.long().cumprod(0).sum())

    @torch.inference_mode()
    def resume_after(
        self, context: LMState, score: StepScore, keep: int, max_tokens: int, seed: int | None = None
    ) -> StepStart | None:
        """Where to greedily write the step that starts with the first ``keep`` tokens of the scored step
        (the model's own greedy choices, see ``greedy_agreement``), reusing the cache the scoring filled:
        ``score.state`` is consumed. Decoding the returned start writes what decoding a step after ``context``
        would write greedily (``decode_steps``), token for token (the stop rules see the kept tokens too). None, with the
        cache untouched, when a sliding-window layer may have dropped positions (restore and decode)."""
        st, n, ids = score.state, len(context.ids), score.token_ids[:keep]
        if score.pred_hidden is None or not fits_window(st.cache, len(st.ids)):
            return None
        at = score.pred_hidden  # (k, L+1, D): the pooled positions of the scored step, as it pools
        if self.spec.pooling == "tokens":
            at = torch.cat([score.pred_hidden[1:], st.hidden[None]])  # outputs at the step's own tokens
        # 1. the kept tokens may already end the step (a delimiter, EOS, the budget)
        for i in range(1, min(keep, max_tokens) + 1):
            done = self.check_stop(ids[:i])
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
        check_sampling(temperature, top_p)
        max_tokens = self.spec.max_step_tokens if max_tokens is None else max_tokens
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        state = self.prefill(context) if isinstance(context, str) else context
        gen = generator(seed)
        starts = [
            StepStart(
                state,
                max_tokens,
                state=LMState(state.text, state.ids, copy.deepcopy(state.cache), state.logits, state.hidden),
            )
            for _ in range(n)
        ]
        runs = sample_rows(self, starts, temperature, top_p, [gen] * n)
        samples = [run.samples[0] for run in runs]
        self._close_pooling(samples, [run.cache for run in runs])
        return samples

    def _close_pooling(self, samples: list[StepSample], caches: list[Cache]) -> None:
        """``tokens`` pooling of steps whose last token no loop fed: feed it after each row's cache (which
        holds everything but that token; extended here) in one padded forward, and pool its output."""
        owed = [b for b, s in enumerate(samples) if s.owed is not None]
        if not owed:
            return
        fed = self.forward_rows([caches[b] for b in owed], [[samples[b].token_ids[-1]] for b in owed])
        for b, (_, hidden, _) in zip(owed, fed, strict=True):
            samples[b].close_pooling(hidden[-1])  # (L+1, D) at the step's last token

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
        check_sampling(temperature, top_p)
        if min_steps < 1:
            raise ValueError(f"min_steps must be >= 1, got {min_steps}")
        if any(st.done is None and st.max_tokens < 1 for st in starts):
            raise ValueError("max_tokens must be >= 1")
        starts = self._resume_partials(starts)
        return self._run_states(starts, self._loop(starts, temperature, top_p, min_steps, more))

    def _loop(
        self,
        starts: list[StepStart],
        temperature: float,
        top_p: float,
        min_steps: int,
        more: NextBudget | None,
    ) -> list[LoopRun]:
        """The decode loop over the rows that still write a step (a row whose start is already a finished
        step, ``StepStart.done``, has that step as its run); each row draws from its partial step's
        generator or a fresh one seeded with its seed."""
        runs = [LoopRun([st.done], st.source.cache) if st.done is not None else None for st in starts]
        live = [i for i, st in enumerate(starts) if st.done is None]
        sub = None if more is None else (lambda b, done: more(live[b], done))
        gens = [starts[i].partial.gen if starts[i].partial else generator(starts[i].seed) for i in live]
        sampled = sample_rows(self, [starts[i] for i in live], temperature, top_p, gens, min_steps, sub)
        for i, run in zip(live, sampled, strict=True):
            runs[i] = run
        return runs

    def _run_states(
        self, starts: list[StepStart], runs: list[LoopRun]
    ) -> list[tuple[list[StepSample], LMState]]:
        """Each row's steps and its context extended by all of them: from the outputs the loop kept after
        the row's last complete step, else by finishing the last step (``_finish_steps``, batched)."""
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

    def check_stop(self, toks: list[int]) -> tuple[str, str] | None:
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


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dense_format(model: PreTrainedModel) -> Format:
    """The format of a model built in memory: its parameters' dtype."""
    return resolve_format(
        dtype_name(next(model.parameters()).dtype), "cuda" if model.device.type == "cuda" else "cpu"
    )
