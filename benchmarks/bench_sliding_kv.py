"""KV memory of one long sequence on a sliding-window model, against full attention.

    python benchmarks/bench_sliding_kv.py [--model build/gemma-3-270m-q4_k_m.gguf]
                                          [--prompt-tokens 4000] [--new-tokens 64]
                                          [--write BENCHMARKS.md]

One request (a prompt of --prompt-tokens, then --new-tokens greedy tokens), stepped by
hand so that the KV bytes the sequence holds (LLMEngine.stats: its blocks over every KV
cache group) are read after every step. Full attention would hold, at the sequence's
final length, K and V of every position in every layer; the ratio of the peak held to
that is the figure. Also printed: the peak of blocks in use in the whole pool (the same,
with a single sequence) and the time the run took.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

DEFAULT = HERE.parent / "build" / "gemma-3-270m-q4_k_m.gguf"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=DEFAULT)
    ap.add_argument("--prompt-tokens", type=int, default=4000)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=None,
                    help="prefill chunk (max_num_batched_tokens; default the engine's)")
    ap.add_argument("--write", type=Path, default=None, help="update this BENCHMARKS.md")
    args = ap.parse_args()
    if not args.model.exists():
        sys.exit(f"{args.model} not found: `make gemma` assembles the default one")

    from common import machine_line, prompt_ids, publish
    from kvloop import LLM, SamplingParams

    opts = {} if args.chunk is None else {"max_num_batched_tokens": args.chunk}
    llm = LLM(args.model, kv_cache_memory="1GiB", **opts)
    eng, c = llm.engine, llm.engine.model_config
    prompt = prompt_ids(llm.tokenizer, args.prompt_tokens)
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    eng.add_request(None, prompt, params)
    # Peaks while the prompt is prefilled (chunks: window + chunk positions per sliding
    # group) and once it decodes (window + 1).
    peak = {"prefill": 0, "decode": 0}
    peak_pool = 0
    phase = "prefill"
    while eng.has_unfinished_requests():
        outs = eng.step()
        st = eng.kv.stats()
        peak[phase] = max(peak[phase], *st.seq_kv_bytes, 0)
        peak_pool = max(peak_pool, st.num_used_blocks * st.bytes_per_block)
        if any(o.outputs and (o.outputs[0].delta_token_ids or o.outputs[0].token_ids)
               for o in outs):
            phase = "decode"  # the step that sampled the first token ended the prompt
    peak_seq = max(peak.values())
    wall = time.perf_counter() - t0
    length = len(prompt) + args.new_tokens
    full = c.num_layers * 2 * c.num_kv_heads * c.head_dim * 4 * length  # fp32 K and V
    sliding = sum(c.is_sliding(i) for i in range(c.num_layers))
    command = " ".join(["python", "benchmarks/bench_sliding_kv.py", *sys.argv[1:]])
    body = "\n".join([
        "## Sliding-window KV: one long sequence"
        + ("" if args.chunk is None else f", prefill in chunks of {args.chunk}"),
        "",
        f"`{command}` on {machine_line()}.",
        "",
        f"Model `{args.model.name}`: {c.num_layers} layers, {sliding} of them sliding "
        f"(window {c.sliding_window}), {c.num_kv_heads} KV head(s) of {c.head_dim}, fp32 "
        f"cache, block size {eng.config.block_size}. One request: {len(prompt)}-token prompt "
        f"(prefill chunks of {eng.config.max_num_batched_tokens} tokens), {args.new_tokens} "
        f"greedy tokens; run {wall:.1f} s.",
        "",
        "| figure | value |",
        "|---|---:|",
        f"| full attention on every layer, {length} positions (MB) | {full / 1e6:.1f} |",
        f"| peak KV the sequence held while prefilling (MB) | {peak['prefill'] / 1e6:.1f} |",
        f"| peak KV the sequence held while decoding (MB) | {peak['decode'] / 1e6:.1f} |",
        f"| peak KV in use in the pool (MB) | {peak_pool / 1e6:.1f} |",
        f"| peak held / full attention | {peak_seq / full:.1%} |",
        f"| held while decoding / full attention | {peak['decode'] / full:.1%} |",
    ])
    publish(body, args.write,
            "bench-sliding-kv" + ("" if args.chunk is None else f"-chunk{args.chunk}"))


if __name__ == "__main__":
    main()
