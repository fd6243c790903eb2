"""The draft's side of the two-model step-level methods (SemanticSpec, SpecReason): ``DraftProposer``
proposes steps for a batch of rows and keeps each row's draft state in step with the answer the row
writes (back to a checkpoint, the round's accepted steps re-read, the target's rewrite read). Its calls
are the rows' draft time (``charged``).

Its interface is the proposer half of speculative decoding (transformers' ``CandidateGenerator``,
vLLM's proposers): ``propose`` writes candidates, ``valid`` says whether one written ahead still stands,
and ``roll_back`` / ``read`` follow the verifier's decisions. The verifier (``verifier.py`` for SemanticSpec,
``specreason.py``) and the target's rewrite (``draft_target.DraftTarget``) never touch the draft model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from semspec.models.lm import LM, LMState, StepSample, StepStart
from semspec.models.spec.batching import Row
from semspec.models.spec.results import charged
from semspec.models.spec.settings import DecodeSettings

Proposals = dict[int, list[tuple[StepSample, int]]]  # row index -> its proposals, each with its budget
Restore = Callable[[], LMState]  # a state's checkpoint: the state as it was when taken


class DraftProposer:
    """The draft model proposing reasoning steps for rows (see the module docstring)."""

    def __init__(self, draft: LM, settings: DecodeSettings) -> None:
        self.draft, self.settings = draft, settings

    def checkpoints(self, rows: Sequence[Row], rooms: Sequence[int]) -> dict[int, Restore]:
        """A checkpoint of each row's draft state, with room for ``rooms[b]`` more positions (what the
        round may write before it rolls back): row index -> restore."""
        return {r.index: r.draft.checkpoint(room) for r, room in zip(rows, rooms, strict=True)}

    @charged("draft")
    def propose(self, rows: list[Row], gamma: int, lookahead: int = 0) -> Proposals:
        """Up to ``gamma`` draft steps per row (fewer after EOS or an empty step) in one batched decode
        loop, plus up to ``lookahead`` more for rows done before the slowest: the steps the draft would
        propose in the next rounds (``valid`` checks their budgets once the steps before are judged);
        advances the draft's caches. Proposal ``j`` samples with ``row.next_seed() + j``. Returns row index ->
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

        starts = [StepStart(r.draft, budgets[b][0], r.next_seed()) for b, r in enumerate(rows)]
        outs = self.draft.decode_runs(starts, s.temperature, s.top_p, gamma, more)
        proposals = {}
        for b, (row, (steps, state)) in enumerate(zip(rows, outs, strict=True)):
            row.draft = state
            proposals[row.index] = list(zip(steps, budgets[b], strict=False))
        return proposals

    def valid(self, row: Row, step: StepSample, budget: int, used: int) -> bool:
        """Whether a proposal is the step the draft writes at this point when it proposes round by round:
        ``used`` output tokens before it (the target's count, as a round would start from); with
        lookahead the draft counted its own tokens, and a different budget matters only when the step
        ran into one of the two."""
        if used >= row.budget:
            return False
        needed = row.step_budget(self.settings, self.draft, used)
        return budget == needed or (step.finish_reason != "length" and step.num_tokens <= needed)

    @charged("draft")
    def roll_back(self, rows: list[Row], restores: list[Restore], replays: list[list[str]]) -> None:
        """Each row's draft back at its checkpoint, re-reading the round's accepted steps ``replays[b]``
        (the rows batched)."""
        states = [restore() for restore in restores]
        for j in range(max((len(replay) for replay in replays), default=0)):
            self._extend(states, [replay[j] if j < len(replay) else "" for replay in replays])
        for row, state in zip(rows, states, strict=True):
            row.draft = state

    @charged("draft")
    def read(self, rows: list[Row], texts: list[str]) -> list[int]:
        """Each row's draft reads its text (the target's step), in one prefill; returns the draft tokens
        each read."""
        states = [r.draft for r in rows]
        before = [len(state.ids) for state in states]
        self._extend(states, texts)
        for row, state in zip(rows, states, strict=True):
            row.draft = state
        return [len(state.ids) - n for state, n in zip(states, before, strict=True)]

    def _extend(self, states: list[LMState], texts: list[str]) -> None:
        """Extend each draft state by its text in place in ``states`` (rows with no text are left alone),
        in one prefill."""
        idx = [i for i, text in enumerate(texts) if text]
        if idx:
            extended = self.draft.extend_many([states[i] for i in idx], [texts[i] for i in idx])
            for i, ext in zip(idx, extended, strict=True):
                states[i] = ext[0]
