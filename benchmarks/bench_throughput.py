"""Generated tokens/s with many concurrent requests: kvloop's continuous batching beside
transformers `generate` on the same prompts as one left-padded static batch, same run.

    python benchmarks/bench_throughput.py [--concurrency 1 8 32 64] [--write BENCHMARKS.md]

Prompts of 64 to 512 tokens (evenly spread), 128 new tokens each, EOS ignored, greedy,
fp32, the default model. Throughput = all generated tokens / wall time from submission
to the last token (prefill included).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_decode import HF
from common import machine_line, prompt_ids, publish
from kvloop import LLM, SamplingParams

NEW_TOKENS = 128


def workload(tokenizer, n: int, salt: int) -> list[list[int]]:
    lengths = [64 + (448 * i) // max(n - 1, 1) for i in range(n)] if n > 1 else [288]
    return [prompt_ids(tokenizer, m, salt * 1000 + i) for i, m in enumerate(lengths)]


def kvloop_throughput(llm: LLM, prompts: list[list[int]]) -> tuple[float, dict]:
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    steps0, pre0 = llm.engine.num_steps, llm.engine.scheduler.num_preemptions
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    assert n == NEW_TOKENS * len(prompts)
    info = {"steps": llm.engine.num_steps - steps0,
            "preemptions": llm.engine.scheduler.num_preemptions - pre0}
    return n / wall, info


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--no-hf", action="store_true", help="skip transformers (quick runs)")
    ap.add_argument("--write", type=Path, default=None)
    args = ap.parse_args()

    llm = LLM(max_num_seqs=max(args.concurrency))
    hf = None if args.no_hf else HF()  # bench_decode's: the same GGUF, EOS ignored
    kvloop_throughput(llm, workload(llm.tokenizer, 2, 99))  # warm-up
    rows = []
    t0 = time.time()
    for i, n in enumerate(args.concurrency):
        prompts = workload(llm.tokenizer, n, i)
        ours, info = kvloop_throughput(llm, prompts)
        theirs = hf.static_batch_throughput(prompts, NEW_TOKENS) if hf else float("nan")
        rows.append((n, ours, theirs, info))
        print(f"{n:3d} requests: kvloop {ours:7.1f} tok/s ({info}), transformers {theirs:7.1f}",
              flush=True)
    elapsed = time.time() - t0
    base = rows[0][1] if rows[0][0] == 1 else float("nan")
    lines = [
        "## Throughput with concurrent requests, fp32 (default model)",
        "",
        f"`python benchmarks/bench_throughput.py --concurrency "
        f"{' '.join(map(str, args.concurrency))}` on {machine_line()}; prompts of 64-512 "
        f"tokens, {NEW_TOKENS} new tokens each (EOS ignored), greedy; generated tokens / wall "
        f"time including prefill; one run per row, all in one run ({elapsed:.0f} s). "
        "transformers runs the same prompts as one left-padded static batch.",
        "",
        "| concurrent requests | kvloop tok/s | transformers tok/s | kvloop / transformers "
        "| kvloop / kvloop at 1 | engine steps | preemptions |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n, ours, theirs, info in rows:
        lines.append(f"| {n} | {ours:.1f} | {theirs:.1f} | {ours / theirs:.2f}x | "
                     f"{ours / base:.2f}x | {info['steps']} | {info['preemptions']} |")
    publish("\n".join(lines), args.write, "bench-throughput")


if __name__ == "__main__":
    main()
