"""The one place that defines the project's local, offline-friendly environment.

``semspec env`` prints these as ``export`` lines for shell scripts; services started by the project
get them too. Values already set in the environment win, so a user can point at a real Prefect,
MLflow or Ray cluster.
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

from models.spec import project_root

HOST = "127.0.0.1"  # every service binds to loopback only


def prefect_port() -> int:
    """Port of the local Prefect server (``SEMSPEC_PREFECT_PORT``, default 4200)."""
    return _port("SEMSPEC_PREFECT_PORT", 4200)


def mlflow_port() -> int:
    """Port of the local MLflow UI (``SEMSPEC_MLFLOW_PORT``, default 5000)."""
    return _port("SEMSPEC_MLFLOW_PORT", 5000)


def _port(var: str, default: int) -> int:
    raw = os.environ.get(var, str(default))
    if not raw.isdigit() or not 0 < int(raw) < 65536:
        raise ValueError(f"{var}={raw!r} is not a TCP port (1-65535)")
    return int(raw)


def service_urls() -> dict[str, str]:
    """Browser URLs of the Prefect and MLflow UIs."""
    return {"prefect": f"http://{HOST}:{prefect_port()}", "mlflow": f"http://{HOST}:{mlflow_port()}"}


def with_venv_path(env: dict[str, str]) -> dict[str, str]:
    """``env`` with this Python's ``bin`` folder (``semspec``, ``dvc``, ``prefect``, ``mlflow``) first on PATH."""
    return {**env, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"}


def project_env(root: Path | None = None) -> dict[str, str]:
    """Environment variables for local services and offline model loading."""
    r = (root or project_root()).resolve()
    return {
        "PREFECT_HOME": str(r / ".prefect"),
        "PREFECT_API_URL": f"http://{HOST}:{prefect_port()}/api",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "DO_NOT_TRACK": "true",
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "MLFLOW_TRACKING_URI": f"sqlite:///{r / 'mlruns.db'}",
        "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
        "DVC_NO_ANALYTICS": "1",
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_AUTH_MODE": "disabled",
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "HF_HUB_OFFLINE": "1",
        "HF_HOME": str(r / ".hf"),
        "TOKENIZERS_PARALLELISM": "false",
    }


def effective_env(root: Path | None = None) -> dict[str, str]:
    """``project_env`` with any value already set in ``os.environ`` taking precedence."""
    return {k: os.environ.get(k, v) for k, v in project_env(root).items()}


def apply_env(root: Path | None = None) -> None:
    """Set every project variable not already set in this process."""
    for k, v in project_env(root).items():
        os.environ.setdefault(k, v)


def shell_exports(root: Path | None = None) -> str:
    """``export K=V`` lines (values quoted) that keep variables the caller already set."""
    return "\n".join(f"export {k}=${{{k}:-{shlex.quote(v)}}}" for k, v in project_env(root).items())
