"""Numeric formats a model runs in, chosen for the CPU at hand, and the weight-only quantized layers.

A model config's ``dtype`` names a format:

* ``float32``, ``float16``, ``bfloat16``: dense weights and activations in that dtype;
* ``int8``: weight-only int8 linear layers (symmetric, one scale per output channel), bfloat16
  activations; int8 calls through semspec's kernel (``models/cpu/int8_kernel.py``, near the memory bandwidth,
  on weights packed for it) where it runs and the shape fits its layout, else through
  ``torch.ops.aten._weight_int8pack_mm``;
* ``int4``: weight-only int4 linear layers (asymmetric, one scale and zero per 32 input channels),
  bfloat16 activations; int4 calls through semspec's int4 kernel (``models/cpu/int4_kernel.py``, on weights
  packed for it) where the CPU has AVX512_BF16, else through ``torch.ops.aten._weight_int4pack_mm_for_cpu``;
* ``auto``: the fastest correct format for the device (``resolve_format``, a documented rule).

A quantized layer runs a call with few rows (one decode token per row) through its int kernel, which
reads half (int8) or a quarter (int4) of bfloat16's bytes: decoding is bound by reading the weights. A
call with many rows (a prompt, a step's verification prefill) is compute-bound. The int4 kernel has
register tiles for those (``int4_kernel``), close to a dense bfloat16 GEMM, so int4 runs every call from
its int weights and keeps no dense copy, except with AMX, whose bfloat16 GEMM is several times faster:
there calls above 6 rows run on a bfloat16 copy of the dequantized weights. The int8 kernel's many-row calls
run register tiles too (3 rows share each widened weight vector, the rows taken in chunks that stay in
cache), and without native bfloat16 int8 runs every call through them: no call dequantizes a layer (a
float32 copy per call moves 4x the int8 bytes; docs/formats.md compares the two). With native bfloat16 int8's
many-row calls run dense, on the same weights, through a bfloat16 copy kept in oneDNN's blocked layout by
``onednn_pack`` (packed once at load, faster for many rows than a plain weight). Where each path stops
paying was measured per CPU kind on one linear layer of the 1.5B target (``docs/formats.md``): hence
``DENSE_ROWS``.

torchao 0.18 was measured too and is not used: its int8 weight-only tensor dequantizes the whole weight
on every eager call on CPU (slower than dense bfloat16 per call), and the wheel on PyPI carries no CPU
kernel for its int8-activation, int4-weight config (``da8w4_linear_cpu`` has no CPU implementation
there).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from semspec.models.cpu import int4_kernel, int8_kernel, ops
from semspec.models.cpu.cpuinfo import CpuInfo, cpu_info
from semspec.models.project.settings import settings

log = logging.getLogger(__name__)

DENSE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
QUANTIZED = ("int8", "int4")
FORMATS = (*DENSE_DTYPES, *QUANTIZED, "auto")
INT4_GROUP = 32  # input channels per int4 scale and zero (the kernel takes 32, 64, 128 or 256)
INT8_K_MULTIPLE = 16  # int8 weights' input width: a multiple of this (the kernel's blocks; PyTorch's op too)
# calls with more rows than this run dense, on a bfloat16 copy kept at load: (format, native bfloat16?) -> rows
# (None: every call runs the int kernel), read off docs/formats.md's tables (native: where the int kernel
# stops beating AMX)
# (int4 and int8 without native bfloat16: a bfloat16 GEMM there is 3-5x slower than float32, a float32
# copy would cost 4x (int8) or 8x (int4) their memory, and the kernels' tiles beat dequantizing per call
# up to about 128 rows, within 1.7x above)
# (int4 with AVX512_BF16: the int4 kernel's tiles run many-row calls close to a dense bfloat16 GEMM, for
# a quarter of its memory)
DENSE_ROWS = {("int8", True): 4, ("int4", True): None, ("int8", False): None, ("int4", False): None}
# With AMX, oneDNN's bfloat16 GEMM of a dequantized copy runs on AMX's tiles, several times faster than
# the int4 kernel for many rows: there int4 keeps the copy, for calls above 6 rows (measured on a
# 1536 -> 8960 layer: docs/formats.md)
AMX_INT4_ROWS = 6
INT4_AVX2_FLAGS = frozenset({"avx2", "fma"})  # what the int4 kernel's AVX2 build needs (models/cpu/build.py)


@dataclass(frozen=True)
class Format:
    """What a model runs in: the weights' format, the activations' dtype and, for the quantized
    formats, which calls run dense and how."""

    name: str  # float32 | float16 | bfloat16 | int8 | int4
    activations: torch.dtype  # hidden states, attention, norms, KV cache (pooled features are float32)
    dense_rows: int | None = None  # quantized: calls with more rows than this run dense (None: none do)
    dense_copy: bool = False  # quantized: the bfloat16 copy they multiply by is kept (needed with dense_rows)
    requested: str = ""  # what the model config said (``auto`` or the name)
    reason: str = ""  # why, for a person reading a figure

    def __post_init__(self) -> None:
        if self.name in QUANTIZED and self.dense_rows is not None and not self.dense_copy:
            raise ValueError(
                f"a {self.name} format whose calls above {self.dense_rows} rows run dense needs dense_copy=True "
                "(the kept bfloat16 copy they multiply by); dense_rows=None runs every call through the int kernel"
            )

    @property
    def quantized(self) -> bool:
        """Whether linear layers hold int weights."""
        return self.name in QUANTIZED

    @property
    def load_dtype(self) -> torch.dtype:
        """The dtype the checkpoint is loaded in before any quantization."""
        return DENSE_DTYPES[self.name] if not self.quantized else self.activations

    def label(self) -> str:
        """Short, printed beside every figure: ``int8 (bfloat16 above 4 rows)``, ``bfloat16``."""
        if not self.quantized:
            return self.name
        if self.dense_rows is None:
            return self.name
        dense = str(self.activations).removeprefix("torch.")  # the kept copy's dtype
        return f"{self.name} ({dense} above {self.dense_rows} rows)"

    def describe(self) -> str:
        """The choice and why: ``auto -> int8 (bfloat16 above 4 rows): AVX512, native bf16: ...``."""
        head = f"{self.requested} -> {self.label()}" if self.requested == "auto" else self.label()
        return f"{head}: {self.reason}" if self.reason else head


def resolve_format(requested: str, device: str = "cpu", cpu: CpuInfo | None = None) -> Format:
    """The format ``requested`` (a model config's ``dtype``) means on ``device``, with ``cpu`` (default: this
    one; tests inject flags). The rule for ``auto``: bfloat16 on a GPU; on a CPU where semspec's int4
    kernel runs (AVX512_BF16, or AVX2 and FMA: its AVX2 build, int8 activations) ``int4``, every call
    through the int4 kernel, except that with AMX calls above 6 rows run in bfloat16 on a dequantized copy
    (AMX's GEMM is several times faster there); on any other CPU ``int8`` (PyTorch's op). ``int8`` asked for
    by name runs its calls above 4 rows on a bfloat16 copy where the CPU has native bfloat16, and every call
    through its kernel (tiles for many rows) where it has not."""
    if requested not in FORMATS:
        raise ValueError(f"field 'dtype' must be one of {FORMATS}, got {requested!r}")
    on_cpu = device == "cpu" or (device == "auto" and not torch.cuda.is_available())
    if not on_cpu:
        if requested in QUANTIZED:
            raise ValueError(
                f"field 'dtype': {requested} is a CPU format (weight-only int kernels for the CPU); on "
                f"{device} use bfloat16, float16 or auto"
            )
        if requested == "auto":
            return Format("bfloat16", torch.bfloat16, requested="auto", reason=f"{device}: bfloat16")
        return Format(requested, DENSE_DTYPES[requested], requested=requested)
    cpu = cpu or cpu_info()
    if requested in DENSE_DTYPES:
        note = ""
        if requested == "bfloat16" and not cpu.native_bf16:
            note = f"{cpu.label()}: calls with many rows run 3-5x slower than float32"
        return Format(requested, DENSE_DTYPES[requested], requested=requested, reason=note)
    name = requested
    int4_runs = int4_kernel.CPU_FLAGS.issubset(cpu.flags) or INT4_AVX2_FLAGS.issubset(cpu.flags)
    if requested == "auto":  # int4 where semspec's int4 kernel runs (elsewhere PyTorch's op: no faster)
        name = "int4" if int4_runs else "int8"
    native = cpu.native_bf16
    rows = DENSE_ROWS[(name, native)]
    if name == "int4" and cpu.amx:
        rows = AMX_INT4_ROWS
    kernel = ""
    if name == "int4" and int4_runs:
        kernel = " (semspec's int4 kernel)" if native else " (semspec's int4 kernel, int8 activations)"
    if rows is None:
        reason = f"{cpu.label()}: {name} weights{kernel} for every call, no dense copy"
    else:
        reason = (
            f"{cpu.label()}: {name} weights{kernel} for calls of up to {rows} rows (decoding), "
            "bfloat16 (a dequantized copy) above"
        )
    return Format(name, torch.bfloat16, rows, rows is not None, requested=requested, reason=reason)


# ----------------------------------------------------------------------------------- quantized layers
def quantize_int8(
    weight: torch.Tensor, chunk: int = 2048, dense: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(N, K) float weight -> (N, K) int8, (N,) float32 scales, symmetric per output channel
    (``w ≈ q * scale``), and with ``dense`` the int weights dequantized (``q * scale`` in float32, then
    cast to ``dense``), (N, K), else None. Done in row chunks, in one pass over the weight, so each chunk
    stays in cache."""
    n = weight.shape[0]
    q = torch.empty(weight.shape, dtype=torch.int8)
    scale = torch.empty(n, dtype=torch.float32)
    back = None if dense is None else torch.empty(weight.shape, dtype=dense)
    for s in range(0, n, chunk):
        blk = weight[s : s + chunk].to(torch.float32, copy=True)  # (c, K), rewritten in place below
        top = torch.maximum(blk.amax(dim=1), blk.amin(dim=1).neg_())  # (c,) max |w|, without abs()'s copy
        sc = top.clamp_min_(1e-12) / 127.0  # (c,)
        blk.div_(sc[:, None]).round_().clamp_(-127, 127)  # the int values, exactly, as float32
        q[s : s + chunk] = blk
        scale[s : s + chunk] = sc
        if back is not None:
            back[s : s + chunk] = blk.mul_(sc[:, None])  # q * scale, as _dequantize computes it
    return q, scale, back


def quantize_int4(
    weight: torch.Tensor, group: int = INT4_GROUP, chunk: int = 2048, dense: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(N, K) float weight -> (N, K) uint8 values in [0, 15], (K / group, N, 2) float32 (scale, zero)
    per group of ``group`` input channels, the kernels' convention ``w ≈ (q - 8) * scale + zero`` (min-max
    asymmetric, so each group's range is used whole), and with ``dense`` the int weights dequantized with
    the scales and zeros rounded to ``dense`` (what the kernels read), cast to ``dense``, (N, K), else
    None. Done in row chunks, in one pass over the weight, like ``quantize_int8``."""
    n, k = weight.shape
    g = k // group
    q = torch.empty(n, k, dtype=torch.uint8)
    scale_zero = torch.empty(g, n, 2, dtype=torch.float32)
    back = None if dense is None else torch.empty(n, k, dtype=dense)
    for s in range(0, n, chunk):
        w = weight[s : s + chunk].to(torch.float32, copy=True).reshape(-1, g, group)  # (c, G, group)
        lo, hi = torch.aminmax(w, dim=2)  # (c, G)
        scale = ((hi - lo) / 15.0).clamp_min_(1e-12)
        w.sub_(lo[..., None]).div_(scale[..., None]).round_().clamp_(0, 15)  # q, as floats
        q[s : s + chunk] = w.reshape(-1, k)
        sz = torch.stack([scale, lo + 8.0 * scale], dim=2)  # (c, G, 2)
        scale_zero[:, s : s + chunk] = sz.transpose(0, 1)
        if back is not None:
            sz = sz.to(dense).float()
            back[s : s + chunk] = w.sub_(8.0).mul_(sz[..., 0:1]).add_(sz[..., 1:2]).reshape(-1, k)
    return q, scale_zero, back


class QuantLinear(nn.Module):
    """A weight-only quantized ``nn.Linear``: calls of up to ``dense_rows`` rows run the int kernel,
    larger ones a dense GEMM on the copy of the dequantized weights kept at load (``dense_rows`` None: every
    call runs the int kernel). Input and output are in the activation dtype."""

    def __init__(self, linear: nn.Linear, fmt: Format) -> None:
        super().__init__()
        if not fmt.quantized:
            raise ValueError(f"QuantLinear needs an int8 or int4 format, got {fmt.name}")
        weight = linear.weight.detach()
        self.out_features, self.in_features = weight.shape
        if (why := _unfit(*weight.shape, fmt)) is not None:
            raise ValueError(
                f"cannot quantize a {self.in_features} -> {self.out_features} linear layer: {why}"
            )
        self.bits = 8 if fmt.name == "int8" else 4
        self.dense_rows, self.act = fmt.dense_rows, fmt.activations
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().to(self.act), False)
        # int8 weights in the kernel's packed layout where it runs here and the shape fits, else PyTorch's
        self.packed = False
        if self.bits == 8:
            q, scale, _ = quantize_int8(weight)
            self.packed = int8_kernel.packable(*q.shape) and int8_kernel.int8_mm() is not None
            q_stored = int8_kernel.pack(q) if self.packed else q  # (N/8, K/16, 8, 16) packed, else (N, K)
            self.register_buffer("qweight", q_stored)
            self.register_buffer("scales", scale.to(self.act))  # (N,)
        else:
            q, sz, _ = quantize_int4(weight)
            sz = sz.to(self.act)  # (K / group, N, 2): what the kernels read
            self.packed = self.act == torch.bfloat16 and int4_kernel.int4_mm() is not None
            if self.packed:  # (N/16, K/32, 8, 32) nibbles, (N/16, K/32, 2, 16) scales and zeros
                nibbles, sz_packed = int4_kernel.pack(q, sz)
                self.register_buffer("qweight", nibbles)
                self.register_buffer("scales", sz_packed)
            else:
                int4pack = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
                self.register_buffer("qweight", int4pack)
                self.register_buffer("scales", sz)
        self._attach_dense(fmt)

    @classmethod
    def from_stored(
        cls,
        fmt: Format,
        layout: dict,
        qweight: torch.Tensor,
        scales: torch.Tensor,
        bias: torch.Tensor | None,
    ) -> QuantLinear:
        """A layer from the tensors and ``layout`` (``stored_layout``) a loaded one holds, as the weight
        cache keeps them (memory-mapped tensors are used as they are, not copied)."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self.in_features, self.out_features = int(layout["in"]), int(layout["out"])
        self.bits, self.packed = int(layout["bits"]), bool(layout["packed"])
        self.dense_rows, self.act = fmt.dense_rows, fmt.activations
        self.bias = None if bias is None else nn.Parameter(bias, False)
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales)
        self._attach_dense(fmt)
        return self

    def stored_layout(self) -> dict:
        """What ``from_stored`` needs besides the tensors: the widths, the bits and the packing."""
        return {"in": self.in_features, "out": self.out_features, "bits": self.bits, "packed": self.packed}

    def _attach_dense(self, fmt: Format) -> None:
        """Keep the bfloat16 copy many-row calls multiply by where ``fmt`` has one: the int weights
        dequantized (not the original ones: every call, whichever kernel runs it, multiplies by the same
        weights up to the activation dtype's rounding, so a step decoded token by token and the same step
        prefilled pool alike), in oneDNN's blocked layout where it takes it, else plain."""
        dense = self._dequantized_all().to(self.act) if fmt.dense_copy else None  # (N, K)
        self._dense_packed = None if dense is None else onednn_pack(dense)  # opaque: not a buffer
        plain = dense if self._dense_packed is None else None
        self.register_buffer("dense", plain, persistent=False)  # (N, K) or None

    def _dequantized_all(self) -> torch.Tensor:
        """The int weights as float32 (N, K), whatever their bits and layout."""
        if self.bits == 8:
            return self.int8_weight().float() * self.scales.float()[:, None]
        if self.packed:
            q, sz = int4_kernel.unpack(self.qweight, self.scales)
        else:  # PyTorch's int4 packing has no inverse here: multiply the identity through its op
            eye = torch.eye(self.in_features, dtype=self.act)
            w = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.qweight, INT4_GROUP, self.scales)
            return w.float().t().contiguous()
        return _dequantize(q, sz.float())

    def extra_repr(self) -> str:
        packed = ", packed" if self.packed else ""
        onednn = " (oneDNN layout)" if self._dense_packed is not None else ""
        return f"in={self.in_features}, out={self.out_features}, int{self.bits}{packed}, dense above {self.dense_rows} rows{onednn}"

    def __getstate__(self) -> dict:  # copy or pickle the oneDNN copy as plain weights (its storage is opaque)
        state = self.__dict__.copy()
        if self._dense_packed is not None:
            state["_dense_packed"], state["_dense_plain"] = None, self._dense_packed.to_dense()
        return state

    def __setstate__(self, state: dict) -> None:
        plain = state.pop("_dense_plain", None)
        super().__setstate__(state)
        if plain is not None:
            self._dense_packed = onednn_pack(plain)
            if self._dense_packed is None:  # not here (another setting): plain, as it would have loaded
                self._buffers["dense"] = plain

    def dense_weight(self) -> torch.Tensor | None:
        """The dense copy many-row calls multiply by, (N, K) plain (None without one)."""
        return self._dense_packed.to_dense() if self._dense_packed is not None else self.dense

    def int8_weight(self) -> torch.Tensor:
        """The int8 weight as (N, K), whatever its layout (a new tensor when packed)."""
        if self.bits != 8:
            raise ValueError("only int8 weights have an (N, K) int8 form; int4's packing is the kernel's own")
        return int8_kernel.unpack(self.qweight) if self.packed else self.qweight

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The int8 weight as the kernel sees it, (N, K) in ``dtype`` (int4 layers: ``_dequantized_all``)."""
        if self.bits != 8:
            raise ValueError("dequantized() is int8's (N, K) weight; an int4 layer's is _dequantized_all()")
        return self.int8_weight().to(dtype) * self.scales.to(dtype)[:, None]

    def _int_mm(self, x: torch.Tensor) -> torch.Tensor:
        if self.bits == 4:
            if not self.packed:
                return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.qweight, INT4_GROUP, self.scales)
            if int4_kernel.int4_mm() is not None and x.device.type == "cpu" and x.dtype == torch.bfloat16:
                return ops.int4_mm(x, self.qweight, self.scales)  # (M, N): the kernel, its inputs checked
            q, sz = int4_kernel.unpack(self.qweight, self.scales)  # the kernel was turned off since loading
            return nn.functional.linear(x.float(), _dequantize(q, sz.float())).to(x.dtype)
        cpu_ok = self.packed and x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float32)
        if cpu_ok and int8_kernel.int8_mm() is not None:  # None only if turned off since loading
            return ops.int8_mm(x, self.qweight, self.scales)  # (M, N): the kernel, its inputs checked
        return torch.ops.aten._weight_int8pack_mm(x, self.int8_weight(), self.scales)  # (M, N)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features).to(self.act).contiguous()  # (M, K)
        if self.dense_rows is None or x2.shape[0] <= self.dense_rows:
            y = self._int_mm(x2)  # (M, N)
        elif (
            self._dense_packed is not None
            and x2.device.type == "cpu"
            and x2.dtype == self._dense_packed.dtype
        ):
            y = onednn_linear(x2, self._dense_packed)  # (M, N)
        else:  # the plain copy (Format makes every layer with dense_rows keep one)
            y = nn.functional.linear(x2, self.dense_weight())
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)


def onednn_pack(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight`` (N, K), bfloat16 on the CPU, reordered once into oneDNN's blocked layout for
    ``torch.ops.mkldnn._linear_pointwise`` (the packed linear PyTorch's own compiled CPU graphs call).
    ``nn.functional.linear`` reorders a plain weight on every call; packed once, many-row calls run faster
    (``benchmarks/formats.py layer``; the figures per CPU kind are in ``docs/formats.md``). None where oneDNN cannot take it (no bfloat16 support,
    another dtype or device) or ``SEMSPEC_ONEDNN_PACK=0``: the caller keeps the plain weight."""
    if settings().onednn_pack == "0" or weight.device.type != "cpu" or weight.dtype != torch.bfloat16:
        return None
    if not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)  # opaque (N, K)
    except RuntimeError as err:  # an unsupported shape or build: the plain weight serves
        log.info("oneDNN packing unavailable (%s); dense calls multiply the plain weight", err)
        return None


def onednn_linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """``x (M, K) @ weight.T`` -> (M, N) for an ``onednn_pack``-ed weight, in the weight's dtype."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [None], "")


def _dequantize(q: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    """float32 (N, K) weights from ``quantize_int8``'s (q, scales (N,)) or ``quantize_int4``'s (q,
    (G, N, 2) scales and zeros)."""
    if params.dim() == 1:
        return q.float() * params[:, None]
    n, k = q.shape
    scale, zero = params[..., 0].t(), params[..., 1].t()  # (N, G)
    groups = (q.float().reshape(n, -1, k // params.shape[0]) - 8.0) * scale[..., None] + zero[..., None]
    return groups.reshape(n, k)


def quantize_model(model: nn.Module, fmt: Format) -> int:
    """Replace every ``nn.Linear`` of ``model`` (output head included) by a ``QuantLinear`` of ``fmt``, in
    place; a layer whose shape the kernel cannot take stays dense (logged). Returns the count replaced."""
    done, skipped = 0, []
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, nn.Linear):
                continue
            if _unfit(*child.weight.shape, fmt) is not None:
                skipped.append(f"{name} {tuple(child.weight.shape)}")
                continue
            setattr(parent, name, QuantLinear(child, fmt))
            done += 1
    if skipped:
        log.info(
            "%s: %d linear layers stay dense (shape): %s", fmt.name, len(skipped), ", ".join(skipped[:4])
        )
    return done


def _unfit(n: int, k: int, fmt: Format) -> str | None:
    """Why a (N, K) weight cannot be quantized to ``fmt`` (None when it can)."""
    if fmt.name == "int4" and (k % INT4_GROUP or n % 16):  # 16: what torch's int4 packing takes
        return f"int4 needs an input width that is a multiple of {INT4_GROUP} and an output width that is a multiple of 16"
    if fmt.name == "int8" and k % INT8_K_MULTIPLE:
        # PyTorch's op (torch 2.13, CPU) reads past the end of each row of another width: measured at
        # widths 8, 24, 40, 72 and 100, its outputs were garbage or NaN, and calls of 8 rows crashed
        return f"int8 needs an input width that is a multiple of {INT8_K_MULTIPLE}"
    return None
