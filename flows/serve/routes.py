"""The endpoints of ``semspec serve`` (``flows.serve.app.create_app`` builds the app around them).

The handlers are module-level functions on an ``APIRouter``; what one app serves (the loaded pair, its
engine and metrics, the limits) is a :class:`Served` in ``request.app.state.served``, so several apps (tests,
Ray Serve replicas) share the code and not the state. A request is checked (model, method, max_tokens), its
prompt submitted to the engine as a :class:`semspec.engine.Request`, and answered (``replies``) as one JSON
body or as server-sent events, step by step; failures raise :class:`ApiError`, which the app answers in
OpenAI's error schema.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import uuid
from collections.abc import Awaitable, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, Field, create_model

from semspec.api import SemanticSpec
from semspec.engine import Engine
from semspec.flows.openai_schema import (
    ChatCompletion,
    ChatCompletionRequest,
    ChatMessage,
    Completion,
    CompletionRequest,
    ErrorResponse,
    ModelCard,
    ModelList,
    ok_responses,
)
from semspec.flows.serve.config import ServeConfig
from semspec.flows.serve.metrics import ServeMetrics
from semspec.flows.serve.replies import ApiError, Reply, completion_body, stream_events
from semspec.models.lm import RawPrompt, check_messages
from semspec.models.spec.results import DecodeResult
from semspec.stops import check_stops
from semspec.submission import Overloaded, Stopped, Submission, TooLarge
from semspec.thinking import END as THINK_END

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Served:
    """What one app serves, as its handlers read it from ``request.app.state.served``."""

    llm: SemanticSpec  # the loaded pair and probes
    engine: Engine  # decodes the requests together (continuous batching)
    metrics: ServeMetrics
    created: int  # when the app was built (the model card's ``created``)
    default_tokens: int  # max_tokens of a request that gives none
    max_tokens_limit: int  # the largest max_tokens a request may ask for
    spec_max_batch: int | None  # SemanticSpec speculates while at most this many are in flight
    limits: ServeConfig  # what a request may be (messages, characters, prompt tokens)
    prompts: ThreadPoolExecutor  # renders and tokenizes prompts, off the event loop and the engine
    thinks: bool = False  # the target's chat template thinks first: chats answer reasoning_content apart
    count_tokens: Callable[[str], int] | None = None  # a text's tokens in the target's tokenizer

    @property
    def model_id(self) -> str:
        """The served pair's name: the one model of /v1/models."""
        return self.llm.pair.name


def bounded_requests(
    limit: int, max_messages: int = 256
) -> tuple[type[ChatCompletionRequest], type[CompletionRequest]]:
    """The request models with ``max_tokens`` (and ``max_completion_tokens``) capped at ``limit`` and a
    chat's messages at ``max_messages``: the OpenAPI schema states this app's limits."""
    tokens = (Annotated[int, Field(ge=1, le=limit)] | None, None)
    chat = create_model(
        "ChatCompletionRequest",
        __base__=ChatCompletionRequest,
        max_tokens=tokens,
        max_completion_tokens=tokens,
        messages=(Annotated[list[ChatMessage], Field(min_length=1, max_length=max_messages)], ...),
    )
    completion = create_model("CompletionRequest", __base__=CompletionRequest, max_tokens=tokens)
    return chat, completion


def _check(served: Served, body: ChatCompletionRequest | CompletionRequest, asked: int | None) -> int:
    """The request's max_tokens, once its model and method are ones this server serves."""
    if body.model is not None and body.model != served.model_id:
        raise ApiError(
            404,
            f"model {body.model!r} is not served here; GET /v1/models lists {served.model_id!r}",
            "not_found_error",
            "model",
        )
    if body.method == "semanticspec" and served.llm.probe is None:
        raise ApiError(400, "this server was started without probes: ask for method 'target'", param="method")
    max_tokens = asked or served.default_tokens
    if max_tokens > served.max_tokens_limit:
        raise ApiError(
            400,
            f"max_tokens {max_tokens} is above this server's limit {served.max_tokens_limit}",
            param="max_tokens",
        )
    return max_tokens


def _check_chars(served: Served, chars: int, param: str) -> None:
    """400 for a prompt longer than the server's ``max_prompt_chars``, before any work is spent on it."""
    if chars > served.limits.max_prompt_chars:
        raise ApiError(
            400,
            f"the prompt has {chars} characters, above this server's limit of {served.limits.max_prompt_chars}",
            param=param,
        )


async def _decode(served: Served, http: Request, body, prompt, max_tokens: int, kind: str) -> Response:
    """Submit the request to the engine; answer when it is decoded, or stream its steps as they come."""
    loop = asyncio.get_running_loop()
    param = "messages" if kind == "chat" else "prompt"
    try:  # rendering and tokenizing a long prompt takes a while: a worker thread does it, not the engine
        prompt_tokens = await loop.run_in_executor(
            served.prompts, served.llm.prompt_tokens, prompt, max_tokens
        )
    except ValueError as e:
        raise ApiError(400, str(e), param=param) from None
    if prompt_tokens > served.limits.max_prompt_tokens:
        raise ApiError(
            400,
            f"the prompt takes {prompt_tokens} tokens, above this server's limit of {served.limits.max_prompt_tokens}",
            param=param,
        )
    steps: asyncio.Queue = asyncio.Queue()
    defaults = served.llm.defaults
    job = Submission(
        prompt,
        body.method,
        max_tokens,
        defaults.temperature if body.temperature is None else body.temperature,
        defaults.top_p if body.top_p is None else body.top_p,
        body.seed,
        on_step=(lambda s: loop.call_soon_threadsafe(steps.put_nowait, s)) if body.stream else None,
        prompt_tokens=prompt_tokens,
        stop=check_stops(body.stop),
        think_end=THINK_END if served.thinks and kind == "chat" else None,  # no stop acts inside reasoning
    )
    try:
        served.engine.submit(job)
    except TooLarge as e:
        raise ApiError(400, str(e), param="max_tokens") from None
    except Overloaded as e:
        served.metrics.refused(kind)
        raise ApiError(429, f"server busy: {e}; retry later", "rate_limit_error") from None
    except Stopped as e:
        raise ApiError(503, str(e), "server_error") from None
    try:  # a client that leaves while its request waits for a row takes it out of the queue
        await _watching(http, job, job.admitted)
    except Stopped as e:
        raise ApiError(503, str(e), "server_error") from None
    except ValueError as e:  # the prompt does not fit the context, a bad prompt
        raise ApiError(400, str(e), param=param) from None
    except ApiError:
        raise
    except Exception:  # the engine's own failure: logged there; the client gets no internals
        raise ApiError(
            500, f"decoding failed (request {job.id}); the server's log has the error", "server_error"
        ) from None
    rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:24]}"
    reply = Reply(rid, kind, served.model_id, served.spec_max_batch, served.thinks, served.count_tokens)
    if body.stream:
        job.future.add_done_callback(lambda _f: loop.call_soon_threadsafe(steps.put_nowait, None))
        usage = body.stream_options is not None and body.stream_options.include_usage
        return StreamingResponse(stream_events(reply, job, steps, usage), media_type="text/event-stream")
    res = await _wait(http, job)
    return JSONResponse(completion_body(reply, job, res))


async def _watching(http: Request, job: Submission, future: Future) -> Any:
    """``future``'s result; a client that disconnects meanwhile cancels ``job`` (its row leaves the batch,
    or it leaves the queue) and gets 499."""
    fut = asyncio.wrap_future(future)
    while True:
        done, _ = await asyncio.wait({fut}, timeout=0.25)
        if done:
            return fut.result()
        if await http.is_disconnected():
            job.cancel()
            fut.add_done_callback(lambda f: f.cancelled() or f.exception())  # nobody waits for it now
            raise ApiError(499, "client closed the request")


async def _wait(http: Request, job: Submission) -> DecodeResult:
    """The job's result; a client that disconnects meanwhile takes its row out of the batch."""
    try:
        return await _watching(http, job, job.future)
    except Stopped as e:
        raise ApiError(503, str(e), "server_error") from None
    except ApiError:
        raise
    except Exception:
        log.exception("request %d failed", job.id)
        raise ApiError(
            500, f"decoding failed (request {job.id}); the server's log has the error", "server_error"
        ) from None


async def chat_completions(body: ChatCompletionRequest, http: Request) -> Response:
    """OpenAI's chat completions; ``method`` picks a baseline, ``semspec`` in the reply is the trace."""
    served: Served = http.app.state.served
    max_tokens = _check(served, body, body.max_completion_tokens or body.max_tokens)
    try:  # the message count is bounded by the request model (bounded_requests)
        messages = check_messages([m.as_dict() for m in body.messages])
    except ValueError as e:
        raise ApiError(400, str(e), param="messages") from None
    _check_chars(served, sum(len(m["content"]) for m in messages), "messages")
    served.metrics.request("chat")
    return await _decode(served, http, body, messages, max_tokens, "chat")


async def completions(body: CompletionRequest, http: Request) -> Response:
    """OpenAI's (legacy) completions: the prompt is read as it is, with no chat template."""
    served: Served = http.app.state.served
    max_tokens = _check(served, body, body.max_tokens)
    prompt = body.prompt if isinstance(body.prompt, str) else body.prompt[0]
    _check_chars(served, len(prompt), "prompt")
    served.metrics.request("completion")
    return await _decode(served, http, body, RawPrompt(prompt), max_tokens, "completion")


async def models(http: Request) -> ModelList:
    """The served pair, as the one model."""
    served: Served = http.app.state.served
    return ModelList(data=[ModelCard(id=served.model_id, created=served.created)])


async def health(http: Request) -> JSONResponse:
    """Liveness and what is served: 503 when the engine's worker is not serving (it died, or stopped)."""
    served: Served = http.app.state.served
    alive = served.engine.alive
    body = {
        "status": "ok" if alive else "unavailable",
        "model": served.model_id,
        "probe": served.llm.probe,
        "models": {role: lm.describe()["dtype"] for role, lm in served.llm.lms.items()},
        "running": served.engine.running,
        "queued": served.engine.queue_depth,
        "spec_max_batch": served.spec_max_batch,
        "lanes": served.engine.lanes,
        "batch_tokens": served.engine.tokens_in_batch,
    }
    return JSONResponse(body, status_code=200 if alive else 503)


async def prometheus(http: Request) -> Response:
    """Prometheus metrics: requests, tokens, step acceptance, target share, queue, latencies."""
    metrics = http.app.state.served.metrics
    return Response(metrics.render(), media_type=metrics.content_type)


def _reading(
    handler: Callable[[Any, Request], Awaitable[Response]], model: type[BaseModel]
) -> Callable[[Any, Request], Awaitable[Response]]:
    """``handler`` with its ``body`` read as ``model``: FastAPI validates and documents a request body by
    the endpoint's signature, and each app has its own max_tokens limit (``bounded_requests``)."""

    @functools.wraps(handler)
    async def endpoint(body: Any, http: Request) -> Response:
        return await handler(body, http)

    signature = inspect.signature(handler, eval_str=True)
    params = [p.replace(annotation=model) if p.name == "body" else p for p in signature.parameters.values()]
    endpoint.__signature__ = signature.replace(parameters=params)  # type: ignore[attr-defined]
    return endpoint


def api_router(max_tokens_limit: int, max_messages: int = 256) -> APIRouter:
    """The endpoints, with the request models capped at ``max_tokens_limit`` (the OpenAPI schema states
    it; a request above it is answered 400)."""
    chat_request, completion_request = bounded_requests(max_tokens_limit, max_messages)
    errors: dict[int | str, dict[str, Any]] = {
        code: {"model": ErrorResponse} for code in (400, 401, 404, 429, 500, 503)
    }
    router = APIRouter()
    router.add_api_route(
        "/v1/chat/completions",
        _reading(chat_completions, chat_request),
        methods=["POST"],
        responses={**ok_responses(ChatCompletion), **errors},
    )
    router.add_api_route(
        "/v1/completions",
        _reading(completions, completion_request),
        methods=["POST"],
        responses={**ok_responses(Completion), **errors},
    )
    router.add_api_route("/v1/models", models, methods=["GET"], response_model=ModelList)
    router.add_api_route("/health", health, methods=["GET"])
    router.add_api_route(
        "/metrics",
        prometheus,
        methods=["GET"],
        response_class=Response,
        responses={200: {"content": {ServeMetrics.content_type: {}}}},
    )
    return router
