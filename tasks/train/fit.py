"""Fitting one probe with Lightning: trained on the train split, early-stopped on validation MSE, one fit
per ``train.search`` candidate shape (the lowest validation MSE kept); the Random probe; predictions."""

from __future__ import annotations

import contextlib
import logging
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path

import lightning as L
import mlflow
import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from semspec.models.project.pairs import project_root
from semspec.models.spec.probe import ProbeMLP, RandomProbe
from semspec.tasks.config import TrainConfig
from semspec.tasks.train.data import ProbeData

log = logging.getLogger(__name__)

MIN_TRAIN_ROWS = 2  # fewer cannot be standardised or early-stopped meaningfully


class _MlflowEpochs(L.Callback):
    """Per-epoch train/val MSE into the active MLflow run."""

    def on_train_epoch_end(self, trainer, pl_module):  # runs after this epoch's validation
        m = {k: float(v) for k, v in trainer.callback_metrics.items() if k in ("train_mse", "val_mse")}
        if m:
            mlflow.log_metrics(m, step=trainer.current_epoch)


def fit_probe(
    data: ProbeData,
    variant: str,
    role: str,
    masks: dict[str, np.ndarray],
    cfg: TrainConfig,
    log_epochs: bool = False,
) -> nn.Module:
    """Train one probe (or build the Random one) on the train split, early-stopped on validation MSE; with
    ``train.search`` each candidate shape is fitted and the one with the lowest validation MSE returned
    (its choice in ``probe.choice``)."""
    if variant == "random":
        # each role gets its own stream: equal seeds would make p == q and accept every step
        return RandomProbe(data.hidden_size, "all", seed=2 * cfg.seed + (role == "target"))
    tr, va = masks["train"], masks["val"]
    n_train = int(tr.sum())
    if n_train < MIN_TRAIN_ROWS:
        raise ValueError(
            f"{role} probe: only {n_train} labelled training samples after the split by question "
            f"(need {MIN_TRAIN_ROWS}): sample more questions (ingest.max_questions) or more samples per "
            "prefix (sample.n), or keep budget-cut steps (cluster.label_length_cut: true)"
        )
    tried, candidates = [], cfg.candidates(role)
    for hidden, weight_decay in candidates:
        # per-epoch MSE goes to MLflow for a single fit only (a search's fits would share the steps)
        probe, epochs = _fit_one(
            data, variant, masks, cfg, hidden, weight_decay, log_epochs and len(candidates) == 1
        )
        val = float(np.mean((predict(probe, data.x[variant][va]) - data.y[va]) ** 2)) if va.any() else 0.0
        tried.append(
            {"hidden": hidden, "weight_decay": weight_decay, "val_mse": val, "epochs": epochs, "probe": probe}
        )
    best = min(tried, key=lambda t: t["val_mse"])
    probe = best.pop("probe")
    probe.choice = {**best, "candidates": [{k: v for k, v in t.items() if k != "probe"} for t in tried]}
    if len(tried) > 1:
        log.info(
            "train[%s/%s]: chose hidden %s, weight decay %g (validation MSE %.4f of %s)",
            role,
            variant,
            best["hidden"],
            best["weight_decay"],
            best["val_mse"],
            [round(t["val_mse"], 4) for t in tried],
        )
    return probe


def _fit_one(data, variant, masks, cfg, hidden, weight_decay, log_epochs) -> tuple[ProbeMLP, int]:
    """One probe of the given shape, early-stopped on validation MSE: (its best weights, epochs to them)."""
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    x = torch.from_numpy(data.x[variant]).float()
    y = torch.from_numpy(data.y)
    probe = ProbeMLP(
        data.hidden_size, hidden, variant, data.num_layers or None, cfg.lr, tuple(cfg.betas), weight_decay
    )
    tr, va = torch.from_numpy(masks["train"]), torch.from_numpy(masks["val"])
    probe.set_standardization(x[tr])
    train_dl = DataLoader(TensorDataset(x[tr], y[tr]), batch_size=cfg.batch_size, shuffle=True)
    val_dl = DataLoader(TensorDataset(x[va], y[va]), batch_size=1024)
    state, epochs = _fit_best_state(probe, train_dl, val_dl, cfg, log_epochs)
    best = ProbeMLP(**probe.hparams)  # a clean module (no trainer attached) with the best weights
    best.load_state_dict(state)
    bad = [k for k, t in best.state_dict().items() if not torch.isfinite(t).all()]
    if bad:
        raise RuntimeError(f"{variant} probe diverged (non-finite {', '.join(bad)}): lower train.lr")
    return best.eval(), epochs


class LitProbe(L.LightningModule):
    """A probe (a plain ``nn.Module``) as Lightning trains it: MSE loss, AdamW with the probe's settings."""

    def __init__(self, probe: ProbeMLP) -> None:
        super().__init__()
        self.probe = probe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.probe(x)

    def _loss(self, batch) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.probe(x), y.float())

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("train_mse", loss, on_step=False, on_epoch=True, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_mse", self._loss(batch), on_step=False, on_epoch=True, prog_bar=True)

    def configure_optimizers(self):
        hp = self.probe.hparams
        return torch.optim.AdamW(
            self.probe.parameters(), lr=hp["lr"], betas=tuple(hp["betas"]), weight_decay=hp["weight_decay"]
        )


@contextlib.contextmanager
def quiet_lightning() -> Iterator[None]:
    """Lightning announces the accelerators ("GPU available: False") and a cloud-logging tip at every
    Trainer, through its own handler and the root one (so twice: its import sets its logger to INFO over
    any earlier setting), and warns about its own use of a deprecated torch pytree API; per probe that is
    only noise in the stage log. Within this block its loggers keep warnings and errors only (both
    namespaces: with the standalone ``pytorch_lightning`` package imported, Lightning logs under it)."""
    loggers = [logging.getLogger(name) for name in ("lightning.pytorch", "pytorch_lightning")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*LeafSpec.* is deprecated")
            yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def _fit_best_state(
    probe: ProbeMLP, train_dl: DataLoader, val_dl: DataLoader, cfg: TrainConfig, log_epochs: bool
) -> tuple[dict[str, torch.Tensor], int]:
    """Lightning fit with early stopping on validation MSE; the weights of the best validation epoch and
    the number of epochs to it."""
    with quiet_lightning():
        return _fit_quietly(probe, train_dl, val_dl, cfg, log_epochs)


def _fit_quietly(
    probe: ProbeMLP, train_dl: DataLoader, val_dl: DataLoader, cfg: TrainConfig, log_epochs: bool
) -> tuple[dict[str, torch.Tensor], int]:
    ckpt_dir = tempfile.mkdtemp(prefix="semspec-probe-")
    ckpt = L.pytorch.callbacks.ModelCheckpoint(
        monitor="val_mse",
        mode="min",
        save_top_k=1,
        save_weights_only=True,
        dirpath=ckpt_dir,
        filename="best-{epoch}",
        enable_version_counter=False,
    )
    callbacks = [L.pytorch.callbacks.EarlyStopping("val_mse", patience=cfg.patience, mode="min"), ckpt]
    if log_epochs:
        callbacks.append(_MlflowEpochs())
    trainer = L.Trainer(
        max_epochs=cfg.max_epochs,
        accelerator="auto",
        devices=1,
        logger=False,
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
        default_root_dir=str(project_root() / ".cache" / "lightning"),
    )
    trainer.fit(LitProbe(probe), train_dl, val_dl)
    state, epochs = probe.state_dict(), trainer.current_epoch
    if ckpt.best_model_path:
        saved = torch.load(ckpt.best_model_path, map_location="cpu", weights_only=True)["state_dict"]
        state = {k.removeprefix("probe."): v for k, v in saved.items()}  # LitProbe's keys -> the probe's
        epochs = int(Path(ckpt.best_model_path).stem.split("epoch=")[-1]) + 1
    shutil.rmtree(ckpt_dir, ignore_errors=True)
    return state, epochs


@torch.inference_mode()
def predict(probe: nn.Module, x: np.ndarray) -> np.ndarray:
    """Probe outputs for rows ``x``."""
    return probe(torch.from_numpy(x).float()).numpy()
