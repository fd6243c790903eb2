"""Semantic-probability labels of one prefix's samples: the judge groups the samples by meaning and a
sample's label is ``|its cluster| / n_valid``.

Empty samples, and steps longer than the judge's window, are invalid: counted per prefix (``n_invalid``)
and not labelled. ``n_truncated`` counts the samples whose question/prefix context was cut (from its start)
so that the judge saw the step whole. Samples cut by the step budget are labelled like any other
(``cluster.label_length_cut``, default on): the decoders cut steps at the same budget and the probes score
those steps too, so they must see such steps in training. Joint labels cluster both models' samples of a
prefix together. :class:`JudgeActor` holds the judge, in a Ray actor or in-process (stage ``cluster``).
"""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import pyarrow as pa

from semspec.models.lm.pair import JudgeConfig
from semspec.models.spec.judges import Judge, load_judge, semantic_entropy
from semspec.models.spec.names import ROLES
from semspec.tasks.config import ClusterConfig

# a row of labels/<role>.parquet (``label_prefix``)
LABEL_SCHEMA = pa.schema(
    [
        ("prefix_id", pa.string()),
        ("question_id", pa.string()),
        ("domain", pa.string()),
        ("role", pa.string()),
        ("sample_idx", pa.int32()),
        ("cluster_id", pa.int32()),
        ("cluster_size", pa.int32()),
        ("n_valid", pa.int32()),
        ("n_invalid", pa.int32()),
        ("n_truncated", pa.int32()),
        ("semantic_prob", pa.float32()),
        ("semantic_entropy", pa.float32()),
        ("in_largest", pa.bool_()),
    ]
)

# a row of labels/joint.parquet (``label_joint``): both models' samples of a prefix clustered together
JOINT_SCHEMA = pa.schema(
    [
        ("prefix_id", pa.string()),
        ("question_id", pa.string()),
        ("domain", pa.string()),
        ("author", pa.string()),  # which model wrote the text
        ("sample_idx", pa.int32()),
        ("cluster_id", pa.int32()),
        ("n_valid_draft", pa.int32()),
        ("n_valid_target", pa.int32()),
        # the share of each model's valid samples in this text's cluster: p(Sem(s) | C, M), for every text
        # whoever wrote it; null when that model has no valid sample at this prefix
        ("share_draft", pa.float32()),
        ("share_target", pa.float32()),
        ("largest_draft", pa.bool_()),  # the text's cluster holds the most of the draft's samples
        ("largest_target", pa.bool_()),
    ]
)


def is_valid(text: str, finish_reason: str, label_length_cut: bool = True) -> bool:
    """A sample counts when it has content (and, unless ``label_length_cut``, was not cut by the budget)."""
    return bool(text.strip()) and (label_length_cut or finish_reason != "length")


def inject_noise(cluster_ids: list[int], fraction: float, rng: random.Random) -> list[int]:
    """Move ``fraction`` of the samples to a cluster other than their own (a new one when only one
    cluster exists) — the paper's robustness study."""
    ids = list(cluster_ids)
    k = round(fraction * len(ids))
    if k == 0:
        return ids
    clusters = sorted(set(ids))
    for i in rng.sample(range(len(ids)), k):
        others = [c for c in clusters if c != ids[i]]
        ids[i] = rng.choice(others) if others else max(clusters) + 1
    return ids


def label_prefix(
    judge: Judge, group: dict[str, Any], cfg: ClusterConfig, premise: str = ""
) -> list[dict[str, Any]]:
    """Labels for the samples of one prefix (``group``: lists of sample_idx, text, finish_reason)."""
    valid = [
        i
        for i, (t, f) in enumerate(zip(group["text"], group["finish_reason"], strict=True))
        if is_valid(t, f, cfg.label_length_cut)
    ]
    if not valid:
        return []
    found = judge.cluster([group["text"][i] for i in valid], premise if cfg.with_question else "")
    # a step longer than the judge's window is not judged: invalid, like an empty one
    fits = [(i, c) for i, c in zip(valid, found.ids, strict=True) if c is not None]
    valid, ids = [i for i, _ in fits], [c for _, c in fits]
    n_invalid = len(group["text"]) - len(valid)
    if not valid:
        return []
    if cfg.noise:
        ids = inject_noise(ids, cfg.noise, random.Random(f"{cfg.seed}:{group['prefix_id']}"))
    sizes = Counter(ids)
    largest = max(sizes.values())
    ent = semantic_entropy(ids)
    return [
        {
            "prefix_id": group["prefix_id"],
            "question_id": group["question_id"],
            "domain": group.get("domain", "unknown"),
            "role": group["role"],
            "sample_idx": group["sample_idx"][i],
            "cluster_id": c,
            "cluster_size": sizes[c],
            "n_valid": len(valid),
            "n_invalid": n_invalid,
            "n_truncated": found.truncated,
            "semantic_prob": sizes[c] / len(valid),
            "semantic_entropy": ent,
            "in_largest": sizes[c] == largest,
        }
        for i, c in zip(valid, ids, strict=True)
    ]


def label_joint(
    judge: Judge, groups: dict[str, dict[str, Any]], cfg: ClusterConfig, premise: str = ""
) -> list[dict[str, Any]]:
    """Joint labels of one prefix: the valid samples of both models (``groups``: role -> that role's group
    as ``cluster.group_samples`` makes it) clustered in one judge call; every text gets, for each model, the share
    of that model's valid samples in its cluster (null for a model with no valid sample here)."""
    texts, who = [], []
    for role in ROLES:
        g = groups.get(role)
        if g is None:
            continue
        for i, (t, f) in enumerate(zip(g["text"], g["finish_reason"], strict=True)):
            if is_valid(t, f, cfg.label_length_cut):
                texts.append(t)
                who.append((role, g["sample_idx"][i]))
    if not texts:
        return []
    found = judge.cluster(texts, premise if cfg.with_question else "")
    kept = [(w, c) for w, c in zip(who, found.ids, strict=True) if c is not None]  # too long: unjudged
    if cfg.noise:
        first = next(iter(groups.values()))["prefix_id"]
        ids = inject_noise([c for _, c in kept], cfg.noise, random.Random(f"{cfg.seed}:joint:{first}"))
        kept = [(w, c) for (w, _), c in zip(kept, ids, strict=True)]
    counts = {role: Counter(c for (r, _), c in kept if r == role) for role in ROLES}
    n_valid = {role: sum(counts[role].values()) for role in ROLES}
    top = {role: max(counts[role].values(), default=0) for role in ROLES}
    g0 = next(iter(groups.values()))
    return [
        {
            "prefix_id": g0["prefix_id"],
            "question_id": g0["question_id"],
            "domain": g0.get("domain", "unknown"),
            "author": role,
            "sample_idx": idx,
            "cluster_id": c,
            "n_valid_draft": n_valid["draft"],
            "n_valid_target": n_valid["target"],
            **{f"share_{m}": counts[m][c] / n_valid[m] if n_valid[m] else None for m in ROLES},
            **{f"largest_{m}": bool(n_valid[m]) and counts[m][c] == top[m] for m in ROLES},
        }
        for (role, idx), c in kept
    ]


class JudgeActor:
    """Holds one judge (a Ray actor, or in-process for the local executor)."""

    def __init__(self, judge_cfg: JudgeConfig | None = None, judge: Judge | None = None) -> None:
        if judge is None and judge_cfg is None:
            raise ValueError("JudgeActor needs a judge config or a judge")
        self.judge = judge or load_judge(judge_cfg)

    def label(self, groups: list[dict[str, Any]], cfg: ClusterConfig) -> list[dict[str, Any]]:
        """Labels for a batch of prefixes (one role's groups, or joint groups: ``{"roles": {...}}``)."""
        out = []
        for g in groups:
            if "roles" in g:
                out += label_joint(self.judge, g["roles"], cfg, g.get("premise", ""))
            else:
                out += label_prefix(self.judge, g, cfg, g.get("premise", ""))
        return out
