"""Numeric formats: the rule ``auto`` follows for given CPU flags, the weight-only int layers against
float32, and a clear error for every bad value."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

from semspec.models.cpu import formats
from semspec.models.cpu.formats import (
    CpuInfo,
    Format,
    QuantLinear,
    _dequantize,
    onednn_pack,
    quantize_int4,
    quantize_int8,
    quantize_model,
    resolve_format,
)
from semspec.models.lm import LM, install_kernels
from semspec.models.lm.pair import ModelConfig
from semspec.models.project.settings import Settings, reload_settings
from tests.helpers.tiny import tiny_lm

AVX2 = CpuInfo("AVX2", frozenset({"avx", "avx2", "fma"}))
AVX512 = CpuInfo("AVX512", frozenset({"avx2", "fma", "avx512f", "avx512bw"}))  # no bf16 instructions
OLD = CpuInfo("DEFAULT", frozenset({"sse4_2"}))  # no AVX2: no semspec kernel
AVX512_BF16 = CpuInfo("AVX512", frozenset({"avx2", "avx512f", "avx512bw", "avx512vl", "avx512_bf16"}))
AMX = CpuInfo("AVX512", frozenset({"avx2", "avx512f", "amx_bf16", "amx_tile"}))  # AMX without AVX512_BF16
BF16_AND_AMX = CpuInfo("AVX512", AVX512_BF16.flags | AMX.flags)
QUESTION = "What is 12 * 7?"


# ----------------------------------------------------------------------------------- the rule
@pytest.mark.parametrize(
    "cpu, name, dense_copy, rows",
    [
        (AVX2, "int4", False, None),  # the int4 kernel's AVX2 build, int8 activations, every call
        (AVX512, "int4", False, None),  # the same build
        (OLD, "int8", False, None),  # every call through the int8 kernel (tiles for many rows)
        (AVX512_BF16, "int4", False, None),  # the int4 kernel's tiles run every call: no dense copy
        (AMX, "int8", True, 4),  # (these flags lack FMA: no int4 kernel)
        (BF16_AND_AMX, "int4", True, 6),  # AMX's bfloat16 GEMM overtakes the int4 kernel above 6 rows
    ],
)
def test_auto_is_int4_where_its_kernel_runs_else_int8_with_dense_calls_in_the_cpus_fast_dtype(
    cpu, name, dense_copy, rows
):
    fmt = resolve_format("auto", "cpu", cpu)
    assert fmt.name == name and fmt.activations == torch.bfloat16
    assert fmt.dense_copy is dense_copy and fmt.dense_rows == rows
    label = name if rows is None else f"{name} (bfloat16 above {rows} rows)"
    assert fmt.label() == label
    assert fmt.describe().startswith(f"auto -> {label}: {cpu.capability}, ")
    assert ("no dense copy" in fmt.describe()) is (rows is None)
    assert ("no native bf16" in fmt.describe()) is not cpu.native_bf16
    assert ("semspec's int4 kernel" in fmt.describe()) is (name == "int4")


def test_auto_on_a_gpu_is_bfloat16_and_the_int_formats_are_refused_there():
    fmt = resolve_format("auto", "cuda", AVX2)
    assert fmt.name == "bfloat16" and fmt.describe() == "auto -> bfloat16: cuda: bfloat16"
    for name in ("int8", "int4"):
        with pytest.raises(ValueError, match=rf"field 'dtype': {name} is a CPU format.*use bfloat16"):
            resolve_format(name, "cuda:1")


def test_explicit_formats_are_kept_and_bfloat16_without_native_support_says_so():
    assert resolve_format("float32", "cpu", AVX2).describe() == "float32"
    assert resolve_format("bfloat16", "cpu", AMX).describe() == "bfloat16"
    slow = resolve_format("bfloat16", "cpu", AVX2)
    assert slow.name == "bfloat16" and "3-5x slower than float32" in slow.describe()
    assert (resolve_format("int4", "cpu", AMX).dense_rows, resolve_format("int4", "cpu", AMX).dense_copy) == (
        6,
        True,
    )
    assert resolve_format("int4", "cpu", AVX512_BF16).dense_rows is None  # its kernel's tiles: no copy
    assert resolve_format("int4", "cpu", AVX2).dense_rows is None  # no dense path: its kernel always


def test_the_flags_come_from_proc_cpuinfo(tmp_path):
    from semspec.models.cpu.cpuinfo import _cpu_flags

    info = tmp_path / "cpuinfo"
    info.write_text("processor : 0\nflags\t\t: fpu AVX2 avx512_bf16 amx_tile\nbugs : none\n")
    assert _cpu_flags(info) == {"fpu", "avx2", "avx512_bf16", "amx_tile"}
    assert _cpu_flags(tmp_path / "missing") == frozenset()


def test_forced_to_avx2_the_cpu_is_seen_as_an_avx2_only_one(monkeypatch):
    """``SEMSPEC_KERNELS=avx2``: no AVX-512 or AMX flag reaches the format rule or the kernels, and every
    figure's label says so."""
    from semspec.models.cpu import cpuinfo

    monkeypatch.setattr(
        cpuinfo, "_cpu_flags", lambda: frozenset({"avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16"})
    )
    cpuinfo._cpu_info.cache_clear()
    monkeypatch.setenv("SEMSPEC_KERNELS", "avx2")
    reload_settings()
    try:
        cpu = cpuinfo.cpu_info()
        assert cpu.flags == {"avx2", "fma"} and not cpu.native_bf16 and not cpu.amx
        assert "seen as AVX2-only" in cpu.label()
        fmt = resolve_format("auto", "cpu")
        assert fmt.name == "int4" and fmt.dense_rows is None
        assert "semspec's int4 kernel, int8 activations" in fmt.describe()
        monkeypatch.delenv("SEMSPEC_KERNELS")
        reload_settings()
        assert cpuinfo.cpu_info().amx and resolve_format("auto", "cpu").dense_rows == 6
    finally:
        cpuinfo._cpu_info.cache_clear()
        reload_settings()


@pytest.mark.parametrize(
    "fields, msg",
    [
        (
            {"dtype": "int3"},
            r"field 'dtype' must be one of \('float32', 'float16', 'bfloat16', 'int8', 'int4', 'auto'\)",
        ),
        ({"dtype": "bf16"}, r"field 'dtype' must be one of"),
        (
            {"dtype": "int8", "device": "cuda"},
            r"field 'dtype' int8 is a CPU format; on cuda use bfloat16 or auto",
        ),
        ({"dtype": "int4", "device": "mps"}, r"field 'dtype' int4 is a CPU format"),
    ],
)
def test_every_bad_format_is_an_error_naming_the_field(fields, msg):
    with pytest.raises(ValueError, match=msg):
        ModelConfig(model_id="m", **fields)
    with pytest.raises(ValueError, match="field 'dtype'"):
        resolve_format(fields["dtype"], fields.get("device", "cpu"))


# ----------------------------------------------------------------------------------- the layers
def test_int8_and_int4_quantization_round_trip_within_their_grids():
    torch.manual_seed(0)
    w = torch.randn(48, 64)
    q, scale, dense = quantize_int8(w)
    assert dense is None, "no dense copy unless asked"
    assert q.dtype == torch.int8 and int(q.abs().max()) == 127
    assert float((q.float() * scale[:, None] - w).abs().max()) <= float(scale.max()) / 2 + 1e-6
    q4, sz, none = quantize_int4(w)
    assert none is None and q4.dtype == torch.uint8
    assert sz.shape == (2, 48, 2) and int(q4.min()) == 0 and int(q4.max()) == 15
    s, z = sz[..., 0].t(), sz[..., 1].t()  # (N, groups)
    back = ((q4.reshape(48, 2, 32).float() - 8) * s[..., None] + z[..., None]).reshape(48, 64)
    assert float((back - w).abs().max()) <= float(s.max()) / 2 + 1e-5
    w0 = w.clone()
    quantize_int8(w)
    assert torch.equal(w, w0), "quantizing leaves the weight as it was"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int8_quantization_gives_its_dense_copy_in_the_same_pass_bit_for_bit(dtype):
    torch.manual_seed(0)
    w = torch.randn(40, 64, dtype=torch.bfloat16) * torch.logspace(-3, 1, 40)[:, None].to(torch.bfloat16)
    q, scale, none = quantize_int8(w, chunk=16)  # chunks that do not divide the rows
    q2, scale2, dense = quantize_int8(w, chunk=16, dense=dtype)
    assert none is None and torch.equal(q, q2) and torch.equal(scale, scale2)
    assert torch.equal(scale, w.float().abs().amax(dim=1) / 127.0), "the scale is max |w| / 127"
    assert dense.dtype == dtype and torch.equal(dense, (q.float() * scale[:, None]).to(dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int4_quantization_gives_its_dense_copy_in_the_same_pass_bit_for_bit(dtype):
    torch.manual_seed(0)
    w = torch.randn(40, 96, dtype=torch.bfloat16) * torch.logspace(-3, 1, 40)[:, None].to(torch.bfloat16)
    q, sz, none = quantize_int4(w, chunk=16)  # chunks that do not divide the rows
    q2, sz2, dense = quantize_int4(w, chunk=16, dense=dtype)
    whole, sz3, _ = quantize_int4(w, chunk=4096)
    assert none is None and torch.equal(q, q2) and torch.equal(sz, sz2)
    assert torch.equal(q, whole) and torch.equal(sz, sz3), "the chunks do not change the result"
    groups = w.float().reshape(40, 3, 32)
    lo, hi = groups.amin(dim=2), groups.amax(dim=2)
    assert torch.equal(sz[..., 0].t(), (hi - lo) / 15.0), "the scale is each group's range / 15"
    want = _dequantize(q, sz.to(dtype).float()).to(dtype)  # the scales and zeros as the kernels read them
    assert dense.dtype == dtype and torch.equal(dense, want)


@pytest.mark.parametrize("dense_rows", [4, None])
def test_a_quantized_layer_runs_few_rows_through_its_kernel_and_many_rows_dense_on_the_same_weights(
    dense_rows,
):
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 48)
    q = QuantLinear(
        lin, Format("int8", torch.float32, dense_rows=dense_rows, dense_copy=dense_rows is not None)
    )
    exact = q.dequantized()  # (N, K): what the int kernel multiplies by
    assert (q.dense is not None) is (dense_rows is not None)
    if dense_rows is not None:
        assert torch.equal(q.dense, exact), "the dense copy is the int weights dequantized"
    few, many = torch.randn(2, 2, 64), torch.randn(2, 5, 64)  # 4 rows: the kernel; 10 rows: dense
    assert torch.allclose(q(few), few @ exact.t() + lin.bias, atol=1e-5)
    assert torch.allclose(q(many), many @ exact.t() + lin.bias, atol=1e-5)
    assert not torch.allclose(q(many), lin(many), atol=1e-4), "int8 weights, not the original ones"


ONEDNN_BF16 = onednn_pack(torch.zeros(8, 8, dtype=torch.bfloat16)) is not None


def test_a_bfloat16_dense_copy_is_held_once_in_onednns_layout_and_multiplies_the_same_weights(monkeypatch):
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 48).to(torch.bfloat16)
    fmt = Format("int8", torch.bfloat16, dense_rows=4, dense_copy=True)
    monkeypatch.setenv("SEMSPEC_ONEDNN_PACK", "0")
    reload_settings()
    plain = QuantLinear(lin, fmt)
    monkeypatch.delenv("SEMSPEC_ONEDNN_PACK")
    reload_settings()
    q = QuantLinear(lin, fmt)
    assert plain.dense is not None and plain._dense_packed is None, "SEMSPEC_ONEDNN_PACK=0: the plain copy"
    assert torch.equal(q.dense_weight(), plain.dense), "the same dequantized weights, whatever the layout"
    if not ONEDNN_BF16:
        assert q.dense is not None and q._dense_packed is None, "no oneDNN bfloat16 here: the plain copy"
        return
    assert q.dense is None and q._dense_packed is not None, "one copy, in oneDNN's layout"
    calls = []
    real = formats.onednn_linear
    monkeypatch.setattr(formats, "onednn_linear", lambda x, w: calls.append(x.shape[0]) or real(x, w))
    many = torch.randn(2, 5, 64).to(torch.bfloat16)  # 10 rows: dense
    got, want = q(many), plain(many)
    assert calls == [10], "a many-row call multiplies the packed copy"
    assert torch.allclose(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    q(many[:, :2])  # 4 rows: the int kernel
    assert calls == [10]
    for twin in (copy.deepcopy(q), pickle.loads(pickle.dumps(q))):
        assert twin._dense_packed is not None and torch.equal(twin(many), got), "copies repack their own"


def test_a_bad_onednn_setting_names_its_variable():
    with pytest.raises(ValueError, match="SEMSPEC_ONEDNN_PACK"):
        Settings.from_env({"SEMSPEC_ONEDNN_PACK": "yes"})


def test_an_int4_layers_dense_copy_is_its_int_weights():
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 48, bias=False)
    q = QuantLinear(lin, Format("int4", torch.float32, dense_rows=4, dense_copy=True))
    eye = torch.eye(64)[:4]  # 4 rows: the kernel, whose output is the first 4 input channels' weights
    assert torch.allclose(q(eye), q.dense[:, :4].t(), atol=1e-5)
    assert float((q.dense - lin.weight.detach()).abs().max()) > 1e-3, "int4 weights, not the original ones"


@pytest.mark.parametrize(("inputs", "outputs"), [(48, 16), (64, 24), (64, 40)])
def test_a_shape_int4s_kernel_cannot_take_stays_dense(inputs, outputs):
    # torch's int4 packing takes output widths that are multiples of 16 only (a RuntimeError otherwise)
    fmt = Format("int4", torch.bfloat16, dense_rows=8, dense_copy=True)
    with pytest.raises(ValueError, match=f"{inputs} -> {outputs} linear layer: int4 needs an input width"):
        QuantLinear(torch.nn.Linear(inputs, outputs), fmt)
    model = torch.nn.Sequential(torch.nn.Linear(64, inputs), torch.nn.Linear(inputs, outputs))
    assert quantize_model(model, fmt) == 1  # the first (64 -> 48 or 64) fits
    assert type(model[1]) is torch.nn.Linear


def _greedy(lm: LM, tokens: int = 40) -> list[int]:
    state = lm.prefill(lm.format_prompt(QUESTION))
    return lm.generate_step(state, n=1, temperature=0.0, max_tokens=tokens)[0].token_ids


def _in_format(base: LM, fmt: Format) -> LM:
    model = copy.deepcopy(base.model).to(fmt.activations)
    if fmt.quantized:
        # 7 projections per block, 2 blocks, and the head, whose 100 outputs int4's kernel cannot take
        # (not a multiple of 16): it stays dense there
        assert quantize_model(model, fmt) == 2 * 7 + (fmt.name == "int8")
    return LM(install_kernels(model), base.tokenizer, base.config, fmt)


# Documented tolerance (README, "Formats"): on a tiny random model (hidden 64) float16, bfloat16 and int8
# decode float32's greedy tokens exactly; int4 (min-max over groups of 32 random weights: ~8% weight
# error) scores float32's greedy tokens with logits within 15% of float32's (relative norm; 8-10%
# measured over seeds; a wrong packing or scale gives 100% or more). Every call runs the int kernel here
# (``dense_rows=None``).
@pytest.mark.parametrize(
    "fmt",
    [
        Format("bfloat16", torch.bfloat16),
        Format("float16", torch.float16),
        Format("int8", torch.float32),
        Format("int8", torch.bfloat16),
        Format("int4", torch.float32),
        Format("int4", torch.bfloat16),
    ],
    ids=lambda f: f"{f.name}-{str(f.activations).removeprefix('torch.')}",
)
def test_each_format_decodes_float32s_greedy_tokens_within_its_tolerance(fmt):
    base = tiny_lm(hidden=64, max_step_tokens=40)
    ref = _greedy(base)
    lm = _in_format(base, fmt)
    if fmt.name != "int4":
        assert _greedy(lm) == ref
        return
    ids = torch.tensor([lm.encode(lm.format_prompt(QUESTION)) + ref])
    with torch.inference_mode():
        want, got = base.model(ids).logits.float(), lm.model(ids).logits.float()
    rel = float((got - want).norm() / want.norm())
    assert rel < 0.15, f"int4 logits differ from float32's by {rel:.3f} (relative norm)"


def test_a_model_built_in_memory_reports_its_dtype_as_its_format():
    lm = tiny_lm()
    assert lm.format.name == "float32" and lm.describe()["dtype"] == "float32"
    q = _in_format(lm, resolve_format("int8", "cpu", AMX))
    assert q.describe()["format"] == "int8" and q.describe()["dtype"] == "int8 (bfloat16 above 4 rows)"
    assert "AVX512, native bf16" in q.describe()["why"]


def test_every_decoder_runs_on_int8_models():
    """Decoders, transformers' assisted generation included, on quantized models: nothing reads a linear
    layer's ``weight`` (an int layer has none), and greedy target-only decoding is SemanticSpec's output
    when every step is rejected."""
    from semspec.models.spec.batching import SingleModelDecoder
    from semspec.models.spec.semanticspec import SemanticSpecDecoder
    from semspec.models.spec.settings import DecodeSettings
    from semspec.models.spec.specreason import SpecReasonDecoder
    from semspec.models.spec.token_level import AssistedDecoder, TokenSpecDecoder

    fmt = Format("int8", torch.float32, dense_rows=4, dense_copy=True)
    draft, target = (_in_format(tiny_lm(seed=s, hidden=64), fmt) for s in (1, 2))
    settings = DecodeSettings(max_new_tokens=24, step_tokens=8, temperature=0.0)
    never = lambda pooled: 0.0  # noqa: E731 - the target's probe: it would never say this (reject all)
    sure = lambda pooled: 1.0  # noqa: E731
    ref = SingleModelDecoder(target, settings, "target").decode(QUESTION)
    decoders = [
        SingleModelDecoder(draft, settings, "draft"),
        SemanticSpecDecoder(draft, target, sure, never, settings),
        SpecReasonDecoder(draft, target, settings),
        TokenSpecDecoder(draft, target, settings, draft_tokens=3),
        AssistedDecoder(draft, target, settings),
    ]
    for dec in decoders:
        res = dec.decode(QUESTION)
        assert res.output_tokens > 0, dec.method
        if dec.method in ("semanticspec", "specsampling"):
            assert res.text == ref.text, f"{dec.method} on int8 is not the target's greedy output"


def test_a_quantized_format_that_runs_calls_dense_must_keep_the_copy_they_multiply_by():
    with pytest.raises(ValueError, match="calls above 64 rows run dense needs dense_copy=True"):
        Format("int8", torch.bfloat16, dense_rows=64)
    assert Format("int8", torch.bfloat16).dense_rows is None  # every call through the int kernel
    assert Format("bfloat16", torch.bfloat16, dense_rows=4).label() == "bfloat16"  # dense formats: no rule
