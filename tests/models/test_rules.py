"""SemanticSpec's acceptance rule as one pure function: the paper's min(1, p/q) first, then the options."""

from __future__ import annotations

import pytest

from semspec.models.spec.rules import REJECTED_BY, Rule, accept, drafting


def test_the_papers_rule_keeps_a_step_when_u_falls_below_min_1_p_over_q():
    assert accept(p=0.4, q=0.8, u=0.49).accepted  # p/q = 0.5
    assert accept(0.4, 0.8, 0.5).reason == "ratio", "u = p/q is not below it"
    assert accept(0.9, 0.3, 0.999).accepted, "p > q: min(1, p/q) = 1 keeps every draw"
    assert accept(0.2, 0.0, 0.999).accepted, "q = 0: a step its own model never says; p/q is infinite"
    assert not accept(0.0, 0.5, 0.0).accepted, "p = 0: never"


def test_the_options_each_say_what_rejected_the_step():
    assert accept(0.3, 0.2, 0.1, Rule(min_ratio=2.0)).reason == "floor"  # drawn in, floored out
    assert accept(0.5, 0.2, 0.1, Rule(min_ratio=2.0)).accepted
    assert accept(0.6, 0.9, 0.99, Rule(min_p=0.5)).accepted, "the target's rule reads p alone, no draw"
    assert accept(0.4, 0.1, 0.0, Rule(min_p=0.5)).reason == "target_rule"
    check = Rule(min_token_p=0.05)
    assert accept(0.9, 0.5, 0.1, check).accepted, "the token check waits for the tokens"
    assert accept(0.9, 0.5, 0.1, check, tok=0.2).accepted
    assert accept(0.9, 0.5, 0.1, check, tok=0.01).reason == "token_check"
    assert accept(0.9, 0.5, 0.1, check, tok=float("nan")).reason == "token_check", "unknown: rejected"


def test_a_verdict_names_what_rejected_the_step_in_the_trace_s_words():
    cases = [(0.4, 0.8, 0.5, Rule()), (0.3, 0.2, 0.1, Rule(min_ratio=2.0)), (0.4, 0.1, 0.0, Rule(min_p=0.5))]
    cases.append((0.9, 0.5, 0.1, Rule(min_token_p=0.05)))
    rejected = [accept(p, q, u, rule, tok=0.01).rejected_by for p, q, u, rule in cases]
    assert rejected == ["ratio", "floor", "target_rule", "token_check"]
    assert set(rejected) <= set(REJECTED_BY)
    assert accept(0.9, 0.3, 0.5).rejected_by is None, "a kept step was rejected by nothing"


@pytest.mark.parametrize(
    "budget, rejections, drafts", [(None, 99, True), (2, 1, True), (2, 2, False), (0, 0, False)]
)
def test_the_rejection_budget_stops_the_draft(budget, rejections, drafts):
    assert drafting(Rule(max_rejections=budget), rejections) is drafts
