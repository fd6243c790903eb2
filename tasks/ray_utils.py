"""Ray at the edge: start in-process unless ``RAY_ADDRESS`` names a cluster."""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)


def init_ray() -> None:
    """``ray.init()`` once: in-process by default, or the cluster named by ``RAY_ADDRESS``."""
    import ray

    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    address = os.environ.get("RAY_ADDRESS") or None
    log.info("starting Ray %s", f"client of {address}" if address else "in-process")
    ray.init(
        address=address,
        include_dashboard=False,
        ignore_reinit_error=True,
        log_to_driver=True,
        configure_logging=False,
    )
