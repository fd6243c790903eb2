"""Ray at the edge: start in-process unless ``RAY_ADDRESS`` names a cluster."""

from __future__ import annotations

import logging
import signal
import sys
import threading

from semspec.models.settings import apply_env, settings

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
    if threading.current_thread() is threading.main_thread():
        exit_on_termination()  # ours again: Ray's own SIGTERM handler aborts without shutting Ray down


def shutdown_ray() -> None:
    """Stop the Ray this process started (its actors, raylet and GCS), or leave the cluster it joined;
    nothing when Ray was never started."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        log.info("stopping Ray")
        ray.shutdown()


def exit_on_termination() -> None:
    """Turn SIGTERM and SIGHUP (a cancelled flow run, a closed terminal) into ``SystemExit`` so that
    ``finally`` blocks run: the stage's partial output stays consistent and ``shutdown_ray`` stops Ray's
    processes. (SIGKILL cannot be caught: then Ray's own reaper stops them when this process dies.)"""

    def stop(signum: int, _frame) -> None:
        raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, stop)
