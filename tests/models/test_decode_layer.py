"""The decode layer kernel: an int8 Llama or Qwen2 decodes the same logits through it as through its
modules, every call it does not take runs the modules, and it says when it is on."""

from __future__ import annotations

import logging

import pytest
import torch

from semspec.models.cpu import attention, build, decode_layer, int4_kernel, int8_kernel
from semspec.models.cpu.cpuinfo import cpu_info
from semspec.models.cpu.formats import Format, quantize_model
from semspec.models.project.settings import Settings, reload_settings

BUILDABLE = build.isa(cpu_info().flags, int8_kernel.ISAS) is not None and build.compiler() is not None
pytestmark = pytest.mark.skipif(not BUILDABLE, reason="needs an AVX2/FMA CPU and a C++ compiler")
HERE = [name for name in int8_kernel.ISAS if build.ISAS[name][1] <= cpu_info().flags]  # builds this CPU runs
INT8 = Format("int8", torch.bfloat16, dense_rows=4, dense_copy=True)
INT4 = Format("int4", torch.bfloat16, dense_rows=8, dense_copy=True)
INT4_RUNS = int4_kernel.CPU_FLAGS.issubset(cpu_info().flags)


@pytest.fixture(autouse=True)
def fresh(monkeypatch, tmp_path):
    """The kernels built into an empty cache, forgotten again afterwards."""
    monkeypatch.setenv("SEMSPEC_CACHE_DIR", str(tmp_path))
    caches = (int8_kernel.int8_mm, int4_kernel.int4_mm, attention.attention_kernel, decode_layer.layer_kernel)
    for c in caches:
        c.cache_clear()
    yield
    for c in caches:
        c.cache_clear()


def _qwen2(vocab: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(3)
    cfg = Qwen2Config(
        vocab_size=vocab, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2048, initializer_range=0.2,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    model = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():  # q, k and v carry biases in Qwen2: give them values, so the kernel's bias counts
        for layer in model.model.layers:
            for p in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                p.bias.normal_(0, 0.5)
    return model


def _int8_lm(arch: str = "llama", fmt: Format = INT8):
    """A tiny int8 (or ``fmt``) LM, bfloat16 activations, of ``arch``: llama (no biases, 16-dim heads) or
    qwen2."""
    from semspec.models.lm import LM, install_kernels
    from tests.helpers.tiny import tiny_lm

    base = tiny_lm(init=0.2, hidden=64)
    model = base.model if arch == "llama" else _qwen2(len(base.tokenizer))
    model = model.to(torch.bfloat16)
    quantize_model(model, fmt)
    return LM(install_kernels(model), base.tokenizer, base.config, fmt)


@pytest.fixture
def counted(monkeypatch):
    """Counts the calls that ran the kernel (``layer_in``) and those that ran the modules."""
    calls = {"kernel": 0, "modules": 0}
    fin, fout = decode_layer.layer_kernel()

    def counting_in(*a):
        calls["kernel"] += 1
        return fin(*a)

    monkeypatch.setattr(decode_layer, "layer_kernel", lambda *_: (counting_in, fout))
    real = decode_layer._forward

    def forward(layer, hidden_states, *a, **kw):
        before = calls["kernel"]
        out = real(layer, hidden_states, *a, **kw)
        calls["modules"] += calls["kernel"] == before
        return out

    monkeypatch.setattr(decode_layer, "_forward", forward)
    return calls


def _generate(lm, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy tokens and per-step logits for ``prompts`` (a padded batch)."""
    ids = lm.tokenizer(prompts, return_tensors="pt", padding=True)
    with torch.inference_mode():
        out = lm.model.generate(
            **ids, max_new_tokens=20, do_sample=False, pad_token_id=0, output_scores=True,
            return_dict_in_generate=True,
        )  # fmt: skip
    return out.sequences, torch.stack(out.scores).float()


@pytest.mark.parametrize("build", HERE)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize(
    "prompts",
    [["3 + 4 = "], ["3 + 4 = ", "12 * 3 - 5 = "], ["3 + 4 = ", "12 * 3 - 5 = ", "7 = "]],
    ids=["one row", "padded", "three rows"],  # three: a pair of rows and a single one per weight block
)
def test_it_decodes_what_the_modules_decode(build, arch, prompts, monkeypatch):
    monkeypatch.setenv("SEMSPEC_KERNELS", build.lower())  # every build this CPU runs
    reload_settings()
    lm = _int8_lm(arch)
    assert int8_kernel.int8_mm().isa == build
    assert decode_layer.describe(lm.model) == "decode layers: semspec's kernel (2 of 2)"
    fin, fout = decode_layer.layer_kernel()
    calls = []
    monkeypatch.setattr(decode_layer, "layer_kernel", lambda *_: None)  # off: the modules
    seq_off, logits_off = _generate(lm, prompts)
    monkeypatch.setattr(decode_layer, "layer_kernel", lambda *_: (lambda *a: calls.append(fin(*a)), fout))
    seq_on, logits_on = _generate(lm, prompts)
    assert len(calls) == 2 * 19, "every decoding call of both layers (20 tokens: 19 after the prefill)"
    assert torch.equal(seq_on, seq_off)
    # the same bfloat16 roundings; only the norm's float32 sum runs in another order
    scale = logits_off.abs().max().item()
    assert (logits_on - logits_off).abs().max().item() <= 1e-2 * scale


INT4_BUILDS = ["avx512"] * INT4_RUNS + ["avx2"]  # the int4 kernel's AVX512_BF16 build, and its AVX2 one


@pytest.mark.parametrize("switch", INT4_BUILDS)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("prompts", [["3 + 4 = "], ["3 + 4 = ", "12 * 3 - 5 = ", "7 = "]])
def test_an_int4_model_decodes_what_its_modules_decode(switch, arch, prompts, monkeypatch):
    monkeypatch.setenv("SEMSPEC_KERNELS", switch)
    reload_settings()
    lm = _int8_lm(arch, INT4)
    assert int4_kernel.int4_mm().isa == ("AVX512_BF16" if switch == "avx512" else "AVX2")
    assert decode_layer.describe(lm.model) == "decode layers: semspec's kernel (2 of 2)"
    assert lm.model.model.layers[0].self_attn.q_proj.bits == 4
    fin, fout = decode_layer.layer_kernel(4)
    calls = []
    monkeypatch.setattr(decode_layer, "layer_kernel", lambda *_: None)  # off: the modules
    seq_off, logits_off = _generate(lm, prompts)
    monkeypatch.setattr(decode_layer, "layer_kernel", lambda *_: (lambda *a: calls.append(fin(*a)), fout))
    seq_on, logits_on = _generate(lm, prompts)
    assert len(calls) == 2 * 19
    assert torch.equal(seq_on, seq_off)
    scale = logits_off.abs().max().item()
    assert (logits_on - logits_off).abs().max().item() <= 1e-2 * scale


def test_a_layer_mixing_int8_and_int4_runs_the_modules():
    lm = _int8_lm("qwen2")
    layer = lm.model.model.layers[0]
    layer.mlp.down_proj.bits = 4  # as one projection of another kind
    assert decode_layer.unfit(layer) == "its projections mix int8 and int4"


def test_rows_sharing_their_positions_decode_alike(monkeypatch):
    """Two rows without a mask share one row of positions (cos and sin broadcast over the batch)."""
    lm = _int8_lm("qwen2")
    ids = lm.tokenizer(["3 + 4 = ", "5 + 6 = "], return_tensors="pt").input_ids  # the same length
    fns = decode_layer.layer_kernel()
    logits = {}
    for on in (False, True):
        monkeypatch.setattr(decode_layer, "layer_kernel", lambda *_, on=on: fns if on else None)
        with torch.inference_mode():
            out = lm.model(ids[:, :-1], use_cache=True)
            logits[on] = lm.model(ids[:, -1:], cache=out.cache).logits.float()  # (2, 1, V)
    assert torch.allclose(logits[True], logits[False], rtol=0, atol=1e-2 * logits[False].abs().max().item())
    assert torch.equal(logits[True].argmax(-1), logits[False].argmax(-1))


def test_calls_it_does_not_take_run_the_modules(counted):
    lm = _int8_lm()
    ids = lm.tokenizer(["3 + 4 = "], return_tensors="pt").input_ids
    with torch.inference_mode():
        out = lm.model(ids, use_cache=True)  # a prefill: several tokens per row
        assert counted == {"kernel": 0, "modules": 2}
        rows = INT8.dense_rows + 1  # more rows than the layers' int8 calls take: a dense GEMM
        lm.model(ids[:, :1].repeat(rows, 1))
        assert counted == {"kernel": 0, "modules": 4}
        lm.model(ids[:, -1:], cache=out.cache)  # a decoding call
        assert counted == {"kernel": 2, "modules": 4}
    with torch.no_grad(), torch.enable_grad():  # autograd on: the modules keep the graph
        lm.model(ids[:, :1])
    assert counted == {"kernel": 2, "modules": 6}


def test_only_int8_llama_style_layers_are_switched():
    from tests.helpers.tiny import tiny_gemma_lm, tiny_lm

    assert decode_layer.describe(tiny_lm().model) is None, "float32: the modules decode"
    assert decode_layer.install(tiny_gemma_lm().model) == 0
    lm = _int8_lm("qwen2")
    layer = lm.model.model.layers[0]
    assert decode_layer.unfit(layer) is None
    layer.self_attn.sliding_window = 8
    assert decode_layer.unfit(layer) == "it attends through a sliding window"
    layer.self_attn.sliding_window = None
    layer.mlp.down_proj.bias = torch.nn.Parameter(torch.zeros(64, dtype=torch.bfloat16), False)
    assert decode_layer.unfit(layer) == "o, gate, up or down has a bias"
    layer.mlp.down_proj.bias = None
    layer.mlp.down_proj.packed = False  # as a projection of a width the kernel's layout does not take
    assert decode_layer.unfit(layer).startswith("not every projection is packed")


def test_off_or_unbuildable_the_modules_decode(monkeypatch, caplog):
    monkeypatch.setenv("SEMSPEC_DECODE_LAYER", "0")
    assert decode_layer.layer_kernel() is None
    assert decode_layer.describe(_int8_lm().model) is None
    monkeypatch.setenv("SEMSPEC_DECODE_LAYER", "auto")
    reload_settings()
    decode_layer.layer_kernel.cache_clear()

    def broken(*a, **kw):
        raise RuntimeError("g++ failed to build the decode_layer kernel: boom")

    assert int8_kernel.int8_mm() is not None  # built before: only the layer kernel's build fails
    monkeypatch.setattr(build, "build", broken)
    with caplog.at_level(logging.WARNING):
        assert decode_layer.layer_kernel() is None
    assert "decode layer kernel off: g++ failed" in caplog.text
    with pytest.raises(ValueError, match="SEMSPEC_DECODE_LAYER"):
        Settings.from_env({"SEMSPEC_DECODE_LAYER": "yes"})


def test_an_int8_model_says_its_layers_decode_through_it():
    assert "; decode layers: semspec's kernel (2 of 2)" in _int8_lm().describe()["why"]


def test_a_copied_model_decodes_with_its_own_weights(monkeypatch):
    """The kernel's weight addresses are gathered once per layer; a deep copy gathers its own, so changing
    the copy's weights changes what the copy decodes, as it does through its modules."""
    import copy

    lm = _int8_lm("qwen2")
    ids = lm.tokenizer(["3 + 4 = "], return_tensors="pt").input_ids
    fns = decode_layer.layer_kernel()

    def last_logits(model, on: bool) -> torch.Tensor:
        monkeypatch.setattr(decode_layer, "layer_kernel", lambda *_: fns if on else None)
        with torch.inference_mode():
            out = model(ids[:, :-1], use_cache=True)
            return model(ids[:, -1:], cache=out.cache).logits.float()  # (1, 1, V)

    before = last_logits(lm.model, True)  # gathers the original's weights
    twin = copy.deepcopy(lm.model)
    with torch.no_grad():
        for layer in twin.model.layers:
            layer.mlp.down_proj.scales.mul_(3)
    changed = last_logits(twin, True)
    assert not torch.allclose(changed, before, atol=1e-3)
    scale = changed.abs().max().item()
    assert torch.allclose(changed, last_logits(twin, False), rtol=0, atol=1e-2 * scale)
    assert torch.equal(last_logits(lm.model, True), before), "the original still decodes its own weights"


def test_a_float_model_loads_without_building_the_kernel(monkeypatch):
    """No layer fits: install neither builds the kernel nor warns that it cannot."""
    from tests.helpers.tiny import tiny_lm

    def build_called():
        raise AssertionError("the layer kernel was built for a model with no int8 layer")

    monkeypatch.setattr(decode_layer, "layer_kernel", build_called)
    assert decode_layer.install(tiny_lm().model) == 0


def test_the_split_benchmark_times_each_part_and_puts_everything_back():
    """``benchmarks/formats.py split``: while timing, every part of a decode call is timed and the call
    computes what it computes untimed; afterwards the kernels, attention and head are the models' own."""
    from benchmarks.formats import _timing_parts

    lm = _int8_lm("qwen2")
    state = lm.prefill("3 + 4 = ")
    nxt = torch.tensor([[int(state.logits.argmax())]])
    plain, _, _ = lm.forward(nxt, state.clone().cache)
    spent = dict.fromkeys(("layer_in", "layer_out", "attention", "head"), 0.0)
    kernel, attend = decode_layer.layer_kernel, attention.attend
    with _timing_parts(lm, spent):
        timed, _, _ = lm.forward(nxt, state.clone().cache)
    assert all(v > 0 for v in spent.values()), spent
    assert torch.equal(timed, plain)
    assert (decode_layer.layer_kernel, attention.attend) == (kernel, attend)
    assert "forward" not in vars(lm.model.get_output_embeddings())
    before = dict(spent)
    lm.forward(nxt, state.clone().cache)
    assert spent == before, "nothing is timed after the block"


FORMATS = [pytest.param(INT8, id="int8"), pytest.param(INT4, id="int4")]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("rows", [1, 2])
def test_a_whole_decoding_call_computes_what_the_model_computes(fmt, arch, rows, monkeypatch):
    """``LM.forward``'s decoding calls through ``decode_model`` give the logits, hidden states and cache
    that the model's own forward gives with the same layer kernel: bit for bit, the same ops in order."""
    lm = _int8_lm(arch, fmt)
    ids = lm.tokenizer(["3 + 4 = ", "5 + 6 = "][:rows], return_tensors="pt").input_ids  # one length
    real, taken = decode_layer.decode_model, []

    def counting(*a):
        got = real(*a)
        taken.append(got is not None)
        return got

    runs = {}
    for on in (False, True):
        monkeypatch.setattr(decode_layer, "decode_model", counting if on else lambda *a: None)
        with torch.inference_mode():
            out = lm.model(ids, use_cache=True)
            cache, nxt, got = out.cache, out.logits[:, -1:].argmax(-1), []
            for _ in range(8):
                logits, hidden, cache = lm.forward(nxt, cache)
                nxt = logits[:, -1].argmax(-1, keepdim=True)
                got.append((logits, hidden))
        runs[on] = got, cache
    assert taken == [True] * 8
    (plain, plain_cache), (whole, whole_cache) = runs[False], runs[True]
    assert plain[0][1].shape == (rows, 1, lm.num_layers + 1, lm.hidden_size)
    assert all(h.is_contiguous() and h.dtype == torch.float32 for _, h in whole)
    for (lp, hp), (lw, hw) in zip(plain, whole, strict=True):
        assert torch.equal(lw, lp) and torch.equal(hw, hp)
    assert whole_cache.get_seq_length() == ids.shape[1] + 8
    for a, b in zip(plain_cache.layers, whole_cache.layers, strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_calls_a_whole_decoding_call_does_not_take_return_none(monkeypatch):
    from transformers.cache_utils import DynamicCache

    from tests.helpers.tiny import tiny_lm

    lm = _int8_lm("qwen2")
    ids = lm.tokenizer(["3 + 4 = "], return_tensors="pt").input_ids
    with torch.inference_mode():
        cache = lm.model(ids, use_cache=True).cache
        nxt = ids[:, -1:]
        assert decode_layer.decode_model(lm.model, ids, cache) is None, "a prefill"
        assert decode_layer.decode_model(lm.model, nxt, DynamicCache(config=lm.model.config)) is None
        rows = INT8.dense_rows + 1  # more rows than the layers' int8 calls take
        wide = lm.model(ids.repeat(rows, 1), use_cache=True).cache
        assert decode_layer.decode_model(lm.model, nxt.repeat(rows, 1), wide) is None
        float_lm = tiny_lm()
        float_cache = float_lm.model(ids, use_cache=True).cache
        assert decode_layer.decode_model(float_lm.model, nxt, float_cache) is None, "no layer in the kernel"
        cache.layers[1].crop(-1)  # layers of unequal lengths
        assert decode_layer.decode_model(lm.model, nxt, cache) is None
        cache = lm.model(ids, use_cache=True).cache
        monkeypatch.setattr(decode_layer, "layer_kernel", lambda *_: None)  # the kernel off
        assert decode_layer.decode_model(lm.model, nxt, cache) is None
    assert cache.get_seq_length() == ids.shape[1], "nothing was written to the cache"
    monkeypatch.undo()
    with torch.no_grad(), torch.enable_grad():  # autograd on
        assert decode_layer.decode_model(lm.model, nxt, cache) is None
