"""Probes that travel: the card of a folder of exported probes, its checks against a pair, and loading a
probe from such a folder, without MLflow.

``semspec probes export`` (``semspec.tasks.probe_export``) writes, for each exported probe variant and
role, the probe as ``save_probe`` stores it (``probe.safetensors`` + ``probe.json``) and one card,
``semspec-probes.json``, that says what each probe reads and where it came from::

    <folder>/
      semspec-probes.json       the card (CARD_FILE)
      draft-all/                one folder per (role, probe key): probe.safetensors + probe.json
      target-all/
      draft-all-math/           a probe of one domain (key ``all@math``)
      ...

This module holds the card's schema (``ProbeCard``, ``CardProbe``; parsed by ``card_from_json``, written by
``write_card``), checks the card against a pair before any model loads (``check_card``: the format check is
why it imports ``models/cpu``) and loads a probe after checking that it fits the model it will read
(``load_card_probe``), as ``semspec.tasks.probe_registry.load_probe`` does for registry versions. Finding
such a folder (local, or a Hugging Face Hub repo) and reading its card is ``probe_folder``. It imports
torch only: never mlflow.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from torch import nn

from semspec.models.cpu.formats import resolve_format
from semspec.models.lm.pair import PairConfig
from semspec.models.spec.names import ROLES, split_probe_key
from semspec.models.spec.probe import CONFIG_FILE, WEIGHTS_FILE, load_probe_folder, sha256_of

CARD_FILE = "semspec-probes.json"  # the card at the top of an exported folder
CARD_KIND = "semspec-probes"  # the card's ``kind``: tells it from other JSON files
CARD_VERSION = 1  # the card's ``format_version``; a reader refuses any other
# what a train run chose or measured on held-out steps (registry tags of these names): the floors, and the
# step acceptance rate ``gamma: auto`` reads
FLOORS = ("min_ratio", "min_p", "accept_rate")
_SHA_RE = re.compile(r"[0-9a-f]{64}")


def probe_folder_name(role: str, variant: str) -> str:
    """The folder of one exported probe: ``<role>-<variant>`` (``<role>-<variant>-<domain>`` for a probe
    key ``<variant>@<domain>``, the suffix of its registry name)."""
    base, domain = split_probe_key(variant)
    return f"{role}-{base}" + (f"-{domain}" if domain else "")


@dataclass(frozen=True)
class CardProbe:
    """One exported probe as the card describes it."""

    path: str  # its folder, relative to the card's folder (probe.safetensors + probe.json)
    model_id: str  # the model whose hidden states it reads (the registry tag ``model_id``)
    model_sha256: str | None  # that model file's sha256, as the pair file pins it (None: not pinned)
    format: str  # the numeric format the model ran in when its hidden states were sampled (tag ``format``)
    feature: str  # the pooled feature it reads: h_last, h_mean, h_layers, or none (Random)
    hidden_size: int  # the model's hidden size
    pooling: str  # how a step's hidden states were pooled (the pair's ``pooling``)
    sha256: str  # of probe.safetensors
    config_sha256: str  # of probe.json
    registry: dict[str, str | None]  # where it was exported from: name, version, run_id
    metrics: dict[str, float]  # what its train run logged (test_mse, test_auroc, ..., val_mse)
    routing: dict[str, float]  # its variant's routing metrics on the test questions (true_accept, ...)
    floors: dict[str, float | None]  # min_ratio and min_p chosen on validation (None: none chosen)
    data_hash: dict[str, str] | None  # samples_hash, labels_hash, source_hash as tagged (None: none)
    description: str = ""  # the registered model's description
    tags: dict[str, str] = field(default_factory=dict)  # every registry tag of its version, as they were


@dataclass(frozen=True)
class ProbeCard:
    """The card of an exported folder: the pair and, per probe key and role, a ``CardProbe``."""

    format_version: int
    pair: str
    probes: dict[str, dict[str, CardProbe]]  # probe key -> role -> probe
    exported_at: str = ""  # ISO time of the export
    folder: Path | None = field(default=None, compare=False)  # where it was read from (None: built)

    @property
    def variants(self) -> list[str]:
        """The probe keys the card holds, sorted."""
        return sorted(self.probes)

    def probe(self, variant: str, role: str) -> CardProbe:
        """The probe of ``role`` for ``variant``; ValueError naming the keys the card holds."""
        if variant not in self.probes:
            raise ValueError(
                f"probe folder{_at(self.folder)} of pair {self.pair!r} has no probes of variant {variant!r}; "
                f"it holds {self.variants}: pick one of them, or export {variant!r} too "
                f"(`semspec probes export --pair {self.pair} DIR --variant {variant}`)"
            )
        if role not in self.probes[variant]:
            raise ValueError(f"probe folder{_at(self.folder)}: variant {variant!r} has no {role} probe")
        return self.probes[variant][role]

    def floor(self, variant: str, name: str) -> float | None:
        """The floor ``name`` (``min_ratio`` or ``min_p``; or ``accept_rate``) the train run chose (measured)
        for ``variant``: the target probe's, as ``semspec.tasks.probe_registry.registered_floor`` reads it;
        None where none was."""
        if name not in FLOORS:
            raise ValueError(f"floor must be one of {FLOORS}, got {name!r}")
        return self.probe(variant, "target").floors.get(name)

    def to_json(self) -> dict[str, Any]:
        """The card as written to ``CARD_FILE``."""
        return {
            "kind": CARD_KIND,
            "format_version": self.format_version,
            "pair": self.pair,
            "exported_at": self.exported_at,
            "probes": {
                k: {r: asdict(p) for r, p in roles.items()} for k, roles in sorted(self.probes.items())
            },
        }


def _at(folder: Path | None) -> str:
    return f" {folder}" if folder is not None else ""


def write_card(card: ProbeCard, folder: Path) -> Path:
    """Write ``card`` as ``folder/CARD_FILE``; returns its path."""
    path = folder / CARD_FILE
    path.write_text(json.dumps(card.to_json(), indent=2, sort_keys=True, allow_nan=False), encoding="utf-8")
    return path


def card_from_json(data: Any, where: str = CARD_FILE, folder: Path | None = None) -> ProbeCard:
    """A ``ProbeCard`` from its JSON mapping; ValueError naming ``where`` and the field."""
    if not isinstance(data, dict) or data.get("kind") != CARD_KIND:
        raise ValueError(f"{where}: not a semspec probe card (expected kind {CARD_KIND!r})")
    version = data.get("format_version")
    if version != CARD_VERSION:
        raise ValueError(_version_message(where, version))
    pair, probes = data.get("pair"), data.get("probes")
    if not isinstance(pair, str) or not pair:
        raise ValueError(f"{where}: field 'pair' must name the model pair")
    if not isinstance(probes, dict) or not probes:
        raise ValueError(f"{where}: field 'probes' must map probe variants to their draft and target probes")
    out: dict[str, dict[str, CardProbe]] = {}
    for key, roles in probes.items():
        try:
            split_probe_key(key)
        except ValueError as e:
            raise ValueError(f"{where}: probes[{key!r}]: {e}") from None
        if not isinstance(roles, dict) or sorted(roles) != sorted(ROLES):
            got = sorted(roles) if isinstance(roles, dict) else roles
            raise ValueError(f"{where}: probes[{key!r}] must hold exactly {list(ROLES)}, got {got}")
        out[key] = {r: _card_probe(roles[r], f"{where}: probes[{key!r}][{r!r}]") for r in ROLES}
    return ProbeCard(CARD_VERSION, pair, out, str(data.get("exported_at", "")), folder)


def _version_message(where: str, version: Any) -> str:
    return (
        f"{where}: probe card format version {version!r}, this semspec reads version {CARD_VERSION}: export "
        f"the probes again with this semspec (`semspec probes export`), or use the semspec that wrote them"
    )


def _card_probe(data: Any, where: str) -> CardProbe:
    """One probe's entry, checked field by field."""
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected a mapping")
    required = ("path", "model_id", "format", "feature", "hidden_size", "pooling", "sha256", "config_sha256")
    missing = [k for k in required if k not in data]
    if missing:
        raise ValueError(f"{where}: missing field(s) {missing}")
    rel = PurePosixPath(str(data["path"]))
    if rel.is_absolute() or ".." in rel.parts or "\\" in str(rel) or not rel.parts:
        raise ValueError(f"{where}: field 'path' must be a folder inside the card's folder, got {rel}")
    for name in ("sha256", "config_sha256"):
        if not isinstance(data[name], str) or not _SHA_RE.fullmatch(data[name]):
            raise ValueError(f"{where}: field {name!r} must be 64 lower-case hex digits")
    if data.get("model_sha256") is not None and not _SHA_RE.fullmatch(str(data["model_sha256"])):
        raise ValueError(f"{where}: field 'model_sha256' must be 64 lower-case hex digits or null")
    try:
        hidden = int(data["hidden_size"])
    except (TypeError, ValueError):
        raise ValueError(f"{where}: field 'hidden_size' must be an integer") from None
    try:
        return _entry(data, str(rel), hidden)
    except (TypeError, ValueError, AttributeError) as e:  # metrics {"auroc": [1]}, floors "x", tags [] ...
        raise ValueError(f"{where}: a malformed field ({type(e).__name__}: {e})") from None


def _entry(data: dict, rel: str, hidden: int) -> CardProbe:
    """The entry's fields converted to their types (a wrong type raises TypeError or ValueError)."""
    floors = data.get("floors") or {}
    return CardProbe(
        path=rel,
        model_id=str(data["model_id"]),
        model_sha256=data.get("model_sha256"),
        format=str(data["format"]),
        feature=str(data["feature"]),
        hidden_size=hidden,
        pooling=str(data["pooling"]),
        sha256=data["sha256"],
        config_sha256=data["config_sha256"],
        registry=dict(data.get("registry") or {}),
        metrics={k: float(v) for k, v in (data.get("metrics") or {}).items()},
        routing={k: float(v) for k, v in (data.get("routing") or {}).items()},
        floors={k: None if floors.get(k) is None else float(floors[k]) for k in FLOORS},
        data_hash=data.get("data_hash") or None,
        description=str(data.get("description") or ""),
        tags={str(k): str(v) for k, v in (data.get("tags") or {}).items()},
    )


# ----------------------------------------------------------------------------------- checking
def check_card(card: ProbeCard, pair: PairConfig, variant: str, check_format: bool = True) -> None:
    """Check, before any model loads, that ``card`` holds probes of ``variant`` for ``pair``: the card's
    version, the pair's name, both roles' model ids, the pair's pooling, the model files' sha256 where
    both the card and the pair file pin one and, with ``check_format``, the format each model resolves to
    on this machine; with the card's folder known, that both probes' files are there and unaltered.
    Every mismatch is a ValueError that says what to do."""
    where = f"probe folder{_at(card.folder)}"
    if card.format_version != CARD_VERSION:
        raise ValueError(_version_message(where, card.format_version))
    if card.pair != pair.name:
        raise ValueError(
            f"{where} holds probes of pair {card.pair!r}, not of {pair.name!r}: load it with pair "
            f"{card.pair!r} (a pair file of that name, with the same models), or export {pair.name!r}'s probes"
        )
    for role in ROLES:
        entry, model_cfg = card.probe(variant, role), pair.role(role)
        what = f"{where}: the {role} probe of {variant!r}"
        if entry.model_id != model_cfg.model_id:
            raise ValueError(
                f"{what} was trained on {entry.model_id!r}, and pair {pair.name!r} has {model_cfg.model_id!r} "
                f"as its {role}: use the pair file the probes were trained with, or train probes for "
                f"this one (`semspec train --pair {pair.name}`)"
            )
        if entry.pooling != pair.pooling:
            raise ValueError(
                f"{what} read hidden states pooled by {entry.pooling!r}, the pair pools by "
                f"{pair.pooling!r}: set the pair file's `pooling: {entry.pooling}`, or retrain the pair's "
                f"probes (`semspec train --pair {pair.name}`)"
            )
        if entry.model_sha256 and model_cfg.sha256 and entry.model_sha256 != model_cfg.sha256.lower():
            raise ValueError(
                f"{what} was trained on a {entry.model_id} file of sha256 {entry.model_sha256}, and the pair "
                f"file pins {model_cfg.sha256.lower()}: use the model file the probes were trained on, or retrain "
                f"the pair's probes (`semspec train --pair {pair.name}`)"
            )
        if check_format:
            here = resolve_format(model_cfg.dtype, model_cfg.device).name
            if entry.format != here:
                raise ValueError(_format_message(what, entry.model_id, entry.format, here, pair.name))
        if card.folder is not None:
            _check_files(card.folder, entry, what)


def _format_message(what: str, model_id: str, trained: str, here: str, pair: str) -> str:
    return (
        f"{what} read hidden states of {model_id} run in {trained}, and the model runs in {here} here "
        f"(the pair file's `dtype`, resolved for this machine): set the model's `dtype: {trained}` in the "
        f"pair file, or train the pair's probes here (`semspec train --pair {pair}`, after `semspec sample`)"
    )


def _check_files(folder: Path, entry: CardProbe, where: str) -> None:
    """Both files of ``entry`` exist in ``folder`` and match the card's sha256s."""
    probe_dir = folder / entry.path
    for name, sha in ((WEIGHTS_FILE, entry.sha256), (CONFIG_FILE, entry.config_sha256)):
        path = probe_dir / name
        if not path.is_file():
            raise ValueError(f"{where}: {path} is missing: copy the whole exported folder")
        if sha256_of(path) != sha:
            raise ValueError(
                f"{where}: {path} does not match its recorded sha256 (altered or corrupt): export it again"
            )


def load_card_probe(
    folder: str | Path,
    card: ProbeCard,
    role: str,
    variant: str,
    model_id: str,
    hidden_size: int,
    pooling: str = "predict",
    fmt: str | None = None,
) -> tuple[nn.Module, str]:
    """The exported probe of ``role`` for ``variant`` in ``folder`` and its weights' sha256, after checking
    from the card — before any weights are read — that it was trained on the hidden states of
    ``model_id`` with ``hidden_size``, pooled as ``pooling`` and, with ``fmt`` given, of the model run in
    that format (as ``semspec.tasks.probe_registry.load_probe`` checks registry versions); its files must
    match the card's sha256s. Every mismatch and a tampered file are clear ``ValueError``s."""
    folder = Path(folder)
    entry = card.probe(variant, role)
    where = f"probe {role}-{variant} in {folder}"
    if entry.model_id != model_id:
        raise ValueError(f"{where} was trained on {entry.model_id!r}, not on {model_id!r}")
    if entry.hidden_size != hidden_size:
        raise ValueError(f"{where} expects hidden size {entry.hidden_size}, the model has {hidden_size}")
    if entry.pooling != pooling:
        raise ValueError(
            f"{where} read hidden states pooled by {entry.pooling!r}, the pair pools by {pooling!r}: set the "
            f"pair file's `pooling` back, or retrain the pair's probes (`semspec train --pair {card.pair}`)"
        )
    if fmt is not None and entry.format != fmt:
        raise ValueError(_format_message(where, model_id, entry.format, fmt, card.pair))
    probe_dir = folder / entry.path
    config = probe_dir / CONFIG_FILE
    if config.is_file() and sha256_of(config) != entry.config_sha256:
        raise ValueError(f"{where}: {CONFIG_FILE} does not match its recorded sha256 (altered or corrupt)")
    probe = load_probe_folder(probe_dir, entry.sha256, where)
    return probe, entry.sha256
