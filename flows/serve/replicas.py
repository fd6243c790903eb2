"""``semspec serve --replicas N``: the same FastAPI app as ``semspec serve``, as N Ray Serve replicas.

Each replica loads the pair once and runs its own engine (continuous batching inside the replica); Ray
Serve's proxy spreads requests over the replicas, on this machine or, with ``RAY_ADDRESS``, a cluster.
There is no second implementation: each replica serves ``create_app``'s app through Serve's ingress.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI
from ray import serve

from semspec.flows.serve.app import create_app
from semspec.flows.serve.config import ServeConfig

log = logging.getLogger(__name__)


@serve.deployment(name="semspec", max_ongoing_requests=256)
@serve.ingress()
class SemspecReplica:
    """One replica: the pair loaded once; Serve asks it for its app (``create_app``'s) after the
    constructor."""

    def __init__(self, pair: str | None, probes: str | None, probe: str | None, cfg: ServeConfig) -> None:
        from semspec.api import load

        self.llm, self.cfg = load(pair, probes=probes, probe=probe), cfg

    def __serve_build_asgi_app__(self) -> FastAPI:
        app = create_app(self.llm, self.cfg)
        app.state.engine.start()  # idempotent: the app's lifespan starts it too where Serve runs it
        return app


def application(pair: str | None, probes: str | None, probe: str | None, cfg: ServeConfig, replicas: int):
    """The Serve application of ``replicas`` replicas (each asks for one CPU)."""
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    return SemspecReplica.options(num_replicas=replicas, ray_actor_options={"num_cpus": 1}).bind(
        pair, probes, probe, cfg
    )


def serve_replicas(
    pair: str | None, probes: str | None, probe: str | None, cfg: ServeConfig, replicas: int
) -> None:
    """Start Ray (in-process, or ``RAY_ADDRESS``'s cluster), Serve's proxy on ``cfg.host:cfg.port`` and the
    replicas; block until interrupted, then shut Serve down."""
    import time

    from semspec.tasks.ray_utils import init_ray

    init_ray()
    serve.start(http_options={"host": cfg.host, "port": cfg.port})
    serve.run(application(pair, probes, probe, cfg, replicas), route_prefix="/")
    log.info("serving %d replicas on http://%s:%d/v1", replicas, cfg.host, cfg.port)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
