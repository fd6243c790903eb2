"""Ray at the edge: start in-process unless ``RAY_ADDRESS`` names a cluster."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading

from semspec.models.project.settings import apply_env, settings

log = logging.getLogger(__name__)


def init_ray() -> None:
    """``ray.init()`` once: in-process by default, or the cluster named by ``RAY_ADDRESS``."""
    import ray  # a slow import that only the ray executor needs

    if ray.is_initialized():
        return
    apply_env(keys=("RAY_USAGE_STATS_ENABLED", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_AUTH_MODE"))
    address = settings().ray_address
    log.info("starting Ray %s", f"client of {address}" if address else "in-process")
    ray.init(
        address=address,
        include_dashboard=False,
        ignore_reinit_error=True,
        log_to_driver=True,
        configure_logging=False,
    )
    if not address:
        _start_watchdog()
    if threading.current_thread() is threading.main_thread():
        exit_on_termination()  # ours again: Ray's own SIGTERM handler aborts without shutting Ray down


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
