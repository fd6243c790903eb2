"""Each model loads straight onto its config's device: a GPU model gets `device_map` at `from_pretrained`,
so no full copy is built in CPU memory first; a CPU model loads as before."""

from __future__ import annotations

from semspec.models.lm import loading
from semspec.models.lm.pair import ModelConfig


def _spec(device: str) -> ModelConfig:
    return ModelConfig(model_id="m", source="local", path="/nonexistent", device=device, dtype="bfloat16")


def test_gpu_models_load_onto_their_device_and_cpu_models_as_before(monkeypatch):
    assert loading._placement(_spec("cpu")) == {}
    assert loading._placement(_spec("cuda:1")) == {"device_map": "cuda:1"}
    monkeypatch.setattr(loading.torch.cuda, "is_available", lambda: True)
    assert loading._placement(_spec("auto")) == {"device_map": "cuda"}
    monkeypatch.setattr(loading.torch.cuda, "is_available", lambda: False)
    assert loading._placement(_spec("auto")) == {}
