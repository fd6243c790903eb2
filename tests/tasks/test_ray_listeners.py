"""Ray, as the pipeline starts it (``init_ray``, in-process), listens on loopback only and requires the
project's token: a test process lists every listening socket of Ray's processes while a task runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

PROBE = r"""
from semspec.tasks.environment import apply_env
apply_env()  # as the CLI does at its start, before anything imports Ray
import json, psutil, ray
from semspec.tasks.ray_utils import init_ray, shutdown_ray
init_ray()
assert ray.get(ray.remote(lambda: 1).remote()) == 1
import time
time.sleep(2)  # the agents bind their ports as they start
me = psutil.Process()
seen = []
for proc in [me, *me.children(recursive=True)]:
    try:
        conns = proc.net_connections(kind="inet")
    except psutil.Error:
        continue
    seen += [[proc.name(), c.laddr.ip, c.laddr.port] for c in conns if c.status == psutil.CONN_LISTEN]
from ray._private.authentication.authentication_utils import is_token_auth_enabled
print("RESULT " + json.dumps({"listening": seen, "token": is_token_auth_enabled()}))
shutdown_ray()
"""

LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}


def test_ray_listens_on_loopback_only_and_requires_a_token(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env |= {"SEMSPEC_HOME": str(tmp_path), "RAY_AUTH_TOKEN_PATH": str(tmp_path / ".ray" / "auth_token")}
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=240, check=False
    )
    lines = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    assert lines, out.stderr[-3000:]
    got = json.loads(lines[0].removeprefix("RESULT "))
    assert got["token"], f"Ray runs with token authentication\n{out.stderr[-2000:]}"
    assert len(got["listening"]) >= 3, "gcs_server, raylet and the agents listen somewhere"
    foreign = [x for x in got["listening"] if x[1] not in LOOPBACK]
    assert not foreign, f"listening beyond loopback: {foreign}\n{out.stderr[-2000:]}"
    token = tmp_path / ".ray" / "auth_token"
    assert token.is_file() and (token.stat().st_mode & 0o077) == 0, "the token is its owner's alone"
