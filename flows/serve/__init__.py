"""``semspec serve``: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over the batched step loop.

Endpoints: ``POST /v1/chat/completions`` and ``POST /v1/completions`` (streaming as server-sent events,
or not), ``GET /v1/models``, ``GET /health`` and ``GET /metrics`` (Prometheus). Concurrent requests are
decoded together by one :class:`semspec.engine.Engine` (continuous batching); each response carries the
SemanticSpec trace in the extension field ``semspec``. Every failure is answered in OpenAI's error schema
and the server keeps serving; a full queue answers 429 with ``Retry-After``.

Modules: ``config`` (``ServeConfig``, the speculation threshold), ``app`` (``create_app``: lifespan, error
handlers, API key check), ``run`` (``run_server``: uvicorn or the replicas), ``routes`` (the endpoints), ``replies`` (the bodies, the event
stream and the errors in OpenAI's schema), ``metrics`` (Prometheus) and ``replicas`` (Ray Serve). The
request and response models are in ``flows.openai_schema``. Nothing is imported here: import from the
module that defines a name.
"""
