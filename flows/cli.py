"""The ``semspec`` command line (Typer): one command per pipeline stage and tool."""

from __future__ import annotations

import logging
import time
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

PairOpt = Annotated[
    str, typer.Option("--pair", "-p", help="Model pair: a name in conf/pairs/ or a YAML path.")
]

CHECK_QUESTION = (
    "A store sells pencils at 3 for $1. Tom buys 12 pencils and 4 erasers that cost $0.50 each. "
    "How much does Tom spend in total?"
)
CHECK_STEP = "First, 12 pencils at 3 for $1 means 12 / 3 = 4 groups, so the pencils cost $4.\n\n"


@app.callback()
def _main(verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Debug logging.")] = False) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    for noisy in ("httpx", "urllib3", "filelock", "transformers.modeling_utils"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


@app.command("env")
def env_cmd() -> None:
    """Print the project's local/offline environment as shell `export` lines (eval it)."""
    from flows.env import shell_exports

    typer.echo(shell_exports())


@models_app.command("check")
def models_check(
    pair: PairOpt = "embedded",
    tokens: Annotated[int, typer.Option(help="Tokens to decode when timing.")] = 24,
) -> None:
    """Load both models of a pair, print their shapes and speeds, and generate one step with each."""
    from models.lm import load_lm
    from models.spec import load_pair

    cfg = _or_exit(load_pair, pair)
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
        score = lm.score_step(state, CHECK_STEP)
        prefill_ms = (time.perf_counter() - t0) / len(score.token_ids) * 1000
        typer.echo(
            f"[{role}] id={spec.model_id} layers={lm.num_layers} hidden_size={lm.hidden_size} "
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
