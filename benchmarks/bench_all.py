"""kvloop beside transformers and llama.cpp on the same model, in the same run, one table.

    python benchmarks/bench_all.py [--runs 3] [--concurrency 8 32 64] [--engines ...]
                                   [--model FILE.gguf] [--quick] [--write BENCHMARKS.md]

The parent process measures the machine (memory read bandwidth, matmul FLOP/s), writes one
workload (token ids, shared by every engine), then starts each engine in its own worker process
(`bench_all.py --engine NAME --json --workload FILE --gated`), so engines never share memory
or threads and each one's peak resident set is its own. The workers take turns, one step at a
time (a load, one decode run, one prefill run, one concurrent run), never two at once: each
figure's runs alternate between the engines, so a change in the machine's speed during the run
(other tenants of a shared host moved its memory bandwidth by 30-50% within minutes here)
falls on every engine alike instead of on whichever ran at the time, and the ratios hold.

Figures, per engine:
- batch-1 decode tok/s: one request, a 16-token prompt, 128 generated tokens (greedy, EOS
  ignored), timed from the first generated token to the last; median of --runs.
- prefill tok/s: a 512-token prompt into an empty KV cache, prompt tokens / time to the first
  token; a new prompt each run (no prefix cache can help); median of --runs.
- generated tok/s at K concurrent requests: K prompts of 64 tokens (--concurrent-prompt; 0:
  64..512 tokens, evenly spread), 128 new tokens each, all generated tokens / wall time from
  submission to the last token (prefill included); one run per K.
- decode weight bandwidth: weight bytes one decode step reads x decode tok/s, and that as a
  fraction of the bandwidth measured here (the roofline of batch-1 decode): the most a probe
  read, once before the engines and once before each round of their turns.
- peak memory: the worker's peak resident set (VmHWM): interpreter, libraries, weights, KV cache,
  activations; once after the batch-1 figures and once at the end (after the concurrent runs).

Engines: kvloop with the file's weights as stored (its block formats, exactly), fp32, int8 and
int4 linear layers; transformers fp32 (`generate`; the
concurrent requests run as one left-padded static batch); llama.cpp through llama-cpp-python,
computing on the GGUF weights as stored (Q4_1, Q8_0 embeddings), one sequence per request
like llama-batched-bench. `--quick` shrinks every size for a smoke test.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import kvloop  # noqa: F401  (no torch: first, so that KVLOOP_ISA caps the libraries torch loads)

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
# Only light imports at module level: the llama.cpp worker must not load torch, or its peak
# memory would include it. torch, kvloop and transformers are imported where they are used.

ENGINES: dict[str, str] = {
    "kvloop-gguf": "kvloop as-stored",
    "kvloop-fp32": "kvloop fp32",
    "kvloop-int8": "kvloop int8",
    "kvloop-int4": "kvloop int4",
    "transformers": "transformers fp32",
    "llama.cpp": "llama.cpp as-stored",
}
KVLOOP = [e for e in ENGINES if e.startswith("kvloop")]
PEERS = ["transformers", "llama.cpp"]
JSON_MARK = "BENCH_ALL_JSON "


@dataclass(frozen=True)
class Sizes:
    """Every size the figures use (the workload file carries them to the workers)."""

    runs: int = 3
    decode_prompt: int = 16
    decode_tokens: int = 128
    prefill_tokens: int = 512
    new_tokens: int = 128
    concurrency: tuple[int, ...] = (8, 32, 64)
    # Prompt length of the concurrent requests: 64 as in the anchor table
    # (llama-batched-bench style); 0 spreads them evenly over 64..512 tokens.
    concurrent_prompt: int = 64

    @classmethod
    def quick(cls, runs: int = 1, concurrency: tuple[int, ...] = (2,)) -> Sizes:
        return cls(runs, 16, 16, 64, 8, concurrency, 16)


@dataclass
class Workload:
    """Token ids for every measurement: index 0 of `decode`/`prefill` is the warm-up."""

    sizes: Sizes
    model_path: str
    threads: int
    decode: list[list[int]]
    prefill: list[list[int]]
    warmup_concurrent: list[list[int]]
    concurrent: dict[str, list[list[int]]]  # str(K) -> K prompts

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self)))

    @classmethod
    def load(cls, path: Path) -> Workload:
        d = json.loads(path.read_text())
        d["sizes"] = Sizes(**{**d["sizes"], "concurrency": tuple(d["sizes"]["concurrency"])})
        return cls(**d)


def build_workload(sizes: Sizes, threads: int, model: Path) -> Workload:
    """Prompts from the model's tokenizer; salts keep every prompt distinct."""
    from bench_throughput import workload
    from common import prompt_ids
    from kvloop.loading.loader import load_checkpoint

    tok = load_checkpoint(model).tokenizer
    n = sizes.runs + 1

    def concurrent(k: int, salt: int) -> list[list[int]]:
        if sizes.concurrent_prompt == 0:
            return workload(tok, k, salt)
        return [prompt_ids(tok, sizes.concurrent_prompt, salt * 1000 + i) for i in range(k)]

    return Workload(
        sizes=sizes, model_path=str(model), threads=threads,
        decode=[prompt_ids(tok, sizes.decode_prompt, 100 + i) for i in range(n)],
        prefill=[prompt_ids(tok, sizes.prefill_tokens, 200 + i) for i in range(n)],
        warmup_concurrent=concurrent(2, 99),
        concurrent={str(k): concurrent(k, 300 + i) for i, k in enumerate(sizes.concurrency)},
    )


def peak_rss_mib() -> float:
    """This process's peak resident set so far, MiB (VmHWM; ru_maxrss where /proc is absent)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# -- engines (worker side) -------------------------------------------------------------------

class Engine(Protocol):
    def decode(self, prompt: list[int], n: int) -> float: ...
    def prefill(self, prompt: list[int]) -> float: ...
    def throughput(self, prompts: list[list[int]], new_tokens: int) -> float: ...
    def read_bytes(self) -> int: ...
    def info(self) -> dict[str, Any]: ...


class KvloopEngine:
    """kvloop's offline API, one LLM for every figure (continuous batching over paged KV)."""

    def __init__(self, model_path: str, quantization: str, max_num_seqs: int) -> None:
        from kvloop import LLM

        self.llm = LLM(model_path, quantization=quantization, max_num_seqs=max_num_seqs)
        self.last_run: dict[str, int] = {}  # engine steps and preemptions of the last run

    def _params(self, n: int) -> Any:
        from kvloop import SamplingParams

        return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)

    def decode(self, prompt: list[int], n: int) -> float:
        out = self.llm.generate([prompt], self._params(n))[0]
        rate = out.metrics.decode_tokens_per_s  # 1 / time per output token after the first
        assert rate is not None and out.metrics.num_output_tokens == n
        return rate

    def prefill(self, prompt: list[int]) -> float:
        out = self.llm.generate([prompt], self._params(1))[0]
        assert out.metrics.ttft is not None and out.metrics.num_cached_tokens == 0
        return len(prompt) / out.metrics.ttft

    def throughput(self, prompts: list[list[int]], new_tokens: int) -> float:
        eng = self.llm.engine
        steps0, pre0 = eng.num_steps, eng.scheduler.num_preemptions
        t = time.perf_counter()
        outs = self.llm.generate(prompts, self._params(new_tokens))
        wall = time.perf_counter() - t
        n = sum(len(o.outputs[0].token_ids) for o in outs)
        assert n == new_tokens * len(prompts)
        self.last_run = {"steps": eng.num_steps - steps0,
                         "preemptions": eng.scheduler.num_preemptions - pre0}
        return n / wall

    def read_bytes(self) -> int:
        return int(self.llm.engine.model.decode_read_bytes())

    def info(self) -> dict[str, Any]:
        # Layers of different KV cache groups share tensors (kv_cache.py): count each once.
        kv = {c.data.data_ptr(): c for c in self.llm.engine.runner.kv_caches or []}
        stats = self.llm.engine.kv.stats()
        return {"kv_pool_mib": sum(c.nbytes for c in kv.values()) / 2**20,
                "kv_dtype": stats.kv_dtype,
                "kv_resident_mib": stats.num_resident_blocks * stats.bytes_per_block / 2**20}


class TransformersEngine:
    """Hugging Face transformers `generate`, fp32, the model loaded from the same GGUF."""

    def __init__(self, model_path: str) -> None:
        from bench_decode import HF

        self.hf = HF(Path(model_path))  # eos_token_id cleared: EOS ignored, as for kvloop

    def decode(self, prompt: list[int], n: int) -> float:
        from common import timed

        first = timed(lambda: self.hf._generate(prompt, 1, True))
        total = timed(lambda: self.hf._generate(prompt, n, True))
        return (n - 1) / (total - first)  # time after the first token, like kvloop's TPOT

    def prefill(self, prompt: list[int]) -> float:
        from common import timed

        return len(prompt) / timed(lambda: self.hf._generate(prompt, 1, True))

    def throughput(self, prompts: list[list[int]], new_tokens: int) -> float:
        """The prompts as one left-padded static batch."""
        return self.hf.static_batch_throughput(prompts, new_tokens)

    def read_bytes(self) -> int:
        """Every linear layer (the head: the tied embedding, read in full) and the norms,
        each tensor once."""
        import torch

        seen: dict[int, int] = {}
        for m in self.hf.model.modules():
            if isinstance(m, torch.nn.Linear) or "Norm" in type(m).__name__:
                for p in m.parameters(recurse=False):
                    seen[p.data_ptr()] = p.numel() * p.element_size()
        return sum(seen.values())

    def info(self) -> dict[str, Any]:
        import transformers

        return {"version": transformers.__version__}


class LlamaCppEngine:
    def __init__(self, model_path: str, threads: int) -> None:
        import llamacpp_peer

        self.path = model_path
        self.peer = llamacpp_peer.LlamaCppPeer(model_path, n_threads=threads)

    def decode(self, prompt: list[int], n: int) -> float:
        return self.peer.decode(prompt, n)

    def prefill(self, prompt: list[int]) -> float:
        return self.peer.prefill(prompt)

    def throughput(self, prompts: list[list[int]], new_tokens: int) -> float:
        return self.peer.throughput(prompts, new_tokens)

    def read_bytes(self) -> int:
        import llamacpp_peer

        return llamacpp_peer.decode_read_bytes(self.path)

    def info(self) -> dict[str, Any]:
        import llamacpp_peer

        return {"version": llamacpp_peer.version(), "threads": self.peer.n_threads}


def make_engine(name: str, work: Workload) -> Engine:
    if name == "llama.cpp":
        return LlamaCppEngine(work.model_path, work.threads)
    import torch

    if torch.get_num_threads() != work.threads:  # only when needed (see LLMEngine)
        torch.set_num_threads(work.threads)
    if name == "transformers":
        return TransformersEngine(work.model_path)
    quant = {"kvloop-gguf": "gguf", "kvloop-fp32": "none", "kvloop-int8": "int8",
             "kvloop-int4": "int4"}[name]
    return KvloopEngine(work.model_path, quant, max(64, *work.sizes.concurrency))


# A gated worker's line asking for its next turn (see run_gated).
GATE = "BENCH_ALL_GATE"


def no_gate() -> None:
    """A worker on its own: every step at once."""


def stdin_gate() -> None:
    """A gated worker: say so and wait for the parent's go (a line on stdin; EOF: the parent
    is gone, stop)."""
    print(GATE, flush=True)
    if not sys.stdin.readline():
        sys.exit(1)


def run_worker(name: str, work: Workload, gate: Callable[[], None] = no_gate) -> dict[str, Any]:
    """Every figure of one engine, in this process; gate() before each timed step."""
    s = work.sizes
    gate()
    t0 = time.perf_counter()
    eng = make_engine(name, work)
    res: dict[str, Any] = {"engine": name, "load_s": time.perf_counter() - t0,
                           "rss_loaded_mib": peak_rss_mib()}
    # Warm-ups (index 0 of each list): first calls pay one-off allocation and kernel selection.
    gate()
    eng.prefill(work.prefill[0])
    eng.decode(work.decode[0], min(8, s.decode_tokens))
    res["decode_runs"] = []
    for p in work.decode[1:]:
        gate()
        res["decode_runs"].append(eng.decode(p, s.decode_tokens))
    res["prefill_runs"] = []
    for p in work.prefill[1:]:
        gate()
        res["prefill_runs"].append(eng.prefill(p))
    res["rss_batch1_mib"] = peak_rss_mib()
    gate()
    eng.throughput(work.warmup_concurrent, min(4, s.new_tokens))
    res["concurrent"], res["concurrent_info"] = {}, {}
    for k, prompts in work.concurrent.items():
        gate()
        res["concurrent"][k] = eng.throughput(prompts, s.new_tokens)
        res["concurrent_info"][k] = getattr(eng, "last_run", None)
        print(f"  {name}: {k} concurrent: {res['concurrent'][k]:.1f} tok/s", file=sys.stderr,
              flush=True)
    res["rss_peak_mib"] = peak_rss_mib()
    res["decode_read_bytes"] = eng.read_bytes()
    res["info"] = eng.info()
    res["wall_s"] = time.perf_counter() - t0
    return res


# -- parent: spawn workers, build the table --------------------------------------------------

def llamacpp_installed(path: Path | None = None) -> str | None:
    """llama-cpp-python's version (the one installed under `path`, if given), or None when
    it is not importable."""
    from importlib.metadata import PackageNotFoundError, distributions, version

    if path is not None:
        found = [d.version for d in distributions(path=[str(path)])
                 if d.metadata["Name"] == "llama_cpp_python"
                 or d.metadata["Name"] == "llama-cpp-python"]
        return f"{found[0]} from {path}" if found else None
    if importlib.util.find_spec("llama_cpp") is None:
        return None
    try:
        return version("llama-cpp-python")
    except PackageNotFoundError:
        return "?"


# Between two workers' turns: the last one's idle threads stop spinning (OpenMP's and
# llama.cpp's wait a while before they sleep) before the next one runs.
TURN_PAUSE_S = 0.5


def start_worker(name: str, workload_path: Path,
                 llama_cpp_path: Path | None = None) -> subprocess.Popen[str]:
    """One engine's gated worker process (stdin: its turns; stdout: gates and its result)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--engine", name, "--json",
           "--workload", str(workload_path), "--gated"]
    env = {**os.environ, "TQDM_DISABLE": "1"}  # transformers' GGUF conversion bar
    if name == "llama.cpp" and llama_cpp_path is not None:
        # A llama-cpp-python built for another ISA (pip install --target DIR), first on the path.
        env["PYTHONPATH"] = os.pathsep.join(
            [str(llama_cpp_path), *filter(None, [env.get("PYTHONPATH")])])
    return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env=env)


def run_gated(names: list[str], workload_path: Path, llama_cpp_path: Path | None = None,
              between: Callable[[], None] = no_gate) -> dict[str, dict[str, Any]]:
    """Every engine's figures, the workers taking turns step by step (see the top): each
    result, or {"error": ...} for a worker that failed. between() runs before each round of
    turns, while every worker waits."""
    procs = {name: start_worker(name, workload_path, llama_cpp_path) for name in names}
    results: dict[str, dict[str, Any]] = {}

    def until_gate(name: str) -> bool:
        """Read the worker's output up to its next gate (True) or its end (False)."""
        proc = procs[name]
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.rstrip("\n") == GATE:
                return True
            if line.startswith(JSON_MARK):
                results[name] = json.loads(line[len(JSON_MARK):])
        proc.wait()
        results.setdefault(name, {"engine": name,
                                  "error": f"worker exited with {proc.returncode}"})
        return False

    # Each worker's imports run before its first gate, all at once: nothing is timed yet.
    live = [name for name in names if until_gate(name)]
    step = 0
    while live:
        step += 1
        print(f"[bench_all] step {step}: {', '.join(live)}", file=sys.stderr, flush=True)
        between()
        for name in list(live):
            time.sleep(TURN_PAUSE_S)
            stdin = procs[name].stdin
            assert stdin is not None
            stdin.write("go\n")
            stdin.flush()
            if not until_gate(name):
                live.remove(name)
    return results


def _fmt(v: float | None, spec: str) -> str:
    return "—" if v is None else format(v, spec)


def model_title(work: Workload) -> str:
    from kvloop.loading.loader import default_model_path

    if Path(work.model_path) == default_model_path():
        return "the default model (SmolLM2-135M-Instruct)"
    return f"`{Path(work.model_path).stem}`"


def tensor_types(path: str) -> str:
    """The file's tensor types and counts ("Q5_0 x81, Q4_K x27, ...")."""
    from collections import Counter

    import gguf

    counts = Counter(t.tensor_type.name for t in gguf.GGUFReader(path).tensors)
    return ", ".join(f"{k} x{v}" for k, v in counts.most_common())


def render(results: dict[str, dict[str, Any]], work: Workload, reads: list[float],
           flops: float, command: str, elapsed: float, llamacpp_version: str | None) -> str:
    """The table and its notes; reads: the bandwidth probe's samples (the most is the
    machine's bandwidth: the host's other tenants only ever take some away)."""
    bandwidth = max(reads)
    s = work.sizes
    names = list(results)
    ok = {n: r for n, r in results.items() if "error" not in r}

    def cell_state(n: str) -> str:  # the reason is spelled out under the table
        return "not installed" if results[n].get("error") == "not installed" else "failed"

    # (label, per-engine value getter, format, higher is better?, ratio meaningful?)
    Row = tuple[str, Any, str, bool, bool]
    rows: list[Row] = [
        (f"batch-1 decode, {s.decode_tokens} tokens (tok/s)",
         lambda r: statistics.median(r["decode_runs"]), ".1f", True, True),
        (f"prefill, {s.prefill_tokens}-token prompt (tok/s)",
         lambda r: statistics.median(r["prefill_runs"]), ".1f", True, True),
    ]
    for k in s.concurrency:
        rows.append((f"generated tok/s, {k} concurrent requests",
                     lambda r, k=k: r["concurrent"][str(k)], ".1f", True, True))
    rows += [
        ("decode: weight bytes read per token (MB)",
         lambda r: r["decode_read_bytes"] / 1e6, ".1f", False, False),
        ("decode: achieved weight bandwidth (GB/s)",
         lambda r: r["decode_read_bytes"] * statistics.median(r["decode_runs"]) / 1e9,
         ".2f", True, True),
        ("decode: fraction of measured bandwidth",
         lambda r: r["decode_read_bytes"] * statistics.median(r["decode_runs"]) / bandwidth,
         ".1%", True, True),
        ("peak memory after batch-1 figures (MiB)", lambda r: r["rss_batch1_mib"], ".0f",
         False, True),
        ("peak memory, whole run (MiB)", lambda r: r["rss_peak_mib"], ".0f", False, True),
    ]
    ours = [n for n in names if n in KVLOOP]
    peers = [n for n in names if n in PEERS]
    head = ["figure", *(ENGINES[n] for n in names)]
    head += [f"best kvloop / {ENGINES[p].split()[0]}" for p in peers if ours]
    lines = ["| " + " | ".join(head) + " |", "|---" + "|---:" * (len(head) - 1) + "|"]
    for label, get, spec, higher, ratio_ok in rows:
        vals = {n: get(r) for n, r in ok.items()}
        cells = [label] + [_fmt(vals[n], spec) if n in vals else cell_state(n) for n in names]
        have = [n for n in ours if n in vals]
        best = (max if higher else min)(have, key=lambda n: vals[n]) if have else None
        for p in peers if ours else []:
            if best is None or p not in vals or not ratio_ok or not vals[p]:
                cells.append("—")
            else:
                cells.append(f"{vals[best] / vals[p]:.2f}x ({ENGINES[best].split()[1]})")
        lines.append("| " + " | ".join(cells) + " |")

    from common import machine_line

    notes = [
        f"## kvloop, transformers and llama.cpp on {model_title(work)}",
        "",
        f"`{command}` on {machine_line()}; measured bandwidth {bandwidth / 1e9:.1f} GB/s "
        f"(the most of {len(reads)} reads of a 512 MiB buffer, one before the engines and one "
        f"before each round of their turns; the least {min(reads) / 1e9:.1f}), "
        f"matmul {flops / 1e9:.1f} GFLOP/s (fp32 1024^3); "
        f"all figures measured in this run ({elapsed:.0f} s), each engine in its own process, "
        f"{work.threads} threads each, the engines taking turns run by run (never two at once).",
        "",
        f"Model file `{Path(work.model_path).name}` ({tensor_types(work.model_path)}). kvloop "
        "as-stored computes on the file's blocks exactly (`--quantization gguf`, the default "
        "for GGUF files); kvloop fp32 and transformers dequantize them; kvloop int8/int4 "
        "re-quantize the linear layers (int4 keeps Q4_0/Q4_1 codes); llama.cpp computes on "
        f"the weights as stored, llama-cpp-python {llamacpp_version or 'not installed'}.",
        f"Batch-1 decode: {s.decode_prompt}-token prompt, {s.decode_tokens} tokens, greedy, "
        f"EOS ignored, timed after the first token; prefill: a fresh {s.prefill_tokens}-token "
        f"prompt per run; median of {s.runs} run{'s' * (s.runs != 1)}. Concurrent: prompts "
        + (f"of {s.concurrent_prompt} tokens, " if s.concurrent_prompt else "of 64-512 tokens, ")
        + f"{s.new_tokens} new tokens each, all generated tokens / wall time including prefill, "
        "one run each; transformers runs them as one left-padded static batch, llama.cpp as "
        "one sequence per request (one KV stream each, all prompts prefilled then one token "
        "per sequence per llama_decode), kvloop by continuous batching.",
        "Bandwidth fraction = weight bytes per decode step x decode tok/s / measured "
        "bandwidth. Peak memory is the worker process's peak resident set (VmHWM): "
        "interpreter and libraries (torch for kvloop and transformers, not for llama.cpp), "
        "weights, KV cache, activations. Ratio columns: the best kvloop variant on that row "
        "(highest figure; lowest for memory) over the peer.",
    ]
    extra = []
    for n, r in ok.items():
        info = r.get("info", {})
        d = ", ".join(f"{x:.1f}" for x in r["decode_runs"])
        p = ", ".join(f"{x:.1f}" for x in r["prefill_runs"])
        line = f"- {ENGINES[n]}: decode runs {d}; prefill runs {p}; load {r['load_s']:.1f} s"
        if "kv_pool_mib" in info:
            line += (f"; KV pool {info['kv_pool_mib']:.0f} MiB {info['kv_dtype']} reserved, "
                     f"{info['kv_resident_mib']:.0f} MiB of it resident after the run")
        runs = [(k, x) for k, x in r.get("concurrent_info", {}).items() if x]
        if runs:
            line += "; engine steps / preemptions at " + ", ".join(
                f"{k} requests {x['steps']}/{x['preemptions']}" for k, x in runs)
        extra.append(line)
    for n, r in results.items():
        if "error" in r:
            extra.append(f"- {ENGINES[n]}: {r['error']}")
    return "\n".join([*notes, "", *lines, "", *extra])


def kvloop_kernels_available() -> bool:
    from kvloop import kernels

    return bool(kernels.available())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=None, help="runs per median (default 3)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=None,
                    help="concurrent-request counts (default 8 32 64)")
    ap.add_argument("--concurrent-prompt", type=int, default=64,
                    help="prompt tokens of each concurrent request (default 64, as "
                         "llama-batched-bench; 0: spread over 64..512)")
    ap.add_argument("--engines", nargs="+", choices=list(ENGINES), default=list(ENGINES))
    ap.add_argument("--model", type=Path, default=None,
                    help="a GGUF file (default: the default model); its table gets its own "
                         "section of --write")
    ap.add_argument("--quick", action="store_true",
                    help="tiny sizes for a smoke test (16 decode tokens, 64-token prefill, "
                         "2 concurrent requests, 8 new tokens, 1 run)")
    ap.add_argument("--write", type=Path, default=None, help="update this BENCHMARKS.md")
    ap.add_argument("--llama-cpp-path", type=Path, default=None,
                    help="a llama-cpp-python installed with `pip install --target DIR` (e.g. "
                         "built for AVX2 only, to sit beside KVLOOP_ISA=avx2), used instead "
                         "of the environment's")
    ap.add_argument("--engine", choices=list(ENGINES), help=argparse.SUPPRESS)  # worker mode
    ap.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--workload", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--gated", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.engine:
        if args.workload is None:
            ap.error("--engine needs --workload")
        res = run_worker(args.engine, Workload.load(args.workload),
                         stdin_gate if args.gated else no_gate)
        print(JSON_MARK + json.dumps(res) if args.json else json.dumps(res, indent=1),
              flush=True)
        return

    import torch

    from kvloop.engine.machine import measure_bandwidth, measure_flops

    conc = tuple(args.concurrency) if args.concurrency else None
    if args.quick:
        sizes = Sizes.quick(args.runs or 1, conc or (2,))
    else:
        sizes = Sizes(runs=args.runs or 3, concurrency=conc or (8, 32, 64),
                      concurrent_prompt=args.concurrent_prompt)
    t0 = time.time()
    from kvloop.loading.loader import default_model_path

    model = args.model or default_model_path()
    work = build_workload(sizes, torch.get_num_threads(), model)
    reads, flops = [measure_bandwidth()], measure_flops()
    print(f"[bench_all] bandwidth {reads[0] / 1e9:.1f} GB/s, {flops / 1e9:.1f} GFLOP/s",
          file=sys.stderr, flush=True)
    from common import isa_line

    print(f"[bench_all] {isa_line()}", file=sys.stderr, flush=True)
    llamacpp_version = llamacpp_installed(args.llama_cpp_path)
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "workload.json"
        work.save(path)
        names = [e for e in ENGINES if e in args.engines]  # columns in a fixed order
        if "llama.cpp" in names and llamacpp_version is None:
            names.remove("llama.cpp")
            results["llama.cpp"] = {"engine": "llama.cpp", "error": "not installed"}
        # The probe again before each round of turns: the host's bandwidth moves (see the
        # top), and the decode figures' fraction of it should not rest on one moment's read.
        results.update(run_gated(names, path, args.llama_cpp_path,
                                 lambda: reads.append(measure_bandwidth())))
        results = {e: results[e] for e in ENGINES if e in results}
    command = shlex.join(["python", os.path.relpath(Path(__file__).resolve(), HERE.parent),
                          *sys.argv[1:]])
    body = render(results, work, reads, flops, command, time.time() - t0, llamacpp_version)
    from common import publish

    # One table per kernel ISA build (KVLOOP_ISA=avx2 on an AVX-512 machine stands for an
    # AVX2-only one), per model.
    from kvloop.kernels import build

    isa = build.kernel_isa() if kvloop_kernels_available() else "pytorch"
    section = (f"bench-all-{isa}" if model == default_model_path()
               else f"bench-all-{model.stem}-{isa}")
    publish(body, args.write, section)


if __name__ == "__main__":
    main()
