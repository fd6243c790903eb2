"""Data layer: benchmark and training-set loaders, the offline arithmetic generator, step splitting
and prefix building.

Every loader maps its rows to one record type, :class:`Problem`, and reads either a local folder
(``SEMSPEC_DATA_DIR`` or an explicit ``data_dir``) or the Hugging Face Hub. Bad input is never dropped
silently: it raises a ``ValueError`` naming the file and line, or — with ``on_error="skip"`` — is
counted in the returned :class:`LoadReport` and logged.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import logging
import random
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from semspec.models.project.settings import settings
from semspec.models.spec.grading import extract_answer

log = logging.getLogger(__name__)

BENCHMARKS = ("math500", "aime24", "amc23", "gpqa")
SOURCES = ("s1k", *BENCHMARKS, "arith")
ON_ERROR = ("raise", "skip")
# where each data set lives: its file in a local data folder (SEMSPEC_DATA_DIR) and its Hub id
SOURCE_FILES = {
    "s1k": ("s1k/train.jsonl", "simplescaling/s1K"),
    "math500": ("math500/test.jsonl", "HuggingFaceH4/MATH-500"),
    "aime24": ("aime24/test.jsonl", "HuggingFaceH4/aime_2024"),
    "amc23": ("amc23/test.jsonl", "math-ai/amc23"),
    "gpqa": ("gpqa/gpqa_diamond.zip", "Idavidrein/gpqa"),
}
GPQA_PASSWORD = b"deserted-untie-orchid"
GPQA_SHUFFLE_SEED = 1234
LETTERS = "ABCD"
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


@dataclass
class LoadReport:
    """What a loader read: the problems, and every row it skipped with the reason."""

    source: str
    location: str
    problems: list[Problem]
    skipped: list[str] = field(default_factory=list)  # "file:line: reason"

    def __len__(self) -> int:
        return len(self.problems)


def resolve_data_dir(explicit: str | Path | None = None) -> Path | None:
    """The local data folder: ``explicit`` or ``SEMSPEC_DATA_DIR``; None means read from the Hub."""
    d = explicit if explicit is not None else settings().data_dir
    if d is None:
        return None
    p = Path(d).expanduser()
    if not p.is_dir():
        raise ValueError(f"data folder {p} does not exist (check SEMSPEC_DATA_DIR)")
    return p


def _check_on_error(on_error: str) -> None:
    if on_error not in ON_ERROR:
        raise ValueError(f"on_error must be one of {ON_ERROR}, got {on_error!r}")


# --------------------------------------------------------------------------------------- readers
def iter_jsonl(path: Path) -> Iterator[tuple[int, dict[str, Any] | Exception]]:
    """Yield (line number, row or the error for that line) for each non-blank line; raises on an empty
    or missing file."""
    if not path.is_file():
        raise ValueError(f"{path}: file not found")
    raw = path.read_bytes()
    if not raw.strip():
        raise ValueError(f"{path}: file is empty")
    for lineno, line in enumerate(raw.split(b"\n"), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line.decode("utf-8"))
        except UnicodeDecodeError as e:
            yield lineno, ValueError(f"not valid UTF-8 (byte {e.start}: {line[e.start : e.start + 1]!r})")
            continue
        except json.JSONDecodeError as e:
            yield lineno, ValueError(f"malformed JSON ({e.msg} at column {e.colno})")
            continue
        if not isinstance(row, dict):
            yield lineno, ValueError(f"expected a JSON object, got {type(row).__name__}")
            continue
        yield lineno, row


def _collect(
    source: str,
    location: str,
    rows: Iterator[tuple[int, dict[str, Any] | Exception]],
    to_problem: Callable[[int, dict[str, Any]], Problem],
    on_error: str,
) -> LoadReport:
    """Map rows to problems, raising or counting bad rows as ``on_error`` says."""
    _check_on_error(on_error)
    report = LoadReport(source, location, [])
    for lineno, row in rows:
        try:
            if isinstance(row, Exception):
                raise row
            report.problems.append(to_problem(lineno, row))
        except (ValueError, KeyError, TypeError) as e:
            msg = f"{location}:{lineno}: {e}"
            if on_error == "raise":
                raise ValueError(msg + " (pass on_error='skip' to skip and count bad rows)") from None
            report.skipped.append(msg)
    if report.skipped:
        log.warning("%s: skipped %d bad row(s); first: %s", location, len(report.skipped), report.skipped[0])
    if not report.problems:
        raise ValueError(f"{location}: no usable rows ({len(report.skipped)} skipped)")
    return report


def _field(row: dict[str, Any], *names: str) -> Any:
    """The first present, non-empty field among ``names``; a clear error when none is."""
    for n in names:
        v = row.get(n)
        if v is not None and v != "" and v != []:
            return v
    raise ValueError(f"missing field {' or '.join(repr(n) for n in names)}")


def _hub_rows(hub_id: str, split: str, config: str | None = None) -> Iterator[tuple[int, dict[str, Any]]]:
    import datasets  # heavy; only when reading from the Hub

    try:
        ds = datasets.load_dataset(hub_id, config, split=split)
    except (ConnectionError, FileNotFoundError, OSError) as e:
        raise ValueError(
            f"cannot load {hub_id} from the Hugging Face Hub ({type(e).__name__}: {e}); "
            f"set SEMSPEC_DATA_DIR to a local copy of the data"
        ) from None
    for i, row in enumerate(ds, start=1):
        yield i, dict(row)


def _rows(
    sub: str, hub_id: str, split: str, ddir: str | Path | None
) -> tuple[str, Iterator[tuple[int, dict[str, Any] | Exception]]]:
    d = resolve_data_dir(ddir)
    if d is None:
        return f"hf://{hub_id}[{split}]", _hub_rows(hub_id, split)
    path = d / sub
    return str(path), iter_jsonl(path)


# --------------------------------------------------------------------------------------- loaders
def _number_str(v: Any) -> str:
    """27.0 -> '27'; other values as their string."""
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    return str(v).strip()


def load_math500(data_dir: str | Path | None = None, on_error: str = "raise") -> LoadReport:
    """MATH-500 (HuggingFaceH4/MATH-500, test split)."""

    def conv(i: int, r: dict[str, Any]) -> Problem:
        return Problem(
            question_id=str(r.get("unique_id") or f"math500-{i}"),
            source="math500",
            domain="math",
            question=_field(r, "problem"),
            answer=str(_field(r, "answer")),
            solution=r.get("solution", ""),
            meta={"subject": r.get("subject"), "level": r.get("level")},
        )

    loc, rows = _rows(*SOURCE_FILES["math500"], "test", data_dir)
    return _collect("math500", loc, rows, conv, on_error)


def _competition(
    name: str, local: str, hub_id: str, split: str, data_dir: str | Path | None, on_error: str
) -> LoadReport:
    """A competition set with integer answers (AIME, AMC): float answers such as 27.0 become '27'."""

    def conv(i: int, r: dict[str, Any]) -> Problem:
        return Problem(
            question_id=f"{name}-{r.get('id', i)}",
            source=name,
            domain="math",
            question=_field(r, "problem", "question"),
            answer=_number_str(_field(r, "answer")),
            solution=r.get("solution") or "",
            meta={"url": r.get("url")},
        )

    loc, rows = _rows(local, hub_id, split, data_dir)
    return _collect(name, loc, rows, conv, on_error)


def load_aime24(data_dir: str | Path | None = None, on_error: str = "raise") -> LoadReport:
    """AIME 2024 (HuggingFaceH4/aime_2024); answers are integers 0-999 kept as strings."""
    return _competition("aime24", *SOURCE_FILES["aime24"], "train", data_dir, on_error)


def load_amc23(data_dir: str | Path | None = None, on_error: str = "raise") -> LoadReport:
    """AMC 2023 (math-ai/amc23)."""
    return _competition("amc23", *SOURCE_FILES["amc23"], "test", data_dir, on_error)


def load_s1k(data_dir: str | Path | None = None, on_error: str = "raise") -> LoadReport:
    """s1K (simplescaling/s1K). Uses ``thinking_trajectories`` / ``deepseek_thinking_trajectory`` as the
    reasoning trace when present; ``cot_type`` as the domain when present, else 'unknown'."""

    def conv(i: int, r: dict[str, Any]) -> Problem:
        solution = str(_field(r, "solution"))
        trace = r.get("deepseek_thinking_trajectory") or r.get("thinking_trajectories")
        if isinstance(trace, list):
            trace = trace[0] if trace else None
        return Problem(
            question_id=f"s1k-{i}",
            source="s1k",
            domain=str(r.get("cot_type") or "unknown"),
            question=str(_field(r, "question")),
            answer=extract_answer(solution) or "",
            solution=solution,
            trace=trace or None,
            meta={"source_type": r.get("source_type")},
        )

    loc, rows = _rows(*SOURCE_FILES["s1k"], "train", data_dir)
    return _collect("s1k", loc, rows, conv, on_error)


def gpqa_problem(i: int, r: dict[str, Any], seed: int = GPQA_SHUFFLE_SEED) -> Problem:
    """One GPQA row -> a Problem with its four answers shuffled by a per-question seeded RNG."""
    question = str(_field(r, "Question")).strip()
    correct = str(_field(r, "Correct Answer")).strip()
    wrong = [str(_field(r, f"Incorrect Answer {k}")).strip() for k in (1, 2, 3)]
    choices = [correct, *wrong]
    qid = str(r.get("Record ID") or f"gpqa-{i}")
    rng = random.Random(f"{seed}:{qid}")
    rng.shuffle(choices)
    letter = LETTERS[choices.index(correct)]
    lettered = "\n".join(f"({LETTERS[k]}) {c}" for k, c in enumerate(choices))
    return Problem(
        question_id=qid,
        source="gpqa",
        domain=str(r.get("High-level domain") or "science"),
        question=f"{question}\n\n{lettered}\n\nAnswer with the letter of the correct choice.",
        answer=letter,
        choices=choices,
        meta={"subdomain": r.get("Subdomain")},
    )


def _gpqa_zip_rows(path: Path) -> Iterator[tuple[int, dict[str, Any] | Exception]]:
    """Rows of the GPQA-Diamond CSV read inside its password zip (never extracted to disk)."""
    if not path.is_file():
        raise ValueError(f"{path}: file not found")
    try:
        zf = zipfile.ZipFile(path)
    except zipfile.BadZipFile as e:
        raise ValueError(f"{path}: not a zip file ({e})") from None
    with zf:
        names = [n for n in zf.namelist() if n.lower().endswith(".csv") and "diamond" in n.lower()]
        names = names or [n for n in zf.namelist() if n.lower().endswith(".csv")]
        if not names:
            raise ValueError(f"{path}: no CSV inside the zip")
        try:
            raw = zf.read(names[0], pwd=GPQA_PASSWORD)
        except RuntimeError as e:
            raise ValueError(f"{path}: cannot decrypt ({e})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}:{names[0]}: not valid UTF-8 at byte {e.start}") from None
    reader = csv.DictReader(io.StringIO(text))
    for row in reader:
        yield reader.line_num, row


def load_gpqa(data_dir: str | Path | None = None, on_error: str = "raise") -> LoadReport:
    """GPQA-Diamond (Idavidrein/gpqa, config gpqa_diamond) with choices shuffled by a fixed seed."""
    d, (local, hub_id) = resolve_data_dir(data_dir), SOURCE_FILES["gpqa"]
    if d is None:
        loc = f"hf://{hub_id}[gpqa_diamond]"
        rows: Iterator = _hub_rows(hub_id, "train", config="gpqa_diamond")
    else:
        loc, rows = str(d / local), _gpqa_zip_rows(d / local)
    return _collect("gpqa", loc, rows, gpqa_problem, on_error)


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


# --------------------------------------------------------------------------------------- registry
LOADERS: dict[str, Callable[..., LoadReport]] = {
    "s1k": load_s1k,
    "math500": load_math500,
    "aime24": load_aime24,
    "amc23": load_amc23,
    "gpqa": load_gpqa,
}


def load_source(
    name: str,
    data_dir: str | Path | None = None,
    on_error: str = "raise",
    split: str = "test",
    n: int = 0,
    seed: int = 0,
) -> list[Problem]:
    """Problems of any source by name; ``arith`` is generated (``n`` problems of ``split``)."""
    if name == "arith":
        return generate_arith(n, split=split, seed=seed)
    if name not in LOADERS:
        raise ValueError(f"unknown data source {name!r}; expected one of {SOURCES}")
    return LOADERS[name](data_dir=data_dir, on_error=on_error).problems
