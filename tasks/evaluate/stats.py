"""An evaluation's statistics: pass@1 with bootstrap intervals, paired differences to ``target`` and to
``draft``, the two speed-ups measured in the same run, how often an answer is the target's or the draft's,
the share of answers the budget cut, and the per-problem record they are computed from."""

from __future__ import annotations

import math
import statistics
import warnings
from collections import Counter
from typing import Any

import numpy as np
from scipy.stats import bootstrap

from semspec.models.spec.results import DecodeResult
from semspec.tasks.data import Problem


def bootstrap_pass(
    correct: list[bool],
    base: list[bool] | None = None,
    n_resamples: int = 2000,
    seed: int = 0,
    versus: str = "target",
) -> dict[str, Any]:
    """95% percentile-bootstrap interval of pass@1 over problems and, with ``base`` (the grades of the
    method ``versus`` on the same problems, in the same order), of the paired difference ``pass@1 - base
    pass@1`` (``delta_vs_<versus>``). Intervals need at least two problems (None otherwise)."""
    a = np.asarray(correct, dtype=float)
    out: dict[str, Any] = {"pass@1_ci95": None}
    delta = f"delta_vs_{versus}"
    if base is not None:
        b = np.asarray(base, dtype=float)
        if b.shape != a.shape:
            raise ValueError(f"paired bootstrap needs grades on the same problems: {a.shape} vs {b.shape}")
        out.update({delta: float(a.mean() - b.mean()) if len(a) else None, f"{delta}_ci95": None})
    if len(a) < 2:
        return out
    kw = {
        "n_resamples": n_resamples,
        "method": "percentile",
        "vectorized": True,
        "rng": np.random.default_rng(seed),
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # all-equal grades: a degenerate (zero-width) interval is the answer
        ci = bootstrap((a,), np.mean, **kw).confidence_interval
        out["pass@1_ci95"] = [float(ci.low), float(ci.high)]
        if base is not None:
            diff = bootstrap((a, b), lambda x, y, axis: np.mean(x - y, axis=axis), paired=True, **kw)
            out[f"{delta}_ci95"] = [
                float(diff.confidence_interval.low),
                float(diff.confidence_interval.high),
            ]
    return out


def summarize_rows(
    rows: list[dict[str, Any]],
    base_rows: list[dict[str, Any]] | None = None,
    draft_rows: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Metrics of one (benchmark, method) from its per-problem rows, against ``base_rows`` (the target's rows
    of the same run) where given. Speed-ups and the paired pass@1 difference use only the problems (question,
    seed) both have: ``speedup_latency`` = the target's mean time per problem / this method's (the paper's
    speed-up), ``speedup_per_token`` = the target's time per output token / this method's (fair when
    outputs differ in length). A problem's time is its ``cost_s``: its latency when decoded alone, its
    share of the batch's time when batched, so batched and one-at-a-time methods compare fairly;
    ``latency_s`` (join to last step) is reported beside it. With ``draft_rows`` (the draft's rows of the
    same run), the paired difference to the draft too. ``cut`` is the share of answers the budget ended;
    ``same_answer_as_target`` / ``_draft`` the share of shared problems whose extracted answer is that
    method's (two missing answers are not equal)."""

    by_seed: dict[int, list[bool]] = {}
    for r in rows:
        by_seed.setdefault(r["seed"], []).append(r["correct"])
    tokens = sum(r["output_tokens"] for r in rows)
    seconds = sum(_cost(r) for r in rows)
    acc = [r["acceptance_rate"] for r in rows if r["acceptance_rate"] is not None]
    out = {
        "pass@1": statistics.mean(statistics.mean(v) for v in by_seed.values()),
        "latency_s": statistics.mean(r["latency_s"] for r in rows),
        "cost_s": statistics.mean(_cost(r) for r in rows),
        "tps": tokens / seconds if seconds else 0.0,
        "target_share": statistics.mean(r["target_share"] for r in rows),
        "step_acceptance": statistics.mean(acc) if acc else None,
        "speedup_latency": None,
        "speedup_per_token": None,
        "ms_per_token": 1000 * seconds / tokens if tokens else None,
        "n": len(rows),
        "cut": statistics.mean(r.get("finish_reason") == "length" for r in rows),
        "budget_90": finish_budget(rows, 0.9),
        **rejections_by_reason(rows),
    }
    if rows is not draft_rows:  # (the draft against itself: nothing to learn)
        out.update(_versus(rows, draft_rows, "draft"))
    both = _paired(rows, base_rows or [])
    if not both:
        out.update(bootstrap_pass([r["correct"] for r in rows]))
        return out
    mine, theirs = [m for m, _ in both], [t for _, t in both]
    out.update(bootstrap_pass([r["correct"] for r in mine], [r["correct"] for r in theirs]))
    out["same_answer_as_target"] = _same_answers(both)
    out["speedup_latency"] = _ratio(sum(_cost(r) for r in theirs), sum(_cost(r) for r in mine))
    out["speedup_per_token"] = _ratio(_per_token(theirs), _per_token(mine))
    return out


def finish_budget(rows: list[dict[str, Any]], share: float = 0.9) -> int | None:
    """The least ``max_new_tokens`` at which ``share`` of these answers end by themselves (EOS), from one
    run at a larger budget: greedy decoding writes the same tokens under any budget it does not reach, so
    an answer of k tokens that ended finishes under every budget >= k. None when fewer than ``share`` of
    them ended within this run's budget (run it again with a larger one)."""
    if not 0 < share <= 1:
        raise ValueError(f"share must be in (0, 1], got {share}")
    ended = sorted(r["output_tokens"] for r in rows if r.get("finish_reason") == "eos")
    need = math.ceil(share * len(rows))
    return ended[need - 1] if rows and len(ended) >= need else None


def _paired(rows: list[dict[str, Any]], other: list[dict[str, Any]]) -> list[tuple[dict, dict]]:
    """(row, other's row) for each (question, seed) both have, in ``rows``' order."""
    theirs = {(r["question_id"], r["seed"]): r for r in other}
    return [(r, theirs[k]) for r in rows if (k := (r["question_id"], r["seed"])) in theirs]


def _same_answers(pairs: list[tuple[dict, dict]]) -> float | None:
    """Share of paired problems whose two extracted answers are equal and not missing."""
    if not pairs:
        return None
    return statistics.mean(
        a.get("answer") is not None and a.get("answer") == b.get("answer") for a, b in pairs
    )


def _versus(rows: list[dict[str, Any]], other: list[dict[str, Any]] | None, name: str) -> dict[str, Any]:
    """The paired difference of pass@1 to method ``name`` (its rows ``other``) and how often the answers
    are its answers: ``delta_vs_<name>``, its interval and ``same_answer_as_<name>``; nothing without
    shared problems."""
    pairs = _paired(rows, other or [])
    if not pairs:
        return {}
    grades = bootstrap_pass([a["correct"] for a, _ in pairs], [b["correct"] for _, b in pairs], versus=name)
    return {
        **{k: v for k, v in grades.items() if k.startswith("delta")},
        f"same_answer_as_{name}": _same_answers(pairs),
    }


def overall_metrics(
    rows: dict[tuple[str, str], list[dict[str, Any]]], labels: list[str], benches: list[str]
) -> dict[str, Any]:
    """Every benchmark together, per method: each problem counts once (pass@1 weighted by problems), and
    the speed-ups compare with the target on the same problems."""

    def pooled(label: str) -> list[dict[str, Any]]:
        return [
            {**r, "question_id": f"{bench}/{r['question_id']}"}
            for bench in benches
            for r in rows.get((bench, label), [])
        ]

    every = {label: pooled(label) for label in labels}
    base, draft = every.get("target"), every.get("draft")
    return {label: summarize_rows(mine, base, draft) for label, mine in every.items() if mine}


def rejections_by_reason(rows: list[dict[str, Any]]) -> dict[str, int]:
    """Steps the target wrote, counted by what rejected the draft's (``rejected_<reason>``, each reason of
    ``rules.REJECTED_BY`` that occurs in the rows' traces)."""
    counts = Counter(s["rejected_by"] for r in rows for s in r.get("steps", []) if s.get("rejected_by"))
    return {f"rejected_{reason}": n for reason, n in sorted(counts.items())}


def _cost(r: dict[str, Any]) -> float:
    """A problem's machine time (rows written before costs were recorded: their latency)."""
    return r.get("cost_s", r["latency_s"])


def _per_token(rows: list[dict[str, Any]]) -> float | None:
    tokens = sum(r["output_tokens"] for r in rows)
    return sum(_cost(r) for r in rows) / tokens if tokens else None


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num and den else None


def problem_row(
    prob: Problem, seed: int, label: str, res: DecodeResult, pred: str | None, ok: bool
) -> dict[str, Any]:
    """One per-problem record: the answer, its grade, speed figures and the step trace."""
    return {
        "question_id": prob.question_id,
        "seed": seed,
        "method": label,
        "answer": pred,
        "gold": prob.answer,
        "correct": ok,
        "output_tokens": res.output_tokens,
        "latency_s": res.timings.total,
        "cost_s": res.timings.share or res.timings.total,
        "tps": res.tokens_per_second,
        "target_share": res.target_share,
        "acceptance_rate": res.acceptance_rate,
        "prefill_per_output_token": res.prefill_per_output_token,
        "timings": vars(res.timings),
        "finish_reason": res.finish_reason,
        "text": res.text,
        "steps": [
            {
                "author": s.author,
                "p": s.p,
                "q": s.q,
                "u": s.u,
                "target_tokens": s.target_tokens,
                **({} if s.tok is None else {"tok": s.tok}),  # the token check's least probability
                **({} if s.rejected_by is None else {"rejected_by": s.rejected_by}),
            }
            for s in res.steps
        ],
        "extra": res.extra,
    }
