"""Retrain policy: which configured pairs lack up-to-date champion probes or a finished evaluation of
them, and why."""

from __future__ import annotations

import json
import logging
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlflow
from mlflow.exceptions import MlflowException

from semspec.models.lm.weights import unavailable_reason
from semspec.models.project.names import CHAMPION, registered_name
from semspec.models.project.pairs import list_pairs, load_pair
from semspec.models.spec.names import PROBE_METHOD, ROLES, probe_key
from semspec.tasks.fingerprint import FINGERPRINT_REASONS, pipeline_fingerprint
from semspec.tasks.probe_registry import check_tracking

log = logging.getLogger(__name__)
NOT_EVALUATED = "not evaluated"  # the probes are up to date, their evaluation is missing or stale


def champion_status(pair: str, roles: list[str], variants: list[str], expected: dict[str, str]) -> str | None:
    """None when every ``champion`` probe of the pair (``variants``: probe keys) exists and carries the
    ``expected`` tags, or a version trained on that config stayed behind it (``train.promote: better``);
    else why the pair needs training ("no champion probe ...", "config changed ...", "data changed ...")."""
    client = mlflow.MlflowClient()
    for role in roles:
        for variant in variants:
            name = registered_name(pair, role, variant)
            try:
                mv = client.get_model_version_by_alias(name, CHAMPION)
            except MlflowException:
                return f"no champion probe {name}"
            stale = _stale_tag(mv.tags or {}, expected)
            if stale is None or _trained_since(client, name, expected):
                continue  # current, or a run on the current config trained probes that did not beat it
            key, value = stale
            why = FINGERPRINT_REASONS.get(key, f"{key} changed")
            return f"{why}: {name} v{mv.version} has {key}={(mv.tags or {}).get(key)}, now {value}"
    return None


def _stale_tag(tags: dict[str, str], expected: dict[str, str]) -> tuple[str, str] | None:
    """The first ``expected`` tag whose value ``tags`` lacks, or None."""
    return next(((k, v) for k, v in expected.items() if tags.get(k) != v), None)


def _of_config(client: mlflow.MlflowClient, name: str, version: Any, expected: dict[str, str] | None) -> bool:
    """Whether ``version`` of ``name`` was trained on the config ``expected`` tags describe."""
    if version is None or not expected:
        return False
    try:
        mv = client.get_model_version(name, str(version))
    except MlflowException:
        return False
    return _stale_tag(mv.tags or {}, expected) is None


def _trained_since(client: mlflow.MlflowClient, name: str, expected: dict[str, str]) -> bool:
    """Whether some version of ``name`` carries every ``expected`` tag: the current config was trained,
    and its probes stayed behind the champion (``train.promote: better``)."""
    versions = client.search_model_versions(f"name = '{name}'")
    return any(_stale_tag(mv.tags or {}, expected) is None for mv in versions)


def evaluation_status(
    params: Any, pair: Any, metrics: Path, expected: dict[str, str] | None = None
) -> str | None:
    """None when ``metrics`` records a finished evaluation (the evaluate stage writes it last) with the
    current settings of the current champion probes, or of probes trained on the current config
    (``expected`` tags) that stayed behind the champion; else why the evaluation must run again."""
    # heavy: only when probes are current
    from semspec.tasks.evaluate.runs import RUN_KEY, evaluation_identity

    if not metrics.is_file():
        return f"{NOT_EVALUATED}: no finished evaluation ({metrics})"
    try:
        run = json.loads(metrics.read_text(encoding="utf-8")).get(RUN_KEY)
    except (ValueError, AttributeError):
        run = None
    if not isinstance(run, dict):
        return f"{NOT_EVALUATED}: {metrics} does not record what it evaluated"
    now = evaluation_identity(params, pair, None)
    changed = [k for k in now if k != "probes" and run.get(k) != now[k]]
    if changed:
        return f"{NOT_EVALUATED}: the evaluation was run with other settings ({', '.join(changed)})"
    if PROBE_METHOD in params.evaluate.methods:
        client = mlflow.MlflowClient()
        for role in ROLES:
            for v in params.evaluate.probe_variants:
                key = probe_key(v, params.evaluate.probe_domain)
                name = registered_name(pair.name, role, key)
                try:
                    version = client.get_model_version_by_alias(name, CHAMPION).version
                except MlflowException:
                    return f"{NOT_EVALUATED}: no champion probe {name} to evaluate"
                done = (run.get("probes") or {}).get(f"{role}-{key}")
                if str(done) != str(version) and not _of_config(client, name, done, expected):
                    return f"{NOT_EVALUATED}: {name}'s champion v{version} was not evaluated"
    return None


def pair_statuses(params: Any, eval_metrics: Callable[[str], Path] | None = None) -> dict[str, str | None]:
    """For every pair in ``conf/pairs/``: None when its champion probes match the current pair file,
    params and data (``pipeline_fingerprint``) and, when ``retrain.stages`` evaluates, ``eval_metrics(pair)``
    records a finished evaluation of them; else why it needs work (``NOT_EVALUATED...``: only the
    evaluation). An unreadable pair file gives ``"invalid: ..."`` and a pair whose models cannot be loaded
    here (not cached offline, no GPU) ``"unavailable: ..."``; both are reported, never trained. An
    MLflow server that cannot be reached is an error within seconds (the registry says what is trained)."""
    check_tracking()
    out: dict[str, str | None] = {}
    for name in list_pairs():
        try:
            cfg = load_pair(name, split_strategy=params.split_strategy)
        except ValueError as e:
            log.error("pair %s: %s", name, e)
            out[name] = f"invalid: {e}"
            continue
        missing = [why for s in (cfg.draft, cfg.target, cfg.judge) if (why := unavailable_reason(s))]
        if missing:
            out[name] = f"unavailable: {'; '.join(missing)}"
            continue
        keys = [probe_key(v, d) for d in params.train.domain_list() for v in params.train.variants]
        out[name] = champion_status(name, list(params.sample.roles), keys, pipeline_fingerprint(params, cfg))
        if out[name] is None and eval_metrics is not None and "evaluate" in params.retrain.stages:
            expected = pipeline_fingerprint(params, cfg)
            out[name] = evaluation_status(params, cfg, eval_metrics(name), expected)
    return out


_REGISTERED_RE = re.compile(r"^semspec-(.+)-(?:draft|target)-(?:random|last|all|mix)(?:-[A-Za-z0-9_.]+)?$")
OUTPUT_FOLDERS = ("data", "eval", "reports")  # where the stages write data/<pair>/, eval/<pair>/, ...


def orphans(root: Path) -> dict[str, list[str]]:
    """What semspec keeps for pairs whose file is gone from ``conf/pairs/``: registered probe models,
    MLflow experiments and output folders (``data/<pair>/``, ``eval/<pair>/``, ``reports/<pair>/``, and
    named runs ``<pair>-<name>``), each listed by name."""
    pairs = set(list_pairs())
    client = mlflow.MlflowClient()
    models = [
        m.name
        for m in client.search_registered_models(filter_string="name LIKE 'semspec-%'")
        if (match := _REGISTERED_RE.match(m.name)) and match.group(1) not in pairs
    ]
    experiments = [
        e.name
        for e in client.search_experiments(filter_string="name LIKE 'semspec-%'")
        if e.name.removeprefix("semspec-") not in pairs
    ]
    folders = [
        str(d.relative_to(root))
        for top in OUTPUT_FOLDERS
        if (root / top).is_dir()
        for d in sorted((root / top).iterdir())
        if d.is_dir() and not d.name.startswith(".") and not _of_a_pair(d.name, pairs)
    ]
    return {"registered models": sorted(models), "experiments": sorted(experiments), "folders": folders}


def _of_a_pair(name: str, pairs: set[str]) -> bool:
    """Whether an output folder belongs to a configured pair: its name, or its name and a suffix (a named
    run such as ``eval/qwen-coder-accuracy``)."""
    return any(name == p or name.startswith(f"{p}-") for p in pairs)


def prune(root: Path, found: dict[str, list[str]]) -> None:
    """Delete what ``orphans`` found: the registered models, the experiments (MLflow's soft delete: the
    UI's trash restores them) and the folders."""
    client = mlflow.MlflowClient()
    for name in found["registered models"]:
        client.delete_registered_model(name)
    for name in found["experiments"]:
        exp = client.get_experiment_by_name(name)
        if exp is not None:
            client.delete_experiment(exp.experiment_id)
    for folder in found["folders"]:
        shutil.rmtree(root / folder)
