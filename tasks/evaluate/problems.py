"""Which problems an evaluation decodes: a seeded subset of each benchmark, by difficulty level where it has
levels; the arithmetic benchmark is the generator's test split."""

from __future__ import annotations

import logging
import random

from semspec.tasks.config import EvaluateConfig
from semspec.tasks.data import Problem, generate_arith
from semspec.tasks.sources import load_source

log = logging.getLogger(__name__)


def eval_problems(
    name: str, count: int, seed: int, data_dir: str | None = None, levels: list[int] | None = None
) -> list[Problem]:
    """``count`` problems of a benchmark (0: all), a seeded subset; ``arith`` is the generated test split.
    ``levels`` keeps only problems of those difficulty levels where a benchmark has levels (MATH-500)."""
    if name == "arith":
        return generate_arith(count or 50, "test", seed=seed)
    problems = load_source(name, data_dir=data_dir)
    if levels and any(p.meta.get("level") is not None for p in problems):
        problems = [p for p in problems if _level(p.meta.get("level")) in levels]
    if count and count < len(problems):
        problems = random.Random(f"{seed}:{name}").sample(problems, count)
    return problems


def _level(v: object) -> int | None:
    """A level as an int (MATH-500 stores 3 or "Level 3")."""
    digits = "".join(c for c in str(v) if c.isdigit())
    return int(digits) if digits else None


def load_problems(
    cfg: EvaluateConfig, data_dir: str | None
) -> tuple[dict[str, list[Problem]], dict[str, str]]:
    """The problems of every benchmark that can be loaded, and the others with the reason."""
    problems, skipped = {}, {}
    for b, n in cfg.benchmarks.items():
        try:
            problems[b] = eval_problems(b, n, cfg.subset_seed, data_dir, cfg.levels)
        except ValueError as e:  # a benchmark that is neither local nor reachable: say so, evaluate the rest
            log.warning("evaluate: skipping %s: %s", b, e)
            skipped[b] = str(e)
    if not problems:
        raise ValueError(f"no benchmark could be loaded: {skipped}")
    return problems, skipped
