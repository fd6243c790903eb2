"""The services' side of the environment: the Prefect and MLflow ports, where MLflow keeps artifacts, and
``project_env``, the local, offline-friendly environment that the CLI and the API apply and the services
inherit (values already set win, so a user can point at a real Prefect, MLflow or Ray cluster). Kept out of
``models/project/settings.py``, the runtime's ground floor, which knows nothing of the services."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from semspec.models.project.settings import HOST, Settings, reload_settings, settings


def _port(env: Mapping[str, str], var: str, default: int) -> int:
    raw = env.get(var, str(default))
    if not raw.isdigit() or not 0 < int(raw) < 65536:
        raise ValueError(f"{var}={raw!r} is not a TCP port (1-65535)")
    return int(raw)


@dataclass(frozen=True)
class Services:
    """The services' settings, parsed: ports checked, the artifact folder resolved."""

    prefect_port: int  # SEMSPEC_PREFECT_PORT (4200)
    mlflow_port: int  # SEMSPEC_MLFLOW_PORT (5000)
    mlflow_artifacts: Path  # SEMSPEC_MLFLOW_ARTIFACTS (default <SEMSPEC_HOME>/mlartifacts)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Services:
        """Parse ``env`` (default ``os.environ``); a bad port is a ValueError naming the variable."""
        env = os.environ if env is None else env
        home = Settings.from_env(env).home
        return cls(
            prefect_port=_port(env, "SEMSPEC_PREFECT_PORT", 4200),
            mlflow_port=_port(env, "SEMSPEC_MLFLOW_PORT", 5000),
            mlflow_artifacts=Path(env.get("SEMSPEC_MLFLOW_ARTIFACTS") or home / "mlartifacts").resolve(),
        )


def services_settings() -> Services:
    """The services' settings of this process's environment, as it is now."""
    return Services.from_env()


def project_env(
    root: Path | None = None, s: Settings | None = None, svc: Services | None = None
) -> dict[str, str]:
    """Environment variables for local services, Ray and offline model loading: their state under
    ``root`` (a copy of the project), else under ``SEMSPEC_HOME`` (of ``s``), with the ports of ``svc``
    (default: this process's)."""
    s, svc = s or settings(), svc or services_settings()
    r = (root or s.home).resolve()
    return {
        "PREFECT_HOME": str(r / ".prefect"),
        "PREFECT_API_URL": f"http://{HOST}:{svc.prefect_port}/api",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        # a web page in the user's browser must not drive the API: only the UI's own origin, CSRF tokens on
        "PREFECT_SERVER_API_CORS_ALLOWED_ORIGINS": f"http://{HOST}:{svc.prefect_port}",
        "PREFECT_SERVER_API_CSRF_PROTECTION_ENABLED": "true",
        # live flow-run logs over the API's websocket: `semspec run` shows stage progress in the terminal
        "PREFECT_SERVER_LOGS_STREAM_OUT_ENABLED": "true",
        "PREFECT_SERVER_LOGS_STREAM_PUBLISHING_ENABLED": "true",
        "DO_NOT_TRACK": "true",
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "MLFLOW_TRACKING_URI": f"sqlite:///{r / 'mlruns.db'}",
        "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
        "DVC_NO_ANALYTICS": "1",
        "RAY_USAGE_STATS_ENABLED": "0",
        # Ray's own servers require this project's token (tasks/ray_utils.py writes it, owner-only)
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN_PATH": str(r / ".ray" / "auth_token"),
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "HF_HUB_OFFLINE": "1",
        "HF_HOME": str(r / ".hf"),
        "TOKENIZERS_PARALLELISM": "false",
    }


def effective_env(root: Path | None = None) -> dict[str, str]:
    """``project_env`` with any value already set in ``os.environ`` taking precedence."""
    return {k: os.environ.get(k, v) for k, v in project_env(root).items()}


def apply_env(root: Path | None = None, keys: tuple[str, ...] | None = None) -> None:
    """Set every project variable (or only ``keys``) not already set in this process, then re-read the
    settings."""
    for k, v in project_env(root).items():
        if keys is None or k in keys:
            os.environ.setdefault(k, v)
    reload_settings()
