"""Keep evaluation problems out of training data: a training question that shares a long run of words
with a benchmark problem (MATH-500, AIME24, AMC23, GPQA-Diamond) is dropped before it becomes a prefix.

s1K's authors decontaminated it the same way (8-gram overlap against their evaluation sets); the check is
repeated here because a local or newer copy of any source may not be, and because the evaluation reads
the benchmarks this project ships loaders for.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from pathlib import Path

from semspec.tasks.data import Problem
from semspec.tasks.sources import BENCHMARKS, load_source

log = logging.getLogger(__name__)

NGRAM = 8  # words in a shared run that marks a question as a benchmark's (s1K's own rule)
_WORD = re.compile(r"[a-z0-9]+")


def ngrams(text: str, n: int = NGRAM) -> set[tuple[str, ...]]:
    """The runs of ``n`` lower-cased alphanumeric words of ``text`` (a text shorter than ``n`` words gives
    one run: itself)."""
    words = _WORD.findall(text.lower())
    if len(words) < n:
        return {tuple(words)} if words else set()
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


def benchmark_ngrams(
    data_dir: str | Path | None, benchmarks: Iterable[str] = BENCHMARKS
) -> set[tuple[str, ...]]:
    """Every ``NGRAM``-word run of every problem of ``benchmarks`` (read as the evaluation reads them). A
    benchmark that cannot be read is logged and skipped: the check then covers the others only."""
    grams: set[tuple[str, ...]] = set()
    for name in benchmarks:
        try:
            problems = load_source(name, data_dir=data_dir)
        except (OSError, ValueError) as err:  # no local copy and no Hub: say what is not checked
            log.warning("decontamination: cannot read %s (%s); its problems are not checked", name, err)
            continue
        for p in problems:
            grams |= ngrams(p.question)
    return grams


def drop_benchmark_questions(
    problems: list[Problem], grams: set[tuple[str, ...]], source: str
) -> list[Problem]:
    """``problems`` without those sharing an ``NGRAM``-word run with a benchmark problem (logged, counted)."""
    kept = [p for p in problems if not (ngrams(p.question) & grams)]
    if len(kept) < len(problems):
        log.info(
            "ingest: dropped %d %s question(s) that overlap a benchmark problem",
            len(problems) - len(kept),
            source,
        )
    return kept
