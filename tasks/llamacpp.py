"""llama.cpp as a baseline in ``semspec bench --llamacpp``: its server on the pair's own GGUF files.

Two ``llama-server`` processes run beside the bench, bound to 127.0.0.1 on free ports: the target alone,
and the target with the pair's draft (llama.cpp's speculative decoding). Each question goes to them as the
same chat-formatted prompt semspec's target decodes (the target's chat template, rendered by semspec), with
the same token budget, greedy (temperature 0) and no prompt cache, and is timed by the bench's clock from
request to response. Each server's peak resident memory is read from ``/proc`` when it stops. Why a
server and not llama-cpp-python: the Python binding has no draft-model speculative decoding, which is the
baseline a CPU user compares against.
"""

from __future__ import annotations

import ctypes
import logging
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any

import httpx

from semspec.models.lm import LM
from semspec.models.lm.pair import ModelConfig
from semspec.models.spec.grading import extract_answer
from semspec.models.spec.results import DecodeResult, Timings
from semspec.models.spec.settings import DecodeSettings

log = logging.getLogger(__name__)

SERVER = "llama-server"
START_TIMEOUT_S = 180.0
REQUEST_TIMEOUT_S = 1800.0  # one completion; far above any bench budget on a CPU


def find_server(where: str | None) -> str:
    """The ``llama-server`` binary: ``where`` (the binary or its folder), else the one on the PATH.
    Raises ``ValueError`` saying how to get one."""
    if where:
        path = Path(where)
        path = path / SERVER if path.is_dir() else path
        if not path.is_file():
            raise ValueError(f"--llamacpp: no {SERVER} at {path}; pass the binary or the folder holding it")
        return str(path)
    found = shutil.which(SERVER)
    if found is None:
        raise ValueError(
            f"--llamacpp needs llama.cpp's {SERVER}: build llama.cpp (its `llama-server` target) and put "
            f"it on the PATH, or pass --llamacpp-bin PATH"
        )
    return found


PR_SET_PDEATHSIG = 1  # prctl option (linux/prctl.h)
PORT_ATTEMPTS = 3  # starts on a new port after the port was taken meanwhile


class PortTaken(RuntimeError):
    """The port chosen for llama-server was bound by another process before the server bound it."""


def _listens(pid: int, port: int) -> bool:
    """Whether process ``pid`` (or a child of it) listens on loopback ``port``."""
    import psutil

    try:
        proc = psutil.Process(pid)
        procs = [proc, *proc.children(recursive=True)]
        return any(
            c.status == psutil.CONN_LISTEN and c.laddr.port == port
            for p in procs
            for c in p.net_connections(kind="inet")
        )
    except psutil.Error:
        return False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LlamaServer:
    """One ``llama-server`` on ``model`` (with ``draft``: speculative decoding), started on entry and
    stopped on exit; ``complete`` sends it one prompt."""

    def __init__(
        self,
        binary: str,
        model: Path,
        draft: Path | None = None,
        threads: int = 2,
        ctx: int = 4096,
        parallel: int = 1,
    ):
        if parallel < 1:
            raise ValueError(f"parallel must be >= 1, got {parallel}")
        self.binary, self.model, self.draft, self.parallel = binary, model, draft, parallel
        self.port = 0  # chosen at each start (a port free then may be taken before the server binds it)
        self.args = [binary, "-m", str(model), "--host", "127.0.0.1"]
        # ``parallel`` slots decode as one batch (llama.cpp's continuous batching), each with ``ctx`` positions
        self.args += ["-t", str(threads), "-c", str(ctx * parallel), "-np", str(parallel)]
        if draft is not None:
            self.args += ["-md", str(draft)]
            if "--spec-type" in _run(binary, "--help"):  # newer builds name the draft model's kind
                self.args += ["--spec-type", "draft-simple"]
        self.proc: subprocess.Popen | None = None
        self.peak_rss_gb: float | None = None
        self._log: IO[bytes] | None = None  # the server's output, in a file: a pipe nobody reads fills up

    @property
    def url(self) -> str:
        """The server's base URL (loopback only)."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def cmd(self) -> list[str]:
        """The server's command line, on the port of this start."""
        return [*self.args, "--port", str(self.port)]

    def __enter__(self) -> LlamaServer:
        for attempt in range(PORT_ATTEMPTS):
            self.port = _free_port()
            self._log = tempfile.TemporaryFile()
            self.proc = subprocess.Popen(
                self.cmd, stdout=self._log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent
            )
            try:
                self._wait_healthy()
                return self
            except PortTaken:  # another process bound the port first: a new port, a new start
                self.__exit__(None, None, None)
                log.info("%s: port taken before it bound it (attempt %d); another port", SERVER, attempt + 1)
            except BaseException:  # a failed start, a timeout, Ctrl-C: never leave the server running
                self.__exit__(None, None, None)
                raise
        raise RuntimeError(f"{SERVER} found no free port in {PORT_ATTEMPTS} attempts")

    def _wait_healthy(self) -> None:
        """Until our process answers ``/health`` on its port (an answer from another process that holds
        the port is not ours: ``PortTaken``, as is our server exiting because the port was taken)."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self._tail()
                if "bind" in tail.lower() or "address already in use" in tail.lower():
                    raise PortTaken(tail)
                raise RuntimeError(f"{SERVER} exited ({self.proc.returncode}) while starting: {tail}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    if not _listens(self.proc.pid, self.port):
                        raise PortTaken(f"port {self.port} answers, but not from {SERVER} {self.proc.pid}")
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(
            f"{SERVER} did not answer /health within {START_TIMEOUT_S:.0f} s: {' '.join(self.cmd)}"
        )

    def _tail(self) -> str:
        """The end of the server's output."""
        if self._log is None:
            return ""
        self._log.seek(0)
        return self._log.read().decode(errors="replace")[-1500:].strip()

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            self.peak_rss_gb = _peak_rss_gb(self.proc.pid)
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None
        if self._log is not None:
            self._log.close()
            self._log = None

    def complete(self, prompt: str, n_predict: int) -> dict[str, Any]:
        """llama.cpp's ``/completion`` of ``prompt``: greedy, ``n_predict`` tokens at most, no prompt cache."""
        body = {
            "prompt": prompt,
            "n_predict": n_predict,
            "temperature": 0.0,
            "cache_prompt": False,
            "seed": 0,
        }
        resp = httpx.post(f"{self.url}/completion", json=body, timeout=REQUEST_TIMEOUT_S)
        resp.raise_for_status()
        return resp.json()

    def version(self) -> str:
        """``llama-server --version``'s first line (its build), or ``unknown``."""
        lines = [ln for ln in _run(self.binary, "--version").splitlines() if ln.startswith("version")]
        return lines[0].removeprefix("version: ") if lines else "unknown"


def _prctl() -> Any:
    """libc's ``prctl``, looked up in this process (never in a forked child, where a lock another thread
    held at the fork could hang the lookup); None where there is none (not Linux)."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _prctl()


def _die_with_parent() -> None:
    """In the server's process before it runs llama-server: it gets SIGTERM when the process that started
    it dies, so a killed bench or evaluation actor (``ray.kill``) never leaves a server behind (Linux)."""
    if _PRCTL is not None:
        _PRCTL(PR_SET_PDEATHSIG, signal.SIGTERM)


def _run(binary: str, flag: str) -> str:
    """``binary flag``'s output (``--help``, ``--version``); empty where it fails or hangs."""
    try:
        done = subprocess.run([binary, flag], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout + done.stderr


def _peak_rss_gb(pid: int) -> float | None:
    """The process's peak resident set (``VmHWM``) in GB, or None where ``/proc`` has none."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return None


class LlamaCppDecoder:
    """A bench or evaluation method: each question through a ``LlamaServer`` as the target would see it;
    ``decode_batch`` sends a batch's questions at once, to the server's parallel slots."""

    def __init__(self, method: str, server: LlamaServer, target: LM, settings: DecodeSettings) -> None:
        self.method, self.server, self.target, self.settings = method, server, target, settings

    @property
    def run_identity(self) -> dict[str, Any]:
        """What decides this method's rows beyond the evaluation settings: llama.cpp's build, the GGUF file
        and the slots that decode together."""
        return {
            "llamacpp": self.server.version(),
            "gguf": self.server.model.name,
            "slots": self.server.parallel,
        }

    def decode_batch(
        self,
        questions: Sequence[str],
        batch_size: int = 1,
        on_result: Callable[[int, DecodeResult], None] | None = None,
    ) -> list[DecodeResult]:
        """Answer ``questions``, ``batch_size`` at a time sent together (at most the server's slots): each
        answer's latency is its own request's, and its machine time (``share``) the batch's wall time over
        its size, as a semspec batch shares its calls."""
        size = min(batch_size, self.server.parallel)
        out: list[DecodeResult] = []
        with ThreadPoolExecutor(size) as pool:
            for at in range(0, len(questions), size):
                t0 = time.perf_counter()
                batch = list(pool.map(self.decode, questions[at : at + size]))
                wall = time.perf_counter() - t0
                for i, res in enumerate(batch, start=at):
                    res.timings.share = wall / len(batch)
                    if on_result is not None:
                        on_result(i, res)
                out += batch
        return out

    def decode(self, question: str) -> DecodeResult:
        """One greedy completion of ``question``'s prompt, timed from request to response."""
        prompt = self.target.format_prompt(question)
        t0 = time.perf_counter()
        out = self.server.complete(prompt, self.settings.max_new_tokens)
        wall = time.perf_counter() - t0
        text = str(out.get("content", ""))
        res = DecodeResult(self.method, text, extract_answer(text, self.settings.benchmark))
        res.timings = Timings(target=wall, total=wall, share=wall)
        res.output_tokens = int(out.get("tokens_predicted", 0))
        res.finish_reason = "eos" if out.get("stop_type") in ("eos", "word") else "length"
        timings = out.get("timings") or {}
        if "draft_n" in timings:
            res.extra["token_acceptance_rate"] = timings.get("draft_n_accepted", 0) / max(
                1, timings["draft_n"]
            )
        return res


def gguf_path(model_cfg: ModelConfig) -> Path:
    """The GGUF file a model config loads (joined and checked as semspec loads it; a Hub model's from the
    local Hub cache); ``ValueError`` for a model that is not one, or not on disk yet, which llama.cpp
    cannot run."""
    from semspec.models.lm.loading import gguf_path as on_disk
    from semspec.models.lm.weights import resolve_model

    if not model_cfg.gguf_file:
        raise ValueError(
            f"--llamacpp needs GGUF models; {model_cfg.model_id} has no gguf_file in the pair file"
        )
    path = on_disk(resolve_model(model_cfg), model_cfg.gguf_file)
    if path is None:
        raise ValueError(
            f"--llamacpp: {model_cfg.model_id}'s {model_cfg.gguf_file} is not on disk yet; load the pair once "
            f"(e.g. `semspec decode`) so the Hub cache holds it"
        )
    return path
