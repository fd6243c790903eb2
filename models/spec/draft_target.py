"""What the two-model step-level methods share: the draft proposes steps (``DraftProposer``), a method's
verifier judges them, the target rewrites the rejected ones together, and the draft rolls back and
re-reads."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

from semspec.models.lm import (
    LM,
    LMState,
    StepSample,
    StepStart,
)
from semspec.models.spec.batching import (
    BatchDecoder,
    Row,
)
from semspec.models.spec.proposer import DraftProposer, Restore
from semspec.models.spec.results import (
    StepRecord,
    charged,
)


@dataclass
class Rewrite:
    """A rejected proposal of one row, for the target to rewrite: where the target starts (its state
    before the proposal, or the salvaged prefix), how the draft rolls back and what it re-reads."""

    row: Row
    start: StepStart
    d_restore: Restore | None  # None: the draft reads no more of this answer (handed over)
    replay: list[str]  # the round's accepted steps, for the draft to re-read
    proposal: str | None  # None: the target writes the step with nothing proposed (handed over)
    why: dict[str, float | int | str | None]  # p, q, u, tok, score and what rejected the step
    salvaged: int = 0  # kept tokens of the proposal (salvage)
    waited: int = 0  # rounds the row has waited for it


class DraftTarget(BatchDecoder):
    """What the two-model step-level decoders share: the draft proposes, the target rewrites rejections."""

    roles = ("draft", "target")
    draft: LM
    target: LM

    def lm(self, role: str) -> LM:
        """The draft or the target."""
        return self.draft if role == "draft" else self.target

    def _propose_and_judge(self, rows: list[Row]) -> list[Rewrite]:
        """Propose and judge for ``rows``; returns the rejected steps to rewrite."""
        raise NotImplementedError

    @functools.cached_property
    def proposer(self) -> DraftProposer:
        """The draft's side: it proposes steps and follows the verifier's decisions."""
        return DraftProposer(self.draft, self.settings)

    @functools.cached_property
    def _owed(self) -> dict[Row, Rewrite]:
        """The rewrites this decoder owes its rows: a rejected step waits here for the target."""
        return {}

    def waiting(self, row: Row) -> bool:
        """Whether ``row`` waits for the target to rewrite a rejected step."""
        return row in self._owed

    def release(self, rows: Sequence[Row]) -> None:
        """Forget the rewrites owed to ``rows`` (they leave this decoder)."""
        for row in rows:
            self._owed.pop(row, None)

    def hand_over(self, rows: Sequence[Row]) -> list[Row]:
        """The rows of ``rows`` that may go on with the target alone: those not waiting for a rewrite (a
        waiting row leaves after the round that rewrites its step; the others are owed nothing, so there is
        nothing to release), their draft states dropped (the draft reads no more of their answers)."""
        moving = [r for r in rows if not self.waiting(r)]
        for row in moving:
            row.draft = None
        return moving

    def _advance(self, rows: list[Row]) -> None:
        """One round (``_propose_and_judge``) for the rows owed no rewrite. The target rewrites the rejected
        rows together, once half the batch waits, one has waited ``rewrite_wait`` rounds, or no row could go
        on without them: its decode forward costs about the same for one row as for several, and a row
        that waits goes through the same steps (only later)."""
        s, owed = self.settings, self._owed
        active = [r for r in rows if r not in owed]
        for it in self._propose_and_judge(active) if active else []:
            owed[it.row] = it
        waiting = [r for r in rows if r in owed]
        if not waiting:
            return
        going = [r for r in rows if r not in owed and not r.finished(s)]
        if (
            not going
            or 2 * len(waiting) >= len(rows)
            or max(owed[r].waited for r in waiting) >= s.rewrite_wait
        ):
            self._rewrite([owed[r] for r in waiting])
            self.release(waiting)
        else:
            for r in waiting:
                owed[r].waited += 1

    def _accept(
        self, row: Row, step: StepSample, target_state: LMState, k: int, **why: float | int | str | None
    ) -> None:
        """Keep an accepted draft step: ``target_state`` is the target's state with the step read (``k``
        target tokens), ``why`` what decided it."""
        row.target = target_state
        row.res.add(StepRecord("draft", step.text, step.num_tokens, k, **why))
        row.res.output_tokens += k
        if step.finish_reason == "eos":
            row.res.finish_reason = "eos"

    @charged("target")
    def _write(self, rows: list[Row], starts: list[StepStart]) -> list[tuple[StepSample, LMState]]:
        """The target writes a step for each row from ``starts`` (one batched decode)."""
        return self.target.decode_steps(starts, self.settings.temperature, self.settings.top_p)

    def _rewrite(self, items: list[Rewrite]) -> None:
        """Rejected proposals: the target writes each row's step (all rows in one batched decode; salvaged
        rows start after their kept prefix), then each draft rolls back to its checkpoint, re-reads the
        round's accepted steps and reads the target's step (``DraftProposer``, batched too). A row handed
        over to the target (no proposal, no checkpoint) only gets the target's step: its draft reads no
        more."""
        if not items:
            return
        rows = [it.row for it in items]
        written = self._write(rows, [it.start for it in items])
        synced = [b for b, it in enumerate(items) if it.d_restore is not None]  # the others: handed over
        draft_tokens = [0] * len(items)
        if synced:
            back = [rows[b] for b in synced]
            self.proposer.roll_back(
                back, [items[b].d_restore for b in synced], [items[b].replay for b in synced]
            )
            for b, k in zip(
                synced, self.proposer.read(back, [written[b][0].text for b in synced]), strict=True
            ):
                draft_tokens[b] = k
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
