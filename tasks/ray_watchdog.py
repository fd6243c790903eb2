"""Stop a stage's in-process Ray when the stage dies without stopping it (SIGKILL, out of memory).

``init_ray`` starts ``python -m semspec.tasks.ray_watchdog <pid>`` in a session of its own, with a pipe on
its stdin that only the stage holds. While the stage lives, the watchdog notes the stage's Ray processes
(its descendants named ``ray::*``, ``raylet``, ``gcs_server``, or running Ray's own scripts). When the pipe
closes (``shutdown_ray``, or the stage's death) it stops every noted process still running: Ray's reaper
stops the GCS and raylet, but its dashboard and runtime-env agents linger for minutes.
"""

from __future__ import annotations

import contextlib
import sys
import threading

import psutil

POLL_SECONDS = 1.0
GRACE_SECONDS = 2.0


def is_ray(proc: psutil.Process) -> bool:
    """Whether ``proc`` is one of Ray's processes (workers, agents, raylet, GCS, monitors)."""
    try:
        name = proc.name()
        if name.startswith("ray::") or name in ("raylet", "gcs_server"):
            return True
        return any("/ray/" in part for part in proc.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def watch(driver: int, closed: threading.Event, poll: float = POLL_SECONDS) -> list[psutil.Process]:
    """Note ``driver``'s Ray descendants every ``poll`` seconds until ``closed`` is set or the driver is
    gone; returns every process noted."""
    seen: dict[int, psutil.Process] = {}
    try:
        stage = psutil.Process(driver)
    except psutil.NoSuchProcess:
        return []
    while True:
        try:
            kids = stage.children(recursive=True)
        except psutil.NoSuchProcess:
            break
        seen.update((p.pid, p) for p in kids if p.pid not in seen and is_ray(p))
        if closed.wait(poll) or not stage.is_running():
            break
    return list(seen.values())


def stop(procs: list[psutil.Process], grace: float = GRACE_SECONDS) -> None:
    """SIGTERM each process still running (the same process, not a reused pid), then SIGKILL after
    ``grace`` seconds."""
    alive = [p for p in procs if p.is_running()]
    for p in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.terminate()
    _, left = psutil.wait_procs(alive, timeout=grace)
    for p in left:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()


def main() -> None:
    """``python -m semspec.tasks.ray_watchdog <stage pid>``; stdin: the stage's end of a pipe."""
    closed = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.buffer.read(), closed.set()), daemon=True).start()
    stop(watch(int(sys.argv[1]), closed))


if __name__ == "__main__":
    main()
