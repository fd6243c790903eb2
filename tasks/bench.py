"""Speed benchmark: the same questions through every method, interleaved, timed in one run."""

from __future__ import annotations

import logging
import resource
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from tqdm.auto import tqdm

from semspec.models.lm import LM
from semspec.models.lm.pair import PairConfig
from semspec.models.spec.names import PROBE_METHOD, PROBE_VARIANTS, method_label
from semspec.models.spec.results import DecodeResult
from semspec.models.spec.settings import DecodeSettings, MethodNotApplicable
from semspec.tasks.data import generate_arith
from semspec.tasks.decoders import build_decoder, decode_settings
from semspec.tasks.llamacpp import LlamaCppDecoder, LlamaServer, gguf_path

log = logging.getLogger(__name__)

LLAMACPP, LLAMACPP_SPEC = "llamacpp", "llamacpp-spec"  # llama.cpp's target alone, and with the draft


def bench_methods(
    pair: PairConfig,
    lms: dict[str, LM],
    settings: DecodeSettings,
    with_assisted: bool = True,
    variants: tuple[str, ...] = PROBE_VARIANTS,
    both_salvage: bool = False,
    also_gammas: tuple[int, ...] = (),
) -> tuple[list[tuple[str, object]], dict[str, str]]:
    """(label, decoder) for target, token-level speculative sampling (one vocabulary only), transformers'
    assisted generation and SemanticSpec with every registered probe (with ``both_salvage`` each also
    the other way, ``<label>/no-salvage`` or ``<label>/salvage``, and with each of ``also_gammas``,
    ``<label>/gamma<g>``, in the same run); and the labels skipped, with why."""
    out = [("target", build_decoder("target", pair, lms, settings))]
    skipped: dict[str, str] = {}
    try:
        out.append(("specsampling", build_decoder("specsampling", pair, lms, settings)))
    except MethodNotApplicable as e:
        skipped["specsampling"] = str(e)
    if with_assisted:
        out.append(("assisted", build_decoder("assisted", pair, lms, settings)))
    for v in variants:
        try:
            out.append((method_label(PROBE_METHOD, v), build_decoder(PROBE_METHOD, pair, lms, settings, v)))
            if both_salvage:
                other = replace(settings, salvage=not settings.salvage)
                dec = build_decoder(PROBE_METHOD, pair, lms, other, v)
                out.append((f"{method_label(PROBE_METHOD, v)}/{'' if other.salvage else 'no-'}salvage", dec))
            for g in also_gammas:
                dec = build_decoder(PROBE_METHOD, pair, lms, replace(settings, gamma=g), v)
                out.append((f"{method_label(PROBE_METHOD, v)}/gamma{g}", dec))
        except ValueError as e:  # not registered for this pair: say so, bench the rest
            skipped[method_label(PROBE_METHOD, v)] = str(e)
    for label, why in skipped.items():
        log.warning("bench: skipping %s: %s", label, why)
    return out, skipped


def summarize(results: dict[str, list[DecodeResult]]) -> dict[str, dict[str, Any]]:
    """Per method: median ms per output token, mean latency per question, both speed-ups against the
    target on the same questions (``speedup_latency``: mean latency, the paper's; ``speedup_per_token``:
    median time per output token), where the time goes, acceptance."""
    per_tok = {m: [r.timings.total / max(1, r.output_tokens) for r in rs] for m, rs in results.items()}
    latency = {m: statistics.mean(r.timings.total for r in rs) for m, rs in results.items()}
    base = statistics.median(per_tok["target"]) if "target" in per_tok else None
    base_latency = latency.get("target")
    llama_latency = latency.get(LLAMACPP)
    out = {}
    for m, rs in results.items():
        total = sum(r.timings.total for r in rs) or 1.0
        med = statistics.median(per_tok[m])
        acc = [r.acceptance_rate for r in rs if r.acceptance_rate is not None]
        stepped = any(r.steps for r in rs)
        out[m] = {
            "ms_per_token": 1000 * med,
            "latency_s": latency[m],
            "speedup_latency": base_latency / latency[m] if base_latency and latency[m] else None,
            "speedup_per_token": base / med if base else None,
            "output_tokens": sum(r.output_tokens for r in rs),
            "share_draft": sum(r.timings.draft for r in rs) / total,
            "share_verify": sum(r.timings.verify for r in rs) / total,
            "share_target": sum(r.timings.target for r in rs) / total,
            "share_probe": sum(r.timings.probe for r in rs) / total,
            "step_acceptance": statistics.mean(acc) if acc else None,
            # step figures: none for a method that writes no steps (llama.cpp's)
            "target_share": statistics.mean(r.target_share for r in rs) if stepped else None,
            "prefill_per_output_token": statistics.mean(r.prefill_per_output_token for r in rs)
            if stepped
            else None,
        }
        if llama_latency:  # llama.cpp's target alone on the same files and questions
            out[m]["speedup_vs_llamacpp"] = llama_latency / latency[m] if latency[m] else None
        salvaged = sum(st.salvaged for r in rs for st in r.steps)
        if salvaged:  # target tokens of rejected steps kept from the proposal instead of decoded
            out[m]["salvaged_share"] = salvaged / max(1, sum(r.target_tokens for r in rs))
        tok_acc = [r.extra["token_acceptance_rate"] for r in rs if "token_acceptance_rate" in r.extra]
        if tok_acc:
            out[m]["token_acceptance"] = statistics.mean(tok_acc)
    return out


def run_bench(
    pair: PairConfig,
    lms: dict[str, LM],
    n: int,
    settings: DecodeSettings,
    seed: int = 0,
    with_assisted: bool = True,
    variants: tuple[str, ...] = PROBE_VARIANTS,
    both_salvage: bool = False,
    also_gammas: tuple[int, ...] = (),
    extra: tuple[tuple[str, Any], ...] = (),
) -> dict[str, dict[str, Any]]:
    """Decode ``n`` arithmetic test questions with every method (and the (label, decoder) pairs in
    ``extra``: llama.cpp's), rotating the order per question."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    methods, skipped = bench_methods(pair, lms, settings, with_assisted, variants, both_salvage, also_gammas)
    methods += list(extra)
    questions = [p.question for p in generate_arith(n, "test", seed=seed)]
    results: dict[str, list[DecodeResult]] = {m: [] for m, _ in methods}
    with tqdm(total=n * len(methods), desc="bench", unit="decode") as bar:
        for i, q in enumerate(questions):
            k = i % len(methods)
            for label, dec in methods[k:] + methods[:k]:  # interleaved, rotated: no method always runs first
                results[label].append(dec.decode(q))
                bar.update(1)
    summary = summarize(results)
    summary.update(model_notes(lms))
    if skipped:
        summary["_skipped"] = skipped
    return summary


def run_batch_bench(
    pair: PairConfig,
    lms: dict[str, LM],
    n: int,
    settings: DecodeSettings,
    batches: tuple[int, ...] = (1, 4, 8),
    variants: tuple[str, ...] = ("all",),
    seed: int = 0,
) -> dict[str, Any]:
    """Throughput at each batch size: the same ``n`` questions through ``target`` and SemanticSpec (each
    variant), every problem decoded in batches of B with continuous batching. Per (B, method): output
    tokens per second over the batch, mean per-problem latency (join to finish), the ratio to ``target`` at
    the same B and to the method's own throughput at the smallest B. Token-level methods are batch-1 only
    and are not in this table."""
    if n < 1 or not batches or min(batches) < 1:
        raise ValueError(f"n and every batch size must be >= 1, got n={n}, batches={batches}")
    methods, skipped = bench_methods(pair, lms, settings, False, variants)
    methods = [(label, dec) for label, dec in methods if label == "target" or label.startswith(PROBE_METHOD)]
    questions = [p.question for p in generate_arith(n, "test", seed=seed)]
    rows: dict[str, Any] = {}
    with tqdm(total=len(batches) * len(methods) * n, desc="bench --batch", unit="decode") as bar:
        for i, b in enumerate(sorted(batches)):
            k = i % len(methods)
            for label, dec in methods[k:] + methods[:k]:  # rotated: no method always runs first
                t0 = time.perf_counter()
                results = dec.decode_batch(questions, b, on_result=lambda *_: bar.update(1))
                wall = time.perf_counter() - t0
                tokens = sum(r.output_tokens for r in results)
                acc = [r.acceptance_rate for r in results if r.acceptance_rate is not None]
                rows[f"{label}@{b}"] = {
                    "method": label,
                    "batch": b,
                    "wall_s": wall,
                    "output_tokens": tokens,
                    "throughput_tps": tokens / wall,
                    "latency_s": statistics.mean(r.timings.total for r in results),
                    "step_acceptance": statistics.mean(acc) if acc else None,
                }
    for row in rows.values():
        base = rows.get(f"target@{row['batch']}")
        first = rows[f"{row['method']}@{min(batches)}"]
        row["x_target_throughput"] = row["throughput_tps"] / base["throughput_tps"] if base else None
        row["x_target_latency"] = base["latency_s"] / row["latency_s"] if base else None
        row["x_own_smallest_batch"] = row["throughput_tps"] / first["throughput_tps"]
    out: dict[str, Any] = dict(
        sorted(rows.items(), key=lambda kv: (kv[1]["method"] != "target", kv[1]["method"], kv[1]["batch"]))
    )
    out.update(model_notes(lms))
    out["_notes"] = {
        "token-level": "specsampling and assisted decode one problem at a time; they are not in this table",
        "latency": "per problem, from joining the batch to its last step",
    }
    if skipped:
        out["_skipped"] = skipped
    return out


def model_notes(lms: dict[str, LM]) -> dict[str, dict[str, str]]:
    """What every figure is printed beside: each model (id, format, device) and why it runs in that
    format on this CPU."""
    return {
        "_models": {r: str(lm) for r, lm in lms.items()},
        "_formats": {r: lm.describe()["why"] for r, lm in lms.items()},
    }


def _table(
    summary: dict[str, Any], cols: list[str], width: int, row: Callable[[str, dict, Callable], list[str]]
) -> str:
    """An aligned table: a header, a line per entry (``row(key, entry, num)`` gives its cells, the label
    first, padded here to the longest; ``num`` formats a number or a share), then the ``_``-prefixed
    entries as notes."""

    def num(v: float | None, pct: bool = False) -> str:
        if v is None:
            return f"{'n/a':>{width}s}"
        return f"{100 * v:{width - 1}.1f}%" if pct else f"{v:{width}.2f}"

    rows = {key: row(key, s, num) for key, s in summary.items() if not key.startswith("_")}
    label = max([20] + [len(cells[0]) for cells in rows.values()])  # long labels (``/gamma2``) stay aligned
    lines = [f"{'method':{label}s} " + " ".join(f"{c:>{width}s}" for c in cols)]
    lines += [" ".join([f"{cells[0]:{label}s}", *cells[1:]]) for cells in rows.values()]
    notes = []
    for key, s in summary.items():
        if key.startswith("_"):
            notes += [f"{key.strip('_')}: {k}: {v}" for k, v in s.items()]
    return "\n".join(lines + notes)


def format_batch_bench(summary: dict[str, Any]) -> str:
    """The batch table: throughput and latency per (method, batch size), each beside ``target`` at the
    same batch size; then each model's dtype and the notes."""
    cols = ["batch", "tok/s", "latency s", "x target tok/s", "x target lat", "x own batch-min", "step acc"]
    keys = ["throughput_tps", "latency_s", "x_target_throughput", "x_target_latency", "x_own_smallest_batch"]
    return _table(
        summary,
        cols,
        15,
        lambda _, s, num: [
            s["method"],
            f"{s['batch']:15d}",
            *(num(s[k]) for k in keys),
            num(s["step_acceptance"]),
        ],
    )


def format_bench(summary: dict[str, dict[str, Any]]) -> str:
    """The summary as an aligned text table, then each model's dtype and what was skipped."""
    cols = [
        "ms/tok",
        "latency s",
        "x latency",
        "x per tok",
        "x llama.cpp",
        "draft",
        "verify",
        "target",
        "probe",
        "step acc",
        "target share",
        "prefill/out",
    ]
    speed = ["ms_per_token", "latency_s", "speedup_latency", "speedup_per_token"]
    shares = ["share_draft", "share_verify", "share_target", "share_probe"]
    rest = ["step_acceptance", "target_share", "prefill_per_output_token"]
    return _table(
        summary,
        cols,
        12,
        lambda m, s, num: [
            m,
            *(num(s[k]) for k in speed),
            num(s.get("speedup_vs_llamacpp")),
            *(num(s[k], True) for k in shares),
            *(num(s[k]) for k in rest),
        ],
    )


def bench(
    params: Any,
    pair_name: str,
    n: int,
    batch: tuple[int, ...] = (),
    variants: tuple[str, ...] = PROBE_VARIANTS,
    with_assisted: bool = True,
    both_salvage: bool = False,
    also_gammas: tuple[int, ...] = (),
    llamacpp: str | None = None,
    **options: Any,
) -> tuple[dict[str, Any], str]:
    """`semspec bench`: load ``pair_name``'s models and time every method on ``n`` questions with the
    evaluation's settings (``options`` replace single fields: the budget, salvage, lookahead, gamma), one
    at a time (SemanticSpec also with each of ``also_gammas``), or per batch size in ``batch``
    (SemanticSpec with ``variants``). With ``llamacpp`` (a ``llama-server`` binary, ``tasks/llamacpp.py``)
    llama.cpp's target alone and its speculative decoding with the draft run beside them, on the pair's
    GGUF files. Returns the summary and its table."""
    from semspec.models.lm import load_lm
    from semspec.models.project.pairs import load_pair
    from semspec.models.spec.names import ROLES

    if bad := set(variants) - set(PROBE_VARIANTS):
        raise ValueError(f"unknown probe variant(s) {sorted(bad)}; expected {PROBE_VARIANTS}")
    pair = load_pair(pair_name, None, params.split_strategy)
    settings = decode_settings(params.evaluate, **options)
    for g in also_gammas:
        replace(settings, gamma=g)  # a bad gamma is refused before the models load
    if llamacpp and batch:
        raise ValueError("--llamacpp runs with the one-at-a-time table, not with --batch")
    lms = {r: load_lm(pair.role(r)) for r in ROLES}
    files = {r: gguf_path(pair.role(r)) for r in ROLES} if llamacpp else {}  # on disk once loaded
    if batch:
        summary = run_batch_bench(pair, lms, n, settings, batch, variants)
        return summary, format_batch_bench(summary)
    args = (pair, lms, n, settings, 0, with_assisted, variants, both_salvage, also_gammas)
    if not llamacpp:
        summary = run_bench(*args)
        return summary, format_bench(summary)
    threads = torch.get_num_threads()
    with (
        LlamaServer(llamacpp, files["target"], threads=threads) as alone,
        LlamaServer(llamacpp, files["target"], files["draft"], threads=threads) as drafted,
    ):
        extra = (
            (LLAMACPP, LlamaCppDecoder(LLAMACPP, alone, lms["target"], settings)),
            (LLAMACPP_SPEC, LlamaCppDecoder(LLAMACPP_SPEC, drafted, lms["target"], settings)),
        )
        summary = run_bench(*args, extra)
    summary["_llamacpp"] = {
        "build": alone.version(),
        "files": f"target {files['target'].name}, draft {files['draft'].name} (as shipped, mmap)",
        "prompts": "the target's chat-formatted prompt, greedy, the same token budget, no prompt cache",
    }
    summary["_peak_rss"] = {
        "semspec (every semspec method, one process)": f"{peak_rss_gb():.2f} GB",
        LLAMACPP: f"{alone.peak_rss_gb or float('nan'):.2f} GB",
        LLAMACPP_SPEC: f"{drafted.peak_rss_gb or float('nan'):.2f} GB",
    }
    return summary, format_bench(summary)


def peak_rss_gb() -> float:
    """This process's peak resident set, GB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
