"""What the engine decodes: a :class:`Submission` (one prompt, as a client asked for it, and what the engine
records of it while it runs) and the ways ``Engine.submit`` refuses one."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from semspec.models.lm import Prompt
from semspec.models.spec.names import PROBE_METHOD
from semspec.models.spec.results import StepRecord
from semspec.stops import StopStrings


class Overloaded(RuntimeError):
    """The queue is full: the request was not taken (a server answers 429 with Retry-After)."""


class Stopped(RuntimeError):
    """The engine stopped before the request finished."""


class TooLarge(ValueError):
    """The request alone needs more tokens than the batch may hold (a server answers 400)."""


@dataclass
class Submission:
    """One prompt to decode, as a client asked for it."""

    prompt: Prompt
    method: str
    # the caller's values (the server's: the request's, else the params' evaluate.decode): no defaults here
    max_new_tokens: int
    temperature: float
    top_p: float
    seed: int | None = None
    on_step: Callable[[StepRecord], None] | None = None  # called from the engine's thread
    prompt_tokens: int = 0  # the prompt's tokens (counted before submitting): admission's token budget
    stop: tuple[str, ...] = ()  # OpenAI's stop strings: the answer ends before the first match
    think_end: str | None = None  # a thinking model's end of reasoning: stop strings act only after it
    # set by the engine
    id: int = -1
    future: Future = field(default_factory=Future)  # the DecodeResult
    admitted: Future = field(default_factory=Future)  # True once its row is in the batch (prompt read)
    cancelled: threading.Event = field(default_factory=threading.Event)
    solo: bool = False  # SemanticSpec under load: in the target's lane (the target writes the rest)
    spec_rounds: int = 0  # rounds in which it speculated (SemanticSpec)
    solo_rounds: int = 0  # rounds in which the target wrote its step alone because the batch was full
    submitted: float = 0.0
    started: float | None = None  # when its row joined a batch (queue wait = started - submitted)
    stops: StopStrings | None = None  # reads its steps for ``stop`` (set by ``submit``)

    @property
    def tokens(self) -> int:
        """What the request may hold in the batch: its prompt and its whole budget of new tokens."""
        return self.prompt_tokens + self.max_new_tokens

    @property
    def speculation(self) -> bool:
        """Whether it speculated in every round (never switched off under load)."""
        return self.solo_rounds == 0

    @property
    def ran_as(self) -> str:
        """The method that decoded it: the target where speculation was off in every round."""
        return "target" if self.method == PROBE_METHOD and self.solo and not self.spec_rounds else self.method

    def cancel(self) -> None:
        """Drop the request: its row leaves the batch at the next round (a client that went away)."""
        self.cancelled.set()
