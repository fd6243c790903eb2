"""What a reasoning step is: one setting (params.yaml's ``split_strategy``) read by ingest, sampling,
labelling and every decoder.

- ``paragraph`` (the paper's default): a step ends at the pair's delimiter (``\\n\\n``), which it includes.
- ``sentence`` (the paper's A.3 study): a step ends after ``.``, ``?`` or ``!`` followed by whitespace, or
  at a blank line; it includes that whitespace. ``3.5`` is not a sentence end (no whitespace after the
  point), nor is the number that opens a list item (``1. `` at the start of a line). While decoding, the
  end is known once the next step's first character appears, so the stop rule sees one token past the
  step and the step's text is cut there.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator

SPLIT_STRATEGIES = ("paragraph", "sentence")
_PARAGRAPH_RE = re.compile(r"\n\s*\n")
_SENTENCE_RE = re.compile(r"(?:(?<=[.!?])\s+|\n\s*\n\s*)(?=\S)")


def check_strategy(strategy: str) -> str:
    """``strategy`` when it is a known split strategy; ValueError naming the choices otherwise."""
    if strategy not in SPLIT_STRATEGIES:
        raise ValueError(f"split_strategy must be one of {SPLIT_STRATEGIES}, got {strategy!r}")
    return strategy


def _opens_list_item(text: str, dot: int) -> bool:
    """Whether the ``.`` at ``text[dot]`` ends a list number (1-3 digits) at the start of a line."""
    j = dot - 1
    while j >= 0 and dot - j <= 3 and text[j].isdigit():
        j -= 1
    if j == dot - 1 or (j >= 0 and text[j].isdigit()):
        return False  # no digits before the point, or more than three
    while j >= 0 and text[j] in " \t":
        j -= 1
    return j < 0 or text[j] == "\n"


def _sentence_ends(text: str) -> Iterator[int]:
    """The index just past each sentence end of ``text`` (with the whitespace after it)."""
    for m in _SENTENCE_RE.finditer(text):
        blank = _PARAGRAPH_RE.search(m.group()) is not None
        if blank or not (text[m.start() - 1] == "." and _opens_list_item(text, m.start() - 1)):
            yield m.end()


def split_steps(text: str, strategy: str = "paragraph") -> list[str]:
    """Split a reasoning chain into steps, stripped; empty steps are skipped."""
    if check_strategy(strategy) == "paragraph":
        parts = _PARAGRAPH_RE.split(text)
    else:
        cuts = [0, *_sentence_ends(text), len(text)]
        parts = [text[a:b] for a, b in itertools.pairwise(cuts)]
    return [p.strip() for p in parts if p.strip()]


def step_end(text: str, strategy: str, delimiter: str = "\n\n") -> int | None:
    """Where the first step of generated ``text`` ends (the index just past its delimiter or its
    sentence end with the whitespace after it), or None while the step is still going."""
    if strategy == "paragraph":
        if delimiter == "\n\n":  # a blank line, spaces on it or not, as ``split_steps`` reads one
            m = _PARAGRAPH_RE.search(text)
            return None if m is None else m.end()
        cut = text.find(delimiter)
        return None if cut < 0 else cut + len(delimiter)
    check_strategy(strategy)
    return next(_sentence_ends(text), None)


def joiner(strategy: str, delimiter: str = "\n\n") -> str:
    """What follows each step when steps are joined back into a context."""
    return delimiter if check_strategy(strategy) == "paragraph" else " "
