"""The train stage's rows: each role's features joined with its labels (``train.examples``: ``own`` or
``both``), one domain's rows, the split by question and the kept fraction of training questions, and the
draft-written steps (``RoutingData``) that the routing metrics are measured on."""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from semspec.models.spec.names import ALL_DOMAINS, FEATURE_COLUMNS
from semspec.tasks.io import column_matrix, read_shards


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
