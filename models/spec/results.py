"""What every decoder returns: the steps (who wrote each, tokens per model, p, q, the acceptance draw)
and the timings, the ``Decoder`` protocol, and ``charged``, which declares what a model call's time is."""

from __future__ import annotations

import functools
import inspect
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol, TypeVar

from semspec.models.spec.grading import extract_answer
from semspec.models.spec.settings import (
    DecodeSettings,
)

StepCallback = Callable[["StepRecord"], None]  # called as each step is accepted or rewritten
F = TypeVar("F", bound=Callable[..., Any])


@dataclass
class StepRecord:
    """One step of the output."""

    author: str  # draft | target
    text: str
    draft_tokens: int  # tokens of the step in the draft's tokenizer (0 if the draft never saw it)
    target_tokens: int  # tokens of the step in the target's tokenizer (0 if the target never saw it)
    p: float | None = None  # target probe
    q: float | None = None  # draft probe
    u: float | None = None  # the acceptance draw
    tok: float | None = None  # the least probability the target gave a token of the step (min_token_p)
    score: int | None = None  # specreason's 0-9 score
    proposal: str | None = None  # a rejected draft step (what the target rewrote)
    salvaged: int = 0  # target tokens of the rejected proposal that the rewrite kept (salvage)
    rejected_by: str | None = None  # why the target wrote this step (rules.REJECTED_BY); None: not judged


@dataclass
class Timings:
    """Wall time split by activity (seconds)."""

    draft: float = 0.0  # draft generation and draft cache upkeep
    verify: float = 0.0  # target prefill of draft steps
    target: float = 0.0  # target generation
    probe: float = 0.0  # probe forward passes
    total: float = 0.0  # latency: from the problem's start (joining its batch) to its last step
    share: float = 0.0  # machine time: each batched call's time divided among its rows (batch 1: total)


PHASES = ("draft", "verify", "target", "probe")  # the Timings fields a model call is charged to (@charged)


@dataclass
class DecodeResult:
    """What every decoder returns."""

    method: str
    text: str
    answer: str | None
    steps: list[StepRecord] = field(default_factory=list)
    timings: Timings = field(default_factory=Timings)
    output_tokens: int = 0  # in the target's tokenizer when a target is involved
    target_prefill_tokens: int = 0  # tokens the target prefilled after the prompt (verification)
    finish_reason: str = "length"  # eos | length
    extra: dict = field(default_factory=dict)  # method-specific figures (e.g. token-level acceptance)
    on_step: StepCallback | None = field(default=None, repr=False, compare=False)

    def add(self, step: StepRecord) -> None:
        """Append a step and stream it to ``on_step``."""
        self.steps.append(step)
        if self.on_step is not None:
            self.on_step(step)

    @property
    def target_tokens(self) -> int:
        """Output tokens written by the target."""
        return sum(s.target_tokens for s in self.steps if s.author == "target")

    @property
    def target_share(self) -> float:
        """Share of output tokens written by the target (the paper's Ratio)."""
        return self.target_tokens / self.output_tokens if self.output_tokens else 0.0

    @property
    def rejections(self) -> int:
        """Draft steps rejected so far (each rewritten by the target)."""
        return sum(s.author == "target" and s.proposal is not None for s in self.steps)

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted draft steps / proposed draft steps (None when nothing was proposed)."""
        proposed = [s for s in self.steps if s.author == "draft" or s.proposal is not None]
        return sum(s.author == "draft" for s in proposed) / len(proposed) if proposed else None

    @property
    def prefill_per_output_token(self) -> float:
        """Target prefill tokens (after the prompt) per output token."""
        return self.target_prefill_tokens / self.output_tokens if self.output_tokens else 0.0

    @property
    def tokens_per_second(self) -> float:
        """Output tokens per wall-clock second."""
        return self.output_tokens / self.timings.total if self.timings.total else 0.0

    def to_dict(self) -> dict:
        """JSON-serialisable trace."""
        d = asdict(self)
        d.pop("on_step", None)
        d.update(
            target_share=self.target_share,
            acceptance_rate=self.acceptance_rate,
            prefill_per_output_token=self.prefill_per_output_token,
            tokens_per_second=self.tokens_per_second,
        )
        return d


class Decoder(Protocol):
    """What every decoder is: a method name and ``decode(question, on_step) -> DecodeResult``."""

    method: str

    def decode(self, question: str, on_step: StepCallback | None = None) -> DecodeResult:
        """Answer ``question``; ``on_step`` sees each step as it is accepted or written."""
        ...


def charged(phase: str) -> Callable[[F], F]:
    """Declare what a method's (or function's) time is: its wall time is added to field ``phase`` of the
    ``Timings`` of the rows it is given (its ``rows`` argument, or its ``row``), each row of a batched call
    having waited for all of it. ``phase`` is a ``Timings`` field (``draft``, ``verify``, ``target``,
    ``probe``), or ``role``: the call's ``role`` argument names it. Timing is declared on the few methods
    that call a model, so the algorithm's code carries no clocks."""

    if phase not in ("role", *PHASES):
        raise TypeError(f"@charged({phase!r}): a phase is one of {PHASES} or role")

    def wrap(fn: F) -> F:
        sig = inspect.signature(fn)
        which = "rows" if "rows" in sig.parameters else "row"
        if which not in sig.parameters or (phase == "role" and "role" not in sig.parameters):
            raise TypeError(f"@charged({phase!r}) needs a 'rows' or 'row' argument (and 'role' for role)")

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            # a call that cannot bind fails here, as it would, before it runs
            call = sig.bind(*args, **kwargs)
            call.apply_defaults()
            bound = call.arguments
            rows = bound[which] if which == "rows" else [bound[which]]
            name = bound["role"] if phase == "role" else phase
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t0
                for row in rows:
                    tm = row.res.timings
                    setattr(tm, name, getattr(tm, name) + dt)

        return timed  # type: ignore[return-value]

    return wrap


def finish_result(method: str, res: DecodeResult, t0: float, settings: DecodeSettings) -> DecodeResult:
    """Complete ``res``: the method, the full text, the extracted answer and the total time since ``t0``."""
    res.method = method
    res.text = "".join(s.text for s in res.steps)
    res.answer = extract_answer(res.text, settings.benchmark)
    res.timings.total = time.perf_counter() - t0
    return res
