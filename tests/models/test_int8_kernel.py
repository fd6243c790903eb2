"""The int8 decode kernel: the same products as float arithmetic, PyTorch's op where it cannot run, and the
quantized layer's routing of few-row calls to it."""

from __future__ import annotations

import logging

import pytest
import torch

from semspec.models import int8_kernel
from semspec.models.formats import Format, QuantLinear, cpu_info

BUILDABLE = int8_kernel.NEEDS <= cpu_info().flags and int8_kernel.compiler() is not None
needs_build = pytest.mark.skipif(not BUILDABLE, reason="needs an AVX2/FMA CPU and a C++ compiler")


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """A kernel built into an empty cache, forgotten again afterwards."""
    monkeypatch.setenv("SEMSPEC_KERNEL_CACHE", str(tmp_path))
    int8_kernel.int8_mm.cache_clear()
    yield tmp_path
    int8_kernel.int8_mm.cache_clear()


def _reference(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return (x.double() @ q.double().t()) * scales.double()  # (M, N)


@needs_build
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m, k, n", [(1, 37, 5), (2, 64, 7), (3, 896, 1536), (4, 33, 3), (1, 1536, 8960)])
def test_the_kernel_is_the_int8_product(fresh, dtype, m, k, n):
    """Shapes off every vector width (K not a multiple of 8 or 32, N odd) and the Qwen layers' own; float32
    to float32's rounding, bfloat16 to one bfloat16 rounding of the output."""
    kernel = int8_kernel.int8_mm()
    assert kernel is not None
    torch.manual_seed(m * k + n)
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    scales, x = (torch.rand(n) * 0.01 + 1e-3).to(dtype), torch.randn(m, k).to(dtype)
    y = kernel(x, q, scales)
    assert y.shape == (m, n) and y.dtype == dtype
    want = _reference(x, q, scales)
    tol = 1e-5 if dtype == torch.float32 else 2**-8  # bfloat16 keeps 8 significant bits
    err = ((y.double() - want).abs() / want.abs().clamp_min(float(want.abs().mean()))).max()
    assert float(err) < tol, f"relative error {float(err):.2e}"


@needs_build
def test_it_agrees_with_pytorchs_op_on_a_model_layer(fresh):
    kernel = int8_kernel.int8_mm()
    torch.manual_seed(0)
    q = torch.randint(-127, 128, (512, 1536), dtype=torch.int8)
    scales, x = (torch.rand(512) * 0.01).to(torch.bfloat16), torch.randn(4, 1536).to(torch.bfloat16)
    ours, theirs = kernel(x, q, scales).float(), torch.ops.aten._weight_int8pack_mm(x, q, scales).float()
    assert float((ours - theirs).abs().max() / theirs.abs().max()) < 2e-2  # both round to bfloat16


@needs_build
def test_it_is_built_once_and_kept(fresh):
    cxx = int8_kernel.compiler()
    lib = int8_kernel.build(cxx, fresh)
    stamp = lib.stat().st_mtime_ns
    assert int8_kernel.build(cxx, fresh) == lib and lib.stat().st_mtime_ns == stamp
    assert [p.name for p in fresh.iterdir()] == [lib.name], "no temporary left beside it"


def test_a_failed_build_falls_back_to_pytorch_with_a_warning(fresh, monkeypatch, caplog):
    monkeypatch.setenv("CXX", "false")  # a compiler that fails at once
    with caplog.at_level(logging.WARNING, logger=int8_kernel.__name__):
        got = int8_kernel.int8_mm()
    assert got is None
    assert "int8 kernel off" in caplog.text and "_weight_int8pack_mm decodes" in caplog.text
    assert not list(fresh.glob("*.so")), "no library left by a failed build"
    layer = QuantLinear(torch.nn.Linear(64, 16), Format("int8", torch.bfloat16))
    x = torch.randn(1, 64).to(torch.bfloat16)  # still decodes, through PyTorch's op
    want = torch.ops.aten._weight_int8pack_mm(x, layer.qweight, layer.scales) + layer.bias
    assert torch.equal(layer(x), want)


def test_it_can_be_turned_off(fresh, monkeypatch):
    monkeypatch.setenv("SEMSPEC_INT8_KERNEL", "0")
    assert int8_kernel.int8_mm() is None


def test_a_quantized_layer_sends_decoding_calls_to_the_kernel(monkeypatch):
    calls: list[int] = []

    def spy(x, q, scales):
        calls.append(x.shape[0])
        return torch.ops.aten._weight_int8pack_mm(x, q, scales)

    monkeypatch.setattr(int8_kernel, "int8_mm", lambda: spy)
    layer = QuantLinear(torch.nn.Linear(64, 16), Format("int8", torch.bfloat16, dense_rows=8))
    for rows in (1, int8_kernel.MAX_ROWS, int8_kernel.MAX_ROWS + 1, 12):  # 12: dense
        layer(torch.randn(rows, 64).to(torch.bfloat16))
    assert calls == [1, int8_kernel.MAX_ROWS], "the kernel for up to MAX_ROWS rows, PyTorch's op above"
