"""Where a decode step's time goes, on the default model (or --model).

    python benchmarks/profile_decode.py [--quantization none|int8|int4|gguf] [--pytorch]
                                        [--batch B --prompt N] [--model FILE.gguf]
                                        [--write BENCHMARKS.md]

--batch B: B requests decoding together (their N-token prompts prefilled in one step, not
counted), as in the 32-request row of bench_all.py (--batch 32 --prompt 64).

Native path (the default, what kvloop runs): wall-clock timers around the pieces of each
engine step: the C++ decode step (split into its linear layers, timed alone on the same
weights, and the rest: attention, norms, rope, cache writes), the output head, the
sampler, and the engine's Python around them. --pytorch: the PyTorch modules instead
(runner.decoder = None), torch.profiler self times grouped by what the ops do.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).parent))
from common import machine_line, prompt_ids, publish
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


class _Timed:
    """Wraps a callable (or the decoder's two methods) and sums the seconds spent in it."""

    def __init__(self, target: Any) -> None:
        self.target, self.seconds = target, defaultdict(float)

    def _run(self, name: str, fn: Any, *a: Any) -> Any:
        t = time.perf_counter()
        out = fn(*a)
        self.seconds[name] += time.perf_counter() - t
        return out

    def __call__(self, *a: Any) -> Any:
        return self._run("call", self.target, *a)

    def forward(self, *a: Any) -> Any:
        return self._run("forward", self.target.forward, *a)

    def logits(self, *a: Any) -> Any:
        return self._run("logits", self.target.logits, *a)


def linear_ms(model: Any, rows: int, runs: int = 20) -> float:
    """The decode step's linear layers (head excluded) alone, `rows` rows, median ms: the
    kernels the step runs (a quantized layer's own, with its bf16 copy if it has one)."""
    from kvloop.models.native import native_linear_of

    layers = [getattr(m, "native", None) or native_linear_of(m)
              for layer in model.layers for m in (
                  layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                  layer.mlp.down_proj)]
    xs = {lin.in_features: torch.randn(rows, lin.in_features) for lin in layers}
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        for lin in layers:
            lin.forward(xs[lin.in_features])
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def native(args: argparse.Namespace) -> str:
    llm = LLM(args.model, quantization=args.quantization)
    runner = llm.engine.runner
    assert runner.decoder is not None, "native kernels unavailable: use --pytorch"
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    llm.generate([prompt_ids(llm.tokenizer, 128, 0)], params)  # warm-up
    dec, sampler = _Timed(runner.decoder), _Timed(runner.sampler)
    runner.decoder, runner.sampler = dec, sampler  # type: ignore[assignment]
    eng = llm.engine
    B, N = args.batch, args.prompt
    for i in range(B):
        eng.add_request(None, prompt_ids(llm.tokenizer, N, 1 + i), params)
    # Every prefill, not counted: as many steps as the step budget needs (B x N over it).
    sched = eng.scheduler
    while sched.waiting or any(r.num_computed_tokens < r.num_prompt_tokens
                               for r in sched.running):
        eng.step()
    dec.seconds.clear()
    sampler.seconds.clear()
    steps = 0
    t = time.perf_counter()
    while eng.has_unfinished_requests():
        eng.step()
        steps += 1
    wall_ms = (time.perf_counter() - t) / steps * 1e3
    fwd = dec.seconds["forward"] / steps * 1e3
    head = dec.seconds["logits"] / steps * 1e3
    samp = sampler.seconds["call"] / steps * 1e3
    lin = min(linear_ms(eng.model, B), fwd)
    rows = [
        (f"linear layers, {len(eng.model.layers)} x (qkv, o, gate/up, down) (C++)", lin),
        ("attention, norms, rope, SiLU, cache writes (C++, the step minus its linears)",
         fwd - lin),
        ("output head (C++)", head),
        ("sampler (PyTorch)", samp),
        ("engine, scheduler, detokenizer, Python (wall - the above)",
         wall_ms - fwd - head - samp),
    ]
    mb = eng.model.decode_read_bytes() / 1e6
    flags = f" --batch {B} --prompt {N}" if B > 1 else ""
    what = ("batch-1 decode step" if B == 1 else f"decode step of {B} sequences")
    if B == 1:
        rate = (f"{wall_ms:.2f} ms per token ({1e3 / wall_ms:.1f} tok/s); {mb:.0f} MB of "
                f"weights per step, so the linear layers and head together read at "
                f"{mb / (lin + head):.1f} GB/s.")
    else:
        flop = 2 * B * sum(m.in_features * m.out_features for m in eng.model.modules()
                           if hasattr(m, "native_spec"))  # every linear layer, head included
        rate = (f"{wall_ms:.2f} ms per step, {B * 1e3 / wall_ms:.0f} generated tok/s; the "
                f"linear layers and head do {flop / 1e9:.1f} GFLOP a step, at "
                f"{flop / (lin + head) / 1e6:.0f} GFLOP/s.")
    lines = [
        f"## Where a {what} goes ({args.quantization}, native path)",
        "",
        f"`python benchmarks/profile_decode.py --quantization {args.quantization}{flags}` on "
        f"{machine_line()}; {steps} engine steps at {N}-{N + steps} tokens of context, "
        f"wall-clock timers around each piece. {rate}",
        "",
        "| part | ms per step | share |",
        "|---|---:|---:|",
    ]
    for name, ms in rows:
        lines.append(f"| {name} | {ms:.2f} | {ms / wall_ms:.0%} |")
    lines.append(f"| **engine step, wall** | **{wall_ms:.2f}** | 100% |")
    return "\n".join(lines)


def pytorch(args: argparse.Namespace) -> str:
    llm = LLM(args.model, quantization=args.quantization)
    llm.engine.runner.decoder = None  # every step through the PyTorch modules
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
        f"## Where a batch-1 decode step goes ({args.quantization}, PyTorch modules)",
        "",
        f"`python benchmarks/profile_decode.py --quantization {args.quantization} --pytorch` on "
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
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quantization", default="none")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1, help="sequences decoding together")
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens per sequence")
    ap.add_argument("--pytorch", action="store_true",
                    help="profile the PyTorch modules instead of the native decode step")
    ap.add_argument("--model", default=None, help="a GGUF file (default: the default model)")
    ap.add_argument("--write", type=Path, default=None)
    args = ap.parse_args()
    kind = "pytorch" if args.pytorch else "native"
    publish(pytorch(args) if args.pytorch else native(args), args.write,
            f"profile-decode-{kind}-{args.quantization}"
            + (f"-b{args.batch}" if args.batch > 1 else ""))


if __name__ == "__main__":
    main()
