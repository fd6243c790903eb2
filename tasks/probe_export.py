"""``semspec probes export``: a pair's champion probes out of the MLflow registry into a folder that travels
(``semspec.models.project.probe_card``: safetensors + one JSON card); ``semspec.tasks.probe_import`` reads
such a folder back into a registry, with the tags they had, so ``load_probe`` accepts them."""

from __future__ import annotations

import logging
import math
import os
import shutil
import tempfile
from datetime import UTC, datetime
from pathlib import Path

import mlflow
from mlflow.exceptions import MlflowException

from semspec.models.lm.pair import PairConfig
from semspec.models.project.names import CHAMPION, registered_name
from semspec.models.project.probe_card import (
    CARD_FILE,
    CARD_VERSION,
    FLOORS,
    CardProbe,
    ProbeCard,
    probe_folder_name,
    write_card,
)
from semspec.models.spec.names import FEATURE_COLUMNS, ROLES, probe_key, split_probe_key
from semspec.models.spec.probe import CONFIG_FILE, WEIGHTS_FILE, load_probe_folder, sha256_of
from semspec.tasks.probe_registry import (
    check_tracking,
    registered_version,
)

log = logging.getLogger(__name__)

IMPORT_STAGE = "import"  # the stage tag of the MLflow runs that register imported probes
ROUTING_PREFIX = "routing_"  # train logs its routing metrics on each probe run under this prefix
DATA_HASH_TAGS = ("samples_hash", "labels_hash", "source_hash")  # what a train run tags its data by


# ----------------------------------------------------------------------------------- export
def champion_variants(pair: str) -> list[str]:
    """The probe keys of ``pair`` whose draft and target probes both have a ``champion`` version in the
    registry, sorted."""
    client = mlflow.MlflowClient()
    prefix = f"semspec-{pair}-"
    found: dict[str, set[str]] = {}
    token = None
    while True:
        page = client.search_registered_models(filter_string=f"name LIKE '{prefix}%'", page_token=token)
        for rm in page:
            role_key = _role_key(rm.name, pair)
            if role_key is not None and _has_champion(client, rm.name):
                found.setdefault(role_key[1], set()).add(role_key[0])
        token = page.token
        if not token:
            break
    return sorted(k for k, roles in found.items() if roles == set(ROLES))


def _role_key(name: str, pair: str) -> tuple[str, str] | None:
    """``(role, probe key)`` of registry name ``semspec-<pair>-<role>-<variant>[-<domain>]``; None for a
    name of another pair or no probe."""
    rest = name.removeprefix(f"semspec-{pair}-")
    role, _, tail = rest.partition("-")
    if rest == name or role not in ROLES:
        return None
    variant, _, domain = tail.partition("-")
    try:
        key = probe_key(variant, domain or None)
    except ValueError:
        return None
    return (role, key) if registered_name(pair, role, key) == name else None


def _has_champion(client: mlflow.MlflowClient, name: str) -> bool:
    try:
        client.get_model_version_by_alias(name, CHAMPION)
    except MlflowException:
        return False
    return True


def export_probes(
    pair: str | PairConfig, out_dir: Path, variants: list[str] | None = None, overwrite: bool = False
) -> Path:
    """Write each role's ``champion`` probe of each of ``variants`` (probe keys; default: every key with
    champions for both roles) of ``pair`` (a name or path ``load_pair`` reads, or a parsed pair) into
    ``out_dir`` with the card ``semspec-probes.json``; returns ``out_dir``. The folder is written whole in
    a temporary folder beside it and renamed into place. An existing non-empty ``out_dir`` is refused,
    unless ``overwrite`` and it holds an earlier export (a card)."""
    from semspec.models.project.pairs import load_pair

    cfg = pair if isinstance(pair, PairConfig) else load_pair(pair)
    out_dir = Path(out_dir)
    _check_target(out_dir, overwrite)
    check_tracking()
    keys = list(variants) if variants else champion_variants(cfg.name)
    if not keys:
        raise ValueError(
            f"pair {cfg.name!r} has no champion probes for both roles in {mlflow.get_tracking_uri()}: train "
            f"them with `semspec train --pair {cfg.name}` (or `dvc repro train`), or point "
            f"MLFLOW_TRACKING_URI at the registry that holds them"
        )
    for key in keys:
        split_probe_key(key)  # a clear error on a key no probe can have
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        probes = {key: {role: _export_one(cfg, role, key, tmp) for role in ROLES} for key in keys}
        exported_at = datetime.now(UTC).isoformat(timespec="seconds")
        write_card(ProbeCard(CARD_VERSION, cfg.name, probes, exported_at), tmp)
        shutil.rmtree(tmp / ".download", ignore_errors=True)
        _replace(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("exported %d probe variant(s) of %s to %s: %s", len(keys), cfg.name, out_dir, keys)
    return out_dir


def _check_target(out_dir: Path, overwrite: bool) -> None:
    """Refuse a file, or a non-empty folder unless ``overwrite`` and it holds an earlier export."""
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"{out_dir} is a file: pass a folder to export the probes into")
    if not out_dir.is_dir() or not any(out_dir.iterdir()):
        return
    if not overwrite:
        raise ValueError(f"{out_dir} is not empty: pass an empty or new folder, or --overwrite to replace it")
    if not (out_dir / CARD_FILE).is_file():
        raise ValueError(
            f"{out_dir} is not empty and holds no {CARD_FILE} (not an earlier export): --overwrite replaces "
            f"only exported probe folders; pass an empty or new folder"
        )


def _replace(tmp: Path, out_dir: Path) -> None:
    """Move the finished folder ``tmp`` to ``out_dir``, replacing what is there (checked beforehand)."""
    old = None
    if out_dir.exists():
        old = out_dir.parent / f".{out_dir.name}.old-{os.getpid()}"
        os.replace(out_dir, old)
    try:
        os.replace(tmp, out_dir)
    except OSError:
        if old is not None:
            os.replace(old, out_dir)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _export_one(cfg: PairConfig, role: str, key: str, tmp: Path) -> CardProbe:
    """Copy the champion of ``semspec-<pair>-<role>-<key>`` into ``tmp`` (checked against its sha256
    tag) and describe it for the card."""
    mv = registered_version(cfg.name, role, key)
    name, tags = registered_name(cfg.name, role, key), dict(mv.tags or {})
    where = f"probe {name} v{mv.version}"
    if "sha256" not in tags or "model_id" not in tags or "hidden_size" not in tags:
        raise ValueError(
            f"{where} lacks the sha256, model_id or hidden_size tag (stored in an older format): retrain "
            f"the pair's probes (`semspec train --pair {cfg.name}`) before exporting them"
        )
    scratch = tmp / ".download" / f"{role}-{key}"
    scratch.mkdir(parents=True)
    src = Path(mlflow.artifacts.download_artifacts(artifact_uri=mv.source, dst_path=str(scratch)))
    load_probe_folder(src, tags["sha256"], where)  # a tampered or old-format probe is refused here
    dest = tmp / probe_folder_name(role, key)
    dest.mkdir()
    for file in (WEIGHTS_FILE, CONFIG_FILE):
        shutil.copyfile(src / file, dest / file)
    metrics, routing = _run_metrics(mv.run_id, tags)
    model_cfg = cfg.role(role)
    pinned = model_cfg.sha256.lower() if model_cfg.sha256 and model_cfg.model_id == tags["model_id"] else None
    if model_cfg.model_id != tags["model_id"]:
        log.warning(
            "%s was trained on %s, the pair file's %s is %s",
            where,
            tags["model_id"],
            role,
            model_cfg.model_id,
        )
    hashes = {k: tags[k] for k in DATA_HASH_TAGS if tags.get(k)}
    return CardProbe(
        path=dest.name,
        model_id=tags["model_id"],
        model_sha256=pinned,
        format=tags.get("format", "bfloat16"),  # versions without the tag predate formats (load_probe's rule)
        feature=tags.get("feature", FEATURE_COLUMNS.get(split_probe_key(key)[0], "none")),
        hidden_size=int(tags["hidden_size"]),
        pooling=tags.get("pooling", "predict"),  # likewise: versions without it predate the setting
        sha256=sha256_of(dest / WEIGHTS_FILE),
        config_sha256=sha256_of(dest / CONFIG_FILE),
        registry={"name": name, "version": str(mv.version), "run_id": mv.run_id or None},
        metrics=metrics,
        routing=routing,
        floors={f: float(tags[f]) if tags.get(f) is not None else None for f in FLOORS},
        data_hash=hashes or None,
        description=_description(name),
        tags=tags,
    )


def _run_metrics(run_id: str | None, tags: dict[str, str]) -> tuple[dict[str, float], dict[str, float]]:
    """The train run's metrics (latest values) of a version: (its own, its variant's routing metrics with
    the ``routing_`` prefix dropped), finite values only; without the run, the version's ``test_*`` tags."""
    found: dict[str, float] = {}
    if run_id:
        try:
            found = dict(mlflow.MlflowClient().get_run(run_id).data.metrics)
        except MlflowException:
            log.warning("run %s of a registered probe is gone: the card keeps its test_* tags", run_id)
    if not found:
        found = {k: float(v) for k, v in tags.items() if k.startswith("test_") and _is_float(v)}
    found = {k: float(v) for k, v in found.items() if math.isfinite(v)}
    own = {k: v for k, v in found.items() if not k.startswith(ROUTING_PREFIX)}
    routing = {k.removeprefix(ROUTING_PREFIX): v for k, v in found.items() if k.startswith(ROUTING_PREFIX)}
    return own, routing


def _is_float(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _description(name: str) -> str:
    try:
        return mlflow.MlflowClient().get_registered_model(name).description or ""
    except MlflowException:
        return ""
