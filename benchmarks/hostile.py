"""Hostile checks against a running ``semspec serve`` (loopback only; every loop bounded): what an operator
would try in a deployment's first week, with the figures the server's guarantees rest on.

1. A non-streamed client with the API key that leaves after 1.5 s: how long its row stays in the batch.
2. Bodies of 1 MB and 10 MB beside a live stream: their answers, how long they took, and the longest
   pause of the stream meanwhile.
3. A prompt just under the model's window (~7,900 tokens): the answer, its time and the server's RSS growth.
4. Every listening socket of the server's process tree.

Usage (the project's venv): python benchmarks/hostile.py [--pair embedded] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import logging
import secrets
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
import contextlib

from serve_load import cpu_info, running, start_semspec_server

log = logging.getLogger("hostile")
METHOD = "target"  # the server runs without probes: the pair's target answers
Q = "Tom has 3 apples and buys 4 more. How many apples does he have?"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def leaving_client(base: str, headers: dict, max_tokens: int) -> dict[str, Any]:
    """A whole (non-streamed) request abandoned after 1.5 s: seconds until the batch is empty again."""
    body = {"messages": [{"role": "user", "content": Q}], "max_tokens": max_tokens, "method": METHOD}
    start = time.perf_counter()
    with contextlib.suppress(httpx.TimeoutException):
        httpx.post(f"{base}/v1/chat/completions", json=body, headers=headers, timeout=1.5)
    left = time.perf_counter()
    deadline = left + 120
    while time.perf_counter() < deadline:
        health = httpx.get(f"{base}/health", timeout=10).json()
        if not health["running"] and not health["queued"]:
            break
        time.sleep(0.05)
    text = httpx.get(f"{base}/metrics", headers=headers, timeout=10).text
    cancelled = [x for x in text.splitlines() if "requests_finished_total" in x and "cancelled" in x]
    return {
        "left_after_s": round(left - start, 2),
        "row_gone_s_after_leaving": round(time.perf_counter() - left, 2),
        "counted": cancelled,
    }


class Stream(threading.Thread):
    """A streamed request; records the longest pause between two events."""

    def __init__(self, base: str, headers: dict, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.base, self.headers, self.max_tokens = base, headers, max_tokens
        self.gaps: list[float] = []

    def run(self) -> None:
        body = {
            "messages": [{"role": "user", "content": Q}],
            "max_tokens": self.max_tokens,
            "stream": True,
            "method": METHOD,
        }
        last = time.perf_counter()
        with httpx.stream(
            "POST", f"{self.base}/v1/chat/completions", json=body, headers=self.headers, timeout=600
        ) as r:
            for _ in r.iter_lines():
                now = time.perf_counter()
                self.gaps.append(now - last)
                last = now


def big_body(base: str, headers: dict, megabytes: int, max_tokens: int) -> dict[str, Any]:
    """A chat request of ``megabytes`` MB beside a live stream."""
    stream = Stream(base, headers, max_tokens)
    stream.start()
    time.sleep(1.0)
    body = json.dumps(
        {
            "messages": [{"role": "user", "content": "x " * (megabytes << 19)}],
            "max_tokens": 4,
            "method": METHOD,
        }
    )
    start = time.perf_counter()
    r = httpx.post(
        f"{base}/v1/chat/completions",
        content=body,
        headers={**headers, "content-type": "application/json"},
        timeout=600,
    )
    took = time.perf_counter() - start
    stream.join(600)
    return {
        "status": r.status_code,
        "seconds": round(took, 2),
        "message": r.json().get("error", {}).get("message"),
        "stream_longest_pause_s": round(max(stream.gaps[1:] or [0.0]), 2),
    }


def long_prompt(base: str, headers: dict, proc: psutil.Process) -> dict[str, Any]:
    """A prompt of ~7,900 tokens (one word each): the answer, its time and the RSS growth."""
    rss = proc.memory_info().rss
    body = {"messages": [{"role": "user", "content": "one " * 7900 + Q}], "max_tokens": 4, "method": METHOD}
    start = time.perf_counter()
    r = httpx.post(f"{base}/v1/chat/completions", json=body, headers=headers, timeout=900)
    return {
        "status": r.status_code,
        "seconds": round(time.perf_counter() - start, 2),
        "message": r.json().get("error", {}).get("message"),
        "rss_growth_mb": round((proc.memory_info().rss - rss) / 2**20, 1),
    }


def listeners(proc: psutil.Process) -> list[str]:
    """Every listening socket of ``proc`` and its children."""
    out = []
    for p in [proc, *proc.children(recursive=True)]:
        for c in p.net_connections(kind="inet"):
            if c.status == psutil.CONN_LISTEN:
                out.append(f"{c.laddr.ip}:{c.laddr.port} ({p.name()})")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", default="embedded")
    ap.add_argument("--max-tokens", type=int, default=64)
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    key, port = secrets.token_hex(16), free_port()
    headers = {"Authorization": f"Bearer {key}"}
    args = ["--probe", "none", "--api-key", key]
    base = f"http://127.0.0.1:{port}"
    with running(start_semspec_server(a.pair, port, args)) as server:
        proc = psutil.Process(server.pid)
        report = {
            "cpu": cpu_info(),
            "pair": a.pair,
            "leaving client": leaving_client(base, headers, a.max_tokens),
            "1 MB body beside a stream": big_body(base, headers, 1, a.max_tokens),
            "10 MB body beside a stream": big_body(base, headers, 10, a.max_tokens),
            "prompt of ~7,900 tokens": long_prompt(base, headers, proc),
            "listening": listeners(proc),
        }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
