"""The API and the server on the real embedded pair: ``import semspec`` from outside the checkout with
exported probes and no MLflow, the openai client against the server (streaming and not), and
schemathesis generating requests from the server's OpenAPI schema."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from openai import OpenAI

from semspec.models.spec.settings import DecodeSettings
from tests.helpers.serving import running_server, write_untrained_probes

pytestmark = pytest.mark.embedded
ROOT = Path(__file__).resolve().parents[2]
Q = "Tom has 3 apples and buys 4 more. How many apples does he have?"


def run_elsewhere(script: str, tmp_path: Path) -> dict:
    """Run ``script`` in a fresh interpreter from ``tmp_path`` (outside the checkout, no MLflow settings,
    its own SEMSPEC_HOME); the JSON its last line prints."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "SEMSPEC_PROJECT"))}
    env |= {"SEMSPEC_HOME": str(tmp_path / "home"), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def probes_dir(tmp_path_factory, embedded_pair, draft_lm, target_lm) -> Path:
    """An exported folder of untrained ``all`` probes for the embedded pair."""
    return write_untrained_probes(tmp_path_factory.mktemp("probes"), embedded_pair, draft_lm, target_lm)


def test_the_api_works_from_outside_the_checkout_with_exported_probes_and_no_mlflow(tmp_path, probes_dir):
    script = textwrap.dedent(
        f"""
        import json, sys
        import semspec
        try:
            semspec.load("embedded", probes={str(probes_dir)!r}, probe="mix")
        except ValueError as e:
            refused = str(e)
        llm = semspec.load("embedded", probes={str(probes_dir)!r})
        out = llm.generate({Q!r}, max_new_tokens=32)
        streamed = list(llm.stream({Q!r}, max_new_tokens=32))
        many = llm.generate([{Q!r}, "What is 6 times 7?"], max_new_tokens=16)
        print(json.dumps({{
            "module": semspec.__file__, "text": out.text, "refused": refused,
            "steps": [s.to_dict() for s in out.steps], "streamed": [s.to_dict() for s in streamed],
            "many": [m.text for m in many], "first_alone": llm.generate({Q!r}, max_new_tokens=16).text,
            "mlflow": "mlflow" in sys.modules,
        }}))
        """
    )
    out = run_elsewhere(script, tmp_path)
    assert Path(out["module"]).parent.parent == ROOT  # the installed package, run from elsewhere
    assert "no probes of variant 'mix'" in out["refused"]
    assert out["text"] and out["text"] == "".join(s["text"] for s in out["steps"])
    assert out["streamed"] == out["steps"]
    assert any(s["author"] == "draft" for s in out["steps"]) or any(
        s["accepted"] is False for s in out["steps"]
    )
    assert all(s["p"] is not None and s["q"] is not None for s in out["steps"] if s["accepted"] is not None)
    assert out["many"][0] == out["first_alone"]  # a prompt decodes alike alone and in a batch
    assert not out["mlflow"]
    assert not (tmp_path / "home" / "mlruns.db").exists() and not (tmp_path / "mlruns.db").exists()


PIPELINE = ("prefect", "mlflow", "ray", "dvc", "lightning", "pytorch_lightning")


def test_the_api_and_the_server_run_with_the_pipeline_blocked_from_import(tmp_path, probes_dir):
    """The core (the API, the server, the CPU runtime, probes from a folder) never imports the pipeline:
    with Prefect, MLflow, Ray, DVC and Lightning made unimportable, the embedded pair loads from an
    exported probe folder and the server answers a request."""
    script = textwrap.dedent(
        f"""
        import json, sys
        for name in {PIPELINE!r}:
            sys.modules[name] = None  # `import name` fails, as where it is not installed
        import semspec
        from fastapi.testclient import TestClient
        from semspec.flows.serve.app import create_app
        from semspec.flows.serve.config import ServeConfig
        llm = semspec.load("embedded", probes={str(probes_dir)!r})
        with TestClient(create_app(llm, ServeConfig()), base_url="http://127.0.0.1") as client:
            r = client.post("/v1/chat/completions", json={{"messages": [{{"role": "user", "content": {Q!r}}}],
                                                          "max_tokens": 16}})
        print(json.dumps({{"status": r.status_code, "body": r.json()}}))
        """
    )
    out = run_elsewhere(script, tmp_path)
    assert out["status"] == 200, out
    assert (
        out["body"]["choices"][0]["message"]["content"] and out["body"]["semspec"]["method"] == "semanticspec"
    )


def test_load_refuses_bad_input_before_any_model_loads(probes_dir):
    import semspec

    with pytest.raises(ValueError, match="unknown model pair"):
        semspec.load("no-such-pair")
    with pytest.raises(ValueError, match="variant"):
        semspec.load("embedded", probes=probes_dir, probe="bogus")
    with pytest.raises(ValueError, match=r"does not exist|not a folder|repo id"):
        semspec.load("embedded", probes="/nonexistent/folder")


@pytest.fixture(scope="module")
def served(embedded_pair, draft_lm, target_lm, probes_dir):
    from semspec.api import SemanticSpec

    llm = SemanticSpec(
        embedded_pair,
        {"draft": draft_lm, "target": target_lm},
        DecodeSettings(max_new_tokens=24),
        "all",
        probes_dir,
        4,
    )
    with running_server(llm, max_tokens_limit=24) as (base, _app):
        yield base, llm


def test_the_openai_client_against_the_embedded_pair(served):
    base, llm = served
    client = OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=300)
    messages = [{"role": "user", "content": Q}]
    out = client.chat.completions.create(model="embedded", messages=messages, max_tokens=24)
    alone = llm.generate(messages, max_new_tokens=24)
    assert out.choices[0].message.content == alone.text
    assert [s["author"] for s in out.model_extra["semspec"]["steps"]] == [s.author for s in alone.steps]
    stream = client.chat.completions.create(model="embedded", messages=messages, max_tokens=24, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == alone.text


@pytest.mark.parametrize(
    ("path", "method", "examples"),
    [
        ("/v1/chat/completions", "POST", 10),
        ("/v1/completions", "POST", 6),
        ("/v1/models", "GET", 2),
        ("/health", "GET", 2),
    ],
)
def test_schemathesis_finds_no_server_error(served, path, method, examples):
    """Requests generated from the OpenAPI schema, valid and not: no 5xx, every response as documented
    (schemathesis's checks: status codes, content types, response schemas)."""
    base, _ = served
    operation = schemathesis.openapi.from_url(f"{base}/openapi.json")[path][method]

    @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(case=operation.as_strategy())
    def check(case):
        case.call_and_validate(timeout=300)

    check()


@pytest.mark.timeout(900)
def test_the_same_app_runs_as_a_ray_serve_replica(tmp_path, probes_dir):
    """`semspec serve --replicas 1`: Ray Serve's proxy in front of one replica of the embedded pair."""
    import signal

    import httpx

    from tests.helpers.project import free_port

    port = free_port()
    log = (tmp_path / "serve.log").open("w")
    cmd = [
        str(Path(sys.executable).parent / "semspec"),
        "serve",
        "--pair",
        "embedded",
        "--probes",
        str(probes_dir),
    ]
    proc = subprocess.Popen(
        [*cmd, "--port", str(port), "--replicas", "1"], stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path
    )
    try:
        base, deadline = f"http://127.0.0.1:{port}", time.time() + 600
        while time.time() < deadline and proc.poll() is None:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            time.sleep(2)
        assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
        body = {"messages": [{"role": "user", "content": Q}], "max_tokens": 16}
        r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        assert (
            r.json()["semspec"]["method"] == "semanticspec" and r.json()["choices"][0]["message"]["content"]
        )
        bad = httpx.post(f"{base}/v1/chat/completions", json={"messages": []}, timeout=60)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages"
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
