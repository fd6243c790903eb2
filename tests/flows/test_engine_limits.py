"""Limits under load: a SemanticSpec row waiting for the target's rewrite is still stepped while the batch
stays over ``--spec-max-batch``, and ``--limit-concurrency`` answers the connection past it with 503."""

from __future__ import annotations

import socket
import threading
import time

import httpx

from semspec.engine import Engine
from semspec.submission import Submission
from tests.helpers.serving import TinySpec, running_server

CHAT = [{"role": "user", "content": "What is 2 + 3?"}]


class _Rewrites:
    """A decoder whose first SemanticSpec round waits for ``go`` and then leaves its row waiting for a
    rewrite (``waiting`` says so, and ``hand_over`` keeps it back, as a real one does); the next round
    that steps the row does the rewrite and records how many requests the engine had in flight."""

    def __init__(self, inner, engine_ref: list, seen: list[int], go: threading.Event) -> None:
        self.inner, self.engine_ref, self.seen, self.go = inner, engine_ref, seen, go
        self.held: list = []  # rows waiting for a rewrite

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def waiting(self, row) -> bool:
        return any(row is r for r in self.held)

    def hand_over(self, rows):
        return self.inner.hand_over([r for r in rows if not self.waiting(r)])

    def round(self, rows):
        if self.inner.method == "semanticspec":
            for row in rows:
                if self.waiting(row):
                    self.seen.append(self.engine_ref[0].running)
                    self.held.remove(row)
        done = self.inner.round(rows)
        if self.inner.method == "semanticspec" and not self.seen:
            assert self.go.wait(10)
            self.held += rows
        return done


def test_a_row_waiting_for_a_rewrite_is_stepped_while_the_batch_stays_full():
    llm, ref, seen, go = TinySpec(delay=0.05), [], [], threading.Event()
    engine = Engine(
        lambda m, t, p: _Rewrites(llm.decoder(m, temperature=t, top_p=p), ref, seen, go),
        max_batch=4,
        spec_max_batch=1,
    )
    ref.append(engine)
    first = engine.submit(Submission(CHAT, "semanticspec", 40, 0.0, 1.0))
    engine.start()
    try:
        first.admitted.result(10)  # its first round runs, and waits for go
        busy = [engine.submit(Submission(CHAT, "target", 40, 0.0, 1.0)) for _ in range(2)]
        go.set()  # the first round ends with its row waiting, and the next admits the two others
        first.future.result(60)
        for r in busy:
            r.future.result(60)
    finally:
        engine.stop()
    # its rewrite ran while the other two rows were in flight (the batch over spec_max_batch), not after
    assert seen and seen[0] == 3
    assert first.solo_rounds > 0  # and then it moved to the target's lane like the rest


def test_the_connection_past_limit_concurrency_is_answered_503():
    with running_server(TinySpec(), limit_concurrency=2) as (base, _):
        host, port = base.removeprefix("http://").split(":")
        idle = [socket.create_connection((host, int(port))) for _ in range(2)]
        try:
            time.sleep(0.2)  # the server has accepted both
            assert httpx.get(f"{base}/health", timeout=5).status_code == 503
        finally:
            for s in idle:
                s.close()
        deadline = time.time() + 5
        while httpx.get(f"{base}/health", timeout=5).status_code != 200:
            assert time.time() < deadline, "the server did not recover after the connections closed"
            time.sleep(0.05)
