"""Run a pipeline stage the way ``dvc.yaml`` defines it.

``dvc.yaml`` is the one definition of every stage (its command, inputs and outputs); the Prefect flow
runs those definitions and never restates a path:

- for the configuration ``params.yaml`` names (its ``pair`` and ``profile``, no overrides) a stage runs
  as ``dvc repro --single-item <stage>``: DVC skips it when nothing changed and records what it made in
  ``dvc.lock``, so ``dvc repro`` afterwards has nothing to do;
- for any other pair, profile or override (a scheduled retrain of a new pair, a tiny test run) the same
  ``cmd`` runs with ``${pair}``/``${profile}`` filled in and ``--pair/--profile/--set`` appended.
  ``dvc.lock`` describes ``params.yaml``'s configuration only, so these runs are not recorded there.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shlex
import signal
import subprocess
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from semspec.flows.env import with_venv_path
from semspec.models.project.names import STAGES
from semspec.models.project.pairs import project_root
from semspec.tasks.config import read_params_file

log = logging.getLogger(__name__)

_VAR = re.compile(r"\$\{(\w+)\}")


class StageFailed(RuntimeError):
    """A stage command exited with an error; the message ends with its last output lines."""


@dataclass
class StageRun:
    """How one stage run went."""

    stage: str
    pair: str
    mode: str  # "dvc" (dvc repro, recorded in dvc.lock) | "direct" (the stage command)
    skipped: bool  # DVC found nothing changed
    seconds: float
    command: str


def tracked_config(root: Path | None = None) -> tuple[str, str]:
    """The (pair, profile) that ``params.yaml`` names, i.e. what ``dvc.lock`` records."""
    raw = read_params_file((root or project_root()) / "params.yaml")
    return str(raw.get("pair", "embedded")), str(raw.get("profile", "demo"))


def _stage_def(stage: str, root: Path | None) -> tuple[Path, dict]:
    path = (root or project_root()) / "dvc.yaml"
    stages = (yaml.safe_load(path.read_text(encoding="utf-8")) or {}).get("stages", {})
    if stage not in stages:
        raise ValueError(f"{path} has no stage {stage!r}; stages: {', '.join(stages)}")
    return path, stages[stage]


def _fill(text: str, pair: str, profile: str, where: str) -> str:
    values = {"pair": pair, "profile": profile}

    def sub(m: re.Match) -> str:
        if m.group(1) not in values:
            raise ValueError(f"{where} uses ${{{m.group(1)}}}; only pair and profile are known")
        return values[m.group(1)]

    return _VAR.sub(sub, text)


def stage_command(stage: str, pair: str, profile: str, root: Path | None = None) -> list[str]:
    """``dvc.yaml``'s command for ``stage`` with ``${pair}`` and ``${profile}`` filled in, as argv."""
    path, st = _stage_def(stage, root)
    return shlex.split(_fill(" ".join(str(st["cmd"]).split()), pair, profile, f"{path}: stage {stage}"))


def stage_option(stage: str, option: str, pair: str, profile: str, root: Path | None = None) -> Path:
    """The path ``dvc.yaml``'s command passes to ``semspec <stage> --<option>``, under the project root
    (so the CLI's defaults are the pipeline's paths, written once)."""
    root = root or project_root()
    argv = stage_command(stage, pair, profile, root)
    flag = f"--{option}"
    if flag not in argv[:-1]:
        raise ValueError(f"dvc.yaml's {stage} command has no {flag}; pass {flag} explicitly")
    return root / argv[argv.index(flag) + 1]


def stage_files(stage: str, kind: str, pair: str, profile: str, root: Path | None = None) -> list[Path]:
    """The ``outs``, ``metrics`` or ``plots`` that ``dvc.yaml`` declares for ``stage`` (absolute paths)."""
    root = root or project_root()
    path, st = _stage_def(stage, root)
    entries = st.get(kind) or []
    names = [next(iter(e)) if isinstance(e, dict) else str(e) for e in entries]
    return [root / _fill(n, pair, profile, f"{path}: stage {stage}") for n in names]


@dataclass(frozen=True)
class StageRequest:
    """One stage to run: for a pair and profile, with ``section.key=value`` overrides; ``force`` reruns
    it under DVC even when nothing changed; ``root`` is the project (default: this one)."""

    stage: str
    pair: str
    profile: str
    overrides: tuple[str, ...] = ()
    force: bool = False
    root: Path | None = None


def plan_stage(req: StageRequest) -> tuple[str, list[str]]:
    """(mode, argv) for one stage run: ``dvc repro`` for the tracked configuration, else the command."""
    stage, pair, profile, overrides, force = req.stage, req.pair, req.profile, req.overrides, req.force
    root = req.root or project_root()
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}; expected one of {', '.join(STAGES)}")
    if (pair, profile) == tracked_config(root) and not overrides and (root / ".dvc").is_dir():
        return "dvc", ["dvc", "repro", "--single-item", *(["--force"] if force else []), stage]
    argv = [*stage_command(stage, pair, profile, root), "--pair", pair, "--profile", profile]
    for o in overrides or []:
        argv += ["--set", o]
    return "direct", argv


def stage_env() -> dict[str, str]:
    """This process's environment with its Python's ``bin`` first on PATH (``semspec``, ``dvc``) and
    progress bars throttled for log capture."""
    env = with_venv_path(dict(os.environ))
    env.setdefault("TQDM_MININTERVAL", "15")
    env["PYTHONUNBUFFERED"] = "1"
    return env


_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
_NOISE = (  # repeated per stage, or said better elsewhere
    "git add dvc.lock",
    "dvc push",
    "To track the changes with git",
    "To enable auto staging",
    "dvc config core.autostage",  # the hint's second line arrives as a line of its own
)
_LEVELS = (
    (re.compile(r"\b(ERROR|CRITICAL|Traceback \(most recent call last\))|^\w*Error:"), logging.ERROR),
    (re.compile(r"\b(WARNING|Warning:|\w+Warning\b)"), logging.WARNING),
)


def clean_line(message: str) -> str | None:
    """A line of stage output as a log shows it: ANSI codes removed, only the last redraw of a progress
    bar, DVC's per-stage git hints dropped (None)."""
    text = _ANSI.sub("", message).split("\r")[-1].rstrip()
    if not text.strip() or any(n in text for n in _NOISE):
        return None
    return text


def line_level(text: str) -> int:
    """The log level a line of stage output reads as (errors and warnings keep theirs; the rest INFO)."""
    return next((level for pattern, level in _LEVELS if pattern.search(text)), logging.INFO)


def stage_line_logger(logger: Any) -> Callable[[str], None]:
    """``on_line`` for ``run_stage``: each line cleaned (``clean_line``), logged at its own level, a line
    repeated within the last few (libraries that print to both streams) logged once."""
    recent: deque[str] = deque(maxlen=20)

    def emit(line: str) -> None:
        text = clean_line(line)
        if text is None or text in recent:
            return
        recent.append(text)
        logger.log(line_level(text), "%s", text)

    return emit


def stream_process(argv: list[str], cwd: Path, env: dict[str, str], on_line: Callable[[str], None]) -> int:
    """Run ``argv`` in its own process group, streaming its non-empty output lines (a progress bar's
    ``\\r`` redraws split) to ``on_line``; returns its exit code. When it ends, however it ends (a crash, a
    SIGKILL), and when this process is interrupted, whatever it left in its group (Ray's GCS, raylet,
    agents and actors) is stopped."""
    with subprocess.Popen(
        argv,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        start_new_session=True,
    ) as proc:
        try:
            assert proc.stdout is not None
            for raw in proc.stdout:
                for line in raw.rstrip("\n").split("\r"):
                    if line.strip():
                        on_line(line)
            return proc.wait()
        finally:
            stop_group(proc.pid)


def stop_group(pgid: int, grace: float = 5.0) -> None:
    """SIGTERM the processes left in group ``pgid``, SIGKILL those still there after ``grace`` seconds;
    nothing when the group is empty (a stage that ended cleanly)."""
    try:
        os.killpg(pgid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        return
    log.warning("stopping the processes the stage left behind (process group %d)", pgid)
    deadline = time.monotonic() + grace
    with contextlib.suppress(ProcessLookupError, PermissionError):
        while time.monotonic() < deadline:
            time.sleep(0.1)
            os.killpg(pgid, 0)
        os.killpg(pgid, signal.SIGKILL)


def run_stage(req: StageRequest, on_line: Callable[[str], None] = log.info) -> StageRun:
    """Run one stage (see the module doc), streaming its output lines to ``on_line``.

    Raises ``StageFailed`` (with the last output lines) when the command fails."""
    stage, pair, root = req.stage, req.pair, req.root or project_root()
    mode, argv = plan_stage(req)
    command = shlex.join(argv)
    on_line(f"$ {command}")
    tail: deque[str] = deque(maxlen=40)
    skipped = False

    def line_out(line: str) -> None:
        nonlocal skipped
        tail.append(line)
        on_line(line)
        skipped |= f"Stage '{stage}' didn't change, skipping" in line

    t0 = time.perf_counter()
    rc = stream_process(argv, root, stage_env(), line_out)
    if rc != 0:
        raise StageFailed(f"stage {stage} ({pair}) failed with exit code {rc}: {command}\n" + "\n".join(tail))
    return StageRun(stage, pair, mode, skipped and mode == "dvc", time.perf_counter() - t0, command)
