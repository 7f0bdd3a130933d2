"""Time to ready: `kvloop generate "Hi" --max-tokens 1` as a fresh process, per weight
format, beside llama-cpp-python loading the same file and writing one token.

    python benchmarks/bench_startup.py [--runs 5] [--write BENCHMARKS.md]

Each configuration runs once first (the kernels' build cache, the layout cache and the
page cache warm), then `--runs` times; the table has medians. "process" is the wall time
from spawning the process to its exit (interpreter, imports, load, one token); "load" is
the part the process itself reports for getting the model ready (kvloop: LLM(), as
`--json` reports it; llama.cpp: the Llama() constructor). Peak memory is the process's
peak resident set (ru_maxrss of the child).

The resident rows run the same command against a `kvloop serve --detach` of the same file
(as stored), started once beforehand and stopped after: "first token" is the time from
spawning the command to the first byte of the streamed reply on its stdout, "whole
command" to its exit. The client process loads no model and imports no torch; the peak
memory is the client's own (the server's is not counted).
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


def measure_resident(args: list[str], env: dict[str, str], runs: int) -> dict:
    """Medians over `runs` fresh client processes (after one warm-up) of a streamed
    command: time to the first byte on stdout, time to exit, peak resident set."""
    firsts, walls, peaks, text = [], [], [], ""
    for i in range(runs + 1):
        t = time.perf_counter()
        proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env=env)
        assert proc.stdout is not None and proc.stderr is not None
        first_byte = proc.stdout.read(1)
        first = time.perf_counter() - t
        rest = proc.stdout.read()
        stderr = proc.stderr.read().decode()
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t
        if os.waitstatus_to_exitcode(status) or not first_byte:
            raise RuntimeError(f"{' '.join(args[:5])} ... failed:\n{stderr[-2000:]}")
        if i == 0:
            continue
        firsts.append(first)
        walls.append(wall)
        peaks.append(usage.ru_maxrss / 1024)
        text = (first_byte + rest).decode(errors="replace")
    return {"first_s": statistics.median(firsts), "process_s": statistics.median(walls),
            "rss_mib": statistics.median(peaks), "firsts": firsts, "walls": walls,
            "text": text}


def resident(model: Path, runs: int) -> dict:
    """The resident path's figures, against a detached server this function starts and
    stops (its run file in a directory of its own: no other server is picked up)."""
    with tempfile.TemporaryDirectory() as run_dir:
        env = {**os.environ, "KVLOOP_RUNTIME_DIR": run_dir, "KVLOOP_SERVER": ""}
        cli = [sys.executable, "-m", "kvloop.cli"]
        subprocess.run([*cli, "serve", "--detach", "--port", "0", "--model", str(model)],
                       env=env, check=True, capture_output=True)
        command = [*cli, "generate", "Hi", "--max-tokens", "1", "--temperature", "0"]
        try:
            # The server answered (load_seconds 0), not a one-shot fallback.
            check = subprocess.run([*command, "--json"], env=env, check=True,
                                   capture_output=True, text=True)
            if json.loads(check.stdout)["load_seconds"] != 0.0:
                raise RuntimeError(f"the command ran one-shot:\n{check.stderr}")
            return measure_resident(command, env, runs)
        finally:
            subprocess.run([*cli, "stop"], env=env, capture_output=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--model", default=None, help="GGUF file (default: SmolLM2's)")
    ap.add_argument("--write", type=Path, default=None)
    args = ap.parse_args()
    # Nothing that imports torch before the measurements (kvloop.loading.loader, common): a
    # child's ru_maxrss starts from the parent's peak (the spawn borrows the parent's
    # memory map until exec), so a 230 MiB driver floored every row at 230 MiB.
    from kvloop.loading.default_model import default_model_path

    model = Path(args.model) if args.model else default_model_path()
    kvloop = [sys.executable, "-m", "kvloop.cli", "generate", "Hi", "--max-tokens", "1",
              "--temperature", "0", "--json", "--model", str(model)]
    results: dict[str, dict] = {}
    for name, mode in MODES.items():
        results[name] = measure([*kvloop, "--quantization", mode], args.runs)
        print(name, results[name], file=sys.stderr)
    res = resident(model, args.runs)
    print("resident", res, file=sys.stderr)
    try:
        import llama_cpp  # noqa: F401

        peer = "llama.cpp (llama-cpp-python)"
        results[peer] = measure([sys.executable, "-c", _LLAMA_CPP, str(model)], args.runs)
    except ImportError:
        peer = ""
    from common import machine_line, publish

    rows = ["| configuration | process, load + 1 token (s) | model load (s) | peak memory (MiB) "
            "| process vs llama.cpp |", "|---|---:|---:|---:|---:|"]
    ref = results.get(peer)
    for name, r in results.items():
        ratio = f"{r['process_s'] / ref['process_s']:.2f}x" if ref else "-"
        rows.append(f"| {name} | {r['process_s']:.2f} | {r['load_s']:.2f} | "
                    f"{r['rss_mib']:.0f} | {ratio} |")
    for what, key in (("first token", "first_s"), ("whole command", "process_s")):
        ratio = f"{res[key] / ref['process_s']:.2f}x" if ref else "-"
        rows.append(f"| kvloop resident (as stored), {what} | {res[key]:.2f} | 0 (loaded) | "
                    f"{res['rss_mib']:.0f} (client) | {ratio} |")
    runs = "\n".join(
        f"- {name}: process {', '.join(f'{w:.2f}' for w in r['walls'])} s; load "
        f"{', '.join(f'{x:.2f}' for x in r['loads'])} s" for name, r in results.items())
    runs += ("\n- kvloop resident: first token "
             f"{', '.join(f'{x:.2f}' for x in res['firsts'])} s; whole command "
             f"{', '.join(f'{x:.2f}' for x in res['walls'])} s")
    body = "\n".join([
        "## Time to ready (bench_startup.py)",
        "",
        f"`python benchmarks/bench_startup.py --runs {args.runs}`: `kvloop generate \"Hi\" "
        "--max-tokens 1 --json` as a fresh process per run, after one warm-up run "
        "(kernel build, layout and page caches warm); medians. The resident rows: the "
        "same command (streamed) against a `kvloop serve --detach` of the same file, "
        "started before and stopped after; the client's own peak memory. Model: "
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
