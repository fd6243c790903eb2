"""The ``semspec`` command line (Typer): one command per pipeline stage and tool.

Each command parses its options and calls a stage or task function. The commands import the project's
modules when they run, not at the top: ``semspec --help``, ``semspec env`` and the service commands must not
pay for torch, transformers and MLflow (seconds). This module builds ``app`` from the command modules:
``stages`` (one command per pipeline stage), ``groups`` and ``probes`` (the command groups models, data,
judge, services, pairs, probes), ``decoding`` (grade, decode, bench), ``serving`` (serve) and ``pipeline`` (env,
deployments, run, register, report); ``common`` holds the options they share.
"""

from __future__ import annotations

import logging
from typing import Annotated

import typer

from semspec.flows.cli.decoding import bench, decode, grade
from semspec.flows.cli.groups import GROUPS
from semspec.flows.cli.pipeline import deployments_app, env_cmd, register, report, run
from semspec.flows.cli.serving import serve
from semspec.flows.cli.stages import add_stage_commands

app = typer.Typer(
    help="SemanticSpec: semantic-aware speculative decoding for reasoning LLMs, with its probe pipeline.",
    no_args_is_help=True,
    add_completion=False,
)
# registered in this order, the order `semspec --help` lists them in
for _name, _group in GROUPS.items():
    app.add_typer(_group, name=_name)
add_stage_commands(app)
app.command("env")(env_cmd)
for _command in (grade, decode, bench, serve):
    app.command()(_command)
app.add_typer(deployments_app, name="deployments")
for _command in (run, register, report):
    app.command()(_command)


@app.callback()
def _main(verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Debug logging.")] = False) -> None:
    from semspec.flows.env import apply_env

    apply_env()
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    for noisy in (
        "httpx",
        "urllib3",
        "filelock",
        "transformers.modeling_utils",
        "lightning.pytorch",
        "pytorch_lightning",
        "lightning.fabric",
    ):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def main() -> None:
    """Console-script entry point."""
    app()
