"""The batched step loop's bookkeeping: rows (one problem each, with both models' states), jobs, and
``BatchDecoder``, whose rows join and leave between rounds (continuous batching); ``SingleModelDecoder``
(``target``, ``draft``) is its simplest method."""

from __future__ import annotations

import functools
import random
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from semspec.models.lm import (
    LM,
    LMState,
    NextBudget,
    Prompt,
    StepSample,
    StepStart,
)
from semspec.models.spec.names import ROLES
from semspec.models.spec.results import (
    Decoder,
    DecodeResult,
    StepCallback,
    StepRecord,
    charged,
    finish_result,
)
from semspec.models.spec.settings import (
    DecodeSettings,
)


def step_room(s: DecodeSettings, lm: LM, used: int, limit: int | None = None) -> int:
    """Tokens ``lm`` may spend on its next step: its step budget, capped by what is left of the output
    (``limit``, a row's own budget; default the settings')."""
    limit = s.max_new_tokens if limit is None else limit
    return max(1, min(s.step_tokens or lm.config.max_step_tokens, limit - used))


def scored_room(s: DecodeSettings, target: LM) -> int:
    """Positions the target's scoring of one step may add to its cache (a draft step re-tokenized by
    the target may take up to twice its tokens), for a checkpoint or window check made before it."""
    return step_room(s, target, 0) * 2 + 8


def uniform(key: str, n: int) -> float:
    """Value ``n`` (from 0) of the stream of uniform draws in [0, 1) seeded by ``key``."""
    rng = random.Random(key)
    for _ in range(n):
        rng.random()
    return rng.random()


@dataclass(eq=False)
class Row:
    """One problem of a batch: its result so far and both models' states. What one method keeps of a row
    between rounds (a rewrite it owes) belongs to that method's decoder, keyed by the row itself (rows
    compare and hash by identity)."""

    index: int  # the job's key: its position in the list of questions, or a server's request id
    res: DecodeResult
    t0: float
    seed: int  # the job's seed; every random draw of the row derives from it and its step count
    draws: str  # the key of the row's stream of acceptance draws: its seed and its prompt
    budget: int  # output tokens this row may write (its job's, else the settings' max_new_tokens)
    draft: LMState | None = None  # the draft's state (None when the decoder has no draft)
    target: LMState | None = None  # the target's state (None when the decoder has no target)

    def next_seed(self) -> int:
        """The sampling seed of the row's next step: its seed plus the steps written so far, a rejected
        proposal counted too (a proposal takes one seed and its rewrite the next), so a step's draws
        depend on neither the batch nor how far the row looked ahead. Proposal ``j`` of a round samples
        with ``next_seed() + j``."""
        return self.seed + len(self.res.steps) + self.res.rejections

    def draw(self) -> float:
        """The acceptance draw ``u`` of the row's next judged step: value ``n`` of the stream seeded by
        (seed, prompt), ``n`` the steps judged so far (those with a ``u``), so problems do not share one
        sequence and a draw depends on nothing but the row's own steps."""
        return uniform(self.draws, sum(step.u is not None for step in self.res.steps))

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
        return step_room(s, lm, self.res.output_tokens if used is None else used, self.budget)

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


def share_time(rows: list[Row], seconds: float) -> None:
    """Divide the time of a batched call among the rows it served."""
    for row in rows:
        row.res.timings.share += seconds / len(rows)


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

    def _advance(self, rows: list[Row]) -> None:
        """One round for every live row."""
        raise NotImplementedError

    def waiting(self, row: Row) -> bool:
        """Whether ``row`` waits in this decoder for work a later round does (a rejected step the target
        has yet to rewrite): until then it cannot leave for another decoder."""
        return False

    def release(self, rows: Sequence[Row]) -> None:
        """Forget what this decoder keeps of ``rows``: they leave it (finished, failed, cancelled or
        handed to another decoder). ``round`` releases the rows it finishes."""

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
        try:
            while queue or live:
                joining = [queue.popleft() for _ in range(min(batch_size - len(live), len(queue)))]
                if joining:
                    live += self.admit(joining, on_step)
                for row in self.round(live):
                    results[row.index] = row.res
                    if on_result is not None:
                        on_result(row.index, row.res)
                live = [r for r in live if not r.finished(self.settings)]
        finally:  # a failed call leaves nothing of its rows behind
            self.release(live)
        return results

    def admit(
        self, jobs: Sequence[Job], on_step: Callable[[int, StepRecord], None] | None = None
    ) -> list[Row]:
        """New rows for ``jobs``: every model reads their prompts in one padded prefill. The caller keeps
        the rows and passes them to ``round`` until each is finished (continuous batching: rows may join
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
            rows.append(Row(job.key, res, t0, seed, f"{seed}:{job.prompt}", budget))
        for role in self.roles:
            for row, state in zip(rows, self._prefill(rows, role, [job.prompt for job in jobs]), strict=True):
                row.set_state(role, state)
                # the last role's count: the target's where there is one
                row.res.extra["prompt_tokens"] = len(state.ids)
        share_time(rows, time.perf_counter() - t0)
        return rows

    @charged("role")
    def _prefill(self, rows: list[Row], role: str, prompts: list[Prompt]) -> list[LMState]:
        """The model playing ``role`` reads the rows' prompts in one padded prefill."""
        lm = self.lm(role)
        return lm.prefill_many([lm.format_prompt(prompt) for prompt in prompts])

    def round(self, live: list[Row]) -> list[Row]:
        """One round for every row in ``live``; returns the rows it finished, their results complete (the
        caller drops them from its list)."""
        t0 = time.perf_counter()
        self._advance(live)
        share_time(live, time.perf_counter() - t0)
        done = [r for r in live if r.finished(self.settings)]
        for row in done:
            finish_result(self.method, row.res, row.t0, self.settings)
        self.release(done)
        return done


def write_alone(lm: LM, role: str, rows: list[Row], s: DecodeSettings) -> None:
    """``lm`` (playing ``role``) writes every row's next step, all in one batched decode loop; rows done
    before the slowest write up to ``lookahead`` more (the steps they would write in the next rounds)."""

    def more(b: int, done: list[StepSample]) -> int | None:
        used = rows[b].used(done)
        if len(done) > s.lookahead or used >= rows[b].budget:
            return None
        return rows[b].step_budget(s, lm, used)

    starts = [StepStart(r.state(role), r.step_budget(s, lm), r.next_seed()) for r in rows]
    for row, (steps, state) in zip(rows, _decode_runs(rows, role, lm, starts, s, more), strict=True):
        row.set_state(role, state)
        for step in steps:
            k = step.num_tokens
            row.res.add(StepRecord(role, step.text, k * (role == "draft"), k * (role == "target")))
            row.res.output_tokens += k
            if step.finish_reason == "eos":
                row.res.finish_reason = "eos"


@charged("role")
def _decode_runs(
    rows: list[Row], role: str, lm: LM, starts: list[StepStart], s: DecodeSettings, more: NextBudget
) -> list[tuple[list[StepSample], LMState]]:
    """``lm`` (playing ``role``) writes the rows' steps from ``starts`` in one batched decode loop."""
    return lm.decode_runs(starts, s.temperature, s.top_p, 1, more)


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

    def _advance(self, rows: list[Row]) -> None:
        """Every row writes its next step (``write_alone``)."""
        write_alone(self.model, self.role, rows, self.settings)


def decode_all(
    decoder: Decoder,
    questions: Sequence[str],
    batch_size: int = 1,
    on_result: Callable[[int, DecodeResult], None] | None = None,
) -> list[DecodeResult]:
    """Answer every question with ``decoder``: batched when it can be (a ``BatchDecoder``, or any decoder
    with a ``decode_batch`` of the same signature), else one at a time (the token-level baselines).
    ``on_result(i, result)`` sees each result as it is ready."""
    if callable(getattr(decoder, "decode_batch", None)):
        return decoder.decode_batch(questions, batch_size, on_result=on_result)
    results = []
    for i, question in enumerate(questions):
        results.append(decoder.decode(question))
        results[-1].timings.share = results[-1].timings.total  # alone: its cost is its latency
        if on_result is not None:
            on_result(i, results[-1])
    return results
