"""Online serving benchmark, in the spirit of vLLM's benchmark_serving: streamed requests
over HTTP against `kvloop serve`, reporting throughput and latency percentiles.

    python benchmarks/bench_serving.py [--url http://127.0.0.1:8000] [--model PATH]
        [--num-prompts 64] [--max-concurrency 1 8 32] [--request-rate inf]
        [--input-len 256] [--output-len 128] [--endpoint completions|chat]
        [--write BENCHMARKS.md]

Without --url it starts `kvloop serve` (as `python -m kvloop.server.cli`) on a free
loopback port with --model, and stops it at the end. Requests arrive all at once
(--request-rate inf) or as a Poisson process of the given rate, at most
--max-concurrency in flight; one run per concurrency value, in order, on one server.
Each request streams (`stream_options.include_usage`), ignores EOS and asks for exactly
--output-len tokens of a prompt of about --input-len tokens (token ids, varied by
+-25 %, never sharing a prefix).

Per request: TTFT = send to first text chunk; TPOT = (latency - TTFT) / (tokens - 1);
ITL = gaps between successive text chunks (one per engine step). Throughput = requests
and generated tokens over the wall time of the run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from common import TEXT, machine_line, publish
from kvloop.loading.loader import load_checkpoint
from kvloop.loading.tokenizer import Tokenizer


@dataclass
class RequestResult:
    ok: bool
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


@dataclass
class RunResult:
    concurrency: int
    duration: float
    results: list[RequestResult]
    server: dict[str, float]
    live_events: int | None = None  # live-page updates read during the run (None: no page)

    @property
    def ok(self) -> list[RequestResult]:
        return [r for r in self.results if r.ok]

    def summary(self) -> dict[str, float]:
        ok = self.ok
        out_tokens = sum(r.output_tokens for r in ok)
        in_tokens = sum(r.prompt_tokens for r in ok)
        s = {"completed": len(ok), "failed": len(self.results) - len(ok),
             "duration_s": self.duration, "req_per_s": len(ok) / self.duration,
             "output_tok_per_s": out_tokens / self.duration,
             "total_tok_per_s": (in_tokens + out_tokens) / self.duration}
        series = {"ttft": [r.ttft for r in ok],
                  "tpot": [t for r in ok if (t := r.tpot) is not None],
                  "itl": [x for r in ok for x in r.itl],
                  "e2e": [r.latency for r in ok]}
        for name, xs in series.items():
            s[f"{name}_mean_ms"] = 1000 * statistics.fmean(xs) if xs else math.nan
            s[f"{name}_p50_ms"] = 1000 * percentile(xs, 50)
            s[f"{name}_p99_ms"] = 1000 * percentile(xs, 99)
        return s


def percentile(xs: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not xs:
        return math.nan
    ys = sorted(xs)
    k = (len(ys) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return ys[lo] + (ys[hi] - ys[lo]) * (k - lo)


# --- workload ----------------------------------------------------------------------------------
def make_prompts(tok: Tokenizer, n: int, input_len: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = []
    for i in range(n):
        length = max(1, round(input_len * rng.uniform(0.75, 1.25)))
        # A distinct head per prompt: the prefix cache helps no request more than another.
        ids = tok.encode(f"[{seed}-{i}] " + TEXT * (length // 40 + 2), add_special_tokens=False)
        prompts.append(ids[:length])
    return prompts


async def one_request(client: httpx.AsyncClient, path: str, body: dict,
                      chat: bool) -> RequestResult:
    start = time.perf_counter()
    res = RequestResult(ok=False)
    for attempt in range(2):
        try:
            return await stream_request(client, path, body, chat, start, res)
        except httpx.RemoteProtocolError as e:
            # A kept-alive connection the server closed while idle (llama-server does so
            # after a few seconds): nothing was sent back, so send it again on a new one,
            # as the openai SDK's retries do. Its time still counts from `start`.
            res.error = repr(e)
            if attempt or res.ttft:  # a token came: the failure is the result
                return res
    return res


async def stream_request(client: httpx.AsyncClient, path: str, body: dict, chat: bool,
                         start: float, res: RequestResult) -> RequestResult:
    """Sends one streamed request into `res`; raises RemoteProtocolError where the server
    dropped the connection (the caller may retry), records any other failure in res."""
    last = None
    try:
        async with client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    res.error = data["error"]["message"]
                    return res
                if data.get("usage"):
                    res.prompt_tokens = data["usage"]["prompt_tokens"]
                    res.output_tokens = data["usage"]["completion_tokens"]
                for c in data.get("choices", []):
                    text = (c["delta"].get("content") or "") if chat else c["text"]
                    if not text:
                        continue
                    now = time.perf_counter()
                    if last is None:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
        res.latency = time.perf_counter() - start
        res.ok = last is not None and res.output_tokens > 0
        if not res.ok:
            res.error = "no tokens streamed"
    except httpx.RemoteProtocolError:
        raise
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        res.error = repr(e)
    return res


async def watch_live_page(url: str, headers: dict[str, str], seen: list[int]) -> None:
    """What a browser on the live page does to the server: read /live/events and parse
    each update, until cancelled. `seen[0]` counts the updates."""
    async with httpx.AsyncClient(base_url=url, timeout=None, headers=headers) as client, \
            client.stream("GET", "/live/events") as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                json.loads(line[len("data: "):])
                seen[0] += 1


async def run(url: str, bodies: list[dict], args: argparse.Namespace, concurrency: int,
              headers: dict[str, str], live: bool = False) -> RunResult:
    chat = args.endpoint == "chat"
    path = "/v1/chat/completions" if chat else "/v1/completions"
    sem = asyncio.Semaphore(concurrency)
    rng = random.Random(args.seed)
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits,
                                 headers=headers) as client:
        async def limited(body: dict) -> RequestResult:
            async with sem:
                return await one_request(client, path, body, chat)

        before = scrape(httpx.get(f"{url}/metrics", timeout=10).text)
        seen = [0]
        watcher = asyncio.create_task(watch_live_page(url, headers, seen)) if live else None
        tasks = []
        t0 = time.perf_counter()
        for body in bodies:
            tasks.append(asyncio.create_task(limited(body)))
            if math.isfinite(args.request_rate):  # Poisson arrivals
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
        if watcher is not None:
            if watcher.done():  # it failed (no live page on that server?): say why
                watcher.result()
            watcher.cancel()
        after = scrape(httpx.get(f"{url}/metrics", timeout=10).text)
    # Counters over this run only; the hit rate is the server's running figure.
    server = {k: v - before.get(k, 0.0) if k.endswith("_total") else v for k, v in after.items()}
    return RunResult(concurrency, duration, list(results), server,
                     seen[0] if live else None)


def make_body(args: argparse.Namespace, prompt: list[int], tok: Tokenizer) -> dict:
    body: dict = {"max_tokens": args.output_len, "temperature": 0.0, "ignore_eos": True,
                  "stream": True, "stream_options": {"include_usage": True}}
    if args.served_model_name:
        body["model"] = args.served_model_name
    if args.endpoint == "chat":
        # Token ids are not a chat message: the decoded prompt text stands in for them.
        body["messages"] = [{"role": "user", "content": tok.decode(prompt)}]
    else:
        body["prompt"] = prompt
    return body


def scrape(text: str) -> dict[str, float]:
    """A few server-side figures from /metrics."""
    out = {}
    for name in ("kvloop_num_preemptions_total", "kvloop_prefix_cache_hit_rate",
                 "kvloop_generation_tokens_total"):
        m = re.search(rf"^{name} (\S+)$", text, re.M)
        if m:
            out[name] = float(m.group(1))
    return out


# --- the server --------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(args: argparse.Namespace, extra: Sequence[str] = (),
                 timeout: float = 300) -> tuple[subprocess.Popen, str]:
    """`kvloop serve` on a free loopback port (with `extra` flags), once /health answers."""
    port = free_port()
    cmd = [sys.executable, "-m", "kvloop.server.cli", "--port", str(port),
           "--max-num-seqs", str(max(max(args.max_concurrency), 1)),
           "--kv-cache-memory", args.kv_cache_memory, "--log-level", "warning"]
    if args.model:
        cmd += ["--model", args.model]
    cmd += list(extra)
    env = {k: v for k, v in os.environ.items() if k != "KVLOOP_API_KEY"}
    proc = subprocess.Popen(cmd, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with status {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.terminate()
    raise SystemExit(f"the server did not come up in {timeout:g} s")


# --- the offline engine on the same workload ---------------------------------------------------
@dataclass
class Offline:
    output_tok_per_s: float
    tpot_p50_ms: float


def offline(args: argparse.Namespace, prompts: list[list[int]], concurrency: int) -> Offline:
    """The same prompts through `LLM.generate` in this process (the server stopped), at
    most `concurrency` sequences at once: what the engine does without the server."""
    from kvloop import LLM, SamplingParams

    llm = LLM(args.model, kv_cache_memory=args.kv_cache_memory, max_num_seqs=concurrency)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[:1], params)  # warm-up, as the served run had
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    tpots = [o.metrics.tpot for o in outs if o.metrics.tpot is not None]
    return Offline(tokens / wall, 1000 * statistics.median(tpots) if tpots else math.nan)


# --- report ------------------------------------------------------------------------------------
def report(runs: list[RunResult], args: argparse.Namespace, model: str,
           offline_runs: dict[int, Offline]) -> str:
    rate = "all at once" if not math.isfinite(args.request_rate) else (
        f"Poisson arrivals at {args.request_rate:g} req/s")
    lines = [
        f"## Online serving: streamed HTTP requests ({model})",
        "",
        f"`python benchmarks/bench_serving.py --num-prompts {args.num_prompts} "
        f"--max-concurrency {' '.join(map(str, args.max_concurrency))} --input-len "
        f"{args.input_len} --output-len {args.output_len} --endpoint {args.endpoint}"
        f"{f' --request-rate {args.request_rate:g}' if math.isfinite(args.request_rate) else ''}"
        f"{f' --model {args.model}' if args.model else ''}"
        f"{f' --live-page {args.live_page}' if args.live_page != 'off' else ''}` on "
        f"{machine_line()}. {args.num_prompts} requests per row ({rate}, at most the given "
        f"number in flight), prompts of {args.input_len} tokens +-25 %, {args.output_len} "
        "generated tokens each (EOS ignored, greedy), streamed over HTTP on loopback; client "
        "and server share the machine. TTFT includes queueing; ITL is the gap between "
        "streamed chunks. Offline: the same prompts through `LLM.generate` in one process "
        "after the server stopped, at most the same number of sequences at once (its TPOT "
        "from the engine's own metrics).",
        "",
        "| concurrency | req/s | output tok/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms "
        "| ITL p50 / p99 ms | e2e p50 ms | failed | preemptions | offline output tok/s "
        "| offline TPOT p50 ms | served / offline TPOT |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in runs:
        s = r.summary()
        off = offline_runs.get(r.concurrency) if r.live_events is None else None
        tail = (f"{off.output_tok_per_s:.1f} | {off.tpot_p50_ms:.1f} | "
                f"{s['tpot_p50_ms'] / off.tpot_p50_ms:.2f}x" if off else "- | - | -")
        label = f"{r.concurrency}{' (live page open)' if r.live_events is not None else ''}"
        lines.append(
            f"| {label} | {s['req_per_s']:.2f} | {s['output_tok_per_s']:.1f} | "
            f"{s['ttft_p50_ms']:.0f} / {s['ttft_p99_ms']:.0f} | "
            f"{s['tpot_p50_ms']:.1f} / {s['tpot_p99_ms']:.1f} | "
            f"{s['itl_p50_ms']:.1f} / {s['itl_p99_ms']:.1f} | {s['e2e_p50_ms']:.0f} | "
            f"{s['failed']:.0f} | {r.server.get('kvloop_num_preemptions_total', 0):.0f} | "
            f"{tail} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default=None, help="a running server (default: start one)")
    ap.add_argument("--model", default=None,
                    help="model to serve, and whose tokenizer builds the prompts")
    ap.add_argument("--served-model-name", default=None, help="`model` sent in each request")
    ap.add_argument("--api-key", default=os.environ.get("KVLOOP_API_KEY"))
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-concurrency", type=int, nargs="+", default=[8])
    ap.add_argument("--request-rate", type=float, default=math.inf,
                    help="requests per second, Poisson (default inf: all at once)")
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    ap.add_argument("--kv-cache-memory", default="2GiB", help="for the server started here")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--live-page", choices=["off", "on", "both"], default="off",
                    help="read the server's live page events (/live/events) during each run, "
                         "as a browser would; 'both': each concurrency without, then with "
                         "it, and their output tok/s ratio (the page's overhead)")
    ap.add_argument("--write", type=Path, default=None,
                    help="write the table into this file (section bench-serving)")
    args = ap.parse_args()

    checkpoint = load_checkpoint(args.model)  # for its tokenizer: the weights stay lazy
    tok = checkpoint.tokenizer
    prompts = make_prompts(tok, args.num_prompts, args.input_len, args.seed)
    bodies = [make_body(args, p, tok) for p in prompts]
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    proc, url = (None, args.url.rstrip("/")) if args.url else start_server(args)
    try:
        models = httpx.get(f"{url}/v1/models", headers=headers, timeout=10).json()
        served_name = models["data"][0]["id"]
        # Warm-up: the first request pays one-off costs (allocations, kernel choices).
        asyncio.run(run(url, bodies[:1], args, 1, headers))
        runs = []
        pages = {"off": [False], "on": [True], "both": [False, True]}[args.live_page]
        for c, live in [(c, live) for c in args.max_concurrency for live in pages]:
            r = asyncio.run(run(url, bodies, args, c, headers, live))
            runs.append(r)
            s = r.summary()
            page = f" [live page: {r.live_events} updates]" if live else ""
            print(f"concurrency {c:3d}{page}: {s['completed']:.0f} ok, {s['failed']:.0f} failed, "
                  f"{s['req_per_s']:.2f} req/s, {s['output_tok_per_s']:.1f} output tok/s, "
                  f"TTFT p50 {s['ttft_p50_ms']:.0f} ms p99 {s['ttft_p99_ms']:.0f} ms, "
                  f"TPOT p50 {s['tpot_p50_ms']:.1f} ms, ITL p50 {s['itl_p50_ms']:.1f} ms "
                  f"p99 {s['itl_p99_ms']:.1f} ms", flush=True)
            if live and len(pages) == 2:
                base = runs[-2].summary()["output_tok_per_s"]
                ratio = s["output_tok_per_s"] / base
                print(f"  live page open: {ratio:.3f}x the output tok/s of the run without it "
                      f"({(ratio - 1) * 100:+.1f} %)", flush=True)
            errors = [x.error for x in r.results if not x.ok]
            if errors:
                print(f"  first error: {errors[0]}", flush=True)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    offline_runs = {}
    if proc is not None and args.endpoint == "completions":  # our server, stopped: quiet
        for c in args.max_concurrency:
            offline_runs[c] = offline(args, prompts, c)
            print(f"offline {c:3d}: {offline_runs[c]}", flush=True)
    publish(report(runs, args, served_name, offline_runs), args.write, "bench-serving")


if __name__ == "__main__":
    main()
