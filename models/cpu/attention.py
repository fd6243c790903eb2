"""Attention for decoding calls on CPU: one query per row, without SDPA's per-call cost.

A decode token attends with one query per row over the whole cache. PyTorch's CPU SDPA runs that through
its flash-attention kernel, built for many queries, whose fixed cost per call is far above the few
microseconds of arithmetic (``docs/formats.md`` has the measurements). Here such a
call runs a small C++ kernel (built and cached like the int8 kernel, ``models/cpu/int8_kernel.py``): per
head, the scores against every cached key in float32, a softmax, and the weighted sum of the values in
float32 (as the flash kernel accumulates), rounded once to the activation dtype; grouped-query heads read
their key/value head in place (no ``repeat_kv`` copy) and the cache may be strided.
``benchmarks/formats.py attention`` measures both.

Every other call (several queries: prompts, a step's verification prefill; a GPU; dropout, soft-capping,
attention sinks, a position bias, a float mask; a dtype other than bfloat16 or float32) goes to
transformers' SDPA function unchanged, so prefill numerics stay as they were; so does every call where the
kernel cannot be built (no compiler, no AVX2/FMA; logged once) or ``SEMSPEC_DECODE_ATTENTION=0``.
Registered in transformers' attention and mask interfaces as ``ATTENTION``; ``use_decode_attention``
switches a loaded model to it.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Callable

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from semspec.models.cpu import build
from semspec.models.project.settings import settings

log = logging.getLogger(__name__)

ATTENTION = "semspec_decode"
# keyword arguments that change attention itself: a call carrying any of them keeps SDPA's path
_SPECIAL = ("softcap", "s_aux", "sinks", "position_bias")
MAX_DIM = 1024  # head dims the kernel takes (its per-thread buffers are sized by the call)

SOURCE = "attention.cpp"  # in csrc/
ISAS = ("AVX512", "AVX2")  # its builds, best first (models/cpu/build.py)

_P = ctypes.c_void_p
_ARGS = [_P, _P, _P, _P, _P, _P, _P] + [ctypes.c_int64] * 5 + [ctypes.c_float, ctypes.c_int]
_STRIDES = ctypes.c_int64 * 3


@functools.cache
def attention_kernel() -> dict[torch.dtype, Callable] | None:
    """The built kernel's functions by activation dtype, or None where it is off
    (``SEMSPEC_DECODE_ATTENTION=0``) or cannot be built here (then SDPA serves every call). The build
    follows ``SEMSPEC_KERNELS`` (``off`` turns it off too). Built once per process."""
    if settings().decode_attention == "0":
        return None
    got = build.load_best("attend", SOURCE, ISAS, "decode attention", "SDPA attends")
    if got is None:
        return None
    dll = got[0]
    fns = {torch.bfloat16: dll.semspec_attend_bf16, torch.float32: dll.semspec_attend_f32}
    for fn in fns.values():
        fn.argtypes, fn.restype = _ARGS, None
    return fns


def _kernel_for(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None):
    """The kernel function for this call, or None when the call is not one it takes."""
    if query.shape[2] != 1 or query.device.type != "cpu" or query.shape[-1] > MAX_DIM:
        return None
    if not (query.dtype == key.dtype == value.dtype) or key.shape[-1] != value.shape[-1]:
        return None
    if query.shape[1] % key.shape[1] or key.stride(-1) != 1 or value.stride(-1) != 1:
        return None
    if mask is not None and mask.dtype != torch.bool:
        return None
    fns = attention_kernel()
    return None if fns is None else fns.get(query.dtype)


def decode_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: query (B, H, Q, D), key and value (B, KV, T, D), the
    mask ``sdpa_mask`` makes (bool (B|1, 1, Q, T), True = attend, or None) -> ((B, Q, H, D), None).
    One query per row on CPU runs the kernel; anything else goes to ``sdpa_attention_forward``."""
    fn = None
    if not dropout and not any(kwargs.get(k) is not None for k in _SPECIAL):
        fn = _kernel_for(query, key, value, attention_mask)
    if fn is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    batch, heads, _, dim = query.shape
    kv_len = key.shape[2]
    q = query.reshape(batch, heads, dim).contiguous()  # (B, H, D)
    mask = None
    if attention_mask is not None:  # (B|1, 1, 1, T') -> (B, T) bytes
        mask = attention_mask[:, 0, -1, :kv_len].expand(batch, kv_len).contiguous()
    out = torch.empty(batch, heads, dim, dtype=query.dtype)  # (B, H, D)
    scale = dim**-0.5 if scaling is None else scaling
    attend(fn, q, key, value, out, scale, torch.get_num_threads(), mask)
    return out.view(batch, 1, heads, dim), None  # (B, 1, H, D)


def attend(
    fn: Callable,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    scaling: float,
    threads: int,
    mask: torch.Tensor | None = None,
) -> None:
    """The kernel ``fn`` (``attention_kernel()[dtype]``) called directly, no checks: one query per row,
    query (B, H, D) or (B, H, 1, D) contiguous, key and value (B, KV, T, D) with unit last strides, mask
    (B, T) bool contiguous or None -> ``out`` (B, H * D)."""
    batch, heads, dim = query.shape[0], query.shape[1], query.shape[-1]
    fn(
        query.data_ptr(), key.data_ptr(), value.data_ptr(),
        _STRIDES(*key.stride()[:3]), _STRIDES(*value.stride()[:3]),
        None if mask is None else mask.data_ptr(), out.data_ptr(),
        batch, heads, key.shape[1], key.shape[2], dim, scaling, threads,
    )  # fmt: skip


AttentionInterface.register(ATTENTION, decode_attention)
AttentionMaskInterface.register(ATTENTION, sdpa_mask)


def use_decode_attention(model: PreTrainedModel) -> bool:
    """Switch ``model`` to ``decode_attention`` where it runs SDPA (the default); True when switched. A
    model on another implementation (eager, flash, a remote-code model's own) is left as it is."""
    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return False
    model.set_attn_implementation(ATTENTION)
    return model.config._attn_implementation == ATTENTION


def describe(model: PreTrainedModel) -> str:
    """Which attention decodes ``model``, for a person reading a figure."""
    impl = getattr(model.config, "_attn_implementation", None)
    if impl != ATTENTION:
        return f"attention: {impl}"
    return "decode attention: " + ("semspec's kernel" if attention_kernel() else "SDPA (kernel off)")
