"""The ``semspec`` command line (Typer): one command per pipeline stage and tool.

Each command parses its options and calls a stage or task function. The commands import the project's
modules when they run, not at the top: ``semspec --help``, ``semspec env`` and the service commands must not
pay for torch, transformers and MLflow (seconds). The stage commands are in ``stages``, the command
groups (models, data, judge, services, pairs) in ``groups``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated

import typer

from semspec.flows.cli.common import PairOpt, PairOverride, ProfileOpt, or_exit
from semspec.flows.cli.groups import GROUPS
from semspec.flows.cli.stages import add_stage_commands

app = typer.Typer(
    help="SemanticSpec: semantic-aware speculative decoding for reasoning LLMs, with its probe pipeline.",
    no_args_is_help=True,
    add_completion=False,
)
for _name, _group in GROUPS.items():
    app.add_typer(_group, name=_name)
add_stage_commands(app)


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


@app.command("env")
def env_cmd() -> None:
    """Print the project's local/offline environment as shell `export` lines (eval it)."""
    from semspec.flows.env import shell_exports

    typer.echo(shell_exports())


@app.command()
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


MaxNewTokensOpt = Annotated[
    int | None, typer.Option(help="Output token budget (default: params' evaluate.decode.max_new_tokens).")
]


@app.command()
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


@app.command()
def bench(
    pair: PairOpt = None,
    n: Annotated[int, typer.Option(help="Questions (arithmetic test split).")] = 8,
    max_new_tokens: MaxNewTokensOpt = None,
    assisted: Annotated[bool, typer.Option(help="Include transformers' assisted generation.")] = True,
    probe: Annotated[
        list[str] | None, typer.Option(help="Probe variants for SemanticSpec (repeat; default: all four).")
    ] = None,
    salvage: Annotated[
        bool | None,
        typer.Option(
            "--salvage/--no-salvage",
            help="SemanticSpec salvages rejected steps, greedy (default: params' evaluate.decode.salvage).",
        ),
    ] = None,
    both_salvage: Annotated[
        bool, typer.Option("--both-salvage", help="Also run each SemanticSpec variant the other way.")
    ] = False,
    batch: Annotated[
        list[int] | None,
        typer.Option(
            help="Batch sizes (repeat, e.g. --batch 1 --batch 4 --batch 8): throughput of target and "
            "SemanticSpec per batch size instead of the one-at-a-time table."
        ),
    ] = None,
    lookahead: Annotated[
        int | None,
        typer.Option(
            help="Steps a row may write ahead in a batch (default: params' evaluate.decode.lookahead)."
        ),
    ] = None,
    gamma: Annotated[
        list[int] | None,
        typer.Option(
            help="SemanticSpec's steps per verification (default: params' evaluate.decode.gamma); repeat to run "
            "each variant with each value in the same run (the first unlabelled, the others <label>/gamma<g>)."
        ),
    ] = None,
    min_token_p: Annotated[
        float | None,
        typer.Option(
            help="SemanticSpec's token check (default: params' evaluate.decode.min_token_p): a step the probes "
            "accept is rejected when the target gives one of its tokens a lower probability."
        ),
    ] = None,
    llamacpp: Annotated[
        bool,
        typer.Option(
            "--llamacpp",
            help="Also run llama.cpp (llama-server on the same GGUF files, bound to 127.0.0.1): its target "
            "alone and its speculative decoding with the draft; speed-ups against it and peak RSS per method.",
        ),
    ] = False,
    llamacpp_bin: Annotated[
        str | None, typer.Option(help="llama-server, or the folder holding it (default: the PATH).")
    ] = None,
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


@app.command()
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
        str | None, typer.Option(envvar="SEMSPEC_API_KEY", help="Required as 'Authorization: Bearer KEY'.")
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
) -> None:
    """Serve the pair over OpenAI's API (/v1/chat/completions, /v1/completions, /v1/models, /health,
    /metrics); concurrent requests are decoded together."""
    from semspec.flows.serve.app import ServeConfig, parse_spec_max_batch, run_server

    cfg = or_exit(
        lambda: ServeConfig(
            host=host,
            port=port,
            api_key=api_key,
            max_batch=max_batch,
            max_queue=max_queue,
            spec_max_batch=parse_spec_max_batch(spec_max_batch),
            max_tokens_limit=max_tokens_limit,
        )
    )
    if replicas < 0:
        raise typer.BadParameter("must be >= 0", param_hint="--replicas")
    or_exit(lambda: run_server(pair, probes, None if probe == "none" else probe, cfg, replicas))


deployments_app = typer.Typer(
    help="The Prefect deployments semspec/full and semspec/retrain.", no_args_is_help=True
)
app.add_typer(deployments_app, name="deployments")


@deployments_app.command("serve")
def deployments_serve() -> None:
    """Serve the deployments semspec/full and semspec/retrain (cron from params.yaml's `retrain`) and run
    their flow runs; needs the Prefect server (`semspec services up` starts both)."""
    from semspec.flows.pipeline import serve_deployments

    serve_deployments()


@app.command()
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


@app.command()
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
    from semspec.tasks.train import register_pending

    params = or_exit(load_params, None, profile, None)
    name = pair or params.pair
    folder = Path(probes) if probes else or_exit(stage_option, "train", "out", name, params.profile)
    metrics = or_exit(register_pending, folder)
    n = sum(len(v) for v in metrics.values())
    typer.echo(f"{name}: every probe registered ({n} in {folder / 'probes.json'})")
    typer.echo("record the train stage in DVC without retraining: dvc commit -f train")


@app.command()
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


def main() -> None:
    """Console-script entry point."""
    app()
