"""llama.cpp as a bench baseline: its server started on loopback, sent the target's own prompt with the
bench's budget, timed, stopped with its peak memory read; against a stub server, and against the real
llama-server where one is on the PATH."""

from __future__ import annotations

import json
import os
import shutil
import stat
import sys
from pathlib import Path

import pytest

from semspec.models.spec.results import DecodeResult, Timings
from semspec.models.spec.settings import DecodeSettings
from semspec.tasks import bench as bench_task
from semspec.tasks.llamacpp import LlamaCppDecoder, LlamaServer, find_server
from tests.helpers.tiny import tiny_lm

STUB = r"""
import json, os, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
args = sys.argv[1:]
if "--help" in args:
    print("--spec-type none,draft-simple"); sys.exit(0)
if "--version" in args:
    print("version: 42 (stub)", file=sys.stderr); sys.exit(0)
if os.environ.get("STUB_FAIL"):
    print("error: cannot load the model", file=sys.stderr); sys.exit(3)
log = os.environ["STUB_LOG"]
with open(log, "a") as f:
    f.write(json.dumps({"argv": args}) + "\n")
port = int(args[args.index("--port") + 1])
assert args[args.index("--host") + 1] == "127.0.0.1"
spec = "-md" in args

class H(BaseHTTPRequestHandler):
    def log_message(self, *a): pass
    def _send(self, body):
        data = json.dumps(body).encode()
        self.send_response(200); self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data))); self.end_headers(); self.wfile.write(data)
    def do_GET(self):
        self._send({"status": "ok"})
    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        start = time.time()
        time.sleep(float(os.environ.get("STUB_DELAY", "0")))
        with open(log, "a") as f:
            f.write(json.dumps({"request": req, "spec": spec, "start": start, "end": time.time()}) + "\n")
        timings = {"draft_n": 10, "draft_n_accepted": 4} if spec else {}
        self._send({"content": "So 2 + 4 = 6. The answer is \\boxed{6}.", "tokens_predicted": 7,
                    "stop_type": "eos", "timings": timings})

ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
"""


@pytest.fixture
def stub(tmp_path, monkeypatch) -> Path:
    """A ``llama-server`` stand-in on the PATH that logs its arguments and requests."""
    binary = tmp_path / "bin" / "llama-server"
    binary.parent.mkdir()
    binary.write_text(f"#!{sys.executable}\n{STUB}")
    binary.chmod(binary.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{binary.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("STUB_LOG", str(tmp_path / "log.jsonl"))
    return binary


def _log(tmp_path: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]


def test_the_server_is_found_on_the_path_or_where_it_is_said(stub, tmp_path, monkeypatch):
    assert find_server(None) == str(stub)
    assert find_server(str(stub.parent)) == str(stub) == find_server(str(stub))
    with pytest.raises(ValueError, match="no llama-server at"):
        find_server(str(tmp_path / "nowhere"))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="put it on the PATH, or pass --llamacpp-bin"):
        find_server(None)


def test_each_question_goes_to_the_server_as_the_target_sees_it(stub, tmp_path):
    lm = tiny_lm()
    settings = DecodeSettings(max_new_tokens=17, temperature=0.0)
    model, draft = tmp_path / "t.gguf", tmp_path / "d.gguf"
    with LlamaServer(str(stub), model, draft, threads=2) as server:
        pid = server.proc.pid
        res = LlamaCppDecoder("llamacpp-spec", server, lm, settings).decode("What is 2 + 4?")
        assert server.version() == "42 (stub)"
    assert server.proc is None and not Path(f"/proc/{pid}").exists(), "stopped and reaped on exit"
    assert server.peak_rss_gb is not None and 0 < server.peak_rss_gb < 4
    argv, request = (e for e in _log(tmp_path))
    assert argv["argv"][argv["argv"].index("-md") + 1] == str(draft)
    assert "--spec-type" in argv["argv"], "this build picks the draft's kind explicitly"
    assert request["request"] == {
        "prompt": lm.format_prompt("What is 2 + 4?"),
        "n_predict": 17,
        "temperature": 0.0,
        "cache_prompt": False,
        "seed": 0,
    }
    assert res.method == "llamacpp-spec" and res.answer == "6" and res.output_tokens == 7
    assert res.finish_reason == "eos" and res.timings.total > 0 and res.extra["token_acceptance_rate"] == 0.4


def test_a_server_that_cannot_start_says_why(stub, tmp_path, monkeypatch):
    monkeypatch.setenv("STUB_FAIL", "1")
    server = LlamaServer(str(stub), tmp_path / "t.gguf")
    with pytest.raises(RuntimeError, match=r"exited \(3\) while starting: error: cannot load the model"):
        server.__enter__()


def _result(method: str, seconds: float, tokens: int = 10) -> DecodeResult:
    res = DecodeResult(method, "x", None)
    res.timings, res.output_tokens = Timings(total=seconds), tokens
    return res


def test_speed_ups_are_given_against_llamacpps_target_too():
    summary = bench_task.summarize(
        {
            "target": [_result("target", 2.0), _result("target", 4.0)],
            bench_task.LLAMACPP: [_result("llamacpp", 3.0), _result("llamacpp", 3.0)],
            "semanticspec-all": [_result("semanticspec", 1.0), _result("semanticspec", 2.0)],
        }
    )
    assert summary["semanticspec-all"]["speedup_vs_llamacpp"] == pytest.approx(2.0)
    assert summary["semanticspec-all"]["speedup_latency"] == pytest.approx(2.0)
    assert summary["target"]["speedup_vs_llamacpp"] == pytest.approx(1.0)
    assert summary[bench_task.LLAMACPP]["target_share"] is None, "no steps: no step figures"
    table = bench_task.format_bench(summary)
    assert "x llama.cpp" in table.splitlines()[0]
    no_llama = bench_task.summarize({"target": [_result("target", 2.0)]})
    assert "speedup_vs_llamacpp" not in no_llama["target"]


@pytest.mark.skipif(shutil.which("llama-server") is None, reason="needs llama.cpp's llama-server on the PATH")
@pytest.mark.embedded
def test_the_real_llama_server_answers_on_the_embedded_target(embedded_pair):
    from semspec.models.lm import load_lm

    lm = load_lm(embedded_pair.target)
    settings = DecodeSettings(max_new_tokens=16, temperature=0.0)
    gguf = bench_task.gguf_path(embedded_pair.target)
    with LlamaServer(find_server(None), gguf) as server:
        res = LlamaCppDecoder("llamacpp", server, lm, settings).decode("What is 2 + 4?")
    assert 0 < res.output_tokens <= 16 and res.text and server.peak_rss_gb > 0


def test_a_port_taken_before_the_server_binds_it_is_never_talked_to(stub, tmp_path, monkeypatch):
    """Another process takes the chosen port first (and answers /health there): the server starts again on
    another port, and every request goes to it, not to the impostor."""
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    from semspec.tasks import llamacpp

    class Impostor(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_GET(self):
            self.send_response(200)
            self.end_headers()

    impostor = HTTPServer(("127.0.0.1", 0), Impostor)
    threading.Thread(target=impostor.serve_forever, daemon=True).start()
    taken = impostor.server_address[1]
    ports = iter([taken, llamacpp._free_port()])
    monkeypatch.setattr(llamacpp, "_free_port", lambda: next(ports))
    try:
        with LlamaServer(str(stub), tmp_path / "t.gguf") as server:
            assert server.port != taken
            assert server.complete("2 + 4?", 8)["content"]
    finally:
        impostor.shutdown()
    started = [e["argv"] for e in _log(tmp_path) if "argv" in e]
    assert started[-1][started[-1].index("--port") + 1] == str(server.port)


def test_a_batch_goes_to_the_server_s_slots_together_and_shares_its_wall_time(stub, tmp_path, monkeypatch):
    """``decode_batch``: at most ``parallel`` requests in flight (the server's slots), each answer's
    latency its own and its machine time the batch's wall time over its size, as a semspec batch."""
    monkeypatch.setenv("STUB_DELAY", "0.3")
    lm, settings = tiny_lm(), DecodeSettings(max_new_tokens=8, temperature=0.0)
    seen = []
    with LlamaServer(str(stub), tmp_path / "t.gguf", parallel=3) as server:
        dec = LlamaCppDecoder("llamacpp", server, lm, settings)
        res = dec.decode_batch([f"What is {i} + 1?" for i in range(5)], 4, lambda i, r: seen.append(i))
        assert dec.run_identity == {"llamacpp": "42 (stub)", "gguf": "t.gguf", "slots": 3}
    argv, *requests = _log(tmp_path)
    assert argv["argv"][argv["argv"].index("-np") + 1] == "3"
    assert argv["argv"][argv["argv"].index("-c") + 1] == str(3 * 4096), "each slot gets the whole context"
    assert [r["request"]["prompt"] for r in sorted(requests, key=lambda r: r["request"]["prompt"])] == [
        lm.format_prompt(f"What is {i} + 1?") for i in range(5)
    ]
    in_flight = max(sum(r["start"] <= e["start"] < r["end"] for r in requests) for e in requests)
    assert in_flight == 3, "a batch of 4 runs on the 3 slots at once, never more"
    assert sorted(seen) == list(range(5)) and [x.method for x in res] == ["llamacpp"] * 5
    first, second = res[:3], res[3:]
    assert len({x.timings.share for x in first}) == 1 and len({x.timings.share for x in second}) == 1
    assert 0.3 / 3 <= first[0].timings.share < min(x.timings.total for x in first)
    with pytest.raises(ValueError, match="parallel"):
        LlamaServer(str(stub), tmp_path / "t.gguf", parallel=0)


def test_an_evaluation_runs_llamacpp_beside_semspec_s_methods(stub, tmp_path, monkeypatch):
    """``evaluate.methods: [..., llamacpp]``: the worker starts one server on the target's GGUF file (its
    slots the batch size), decodes the method's problems through it, and stops it on close; a target that
    is not a GGUF file skips the method, saying why; without a llama-server the evaluation says how to
    get one."""
    from semspec.tasks import llamacpp
    from semspec.tasks.config import EvaluateConfig
    from semspec.tasks.data import Problem
    from semspec.tasks.evaluate.workers import EvalWorker, LocalPool, Turn
    from tests.helpers.pipeline import write_tiny_pair

    pair = write_tiny_pair(tmp_path, max_step_tokens=4)
    cfg = EvaluateConfig(
        benchmarks={"arith": 2}, methods=["target", "llamacpp"], batch_size=2, decode={"max_new_tokens": 8}
    )
    lms = {"draft": tiny_lm(max_step_tokens=4), "target": tiny_lm(seed=1, max_step_tokens=4)}
    plan = EvalWorker(cfg, pair, None, lms).plan("arith")
    assert "GGUF" in plan["not_run"]["llamacpp"] and "target" not in plan["not_run"]
    monkeypatch.setattr(llamacpp, "gguf_path", lambda model_cfg: tmp_path / "target.gguf")
    pool = LocalPool(EvalWorker(cfg, pair, None, lms))
    assert pool.plan("arith")["identity"]["llamacpp"]["slots"] == 2
    problems = [Problem(f"q{i}", "arith", "math", f"What is {i} + {i}?", str(2 * i)) for i in (1, 2)]
    kept = []
    pool.run([Turn("arith", 0, "llamacpp", problems)], lambda turn, i, res: kept.append((i, res.answer)))
    server = pool.worker._llama
    assert sorted(kept) == [(0, "6"), (1, "6")] and server.proc is not None
    pool.close()
    assert server.proc is None and pool.worker._llama is None
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="llama-server"):
        EvalWorker(cfg, pair, None, lms).plan("arith")
