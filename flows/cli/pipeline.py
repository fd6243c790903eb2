"""The ``semspec`` commands about the pipeline as a whole: env, deployments serve, run, register, report.

They drive the Prefect deployments and read what the stages left (metrics, the MLflow registry); Prefect,
MLflow and the tasks are imported when a command runs. ``semspec.flows.cli`` registers these functions as
commands and ``deployments_app`` as the ``deployments`` group.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from semspec.flows.cli.common import PairOverride, ProfileOpt, or_exit


def env_cmd() -> None:
    """Print the project's local/offline environment as shell `export` lines (eval it)."""
    from semspec.flows.env import shell_exports

    typer.echo(shell_exports())


deployments_app = typer.Typer(
    help="The Prefect deployments semspec/full and semspec/retrain.", no_args_is_help=True
)


@deployments_app.command("serve")
def deployments_serve() -> None:
    """Serve the deployments semspec/full and semspec/retrain (cron from params.yaml's `retrain`) and run
    their flow runs; needs the Prefect server (`semspec services up` starts both)."""
    from semspec.flows.pipeline import serve_deployments

    serve_deployments()


def run(
    retrain: Annotated[
        bool, typer.Option("--retrain", help="Run semspec/retrain (every pair that needs it) instead.")
    ] = False,
) -> None:
    """Run the deployment semspec/full (params.yaml's pair and profile) and follow it here: each stage's
    output and progress as it runs, then the metrics and the links to the flow run and the probe
    comparison. Needs `semspec services up`."""
    import asyncio

    from semspec.flows.watch import flow_run_url, run_and_follow

    deployment = "semspec/retrain" if retrain else "semspec/full"
    try:
        done = asyncio.run(run_and_follow(deployment, {}, typer.echo))
    except Exception as e:  # the API is down, the deployment is not served, ...
        typer.echo(f"error: {deployment}: {e} (is `semspec services up` running?)", err=True)
        raise typer.Exit(2) from None
    typer.echo("")
    report(None, None)
    typer.echo(f"Flow run:   {flow_run_url(done.id)}")
    if not (done.state and done.state.is_completed()):
        typer.echo(
            f"error: flow run {done.name} ended {done.state.name if done.state else 'unknown'}", err=True
        )
        raise typer.Exit(1)


def register(
    pair: PairOverride = None,
    profile: ProfileOpt = None,
    probes: Annotated[
        str | None, typer.Option(help="The train stage's output folder (default: dvc.yaml's for the pair).")
    ] = None,
) -> None:
    """Register the probes a train run kept locally because MLflow became unreachable (no retraining),
    then write the train stage's outputs."""
    from semspec.flows.stages import stage_option
    from semspec.tasks.config import load_params
    from semspec.tasks.train.registry import register_pending

    params = or_exit(load_params, None, profile, None)
    name = pair or params.pair
    folder = Path(probes) if probes else or_exit(stage_option, "train", "out", name, params.profile)
    metrics = or_exit(register_pending, folder)
    n = sum(len(v) for v in metrics.values())
    typer.echo(f"{name}: every probe registered ({n} in {folder / 'probes.json'})")
    typer.echo("record the train stage in DVC without retraining: dvc commit -f train")


def report(pair: PairOverride = None, profile: ProfileOpt = None) -> None:
    """Print the pair's probe and evaluation metrics (as the stages left them) and the UI URLs, with one
    link that compares the probe variants in MLflow."""
    from semspec.flows.env import service_urls
    from semspec.flows.report import compare_url, experiment_url, pair_report
    from semspec.flows.stages import tracked_config

    default_pair, default_profile = tracked_config()
    name = pair or default_pair
    typer.echo(pair_report(name, profile or default_profile))
    urls = service_urls()
    typer.echo(f"\nPrefect UI: {urls['prefect']}\nMLflow UI:  {experiment_url(name) or urls['mlflow']}")
    if link := compare_url(name):
        typer.echo(f"Compare the probes (MLflow): {link}")
