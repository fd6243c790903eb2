"""Continuous batching for concurrent requests: one worker thread runs the batched step loop, requests
join the running batch between two rounds and leave it when they finish or their client goes away.

Requests are grouped in *lanes*, one per (method, temperature, top_p): rows of a lane share every model
call (``BatchDecoder.admit`` and ``round``), and the lanes take turns round by round. A row's budget and
seed are its own, so requests with different ``max_tokens`` or seeds share a lane.

Speculation is switched off under load, as vLLM's ``speculative_disable_by_batch_size`` does: a
SemanticSpec request that arrives while more than ``spec_max_batch`` requests are in flight joins the
target's lane, and when the batch grows past ``spec_max_batch`` rows, SemanticSpec's rows move into the
target's lane too (each keeps its caches, budget and seed; the target writes the rest of its answer).
Under load every row then shares one batched decode, as the target alone would run. A full batch is
compute-bound, and the target's verification then costs more than the draft saves; which batch size
that is depends on the CPU (``conf/serving.yaml``, ``semspec.flows.serve.config.auto_spec_max_batch``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from itertools import count

from semspec.lanes import Lane, progress, step_callback
from semspec.models.spec.batching import BatchDecoder, Job, Row
from semspec.models.spec.names import PROBE_METHOD
from semspec.models.spec.results import DecodeResult, finish_result
from semspec.stops import StopStrings
from semspec.submission import Overloaded, Stopped, Submission, TooLarge

log = logging.getLogger(__name__)

LaneKey = tuple[str, float, float]  # (method, temperature, top_p)
DecoderFactory = Callable[[str, float, float], BatchDecoder]


def may_speculate(spec_max_batch: int | None, rows: int) -> bool:
    """Whether SemanticSpec speculates with ``rows`` requests in flight."""
    return spec_max_batch is None or rows <= spec_max_batch


def _whitespace_tokens(text: str) -> int:
    return len(text.split())


class Engine:
    """The batched step loop behind a server: ``submit`` a request, wait on its ``future``.

    Args:
        decoders: builds the decoder of (method, temperature, top_p); called once per lane.
        max_batch: rows decoded at once, over every lane.
        max_queue: requests that may wait for a place (>= 1); one more raises :class:`Overloaded`.
        max_batch_tokens: the most tokens (prompt and budget of new tokens, :attr:`Submission.tokens`) the
            rows in the batch may hold together (None: no limit); a request waits until its tokens fit,
            and one that could never fit raises :class:`TooLarge`. Rows are admitted by tokens, not
            only by count: eight long prompts cost what hundreds of short ones do.
        spec_max_batch: the most requests in flight for which SemanticSpec still speculates (None: always).
        admit_wait: seconds an idle engine waits for more requests before it admits the first (with a
            ``spec_max_batch``), so a burst is counted whole.
        on_done: called with each finished request and its result (metrics), from the engine's thread.
        count_tokens: a text's tokens in the target's tokenizer (an answer cut at a stop string is counted
            again); default: whitespace-separated words.
    """

    def __init__(
        self,
        decoders: DecoderFactory,
        max_batch: int = 8,
        max_queue: int = 64,
        spec_max_batch: int | None = None,
        on_done: Callable[[Submission, DecodeResult | None, BaseException | None], None] | None = None,
        admit_wait: float = 0.02,
        max_batch_tokens: int | None = None,
        count_tokens: Callable[[str], int] | None = None,
    ) -> None:
        if max_batch < 1 or max_queue < 1:
            raise ValueError(f"max_batch and max_queue must be >= 1, got {max_batch}, {max_queue}")
        if max_batch_tokens is not None and max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be None or >= 1, got {max_batch_tokens}")
        if spec_max_batch is not None and spec_max_batch < 0:
            raise ValueError(f"spec_max_batch must be None or >= 0, got {spec_max_batch}")
        self.decoders, self.max_batch, self.max_queue = decoders, max_batch, max_queue
        self.spec_max_batch, self.on_done, self.admit_wait = spec_max_batch, on_done, admit_wait
        self.max_batch_tokens = max_batch_tokens
        self.count_tokens = count_tokens or _whitespace_tokens
        self.error: BaseException | None = None  # what killed the worker thread (None: alive)
        self._pending: deque[Submission] = deque()
        self._lanes: dict[LaneKey, Lane] = {}
        self._cond = threading.Condition()
        self._ids = count()
        self._stop = False
        self._thread: threading.Thread | None = None
        self.rounds = 0  # model rounds run (each over every row of one lane)

    # ----------------------------------------------------------------------------- client side
    @property
    def queue_depth(self) -> int:
        """Requests waiting for a place in the batch."""
        return len(self._pending)

    @property
    def running(self) -> int:
        """Rows in the batch now, over every lane."""
        return sum(len(lane.rows) for lane in list(self._lanes.values()))

    @property
    def tokens_in_batch(self) -> int:
        """Tokens the requests in the batch may hold (:attr:`Submission.tokens`), over every lane."""
        return sum(r.tokens for lane in list(self._lanes.values()) for r in list(lane.requests.values()))

    @property
    def lanes(self) -> int:
        """Lanes (method, temperature, top_p) with rows now; an emptied lane is dropped."""
        return len(self._lanes)

    @property
    def alive(self) -> bool:
        """Whether the worker thread serves: started, not stopped, not dead of an error."""
        return self._thread is not None and self._thread.is_alive() and self.error is None

    def submit(self, request: Submission) -> Submission:
        """Queue ``request``; its ``future`` resolves to a ``DecodeResult``. Raises :class:`Overloaded`
        when ``max_queue`` requests already wait, :class:`Stopped` after ``stop``."""
        if self.max_batch_tokens is not None and request.tokens > self.max_batch_tokens:
            raise TooLarge(
                f"the prompt ({request.prompt_tokens} tokens) and max_tokens ({request.max_new_tokens}) need "
                f"{request.tokens} tokens, above this server's batch budget of {self.max_batch_tokens}: send a "
                f"shorter prompt or a smaller max_tokens"
            )
        with self._cond:
            if self.error is not None:
                raise Stopped(f"the engine failed ({type(self.error).__name__}); it takes no more requests")
            if self._stop:
                raise Stopped("the engine is stopped")
            if len(self._pending) >= self.max_queue:
                raise Overloaded(
                    f"{len(self._pending)} requests are waiting (the queue holds {self.max_queue})"
                )
            request.id, request.submitted = next(self._ids), time.perf_counter()
            request.stops = StopStrings(request.stop, after=request.think_end) if request.stop else None
            self._pending.append(request)
            self._cond.notify()
        return request

    def start(self) -> Engine:
        """Start the worker thread (once)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="semspec-engine", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Stop taking requests, fail the unfinished ones with :class:`Stopped`, join the thread."""
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)
        with self._cond:  # the worker may still run after the join's timeout: take a copy under the lock
            left = [
                *self._pending,
                *(r for lane in list(self._lanes.values()) for r in list(lane.requests.values())),
            ]
        for req in left:
            self._fail(req, Stopped("the server is shutting down"))

    # ----------------------------------------------------------------------------- worker side
    def _loop(self) -> None:
        """The worker: rounds until stopped. An error outside a lane's decode kills it: every request in
        flight and waiting fails with it, ``alive`` turns False and ``submit`` refuses new work."""
        try:
            self._rounds()
        except BaseException as e:
            log.exception("the engine's worker died")
            with self._cond:
                self.error = e
                waiting = [
                    *self._pending,
                    *(r for lane in self._lanes.values() for r in lane.requests.values()),
                ]
                self._pending.clear()
            for req in waiting:
                self._fail(req, Stopped(f"the engine failed ({type(e).__name__})"))

    def _rounds(self) -> None:
        while True:
            with self._cond:
                while not self._stop and not self._pending and not self.running:
                    self._cond.wait()
                if not self._stop and not self.running and self.spec_max_batch is not None:
                    # an idle batch: clients whose answers ended together send their next requests within
                    # milliseconds; wait for them before deciding whether SemanticSpec speculates
                    deadline = time.perf_counter() + self.admit_wait
                    while not self._stop and (left := deadline - time.perf_counter()) > 0:
                        self._cond.wait(left)
                if self._stop:
                    return
                joining = self._take()
            self._admit(joining)
            for key in list(self._lanes):
                self._round(key)
            for key in [k for k, lane in self._lanes.items() if not lane.rows and not lane.requests]:
                del self._lanes[key]  # a lane per distinct setting must not pile up

    def _take(self) -> list[Submission]:
        """Pending requests that fit in the batch, in order; cancelled ones are dropped."""
        for req in [r for r in self._pending if r.cancelled.is_set()]:  # gone clients free their places
            self._pending.remove(req)
            self._fail(req, Stopped("cancelled"))
        taken, room, tokens = [], self.max_batch - self.running, self.tokens_in_batch
        while self._pending and len(taken) < room:
            req = self._pending[0]
            if req.cancelled.is_set():
                self._pending.popleft()
                self._fail(req, Stopped("cancelled"))
                continue
            if self.max_batch_tokens is not None and tokens + req.tokens > self.max_batch_tokens:
                break  # it waits (in order) until finished rows free its tokens
            self._pending.popleft()
            tokens += req.tokens
            in_flight = self.running + len(taken) + 1 + len(self._pending)
            req.solo = req.method == PROBE_METHOD and not may_speculate(self.spec_max_batch, in_flight)
            taken.append(req)
        return taken

    def _lane(self, req: Submission) -> tuple[LaneKey, Lane]:
        key = ("target" if req.solo else req.method, float(req.temperature), float(req.top_p))
        if key not in self._lanes:
            self._lanes[key] = Lane(self.decoders(*key))
        return key, self._lanes[key]

    def _admit(self, requests: list[Submission]) -> None:
        """Prefill the new requests, lane by lane (one padded prefill per lane); a request whose prompt
        fails alone is failed alone."""
        groups: dict[LaneKey, list[Submission]] = {}
        for req in requests:
            try:
                key, _ = self._lane(req)
            except Exception as e:  # a decoder that cannot be built: this request's error
                self._fail(req, e)
                continue
            groups.setdefault(key, []).append(req)
        for key, reqs in groups.items():
            lane = self._lanes[key]
            try:
                rows = self._admit_rows(lane, reqs)
            except Exception:  # find the culprit: admit one by one
                rows = []
                for req in reqs:
                    try:
                        rows += self._admit_rows(lane, [req])
                    except Exception as e:
                        self._fail(req, e)
            lane.rows += rows

    def _admit_rows(self, lane: Lane, reqs: list[Submission]) -> list[Row]:
        jobs = [Job(r.id, r.prompt, r.max_new_tokens, r.seed) for r in reqs]
        by_id = {r.id: r for r in reqs}

        rows = lane.decoder.admit(jobs, step_callback(by_id))
        now = time.perf_counter()
        for req in reqs:
            req.started = now
            lane.requests[req.id] = req
            req.admitted.set_result(True)
        return rows

    def _round(self, key: LaneKey) -> None:
        """One round of one lane: drop cancelled rows, advance the rest, resolve the finished."""
        lane = self._lanes[key]
        for row in [r for r in lane.rows if lane.requests[r.index].cancelled.is_set()]:
            lane.drop(row)
            self._fail(lane.requests.pop(row.index), Stopped("cancelled"))
        for row in [r for r in lane.rows if (q := lane.requests[r.index].stops) is not None and q.stopped]:
            lane.drop(row)  # its answer ended at a stop string: no more rounds for it
            finish_result(lane.decoder.method, row.res, row.t0, lane.decoder.settings)
            self._resolve(lane, row)
        if not lane.rows:
            return
        if key[0] == PROBE_METHOD and not may_speculate(
            self.spec_max_batch, self.running
        ):  # the batch is full
            self._hand_over(key, lane)
            if not lane.rows:
                return  # the rows left waiting for a rewrite are stepped now, not starved while it stays full
        before = {row.index: progress(row) for row in lane.rows}
        try:
            done = lane.decoder.round(lane.rows)
        except (
            Exception
        ) as e:  # find the culprit: each untouched row alone; only a row that fails alone fails
            log.exception("decoding failed for %d rows of %s; retrying them one by one", len(lane.rows), key)
            done = lane.round_alone(before, e, self._fail)
        self.rounds += 1
        for row in lane.rows:
            req = lane.requests[row.index]
            if req.method == PROBE_METHOD:
                req.solo_rounds += req.solo
                req.spec_rounds += not req.solo
        finished = {r.index for r in done}
        lane.rows = [r for r in lane.rows if r.index not in finished]
        for row in done:
            self._resolve(lane, row)

    def _resolve(self, lane: Lane, row: Row) -> None:
        """Hand a finished row's result (cut at its stop string, if one matched) to its request."""
        req = lane.requests[row.index]
        res = row.res if req.stops is None else req.stops.cut(row.res, self.count_tokens)
        try:
            if self.on_done is not None:
                self.on_done(req, res, None)
        finally:  # its answer is whole whatever the callback did; the rest fail with the worker
            del lane.requests[row.index]
            req.future.set_result(res)

    def _hand_over(self, key: LaneKey, lane: Lane) -> None:
        """Move SemanticSpec's rows into the target's lane of the same sampling settings: the batch is full,
        and the target writes the rest of their answers there, batched with its own rows."""
        _, temperature, top_p = key
        target_key = ("target", temperature, top_p)
        if target_key not in self._lanes:
            self._lanes[target_key] = Lane(self.decoders(*target_key))
        into = self._lanes[target_key]
        moving = lane.decoder.hand_over(lane.rows)  # a row waiting for a rewrite moves after it
        for row in moving:
            req = lane.requests.pop(row.index)
            req.solo = True
            into.requests[row.index] = req
        into.rows += moving
        lane.rows = [r for r in lane.rows if r not in moving]

    def _fail(self, req: Submission, error: BaseException) -> None:
        """Fail ``req``: its futures first, then ``on_done``, whose own error is only logged."""
        if not req.admitted.done():
            req.admitted.set_exception(error)
        if req.future.done():
            return
        req.future.set_exception(error)
        if self.on_done is not None:
            try:
                self.on_done(req, None, error)
            except Exception:
                log.exception("on_done failed for request %d", req.id)
