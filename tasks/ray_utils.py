"""Ray at the edge: start in-process unless ``RAY_ADDRESS`` names a cluster."""

from __future__ import annotations

import logging
import os
import secrets
import signal
import subprocess
import sys
import threading
from pathlib import Path

from semspec.models.project.settings import settings
from semspec.tasks.environment import apply_env

log = logging.getLogger(__name__)


def init_ray() -> None:
    """``ray.init()`` once: in-process by default, or the cluster named by ``RAY_ADDRESS``."""
    keys = (
        "RAY_USAGE_STATS_ENABLED",
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER",
        "RAY_AUTH_MODE",
        "RAY_AUTH_TOKEN_PATH",
    )
    # Ray reads its auth mode when first imported: the CLI and the API apply the whole environment at
    # their start, before anything imports Ray; a caller that imports Ray first sets RAY_AUTH_MODE itself
    apply_env(keys=keys)
    imported = "ray" in sys.modules
    import ray  # a slow import that only the ray executor needs

    if ray.is_initialized():
        return
    if imported and os.environ.get("RAY_AUTH_MODE") == "token" and not _token_auth_on():
        log.warning(
            "Ray was imported before the project's environment was applied, so it runs without its token: "
            "apply it first (semspec.tasks.environment.apply_env), as the CLI and the API do"
        )
        os.environ["RAY_AUTH_MODE"] = "disabled"  # Ray's processes must agree with this driver
    ensure_auth_token()
    address = settings().ray_address
    log.info("starting Ray %s", f"client of {address}" if address else "in-process")
    ray.init(
        address=address,
        include_dashboard=False,
        ignore_reinit_error=True,
        log_to_driver=True,
        configure_logging=False,
        # in-process: the node's address is loopback (its agents listen there); a cluster names its own
        **({} if address else {"_node_ip_address": LOOPBACK}),
    )
    if not address:
        _start_watchdog()
    if threading.current_thread() is threading.main_thread():
        exit_on_termination()  # ours again: Ray's own SIGTERM handler aborts without shutting Ray down


LOOPBACK = "127.0.0.1"


def _token_auth_on() -> bool:
    """Whether the imported Ray runs with token authentication (it read RAY_AUTH_MODE when imported)."""
    from ray._private.authentication.authentication_utils import is_token_auth_enabled

    return bool(is_token_auth_enabled())


def ensure_auth_token() -> Path | None:
    """With ``RAY_AUTH_MODE=token`` (the project's default) and no ``RAY_AUTH_TOKEN``, the token file at
    ``RAY_AUTH_TOKEN_PATH``: made once, random, readable by its owner only. Ray's servers then refuse a
    caller without it; some of them (gcs_server, raylet) listen on every interface whatever the node's
    address, so the token is what keeps another host out. Returns the file, or None when not used."""
    path = os.environ.get("RAY_AUTH_TOKEN_PATH")
    if os.environ.get("RAY_AUTH_MODE") != "token" or os.environ.get("RAY_AUTH_TOKEN") or not path:
        return None
    token = Path(path)
    if not token.is_file() or not token.read_text(encoding="utf-8").strip():  # none, or a cut write
        token.parent.mkdir(parents=True, exist_ok=True)
        tmp = token.with_name(f"{token.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
        try:
            os.link(tmp, token)  # the first process's token wins; a concurrent one reads it
        except FileExistsError:
            if not token.read_text(encoding="utf-8").strip():
                os.replace(tmp, token)
        finally:
            tmp.unlink(missing_ok=True)
    return token


_WATCHDOG: subprocess.Popen | None = None


def _start_watchdog() -> None:
    """Start ``tasks/ray_watchdog.py`` for this process: when it dies without ``shutdown_ray`` (SIGKILL),
    the watchdog stops the Ray processes it started (in a session of its own, so a signal to this
    process's group spares it)."""
    global _WATCHDOG
    _WATCHDOG = subprocess.Popen(
        [sys.executable, "-m", "semspec.tasks.ray_watchdog", str(os.getpid())],
        stdin=subprocess.PIPE,
        start_new_session=True,
    )


def _stop_watchdog() -> None:
    """Close the watchdog's pipe: it stops whatever of Ray outlived ``ray.shutdown`` and exits."""
    global _WATCHDOG
    if _WATCHDOG is not None and _WATCHDOG.stdin is not None:
        _WATCHDOG.stdin.close()
        try:
            _WATCHDOG.wait(timeout=15)
        except subprocess.TimeoutExpired:
            log.warning("the Ray watchdog (pid %d) did not exit; it stops by itself", _WATCHDOG.pid)
    _WATCHDOG = None


ACTOR_RESTARTS = 2  # a dead actor (killed, out of memory, a lost node) is replaced this often, then we fail


def restartable(**options: object) -> dict[str, object]:
    """Ray actor options that replace a dead actor and retry the calls it had not finished, at most
    ``ACTOR_RESTARTS`` times (its batch is redone whole; finished batches are already written)."""
    return {**options, "max_restarts": ACTOR_RESTARTS, "max_task_retries": ACTOR_RESTARTS}


def get_result(ref: object, what: str) -> object:
    """``ray.get(ref)``; when the actor died more often than it may be replaced, a RuntimeError that names
    ``what`` (the stage and the work of the call) and how to resume."""
    import ray

    try:
        return ray.get(ref)
    except ray.exceptions.RayActorError as e:
        raise RuntimeError(
            f"{what}: the Ray actor died and could not be replaced (at most {ACTOR_RESTARTS} restarts; "
            f"{type(e).__name__}); finished work is kept, so rerunning the stage resumes"
        ) from None


def shutdown_ray() -> None:
    """Stop the Ray this process started (its actors, raylet and GCS), or leave the cluster it joined;
    nothing when Ray was never started."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        log.info("stopping Ray")
        ray.shutdown()
    _stop_watchdog()


def exit_on_termination() -> None:
    """Turn SIGTERM and SIGHUP (a cancelled flow run, a closed terminal) into ``SystemExit`` so that
    ``finally`` blocks run: the stage's partial output stays consistent and ``shutdown_ray`` stops Ray's
    processes. (SIGKILL cannot be caught: then Ray's own reaper and our watchdog stop them.)"""

    def stop(signum: int, _frame) -> None:
        raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, stop)
