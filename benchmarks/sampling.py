"""Batched vs sequential step sampling on a pair's draft (or target).

Prints seconds per prefix for N samples drawn in one batched decode loop vs N separate calls, and the
ratio. Usage: python benchmarks/sampling.py [--pair embedded] [--role draft] [--n 20] [--prefixes 2]
"""

from __future__ import annotations

import argparse
import time

from semspec.models.lm import load_lm
from semspec.models.project.pairs import load_pair
from semspec.models.spec.steps import split_steps
from semspec.tasks.data import build_prefixes, generate_arith


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pair", default="embedded")
    ap.add_argument("--role", default="draft", choices=["draft", "target"])
    ap.add_argument("--n", type=int, default=20)
    ap.add_argument("--prefixes", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=48)
    a = ap.parse_args()
    lm = load_lm(load_pair(a.pair).role(a.role))
    probs = generate_arith(a.prefixes, "test", seed=1)
    contexts = []
    for p in probs:
        pre = build_prefixes(p, split_steps(p.solution), max_prefixes=1)[0]
        contexts.append(lm.format_prompt(pre.question) + pre.context)
    lm.generate_step(contexts[0], n=2, max_tokens=4, seed=0)  # warm-up
    batched = sequential = 0.0
    tokens_b = tokens_s = 0
    for i, ctx in enumerate(contexts):
        t = time.perf_counter()
        out = lm.generate_step(ctx, n=a.n, max_tokens=a.max_tokens, seed=i)
        batched += time.perf_counter() - t
        tokens_b += sum(s.num_tokens for s in out)
        t = time.perf_counter()
        for k in range(a.n):
            tokens_s += lm.generate_step(ctx, n=1, max_tokens=a.max_tokens, seed=1000 * i + k)[0].num_tokens
        sequential += time.perf_counter() - t
    m = len(contexts)
    print(f"{a.role} {lm.model_id}: N={a.n}, {m} prefixes, step budget {a.max_tokens}")
    print(f"  batched    {batched / m:6.2f} s/prefix  ({tokens_b / batched:6.1f} tokens/s)")
    print(f"  sequential {sequential / m:6.2f} s/prefix  ({tokens_s / sequential:6.1f} tokens/s)")
    print(
        f"  speed-up   {sequential / batched:6.2f}x per prefix, {(tokens_b / batched) / (tokens_s / sequential):.2f}x per token"
    )


if __name__ == "__main__":
    main()
