"""Time to ready: `kvloop generate "Hi" --max-tokens 1` as a fresh process, per weight
format, beside llama-cpp-python loading the same file and writing one token.

    python benchmarks/bench_startup.py [--runs 5] [--write BENCHMARKS.md]

Each configuration runs once first (the kernels' build cache, the layout cache and the
page cache warm), then `--runs` times; the table has medians. "process" is the wall time
from spawning the process to its exit (interpreter, imports, load, one token); "load" is
the part the process itself reports for getting the model ready (kvloop: LLM(), as
`--json` reports it; llama.cpp: the Llama() constructor). Peak memory is the process's
peak resident set (ru_maxrss of the child).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import machine_line, publish

MODES = {"kvloop fp32": "none", "kvloop as stored (Q4_1)": "gguf", "kvloop int8": "int8",
         "kvloop int4": "int4"}

_LLAMA_CPP = """
import json, sys, time
t0 = time.perf_counter()
from llama_cpp import Llama
t1 = time.perf_counter()
llm = Llama(model_path=sys.argv[1], n_threads=2, n_ctx=512, verbose=False)
t2 = time.perf_counter()
out = llm("Hi", max_tokens=1, temperature=0)
t3 = time.perf_counter()
print(json.dumps({"load_seconds": t2 - t1, "import_seconds": t1 - t0,
                  "text": out["choices"][0]["text"]}))
"""


def measure(args: list[str], runs: int) -> dict:
    """Medians over `runs` fresh processes (after one warm-up): wall time, the load the
    process reports, and its peak resident set (its own rusage, from wait4)."""
    walls, loads, peaks, text = [], [], [], ""
    for i in range(runs + 1):
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            t = time.perf_counter()
            proc = subprocess.Popen(args, stdout=out, stderr=err)
            _, status, usage = os.wait4(proc.pid, 0)
            wall = time.perf_counter() - t
            out.seek(0)
            err.seek(0)
            stdout, stderr = out.read().decode(), err.read().decode()
        if os.waitstatus_to_exitcode(status):
            raise RuntimeError(f"{' '.join(args[:5])} ... failed:\n{stderr[-2000:]}")
        data = json.loads([x for x in stdout.splitlines() if x.startswith("{")][-1])
        if i == 0:  # the warm-up: caches filled
            continue
        walls.append(wall)
        loads.append(float(data["load_seconds"]))
        peaks.append(usage.ru_maxrss / 1024)  # KiB on Linux
        text = data.get("text", "")
    return {"process_s": statistics.median(walls), "load_s": statistics.median(loads),
            "rss_mib": statistics.median(peaks), "walls": walls, "loads": loads, "text": text}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--model", default=None, help="GGUF file (default: SmolLM2's)")
    ap.add_argument("--write", type=Path, default=None)
    args = ap.parse_args()
    from kvloop.loading.loader import default_model_path

    model = Path(args.model) if args.model else default_model_path()
    kvloop = [sys.executable, "-m", "kvloop.cli", "generate", "Hi", "--max-tokens", "1",
              "--temperature", "0", "--json", "--model", str(model)]
    results: dict[str, dict] = {}
    for name, mode in MODES.items():
        results[name] = measure([*kvloop, "--quantization", mode], args.runs)
        print(name, results[name], file=sys.stderr)
    try:
        import llama_cpp  # noqa: F401

        peer = "llama.cpp (llama-cpp-python)"
        results[peer] = measure([sys.executable, "-c", _LLAMA_CPP, str(model)], args.runs)
    except ImportError:
        peer = ""
    rows = ["| configuration | process, load + 1 token (s) | model load (s) | peak memory (MiB) "
            "| process vs llama.cpp |", "|---|---:|---:|---:|---:|"]
    ref = results.get(peer)
    for name, r in results.items():
        ratio = f"{r['process_s'] / ref['process_s']:.2f}x" if ref else "-"
        rows.append(f"| {name} | {r['process_s']:.2f} | {r['load_s']:.2f} | "
                    f"{r['rss_mib']:.0f} | {ratio} |")
    runs = "\n".join(
        f"- {name}: process {', '.join(f'{w:.2f}' for w in r['walls'])} s; load "
        f"{', '.join(f'{x:.2f}' for x in r['loads'])} s" for name, r in results.items())
    body = "\n".join([
        "## Time to ready (bench_startup.py)",
        "",
        f"`python benchmarks/bench_startup.py --runs {args.runs}`: `kvloop generate \"Hi\" "
        "--max-tokens 1 --json` as a fresh process per run, after one warm-up run "
        "(kernel build, layout and page caches warm); medians. Model: "
        f"`{model.name}`. Machine: {machine_line()}.",
        "",
        *rows,
        "",
        runs,
        "",
    ])
    publish(body, args.write, "startup")


if __name__ == "__main__":
    main()
