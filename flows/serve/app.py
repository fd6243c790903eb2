"""``semspec serve``: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over the batched step loop.

Endpoints: ``POST /v1/chat/completions`` and ``POST /v1/completions`` (streaming as server-sent events,
or not), ``GET /v1/models``, ``GET /health`` and ``GET /metrics`` (Prometheus). Concurrent requests are
decoded together by one :class:`semspec.engine.Engine` (continuous batching); each response carries the
SemanticSpec trace in the extension field ``semspec``. Every failure is answered in OpenAI's error schema
and the server keeps serving; a full queue answers 429 with ``Retry-After``.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import Field, create_model
from starlette.exceptions import HTTPException as StarletteHTTPException

from semspec.api import SemanticSpec, Step
from semspec.engine import Engine, Overloaded, Stopped
from semspec.engine import Request as Job
from semspec.flows.openai_schema import (
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    ErrorResponse,
    ModelCard,
    ModelList,
    StepOut,
    Trace,
    Usage,
    ok_responses,
)
from semspec.flows.serve.metrics import ServeMetrics
from semspec.models.lm import RawPrompt, check_messages
from semspec.models.project.settings import HOST
from semspec.models.spec.results import DecodeResult

log = logging.getLogger(__name__)
RETRY_AFTER_S = 2  # what a 429 tells the client to wait


@dataclass(frozen=True)
class ServeConfig:
    """How the server runs; checked before any model loads."""

    host: str = HOST  # loopback by default; another address needs an api_key
    port: int = 8000
    api_key: str | None = None  # required as ``Authorization: Bearer <key>`` when set
    max_batch: int = 8  # rows decoded at once
    max_queue: int = 64  # requests that may wait for a row; one more is answered 429
    spec_max_batch: int | None = None  # SemanticSpec speculates while at most this many are in flight
    max_tokens_limit: int = 2048  # the largest max_tokens a request may ask for
    default_max_tokens: int | None = None  # a request without max_tokens (None: the evaluation's budget)

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be 1-65535, got {self.port}")
        if self.max_batch < 1 or self.max_queue < 0 or self.max_tokens_limit < 1:
            raise ValueError("max_batch and max_tokens_limit must be >= 1, max_queue >= 0")
        if self.default_max_tokens is not None and not 1 <= self.default_max_tokens <= self.max_tokens_limit:
            raise ValueError(f"default_max_tokens must be in 1..{self.max_tokens_limit}")
        if not is_loopback(self.host) and not self.api_key:
            raise ValueError(
                f"--host {self.host} exposes the server beyond this machine: give --api-key KEY (clients "
                f"send it as 'Authorization: Bearer KEY'), or keep the default --host {HOST}"
            )


def cpu_kind() -> str:
    """``amx``, ``avx512_bf16`` or ``avx2``: the kinds whose serving threshold differs."""
    from semspec.models.cpu.formats import cpu_info

    cpu = cpu_info()
    return "amx" if cpu.amx else ("avx512_bf16" if cpu.native_bf16 else "avx2")


def auto_spec_max_batch(kind: str | None = None) -> int:
    """The serving threshold measured for this CPU kind (``conf/serving.yaml``)."""
    import yaml

    from semspec.models.project.pairs import project_root

    path = project_root() / "conf" / "serving.yaml"
    table = (yaml.safe_load(path.read_text(encoding="utf-8")) or {}).get("spec_max_batch", {})
    kind = kind or cpu_kind()
    if kind not in table:
        raise ValueError(f"{path}: no spec_max_batch for the CPU kind {kind!r}; add it, or pass a number")
    return int(table[kind])


def parse_spec_max_batch(value: str) -> int | None:
    """``auto`` (this CPU kind's measured threshold), ``always`` (never switch off) or a count >= 0."""
    if value == "auto":
        return auto_spec_max_batch()
    if value == "always":
        return None
    if not value.isdigit():
        raise ValueError(f"--spec-max-batch must be auto, always or a count >= 0, got {value!r}")
    return int(value)


def is_loopback(host: str) -> bool:
    """Whether ``host`` only reaches this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class ApiError(Exception):
    """An error answered in OpenAI's schema."""

    def __init__(
        self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None
    ):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


def _error(status: int, message: str, kind: str, param: str | None = None, headers: dict | None = None):
    body = {"error": {"message": message, "type": kind, "param": param, "code": str(status)}}
    return JSONResponse(body, status_code=status, headers=headers)


def _trace(job: Job, res: DecodeResult | None, spec_max_batch: int | None, with_steps: bool = True) -> Trace:
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


def bounded_requests(limit: int) -> tuple[type[ChatCompletionRequest], type[CompletionRequest]]:
    """The request models with ``max_tokens`` (and ``max_completion_tokens``) capped at ``limit``."""
    tokens = (Annotated[int, Field(ge=1, le=limit)] | None, None)
    chat = create_model(
        "ChatCompletionRequest",
        __base__=ChatCompletionRequest,
        max_tokens=tokens,
        max_completion_tokens=tokens,
    )
    completion = create_model("CompletionRequest", __base__=CompletionRequest, max_tokens=tokens)
    return chat, completion


def _usage(res: DecodeResult) -> Usage:
    prompt = int(res.extra.get("prompt_tokens", 0))
    return Usage(
        prompt_tokens=prompt, completion_tokens=res.output_tokens, total_tokens=prompt + res.output_tokens
    )


def _finish(res: DecodeResult) -> str:
    return "stop" if res.finish_reason == "eos" else "length"


def create_app(spec: SemanticSpec, cfg: ServeConfig) -> FastAPI:
    """The FastAPI app serving ``spec`` (loaded once) with one engine, started and stopped with the app."""
    metrics = ServeMetrics(cfg.spec_max_batch)
    engine = Engine(
        lambda method, t, p: spec.decoder(method, temperature=t, top_p=p),
        cfg.max_batch,
        cfg.max_queue,
        cfg.spec_max_batch,
        metrics.done,
    )
    metrics.watch(engine)
    model_id = spec.pair.name
    created = int(time.time())
    default_tokens = cfg.default_max_tokens or min(spec.defaults.max_new_tokens, cfg.max_tokens_limit)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        log.info("serving %s on http://%s:%d/v1", model_id, cfg.host, cfg.port)
        yield
        engine.stop()

    app = FastAPI(title="semspec", version="0.1.0", lifespan=lifespan)
    app.state.engine, app.state.metrics = engine, metrics
    error_responses: dict[int | str, dict[str, Any]] = {
        code: {"model": ErrorResponse} for code in (400, 401, 404, 429, 500, 503)
    }

    @app.exception_handler(ApiError)
    async def _api_error(_r: Request, e: ApiError) -> JSONResponse:
        headers = {"Retry-After": str(RETRY_AFTER_S)} if e.status == 429 else None
        return _error(e.status, e.message, e.kind, e.param, headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_r: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {}
        where = ".".join(str(x) for x in first.get("loc", ()) if x != "body") or None
        return _error(
            400, f"{where or 'body'}: {first.get('msg', 'invalid request')}", "invalid_request_error", where
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http(_r: Request, e: StarletteHTTPException) -> JSONResponse:
        return _error(e.status_code, str(e.detail), "invalid_request_error", headers=e.headers)  # 405: Allow

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if cfg.api_key and request.url.path.startswith("/v1/"):
            given = request.headers.get("authorization", "")
            if not secrets.compare_digest(given.encode(), f"Bearer {cfg.api_key}".encode()):
                return _error(
                    401, "missing or wrong API key (Authorization: Bearer KEY)", "authentication_error"
                )
        return await call_next(request)

    def _check(body: ChatCompletionRequest | CompletionRequest, asked: int | None) -> int:
        if body.model is not None and body.model != model_id:
            raise ApiError(
                404,
                f"model {body.model!r} is not served here; GET /v1/models lists {model_id!r}",
                "not_found_error",
                "model",
            )
        if body.method == "semanticspec" and spec.probe is None:
            raise ApiError(
                400, "this server was started without probes: ask for method 'target'", param="method"
            )
        max_tokens = asked or default_tokens
        if max_tokens > cfg.max_tokens_limit:
            raise ApiError(
                400,
                f"max_tokens {max_tokens} is above this server's limit {cfg.max_tokens_limit}",
                param="max_tokens",
            )
        return max_tokens

    async def _decode(http: Request, body, prompt, max_tokens: int, kind: str) -> Response:
        loop = asyncio.get_running_loop()
        steps: asyncio.Queue = asyncio.Queue()
        job = Job(
            prompt,
            body.method,
            max_tokens,
            spec.defaults.temperature if body.temperature is None else body.temperature,
            spec.defaults.top_p if body.top_p is None else body.top_p,
            body.seed,
            on_step=(lambda s: loop.call_soon_threadsafe(steps.put_nowait, s)) if body.stream else None,
        )
        try:
            engine.submit(job)
        except Overloaded as e:
            metrics.refused(kind)
            raise ApiError(429, f"server busy: {e}; retry later", "rate_limit_error") from None
        except Stopped as e:
            raise ApiError(503, str(e), "server_error") from None
        try:
            await asyncio.wrap_future(job.admitted)
        except ValueError as e:  # the prompt does not fit the context, a bad prompt
            raise ApiError(400, str(e), param="messages" if kind == "chat" else "prompt") from None
        except Stopped as e:
            raise ApiError(503, str(e), "server_error") from None
        rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        if body.stream:
            job.future.add_done_callback(lambda _f: loop.call_soon_threadsafe(steps.put_nowait, None))
            events = _events(
                job, steps, rid, kind, body.stream_options is not None and body.stream_options.include_usage
            )
            return StreamingResponse(events, media_type="text/event-stream")
        res = await _wait(http, job)
        return JSONResponse(_body(job, res, rid, kind))

    async def _wait(http: Request, job: Job) -> DecodeResult:
        fut = asyncio.wrap_future(job.future)
        while True:
            done, _ = await asyncio.wait({fut}, timeout=0.5)
            if done:
                break
            if await http.is_disconnected():  # its row leaves the batch
                job.cancel()
                raise ApiError(499, "client closed the request")
        try:
            return fut.result()
        except Stopped as e:
            raise ApiError(503, str(e), "server_error") from None
        except Exception as e:
            log.exception("request %d failed", job.id)
            raise ApiError(500, f"decoding failed: {type(e).__name__}: {e}", "server_error") from None

    def _body(job: Job, res: DecodeResult, rid: str, kind: str) -> dict[str, Any]:
        common = {
            "id": rid,
            "created": int(time.time()),
            "model": model_id,
            "usage": _usage(res).model_dump(),
        }
        trace = _trace(job, res, cfg.spec_max_batch).model_dump()
        if kind == "chat":
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": res.text},
                "finish_reason": _finish(res),
            }
            return {**common, "object": "chat.completion", "choices": [choice], "semspec": trace}
        choice = {"index": 0, "text": res.text, "finish_reason": _finish(res), "logprobs": None}
        return {**common, "object": "text_completion", "choices": [choice], "semspec": trace}

    def _chunk(rid: str, kind: str, text: str | None, finish: str | None, extra: dict) -> str:
        if kind == "chat":
            delta = {} if text is None else {"content": text}
            choice = {"index": 0, "delta": delta, "finish_reason": finish}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
            obj = "text_completion"
        body = {"id": rid, "object": obj, "created": int(time.time()), "model": model_id, "choices": [choice]}
        return f"data: {json.dumps({**body, **extra})}\n\n"

    async def _events(job: Job, steps: asyncio.Queue, rid: str, kind: str, usage: bool) -> AsyncIterator[str]:
        try:
            if kind == "chat":
                yield _chunk(rid, kind, None, None, {}).replace(
                    '"delta": {}', '"delta": {"role": "assistant"}', 1
                )
            while (step := await steps.get()) is not None:
                out = StepOut(**Step.from_record(step).to_dict()).model_dump()
                yield _chunk(rid, kind, step.text, None, {"semspec": {"step": out}})
            try:
                res = job.future.result()
            except Exception as e:
                err = {"message": f"decoding failed: {type(e).__name__}: {e}", "type": "server_error"}
                yield f"data: {json.dumps({'error': err})}\n\n"
                yield "data: [DONE]\n\n"
                return
            trace = _trace(job, res, cfg.spec_max_batch, with_steps=False).model_dump()
            yield _chunk(rid, kind, None if kind == "chat" else "", _finish(res), {"semspec": trace})
            if usage:
                tail = {
                    "id": rid,
                    "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
                    "created": int(time.time()),
                    "model": model_id,
                    "choices": [],
                    "usage": _usage(res).model_dump(),
                }
                yield f"data: {json.dumps(tail)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            if not job.future.done():  # the client went away mid-stream: its row leaves the batch
                job.cancel()

    chat_body, completion_body = bounded_requests(cfg.max_tokens_limit)

    async def chat_completions(body: ChatCompletionRequest, http: Request) -> Response:
        """OpenAI's chat completions; ``method`` picks a baseline, ``semspec`` in the reply is the trace."""
        max_tokens = _check(body, body.max_completion_tokens or body.max_tokens)
        try:
            messages = check_messages([{"role": m.role, "content": m.content} for m in body.messages])
        except ValueError as e:
            raise ApiError(400, str(e), param="messages") from None
        metrics.request("chat")
        return await _decode(http, body, messages, max_tokens, "chat")

    async def completions(body: CompletionRequest, http: Request) -> Response:
        """OpenAI's (legacy) completions: the prompt is read as it is, with no chat template."""
        max_tokens = _check(body, body.max_tokens)
        prompt = body.prompt if isinstance(body.prompt, str) else body.prompt[0]
        metrics.request("completion")
        return await _decode(http, body, RawPrompt(prompt), max_tokens, "completion")

    # the request models with this server's max_tokens limit, so the OpenAPI schema states it
    chat_completions.__annotations__["body"] = chat_body
    completions.__annotations__["body"] = completion_body
    app.post("/v1/chat/completions", responses={**ok_responses(ChatCompletion), **error_responses})(
        chat_completions
    )
    app.post("/v1/completions", responses={**ok_responses(Completion), **error_responses})(completions)

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> ModelList:
        """The served pair, as the one model."""
        return ModelList(data=[ModelCard(id=model_id, created=created)])

    @app.get("/health")
    async def health() -> dict[str, Any]:
        """Liveness and what is served."""
        return {
            "status": "ok",
            "model": model_id,
            "probe": spec.probe,
            "models": {role: lm.describe()["dtype"] for role, lm in spec.lms.items()},
            "running": engine.running,
            "queued": engine.queue_depth,
            "spec_max_batch": cfg.spec_max_batch,
        }

    @app.get("/metrics", response_class=Response, responses={200: {"content": {metrics.content_type: {}}}})
    async def prometheus() -> Response:
        """Prometheus metrics: requests, tokens, step acceptance, target share, queue, latencies."""
        return Response(metrics.render(), media_type=metrics.content_type)

    return app


def run_server(
    pair: str | None, probes: str | None, probe: str | None, cfg: ServeConfig, replicas: int = 0
) -> None:
    """Load the pair (every check first, then the models, once) and serve it until interrupted: in this
    process with uvicorn, or with ``replicas`` >= 1 as that many Ray Serve replicas of the same app."""
    if replicas:
        from semspec.flows.serve.replicas import serve_replicas

        serve_replicas(pair, probes, probe, cfg, replicas)
        return
    import uvicorn

    from semspec.api import load

    spec = load(pair, probes=probes, probe=probe)
    uvicorn.run(create_app(spec, cfg), host=cfg.host, port=cfg.port, log_level="info")
