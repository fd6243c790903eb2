"""What the ``semspec`` command modules share: the common options and the ValueError-to-exit rule."""

from __future__ import annotations

from typing import Annotated

import typer

PairOpt = Annotated[
    str | None,
    typer.Option(
        "--pair", "-p", help="Model pair: a name in conf/pairs/ or a YAML path (default: params.yaml's)."
    ),
]
ParamsOpt = Annotated[
    str | None, typer.Option("--params", help="params.yaml to read (default: the project's).")
]
ProfileOpt = Annotated[str | None, typer.Option("--profile", help="Profile overlay: demo, paper, tiny, ...")]
SetOpt = Annotated[list[str] | None, typer.Option("--set", "-s", help="Override a param: section.key=value.")]
PairOverride = Annotated[str | None, typer.Option("--pair", "-p", help="Model pair (default: params' pair).")]


def or_exit(fn, *args):
    """Call ``fn``; a ValueError becomes a clean error message and exit code 2."""
    try:
        return fn(*args)
    except ValueError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None


def default_pair() -> str:
    """params.yaml's pair (the one the main job runs)."""
    from semspec.tasks.config import load_params

    return or_exit(load_params).pair
