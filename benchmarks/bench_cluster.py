"""Issue 17's goal: two replicas reach >= 1.8x one replica's generated tokens/s, and the
router in front of them costs < 1 ms per request.

    python benchmarks/bench_cluster.py [--model PATH] [--num-prompts 64]
        [--max-concurrency 32] [--input-len 128] [--output-len 64] [--threads 1]
        [--routing prefix|round_robin] [--quick] [--write BENCHMARKS.md]

Two machines simulated on one box: a "machine" is one core, so a replica is an engine
with --threads 1. The baseline is `kvloop serve --replicas 1 --threads 1` (one engine in
the server's process, no Ray); the cluster is `kvloop serve --replicas 2 --threads 1`
(a local Ray cluster started by the server, each replica its own Ray worker process
reserving 1 Ray CPU). Each server runs as a subprocess on a free loopback port, gets a
warm-up request per replica, then the same streamed workload as bench_serving (its
prompts, bodies and client, imported), and is stopped (SIGTERM; the server undeploys and
its Ray cluster goes with it) before the next starts. Any process the server started that
outlives it is reported and ended by its pid. The ingress, the benchmark client and Ray's
own processes share the box's cores with the replicas: on a 2-core box the cluster run is
the pessimistic case.

The router's own overhead is timed in this process, not over HTTP: for each benchmark
prompt, what ReplicaPool does to pick a replica (the prompt's chain hashes of up to
ROUTE_BLOCKS leading blocks, the candidate list, the router's choice and its record of
the choice), with in-flight counts as --max-concurrency requests in flight would leave
them. It excludes the Ray Serve handle call that then carries the request to the replica.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_serving import RunResult, make_body, make_prompts, percentile, run, start_server
from common import machine_line, publish
from kvloop.cluster.pool import ROUTE_BLOCKS
from kvloop.cluster.router import Candidate, Routing, make_router
from kvloop.config import EngineConfig
from kvloop.kv_cache import prompt_block_hashes
from kvloop.loading.loader import load_checkpoint

GOAL_SPEEDUP = 1.8
GOAL_ROUTER_US = 1000.0


@dataclass(frozen=True)
class Overhead:
    """Microseconds per routing decision, over `n` decisions."""

    n: int
    mean_us: float
    p50_us: float
    p99_us: float


def router_overhead(prompts: list[list[int]], num_replicas: int = 2,
                    routing: Routing = "prefix", block_size: int = EngineConfig.block_size,
                    concurrency: int = 32, passes: int = 20) -> Overhead:
    """Time ReplicaPool's routing work per prompt (see the module doc), `passes` times over
    the prompts, each pass with a fresh router (its memory empty, as after a start)."""
    samples: list[float] = []
    clock = time.perf_counter_ns
    for _ in range(passes):
        router = make_router(routing, num_replicas)
        in_flight = [0] * num_replicas
        running: collections.deque[int] = collections.deque()
        for prompt in prompts:
            t0 = clock()
            hashes = prompt_block_hashes(prompt, block_size, ROUTE_BLOCKS)
            index = router.choose(hashes, [Candidate(i, n) for i, n in enumerate(in_flight)])
            assert index is not None
            router.record(index, hashes)
            samples.append((clock() - t0) / 1000)
            in_flight[index] += 1  # the oldest request finishes once the limit is reached
            running.append(index)
            if len(running) > concurrency:
                in_flight[running.popleft()] -= 1
    return Overhead(len(samples), statistics.fmean(samples), percentile(samples, 50),
                    percentile(samples, 99))


# --- the servers -------------------------------------------------------------------------------
def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = collections.defaultdict(list)
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        tree[ppid].append(int(entry))
    return tree


def descendants(pid: int) -> set[int]:
    tree, found, todo = _children(), set(), [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def stop_server(proc: subprocess.Popen, spawned: set[int], grace: float = 60.0) -> list[int]:
    """SIGTERM the server, wait for it and for what it started (Ray's processes); end by
    pid whatever is still there after `grace` seconds and return those pids."""
    proc.terminate()
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(_alive(p) for p in spawned):
        time.sleep(0.5)
    left = sorted(p for p in spawned if _alive(p))
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, sig)
        if sig == signal.SIGTERM and left:
            time.sleep(3)
    return left


@dataclass
class Served:
    replicas: int
    run: RunResult
    leftover: list[int]


def serve_and_load(args: argparse.Namespace, replicas: int, bodies: list[dict],
                   warmup: list[dict]) -> Served:
    server_args = argparse.Namespace(model=args.model, kv_cache_memory=args.kv_cache_memory,
                                     max_concurrency=[args.max_concurrency])
    proc, url = start_server(server_args, ["--threads", str(args.threads), "--replicas",
                                           str(replicas), "--routing", args.routing], 600)
    spawned: set[int] = set()
    try:
        # One warm-up request per replica at once: the load bound sends each to its own.
        asyncio.run(run(url, warmup[:replicas], args, replicas, {}))
        result = asyncio.run(run(url, bodies, args, args.max_concurrency, {}))
    finally:
        spawned = descendants(proc.pid)
        leftover = stop_server(proc, spawned)
    s = result.summary()
    print(f"{replicas} replica(s) x {args.threads} thread(s): {s['completed']:.0f} ok, "
          f"{s['failed']:.0f} failed, {s['output_tok_per_s']:.1f} output tok/s, TTFT p50 "
          f"{s['ttft_p50_ms']:.0f} ms, TPOT p50 {s['tpot_p50_ms']:.1f} ms; stopped "
          f"({len(spawned)} processes it started, {len(leftover)} had to be ended)",
          flush=True)
    errors = [r.error for r in result.results if not r.ok]
    if errors:
        print(f"  first error: {errors[0]}", flush=True)
    return Served(replicas, result, leftover)


# --- report ------------------------------------------------------------------------------------
def report(args: argparse.Namespace, model: str, runs: list[Served], cost: Overhead) -> str:
    base = runs[0].run.summary()["output_tok_per_s"]
    ratio = runs[-1].run.summary()["output_tok_per_s"] / base
    cpus = len(os.sched_getaffinity(0))
    flags = (f"--num-prompts {args.num_prompts} --max-concurrency {args.max_concurrency} "
             f"--input-len {args.input_len} --output-len {args.output_len} --threads "
             f"{args.threads} --routing {args.routing}"
             f"{f' --model {args.model}' if args.model else ''}")
    lines = [
        f"## Replicas: two vs one, and the router's overhead ({model})",
        "",
        f"`python benchmarks/bench_cluster.py {flags}` on {machine_line()}; {cpus} CPUs "
        f"usable. Two machines simulated on one box, a machine being one core: one replica "
        f"= one engine with --threads {args.threads}. 1 replica: `kvloop serve --replicas 1` "
        "(the engine in the server's process, no Ray). 2 replicas: `kvloop serve --replicas "
        "2` (a local Ray cluster; each replica its own Ray worker process), routed by the "
        f"server's ReplicaPool ({args.routing}). The ingress, Ray's processes and this "
        "client share the same cores. Workload as bench_serving: "
        f"{args.num_prompts} streamed completions, all at once with at most "
        f"{args.max_concurrency} in flight, prompts of {args.input_len} tokens +-25 % "
        f"(distinct prefixes), {args.output_len} generated tokens each (EOS ignored, "
        "greedy), after one warm-up request per replica.",
        "",
        "| replicas | threads each | output tok/s | req/s | TTFT p50 ms | TPOT p50 ms "
        "| failed |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for served in runs:
        s = served.run.summary()
        lines.append(f"| {served.replicas} | {args.threads} | {s['output_tok_per_s']:.1f} | "
                     f"{s['req_per_s']:.2f} | {s['ttft_p50_ms']:.0f} | "
                     f"{s['tpot_p50_ms']:.1f} | {s['failed']:.0f} |")
    verdict = "met" if ratio >= GOAL_SPEEDUP else "not met"
    cost_verdict = "met" if cost.p99_us < GOAL_ROUTER_US else "not met"
    lines += [
        "",
        f"2 replicas / 1 replica, generated tok/s: **{ratio:.2f}x** (goal >= "
        f"{GOAL_SPEEDUP}x: {verdict}).",
        "",
        f"Router overhead per request: mean {cost.mean_us:.1f} us, p50 {cost.p50_us:.1f} us, "
        f"p99 {cost.p99_us:.1f} us over {cost.n} routing decisions (goal < 1 ms: "
        f"{cost_verdict}). It covers the routing decision only, timed in-process over the "
        f"benchmark's prompts: the chain hashes of up to {ROUTE_BLOCKS} leading blocks, the "
        f"candidate list, `{args.routing}` choose and record, for 2 replicas with up to "
        f"{args.max_concurrency} requests in flight; not the Ray Serve handle call (the hop "
        "to the replica's process), HTTP or tokenization.",
    ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None,
                    help="model to serve, and whose tokenizer builds the prompts")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-concurrency", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1, help="engine threads per replica")
    ap.add_argument("--routing", choices=["prefix", "round_robin"], default="prefix")
    ap.add_argument("--kv-cache-memory", default="2GiB", help="per replica")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run: 8 prompts, 4 in flight, 64-token prompts, 8 tokens out")
    ap.add_argument("--write", type=Path, default=None,
                    help="write the report into this file (section bench-cluster)")
    args = ap.parse_args()
    if args.quick:
        args.num_prompts, args.max_concurrency, args.input_len, args.output_len = 8, 4, 64, 8
    # What bench_serving's run and make_body read from their arguments.
    args.endpoint, args.request_rate, args.served_model_name = "completions", float("inf"), None

    tok = load_checkpoint(args.model).tokenizer  # the weights stay lazy
    prompts = make_prompts(tok, args.num_prompts, args.input_len, args.seed)
    bodies = [make_body(args, p, tok) for p in prompts]
    warmup = [make_body(args, p, tok) for p in make_prompts(tok, 2, args.input_len,
                                                              args.seed + 1000)]
    cost = router_overhead(prompts, 2, args.routing, concurrency=args.max_concurrency)
    print(f"router: mean {cost.mean_us:.1f} us, p99 {cost.p99_us:.1f} us per request "
          f"(routing decision only)", flush=True)
    runs = [serve_and_load(args, n, bodies, warmup) for n in (1, 2)]
    model = Path(args.model).name if args.model else "SmolLM2-135M-Instruct (default)"
    publish(report(args, model, runs, cost), args.write, "bench-cluster")
    if any(s.leftover for s in runs):
        print(f"warning: ended {sum(len(s.leftover) for s in runs)} process(es) the servers "
              "left behind", file=sys.stderr)


if __name__ == "__main__":
    main()
