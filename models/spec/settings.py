"""The decode settings, defined once: every decoder, ``params.yaml``'s ``evaluate.decode`` section, the
CLI, the API and the server read this dataclass."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from semspec.models.spec import rules
from semspec.models.spec.names import FLOOR_AUTO, GAMMA_AUTO


class MethodNotApplicable(ValueError):
    """A decoding method that cannot run on this pair (e.g. token-level speculation across two
    vocabularies); evaluation and the bench skip it and report the reason."""


MIN_TEMPERATURE = 1e-3  # a temperature below this decodes greedily
GAMMA_MAX = 4  # the most steps per round ``gamma_for`` picks
GAMMA_WHOLE = 0.5  # gamma_for: the longest round accepted whole at least this often
# DecodeSettings' fields a run sets (its seed from evaluate.seeds, how its benchmark's answers are read)
PER_RUN = ("seed", "benchmark")


def gamma_for(accept_rate: float | None) -> int:
    """SemanticSpec's steps per round for a step acceptance rate ``accept_rate`` (the probes' rate on
    held-out steps): the longest round, up to ``GAMMA_MAX``, that is accepted whole at least half the time
    (``accept_rate ** gamma >= 1/2``), since a rejection discards the round's later steps; 1 where the rate
    is unknown or below one half."""
    if accept_rate is None or not 0 <= accept_rate <= 1:
        return 1
    return max(g for g in range(1, GAMMA_MAX + 1) if g == 1 or accept_rate**g >= GAMMA_WHOLE)


@dataclass
class DecodeSettings:
    """The knobs every decoder shares, each defined here once: a field, its comment and its check.
    ``params.yaml``'s ``evaluate.decode`` section is parsed into it (``from_mapping``), and the evaluation,
    ``semspec decode``, ``semspec bench``, the API and the server start from that; a new setting is a
    field here and a line there."""

    max_new_tokens: int = 256  # output budget (target-tokenizer tokens where a target is involved)
    step_tokens: int | None = None  # per-step budget; None: each model config's max_step_tokens
    # 0: greedy; below MIN_TEMPERATURE too (its limit: dividing logits by less overflows the softmax)
    temperature: float = 0.0
    top_p: float = 1.0
    # steps drafted before verification (paper default 1); GAMMA_AUTO ("auto") is resolved to a count from
    # the probes' acceptance on held-out steps (``gamma_for``) by whoever loads them, before decoding
    gamma: int | str = 1
    # batches only: steps a row may write ahead while others finish theirs (never changes an output)
    lookahead: int = 4
    # batches only: rounds a rejected row may wait so the target rewrites several rows in one decode loop
    rewrite_wait: int = 0
    # also reject when p/q falls below this (off by default); FLOOR_AUTO ("auto") is resolved to a
    # number or None by whoever loads the probes (semspec.tasks.decoders.build_decoder), before a decoder
    # reads it
    min_ratio: float | str | None = None
    # the target's rule in place of the paper's: accept a step iff p >= min_p, no draw, q not read (for
    # greedy decoding: keep the steps whose meaning the target likely shares); "auto" as for min_ratio
    min_p: float | str | None = None
    # semanticspec: after this many rejected steps in an answer, the target writes the rest of it alone
    # (the draft proposes no more). None: off, the paper's rule for every step
    max_rejections: int | None = None
    # semanticspec: the target's token check, beside the probes: a step they accept is rejected all the
    # same when the target gives one of its tokens a probability below this (a wrong number, a word it
    # would not write); the output head then runs over every accepted step's positions. None: off
    min_token_p: float | None = None
    accept_threshold: int = 7  # specreason: accept steps scored at or above this (0-9)
    salvage: bool = True  # greedy semanticspec: a rejected step keeps its prefix the target agrees with
    # per run, not configured (PER_RUN): the seed of the run's draws and how its answers are read
    seed: int = 0
    benchmark: str = "math"  # how to extract the final answer (gpqa: a letter)

    @property
    def rule(self) -> rules.Rule:
        """SemanticSpec's acceptance options (``models/spec/rules.py``); floors must be resolved."""
        return rules.Rule(self.min_ratio, self.min_p, self.min_token_p, self.max_rejections)

    @property
    def salvages(self) -> bool:
        """Whether rejected steps are salvaged: asked for, and greedy (the only exact case)."""
        return self.salvage and self.temperature == 0

    def __post_init__(self) -> None:
        _count("max_new_tokens", self.max_new_tokens, 1)
        _count("step_tokens", self.step_tokens, 1, optional=True)
        if self.gamma != GAMMA_AUTO:
            _count("gamma", self.gamma, 1, extra=" or 'auto'")
        _count("lookahead", self.lookahead, 0)
        _count("rewrite_wait", self.rewrite_wait, 0)
        for name in ("min_ratio", "min_p"):
            floor = getattr(self, name)
            if floor is not None and floor != FLOOR_AUTO and (not _number(floor) or floor < 0):
                raise ValueError(f"{name} must be null, a number >= 0 or 'auto', got {floor!r}")
        if self.min_ratio is not None and self.min_p is not None:
            raise ValueError("min_ratio and min_p are two acceptance rules: set one of them, not both")
        _count("max_rejections", self.max_rejections, 0, optional=True)
        if self.min_token_p is not None and (not _number(self.min_token_p) or not 0 < self.min_token_p < 1):
            raise ValueError(f"min_token_p must be null or a probability in (0, 1), got {self.min_token_p!r}")
        _count("accept_threshold", self.accept_threshold, 0)
        if self.accept_threshold > 9:
            raise ValueError(f"accept_threshold must be in 0..9, got {self.accept_threshold}")
        if not isinstance(self.salvage, bool):
            raise ValueError(f"salvage must be true or false, got {self.salvage!r}")
        if not _number(self.temperature) or not _number(self.top_p):
            raise ValueError(
                f"temperature and top_p must be numbers, got {self.temperature!r}, {self.top_p!r}"
            )
        if not self.temperature >= 0 or not 0 < self.top_p <= 1:  # NaN fails too
            raise ValueError("temperature must be >= 0 and top_p in (0, 1]")
        if self.temperature < MIN_TEMPERATURE:
            self.temperature = 0.0

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], where: str = "evaluate.decode") -> DecodeSettings:
        """The settings a config section gives (``params.yaml``'s ``evaluate.decode``), checked once: an
        unknown key, a per-run field or a bad value is a ValueError naming ``where``."""
        if not isinstance(data, Mapping):
            raise ValueError(f"{where} must be a mapping of decode settings, got {type(data).__name__}")
        known = [f.name for f in fields(cls) if f.name not in PER_RUN]
        unknown = sorted(set(data) - set(known))
        if unknown:
            why = " (set per run: evaluate.seeds, the benchmark)" if set(unknown) & set(PER_RUN) else ""
            raise ValueError(f"{where}: unknown setting(s) {unknown}{why}; known: {known}")
        try:
            return cls(**data)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None

    def configured(self) -> dict[str, Any]:
        """The settings a config gives, by name (the per-run fields left out)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in PER_RUN}


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _count(name: str, value: Any, least: int, optional: bool = False, extra: str = "") -> None:
    """ValueError unless ``value`` is an int >= ``least`` (or None when ``optional``)."""
    if optional and value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        none = "null or " if optional else ""
        raise ValueError(f"{name} must be {none}a count >= {least}{extra}, got {value!r}")
