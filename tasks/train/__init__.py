"""Stage ``train``: fit one probe per (role, feature variant) with Lightning, track it in MLflow,
register it as ``semspec-<pair>-<role>-<variant>`` with alias ``champion``. With ``train.domains`` a list,
one probe per (role, variant, domain) on that domain's questions, named ``...-<variant>-<domain>``.

Train/validation/test splits are made **by question**: no prefix of a test question is trained on.

This module holds the stage's entries (``stage``, ``run_train``) and the loop over roles, domains and variants. The package's other modules:
``data`` (feature I/O joined with the labels, one domain's rows, the splits by question, the routing
steps), ``fit`` (Lightning fitting, the shape search, ``predict``), ``metrics`` (probe and routing metrics,
the ``min_ratio`` / ``min_p`` floors), ``plots`` (calibration and variant figures), ``trained`` (one probe
of a run: fitted once, tested, its tags and params) and ``registry`` (MLflow runs and registration, the
stage's outputs, and registering later the probes kept while MLflow was unreachable).
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import mlflow
from torch import nn

from semspec.models.lm.pair import PairConfig
from semspec.models.spec.names import ALL_DOMAINS, ROLES, probe_key, split_probe_key
from semspec.tasks.config import Params, TrainConfig
from semspec.tasks.fingerprint import pipeline_fingerprint
from semspec.tasks.io import close_figure, data_hash, git_commit, save_figure_atomic
from semspec.tasks.probe_registry import TRACKING_ERRORS, check_tracking, setup_experiment
from semspec.tasks.train.data import (
    ProbeData,
    keep_questions,
    load_joint_probe_data,
    load_probe_data,
    load_routing_data,
    only_domain,
    split_by_question,
)
from semspec.tasks.train.metrics import routing_table
from semspec.tasks.train.plots import variant_figure
from semspec.tasks.train.registry import (
    PENDING_DIR,
    TRAIN_PARENT,
    champion_probes,
    log_routing,
    promote_trained,
    tag_floors,
    track_probe,
    write_outputs,
    write_pending,
)
from semspec.tasks.train.trained import KeptProbe, Trained, TrainRun

__all__ = ["run_train", "stage"]

log = logging.getLogger(__name__)


def stage(
    *,
    params: Params,
    pair: PairConfig,
    samples: Path,
    cross: Path,
    labels: Path,
    out: Path,
    metrics: Path,
    plots: Path,
) -> dict[str, Any]:
    """Stage train (the CLI's and dvc.yaml's entry): fit, evaluate, log and register every probe, tagged
    with the pipeline fingerprint; returns the test metrics ``{role: {variant: {...}}}``."""
    if params.train.register:
        check_tracking()
    fingerprint = pipeline_fingerprint(params, pair)
    return run_train(
        params.train, pair, samples, labels, out, metrics, plots, fingerprint=fingerprint, cross_dir=cross
    )


def run_train(
    cfg: TrainConfig,
    pair: PairConfig,
    samples_dir: Path,
    labels_dir: Path,
    out_dir: Path,
    metrics_path: Path,
    plots_dir: Path,
    roles: list[str] | None = None,
    fingerprint: dict[str, str] | None = None,
    cross_dir: Path | None = None,
) -> dict[str, Any]:
    """Train, evaluate on the held-out questions, log to MLflow and register every probe.

    ``train.examples: both`` trains each probe on its model's features over both models' steps
    (``cross_dir``, the cross stage's output) with the joint labels (``labels_dir/joint.parquet``). With
    both available, the routing metrics of each variant (``routing_table``) are measured on the test
    questions' draft-written steps, logged beside the MSE and written under ``_routing``.

    The probes are stored once, as MLflow run artifacts (safetensors + JSON) that the registry's versions
    point at; ``out_dir/probes.json`` (the DVC out) records each one's name, version, URI and sha256, so
    ``dvc repro`` and the registry name the same probes. ``fingerprint``
    (``semspec.tasks.fingerprint.pipeline_fingerprint``) tags every run and version, so a scheduled retrain
    can tell which pairs changed. Writes the test metrics to ``metrics_path`` and calibration plots to
    ``plots_dir``; returns the metrics ``{role: {variant: {...}}}``.
    """
    roles = roles or sorted(p.stem for p in labels_dir.glob("*.parquet") if p.stem in ROLES)
    if not roles:
        raise ValueError(f"no labels in {labels_dir}: run the cluster stage first")
    setup_experiment(pair.name)
    run = TrainRun(cfg, pair, plots_dir, git_commit(), fingerprint or {})
    done = _train_in_parent_run(run, roles, samples_dir, labels_dir, out_dir, cross_dir)
    if done.kept:
        write_pending(run, roles, done.pointers, done.kept, done.metrics, metrics_path, out_dir)
        raise ValueError(
            f"train: MLflow became unreachable; {len(done.kept)} trained probe(s) are kept in "
            f"{out_dir / PENDING_DIR} ({len(done.pointers)} were registered before). Once MLflow is back, "
            f"register them without retraining: semspec register --pair {pair.name} --probes {out_dir}"
        )
    pointers = {"params": asdict(cfg), "roles": roles, "probes": done.pointers}
    write_outputs(done.metrics, metrics_path, pointers, out_dir)
    return done.metrics


def _train_in_parent_run(
    run: TrainRun,
    roles: list[str],
    samples_dir: Path,
    labels_dir: Path,
    out_dir: Path,
    cross_dir: Path | None,
) -> _Outcome:
    """Every probe, each nested under the stage's parent MLflow run, then the run's summary
    (``_summarise``). MLflow lost while the parent run closes is a warning when probes are kept locally
    already (they are registered later), an error otherwise."""
    done: _Outcome | None = None
    parent_tags = {"stage": TRAIN_PARENT, "pair": run.pair.name, "git_commit": run.commit, **run.fingerprint}
    try:
        with mlflow.start_run(
            run_name=f"train-{run.pair.name}", tags=parent_tags
        ):  # the probes nest under it
            done = _train_roles(run, roles, samples_dir, labels_dir, out_dir, cross_dir)
            _summarise(run, done, samples_dir, labels_dir, cross_dir)
    except TRACKING_ERRORS as e:
        if done is None or not done.kept:
            raise
        log.warning("train: MLflow unreachable while closing the run: %s", e)
    return done


def _summarise(
    run: TrainRun, done: _Outcome, samples_dir: Path, labels_dir: Path, cross_dir: Path | None
) -> None:
    """On the parent run: the routing metrics (kept in ``done.metrics["_routing"]``), logged on the probe
    runs with the chosen floors tagged on their versions, and the variants figure; only the metrics when
    probes were kept locally (MLflow is gone)."""
    routing, champions = _routing(done.trained, samples_dir, cross_dir, labels_dir, run.cfg.variants)
    if routing:
        done.metrics["_routing"] = routing
        if not done.kept:
            log_routing(routing, done.trained)
            tag_floors(routing, done.pointers)
    if not done.kept:
        promote_trained(run.pair.name, done.pointers, routing, run.cfg.promote, champions)
        fig = variant_figure(done.metrics, run.pair.name)
        save_figure_atomic(fig, run.plots_dir / "probe-variants.png")
        mlflow.log_figure(fig, "probe-variants.png")  # once, on the parent run
        close_figure(fig)


@dataclass
class _Outcome:
    """What a train run's probes came to: the test metrics ``{role: {key: ...}}``, the registered probes'
    pointers, the probes kept locally because MLflow was unreachable, and every probe by (role, key)."""

    metrics: dict[str, Any] = field(default_factory=dict)
    pointers: dict[str, dict[str, Any]] = field(default_factory=dict)
    kept: list[KeptProbe] = field(default_factory=list)
    trained: dict[tuple[str, str], Trained] = field(default_factory=dict)


def _train_roles(
    run: TrainRun,
    roles: list[str],
    samples_dir: Path,
    labels_dir: Path,
    out_dir: Path,
    cross_dir: Path | None = None,
) -> _Outcome:
    """Every (role, domain, variant) probe, each in a nested MLflow run. Once MLflow cannot be reached,
    every probe (the one in flight included) is still trained and tested, and kept under
    ``out_dir/pending`` to register later."""
    cfg, done = run.cfg, _Outcome()
    for role in roles:
        data, labels_path, hashes = _role_data(cfg, role, samples_dir, labels_dir, cross_dir)
        done.metrics[role] = {}
        parts = {}  # every domain's data and split, so that a bad domain fails before any fit
        for domain in cfg.domain_list():
            part = only_domain(data, domain, labels_path)
            try:
                masks = split_by_question(part.question_id, cfg.val_fraction, cfg.test_fraction, cfg.seed)
            except ValueError as e:
                raise ValueError(f"train: {role} probes of domain {domain!r}: {e}") from None
            if cfg.train_fraction < 1:
                masks["train"] &= keep_questions(part.question_id, cfg.train_fraction, cfg.seed)
            parts[domain] = (part, masks)
        for domain, (part, masks) in parts.items():
            for variant in cfg.variants:
                key = probe_key(variant, domain)
                trained = done.trained[role, key] = Trained(run, part, masks, hashes, role, key)
                try:
                    _track_or_keep(trained, done, out_dir / PENDING_DIR)
                finally:
                    close_figure(trained.figure)
    return done


def _track_or_keep(trained: Trained, done: _Outcome, kept_dir: Path) -> None:
    """Track and register one probe (``track_probe``) while MLflow answers; else (from the first error on)
    keep it under ``kept_dir`` to register later. Its test metrics go to ``done`` either way."""
    role, key = trained.role, trained.key
    if not done.kept:
        try:
            metrics, ref = track_probe(trained)
            done.metrics[role][key] = metrics
            done.pointers[f"{role}-{key}"] = asdict(ref)
            log.info("train[%s/%s]: %s", role, key, {k: round(v, 4) for k, v in metrics.items()})
            return
        except TRACKING_ERRORS as e:
            log.error("train: MLflow unreachable (%s): the probes are kept locally", e)
    done.kept.append(trained.keep(kept_dir))
    done.metrics[role][key] = dict(trained.metrics)


def _role_data(
    cfg: TrainConfig, role: str, samples_dir: Path, labels_dir: Path, cross_dir: Path | None
) -> tuple[ProbeData, Path, dict[str, str]]:
    """A role's training rows by ``train.examples``, the labels file they come from and the data hashes."""
    if cfg.examples == "both":
        if cross_dir is None:
            raise ValueError("train.examples: both needs the cross stage's output (--cross)")
        labels_path = labels_dir / "joint.parquet"
        data = load_joint_probe_data(role, samples_dir, cross_dir, labels_path, cfg.variants)
        samples_hash = f"{data_hash(samples_dir / role)}+{data_hash(cross_dir / role)}"
    else:
        labels_path = labels_dir / f"{role}.parquet"
        data = load_probe_data(samples_dir / role, labels_path, cfg.variants)
        samples_hash = data_hash(samples_dir / role)
    return data, labels_path, {"samples": samples_hash, "labels": data_hash(labels_path)}


def _routing(
    trained: dict[tuple[str, str], Trained],
    samples_dir: Path,
    cross_dir: Path | None,
    labels_dir: Path,
    variants: list[str],
) -> tuple[dict[str, dict[str, float]] | None, dict[str, dict[str, float]]]:
    """The routing metrics of the pooled (all-domain) probes, or None without joint labels and cross
    features; and those of each variant's current champion on the same steps, where it can read them
    (``champion_probes``), for a promotion that compares like with like. Test questions: those held out
    from both roles' probes."""
    keys = {
        (r, v): t for (r, k), t in trained.items() if k == probe_key(v := split_probe_key(k)[0], ALL_DOMAINS)
    }
    if cross_dir is None or {r for r, _ in keys} != set(ROLES):
        return None, {}
    data = load_routing_data(samples_dir, cross_dir, labels_dir / "joint.parquet", variants)
    if data is None:
        return None, {}
    tests = [set(t.data.question_id[t.masks["test"]].tolist()) for (r, _), t in keys.items()]
    vals = [set(t.data.question_id[t.masks["val"]].tolist()) for (r, _), t in keys.items()]
    test, val = set.intersection(*tests), set.intersection(*vals)
    probes: dict[str, dict[str, nn.Module]] = {}
    for (role, variant), t in keys.items():
        t.fit(log_epochs=False)  # fitted already (tracked or kept): a no-op
        probes.setdefault(variant, {})[role] = t.probe
    table = routing_table(data, probes, test, val)
    for name, m in table.items():
        log.info("train: routing %s: %s", name, {k: round(v, 3) for k, v in m.items()})
    held = {v: pair for v in probes if (pair := champion_probes(keys, v)) is not None}
    champions = routing_table(data, held, test, val) if held else {}
    champions.pop("oracle", None)
    for name, m in champions.items():
        log.info("train: the %s champion on the same steps: %s", name, {k: round(v, 3) for k, v in m.items()})
    return table, champions
