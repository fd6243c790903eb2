"""Shared fixtures: offline environment, the local data folder, the embedded pair (loaded once)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("DO_NOT_TRACK", "true")
os.environ.setdefault("RAY_AUTH_MODE", "token")  # as the CLI sets it, before anything imports Ray


@pytest.fixture(autouse=True)
def _fresh_settings():
    """Settings are read once per process; each test reads its own environment (monkeypatch.setenv)."""
    from semspec.models.project.settings import settings

    settings.cache_clear()
    yield
    settings.cache_clear()


@pytest.fixture(scope="session")
def data_dir() -> Path:
    """The local copy of the benchmarks: $SEMSPEC_DATA_DIR, else ../shared/data beside the repo."""
    d = Path(os.environ.get("SEMSPEC_DATA_DIR") or ROOT.parent / "shared" / "data")
    if not d.is_dir():
        pytest.skip(f"no local data folder at {d}; set SEMSPEC_DATA_DIR")
    return d


@pytest.fixture(scope="session")
def embedded_pair():
    from semspec.models.project.pairs import load_pair

    return load_pair("embedded")


@pytest.fixture(scope="session")
def draft_lm(embedded_pair):
    """The embedded draft (~18 s to convert from GGUF, under a second from its converted copy), once per
    test session."""
    from semspec.models.lm import load_lm

    return load_lm(embedded_pair.draft)


@pytest.fixture(scope="session")
def target_lm(embedded_pair):
    """The embedded target (~50 s to convert from GGUF, ~4 s from its converted copy), once per test
    session."""
    from semspec.models.lm import load_lm

    return load_lm(embedded_pair.target)


_OBSERVED: list[str] = []


@pytest.fixture
def observed(request):
    """``observed(text)``: what a fault test saw (rows kept, work redone, seconds to fail), printed in the
    ``observed under faults`` section at the end of the run, so every run reports the figures."""

    def note(text: str) -> None:
        _OBSERVED.append(f"{request.node.nodeid}: {text}")

    return note


def pytest_terminal_summary(terminalreporter) -> None:
    """Print the fault tests' observations after the results."""
    if _OBSERVED:
        terminalreporter.section("observed under faults")
        for line in _OBSERVED:
            terminalreporter.write_line(line)
