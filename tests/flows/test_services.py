"""Service lifecycle with a stand-in server: idempotent start, port conflicts, stopping only our PIDs."""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

import psutil
import pytest

from semspec.flows import services as svcs
from semspec.flows.services import Service, port_in_use, start, state_dir, stop
from semspec.tasks.environment import apply_env, services_settings
from tests.helpers.project import free_port


def http_service(port: int) -> Service:
    argv = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"]
    return Service("web", argv, port, f"http://127.0.0.1:{port}/", ready_timeout=30)


def test_start_is_idempotent_and_stop_ends_the_process(tmp_path: Path):
    svc = http_service(free_port())
    msgs: list[str] = []
    start(svc, tmp_path, msgs.append)
    rec = json.loads((state_dir(tmp_path) / "web.json").read_text())
    assert port_in_use(svc.port) and psutil.pid_exists(rec["pid"])
    start(svc, tmp_path, msgs.append)  # already running: nothing new
    assert msgs[-1] == "web: already running"
    assert json.loads((state_dir(tmp_path) / "web.json").read_text())["pid"] == rec["pid"]
    assert stop(svc, tmp_path, echo=msgs.append)
    assert not psutil.pid_exists(rec["pid"]) or psutil.Process(rec["pid"]).status() == psutil.STATUS_ZOMBIE
    assert not port_in_use(svc.port) and not (state_dir(tmp_path) / "web.json").exists()
    assert not stop(svc, tmp_path)  # nothing left to stop
    assert (state_dir(tmp_path) / "web.log").is_file()


def test_a_port_taken_by_another_process_is_a_clear_error(tmp_path: Path):
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        svc = http_service(other.getsockname()[1])
        with pytest.raises(RuntimeError, match=f"port 127.0.0.1:{svc.port} is already in use"):
            start(svc, tmp_path)
    assert not (state_dir(tmp_path) / "web.json").exists()


def test_a_service_that_exits_reports_its_log(tmp_path: Path):
    svc = Service(
        "bad",
        [sys.executable, "-c", "print('cannot start: no config'); raise SystemExit(4)"],
        None,
        "http://127.0.0.1:1/",
    )
    with pytest.raises(RuntimeError, match="bad exited with code 4") as e:
        start(svc, tmp_path)
    assert "cannot start: no config" in str(e.value)


@pytest.mark.parametrize("since_boot", [True, False])
def test_stop_never_signals_a_process_it_did_not_start(tmp_path: Path, since_boot: bool):
    d = state_dir(tmp_path)
    d.mkdir()
    me = psutil.Process(os.getpid())  # a recycled PID: same number, another start time
    rec = {"pid": me.pid, "create_time": me.create_time() - 100, "argv": []}
    if since_boot:
        rec["since_boot"] = me.create_time() - psutil.boot_time() - 100
    (d / "web.json").write_text(json.dumps(rec))
    assert not stop(http_service(free_port()), tmp_path)
    assert me.is_running() and not (d / "web.json").exists()


def test_a_service_stays_ours_when_the_wall_clock_moves(tmp_path: Path):
    """NTP moves the boot time psutil reports, and with it every process's wall-clock start time: a
    running service must still be recognised (and stopped), or `services up` takes its port for a
    stranger's."""
    svc = http_service(free_port())
    start(svc, tmp_path)
    path = state_dir(tmp_path) / "web.json"
    rec = json.loads(path.read_text())
    path.write_text(json.dumps({**rec, "create_time": rec["create_time"] - 30}))  # the clock moved 30 s
    assert svcs._alive(json.loads(path.read_text())) is not None
    assert stop(svc, tmp_path) and not port_in_use(svc.port)


def test_status_and_ports_come_from_the_environment(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("SEMSPEC_PREFECT_PORT", "4311")
    monkeypatch.setenv("SEMSPEC_MLFLOW_PORT", "5311")
    names = {s.name: s for s in svcs.services(tmp_path)}
    assert list(names) == ["prefect", "mlflow", "serve"]
    assert names["prefect"].port == 4311 and "127.0.0.1" in names["prefect"].argv
    assert names["mlflow"].argv[names["mlflow"].argv.index("--workers") + 1] == "1"
    assert names["serve"].env["PREFECT_API_URL"] == "http://127.0.0.1:4311/api"
    assert [(s.name, s.state) for s in svcs.status(tmp_path)] == [
        ("prefect", "stopped"),
        ("mlflow", "stopped"),
        ("serve", "stopped"),
    ]
    monkeypatch.setenv("SEMSPEC_MLFLOW_PORT", "http")
    with pytest.raises(ValueError, match="SEMSPEC_MLFLOW_PORT"):
        services_settings()  # the CLI and the API read it first thing (apply_env): a bad port fails there
    with pytest.raises(ValueError, match="SEMSPEC_MLFLOW_PORT"):
        apply_env()
