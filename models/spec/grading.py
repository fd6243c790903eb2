"""Answer extraction and grading.

Symbolic equivalence comes from Hugging Face's ``math-verify`` (LaTeX -> sympy via latex2sympy2);
this module adds only what it lacks: last-``\\boxed{}`` extraction with balanced braces, the
"answer is X" fallback, multiple-choice letters, a plain normalised string match and a relative
numeric tolerance.
"""

from __future__ import annotations

import logging
import re
import threading

from math_verify import parse, verify

log = logging.getLogger(__name__)

GRADED_BENCHMARKS = ("math500", "aime24", "amc23", "gpqa", "arith", "s1k")
NUMERIC_RTOL = 1e-4
_BOX_RE = re.compile(r"\\(?:boxed|fbox)\s*")
_ANSWER_IS_RE = re.compile(r"answer\s*(?:is\s*[:=]?|[:=])\s*", re.IGNORECASE)
_WORD_RE = re.compile(r"(?<![\\a-zA-Z])[a-zA-Z]{2,}")
_LETTER_RE = re.compile(r"^\(?\s*(?:\\text\{\s*)?\(?([A-Da-d])\)?\s*\}?\)?[.:]?$")


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox``) with balanced braces; ``\\boxed 5`` too."""
    matches = list(_BOX_RE.finditer(text))
    for m in reversed(matches):
        i = m.end()
        if i < len(text) and text[i] == "{":
            depth = 0
            for j in range(i, len(text)):
                if text[j] == "{":
                    depth += 1
                elif text[j] == "}":
                    depth -= 1
                    if depth == 0:
                        return text[i + 1 : j].strip()
            continue  # unbalanced: try an earlier box
        tail = re.match(r"([^\s$]+)", text[i:])
        if tail:
            return tail.group(1).strip()
    return None


def one_expression(text: str) -> bool:
    """Whether ``text`` is one answer, not prose: no word of two or more letters outside LaTeX commands
    and ``\\text{}`` (so "6 and 7", "about 6" and "my answer here, 6" are not answers; "x = 6",
    "\\frac{1}{2}", "(1, 2)" and "5\\text{ cm}" are)."""
    t = re.sub(r"\\(?:text|mathrm|textbf|mbox)\{[^}]*\}", "", text)
    t = re.sub(r"\\[a-zA-Z]+", "", t)
    return not _WORD_RE.search(t)


def _answer_is(text: str) -> str | None:
    """The text after the last 'answer is' / 'answer:', up to the end of its sentence or line, when it
    is one expression (a completion that names two candidates has committed to neither)."""
    matches = list(_ANSWER_IS_RE.finditer(text))
    if not matches:
        return None
    rest = text[matches[-1].end() :].split("\n", 1)[0]
    rest = re.split(r"\.(?:\s|$)", rest, maxsplit=1)[0]
    rest = rest.strip().strip("$").strip()
    return rest if rest and one_expression(rest) else None


def extract_answer(text: str, benchmark: str = "math") -> str | None:
    """The final answer in a completion: the last ``\\boxed{}``, else what follows 'answer is'.
    For ``gpqa`` the result is a single letter A-D (or None)."""
    if not text:
        return None
    ans = last_boxed(text) or _answer_is(text)
    if benchmark == "gpqa":
        if ans is not None:
            m = _LETTER_RE.match(ans.strip())
            return m.group(1).upper() if m else None
        m = re.findall(r"\(([A-D])\)", text)
        return m[-1] if m else None
    return ans


def normalize(s: str) -> str:
    """A plain normal form for string comparison: no ``$``, ``\\text{}``, ``\\left``/``\\right``,
    spaces, trailing period, degree or percent signs; ``\\dfrac`` -> ``\\frac``."""
    s = s.strip().strip("$").strip()
    s = re.sub(r"\\text\{([^}]*)\}", r"\1", s)
    s = re.sub(r"\\(?:mathrm|textbf|mathbf)\{([^}]*)\}", r"\1", s)
    s = s.replace("\\left", "").replace("\\right", "").replace("\\!", "").replace("\\,", "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = s.replace("^\\circ", "").replace("^{\\circ}", "").replace("\\%", "").replace("%", "")
    s = s.replace("\\$", "")
    s = re.sub(r"\s+", "", s).rstrip(".")
    return s


def _as_float(s: str) -> float | None:
    t = normalize(s).replace(",", "")
    try:
        return float(t)
    except ValueError:
        return None


def _verify(gold: str, pred: str) -> bool:
    """math-verify's symbolic comparison. Its timeouts use signals, which only work in the main thread."""
    main = threading.current_thread() is threading.main_thread()
    timeout = 5 if main else None
    try:
        g = parse(f"${gold}$", parsing_timeout=timeout)
        p = parse(f"${pred}$", parsing_timeout=timeout)
        return bool(g and p and verify(g, p, timeout_seconds=timeout))
    except Exception as e:  # math-verify raises on exotic input; that answer is simply not equal
        log.debug("math-verify failed on %r vs %r: %s", gold, pred, e)
        return False


def is_equiv(gold: str, pred: str | None, benchmark: str = "math") -> bool:
    """Whether ``pred`` (an extracted answer) equals the reference ``gold``."""
    if pred is None or not str(pred).strip():
        return False
    gold, pred = str(gold), str(pred)
    if benchmark == "gpqa":
        g = extract_answer(f"\\boxed{{{gold}}}", "gpqa")
        p = extract_answer(f"\\boxed{{{pred}}}", "gpqa")
        return g is not None and g == p
    if normalize(gold) == normalize(pred):
        return True
    gf, pf = _as_float(gold), _as_float(pred)
    if gf is not None and pf is not None:
        return abs(gf - pf) <= NUMERIC_RTOL * max(abs(gf), abs(pf), 1e-12)
    return _verify(gold, pred)


def grade(benchmark: str, gold: str, completion: str) -> tuple[str | None, bool]:
    """Extract the answer from a model's ``completion`` and compare it with ``gold``."""
    if benchmark not in GRADED_BENCHMARKS:
        raise ValueError(f"unknown benchmark {benchmark!r}; expected one of {GRADED_BENCHMARKS}")
    pred = extract_answer(completion, benchmark)
    bare = completion.strip()
    if pred is None and "\n" not in bare and len(bare) <= 64 and one_expression(bare):
        pred = bare  # a bare answer such as "3/4" or "B"
        if benchmark == "gpqa":
            pred = extract_answer(f"\\boxed{{{pred}}}", "gpqa")
    return pred, is_equiv(gold, pred, benchmark)
