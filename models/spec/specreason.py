"""SpecReason (github.com/ruipeterpan/specreason): the target scores each draft step 0-9 in a verification
turn; steps scored below the threshold are rewritten."""

from __future__ import annotations

import torch

from semspec.models.lm import (
    LM,
    LMState,
    StepStart,
)
from semspec.models.spec.batching import (
    Row,
)
from semspec.models.spec.draft_target import DraftTarget, Rewrite
from semspec.models.spec.results import (
    charged,
)
from semspec.models.spec.settings import (
    DecodeSettings,
)

# SpecReason's verification (github.com/ruipeterpan/specreason, spec_reason.py): after the steps, a user
# turn asks for a 0-9 score of the last step and the assistant's reply starts with the lead below; the
# score is the target's greedy next token, 0 when that token is not a digit; steps scored >= 7 are kept.
VERIFY_INSTRUCTION = (
    "Evaluate the last reasoning step solely based on factual correctness and logical validity. Ignore "
    "style, phrasing, or overall usefulness—only judge whether the step is objectively correct and "
    "logically follows from prior steps. Assign a score from 0 to 9."
)
VERIFY_LEAD = "I think the quality score is: "


class SpecReasonVerifier:
    """SpecReason's verifier: the target rates a step 0-9 in a verification turn after it."""

    def __init__(self, target: LM, instruction: str = VERIFY_INSTRUCTION, lead: str = VERIFY_LEAD) -> None:
        self.target = target
        self.prompt = target.next_turn(instruction, lead)
        ids = [target.plain_ids(str(d)) for d in range(10)]
        self.digits = {i[0]: d for d, i in enumerate(ids) if len(i) == 1}
        # the verification turn's length, with room for tokens that merge across its boundary
        self.turn_tokens = len(target.plain_ids(self.prompt)) + 8

    def rate(self, states: list[LMState], step_texts: list[str]) -> list[tuple[int, LMState, int]]:
        """Score each row's step 0-9 (the target's greedy token after the verification turn; 0 when it is
        not a digit), all rows in one padded prefill of the steps and one of the verification turn.

        Returns per row the score, the target state extended by the step (the turn is cropped away) and
        the number of step tokens prefilled."""
        stepped = self.target.extend_many(states, step_texts)
        # the turn is taken back after scoring: a crop where every position is still cached, else a copy (a
        # sliding-window layer may drop the step's positions while it reads the turn)
        restores = [st.checkpoint(self.turn_tokens) for st, _, _, _ in stepped]
        prompted = self.target.extend_many([st for st, _, _, _ in stepped], [self.prompt] * len(states))
        out = []
        for (st2, _, _, _), restore, (_, ids, _, _) in zip(prompted, restores, stepped, strict=True):
            score = self.digits.get(int(torch.argmax(st2.logits)), 0)
            out.append((score, restore(), len(ids)))
        return out


class SpecReasonDecoder(DraftTarget):
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
        self.verifier = SpecReasonVerifier(target, instruction, lead)

    @charged("verify")
    def _rate(self, rows: list[Row], texts: list[str]) -> list[tuple[int, LMState, int]]:
        """The verifier rates each row's step (``SpecReasonVerifier.rate``)."""
        return self.verifier.rate([r.target for r in rows], texts)

    def _propose_and_judge(self, rows: list[Row]) -> list[Rewrite]:
        """One round: the draft writes a step per row, the target rates them (batched); returns the steps
        below the threshold, for the target to rewrite."""
        s = self.settings
        d_restores = self.proposer.checkpoints(rows, [r.step_budget(s, self.draft) + 8 for r in rows])
        proposals = self.proposer.propose(rows, 1)
        steps = [proposals[r.index][0][0] for r in rows]
        room = self.target.config.max_step_tokens * 2 + self.verifier.turn_tokens  # the step, then the turn
        t_restores = [r.target.checkpoint(room) for r in rows]
        idx = [b for b, step in enumerate(steps) if step.text]
        rated: dict[int, tuple[int, LMState, int]] = {}
        if idx:
            scored = [rows[b] for b in idx]
            out = self._rate(scored, [steps[b].text for b in idx])
            rated = dict(zip(idx, out, strict=True))
        rewrites = []
        for b, (row, step) in enumerate(zip(rows, steps, strict=True)):
            score, new_t, k = rated.get(b, (0, None, 0))
            row.res.target_prefill_tokens += k
            if new_t is not None and score >= s.accept_threshold:
                self._accept(row, step, new_t, k, score=score)
                continue
            budget = row.step_budget(s, self.target)
            start = StepStart(t_restores[b](), budget, row.next_seed() + 1)  # the seed after the proposal's
            why = {"score": score, "rejected_by": "score" if step.text else "empty"}
            rewrites.append(Rewrite(row, start, d_restores[row.index], [], step.text, why))
        return rewrites
