"""benchmarks/serve_load.py: a bounded load against a stub OpenAI-compatible server on loopback counts every
request once (answered, refused by status, or failed), and its throughput is tokens / wall."""

from __future__ import annotations

import json
import math
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest

from benchmarks.serve_load import check_loopback, format_table, measure, percentile

TOKENS = 7  # every answer's usage.completion_tokens
DELAY_S = 0.02


class _Stub(BaseHTTPRequestHandler):
    """Chat completions: request numbers divisible by 4 get 429; prompt 'overload' gets 503; prompt
    'garbage' gets a 200 whose body is not JSON; everything else a fixed answer."""

    counter: ClassVar[int] = 0
    lock: ClassVar[threading.Lock] = threading.Lock()
    bodies: ClassVar[list[dict]] = []

    def log_message(self, *args) -> None:  # quiet
        pass

    def _send(self, status: int, payload: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def do_GET(self) -> None:
        self._send(200 if self.path == "/health" else 404, b'{"status": "ok"}')

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with _Stub.lock:
            _Stub.counter += 1
            n = _Stub.counter
            _Stub.bodies.append(body)
        time.sleep(DELAY_S)
        prompt = body["messages"][0]["content"] if "messages" in body else body["prompt"]
        if self.path not in ("/v1/chat/completions", "/v1/completions"):
            return self._send(404, b"{}")
        if n % 4 == 0:
            return self._send(429, b'{"error": "busy"}')
        if prompt == "overload":
            return self._send(503, b'{"error": "overloaded"}')
        if prompt == "garbage":
            return self._send(200, b"not json")
        answer = {
            "choices": [
                {"index": 0, "message": {"role": "assistant", "content": "x"}, "finish_reason": "length"}
            ],
            "usage": {"prompt_tokens": 3, "completion_tokens": TOKENS, "total_tokens": 3 + TOKENS},
        }
        self._send(200, json.dumps(answer).encode())


@pytest.fixture
def stub_url():
    _Stub.counter = 0
    _Stub.bodies = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Stub)  # port 0: a free port
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def test_counts_add_up_and_throughput_is_tokens_over_wall(stub_url):
    r = measure(
        stub_url, clients=4, requests=20, prompts=["q1", "q2"], max_tokens=16, extra_body={"method": "target"}
    )
    assert r["refused_by_status"] == {429: 5}, "requests 4, 8, ..., 20 of 20 are refused with 429"
    assert (r["answered"], r["refused"], r["failed"]) == (15, 5, 0)
    assert r["answered"] + r["refused"] + r["failed"] == 20
    assert r["completion_tokens"] == 15 * TOKENS
    assert r["tok_per_s"] == pytest.approx(r["completion_tokens"] / r["wall_s"])
    assert r["wall_s"] >= 20 / 4 * DELAY_S * 0.9, "4 workers, 20 requests of >= 20 ms each"
    assert r["latency_p50_s"] >= DELAY_S and r["latency_p95_s"] >= r["latency_p50_s"]
    assert r["finish_reasons"] == {"length": 15}
    # every request went out as asked: chat, temperature 0, the extra field, the prompts cycled
    assert len(_Stub.bodies) == 20
    assert all(
        b["temperature"] == 0 and b["max_tokens"] == 16 and b["method"] == "target" for b in _Stub.bodies
    )
    assert sorted(b["messages"][0]["content"] for b in _Stub.bodies) == ["q1"] * 10 + ["q2"] * 10


def test_refusals_by_status_and_failures_are_counted(stub_url):
    # prompts cycle overload, garbage, ok, ok: requests 1..8 (one client, in order) ->
    # 1 503, 2 failed (not JSON), 3 ok, 4 429, 5 503, 6 failed, 7 ok, 8 429
    prompts = ["overload", "garbage", "ok", "ok"]
    r = measure(
        stub_url + "/v1/", clients=1, requests=8, prompts=prompts, max_tokens=4, chat=False, api_key="k"
    )
    assert r["refused_by_status"] == {429: 2, 503: 2}
    assert (r["answered"], r["refused"], r["failed"]) == (2, 4, 2)
    assert sum(r["errors"].values()) == 2 and all("JSONDecodeError" in e for e in r["errors"])
    assert r["completion_tokens"] == 2 * TOKENS
    assert all("prompt" in b and "messages" not in b for b in _Stub.bodies), "chat=False: /v1/completions"


def test_nothing_answered_gives_zero_throughput(stub_url):
    r = measure(stub_url, clients=2, requests=3, prompts=["overload"], max_tokens=4)
    assert (r["answered"], r["refused"], r["failed"]) == (0, 3, 0)
    assert r["tok_per_s"] == 0 and math.isnan(r["latency_mean_s"])
    assert "semspec/target" in format_table([{**r, "server": "semspec/target"}], {"flags": {}})


def test_connection_errors_are_failures():
    # a port nobody listens on: every request fails, none is lost
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = measure(f"http://127.0.0.1:{port}", clients=2, requests=3, prompts=["q"], max_tokens=4, timeout=5)
    assert (r["answered"], r["refused"], r["failed"]) == (0, 0, 3)


@pytest.mark.parametrize(
    "url",
    [
        "http://example.com:8000",
        "http://10.0.0.1:8000",
        "http://0.0.0.0:8000",
        "ftp://127.0.0.1/",
        "nonsense",
    ],
)
def test_non_loopback_base_url_is_refused(url):
    with pytest.raises(ValueError):
        measure(url, clients=1, requests=1, prompts=["q"], max_tokens=4)


def test_loopback_urls_are_accepted():
    assert check_loopback("http://127.0.0.1:8000/v1/") == "http://127.0.0.1:8000"
    assert check_loopback("http://localhost:1") == "http://localhost:1"
    assert check_loopback("http://[::1]:8080") == "http://[::1]:8080"


def test_percentile():
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([0.0, 10.0], 95) == pytest.approx(9.5)
    assert math.isnan(percentile([], 50))
