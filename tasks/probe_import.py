"""``semspec probes import``: an exported folder (``semspec probes export``) into the local registry, each
probe registered with the tags and metrics it had, made champion (or, with ``if_better``, only where its
card's routing score beats the registry's champion: how ``scripts/setup`` installs the shipped probes)."""

from __future__ import annotations

import logging
from pathlib import Path

import mlflow

from semspec.models.project.probe_card import CardProbe, ProbeCard, check_card
from semspec.models.project.probe_folder import read_card, resolve_probes
from semspec.models.spec.names import ALL_DOMAINS, ROLES, split_probe_key
from semspec.models.spec.probe import load_probe_folder
from semspec.tasks.probe_export import IMPORT_STAGE, ROUTING_PREFIX
from semspec.tasks.probe_registry import (
    ProbeRef,
    beats,
    champion_score,
    check_tracking,
    promote,
    register_probe,
    routing_score,
    setup_experiment,
)

log = logging.getLogger(__name__)


def import_probes(folder: str | Path, if_better: bool = False) -> list[ProbeRef]:
    """Register the probes of an exported folder (or Hub repo id, see ``resolve_probes``) in the local
    registry, in the pair's experiment: each in its own MLflow run (under one ``import-<pair>`` run) with
    the metrics its train run logged, as a new version with the tags the original had, made ``champion``
    (with ``if_better``: only the variants whose card's routing score beats the registry's champion,
    ``beats``; the others are not imported). Every probe is checked (sha256) before any is registered,
    and, where this checkout has a pair file of that name, the card against it (model ids, pooling; a
    format other than this machine's is only logged). Returns the registered probes."""
    from semspec.models.project.pairs import load_pair

    source = folder
    folder = resolve_probes(folder)
    card = read_card(folder)
    try:
        pair = load_pair(card.pair)
    except ValueError:
        pair = None
        log.warning(
            "no pair file %r here: the imported probes are checked when a decoder loads them", card.pair
        )
    for key in card.variants:
        if pair is not None:
            check_card(card, pair, key, check_format=False)
            try:
                check_card(card, pair, key)
            except ValueError as e:
                log.warning("importing anyway: %s", e)
        for role in ROLES:
            entry = card.probe(key, role)
            load_probe_folder(folder / entry.path, entry.sha256, f"probe {role}-{key} in {folder}")
    check_tracking()
    keys = [k for k in card.variants if not if_better or _better_than_champion(card, k)]
    if not keys:
        return []
    setup_experiment(card.pair)
    refs: list[ProbeRef] = []
    run_tags = {"stage": IMPORT_STAGE, "pair": card.pair, "imported_from": str(source)}
    with mlflow.start_run(run_name=f"import-{card.pair}", tags=run_tags):
        for key in keys:
            versions = {}
            for role in ROLES:
                refs.append(_import_one(card, folder, role, key, run_tags))
                versions[role] = str(refs[-1].version)
            promote(card.pair, key, versions, routing_score(card.probe(key, "target").routing), force=True)
    log.info("imported %d probe(s) of %s from %s", len(refs), card.pair, source)
    return refs


def _better_than_champion(card: ProbeCard, key: str) -> bool:
    """Whether the card's ``key`` probes route better than the registry's champion (``beats``)."""
    score = routing_score(card.probe(key, "target").routing)
    current = champion_score(card.pair, key)
    if beats(score, current):
        return True
    log.info(
        "%s probes of %s: the registry's champion (routing score %s) is at least as good as the card's "
        "(%s); not imported",
        key, card.pair, current[1], score,
    )  # fmt: skip
    return False


def _import_one(card: ProbeCard, folder: Path, role: str, key: str, run_tags: dict[str, str]) -> ProbeRef:
    """Register one probe of the card in a nested run that carries its metrics."""
    entry = card.probe(key, role)
    variant, domain = split_probe_key(key)
    tags = {
        **run_tags,
        "role": role,
        "variant": variant,
        "domain": domain or ALL_DOMAINS,
        "model_id": entry.model_id,
    }
    with mlflow.start_run(run_name=f"probe-{role}-{key}", tags=tags, nested=True):
        metrics = {**entry.metrics, **{ROUTING_PREFIX + k: v for k, v in entry.routing.items()}}
        if metrics:
            mlflow.log_metrics(metrics)
        version_tags = {k: v for k, v in _version_tags(card, entry, role, key).items() if k != "sha256"}
        ref = register_probe(
            folder / entry.path,
            card.pair,
            role,
            key,
            version_tags,
            description=entry.description or None,
            champion=False,
        )
    origin = entry.registry
    log.info("%s v%s <- %s v%s", ref.name, ref.version, origin.get("name"), origin.get("version"))
    return ref


def _version_tags(card: ProbeCard, entry: CardProbe, role: str, key: str) -> dict[str, str]:
    """The registry tags of an imported probe: the original version's, with what ``load_probe`` and the
    floors read taken from the card's fields (the same values in a card ``export_probes`` wrote)."""
    variant, domain = split_probe_key(key)
    derived = {
        "model_id": entry.model_id,
        "hidden_size": str(entry.hidden_size),
        "format": entry.format,
        "pooling": entry.pooling,
        "feature": entry.feature,
        "pair": card.pair,
        "role": role,
        "variant": variant,
        **{f: f"{v:.6g}" for f, v in entry.floors.items() if v is not None},
    }
    tags = {**entry.tags, **derived}
    tags.setdefault("domain", domain or ALL_DOMAINS)
    return tags
