"""Peak memory and load time of a pair: semspec's API against llama.cpp on the same GGUF files, in one run.

    python benchmarks/memory.py [--pair qwen-coder] [--probes DIR] [--llamacpp BIN_DIR] [--tokens 128]

Each row runs in its own process, whose peak resident set (``ru_maxrss``, the kernel's count: pages of
memory-mapped weight files that were touched included, as for llama.cpp's mmap) is read when it exits:

* ``semspec API``: ``semspec.load(pair, probes=...)`` then one SemanticSpec answer of ``--tokens`` tokens,
  timing the load (warm caches: run it twice, the first run fills them);
* ``llama.cpp target`` and ``llama.cpp draft``: ``llama-bench -p 48 -n <tokens>`` on each GGUF file (its
  pp48 and tg figures are printed too);
* ``llama.cpp speculative``: ``llama-speculative-simple`` with the target and the draft, ``--tokens``
  tokens.

``--llamacpp`` is the folder holding llama.cpp's binaries (default: found on the PATH); without them only
semspec's row is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from semspec.models.cpu.cpuinfo import cpu_info
from semspec.models.project.pairs import load_pair
from semspec.tasks.llamacpp import gguf_path

QUESTION = "A train travels 60 km in 45 minutes. What is its average speed in km/h?"
_CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import semspec
llm = semspec.load(sys.argv[1], probes=sys.argv[2] or None)
load = time.perf_counter() - t0
out = llm.generate(sys.argv[3], max_new_tokens=int(sys.argv[4]))
print(json.dumps({"load_s": load, "tokens": out.output_tokens,
                  "formats": {r: llm.lms[r].dtype_name for r in ("draft", "target")}}))
"""


# runs a command as its only child and reports the child's peak RSS (the rusage of reaped children)
_MEASURE = r"""
import resource, subprocess, sys
done = subprocess.run(sys.argv[1:], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
sys.stdout.write(done.stdout)
sys.stderr.write(done.stderr[-2000:] + "\nmaxrss_kb %d\n" % resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
sys.exit(done.returncode)
"""


def run(cmd: list[str]) -> tuple[float, str]:
    """(peak RSS in GB, stdout) of ``cmd`` run to its end; raises with its output when it fails."""
    done = subprocess.run([sys.executable, "-c", _MEASURE, *cmd], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{cmd[0]} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    kb = int(done.stderr.rsplit("maxrss_kb", 1)[1])
    return kb / 2**20, done.stdout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", default="qwen-coder")
    ap.add_argument("--probes", default="", help="an exported probes folder (default: the registry's)")
    ap.add_argument("--llamacpp", type=Path, help="the folder of llama.cpp's binaries (default: the PATH)")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    a = ap.parse_args()
    pair = load_pair(a.pair)
    print(
        f"cpu: {cpu_info().label()}, flags: {sorted(cpu_info().flags & {'avx512_bf16', 'avx512_vnni', 'avx_vnni', 'amx_bf16', 'amx_int8'})}"
    )
    rows = []
    rss, out = run([sys.executable, "-c", _CHILD, a.pair, a.probes, QUESTION, str(a.tokens)])
    info = json.loads(out.strip().splitlines()[-1])
    fmts = ", ".join(f"{r} {f}" for r, f in info["formats"].items())
    rows.append(("semspec API (load + one SemanticSpec answer)", rss, f"load {info['load_s']:.1f} s; {fmts}"))
    tool = (lambda name: str(a.llamacpp / name)) if a.llamacpp else shutil.which
    bench, spec_bin = tool("llama-bench"), tool("llama-speculative-simple")
    if bench and Path(bench).is_file():
        for role in ("target", "draft"):
            path = gguf_path(pair.role(role))
            cmd = [
                bench,
                "-m",
                str(path),
                "-p",
                "48",
                "-n",
                str(a.tokens),
                "-t",
                str(a.threads),
                "-o",
                "json",
            ]
            rss, out = run(cmd)
            res = {f"pp{r['n_prompt']}" if r["n_prompt"] else f"tg{r['n_gen']}": r for r in json.loads(out)}
            figures = ", ".join(f"{k} {1000 / v['avg_ts']:.2f} ms/token" for k, v in res.items())
            kind = next(iter(res.values()))
            rows.append(
                (
                    f"llama.cpp {role} (llama-bench)",
                    rss,
                    f"{path.name}: {figures}; build {kind.get('build_commit', '?')}",
                )
            )
    if spec_bin and Path(spec_bin).is_file():
        t, d = gguf_path(pair.target), gguf_path(pair.draft)
        cmd = [
            spec_bin,
            "-m",
            str(t),
            "-md",
            str(d),
            "--spec-type",
            "draft-simple",
            "-p",
            QUESTION,
            "-n",
            str(a.tokens),
            "-t",
            str(a.threads),
        ]
        t0 = time.perf_counter()
        rss, _ = run(cmd)
        rows.append(("llama.cpp speculative (target + draft)", rss, f"{time.perf_counter() - t0:.1f} s wall"))
    print(f"{'what':48s} {'peak RSS':>9s}  notes")
    for what, rss, note in rows:
        print(f"{what:48s} {rss:6.2f} GB  {note}", flush=True)


if __name__ == "__main__":
    main()
