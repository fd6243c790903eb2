"""Run a deployment and follow it from the terminal: Prefect's live log stream of the flow run (each
stage's output, progress bars included, ANSI codes removed) until the run ends, then the links a user
needs (the flow run in Prefect, the probe comparison in MLflow)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from contextlib import suppress
from uuid import UUID

from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
from prefect.client.schemas.objects import FlowRun
from prefect.deployments.flow_runs import arun_deployment
from prefect.flow_runs import wait_for_flow_run
from prefect.logging.clients import get_logs_subscriber

from semspec.flows.env import service_urls
from semspec.flows.stages import clean_line


def flow_run_url(flow_run_id: UUID | str) -> str:
    """The flow run's page in the Prefect UI."""
    return f"{service_urls()['prefect']}/runs/flow-run/{flow_run_id}"


async def follow(flow_run_id: UUID, echo: Callable[[str], None], timeout: int | None = None) -> FlowRun:
    """Print the flow run's logs as they arrive (Prefect's websocket log stream) until it ends; returns
    the finished run."""
    logs = LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id]))

    async def stream() -> None:
        async with get_logs_subscriber(filter=logs) as subscriber:
            async for log in subscriber:
                if (line := clean_line(log.message)) is not None:
                    echo(f"{log.timestamp:%H:%M:%S} {line}")

    streaming = asyncio.create_task(stream())
    try:
        return await wait_for_flow_run(flow_run_id, timeout=timeout)
    finally:
        await asyncio.sleep(1)  # the last lines may still be in flight
        streaming.cancel()
        with suppress(asyncio.CancelledError, Exception):
            await streaming


async def run_and_follow(
    deployment: str, parameters: dict, echo: Callable[[str], None], timeout: int | None = None
) -> FlowRun:
    """Start a run of ``deployment`` (served by ``semspec deployments serve``) and follow it to its end."""
    run = await arun_deployment(deployment, parameters=parameters, timeout=0)
    echo(f"flow run {run.name}: {flow_run_url(run.id)}")
    return await follow(run.id, echo, timeout)
