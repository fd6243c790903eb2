"""Decode attention: the kernel computes softmax(q k^T) v as float arithmetic does, SDPA keeps every call
it does not take, and a model decodes the same tokens through it."""

from __future__ import annotations

import logging

import pytest
import torch

from semspec.models.cpu import attention, build, int8_kernel
from semspec.models.cpu.cpuinfo import cpu_info
from semspec.models.project.settings import reload_settings

BUILDABLE = build.isa(cpu_info().flags, int8_kernel.ISAS) is not None and build.compiler() is not None
needs_build = pytest.mark.skipif(not BUILDABLE, reason="needs an AVX2/FMA CPU and a C++ compiler")
HERE = [name for name in int8_kernel.ISAS if build.ISAS[name][1] <= cpu_info().flags]  # builds this CPU runs


class _Layer(torch.nn.Module):
    """What transformers' attention functions read off the attention module."""

    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups, self.is_causal = groups, True


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """The kernel built into an empty cache, forgotten again afterwards."""
    monkeypatch.setenv("SEMSPEC_CACHE_DIR", str(tmp_path))
    attention.attention_kernel.cache_clear()
    yield tmp_path / "kernels"
    attention.attention_kernel.cache_clear()


def _inputs(b: int, h: int, kv: int, d: int, t: int, dtype: torch.dtype, masked: bool, seed: int = 0):
    """query (B, H, 1, D); key and value (B, KV, T, D), the key a strided view into a longer cache; a
    bool mask (B, 1, 1, T) with row 0 attending nowhere when there are two rows or more."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, 1, d, generator=g).to(dtype)
    k = torch.randn(b, kv, t + 5, d, generator=g).to(dtype)[:, :, :t]  # (B, KV, T, D), not contiguous
    v = torch.randn(b, kv, t, d, generator=g).to(dtype)
    mask = None
    if masked:
        mask = torch.rand(b, 1, 1, t, generator=g) > 0.4
        mask[..., -1] = True
        if b > 1:
            mask[0] = False
    return q, k, v, mask


def _reference(q, k, v, mask) -> torch.Tensor:
    """float64 attention with the key/value heads repeated -> (B, 1, H, D)."""
    rep = q.shape[1] // k.shape[1]
    kk, vv = k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    scores = q.double() @ kk.transpose(-1, -2) / q.shape[-1] ** 0.5  # (B, H, 1, T)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    out = torch.softmax(scores, -1).nan_to_num(0.0) @ vv  # a row attending nowhere: zeros
    return out.transpose(1, 2)


@needs_build
@pytest.mark.parametrize("target", HERE)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "b, h, kv, d, t, masked",
    [(1, 14, 2, 64, 150, False), (1, 12, 2, 128, 37, False), (3, 4, 2, 20, 33, True), (2, 6, 6, 8, 5, True)],
)
def test_the_kernel_is_attention(fresh, monkeypatch, target, dtype, b, h, kv, d, t, masked):
    """Each build this CPU runs, grouped and plain heads, head dims and lengths off every vector width, a
    strided key cache, a padding mask (a row attending nowhere gets zeros); float32 to float32's
    rounding, bfloat16 to its own."""
    monkeypatch.setenv("SEMSPEC_KERNELS", target.lower())
    q, k, v, mask = _inputs(b, h, kv, d, t, dtype, masked)
    fns = attention.attention_kernel()
    assert fns is not None
    got, weights = attention.decode_attention(_Layer(h // kv), q, k, v, mask)
    assert weights is None and got.shape == (b, 1, h, d) and got.dtype == dtype
    want = _reference(q, k, v, mask)
    tol = 1e-5 if dtype == torch.float32 else 8e-3
    assert torch.allclose(got.double(), want, atol=tol, rtol=tol), (got.double() - want).abs().max()


@needs_build
def test_it_agrees_with_sdpa_where_both_run(fresh):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    q, k, v, mask = _inputs(2, 8, 2, 64, 90, torch.float32, masked=True, seed=1)
    mask[0, ..., :3] = True  # every row attends somewhere (SDPA gives NaN where none does)
    layer = _Layer(4)
    got, _ = attention.decode_attention(layer, q, k, v, mask)
    want, _ = sdpa_attention_forward(layer, q, k, v, mask)
    assert torch.allclose(got, want, atol=1e-5)


def test_calls_it_does_not_take_go_to_sdpa(monkeypatch):
    """Several queries (a prefill), a float mask, dropout or soft-capping keep transformers' SDPA path."""
    seen: list[str] = []

    def sdpa(module, query, *a, **kw):
        seen.append("sdpa")
        return torch.zeros(query.shape[0], query.shape[2], query.shape[1], query.shape[3]), None

    monkeypatch.setattr(attention, "sdpa_attention_forward", sdpa)
    q, k, v, _ = _inputs(1, 4, 2, 16, 10, torch.float32, masked=False)
    layer = _Layer(2)
    attention.decode_attention(layer, torch.cat([q, q], dim=2), k, v, None)
    attention.decode_attention(layer, q, k, v, torch.zeros(1, 1, 1, 10))
    attention.decode_attention(layer, q, k, v, None, dropout=0.1)
    attention.decode_attention(layer, q, k, v, None, softcap=30.0)
    attention.decode_attention(layer, q.half(), k.half(), v.half(), None)
    assert seen == ["sdpa"] * 5
    if BUILDABLE:
        attention.decode_attention(layer, q, k, v, None)
        assert len(seen) == 5, "one query per row, float32, no extras: the kernel"


def test_off_or_unbuildable_it_is_sdpa_with_a_warning(fresh, monkeypatch, caplog):
    monkeypatch.setenv("SEMSPEC_DECODE_ATTENTION", "0")
    assert attention.attention_kernel() is None
    monkeypatch.setenv("SEMSPEC_DECODE_ATTENTION", "auto")
    monkeypatch.setenv("CXX", "false")  # a compiler that fails at once
    reload_settings()
    attention.attention_kernel.cache_clear()
    with caplog.at_level(logging.WARNING, logger=attention.__name__):
        assert attention.attention_kernel() is None
    assert "decode attention kernel off" in caplog.text and "SDPA attends" in caplog.text
    q, k, v, mask = _inputs(2, 4, 2, 16, 12, torch.float32, masked=True)
    mask[0, ..., 0] = True
    got, _ = attention.decode_attention(_Layer(2), q, k, v, mask)  # still attends, through SDPA
    assert torch.allclose(got.double(), _reference(q, k, v, mask), atol=1e-5)


def test_a_bad_setting_names_the_variable(monkeypatch):
    from semspec.models.project.settings import Settings

    with pytest.raises(ValueError, match="SEMSPEC_DECODE_ATTENTION"):
        Settings.from_env({"SEMSPEC_DECODE_ATTENTION": "fast"})


def test_a_model_decodes_the_same_tokens_through_it_and_says_so():
    """float32 greedy decoding of a tiny model, one row and a padded batch, with and without the kernel."""
    from tests.helpers.tiny import tiny_lm

    lm = tiny_lm(init=0.2)
    assert lm.model.config._attn_implementation == attention.ATTENTION
    assert "decode attention:" in lm.describe()["why"]
    ids = lm.tokenizer(["3 + 4 = ", "12 * 3 - 5 = "], return_tensors="pt", padding=True)
    outs = {}
    for impl in ("sdpa", attention.ATTENTION):
        lm.model.set_attn_implementation(impl)
        with torch.inference_mode():
            outs[impl] = lm.model.generate(**ids, max_new_tokens=24, do_sample=False, pad_token_id=0)
    assert torch.equal(outs["sdpa"], outs[attention.ATTENTION])
