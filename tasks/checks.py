"""The inspection tools behind `semspec models check`, `semspec data check` and `semspec judge calibrate`:
each yields the lines it reports, so the command only prints them."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

from semspec.models.lm.pair import ModelConfig, PairConfig

CHECK_QUESTION = (
    "A store sells pencils at 3 for $1. Tom buys 12 pencils and 4 erasers that cost $0.50 each. "
    "How much does Tom spend in total?"
)
CHECK_STEP = "First, 12 pencils at 3 for $1 means 12 / 3 = 4 groups, so the pencils cost $4.\n\n"


def model_check(role: str, model_cfg: ModelConfig, tokens: int) -> Iterator[str]:
    """Load one model, time ``tokens`` greedy decode tokens and a verifier's step prefill on a cached
    context, and report its shapes, format and one generated step."""
    from semspec.models.lm import load_lm

    yield f"[{role}] loading {model_cfg.model_id} ..."
    lm = load_lm(model_cfg)
    state = lm.prefill(lm.format_prompt(CHECK_QUESTION))
    t0 = time.perf_counter()
    step = lm.generate_step(state, n=1, temperature=0.0, max_tokens=tokens)[0]
    decode_ms = (time.perf_counter() - t0) / step.num_tokens * 1000
    t0 = time.perf_counter()
    score = lm.score_step(state, CHECK_STEP, logprobs=False)  # as a verifier prefills a step
    prefill_ms = (time.perf_counter() - t0) / len(score.token_ids) * 1000
    yield (
        f"[{role}] id={model_cfg.model_id} {lm.dtype_name} on {lm.device} layers={lm.num_layers} "
        f"hidden_size={lm.hidden_size} load={lm.load_seconds:.1f}s decode={decode_ms:.1f} ms/token "
        f"prefill={prefill_ms:.1f} ms/token ({len(score.token_ids)}-token step on a cached context)"
    )
    yield f"[{role}] step ({step.finish_reason}, {step.num_tokens} tokens): {step.text!r}"
    yield f"[{role}] format: {lm.format.describe()}"


def data_check(data_dir: str | None) -> tuple[list[str], list[str]]:
    """The row count of every data set (local folder or the Hub) and of the generated arithmetic splits,
    and one error line per set that could not be read."""
    from semspec.tasks.data import generate_arith
    from semspec.tasks.sources import LOADERS

    lines, errors = [], []
    for name, loader in LOADERS.items():
        try:
            rep = loader(data_dir=data_dir)
        except Exception as e:  # report every set, then fail
            errors.append(f"{name:8s} ERROR  {e}")
            continue
        extra = f" ({len(rep.skipped)} skipped)" if rep.skipped else ""
        lines.append(f"{name:8s} {len(rep):5d}  {rep.location}{extra}")
    n_train, n_test = len(generate_arith(200, "train")), len(generate_arith(50, "test"))
    lines.append(f"{'arith':8s} {n_train:5d}+{n_test}  (generated)")
    return lines, errors


def judge_calibration(pair: PairConfig, pairs_file: Path) -> Iterator[str]:
    """Sweep the pair's embedding judge's cosine threshold on labelled step pairs, with and without the
    numbers-must-match rule: accuracy, precision, recall and F1 per threshold, and the best F1."""
    from semspec.models.spec.judges import EmbeddingJudge, calibrate, load_judge, load_labelled_pairs

    if pair.judge.kind != "embedding":
        raise ValueError(
            f"pair {pair.name} uses a '{pair.judge.kind}' judge; calibration is for embedding judges"
        )
    labelled = load_labelled_pairs(pairs_file)
    judge = load_judge(pair.judge)
    yield f"{len(labelled)} labelled pairs, {sum(x[0] for x in labelled)} equivalent"
    thresholds = [round(0.5 + 0.05 * i, 2) for i in range(10)] + [0.97, 0.99]
    for rule in (False, True):
        rows = calibrate(EmbeddingJudge(judge.encode, pair.judge.threshold, rule), labelled, thresholds)
        yield f"numbers_must_match={rule}"
        yield "  threshold accuracy precision recall f1"
        for r in rows:
            yield (
                f"  {r['threshold']:9.2f} {r['accuracy']:8.3f} {r['precision']:9.3f} {r['recall']:6.3f} "
                f"{r['f1']:.3f}"
            )
        best = max(rows, key=lambda r: (r["f1"], r["threshold"]))
        yield f"  best F1 {best['f1']:.3f} at threshold {best['threshold']:.2f}"
