"""SemanticSpec's verifier: the target reads each proposed step on its cache, the probes give q (draft)
and p (target), and ``rules.accept`` keeps the step or names what rejected it; for a rejected step it
finds where the target rewrites (after the prefix the target agrees with, ``salvage``).

It is the verifier half of speculative decoding (vLLM's rejection sampler, transformers' candidate
verification) at the level of reasoning steps: ``score_ahead`` and ``judge`` decide, ``salvage`` starts the
rewrite. It never touches the draft model (``proposer.DraftProposer`` does).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from semspec.models.lm import (
    LM,
    Pooled,
    StepSample,
    StepScore,
    StepStart,
    fits_window,
)
from semspec.models.spec import rules
from semspec.models.spec.batching import Row, scored_room
from semspec.models.spec.proposer import Restore
from semspec.models.spec.results import charged
from semspec.models.spec.settings import DecodeSettings

ProbeFn = Callable[[Pooled], float]  # pooled hidden states of a step -> semantic probability
Validity = Callable[[Row, StepSample, int, int], bool]  # (row, step, its budget, tokens used before it)


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
    restore: Restore  # the target's state before the step


class SemanticSpecVerifier:
    """The target and the probes ``q_probe`` (draft) and ``p_probe`` (target) judging proposed steps."""

    def __init__(self, target: LM, q_probe: ProbeFn, p_probe: ProbeFn, settings: DecodeSettings) -> None:
        self.target, self.q_probe, self.p_probe, self.settings = target, q_probe, p_probe, settings

    def score_ahead(
        self,
        rows: list[Row],
        groups: list[list[tuple[StepSample, int]]],
        start_used: dict[int, int],
        valid: Validity,
    ) -> dict[int, list[StepScore]]:
        """With ``gamma`` > 1: the target scores each row's proposals of this virtual round (``groups[b]``,
        the first already found ``valid``) in one padded prefill, one pass over its weights for up to
        ``gamma`` steps; returns row index -> its scores, which ``judge`` takes in order. A run ends
        before an empty or invalid step and after an EOS step, and is a single step where a sliding window
        could not crop back."""
        s, runs, scored = self.settings, [], []
        per_step = scored_room(s, self.target)
        for row, group in zip(rows, groups, strict=True):
            run: list[str] = []
            for j, (step, budget) in enumerate(group):
                used = row.used([x for x, _ in group[:j]], base=start_used[row.index])
                if not step.text or (j and not valid(row, step, budget, used)):
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
        out = self._score_runs(scored, runs)
        for row, scores in zip(scored, out, strict=True):
            row.res.target_prefill_tokens += sum(len(sc.token_ids) for sc in scores)
        return {row.index: scores for row, scores in zip(scored, out, strict=True)}

    def judge(
        self, rows: list[Row], steps: list[StepSample], ahead_scores: dict[int, list[StepScore]]
    ) -> list[Judgement]:
        """The target prefills each row's step on its cache (in place, all rows in one padded prefill; a
        row's next score from ``score_ahead``, in ``ahead_scores``, is taken as it is) and the probes give q
        and p (batched); ``rules.accept`` decides: ``u < min(1, p/q)`` (and ``p/q >= min_ratio`` when set),
        or with ``min_p`` ``p >= min_p``; with ``min_token_p``, a step so accepted is then rejected when the
        target gives one of its tokens a lower probability (one head pass over the accepted steps' positions).
        Returns each row's verdict."""
        s = self.settings
        restores = [r.target.checkpoint(scored_room(s, self.target)) for r in rows]
        qs = self._probe(rows, self.q_probe, [step.pooled for step in steps])
        scores: list[StepScore | None] = [
            ahead_scores[r.index].pop(0) if ahead_scores.get(r.index) else None for r in rows
        ]
        idx = [b for b, step in enumerate(steps) if step.text and scores[b] is None]
        if idx:
            scored = [rows[b] for b in idx]
            for b, sc in zip(idx, self._score_steps(scored, [steps[b].text for b in idx]), strict=True):
                scores[b] = sc
                rows[b].res.target_prefill_tokens += len(sc.token_ids)
        have = [b for b, sc in enumerate(scores) if sc is not None]
        ps = [0.0] * len(rows)
        if have:
            pooled = [scores[b].pooled for b in have]
            for b, p in zip(have, self._probe([rows[b] for b in have], self.p_probe, pooled), strict=True):
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
        self._read_tokens([rows[b] for b in checked], [scores[b] for b in checked])
        for b in checked:
            w = whys[b]
            w["tok"] = float(scores[b].token_p.min())
            verdict = rules.accept(w["p"], w["q"], w["u"], self.settings.rule, w["tok"])
            accepts[b], w["rejected_by"] = verdict.accepted, verdict.rejected_by

    def salvage(self, row: Row, score: StepScore | None, t_restore: Restore) -> tuple[StepStart, int]:
        """Where the target rewrites a rejected step, and how many of its tokens it keeps. With
        ``salvage`` (greedy only): after the longest prefix of the rejected step that the target would
        have written itself (its argmax at every position, from the verification prefill), which gives
        the target's own greedy step token for token. Otherwise (or when the cache cannot be cropped)
        from the target's state before the step. The rewrite samples with the seed after its
        proposal's."""
        budget, seed = row.step_budget(self.settings, self.target), row.next_seed() + 1
        if self.settings.salvages and score is not None:
            start, keep = self._resume(row, score, budget, seed)
            if start is not None:
                return start, keep
        return StepStart(t_restore(), budget, seed), 0

    # the model calls, and what their time is (``charged``)

    @charged("probe")
    def _probe(self, rows: list[Row], fn: ProbeFn, pooled: list[Pooled]) -> list[float]:
        """A probe on the rows' pooled states (batched where it can)."""
        return probe_all(fn, pooled)

    @charged("verify")
    def _score_runs(self, rows: list[Row], runs: list[list[str]]) -> list[list[StepScore]]:
        """The target reads each row's run of steps on its cache, in one padded prefill."""
        return self.target.score_runs([r.target for r in rows], runs)

    @charged("verify")
    def _score_steps(self, rows: list[Row], texts: list[str]) -> list[StepScore]:
        """The target reads each row's step on its cache, in one padded prefill."""
        return self.target.score_steps([r.target for r in rows], texts)

    @charged("verify")
    def _read_tokens(self, rows: list[Row], scores: list[StepScore]) -> None:
        """The target's probabilities of the scored steps' tokens (one head pass), into the scores."""
        self.target.read_tokens(scores)

    @charged("target")
    def _resume(self, row: Row, score: StepScore, budget: int, seed: int) -> tuple[StepStart | None, int]:
        """The target's start after the prefix of a rejected step it agrees with, and that prefix's length
        (None where the cache cannot be cropped there)."""
        keep = self.target.greedy_agreement(score)
        return self.target.resume_after(row.target, score, keep, budget, seed), keep
