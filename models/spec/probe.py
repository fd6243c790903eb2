"""Semantic-probability probes: pooled hidden state -> P(the model means the same thing here).

* :class:`ProbeMLP` (a plain ``nn.Module``: decoding needs torch alone; training wraps it in Lightning,
  ``tasks/train/fit.py``): standardised input -> MLP (ReLU) -> sigmoid; its optimiser settings (AdamW)
  travel with it. ``feature`` picks the input: ``last`` (h_last [D]), ``all`` (h_mean [D], the paper's method)
  or ``mix`` (h_layers [L+1, D] combined by learned softmax weights over layers — our extension).
* :class:`RandomProbe`: the paper's Random ablation, uniform random output, loadable like any probe.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from semspec.models.spec.names import FEATURE_COLUMNS

FEATURES = tuple(FEATURE_COLUMNS)  # the variants a trained probe can read
SIGMA_FLOOR = 1e-6  # a standard deviation below this counts as constant
WEIGHTS_FILE = "probe.safetensors"  # tensors only: loading it runs no code
CONFIG_FILE = "probe.json"  # what module to build around the weights
FORMAT_VERSION = 1
# a probe.json from elsewhere is checked before any tensor is allocated: the paper's widest probe is
# 5120-2048-512-1; these bounds leave room for any real model and refuse a file that asks for gigabytes
MAX_WIDTH = 65_536
MAX_DEPTH = 8


class ProbeMLP(nn.Module):
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
        # the constructor's arguments: a clean copy is ProbeMLP(**probe.hparams); probe.json records them
        self.hparams: dict[str, Any] = {
            "input_dim": input_dim,
            "hidden": list(hidden),
            "feature": feature,
            "num_layers": num_layers,
            "lr": lr,
            "betas": tuple(betas),
            "weight_decay": weight_decay,
        }
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


class RandomProbe(nn.Module):
    """Uniform random output whatever the input (the paper's Random ablation)."""

    def __init__(self, input_dim: int, feature: str = "all", seed: int = 0) -> None:
        super().__init__()
        self.feature, self.input_dim, self.seed = feature, input_dim, seed
        self.generator = torch.Generator().manual_seed(seed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, ...) -> uniform [0, 1) (B,)."""
        return torch.rand(x.shape[0], generator=self.generator)


def probe_input(probe: nn.Module, pooled) -> torch.Tensor:
    """The probe's input built from a :class:`semspec.models.lm.Pooled` -> (1, D) or (1, L+1, D)."""
    return pooled.feature(probe.feature)[None]


@torch.inference_mode()
def probe_probability(probe: nn.Module, pooled) -> float:
    """Semantic probability the probe assigns to one pooled step."""
    return float(probe(probe_input(probe, pooled))[0])


@torch.inference_mode()
def probe_probabilities(probe: nn.Module, pooled: list) -> list[float]:
    """Semantic probabilities of many pooled steps, in one forward: (B, D) or (B, L+1, D) -> B values."""
    if not pooled:
        return []
    x = torch.cat([probe_input(probe, p) for p in pooled])
    return [float(v) for v in probe(x)]


def probe_config(probe: nn.Module) -> dict[str, Any]:
    """The JSON description of a probe: enough to rebuild the module its weights belong to."""
    if isinstance(probe, RandomProbe):
        return {
            "format": FORMAT_VERSION,
            "kind": "random",
            "feature": probe.feature,
            "input_dim": probe.input_dim,
            "seed": probe.seed,
        }
    if isinstance(probe, ProbeMLP):
        hp = dict(probe.hparams)
        return {
            "format": FORMAT_VERSION,
            "kind": "mlp",
            "feature": hp["feature"],
            "input_dim": hp["input_dim"],
            "hidden": list(hp["hidden"]),
            "num_layers": hp["num_layers"],
            "lr": hp["lr"],
            "betas": list(hp["betas"]),
            "weight_decay": hp["weight_decay"],
        }
    raise ValueError(f"cannot store a {type(probe).__name__}: expected ProbeMLP or RandomProbe")


def save_probe(probe: nn.Module, folder: Path) -> str:
    """Write ``probe`` as ``probe.safetensors`` (its tensors, incl. the standardisation) and ``probe.json``
    (its config) into ``folder``; returns the weights file's sha256."""
    folder.mkdir(parents=True, exist_ok=True)
    config = probe_config(probe)
    tensors = {k: v.detach().contiguous().cpu() for k, v in probe.state_dict().items()}
    save_file(tensors, str(folder / WEIGHTS_FILE), metadata={"kind": config["kind"]})
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True), encoding="utf-8")
    return sha256_of(folder / WEIGHTS_FILE)


def sha256_of(path: Path) -> str:
    """Hex sha256 of a file."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def load_probe_folder(folder: Path, sha256: str | None = None, where: str | None = None) -> nn.Module:
    """The probe stored by ``save_probe`` in ``folder`` (eval mode). With ``sha256`` the weights file must
    have that hash. Anything else — a missing or altered file, a pickle-format probe, weights that do not
    fit the config — is a ``ValueError`` naming ``where`` (default: the folder)."""
    where = where or str(folder)
    weights, config_path = folder / WEIGHTS_FILE, folder / CONFIG_FILE
    if not config_path.is_file() or not weights.is_file():
        if (folder / "MLmodel").is_file() or any(folder.glob("**/*.pth")) or any(folder.glob("**/*.pkl")):
            raise ValueError(
                f"{where} is a pickle-format probe (an old format whose loading can run arbitrary code); it "
                "is refused: retrain the pair's probes (`semspec train --pair <pair>` or `dvc repro train`)"
            )
        raise ValueError(f"{where} holds no {WEIGHTS_FILE} + {CONFIG_FILE}")
    if sha256 is not None and sha256_of(weights) != sha256:
        raise ValueError(f"{where}: {WEIGHTS_FILE} does not match its recorded sha256 (altered or corrupt)")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
        probe = _build(config)
        probe.load_state_dict(load_file(str(weights)), strict=True)
    except (json.JSONDecodeError, SafetensorError, KeyError, TypeError, RuntimeError, ValueError) as e:
        raise ValueError(f"{where}: not a valid probe ({type(e).__name__}: {e})") from None
    return probe.eval()


def _build(config: dict[str, Any]) -> nn.Module:
    if config.get("format") != FORMAT_VERSION:
        raise ValueError(f"probe format {config.get('format')!r}, this version reads {FORMAT_VERSION}")
    if config["kind"] == "random":
        return RandomProbe(int(config["input_dim"]), config["feature"], seed=int(config["seed"]))
    if config["kind"] == "mlp":
        widths = [int(config["input_dim"]), *(int(h) for h in config["hidden"])]
        layers = int(config.get("num_layers") or 0)
        if len(widths) > MAX_DEPTH + 1 or any(w > MAX_WIDTH for w in widths) or layers > MAX_WIDTH:
            raise ValueError(
                f"probe widths {widths} exceed what a probe may be ({MAX_DEPTH} hidden layers of at most "
                f"{MAX_WIDTH}): refused before anything is allocated"
            )
        return ProbeMLP(
            int(config["input_dim"]),
            [int(h) for h in config["hidden"]],
            config["feature"],
            config["num_layers"],
            float(config["lr"]),
            tuple(config["betas"]),
            float(config["weight_decay"]),
        )
    raise ValueError(f"unknown probe kind {config['kind']!r}")
