"""Local services started from the project: the Prefect server, the deployment server (``semspec
serve``) and the MLflow UI. PIDs and logs live in ``<project>/.services``; every server binds to
127.0.0.1; ``up`` is idempotent and ``down`` stops only what ``up`` started (checked by PID and the
process's start time, so a reused PID is never signalled).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

from semspec.flows.env import HOST, effective_env, with_venv_path
from semspec.models.project.pairs import project_root
from semspec.tasks.environment import services_settings
from semspec.tasks.io import write_json_atomic

log = logging.getLogger(__name__)


@dataclass
class Service:
    """One background process: how to start it and how to tell that it is ready."""

    name: str
    argv: list[str]
    port: int | None  # the port it listens on (checked before start), None for a client process
    ready_url: str  # GET returns 200 once the service is usable
    url: str | None = None  # what to open in a browser
    ready_timeout: float = 180.0
    env: dict[str, str] = field(default_factory=dict)
    ready_log: str | None = None  # and its log (this run's part) shows this text


@dataclass
class ServiceState:
    """What ``status`` reports for one service."""

    name: str
    state: str  # running | stopped | dead (pidfile left by a process that is gone)
    pid: int | None
    url: str | None
    ready: bool


def state_dir(root: Path | None = None) -> Path:
    """``<project>/.services``: one ``<name>.json`` (PID, start time, command) and ``<name>.log`` each."""
    return (root or project_root()) / ".services"


def services(root: Path | None = None) -> list[Service]:
    """The project's services in start order (the deployment server needs the Prefect server)."""
    root = root or project_root()
    bin_dir = Path(sys.executable).parent
    svc = services_settings()
    pp, mp = svc.prefect_port, svc.mlflow_port
    api = f"http://{HOST}:{pp}/api"
    return [
        Service(
            "prefect",
            [str(bin_dir / "prefect"), "server", "start", "--host", HOST, "--port", str(pp)],
            pp,
            f"{api}/health",
            f"http://{HOST}:{pp}",
        ),
        Service(
            "mlflow",
            [
                str(bin_dir / "mlflow"),
                "server",
                "--host",
                HOST,
                "--port",
                str(mp),
                "--workers",
                "1",
                "--backend-store-uri",
                effective_env(root)["MLFLOW_TRACKING_URI"],
                "--default-artifact-root",
                (root / "mlartifacts").as_uri(),
            ],
            mp,
            f"http://{HOST}:{mp}/health",
            f"http://{HOST}:{mp}",
        ),
        Service(
            "serve",
            [str(bin_dir / "semspec"), "deployments", "serve"],
            None,
            f"{api}/deployments/name/semspec/retrain",  # both deployments exist once this answers
            env={"PREFECT_API_URL": api},
            ready_log="being served",
        ),
    ]


def port_in_use(port: int) -> bool:
    """Whether something accepts connections on 127.0.0.1:``port``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        return s.connect_ex((HOST, port)) == 0


def _ready(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


def _record(svc: Service, root: Path) -> dict | None:
    path = state_dir(root) / f"{svc.name}.json"
    try:
        return json.loads(path.read_text()) if path.is_file() else None
    except json.JSONDecodeError:
        return None


def _since_boot(proc: psutil.Process) -> float:
    """When ``proc`` started, in seconds after boot: unlike its start time on the wall clock, this never
    changes when the clock is adjusted (NTP), which would make a running service look dead."""
    return proc.create_time() - psutil.boot_time()


def _alive(rec: dict | None) -> psutil.Process | None:
    """The recorded process if it still runs (same PID and start time), else None."""
    if not rec:
        return None
    try:
        proc = psutil.Process(rec["pid"])
        if "since_boot" in rec:
            same = abs(_since_boot(proc) - rec["since_boot"]) < 2.0
        else:  # a record written before start times were kept relative to boot
            same = abs(proc.create_time() - rec["create_time"]) < 1.0
        if same and proc.status() != psutil.STATUS_ZOMBIE:
            return proc
    except (psutil.Error, KeyError):
        pass
    return None


def _logged(path: Path, offset: int, marker: str | None) -> bool:
    if marker is None:
        return True
    with open(path, "rb") as f:
        f.seek(offset)
        return marker in f.read().decode(errors="replace")


def _log_tail(path: Path, n: int = 25) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-n:]) if path.is_file() else ""


def start(svc: Service, root: Path | None = None, echo: Callable[[str], None] = log.info) -> None:
    """Start ``svc`` unless it already runs; wait until it is ready. A port held by another process, a
    process that exits or one that is not ready in time is a ``RuntimeError`` with its log tail."""
    root = root or project_root()
    d = state_dir(root)
    d.mkdir(parents=True, exist_ok=True)
    if _alive(_record(svc, root)):
        echo(f"{svc.name}: already running" + (f" at {svc.url}" if svc.url else ""))
        return
    if svc.port is not None and port_in_use(svc.port):
        var = "SEMSPEC_PREFECT_PORT" if svc.name == "prefect" else "SEMSPEC_MLFLOW_PORT"
        raise RuntimeError(
            f"{svc.name}: port {HOST}:{svc.port} is already in use by a process this project did not start; "
            f"stop that process or choose another port with {var}=<port>"
        )
    logfile = d / f"{svc.name}.log"
    env = with_venv_path({**os.environ, **effective_env(root), **svc.env})
    offset = logfile.stat().st_size if logfile.is_file() else 0
    with open(logfile, "ab") as out:
        proc = subprocess.Popen(
            svc.argv, cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    ps = psutil.Process(proc.pid)
    rec = {"pid": proc.pid, "create_time": ps.create_time(), "since_boot": _since_boot(ps), "argv": svc.argv}
    write_json_atomic(rec, d / f"{svc.name}.json")  # a kill never leaves a half-written PID record
    echo(f"{svc.name}: started (pid {proc.pid}, log {logfile})")
    deadline = time.monotonic() + svc.ready_timeout
    while not (_ready(svc.ready_url) and _logged(logfile, offset, svc.ready_log)):
        if proc.poll() is not None:
            (d / f"{svc.name}.json").unlink(missing_ok=True)
            raise RuntimeError(f"{svc.name} exited with code {proc.returncode}:\n{_log_tail(logfile)}")
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"{svc.name} not ready after {svc.ready_timeout:.0f}s ({svc.ready_url}):\n{_log_tail(logfile)}"
            )
        time.sleep(1.0)
    echo(f"{svc.name}: ready" + (f" at {svc.url}" if svc.url else ""))


def stop(
    svc: Service, root: Path | None = None, timeout: float = 30.0, echo: Callable[[str], None] = log.info
) -> bool:
    """Stop ``svc`` and its children if ``up`` started it (SIGTERM, then SIGKILL after ``timeout``);
    returns whether something was stopped."""
    root = root or project_root()
    path = state_dir(root) / f"{svc.name}.json"
    proc = _alive(_record(svc, root))
    if proc is None:
        path.unlink(missing_ok=True)
        return False
    procs = [proc, *proc.children(recursive=True)]
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.send_signal(signal.SIGTERM)
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    for p in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    psutil.wait_procs(alive, timeout=5)
    path.unlink(missing_ok=True)
    echo(f"{svc.name}: stopped (pid {proc.pid})" + (" after SIGKILL" if alive else ""))
    return True


def status(root: Path | None = None) -> list[ServiceState]:
    """State of every service."""
    root = root or project_root()
    out = []
    for svc in services(root):
        rec = _record(svc, root)
        proc = _alive(rec)
        state = "running" if proc else ("dead" if rec else "stopped")
        out.append(
            ServiceState(
                svc.name, state, proc.pid if proc else None, svc.url, bool(proc) and _ready(svc.ready_url)
            )
        )
    return out


def up(root: Path | None = None, echo: Callable[[str], None] = log.info) -> None:
    """Start every service that is not running, in order."""
    for svc in services(root):
        start(svc, root, echo)


def down(root: Path | None = None, echo: Callable[[str], None] = log.info) -> int:
    """Stop every service ``up`` started, in reverse order; returns how many were running."""
    return sum(stop(svc, root, echo=echo) for svc in reversed(services(root)))
