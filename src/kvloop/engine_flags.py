"""The engine's options as command-line flags: one definition for `kvloop generate`,
`kvloop chat` and `kvloop serve`, so every face offers the same engine (quantization and
speculation included) with the same words.

Imports nothing heavy: `kvloop --help` stays fast.
"""

from __future__ import annotations

import argparse
from typing import Any

from kvloop.config import DEFAULT_MAX_PROMPT_LOGPROBS, MAX_CHAT_TEMPLATE_CHARS, EngineConfig
from kvloop.errors import InvalidParamsError


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None, help="GGUF file or HF directory (default: SmolLM2)")
    g.add_argument("--quantization", default="auto",
                   choices=["auto", "gguf", "none", "int8", "int4"],
                   help="weights of the linear layers: 'gguf' computes a GGUF file's "
                        "quantized blocks as stored (exactly the weights they encode); "
                        "'none' dequantizes to fp32 (the reference); 'int8' / 'int4' "
                        "re-quantize. Default 'auto': 'gguf' for a quantized GGUF file, "
                        "else 'none'")
    g.add_argument("--kv-cache-memory", default="2GiB",
                   help="memory for all K and V blocks (default 2GiB)")
    # No argparse `choices`: EngineConfig refuses a bad value in the API's words (one line
    # naming kv_cache_dtype), the same for the CLI, the server and LLM(...).
    g.add_argument("--kv-cache-dtype", default="auto", metavar="DTYPE",
                   help="how the KV cache stores K and V: auto (default: fp32 beside "
                        "--quantization none, else fp16), fp16 or bf16 (half fp32's bytes: "
                        "2x the tokens in the same --kv-cache-memory), fp32 (the reference), "
                        "int8 (one fp16 scale per token per head: ~4x)")
    g.add_argument("--prefix-cache-memory", default="64MiB", metavar="SIZE",
                   help="KV memory that blocks no request holds may keep for prefix-cache "
                        "hits before they are reused instead of growing the resident pool "
                        "(default 64MiB; the pool never exceeds --kv-cache-memory)")
    g.add_argument("--threads", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=64, help="sequences per batch")
    g.add_argument("--max-num-batched-tokens", type=int, default=1024,
                   help="token budget per step (default 1024: the native step's largest "
                        "prefill chunk)")
    g.add_argument("--max-prefill-tokens-while-decoding", type=int, default=128, metavar="N",
                   help="prompt positions a step may run while streams are decoding: the "
                        "longest pause a long prompt puts between their tokens (default 128)")
    g.add_argument("--max-prompt-logprobs", type=int, default=DEFAULT_MAX_PROMPT_LOGPROBS,
                   metavar="N",
                   help="prompt tokens x top log-probs one request may ask for (echo with "
                        "logprobs, prompt_logprobs); more is refused (default "
                        f"{DEFAULT_MAX_PROMPT_LOGPROBS})")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="context length (default: the model's)")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--no-cache", action="store_true",
                   help="re-run the whole sequence every step (no KV cache)")
    g.add_argument("--speculative", default=None, metavar="METHOD",
                   help="speculative decoding: 'ngram' (prompt lookup), 'self:int4' or "
                        "'self:int8' (this model with quantized weights drafts), or "
                        "'draft:PATH' (a smaller model with the same tokenizer drafts); the "
                        "model verifies the drafts in one step (same output, fewer steps)")
    g.add_argument("--num-speculative-tokens", type=int, default=4,
                   help="draft tokens per sequence per step, at most (default 4)")
    g.add_argument("--ngram-min", type=int, default=1, help="shortest suffix looked up")
    g.add_argument("--ngram-max", type=int, default=4, help="longest suffix looked up")
    g.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a jinja2 chat template file, used instead of the model's own (base "
                        "models such as Gemma 3 270M ship none)")
    g.add_argument("--speculative-max-batch", type=int, default=8,
                   help="with more sequences decoding at once, none drafts (default 8)")
    g.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                   help="split every layer's attention heads and MLP columns over N ranks "
                        "(processes on this machine, over gloo; fp32 weights): for models "
                        "that do not fit one machine's memory, or to use its cores as N "
                        "groups (default 1: no split). Across machines: README")
    g.add_argument("--no-jump-forward", action="store_true",
                   help="structured output: sample every token, even those the grammar "
                        "forces (by default they run in one step; the output is the same)")


def add_trace_flag(p: argparse.ArgumentParser, when: str) -> None:
    """--trace FILE, the same words on `generate` and `serve` (not an engine option: it
    changes nothing the engine computes, so a resident engine's options never differ
    by it). `when`: when that command writes the file."""
    p.add_argument("--trace", default=None, metavar="FILE",
                   help="write the engine's steps and each request's phases (queued, "
                        "prefill, decode, preempted) to FILE as Chrome trace-event JSON, "
                        f"for Perfetto (ui.perfetto.dev) or chrome://tracing; {when}")


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The engine flags as EngineConfig options, checked now (before the slow model load):
    a bad one is the API's InvalidParamsError, printed as one line."""
    options: dict[str, Any] = {
        "use_cache": not args.no_cache, "kv_cache_memory": args.kv_cache_memory,
        "kv_cache_dtype": args.kv_cache_dtype, "prefix_cache_memory": args.prefix_cache_memory,
        "num_threads": args.threads, "quantization": args.quantization,
        "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_prompt_logprobs": args.max_prompt_logprobs,
        "max_prefill_tokens_while_decoding": args.max_prefill_tokens_while_decoding,
        "max_model_len": args.max_model_len, "block_size": args.block_size,
        "enable_prefix_caching": not args.no_prefix_caching,
        "speculative": args.speculative, "num_speculative_tokens": args.num_speculative_tokens,
        "ngram_min": args.ngram_min, "ngram_max": args.ngram_max,
        "speculative_max_batch": args.speculative_max_batch,
        "jump_forward": not args.no_jump_forward,
        "tensor_parallel_size": args.tensor_parallel,
    }
    if args.chat_template is not None:
        options["chat_template"] = read_chat_template(args.chat_template)
    EngineConfig(**options)
    return options


def default_engine_options() -> dict[str, Any]:
    """engine_options() of a command given no engine flag."""
    p = argparse.ArgumentParser()
    add_engine_flags(p)
    return engine_options(p.parse_args([]))


def read_chat_template(path: str) -> str:
    """The text of a --chat-template file; one InvalidParamsError line if it cannot be."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_CHAT_TEMPLATE_CHARS * 4 + 1)  # UTF-8: up to 4 bytes a char
    except OSError as e:
        raise InvalidParamsError(f"--chat-template {path}: {e.strerror or e}",
                                 param="chat_template") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidParamsError(f"--chat-template {path}: not UTF-8 text",
                                 param="chat_template") from None
