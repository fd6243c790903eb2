"""What the ``semspec`` command modules share: the common options, the options of ``semspec bench`` (declared
here as ``Annotated`` aliases so the command's signature stays readable) and the ValueError-to-exit rule."""

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
MaxNewTokensOpt = Annotated[
    int | None, typer.Option(help="Output token budget (default: params' evaluate.decode.max_new_tokens).")
]

# semspec bench
QuestionsOpt = Annotated[int, typer.Option(help="Questions (arithmetic test split).")]
AssistedOpt = Annotated[bool, typer.Option(help="Include transformers' assisted generation.")]
ProbeVariantsOpt = Annotated[
    list[str] | None, typer.Option(help="Probe variants for SemanticSpec (repeat; default: all four).")
]
SalvageOpt = Annotated[
    bool | None,
    typer.Option(
        "--salvage/--no-salvage",
        help="SemanticSpec salvages rejected steps, greedy (default: params' evaluate.decode.salvage).",
    ),
]
BothSalvageOpt = Annotated[
    bool, typer.Option("--both-salvage", help="Also run each SemanticSpec variant the other way.")
]
BatchSizesOpt = Annotated[
    list[int] | None,
    typer.Option(
        help="Batch sizes (repeat, e.g. --batch 1 --batch 4 --batch 8): throughput of target and "
        "SemanticSpec per batch size instead of the one-at-a-time table."
    ),
]
LookaheadOpt = Annotated[
    int | None,
    typer.Option(help="Steps a row may write ahead in a batch (default: params' evaluate.decode.lookahead)."),
]
GammasOpt = Annotated[
    list[int] | None,
    typer.Option(
        help="SemanticSpec's steps per verification (default: params' evaluate.decode.gamma); repeat to run "
        "each variant with each value in the same run (the first unlabelled, the others <label>/gamma<g>)."
    ),
]
MinTokenPOpt = Annotated[
    float | None,
    typer.Option(
        help="SemanticSpec's token check (default: params' evaluate.decode.min_token_p): a step the probes "
        "accept is rejected when the target gives one of its tokens a lower probability."
    ),
]
LlamacppOpt = Annotated[
    bool,
    typer.Option(
        "--llamacpp",
        help="Also run llama.cpp (llama-server on the same GGUF files, bound to 127.0.0.1): its target "
        "alone and its speculative decoding with the draft; speed-ups against it and peak RSS per method.",
    ),
]
LlamacppBinOpt = Annotated[
    str | None, typer.Option(help="llama-server, or the folder holding it (default: the PATH).")
]


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
