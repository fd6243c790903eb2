"""The services' side of the environment: their URLs, the PATH they run with and the ``export`` lines
``semspec env`` prints for shell scripts. The variables themselves are defined in
``semspec.tasks.environment`` (the services') and ``semspec.models.project.settings`` (the runtime's)."""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

from semspec.models.project.settings import HOST
from semspec.tasks.environment import apply_env, effective_env, project_env, services_settings

__all__ = ["HOST", "apply_env", "effective_env", "service_urls", "shell_exports", "with_venv_path"]


def service_urls() -> dict[str, str]:
    """Browser URLs of the Prefect and MLflow UIs."""
    s = services_settings()
    return {"prefect": f"http://{HOST}:{s.prefect_port}", "mlflow": f"http://{HOST}:{s.mlflow_port}"}


def with_venv_path(env: dict[str, str]) -> dict[str, str]:
    """``env`` with this Python's ``bin`` folder (``semspec``, ``dvc``, ``prefect``, ``mlflow``) first on PATH."""
    return {**env, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"}


def shell_exports(root: Path | None = None) -> str:
    """``export K=V`` lines (values quoted) that keep variables the caller already set."""
    return "\n".join(f"export {k}=${{{k}:-{shlex.quote(v)}}}" for k, v in project_env(root).items())
