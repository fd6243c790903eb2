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

from collections.abc import Callable
from dataclasses import dataclass

from semspec.models.lm import (
    LM,
    LMState,
    Pooled,
    StepSample,
    StepScore,
    StepStart,
    crop_to,
    fits_window,
)
from semspec.models.spec import rules
from semspec.models.spec.batching import (
    Row,
    scored_room,
    step_room,
    timings_of,
)
from semspec.models.spec.draft_target import DraftTarget, Rewrite
from semspec.models.spec.names import SEMANTICSPEC_RULES
from semspec.models.spec.results import (
    Clock,
)
from semspec.models.spec.settings import (
    DecodeSettings,
)

ProbeFn = Callable[[Pooled], float]  # pooled hidden states of a step -> semantic probability


def probe_all(fn: ProbeFn, pooled: list[Pooled]) -> list[float]:
    """The probe on every row: one call when it scores batches (a ``many`` attribute), else row by row."""
    many = getattr(fn, "many", None)
    return list(many(pooled)) if many is not None else [fn(p) for p in pooled]


@dataclass
class Judgement:
    """SemanticSpec's judgement of one proposed step."""

    score: StepScore | None  # the target's scoring of the step (None for an empty step)
    accepted: bool
    why: dict[str, float | str | None]  # p, q, the uniform draw u and what rejected the step (None: kept)
    restore: Callable[[], LMState]  # the target's state before the step


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
        ``_propose``), the target verifies them in order with the probes (each proposal position one
        batched prefill over the rows still going); returns the first rejected step of each row, for the
        target to rewrite."""
        s = self.settings
        d_restores = {r.index: r.draft.checkpoint(s.gamma * step_room(s, self.draft, 0) + 8) for r in rows}
        proposals = self._propose(rows, s.gamma, s.lookahead)
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
                if self._valid(row, step, budget, used):
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
                ahead_scores.update(self._score_ahead(current, groups, start_used))
            verdicts = self._judge(current, steps, ahead_scores)
            verifying = []
            for row, step, v in zip(current, steps, verdicts, strict=True):
                if v.accepted and v.score is not None:
                    self._accept(row, step, v.score.state, len(v.score.token_ids), **v.why)
                    if step.finish_reason != "eos":
                        verifying.append(row)
                    continue
                start, kept = self._salvage(row, v.score, v.restore)
                replay = [prev.text for prev, _ in proposals[row.index][:i]]
                rewrites.append(Rewrite(row, start, d_restores[row.index], replay, step.text, v.why, kept))
        rejected = {it.row.index for it in rewrites}
        for row in rows:  # a row that stopped inside a jointly scored run: its cache holds steps not taken
            if row.index not in rejected and row.target is not None:
                crop_to(row.target.cache, len(row.target.ids))
        if dropped:
            with Clock(timings_of([row for _, _, row in dropped]), "draft"):
                states = self._draft_back([(restore, replay) for restore, replay, _ in dropped])
            for (_, _, row), state in zip(dropped, states, strict=True):
                row.draft = state
        return rewrites

    def _score_ahead(
        self, rows: list[Row], groups: list[list[tuple[StepSample, int]]], start_used: dict[int, int]
    ) -> dict[int, list[StepScore]]:
        """With ``gamma`` > 1: the target scores each row's proposals of this virtual round (``groups[b]``,
        the first already found valid) in one padded prefill, one pass over its weights for up to
        ``gamma`` steps; returns row index -> its scores, which ``_judge`` takes in order. A run ends
        before an empty or invalid step and after an EOS step, and is a single step where a sliding window
        could not crop back."""
        s, runs, scored = self.settings, [], []
        per_step = scored_room(s, self.target)
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
            return {}
        with Clock(timings_of(scored), "verify"):
            out = self.target.score_runs([r.target for r in scored], runs)
        for row, scores in zip(scored, out, strict=True):
            row.res.target_prefill_tokens += sum(len(sc.token_ids) for sc in scores)
        return {row.index: scores for row, scores in zip(scored, out, strict=True)}

    def _judge(
        self, rows: list[Row], steps: list[StepSample], ahead_scores: dict[int, list[StepScore]]
    ) -> list[Judgement]:
        """The target prefills each row's step on its cache (in place, all rows in one padded prefill;
        a row's next score from ``_score_ahead``, in ``ahead_scores``, is taken as it is) and the probes give q
        and p (batched); a step is accepted when ``u < min(1, p/q)`` (and ``p/q >= min_ratio`` when set), or with ``min_p``
        when ``p >= min_p``; with ``min_token_p``, a step so accepted is then rejected when the target
        gives one of its tokens a lower probability (one head pass over the accepted steps' positions).
        Returns each row's verdict."""
        s, tms = self.settings, timings_of(rows)
        restores = [r.target.checkpoint(scored_room(s, self.target)) for r in rows]
        with Clock(tms, "probe"):
            qs = probe_all(self.q_probe, [step.pooled for step in steps])
        scores: list[StepScore | None] = [
            ahead_scores[r.index].pop(0) if ahead_scores.get(r.index) else None for r in rows
        ]
        idx = [b for b, step in enumerate(steps) if step.text and scores[b] is None]
        if idx:
            scored = [rows[b] for b in idx]
            with Clock(timings_of(scored), "verify"):
                out = self.target.score_steps([r.target for r in scored], [steps[b].text for b in idx])
            for b, sc in zip(idx, out, strict=True):
                scores[b] = sc
                rows[b].res.target_prefill_tokens += len(sc.token_ids)
        have = [b for b, sc in enumerate(scores) if sc is not None]
        ps = [0.0] * len(rows)
        if have:
            with Clock(timings_of([rows[b] for b in have]), "probe"):
                pooled = [scores[b].pooled for b in have]
                for b, p in zip(have, probe_all(self.p_probe, pooled), strict=True):
                    ps[b] = p
        accepts, whys = [], []
        for b, row in enumerate(rows):
            p, q, u = ps[b], qs[b], row.draw()  # u is drawn for every row, scored or not
            verdict = rules.accept(p, q, u, s.rule) if scores[b] is not None else None
            accepts.append(verdict is not None and verdict.accepted)
            why = verdict.rejected_by if verdict is not None else "empty"
            whys.append({"p": p, "q": q, "u": u, "rejected_by": why})
        if s.min_token_p is not None:
            self._check_tokens(rows, scores, accepts, whys)
        return [
            Judgement(sc, accept, why, restore)
            for sc, accept, why, restore in zip(scores, accepts, whys, restores, strict=True)
        ]

    def _check_tokens(
        self, rows: list[Row], scores: list[StepScore | None], accepts: list[bool], whys: list[dict]
    ) -> None:
        """The token check (``min_token_p``) of the steps the probes accepted, in place: each gets ``tok``,
        the least probability the target gives one of its tokens, and is rejected below the floor."""
        checked = [b for b, accept in enumerate(accepts) if accept]
        if not checked:
            return
        with Clock(timings_of([rows[b] for b in checked]), "verify"):
            self.target.read_tokens([scores[b] for b in checked])
        for b in checked:
            w = whys[b]
            w["tok"] = float(scores[b].token_p.min())
            verdict = rules.accept(w["p"], w["q"], w["u"], self.settings.rule, w["tok"])
            accepts[b], w["rejected_by"] = verdict.accepted, verdict.rejected_by

    def _salvage(
        self, row: Row, score: StepScore | None, t_restore: Callable[[], LMState]
    ) -> tuple[StepStart, int]:
        """Where the target rewrites a rejected step, and how many of its tokens it keeps. With
        ``salvage`` (greedy only): after the longest prefix of the rejected step that the target would
        have written itself (its argmax at every position, from the verification prefill), which gives
        the target's own greedy step token for token. Otherwise (or when the cache cannot be cropped)
        from the target's state before the step. The rewrite samples with the seed after its
        proposal's."""
        tstate, budget, seed = row.target, row.step_budget(self.settings, self.target), row.next_seed() + 1
        if self.settings.salvages and score is not None:
            with Clock(row.res.timings, "target"):
                keep = self.target.greedy_agreement(score)
                start = self.target.resume_after(tstate, score, keep, budget, seed)
            if start is not None:
                return start, keep
        return StepStart(t_restore(), budget, seed), 0
