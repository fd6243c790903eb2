"""The environment the runtime reads, in one object read once per process: the project and home
folders, the caches, the data, the kernel switches. The ground floor: it imports nothing of the project's,
and nothing of the pipeline's services (their ports and the environment the CLI applies for them are
``semspec.tasks.environment``'s).

``settings()`` parses the variables the first time it is called; ``reload_settings()`` reads them again
(after a process changed its environment, e.g. ``apply_env`` or a test).
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
        """Parse ``env`` (default ``os.environ``); a bad value is a ValueError naming the variable."""
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
