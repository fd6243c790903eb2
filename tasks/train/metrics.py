"""The train stage's metrics: a probe's test metrics against the semantic probability, and the routing
metrics of a probe pair (does it accept the right draft steps?) with the ``min_ratio`` and ``min_p`` floors
chosen on the validation questions."""

from __future__ import annotations

import numpy as np
from scipy.stats import spearmanr
from sklearn.metrics import roc_auc_score
from torch import nn

from semspec.tasks.train.data import RoutingData
from semspec.tasks.train.fit import predict

ECE_BINS = 10


def probe_metrics(pred: np.ndarray, y: np.ndarray, in_largest: np.ndarray) -> dict[str, float]:
    """MSE, MAE, Spearman, Brier and AUROC for 'in the largest cluster', ECE of predicted vs observed
    semantic probability (10 equal-width bins)."""
    bins = np.minimum((pred * ECE_BINS).astype(int), ECE_BINS - 1)
    ece = sum(abs(pred[bins == b].mean() - y[bins == b].mean()) * (bins == b).mean() for b in np.unique(bins))
    rho = spearmanr(pred, y).statistic if np.std(pred) > 0 and np.std(y) > 0 else float("nan")
    auroc = roc_auc_score(in_largest, pred) if 0 < in_largest.mean() < 1 else float("nan")
    return {
        "mse": float(np.mean((pred - y) ** 2)),
        "mae": float(np.mean(np.abs(pred - y))),
        "spearman": float(rho),
        "brier": float(np.mean((pred - in_largest.astype(np.float32)) ** 2)),
        "ece": float(ece),
        "auroc": float(auroc),
        "n": len(y),
    }


def routing_metrics(
    p: np.ndarray, q: np.ndarray, shared: np.ndarray, min_ratio: float = 0.0
) -> dict[str, float]:
    """Does a probe pair accept the right draft steps? With the decoder's rule a(s) = min(1, p/q), 0 where
    p/q falls below ``min_ratio`` (``evaluate.decode.min_ratio``; 0: the paper's rule): the true-accept rate (mean
    a over steps the target shares), the false-accept rate (mean a over steps it does not), the AUROC of
    p/q for shared vs not shared and, beside it, of p alone (whether dividing by the draft's q helps; NaN
    where a side is empty)."""
    p, q, shared = np.asarray(p, dtype=float), np.asarray(q, dtype=float), np.asarray(shared, dtype=bool)
    ratio = p / np.maximum(q, 1e-9)  # q = 0 only for a step its own model never says: accept
    accept = np.minimum(1.0, ratio) * (ratio >= min_ratio)
    both = 0 < shared.mean() < 1 if len(shared) else False
    return {
        "true_accept": float(accept[shared].mean()) if shared.any() else float("nan"),
        "false_accept": float(accept[~shared].mean()) if (~shared).any() else float("nan"),
        "accept_rate": float(accept.mean()) if len(accept) else float("nan"),  # what gamma: auto reads
        "auroc": float(roc_auc_score(shared, ratio)) if both else float("nan"),
        "auroc_p": float(roc_auc_score(shared, p)) if both else float("nan"),
        "n_shared": int(shared.sum()),
        "n_not_shared": int((~shared).sum()),
    }


def choose_min_ratio(p: np.ndarray, q: np.ndarray, shared: np.ndarray) -> float | None:
    """The ``min_ratio`` that best separates these (validation) draft steps under the rule of
    ``routing_metrics``: the floor on p/q with the largest true-accept minus false-accept rate, the
    smallest such (0, the paper's rule, when no floor does better). None where the steps lack a side."""
    shared = np.asarray(shared, dtype=bool)
    if not 0 < shared.mean() < 1:
        return None
    ratio = np.asarray(p, dtype=float) / np.maximum(np.asarray(q, dtype=float), 1e-9)
    accept = np.minimum(1.0, ratio)
    floors = np.unique(np.concatenate([[0.0], ratio]))  # ascending: ties keep the smallest
    gaps = [
        accept[shared & (ratio >= t)].sum() / shared.sum()
        - accept[~shared & (ratio >= t)].sum() / (~shared).sum()
        for t in floors
    ]
    return float(floors[int(np.argmax(gaps))])


def choose_min_p(p: np.ndarray, shared: np.ndarray) -> float | None:
    """The ``min_p`` of the target's rule (accept a step iff p >= min_p) that best separates these
    (validation) draft steps: the largest true-accept minus false-accept rate, the smallest such floor.
    None where the steps lack a side."""
    p, shared = np.asarray(p, dtype=float), np.asarray(shared, dtype=bool)
    if not 0 < shared.mean() < 1:
        return None
    floors = np.unique(p)  # ascending: ties keep the smallest
    gaps = [(p[shared] >= t).mean() - (p[~shared] >= t).mean() for t in floors]
    return float(floors[int(np.argmax(gaps))])


def p_rule_rates(p: np.ndarray, shared: np.ndarray, min_p: float) -> dict[str, float]:
    """True- and false-accept rates of the target's rule (accept iff p >= ``min_p``) on these steps."""
    p, shared = np.asarray(p, dtype=float), np.asarray(shared, dtype=bool)
    accept = p >= min_p
    return {
        "true_accept_at_min_p": float(accept[shared].mean()) if shared.any() else float("nan"),
        "false_accept_at_min_p": float(accept[~shared].mean()) if (~shared).any() else float("nan"),
    }


def routing_table(
    data: RoutingData,
    probes: dict[str, dict[str, nn.Module]],
    test_questions: set[str],
    val_questions: set[str] = frozenset(),
) -> dict[str, dict[str, float]]:
    """Routing metrics on the test questions' draft-written steps for every variant with both probes
    (``probes``: variant -> role -> probe), and for the oracle (the true shares in place of p and q). With
    ``val_questions``, each variant also gets the ``min_ratio`` chosen on their draft steps
    (``choose_min_ratio``) and the test rates under it (``*_at_min_ratio``), so a stricter rule is judged
    on steps it was not chosen on, and likewise the ``min_p`` of the target's rule (``choose_min_p``,
    ``*_at_min_p``)."""
    te = np.isin(data.question_id, sorted(test_questions))
    va = np.isin(data.question_id, sorted(val_questions))
    shared = data.share_target > 0
    out = {}
    for variant, pair in probes.items():
        if set(pair) == {"draft", "target"}:
            p = predict(pair["target"], data.p_x[variant][te | va])
            q = predict(pair["draft"], data.q_x[variant][te | va])
            on_te, on_va = te[te | va], va[te | va]
            out[variant] = routing_metrics(p[on_te], q[on_te], shared[te])
            floor = choose_min_ratio(p[on_va], q[on_va], shared[va])
            if floor is not None:
                strict = routing_metrics(p[on_te], q[on_te], shared[te], floor)
                out[variant] |= {
                    "min_ratio": floor,
                    "true_accept_at_min_ratio": strict["true_accept"],
                    "false_accept_at_min_ratio": strict["false_accept"],
                }
            min_p = choose_min_p(p[on_va], shared[va])
            if min_p is not None:
                out[variant] |= {"min_p": min_p, **p_rule_rates(p[on_te], shared[te], min_p)}
    out["oracle"] = routing_metrics(data.share_target[te], data.share_draft[te], shared[te])
    return out


def auroc_gap(
    label: np.ndarray, a: np.ndarray, b: np.ndarray, groups: np.ndarray, n_boot: int = 1000, seed: int = 0
) -> dict[str, float]:
    """AUROC of scores ``a`` minus AUROC of scores ``b`` for the same binary ``label`` (N,), with a 95%
    percentile interval from resampling whole ``groups`` (the questions: samples of one question are not
    independent, so resampling samples would make the interval too narrow). A resample with one class
    only is drawn again."""
    label, a, b = np.asarray(label, dtype=bool), np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if not len(label) == len(a) == len(b) == len(groups):
        raise ValueError(
            f"auroc_gap needs one label, score and group per sample: {len(label)}, {len(a)}, {len(b)}, {len(groups)}"
        )
    if not 0 < label.mean() < 1:
        raise ValueError("auroc_gap needs samples of both classes")
    names, idx = np.unique(np.asarray(groups), return_inverse=True)
    members = [np.flatnonzero(idx == g) for g in range(len(names))]
    rng, gaps = np.random.default_rng(seed), []
    while len(gaps) < n_boot:
        rows = np.concatenate([members[g] for g in rng.integers(0, len(names), len(names))])
        if 0 < label[rows].mean() < 1:
            gaps.append(roc_auc_score(label[rows], a[rows]) - roc_auc_score(label[rows], b[rows]))
    lo, hi = np.percentile(gaps, [2.5, 97.5])
    gap = roc_auc_score(label, a) - roc_auc_score(label, b)
    return {"gap": float(gap), "lo": float(lo), "hi": float(hi), "groups": len(names)}
