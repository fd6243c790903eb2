"""What a reasoning step is: one setting (params.yaml's ``split_strategy``) read by ingest, sampling,
labelling and every decoder.

- ``paragraph`` (the paper's default): a step ends at the pair's delimiter (``\\n\\n``), which it includes.
- ``sentence`` (the paper's A.3 study): a step ends after ``.``, ``?`` or ``!`` followed by whitespace, or
  at a blank line; it includes that whitespace. ``3.5`` is not a sentence end (no whitespace after the
  point). While decoding, the end is known once the next step's first character appears, so the stop rule
  sees one token past the step and the step's text is cut there.
"""

from __future__ import annotations

import re

SPLIT_STRATEGIES = ("paragraph", "sentence")
_PARAGRAPH_RE = re.compile(r"\n\s*\n")
_SENTENCE_RE = re.compile(r"(?:(?<=[.!?])\s+|\n\s*\n\s*)(?=\S)")


def check_strategy(strategy: str) -> str:
    """``strategy`` when it is a known split strategy; ValueError naming the choices otherwise."""
    if strategy not in SPLIT_STRATEGIES:
        raise ValueError(f"split_strategy must be one of {SPLIT_STRATEGIES}, got {strategy!r}")
    return strategy


def split_steps(text: str, strategy: str = "paragraph") -> list[str]:
    """Split a reasoning chain into steps, stripped; empty steps are skipped."""
    pattern = _PARAGRAPH_RE if check_strategy(strategy) == "paragraph" else _SENTENCE_RE
    return [p.strip() for p in pattern.split(text) if p.strip()]


def step_end(text: str, strategy: str, delimiter: str = "\n\n") -> int | None:
    """Where the first step of generated ``text`` ends (the index just past its delimiter or its
    sentence end with the whitespace after it), or None while the step is still going."""
    if strategy == "paragraph":
        cut = text.find(delimiter)
        return None if cut < 0 else cut + len(delimiter)
    check_strategy(strategy)
    m = _SENTENCE_RE.search(text)
    return None if m is None else m.end()


def joiner(strategy: str, delimiter: str = "\n\n") -> str:
    """What follows each step when steps are joined back into a context."""
    return delimiter if check_strategy(strategy) == "paragraph" else " "
