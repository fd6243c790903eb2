"""OpenAI's ``stop``: the answer ends at the first occurrence of any stop string, which is not returned.

Steps arrive whole (a reasoning step, accepted from the draft or written by the target), so a stop string
may sit inside a step, or straddle two. :class:`StopStrings` reads the answer as its steps come and says
which text may be released now: everything before a match, or, while no string matched, everything but
the longest tail that could still begin one (streamed text is never taken back, as vLLM's detokenizer
holds back the same tail). When the answer ends, :meth:`StopStrings.cut` shortens the result to the text
before the match, with its steps cut there too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

from semspec.models.spec.grading import extract_answer
from semspec.models.spec.results import DecodeResult

MAX_STOPS = 4  # OpenAI's limit


def _tail(text: str, strings: Sequence[str]) -> int:
    """Length of the longest tail of ``text`` that begins one of ``strings`` (it may still match)."""
    for n in range(min(max(len(s) for s in strings) - 1, len(text)), 0, -1):
        if any(s.startswith(text[-n:]) for s in strings):
            return n
    return 0


def check_stops(stop: str | Sequence[str] | None) -> tuple[str, ...]:
    """``stop`` as a tuple of distinct non-empty strings (OpenAI: a string or up to 4); ValueError else."""
    if stop is None:
        return ()
    stops = (stop,) if isinstance(stop, str) else tuple(stop)
    if len(stops) > MAX_STOPS or any(not isinstance(s, str) or not s for s in stops):
        raise ValueError(
            f"stop must be a non-empty string or a list of up to {MAX_STOPS} of them, got {stop!r}"
        )
    return tuple(dict.fromkeys(stops))


class StopStrings:
    """The stop strings of one answer, fed its steps in order."""

    def __init__(self, stops: Sequence[str], after: str | None = None) -> None:
        self.stops = check_stops(list(stops))
        if not self.stops:
            raise ValueError("StopStrings needs at least one stop string")
        self.after = after  # a marker (a thinking model's end of reasoning) before which no stop acts
        self.longest = max(len(s) for s in self.stops)
        self.text = ""  # the answer so far, as its steps gave it
        self.released = 0  # characters of ``text`` released (streamed)
        self.stopped = False  # a stop string matched; ``released`` is where the answer ends
        self.open_at: int | None = 0 if after is None else None  # where stop strings start to act

    def feed(self, step_text: str) -> str:
        """Read the next step; return the text that may be released now (empty once stopped)."""
        if self.stopped:
            return ""
        before = len(self.text)
        self.text += step_text
        if self.open_at is None:  # still before the marker: no stop acts; hold what may begin it
            i = self.text.find(self.after)
            if i < 0:
                return self._release(len(self.text) - _tail(self.text, (self.after,)))
            self.open_at = before = i + len(self.after)
        start = max(self.open_at, before - self.longest + 1)  # a match may begin in text already read
        hits = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            return self._release(min(hits))
        return self._release(len(self.text) - _tail(self.text[self.open_at :], self.stops))

    def _release(self, end: int) -> str:
        out, self.released = self.text[self.released : end], max(self.released, end)
        return out

    def rest(self) -> str:
        """What is still held back once the answer ended without a match (to be released last)."""
        return "" if self.stopped else self.text[self.released :]

    def cut(self, res: DecodeResult, count_tokens: Callable[[str], int]) -> DecodeResult:
        """``res`` ended at the match: its text, steps and token count cut there, ``finish_reason``
        ``stop``. Unchanged when nothing matched."""
        if not self.stopped:
            return res
        end, kept, seen = self.released, [], 0
        for step in res.steps:
            if seen >= end:
                break
            text = step.text[: end - seen]
            kept.append(step if text == step.text else replace(step, text=text))
            seen += len(step.text)
        text = res.text[:end]
        return replace(
            res,
            text=text,
            answer=extract_answer(text),  # read from what is returned, not from text past the stop
            steps=kept,
            finish_reason="stop",
            output_tokens=count_tokens(text),
        )
