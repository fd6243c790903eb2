"""One ``semspec`` command per pipeline stage, built from one table.

Each entry is the stage module's keyword-only ``stage(params=, pair=, <paths>)``; the path options default
to the paths dvc.yaml passes to the same command for the chosen pair, so paths are written in dvc.yaml only.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer

from semspec.flows.cli.common import PairOverride, ParamsOpt, ProfileOpt, SetOpt, or_exit


@dataclass(frozen=True)
class StageCommand:
    """A pipeline stage as a CLI command."""

    module: str  # the stage module (imported when the command runs)
    help: str
    paths: dict[str, str]  # path option -> help
    show: Callable[[Any], str] = str  # the entry's result as terminal text


def _metrics_table(res: Any) -> str:
    from semspec.flows.report import metrics_table

    return metrics_table(res)


def _eval_table(res: Any) -> str:
    from semspec.flows.report import eval_table

    return eval_table(res)


STAGE_COMMANDS = {
    "ingest": StageCommand(
        "semspec.tasks.ingest",
        "Stage ingest: questions -> reasoning steps -> prefixes.parquet.",
        {"out": "prefixes.parquet to write."},
    ),
    "sample": StageCommand(
        "semspec.tasks.sample",
        "Stage sample: N steps per prefix and role with pooled hidden states (Ray actors; resumes).",
        {"prefixes": "prefixes.parquet to read.", "out": "Folder for samples/<role>/part-*.parquet."},
    ),
    "cross": StageCommand(
        "semspec.tasks.cross",
        "Stage cross: each model reads the other's sampled steps, pooled as a verifier pools them (resumes).",
        {
            "prefixes": "prefixes.parquet to read.",
            "samples": "Samples folder (both roles).",
            "out": "Folder for cross/<reader>/part-*.parquet.",
        },
    ),
    "cluster": StageCommand(
        "semspec.tasks.cluster",
        "Stage cluster: group samples by meaning with the pair's judge -> semantic-probability labels.",
        {
            "samples": "Samples folder.",
            "prefixes": "prefixes.parquet (for the question/prefix).",
            "out": "Folder for labels/<role>.parquet.",
        },
    ),
    "train": StageCommand(
        "semspec.tasks.train",
        "Stage train: fit, evaluate, log to MLflow and register the probes (alias champion).",
        {
            "samples": "Samples folder.",
            "cross": "The cross stage's folder (each model's features over the other's steps).",
            "labels": "Labels folder.",
            "out": "Folder for probes.json (the stored probes' registry versions, URIs and hashes).",
            "metrics": "Test-metrics JSON to write.",
            "plots": "Folder for calibration plots.",
        },
        _metrics_table,
    ),
    "evaluate": StageCommand(
        "semspec.tasks.evaluate",
        "Stage evaluate: every method on the benchmarks (pass@1, latency, TPS, target share, speed-up).",
        {
            "probes": "The train stage's output folder (which probe versions to evaluate).",
            "out": "Folder for <benchmark>/<method>.jsonl and metrics.json.",
            "plots": "Folder for the evaluation plots.",
            "metrics": "Summary JSON for DVC.",
        },
        _eval_table,
    ),
}


OUTPUT_OPTIONS = {"out", "metrics", "plots"}  # the stage options that name what a stage writes


def _stage_command(name: str, command: StageCommand) -> Callable[..., None]:
    """A Typer command for one stage: its path options, then --params/--profile/--set/--pair."""

    def run(**options: Any) -> None:
        from semspec.flows.stages import stage_option
        from semspec.models.project.pairs import load_pair
        from semspec.tasks.config import load_params
        from semspec.tasks.io import check_writable
        from semspec.tasks.ray_utils import exit_on_termination, shutdown_ray

        params = or_exit(load_params, options["params"], options["profile"], options["set_"])
        params.pair = options["pair"] or params.pair
        pair_config = or_exit(load_pair, params.pair, None, params.split_strategy)
        paths = {
            opt: Path(options[opt])
            if options[opt]
            else or_exit(stage_option, name, opt, params.pair, params.profile)
            for opt in command.paths
        }
        for opt in OUTPUT_OPTIONS & set(paths):
            or_exit(check_writable, paths[opt], f"--{opt}")
        entry = importlib.import_module(command.module).stage
        exit_on_termination()
        try:
            typer.echo(command.show(or_exit(lambda: entry(params=params, pair=pair_config, **paths))))
        finally:
            shutdown_ray()  # a stage leaves no Ray process behind, whether it ends, fails or is stopped

    kw = inspect.Parameter.KEYWORD_ONLY
    parameters = [
        inspect.Parameter(opt, kw, default=None, annotation=Annotated[str | None, typer.Option(help=text)])
        for opt, text in command.paths.items()
    ] + [
        inspect.Parameter("params", kw, default=None, annotation=ParamsOpt),
        inspect.Parameter("profile", kw, default=None, annotation=ProfileOpt),
        inspect.Parameter("set_", kw, default=None, annotation=SetOpt),
        inspect.Parameter("pair", kw, default=None, annotation=PairOverride),
    ]
    run.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]
    run.__annotations__ = {p.name: p.annotation for p in parameters}
    run.__doc__ = command.help
    run.__name__ = name
    return run


def add_stage_commands(app: typer.Typer) -> None:
    """Add one command per entry of ``STAGE_COMMANDS`` to ``app``."""
    for name, command in STAGE_COMMANDS.items():
        app.command(name)(_stage_command(name, command))
