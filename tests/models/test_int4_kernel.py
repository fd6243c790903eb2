"""The int4 kernel, both builds (AVX512_BF16, and AVX2: on an AVX-512 CPU forced with
``SEMSPEC_KERNELS=avx2``): the product of the int4 format's weights, PyTorch's op where it cannot run, and
the quantized layer's routing of few-row calls to it."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from semspec.models.cpu import build, int4_kernel
from semspec.models.cpu.cpuinfo import cpu_info
from semspec.models.cpu.formats import Format, QuantLinear, _dequantize, quantize_int4

BF16 = int4_kernel.CPU_FLAGS.issubset(cpu_info().flags) and build.compiler() is not None
RUNS = build.ISAS["AVX2"][1].issubset(cpu_info().flags) and build.compiler() is not None
needs_kernel = pytest.mark.skipif(not RUNS, reason="needs an AVX2 CPU and a C++ compiler")
INT4 = Format("int4", torch.bfloat16, dense_rows=8, dense_copy=True)
BUILDS = [
    pytest.param("AVX512_BF16", marks=pytest.mark.skipif(not BF16, reason="needs an AVX512_BF16 CPU")),
    pytest.param("AVX2", marks=needs_kernel),
]


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """A kernel built into an empty cache, forgotten again afterwards."""
    monkeypatch.setenv("SEMSPEC_CACHE_DIR", str(tmp_path))
    built = int4_kernel.int4_mm  # a test may replace it
    built.cache_clear()
    yield tmp_path / "kernels"
    built.cache_clear()


@pytest.fixture(params=BUILDS)
def isa(request, fresh, monkeypatch):
    """Each build this CPU runs: AVX2 through ``SEMSPEC_KERNELS=avx2`` where the CPU has more."""
    from semspec.models.project.settings import reload_settings

    if request.param == "AVX2":
        monkeypatch.setenv("SEMSPEC_KERNELS", "avx2")
    reload_settings()
    yield request.param
    monkeypatch.delenv("SEMSPEC_KERNELS", raising=False)
    reload_settings()


def _weights(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q (N, K), (scale, zero) per group (bfloat16 values) and the weights they mean, float64 (N, K)."""
    torch.manual_seed(seed)
    q, sz, _ = quantize_int4(torch.randn(n, k))
    sz = sz.to(torch.bfloat16)
    return q, sz, _dequantize(q, sz.float()).double()


@pytest.mark.parametrize(
    "m, k, n",
    [
        (1, 32, 16),
        (2, 64, 32),
        (3, 896, 1152),
        (4, 160, 48),
        (5, 96, 16),
        (8, 1536, 256),
        (13, 96, 48),
        (48, 896, 160),
        (9, 1536, 16),
    ],
)
def test_the_kernel_is_the_int4_product(isa, m, k, n):
    """The smallest packed shape, each row count the streaming path takes (1-3), the tiles' (4 and more:
    a whole tile of 8, 13 = 8 + 5, 48 = 6 tiles), channel blocks in pairs and one left over (48, 160, 16
    channels), widths that are not multiples of 64, the Qwen layers' own: one bfloat16 rounding off the
    exact product (the AVX2 build: of the exact product with its int8 activations, and within their
    error of x's)."""
    kernel = int4_kernel.int4_mm()
    assert kernel is not None and kernel.isa == isa
    q, sz, w = _weights(n, k, m * k + n)
    x = torch.randn(m, k).to(torch.bfloat16)
    y = kernel(x, *int4_kernel.pack(q, sz))
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    read = x.double() if isa == int4_kernel.ISA else int4_kernel.quantize_activations(x).double()
    want = read @ w.t()  # (M, N)
    err = ((y.double() - want).abs() / want.abs().clamp_min(float(want.abs().mean()))).max()
    assert float(err) < 2**-8, f"relative error {float(err):.2e}"
    exact = x.double() @ w.t()
    assert float((y.double() - exact).norm() / exact.norm()) < 1e-2


def test_packing_keeps_every_weight_and_refuses_a_shape_it_cannot_take():
    q, sz, _ = _weights(48, 96, 0)
    nibbles, packed_sz = int4_kernel.pack(q, sz)
    assert nibbles.shape == (3, 3, 8, 32) and nibbles.dtype == torch.uint8
    back_q, back_sz = int4_kernel.unpack(nibbles, packed_sz)
    assert torch.equal(back_q, q) and torch.equal(back_sz, sz)
    for shape in ((24, 64), (32, 48)):
        with pytest.raises(ValueError, match="N must divide by 16, K by 32"):
            int4_kernel.pack(torch.zeros(shape, dtype=torch.int32), torch.zeros(shape[1] // 16, shape[0], 2))


def test_it_agrees_with_pytorchs_op(isa):
    q, sz, _ = _weights(256, 1536, 1)
    x = torch.randn(3, 1536).to(torch.bfloat16)
    ours = int4_kernel.int4_mm()(x, *int4_kernel.pack(q, sz)).float()
    theirs = torch.ops.aten._weight_int4pack_mm_for_cpu(
        x, torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1), 32, sz
    ).float()
    assert float((ours - theirs).norm() / theirs.norm()) < (5e-3 if isa == int4_kernel.ISA else 1e-2)


def test_a_quantized_layer_sends_its_int4_calls_to_the_kernel(isa, monkeypatch):
    torch.manual_seed(2)
    layer = QuantLinear(nn.Linear(64, 48), INT4)
    assert layer.packed and "int4, packed" in repr(layer)
    calls = []
    real = int4_kernel.int4_mm()
    monkeypatch.setattr(int4_kernel, "int4_mm", lambda: lambda *a: calls.append(1) or real(*a))
    x = torch.randn(9, 64).to(torch.bfloat16)
    few, many = layer(x[:8]), layer(x)  # 8 rows: the kernel; 9: the dense copy
    assert len(calls) == 1
    # both paths multiply by the same weights: rows agree within the bfloat16 roundings
    assert float((few.float() - many[:8].float()).abs().max()) < 2e-2 * float(many.float().abs().max())


def test_a_packed_layer_turned_off_after_loading_still_multiplies(isa, monkeypatch):
    torch.manual_seed(4)
    layer = QuantLinear(nn.Linear(64, 32, bias=False), INT4)
    x = torch.randn(2, 64).to(torch.bfloat16)
    on = layer(x).float()
    monkeypatch.setattr(int4_kernel, "int4_mm", lambda: None)
    off = layer(x).float()
    assert float((on - off).abs().max()) < 2e-2 * float(on.abs().max())


def test_without_the_kernel_int4_keeps_pytorchs_layout(fresh, monkeypatch):
    """Turned off (or a CPU without AVX512_BF16): PyTorch's packing and op, the same products."""
    monkeypatch.setenv("SEMSPEC_KERNELS", "off")
    from semspec.models.project.settings import reload_settings

    reload_settings()
    try:
        assert int4_kernel.int4_mm() is None
        torch.manual_seed(5)
        layer = QuantLinear(nn.Linear(64, 32), INT4)
        assert not layer.packed and layer.qweight.dim() == 2  # PyTorch's packing, not (N/16, K/32, 8, 32)
        y = layer(torch.randn(2, 64).to(torch.bfloat16))
        assert y.shape == (2, 32) and torch.isfinite(y.float()).all()
    finally:
        monkeypatch.delenv("SEMSPEC_KERNELS")
        reload_settings()


@needs_kernel
def test_a_failed_build_is_off_with_a_warning(fresh, monkeypatch, caplog):
    def broken(*a, **kw):
        raise RuntimeError("g++ failed to build the int4_mm kernel: boom")

    monkeypatch.setattr(build, "build", broken)
    with caplog.at_level(logging.WARNING):
        assert int4_kernel.int4_mm() is None
    assert "int4 kernel off: g++ failed" in caplog.text


def test_an_int4_model_says_which_kernel_decodes(fresh):
    from semspec.models.cpu.formats import quantize_model
    from semspec.models.lm import LM, install_kernels
    from tests.helpers.tiny import tiny_lm

    base = tiny_lm(init=0.2, hidden=64)
    model = base.model.to(torch.bfloat16)
    quantize_model(model, INT4)
    why = LM(install_kernels(model), base.tokenizer, base.config, INT4).describe()["why"]
    best = "AVX512_BF16" if BF16 else "AVX2, int8 activations per 32"
    kernel = f"semspec's int4 kernel ({best}, packed weights)" if RUNS else "_weight_int4pack_mm_for_cpu"
    assert f"int4 calls: {kernel}" in why
