"""The ``semspec`` commands that decode: grade, decode, bench and serve.

Each parses its options, checks them before any model loads, and calls a task (``tasks.answer``,
``tasks.bench``) or the server (``flows.serve``); those are imported when the command runs, so the CLI
starts without torch. ``semspec.flows.cli`` registers these functions as commands.
"""

from __future__ import annotations

from typing import Annotated

import typer

from semspec.flows.cli.common import (
    AssistedOpt,
    BatchSizesOpt,
    BothSalvageOpt,
    GammasOpt,
    LlamacppBinOpt,
    LlamacppOpt,
    LookaheadOpt,
    MaxNewTokensOpt,
    MinTokenPOpt,
    PairOpt,
    ProbeVariantsOpt,
    QuestionsOpt,
    SalvageOpt,
    or_exit,
)


def grade(
    benchmark: Annotated[str, typer.Option(help="math500, aime24, amc23, gpqa or arith.")],
    gold: Annotated[str, typer.Option(help="The reference answer.")],
    pred: Annotated[str, typer.Option(help="A model's answer or whole completion.")],
) -> None:
    """Grade one prediction: prints `correct` or `wrong`."""
    from semspec.models.spec.grading import GRADED_BENCHMARKS
    from semspec.models.spec.grading import grade as grade_fn

    if benchmark not in GRADED_BENCHMARKS:
        raise typer.BadParameter(f"expected one of {', '.join(GRADED_BENCHMARKS)}", param_hint="--benchmark")
    _, ok = grade_fn(benchmark, gold, pred)
    typer.echo("correct" if ok else "wrong")


def _show_step(step) -> None:
    """One streamed step: who wrote it (the draft, accepted; the target, rewriting or alone) and p, q."""
    if step.author == "draft":
        tag = typer.style("[draft ✓]", fg=typer.colors.GREEN)
    else:
        tag = typer.style("[target ✎]" if step.proposal is not None else "[target]", fg=typer.colors.YELLOW)
    extra = f" p={step.p:.2f} q={step.q:.2f}" if step.p is not None else ""
    typer.echo(f"{tag}{extra} {step.text.rstrip()}")


def decode(
    question: Annotated[str, typer.Argument(help="The question to answer.")],
    pair: PairOpt = None,
    method: Annotated[
        str, typer.Option(help="target, draft, semanticspec, specsampling, assisted or specreason.")
    ] = "semanticspec",
    probe: Annotated[
        str,
        typer.Option(
            help="Probe variant from the registry: random, last, all or mix; <variant>@<domain> for one "
            "domain's probes (train.domains), e.g. all@math."
        ),
    ] = "all",
    max_new_tokens: MaxNewTokensOpt = None,
    temperature: Annotated[
        float | None, typer.Option(help="0 = greedy (default: params' evaluate.decode.temperature).")
    ] = None,
    gamma: Annotated[
        int | None,
        typer.Option(help="Draft steps per verification (default: params' evaluate.decode.gamma)."),
    ] = None,
    seed: Annotated[int | None, typer.Option(help="The seed of the answer's draws (default: 0).")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print the full trace as JSON.")] = False,
) -> None:
    """Answer a question, streaming each step as it is accepted (draft) or written by the target."""
    import json

    from semspec.models.spec.names import METHODS, PROBE_METHOD, PROBE_VARIANTS, split_probe_key

    # every argument is checked before any model loads (that takes a minute on a CPU)
    if not question.strip():
        raise typer.BadParameter("the question is empty", param_hint="QUESTION")
    if method not in METHODS:
        raise typer.BadParameter(f"expected one of {', '.join(METHODS)}", param_hint="--method")
    if method == PROBE_METHOD:
        try:
            split_probe_key(probe)
        except ValueError as e:
            raise typer.BadParameter(
                f"{e} (or <variant>@<domain>: {', '.join(PROBE_VARIANTS)})", param_hint="--probe"
            ) from None
    from semspec.tasks.answer import open_decoder, summary_line
    from semspec.tasks.config import load_params

    params = or_exit(load_params)
    options = {"max_new_tokens": max_new_tokens, "temperature": temperature, "gamma": gamma, "seed": seed}
    dec = or_exit(lambda: open_decoder(params, pair or params.pair, method, probe, **options))
    res = dec.decode(question, on_step=None if json_out else _show_step)
    if json_out:
        typer.echo(json.dumps(res.to_dict(), indent=2, default=str))
        return
    typer.echo(f"answer: {res.answer}\n{summary_line(res)}")


def bench(
    pair: PairOpt = None,
    n: QuestionsOpt = 8,
    max_new_tokens: MaxNewTokensOpt = None,
    assisted: AssistedOpt = True,
    probe: ProbeVariantsOpt = None,
    salvage: SalvageOpt = None,
    both_salvage: BothSalvageOpt = False,
    batch: BatchSizesOpt = None,
    lookahead: LookaheadOpt = None,
    gamma: GammasOpt = None,
    min_token_p: MinTokenPOpt = None,
    llamacpp: LlamacppOpt = False,
    llamacpp_bin: LlamacppBinOpt = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print the summary as JSON.")] = False,
) -> None:
    """Time target, token-level speculative sampling, assisted generation and SemanticSpec (each registered
    probe) on the same questions; speed-ups by mean latency (the paper's) and per output token. With
    --llamacpp: llama.cpp beside them. With --batch: throughput per batch size (continuous batching),
    each beside the target at that size."""
    import json

    from semspec.models.spec.names import PROBE_VARIANTS
    from semspec.tasks import bench as bench_task
    from semspec.tasks.config import load_params

    params = or_exit(load_params)
    variants = tuple(probe or (["all"] if batch else PROBE_VARIANTS))
    first = gamma[0] if gamma else None
    options = dict(max_new_tokens=max_new_tokens, salvage=salvage, lookahead=lookahead, gamma=first)
    options |= {"min_token_p": min_token_p}  # None: the params' value (tasks.decoders.decode_settings)
    also = tuple(dict.fromkeys(gamma[1:])) if gamma else ()
    if also and batch:
        raise typer.BadParameter("one gamma with --batch", param_hint="--gamma")
    if llamacpp and batch:
        raise typer.BadParameter("--llamacpp runs with the one-at-a-time table", param_hint="--batch")
    server = None
    if llamacpp:
        from semspec.tasks.llamacpp import find_server

        server = or_exit(lambda: find_server(llamacpp_bin))
    summary, table = or_exit(
        lambda: bench_task.bench(
            params,
            pair or params.pair,
            n,
            tuple(batch or ()),
            variants,
            assisted,
            both_salvage,
            also,
            server,
            **options,
        )
    )
    typer.echo(json.dumps(summary, indent=2) if json_out else table)
