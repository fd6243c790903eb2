"""semspec's matrix-product kernels as torch operators: ``torch.ops.semspec.int8_mm`` and
``torch.ops.semspec.int4_mm``.

The kernels read raw memory: a tensor of the wrong dtype, shape or layout would make them read past its
end, which in a Ray actor or the server is a crash with no message. So every call goes through an
operator that checks its tensors first (device, dtype, dimensions, the packed layout's block sizes, the
widths agreeing, contiguity) and raises ``ValueError`` naming what is wrong. The operators are registered
with ``torch.library`` for the CPU; a plain ``Library`` implementation (not ``custom_op``) keeps the
dispatcher's cost per call to a few microseconds, which matters for decoding's many small calls.
"""

from __future__ import annotations

import torch

from semspec.models.cpu import int4_kernel, int8_kernel

_LIB = torch.library.Library("semspec", "DEF")
_LIB.define("int8_mm(Tensor x, Tensor q, Tensor scales) -> Tensor")
_LIB.define("int4_mm(Tensor x, Tensor q, Tensor scales_zeros) -> Tensor")


def _require(ok: bool, op: str, what: str) -> None:
    if not ok:
        raise ValueError(f"semspec::{op}: {what}")


def _check_x(op: str, x: torch.Tensor, dtypes: tuple[torch.dtype, ...]) -> None:
    _require(x.device.type == "cpu", op, f"x must be on the CPU, got {x.device}")
    _require(x.dim() == 2, op, f"x must be (M, K), got shape {tuple(x.shape)}")
    _require(x.dtype in dtypes, op, f"x must be one of {dtypes}, got {x.dtype}")
    _require(x.is_contiguous(), op, "x must be contiguous")


def _check_packed(op: str, t: torch.Tensor, name: str, dtype: torch.dtype, shape: tuple) -> None:
    """``t`` has ``dtype`` and ``shape`` (None: any size), contiguous on the CPU."""
    _require(
        t.device.type == "cpu" and t.dtype == dtype, op, f"{name} must be {dtype} on the CPU, got {t.dtype}"
    )
    fits = t.dim() == len(shape) and all(s is None or s == d for s, d in zip(shape, t.shape, strict=True))
    _require(fits, op, f"{name} must have shape {shape} (None: any), got {tuple(t.shape)}")
    _require(t.is_contiguous(), op, f"{name} must be contiguous")


def _int8_mm(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """(x (M, K) @ w.T) * scales -> (M, N) in x's dtype, for ``int8_kernel.pack``'s q (N/8, K/16, 8, 16)."""
    _check_x("int8_mm", x, (torch.bfloat16, torch.float32))
    j, c = int8_kernel.PACK
    _require(x.shape[1] % c == 0, "int8_mm", f"K must be a multiple of {c}, got {x.shape[1]}")
    _check_packed("int8_mm", q, "q", torch.int8, (None, x.shape[1] // c, j, c))
    _check_packed("int8_mm", scales, "scales", x.dtype, (q.shape[0] * j,))
    kernel = int8_kernel.int8_mm()
    if kernel is None:
        raise RuntimeError(
            "semspec::int8_mm: the int8 kernel is off here (SEMSPEC_KERNELS, the CPU or no compiler)"
        )
    return kernel(x, q, scales)


def _int4_mm(x: torch.Tensor, q: torch.Tensor, sz: torch.Tensor) -> torch.Tensor:
    """x (M, K) @ w.T -> (M, N) bfloat16, for ``int4_kernel.pack``'s nibbles (N/16, K/32, 8, 32) and
    scales and zeros (N/16, K/32, 2, 16)."""
    _check_x("int4_mm", x, (torch.bfloat16,))
    g, b = int4_kernel.GROUP, int4_kernel.BLOCK
    _require(x.shape[1] % g == 0, "int4_mm", f"K must be a multiple of {g}, got {x.shape[1]}")
    _check_packed("int4_mm", q, "q", torch.uint8, (None, x.shape[1] // g, g // 4, 2 * b))
    _check_packed("int4_mm", sz, "scales_zeros", torch.bfloat16, (q.shape[0], q.shape[1], 2, b))
    kernel = int4_kernel.int4_mm()
    if kernel is None:
        raise RuntimeError(
            "semspec::int4_mm: the int4 kernel is off here (SEMSPEC_KERNELS, the CPU or no compiler)"
        )
    return kernel(x, q, sz)


_LIB.impl("int8_mm", _int8_mm, "CPU")
_LIB.impl("int4_mm", _int4_mm, "CPU")
int8_mm = torch.ops.semspec.int8_mm
int4_mm = torch.ops.semspec.int4_mm
