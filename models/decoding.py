"""Decoders with one call signature and one result type.

Every decoder is ``decode(question) -> DecodeResult``: the text, the final answer, and a per-step
trace (who wrote each step, tokens per model, p, q, the acceptance draw, timings).

* ``target`` / ``draft``: one model alone, step by step on its KV cache (plain autoregressive cost).
* ``semanticspec``: the paper's Algorithm 1 — the draft writes a step, the target prefills it on its
  cached context, probes give q (draft) and p (target), the step is accepted with probability
  min(1, p/q); otherwise the target writes the step itself from the last accepted context.
* ``specreason``: the target scores each draft step 0-9 in a verification turn (SpecReason's prompt and
  scale); steps scored below the threshold are rewritten.

The token-level baselines (``specsampling``, ``assisted``) live in ``semspec.models.token_level``.

Steps travel between the models as text; each model re-tokenises them, so the pair may use different
tokenizers. Both models keep their caches across steps: accepted text is appended, rejected text is
cropped away; nothing re-prefills the whole context.
"""

from __future__ import annotations

import functools
import random
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Protocol

import torch

from semspec.models.grading import extract_answer
from semspec.models.lm import (
    LM,
    LMState,
    Pooled,
    Prompt,
    StepSample,
    StepScore,
    StepStart,
    crop_to,
    fits_window,
)
from semspec.models.names import FLOOR_AUTO, GAMMA_AUTO, ROLES, SEMANTICSPEC_RULES
from semspec.models.spec import rules


class MethodNotApplicable(ValueError):
    """A decoding method that cannot run on this pair (e.g. token-level speculation across two
    vocabularies); evaluation and the bench skip it and report the reason."""


MIN_TEMPERATURE = 1e-3  # a temperature below this decodes greedily
GAMMA_MAX = 4  # the most steps per round ``gamma_for`` picks
GAMMA_WHOLE = 0.5  # gamma_for: the longest round accepted whole at least this often


def gamma_for(accept_rate: float | None) -> int:
    """SemanticSpec's steps per round for a step acceptance rate ``accept_rate`` (the probes' rate on
    held-out steps): the longest round, up to ``GAMMA_MAX``, that is accepted whole at least half the time
    (``accept_rate ** gamma >= 1/2``), since a rejection discards the round's later steps; 1 where the rate
    is unknown or below one half."""
    if accept_rate is None or not 0 <= accept_rate <= 1:
        return 1
    return max(g for g in range(1, GAMMA_MAX + 1) if g == 1 or accept_rate**g >= GAMMA_WHOLE)


ProbeFn = Callable[[Pooled], float]  # pooled hidden states of a step -> semantic probability
StepCallback = Callable[["StepRecord"], None]  # called as each step is accepted or rewritten


@dataclass
class DecodeSettings:
    """Knobs shared by every decoder."""

    max_new_tokens: int = 256  # output budget (target-tokenizer tokens where a target is involved)
    step_tokens: int | None = None  # per-step budget; None: each model spec's max_step_tokens
    # 0: greedy; below MIN_TEMPERATURE too (its limit: dividing logits by less overflows the softmax)
    temperature: float = 0.0
    top_p: float = 1.0
    # steps drafted before verification (paper default 1); GAMMA_AUTO ("auto") is resolved to a count from
    # the probes' acceptance on held-out steps (``gamma_for``) by whoever loads them, before decoding
    gamma: int | str = 1
    # batches only: steps a row may write ahead while others finish theirs (never changes an output)
    lookahead: int = 4
    # batches only: rounds a rejected row may wait so the target rewrites several rows in one decode loop
    rewrite_wait: int = 0
    # also reject when p/q falls below this (off by default); FLOOR_AUTO ("auto") is resolved to a
    # number or None by whoever loads the probes (semspec.tasks.decoders.build_decoder), before a decoder
    # reads it
    min_ratio: float | str | None = None
    # the target's rule in place of the paper's: accept a step iff p >= min_p, no draw, q not read (for
    # greedy decoding: keep the steps whose meaning the target likely shares); "auto" as for min_ratio
    min_p: float | str | None = None
    # semanticspec: after this many rejected steps in an answer, the target writes the rest of it alone
    # (the draft proposes no more). None: off, the paper's rule for every step
    max_rejections: int | None = None
    # semanticspec: the target's token check, beside the probes: a step they accept is rejected all the
    # same when the target gives one of its tokens a probability below this (a wrong number, a word it
    # would not write); the output head then runs over every accepted step's positions. None: off
    min_token_p: float | None = None
    accept_threshold: int = 7  # specreason: accept steps scored at or above this (0-9)
    salvage: bool = True  # greedy semanticspec: a rejected step keeps its prefix the target agrees with
    seed: int = 0
    benchmark: str = "math"  # how to extract the final answer (gpqa: a letter)

    @property
    def rule(self) -> rules.Rule:
        """SemanticSpec's acceptance options (``models/spec/rules.py``); floors must be resolved."""
        return rules.Rule(self.min_ratio, self.min_p, self.min_token_p, self.max_rejections)

    @property
    def salvages(self) -> bool:
        """Whether rejected steps are salvaged: asked for, and greedy (the only exact case)."""
        return self.salvage and self.temperature == 0

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.step_tokens is not None and self.step_tokens < 1:
            raise ValueError(f"step_tokens must be >= 1, got {self.step_tokens}")
        if self.gamma != GAMMA_AUTO and (
            not isinstance(self.gamma, int) or isinstance(self.gamma, bool) or self.gamma < 1
        ):
            raise ValueError(f"gamma must be a count >= 1 or 'auto', got {self.gamma!r}")
        if self.lookahead < 0:
            raise ValueError(f"lookahead must be >= 0, got {self.lookahead}")
        if self.rewrite_wait < 0:
            raise ValueError(f"rewrite_wait must be >= 0, got {self.rewrite_wait}")
        for name in ("min_ratio", "min_p"):
            floor = getattr(self, name)
            if floor is not None and floor != FLOOR_AUTO and (isinstance(floor, str) or floor < 0):
                raise ValueError(f"{name} must be None, a number >= 0 or 'auto', got {floor!r}")
        if self.min_ratio is not None and self.min_p is not None:
            raise ValueError("min_ratio and min_p are two acceptance rules: set one of them, not both")
        if self.max_rejections is not None and (
            not isinstance(self.max_rejections, int) or self.max_rejections < 0
        ):
            raise ValueError(f"max_rejections must be None or a count >= 0, got {self.max_rejections!r}")
        if self.min_token_p is not None and (
            isinstance(self.min_token_p, bool | str) or not 0 < self.min_token_p < 1
        ):
            raise ValueError(f"min_token_p must be None or a probability in (0, 1), got {self.min_token_p!r}")
        if not 0 <= self.accept_threshold <= 9:
            raise ValueError(f"accept_threshold must be in 0..9, got {self.accept_threshold}")
        if not self.temperature >= 0 or not 0 < self.top_p <= 1:  # NaN fails too
            raise ValueError("temperature must be >= 0 and top_p in (0, 1]")
        if self.temperature < MIN_TEMPERATURE:
            self.temperature = 0.0


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
    tok: float | None = None  # the least probability the target gave a token of the step (min_token_p)
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
    total: float = 0.0  # latency: from the problem's start (joining its batch) to its last step
    share: float = 0.0  # machine time: each batched call's time divided among its rows (batch 1: total)


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
    def rejections(self) -> int:
        """Draft steps rejected so far (each rewritten by the target)."""
        return sum(s.author == "target" and s.proposal is not None for s in self.steps)

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
    """Adds the elapsed time of a ``with`` block to one field of every given Timings (each row of a
    batch waited for the whole batched call)."""

    def __init__(self, timings: Timings | list[Timings], name: str) -> None:
        self.timings = timings if isinstance(timings, list) else [timings]
        self.name = name

    def __enter__(self) -> None:
        self.t0 = time.perf_counter()

    def __exit__(self, *exc) -> None:
        dt = time.perf_counter() - self.t0
        for tm in self.timings:
            setattr(tm, self.name, getattr(tm, self.name) + dt)


def finish_result(method: str, res: DecodeResult, t0: float, settings: DecodeSettings) -> DecodeResult:
    """Complete ``res``: the method, the full text, the extracted answer and the total time since ``t0``."""
    res.method = method
    res.text = "".join(s.text for s in res.steps)
    res.answer = extract_answer(res.text, settings.benchmark)
    res.timings.total = time.perf_counter() - t0
    return res


def _step_budget(s: DecodeSettings, lm: LM, used: int, limit: int | None = None) -> int:
    """Tokens ``lm`` may spend on its next step: its step budget, capped by what is left of the output
    (``limit``, a row's own budget; default the settings')."""
    limit = s.max_new_tokens if limit is None else limit
    return max(1, min(s.step_tokens or lm.spec.max_step_tokens, limit - used))


def _scored_room(s: DecodeSettings, target: LM) -> int:
    """Positions the target's scoring of one step may add to its cache (a draft step re-tokenized by
    the target may take up to twice its tokens), for a checkpoint or window check made before it."""
    return _step_budget(s, target, 0) * 2 + 8


def _probe_all(fn: ProbeFn, pooled: list[Pooled]) -> list[float]:
    """The probe on every row: one call when it scores batches (a ``many`` attribute), else row by row."""
    many = getattr(fn, "many", None)
    return list(many(pooled)) if many is not None else [fn(p) for p in pooled]


@dataclass
class _Row:
    """One problem of a batch: its result so far and both models' states."""

    index: int  # the job's key: its position in the list of questions, or a server's request id
    res: DecodeResult
    t0: float
    seed: int
    rng: random.Random
    budget: int  # output tokens this row may write (its job's, else the settings' max_new_tokens)
    draft: LMState | None = None  # the draft's state (None when the decoder has no draft)
    target: LMState | None = None  # the target's state (None when the decoder has no target)
    queued: _Rewrite | None = None  # a rejected step waiting for the target to rewrite it
    waited: int = 0  # rounds it has waited
    # the target's scores of the round's next proposals, from one prefill (``_score_ahead``, gamma > 1)
    scored: list[StepScore] = field(default_factory=list)

    def state(self, role: str) -> LMState:
        """The state of the model playing ``role``."""
        state = self.draft if role == "draft" else self.target
        if state is None:
            raise ValueError(f"row {self.index} has no {role} state: the decoder has no {role} model")
        return state

    def set_state(self, role: str, state: LMState) -> None:
        """Replace the state of the model playing ``role``."""
        if role == "draft":
            self.draft = state
        else:
            self.target = state

    def finished(self, s: DecodeSettings) -> bool:
        """Whether the row has used its budget or ended with EOS."""
        return self.res.output_tokens >= self.budget or self.res.finish_reason == "eos"

    def step_budget(self, s: DecodeSettings, lm: LM, used: int | None = None) -> int:
        """Tokens ``lm`` may spend on this row's next step after ``used`` output tokens (default: the
        row's output so far)."""
        return _step_budget(s, lm, self.res.output_tokens if used is None else used, self.budget)

    def used(self, ahead: Sequence[StepSample], base: int | None = None) -> int:
        """Output tokens a step written after the steps ``ahead`` starts from: ``base`` (default the
        row's output so far) plus what those steps use."""
        return (self.res.output_tokens if base is None else base) + sum(x.num_tokens for x in ahead)


@dataclass(frozen=True)
class Job:
    """One prompt for a batch decoder: its key (the row's ``index``), and its own output budget and seed
    where they differ from the decoder's settings (a server's requests do)."""

    key: int
    prompt: Prompt
    max_new_tokens: int | None = None
    seed: int | None = None


def _share(rows: list[_Row], seconds: float) -> None:
    """Divide the time of a batched call among the rows it served."""
    for row in rows:
        row.res.timings.share += seconds / len(rows)


def _timings(rows: list[_Row]) -> list[Timings]:
    return [r.res.timings for r in rows]


class BatchDecoder:
    """A step-level decoder that runs many problems at once: rows advance in lock-step rounds, each
    model call covers every live row (one padded forward), finished rows leave and queued problems join
    (continuous batching). A row's output does not depend on the others: each has its own caches, seeds
    and acceptance draws, so ``decode`` (a batch of one) gives the same steps."""

    method: str
    settings: DecodeSettings
    roles: tuple[str, ...]

    def lm(self, role: str) -> LM:
        """The model playing ``role``."""
        raise NotImplementedError

    def _advance(self, rows: list[_Row]) -> None:
        """One round for every live row."""
        raise NotImplementedError

    def decode(self, question: Prompt, on_step: StepCallback | None = None) -> DecodeResult:
        """Answer ``question``; ``on_step`` sees each step as it is accepted or written."""
        callback = None if on_step is None else (lambda _i, step: on_step(step))
        return self.decode_batch([question], batch_size=1, on_step=callback)[0]

    def decode_batch(
        self,
        questions: Sequence[Prompt],
        batch_size: int = 8,
        on_step: Callable[[int, StepRecord], None] | None = None,
        on_result: Callable[[int, DecodeResult], None] | None = None,
    ) -> list[DecodeResult]:
        """Answer every question, ``batch_size`` at a time (continuous batching). ``on_step(i, step)`` sees
        each step of question ``i``; ``on_result(i, result)`` each result as its row finishes (rows finish
        out of order). A result's latency (``timings.total``) runs from its row joining the batch to its
        last step; its ``timings.share`` is its share of the machine time (each round's time divided among
        the rows in it), the per-problem cost that compares fairly across batch sizes."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        queue, live = deque(Job(i, q) for i, q in enumerate(questions)), []
        results: list[DecodeResult | None] = [None] * len(questions)
        while queue or live:
            joining = [queue.popleft() for _ in range(min(batch_size - len(live), len(queue)))]
            if joining:
                live += self.admit(joining, on_step)
            for row in self.step(live):
                results[row.index] = row.res
                if on_result is not None:
                    on_result(row.index, row.res)
            live = [r for r in live if not r.finished(self.settings)]
        return results

    def admit(
        self, jobs: Sequence[Job], on_step: Callable[[int, StepRecord], None] | None = None
    ) -> list[_Row]:
        """New rows for ``jobs``: every model reads their prompts in one padded prefill. The caller keeps
        the rows and passes them to ``step`` until each is finished (continuous batching: rows may join
        between any two steps, and a row dropped from the list simply leaves the batch)."""
        s, t0 = self.settings, time.perf_counter()
        rows = []
        for job in jobs:
            callback = None if on_step is None else functools.partial(on_step, job.key)
            res = DecodeResult(self.method, "", None, on_step=callback)
            seed = s.seed if job.seed is None else job.seed
            budget = s.max_new_tokens if job.max_new_tokens is None else job.max_new_tokens
            if budget < 1:
                raise ValueError(f"max_new_tokens must be >= 1, got {budget}")
            # acceptance draws: seeded per (seed, problem), so problems do not share one sequence of draws
            rows.append(_Row(job.key, res, t0, seed, random.Random(f"{seed}:{job.prompt}"), budget))
        for role in self.roles:
            lm = self.lm(role)
            with _Clock(_timings(rows), role):
                states = lm.prefill_many([lm.format_prompt(job.prompt) for job in jobs])
            for row, state in zip(rows, states, strict=True):
                row.set_state(role, state)
                # the last role's count: the target's where there is one
                row.res.extra["prompt_tokens"] = len(state.ids)
        _share(rows, time.perf_counter() - t0)
        return rows

    def step(self, live: list[_Row]) -> list[_Row]:
        """One round for every row in ``live``; returns the rows it finished, their results complete (the
        caller drops them from its list)."""
        t0 = time.perf_counter()
        self._advance(live)
        _share(live, time.perf_counter() - t0)
        done = [r for r in live if r.finished(self.settings)]
        for row in done:
            finish_result(self.method, row.res, row.t0, self.settings)
        return done


def write_alone(lm: LM, role: str, rows: list[_Row], s: DecodeSettings) -> None:
    """``lm`` (playing ``role``) writes every row's next step, all in one batched decode loop; rows done
    before the slowest write up to ``lookahead`` more (the steps they would write in the next rounds)."""

    def more(b: int, done: list[StepSample]) -> int | None:
        used = rows[b].used(done)
        if len(done) > s.lookahead or used >= rows[b].budget:
            return None
        return rows[b].step_budget(s, lm, used)

    starts = [StepStart(r.state(role), r.step_budget(s, lm), r.seed) for r in rows]
    with _Clock(_timings(rows), role):
        outs = lm.decode_runs(starts, s.temperature, s.top_p, 1, more)
    for row, (steps, state) in zip(rows, outs, strict=True):
        row.set_state(role, state)
        row.seed += len(steps)
        for step in steps:
            k = step.num_tokens
            row.res.add(StepRecord(role, step.text, k * (role == "draft"), k * (role == "target")))
            row.res.output_tokens += k
            if step.finish_reason == "eos":
                row.res.finish_reason = "eos"


class SingleModelDecoder(BatchDecoder):
    """``target`` or ``draft``: one model writes every step."""

    def __init__(self, lm: LM, settings: DecodeSettings, role: str = "target") -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        self.model, self.settings, self.role = lm, settings, role
        self.roles = (role,)

    @property
    def method(self) -> str:
        """The method name (its role)."""
        return self.role

    def lm(self, role: str) -> LM:
        """The one model."""
        return self.model

    def _advance(self, rows: list[_Row]) -> None:
        """Every row writes its next step (``write_alone``)."""
        write_alone(self.model, self.role, rows, self.settings)


@dataclass
class _Rewrite:
    """A rejected proposal of one row, for the target to rewrite: where the target starts (its state
    before the proposal, or the salvaged prefix), how the draft rolls back and what it re-reads."""

    row: _Row
    start: StepStart
    d_restore: Callable[[], LMState] | None  # None: the draft reads no more of this answer (handed over)
    replay: list[str]  # the round's accepted steps, for the draft to re-read
    proposal: str | None  # None: the target writes the step with nothing proposed (handed over)
    why: dict[str, float | int | None]
    salvaged: int = 0  # kept tokens of the proposal (salvage)


class _DraftTarget(BatchDecoder):
    """What the two-model step-level decoders share: the draft proposes, the target rewrites rejections."""

    roles = ("draft", "target")
    draft: LM
    target: LM

    def lm(self, role: str) -> LM:
        """The draft or the target."""
        return self.draft if role == "draft" else self.target

    def _round(self, rows: list[_Row]) -> list[_Rewrite]:
        """Propose and judge for ``rows``; returns the rejected steps to rewrite."""
        raise NotImplementedError

    def _advance(self, rows: list[_Row]) -> None:
        """One round (``_round``) for the rows without a queued rewrite. The target rewrites the rejected
        rows together, once half the batch waits, one has waited ``rewrite_wait`` rounds, or no row could
        go on without them: its decode forward costs about the same for one row as for several, and a row
        that waits goes through the same steps (only later)."""
        s = self.settings
        active = [r for r in rows if r.queued is None]
        for it in self._round(active) if active else []:
            it.row.queued = it
        waiting = [r for r in rows if r.queued is not None]
        if not waiting:
            return
        going = [r for r in rows if r.queued is None and not r.finished(s)]
        if not going or 2 * len(waiting) >= len(rows) or max(r.waited for r in waiting) >= s.rewrite_wait:
            self._rewrite([r.queued for r in waiting])
            for r in waiting:
                r.queued, r.waited = None, 0
        else:
            for r in waiting:
                r.waited += 1

    def _propose(
        self, rows: list[_Row], gamma: int, lookahead: int = 0
    ) -> dict[int, list[tuple[StepSample, int]]]:
        """Up to ``gamma`` draft steps per row (fewer after EOS or an empty step) in one batched decode
        loop, plus up to ``lookahead`` more for rows done before the slowest: the steps the draft would
        propose in the next rounds (``_valid`` checks their budgets once the steps before are judged);
        advances the draft's caches. Proposal ``j`` samples with ``row.seed + j``. Returns row index ->
        its proposals, each with the token budget it was written under."""
        s = self.settings
        budgets = {b: [r.step_budget(s, self.draft)] for b, r in enumerate(rows)}

        def more(b: int, done: list[StepSample]) -> int | None:
            # what the round's earlier proposals use counts against the output budget too
            used = rows[b].used(done)
            if used >= rows[b].budget or len(done) >= gamma + lookahead:
                return None
            budgets[b].append(rows[b].step_budget(s, self.draft, used))
            return budgets[b][-1]

        starts = [StepStart(r.draft, budgets[b][0], r.seed) for b, r in enumerate(rows)]
        with _Clock(_timings(rows), "draft"):
            outs = self.draft.decode_runs(starts, s.temperature, s.top_p, gamma, more)
        proposals = {}
        for b, (row, (steps, state)) in enumerate(zip(rows, outs, strict=True)):
            row.draft = state
            proposals[row.index] = list(zip(steps, budgets[b], strict=False))
        return proposals

    def _valid(self, row: _Row, step: StepSample, budget: int, used: int) -> bool:
        """Whether a proposal is the step the draft writes at this point when it proposes round by round:
        ``used`` output tokens before it (the target's count, as a round would start from); with
        lookahead the draft counted its own tokens, and a different budget matters only when the step
        ran into one of the two."""
        if used >= row.budget:
            return False
        needed = row.step_budget(self.settings, self.draft, used)
        return budget == needed or (step.finish_reason != "length" and step.num_tokens <= needed)

    def _accept(
        self, row: _Row, step: StepSample, target_state: LMState, k: int, **why: float | int | None
    ) -> None:
        """Keep an accepted draft step: ``target_state`` is the target's state with the step read (``k``
        target tokens), ``why`` what decided it."""
        row.target = target_state
        row.res.add(StepRecord("draft", step.text, step.num_tokens, k, **why))
        row.res.output_tokens += k
        if step.finish_reason == "eos":
            row.res.finish_reason = "eos"

    def _rewrite(self, items: list[_Rewrite]) -> None:
        """Rejected proposals: the target writes each row's step (all rows in one batched decode; salvaged
        rows start after their kept prefix), then each draft rolls back to its checkpoint, re-reads the
        round's accepted steps and reads the target's step (batched too). A row handed over to the target
        (no proposal, no checkpoint) only gets the target's step: its draft reads no more."""
        if not items:
            return
        s, rows = self.settings, [it.row for it in items]
        with _Clock(_timings(rows), "target"):
            written = self.target.decode_steps([it.start for it in items], s.temperature, s.top_p)
        synced = [b for b, it in enumerate(items) if it.d_restore is not None]  # the others: handed over
        draft_tokens = [0] * len(items)
        with _Clock(_timings([rows[b] for b in synced]), "draft"):
            dstates = self._draft_back([(items[b].d_restore, items[b].replay) for b in synced])
            before = [len(d.ids) for d in dstates]
            self._draft_reads(dstates, [written[b][0].text for b in synced])
        for b, dstate, n in zip(synced, dstates, before, strict=True):
            rows[b].draft, draft_tokens[b] = dstate, len(dstate.ids) - n
        for it, (step, tstate), k in zip(items, written, draft_tokens, strict=True):
            row = it.row
            row.target = tstate
            salvaged = min(it.salvaged, step.num_tokens)
            record = StepRecord(
                "target",
                step.text,
                k,
                step.num_tokens,
                proposal=it.proposal,
                salvaged=salvaged,
                **it.why,
            )
            row.res.add(record)
            row.res.output_tokens += step.num_tokens
            if step.finish_reason == "eos" or not step.text:
                row.res.finish_reason = "eos"

    def _draft_back(self, items: list[tuple[Callable[[], LMState], list[str]]]) -> list[LMState]:
        """Each draft rolled back to its round's checkpoint and re-reading the round's accepted steps,
        the rows batched."""
        dstates = [restore() for restore, _ in items]
        for j in range(max((len(replay) for _, replay in items), default=0)):
            self._draft_reads(dstates, [replay[j] if j < len(replay) else "" for _, replay in items])
        return dstates

    def _draft_reads(self, dstates: list[LMState], texts: list[str]) -> None:
        """Extend each draft state by its text (rows with no text are left alone), in one prefill."""
        idx = [i for i, text in enumerate(texts) if text]
        if idx:
            for i, ext in zip(
                idx, self.draft.extend_many([dstates[i] for i in idx], [texts[i] for i in idx]), strict=True
            ):
                dstates[i] = ext[0]


@dataclass
class _Verdict:
    """SemanticSpec's judgement of one proposed step."""

    score: StepScore | None  # the target's scoring of the step (None for an empty step)
    accepted: bool
    why: dict[str, float]  # p, q and the uniform draw u
    restore: Callable[[], LMState]  # the target's state before the step


class SemanticSpecDecoder(_DraftTarget):
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
        for name in ("min_ratio", "min_p", "gamma"):
            if isinstance(getattr(settings, name), str):
                raise ValueError(
                    f"{name} 'auto' is read from the probes: resolve it to a number before decoding "
                    "(semspec.tasks.decoders.build_decoder reads it from the registered probes)"
                )
        self.draft, self.target, self.settings = draft, target, settings
        self.q_probe, self.p_probe = q_probe, p_probe
        self.probe_ids = probe_ids  # role -> identity of the probe (its weights' sha256)

    @property
    def run_identity(self) -> dict:
        """What, beyond the evaluation settings, decides this decoder's rows: the probes, salvage, the
        floor on p/q or on p where there is one (``auto`` resolves per probe pair), the rejection
        budget and the token check where there are."""
        floors = {k: getattr(self.settings, k) for k in SEMANTICSPEC_RULES}
        floors = {k: v for k, v in floors.items() if v is not None}
        return {"probes": self.probe_ids, "salvage": self.settings.salvages, **floors}

    def _round(self, rows: list[_Row]) -> list[_Rewrite]:
        """One round (``_verify_round``) for the rows whose answers still have rejections to spend; the
        others (``max_rejections`` spent) are handed to the target, which writes their next step alone."""
        s = self.settings
        if s.max_rejections is None:
            return self._verify_round(rows)
        handed = [r for r in rows if not rules.drafting(s.rule, r.res.rejections)]
        going = [r for r in rows if rules.drafting(s.rule, r.res.rejections)]
        writes = []
        for row in handed:
            start = StepStart(row.target, row.step_budget(s, self.target), row.seed)
            writes.append(_Rewrite(row, start, None, [], None, {}))
            row.seed += 1
        return writes + (self._verify_round(going) if going else [])

    def _verify_round(self, rows: list[_Row]) -> list[_Rewrite]:
        """One round: the draft proposes up to gamma steps per row (and lookahead steps, see
        ``_propose``), the target verifies them in order with the probes (each proposal position one
        batched prefill over the rows still going); returns the first rejected step of each row, for the
        target to rewrite. A row consumes the seeds of the proposals it judged only, so its steps do not
        depend on how far it looked ahead."""
        s = self.settings
        d_restores = {r.index: r.draft.checkpoint(s.gamma * _step_budget(s, self.draft, 0) + 8) for r in rows}
        seeds = {r.index: r.seed for r in rows}
        proposals = self._propose(rows, s.gamma, s.lookahead)
        for row in rows:
            row.seed = seeds[row.index] + len(proposals[row.index])
        verifying, rewrites, dropped = list(rows), [], []
        start_used: dict[int, int] = {}  # row -> output tokens where its current virtual round began
        for i in range(max(len(p) for p in proposals.values())):
            current = []
            for row in verifying:
                if len(proposals[row.index]) <= i or row.finished(s):
                    continue
                if i % s.gamma == 0:
                    start_used[row.index] = row.res.output_tokens
                step, budget = proposals[row.index][i]
                ahead = [x for x, _ in proposals[row.index][i - i % s.gamma : i]]
                used = row.used(ahead, base=start_used[row.index])
                if self._valid(row, step, budget, used):
                    current.append(row)
                else:  # written ahead under another budget: drop it and the rest, draft again next round
                    row.seed = seeds[row.index] + i
                    dropped.append(
                        (d_restores[row.index], [x.text for x, _ in proposals[row.index][:i]], row)
                    )
            if not current:
                break
            steps = [proposals[r.index][i][0] for r in current]
            if s.gamma > 1 and i % s.gamma == 0:
                self._score_ahead(current, [proposals[r.index][i : i + s.gamma] for r in current], start_used)
            verdicts = self._judge(current, steps)
            verifying = []
            for row, step, v in zip(current, steps, verdicts, strict=True):
                if v.accepted and v.score is not None:
                    self._accept(row, step, v.score.state, len(v.score.token_ids), **v.why)
                    if step.finish_reason != "eos":
                        verifying.append(row)
                    continue
                row.seed = seeds[row.index] + i + 1
                budget = row.step_budget(s, self.target)
                start, kept = self._salvage(row, v.score, budget, v.restore)
                replay = [prev.text for prev, _ in proposals[row.index][:i]]
                rewrites.append(_Rewrite(row, start, d_restores[row.index], replay, step.text, v.why, kept))
                row.seed += 1
        rejected = {it.row.index for it in rewrites}
        for row in rows:  # a row that stopped inside a jointly scored run: its cache holds steps not taken
            row.scored = []
            if row.index not in rejected and row.target is not None:
                crop_to(row.target.cache, len(row.target.ids))
        if dropped:
            with _Clock(_timings([row for _, _, row in dropped]), "draft"):
                states = self._draft_back([(restore, replay) for restore, replay, _ in dropped])
            for (_, _, row), state in zip(dropped, states, strict=True):
                row.draft = state
        return rewrites

    def _score_ahead(
        self, rows: list[_Row], groups: list[list[tuple[StepSample, int]]], start_used: dict[int, int]
    ) -> None:
        """With ``gamma`` > 1: the target scores each row's proposals of this virtual round (``groups[b]``,
        the first already found valid) in one padded prefill, one pass over its weights for up to
        ``gamma`` steps; ``_judge`` then takes the scores in order. A run ends before an empty or invalid
        step and after an EOS step, and is a single step where a sliding window could not crop back."""
        s, runs, scored = self.settings, [], []
        per_step = _scored_room(s, self.target)
        for row, group in zip(rows, groups, strict=True):
            run: list[str] = []
            for j, (step, budget) in enumerate(group):
                used = row.used([x for x, _ in group[:j]], base=start_used[row.index])
                if not step.text or (j and not self._valid(row, step, budget, used)):
                    break
                run.append(step.text)
                if step.finish_reason == "eos":
                    break
            if not fits_window(row.target.cache, len(row.target.ids) + len(run) * per_step):
                run = run[:1]
            if run:
                runs.append(run)
                scored.append(row)
        if not scored:
            return
        with _Clock(_timings(scored), "verify"):
            out = self.target.score_runs([r.target for r in scored], runs)
        for row, scores in zip(scored, out, strict=True):
            row.scored = scores
            row.res.target_prefill_tokens += sum(len(sc.token_ids) for sc in scores)

    def _judge(self, rows: list[_Row], steps: list[StepSample]) -> list[_Verdict]:
        """The target prefills each row's step on its cache (in place, all rows in one padded prefill;
        a row's score from ``_score_ahead`` is taken as it is) and the probes give q and p (batched); a
        step is accepted when ``u < min(1, p/q)`` (and ``p/q >= min_ratio`` when set), or with ``min_p``
        when ``p >= min_p``; with ``min_token_p``, a step so accepted is then rejected when the target
        gives one of its tokens a lower probability (one head pass over the accepted steps' positions).
        Returns each row's verdict."""
        s, tms = self.settings, _timings(rows)
        restores = [r.target.checkpoint(_scored_room(s, self.target)) for r in rows]
        with _Clock(tms, "probe"):
            qs = _probe_all(self.q_probe, [step.pooled for step in steps])
        scores: list[StepScore | None] = [r.scored.pop(0) if r.scored else None for r in rows]
        idx = [b for b, step in enumerate(steps) if step.text and scores[b] is None]
        if idx:
            scored = [rows[b] for b in idx]
            with _Clock(_timings(scored), "verify"):
                out = self.target.score_steps([r.target for r in scored], [steps[b].text for b in idx])
            for b, sc in zip(idx, out, strict=True):
                scores[b] = sc
                rows[b].res.target_prefill_tokens += len(sc.token_ids)
        have = [b for b, sc in enumerate(scores) if sc is not None]
        ps = [0.0] * len(rows)
        if have:
            with _Clock(_timings([rows[b] for b in have]), "probe"):
                pooled = [scores[b].pooled for b in have]
                for b, p in zip(have, _probe_all(self.p_probe, pooled), strict=True):
                    ps[b] = p
        accepts, whys = [], []
        for b, row in enumerate(rows):
            p, q, u = ps[b], qs[b], row.rng.random()  # u is drawn for every row, scored or not
            accepts.append(scores[b] is not None and rules.accept(p, q, u, s.rule).accepted)
            whys.append({"p": p, "q": q, "u": u})
        if s.min_token_p is not None:
            self._check_tokens(rows, scores, accepts, whys)
        return [
            _Verdict(sc, accept, why, restore)
            for sc, accept, why, restore in zip(scores, accepts, whys, restores, strict=True)
        ]

    def _check_tokens(
        self, rows: list[_Row], scores: list[StepScore | None], accepts: list[bool], whys: list[dict]
    ) -> None:
        """The token check (``min_token_p``) of the steps the probes accepted, in place: each gets ``tok``,
        the least probability the target gives one of its tokens, and is rejected below the floor."""
        checked = [b for b, accept in enumerate(accepts) if accept]
        if not checked:
            return
        with _Clock(_timings([rows[b] for b in checked]), "verify"):
            self.target.read_tokens([scores[b] for b in checked])
        for b in checked:
            w = whys[b]
            w["tok"] = float(scores[b].token_p.min())
            accepts[b] = rules.accept(w["p"], w["q"], w["u"], self.settings.rule, w["tok"]).accepted

    def _salvage(
        self, row: _Row, score: StepScore | None, budget: int, t_restore: Callable[[], LMState]
    ) -> tuple[StepStart, int]:
        """Where the target rewrites a rejected step, and how many of its tokens it keeps. With
        ``salvage`` (greedy only): after the longest prefix of the rejected step that the target would
        have written itself (its argmax at every position, from the verification prefill), which gives
        the target's own greedy step token for token. Otherwise (or when the cache cannot be cropped)
        from the target's state before the step."""
        tstate = row.target
        if self.settings.salvages and score is not None:
            with _Clock(row.res.timings, "target"):
                keep = self.target.greedy_agreement(score)
                start = self.target.resume_after(tstate, score, keep, budget, row.seed)
            if start is not None:
                return start, keep
        return StepStart(t_restore(), budget, row.seed), 0


# SpecReason's verification (github.com/ruipeterpan/specreason, spec_reason.py): after the steps, a user
# turn asks for a 0-9 score of the last step and the assistant's reply starts with the lead below; the
# score is the target's greedy next token, 0 when that token is not a digit; steps scored >= 7 are kept.
VERIFY_INSTRUCTION = (
    "Evaluate the last reasoning step solely based on factual correctness and logical validity. Ignore "
    "style, phrasing, or overall usefulness—only judge whether the step is objectively correct and "
    "logically follows from prior steps. Assign a score from 0 to 9."
)
VERIFY_LEAD = "I think the quality score is: "


class SpecReasonDecoder(_DraftTarget):
    """SpecReason: the target scores each draft step 0-9; steps scored below the threshold are rewritten."""

    method = "specreason"

    def __init__(
        self,
        draft: LM,
        target: LM,
        settings: DecodeSettings,
        instruction: str = VERIFY_INSTRUCTION,
        lead: str = VERIFY_LEAD,
    ) -> None:
        self.draft, self.target, self.settings = draft, target, settings
        self.prompt = target.next_turn(instruction, lead)
        ids = [target.tokenizer.encode(str(d), add_special_tokens=False) for d in range(10)]
        self.digits = {i[0]: d for d, i in enumerate(ids) if len(i) == 1}

    def rate(self, states: list[LMState], step_texts: list[str]) -> list[tuple[int, LMState, int]]:
        """Score each row's step 0-9 (the target's greedy token after the verification turn; 0 when it is
        not a digit), all rows in one padded prefill of the steps and one of the verification turn.

        Returns per row the score, the target state extended by the step (the turn is cropped away) and
        the number of step tokens prefilled."""
        stepped = self.target.extend_many(states, step_texts)
        kept = [(st.text, list(st.ids), st.logits, st.hidden) for st, _, _, _ in stepped]
        prompted = self.target.extend_many([st for st, _, _, _ in stepped], [self.prompt] * len(states))
        out = []
        for (st2, _, _, _), keep, (_, ids, _, _) in zip(prompted, kept, stepped, strict=True):
            score = self.digits.get(int(torch.argmax(st2.logits)), 0)
            crop_to(st2.cache, len(keep[1]))
            out.append((score, LMState(keep[0], keep[1], st2.cache, keep[2], keep[3]), len(ids)))
        return out

    def _round(self, rows: list[_Row]) -> list[_Rewrite]:
        """One round: the draft writes a step per row, the target rates them (batched); returns the steps
        below the threshold, for the target to rewrite."""
        s = self.settings
        d_restores = {r.index: r.draft.checkpoint(r.step_budget(s, self.draft) + 8) for r in rows}
        proposals = self._propose(rows, 1)
        steps = [proposals[r.index][0][0] for r in rows]
        for row in rows:
            row.seed += 1
        t_restores = [r.target.checkpoint(self.target.spec.max_step_tokens * 2 + 64) for r in rows]
        idx = [b for b, step in enumerate(steps) if step.text]
        rated: dict[int, tuple[int, LMState, int]] = {}
        if idx:
            scored = [rows[b] for b in idx]
            with _Clock(_timings(scored), "verify"):
                out = self.rate([r.target for r in scored], [steps[b].text for b in idx])
            rated = dict(zip(idx, out, strict=True))
        rewrites = []
        for b, (row, step) in enumerate(zip(rows, steps, strict=True)):
            score, new_t, k = rated.get(b, (0, None, 0))
            row.res.target_prefill_tokens += k
            if new_t is not None and score >= s.accept_threshold:
                self._accept(row, step, new_t, k, score=score)
                continue
            budget = row.step_budget(s, self.target)
            start = StepStart(t_restores[b](), budget, row.seed)
            rewrites.append(_Rewrite(row, start, d_restores[row.index], [], step.text, {"score": score}))
            row.seed += 1
        return rewrites


def decode_all(
    decoder: Decoder,
    questions: Sequence[str],
    batch_size: int = 1,
    on_result: Callable[[int, DecodeResult], None] | None = None,
) -> list[DecodeResult]:
    """Answer every question with ``decoder``: batched when it is a ``BatchDecoder``, else one at a time
    (the token-level baselines). ``on_result(i, result)`` sees each result as it is ready."""
    if isinstance(decoder, BatchDecoder):
        return decoder.decode_batch(questions, batch_size, on_result=on_result)
    results = []
    for i, question in enumerate(questions):
        results.append(decoder.decode(question))
        results[-1].timings.share = results[-1].timings.total  # alone: its cost is its latency
        if on_result is not None:
            on_result(i, results[-1])
    return results
