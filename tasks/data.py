"""The project's record of a question, :class:`Problem`, and the data made from records here: the offline
arithmetic generator and the prefixes (a question plus its first reasoning steps) a model continues.

The published data sets are read into the same record type by ``semspec.tasks.sources``.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import asdict, dataclass, field
from typing import Any

MAX_STEPS = 200  # chains with this many steps or more are dropped (counted) when building prefixes


@dataclass
class Problem:
    """One question with its reference answer, from any source."""

    question_id: str  # unique within its source, stable across runs
    source: str  # s1k | math500 | aime24 | amc23 | gpqa | arith
    domain: str  # math | science | ... ('unknown' when the source does not say)
    question: str  # the text shown to the model (GPQA: with its shuffled lettered choices)
    answer: str  # the reference final answer (GPQA: the correct letter)
    solution: str = ""  # reference solution text
    trace: str | None = None  # a reasoning trajectory when the data carries one
    choices: list[str] | None = None  # GPQA: the shuffled choices, in letter order
    meta: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict."""
        return asdict(self)


# --------------------------------------------------------------------------------------- arithmetic
_NAMES = ["Maya", "Tom", "Lena", "Omar", "Priya", "Jonas", "Aiko", "Carlos", "Fatima", "Ben", "Zoe", "Ivan"]
_ITEMS = [
    "apples",
    "pencils",
    "stickers",
    "marbles",
    "books",
    "cookies",
    "stamps",
    "shells",
    "coins",
    "cards",
]


def _arith_one(rng: random.Random) -> tuple[str, list[str], int]:
    """One word problem: (question, solution steps, answer)."""
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    boxes, per = rng.randint(2, 12), rng.randint(2, 12)
    total = boxes * per
    q = [f"{name} has {boxes} boxes with {per} {item} in each box."]
    steps = [f"{name} starts with {boxes} boxes of {per} {item}, so {boxes} * {per} = {total} {item}."]
    for _ in range(rng.randint(2, 4)):
        op = rng.choice(["gain", "lose", "packs", "share"] if total >= 4 else ["gain", "packs"])
        if op == "gain":
            k = rng.randint(3, 40)
            q.append(f"Then {name} finds {k} more {item}.")
            steps.append(f"Finding {k} more gives {total} + {k} = {total + k} {item}.")
            total += k
        elif op == "lose" and total > 3:
            k = rng.randint(1, total - 1)
            q.append(f"Then {name} gives away {k} {item}.")
            steps.append(f"Giving away {k} leaves {total} - {k} = {total - k} {item}.")
            total -= k
        elif op == "packs":
            p, s = rng.randint(2, 6), rng.randint(2, 10)
            q.append(f"Then {name} buys {p} packs of {s} {item}.")
            steps.append(
                f"The packs hold {p} * {s} = {p * s} {item}, so now there are {total} + {p * s} = {total + p * s}."
            )
            total += p * s
        else:
            divisors = [m for m in range(2, 7) if total % m == 0]
            if not divisors:
                k = rng.randint(3, 40)
                q.append(f"Then {name} finds {k} more {item}.")
                steps.append(f"Finding {k} more gives {total} + {k} = {total + k} {item}.")
                total += k
                continue
            m = rng.choice(divisors)
            q.append(f"Then {name} splits the {item} equally among {m} friends and keeps one share.")
            steps.append(
                f"Splitting {total} {item} into {m} equal shares gives {total} / {m} = {total // m}."
            )
            total //= m
    q.append(f"How many {item} does {name} have now?")
    steps.append(f"So {name} has {total} {item} now. The answer is \\boxed{{{total}}}.")
    return " ".join(q), steps, total


def arith_split_of(question: str, test_percent: int = 20) -> str:
    """Deterministic split of a question text: the same text always lands in the same split."""
    h = int(hashlib.sha1(question.encode("utf-8")).hexdigest()[:8], 16)
    return "test" if h % 100 < test_percent else "train"


def generate_arith(n: int, split: str = "train", seed: int = 0, test_percent: int = 20) -> list[Problem]:
    """``n`` seeded multi-step arithmetic word problems of ``split`` ('train' or 'test').

    Problems are assigned to a split by a hash of their text, so train and test never share a problem
    whatever seeds are used; within a split, duplicates are skipped.
    """
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if not 0 < test_percent < 100:
        raise ValueError(f"test_percent must be in (0, 100), got {test_percent}")
    rng = random.Random(f"arith:{seed}")
    out: list[Problem] = []
    seen: set[str] = set()
    tries = 0
    while len(out) < n:
        tries += 1
        if tries > 1000 * (n + 10):
            raise ValueError(f"could not generate {n} distinct {split} problems")
        question, steps, answer = _arith_one(rng)
        if question in seen or arith_split_of(question, test_percent) != split:
            continue
        seen.add(question)
        qid = "arith-" + hashlib.sha1(question.encode("utf-8")).hexdigest()[:12]
        out.append(
            Problem(
                qid,
                "arith",
                "math",
                question,
                str(answer),
                solution="\n\n".join(steps),
                meta={"split": split},
            )
        )
    return out


# --------------------------------------------------------------------------------------- steps
@dataclass
class Prefix:
    """A question plus its first ``step_index`` reasoning steps (the context a model continues)."""

    prefix_id: str
    question_id: str
    source: str
    domain: str
    step_index: int
    question: str
    context: str  # the steps so far, each followed by the delimiter ('' for step_index 0)


def build_prefixes(
    problem: Problem,
    steps: list[str],
    max_prefixes: int | None = None,
    delimiter: str = "\n\n",
    max_steps: int = MAX_STEPS,
    rng: random.Random | None = None,
    chain: str = "",
    first: int = 0,
) -> list[Prefix]:
    """Prefixes (question + first k steps, k = ``first`` .. len(steps)-1) of one problem.

    Chains with ``max_steps`` steps or more yield nothing (the caller counts them). With
    ``max_prefixes``, a seeded random subset of that size is kept, in step order. ``chain`` names one of
    several chains of the same problem (its author), so their prefixes get ids of their own; such a chain
    starts at ``first`` = 1, since its k = 0 (the question alone) is the first chain's.
    """
    if len(steps) >= max_steps or not steps:
        return []
    ks = list(range(first, len(steps)))
    if max_prefixes is not None and len(ks) > max_prefixes:
        ks = sorted((rng or random.Random(0)).sample(ks, max_prefixes))
    out = []
    for k in ks:
        key = f"{problem.source}:{problem.question_id}:{k}" + (f":{chain}" if chain else "")
        pid = hashlib.sha1(key.encode()).hexdigest()[:16]
        context = "".join(s + delimiter for s in steps[:k])
        out.append(
            Prefix(pid, problem.question_id, problem.source, problem.domain, k, problem.question, context)
        )
    return out
