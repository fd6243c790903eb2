"""MLflow I/O: the pair's experiment, registering a probe and loading it back (with the model-fit check).

Probes are stored as safetensors weights + a JSON config (``semspec.models.spec.probe.save_probe``), logged as
run artifacts; the registry's versions point at them. Nothing here unpickles anything."""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path

import httpx
import mlflow
from mlflow.exceptions import MlflowException
from torch import nn

from semspec.models.project.names import CHAMPION, experiment_name, registered_name
from semspec.models.spec.names import ROLES
from semspec.models.spec.probe import WEIGHTS_FILE, load_probe_folder, sha256_of
from semspec.tasks.environment import services_settings

log = logging.getLogger(__name__)


def artifact_root() -> Path:
    """Where run artifacts go (``SEMSPEC_MLFLOW_ARTIFACTS``, default ``<project>/mlartifacts``)."""
    return services_settings().mlflow_artifacts


# what a tracking server that went away raises (MLflow wraps HTTP failures in MlflowException)
TRACKING_ERRORS = (MlflowException, ConnectionError, TimeoutError)


def check_tracking(timeout: float = 5.0) -> None:
    """Fail within seconds, before any work, when the MLflow tracking server is not reachable (a local
    ``sqlite:`` or file store needs no server)."""
    uri = mlflow.get_tracking_uri()
    if not uri.startswith(("http://", "https://")):
        return
    try:
        httpx.get(uri.rstrip("/") + "/health", timeout=timeout).raise_for_status()
    except httpx.HTTPError as e:
        raise ValueError(
            f"MLflow tracking server {uri} is not reachable ({type(e).__name__}): start it "
            f"(`semspec services up`) or point MLFLOW_TRACKING_URI at a running one"
        ) from None


def setup_experiment(pair: str) -> str:
    """Create (once) and activate the pair's experiment; returns its id."""
    name = experiment_name(pair)
    exp = mlflow.get_experiment_by_name(name)
    if exp is None:
        exp_id = mlflow.create_experiment(name, artifact_location=(artifact_root() / name).as_uri())
    else:
        exp_id = exp.experiment_id
    tags = (exp.tags or {}) if exp is not None else {}
    for key, value in _experiment_tags(pair).items():
        if tags.get(key) != value:
            mlflow.MlflowClient().set_experiment_tag(exp_id, key, value)
    mlflow.set_experiment(experiment_id=exp_id)
    return exp_id


def _experiment_tags(pair: str) -> dict[str, str]:
    """A model-training experiment (the UI opens on its runs, not on the GenAI overview) with a
    description."""
    return {
        "mlflow.experimentKind": "custom_model_development",
        "mlflow.note.content": (
            f"SemanticSpec on the pair `{pair}`: the `train` runs fit and register the probes that predict, "
            "from a model's hidden states, how likely a reasoning step's meaning is (one per role and "
            "feature: last, all, mix, random); the `eval-*` runs decode the benchmarks with every method "
            "(pass@1, latency, speed-ups against the target)."
        ),
    }


POINTERS_FILE = "probes.json"  # in the train stage's DVC out: the stored probes that run made


def read_pointers(folder: Path) -> dict[str, str]:
    """``{"<role>-<variant>": version}`` of the registered probes a train run recorded in ``folder``."""
    path = folder / POINTERS_FILE
    if not path.is_file():
        raise ValueError(f"{path} does not exist: run the train stage (`dvc repro train`) first")
    probes = json.loads(path.read_text(encoding="utf-8")).get("probes", {})
    return {k: str(v["version"]) for k, v in probes.items() if v.get("version") is not None}


@dataclass(frozen=True)
class ProbeRef:
    """Where a stored probe lives: its MLflow artifact URI (the one store of probe weights), its registry
    name and version (None when not registered) and the sha256 of its weights file."""

    name: str
    version: str | None
    source: str
    sha256: str


def register_probe(
    folder: Path,
    pair: str,
    role: str,
    variant: str,
    tags: dict[str, str],
    register: bool = True,
    description: str | None = None,
    champion: bool = True,
) -> ProbeRef:
    """Log a probe saved by ``save_probe`` in ``folder`` as artifacts of the active run (named after the
    probe) and, with ``register``, create a registry version with ``tags`` (and with ``champion``, point
    ``champion`` at it; else ``promote`` decides later); ``description`` (what the probe reads and
    predicts) becomes the registered model's description. The weights' sha256 is a version tag, checked
    whenever the probe is loaded."""
    name = registered_name(pair, role, variant)
    sha = sha256_of(folder / WEIGHTS_FILE)
    mlflow.log_artifacts(str(folder), artifact_path=name)
    source = mlflow.get_artifact_uri(name)
    if not register:
        return ProbeRef(name, None, source, sha)
    client = mlflow.MlflowClient()
    try:
        client.get_registered_model(name)
    except MlflowException:
        client.create_registered_model(name)
    if description:
        client.update_registered_model(name, description=description)
    run = mlflow.active_run()
    mv = client.create_model_version(
        name, source, run_id=run.info.run_id if run else None, tags={**tags, "sha256": sha}
    )
    if champion:
        client.set_registered_model_alias(name, CHAMPION, mv.version)
    return ProbeRef(name, str(mv.version), source, sha)


SCORE_TAG = "routing_score"  # a version's held-out routing score (``routing_score``), what promotion compares


def routing_score(metrics: dict[str, float] | None) -> float | None:
    """How well a variant's pair of probes routes: the true-accept minus the false-accept rate of the
    decoder's default rule (the paper's, ``min(1, p/q)``) on the held-out questions' draft steps
    (``routing_metrics``); None without both rates (no joint labels, or a side with no step)."""
    if not metrics:
        return None
    ta, fa = metrics.get("true_accept"), metrics.get("false_accept")
    if ta is None or fa is None or not (math.isfinite(ta) and math.isfinite(fa)):
        return None
    return float(ta) - float(fa)


def champion_score(pair: str, variant: str) -> tuple[bool, float | None]:
    """(whether both roles of ``variant`` have a champion, the target champion's ``routing_score`` tag)."""
    try:
        tags = {role: registered_version(pair, role, variant).tags or {} for role in ROLES}
    except ValueError:
        return False, None
    value = tags["target"].get(SCORE_TAG)
    return True, None if value is None else float(value)


def beats(score: float | None, current: tuple[bool, float | None]) -> bool:
    """Whether probes of ``score`` should replace the champion ``current`` (``champion_score``): with no
    champion, or a champion without a score, yes; without a score against a scored one, no; else only
    when strictly higher (equal probes keep the champion)."""
    exists, best = current
    if not exists or best is None:
        return True
    return score is not None and score > best


# a routing score stands for a run's probes against a champion only with this many held-out draft steps the
# target shares, and as many it does not: on fewer, one step moves the false-accept rate by 5% or more
MIN_JUDGED_STEPS = 20


def promote(
    pair: str,
    variant: str,
    versions: dict[str, str],
    score: float | None,
    force: bool = False,
    against: float | None = None,
    judged: bool = True,
) -> bool:
    """Tag both roles' new ``versions`` (role -> version) of ``variant`` with ``score`` and point
    ``champion`` at them when they beat the current champion (``beats``) or ``force``; returns whether
    they became champion. Both roles move together: a variant's probes are judged as a pair. ``against``:
    the champion's score on the steps ``score`` was measured on, which replaces its own tag (measured on
    other steps) in the comparison. ``judged`` False: too few steps stand behind ``score`` to judge by it
    (``MIN_JUDGED_STEPS``); it is tagged, but replaces only a champion without a score."""
    client = mlflow.MlflowClient()
    current = champion_score(pair, variant)
    where = ""
    if against is not None and current[0]:
        current, where = (True, against), " on the same held-out steps"
    for role, version in versions.items():
        if score is not None:
            client.set_model_version_tag(
                registered_name(pair, role, variant), version, SCORE_TAG, f"{score:.6g}"
            )
    if not (force or judged or not current[0] or current[1] is None):
        log.info(
            "%s probes of %s: too few held-out steps (under %d shared or not shared) to judge them against "
            "the champion (routing score %s); the champion stays",
            variant, pair, MIN_JUDGED_STEPS, _fmt(current[1]),
        )  # fmt: skip
        return False
    if not (force or beats(score, current)):
        log.info(
            "%s probes of %s: routing score %s does not beat the champion's %s%s; the champion stays",
            variant, pair, _fmt(score), _fmt(current[1]), where,
        )  # fmt: skip
        return False
    for role, version in versions.items():
        client.set_registered_model_alias(registered_name(pair, role, variant), CHAMPION, version)
    log.info("%s probes of %s (routing score %s%s) are champion", variant, pair, _fmt(score), where)
    return True


def champion_origin(pair: str, variant: str) -> str:
    """Which probes decode ``variant`` of ``pair`` (the target's champion), for a report: its registry name
    and version, where it came from (imported from a folder, or the train run that made it) and its
    routing score."""
    mv = registered_version(pair, "target", variant)
    tags = {}
    if mv.run_id:
        try:
            tags = mlflow.MlflowClient().get_run(mv.run_id).data.tags
        except MlflowException:
            tags = {}
    if tags.get("stage") == "import":
        origin = f"imported from {tags.get('imported_from', '?')}"
    else:
        origin = f"trained in run {mv.run_id or '?'}"
    score = (mv.tags or {}).get(SCORE_TAG)
    return f"{mv.name} v{mv.version}, {origin}, routing score {score or 'none'}"


def _fmt(score: float | None) -> str:
    return "none" if score is None else f"{score:.3f}"


def registered_version(pair: str, role: str, variant: str, alias: str = CHAMPION, version: str | None = None):
    """The registry entry of ``semspec-<pair>-<role>-<variant>`` (``@alias`` or ``version``), without
    reading any weights; a clear ``ValueError`` saying how to train it when there is none."""
    name = registered_name(pair, role, variant)
    which = f" v{version}" if version else f"@{alias}"
    client = mlflow.MlflowClient()
    try:
        return (
            client.get_model_version(name, version)
            if version
            else client.get_model_version_by_alias(name, alias)
        )
    except MlflowException:
        raise ValueError(
            f"no registered probe {name}{which} in {mlflow.get_tracking_uri()}: train it with "
            f"`semspec train --pair {pair}` (or `dvc repro train`)"
        ) from None


MIN_RATIO_TAG = "min_ratio"  # a registered probe's floor on p/q, chosen on the validation questions
MIN_P_TAG = "min_p"  # its floor on p for the target's rule (accept iff p >= min_p), chosen likewise
ACCEPT_RATE_TAG = "accept_rate"  # the pair's step acceptance on the held-out steps (gamma: auto reads it)


def registered_floor(
    pair: str, variant: str, version: str | None = None, tag: str = MIN_RATIO_TAG
) -> float | None:
    """The floor (``tag``: ``MIN_RATIO_TAG`` or ``MIN_P_TAG``) the train run chose on the validation
    questions for ``variant``'s probes, or the step acceptance it measured (``ACCEPT_RATE_TAG``) (the
    target probe's tag; ``version`` or the champion), or None where it has none (no routing metrics: no
    joint labels, or no validation step the floor could separate; a probe trained before the tag)."""
    value = (registered_version(pair, "target", variant, version=version).tags or {}).get(tag)
    return None if value is None else float(value)


def load_probe(
    pair: str,
    role: str,
    variant: str,
    model_id: str,
    hidden_size: int,
    alias: str = CHAMPION,
    version: str | None = None,
    pooling: str = "predict",
    fmt: str | None = None,
) -> tuple[nn.Module, ProbeRef]:
    """The registered probe ``semspec-<pair>-<role>-<variant>`` (``@alias``, or ``version`` when given),
    after checking from its tags — before any weights are read — that it was trained on the hidden
    states of ``model_id`` with ``hidden_size``, pooled as ``pooling`` (versions without the tag predate
    the setting: ``predict``), and with ``fmt`` given, of the model run in that format (``int8``,
    ``bfloat16``, ...; versions without the tag predate formats: ``bfloat16``); its weights must match
    the sha256 tag. Every mismatch, a pickle-format (old) version and a tampered file are clear
    ``ValueError``s."""
    name = registered_name(pair, role, variant)
    mv = registered_version(pair, role, variant, alias, version)
    tags = mv.tags or {}
    if tags.get("model_id") != model_id:
        raise ValueError(
            f"probe {name} v{mv.version} was trained on {tags.get('model_id')!r}, not on {model_id!r}"
        )
    if tags.get("hidden_size") != str(hidden_size):
        raise ValueError(
            f"probe {name} v{mv.version} expects hidden size {tags.get('hidden_size')}, "
            f"the model has {hidden_size}"
        )
    trained_pooling = tags.get("pooling", "predict")
    if trained_pooling != pooling:
        raise ValueError(
            f"probe {name} v{mv.version} read hidden states pooled by {trained_pooling!r}, "
            f"the pair pools by {pooling!r}: retrain the pair's probes (`semspec train --pair {pair}`) or "
            f"set the pair file's `pooling` back"
        )
    trained_format = tags.get("format", "bfloat16")
    if fmt is not None and trained_format != fmt:
        raise ValueError(
            f"probe {name} v{mv.version} read hidden states of {model_id} run in {trained_format}, and "
            f"the model runs in {fmt} here (the pair file's `dtype`, resolved for this machine): retrain "
            f"the pair's probes here (`semspec train --pair {pair}`, after `semspec sample`), or set the "
            f"model's `dtype: {trained_format}` in the pair file"
        )
    where = f"probe {name} v{mv.version}"
    folder = Path(mlflow.artifacts.download_artifacts(artifact_uri=mv.source))
    if "sha256" not in tags:  # versions registered before probes were stored as safetensors
        load_probe_folder(folder, None, where)  # raises: names the pickle format and how to retrain
        raise ValueError(
            f"{where} has no sha256 tag: retrain the pair's probes (`semspec train --pair {pair}`)"
        )
    probe = load_probe_folder(folder, tags["sha256"], where)
    return probe, ProbeRef(name, str(mv.version), mv.source, tags["sha256"])
