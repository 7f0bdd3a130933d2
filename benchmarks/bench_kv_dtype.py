"""KV cache dtypes (--kv-cache-dtype) on the default model: how many long sequences a fixed
KV budget holds, decode speed at long context, and quality against the fp32 cache.

    python benchmarks/bench_kv_dtype.py [--model PATH] [--kv-budget 256MiB]
                                        [--seq-tokens 2048] [--context 2048] [--batch 8]
                                        [--new-tokens 32] [--dtypes fp32 bf16 fp16 int8]
                                        [--quick] [--write BENCHMARKS.md]

Per KV dtype:
- bytes per token (K and V of one position over every layer, int8 scales included) and
  the most --seq-tokens sequences that fit --kv-budget, from the engine's own pool (its
  num_blocks less the admission watermark, over the blocks one such sequence holds);
- decode tokens/s with one sequence and with --batch sequences, each --context tokens of
  prompt, then --new-tokens greedy tokens (weights as --quantization; sequences over the
  median time per output token of the requests, median of --runs runs: a batch's steps
  produce one token per sequence);
- quality with fp32 weights, against the same model with the fp32 cache: how many of
  quant_quality.py's 8 chat prompts keep all of their first 32 greedy tokens, the median
  and least index of the first token that differs, and over quant_quality's fixed
  256-token text, one native decode step per position (the cache filled as it goes), the
  mean |logit - fp32-cache logit| and the perplexity.

--quick shrinks every size (a 32 MiB budget, 256-token sequences, 2 prompts x 8 tokens,
a 64-token text) to check that the script runs end to end; its figures mean nothing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import TEXT, machine_line, prompt_ids, publish
from kvloop import LLM, SamplingParams
from kvloop.config import KV_CACHE_DTYPES, MAX_NUM_SEQS, parse_size
from kvloop.kv_cache import blocks_for_sequence
from quant_quality import AGREE_TOKENS, PROMPTS, decode_logits, perplexity


@dataclass
class Row:
    dtype: str
    bytes_per_token: int = 0
    blocks: int = 0
    tokens: int = 0
    concurrent: int = 0
    tps_one: float = 0.0
    tps_batch: float = 0.0
    agree_full: int = 0
    first_diff: list[int] = field(default_factory=list)
    logit_err: float = 0.0
    ppl: float = 0.0


def capacity(args: argparse.Namespace, dtype: str, row: Row) -> None:
    """The pool the engine sizes for --kv-budget, and how many --seq-tokens sequences it
    admits at once (max_num_seqs raised so that it is not the limit)."""
    llm = LLM(args.model, quantization=args.quantization, kv_cache_memory=args.kv_budget,
              kv_cache_dtype=dtype, max_num_seqs=MAX_NUM_SEQS)
    eng = llm.engine
    per_seq = blocks_for_sequence(args.seq_tokens, eng.config.block_size,
                                  [g.window for g in eng.kv_groups],
                                  eng.config.max_num_batched_tokens)
    row.bytes_per_token = eng.kv_bytes_per_token
    row.blocks = eng.num_blocks
    row.tokens = eng.num_blocks // len(eng.kv_groups) * eng.config.block_size
    row.concurrent = (eng.num_blocks - eng.kv.watermark_blocks) // per_seq


def decode_speed(args: argparse.Namespace, dtype: str, row: Row) -> None:
    need = args.batch * (args.context + args.new_tokens + 64)  # tokens the runs hold
    llm = LLM(args.model, quantization=args.quantization, kv_cache_dtype=dtype,
              kv_cache_memory=int(need * row.bytes_per_token * 1.25) + 2**24)
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    for n, attr in ((1, "tps_one"), (args.batch, "tps_batch")):
        # Warm-up at this batch size (first-call costs), then salted prompts: nothing
        # shared, no prefix-cache help.
        llm.generate([prompt_ids(llm.tokenizer, 64, salt=900 + i) for i in range(n)], params)
        tpots = []
        for run in range(args.runs):
            prompts = [prompt_ids(llm.tokenizer, args.context, salt=1000 * run + 100 * n + i)
                       for i in range(n)]
            outs = llm.generate(prompts, params)
            tpots.append(statistics.median(o.metrics.tpot or float("nan") for o in outs))
        setattr(row, attr, n / statistics.median(tpots))


def quality(args: argparse.Namespace, dtype: str, row: Row, ref: Row | None,
            ref_out: dict) -> None:
    """Against the fp32 cache (ref_out, filled by the fp32 row, which runs first)."""
    llm = LLM(args.model, quantization="none", kv_cache_dtype=dtype)
    chats = [llm.tokenizer.encode_chat([{"role": "user", "content": p}])
             for p in PROMPTS[: args.prompts]]
    greedy = [o.outputs[0].token_ids for o in llm.generate(chats, SamplingParams(
        temperature=0, max_tokens=args.agree_tokens, ignore_eos=True))]
    text = llm.tokenizer.encode(TEXT * 4, add_special_tokens=False)[: args.text_tokens]
    logits = decode_logits(llm, text)  # [T, V], one native decode step per position
    row.ppl = perplexity(logits, text)
    if ref is None:
        ref_out["greedy"], ref_out["logits"] = greedy, logits
    row.first_diff = [next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y),
                           len(a)) for a, b in zip(greedy, ref_out["greedy"], strict=True)]
    row.agree_full = sum(n == args.agree_tokens for n in row.first_diff)
    row.logit_err = float((logits - ref_out["logits"]).abs().mean())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF file or HF directory (default: SmolLM2)")
    ap.add_argument("--quantization", default="auto", help="weights of the speed runs")
    ap.add_argument("--kv-budget", default="256MiB")
    ap.add_argument("--seq-tokens", type=int, default=2048)
    ap.add_argument("--context", type=int, default=2048, help="prompt tokens, speed runs")
    ap.add_argument("--batch", type=int, default=8, help="sequences of the batched speed run")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--runs", type=int, default=3, help="speed runs per size (median)")
    ap.add_argument("--dtypes", nargs="+", default=list(KV_CACHE_DTYPES),
                    choices=list(KV_CACHE_DTYPES))
    ap.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run")
    ap.add_argument("--write", type=Path, default=None, help="update this BENCHMARKS.md")
    args = ap.parse_args()
    args.prompts, args.agree_tokens, args.text_tokens = len(PROMPTS), AGREE_TOKENS, 256
    if args.quick:
        args.kv_budget, args.seq_tokens, args.context = "32MiB", 256, 256
        args.batch, args.new_tokens, args.runs = 2, 8, 1
        args.prompts, args.agree_tokens, args.text_tokens = 2, 8, 64
    dtypes = ["fp32", *[d for d in args.dtypes if d != "fp32"]]  # the reference first

    rows: list[Row] = []
    ref_out: dict = {}
    for dtype in dtypes:
        row = Row(dtype)
        capacity(args, dtype, row)
        decode_speed(args, dtype, row)
        quality(args, dtype, row, rows[0] if rows else None, ref_out)
        rows.append(row)
        print(row, file=sys.stderr, flush=True)

    base = rows[0]
    command = " ".join(["python", "benchmarks/bench_kv_dtype.py", *sys.argv[1:]])
    budget_mib = parse_size(args.kv_budget) / 2**20
    n, k = args.prompts, args.agree_tokens
    lines = [
        "## KV cache dtypes: capacity, long-context decode, quality against fp32"
        + (" (--quick: a smoke run, not figures)" if args.quick else ""),
        "",
        f"`{command}` on {machine_line()}.",
        "",
        f"Default model unless `--model`. Capacity: the engine's own pool for a "
        f"{budget_mib:g} MiB KV budget (`kv_cache_memory`), over the blocks one "
        f"{args.seq_tokens}-token sequence holds. Decode: {args.context}-token prompts, "
        f"{args.new_tokens} greedy tokens, weights `{args.quantization}`; tokens/s = "
        f"sequences / median time per output token (median of {args.runs}). Quality: "
        f"fp32 weights against the same model with the fp32 cache; greedy over {n} of "
        f"quant_quality.py's chat prompts x {k} tokens, and its fixed "
        f"{args.text_tokens}-token text one native decode step per position (logits and "
        f"perplexity). int8: one fp16 scale per token per head, keys stored "
        f"Hadamard-rotated (kvloop/quant/kv.py).",
        "",
        f"| KV dtype | bytes / token | blocks (tokens) in {budget_mib:g} MiB | concurrent "
        f"{args.seq_tokens}-token sequences | decode tok/s, 1 x {args.context} | decode "
        f"tok/s, {args.batch} x {args.context} | prompts with all {k} greedy tokens = fp32 "
        f"(of {n}) | first differing token (median / min) | mean abs logit diff "
        f"| perplexity |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        diff = sorted(r.first_diff)
        lines.append(
            f"| {r.dtype} | {r.bytes_per_token:,} | {r.blocks:,} ({r.tokens:,}) | {r.concurrent:,} "
            f"({r.concurrent / max(base.concurrent, 1):.2f}x) | {r.tps_one:.1f} "
            f"({r.tps_one / base.tps_one:.2f}x) | {r.tps_batch:.1f} "
            f"({r.tps_batch / base.tps_batch:.2f}x) | {r.agree_full} | "
            f"{diff[len(diff) // 2]} / {diff[0]} | {r.logit_err:.4f} | {r.ppl:.3f} |")
    publish("\n".join(lines), args.write, "bench-kv-dtype" + ("-quick" if args.quick else ""))


if __name__ == "__main__":
    main()
