"""Every setting the project reads from the environment, in one object read once per process.

``settings()`` parses the variables the first time it is called; ``reload_settings()`` reads them again
(after a process changed its environment, e.g. ``apply_env`` or a test). ``project_env`` is the local,
offline-friendly environment that the CLI applies and the services inherit; values already set win, so
a user can point at a real Prefect, MLflow or Ray cluster.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

HOST = "127.0.0.1"  # every service binds to loopback only
_REPO = Path(__file__).resolve().parents[2]
_TRUE = ("1", "true", "yes", "on")


def _port(env: Mapping[str, str], var: str, default: int) -> int:
    raw = env.get(var, str(default))
    if not raw.isdigit() or not 0 < int(raw) < 65536:
        raise ValueError(f"{var}={raw!r} is not a TCP port (1-65535)")
    return int(raw)


def _choice(env: Mapping[str, str], var: str, allowed: tuple[str, ...]) -> str:
    raw = env.get(var, allowed[0]).strip().lower()
    if raw not in allowed:
        raise ValueError(f"{var}={raw!r} must be one of {allowed}")
    return raw


@dataclass(frozen=True)
class Settings:
    """The environment, parsed: paths resolved, ports checked."""

    project_dir: Path  # SEMSPEC_PROJECT_DIR: conf/, params.yaml, dvc.yaml (default: this repository)
    # SEMSPEC_HOME: the state a user's runs keep (the MLflow registry mlruns.db, mlartifacts/, .prefect/,
    # .hf/); default the project folder, so a checkout keeps its own
    home: Path
    cache_dir: Path  # SEMSPEC_CACHE_DIR: joined model parts, hash stamps (default ~/.cache/semspec)
    data_dir: Path | None  # SEMSPEC_DATA_DIR: local benchmark copies (None: the Hub)
    mlflow_artifacts: Path  # SEMSPEC_MLFLOW_ARTIFACTS (default <project>/mlartifacts)
    prefect_port: int  # SEMSPEC_PREFECT_PORT (4200)
    mlflow_port: int  # SEMSPEC_MLFLOW_PORT (5000)
    ray_address: str | None  # RAY_ADDRESS: a Ray cluster (None: in-process)
    hub_offline: bool  # HF_HUB_OFFLINE
    gguf_cache: bool  # SEMSPEC_GGUF_CACHE (on): keep GGUF models converted in the cache, to load in seconds
    cxx: str | None  # CXX: the C++ compiler that builds the CPU kernels (default: g++ or c++ on the PATH)
    kernels: str  # SEMSPEC_KERNELS: auto (default), avx512, avx2 (those builds), off (PyTorch's ops, SDPA)
    decode_attention: str  # SEMSPEC_DECODE_ATTENTION: auto (default; semspec's kernel), 0 (SDPA)
    decode_layer: str  # SEMSPEC_DECODE_LAYER: auto (default; semspec's layer kernel), 0 (the modules)
    onednn_pack: str  # SEMSPEC_ONEDNN_PACK: auto (default; dense copies in oneDNN's layout), 0 (plain)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        """Parse ``env`` (default ``os.environ``); a bad port is a ValueError naming the variable."""
        env = os.environ if env is None else env
        project = Path(env["SEMSPEC_PROJECT_DIR"]).resolve() if env.get("SEMSPEC_PROJECT_DIR") else _REPO
        # a checkout keeps its own state; an installed package (no dvc.yaml beside its conf/) keeps it in
        # the user's home, never in site-packages
        default_home = project if (project / "dvc.yaml").is_file() else Path.home() / ".semspec"
        home = Path(env["SEMSPEC_HOME"]).expanduser().resolve() if env.get("SEMSPEC_HOME") else default_home
        return cls(
            project_dir=project,
            home=home,
            cache_dir=Path(env.get("SEMSPEC_CACHE_DIR") or Path.home() / ".cache" / "semspec"),
            data_dir=Path(env["SEMSPEC_DATA_DIR"]) if env.get("SEMSPEC_DATA_DIR") else None,
            mlflow_artifacts=Path(env.get("SEMSPEC_MLFLOW_ARTIFACTS") or home / "mlartifacts").resolve(),
            prefect_port=_port(env, "SEMSPEC_PREFECT_PORT", 4200),
            mlflow_port=_port(env, "SEMSPEC_MLFLOW_PORT", 5000),
            ray_address=env.get("RAY_ADDRESS") or None,
            hub_offline=env.get("HF_HUB_OFFLINE", "").lower() in _TRUE,
            gguf_cache=env.get("SEMSPEC_GGUF_CACHE", "1").lower() in _TRUE,
            cxx=env.get("CXX") or None,
            kernels=_choice(env, "SEMSPEC_KERNELS", ("auto", "avx512", "avx2", "off")),
            decode_attention=_choice(env, "SEMSPEC_DECODE_ATTENTION", ("auto", "0")),
            decode_layer=_choice(env, "SEMSPEC_DECODE_LAYER", ("auto", "0")),
            onednn_pack=_choice(env, "SEMSPEC_ONEDNN_PACK", ("auto", "0")),
        )


@functools.cache
def settings() -> Settings:
    """This process's settings, read from the environment on the first call."""
    return Settings.from_env()


def reload_settings() -> Settings:
    """Read the environment again (after it changed) and return the new settings."""
    settings.cache_clear()
    return settings()


def project_env(root: Path | None = None, s: Settings | None = None) -> dict[str, str]:
    """Environment variables for local services, Ray and offline model loading: their state under
    ``root`` (a copy of the project), else under ``SEMSPEC_HOME``, with the ports of ``s`` (default: this
    process's settings)."""
    s = s or settings()
    r = (root or s.home).resolve()
    return {
        "PREFECT_HOME": str(r / ".prefect"),
        "PREFECT_API_URL": f"http://{HOST}:{s.prefect_port}/api",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        # a web page in the user's browser must not drive the API: only the UI's own origin, CSRF tokens on
        "PREFECT_SERVER_API_CORS_ALLOWED_ORIGINS": f"http://{HOST}:{s.prefect_port}",
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
