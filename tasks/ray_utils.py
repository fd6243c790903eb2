"""Ray at the edge: start in-process unless ``RAY_ADDRESS`` names a cluster."""

from __future__ import annotations

import logging

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
