"""The published data sets (s1K, MATH-500, AIME 2024, AMC 2023, GPQA-Diamond): where each lives, the
readers of their files, one loader per set, and ``load_source``, which also hands out the generated
arithmetic problems by name.

Every loader maps its rows to one record type, :class:`~semspec.tasks.data.Problem`, and reads either a
local folder (``SEMSPEC_DATA_DIR`` or an explicit ``data_dir``) or the Hugging Face Hub. Bad input is never
dropped silently: it raises a ``ValueError`` naming the file and line, or — with ``on_error="skip"`` — is
counted in the returned :class:`LoadReport` and logged.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import random
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from semspec.models.project.settings import settings
from semspec.models.spec.grading import extract_answer
from semspec.tasks.data import Problem, generate_arith

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
