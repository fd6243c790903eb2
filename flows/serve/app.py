"""The app of ``semspec serve``: ``create_app`` wires one engine (started and stopped by the app's
lifespan), the error handlers that answer every failure in OpenAI's error schema (a full queue: 429 with
``Retry-After``), the API key check and the endpoints of ``routes`` (``run`` serves it).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from semspec.api import SemanticSpec
from semspec.engine import Engine
from semspec.flows.serve.config import ServeConfig
from semspec.flows.serve.guard import Guard
from semspec.flows.serve.metrics import ServeMetrics
from semspec.flows.serve.replies import ApiError, error_response
from semspec.flows.serve.routes import Served, api_router
from semspec.thinking import thinks

log = logging.getLogger(__name__)
RETRY_AFTER_S = 2  # what a 429 tells the client to wait


async def _api_error(_r: Request, e: ApiError) -> JSONResponse:
    """An ``ApiError`` raised by a handler, in OpenAI's schema; a 429 says when to retry."""
    headers = {"Retry-After": str(RETRY_AFTER_S)} if e.status == 429 else None
    return error_response(e.status, e.message, e.kind, e.param, headers)


async def _invalid_request(_r: Request, e: RequestValidationError) -> JSONResponse:
    """A body that does not validate: 400 naming the first bad field (``param``), not FastAPI's 422."""
    first = e.errors()[0] if e.errors() else {}
    where = ".".join(str(x) for x in first.get("loc", ()) if x != "body") or None
    return error_response(
        400, f"{where or 'body'}: {first.get('msg', 'invalid request')}", "invalid_request_error", where
    )


async def _http_error(_r: Request, e: StarletteHTTPException) -> JSONResponse:
    """Starlette's own errors (404 unknown path, 405 with its ``Allow`` header) in OpenAI's schema."""
    return error_response(e.status_code, str(e.detail), "invalid_request_error", headers=e.headers)


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    """The engine runs while the app does."""
    engine, cfg = app.state.engine, app.state.cfg
    engine.start()
    log.info("serving %s on http://%s:%d/v1", app.state.served.model_id, cfg.host, cfg.port)
    yield
    engine.stop()
    app.state.served.prompts.shutdown(wait=False, cancel_futures=True)


def create_app(llm: SemanticSpec, cfg: ServeConfig) -> FastAPI:
    """The FastAPI app serving ``llm`` (loaded once) with one engine, started and stopped with the app."""
    metrics = ServeMetrics(cfg.spec_max_batch)
    target = llm.lms["target"]
    engine = Engine(
        lambda method, t, p: llm.decoder(method, temperature=t, top_p=p),
        cfg.max_batch,
        cfg.max_queue,
        cfg.spec_max_batch,
        metrics.done,
        max_batch_tokens=cfg.batch_tokens,
        count_tokens=lambda text: len(target.plain_ids(text)),  # in the target's tokenizer
    )
    metrics.watch(engine)
    app = FastAPI(title="semspec", version="0.1.0", lifespan=_lifespan)
    app.state.engine, app.state.metrics, app.state.cfg = engine, metrics, cfg
    app.state.served = Served(
        llm=llm,
        engine=engine,
        metrics=metrics,
        created=int(time.time()),
        default_tokens=cfg.default_max_tokens or min(llm.defaults.max_new_tokens, cfg.max_tokens_limit),
        max_tokens_limit=cfg.max_tokens_limit,
        spec_max_batch=cfg.spec_max_batch,
        limits=cfg,
        prompts=ThreadPoolExecutor(cfg.prompt_workers, thread_name_prefix="semspec-prompt"),
        thinks=thinks(getattr(target.tokenizer, "chat_template", None)),
        count_tokens=lambda text: len(target.plain_ids(text)),  # in the target's tokenizer
    )
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(RequestValidationError, _invalid_request)
    app.add_exception_handler(StarletteHTTPException, _http_error)  # 405 keeps its Allow header
    app.include_router(api_router(cfg.max_tokens_limit, cfg.max_messages))
    app.add_middleware(Guard, cfg=cfg)  # Host, API key, body size and time, before any handler
    return app
