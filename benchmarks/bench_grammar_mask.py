"""Token-mask cost of the grammar engines on this CPU, for a 49k and a 262k vocabulary.

    python benchmarks/bench_grammar_mask.py [--write BENCHMARKS.md]

Structured output masks every step's logits with the tokens a grammar allows next
(kvloop.engine.structured). This measures what that costs with each maintained engine,
llguidance (kvloop's choice) and xgrammar (measured only if installed: it is not a kvloop
dependency), on the default model's tokenizer (SmolLM2, 49,152 tokens) and Gemma 3's
(262,144 tokens; `make gemma` writes its file), with a JSON schema of nested objects,
arrays, enums and numbers: the tokenizer conversion once, the schema compile once (after
one other schema, so that it is a new schema's cost, not the process's first call; no
cache), then, along the tokens of one valid JSON document, the time to fill each step's bitmask
(median and 90th percentile over the document's tokens, and the first step's).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string"},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "scores": {"type": "array", "items": {"type": "number"}},
        "address": {"type": "object", "properties": {
            "street": {"type": "string"}, "city": {"type": "string"},
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["street", "city", "zip"], "additionalProperties": False},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "role", "scores", "address", "active"],
    "additionalProperties": False,
}
DOCUMENT = json.dumps({
    "name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "role": "editor",
    "scores": [9.5, 7.25, 10], "address": {"street": "12 St James's Square",
                                           "city": "London", "zip": "12345"},
    "active": True,
})


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def walk(fill: Callable[[], None], accept: Callable[[int], Any], ids: list[int]) -> list[float]:
    """Time `fill` before each token of the document, then accept the token."""
    times = []
    for tok in ids:
        dt, _ = timed(fill)
        times.append(dt)
        ok = accept(tok)
        if ok is False:
            raise RuntimeError(f"the grammar refused token {tok}")
    return times


def bench_llguidance(backend_json: str, vocab: int, eos: list[int], ids: list[int],
                     schema: str) -> dict[str, float]:
    import llguidance as llg
    import torch
    from llguidance.torch import fill_next_token_bitmask

    t_tok, tok = timed(lambda: llg.LLTokenizer(backend_json, n_vocab=vocab, eos_token=eos))
    # One other schema first: the timed compile is a new schema's, not the process's first.
    llg.LLMatcher(tok, llg.LLMatcher.grammar_from_json_schema('{"type": "integer"}'))
    grammar = llg.LLMatcher.grammar_from_json_schema(schema)
    t_compile, m = timed(lambda: llg.LLMatcher(tok, grammar, log_level=0))
    mask = torch.empty(1, (vocab + 31) // 32, dtype=torch.int32)
    times = walk(lambda: fill_next_token_bitmask(m, mask), m.consume_token, ids)
    return summary(t_tok, t_compile, times)


def bench_xgrammar(backend_json: str, vocab: int, eos: list[int], ids: list[int],
                   schema: str) -> dict[str, float]:
    import xgrammar as xgr
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(backend_json))
    t_tok, info = timed(lambda: xgr.TokenizerInfo.from_huggingface(
        hf, vocab_size=vocab, stop_token_ids=eos))
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    compiler.compile_json_schema('{"type": "integer"}')  # as for llguidance
    t_compile, compiled = timed(lambda: compiler.compile_json_schema(schema))
    m = xgr.GrammarMatcher(compiled)
    mask = xgr.allocate_token_bitmask(1, vocab)
    times = walk(lambda: m.fill_next_token_bitmask(mask), m.accept_token, ids)
    return summary(t_tok, t_compile, times)


def summary(t_tok: float, t_compile: float, times: list[float]) -> dict[str, float]:
    rest = sorted(times[1:])
    return {"tokenizer_ms": t_tok * 1e3, "compile_ms": t_compile * 1e3,
            "first_ms": times[0] * 1e3, "median_ms": statistics.median(rest) * 1e3,
            "p90_ms": rest[int(0.9 * (len(rest) - 1))] * 1e3, "tokens": len(times)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gemma", type=Path,
                    default=HERE.parent / "build" / "gemma-3-270m-q4_k_m.gguf")
    ap.add_argument("--write", type=Path, default=None, help="update this BENCHMARKS.md")
    args = ap.parse_args()

    import importlib.util

    from common import machine_line, publish
    from kvloop.loading.loader import load_checkpoint

    models = {"SmolLM2-135M (default)": None}
    if args.gemma.exists():
        models["Gemma 3 270M"] = args.gemma
    engines: dict[str, Callable[..., dict[str, float]]] = {"llguidance": bench_llguidance}
    if importlib.util.find_spec("xgrammar") is not None:
        engines["xgrammar"] = bench_xgrammar
    schema = json.dumps(SCHEMA)
    rows = []
    for label, path in models.items():
        ckpt = load_checkpoint(path)
        tok, vocab = ckpt.tokenizer, ckpt.config.vocab_size
        ids = tok.encode(DOCUMENT, False)
        eos = list(tok.eos_token_ids)
        for name, fn in engines.items():
            r = fn(tok.backend.to_str(), vocab, eos, ids, schema)
            rows.append(f"| {label}, {vocab:,} tokens | {name} | {r['tokenizer_ms']:.0f} | "
                        f"{r['compile_ms']:.2f} | {r['first_ms']:.2f} | {r['median_ms']:.3f} | "
                        f"{r['p90_ms']:.3f} | {r['tokens']:.0f} |")
            print(rows[-1], file=sys.stderr, flush=True)
    missing = "" if "xgrammar" in engines else " xgrammar is not installed: its rows are absent."
    body = "\n".join([
        "## Grammar engines: token-mask cost per step",
        "",
        f"`python benchmarks/bench_grammar_mask.py` on {machine_line()}.{missing} One JSON "
        "schema (nested object, array, enum, pattern, numbers); the document is one valid "
        f"instance ({len(DOCUMENT)} characters) fed token by token; mask = the next-token "
        "bitmask over the whole vocabulary.",
        "",
        "| vocabulary | engine | tokenizer setup (ms) | schema compile (ms) | first mask (ms) "
        "| mask median (ms) | mask p90 (ms) | tokens |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
        *rows,
    ])
    publish(body, args.write, "bench-grammar-mask")


if __name__ == "__main__":
    main()
