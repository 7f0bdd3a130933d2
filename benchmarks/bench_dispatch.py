"""Where each weight format's batched path starts to win, on this CPU and kernel build.

kvloop.dispatch picks, per row count, between the native row-streaming kernels (each weight
row read once per chunk of activation rows, int8 activations for quantized weights) and a
GEMM (quantized weights decoded a chunk of rows at a time, in bf16 where AVX512-BF16 exists,
else fp32; fp32 weights as they are) through ATen (oneDNN / MKL). This script times one
linear layer of the default model (the MLP's fused gate/up projection, [3072, 576], and its
down projection, [576, 1536]) on every path at row counts around the thresholds, and
prints the row count from which each path is fastest: the figures dispatch.py's table is
set from, per ISA.

    python benchmarks/bench_dispatch.py                  # this CPU's best build
    KVLOOP_ISA=avx2 python benchmarks/bench_dispatch.py  # an AVX2-only CPU (libraries too)
    python benchmarks/bench_dispatch.py --model FILE.gguf  # that file's first MLP, as stored

Quantized layers also time the int8 GEMM (QLinear.set_int8_gemm: weight rows unpacked once
per tile, activations across vector lanes) where their format runs in it on this build.

Run it on a quiet machine: each figure is the median of interleaved repetitions.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

import kvloop  # noqa: F401  (first: KVLOOP_ISA holds the libraries under torch to it)
from common import isa_line

ROWS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 65, 96, 128, 256, 512)
NEVER = 1 << 30  # a min_rows no batch reaches: the native kernels at every size
FORMATS = {"fp32": "none", "int8": "int8", "int4": "int4", "as stored (Q4_1)": "gguf"}


def layers(quantization: str, model: str | None = None) -> dict[str, Any]:
    """The kernel-side layers of the model's first MLP (default: the default model's), in
    one format."""
    from kvloop import LLM
    from kvloop.models.native import native_linear_of, native_stack

    llm = LLM(model, quantization=quantization, use_kernels=True)
    mlp = llm.engine.model.layers[0].mlp
    out = {}
    for attr in ("gate_up_proj", "down_proj"):
        module = getattr(mlp, attr)
        lin = (native_stack([native_linear_of(p) for p in module.blocks()])
               if hasattr(module, "blocks") else native_linear_of(module))
        out[f"{attr} [{lin.out_features}x{lin.in_features}]"] = lin
    return out


# A path: (min_rows of the decoded-weights GEMM, in bf16, min_rows of the int8 GEMM).
PathSpec = tuple[int, bool, int]


def time_paths(lin: Any, m: int, paths: dict[str, PathSpec], reps: int) -> dict[str, float]:
    """Median microseconds of lin.forward on m rows, for each path, the paths interleaved so
    that a noisy moment costs all of them alike."""
    x = torch.randn(m, lin.in_features)
    times: dict[str, list[float]] = {p: [] for p in paths}
    for _ in range(reps):
        for name, (min_rows, bf16, gemm_rows) in paths.items():
            lin.set_batched_decode(min_rows, bf16)
            lin.set_int8_gemm(gemm_rows)
            lin.forward(x)  # the path's scratch and its first-call costs
            t = time.perf_counter()
            lin.forward(x)
            times[name].append((time.perf_counter() - t) * 1e6)
    return {p: statistics.median(v) for p, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--formats", nargs="+", choices=list(FORMATS), default=list(FORMATS))
    ap.add_argument("--model", default=None, help="a GGUF file (default: the default model)")
    args = ap.parse_args()
    from kvloop import dispatch

    bf16 = dispatch.bf16_gemm_fast()
    print(f"{isa_line()}; ATen {torch.backends.cpu.get_cpu_capability()}; "
          f"bf16 GEMM {'fast' if bf16 else 'off'}; {torch.get_num_threads()} threads")
    print(f"policy now: {dispatch.policy()}")
    for fmt in args.formats:
        for lname, lin in layers(FORMATS[fmt], args.model).items():
            paths: dict[str, PathSpec] = {"kernel": (NEVER, False, 0), "gemm fp32": (1, False, 0)}
            if bf16 and fmt != "fp32":
                paths["gemm bf16"] = (1, True, 0)
            if fmt != "fp32" and lin.gemm_supported:
                paths["int8 gemm"] = (NEVER, False, 1)
            print(f"\n{fmt}, {lname}: microseconds per call (rows: " +
                  ", ".join(paths) + ")")
            best: list[str] = []
            for m in ROWS:
                t = time_paths(lin, m, paths, args.reps)
                best.append(min(t, key=t.__getitem__))
                print(f"  {m:4d} rows: " + "  ".join(f"{p} {v:9.1f}" for p, v in t.items())
                      + f"   -> {best[-1]}")
            # The first row count from which the kernel never wins again.
            start = next((ROWS[i] for i in range(len(ROWS))
                          if all(b != "kernel" for b in best[i:])), None)
            print(f"  a GEMM wins from {start} rows" if start else "  the kernel wins throughout")


if __name__ == "__main__":
    main()
