"""One probe of a train run: what every probe of the run shares (``TrainRun``), the probe itself
(``Trained``: fitted once, tested, its calibration plotted, its MLflow tags and params) and what
registering it needs (``KeptProbe``), now or, when MLflow was unreachable, later."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from torch import nn

from semspec.models.lm.pair import PairConfig
from semspec.models.spec.names import ALL_DOMAINS, FEATURE_COLUMNS, split_probe_key
from semspec.models.spec.probe import save_probe
from semspec.tasks.config import TrainConfig
from semspec.tasks.io import save_figure_atomic
from semspec.tasks.train.data import ProbeData
from semspec.tasks.train.fit import fit_probe, predict
from semspec.tasks.train.metrics import probe_metrics
from semspec.tasks.train.plots import calibration_figure

log = logging.getLogger(__name__)


@dataclass
class TrainRun:
    """What every probe of one train stage run shares."""

    cfg: TrainConfig
    pair: PairConfig
    plots_dir: Path
    commit: str
    fingerprint: dict[str, str]


class Trained:
    """One probe (``key``: its variant, ``@domain`` for one domain's): fitted on first use, tested, its
    calibration plotted; tracked in MLflow by ``track_probe`` or kept locally by ``keep``."""

    def __init__(
        self,
        run: TrainRun,
        data: ProbeData,
        masks: dict[str, np.ndarray],
        hashes: dict[str, str],
        role: str,
        key: str,
    ) -> None:
        self.run, self.data, self.masks, self.hashes, self.role, self.key = (
            run,
            data,
            masks,
            hashes,
            role,
            key,
        )
        self.variant, domain = split_probe_key(key)
        self.domain = domain or ALL_DOMAINS
        self.probe: nn.Module | None = None
        self.run_id: str | None = None  # its MLflow run, once tracked
        self.metrics: dict[str, float] = {}
        self.figure = None  # the calibration plot, once fitted

    def fit(self, log_epochs: bool) -> None:
        """Fit (once), test on the held-out questions and save the calibration plot."""
        if self.probe is not None:
            return
        run, data, te = self.run, self.data, self.masks["test"]
        self.probe = fit_probe(data, self.variant, self.role, self.masks, run.cfg, log_epochs=log_epochs)
        pred = predict(self.probe, data.x[self.variant][te])
        self.metrics = probe_metrics(pred, data.y[te], data.in_largest[te])
        self.figure = calibration_figure(pred, data.y[te], f"{run.pair.name} {self.role} {self.key}")
        self.plot = save_figure_atomic(self.figure, run.plots_dir / f"calibration-{self.role}-{self.key}.png")

    def run_tags(self) -> dict[str, str]:
        run = self.run
        return {
            "stage": "train",
            "pair": run.pair.name,
            "role": self.role,
            "variant": self.variant,
            "domain": self.domain,
            "model_id": self.data.model_id,
            "git_commit": run.commit,
            **run.fingerprint,
        }

    def params(self) -> dict[str, Any]:
        run = self.run
        return {
            **_probe_params(run.cfg, run.pair, self.role, self.variant, self.hashes, self.masks),
            "domain": self.domain,
        }

    def version_tags(self) -> dict[str, str]:
        """The same names and values as the run's params, plus the test metrics."""
        run = self.run
        return {
            "model_id": self.data.model_id,
            "hidden_size": str(self.data.hidden_size),
            "format": self.data.format,
            "variant": self.variant,
            "feature": FEATURE_COLUMNS.get(self.variant, "none"),
            "pooling": run.pair.pooling,
            "examples": run.cfg.examples,
            "domain": self.domain,
            "pair": run.pair.name,
            "role": self.role,
            "git_commit": run.commit,
            "samples_hash": self.hashes["samples"],
            "labels_hash": self.hashes["labels"],
            **{f"test_{k}": f"{v:.4g}" for k, v in self.metrics.items() if np.isfinite(v)},
            **run.fingerprint,
        }

    def record(self, folder: Path) -> KeptProbe:
        """What registering this probe (saved in ``folder``) needs, now or later."""
        return KeptProbe(
            role=self.role,
            key=self.key,
            folder=str(folder),
            run_name=f"probe-{self.role}-{self.key}",
            run_tags=self.run_tags(),
            params=self.params(),
            metrics={f"test_{k}": v for k, v in self.metrics.items() if np.isfinite(v)},
            version_tags=self.version_tags(),
            description=_description(self.run.pair, self.role, self.key),
            plot=str(self.plot),
        )

    def keep(self, folder: Path) -> KeptProbe:
        """Fit if not yet, save the probe under ``folder/<role>-<key>``; returns what registering it needs."""
        self.fit(log_epochs=False)
        where = folder / f"{self.role}-{self.key}"
        save_probe(self.probe, where)
        log.info("train[%s/%s] kept in %s: %s", self.role, self.key, where, self.metrics)
        return self.record(where)


@dataclass
class KeptProbe:
    """A trained probe's registration, written to ``pending.json`` when MLflow was unreachable: its run's
    name, tags, params and test metrics, its calibration plot, and the version's tags and description."""

    role: str
    key: str
    folder: str  # where the probe is saved
    run_name: str
    run_tags: dict[str, str]
    params: dict[str, Any]
    metrics: dict[str, float]
    version_tags: dict[str, str]
    description: str
    plot: str


def _description(pair: PairConfig, role: str, key: str) -> str:
    """The registered model's description: what the probe reads and what it predicts."""
    variant, domain = split_probe_key(key)
    reads = {
        "last": "the last layer's hidden states",
        "all": "the mean over all layers of the hidden states (the paper's probe)",
        "mix": "the hidden states of every layer, with learned layer weights",
        "random": "nothing: the paper's Random ablation draws a uniform number",
    }[variant]
    model_cfg = pair.role(role)
    return (
        f"SemanticSpec probe of pair {pair.name}, role {role} ({model_cfg.model_id}). Reads {reads}, pooled over "
        f"a reasoning step ({pair.pooling} pooling), and predicts the step's semantic probability: the share of the {role}'s sampled "
        f"continuations of the same prefix that mean the same thing. Trained on "
        f"{'every domain' if domain is None else f'the {domain} questions only'}. Decoding loads the version "
        f"with alias champion."
    )


def _probe_params(
    cfg: TrainConfig,
    pair: PairConfig,
    role: str,
    variant: str,
    hashes: dict[str, str],
    masks: dict[str, np.ndarray],
) -> dict[str, Any]:
    """The MLflow params of one probe's training run."""
    return {
        "pair": pair.name,
        "role": role,
        "variant": variant,
        "feature": FEATURE_COLUMNS.get(variant, "none"),
        "pooling": pair.pooling,
        "hidden": cfg.hidden(role) if variant != "random" else [],
        "lr": cfg.lr,
        "betas": cfg.betas,
        "weight_decay": cfg.weight_decay,
        "batch_size": cfg.batch_size,
        "seed": cfg.seed,
        "max_epochs": cfg.max_epochs,
        "patience": cfg.patience,
        "examples": cfg.examples,
        "train_fraction": cfg.train_fraction,
        "samples_hash": hashes["samples"],
        "labels_hash": hashes["labels"],
        **{f"n_{k}": int(masks[k].sum()) for k in ("train", "val", "test")},
    }
