"""Batch-1 prefill and decode on the default model: kvloop beside transformers `generate`,
both fp32, measured in the same run, with and without the KV cache.

    python benchmarks/bench_decode.py [--runs 3] [--write BENCHMARKS.md]

Prefill: tokens/s over a 512-token prompt (time to the first token). Decode: tokens/s over
256 generated tokens (EOS ignored), timed after the first token. Medians over --runs
(the no-cache row: one run, it takes minutes).
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import machine_line, median_of, prompt_ids, publish, timed
from kvloop import LLM, SamplingParams
from kvloop.loading.loader import default_model_path

PREFILL_TOKENS = 512
DECODE_TOKENS = 256
DECODE_PROMPT = 16


def kvloop_prefill(llm: LLM, salt: int) -> float:
    ids = prompt_ids(llm.tokenizer, PREFILL_TOKENS, salt)
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1))[0]
    assert out.metrics.ttft is not None
    return PREFILL_TOKENS / out.metrics.ttft


def kvloop_decode(llm: LLM, salt: int) -> float:
    ids = prompt_ids(llm.tokenizer, DECODE_PROMPT, salt)
    params = SamplingParams(temperature=0, max_tokens=DECODE_TOKENS, ignore_eos=True)
    out = llm.generate([ids], params)[0]
    rate = out.metrics.decode_tokens_per_s
    assert rate is not None and out.metrics.num_output_tokens == DECODE_TOKENS
    return rate


class HF:
    def __init__(self, path: Path | None = None) -> None:
        """transformers on a GGUF file (default: the default model), dequantized to fp32."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = Path(path) if path is not None else default_model_path()
        kw = {"gguf_file": path.name}
        self.model = AutoModelForCausalLM.from_pretrained(
            str(path.parent), dtype=torch.float32, **kw).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(str(path.parent), **kw)
        self.model.generation_config.eos_token_id = None  # EOS ignored, as for kvloop

    def _generate(self, ids: list[int], n: int, use_cache: bool) -> None:
        cfg = copy.deepcopy(self.model.generation_config)
        cfg.update(do_sample=False, max_new_tokens=n, min_new_tokens=n, use_cache=use_cache,
                   pad_token_id=0)
        with torch.inference_mode():
            self.model.generate(torch.tensor([ids]), generation_config=cfg,
                                attention_mask=torch.ones(1, len(ids), dtype=torch.long))

    def static_batch_throughput(self, prompts: list[list[int]], new_tokens: int) -> float:
        """Generated tokens/s for the prompts as one left-padded static batch."""
        pad = 0
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):  # left padding, as generate expects
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        cfg = copy.deepcopy(self.model.generation_config)
        cfg.update(do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                   pad_token_id=pad)
        t = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(ids, attention_mask=mask, generation_config=cfg)
        wall = time.perf_counter() - t
        assert out.shape[1] - width == new_tokens
        return new_tokens * len(prompts) / wall

    def prefill(self, salt: int, tok) -> float:
        ids = prompt_ids(tok, PREFILL_TOKENS, salt)
        return PREFILL_TOKENS / timed(lambda: self._generate(ids, 1, True))

    def decode(self, salt: int, tok, use_cache: bool = True) -> float:
        ids = prompt_ids(tok, DECODE_PROMPT, salt)
        first = timed(lambda: self._generate(ids, 1, use_cache))
        total = timed(lambda: self._generate(ids, DECODE_TOKENS, use_cache))
        return (DECODE_TOKENS - 1) / (total - first)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--write", type=Path, default=None, help="update this BENCHMARKS.md")
    args = ap.parse_args()

    llm = LLM(enable_prefix_caching=False)
    nocache = LLM(use_cache=False)
    hf = HF()
    tok = llm.tokenizer
    # Warm-up: first calls pay one-off allocation and kernel selection.
    kvloop_prefill(llm, -1)
    hf.prefill(-1, tok)

    rows = []
    t0 = time.time()
    r = args.runs
    rows.append(("prefill, 512-token prompt (tok/s)",
                 median_of(lambda i: kvloop_prefill(llm, i), r),
                 median_of(lambda i: hf.prefill(i, tok), r)))
    rows.append(("decode, 256 tokens, KV cache (tok/s)",
                 median_of(lambda i: kvloop_decode(llm, i), r),
                 median_of(lambda i: hf.decode(i, tok), r)))
    # Without a cache each step re-runs the whole sequence: minutes per run, so one run.
    rows.append(("decode, 256 tokens, no cache (tok/s, 1 run)",
                 kvloop_decode(nocache, 0), hf.decode(0, tok, use_cache=False)))
    elapsed = time.time() - t0

    lines = [
        "## Batch-1 prefill and decode, fp32 (default model)",
        "",
        f"`python benchmarks/bench_decode.py --runs {r}` on {machine_line()}; "
        f"SmolLM2-135M-Instruct (Q4_1 GGUF dequantized to fp32 by both engines); "
        f"median of {r} runs each; measured in one run ({elapsed:.0f} s).",
        "",
        "| figure | kvloop | transformers generate | kvloop / transformers |",
        "|---|---:|---:|---:|",
    ]
    for name, ours, theirs in rows:
        lines.append(f"| {name} | {ours:.1f} | {theirs:.1f} | {ours / theirs:.2f}x |")
    publish("\n".join(lines), args.write, "bench-decode")


if __name__ == "__main__":
    main()
