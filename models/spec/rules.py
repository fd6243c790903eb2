"""SemanticSpec's acceptance rule, in one place and without batching.

The paper's rule first: a draft step is accepted with probability ``min(1, p/q)``, where ``p`` is the
target probe's semantic probability of the step (how likely the target is to mean the same thing) and
``q`` the draft probe's; with ``u`` a uniform draw in [0, 1), the step is kept when ``u < min(1, p/q)``.
Then the options, each named as the README names them:

* **the p/q floor** (``min_ratio``): also reject a step whose ``p/q`` is below this;
* **the target's rule** (``min_p``): accept iff ``p >= min_p``, in place of the draw (``u`` is drawn all
  the same, so the random stream does not depend on the rule);
* **the token check** (``min_token_p``): a step the probes accept is rejected all the same when the
  target gives one of its tokens a probability ``tok`` below this;
* **the rejection budget** (``max_rejections``): after that many rejected steps in an answer the draft
  proposes no more (``drafting``).

A verdict names what decided it; a step the target wrote carries that name in its trace as
``rejected_by`` (``REJECTED_BY``).
"""

from __future__ import annotations

from dataclasses import dataclass

# why the target wrote a step, as the trace says it (``StepRecord.rejected_by``): the rule's parts (the
# paper's draw on p/q, the p/q floor, the target's rule, the token check), the rejection budget spent
# (the target writes with nothing proposed), an empty proposal (nothing to judge), SpecReason's score
REJECTED_BY = ("ratio", "floor", "target_rule", "token_check", "budget", "empty", "score")


@dataclass(frozen=True)
class Rule:
    """The options on top of the paper's rule (None: off)."""

    min_ratio: float | None = None  # the p/q floor
    min_p: float | None = None  # the target's rule
    min_token_p: float | None = None  # the token check
    max_rejections: int | None = None  # the rejection budget


@dataclass(frozen=True)
class Verdict:
    """Whether a step is kept, and which part of the rule decided."""

    accepted: bool
    reason: str  # accepted, or what rejected it: ratio | floor | target_rule | token_check

    @property
    def rejected_by(self) -> str | None:
        """What rejected the step (None: kept)."""
        return None if self.accepted else self.reason


def accept(p: float, q: float, u: float, rule: Rule = Rule(), tok: float | None = None) -> Verdict:
    """The verdict on one draft step: ``p`` the target probe's semantic probability of it, ``q`` the draft
    probe's, ``u`` a uniform draw in [0, 1), ``tok`` the least probability the target gives one of its
    tokens (None: not read yet; the token check then waits for it)."""
    ratio = p / q if q > 0 else float("inf")  # q = 0: a step its own model never says; p decides
    if rule.min_p is not None:
        if p < rule.min_p:
            return Verdict(False, "target_rule")
    elif not u < min(1.0, ratio):  # the paper's rule
        return Verdict(False, "ratio")
    if rule.min_ratio is not None and ratio < rule.min_ratio:
        return Verdict(False, "floor")
    if rule.min_token_p is not None and tok is not None and not tok >= rule.min_token_p:
        return Verdict(False, "token_check")
    return Verdict(True, "accepted")


def drafting(rule: Rule, rejections: int) -> bool:
    """Whether the draft still proposes after ``rejections`` rejected steps (the rejection budget)."""
    return rule.max_rejections is None or rejections < rule.max_rejections
