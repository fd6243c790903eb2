"""The int8 decode kernel: the same products as float arithmetic, PyTorch's op where it cannot run, and the
quantized layer's routing of few-row calls to it."""

from __future__ import annotations

import logging

import pytest
import torch

from semspec.models.cpu import build, int8_kernel
from semspec.models.cpu.cpuinfo import cpu_info
from semspec.models.cpu.formats import Format, QuantLinear, quantize_model

BUILDABLE = build.isa(cpu_info().flags, int8_kernel.ISAS) is not None and build.compiler() is not None
needs_build = pytest.mark.skipif(not BUILDABLE, reason="needs an AVX2/FMA CPU and a C++ compiler")
HERE = [name for name in int8_kernel.ISAS if build.ISAS[name][1] <= cpu_info().flags]  # builds this CPU runs


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """A kernel built into an empty cache, forgotten again afterwards."""
    monkeypatch.setenv("SEMSPEC_CACHE_DIR", str(tmp_path))
    int8_kernel.int8_mm.cache_clear()
    yield tmp_path / "kernels"
    int8_kernel.int8_mm.cache_clear()


def _reference(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return (x.double() @ q.double().t()) * scales.double()  # (M, N)


@needs_build
@pytest.mark.parametrize("target", HERE)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "m, k, n", [(1, 16, 8), (2, 48, 24), (3, 896, 1536), (5, 32, 16), (1, 1536, 8960), (64, 80, 40)]
)
def test_the_kernel_is_the_int8_product(fresh, monkeypatch, target, dtype, m, k, n):
    """Each build this CPU runs, on the smallest packed shape, odd row counts (pairs of rows and a single
    one), K not a multiple of 32 or 64, the Qwen layers' own and a prompt's many rows; float32 to float32's
    rounding, bfloat16 to one bfloat16 rounding."""
    monkeypatch.setenv("SEMSPEC_KERNELS", target.lower())
    kernel = int8_kernel.int8_mm()
    assert kernel is not None and kernel.isa == target
    torch.manual_seed(m * k + n)
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    scales, x = (torch.rand(n) * 0.01 + 1e-3).to(dtype), torch.randn(m, k).to(dtype)
    y = kernel(x, int8_kernel.pack(q), scales)
    assert y.shape == (m, n) and y.dtype == dtype
    want = _reference(x, q, scales)
    tol = 1e-5 if dtype == torch.float32 else 2**-8  # bfloat16 keeps 8 significant bits
    err = ((y.double() - want).abs() / want.abs().clamp_min(float(want.abs().mean()))).max()
    assert float(err) < tol, f"relative error {float(err):.2e}"


@needs_build
@pytest.mark.parametrize("target", HERE)
@pytest.mark.parametrize("k", [1536, 8960])
def test_a_rows_result_is_the_same_alone_in_a_tile_or_in_a_later_chunk_of_rows(fresh, monkeypatch, target, k):
    """One row alone streams the weights; among 40 it runs in tiles of rows, in chunks of rows that fit a
    core's cache (a handful of rows at K=8960, so several chunks and a row left over): every output is
    summed in the same order, bit for bit, and is the int8 product."""
    monkeypatch.setenv("SEMSPEC_KERNELS", target.lower())
    kernel = int8_kernel.int8_mm()
    torch.manual_seed(k)
    q, scales = torch.randint(-127, 128, (24, k), dtype=torch.int8), torch.rand(24) * 0.01 + 1e-3
    x = torch.randn(40, k)  # (M, K)
    packed = int8_kernel.pack(q)
    many = kernel(x, packed, scales)  # (40, 24)
    for row in (0, 2, 13, 38, 39):
        assert torch.equal(kernel(x[row : row + 1], packed, scales)[0], many[row]), f"row {row}"
    assert torch.equal(kernel(x[:5], packed, scales), many[:5]), "a tile and a streamed pair of rows"
    assert torch.allclose(many.double(), _reference(x, q, scales), rtol=1e-5, atol=1e-5 * k**0.5)


@needs_build
def test_it_agrees_with_pytorchs_op_on_a_model_layer(fresh):
    kernel = int8_kernel.int8_mm()
    torch.manual_seed(0)
    q = torch.randint(-127, 128, (512, 1536), dtype=torch.int8)
    scales, x = (torch.rand(512) * 0.01).to(torch.bfloat16), torch.randn(4, 1536).to(torch.bfloat16)
    ours = kernel(x, int8_kernel.pack(q), scales).float()
    theirs = torch.ops.aten._weight_int8pack_mm(x, q, scales).float()
    assert float((ours - theirs).abs().max() / theirs.abs().max()) < 2e-2  # both round to bfloat16


def test_a_failed_build_falls_back_to_pytorch_with_a_warning(fresh, monkeypatch, caplog):
    monkeypatch.setenv("CXX", "false")  # a compiler that fails at once
    with caplog.at_level(logging.WARNING):
        got = int8_kernel.int8_mm()
    assert got is None
    assert "int8 kernel off" in caplog.text and "_weight_int8pack_mm decodes" in caplog.text
    assert not list(fresh.glob("*.so")), "no library left by a failed build"
    assert not [p for p in fresh.iterdir() if p.is_dir()], "nor a temporary folder"
    layer = QuantLinear(torch.nn.Linear(64, 16), Format("int8", torch.bfloat16))
    assert not layer.packed, "PyTorch's layout where the kernel is off"
    x = torch.randn(1, 64).to(torch.bfloat16)  # still decodes, through PyTorch's op
    want = torch.ops.aten._weight_int8pack_mm(x, layer.qweight, layer.scales) + layer.bias
    assert torch.equal(layer(x), want)


def test_it_can_be_turned_off(fresh, monkeypatch):
    monkeypatch.setenv("SEMSPEC_KERNELS", "off")
    assert int8_kernel.int8_mm() is None


def test_a_quantized_layer_sends_its_int8_calls_to_the_kernel(monkeypatch):
    calls: list[int] = []

    class Spy(int8_kernel._Kernel):
        def __call__(self, x, q, scales):
            calls.append(x.shape[0])
            return torch.ops.aten._weight_int8pack_mm(x, int8_kernel.unpack(q), scales)

    monkeypatch.setattr(int8_kernel, "int8_mm", lambda: Spy({}, "AVX512"))
    layer = QuantLinear(
        torch.nn.Linear(64, 16), Format("int8", torch.bfloat16, dense_rows=8, dense_copy=True)
    )
    assert layer.packed and layer.qweight.shape == (2, 4, 8, 16)
    for rows in (1, 2, 3, 12):  # 12: dense
        layer(torch.randn(rows, 64).to(torch.bfloat16))
    assert calls == [1, 2, 3], "the kernel for every call of up to dense_rows rows, a dense GEMM above"
    odd = QuantLinear(torch.nn.Linear(48, 12), Format("int8", torch.bfloat16, dense_rows=8, dense_copy=True))
    assert not odd.packed and odd.qweight.shape == (12, 48), "12 outputs: a shape the layout does not take"
    x = torch.randn(1, 48).to(torch.bfloat16)
    assert torch.equal(odd(x), torch.ops.aten._weight_int8pack_mm(x, odd.qweight, odd.scales) + odd.bias)
    assert calls == [1, 2, 3], "PyTorch's op serves it"


@pytest.mark.parametrize("width", [8, 24, 40, 100])
def test_an_input_width_no_int8_kernel_takes_stays_dense(width):
    # PyTorch's op, the only other int8 kernel, returns garbage or NaN for such a width and crashes on
    # several rows (torch 2.13, CPU): such a layer is refused, and a model keeps it dense
    fmt = Format("int8", torch.bfloat16, dense_rows=8, dense_copy=True)
    with pytest.raises(
        ValueError, match=f"{width} -> 16 linear layer: int8 needs an input width that is a multiple of 16"
    ):
        QuantLinear(torch.nn.Linear(width, 16), fmt)
    model = torch.nn.Sequential(torch.nn.Linear(width, 32), torch.nn.Linear(32, 16))
    assert quantize_model(model, fmt) == 1
    assert type(model[0]) is torch.nn.Linear and isinstance(model[1], QuantLinear)


def test_packing_keeps_every_weight_and_refuses_a_shape_it_cannot_take():
    q = torch.randint(-127, 128, (24, 48), dtype=torch.int8)
    packed = int8_kernel.pack(q)
    assert packed.shape == (3, 3, 8, 16)
    assert torch.equal(packed[1, 2], q[8:16, 32:48]), "block 1 (channels 8-15), chunk 2 (inputs 32-47)"
    assert torch.equal(int8_kernel.unpack(packed), q)
    with pytest.raises(ValueError, match=r"shape \(24, 40\) cannot be packed: N must divide by 8, K by 16"):
        int8_kernel.pack(q[:, :40])
    kernel = int8_kernel._Kernel({}, "AVX2")
    with pytest.raises(ValueError, match=r"takes weights from pack\(\) for K=48, got shape \(24, 48\)"):
        kernel(torch.zeros(1, 48), q, torch.ones(24))  # PyTorch's layout, not the kernel's


def test_a_packed_layer_turned_off_after_loading_still_multiplies(fresh, monkeypatch):
    if not BUILDABLE:
        pytest.skip("needs an AVX2/FMA CPU and a C++ compiler")
    layer = QuantLinear(
        torch.nn.Linear(64, 16), Format("int8", torch.bfloat16, dense_rows=8, dense_copy=True)
    )
    assert layer.packed
    x = torch.randn(2, 64).to(torch.bfloat16)
    on = layer(x)
    with monkeypatch.context() as patched:  # undone before `fresh` forgets the kernel
        patched.setattr(int8_kernel, "int8_mm", lambda: None)  # as a benchmark turning the kernel off
        off = layer(x)
    want = torch.ops.aten._weight_int8pack_mm(x, layer.int8_weight(), layer.scales) + layer.bias
    assert torch.equal(off, want)
    assert float((on.float() - off.float()).abs().max()) <= 2e-2 * float(off.float().abs().max())
    assert torch.equal(layer.dequantized(), layer.int8_weight().float() * layer.scales.float()[:, None])


def test_an_int8_model_says_which_kernel_decodes(monkeypatch):
    from semspec.models.lm import LM
    from tests.helpers.tiny import tiny_lm

    base = tiny_lm()
    lm = LM(
        base.model, base.tokenizer, base.config, Format("int8", torch.bfloat16, dense_rows=4, dense_copy=True)
    )
    monkeypatch.setattr(int8_kernel, "int8_mm", lambda: None)
    assert "; int8 calls: PyTorch's _weight_int8pack_mm;" in lm.describe()["why"]
    monkeypatch.setattr(int8_kernel, "int8_mm", lambda: int8_kernel._Kernel({}, "AVX2"))
    assert "; int8 calls: semspec's int8 kernel (AVX2, packed weights);" in lm.describe()["why"]
    assert "int8 kernel" not in base.describe()["why"], "a float32 model names no int8 kernel"


def test_a_build_the_cpu_cannot_run_is_off_and_says_which(fresh, monkeypatch, caplog):
    from semspec.models.cpu import cpuinfo

    monkeypatch.setattr(cpuinfo, "cpu_info", lambda: cpuinfo.CpuInfo("AVX2", frozenset({"avx2", "fma"})))
    monkeypatch.setenv("SEMSPEC_KERNELS", "avx512")
    with caplog.at_level(logging.WARNING, logger=int8_kernel.__name__):
        assert int8_kernel.int8_mm() is None
    assert "the CPU lacks what the avx512 build needs" in caplog.text
