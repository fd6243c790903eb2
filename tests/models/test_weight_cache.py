"""The weight cache: a quantized model written once, memory-mapped at later loads, computing what the model
it was made from computes; a stale or broken entry is rebuilt, never used."""

from __future__ import annotations

import json

import pytest
import torch

from semspec.models.cpu.formats import Format, QuantLinear, quantize_model
from semspec.models.lm import weight_cache
from semspec.models.project.settings import reload_settings
from tests.helpers.tiny import char_tokenizer, tiny_llama

INT4 = Format("int4", torch.bfloat16, dense_rows=None)
INT8 = Format("int8", torch.bfloat16, dense_rows=4, dense_copy=True)
SOURCE = {"sha256": "ab" * 32, "dtype": "bfloat16", "converter": "test"}


@pytest.fixture
def cache(monkeypatch, tmp_path):
    monkeypatch.setenv("SEMSPEC_CACHE_DIR", str(tmp_path))
    reload_settings()
    yield tmp_path
    reload_settings()


def _quantized(fmt: Format):
    model = tiny_llama(len(char_tokenizer()), seed=3, hidden=64).to(torch.bfloat16)
    assert quantize_model(model, fmt) > 0
    return char_tokenizer(), model.eval()


def _logits(model, rows: int) -> torch.Tensor:
    ids = torch.arange(3, 3 + 8 * rows).reshape(rows, 8) % 40 + 3  # (rows, 8)
    with torch.no_grad():
        return model(ids).logits.float()  # (rows, 8, vocab)


@pytest.mark.parametrize("fmt", [INT4, INT8], ids=["int4", "int8 with a dense copy"])
def test_a_cached_model_is_mapped_from_the_file_and_computes_the_same(cache, fmt):
    tokenizer, model = _quantized(fmt)
    key = weight_cache.cache_key(SOURCE, fmt)
    folder = weight_cache.entry_path("org/tiny", key)
    assert folder.parent == cache / "quantized" and folder.name.startswith(f"org_tiny-{fmt.name}-")
    weight_cache.save(folder, key, tokenizer, model)
    tok2, loaded = weight_cache.load(folder, key, fmt)
    assert tok2.get_vocab() == tokenizer.get_vocab()
    layers = [m for m in loaded.modules() if isinstance(m, QuantLinear)]
    assert len(layers) == sum(isinstance(m, QuantLinear) for m in model.modules())
    assert not any(t.is_meta for t in loaded.state_dict().values())
    assert (layers[0].dense is not None or layers[0]._dense_packed is not None) is fmt.dense_copy
    for rows in (1, 2, 5):  # the int kernels' few-row calls and many-row ones (dense copy or tiles)
        assert torch.equal(_logits(loaded, rows), _logits(model, rows))


def test_a_stale_or_broken_entry_is_deleted_and_never_used(cache, caplog):
    tokenizer, model = _quantized(INT4)
    key = weight_cache.cache_key(SOURCE, INT4)
    folder = weight_cache.entry_path("org/tiny", key)
    weight_cache.save(folder, key, tokenizer, model)
    other = {**key, "source": {**SOURCE, "sha256": "cd" * 32}}  # the GGUF file changed: another key...
    assert weight_cache.entry_path("org/tiny", other) != folder
    assert weight_cache.load(folder, other, INT4) is None and not folder.exists()  # ...and this one is stale

    weight_cache.save(folder, key, tokenizer, model)
    tensors = folder / "model.safetensors"
    tensors.write_bytes(tensors.read_bytes()[: tensors.stat().st_size // 2])  # cut
    assert weight_cache.load(folder, key, INT4) is None and not folder.exists()
    assert "unusable" in caplog.text

    weight_cache.save(folder, key, tokenizer, model)
    (folder / "semspec-key.json").write_text(json.dumps({**key, "layout": -1}))  # another layout version
    assert weight_cache.load(folder, key, INT4) is None and not folder.exists()


def test_a_new_entry_replaces_those_of_another_gguf_file_and_keeps_other_settings(cache):
    tokenizer, model = _quantized(INT4)
    old_key = weight_cache.cache_key(SOURCE, INT4)
    old = weight_cache.entry_path("org/tiny", old_key)
    weight_cache.save(old, old_key, tokenizer, model)
    other_setting = {**old_key, "int8_kernel": "AVX2"}  # the same file, another kernel build
    beside = weight_cache.entry_path("org/tiny", other_setting)
    weight_cache.save(beside, other_setting, tokenizer, model)
    assert old.is_dir() and beside.is_dir(), "another setting of the same file keeps its entry"
    new_key = {**old_key, "source": {**SOURCE, "sha256": "ef" * 32}}  # the GGUF file changed
    new = weight_cache.entry_path("org/tiny", new_key)
    weight_cache.save(new, new_key, tokenizer, model)
    assert new.is_dir() and not old.exists() and not beside.exists()
    assert weight_cache.load(new, new_key, INT4) is not None


def test_an_error_of_this_process_leaves_the_entry(cache, monkeypatch):
    tokenizer, model = _quantized(INT4)
    key = weight_cache.cache_key(SOURCE, INT4)
    folder = weight_cache.entry_path("org/tiny", key)
    weight_cache.save(folder, key, tokenizer, model)

    def no_memory(*a, **k):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(weight_cache, "_load", no_memory)
    assert weight_cache.load(folder, key, INT4) is None and folder.is_dir(), "kept for the next load"


def test_an_entry_whose_packed_weights_do_not_fit_their_layer_is_deleted(cache, caplog):
    from safetensors import safe_open
    from safetensors.torch import save_file

    tokenizer, model = _quantized(INT4)
    key = weight_cache.cache_key(SOURCE, INT4)
    folder = weight_cache.entry_path("org/tiny", key)
    weight_cache.save(folder, key, tokenizer, model)
    path = folder / "model.safetensors"
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not iterable)
    name = next(k for k in tensors if k.endswith(".qweight"))
    tensors[name] = tensors[name].flatten()[: tensors[name].numel() // 2].clone()  # half the weights
    save_file(tensors, str(path), metadata=meta)
    assert weight_cache.load(folder, key, INT4) is None and not folder.exists()
    assert "do not hold" in caplog.text
