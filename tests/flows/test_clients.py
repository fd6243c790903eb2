"""The clients people already use, against the server over tiny models: OpenAI's own client, LangChain's
``ChatOpenAI`` and LiteLLM, each streamed and not, with ``stop``; the protocol's other forms (the
developer role, text-part content, neutral option values) and a clear 400 for what is not supported."""

from __future__ import annotations

import httpx
import pytest
from openai import OpenAI

from semspec.models.spec.results import DecodeResult, StepRecord
from semspec.stops import StopStrings, check_stops

Q = "What is 2 + 3?"
CHAT = [{"role": "user", "content": Q}]


@pytest.fixture(scope="module")
def answer(llm) -> str:
    """The unstopped answer to ``CHAT`` (greedy, 24 tokens): the stop strings are cut from it."""
    return llm.generate(CHAT, max_new_tokens=24, temperature=0.0).text


def _stop_of(answer: str) -> str:
    """A stop string that occurs in ``answer`` past its first step: two characters from its middle."""
    mid = len(answer) // 2
    return answer[mid : mid + 2]


def _client(base: str) -> OpenAI:
    return OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=60)


# ------------------------------------------------------------------------------------- stop, unit
def test_stop_strings_release_text_before_a_match_and_hold_back_a_possible_start():
    stops = StopStrings(["END", "xy"])
    assert stops.feed("abc E") == "abc "  # "E" may begin "END": held
    assert stops.feed("N") == ""  # "EN" still may
    assert stops.feed("D and more") == "" and stops.stopped  # the match ends the answer before it
    assert stops.text[: stops.released] == "abc "
    straddle = StopStrings(["\n\nQ"])
    assert straddle.feed("one.\n\n") == "one."  # the step's delimiter may begin the stop string
    assert straddle.feed("Q: next") == "" and straddle.stopped and straddle.released == 4
    plain = StopStrings(["zz"])
    assert plain.feed("a z") == "a " and plain.rest() == "z"  # no match: the held tail comes last


def test_a_result_is_cut_at_the_match_with_its_steps():
    steps = [StepRecord("draft", "First. ", 2, 2), StepRecord("target", "Second END third.", 0, 4)]
    res = DecodeResult("semanticspec", "First. Second END third.", None, steps, output_tokens=6)
    stops = StopStrings(["END"])
    for s in steps:
        stops.feed(s.text)
    cut = stops.cut(res, lambda text: len(text.split()))
    assert cut.text == "First. Second " and cut.finish_reason == "stop" and cut.output_tokens == 2
    assert [s.text for s in cut.steps] == ["First. ", "Second "] and cut.steps[1].author == "target"


@pytest.mark.parametrize("bad", ["", ["a", ""], ["a", "b", "c", "d", "e"], [3]])
def test_bad_stops_are_refused(bad):
    with pytest.raises(ValueError, match="stop"):
        check_stops(bad)


# ----------------------------------------------------------------------------------- openai client
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_the_openai_client_stops_at_a_stop_string(server, answer, stream):
    base, _ = server
    stop = _stop_of(answer)
    expected = answer[: answer.index(stop)]
    kw = {"model": "tiny", "messages": CHAT, "max_tokens": 24, "temperature": 0, "stop": [stop]}
    if stream:
        chunks = list(_client(base).chat.completions.create(**kw, stream=True))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    else:
        out = _client(base).chat.completions.create(**kw)
        text, finish = out.choices[0].message.content, [out.choices[0].finish_reason]
        assert out.usage.completion_tokens <= len(expected) + 1
    assert text == expected and finish == ["stop"]


def test_the_completions_endpoint_stops_too_for_a_baseline(server, llm):
    base, _ = server
    from semspec.models.lm import RawPrompt

    prompt = "Question: 2+3?\nAnswer:"
    whole = llm.generate(RawPrompt(prompt), method="target", max_new_tokens=20).text
    stop = _stop_of(whole)
    out = _client(base).completions.create(
        model="tiny", prompt=prompt, max_tokens=20, stop=stop, extra_body={"method": "target"}
    )
    assert out.choices[0].text == whole[: whole.index(stop)] and out.choices[0].finish_reason == "stop"


def test_developer_role_text_parts_and_neutral_values_are_accepted(server, llm):
    base, _ = server
    messages = [
        {"role": "developer", "content": "Be brief."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "What is"}, {"type": "text", "text": "2 + 3?"}],
        },
    ]
    out = _client(base).chat.completions.create(
        model="tiny",
        messages=messages,
        max_completion_tokens=12,
        temperature=0,
        presence_penalty=0,
        frequency_penalty=0,
        logprobs=False,
        response_format={"type": "text"},
        n=1,
        extra_body={"tool_choice": "none", "parallel_tool_calls": False},
    )
    alone = llm.generate(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is\n2 + 3?"}],
        max_new_tokens=12,
        temperature=0.0,
    )
    assert out.choices[0].message.content == alone.text


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("presence_penalty", 0.5),
        ("frequency_penalty", -1.0),
        ("logprobs", True),
        ("response_format", {"type": "json_object"}),
        ("tool_choice", "auto"),
        ("n", 2),
        ("stop", ""),
        ("stop", ["a", ""]),
        ("stop", ["a", "b", "c", "d", "e"]),
    ],
)
def test_other_values_are_refused_by_name(server, field, value):
    base, _ = server
    r = httpx.post(f"{base}/v1/chat/completions", json={"messages": CHAT, "max_tokens": 4, field: value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert field in (err["param"] or "") or field in err["message"]


# ------------------------------------------------------------------------------ langchain, litellm
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_langchain_chat_openai(server, answer, stream):
    import langchain_openai

    base, _ = server
    stop = _stop_of(answer)
    llm = langchain_openai.ChatOpenAI(
        base_url=f"{base}/v1", api_key="none", model="tiny", temperature=0, max_tokens=24, max_retries=0
    )
    if stream:
        text = "".join(chunk.content for chunk in llm.stream(Q, stop=[stop]))
    else:
        text = llm.invoke(Q, stop=[stop]).content
    assert text == answer[: answer.index(stop)]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_litellm(server, answer, stream, monkeypatch):
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # its price list from the package, offline
    import litellm

    base, _ = server
    stop = _stop_of(answer)
    kw = {
        "model": "openai/tiny",
        "api_base": f"{base}/v1",
        "api_key": "none",
        "messages": CHAT,
        "max_tokens": 24,
        "temperature": 0,
        "stop": [stop],
    }
    if stream:
        text = "".join(c.choices[0].delta.content or "" for c in litellm.completion(**kw, stream=True))
    else:
        text = litellm.completion(**kw).choices[0].message.content
    assert text == answer[: answer.index(stop)]


def test_an_empty_stop_list_means_no_stop(server, answer):
    base, _ = server
    r = httpx.post(
        f"{base}/v1/chat/completions",
        json={"messages": CHAT, "max_tokens": 24, "temperature": 0, "stop": []},
        timeout=60,
    )
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == answer
