"""``semspec probes``: export a pair's champion probes to a folder that travels, import such a folder."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from semspec.flows.cli.common import PairOpt, default_pair, or_exit

probes_app = typer.Typer(
    help="Probes that travel: a folder of safetensors probes and a JSON card (semspec-probes.json).",
    no_args_is_help=True,
)


@probes_app.command("export")
def probes_export(
    folder: Annotated[Path, typer.Argument(help="Folder to write (new or empty; see --overwrite).")],
    pair: PairOpt = None,
    variant: Annotated[
        list[str] | None,
        typer.Option(
            "--variant",
            help="Probe variant to export, e.g. all or all@math (repeatable; default: every variant with "
            "champion probes for both roles).",
        ),
    ] = None,
    overwrite: Annotated[
        bool, typer.Option("--overwrite", help="Replace the folder when it holds an earlier export.")
    ] = False,
) -> None:
    """Write the champion draft and target probes of a pair's variants, with their card, to FOLDER."""
    from semspec.models.project.probe_folder import read_card
    from semspec.tasks.probe_export import export_probes

    out = or_exit(lambda: export_probes(pair or default_pair(), folder, variant, overwrite))
    card = read_card(out)
    typer.echo(f"[probes] exported {', '.join(card.variants)} of pair {card.pair} to {out}")


@probes_app.command("import")
def probes_import(
    source: Annotated[
        str, typer.Argument(help="Exported folder, or a Hugging Face Hub repo id org/name[@revision].")
    ],
    if_better: Annotated[
        bool,
        typer.Option(
            "--if-better",
            help="Import only the variants whose held-out routing score (true- minus false-accept, on "
            "their card) beats the registry's champion; the others are left out.",
        ),
    ] = False,
) -> None:
    """Register the probes of an exported folder in the local MLflow registry (as champions)."""
    from semspec.tasks.probe_import import import_probes

    refs = or_exit(import_probes, source, if_better)
    for ref in refs:
        typer.echo(f"[probes] registered {ref.name} v{ref.version} (sha256 {ref.sha256[:12]})")
    if not refs:
        typer.echo("[probes] the registry's champions are at least as good: nothing imported")
