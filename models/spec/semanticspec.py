"""SemanticSpec (the paper's Algorithm 1), batched: per round the draft writes ``gamma`` steps per row, the
target prefills them on its cached context (one prefill per round), the probes give q (draft) and p
(target), and each step is kept by the acceptance rule (``rules.accept``: ``u < min(1, p/q)`` and its
options); the first rejected step is rewritten by the target from the last accepted context (greedy:
after the prefix of it the target agrees with, ``salvage``).

Steps travel between the models as text; each model re-tokenises them, so the pair may use different
tokenizers. Both models keep their caches across steps: accepted text is appended, rejected text is
cropped away; nothing re-prefills the whole context. The other methods: ``specreason``, ``token_level``
(``specsampling``, ``assisted``) and ``batching.SingleModelDecoder`` (``target``, ``draft``).
"""

from __future__ import annotations

from semspec.models.lm import (
    LM,
    StepScore,
    StepStart,
    crop_to,
)
from semspec.models.spec import rules
from semspec.models.spec.batching import Row, step_room
from semspec.models.spec.draft_target import DraftTarget, Rewrite
from semspec.models.spec.names import SEMANTICSPEC_RULES
from semspec.models.spec.settings import DecodeSettings
from semspec.models.spec.verifier import ProbeFn, SemanticSpecVerifier


class SemanticSpecDecoder(DraftTarget):
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
        self.verifier = SemanticSpecVerifier(target, q_probe, p_probe, settings)
        self.probe_ids = probe_ids  # role -> identity of the probe (its weights' sha256)

    @property
    def q_probe(self) -> ProbeFn:
        """The draft's probe (the verifier's)."""
        return self.verifier.q_probe

    @property
    def p_probe(self) -> ProbeFn:
        """The target's probe (the verifier's)."""
        return self.verifier.p_probe

    @property
    def run_identity(self) -> dict:
        """What, beyond the evaluation settings, decides this decoder's rows: the probes, salvage, the
        floor on p/q or on p where there is one (``auto`` resolves per probe pair), the rejection
        budget and the token check where there are."""
        floors = {k: getattr(self.settings, k) for k in SEMANTICSPEC_RULES}
        floors = {k: v for k, v in floors.items() if v is not None}
        return {"probes": self.probe_ids, "salvage": self.settings.salvages, **floors}

    def _propose_and_judge(self, rows: list[Row]) -> list[Rewrite]:
        """One round (``_verify_round``) for the rows whose answers still have rejections to spend; the
        others (``max_rejections`` spent) are handed to the target, which writes their next step alone."""
        s = self.settings
        if s.max_rejections is None:
            return self._verify_round(rows)
        handed = [r for r in rows if not rules.drafting(s.rule, r.res.rejections)]
        going = [r for r in rows if rules.drafting(s.rule, r.res.rejections)]
        writes = []
        for row in handed:
            start = StepStart(row.target, row.step_budget(s, self.target), row.next_seed())
            writes.append(Rewrite(row, start, None, [], None, {"rejected_by": "budget"}))
        return writes + (self._verify_round(going) if going else [])

    def _verify_round(self, rows: list[Row]) -> list[Rewrite]:
        """One round: the draft proposes up to gamma steps per row (and lookahead steps, see
        ``DraftProposer.propose``), the verifier judges them in order (``SemanticSpecVerifier``: each
        proposal position one batched prefill over the rows still going); returns the first rejected step
        of each row, for the target to rewrite."""
        s = self.settings
        d_restores = self.proposer.checkpoints(rows, [s.gamma * step_room(s, self.draft, 0) + 8] * len(rows))
        proposals = self.proposer.propose(rows, s.gamma, s.lookahead)
        verifying, rewrites, dropped = list(rows), [], []
        ahead_scores: dict[int, list[StepScore]] = {}  # row -> the target's scores of its next proposals
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
                if self.proposer.valid(row, step, budget, used):
                    current.append(row)
                else:  # written ahead under another budget: drop it and the rest, draft again next round
                    dropped.append(
                        (d_restores[row.index], [x.text for x, _ in proposals[row.index][:i]], row)
                    )
            if not current:
                break
            steps = [proposals[r.index][i][0] for r in current]
            if s.gamma > 1 and i % s.gamma == 0:
                groups = [proposals[r.index][i : i + s.gamma] for r in current]
                ahead_scores.update(
                    self.verifier.score_ahead(current, groups, start_used, self.proposer.valid)
                )
            verdicts = self.verifier.judge(current, steps, ahead_scores)
            verifying = []
            for row, step, v in zip(current, steps, verdicts, strict=True):
                if v.accepted and v.score is not None:
                    self._accept(row, step, v.score.state, len(v.score.token_ids), **v.why)
                    if step.finish_reason != "eos":
                        verifying.append(row)
                    continue
                start, kept = self.verifier.salvage(row, v.score, v.restore)
                replay = [prev.text for prev, _ in proposals[row.index][:i]]
                rewrites.append(Rewrite(row, start, d_restores[row.index], replay, step.text, v.why, kept))
        rejected = {it.row.index for it in rewrites}
        for row in rows:  # a row that stopped inside a jointly scored run: its cache holds steps not taken
            if row.index not in rejected and row.target is not None:
                crop_to(row.target.cache, len(row.target.ids))
        if dropped:
            restores, replays, back = (list(x) for x in zip(*dropped, strict=True))
            self.proposer.roll_back(back, restores, replays)
        return rewrites
