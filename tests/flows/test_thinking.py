"""A pair whose chat template thinks first: the reasoning comes back as ``reasoning_content`` (streamed as
its own deltas) and the answer as ``content``, with the reasoning's tokens in the usage; a stop string does
not act inside the reasoning."""

from __future__ import annotations

import pytest
from openai import OpenAI

from semspec.stops import StopStrings
from semspec.thinking import ThinkSplit, split_reasoning, thinks
from tests.helpers.serving import TinySpec, running_server

THINKING = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|><think>\n{% endif %}"
)  # a template like the R1 distills': the reply opens with <think>, the model writes </think> itself
CHAT = [{"role": "user", "content": "What is 2 + 3?"}]


def test_a_whole_answer_splits_at_the_end_of_its_reasoning():
    assert thinks(THINKING) and not thinks("{{ messages }}") and not thinks(None)
    assert split_reasoning("<think>\nadd them.\n</think>\n\nThe answer is 5.") == (
        "add them.",
        "The answer is 5.",
    )
    assert split_reasoning("still thinking when the budget ran out") == (
        "still thinking when the budget ran out",
        None,
    )


@pytest.mark.parametrize("cut", range(1, 12))
def test_a_streamed_answer_splits_wherever_its_steps_end(cut):
    text = "<think>\nadd: 2+3.\n</think>\n\nThe answer is 5."
    steps = [text[i : i + cut] for i in range(0, len(text), cut)]
    split, reasoning, content = ThinkSplit(), "", ""
    for step in steps:
        r, c = split.feed(step)
        reasoning, content = reasoning + r, content + c
    reasoning += split.rest()
    assert (reasoning.strip(), content) == split_reasoning(text)


def test_no_stop_string_acts_inside_the_reasoning():
    stops = StopStrings(["5"], after="</think>")
    out = stops.feed("<think>\n2+3 is 5, ") + stops.feed("so</") + stops.feed("think>\nIt is 5.")
    assert stops.stopped and out == "<think>\n2+3 is 5, so</think>\nIt is "


@pytest.fixture(scope="module")
def thinking_server():
    llm = TinySpec()
    for lm in llm.lms.values():
        lm.tokenizer.chat_template = THINKING
    with running_server(llm, max_tokens_limit=64, spec_max_batch=None) as (base, app):
        yield llm, base, app


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_the_server_returns_the_reasoning_apart(thinking_server, stream):
    llm, base, app = thinking_server
    assert app.state.served.thinks
    answer = llm.generate(CHAT, max_new_tokens=24, temperature=0.0).text
    reasoning, content = split_reasoning(answer)
    stop = answer[len(answer) // 2 : len(answer) // 2 + 2]  # in the reasoning (the tiny model never ends it)
    client = OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=60)
    kw = {"model": "tiny", "messages": CHAT, "max_tokens": 24, "temperature": 0, "stop": [stop]}
    if stream:
        chunks = list(
            client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
        )
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        got = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
        assert got.strip() == reasoning and not any(d.content for d in deltas)
        usage = chunks[-1].usage
    else:
        out = client.chat.completions.create(**kw)
        message = out.choices[0].message
        assert message.model_extra["reasoning_content"] == reasoning and message.content == content
        usage = out.usage
    assert content is None, "the tiny model never ends its reasoning: all of it is reasoning"
    assert usage.completion_tokens_details.reasoning_tokens > 0
