"""The converted copy of a GGUF model: made once, read after, never stale, repaired when broken. The GGUF
conversion itself is replaced by a tiny model here (tests/integration/test_embedded_lm.py checks the real
one gives the same model bit for bit)."""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os

import pytest
import torch

import semspec.models.lm.loading as loading
from semspec.models.lm import load_lm
from semspec.models.lm.pair import ModelConfig
from tests.helpers.tiny import char_tokenizer, tiny_llama

TEXT = "12 * 7 = 84.\n\nSo the answer is 84."


@pytest.fixture
def gguf(tmp_path, monkeypatch):
    """A local GGUF model whose conversion is a tiny Llama; returns (model_cfg, conversions done so far)."""
    monkeypatch.setenv("SEMSPEC_CACHE_DIR", str(tmp_path / "cache"))
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "m.gguf").write_bytes(b"GGUF stand-in")
    calls: list[int] = []

    def convert(model_cfg, where, dtype):
        calls.append(1)
        tok = char_tokenizer()
        return tok, tiny_llama(len(tok), seed=len(calls)).to(dtype)

    monkeypatch.setattr(loading, "_load_pretrained", convert)
    model_cfg = ModelConfig(
        model_id="org/m:Q4", source="local", path=str(folder), gguf_file="m.gguf", dtype="bfloat16"
    )
    return model_cfg, calls


def _converted(tmp_path):
    root = tmp_path / "cache" / "converted"
    return sorted(p.name for p in root.iterdir()) if root.is_dir() else []


def _same(a, b) -> bool:
    sa, sb = a.model.state_dict(), b.model.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_a_gguf_model_is_converted_once_then_read_from_the_cache(gguf, tmp_path):
    model_cfg, calls = gguf
    first = load_lm(model_cfg)
    (name,) = _converted(tmp_path)
    assert name.startswith("org_m_Q4-bfloat16-") and len(calls) == 1
    second = load_lm(model_cfg)
    assert len(calls) == 1, "the second load reads the converted copy"
    assert _same(first, second) and second.model.dtype == torch.bfloat16
    assert first.tokenizer(TEXT).input_ids == second.tokenizer(TEXT).input_ids
    assert first.eos_ids == second.eos_ids


def test_a_changed_gguf_file_is_converted_again_and_the_old_copy_removed(gguf, tmp_path):
    model_cfg, calls = gguf
    load_lm(model_cfg)
    (old,) = _converted(tmp_path)
    gguf_file = tmp_path / "model" / "m.gguf"
    gguf_file.write_bytes(b"GGUF another version")  # another size and mtime
    fresh = load_lm(model_cfg)
    (new,) = _converted(tmp_path)
    assert len(calls) == 2 and new != old
    assert _same(fresh, load_lm(model_cfg)) and len(calls) == 2


def test_a_pinned_file_shares_one_copy_wherever_it_lies(gguf, tmp_path):
    """Two installs (venvs, checkouts) of the same pinned GGUF file: converted once, whatever the path."""
    model_cfg, calls = gguf
    data = (tmp_path / "model" / "m.gguf").read_bytes()
    other = tmp_path / "other-venv"
    other.mkdir()
    (other / "m.gguf").write_bytes(data)
    pin = hashlib.sha256(data).hexdigest()
    load_lm(dataclasses.replace(model_cfg, sha256=pin))
    load_lm(dataclasses.replace(model_cfg, sha256=pin, path=str(other)))
    assert len(calls) == 1 and len(_converted(tmp_path)) == 1
    (other / "m.gguf").write_bytes(b"GGUF cut")  # the pin is checked before any copy is used
    with pytest.raises(ValueError, match="sha256"):
        load_lm(dataclasses.replace(model_cfg, sha256=pin, path=str(other)))


def test_another_dtype_is_another_copy(gguf, tmp_path):
    model_cfg, calls = gguf
    load_lm(model_cfg)
    load_lm(dataclasses.replace(model_cfg, dtype="float32"))
    names = _converted(tmp_path)
    assert len(calls) == 2 and len(names) == 2
    assert {n.split("-")[1] for n in names} == {"bfloat16", "float32"}


def test_the_int_formats_share_the_bfloat16_copy_and_quantize_it(gguf, tmp_path):
    """int8 and int4 load the bfloat16 copy (their activations' dtype) and quantize it after loading: no
    copy of their own, and the same model as the bfloat16 one before quantization."""
    model_cfg, calls = gguf
    dense = load_lm(model_cfg)
    for fmt in ("int8", "int4"):
        lm = load_lm(dataclasses.replace(model_cfg, dtype=fmt, device="cpu"))
        assert lm.format.name == fmt and lm.dtype_name.startswith(fmt)
        assert any(type(m).__name__ == "QuantLinear" for m in lm.model.modules())
    assert len(calls) == 1 and len(_converted(tmp_path)) == 1
    assert dense.format.name == "bfloat16"


def test_a_broken_copy_is_deleted_and_the_model_converted_again(gguf, tmp_path, caplog):
    model_cfg, calls = gguf
    good = load_lm(model_cfg)
    (name,) = _converted(tmp_path)
    weights = tmp_path / "cache" / "converted" / name / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # cut, e.g. by a full disk
    with caplog.at_level(logging.WARNING, logger="semspec.models.lm"):
        again = load_lm(model_cfg)
    assert len(calls) == 2 and "unusable" in caplog.text and "deleting it" in caplog.text
    assert _converted(tmp_path) == [name] and weights.stat().st_size > 100
    assert again.tokenizer(TEXT).input_ids == good.tokenizer(TEXT).input_ids


def test_an_unwritable_cache_costs_speed_only(gguf, tmp_path, caplog):
    model_cfg, calls = gguf
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "converted").write_text("a file where the folder should be")
    with caplog.at_level(logging.WARNING, logger="semspec.models.lm"):
        lm = load_lm(model_cfg)
    assert lm.tokenizer(TEXT).input_ids and len(calls) == 1
    assert "could not keep a converted copy" in caplog.text
    assert not [p for p in (tmp_path / "cache").iterdir() if ".tmp" in p.name]


def test_the_cache_can_be_turned_off(gguf, tmp_path, monkeypatch):
    model_cfg, calls = gguf
    monkeypatch.setenv("SEMSPEC_GGUF_CACHE", "0")
    load_lm(model_cfg)
    load_lm(model_cfg)
    assert len(calls) == 2 and _converted(tmp_path) == []


def test_no_half_written_copy_is_left_when_saving_fails(gguf, tmp_path, monkeypatch):
    """The weights are written, then the disk fills up while the tokenizer is: nothing that looks like a
    copy is left, and the next load converts again and keeps a whole one."""
    model_cfg, calls = gguf
    cls = type(char_tokenizer())
    real = cls.save_pretrained

    def full_disk(self, folder, *a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(cls, "save_pretrained", full_disk)
    load_lm(model_cfg)
    root = tmp_path / "cache" / "converted"
    assert list(root.iterdir()) == [], os.listdir(root)
    monkeypatch.setattr(cls, "save_pretrained", real)
    load_lm(model_cfg)
    assert len(calls) == 2 and len(_converted(tmp_path)) == 1
