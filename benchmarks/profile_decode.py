"""Where a batch-1 decode step's time goes: torch.profiler over decode steps of the
default model, ops grouped by what they do, and the Python/dispatch rest.

    python benchmarks/profile_decode.py [--quantization none|int8|int4] [--write BENCHMARKS.md]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).parent))
from common import machine_line, prompt_ids, write_section
from kvloop import LLM, SamplingParams

GROUPS = {
    "linear layers (weights)": ("linear", "mm", "int4pack", "int8pack", "addmm"),
    "attention (SDPA)": ("scaled_dot_product", "flash_attention"),
    "KV cache write + gather": ("index_select", "index_copy"),
    "sampling (argmax, logsumexp)": ("argmax", "logsumexp", "topk", "exponential", "gather"),
}


def categorize(name: str) -> str:
    for group, keys in GROUPS.items():
        if any(k in name for k in keys):
            return group
    return "other ops (norms, rope, residuals, casts, copies)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quantization", default="none")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--write", type=Path, default=None)
    args = ap.parse_args()
    llm = LLM(quantization=args.quantization)
    ids = prompt_ids(llm.tokenizer, 128, 0)
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    llm.generate([ids], params)  # warm-up
    eng = llm.engine
    eng.add_request(None, prompt_ids(llm.tokenizer, 128, 1), params)
    eng.step()  # the prefill, not profiled
    steps = 0
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        while eng.has_unfinished_requests():
            eng.step()
            steps += 1
        wall = time.perf_counter() - t
    per_group: dict[str, float] = defaultdict(float)
    for ev in prof.key_averages():
        per_group[categorize(ev.key)] += ev.self_cpu_time_total / 1e6  # seconds
    # The profiler adds overhead of its own; scale the op times to an unprofiled run.
    eng.add_request(None, prompt_ids(llm.tokenizer, 128, 2), params)
    eng.step()
    t = time.perf_counter()
    n = 0
    while eng.has_unfinished_requests():
        eng.step()
        n += 1
    plain_ms = (time.perf_counter() - t) / n * 1e3
    op_total = sum(per_group.values())
    lines = [
        f"## Where a batch-1 decode step goes ({args.quantization})",
        "",
        f"`python benchmarks/profile_decode.py --quantization {args.quantization}` on "
        f"{machine_line()}; {steps} decode steps at 128-190 tokens of context, torch.profiler "
        f"self times per step. Unprofiled: {plain_ms:.1f} ms per token "
        f"({1e3 / plain_ms:.1f} tok/s). The rest is Python and dispatch between ops.",
        "",
        "| part | ms per token | share |",
        "|---|---:|---:|",
    ]
    wall_ms = wall / steps * 1e3
    for group, secs in sorted(per_group.items(), key=lambda kv: -kv[1]):
        ms = secs / steps * 1e3
        lines.append(f"| {group} | {ms:.2f} | {ms / wall_ms:.0%} |")
    rest = wall_ms - op_total / steps * 1e3
    lines.append(f"| Python, dispatch, profiler (wall - ops) | {rest:.2f} | {rest / wall_ms:.0%} |")
    lines.append(f"| **profiled step, wall** | **{wall_ms:.2f}** | 100% |")
    body = "\n".join(lines)
    print(body)
    if args.write:
        write_section(args.write, f"profile-decode-{args.quantization}", body)


if __name__ == "__main__":
    main()
