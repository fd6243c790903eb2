"""The engine's lanes: the rows of one (method, temperature, top_p), which share every model call, with
what a lane does to its rows alone (retry them one by one after a failed round) and the callback that
hands a row's steps to its request."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from semspec.models.spec.batching import BatchDecoder, Row
from semspec.models.spec.results import StepRecord
from semspec.submission import Submission

log = logging.getLogger(__name__)


@dataclass
class Lane:
    """The rows of one (method, temperature, top_p): they share every model call."""

    decoder: BatchDecoder
    rows: list[Row] = field(default_factory=list)
    requests: dict[int, Submission] = field(default_factory=dict)

    def round_alone(self, before: dict[int, tuple], error: Exception, fail: Callable) -> list[Row]:
        """One round of each row by itself, after the batched round failed; a row that fails alone fails
        its request (``fail``), the others go on. A row the failed round had already moved (a step
        recorded, a cache extended: a round is not all-or-nothing) cannot be retried safely and fails
        with the round's error."""
        done = []
        for row in list(self.rows):
            if progress(row) != before[row.index]:
                self.drop(row)
                fail(self.requests.pop(row.index), error)
                continue
            try:
                done += self.decoder.round([row])
            except Exception as e:
                log.exception("request %d failed", row.index)
                self.drop(row)
                fail(self.requests.pop(row.index), e)
        return done

    def drop(self, row: Row) -> None:
        """Take ``row`` out of the lane before it finishes; its decoder forgets it."""
        self.rows.remove(row)
        self.decoder.release([row])


def step_callback(by_id: dict[int, Submission]) -> Callable[[int, StepRecord], None]:
    """The decoder's ``on_step`` for rows of ``by_id``: a row's steps go to its request's ``on_step``,
    cut at its stop strings (only text before a match, and none that may begin one)."""

    def on_step(key: int, step: StepRecord) -> None:
        req = by_id[key]
        if req.stops is not None:
            text = req.stops.feed(step.text)
            if not text:
                return
            step = replace(step, text=text)
        if req.on_step is not None:
            req.on_step(step)

    return on_step


def progress(row: Row) -> tuple:
    """What a round changes in a row: its steps, its tokens and each model's context and cache length."""
    states = []
    for state in (row.draft, row.target):
        if state is None:
            states.append(None)
            continue
        cache = state.cache.get_seq_length() if state.cache is not None else 0
        states.append((len(state.ids), cache))
    return len(row.res.steps), row.res.output_tokens, tuple(states)
