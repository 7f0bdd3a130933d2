"""Where kvloop's resident memory goes, per weight format: the interpreter and libraries,
the model's tensors (and how much of them is mapped from the file rather than copied), the
rest of what loading adds, the KV blocks touched, and activations and scratch.

    python benchmarks/memory_breakdown.py [--modes none gguf int4] [--write BENCHMARKS.md]

Each format runs in a fresh process, which reads its own /proc/self/status (VmRSS,
RssFile, VmHWM) at three points: after importing torch, kvloop's engine modules and its
native kernels; after `LLM()` loaded the model; after the batch-1 work of bench_all (a
512-token prefill, then a 16-token prompt with 128 greedy tokens). The weights are the
model's tensors (distinct storages); the rest of the load's growth is the tokenizer,
metadata and tables; the KV share is the pool's blocks written at least once (the pool is
reserved untouched and becomes resident as blocks are first written); activations and
scratch are the peak minus everything before them.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

MIB = 2**20
MODES = {"none": "fp32", "gguf": "as stored", "int4": "int4"}


def status() -> dict[str, int]:
    """This process's memory figures from /proc/self/status, in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
                out[key] = int(value.split()[0]) * 1024
    return out


def worker(mode: str, model: str | None) -> dict[str, float]:
    """One format's breakdown, in this (fresh) process."""
    import torch

    import kvloop.engine.llm_engine  # noqa: F401  (the engine's modules: tokenizers, llguidance)
    from kvloop import LLM, SamplingParams
    from kvloop.kernels import build

    torch.set_num_threads(2)
    if build.available():
        build.native_module()  # the C++ extension is a library too, loaded before the model
    libs = status()
    llm = LLM(model, quantization=mode)
    loaded = status()
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    llm.generate([list(range(100, 612))], params)  # the 512-token prefill
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    llm.generate([list(range(1000, 1016))], params)  # batch-1 decode
    done = status()
    engine = llm.engine
    kv = engine.kv.pool.num_resident * engine.kv_bytes_per_block
    weights = tensor_bytes(engine.model)
    load = loaded["VmRSS"] - libs["VmRSS"]
    peak = done["VmHWM"]
    return {"libraries": libs["VmRSS"] / MIB, "weights": weights / MIB,
            "mapped": (loaded["RssFile"] - libs["RssFile"]) / MIB,
            "other_load": (load - weights) / MIB, "kv_touched": kv / MIB,
            "activations": (peak - loaded["VmRSS"] - kv) / MIB, "peak": peak / MIB}


def tensor_bytes(model: object) -> int:
    """Bytes of the distinct storages the model's modules hold (parameters, buffers and
    tensor attributes such as packed layouts): its weights as resident."""
    import torch

    storages: dict[int, int] = {}
    for module in model.modules():  # type: ignore[attr-defined]
        tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False),
                   *(v for v in vars(module).values() if isinstance(v, torch.Tensor))]
        for t in tensors:
            storage = t.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--write", type=Path, default=None)
    ap.add_argument("--model", default=None, help="model path (default: the default model)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker is not None:
        print(json.dumps(worker(args.worker, args.model)))
        return
    results = {}
    for mode in args.modes:
        model = ["--model", args.model] if args.model else []
        out = subprocess.run([sys.executable, __file__, "--worker", mode, *model],
                             check=True, capture_output=True, text=True).stdout
        results[mode] = json.loads(out.strip().splitlines()[-1])
        print(MODES[mode], results[mode], file=sys.stderr)

    sys.path.insert(0, str(Path(__file__).parent))
    from common import machine_line, publish

    rows = ["| weights | interpreter and libraries | model tensors (of which file-mapped) "
            "| other load-time memory | KV blocks touched | activations and scratch "
            "| peak (VmHWM) |",
            "|---|---:|---:|---:|---:|---:|---:|"]
    for mode, r in results.items():
        rows.append(f"| {MODES[mode]} | {r['libraries']:.0f} | {r['weights']:.0f} "
                    f"({r['mapped']:.0f}) | {r['other_load']:.0f} | {r['kv_touched']:.0f} | "
                    f"{r['activations']:.0f} | {r['peak']:.0f} |")
    body = "\n".join([
        "## Where the memory goes (memory_breakdown.py)",
        "",
        f"`python benchmarks/memory_breakdown.py{f' --model {args.model}' if args.model else ''}`"
        f" on {machine_line()}. Model: {Path(args.model).name if args.model else 'the default'}; "
        "MiB of resident memory, each format in a fresh process: after importing torch, "
        "kvloop's engine and its native kernels; the model's tensors (distinct storages; in "
        "brackets, how much of the load's growth was file-backed, i.e. mapped from the "
        "GGUF rather than copied); the rest of what loading added (tokenizer, metadata, "
        "tables, allocator slack); the KV pool's blocks written at least once; the rest of "
        "the peak after a 512-token prefill and a 128-token batch-1 decode (activations, "
        "scratch).",
        "",
        *rows,
        "",
    ])
    publish(body, args.write, "memory-breakdown" if args.model is None else
            f"memory-breakdown-{Path(args.model).stem}")


if __name__ == "__main__":
    main()
