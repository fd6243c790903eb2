"""Load benchmark for OpenAI-compatible servers: throughput and latency at several client counts.

Compares, on the same prompts and the same GGUF file, one server at a time (never two at once):

* ``semspec serve --pair P`` answering with SemanticSpec (request field ``"method": "semanticspec"``)
  and with the target alone (``"method": "target"``);
* llama.cpp's ``llama-server -np 8`` on the pair's target GGUF file.

Every request is a chat completion of one question from the seeded arithmetic generator
(``tasks/data.py``), temperature 0, ``max_tokens`` tokens, no ``ignore_eos``: the tokens counted are the
ones each server actually produced (``usage.completion_tokens``). Traffic goes to loopback only.

Usage (from the project's venv):
    python benchmarks/serve_load.py --pair qwen-coder --clients 1 --clients 4 --clients 8 \\
        --requests-per-client 2 --max-tokens 128 [--llama-server PATH] [--semspec] \\
        [--methods semanticspec target] [--probes DIR] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import os
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

log = logging.getLogger("serve_load")

ROOT = Path(__file__).resolve().parent.parent
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})
CPU_FLAGS = ("avx512_bf16", "amx_bf16", "amx_int8", "amx_tile", "avx512_vnni", "avx_vnni")
LLAMA = "llama-server"


# ----------------------------------------------------------------------------------- load
def check_loopback(base_url: str) -> str:
    """``base_url`` without a trailing ``/`` or ``/v1``; a ValueError unless its host is loopback."""
    parts = urlsplit(base_url)
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"base_url {base_url!r} must be an http(s) URL")
    host = (parts.hostname or "").lower()
    if host not in LOOPBACK_HOSTS:
        raise ValueError(
            f"base_url {base_url!r}: host {host!r} is not loopback ({', '.join(sorted(LOOPBACK_HOSTS))})"
        )
    url = base_url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of ``values``, linearly interpolated; NaN when empty."""
    if not values:
        return math.nan
    s = sorted(values)
    pos = (len(s) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def request_body(
    prompt: str,
    max_tokens: int,
    extra_body: dict | None,
    chat: bool,
    model: str | None,
    system: str | None = None,
) -> dict[str, Any]:
    """One non-streamed completion request: temperature 0, ``max_tokens``, then ``extra_body``; a chat
    request has one user message, after a system message when ``system`` is given."""
    body: dict[str, Any] = {"max_tokens": max_tokens, "temperature": 0, "stream": False}
    if model:
        body["model"] = model
    if chat:
        body["messages"] = [
            *([{"role": "system", "content": system}] if system else []),
            {"role": "user", "content": prompt},
        ]
    else:
        body["prompt"] = prompt
    body.update(extra_body or {})
    return body


async def _measure(
    base: str,
    clients: int,
    requests: int,
    prompts: list[str],
    max_tokens: int,
    extra_body: dict | None,
    chat: bool,
    api_key: str | None,
    timeout: float,
    model: str | None,
    system: str | None,
) -> dict[str, Any]:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    next_index = iter(range(requests))  # shared by the workers: each request is sent exactly once
    answered: list[dict[str, Any]] = []
    refused: Counter[int] = Counter()
    errors: Counter[str] = Counter()
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)

    async def worker(client: httpx.AsyncClient) -> None:
        for i in next_index:
            body = request_body(prompts[i % len(prompts)], max_tokens, extra_body, chat, model, system)
            t0 = time.perf_counter()
            try:
                r = await client.post(path, json=body, headers=headers)
                if r.status_code != 200:
                    refused[r.status_code] += 1
                    log.debug("request %d refused: %d %s", i, r.status_code, r.text[:200])
                    continue
                data = r.json()
                tokens = int(data["usage"]["completion_tokens"])
                finish = (data.get("choices") or [{}])[0].get("finish_reason")
            except Exception as e:  # timeouts, dropped connections, bodies without usage: failed, counted
                errors[f"{type(e).__name__}: {str(e)[:120]}"] += 1
                log.debug("request %d failed: %r", i, e)
                continue
            answered.append(
                {"latency_s": time.perf_counter() - t0, "tokens": tokens, "finish_reason": str(finish)}
            )

    # trust_env=False: no proxy from the environment ever sits between the client and loopback
    async with httpx.AsyncClient(base_url=base, timeout=timeout, limits=limits, trust_env=False) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(clients)))
        wall = time.perf_counter() - t0

    latencies = [a["latency_s"] for a in answered]
    tokens = sum(a["tokens"] for a in answered)
    n_refused, n_failed = sum(refused.values()), sum(errors.values())
    if len(answered) + n_refused + n_failed != requests:  # every request ends in exactly one bucket
        raise RuntimeError(f"lost requests: {len(answered)} + {n_refused} + {n_failed} != {requests}")
    return {
        "clients": clients,
        "requests": requests,
        "answered": len(answered),
        "refused": n_refused,
        "refused_by_status": dict(sorted(refused.items())),
        "failed": n_failed,
        "errors": dict(errors),
        "completion_tokens": tokens,
        "finish_reasons": dict(Counter(a["finish_reason"] for a in answered)),
        "wall_s": wall,
        "tok_per_s": tokens / wall if wall > 0 else math.nan,
        "latency_mean_s": sum(latencies) / len(latencies) if latencies else math.nan,
        "latency_p50_s": percentile(latencies, 50),
        "latency_p95_s": percentile(latencies, 95),
    }


def measure(
    base_url: str,
    clients: int,
    requests: int,
    prompts: list[str],
    max_tokens: int,
    extra_body: dict | None = None,
    chat: bool = True,
    api_key: str | None = None,
    timeout: float = 900.0,
    model: str | None = None,
    system: str | None = None,
) -> dict[str, Any]:
    """Send ``requests`` completion requests in total from ``clients`` concurrent workers to the
    OpenAI-compatible server at ``base_url`` (loopback only, else ValueError), request ``i`` asking
    ``prompts[i % len(prompts)]`` (chat: as the one user message, after ``system`` when given).

    Returns the counts (``answered`` + ``refused`` + ``failed`` == ``requests``; ``refused_by_status``:
    non-200 answers by status; ``errors``: exceptions by type and message), the completion tokens of the
    answered requests (``usage.completion_tokens``), the wall seconds of the whole load, the throughput
    (tokens / wall) and the answered requests' mean, p50 and p95 latency."""
    base = check_loopback(base_url)
    if clients < 1 or requests < 0:
        raise ValueError(f"need clients >= 1 and requests >= 0, got {clients} and {requests}")
    if not prompts:
        raise ValueError("no prompts")
    return asyncio.run(
        _measure(
            base, clients, requests, prompts, max_tokens, extra_body, chat, api_key, timeout, model, system
        )
    )


def arith_prompts(n: int, seed: int = 0) -> list[str]:
    """``n`` questions from the seeded arithmetic generator (test split), the same on every server."""
    from semspec.tasks.data import generate_arith

    return [p.question for p in generate_arith(n, split="test", seed=seed)]


# ----------------------------------------------------------------------------------- servers
def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _log_tail(path: Path, n: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def wait_healthy(proc: subprocess.Popen, base_url: str, timeout: float, log_path: Path | None = None) -> None:
    """Wait until ``GET /health`` answers 200 (RuntimeError if the process exits or ``timeout`` passes)."""
    base = check_loopback(base_url)
    deadline = time.monotonic() + timeout
    with httpx.Client(base_url=base, timeout=5.0, trust_env=False) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                tail = _log_tail(log_path) if log_path else ""
                raise RuntimeError(f"server exited with {proc.returncode} before it was healthy\n{tail}")
            with contextlib.suppress(httpx.HTTPError):
                if client.get("/health").status_code == 200:
                    return
            time.sleep(0.5)
    raise RuntimeError(f"server at {base} not healthy after {timeout:.0f} s")


def stop_server(proc: subprocess.Popen, timeout: float = 30.0) -> None:
    """Terminate ``proc``, wait ``timeout`` seconds, then kill it."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        log.warning("server %d still running %.0f s after SIGTERM: killing it", proc.pid, timeout)
        proc.kill()
        proc.wait(timeout=timeout)


def _spawn(cmd: list[str], log_path: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    log.info("starting: %s (log %s)", " ".join(cmd), log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)


def llama_server_binary(path: str | Path) -> Path:
    """The ``llama-server`` executable: ``path`` itself or ``path/llama-server``."""
    p = Path(path)
    exe = p / LLAMA if p.is_dir() else p
    if not exe.is_file():
        raise FileNotFoundError(f"no llama-server at {exe}")
    return exe


def start_llama_server(
    bin: str | Path,
    gguf: str | Path,
    port: int,
    parallel: int = 8,
    threads: int = 2,
    ctx: int | None = None,
    log_path: Path | None = None,
    health_timeout: float = 300.0,
) -> subprocess.Popen:
    """Start ``llama-server`` on ``gguf`` bound to 127.0.0.1:``port`` with ``parallel`` slots and
    ``threads`` threads (``ctx``: total context, default 1024 per slot), and wait until it is healthy.
    The caller stops it with :func:`stop_server` in a ``finally``."""
    ctx = ctx or 1024 * parallel
    cmd = [
        str(llama_server_binary(bin)),
        "--model", str(gguf),
        "--host", "127.0.0.1",
        "--port", str(port),
        "--parallel", str(parallel),
        "--threads", str(threads),
        "--threads-batch", str(threads),
        "--ctx-size", str(ctx),
    ]  # fmt: skip
    log_path = log_path or Path(f"/tmp/serve_load-llama-server-{port}.log")
    return _start_healthy(cmd, port, log_path, health_timeout)


def start_semspec_server(
    pair: str,
    port: int,
    extra_args: Sequence[str] = (),
    exe: str | Path | None = None,
    threads: int | None = None,
    log_path: Path | None = None,
    health_timeout: float = 600.0,
) -> subprocess.Popen:
    """Start ``semspec serve --pair PAIR --port PORT [extra_args]`` (the venv's ``semspec``, or ``exe``)
    and wait until ``/health`` answers (loading the models takes a minute). ``threads`` caps the
    process's OpenMP/MKL threads. The caller stops it with :func:`stop_server` in a ``finally``."""
    exe = Path(exe) if exe else Path(sys.executable).parent / "semspec"
    if not exe.is_file():
        exe = ROOT / ".venv" / "bin" / "semspec"
    cmd = [str(exe), "serve", "--pair", pair, "--port", str(port), *extra_args]
    env = dict(os.environ)
    if threads:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    log_path = log_path or Path(f"/tmp/serve_load-semspec-{port}.log")
    return _start_healthy(cmd, port, log_path, health_timeout, env)


def _start_healthy(
    cmd: list[str], port: int, log_path: Path, health_timeout: float, env: dict[str, str] | None = None
) -> subprocess.Popen:
    """Spawn ``cmd`` and wait until its ``/health`` on loopback ``port`` answers; stop it if that fails."""
    proc = _spawn(cmd, log_path, env)
    try:
        wait_healthy(proc, f"http://127.0.0.1:{port}", health_timeout, log_path)
    except BaseException:
        stop_server(proc)
        raise
    return proc


@contextlib.contextmanager
def running(proc: subprocess.Popen) -> Iterator[subprocess.Popen]:
    """Yield ``proc`` and stop it on the way out, whatever happened."""
    try:
        yield proc
    finally:
        stop_server(proc)


# ----------------------------------------------------------------------------------- report
def cpu_info(llama_bin: Path | None = None) -> dict[str, Any]:
    """torch's CPU capability, the relevant /proc/cpuinfo flags, core count and the llama.cpp build."""
    info: dict[str, Any] = {"cores": os.cpu_count()}
    try:
        import torch

        info["torch_cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    except Exception as e:  # torch missing or too old: say so in the table
        info["torch_cpu_capability"] = f"unknown ({type(e).__name__})"
    flags: set[str] = set()
    model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
            elif line.startswith("model name") and not model:
                model = line.split(":", 1)[1].strip()
    info["cpu"] = model
    info["flags"] = {f: f in flags for f in CPU_FLAGS}
    if llama_bin:
        try:
            out = subprocess.run(
                [str(llama_bin), "--version"], capture_output=True, text=True, timeout=30, check=False
            )
            info["llama_cpp"] = " | ".join(
                ln.strip() for ln in (out.stdout + out.stderr).splitlines() if ln.strip()
            )
        except (OSError, subprocess.TimeoutExpired) as e:
            info["llama_cpp"] = f"unknown ({e})"
    return info


def _ratio(a: float, b: float | None) -> str:
    return f"{a / b:.2f}x" if b and b > 0 and not math.isnan(a) else "-"


def format_table(rows: list[dict[str, Any]], info: dict[str, Any]) -> str:
    """One line per (server/method, clients) with its ratio to the target row and the llama-server row
    at the same concurrency, then the CPU and build information."""
    ref_target = {r["clients"]: r["tok_per_s"] for r in rows if r["server"] == "semspec/target"}
    ref_llama = {r["clients"]: r["tok_per_s"] for r in rows if r["server"] == LLAMA}
    head = (
        f"{'server/method':<22} {'clients':>7} {'requests':>8} {'answered':>8} {'refused':>7} {'failed':>6} "
        f"{'tokens':>7} {'tok/s':>7} {'mean s':>7} {'p50 s':>7} {'p95 s':>7} {'vs target':>9} {'vs llama':>8}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['server']:<22} {r['clients']:>7} {r['requests']:>8} {r['answered']:>8} {r['refused']:>7} "
            f"{r['failed']:>6} {r['completion_tokens']:>7} {r['tok_per_s']:>7.2f} {r['latency_mean_s']:>7.2f} "
            f"{r['latency_p50_s']:>7.2f} {r['latency_p95_s']:>7.2f} "
            f"{_ratio(r['tok_per_s'], ref_target.get(r['clients'])):>9} "
            f"{_ratio(r['tok_per_s'], ref_llama.get(r['clients'])):>8}"
        )
    flags = " ".join(f"{k}={'yes' if v else 'no'}" for k, v in info.get("flags", {}).items())
    lines += [
        "",
        f"cpu: {info.get('cpu', '?')} ({info.get('cores')} cores); torch capability: "
        f"{info.get('torch_cpu_capability')}",
        f"flags: {flags}",
    ]
    if "llama_cpp" in info:
        lines.append(f"llama.cpp: {info['llama_cpp']}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------- CLI
def target_gguf(pair: str) -> Path:
    """The local GGUF file of the pair's target (joined from its parts and checked on first use)."""
    from semspec.models.lm.weights import resolve_model
    from semspec.models.project.pairs import load_pair

    model_cfg = load_pair(pair).target
    if not model_cfg.gguf_file:
        raise ValueError(f"pair {pair!r}: the target has no GGUF file")
    return Path(resolve_model(model_cfg)) / model_cfg.gguf_file


def run_levels(
    label: str,
    base_url: str,
    args: argparse.Namespace,
    prompts: list[str],
    extra_body: dict | None,
    model: str | None,
    system: str | None,
) -> list[dict[str, Any]]:
    """A warm-up request (not counted), then one bounded load per client count."""
    kw = dict(
        prompts=prompts,
        max_tokens=args.max_tokens,
        extra_body=extra_body,
        chat=True,
        api_key=args.api_key,
        timeout=args.timeout,
        model=model,
        system=system,
    )
    warm = measure(base_url, clients=1, requests=1, **kw)
    log.info("%s warm-up: %d answered, refused %s, errors %s", label, warm["answered"],
             warm["refused_by_status"], warm["errors"])  # fmt: skip
    rows = []
    for clients in args.clients:
        n = max(clients * args.requests_per_client, args.min_requests)
        r = {"server": label, **measure(base_url, clients=clients, requests=n, **kw)}
        log.info(
            "%s clients=%d: %d/%d answered, %d tokens in %.1f s = %.2f tok/s, refused %s, errors %s, finish %s",
            label, clients, r["answered"], n, r["completion_tokens"], r["wall_s"], r["tok_per_s"],
            r["refused_by_status"], r["errors"], r["finish_reasons"],
        )  # fmt: skip
        rows.append(r)
    return rows


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", default="qwen-coder", help="pair whose target GGUF file llama-server serves")
    ap.add_argument("--clients", type=int, action="append", help="concurrent clients (repeat; default 1 4 8)")
    ap.add_argument("--requests-per-client", type=int, default=2)
    ap.add_argument("--min-requests", type=int, default=1, help="at least this many requests per level")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=16, help="distinct arithmetic questions, cycled")
    ap.add_argument("--seed", type=int, default=0, help="arithmetic generator seed")
    ap.add_argument(
        "--system-prompt",
        choices=("none", "pair"),
        default="none",
        help="chat messages: the question alone (default), or after the pair's system prompt",
    )
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per request")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llama-server", default=None, help="llama-server executable or its bin folder")
    ap.add_argument("--parallel", type=int, default=8, help="llama-server slots (-np)")
    ap.add_argument("--ctx", type=int, default=None, help="llama-server total context (default 1024/slot)")
    ap.add_argument("--gguf", default=None, help="GGUF file for llama-server (default: the pair's target)")
    ap.add_argument("--semspec", action="store_true", help="also measure `semspec serve`")
    ap.add_argument("--methods", nargs="+", default=["semanticspec", "target"])
    ap.add_argument("--probes", default=None, help="passed to `semspec serve --probes`")
    ap.add_argument(
        "--semspec-arg",
        action="append",
        default=[],
        help="extra `semspec serve` argument (repeat; --semspec-arg=--flag for dashes)",
    )
    ap.add_argument("--semspec-exe", default=None, help="the semspec executable (default: the venv's)")
    ap.add_argument("--json", default=None, help="also write the rows and CPU information here")
    args = ap.parse_args(argv)
    args.clients = args.clients or [1, 4, 8]
    if not args.semspec and not args.llama_server:
        ap.error("nothing to measure: give --llama-server PATH and/or --semspec")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    args = parse_args(argv)
    prompts = arith_prompts(args.prompts, args.seed)
    system = None
    if args.system_prompt == "pair":
        from semspec.models.project.pairs import load_pair

        system = load_pair(args.pair).target.system_prompt
    rows: list[dict[str, Any]] = []
    llama_bin = llama_server_binary(args.llama_server) if args.llama_server else None

    if args.semspec:  # one server process; the method is a request field
        port = free_port()
        extra = [*(["--probes", args.probes] if args.probes else []), *args.semspec_arg]
        proc = start_semspec_server(args.pair, port, extra, args.semspec_exe, args.threads)
        with running(proc):
            for method in args.methods:
                rows += run_levels(
                    f"semspec/{method}",
                    f"http://127.0.0.1:{port}",
                    args,
                    prompts,
                    {"method": method},
                    args.pair,
                    system,
                )
    if llama_bin:
        gguf = Path(args.gguf) if args.gguf else target_gguf(args.pair)
        port = free_port()
        proc = start_llama_server(llama_bin, gguf, port, args.parallel, args.threads, args.ctx)
        with running(proc):
            rows += run_levels(LLAMA, f"http://127.0.0.1:{port}", args, prompts, None, gguf.name, system)

    info = cpu_info(llama_bin)
    print(format_table(rows, info))
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "cpu": info, "argv": sys.argv}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
