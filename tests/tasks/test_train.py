"""Probe fitting on synthetic features: guards against splits too small to train on."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from semspec.tasks.config import TrainConfig
from semspec.tasks.train.data import ProbeData
from semspec.tasks.train.fit import fit_probe, predict


def _data(n: int, d: int = 6) -> ProbeData:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, d)).astype(np.float32)
    x[:, 0] = 3.0  # a dimension that never varies
    y = (1 / (1 + np.exp(-x[:, 1]))).astype(np.float32)
    return ProbeData(
        x={"all": x},
        y=y,
        in_largest=y > 0.5,
        question_id=np.array([f"q{i}" for i in range(n)]),
        domain=np.array(["math"] * n),
        model_id="m",
        hidden_size=d,
        num_layers=0,
    )


def _masks(n: int, n_train: int) -> dict[str, np.ndarray]:
    idx = np.arange(n)
    return {"train": idx < n_train, "val": idx >= n_train, "test": idx >= n_train}


def test_fit_probe_refuses_a_single_training_row():
    with pytest.raises(ValueError, match="only 1 labelled training samples"):
        fit_probe(
            _data(4),
            "all",
            "draft",
            _masks(4, 1),
            TrainConfig(hidden_draft=[4], max_epochs=2, register=False),
        )


def test_fit_probe_on_a_tiny_split_gives_finite_predictions(capsys, caplog):
    import logging
    import warnings

    data = _data(12)
    cfg = TrainConfig(hidden_draft=[4], max_epochs=3, patience=2, register=False)
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.INFO):
        warnings.simplefilter("always")
        probe = fit_probe(data, "all", "draft", _masks(12, 2), cfg)
    # Lightning's per-Trainer announcements and its own deprecation warning stay out of the stage log
    said = capsys.readouterr().err + caplog.text + " ".join(str(w.message) for w in caught)
    assert "GPU available" not in said and "litlogger" not in said and "LeafSpec" not in said
    assert all(torch.isfinite(t).all() for t in probe.state_dict().values())
    pred = predict(probe, data.x["all"] * 100)  # far outside the training range
    assert np.isfinite(pred).all() and ((pred >= 0) & (pred <= 1)).all()


def test_a_training_fraction_keeps_nested_seeded_subsets_of_questions():
    import numpy as np

    from semspec.tasks.train.data import keep_questions

    q = np.array([f"q{i % 200}" for i in range(1000)])
    quarter, half = keep_questions(q, 0.25, 0), keep_questions(q, 0.5, 0)
    assert 0.18 < quarter.mean() < 0.32 and 0.42 < half.mean() < 0.58
    assert not (quarter & ~half).any(), "a smaller share keeps a subset of a larger one's questions"
    same = {qq for qq, k in zip(q, quarter, strict=True) if k}
    assert all(k == (qq in same) for qq, k in zip(q, quarter, strict=True)), "by question, not by row"
    assert keep_questions(q, 1.0, 0).all() and (keep_questions(q, 0.25, 1) != quarter).any()
