"""The Prefect flow ``semspec`` and its deployments ``semspec/full`` and ``semspec/retrain``.

Each stage task runs the stage as ``dvc.yaml`` defines it (see ``flows.stages``); the last task loads the
registered ``champion`` probes and decodes one question, proving the registry round trip. Nothing runs
at import time: ``semspec deployments serve`` (or ``serve_deployments``) serves the deployments.
"""

from __future__ import annotations

import logging
import signal
from dataclasses import asdict
from typing import Any

from filelock import FileLock
from prefect import flow, get_run_logger, serve, task
from prefect.artifacts import create_link_artifact, create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from prefect.flows import EntrypointType
from prefect.schedules import Cron

from semspec.flows.report import compare_url, experiment_url, mlflow_runs, pair_report
from semspec.flows.stages import StageRequest, run_stage, stage_line_logger, stage_option
from semspec.models.lm import load_lm
from semspec.models.project.names import SMOKE_STAGE, STAGES
from semspec.models.project.pairs import load_pair, project_root
from semspec.models.spec.names import PROBE_METHOD, ROLES
from semspec.models.spec.settings import DecodeSettings
from semspec.tasks.config import load_params
from semspec.tasks.decoders import build_decoder, decode_settings
from semspec.tasks.probe_registry import champion_origin
from semspec.tasks.retrain import NOT_EVALUATED, pair_statuses

log = logging.getLogger(__name__)

ALL_STAGES = (*STAGES, SMOKE_STAGE)  # decode = the registry round-trip smoke test
NOT_TRAINABLE = ("invalid", "unavailable")  # pair statuses the retrain reports but cannot fix
SMOKE_QUESTION = "Tom has 3 boxes with 4 apples in each box. He eats 2 apples. How many apples are left?"


@task(name="stage", task_run_name="{stage}[{pair}]", cache_policy=NO_CACHE)
def stage_task(stage: str, pair: str, profile: str, overrides: list[str], force: bool) -> dict[str, Any]:
    """One pipeline stage (``dvc repro`` or its ``dvc.yaml`` command), output streamed to the run log."""
    logger = get_run_logger()
    run = run_stage(StageRequest(stage, pair, profile, tuple(overrides), force), stage_line_logger(logger))
    logger.info(
        "%s[%s]: %s in %.1fs (%s)",
        stage,
        pair,
        "up to date" if run.skipped else "done",
        run.seconds,
        run.mode,
    )
    return asdict(run)


SMOKE_TOKENS = 48  # the smoke test's output budget: a few steps


def smoke_settings(params: Any) -> DecodeSettings:
    """The smoke test decodes as the evaluation does, within a few steps' budget."""
    return decode_settings(params.evaluate, max_new_tokens=SMOKE_TOKENS)


@task(
    name="decode-smoke",
    task_run_name="decode-smoke[{pair}]",
    cache_policy=NO_CACHE,
    retries=1,  # the registry is a database that can be busy
    retry_delay_seconds=10,
)
def decode_smoke(pair: str, variant: str, split_strategy: str, settings: DecodeSettings) -> dict[str, Any]:
    """Load both models and the ``champion`` probes of ``variant`` from the registry, decode one question
    with ``settings`` (the evaluation's, see ``smoke_settings``)."""
    logger = get_run_logger()
    pair_config = load_pair(pair, split_strategy=split_strategy)
    lms = {role: load_lm(pair_config.role(role)) for role in ROLES}
    dec = build_decoder(PROBE_METHOD, pair_config, lms, settings, variant)
    res = dec.decode(SMOKE_QUESTION)
    if not res.steps:
        raise RuntimeError(f"decode smoke test for {pair} produced no step")
    summary = {
        "question": SMOKE_QUESTION,
        "probe": variant,
        "probes": champion_origin(pair, variant),
        "steps": len(res.steps),
        "output_tokens": res.output_tokens,
        "target_share": round(res.target_share, 3),
        "acceptance": res.acceptance_rate,
        "answer": res.answer,
        "text": res.text,
        "trace": [{"author": st.author, "text": st.text} for st in res.steps],
        "seconds": round(res.timings.total, 1),
    }
    logger.info("decode smoke[%s]: %s", pair, {k: v for k, v in summary.items() if k != "text"})
    return summary


@task(name="find-stale-pairs", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=5)
def find_stale_pairs(profile: str | None, overrides: list[str]) -> dict[str, str | None]:
    """Every configured pair's status: None when up to date, else why it needs work or cannot be trained
    (see ``semspec.tasks.retrain.pair_statuses``)."""
    logger = get_run_logger()
    params = load_params(None, profile, overrides)
    statuses = pair_statuses(params, eval_metrics_path(params.profile))
    for name, why in statuses.items():
        logger.info("%s: %s", name, why or "up to date")
    return statuses


def eval_metrics_path(profile: str):
    """``pair -> the evaluate stage's metrics file`` (dvc.yaml's path), where a finished evaluation is
    recorded."""
    return lambda pair: stage_option("evaluate", "metrics", pair, profile)


def retrain_plan(
    statuses: dict[str, str | None], stages: list[str]
) -> tuple[dict[str, list[str]], dict[str, str]]:
    """(pair -> the stages to run, pair -> why it is skipped): a pair whose probes are current but whose
    evaluation is not reruns only evaluate and the decode smoke; invalid or unavailable pairs are skipped
    and reported, never trained."""
    todo, skipped = {}, {}
    for name, why in statuses.items():
        if why is None:
            continue
        if why.startswith(NOT_TRAINABLE):
            skipped[name] = why
        elif why.startswith(NOT_EVALUATED):
            todo[name] = [s for s in stages if s in ("evaluate", SMOKE_STAGE)]
        else:
            todo[name] = list(stages)
    return todo, skipped


@task(name="report", task_run_name="report[{pair}]", cache_policy=NO_CACHE, retries=1, retry_delay_seconds=5)
def publish_report(pair: str, profile: str, runs: list[dict[str, Any]], smoke: dict[str, Any] | None) -> str:
    """Markdown artifact: stage runs, probe and evaluation metrics, the smoke decode and MLflow links."""
    lines = ["| stage | mode | result | seconds |", "|---|---|---|---|"]
    lines += [
        f"| {r['stage']} | {r['mode']} | {'up to date' if r['skipped'] else 'ran'} | {r['seconds']:.1f} |"
        for r in runs
    ]
    if smoke:
        lines.append(f"| {SMOKE_STAGE} | registry | ran | {smoke.get('seconds', 0):.1f} |")
    md = [pair_report(pair, profile), "## Stages", "\n".join(lines)]
    if smoke:
        answer = f"`{smoke['answer']}`" if smoke["answer"] is not None else "none within the smoke budget"
        trace = "\n".join(
            f"{i}. {'draft, accepted' if st['author'] == 'draft' else 'target, rewritten'}: "
            f"`{' '.join(st['text'].split())[:120]}`"
            for i, st in enumerate(smoke.get("trace", []), 1)
        )
        md += [
            "## Decode smoke test (registered champion probes)",
            f"{smoke['question']}\n\nprobe `{smoke['probe']}` ({smoke.get('probes', 'the champions')}): "
            f"{smoke['steps']} steps, "
            f"{smoke['output_tokens']} tokens, target share {smoke['target_share']}, answer {answer}",
            "Steps:\n\n" + trace,
        ]
    compare = compare_url(pair)
    if compare:
        md += [
            "## Compare the probe variants",
            f"[Random / last / all / mix side by side in MLflow]({compare})",
        ]
    links = mlflow_runs(pair)
    if links:
        md += ["## MLflow runs", "\n".join(f"- [{x['name']}]({x['url']})" for x in links)]
    text = "\n\n".join(md)
    key = f"semspec-{pair}".lower().replace("_", "-").replace(".", "-")
    create_markdown_artifact(text, key=key, description=f"semspec metrics for {pair} ({profile})")
    url = experiment_url(pair)
    if url:
        create_link_artifact(url, link_text=f"MLflow experiment semspec-{pair}", key=f"{key}-mlflow")
    return text


def run_pair(pair: str, profile: str, stages: list[str], overrides: list[str], force: bool) -> dict[str, Any]:
    """ingest -> sample -> cross -> cluster -> train -> evaluate -> decode smoke for one pair (the stages asked for),
    holding the pair's lock so two runs never write the same outputs."""
    lock = project_root() / ".cache" / "locks" / f"{pair}.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    runs: list[dict[str, Any]] = []
    smoke = None
    with FileLock(lock):
        for stage in STAGES:
            if stage in stages:
                runs.append(stage_task(stage, pair, profile, overrides, force))
        if SMOKE_STAGE in stages:
            params = load_params(None, profile, overrides)
            variants = params.train.variants
            variant = (
                "all" if "all" in variants else next((v for v in variants if v != "random"), variants[0])
            )
            smoke = decode_smoke(pair, variant, params.split_strategy, smoke_settings(params))
    publish_report(pair, profile, runs, smoke)
    return {"stages": runs, "decode": smoke}


@flow(
    name="semspec",
    description="SemanticSpec pipeline: ingest, sample, cross, cluster, train, evaluate, decode.",
)
def semspec(
    pair: str | None = None,
    profile: str | None = None,
    stages: list[str] | None = None,
    overrides: list[str] | None = None,
    retrain: bool = False,
) -> dict[str, Any]:
    """Run the pipeline for ``pair`` (default: params.yaml's), or with ``retrain`` for every pair in
    ``conf/pairs/`` whose champion probes are missing or were trained on another config or data.

    ``stages`` picks a subset of ingest, sample, cross, cluster, train, evaluate, decode (default: all; with
    ``retrain``: params.yaml's ``retrain.stages``); ``overrides`` are ``section.key=value`` settings.
    """
    overrides = list(overrides or [])
    params = load_params(None, profile, overrides)  # bad settings fail here, before any work
    stages = list(stages or (params.retrain.stages if retrain else ALL_STAGES))
    unknown = [s for s in stages if s not in ALL_STAGES]
    if unknown:
        raise ValueError(f"unknown stage(s) {unknown}; expected some of {list(ALL_STAGES)}")
    skipped: dict[str, str] = {}
    if retrain:
        todo, skipped = retrain_plan(find_stale_pairs(profile, overrides), stages)
        get_run_logger().info(
            "retrain: %s; skipped: %s",
            ", ".join(f"{n} ({', '.join(st)})" for n, st in todo.items())
            or "every trainable pair is up to date",
            "; ".join(f"{n} ({why})" for n, why in skipped.items()) or "none",
        )
    else:
        todo = {pair or params.pair: stages}
    results: dict[str, Any] = {"_skipped": skipped} if skipped else {}
    failed: dict[str, str] = {}
    for name, pair_stages in todo.items():
        try:
            results[name] = run_pair(name, params.profile, pair_stages, overrides, force=retrain)
        except Exception as e:
            if not retrain:
                raise
            get_run_logger().error("retrain of %s failed: %s", name, e)
            failed[name] = str(e).splitlines()[0]  # one broken pair does not stop the others
    if failed:
        raise RuntimeError(f"retrain failed for {len(failed)} pair(s): {failed}; the others finished")
    return results


def deployments() -> list:
    """``semspec/full`` (the whole flow, params.yaml's pair and profile) and ``semspec/retrain`` (on the
    ``retrain.cron`` schedule, only the pairs that need it)."""
    schedule = load_params().retrain
    common = {"entrypoint_type": EntrypointType.MODULE_PATH, "tags": ["semspec"]}
    full = semspec.to_deployment(
        name="full", description="The whole pipeline on params.yaml's pair and profile.", **common
    )
    retrain = semspec.to_deployment(
        name="retrain",
        description="Train, register and evaluate probes for every pair without up-to-date champions.",
        schedule=Cron(schedule.cron, timezone=schedule.timezone),
        parameters={"retrain": True},
        **common,
    )
    return [full, retrain]


def serve_deployments() -> None:
    """Register both deployments with the Prefect server and run their flow runs until interrupted."""
    signal.signal(signal.SIGINT, signal.default_int_handler)  # a backgrounded process may inherit SIG_IGN
    serve(*deployments(), print_starting_message=True)
