"""``semspec serve``: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over the batched step loop.

Modules: ``app`` (the configuration, ``create_app`` and ``run_server``), ``metrics`` (Prometheus) and
``replicas`` (Ray Serve). Nothing is imported here: import from the module that defines a name.
"""
