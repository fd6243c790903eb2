"""Joint labels: both models' samples of a prefix clustered together, each text labelled with the share of
each model's samples that mean the same (the paper's p(Sem(s) | C, M) applied whoever wrote the text)."""

from __future__ import annotations

import pytest

from semspec.models.spec.judges import Clustering, Judge
from semspec.tasks.config import ClusterConfig
from semspec.tasks.labelling import label_joint


class ByFirstWord(Judge):
    """A judge whose meaning of a step is its first word (hand-made clusters); 'long' never fits."""

    tokenizer = None

    def __init__(self) -> None:
        pass

    def cluster(self, texts, premise=""):
        words, ids = {}, []
        for t in texts:
            ids.append(None if t.startswith("long") else words.setdefault(t.split()[0], len(words)))
        return Clustering(ids)


def _group(role, texts, prefix="p0"):
    return {
        "prefix_id": prefix,
        "question_id": "q0",
        "domain": "math",
        "role": role,
        "sample_idx": list(range(len(texts))),
        "text": texts,
        "finish_reason": ["delimiter"] * len(texts),
    }


def _by(rows):
    return {(r["author"], r["sample_idx"]): r for r in rows}


def test_each_text_gets_both_models_shares():
    draft = _group("draft", ["a x", "a y", "b", "c only-draft"])
    target = _group("target", ["a z", "b", "b again", "d only-target"])
    rows = _by(label_joint(ByFirstWord(), {"draft": draft, "target": target}, ClusterConfig()))
    assert len(rows) == 8
    assert rows["draft", 0]["share_draft"] == pytest.approx(2 / 4)  # 'a': 2 of the draft's 4
    assert rows["draft", 0]["share_target"] == pytest.approx(1 / 4)  # and 1 of the target's 4
    assert (
        rows["target", 1]["share_target"] == pytest.approx(2 / 4) and rows["target", 1]["share_draft"] == 0.25
    )
    # a text the other model never says: share 0 there, its own share as usual
    assert rows["draft", 3]["share_target"] == 0.0 and rows["draft", 3]["share_draft"] == 0.25
    assert rows["target", 3]["share_draft"] == 0.0 and rows["target", 3]["share_target"] == 0.25
    assert {r["n_valid_draft"] for r in rows.values()} == {4} == {r["n_valid_target"] for r in rows.values()}
    # the same text: one cluster, whoever wrote it
    assert rows["draft", 2]["cluster_id"] == rows["target", 1]["cluster_id"]
    assert rows["target", 1]["largest_target"] and not rows["target", 3]["largest_target"]
    assert rows["draft", 0]["largest_draft"] and not rows["draft", 2]["largest_draft"]


def test_a_role_with_no_valid_sample_has_no_share():
    draft = _group("draft", ["", "  ", "long step the judge cannot read"])  # empty, blank, too long
    target = _group("target", ["a", "a", "b"])
    rows = _by(label_joint(ByFirstWord(), {"draft": draft, "target": target}, ClusterConfig()))
    assert set(rows) == {("target", 0), ("target", 1), ("target", 2)}
    for r in rows.values():
        assert r["share_draft"] is None and r["n_valid_draft"] == 0 and not r["largest_draft"]
    assert rows["target", 0]["share_target"] == pytest.approx(2 / 3)


def test_budget_cut_steps_follow_label_length_cut():
    draft = _group("draft", ["a", "a"])
    draft["finish_reason"] = ["delimiter", "length"]
    target = _group("target", ["a"])
    groups = {"draft": draft, "target": target}
    assert len(label_joint(ByFirstWord(), groups, ClusterConfig(label_length_cut=True))) == 3
    rows = label_joint(ByFirstWord(), groups, ClusterConfig(label_length_cut=False))
    assert len(rows) == 2 and all(r["n_valid_draft"] == 1 for r in rows)
