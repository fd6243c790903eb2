"""An isolated copy of the project (its DVC pipeline, params, configs and the code dvc.yaml depends on)
with its own ports, so the whole flow can run against real services without touching the checkout."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import yaml

from semspec.models.project.settings import Settings
from semspec.tasks.environment import Services, project_env

ROOT = Path(__file__).resolve().parents[2]
COPIED = ("dvc.yaml", "params.yaml", "conf", "models", "tasks")  # the stages' files and deps
BIN = Path(sys.executable).parent


def free_port() -> int:
    """A TCP port nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def copy_project(dest: Path, profile: str = "tiny", pair: str = "embedded") -> Path:
    """Copy the pipeline into ``dest`` with ``pair`` and ``profile`` as params.yaml's; a DVC repo without git.
    The copy configures ``pair`` only: a scheduled retrain there must not train every real pair of the
    repository (the reasoning pairs' 1.5B target takes minutes per stage on a CPU)."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in COPIED:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(src, dest / name)
    for other in (dest / "conf" / "pairs").glob("*.yaml"):
        if other.stem != pair:
            other.unlink()
    params = yaml.safe_load((dest / "params.yaml").read_text())
    params["profile"] = profile
    params["pair"] = pair
    (dest / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    subprocess.run([BIN / "dvc", "init", "--no-scm", "-q"], cwd=dest, check=True)
    subprocess.run([BIN / "dvc", "config", "core.analytics", "false"], cwd=dest, check=True)
    return dest


def project_environ(dest: Path, prefect_port: int, mlflow_port: int) -> dict[str, str]:
    """This process's environment pointed at the copy: its folder, its ports and its local services."""
    env = dict(os.environ)
    env.update(
        SEMSPEC_PROJECT_DIR=str(dest),
        SEMSPEC_PREFECT_PORT=str(prefect_port),
        SEMSPEC_MLFLOW_PORT=str(mlflow_port),
        PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}",
    )
    env.update(
        project_env(dest, Settings.from_env(env), Services.from_env(env))
    )  # the copy's values win over anything inherited
    return env


def kill_mid_run(script: str, arg: Path, ready: Callable[[], bool], timeout: float) -> None:
    """Run ``python -c script arg`` from the project root and SIGKILL it once ``ready()`` holds (or it
    ends, or ``timeout`` seconds pass): a stage killed mid-run, as by the OOM killer."""
    proc = subprocess.Popen(
        [sys.executable, "-c", script, str(arg)],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None and not ready():
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
