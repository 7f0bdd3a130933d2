"""Speculative decoding on the default model: kvloop with and without speculation, beside
transformers' prompt lookup and assisted generation and llama-cpp-python's prompt-lookup
draft, all on the same prompts in the same run.

    python benchmarks/bench_speculative.py [--runs 3] [--tokens 128] [--write BENCHMARKS.md]
    python benchmarks/bench_speculative.py --quick      # tiny sizes: a dry run, not a result

(a) batch-1 generated tok/s on input-grounded prompts (repeat / edit / summarize a text or
    code given in the prompt), n-gram proposer, fp32 and int4 targets;
(b) batch-1 on open chat prompts, the 4-bit self-draft ("self:int4") for the fp32 and int8
    targets (when the engine takes it);
(c) generated tok/s at 1, 8, 32, 64 concurrent requests, n-gram on and off (the engine's
    speculative_max_batch default applies);
(d) peers on the (a) prompts: transformers `generate(prompt_lookup_num_tokens=...)` and
    assisted generation (the same model, loaded twice, drafting for itself), llama-cpp-python
    with `LlamaPromptLookupDecoding`; each with and without its speculation.

Every run is greedy with EOS ignored, the chat template applied; batch-1 tok/s is timed after
the first token (prefill excluded), medians over --runs, each run cycling through the prompts.
"""

from __future__ import annotations

import argparse
import copy
import gc
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import machine_line, publish
from kvloop.config import EngineConfig
from kvloop.engine.llm_engine import LLMEngine
from kvloop.errors import InvalidParamsError
from kvloop.loading.loader import DEFAULT_MODEL_FILE, default_model_path, load_checkpoint
from kvloop.params import SamplingParams

_CODE = '''def merge(a, b):
    out = []
    i = j = 0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            out.append(a[i])
            i += 1
        else:
            out.append(b[j])
            j += 1
    out.extend(a[i:])
    out.extend(b[j:])
    return out
'''
_TEXT = ("The city council met on Tuesday to discuss the new bicycle lanes on Main Street. "
         "Residents praised the safer crossings, but shop owners worried about losing parking "
         "spaces in front of their stores. After two hours of debate, the council agreed to a "
         "six-month trial, with a review of traffic and sales figures in the spring.")

GROUNDED = [
    f"Repeat the following code exactly:\n\n{_CODE}",
    f"Rename the function to merge_sorted and the variable out to result in this code, and "
    f"show the whole new code:\n\n{_CODE}",
    f"Add type hints and a docstring to this function:\n\n{_CODE}",
    f"Summarize this text in two sentences:\n\n{_TEXT}",
    f"Repeat this text word for word:\n\n{_TEXT}",
    f"Rewrite this text in the first person, as a shop owner:\n\n{_TEXT}",
]
CHAT = [
    "What are three tips for staying focused while studying?",
    "Explain why the sky is blue to a ten-year-old.",
    "Write a short story about a robot who learns to paint.",
    "What should I pack for a week of hiking in the mountains?",
    "Describe how a bill becomes a law.",
    "Give me a recipe for a simple vegetable soup.",
]
CONCURRENCY: tuple[int, ...] = (1, 8, 32, 64)
PROMPT_LOOKUP_TOKENS = 10  # transformers' suggested value; llama.cpp's num_pred_tokens too


@dataclass
class Result:
    """One engine configuration on one prompt set."""

    rates: list[float] = field(default_factory=list)  # generated tok/s per run
    drafted: int = 0
    accepted: int = 0
    spec_steps: int = 0
    outputs: dict[int, list[int]] = field(default_factory=dict)  # prompt index -> ids
    note: str = ""

    @property
    def rate(self) -> float | None:
        return statistics.median(self.rates) if self.rates else None

    @property
    def acceptance(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def mean_accepted_length(self) -> float | None:
        return 1.0 + self.accepted / self.spec_steps if self.spec_steps else None


def na(note: str) -> Result:
    return Result(note=note)


# -- kvloop -----------------------------------------------------------------------------------
class Kvloop:
    def __init__(self, checkpoint, **options: Any) -> None:
        self.engine = LLMEngine(None, EngineConfig(**options), checkpoint=checkpoint)
        self._ids = 0

    def run(self, prompts: list[list[int]], params: SamplingParams) -> tuple[list, float]:
        """All prompts at once (continuous batching); outputs in order, and the wall time."""
        rids = []
        t = time.perf_counter()
        for p in prompts:
            self._ids += 1
            rids.append(self.engine.add_request(f"b{self._ids}", p, params))
        finals = {}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    if out.error:
                        raise RuntimeError(out.error)
                    finals[out.request_id] = out
        return [finals[r] for r in rids], time.perf_counter() - t

    def close(self) -> None:
        del self.engine
        gc.collect()


def kvloop_batch1(engine: Kvloop, prompts: list[list[int]], tokens: int, runs: int) -> Result:
    """Generated tok/s of one request at a time: per run, the decode tokens of every prompt
    over their decode time (after each one's first token)."""
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    engine.run(prompts[:1], SamplingParams(temperature=0, max_tokens=4))  # warm-up
    res = Result()
    for r in range(runs):
        n = secs = 0.0
        for i, p in enumerate(prompts):
            (out,), _ = engine.run([p], params)
            m = out.metrics
            n += m.num_output_tokens - 1
            secs += m.decode_time
            if r == 0:
                res.outputs[i] = list(out.outputs[0].token_ids)
                res.drafted += m.num_draft_tokens
                res.accepted += m.num_accepted_tokens
                res.spec_steps += m.num_spec_steps
        res.rates.append(n / secs)
    return res


def kvloop_concurrent(engine: Kvloop, prompts: list[list[int]], n: int, tokens: int,
                      runs: int) -> Result:
    """Generated tok/s with n requests submitted together (wall time, prefill included)."""
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    batch = [prompts[i % len(prompts)] for i in range(n)]
    res = Result()
    for _ in range(runs):
        outs, wall = engine.run(batch, params)
        res.rates.append(sum(o.metrics.num_output_tokens for o in outs) / wall)
        res.drafted = sum(o.metrics.num_draft_tokens for o in outs)
        res.accepted = sum(o.metrics.num_accepted_tokens for o in outs)
        res.spec_steps = sum(o.metrics.num_spec_steps for o in outs)
    return res


# -- transformers -----------------------------------------------------------------------------
class HF:
    def __init__(self, assisted: bool) -> None:
        from transformers import AutoModelForCausalLM

        path = default_model_path()

        def load():
            m = AutoModelForCausalLM.from_pretrained(
                str(path.parent), gguf_file=DEFAULT_MODEL_FILE, dtype=torch.float32).eval()
            m.generation_config.eos_token_id = None  # EOS ignored, as for kvloop
            return m

        self.model = load()
        self.assistant = load() if assisted else None

    def _generate(self, ids: list[int], n: int, **spec: Any) -> list[int]:
        cfg = copy.deepcopy(self.model.generation_config)
        cfg.update(do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=0)
        with torch.inference_mode():
            out = self.model.generate(torch.tensor([ids]), generation_config=cfg,
                                      attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                      **spec)
        return out[0, len(ids):].tolist()

    def batch1(self, prompts: list[list[int]], tokens: int, runs: int, **spec: Any) -> Result:
        self._generate(prompts[0], 4, **spec)  # warm-up
        res = Result()
        for r in range(runs):
            n = secs = 0.0
            for i, p in enumerate(prompts):
                t = time.perf_counter()
                self._generate(p, 1)  # the prefill and first token, as timed apart
                first = time.perf_counter() - t
                t = time.perf_counter()
                out = self._generate(p, tokens, **spec)
                secs += time.perf_counter() - t - first
                n += tokens - 1
                if r == 0:
                    res.outputs[i] = out
            res.rates.append(n / secs)
        return res


# -- llama.cpp --------------------------------------------------------------------------------
def llamacpp_batch1(prompts: list[list[int]], tokens: int, runs: int, threads: int,
                    lookup: bool) -> Result:
    try:
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    except ImportError:
        return na("not installed")
    draft = LlamaPromptLookupDecoding(num_pred_tokens=PROMPT_LOOKUP_TOKENS) if lookup else None
    llm = Llama(model_path=str(default_model_path()), n_ctx=2048, n_threads=threads,
                n_threads_batch=threads, verbose=False, draft_model=draft)

    def generate(ids: list[int], n: int) -> tuple[list[int], float]:
        """Greedy ids (EOS ignored) and the seconds after the first token."""
        llm.reset()
        out: list[int] = []
        t_first = 0.0
        for tok in llm.generate(ids, temp=0.0, top_k=1, repeat_penalty=1.0, reset=True):
            out.append(tok)
            if len(out) == 1:
                t_first = time.perf_counter()
            if len(out) == n:
                break
        return out, time.perf_counter() - t_first

    generate(prompts[0], 4)  # warm-up
    res = Result()
    for r in range(runs):
        n = secs = 0.0
        for i, p in enumerate(prompts):
            out, s = generate(p, tokens)
            n += tokens - 1
            secs += s
            if r == 0:
                res.outputs[i] = out
        res.rates.append(n / secs)
    getattr(llm, "close", lambda: None)()  # frees the context (newer versions)
    return res


# -- the run ----------------------------------------------------------------------------------
def takes(method: str) -> bool:
    try:
        EngineConfig(speculative=method)
    except InvalidParamsError:
        return False
    return True


def fmt(x: float | None, spec: str = ".1f") -> str:
    return "—" if x is None else format(x, spec)


def same(a: Result, b: Result) -> str:
    if not a.outputs or not b.outputs:
        return "—"
    n = sum(a.outputs[i] == b.outputs.get(i) for i in a.outputs)
    return f"{n}/{len(a.outputs)}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128, help="generated per request")
    ap.add_argument("--quick", action="store_true",
                    help="tiny sizes (2 prompts, 16 tokens, 1 run, concurrency 1 and 4): a "
                         "dry run of every row, not a result")
    ap.add_argument("--skip-peers", action="store_true", help="kvloop rows only")
    ap.add_argument("--write", type=Path, default=None, help="update this BENCHMARKS.md")
    args = ap.parse_args()
    runs, tokens, concurrency = args.runs, args.tokens, CONCURRENCY
    grounded_text, chat_text = GROUNDED, CHAT
    if args.quick:
        runs, tokens, concurrency = 1, 16, (1, 4)
        grounded_text, chat_text = GROUNDED[:2], CHAT[:2]
    threads = torch.get_num_threads()
    t0 = time.time()

    checkpoint = load_checkpoint(None)
    tok = checkpoint.tokenizer
    grounded = [tok.encode_chat([{"role": "user", "content": t}]) for t in grounded_text]
    chat = [tok.encode_chat([{"role": "user", "content": t}]) for t in chat_text]
    kv_mem = "3GiB" if max(concurrency) > 32 else "1GiB"

    def kvloop(fn, **options):
        engine = Kvloop(checkpoint, kv_cache_memory=kv_mem, **options)
        try:
            return fn(engine)
        finally:
            engine.close()

    def b1(prompts):
        return lambda e: kvloop_batch1(e, prompts, tokens, runs)

    # (a) input-grounded, n-gram, fp32 and int4 targets.
    a: dict[str, Result] = {}
    for q in ("none", "int4"):
        a[f"{q}/off"] = kvloop(b1(grounded), quantization=q)
        a[f"{q}/ngram"] = kvloop(b1(grounded), quantization=q, speculative="ngram")
    print(f"(a) done at {time.time() - t0:.0f} s", file=sys.stderr)

    # (b) open chat, 4-bit self-draft, fp32 and int8 targets.
    b: dict[str, Result] = {}
    self_ok = takes("self:int4")
    for q in ("none", "int8"):
        b[f"{q}/off"] = kvloop(b1(chat), quantization=q)
        b[f"{q}/self"] = (kvloop(b1(chat), quantization=q, speculative="self:int4")
                          if self_ok else na("not available"))
    print(f"(b) done at {time.time() - t0:.0f} s", file=sys.stderr)

    # (c) concurrency, n-gram on and off, on the grounded prompts.
    c: dict[tuple[int, str], Result] = {}
    def sweep(mode: str):
        def fn(e: Kvloop) -> None:
            kvloop_concurrent(e, grounded, 2, 4, 1)  # warm-up
            for n in concurrency:
                c[n, mode] = kvloop_concurrent(e, grounded, n, tokens, runs)
        return fn

    kvloop(sweep("off"))
    kvloop(sweep("ngram"), speculative="ngram")
    print(f"(c) done at {time.time() - t0:.0f} s", file=sys.stderr)

    # (d) peers on the grounded prompts.
    d: dict[str, Result] = {}
    if args.skip_peers:
        d = {k: na("skipped") for k in ("hf/off", "hf/lookup", "hf/assisted",
                                        "llamacpp/off", "llamacpp/lookup")}
    else:
        hf = HF(assisted=True)
        d["hf/off"] = hf.batch1(grounded, tokens, runs)
        d["hf/lookup"] = hf.batch1(grounded, tokens, runs,
                                   prompt_lookup_num_tokens=PROMPT_LOOKUP_TOKENS)
        d["hf/assisted"] = hf.batch1(grounded, tokens, runs, assistant_model=hf.assistant)
        del hf
        gc.collect()
        d["llamacpp/off"] = llamacpp_batch1(grounded, tokens, runs, threads, lookup=False)
        d["llamacpp/lookup"] = llamacpp_batch1(grounded, tokens, runs, threads, lookup=True)
    elapsed = time.time() - t0

    # -- the report ------------------------------------------------------------------------
    base = a["none/off"].rate

    def vs_base(r: Result) -> str:
        return f"{r.rate / base:.2f}x" if r.rate and base else "—"

    def row(name: str, r: Result, ref: Result | None, same_as: Result | None) -> str:
        if r.rate is None:
            return f"| {name} | {r.note} | — | — | — | — | — |"
        own = f"{r.rate / ref.rate:.2f}x" if ref is not None and ref.rate else "—"
        acc = fmt(r.acceptance and 100 * r.acceptance, ".0f") + ("%" if r.acceptance else "")
        return (f"| {name} | {r.rate:.1f} | {own} | {vs_base(r)} | {acc} | "
                f"{fmt(r.mean_accepted_length, '.2f')} | "
                f"{same(r, same_as) if same_as is not None else '—'} |")

    cmd = "python benchmarks/bench_speculative.py" + (" --quick" if args.quick else
                                                      f" --runs {args.runs} --tokens {tokens}")
    try:
        import llama_cpp
        lc_version = llama_cpp.__version__
    except ImportError:
        lc_version = "not installed"
    import transformers

    head = ("| engine / setting | tok/s | vs same engine without speculation | "
            "vs kvloop fp32 without | acceptance (accepted/drafted) | mean accepted length "
            "| output = without speculation |")
    rule = "|---|---:|---:|---:|---:|---:|---:|"
    lines = [
        "## Speculative decoding (default model, greedy)",
        "",
        f"`{cmd}` on {machine_line()}; transformers {transformers.__version__}, "
        f"llama-cpp-python {lc_version}; all figures measured in this run ({elapsed:.0f} s). "
        f"{len(grounded)} input-grounded and {len(chat)} open-chat prompts through the chat "
        f"template, {tokens} generated tokens each, EOS ignored. Batch-1 tok/s: decode tokens "
        f"over decode time (after each request's first token), one request at a time, median "
        f"of {runs} runs over all the prompts. kvloop n-gram: up to "
        f"{EngineConfig().num_speculative_tokens} drafts per step, adaptive; peers' prompt "
        f"lookup proposes {PROMPT_LOOKUP_TOKENS}. Mean accepted length: tokens gained per "
        f"speculative step (accepted drafts + 1). llama.cpp computes on the GGUF's own "
        f"quantized weights (Q4_1/Q8_0); kvloop and transformers on fp32 unless stated.",
        "",
        "### Batch 1, input-grounded prompts (repeat / edit / summarize given text or code)",
        "",
        head, rule,
        row("kvloop fp32", a["none/off"], None, None),
        row("kvloop fp32, n-gram", a["none/ngram"], a["none/off"], a["none/off"]),
        row("kvloop int4", a["int4/off"], None, None),
        row("kvloop int4, n-gram", a["int4/ngram"], a["int4/off"], a["int4/off"]),
        row("transformers fp32", d["hf/off"], None, None),
        row(f"transformers fp32, prompt lookup ({PROMPT_LOOKUP_TOKENS})", d["hf/lookup"],
            d["hf/off"], d["hf/off"]),
        row("transformers fp32, assisted (same model drafts)", d["hf/assisted"], d["hf/off"],
            d["hf/off"]),
        row("llama.cpp", d["llamacpp/off"], None, None),
        row(f"llama.cpp, prompt lookup ({PROMPT_LOOKUP_TOKENS})", d["llamacpp/lookup"],
            d["llamacpp/off"], d["llamacpp/off"]),
        "",
        "### Batch 1, open chat, 4-bit self-draft (`speculative=\"self:int4\"`)",
        "",
        head, rule,
        row("kvloop fp32", b["none/off"], None, None),
        row("kvloop fp32, self:int4 draft", b["none/self"], b["none/off"], b["none/off"]),
        row("kvloop int8", b["int8/off"], None, None),
        row("kvloop int8, self:int4 draft", b["int8/self"], b["int8/off"], b["int8/off"]),
        "",
        "### Concurrent requests, input-grounded prompts, fp32, n-gram (generated tok/s, "
        "wall time incl. prefill)",
        "",
        f"speculative_max_batch = {EngineConfig().speculative_max_batch} (the default): "
        "above it, nobody drafts.",
        "",
        "| concurrent requests | without | with n-gram | with / without | acceptance |",
        "|---:|---:|---:|---:|---:|",
    ]
    for n in concurrency:
        off, on = c[n, "off"], c[n, "ngram"]
        ratio = f"{on.rate / off.rate:.2f}x" if on.rate and off.rate else "—"
        acc = f"{100 * on.acceptance:.0f}%" if on.acceptance is not None else "no drafts"
        lines.append(f"| {n} | {fmt(off.rate)} | {fmt(on.rate)} | {ratio} | {acc} |")
    publish("\n".join(lines), args.write, "speculative")


if __name__ == "__main__":
    main()
