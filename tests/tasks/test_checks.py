"""The inspection tools' reports: the judge calibration sweep (with a bag-of-words encoder in place of the
sentence model) and its refusal of a judge that is not an embedding judge."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import semspec.models.spec.judges as judges
from semspec.tasks.checks import judge_calibration

PAIRS = """pairs:
  - [true, "12 * 7 = 84 pencils.", "12 * 7 = 84 pencils in all."]
  - [true, "So 84 - 15 = 69 left.", "So 84 - 15 = 69 remain."]
  - [false, "12 * 7 = 84 pencils.", "So 84 - 15 = 69 left."]
  - [false, "The answer is 96.", "12 * 7 = 84 pencils in all."]
"""


def _bag_of_words(texts: list[str]) -> torch.Tensor:
    """Unit vectors of word counts over the texts' vocabulary: equal wording, cosine 1."""
    vocab = sorted({w for t in texts for w in t.split()})
    rows = torch.tensor([[t.split().count(w) for w in vocab] for t in texts], dtype=torch.float32)
    return rows / rows.norm(dim=1, keepdim=True)


def test_the_sweep_reports_every_threshold_and_the_best_f1(tmp_path: Path, monkeypatch):
    path = tmp_path / "pairs.yaml"
    path.write_text(PAIRS, encoding="utf-8")
    monkeypatch.setattr(judges, "load_judge", lambda cfg: SimpleNamespace(encode=_bag_of_words))
    pair = SimpleNamespace(name="p", judge=SimpleNamespace(kind="embedding", threshold=0.9))
    lines = list(judge_calibration(pair, path))
    assert lines[0] == "4 labelled pairs, 2 equivalent"
    best = [line for line in lines if line.strip().startswith("best F1")]
    assert len(best) == 2  # with and without the numbers rule
    # the equivalent pairs share most words, the others few: some threshold separates them perfectly
    assert all(line.strip().startswith("best F1 1.000") for line in best), best
    rows = [line.split() for line in lines if line.startswith("  ") and line.split()[0][0].isdigit()]
    assert [float(r[0]) for r in rows[:12]] == pytest.approx(
        [0.5 + 0.05 * i for i in range(10)] + [0.97, 0.99]
    )
    assert len(rows) == 2 * 12 and all(len(r) == 5 for r in rows)  # threshold and four scores, per rule


def test_a_judge_that_is_not_an_embedding_judge_is_refused(tmp_path: Path):
    pair = SimpleNamespace(name="p", judge=SimpleNamespace(kind="llm", threshold=None))
    with pytest.raises(ValueError, match="'llm' judge; calibration is for embedding judges"):
        list(judge_calibration(pair, tmp_path / "none.yaml"))
