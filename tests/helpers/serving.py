"""A served pair of tiny models (no checkpoint, milliseconds a step) and a uvicorn server in a thread."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import httpx
import uvicorn

from semspec.api import SemanticSpec
from semspec.flows.serve.app import create_app
from semspec.flows.serve.config import ServeConfig
from semspec.models.lm import LM
from semspec.models.lm.pair import PairConfig
from semspec.models.project.probe_card import (
    CARD_VERSION,
    CardProbe,
    ProbeCard,
    probe_folder_name,
    write_card,
)
from semspec.models.spec.batching import BatchDecoder, SingleModelDecoder
from semspec.models.spec.probe import ProbeMLP, save_probe, sha256_of
from semspec.models.spec.semanticspec import SemanticSpecDecoder
from semspec.models.spec.settings import DecodeSettings
from tests.helpers.project import free_port
from tests.helpers.tiny import tiny_lm


class TinySpec(SemanticSpec):
    """A ``SemanticSpec`` over two tiny random models whose probes are fixed functions (p 0.5, q 1.0:
    about half the draft's steps accepted); ``delay`` slows each round (disconnects, full queues)."""

    def __init__(self, delay: float = 0.0) -> None:
        draft = tiny_lm(merged=True, seed=0, boost=2.0, eos_bias=-2.0, init=0.2, max_step_tokens=8)
        target = tiny_lm(
            merged=False, seed=1, boost=2.0, eos_bias=-2.0, hidden=64, init=0.2, max_step_tokens=8
        )
        pair = PairConfig.from_dict(
            {
                "name": "tiny",
                "draft": {"model_id": "tiny-llama-0", "source": "local", "path": "/nonexistent"},
                "target": {"model_id": "tiny-llama-1", "source": "local", "path": "/nonexistent"},
            },
            where="tiny",
        )
        super().__init__(
            pair, {"draft": draft, "target": target}, DecodeSettings(max_new_tokens=24), "all", None, 4
        )
        self.delay = delay

    def decoder(self, method: str = "semanticspec", **overrides) -> BatchDecoder:
        settings = self.settings(**overrides)
        if method == "semanticspec":
            dec = SemanticSpecDecoder(
                self.lms["draft"],
                self.lms["target"],
                lambda h: 1.0,
                lambda h: 0.5,
                replace(settings, seed=overrides.get("seed", 0)),
            )
        else:
            dec = SingleModelDecoder(self.lms[method], settings, method)
        if self.delay:
            one_round = dec.round

            def slow(live):
                time.sleep(self.delay)
                return one_round(live)

            dec.round = slow
        return dec


@contextlib.contextmanager
def running_server(llm: SemanticSpec, **cfg) -> Iterator[tuple[str, object]]:
    """Serve ``llm`` on a free loopback port in a thread; yields (base URL, app); stops it after."""
    port = free_port()
    config = ServeConfig(port=port, **cfg)
    app = create_app(llm, config)
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", **config.uvicorn_options())
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 30
    while True:
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.time() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.05)
    try:
        yield base, app
    finally:
        server.should_exit = True
        thread.join(10)


def write_untrained_probes(folder: Path, pair: PairConfig, draft: LM, target: LM) -> Path:
    """An exported folder (``semspec probes export``'s layout and card) of untrained ``all`` probes for
    ``pair``'s two models: what matters to its users is that they load, fit the models and decide steps,
    not how well."""
    import torch

    entries = {}
    for role, lm in (("draft", draft), ("target", target)):
        torch.manual_seed(len(role))
        sub = probe_folder_name(role, "all")
        sha = save_probe(ProbeMLP(lm.hidden_size, [16], feature="all"), folder / sub)
        entries[role] = CardProbe(
            path=sub,
            model_id=lm.model_id,
            model_sha256=None,
            format=lm.format.name,
            feature="h_mean",
            hidden_size=lm.hidden_size,
            pooling=pair.pooling,
            sha256=sha,
            config_sha256=sha256_of(folder / sub / "probe.json"),
            registry={"name": None, "version": None, "run_id": None},
            metrics={},
            routing={},
            floors={"min_ratio": None, "min_p": None},
            data_hash=None,
        )
    write_card(ProbeCard(CARD_VERSION, pair.name, {"all": entries}), folder)
    return folder
