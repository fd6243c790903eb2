"""A row's random draws are functions of its seed, its prompt and its step count: the acceptance draw of
the n-th judged step is value n of the stream seeded by (seed, prompt), a step's sampling seed is the
seed plus the steps written before it (a rejected proposal counted), whatever the batch or lookahead."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from semspec.models.spec.batching import uniform
from semspec.models.spec.semanticspec import SemanticSpecDecoder
from semspec.models.spec.settings import DecodeSettings
from semspec.models.spec.specreason import SpecReasonDecoder
from tests.helpers.tiny import tiny_lm

QUESTIONS = ["What is 2 + 3?", "Add 17 and 25.", "What is 9 - 4?"]
SAMPLED = DecodeSettings(max_new_tokens=40, step_tokens=8, temperature=0.8, top_p=0.95, seed=7)


@pytest.fixture(scope="module")
def pair():
    draft = tiny_lm(merged=True, seed=0, boost=2.5, max_step_tokens=8)
    target = tiny_lm(merged=False, seed=1, boost=2.0, max_step_tokens=8)
    return draft, target


def test_uniform_is_value_n_of_the_seeded_stream():
    rng = random.Random("7:q")
    assert [uniform("7:q", n) for n in range(5)] == [rng.random() for _ in range(5)]


def test_each_judged_step_s_draw_is_value_n_of_its_problem_s_stream(pair):
    draft, target = pair
    dec = SemanticSpecDecoder(draft, target, lambda h: 1.0, lambda h: 0.6, SAMPLED)
    res = dec.decode(QUESTIONS[0])
    draws = [s.u for s in res.steps if s.u is not None]
    assert len(draws) >= 2 and any(s.author == "target" for s in res.steps)  # rejections happened
    assert draws == [uniform(f"{SAMPLED.seed}:{QUESTIONS[0]}", n) for n in range(len(draws))]


@pytest.mark.parametrize("gamma", [1, 3])
def test_sampled_answers_do_not_depend_on_the_batch_or_the_lookahead(pair, gamma):
    draft, target = pair
    settings = replace(SAMPLED, gamma=gamma)
    alone = [
        SemanticSpecDecoder(
            draft, target, lambda h: 1.0, lambda h: 0.6, replace(settings, lookahead=0)
        ).decode(q)
        for q in QUESTIONS
    ]
    batched = SemanticSpecDecoder(draft, target, lambda h: 1.0, lambda h: 0.6, settings).decode_batch(
        QUESTIONS, batch_size=3
    )
    for a, b in zip(alone, batched, strict=True):
        assert [(s.author, s.text, s.u) for s in a.steps] == [(s.author, s.text, s.u) for s in b.steps]


def test_another_seed_samples_other_steps(pair):
    draft, target = pair
    texts = {
        seed: SpecReasonDecoder(draft, target, replace(SAMPLED, seed=seed)).decode(QUESTIONS[1]).text
        for seed in (1, 2, 3)
    }
    assert len(set(texts.values())) > 1
