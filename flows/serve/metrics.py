"""The server's Prometheus metrics (prometheus_client), in a registry of their own per app.

Rates are left to Prometheus (``rate(semspec_generated_tokens_total[1m])`` is tokens/s); the step
acceptance is ``semspec_draft_steps_total{outcome="accepted"}`` over all outcomes, the target share
``semspec_target_tokens_total`` over ``semspec_generated_tokens_total``.
"""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from semspec.engine import Engine
from semspec.models.spec.results import DecodeResult
from semspec.submission import Submission

_LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128, 256)


class ServeMetrics:
    """Counters, gauges and histograms of one server."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, spec_max_batch: int | None) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "semspec_requests", "Requests received, by endpoint.", ["endpoint"], registry=r
        )
        self.finished = Counter(
            "semspec_requests_finished",
            "Requests ended, by method run and status.",
            ["method", "status"],
            registry=r,
        )
        self.refusals = Counter(
            "semspec_requests_refused",
            "Requests refused with 429 (the queue was full), by endpoint.",
            ["endpoint"],
            registry=r,
        )
        self.tokens = Counter(
            "semspec_generated_tokens", "Output tokens, by method run.", ["method"], registry=r
        )
        self.target_tokens = Counter(
            "semspec_target_tokens", "Output tokens the target wrote, by method run.", ["method"], registry=r
        )
        self.steps = Counter(
            "semspec_draft_steps", "SemanticSpec's draft proposals, by outcome.", ["outcome"], registry=r
        )
        why = "Steps the target wrote, by what rejected the draft's (the trace's rejected_by)."
        self.rejected = Counter("semspec_rejected_steps", why, ["reason"], registry=r)
        self.spec_off = Counter(
            "semspec_speculation_off_rounds",
            "Rounds in which a SemanticSpec request's step was written by the target alone (the batch was full).",
            registry=r,
        )
        self.latency = Histogram(
            "semspec_request_latency_seconds",
            "Submit to last step.",
            ["method"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.queued = Histogram(
            "semspec_queue_seconds", "Submit to joining the batch.", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.speed = Histogram(
            "semspec_request_tokens_per_second",
            "Output tokens per second of decoding, per request.",
            ["method"],
            buckets=(1, 2, 5, 10, 20, 30, 40, 60, 80, 120, 200),
            registry=r,
        )
        self.queue_depth = Gauge("semspec_queue_depth", "Requests waiting for a row.", registry=r)
        self.running = Gauge("semspec_running_rows", "Rows in the batch.", registry=r)
        threshold = Gauge(
            "semspec_spec_max_batch",
            "Requests in flight up to which SemanticSpec speculates (-1: always).",
            registry=r,
        )
        threshold.set(-1 if spec_max_batch is None else spec_max_batch)

    def watch(self, engine: Engine) -> None:
        """Read the queue depth and the batch size from ``engine`` at every scrape."""
        self.queue_depth.set_function(lambda: engine.queue_depth)
        self.running.set_function(lambda: engine.running)

    def request(self, endpoint: str) -> None:
        """A request arrived."""
        self.requests.labels(endpoint).inc()

    def refused(self, endpoint: str) -> None:
        """A request to ``endpoint`` was refused because the queue was full (429)."""
        self.refusals.labels(endpoint).inc()

    def done(self, req: Submission, res: DecodeResult | None, error: BaseException | None) -> None:
        """A request finished (``res``) or failed (``error``); called from the engine's thread."""
        method = req.ran_as
        if res is None:
            status = "cancelled" if type(error).__name__ == "Stopped" else "error"
            self.finished.labels(method, status).inc()
            return
        self.finished.labels(method, "ok").inc()
        self.tokens.labels(method).inc(res.output_tokens)
        self.target_tokens.labels(method).inc(res.target_tokens)
        self.spec_off.inc(req.solo_rounds)
        for step in res.steps:
            if step.author == "draft":
                self.steps.labels("accepted").inc()
            elif step.proposal is not None:
                self.steps.labels("rejected").inc()
            if step.rejected_by is not None:
                self.rejected.labels(step.rejected_by).inc()
        self.latency.labels(method).observe(
            res.timings.total + ((req.started or req.submitted) - req.submitted)
        )
        if req.started is not None:
            self.queued.observe(req.started - req.submitted)
        if res.timings.total > 0:
            self.speed.labels(method).observe(res.output_tokens / res.timings.total)

    def render(self) -> bytes:
        """The exposition text."""
        return generate_latest(self.registry)
