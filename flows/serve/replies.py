"""What the server answers, in OpenAI's schema: a whole completion, the server-sent events of a streamed
one, and errors; each completion carries the SemanticSpec trace in the extension field ``semspec``."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi.responses import JSONResponse

from semspec.api import Step
from semspec.flows.openai_schema import StepOut, Trace, Usage
from semspec.models.spec.results import DecodeResult
from semspec.submission import Submission
from semspec.thinking import ThinkSplit, split_reasoning


class ApiError(Exception):
    """An error answered in OpenAI's schema."""

    def __init__(
        self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None
    ):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


def error_response(
    status: int, message: str, kind: str, param: str | None = None, headers: dict | None = None
) -> JSONResponse:
    """An error in OpenAI's schema: ``{"error": {message, type, param, code}}``."""
    body = {"error": {"message": message, "type": kind, "param": param, "code": str(status)}}
    return JSONResponse(body, status_code=status, headers=headers)


@dataclass(frozen=True)
class Reply:
    """What every part of one request's answer names."""

    rid: str  # chatcmpl-<hex> or cmpl-<hex>
    kind: str  # chat or completion
    model_id: str  # the served pair's name
    spec_max_batch: int | None  # the server's threshold, reported in the trace
    thinks: bool = False  # a chat of a model that thinks first: reasoning_content apart from content
    count_tokens: Callable[[str], int] | None = None  # a text's tokens (the reasoning's, in the usage)


def _trace(
    job: Submission, res: DecodeResult | None, spec_max_batch: int | None, with_steps: bool = True
) -> Trace:
    """The request's SemanticSpec trace: how it ran, its steps (unless streamed), shares and timings."""
    steps = [StepOut(**Step.from_record(s).to_dict()) for s in res.steps] if res and with_steps else []
    decode_s = res.timings.total if res else None
    queued = None if job.started is None else job.started - job.submitted
    return Trace(
        method=job.method,
        ran_as=job.ran_as,
        speculation=job.speculation,
        rounds_without_speculation=job.solo_rounds,
        spec_max_batch=spec_max_batch,
        steps=steps,
        target_share=res.target_share if res else None,
        acceptance_rate=res.acceptance_rate if res else None,
        queue_seconds=queued,
        decode_seconds=decode_s,
    )


def _usage(res: DecodeResult, reasoning_tokens: int | None = None) -> Usage:
    prompt = int(res.extra.get("prompt_tokens", 0))
    details = None if reasoning_tokens is None else {"reasoning_tokens": reasoning_tokens}
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=res.output_tokens,
        total_tokens=prompt + res.output_tokens,
        completion_tokens_details=details,
    )


def _reasoning_tokens(reply: Reply, res: DecodeResult) -> int | None:
    """Tokens of a thinking model's reasoning (None for other answers)."""
    if not (reply.thinks and reply.kind == "chat" and reply.count_tokens):
        return None
    return reply.count_tokens(split_reasoning(res.text)[0])


def _finish(res: DecodeResult) -> str:
    """OpenAI's finish_reason: ``stop`` at the model's end or a stop string, else ``length``."""
    return "stop" if res.finish_reason in ("eos", "stop") else "length"


def completion_body(reply: Reply, job: Submission, res: DecodeResult) -> dict[str, Any]:
    """A whole (non-streamed) completion, with the trace in ``semspec``."""
    common = {
        "id": reply.rid,
        "created": int(time.time()),
        "model": reply.model_id,
        "usage": _usage(res, _reasoning_tokens(reply, res)).model_dump(exclude_none=True),
    }
    semspec = _trace(job, res, reply.spec_max_batch).model_dump()
    if reply.kind == "chat":
        message: dict[str, Any] = {"role": "assistant", "content": res.text}
        if reply.thinks:
            message["reasoning_content"], message["content"] = split_reasoning(res.text)
        choice = {"index": 0, "message": message, "finish_reason": _finish(res)}
        return {**common, "object": "chat.completion", "choices": [choice], "semspec": semspec}
    choice = {"index": 0, "text": res.text, "finish_reason": _finish(res), "logprobs": None}
    return {**common, "object": "text_completion", "choices": [choice], "semspec": semspec}


def _chunk(reply: Reply, text: str | None, finish: str | None, extra: dict, field: str = "content") -> str:
    """One server-sent event of a streamed completion (a chat's text as its ``field``: ``content`` or a
    thinking model's ``reasoning_content``)."""
    if reply.kind == "chat":
        delta = {} if text is None else {field: text}
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
        obj = "text_completion"
    body = {
        "id": reply.rid,
        "object": obj,
        "created": int(time.time()),
        "model": reply.model_id,
        "choices": [choice],
    }
    return f"data: {json.dumps({**body, **extra})}\n\n"


async def stream_events(
    reply: Reply, job: Submission, steps: asyncio.Queue, usage: bool
) -> AsyncIterator[str]:
    """The stream: (chat) the role, then one event per step with its ``semspec.step``, the finish with the
    trace, the usage when asked, ``[DONE]``. A failed decode ends with an error event and ``[DONE]``.
    ``steps`` holds the steps as they are decided and ``None`` once the job is done."""
    chat = reply.kind == "chat"
    try:
        if chat:
            yield _chunk(reply, None, None, {}).replace('"delta": {}', '"delta": {"role": "assistant"}', 1)
        split = ThinkSplit() if reply.thinks and chat else None
        while (step := await steps.get()) is not None:
            out = StepOut(**Step.from_record(step).to_dict()).model_dump()
            for text, field in _parts(split, step.text):
                yield _chunk(reply, text, None, {"semspec": {"step": out}}, field)
        try:
            res = job.future.result()
        except Exception:  # the server's log has the error; the client gets no internals
            err = {"message": f"decoding failed (request {job.id})", "type": "server_error"}
            yield f"data: {json.dumps({'error': err})}\n\n"
            yield "data: [DONE]\n\n"
            return
        rest = job.stops.rest() if job.stops is not None else ""  # the tail held back for a stop string
        for text, field in [*_parts(split, rest), *(((split.rest(), "reasoning_content"),) if split else ())]:
            if text:
                yield _chunk(reply, text, None, {}, field)
        semspec = _trace(job, res, reply.spec_max_batch, with_steps=False).model_dump()
        yield _chunk(reply, None if chat else "", _finish(res), {"semspec": semspec})
        if usage:
            tail = {
                "id": reply.rid,
                "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()),
                "model": reply.model_id,
                "choices": [],
                "usage": _usage(res, _reasoning_tokens(reply, res)).model_dump(exclude_none=True),
            }
            yield f"data: {json.dumps(tail)}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        if not job.future.done():  # the client went away mid-stream: its row leaves the batch
            job.cancel()


def _parts(split: ThinkSplit | None, text: str) -> list[tuple[str, str]]:
    """``text`` as (text, delta field) parts: all ``content``, or a thinking model's reasoning and content."""
    if split is None:
        return [(text, "content")] if text else []
    reasoning, content = split.feed(text)
    return [(t, f) for t, f in ((reasoning, "reasoning_content"), (content, "content")) if t]
