"""``run_server``: ``semspec serve`` in this process with uvicorn, or as Ray Serve replicas. Above both
``app`` and ``replicas`` (which builds the same app per replica), so neither imports the other's caller."""

from __future__ import annotations

from semspec.flows.serve.app import create_app
from semspec.flows.serve.config import ServeConfig


def run_server(
    pair: str | None, probes: str | None, probe: str | None, cfg: ServeConfig, replicas: int = 0
) -> None:
    """Load the pair (every check first, then the models, once) and serve it until interrupted: in this
    process with uvicorn, or with ``replicas`` >= 1 as that many Ray Serve replicas of the same app."""
    if replicas:
        from semspec.flows.serve.replicas import serve_replicas

        serve_replicas(pair, probes, probe, cfg, replicas)
        return
    import uvicorn

    from semspec.api import load

    llm = load(pair, probes=probes, probe=probe)
    uvicorn.run(
        create_app(llm, cfg),
        host=cfg.host,
        port=cfg.port,
        log_level="info",
        **cfg.uvicorn_options(),
    )
