"""Answer a question with SemanticSpec and show who wrote each step, then compare with the target alone.

python examples/quickstart.py                                  # the registry's champion probes
python examples/quickstart.py --probes exported-probes/        # probes from `semspec probes export`
python examples/quickstart.py --pair embedded --question "..." # another pair
"""

from __future__ import annotations

import argparse
import logging

import semspec

log = logging.getLogger("quickstart")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pair", default=None, help="pair name or YAML path (default: params.yaml's)")
    parser.add_argument("--probes", default=None, help="exported probe folder or Hub repo id")
    parser.add_argument(
        "--question",
        default="A shop sells pens at 3 dollars each. Ann buys 4 pens and pays with a 20 dollar note. How much change does she get?",
    )
    parser.add_argument("--max-new-tokens", type=int, default=256)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    llm = semspec.load(args.pair, probes=args.probes)
    out = llm.generate(args.question, max_new_tokens=args.max_new_tokens)
    for step in out.steps:
        verdict = {True: "accepted", False: "rewritten", None: "target"}[step.accepted]
        scores = "" if step.p is None else f" p={step.p:.2f} q={step.q:.2f}"
        log.info("[%s %s%s] %s", step.author, verdict, scores, step.text.strip())
    log.info(
        "semanticspec: answer %s, %d tokens in %.1f s (%.1f tok/s), target share %.2f",
        out.answer,
        out.output_tokens,
        out.seconds,
        out.tokens_per_second,
        out.target_share,
    )
    alone = llm.generate(args.question, method="target", max_new_tokens=args.max_new_tokens)
    log.info(
        "target alone: answer %s, %d tokens in %.1f s (%.1f tok/s)",
        alone.answer,
        alone.output_tokens,
        alone.seconds,
        alone.tokens_per_second,
    )


if __name__ == "__main__":
    main()
