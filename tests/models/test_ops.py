"""The kernels' operators: a call the kernel would read out of bounds raises ``ValueError`` naming what is
wrong, before the kernel runs; a good call is the kernel's product."""

from __future__ import annotations

import pytest
import torch

from semspec.models.cpu import build, int4_kernel, int8_kernel, ops
from semspec.models.cpu.cpuinfo import cpu_info
from semspec.models.cpu.formats import quantize_int4

INT8 = build.isa(cpu_info().flags, int8_kernel.ISAS) is not None and build.compiler() is not None
INT4 = build.isa(cpu_info().flags, (int4_kernel.ISA,)) is not None and build.compiler() is not None


def _int8(n: int = 32, k: int = 64) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    q = int8_kernel.pack(torch.randint(-127, 128, (n, k), dtype=torch.int8))  # (N/8, K/16, 8, 16)
    return torch.randn(3, k).to(torch.bfloat16), q, (torch.rand(n) * 0.01).to(torch.bfloat16)


def _int4(n: int = 32, k: int = 64) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    q, sz, _ = quantize_int4(torch.randn(n, k))
    nibbles, packed = int4_kernel.pack(q, sz.to(torch.bfloat16))
    return torch.randn(3, k).to(torch.bfloat16), nibbles, packed


@pytest.mark.skipif(not INT8, reason="needs the int8 kernel (AVX2/FMA and a C++ compiler)")
def test_int8_mm_checks_its_tensors():
    x, q, s = _int8()
    assert torch.equal(ops.int8_mm(x, q, s), int8_kernel.int8_mm()(x, q, s))
    bad = {
        "x must be one of": (x.half(), q, s),
        "x must be \\(M, K\\)": (x[0], q, s),
        "x must be contiguous": (torch.randn(64, 3).to(torch.bfloat16).t(), q, s),
        "q must have shape": (torch.randn(3, 80).to(torch.bfloat16), q, s),  # K of another layer
        "q must be torch.int8": (x, q.to(torch.uint8), s),
        "scales must be torch.bfloat16": (x, q, s.float()),
        "scales must have shape": (x, q, s[:16]),
        "K must be a multiple of 16": (torch.randn(3, 63).to(torch.bfloat16), q, s),
    }
    for message, args in bad.items():
        with pytest.raises(ValueError, match=f"semspec::int8_mm: {message}"):
            ops.int8_mm(*args)


@pytest.mark.skipif(not INT4, reason="needs the int4 kernel (AVX512_BF16 and a C++ compiler)")
def test_int4_mm_checks_its_tensors():
    x, q, sz = _int4()
    assert torch.equal(ops.int4_mm(x, q, sz), int4_kernel.int4_mm()(x, q, sz))
    bad = {
        "x must be one of": (x.float(), q, sz),
        "q must have shape": (torch.randn(3, 96).to(torch.bfloat16), q, sz),
        "q must be torch.uint8": (x, q.to(torch.int8), sz),
        "q must be contiguous": (x, q.transpose(0, 1).contiguous().transpose(0, 1), sz),
        "scales_zeros must have shape": (x, q, sz[:1]),
        "K must be a multiple of 32": (torch.randn(3, 48).to(torch.bfloat16), q, sz),
    }
    for message, args in bad.items():
        with pytest.raises(ValueError, match=f"semspec::int4_mm: {message}"):
            ops.int4_mm(*args)
    with pytest.raises(NotImplementedError):  # another device: the dispatcher has no kernel for it
        ops.int4_mm(x.to("meta"), q.to("meta"), sz.to("meta"))


def test_the_operators_are_registered_with_torch():
    assert torch.ops.semspec.int8_mm is ops.int8_mm and torch.ops.semspec.int4_mm is ops.int4_mm
    assert "CPU" in torch._C._dispatch_dump("semspec::int4_mm")
