"""Probes: shapes, standardisation, the mix variant, the Random ablation."""

from __future__ import annotations

import pytest
import torch

from semspec.models.lm import Pooled
from semspec.models.spec.probe import (
    ProbeMLP,
    RandomProbe,
    load_probe_folder,
    probe_probabilities,
    probe_probability,
    save_probe,
)


def test_mlp_probe_outputs_probabilities():
    p = ProbeMLP(16, [8, 4], "all")
    x = torch.randn(5, 16) * 100 + 50
    p.set_standardization(x)
    out = p(x)
    assert out.shape == (5,) and ((out > 0) & (out < 1)).all()
    assert torch.allclose(p.mu, x.mean(0)) and torch.allclose(p.sigma, x.std(0, correction=0))


def test_standardisation_of_one_row_and_constant_dimensions_stays_finite():
    p = ProbeMLP(4, [3], "all")
    p.set_standardization(torch.tensor([[1.0, 2.0, 3.0, 4.0]]))  # one training row: no spread at all
    assert torch.equal(p.sigma, torch.ones(4)), "constant dimensions keep scale 1"
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0], [1.0, 5.0, 3.0, 4.0], [2.0, 2.0, 3.0, 4.0]])
    p.set_standardization(x)
    assert p.sigma[0] > 0.4 and p.sigma[1] > 1 and torch.equal(p.sigma[2:], torch.ones(2))
    out = p(torch.tensor([[1.0, 2.0, 1e3, -1e3]]))  # far off in the dimensions seen constant
    assert torch.isfinite(out).all()


def test_standardisation_rejects_non_finite_inputs():
    p = ProbeMLP(2, [2], "all")
    with pytest.raises(ValueError, match="NaN"):
        p.set_standardization(torch.tensor([[1.0, float("nan")], [0.0, 1.0]]))


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
        expected = float(p(pooled.feature(feat)[None])[0].detach())
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


def test_random_probe_is_uniform_and_seeded():
    p = RandomProbe(8, seed=3)
    a = p(torch.zeros(1000, 8))
    assert 0.45 < float(a.mean()) < 0.55 and a.min() >= 0 and a.max() < 1
    assert torch.equal(RandomProbe(8, seed=3)(torch.zeros(10, 8)), RandomProbe(8, seed=3)(torch.zeros(10, 8)))
    assert not torch.equal(
        RandomProbe(8, seed=4)(torch.zeros(10, 8)), RandomProbe(8, seed=3)(torch.zeros(10, 8))
    )


@pytest.mark.parametrize("feature", ["last", "mix"])
def test_a_stored_probe_loads_back_identical(tmp_path, feature):
    layers = 3 if feature == "mix" else None
    probe = ProbeMLP(8, [4], feature, layers)
    shape = (5, 3, 8) if feature == "mix" else (5, 8)
    probe.set_standardization(torch.randn(*shape) * 3 + 1)
    sha = save_probe(probe, tmp_path)
    assert sorted(f.name for f in tmp_path.iterdir()) == ["probe.json", "probe.safetensors"]
    back = load_probe_folder(tmp_path, sha)
    x = torch.randn(*shape)
    assert torch.equal(back(x), probe.eval()(x))
    assert torch.equal(back.mu, probe.mu) and torch.equal(back.sigma, probe.sigma)
    rnd = tmp_path / "random"
    save_probe(RandomProbe(8, seed=5), rnd)
    assert torch.equal(load_probe_folder(rnd)(torch.zeros(4, 8)), RandomProbe(8, seed=5)(torch.zeros(4, 8)))


def test_a_tampered_or_broken_probe_is_a_clean_error(tmp_path):
    sha = save_probe(ProbeMLP(8, [4]), tmp_path)
    weights = tmp_path / "probe.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # one flipped bit in a weight
    weights.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="does not match its recorded sha256"):
        load_probe_folder(tmp_path, sha)
    weights.write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="not a valid probe"):
        load_probe_folder(tmp_path)
    save_probe(ProbeMLP(8, [4]), tmp_path)
    (tmp_path / "probe.json").write_text(
        '{"format": 1, "kind": "mlp", "feature": "all", "input_dim": 16, '
        '"hidden": [4], "num_layers": null, "lr": 0.001, "betas": [0.9, 0.95], '
        '"weight_decay": 0.01}'
    )
    with pytest.raises(ValueError, match="not a valid probe"):  # the weights do not fit the config
        load_probe_folder(tmp_path)


def test_a_pickle_format_probe_is_refused_before_anything_is_unpickled(tmp_path):
    (tmp_path / "MLmodel").write_text("flavors: {pytorch: {}}\n")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "model.pth").write_bytes(b"\x80\x04 a pickle that must never be opened")
    with pytest.raises(ValueError, match=r"pickle-format probe.*retrain"):
        load_probe_folder(tmp_path)


@pytest.mark.parametrize("feature", ["all", "last", "mix"])
def test_a_batch_of_steps_scores_as_each_step_alone(feature):
    torch.manual_seed(0)
    probe = ProbeMLP(8, [4], feature, num_layers=4).eval()
    pooled = [Pooled(torch.randn(4, 8)) for _ in range(5)]
    batched = probe_probabilities(probe, pooled)
    assert batched == pytest.approx([probe_probability(probe, p) for p in pooled], abs=1e-6)
    assert len(set(batched)) > 1 and probe_probabilities(probe, []) == []
