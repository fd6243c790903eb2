"""Decoders with one call signature and one result type.

Every decoder is ``decode(question) -> DecodeResult``: the text, the final answer, and a per-step
trace (who wrote each step, tokens per model, p, q, the acceptance draw, timings).

* ``target`` / ``draft``: one model alone, step by step on its KV cache (plain autoregressive cost).
* ``semanticspec``: the paper's Algorithm 1 — the draft writes a step, the target prefills it on its
  cached context, probes give q (draft) and p (target), the step is accepted with probability
  min(1, p/q); otherwise the target writes the step itself from the last accepted context.
* ``specreason``: the target scores each draft step 0-9 with a verification prompt; accept at a threshold.

The token-level baselines (``specsampling``, ``assisted``) live in ``semspec.models.token_level``.

Steps travel between the models as text; each model re-tokenises them, so the pair may use different
tokenizers. Both models keep their caches across steps: accepted text is appended, rejected text is
cropped away; nothing re-prefills the whole context.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Protocol

import torch

from semspec.models.grading import extract_answer
from semspec.models.lm import LM, LMState, Pooled, StepSample, StepScore


class MethodNotApplicable(ValueError):
    """A decoding method that cannot run on this pair (e.g. token-level speculation across two
    vocabularies); evaluation and the bench skip it and report the reason."""


ProbeFn = Callable[[Pooled], float]  # pooled hidden states of a step -> semantic probability
StepCallback = Callable[["StepRecord"], None]  # called as each step is accepted or rewritten


@dataclass
class DecodeSettings:
    """Knobs shared by every decoder."""

    max_new_tokens: int = 256  # output budget (target-tokenizer tokens where a target is involved)
    step_tokens: int | None = None  # per-step budget; None: each model spec's max_step_tokens
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    gamma: int = 1  # steps drafted before verification (paper default 1)
    min_ratio: float | None = None  # also reject when p/q falls below this (off by default)
    accept_threshold: int = 7  # specreason: accept steps scored at or above this (0-9)
    salvage: bool = True  # greedy semanticspec: a rejected step keeps its prefix the target agrees with
    seed: int = 0
    benchmark: str = "math"  # how to extract the final answer (gpqa: a letter)

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.step_tokens is not None and self.step_tokens < 1:
            raise ValueError(f"step_tokens must be >= 1, got {self.step_tokens}")
        if self.gamma < 1:
            raise ValueError(f"gamma must be >= 1, got {self.gamma}")
        if self.min_ratio is not None and self.min_ratio < 0:
            raise ValueError(f"min_ratio must be >= 0, got {self.min_ratio}")
        if not 0 <= self.accept_threshold <= 9:
            raise ValueError(f"accept_threshold must be in 0..9, got {self.accept_threshold}")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ValueError("temperature must be >= 0 and top_p in (0, 1]")


@dataclass
class StepRecord:
    """One step of the output."""

    author: str  # draft | target
    text: str
    draft_tokens: int  # tokens of the step in the draft's tokenizer (0 if the draft never saw it)
    target_tokens: int  # tokens of the step in the target's tokenizer (0 if the target never saw it)
    p: float | None = None  # target probe
    q: float | None = None  # draft probe
    u: float | None = None  # the acceptance draw
    score: int | None = None  # specreason's 0-9 score
    proposal: str | None = None  # a rejected draft step (what the target rewrote)
    salvaged: int = 0  # target tokens of the rejected proposal that the rewrite kept (salvage)


@dataclass
class Timings:
    """Wall time split by activity (seconds)."""

    draft: float = 0.0  # draft generation and draft cache upkeep
    verify: float = 0.0  # target prefill of draft steps
    target: float = 0.0  # target generation
    probe: float = 0.0  # probe forward passes
    total: float = 0.0


@dataclass
class DecodeResult:
    """What every decoder returns."""

    method: str
    text: str
    answer: str | None
    steps: list[StepRecord] = field(default_factory=list)
    timings: Timings = field(default_factory=Timings)
    output_tokens: int = 0  # in the target's tokenizer when a target is involved
    target_prefill_tokens: int = 0  # tokens the target prefilled after the prompt (verification)
    finish_reason: str = "length"  # eos | length
    extra: dict = field(default_factory=dict)  # method-specific figures (e.g. token-level acceptance)
    on_step: StepCallback | None = field(default=None, repr=False, compare=False)

    def add(self, step: StepRecord) -> None:
        """Append a step and stream it to ``on_step``."""
        self.steps.append(step)
        if self.on_step is not None:
            self.on_step(step)

    @property
    def target_tokens(self) -> int:
        """Output tokens written by the target."""
        return sum(s.target_tokens for s in self.steps if s.author == "target")

    @property
    def target_share(self) -> float:
        """Share of output tokens written by the target (the paper's Ratio)."""
        return self.target_tokens / self.output_tokens if self.output_tokens else 0.0

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted draft steps / proposed draft steps (None when nothing was proposed)."""
        proposed = [s for s in self.steps if s.author == "draft" or s.proposal is not None]
        return sum(s.author == "draft" for s in proposed) / len(proposed) if proposed else None

    @property
    def prefill_per_output_token(self) -> float:
        """Target prefill tokens (after the prompt) per output token."""
        return self.target_prefill_tokens / self.output_tokens if self.output_tokens else 0.0

    @property
    def tokens_per_second(self) -> float:
        """Output tokens per wall-clock second."""
        return self.output_tokens / self.timings.total if self.timings.total else 0.0

    def to_dict(self) -> dict:
        """JSON-serialisable trace."""
        d = asdict(self)
        d.pop("on_step", None)
        d.update(
            target_share=self.target_share,
            acceptance_rate=self.acceptance_rate,
            prefill_per_output_token=self.prefill_per_output_token,
            tokens_per_second=self.tokens_per_second,
        )
        return d


class Decoder(Protocol):
    """What every decoder is: a method name and ``decode(question, on_step) -> DecodeResult``."""

    method: str

    def decode(self, question: str, on_step: StepCallback | None = None) -> DecodeResult:
        """Answer ``question``; ``on_step`` sees each step as it is accepted or written."""
        ...


class _Clock:
    """Adds the elapsed time of a ``with`` block to one field of a Timings."""

    def __init__(self, timings: Timings, name: str) -> None:
        self.timings, self.name = timings, name

    def __enter__(self) -> None:
        self.t0 = time.perf_counter()

    def __exit__(self, *exc) -> None:
        setattr(self.timings, self.name, getattr(self.timings, self.name) + time.perf_counter() - self.t0)


def finish_result(method: str, res: DecodeResult, t0: float, settings: DecodeSettings) -> DecodeResult:
    """Complete ``res``: the method, the full text, the extracted answer and the total time since ``t0``."""
    res.method = method
    res.text = "".join(s.text for s in res.steps)
    res.answer = extract_answer(res.text, settings.benchmark)
    res.timings.total = time.perf_counter() - t0
    return res


def _prefill_pair(draft: LM, target: LM, question: str, tm: Timings) -> tuple[LMState, LMState]:
    """Both models read the prompt once (timed as draft and target work)."""
    with _Clock(tm, "draft"):
        dstate = draft.prefill(draft.format_prompt(question))
    with _Clock(tm, "target"):
        tstate = target.prefill(target.format_prompt(question))
    return dstate, tstate


def _step_budget(s: DecodeSettings, lm: LM, used: int) -> int:
    """Tokens ``lm`` may spend on its next step: its step budget, capped by what is left of the output."""
    return max(1, min(s.step_tokens or lm.spec.max_step_tokens, s.max_new_tokens - used))


def _target_rewrites(
    draft: LM,
    target: LM,
    s: DecodeSettings,
    res: DecodeResult,
    states: tuple[Callable[[], LMState], LMState],
    replay: list[str],
    proposal: str,
    budget: int,
    seed: int,
    written: tuple[StepSample, LMState, int] | None = None,
    **why: float | int | None,
) -> tuple[LMState, LMState]:
    """A rejected proposal: the target writes the step itself from its state before the proposal
    (``states[1]``), unless ``written`` already holds its step, state and the number of tokens kept from
    the proposal (salvage); the draft rolls back to its checkpoint (``states[0]``), re-reads the steps of
    the round that were accepted (``replay``) and reads the target's step. The step goes into ``res`` with
    ``why`` (p, q, u or a score); returns the (draft, target) states after it."""
    d_restore, tstate = states
    salvaged = 0
    if written is not None:
        tstep, tstate, salvaged = written
    else:
        with _Clock(res.timings, "target"):
            tstep, tstate = target.decode_step(tstate, s.temperature, s.top_p, budget, seed)
    with _Clock(res.timings, "draft"):
        dstate = d_restore()
        for text in replay:
            dstate = draft.prefill(text, dstate)
        before = len(dstate.ids)
        if tstep.text:
            dstate = draft.prefill(tstep.text, dstate)
    res.add(
        StepRecord(
            "target",
            tstep.text,
            len(dstate.ids) - before,
            tstep.num_tokens,
            proposal=proposal,
            salvaged=salvaged,
            **why,
        )
    )
    res.output_tokens += tstep.num_tokens
    if tstep.finish_reason == "eos" or not tstep.text:
        res.finish_reason = "eos"
    return dstate, tstate


class SingleModelDecoder:
    """``target`` or ``draft``: one model writes every step."""

    def __init__(self, lm: LM, settings: DecodeSettings, role: str = "target") -> None:
        if role not in ("draft", "target"):
            raise ValueError(f"role must be 'draft' or 'target', got {role!r}")
        self.lm, self.settings, self.role = lm, settings, role

    @property
    def method(self) -> str:
        """The method name (its role)."""
        return self.role

    def decode(self, question: str, on_step: StepCallback | None = None) -> DecodeResult:
        """Write steps until EOS or the token budget."""
        s, t0 = self.settings, time.perf_counter()
        res = DecodeResult(self.method, "", None, on_step=on_step)
        clock = _Clock(res.timings, "target" if self.role == "target" else "draft")
        with clock:
            state = self.lm.prefill(self.lm.format_prompt(question))
        seed = s.seed
        while res.output_tokens < s.max_new_tokens:
            budget = _step_budget(s, self.lm, res.output_tokens)
            with clock:
                step, state = self.lm.decode_step(state, s.temperature, s.top_p, budget, seed)
            seed += 1
            k = step.num_tokens
            res.add(
                StepRecord(
                    self.role, step.text, k if self.role == "draft" else 0, k if self.role == "target" else 0
                )
            )
            res.output_tokens += k
            if step.finish_reason == "eos":
                res.finish_reason = "eos"
                break
        return finish_result(self.method, res, t0, s)


class SemanticSpecDecoder:
    """SemanticSpec (Algorithm 1) with probes ``q_probe`` (draft) and ``p_probe`` (target)."""

    method = "semanticspec"

    def __init__(
        self,
        draft: LM,
        target: LM,
        q_probe: ProbeFn,
        p_probe: ProbeFn,
        settings: DecodeSettings,
        probe_ids: dict[str, str] | None = None,
    ) -> None:
        self.draft, self.target, self.settings = draft, target, settings
        self.q_probe, self.p_probe = q_probe, p_probe
        self.probe_ids = probe_ids  # role -> identity of the probe (its weights' sha256)

    @property
    def run_identity(self) -> dict:
        """What, beyond the evaluation settings, decides this decoder's rows: the probes and salvage."""
        return {"probes": self.probe_ids, "salvage": self.settings.salvage and self.settings.temperature == 0}

    def decode(self, question: str, on_step: StepCallback | None = None) -> DecodeResult:
        """Rounds of: the draft proposes up to gamma steps, the target verifies them in order with the
        probes, the first rejected one is rewritten by the target."""
        s, t0 = self.settings, time.perf_counter()
        rng = random.Random(s.seed)
        res = DecodeResult(self.method, "", None, on_step=on_step)
        dstate, tstate = _prefill_pair(self.draft, self.target, question, res.timings)
        seed = s.seed
        while res.output_tokens < s.max_new_tokens and res.finish_reason != "eos":
            d_restore = dstate.checkpoint(s.gamma * _step_budget(s, self.draft, 0) + 8)
            proposals, dstate = self._propose(dstate, res, seed)
            seed += len(proposals)
            dstate, tstate, seed = self._verify(proposals, (d_restore, dstate), tstate, res, rng, seed)
        return finish_result(self.method, res, t0, s)

    def _propose(self, dstate: LMState, res: DecodeResult, seed: int) -> tuple[list[StepSample], LMState]:
        """Up to gamma draft steps (fewer after EOS or an empty step), advancing the draft's cache."""
        s, proposals = self.settings, []
        with _Clock(res.timings, "draft"):
            for i in range(s.gamma):
                budget = _step_budget(s, self.draft, res.output_tokens)
                step, dstate = self.draft.decode_step(dstate, s.temperature, s.top_p, budget, seed + i)
                proposals.append(step)
                if step.finish_reason == "eos" or not step.text:
                    break
        return proposals, dstate

    def _verify(
        self,
        proposals: list[StepSample],
        draft_states: tuple[Callable[[], LMState], LMState],
        tstate: LMState,
        res: DecodeResult,
        rng: random.Random,
        seed: int,
    ) -> tuple[LMState, LMState, int]:
        """Verify ``proposals`` in order; the first rejection is rewritten by the target and ends the
        round. Returns the (draft, target) states and the next seed."""
        d_restore, dstate = draft_states
        for i, step in enumerate(proposals):
            t_restore = tstate.checkpoint(_step_budget(self.settings, self.target, 0) * 2 + 8)
            score, accepted, why = self._judge(step, tstate, res, rng)
            if accepted:  # the target's cache already holds the step
                tstate = score.state
                res.add(StepRecord("draft", step.text, step.num_tokens, len(score.token_ids), **why))
                res.output_tokens += len(score.token_ids)
                if step.finish_reason == "eos":
                    res.finish_reason = "eos"
                    break
                continue
            budget = _step_budget(self.settings, self.target, res.output_tokens)
            replay = [prev.text for prev in proposals[:i]]
            written = self._salvage(tstate, score, budget, seed, res) if score is not None else None
            dstate, tstate = _target_rewrites(
                self.draft,
                self.target,
                self.settings,
                res,
                (d_restore, tstate if written else t_restore()),
                replay,
                step.text,
                budget,
                seed,
                written,
                **why,
            )
            seed += 1
            break
        return dstate, tstate, seed

    def _judge(
        self, step: StepSample, tstate: LMState, res: DecodeResult, rng: random.Random
    ) -> tuple[StepScore | None, bool, dict[str, float]]:
        """The target prefills the step on its cache (in place) and the probes give q and p; the step is
        accepted when ``u < min(1, p/q)`` (and ``p/q >= min_ratio`` when set). Returns the target's score
        of the step (None for an empty step), whether it was accepted, and ``{p, q, u}``."""
        s, tm = self.settings, res.timings
        with _Clock(tm, "probe"):
            q = self.q_probe(step.pooled)
        score, p = None, 0.0
        if step.text:
            with _Clock(tm, "verify"):
                score = self.target.score_step(tstate, step.text, inplace=True, logprobs=False)
            res.target_prefill_tokens += len(score.token_ids)
            with _Clock(tm, "probe"):
                p = self.p_probe(score.pooled)
        u = rng.random()
        ratio = p / q if q > 0 else float("inf")
        accept = score is not None and u < min(1.0, ratio)
        if accept and s.min_ratio is not None and ratio < s.min_ratio:
            accept = False
        return score, accept, {"p": p, "q": q, "u": u}

    def _salvage(
        self, tstate: LMState, score: StepScore, budget: int, seed: int, res: DecodeResult
    ) -> tuple[StepSample, LMState, int] | None:
        """With ``salvage`` (greedy only): keep the longest prefix of the rejected step that the target
        would have written itself (its argmax at every position, from the verification prefill) and let
        the target continue from there. The result equals the target's own greedy step, token for token.
        None when salvage is off, sampling, or the cache cannot be cropped (the step is then rewritten)."""
        if not self.settings.salvage or self.settings.temperature > 0:
            return None
        with _Clock(res.timings, "target"):
            keep = self.target.greedy_agreement(score)
            out = self.target.continue_after(tstate, score, keep, budget, seed)
        return None if out is None else (*out, min(keep, out[0].num_tokens))


VERIFY_PROMPT = "\n\nIs the previous step correct? Rate it from 0 (wrong) to 9 (certainly correct). Rating:"


class SpecReasonDecoder:
    """SpecReason: the target rates each draft step 0-9; steps rated below the threshold are rewritten."""

    method = "specreason"

    def __init__(self, draft: LM, target: LM, settings: DecodeSettings, prompt: str = VERIFY_PROMPT) -> None:
        self.draft, self.target, self.settings, self.prompt = draft, target, settings, prompt
        ids = [target.tokenizer.encode(str(d), add_special_tokens=False) for d in range(10)]
        self.digit_ids = [i[-1] for i in ids]

    def rate(self, state: LMState, step_text: str) -> tuple[int, LMState, int]:
        """Score a step 0-9 (argmax over the digit tokens after the verification prompt).

        Returns the score, the target state extended by the step (the prompt is cropped away) and the
        number of step tokens prefilled."""
        st, ids, _, _ = self.target.extend(state, step_text)
        keep = (st.text, list(st.ids), st.logits, st.hidden)
        st2 = self.target.extend(st, self.prompt)[0]
        score = int(torch.argmax(st2.logits[self.digit_ids]))
        extra = st2.cache.get_seq_length() - len(keep[1])
        if extra > 0:
            st2.cache.crop(-extra)
        return score, LMState(keep[0], keep[1], st2.cache, keep[2], keep[3]), len(ids)

    def decode(self, question: str, on_step: StepCallback | None = None) -> DecodeResult:
        """Draft a step, let the target rate it, rewrite it below the threshold."""
        s, t0 = self.settings, time.perf_counter()
        res = DecodeResult(self.method, "", None, on_step=on_step)
        tm = res.timings
        dstate, tstate = _prefill_pair(self.draft, self.target, question, tm)
        seed = s.seed
        while res.output_tokens < s.max_new_tokens and res.finish_reason != "eos":
            budget = _step_budget(s, self.draft, res.output_tokens)
            d_restore = dstate.checkpoint(budget + 8)
            with _Clock(tm, "draft"):
                step, dstate = self.draft.decode_step(dstate, s.temperature, s.top_p, budget, seed)
            seed += 1
            score, k, t_restore = 0, 0, None
            if step.text:
                t_restore = tstate.checkpoint(self.target.spec.max_step_tokens * 2 + 64)
                with _Clock(tm, "verify"):
                    score, new_t, k = self.rate(tstate, step.text)
                res.target_prefill_tokens += k
            if step.text and score >= s.accept_threshold:
                tstate = new_t
                res.add(StepRecord("draft", step.text, step.num_tokens, k, score=score))
                res.output_tokens += k
                if step.finish_reason == "eos":
                    res.finish_reason = "eos"
                continue
            if t_restore is not None:
                tstate = t_restore()
            dstate, tstate = _target_rewrites(
                self.draft, self.target, s, res, (d_restore, tstate), [], step.text, budget, seed, score=score
            )
            seed += 1
        return finish_result(self.method, res, t0, s)
