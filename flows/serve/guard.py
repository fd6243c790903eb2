"""What stands in front of the server's endpoints, as one pure ASGI middleware: the ``Host`` header, the
API key, the body's size and the time a client takes to send it.

A pure ASGI middleware (not Starlette's ``BaseHTTPMiddleware``) passes the client's ``receive`` through
to the endpoint, so a handler still sees ``http.disconnect`` when its client goes away and takes the
request's row out of the batch; ``BaseHTTPMiddleware`` hides it (the handler saw a connected client until
the answer was decoded in full).
"""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from semspec.flows.serve.config import ServeConfig, is_loopback

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

OPEN_PATHS = ("/health",)  # liveness: answered without the key (it tells no more than up or down)
LOOPBACK_NAMES = ("127.0.0.1", "localhost", "[::1]", "::1")


class BodyTooLarge(Exception):
    """The body passed ``max_body_bytes`` while it was read."""


class Guard:
    """Checks every HTTP request before the app sees it.

    - ``Host``: a server bound to loopback answers only requests addressed to a loopback name (400
      otherwise): a web page cannot reach it through a DNS name rebound to 127.0.0.1.
    - The API key (when set): every path but ``/health`` (and ``/metrics`` with ``public_metrics``) needs
      ``Authorization: Bearer KEY`` (401), compared in constant time.
    - The body: a ``Content-Length`` above ``max_body_bytes`` is answered 413 before a byte is read; the
      body is read whole before the app runs, and one that grows past the limit (chunked) is answered
      413, one not received within ``body_timeout`` seconds 408.
    """

    def __init__(self, app: ASGIApp, cfg: ServeConfig) -> None:
        self.app, self.cfg = app, cfg
        self.loopback = is_loopback(cfg.host)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self._refusal(scope)
        if refusal is not None:
            await _error(send, *refusal)
            return
        length = _header(scope, b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.cfg.max_body_bytes):
            await _error(
                send, 413, f"the request body is above this server's limit of {self.cfg.max_body_bytes} bytes"
            )
            return
        try:
            body = await self._read_body(receive)
        except BodyTooLarge:
            await _error(
                send, 413, f"the request body is above this server's limit of {self.cfg.max_body_bytes} bytes"
            )
            return
        except TimeoutError:
            await _error(send, 408, f"the request body was not received within {self.cfg.body_timeout:g} s")
            return
        if body is None:  # the client left while sending
            return
        await self.app(scope, _replay(body, receive), send)

    def _refusal(self, scope: Scope) -> tuple[int, str, str] | None:
        """(status, message, type) of a request refused for its Host header or key, else None."""
        if self.loopback and host_name(_header(scope, b"host") or "") not in LOOPBACK_NAMES:
            return (
                400,
                "this server answers requests to 127.0.0.1 or localhost only (Host header)",
                "invalid_request_error",
            )
        key, path = self.cfg.api_key, scope.get("path", "")
        if not key or path in OPEN_PATHS or (path == "/metrics" and self.cfg.public_metrics):
            return None
        given = _header(scope, b"authorization") or ""
        if secrets.compare_digest(given.encode(), f"Bearer {key}".encode()):
            return None
        return 401, "missing or wrong API key (Authorization: Bearer KEY)", "authentication_error"

    async def _read_body(self, receive: Receive) -> bytes | None:
        """The whole body, read before the app runs: at most ``max_body_bytes`` (else ``BodyTooLarge``),
        within ``body_timeout`` seconds (else ``TimeoutError``); None when the client disconnected."""
        parts, size = [], 0
        async with asyncio.timeout(self.cfg.body_timeout):
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return None
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > self.cfg.max_body_bytes:
                    raise BodyTooLarge
                parts.append(chunk)
                if not message.get("more_body", False):
                    return b"".join(parts)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that gives the app the body already read, then the client's own messages (its
    disconnect, which a handler waits for while the answer is decoded)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def host_name(value: str) -> str:
    """The name of a ``Host`` header, lower-cased, without its port (``[::1]:8000`` -> ``[::1]``)."""
    value = value.lower()
    if value.startswith("["):
        return value.split("]", 1)[0] + "]"
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


async def _error(send: Send, status: int, message: str, kind: str = "invalid_request_error") -> None:
    """An error in OpenAI's schema, written straight to the ASGI channel."""
    body = json.dumps(
        {"error": {"message": message, "type": kind, "param": None, "code": str(status)}}
    ).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})
