"""``semspec serve``: its options (one alias each) and the command, which checks them into a
``ServeConfig`` before any model loads and runs the server."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Annotated

import typer

from semspec.flows.cli.common import PairOpt, or_exit

ProbesOpt = Annotated[
    str | None,
    typer.Option(
        help="Exported probes: a folder or a Hub repo id (default: the local registry's champions)."
    ),
]
ProbeOpt = Annotated[
    str, typer.Option(help="Probe variant (all, last, mix, random); 'none' serves baselines only.")
]
HostOpt = Annotated[str, typer.Option(help="Address to bind; another than loopback needs --api-key.")]
PortOpt = Annotated[int, typer.Option(help="TCP port.")]
ApiKeyOpt = Annotated[
    str | None,
    typer.Option(
        envvar="SEMSPEC_API_KEY",
        help="Required as 'Authorization: Bearer KEY' (the variable or --api-key-file keeps it out of ps).",
    ),
]
ApiKeyFileOpt = Annotated[
    Path | None, typer.Option(help="A file holding the API key (its first line).", dir_okay=False)
]
MaxBatchOpt = Annotated[int, typer.Option(help="Rows decoded at once (continuous batching).")]
MaxQueueOpt = Annotated[int, typer.Option(help="Requests that may wait; one more is answered 429.")]
SpecMaxBatchOpt = Annotated[
    str,
    typer.Option(
        help="Requests in flight up to which SemanticSpec speculates (above: the target alone): auto "
        "(measured per CPU kind, conf/serving.yaml), always, or a count."
    ),
]
MaxTokensLimitOpt = Annotated[int, typer.Option(help="The largest max_tokens a request may ask.")]
ReplicasOpt = Annotated[
    int, typer.Option(help="0: one process (uvicorn); N >= 1: N replicas under Ray Serve.")
]
MaxBodyOpt = Annotated[int, typer.Option(help="A request body's bytes; more is answered 413.")]
BodyTimeoutOpt = Annotated[float, typer.Option(help="Seconds to receive a body; slower is answered 408.")]
MaxMessagesOpt = Annotated[int, typer.Option(help="A chat's messages.")]
MaxCharsOpt = Annotated[int, typer.Option(help="A prompt's characters, every message together.")]
MaxPromptTokensOpt = Annotated[int, typer.Option(help="A prompt's tokens, in either model.")]
MaxBatchTokensOpt = Annotated[
    int | None,
    typer.Option(
        help="Tokens (prompt + max_tokens) the batch's rows may hold together (default: room for "
        "--max-batch rows of the largest request)."
    ),
]
ConcurrencyOpt = Annotated[int, typer.Option(help="Open connections; one more is answered 503.")]
KeepAliveOpt = Annotated[int, typer.Option(help="Seconds an idle keep-alive connection stays.")]
PublicMetricsOpt = Annotated[
    bool, typer.Option(help="Serve /metrics without the API key (a scraper on a trusted network).")
]


def serve(
    pair: PairOpt = None,
    probes: ProbesOpt = None,
    probe: ProbeOpt = "all",
    host: HostOpt = "127.0.0.1",
    port: PortOpt = 8000,
    api_key: ApiKeyOpt = None,
    api_key_file: ApiKeyFileOpt = None,
    max_batch: MaxBatchOpt = 8,
    max_queue: MaxQueueOpt = 64,
    spec_max_batch: SpecMaxBatchOpt = "auto",
    max_tokens_limit: MaxTokensLimitOpt = 2048,
    replicas: ReplicasOpt = 0,
    max_body_bytes: MaxBodyOpt = 1 << 20,
    body_timeout: BodyTimeoutOpt = 10.0,
    max_messages: MaxMessagesOpt = 256,
    max_prompt_chars: MaxCharsOpt = 200_000,
    max_prompt_tokens: MaxPromptTokensOpt = 4096,
    max_batch_tokens: MaxBatchTokensOpt = None,
    limit_concurrency: ConcurrencyOpt = 256,
    timeout_keep_alive: KeepAliveOpt = 5,
    public_metrics: PublicMetricsOpt = False,
) -> None:
    """Serve the pair over OpenAI's API (/v1/chat/completions, /v1/completions, /v1/models, /health,
    /metrics); concurrent requests are decoded together."""
    from semspec.flows.serve.config import ServeConfig, parse_spec_max_batch, read_key_file
    from semspec.flows.serve.run import run_server

    options = {k: v for k, v in locals().items() if k in {f.name for f in fields(ServeConfig)}}
    if api_key_file is not None:
        if api_key:
            raise typer.BadParameter("give the key once: --api-key (SEMSPEC_API_KEY) or --api-key-file")
        options["api_key"] = or_exit(lambda: read_key_file(api_key_file))
    options["spec_max_batch"] = or_exit(lambda: parse_spec_max_batch(spec_max_batch))
    cfg = or_exit(lambda: ServeConfig(**options))
    if replicas < 0:
        raise typer.BadParameter("must be >= 0", param_hint="--replicas")
    or_exit(lambda: run_server(pair, probes, None if probe == "none" else probe, cfg, replicas))
