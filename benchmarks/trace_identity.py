"""Same tokens before and after a refactor: every decoding method's full trace on a few questions.

    python benchmarks/trace_identity.py record OUT.json [--pair qwen-coder] [--n 4] [--max-new-tokens 96]
                                                        [--probes FOLDER]
    python benchmarks/trace_identity.py compare BEFORE.json AFTER.json

``record`` decodes ``--n`` arithmetic test problems through ``semspec.load(pair)`` (the registered probes,
or the shipped ones; ``--probes``: an exported folder, so that records made before and after a change
read the same probes whatever the registry's champions are by then) with every method, greedy and sampled, and SemanticSpec under the settings that force
rejections (the p/q floor, the target's rule, the token check, the rejection budget, salvage, look-ahead
scoring with gamma 2), and writes each answer's text, tokens and steps (author, text, p, q, u, tok, the
rejected proposal). ``compare`` checks two records field by field over the fields both have (a field a
refactor adds is reported, not compared) and exits non-zero on any difference.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from pathlib import Path

log = logging.getLogger("trace_identity")

# (name, method, settings): each method greedy; the sampled ones; SemanticSpec's rule settings one by one
CASES = [
    ("target", "target", {}),
    ("draft", "draft", {}),
    ("specreason", "specreason", {}),
    ("semanticspec", "semanticspec", {}),
    ("semanticspec-sampled", "semanticspec", {"temperature": 0.7, "top_p": 0.95}),
    ("target-sampled", "target", {"temperature": 0.7, "top_p": 0.95}),
    ("semanticspec-floor", "semanticspec", {"min_ratio": 1.5}),
    ("semanticspec-target-rule", "semanticspec", {"min_p": 0.9}),
    ("semanticspec-token-check", "semanticspec", {"min_token_p": 0.3}),
    ("semanticspec-budget", "semanticspec", {"min_ratio": 1.5, "max_rejections": 1}),
    ("semanticspec-gamma2", "semanticspec", {"gamma": 2, "min_ratio": 1.2}),
]
TOKEN_LEVEL = [("specsampling", "specsampling", {})]


def record(out: Path, pair: str | None, n: int, max_new_tokens: int, probes: str | None = None) -> None:
    """Decode every case and write the traces to ``out``."""
    import semspec
    from semspec.tasks.data import generate_arith

    questions = [p.question for p in generate_arith(n, split="test")]
    llm = semspec.load(pair, probes=probes)
    traces: dict[str, list[dict]] = {}
    for name, method, settings in CASES:
        dec = llm.decoder(method, max_new_tokens=max_new_tokens, seed=7, **settings)
        results = dec.decode_batch(questions, batch_size=n)
        traces[name] = [_trace(r) for r in results]
        log.info("%s: %s", name, [len(t["steps"]) for t in traces[name]])
    for name, method, settings in TOKEN_LEVEL:
        gens = [llm.generate(q, method, max_new_tokens=max_new_tokens, seed=7, **settings) for q in questions]
        traces[name] = [{"text": g.text, "output_tokens": g.output_tokens} for g in gens]
    out.write_text(json.dumps(traces, indent=1))


def _trace(res) -> dict:
    steps = [dataclasses.asdict(s) for s in res.steps]
    return {"text": res.text, "output_tokens": res.output_tokens, "steps": steps}


def compare(before: Path, after: Path) -> int:
    """Differences between two records (0: none)."""
    a, b = json.loads(before.read_text()), json.loads(after.read_text())
    bad, added = 0, set()
    for name in sorted(set(a) | set(b)):
        if name not in a or name not in b:
            print(f"{name}: only in {'after' if name in b else 'before'}")
            bad += 1
            continue
        for i, (x, y) in enumerate(zip(a[name], b[name], strict=True)):
            if (x["text"], x["output_tokens"]) != (y["text"], y["output_tokens"]):
                print(f"{name}[{i}]: text or tokens differ")
                bad += 1
            for j, (s, t) in enumerate(zip(x.get("steps", []), y.get("steps", []), strict=True)):
                added |= set(t) - set(s)
                diff = [k for k in set(s) & set(t) if s[k] != t[k]]
                if diff:
                    print(f"{name}[{i}] step {j}: {diff} differ")
                    bad += 1
    steps = sum(len(r.get("steps", [])) for v in a.values() for r in v)
    rejected = sum(s["proposal"] is not None for v in a.values() for r in v for s in r.get("steps", []))
    print(f"{len(a)} cases, {steps} steps ({rejected} rewritten) compared: {bad} differences")
    if added:
        print(f"fields only after: {sorted(added)}")
    return bad


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record")
    r.add_argument("out", type=Path)
    r.add_argument("--pair", default=None)
    r.add_argument("--n", type=int, default=4)
    r.add_argument("--max-new-tokens", type=int, default=96)
    r.add_argument(
        "--probes", default=None, help="an exported probe folder (default: the registry's champions)"
    )
    c = sub.add_parser("compare")
    c.add_argument("before", type=Path)
    c.add_argument("after", type=Path)
    a = ap.parse_args()
    if a.cmd == "record":
        record(a.out, a.pair, a.n, a.max_new_tokens, a.probes)
    else:
        sys.exit(1 if compare(a.before, a.after) else 0)


if __name__ == "__main__":
    main()
