"""Stage ``train``: fit one probe per (role, feature variant) with Lightning, track it in MLflow,
register it as ``semspec-<pair>-<role>-<variant>`` with alias ``champion``. With ``train.domains`` a list,
one probe per (role, variant, domain) on that domain's questions, named ``...-<variant>-<domain>``.

Train/validation/test splits are made **by question**: no prefix of a test question is trained on.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import random
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import lightning as L
import mlflow
import numpy as np
import pyarrow.parquet as pq
import torch
from scipy.stats import spearmanr
from sklearn.metrics import roc_auc_score
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from semspec.models.lm.pair import PairConfig
from semspec.models.project.pairs import project_root
from semspec.models.spec.names import ALL_DOMAINS, FEATURE_COLUMNS, ROLES, probe_key, split_probe_key
from semspec.models.spec.probe import ProbeMLP, RandomProbe, save_probe
from semspec.tasks.config import Params, TrainConfig
from semspec.tasks.fingerprint import pipeline_fingerprint
from semspec.tasks.io import (
    close_figure,
    column_matrix,
    data_hash,
    git_commit,
    read_shards,
    save_figure_atomic,
    write_json_atomic,
)
from semspec.tasks.probe_registry import (
    ACCEPT_RATE_TAG,
    MIN_P_TAG,
    MIN_RATIO_TAG,
    POINTERS_FILE,
    TRACKING_ERRORS,
    ProbeRef,
    check_tracking,
    register_probe,
    setup_experiment,
)

log = logging.getLogger(__name__)

ECE_BINS = 10
MIN_TRAIN_ROWS = 2  # fewer cannot be standardised or early-stopped meaningfully


@dataclass
class ProbeData:
    """Features and labels of one role, aligned row by row."""

    x: dict[str, np.ndarray]  # variant -> (N, D) or (N, L+1, D)
    y: np.ndarray  # (N,) semantic probability
    in_largest: np.ndarray  # (N,) bool: sample is in its prefix's largest cluster
    question_id: np.ndarray  # (N,)
    domain: np.ndarray  # (N,) the question's domain ('unknown' for labels made before domains were kept)
    model_id: str
    hidden_size: int
    num_layers: int  # L+1 hidden-state layers
    format: str = "bfloat16"  # the format the model ran in when sampling (shards without it predate formats)
    author: np.ndarray | None = None  # (N,) which model wrote each step (``examples: both`` mixes them)


@dataclass
class _Features:
    """One role's feature rows from shard folders, by (prefix_id, author, sample_idx)."""

    index: dict[tuple[str, str, int], int]
    question_id: np.ndarray  # (N,)
    columns: dict[str, np.ndarray]  # feature column -> (N, D) or (N, (L+1) * D)
    model_id: str
    format: str
    hidden_size: int


def _read_features(folders: list[Path], variants: list[str]) -> _Features:
    """The feature rows of one role's shard folders (its own samples and, for ``both``, its reading of the
    other model's steps); shards without an ``author`` column are the role's own samples."""
    feats = list(dict.fromkeys(["h_mean", *(FEATURE_COLUMNS[v] for v in variants if v != "random")]))
    keys, qids, mats, model_ids, formats = [], [], {f: [] for f in feats}, set(), set()
    for folder in folders:
        cols = ["prefix_id", "sample_idx", "question_id", "model_id", "role", *feats]
        t = read_shards(folder, columns=cols, optional=["format", "author"])
        authors = t.column("author" if "author" in t.column_names else "role").to_pylist()
        keys += zip(
            t.column("prefix_id").to_pylist(), authors, t.column("sample_idx").to_pylist(), strict=True
        )
        qids += t.column("question_id").to_pylist()
        for f in feats:
            mats[f].append(column_matrix(t, f))
        model_ids.update(t.column("model_id").to_pylist())
        formats.add(_one_format(t, folder))
    if len(model_ids) != 1 or len(formats) != 1:
        raise ValueError(
            f"{', '.join(map(str, folders))} hold features of {sorted(model_ids)} in {sorted(formats)}: one "
            f"model in one format is needed; rerun the sample and cross stages"
        )
    return _Features(
        {k: i for i, k in enumerate(keys)},
        np.array(qids),
        {f: np.concatenate(m) for f, m in mats.items()},
        model_ids.pop(),
        formats.pop(),
        int(mats["h_mean"][0].shape[1]),
    )


def _probe_data(
    feats: _Features, keys: list[tuple], y, in_largest, domain, variants, where: str
) -> ProbeData:
    """The rows of ``feats`` at ``keys`` (one per label), as a ProbeData."""
    try:
        rows = np.array([feats.index[k] for k in keys], dtype=int)
    except KeyError as e:
        raise ValueError(
            f"label {e} has no features in {where}: samples and labels are out of date"
        ) from None
    d, x = feats.hidden_size, {}
    for v in variants:
        m = feats.columns[FEATURE_COLUMNS.get(v, "h_mean")][rows]
        x[v] = m.reshape(len(rows), -1, d) if v == "mix" else m
    return ProbeData(
        x=x,
        y=np.asarray(y, dtype=np.float32),
        in_largest=np.asarray(in_largest, dtype=bool),
        question_id=feats.question_id[rows],
        domain=np.asarray(domain),
        model_id=feats.model_id,
        hidden_size=d,
        num_layers=x["mix"].shape[1] if "mix" in x else 0,
        format=feats.format,
        author=np.array([k[1] for k in keys]),
    )


def load_probe_data(samples_dir: Path, labels_path: Path, variants: list[str]) -> ProbeData:
    """Join a role's samples (features) with its labels on (prefix_id, sample_idx): ``examples: own``."""
    labels = pq.read_table(labels_path).to_pylist()
    if not labels:
        raise ValueError(f"{labels_path} has no labelled samples (all invalid?)")
    feats = _read_features([samples_dir], variants)
    keys = [(r["prefix_id"], r["role"], r["sample_idx"]) for r in labels]
    domain = [r.get("domain") or "unknown" for r in labels]
    y, largest = [r["semantic_prob"] for r in labels], [r["in_largest"] for r in labels]
    return _probe_data(feats, keys, y, largest, domain, variants, str(samples_dir))


def load_joint_probe_data(
    role: str, samples_dir: Path, cross_dir: Path, joint_path: Path, variants: list[str]
) -> ProbeData:
    """``examples: both``: ``role``'s hidden states over both models' steps (its samples, and the cross
    stage's reading of the other's), each labelled with ``role``'s share of the step's joint cluster
    (steps of prefixes where ``role`` has no valid sample carry no label and are left out)."""
    if not joint_path.is_file():
        raise ValueError(f"{joint_path} does not exist: run the cluster stage with both roles sampled")
    if not (cross_dir / role).is_dir():
        raise ValueError(f"{cross_dir / role} does not exist: run the cross stage (`semspec cross`) first")
    labels = [r for r in pq.read_table(joint_path).to_pylist() if r[f"share_{role}"] is not None]
    if not labels:
        raise ValueError(f"{joint_path} has no step labelled for the {role} (no valid {role} sample?)")
    feats = _read_features([samples_dir / role, cross_dir / role], variants)
    keys = [(r["prefix_id"], r["author"], r["sample_idx"]) for r in labels]
    domain = [r.get("domain") or "unknown" for r in labels]
    y, largest = [r[f"share_{role}"] for r in labels], [r[f"largest_{role}"] for r in labels]
    return _probe_data(
        feats, keys, y, largest, domain, variants, f"{samples_dir / role} + {cross_dir / role}"
    )


def _one_format(samples, samples_dir: Path) -> str:
    """The one format a role's samples were made in; mixed shards (a resumed run on another machine) are
    an error: their features would not be alike."""
    if "format" not in samples.column_names:
        return "bfloat16"
    found = sorted(set(samples.column("format").to_pylist()))
    if len(found) != 1:
        raise ValueError(
            f"{samples_dir} mixes samples made in formats {found}: remove the folder and sample again"
        )
    return found[0]


def only_domain(data: ProbeData, domain: str, labels_path: Path) -> ProbeData:
    """The rows of ``data`` whose question is in ``domain`` (``all``: every row); a clear error naming the
    domains present when there is none."""
    if domain == ALL_DOMAINS:
        return data
    keep = data.domain == domain
    if not keep.any():
        present = sorted(set(data.domain.tolist()))
        hint = (
            " (labels made before domains were kept: rerun the cluster stage)"
            if present == ["unknown"]
            else ""
        )
        raise ValueError(
            f"train: no labelled sample of domain {domain!r} in {labels_path}; domains present: "
            f"{present}{hint}. Set train.domains to some of them, or to 'all'"
        )
    return replace(
        data,
        x={v: m[keep] for v, m in data.x.items()},
        y=data.y[keep],
        in_largest=data.in_largest[keep],
        question_id=data.question_id[keep],
        domain=data.domain[keep],
        author=None if data.author is None else data.author[keep],
    )


def split_by_question(
    question_ids: np.ndarray, val_fraction: float, test_fraction: float, seed: int
) -> dict[str, np.ndarray]:
    """Boolean masks train/val/test over rows, with every question in exactly one split."""
    qs = sorted(set(question_ids.tolist()))
    if len(qs) < 3:
        raise ValueError(f"need at least 3 distinct questions to split by question, got {len(qs)}")
    random.Random(seed).shuffle(qs)
    n_test = max(1, round(test_fraction * len(qs)))
    n_val = max(1, round(val_fraction * len(qs)))
    parts = {
        "test": set(qs[:n_test]),
        "val": set(qs[n_test : n_test + n_val]),
        "train": set(qs[n_test + n_val :]),
    }
    return {k: np.isin(question_ids, list(v)) for k, v in parts.items()}


def keep_questions(question_ids: np.ndarray, fraction: float, seed: int) -> np.ndarray:
    """Rows whose question falls in a seeded ``fraction`` of the questions (by a hash of seed and id, so
    both roles keep the same questions and a smaller fraction keeps a subset of a larger one's)."""

    def draw(q: str) -> float:
        return int(hashlib.sha1(f"{seed}:{q}".encode()).hexdigest()[:12], 16) / 16**12

    return np.array([draw(q) < fraction for q in question_ids.tolist()], dtype=bool)


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
    p/q falls below ``min_ratio`` (``evaluate.min_ratio``; 0: the paper's rule): the true-accept rate (mean
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


# the routing metrics logged on each probe run, beside its MSE
ROUTING_LOGGED = (
    "true_accept", "false_accept", "accept_rate", "auroc", "auroc_p", "min_ratio", "true_accept_at_min_ratio",
    "false_accept_at_min_ratio", "min_p", "true_accept_at_min_p", "false_accept_at_min_p",
)  # fmt: skip


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


@dataclass
class RoutingData:
    """The draft-written steps (labelled jointly): the draft's features over them, the target's (the cross
    stage), and both models' true shares."""

    q_x: dict[str, np.ndarray]  # variant -> the draft's features
    p_x: dict[str, np.ndarray]  # variant -> the target's features over the same steps
    share_draft: np.ndarray  # (N,)
    share_target: np.ndarray  # (N,)
    question_id: np.ndarray  # (N,)


def load_routing_data(
    samples_dir: Path, cross_dir: Path, joint_path: Path, variants: list[str]
) -> RoutingData | None:
    """``RoutingData`` from the stages' outputs; None without joint labels or the target's cross features
    (a pipeline that sampled one role only)."""
    if not joint_path.is_file() or not (cross_dir / "target").is_dir():
        return None
    labels = [
        r
        for r in pq.read_table(joint_path).to_pylist()
        if r["author"] == "draft" and r["share_target"] is not None and r["share_draft"] is not None
    ]
    if not labels:
        return None
    keys = [(r["prefix_id"], "draft", r["sample_idx"]) for r in labels]
    none = np.zeros(len(labels))
    q = _probe_data(
        _read_features([samples_dir / "draft"], variants), keys, none, none, none, variants, "draft"
    )
    p = _probe_data(
        _read_features([cross_dir / "target"], variants), keys, none, none, none, variants, "cross"
    )
    return RoutingData(
        q.x,
        p.x,
        np.array([r["share_draft"] for r in labels]),
        np.array([r["share_target"] for r in labels]),
        q.question_id,
    )


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


def calibration_figure(pred: np.ndarray, y: np.ndarray, title: str):
    """Reliability diagram: mean observed semantic probability per predicted-probability bin."""
    import matplotlib  # imported here: the headless backend must be chosen before pyplot loads

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bins = np.minimum((pred * ECE_BINS).astype(int), ECE_BINS - 1)
    fig, ax = plt.subplots(figsize=(4.5, 4.5))
    ax.plot([0, 1], [0, 1], "--", color="grey", label="perfect")
    xs = [pred[bins == b].mean() for b in np.unique(bins)]
    ys = [y[bins == b].mean() for b in np.unique(bins)]
    counts = [(bins == b).sum() for b in np.unique(bins)]
    ax.scatter(xs, ys, s=[10 + 3 * c for c in counts], label="bins (size ~ count)")
    ax.plot(xs, ys)
    ax.set(
        xlabel="predicted semantic probability",
        ylabel="observed semantic probability",
        xlim=(0, 1),
        ylim=(0, 1),
        title=title,
    )
    ax.legend(loc="upper left")
    fig.tight_layout()
    return fig


class _MlflowEpochs(L.Callback):
    """Per-epoch train/val MSE into the active MLflow run."""

    def on_train_epoch_end(self, trainer, pl_module):  # runs after this epoch's validation
        m = {k: float(v) for k, v in trainer.callback_metrics.items() if k in ("train_mse", "val_mse")}
        if m:
            mlflow.log_metrics(m, step=trainer.current_epoch)


def fit_probe(
    data: ProbeData,
    variant: str,
    role: str,
    masks: dict[str, np.ndarray],
    cfg: TrainConfig,
    log_epochs: bool = False,
) -> nn.Module:
    """Train one probe (or build the Random one) on the train split, early-stopped on validation MSE; with
    ``train.search`` each candidate shape is fitted and the one with the lowest validation MSE returned
    (its choice in ``probe.choice``)."""
    if variant == "random":
        # each role gets its own stream: equal seeds would make p == q and accept every step
        return RandomProbe(data.hidden_size, "all", seed=2 * cfg.seed + (role == "target"))
    tr, va = masks["train"], masks["val"]
    n_train = int(tr.sum())
    if n_train < MIN_TRAIN_ROWS:
        raise ValueError(
            f"{role} probe: only {n_train} labelled training samples after the split by question "
            f"(need {MIN_TRAIN_ROWS}): sample more questions (ingest.max_questions) or more samples per "
            "prefix (sample.n), or keep budget-cut steps (cluster.label_length_cut: true)"
        )
    tried, candidates = [], cfg.candidates(role)
    for hidden, weight_decay in candidates:
        # per-epoch MSE goes to MLflow for a single fit only (a search's fits would share the steps)
        probe, epochs = _fit_one(
            data, variant, masks, cfg, hidden, weight_decay, log_epochs and len(candidates) == 1
        )
        val = float(np.mean((predict(probe, data.x[variant][va]) - data.y[va]) ** 2)) if va.any() else 0.0
        tried.append(
            {"hidden": hidden, "weight_decay": weight_decay, "val_mse": val, "epochs": epochs, "probe": probe}
        )
    best = min(tried, key=lambda t: t["val_mse"])
    probe = best.pop("probe")
    probe.choice = {**best, "candidates": [{k: v for k, v in t.items() if k != "probe"} for t in tried]}
    if len(tried) > 1:
        log.info(
            "train[%s/%s]: chose hidden %s, weight decay %g (validation MSE %.4f of %s)",
            role,
            variant,
            best["hidden"],
            best["weight_decay"],
            best["val_mse"],
            [round(t["val_mse"], 4) for t in tried],
        )
    return probe


def _fit_one(data, variant, masks, cfg, hidden, weight_decay, log_epochs) -> tuple[ProbeMLP, int]:
    """One probe of the given shape, early-stopped on validation MSE: (its best weights, epochs to them)."""
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    x = torch.from_numpy(data.x[variant]).float()
    y = torch.from_numpy(data.y)
    probe = ProbeMLP(
        data.hidden_size, hidden, variant, data.num_layers or None, cfg.lr, tuple(cfg.betas), weight_decay
    )
    tr, va = torch.from_numpy(masks["train"]), torch.from_numpy(masks["val"])
    probe.set_standardization(x[tr])
    train_dl = DataLoader(TensorDataset(x[tr], y[tr]), batch_size=cfg.batch_size, shuffle=True)
    val_dl = DataLoader(TensorDataset(x[va], y[va]), batch_size=1024)
    state, epochs = _fit_best_state(probe, train_dl, val_dl, cfg, log_epochs)
    best = ProbeMLP(**probe.hparams)  # a clean module (no trainer attached) with the best weights
    best.load_state_dict(state)
    bad = [k for k, t in best.state_dict().items() if not torch.isfinite(t).all()]
    if bad:
        raise RuntimeError(f"{variant} probe diverged (non-finite {', '.join(bad)}): lower train.lr")
    return best.eval(), epochs


@contextlib.contextmanager
def quiet_lightning() -> Iterator[None]:
    """Lightning announces the accelerators ("GPU available: False") and a cloud-logging tip at every
    Trainer, through its own handler and the root one (so twice: its import sets its logger to INFO over
    any earlier setting), and warns about its own use of a deprecated torch pytree API; per probe that is
    only noise in the stage log. Within this block its loggers keep warnings and errors only (both
    namespaces: with the standalone ``pytorch_lightning`` package imported, Lightning logs under it)."""
    loggers = [logging.getLogger(name) for name in ("lightning.pytorch", "pytorch_lightning")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*LeafSpec.* is deprecated")
            yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def _fit_best_state(
    probe: ProbeMLP, train_dl: DataLoader, val_dl: DataLoader, cfg: TrainConfig, log_epochs: bool
) -> tuple[dict[str, torch.Tensor], int]:
    """Lightning fit with early stopping on validation MSE; the weights of the best validation epoch and
    the number of epochs to it."""
    with quiet_lightning():
        return _fit_quietly(probe, train_dl, val_dl, cfg, log_epochs)


def _fit_quietly(
    probe: ProbeMLP, train_dl: DataLoader, val_dl: DataLoader, cfg: TrainConfig, log_epochs: bool
) -> tuple[dict[str, torch.Tensor], int]:
    ckpt_dir = tempfile.mkdtemp(prefix="semspec-probe-")
    ckpt = L.pytorch.callbacks.ModelCheckpoint(
        monitor="val_mse",
        mode="min",
        save_top_k=1,
        save_weights_only=True,
        dirpath=ckpt_dir,
        filename="best-{epoch}",
        enable_version_counter=False,
    )
    callbacks = [L.pytorch.callbacks.EarlyStopping("val_mse", patience=cfg.patience, mode="min"), ckpt]
    if log_epochs:
        callbacks.append(_MlflowEpochs())
    trainer = L.Trainer(
        max_epochs=cfg.max_epochs,
        accelerator="auto",
        devices=1,
        logger=False,
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
        default_root_dir=str(project_root() / ".cache" / "lightning"),
    )
    trainer.fit(probe, train_dl, val_dl)
    state, epochs = probe.state_dict(), trainer.current_epoch
    if ckpt.best_model_path:
        state = torch.load(ckpt.best_model_path, map_location="cpu", weights_only=True)["state_dict"]
        epochs = int(Path(ckpt.best_model_path).stem.split("epoch=")[-1]) + 1
    shutil.rmtree(ckpt_dir, ignore_errors=True)
    return state, epochs


@torch.inference_mode()
def predict(probe: nn.Module, x: np.ndarray) -> np.ndarray:
    """Probe outputs for rows ``x``."""
    return probe(torch.from_numpy(x).float()).numpy()


@dataclass
class _TrainRun:
    """What every probe of one train stage run shares."""

    cfg: TrainConfig
    pair: PairConfig
    plots_dir: Path
    commit: str
    fingerprint: dict[str, str]


def run_train(
    cfg: TrainConfig,
    pair: PairConfig,
    samples_dir: Path,
    labels_dir: Path,
    out_dir: Path,
    metrics_path: Path,
    plots_dir: Path,
    roles: list[str] | None = None,
    fingerprint: dict[str, str] | None = None,
    cross_dir: Path | None = None,
) -> dict[str, Any]:
    """Train, evaluate on the held-out questions, log to MLflow and register every probe.

    ``train.examples: both`` trains each probe on its model's features over both models' steps
    (``cross_dir``, the cross stage's output) with the joint labels (``labels_dir/joint.parquet``). With
    both available, the routing metrics of each variant (``routing_table``) are measured on the test
    questions' draft-written steps, logged beside the MSE and written under ``_routing``.

    The probes are stored once, as MLflow run artifacts (safetensors + JSON) that the registry's versions
    point at; ``out_dir/probes.json`` (the DVC out) records each one's name, version, URI and sha256, so
    ``dvc repro`` and the registry name the same probes. ``fingerprint``
    (``semspec.tasks.fingerprint.pipeline_fingerprint``) tags every run and version, so a scheduled retrain
    can tell which pairs changed. Writes the test metrics to ``metrics_path`` and calibration plots to
    ``plots_dir``; returns the metrics ``{role: {variant: {...}}}``.
    """
    roles = roles or sorted(p.stem for p in labels_dir.glob("*.parquet") if p.stem in ROLES)
    if not roles:
        raise ValueError(f"no labels in {labels_dir}: run the cluster stage first")
    setup_experiment(pair.name)
    run = _TrainRun(cfg, pair, plots_dir, git_commit(), fingerprint or {})
    done: _Outcome | None = None
    parent_tags = {"stage": TRAIN_PARENT, "pair": pair.name, "git_commit": run.commit, **run.fingerprint}
    try:
        with mlflow.start_run(run_name=f"train-{pair.name}", tags=parent_tags):  # the probes nest under it
            done = _train_roles(run, roles, samples_dir, labels_dir, out_dir, cross_dir)
            routing = _routing(done.trained, samples_dir, cross_dir, labels_dir, cfg.variants)
            if routing:
                done.metrics["_routing"] = routing
                if not done.kept:
                    _log_routing(routing, done.trained)
                    _tag_floors(routing, done.pointers)
            if not done.kept:
                fig = variant_figure(done.metrics, pair.name)
                save_figure_atomic(fig, plots_dir / "probe-variants.png")
                mlflow.log_figure(fig, "probe-variants.png")  # once, on the parent run
                close_figure(fig)
    except TRACKING_ERRORS as e:
        if done is None or not done.kept:
            raise
        log.warning("train: MLflow unreachable while closing the run: %s", e)
    if done.kept:
        write_json_atomic(
            {
                "pair": pair.name,
                "params": asdict(cfg),
                "roles": roles,
                "registered": done.pointers,
                "pending": [asdict(k) for k in done.kept],
                "metrics": done.metrics,
                "metrics_path": str(metrics_path),
                "plots_dir": str(plots_dir),
            },
            out_dir / PENDING_FILE,
        )
        raise ValueError(
            f"train: MLflow became unreachable; {len(done.kept)} trained probe(s) are kept in "
            f"{out_dir / PENDING_DIR} ({len(done.pointers)} were registered before). Once MLflow is back, "
            f"register them without retraining: semspec register --pair {pair.name} --probes {out_dir}"
        )
    pointers = {"params": asdict(cfg), "roles": roles, "probes": done.pointers}
    _finish(done.metrics, metrics_path, pointers, out_dir)
    return done.metrics


PENDING_FILE = "pending.json"  # in the train out folder: probes trained but not registered yet
PENDING_DIR = "pending"  # their weights, one folder per probe


def _finish(metrics: dict[str, Any], metrics_path: Path, pointers: dict[str, Any], out_dir: Path) -> None:
    """Write the test metrics and the registered probes' pointers (the train stage's outputs)."""
    write_json_atomic(metrics, metrics_path)
    write_json_atomic(pointers, out_dir / POINTERS_FILE)


TRAIN_PARENT = "train-summary"  # the stage tag of the run that groups one train stage's probe runs


@dataclass
class _Outcome:
    """What a train run's probes came to: the test metrics ``{role: {key: ...}}``, the registered probes'
    pointers, the probes kept locally because MLflow was unreachable, and every probe by (role, key)."""

    metrics: dict[str, Any] = field(default_factory=dict)
    pointers: dict[str, dict[str, Any]] = field(default_factory=dict)
    kept: list[_KeptProbe] = field(default_factory=list)
    trained: dict[tuple[str, str], _Trained] = field(default_factory=dict)


def _train_roles(
    run: _TrainRun,
    roles: list[str],
    samples_dir: Path,
    labels_dir: Path,
    out_dir: Path,
    cross_dir: Path | None = None,
) -> _Outcome:
    """Every (role, domain, variant) probe, each in a nested MLflow run. Once MLflow cannot be reached,
    every probe (the one in flight included) is still trained and tested, and kept under
    ``out_dir/pending`` to register later."""
    cfg, done = run.cfg, _Outcome()
    for role in roles:
        data, labels_path, hashes = _role_data(cfg, role, samples_dir, labels_dir, cross_dir)
        done.metrics[role] = {}
        parts = {}  # every domain's data and split, so that a bad domain fails before any fit
        for domain in cfg.domain_list():
            part = only_domain(data, domain, labels_path)
            try:
                masks = split_by_question(part.question_id, cfg.val_fraction, cfg.test_fraction, cfg.seed)
            except ValueError as e:
                raise ValueError(f"train: {role} probes of domain {domain!r}: {e}") from None
            if cfg.train_fraction < 1:
                masks["train"] &= keep_questions(part.question_id, cfg.train_fraction, cfg.seed)
            parts[domain] = (part, masks)
        for domain, (part, masks) in parts.items():
            for variant in cfg.variants:
                key = probe_key(variant, domain)
                trained = done.trained[role, key] = _Trained(run, part, masks, hashes, role, key)
                try:
                    _track_or_keep(trained, done, out_dir / PENDING_DIR)
                finally:
                    close_figure(trained.figure)
    return done


def _track_or_keep(trained: _Trained, done: _Outcome, kept_dir: Path) -> None:
    """Track and register one probe (``_track_probe``) while MLflow answers; else (from the first error on)
    keep it under ``kept_dir`` to register later. Its test metrics go to ``done`` either way."""
    role, key = trained.role, trained.key
    if not done.kept:
        try:
            metrics, ref = _track_probe(trained)
            done.metrics[role][key] = metrics
            done.pointers[f"{role}-{key}"] = asdict(ref)
            log.info("train[%s/%s]: %s", role, key, {k: round(v, 4) for k, v in metrics.items()})
            return
        except TRACKING_ERRORS as e:
            log.error("train: MLflow unreachable (%s): the probes are kept locally", e)
    done.kept.append(trained.keep(kept_dir))
    done.metrics[role][key] = dict(trained.metrics)


def _role_data(
    cfg: TrainConfig, role: str, samples_dir: Path, labels_dir: Path, cross_dir: Path | None
) -> tuple[ProbeData, Path, dict[str, str]]:
    """A role's training rows by ``train.examples``, the labels file they come from and the data hashes."""
    if cfg.examples == "both":
        if cross_dir is None:
            raise ValueError("train.examples: both needs the cross stage's output (--cross)")
        labels_path = labels_dir / "joint.parquet"
        data = load_joint_probe_data(role, samples_dir, cross_dir, labels_path, cfg.variants)
        samples_hash = f"{data_hash(samples_dir / role)}+{data_hash(cross_dir / role)}"
    else:
        labels_path = labels_dir / f"{role}.parquet"
        data = load_probe_data(samples_dir / role, labels_path, cfg.variants)
        samples_hash = data_hash(samples_dir / role)
    return data, labels_path, {"samples": samples_hash, "labels": data_hash(labels_path)}


def _routing(
    trained: dict[tuple[str, str], _Trained],
    samples_dir: Path,
    cross_dir: Path | None,
    labels_dir: Path,
    variants: list[str],
) -> dict[str, dict[str, float]] | None:
    """The routing metrics of the pooled (all-domain) probes, or None without joint labels and cross
    features. Test questions: those held out from both roles' probes."""
    keys = {
        (r, v): t for (r, k), t in trained.items() if k == probe_key(v := split_probe_key(k)[0], ALL_DOMAINS)
    }
    if cross_dir is None or {r for r, _ in keys} != set(ROLES):
        return None
    data = load_routing_data(samples_dir, cross_dir, labels_dir / "joint.parquet", variants)
    if data is None:
        return None
    tests = [set(t.data.question_id[t.masks["test"]].tolist()) for (r, _), t in keys.items()]
    vals = [set(t.data.question_id[t.masks["val"]].tolist()) for (r, _), t in keys.items()]
    probes: dict[str, dict[str, nn.Module]] = {}
    for (role, variant), t in keys.items():
        t.fit(log_epochs=False)  # fitted already (tracked or kept): a no-op
        probes.setdefault(variant, {})[role] = t.probe
    table = routing_table(data, probes, set.intersection(*tests), set.intersection(*vals))
    for name, m in table.items():
        log.info("train: routing %s: %s", name, {k: round(v, 3) for k, v in m.items()})
    return table


def _log_routing(routing: dict[str, dict[str, float]], trained: dict[tuple[str, str], _Trained]) -> None:
    """Routing metrics on both probe runs of each variant (beside their MSE in the compare view) and every
    variant's, the oracle's included, on the parent train run."""
    client = mlflow.MlflowClient()
    for (_, key), t in trained.items():
        m = routing.get(key)
        if m is not None and t.run_id is not None:
            for name in ROUTING_LOGGED:
                if np.isfinite(m.get(name, float("nan"))):
                    client.log_metric(t.run_id, f"routing_{name}", m[name])
    mlflow.log_metrics(
        {f"routing_{v}_{k}": x for v, m in routing.items() for k, x in m.items() if np.isfinite(x)}
    )


def _tag_floors(routing: dict[str, dict[str, float]], pointers: dict[str, dict[str, Any]]) -> None:
    """Tag both registered probes of each trained variant with the ``min_ratio`` and ``min_p`` chosen on
    the validation questions and the pair's step acceptance on the held-out steps (``evaluate.min_ratio:
    auto``, ``min_p: auto`` and ``gamma: auto`` read them back at decode time; Random keeps the paper's
    rule and is not tagged)."""
    client = mlflow.MlflowClient()
    for variant, m in routing.items():
        if variant == "random":  # keys: plain variants, and the oracle (no probes, so no pointers)
            continue
        for tag in (MIN_RATIO_TAG, MIN_P_TAG, ACCEPT_RATE_TAG):
            floor = m.get(tag)
            if floor is None or not np.isfinite(floor):
                continue
            for role in ROLES:
                ref = pointers.get(f"{role}-{variant}")
                if ref is not None and ref.get("version") is not None:
                    client.set_model_version_tag(ref["name"], ref["version"], tag, f"{floor:.6g}")


def variant_figure(all_metrics: dict[str, dict[str, dict[str, float]]], pair: str):
    """The probe variants side by side: test MSE, AUROC and Spearman per variant (x) and role (bars)."""
    import matplotlib  # imported here: the headless backend must be chosen before pyplot loads

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    roles = sorted(all_metrics)
    keys = sorted({k for r in roles for k in all_metrics[r]})
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.8))
    for ax, (metric, title) in zip(
        axes,
        (("mse", "test MSE (lower is better)"), ("auroc", "AUROC"), ("spearman", "Spearman")),
        strict=True,
    ):
        for j, role in enumerate(roles):
            ax.bar(
                [i + 0.8 * j / len(roles) for i in range(len(keys))],
                [all_metrics[role].get(k, {}).get(metric, float("nan")) for k in keys],
                width=0.8 / len(roles),
                label=role,
            )
        ax.set_xticks([i + 0.4 - 0.4 / len(roles) for i in range(len(keys))], keys, rotation=20, fontsize=8)
        ax.set_title(title, fontsize=10)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{pair}: probe variants on held-out questions", fontsize=11)
    fig.tight_layout()
    return fig


class _Trained:
    """One probe (``key``: its variant, ``@domain`` for one domain's): fitted on first use, tested, its
    calibration plotted; tracked in MLflow by ``_track_probe`` or kept locally by ``keep``."""

    def __init__(
        self,
        run: _TrainRun,
        data: ProbeData,
        masks: dict[str, np.ndarray],
        hashes: dict[str, str],
        role: str,
        key: str,
    ) -> None:
        self.run, self.data, self.masks, self.hashes, self.role, self.key = (
            run,
            data,
            masks,
            hashes,
            role,
            key,
        )
        self.variant, domain = split_probe_key(key)
        self.domain = domain or ALL_DOMAINS
        self.probe: nn.Module | None = None
        self.run_id: str | None = None  # its MLflow run, once tracked
        self.metrics: dict[str, float] = {}
        self.figure = None  # the calibration plot, once fitted

    def fit(self, log_epochs: bool) -> None:
        """Fit (once), test on the held-out questions and save the calibration plot."""
        if self.probe is not None:
            return
        run, data, te = self.run, self.data, self.masks["test"]
        self.probe = fit_probe(data, self.variant, self.role, self.masks, run.cfg, log_epochs=log_epochs)
        pred = predict(self.probe, data.x[self.variant][te])
        self.metrics = probe_metrics(pred, data.y[te], data.in_largest[te])
        self.figure = calibration_figure(pred, data.y[te], f"{run.pair.name} {self.role} {self.key}")
        self.plot = save_figure_atomic(self.figure, run.plots_dir / f"calibration-{self.role}-{self.key}.png")

    def run_tags(self) -> dict[str, str]:
        run = self.run
        return {
            "stage": "train",
            "pair": run.pair.name,
            "role": self.role,
            "variant": self.variant,
            "domain": self.domain,
            "model_id": self.data.model_id,
            "git_commit": run.commit,
            **run.fingerprint,
        }

    def params(self) -> dict[str, Any]:
        run = self.run
        return {
            **_probe_params(run.cfg, run.pair, self.role, self.variant, self.hashes, self.masks),
            "domain": self.domain,
        }

    def version_tags(self) -> dict[str, str]:
        """The same names and values as the run's params, plus the test metrics."""
        run = self.run
        return {
            "model_id": self.data.model_id,
            "hidden_size": str(self.data.hidden_size),
            "format": self.data.format,
            "variant": self.variant,
            "feature": FEATURE_COLUMNS.get(self.variant, "none"),
            "pooling": run.pair.pooling,
            "examples": run.cfg.examples,
            "domain": self.domain,
            "pair": run.pair.name,
            "role": self.role,
            "git_commit": run.commit,
            "samples_hash": self.hashes["samples"],
            "labels_hash": self.hashes["labels"],
            **{f"test_{k}": f"{v:.4g}" for k, v in self.metrics.items() if np.isfinite(v)},
            **run.fingerprint,
        }

    def record(self, folder: Path) -> _KeptProbe:
        """What registering this probe (saved in ``folder``) needs, now or later."""
        return _KeptProbe(
            role=self.role,
            key=self.key,
            folder=str(folder),
            run_name=f"probe-{self.role}-{self.key}",
            run_tags=self.run_tags(),
            params=self.params(),
            metrics={f"test_{k}": v for k, v in self.metrics.items() if np.isfinite(v)},
            version_tags=self.version_tags(),
            description=_description(self.run.pair, self.role, self.key),
            plot=str(self.plot),
        )

    def keep(self, folder: Path) -> _KeptProbe:
        """Fit if not yet, save the probe under ``folder/<role>-<key>``; returns what registering it needs."""
        self.fit(log_epochs=False)
        where = folder / f"{self.role}-{self.key}"
        save_probe(self.probe, where)
        log.info("train[%s/%s] kept in %s: %s", self.role, self.key, where, self.metrics)
        return self.record(where)


@dataclass
class _KeptProbe:
    """A trained probe's registration, written to ``pending.json`` when MLflow was unreachable: its run's
    name, tags, params and test metrics, its calibration plot, and the version's tags and description."""

    role: str
    key: str
    folder: str  # where the probe is saved
    run_name: str
    run_tags: dict[str, str]
    params: dict[str, Any]
    metrics: dict[str, float]
    version_tags: dict[str, str]
    description: str
    plot: str


def _log_and_register(kept: _KeptProbe, pair: str, register: bool) -> ProbeRef:
    """In the active (probe) run: the test metrics and the calibration plot; then the probe in
    ``kept.folder`` is stored as run artifacts and registered (``register``: as a new champion version)."""
    mlflow.log_metrics(kept.metrics)
    if Path(kept.plot).is_file():
        mlflow.log_artifact(kept.plot)
    return register_probe(
        Path(kept.folder), pair, kept.role, kept.key, kept.version_tags, register, kept.description
    )


def _track_probe(t: _Trained) -> tuple[dict[str, float], ProbeRef]:
    """The probe in its own nested MLflow run: its params, the per-epoch MSE while it fits, its test
    metrics and calibration plot; stored as run artifacts and registered. Returns its test metrics and
    where it is stored."""
    with mlflow.start_run(run_name=f"probe-{t.role}-{t.key}", tags=t.run_tags(), nested=True) as active:
        t.run_id = active.info.run_id
        mlflow.log_params(t.params())
        t.fit(log_epochs=True)
        choice = getattr(t.probe, "choice", None)
        if choice is not None:  # the shape kept (validation MSE) and every candidate fitted
            mlflow.log_params({f"chosen_{k}": choice[k] for k in ("hidden", "weight_decay", "epochs")})
            mlflow.log_dict(choice, "search.json")
        with tempfile.TemporaryDirectory(prefix="semspec-probe-") as tmp:
            save_probe(t.probe, Path(tmp))
            ref = _log_and_register(t.record(Path(tmp)), t.run.pair.name, t.run.cfg.register)
    metrics = dict(t.metrics)
    if ref.version is not None:
        metrics["registered_version"] = int(ref.version)
    return metrics, ref


def register_pending(out_dir: Path, register: bool = True) -> dict[str, Any]:
    """Register the probes a train run kept in ``out_dir`` while MLflow was unreachable (no retraining):
    each gets its MLflow run (params, test metrics, calibration plot) and registry version as if it had
    been registered then; then the stage's outputs (test metrics, ``probes.json``) are written and the
    local copies removed. Returns the test metrics."""
    path = out_dir / PENDING_FILE
    if not path.is_file():
        raise ValueError(f"{path} does not exist: no probe is waiting to be registered")
    record = json.loads(path.read_text(encoding="utf-8"))
    check_tracking()
    pair, pointers, metrics = record["pair"], dict(record["registered"]), record["metrics"]
    setup_experiment(pair)
    with mlflow.start_run(
        run_name=f"train-{pair}-registered-later", tags={"stage": TRAIN_PARENT, "pair": pair}
    ):
        for kept in (_KeptProbe(**p) for p in record["pending"]):
            with mlflow.start_run(run_name=kept.run_name, tags=kept.run_tags, nested=True):
                mlflow.log_params(kept.params)
                ref = _log_and_register(kept, pair, register)
            pointers[f"{kept.role}-{kept.key}"] = asdict(ref)
            if ref.version is not None:
                metrics[kept.role][kept.key]["registered_version"] = int(ref.version)
        fig = variant_figure(metrics, pair)
        save_figure_atomic(fig, Path(record["plots_dir"]) / "probe-variants.png")
        mlflow.log_figure(fig, "probe-variants.png")
        close_figure(fig)
    _finish(
        metrics,
        Path(record["metrics_path"]),
        {**{k: record[k] for k in ("params", "roles")}, "probes": pointers},
        out_dir,
    )
    shutil.rmtree(out_dir / PENDING_DIR, ignore_errors=True)
    path.unlink()
    log.info("registered %d kept probe(s) of %s", len(record["pending"]), pair)
    return metrics


def _description(pair: PairConfig, role: str, key: str) -> str:
    """The registered model's description: what the probe reads and what it predicts."""
    variant, domain = split_probe_key(key)
    reads = {
        "last": "the last layer's hidden states",
        "all": "the mean over all layers of the hidden states (the paper's probe)",
        "mix": "the hidden states of every layer, with learned layer weights",
        "random": "nothing: the paper's Random ablation draws a uniform number",
    }[variant]
    spec = pair.role(role)
    return (
        f"SemanticSpec probe of pair {pair.name}, role {role} ({spec.model_id}). Reads {reads}, pooled over "
        f"a reasoning step ({pair.pooling} pooling), and predicts the step's semantic probability: the share of the {role}'s sampled "
        f"continuations of the same prefix that mean the same thing. Trained on "
        f"{'every domain' if domain is None else f'the {domain} questions only'}. Decoding loads the version "
        f"with alias champion."
    )


def _probe_params(
    cfg: TrainConfig,
    pair: PairConfig,
    role: str,
    variant: str,
    hashes: dict[str, str],
    masks: dict[str, np.ndarray],
) -> dict[str, Any]:
    """The MLflow params of one probe's training run."""
    return {
        "pair": pair.name,
        "role": role,
        "variant": variant,
        "feature": FEATURE_COLUMNS.get(variant, "none"),
        "pooling": pair.pooling,
        "hidden": cfg.hidden(role) if variant != "random" else [],
        "lr": cfg.lr,
        "betas": cfg.betas,
        "weight_decay": cfg.weight_decay,
        "batch_size": cfg.batch_size,
        "seed": cfg.seed,
        "max_epochs": cfg.max_epochs,
        "patience": cfg.patience,
        "examples": cfg.examples,
        "train_fraction": cfg.train_fraction,
        "samples_hash": hashes["samples"],
        "labels_hash": hashes["labels"],
        **{f"n_{k}": int(masks[k].sum()) for k in ("train", "val", "test")},
    }


def stage(
    *,
    params: Params,
    pair: PairConfig,
    samples: Path,
    cross: Path,
    labels: Path,
    out: Path,
    metrics: Path,
    plots: Path,
) -> dict[str, Any]:
    """Stage train (the CLI's and dvc.yaml's entry): fit, evaluate, log and register every probe, tagged
    with the pipeline fingerprint; returns the test metrics ``{role: {variant: {...}}}``."""
    if params.train.register:
        check_tracking()
    fingerprint = pipeline_fingerprint(params, pair)
    return run_train(
        params.train, pair, samples, labels, out, metrics, plots, fingerprint=fingerprint, cross_dir=cross
    )
