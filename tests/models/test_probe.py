"""Probes: shapes, standardisation, the mix variant, the Random ablation."""

from __future__ import annotations

import pickle

import pytest
import torch

from models.lm import Pooled
from models.probe import ProbeMLP, RandomProbe, probe_probability


def test_mlp_probe_outputs_probabilities():
    p = ProbeMLP(16, [8, 4], "all")
    x = torch.randn(5, 16) * 100 + 50
    p.set_standardization(x)
    out = p(x)
    assert out.shape == (5,) and ((out > 0) & (out < 1)).all()
    assert torch.allclose(p.mu, x.mean(0)) and torch.allclose(p.sigma, x.std(0))


def test_mix_probe_learns_layer_weights():
    p = ProbeMLP(8, [4], "mix", num_layers=3)
    x = torch.randn(6, 3, 8)
    assert p(x).shape == (6,)
    assert p.layer_logits.shape == (3,)
    loss = torch.nn.functional.mse_loss(p(x), torch.rand(6))
    loss.backward()
    assert p.layer_logits.grad is not None and p.layer_logits.grad.abs().sum() > 0


def test_probe_reads_the_right_feature_from_pooled():
    h = torch.randn(4, 8)  # (L+1, D)
    pooled = Pooled(h)
    for feat in ("last", "all"):
        p = ProbeMLP(8, [4], feat)
        expected = float(p(pooled.feature(feat)[None])[0])
        assert probe_probability(p, pooled) == pytest.approx(expected)
    mix = ProbeMLP(8, [4], "mix", num_layers=4)
    assert 0 < probe_probability(mix, pooled) < 1


@pytest.mark.parametrize(
    "kwargs, msg",
    [({"feature": "middle"}, "feature"), ({"feature": "mix"}, "num_layers"), ({"hidden": [0]}, "positive")],
)
def test_bad_probe_arguments(kwargs, msg):
    args = {"input_dim": 8, "hidden": [4], **kwargs}
    with pytest.raises(ValueError, match=msg):
        ProbeMLP(**args)


def test_random_probe_is_uniform_seeded_and_pickles():
    p = RandomProbe(8, seed=3)
    a = p(torch.zeros(1000, 8))
    assert 0.45 < float(a.mean()) < 0.55 and a.min() >= 0 and a.max() < 1
    q = pickle.loads(pickle.dumps(RandomProbe(8, seed=3)))
    assert torch.equal(q(torch.zeros(10, 8)), RandomProbe(8, seed=3)(torch.zeros(10, 8)))
