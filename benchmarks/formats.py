"""Numeric formats on the CPU at hand: what each costs per call, and what it changes in the answers.

    python benchmarks/formats.py layer                      # one linear layer of the 1.5B target, by rows
    python benchmarks/formats.py attention                  # one decode call's attention, by context
    python benchmarks/formats.py speed [--pair qwen-coder] [--formats bfloat16 float32 int8 int8-torch int4]
    python benchmarks/formats.py quality [--pair qwen-coder] [--n 40] [--formats bfloat16 int8]
    python benchmarks/formats.py split [--pair qwen-coder]      # where one decode token goes, by part

``speed`` loads each model of the pair in each format (``semspec.models.lm.load_lm``, the product's own
calls: hidden states kept, pooled as decoding pools) and prints decode ms/token for 1 row, one decode
forward of 8 rows, a step's verification prefill (ms/token, 1 row, cached context) and a prompt
prefill, beside the floor: the bytes one decode token reads (every linear layer's weights and scales,
the output head included; embeddings are gathered, not read) over the read bandwidth measured here.
``quality`` decodes ``--n`` arithmetic test problems with the target alone in each format (greedy, the
evaluation's batching) and prints pass@1 with its 95% interval, the paired difference to the first
format, and token agreement with it (the share of its output tokens each problem shares as a prefix,
and the problems with the same output). The CPU's capability and each model's format are printed beside
every figure. ``int8-torch`` is int8 with every semspec kernel off (``SEMSPEC_KERNELS=off``: decoding
calls through PyTorch's ``_weight_int8pack_mm``, SDPA attention, the modules), to compare in one run;
``int4-dense`` is int4 with a bfloat16 copy for calls above 8 rows (the rule before the int4 kernel's
tiles); a ``-sdpa`` suffix (e.g.
``int8-sdpa``) decodes with transformers' SDPA attention instead of semspec's decode attention
(``models/cpu/attention.py``). ``attention`` times one decode call's attention both ways, per head shape
(the defaults: the 0.5B's and the 1.5B's) and context length. ``--as-avx2`` (any command) runs as an AVX2-only CPU would, on an AVX-512 one: semspec's AVX2 builds, the
format rule without AVX-512 or AMX, PyTorch's and oneDNN's AVX2 kernels. ``split`` decodes with each model in
``auto`` and times the parts of each token inside ``LM.forward``: the decode layers' two C calls
(``layer_in``, ``layer_out``, summed over the layers), decode attention, the output head, and the rest
(Python, the cache's ``update``, hidden states), one line per pass.
"""

from __future__ import annotations

import os
import sys

if "--as-avx2" in sys.argv:  # before torch loads: its kernel dispatch reads these once
    sys.argv.remove("--as-avx2")
    os.environ.update(SEMSPEC_KERNELS="avx2", ATEN_CPU_CAPABILITY="avx2", ONEDNN_MAX_CPU_ISA="AVX2")

import argparse
import contextlib
import dataclasses
import functools
import statistics
import time
from collections.abc import Iterator

import torch

from semspec.models.cpu import attention, decode_layer, formats, int4_kernel, int8_kernel
from semspec.models.cpu.cpuinfo import cpu_info
from semspec.models.cpu.formats import DENSE_DTYPES, Format, QuantLinear
from semspec.models.lm import LM, LMState, load_lm
from semspec.models.project.pairs import load_pair
from semspec.models.project.settings import reload_settings
from semspec.models.spec.grading import grade
from semspec.models.spec.settings import DecodeSettings
from semspec.tasks.data import generate_arith
from semspec.tasks.decoders import build_decoder
from semspec.tasks.evaluate.stats import bootstrap_pass

LONG_REPEATS = 16  # the long prompt: CONTEXT this many times (about 600 tokens), where attention weighs
CONTEXT = "A store sells pencils at 3 for $1. Tom buys 12 pencils and 4 erasers that cost $0.50 each. How much does Tom spend in total?"
STEP = "Next, 4 erasers at $0.50 each cost 4 * 0.50 = $2, so the erasers cost $2 in total.\n\n"


def bandwidth_gbs() -> float:
    """Read bandwidth: the best of five sums over 1 GiB of float32."""
    x = torch.ones(256 * 1024 * 1024)
    best = 1e9
    for _ in range(6):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best / 1e9


def decode_bytes(model: torch.nn.Module) -> int:
    """Bytes one decode token reads: every linear layer's weights (int weights and scales for a quantized
    one), biases and norms; embedding tables are gathered a row at a time and left out."""
    total = 0
    for mod in model.modules():
        if isinstance(mod, QuantLinear):
            total += sum(t.numel() * t.element_size() for t in (mod.qweight, mod.scales))
        elif isinstance(mod, torch.nn.Linear):
            total += mod.weight.numel() * mod.weight.element_size()
    return total


# a format's suffix -> the setting that turns one of semspec's kernels off, to compare in one run
DENSE_COPY = (
    "int4 dense copy"  # not a variable: int4 with a bfloat16 copy for calls above 8 rows (the old rule)
)
SUFFIXES = {
    "-torch": ("SEMSPEC_KERNELS", "off"),
    "-sdpa": ("SEMSPEC_DECODE_ATTENTION", "0"),
    "-layer": ("SEMSPEC_DECODE_LAYER", "0"),
    "-plain": ("SEMSPEC_ONEDNN_PACK", "0"),
    "-dense": (DENSE_COPY, "8"),
}


@contextlib.contextmanager
def kernels_off(env: dict[str, str]) -> Iterator[None]:
    """semspec's kernels turned off as ``env`` says (e.g. ``{"SEMSPEC_KERNELS": "off"}``) while inside;
    ``DENSE_COPY`` gives int4 on a CPU with native bfloat16 a dense copy for calls above that many rows."""
    env = dict(env)
    rows = env.pop(DENSE_COPY, None)
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    _reload()
    old_rows = formats.DENSE_ROWS[("int4", True)]
    if rows is not None:
        formats.DENSE_ROWS[("int4", True)] = int(rows)
    try:
        yield
    finally:
        formats.DENSE_ROWS[("int4", True)] = old_rows
        for k, v in old.items():
            if v is None:
                os.environ.pop(k)
            else:
                os.environ[k] = v
        _reload()


def _reload() -> None:
    reload_settings()
    int8_kernel.int8_mm.cache_clear()
    int4_kernel.int4_mm.cache_clear()
    attention.attention_kernel.cache_clear()
    decode_layer.layer_kernel.cache_clear()


def _split(fmt: str) -> tuple[str, dict[str, str]]:
    """``int8-torch`` -> (``int8``, {SEMSPEC_KERNELS: off}): the format, and the kernels it runs without."""
    for suffix, (var, value) in SUFFIXES.items():
        if fmt.endswith(suffix):
            return fmt.removesuffix(suffix), {var: value}
    return fmt, {}


def _kernel(fmt_name: str, off: dict[str, str]) -> str:
    if "SEMSPEC_DECODE_ATTENTION" in off:
        return " [SDPA decode]"
    if "SEMSPEC_DECODE_LAYER" in off:
        return " [modules decode]"
    if "SEMSPEC_ONEDNN_PACK" in off:
        return " [plain dense copy]"
    if DENSE_COPY in off:
        return " [dense copy]"
    if fmt_name not in ("int8", "int4"):
        return ""
    kernel = int8_kernel.int8_mm() if fmt_name == "int8" else int4_kernel.int4_mm()
    return " [torch op]" if off or kernel is None else " [semspec kernel]"


def _best(fn, reps: int = 3) -> float:
    fn()
    return min(_timed(fn) for _ in range(reps))


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _decode(lm: LM, start: LMState, n: int) -> None:
    """Greedy-decode ``n`` tokens after ``start``, one row, extending its cache in place."""
    cache, nxt = start.cache, torch.tensor([[int(start.logits.argmax())]])
    for _ in range(n):
        logits, _, cache = lm.forward(nxt, cache)
        nxt = logits[:, -1].argmax(-1, keepdim=True)


@torch.inference_mode()
def costs(lm: LM, tokens: int = 24) -> dict[str, float]:
    """ms: decode per token (1 row; after the short prompt and after a long one), one decode forward of 8
    rows, step prefill per token, prompt prefill."""
    prompt = lm.format_prompt(CONTEXT)
    state = lm.prefill(prompt)
    step = lm.continuation_ids(state.text, state.ids, STEP)

    long = lm.prefill(lm.format_prompt(" ".join([CONTEXT] * LONG_REPEATS)))
    rows = [state.clone() for _ in range(8)]

    def decode_eight():
        caches = [r.clone().cache for r in rows]
        lm.forward_rows(caches, [[int(state.logits.argmax())]] * 8)

    return {
        "decode": 1000 * _best(lambda: _decode(lm, state.clone(), tokens)) / tokens,
        "decode_long": 1000 * _best(lambda: _decode(lm, long.clone(), 8)) / 8,
        "long_tokens": len(long.ids),
        "decode8": 1000 * _best(decode_eight),
        "step": 1000 * _best(lambda: lm.score_steps([state.clone()], [STEP])) / len(step),
        "prompt": 1000 * _best(lambda: lm.prefill(prompt), reps=2),
        "prompt_tokens": len(state.ids),
    }


def speed(a: argparse.Namespace) -> None:
    bw = bandwidth_gbs()
    print(f"cpu: {cpu_info().label()}, threads {torch.get_num_threads()}, read bandwidth {bw:.1f} GB/s")
    print(
        f"{'model':42s} {'format':47s} {'decode 1 row':>13s} {'long ctx':>10s} {'fwd 8 rows':>11s} {'step prefill':>13s}"
        f" {'prompt':>9s} {'floor':>7s} {'x floor':>7s}"
    )
    pair = load_pair(a.pair)
    for role in ("draft", "target"):
        for fmt in a.formats:
            name, off = _split(fmt)
            with kernels_off(off):  # loaded inside too: int8 packs its weights only where the kernel runs
                lm = load_lm(dataclasses.replace(pair.role(role), dtype=name))
                c = costs(lm)
                label = lm.dtype_name + _kernel(name, off)
            floor = decode_bytes(lm.model) / 1e9 / bw * 1000
            print(
                f"{lm.model_id[:42]:42s} {label[:47]:47s} {c['decode']:8.1f} ms/t {c['decode_long']:5.1f} ms/t"
                f" {c['decode8']:8.1f} ms"
                f" {c['step']:8.2f} ms/t {c['prompt']:6.0f} ms {floor:5.1f} ms {c['decode'] / floor:6.2f}x",
                flush=True,
            )
            del lm
    print(
        f"prompt: {c['prompt_tokens']} tokens (long ctx: {c['long_tokens']}, the same 'decode 1 row' after"
        f" it); step: {STEP!r}"
    )


def layer(a: argparse.Namespace) -> None:
    """One linear layer of the 1.5B (1536 -> 8960), 28 distinct copies so its weights come from memory. The
    int8 and int4 columns are what those formats run on this CPU (``resolve_format``: the int kernel up to
    the format's dense rows, a dense GEMM above); "bf16 oneDNN" is bfloat16 with the weight packed once
    in oneDNN's layout (``onednn_pack``, the quantized formats' dense copy where the CPU has native
    bfloat16); the last two run each int8 kernel at every row count: PyTorch's op on its own layout,
    semspec's on its packed one."""
    from semspec.models.cpu.formats import onednn_linear, onednn_pack, resolve_format

    k, n, copies = 1536, 8960, 28
    torch.manual_seed(0)
    dense = [torch.nn.Linear(k, n, bias=False).to(torch.bfloat16) for _ in range(copies)]
    fp32 = [torch.nn.Linear(k, n, bias=False) for _ in range(copies // 2)]
    formats = {name: resolve_format(name) for name in ("int8", "int4")}
    quant = {name: [QuantLinear(d, fmt) for d in dense] for name, fmt in formats.items()}
    packed = [p for p in (onednn_pack(d.weight.detach()) for d in dense) if p is not None]
    with kernels_off(_split("int8-torch")[1]):  # int8 in PyTorch's layout (the kernel packs its own)
        plain = [QuantLinear(d, Format("int8", torch.bfloat16)) for d in dense]
    print(
        f"cpu: {cpu_info().label()}, threads {torch.get_num_threads()}; ms per call of one {k}->{n} layer;"
        f" {int8_kernel.describe()}; " + "; ".join(f"{name}: {fmt.label()}" for name, fmt in formats.items())
    )
    kernel = int8_kernel.int8_mm()
    print(
        f"{'rows':>5s} {'float32':>9s} {'bfloat16':>9s} {'bf16 oneDNN':>12s} {'int8':>9s} {'int4':>9s}"
        f" {'torch op':>9s} {'kernel' if kernel is None else 'kernel (' + kernel.isa + ')':>15s}"
    )
    with torch.inference_mode():
        for m in a.rows:
            x = torch.randn(m, k)
            xb = x.bfloat16()
            cells = [_best(lambda x=x: [f(x) for f in fp32]) / len(fp32)]
            cells.append(_best(lambda xb=xb: [f(xb) for f in dense]) / copies)
            onednn = _best(lambda xb=xb: [onednn_linear(xb, p) for p in packed]) / copies if packed else None
            cells += [_best(lambda q=q, xb=xb: [f(xb) for f in q]) / copies for q in quant.values()]
            with kernels_off(_split("int8-torch")[1]):  # PyTorch's op for every int8 call
                cells.append(_best(lambda xb=xb: [f(xb) for f in plain]) / copies)
            if kernel is not None:
                cells.append(
                    _best(lambda xb=xb: [kernel(xb, f.qweight, f.scales) for f in quant["int8"]]) / copies
                )
            print(
                f"{m:5d} " + " ".join(f"{1000 * c:9.2f}" for c in cells[:2]),
                f"{'n/a' if onednn is None else f'{1000 * onednn:.2f}':>12s}",
                " ".join(f"{1000 * c:9.2f}" for c in cells[2:5]),
                *(f"{1000 * c:15.2f}" for c in cells[5:]),
                flush=True,
            )


def attention_cost(a: argparse.Namespace) -> None:
    """One decode call's attention (one query, a cache of ``--contexts`` positions) per head shape, us per
    call: transformers' SDPA function and semspec's decode kernel, in bfloat16 and float32."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    print(
        f"cpu: {cpu_info().label()}, threads {torch.get_num_threads()}; us per call of one layer's attention"
    )
    print(f"{'heads/kv/dim':>13s} {'ctx':>5s} {'dtype':>9s} {'SDPA':>8s} {'kernel':>8s} {'x':>6s}")
    for shape in a.shapes:
        heads, kv, dim = (int(v) for v in shape.split("/"))
        layer = torch.nn.Module()
        layer.num_key_value_groups, layer.is_causal = heads // kv, True
        for ctx in a.contexts:
            for dtype in (torch.bfloat16, torch.float32):
                q = torch.randn(1, heads, 1, dim).to(dtype)
                k, v = torch.randn(2, 1, kv, ctx, dim).to(dtype)
                reps = 200

                def loop(fn, layer=layer, q=q, k=k, v=v, reps=reps):
                    for _ in range(reps):
                        fn(layer, q, k, v, None)

                sdpa = _best(lambda: loop(sdpa_attention_forward)) / reps
                kern = _best(lambda: loop(attention.decode_attention)) / reps
                print(
                    f"{shape:>13s} {ctx:5d} {str(dtype).removeprefix('torch.'):>9s} {1e6 * sdpa:8.1f}"
                    f" {1e6 * kern:8.1f} {sdpa / kern:6.2f}",
                    flush=True,
                )


def quality(a: argparse.Namespace) -> None:
    pair = load_pair(a.pair)
    problems = generate_arith(a.n, "test", seed=0)
    settings = DecodeSettings(max_new_tokens=a.max_new_tokens, temperature=0.0)
    print(
        f"cpu: {cpu_info().label()}; {a.n} arithmetic test problems, target alone, greedy, {a.max_new_tokens} tokens"
    )
    outs: dict[str, list] = {}
    for fmt in a.formats:
        name, off = _split(fmt)
        with kernels_off(off):  # loaded inside: the dense copy is made at load
            lm = load_lm(dataclasses.replace(pair.target, dtype=name))
            dec = build_decoder("target", pair, {"target": lm}, settings)
            t0 = time.perf_counter()
            res = dec.decode_batch([p.question for p in problems], a.batch)
            wall = time.perf_counter() - t0
            label = lm.dtype_name + _kernel(name, off)
        grades = [grade("arith", p.answer, r.text)[1] for p, r in zip(problems, res, strict=True)]
        ids = [lm.tokenizer(r.text, add_special_tokens=False)["input_ids"] for r in res]
        outs[fmt] = [label, grades, ids, wall]
        del lm, dec
    _, base_grades, base_ids, _ = outs[a.formats[0]]
    print(
        f"{'format':47s} {'pass@1':>7s} {'95% CI':>14s} {'vs ' + a.formats[0]:>18s} {'token agreement':>16s} {'same output':>12s} {'wall s':>7s}"
    )
    for label, grades, ids, wall in outs.values():
        stats = bootstrap_pass(grades, base_grades)
        agree = [_prefix(x, y) / max(1, len(y)) for x, y in zip(ids, base_ids, strict=True)]
        same = sum(x == y for x, y in zip(ids, base_ids, strict=True))
        lo, hi = stats["pass@1_ci95"]
        dlo, dhi = stats["delta_vs_target_ci95"]
        print(
            f"{label[:47]:47s} {statistics.mean(grades):7.3f}  [{lo:.2f}, {hi:.2f}]  {stats['delta_vs_target']:+.3f} [{dlo:+.2f}, {dhi:+.2f}]"
            f" {statistics.mean(agree):16.3f} {same:6d}/{len(ids)} {wall:7.0f}",
            flush=True,
        )


@contextlib.contextmanager
def _timing_parts(lm: LM, spent: dict[str, float]) -> Iterator[None]:
    """Add the seconds spent in each part of a decode call to ``spent`` while inside."""

    def timed(fn, part: str):
        def call(*args, **kwargs):
            t = time.perf_counter()
            out = fn(*args, **kwargs)
            spent[part] += time.perf_counter() - t
            return out

        return call

    kernel, attend, head = (
        decode_layer.layer_kernel,
        attention.attend,  # every decoding call's attention kernel (the modules' and the whole call's)
        lm.model.get_output_embeddings(),
    )
    bits = getattr(lm.model.get_output_embeddings(), "bits", 8)
    fns = kernel(bits)
    if fns is not None:
        timed_fns = (timed(fns[0], "layer_in"), timed(fns[1], "layer_out"))
        decode_layer.layer_kernel = lambda *_: timed_fns
    attention.attend = timed(attend, "attention")
    head.forward = timed(head.forward, "head")
    try:
        yield
    finally:
        decode_layer.layer_kernel, attention.attend = kernel, attend
        del head.forward  # the class's own again


@torch.inference_mode()
def split(a: argparse.Namespace) -> None:
    print(f"cpu: {cpu_info().label()}, threads {torch.get_num_threads()}; ms per decode token, 1 row")
    parts = ("layer_in", "layer_out", "attention", "head")
    print(f"{'model':42s} {'format':30s} {'total':>7s} " + " ".join(f"{p:>9s}" for p in (*parts, "rest")))
    pair = load_pair(a.pair)
    for role in ("draft", "target"):
        lm = load_lm(dataclasses.replace(pair.role(role), dtype="auto"))
        state = lm.prefill(lm.format_prompt(CONTEXT))
        for n in range(a.passes + 1):  # the first pass warms up
            spent, start = dict.fromkeys(parts, 0.0), state.clone()
            with _timing_parts(lm, spent):
                total = _timed(functools.partial(_decode, lm, start, a.tokens))
            ms = {k: 1000 * v / a.tokens for k, v in spent.items()}
            ms["rest"] = 1000 * total / a.tokens - sum(ms.values())
            if n > 0:
                print(
                    f"{lm.model_id[:42]:42s} {lm.dtype_name[:30]:30s} {1000 * total / a.tokens:7.2f} "
                    + " ".join(f"{ms[p]:9.2f}" for p in (*parts, "rest")),
                    flush=True,
                )
        del lm


def _prefix(a: list[int], b: list[int]) -> int:
    """Length of the common prefix of two token lists."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    s = sub.add_parser("speed")
    s.add_argument("--pair", default="qwen-coder")
    s.add_argument("--formats", nargs="+", default=["bfloat16", "float32", "int8", "int8-torch", "int4"])
    la = sub.add_parser("layer")
    la.add_argument("--rows", nargs="+", type=int, default=[1, 2, 4, 8, 16, 48, 384])
    at = sub.add_parser("attention")
    at.add_argument("--shapes", nargs="+", default=["14/2/64", "12/2/128"], help="heads/kv heads/head dim")
    at.add_argument("--contexts", nargs="+", type=int, default=[64, 150, 300, 600, 1200])
    q = sub.add_parser("quality")
    q.add_argument("--pair", default="qwen-coder")
    q.add_argument("--n", type=int, default=40)
    q.add_argument("--batch", type=int, default=8)
    q.add_argument("--max-new-tokens", type=int, default=512)
    q.add_argument("--formats", nargs="+", default=["bfloat16", "int8"])
    sp = sub.add_parser("split")
    sp.add_argument("--pair", default="qwen-coder")
    sp.add_argument("--tokens", type=int, default=48)
    sp.add_argument("--passes", type=int, default=3)
    a = ap.parse_args()
    if getattr(a, "formats", None):
        bad = [f for f in a.formats if _split(f)[0] not in (*DENSE_DTYPES, "int8", "int4", "auto")]
        bad += [f for f in a.formats if f.endswith("-torch") and _split(f)[0] != "int8"]
        if bad:
            ap.error(f"unknown format(s) {bad}")
    fns = {"speed": speed, "layer": layer, "attention": attention_cost, "quality": quality, "split": split}
    fns[a.what](a)


if __name__ == "__main__":
    main()
