"""Where an evaluation's problems are decoded: a worker holds one replica of the pair and its decoders, in
this process or as a Ray actor; a pool hands each worker turns (one method's problems of one benchmark and
seed) and gives back each problem's result as it finishes."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from semspec.models.lm import LM, load_lm
from semspec.models.lm.pair import PairConfig
from semspec.models.spec.batching import decode_all
from semspec.models.spec.names import LLAMACPP, ROLES, parse_label
from semspec.models.spec.results import DecodeResult
from semspec.models.spec.settings import MethodNotApplicable
from semspec.tasks.config import EvaluateConfig
from semspec.tasks.data import Problem
from semspec.tasks.decoders import build_decoder, decode_settings
from semspec.tasks.ray_utils import get_result, init_ray, restartable

log = logging.getLogger(__name__)


def method_decoders(
    cfg: EvaluateConfig,
    pair: PairConfig,
    lms: dict[str, LM],
    benchmark: str,
    seed: int,
    pins: dict[str, str] | None = None,
    llama: Callable[[], Any] | None = None,
) -> tuple[dict[str, Any], dict[str, str]]:
    """The decoders of every method label, and the labels that cannot run on this pair with the reason.
    ``llama`` gives the ``llamacpp`` method's running server (``tasks/llamacpp.py``)."""
    settings = decode_settings(cfg, seed=seed, benchmark="gpqa" if benchmark == "gpqa" else "math")
    out, skipped = {}, {}
    for label in cfg.method_labels():
        method, variant = parse_label(label)
        try:
            if method == LLAMACPP:
                from semspec.tasks.llamacpp import LlamaCppDecoder

                if llama is None:
                    raise MethodNotApplicable("llamacpp runs in an evaluation worker that starts its server")
                out[label] = LlamaCppDecoder(label, llama(), lms["target"], settings)
            else:
                out[label] = build_decoder(method, pair, lms, settings, variant or "all", pins)
        except MethodNotApplicable as e:
            skipped[label] = str(e)
    return out, skipped


@dataclass
class Turn:
    """Problems of one benchmark and seed for one method, decoded in one batched call."""

    bench: str
    seed: int
    label: str
    problems: list[Problem]


class EvalWorker:
    """One replica of the pair and its decoders (in-process, or a Ray actor)."""

    def __init__(
        self,
        cfg: EvaluateConfig,
        pair: PairConfig,
        pins: dict[str, str] | None,
        lms: dict[str, LM] | None = None,
        threads: int | None = None,
    ) -> None:
        if threads:
            torch.set_num_threads(threads)
        self.cfg, self.pair, self.pins, self.threads = cfg, pair, pins, threads
        self.lms = lms or {r: load_lm(pair.role(r)) for r in ROLES}
        self._built: dict[tuple[str, int], tuple[dict[str, Any], dict[str, str]]] = {}
        self._llama: Any = None  # the llamacpp method's server, started at its first use

    def decoders(self, bench: str, seed: int) -> tuple[dict[str, Any], dict[str, str]]:
        """The decoders of (benchmark, seed), built once."""
        if (bench, seed) not in self._built:
            self._built[bench, seed] = method_decoders(
                self.cfg, self.pair, self.lms, bench, seed, self.pins, self.llama_server
            )
        return self._built[bench, seed]

    def llama_server(self) -> Any:
        """The ``llamacpp`` method's ``llama-server`` on the target's GGUF file, started once: this worker's
        threads, one slot per problem of a batch (``evaluate.batch_size``). ``MethodNotApplicable`` for a
        target that is not a GGUF file; ``ValueError`` (how to get one) without a ``llama-server``."""
        if self._llama is None:
            from semspec.tasks.llamacpp import LlamaServer, find_server, gguf_path

            binary = find_server(self.cfg.llamacpp_bin)
            try:
                model = gguf_path(self.pair.role("target"))
            except ValueError as e:
                raise MethodNotApplicable(f"llama.cpp runs GGUF files: {e}") from None
            threads = self.threads or torch.get_num_threads()
            server = LlamaServer(binary, model, threads=threads, parallel=self.cfg.batch_size)
            self._llama = server.__enter__()
        return self._llama

    def close(self) -> None:
        """Stop the ``llamacpp`` method's server, if one was started."""
        if self._llama is not None:
            self._llama.__exit__(None, None, None)
            self._llama = None

    def plan(self, bench: str) -> dict[str, Any]:
        """The models (id, dtype, device), the labels that cannot run with why, each label's run identity
        (the same for every benchmark: ``bench`` is where the decoders are built first)."""
        decoders, not_run = self.decoders(bench, self.cfg.seeds[0])
        identity = {label: getattr(dec, "run_identity", None) for label, dec in decoders.items()}
        return {
            "models": {r: lm.describe() for r, lm in self.lms.items()},
            "not_run": not_run,
            "identity": identity,
        }

    def decode(
        self, turn: Turn, on_result: Callable[[int, DecodeResult], None] | None = None
    ) -> list[DecodeResult]:
        """Decode a turn's problems (batched where the method can be)."""
        decoder = self.decoders(turn.bench, turn.seed)[0][turn.label]
        return decode_all(decoder, [p.question for p in turn.problems], self.cfg.batch_size, on_result)


class LocalPool:
    """One in-process worker; rows are kept as each problem finishes."""

    def __init__(self, worker: EvalWorker) -> None:
        self.worker = worker

    def plan(self, bench: str) -> dict[str, Any]:
        return self.worker.plan(bench)

    def run(self, turns: list[Turn], keep: Callable[[Turn, int, DecodeResult], None]) -> None:
        for turn in turns:
            self.worker.decode(turn, functools.partial(keep, turn))

    def close(self) -> None:
        self.worker.close()


class RayPool:
    """Ray actors, each a worker with its share of the cores (or one GPU); turns go to whichever actor is
    free, and each turn's rows are kept by the driver when it returns."""

    def __init__(self, cfg: EvaluateConfig, pair: PairConfig, pins: dict[str, str] | None, n: int) -> None:
        import ray  # only the Ray pool needs it (a slow import)

        init_ray()
        self.ray = ray
        cuda = any(pair.role(r).uses_cuda for r in ROLES)
        cpus = max(1, int(ray.available_resources().get("CPU", os.cpu_count() or 1)) // n)
        opts = restartable(num_cpus=cpus, num_gpus=1 if cuda else 0)
        remote = ray.remote(EvalWorker)
        self.actors = [remote.options(**opts).remote(cfg, pair, pins, None, cpus) for _ in range(n)]
        log.info("evaluate: %d Ray actors, %d CPUs%s each", n, cpus, " and one GPU" if cuda else "")

    def plan(self, bench: str) -> dict[str, Any]:
        return self.ray.get(self.actors[0].plan.remote(bench))

    def run(self, turns: list[Turn], keep: Callable[[Turn, int, DecodeResult], None]) -> None:
        queue, idle, running = list(turns), list(self.actors), {}
        while queue or running:
            while idle and queue:
                actor, turn = idle.pop(), queue.pop(0)
                running[actor.decode.remote(turn)] = (actor, turn)
            ready, _ = self.ray.wait(list(running), num_returns=1)
            actor, turn = running.pop(ready[0])
            ids = ", ".join(p.question_id for p in turn.problems)
            what = f"evaluate[{turn.bench}/{turn.label}, seed {turn.seed}] of problems {ids}"
            for i, res in enumerate(get_result(ready[0], what)):
                keep(turn, i, res)
            idle.append(actor)

    def close(self) -> None:
        # each actor stops its llama-server first (one that cannot is killed: its server gets SIGTERM then)
        with contextlib.suppress(Exception):
            self.ray.get([actor.close.remote() for actor in self.actors], timeout=30)
        for actor in self.actors:
            self.ray.kill(actor)


Pool = LocalPool | RayPool  # what ``make_pool`` returns: both have plan, run and close


def make_pool(
    cfg: EvaluateConfig, pair: PairConfig, pins: dict[str, str] | None, lms: dict[str, LM] | None
) -> Pool:
    """Where problems are decoded: Ray actors (``evaluate.actors``, or one per GPU for a cuda pair), else
    in this process (given ``lms`` always run here)."""
    n = cfg.actors
    if n is None and any(pair.role(r).uses_cuda for r in ROLES):
        n = torch.cuda.device_count() or None
    if lms is not None or not n:
        return LocalPool(EvalWorker(cfg, pair, pins, lms))
    return RayPool(cfg, pair, pins, n)
