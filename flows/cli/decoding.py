"""The ``semspec`` commands that decode: grade, decode, bench and serve.

Each parses its options, checks them before any model loads, and calls a task (``tasks.answer``,
``tasks.bench``) or the server (``flows.serve``); those are imported when the command runs, so the CLI
starts without torch. ``semspec.flows.cli`` registers these functions as commands.
"""

from __future__ import annotations

from pathlib import Path
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


def serve(
    pair: PairOpt = None,
    probes: Annotated[
        str | None,
        typer.Option(
            help="Exported probes: a folder or a Hub repo id (default: the local registry's champions)."
        ),
    ] = None,
    probe: Annotated[
        str, typer.Option(help="Probe variant (all, last, mix, random); 'none' serves baselines only.")
    ] = "all",
    host: Annotated[
        str, typer.Option(help="Address to bind; another than loopback needs --api-key.")
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port.")] = 8000,
    api_key: Annotated[
        str | None,
        typer.Option(
            envvar="SEMSPEC_API_KEY",
            help="Required as 'Authorization: Bearer KEY' (the variable or --api-key-file keeps it out of ps).",
        ),
    ] = None,
    api_key_file: Annotated[
        Path | None, typer.Option(help="A file holding the API key (its first line).", dir_okay=False)
    ] = None,
    max_batch: Annotated[int, typer.Option(help="Rows decoded at once (continuous batching).")] = 8,
    max_queue: Annotated[int, typer.Option(help="Requests that may wait; one more is answered 429.")] = 64,
    spec_max_batch: Annotated[
        str,
        typer.Option(
            help="Requests in flight up to which SemanticSpec speculates (above: the target alone): auto "
            "(measured per CPU kind, conf/serving.yaml), always, or a count."
        ),
    ] = "auto",
    max_tokens_limit: Annotated[int, typer.Option(help="The largest max_tokens a request may ask.")] = 2048,
    replicas: Annotated[
        int, typer.Option(help="0: one process (uvicorn); N >= 1: N replicas under Ray Serve.")
    ] = 0,
    max_body_bytes: Annotated[int, typer.Option(help="A request body's bytes; more is answered 413.")] = 1
    << 20,
    body_timeout: Annotated[
        float, typer.Option(help="Seconds to receive a body; slower is answered 408.")
    ] = 10.0,
    max_messages: Annotated[int, typer.Option(help="A chat's messages.")] = 256,
    max_prompt_chars: Annotated[
        int, typer.Option(help="A prompt's characters, every message together.")
    ] = 200_000,
    max_prompt_tokens: Annotated[int, typer.Option(help="A prompt's tokens, in either model.")] = 4096,
    max_batch_tokens: Annotated[
        int | None,
        typer.Option(
            help="Tokens (prompt + max_tokens) the batch's rows may hold together (default: room for "
            "--max-batch rows of the largest request)."
        ),
    ] = None,
    limit_concurrency: Annotated[int, typer.Option(help="Open connections; one more is answered 503.")] = 256,
    timeout_keep_alive: Annotated[int, typer.Option(help="Seconds an idle keep-alive connection stays.")] = 5,
    public_metrics: Annotated[
        bool, typer.Option(help="Serve /metrics without the API key (a scraper on a trusted network).")
    ] = False,
) -> None:
    """Serve the pair over OpenAI's API (/v1/chat/completions, /v1/completions, /v1/models, /health,
    /metrics); concurrent requests are decoded together."""
    from semspec.flows.serve.app import run_server
    from semspec.flows.serve.config import ServeConfig, parse_spec_max_batch, read_key_file

    if api_key_file is not None:
        if api_key:
            raise typer.BadParameter("give the key once: --api-key (SEMSPEC_API_KEY) or --api-key-file")
        api_key = or_exit(lambda: read_key_file(api_key_file))
    cfg = or_exit(
        lambda: ServeConfig(
            host=host,
            port=port,
            api_key=api_key,
            max_batch=max_batch,
            max_queue=max_queue,
            spec_max_batch=parse_spec_max_batch(spec_max_batch),
            max_tokens_limit=max_tokens_limit,
            max_body_bytes=max_body_bytes,
            body_timeout=body_timeout,
            max_messages=max_messages,
            max_prompt_chars=max_prompt_chars,
            max_prompt_tokens=max_prompt_tokens,
            max_batch_tokens=max_batch_tokens,
            limit_concurrency=limit_concurrency,
            timeout_keep_alive=timeout_keep_alive,
            public_metrics=public_metrics,
        )
    )
    if replicas < 0:
        raise typer.BadParameter("must be >= 0", param_hint="--replicas")
    or_exit(lambda: run_server(pair, probes, None if probe == "none" else probe, cfg, replicas))
