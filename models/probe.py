"""Semantic-probability probes: pooled hidden state -> P(the model means the same thing here).

* :class:`ProbeMLP` (a LightningModule): standardised input -> MLP (ReLU) -> sigmoid, MSE loss,
  AdamW. ``feature`` picks the input: ``last`` (h_last [D]), ``all`` (h_mean [D], the paper's method)
  or ``mix`` (h_layers [L+1, D] combined by learned softmax weights over layers — our extension).
* :class:`RandomProbe`: the paper's Random ablation, uniform random output, loadable like any probe.
"""

from __future__ import annotations

import itertools

import lightning as L
import torch
from torch import nn

FEATURES = ("last", "all", "mix")
SIGMA_FLOOR = 1e-6  # a standard deviation below this counts as constant


class ProbeMLP(L.LightningModule):
    """MLP probe with input standardisation (statistics of the training split, stored as buffers)."""

    def __init__(
        self,
        input_dim: int,
        hidden: list[int],
        feature: str = "all",
        num_layers: int | None = None,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.95),
        weight_decay: float = 0.01,
    ) -> None:
        super().__init__()
        if feature not in FEATURES:
            raise ValueError(f"feature must be one of {FEATURES}, got {feature!r}")
        if feature == "mix" and not num_layers:
            raise ValueError("feature 'mix' needs num_layers (the L+1 hidden-state layers)")
        if input_dim < 1 or any(h < 1 for h in hidden):
            raise ValueError(f"input_dim and hidden widths must be positive, got {input_dim}, {hidden}")
        self.save_hyperparameters()
        self.feature, self.input_dim, self.num_layers = feature, input_dim, num_layers
        shape = (num_layers, input_dim) if feature == "mix" else (input_dim,)
        self.register_buffer("mu", torch.zeros(shape))
        self.register_buffer("sigma", torch.ones(shape))
        if feature == "mix":
            self.layer_logits = nn.Parameter(torch.zeros(num_layers))  # softmax weights over layers
        dims = [input_dim, *hidden]
        layers: list[nn.Module] = []
        for a, b in itertools.pairwise(dims):
            layers += [nn.Linear(a, b), nn.ReLU()]
        layers.append(nn.Linear(dims[-1], 1))
        self.mlp = nn.Sequential(*layers)

    def set_standardization(self, x: torch.Tensor) -> None:
        """Fit the input standardisation on training inputs ``x`` (N, D) or (N, L+1, D).

        Population statistics (defined for a single row); a dimension that does not vary in training
        keeps scale 1, as in scikit-learn's ``StandardScaler``, so an unseen value cannot blow up.
        """
        if x.shape[0] < 1:
            raise ValueError("set_standardization needs at least one training row")
        x = x.float()
        if not torch.isfinite(x).all():
            raise ValueError("training inputs contain NaN or infinite values: re-run the sample stage")
        sigma = x.std(dim=0, correction=0)
        self.mu.copy_(x.mean(dim=0))
        self.sigma.copy_(torch.where(sigma < SIGMA_FLOOR, torch.ones_like(sigma), sigma))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, D) or (B, L+1, D) for mix -> probability (B,)."""
        z = (x.float() - self.mu) / self.sigma
        if self.feature == "mix":
            w = torch.softmax(self.layer_logits, dim=0)  # (L+1,)
            z = torch.einsum("bld,l->bd", z, w)  # (B, D)
        return torch.sigmoid(self.mlp(z)).squeeze(-1)

    def _loss(self, batch) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y.float())

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("train_mse", loss, on_step=False, on_epoch=True, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_mse", self._loss(batch), on_step=False, on_epoch=True, prog_bar=True)

    def configure_optimizers(self):
        hp = self.hparams
        return torch.optim.AdamW(
            self.parameters(), lr=hp.lr, betas=tuple(hp.betas), weight_decay=hp.weight_decay
        )


class RandomProbe(nn.Module):
    """Uniform random output whatever the input (the paper's Random ablation)."""

    def __init__(self, input_dim: int, feature: str = "all", seed: int = 0) -> None:
        super().__init__()
        self.feature, self.input_dim, self.seed = feature, input_dim, seed
        self.generator = torch.Generator().manual_seed(seed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, ...) -> uniform [0, 1) (B,)."""
        return torch.rand(x.shape[0], generator=self.generator)

    def __getstate__(self):
        state = self.__dict__.copy()
        state["generator"] = None  # generators do not pickle; re-seeded on load
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self.generator = torch.Generator().manual_seed(self.seed)


def probe_input(probe: nn.Module, pooled) -> torch.Tensor:
    """The probe's input built from a :class:`semspec.models.lm.Pooled` -> (1, D) or (1, L+1, D)."""
    return pooled.feature(probe.feature)[None]


@torch.inference_mode()
def probe_probability(probe: nn.Module, pooled) -> float:
    """Semantic probability the probe assigns to one pooled step."""
    return float(probe(probe_input(probe, pooled))[0])
