"""Random-weight GGUF models shaped like the small models people run, for benchmarks.

    python benchmarks/shaped_models.py [--tiny] [--out build/shaped] [--models NAME ...]
                                       [--no-quantize] [--verify] [--bench]

Writes Llama-3.2-1B, Qwen2.5-1.5B and Gemma-3-1B as F16 GGUF files with the published
configs' shapes (layers, widths, heads, KV heads, head_dim, vocabulary, rope and sliding
windows; the constants below, each naming its config.json), weights normal(0, 0.02) from a
seeded numpy Generator and norms 1.0, then quantizes each to Q4_K_M and Q8_0 with llama.cpp's
own quantizer (llama_cpp.llama_model_quantize), so that kvloop and llama.cpp read the same
file. Random weights cost exactly what trained ones cost to run: the same shapes, formats
and bytes read per token.

Tokenizers are copied from the GGUF metadata (every tokenizer.* key) of the nearest model
this project ships: Gemma 3 270M's (build/gemma-3-270m-q4_k_m.gguf, `make gemma`: the same
262,144 tokens) for Gemma-3-1B; SmolLM2-135M-Instruct's (the default model, 49,152 tokens)
for Llama-3.2-1B and Qwen2.5-1.5B, padded with unique UNUSED tokens `<|pad_N|>` up to the
published vocabulary (128,256 / 151,936) so that the embedding and the head have the real
shape. Each file records its shape and tokenizer under the key `kvloop.shaped_model`; a file
whose record matches is not written again. `--tiny` scales every model down (2 layers, 6
for Gemma's 5:1 pattern; width 256) with the same structure and the real vocabulary, for a
fast end-to-end test. `--verify` loads each file in llama.cpp and in kvloop and generates a
few tokens; `--bench` runs bench_all.py on each quantized file.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
RECORD_KEY = "kvloop.shaped_model"
STD = 0.02


@dataclass(frozen=True)
class Shape:
    name: str
    arch: str  # llama.cpp's architecture: the GGUF key prefix and tensor names
    source: str  # the published config these constants come from
    tokenizer: str  # "smollm2" or "gemma3-270m"
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    context: int
    rms_eps: float
    rope_theta: float
    tied: bool = True
    attention_bias: bool = False
    # Llama 3 rope scaling (rope_type "llama3"): factor, low/high freq factors, original ctx
    llama3_rope: tuple[float, float, float, int] | None = None
    sliding_window: int | None = None
    sliding_pattern: int | None = None  # every N-th layer global (Gemma 3: 6, i.e. 5:1)
    rope_local_theta: float | None = None  # rope base of the sliding layers


SHAPES = {
    # meta-llama/Llama-3.2-1B config.json: 16 layers, hidden 2048, intermediate 8192, 32 heads,
    # 8 KV heads, head_dim 64, vocab 128256, max_position_embeddings 131072, rms_norm_eps 1e-5,
    # rope_theta 500000, rope_scaling {rope_type llama3, factor 32, low_freq_factor 1,
    # high_freq_factor 4, original_max_position_embeddings 8192}, tie_word_embeddings true.
    "llama-3.2-1b": Shape(
        "llama-3.2-1b", "llama", "meta-llama/Llama-3.2-1B config.json", "smollm2",
        layers=16, hidden=2048, intermediate=8192, heads=32, kv_heads=8, head_dim=64,
        vocab=128256, context=131072, rms_eps=1e-5, rope_theta=500000.0,
        llama3_rope=(32.0, 1.0, 4.0, 8192)),
    # Qwen/Qwen2.5-1.5B config.json: 28 layers, hidden 1536, intermediate 8960, 12 heads,
    # 2 KV heads (head_dim 128), vocab 151936, max_position_embeddings 131072, rms_norm_eps
    # 1e-6, rope_theta 1000000, q/k/v biases, use_sliding_window false (no window),
    # tie_word_embeddings true.
    "qwen2.5-1.5b": Shape(
        "qwen2.5-1.5b", "qwen2", "Qwen/Qwen2.5-1.5B config.json", "smollm2",
        layers=28, hidden=1536, intermediate=8960, heads=12, kv_heads=2, head_dim=128,
        vocab=151936, context=131072, rms_eps=1e-6, rope_theta=1000000.0,
        attention_bias=True),
    # google/gemma-3-1b-pt config.json: 26 layers, hidden 1152, intermediate 6912, 4 heads,
    # 1 KV head, head_dim 256, vocab 262144, max_position_embeddings 32768, rms_norm_eps 1e-6,
    # rope_theta 1000000 (global layers), rope_local_base_freq 10000 (sliding layers),
    # sliding_window 512, sliding_window_pattern 6 (5 local : 1 global), no rope scaling,
    # QK-norm, tie_word_embeddings true. llama.cpp's gemma3 graph fixes the pattern and the
    # local base; the GGUF states the window.
    "gemma-3-1b": Shape(
        "gemma-3-1b", "gemma3", "google/gemma-3-1b-pt config.json", "gemma3-270m",
        layers=26, hidden=1152, intermediate=6912, heads=4, kv_heads=1, head_dim=256,
        vocab=262144, context=32768, rms_eps=1e-6, rope_theta=1000000.0,
        sliding_window=512, sliding_pattern=6, rope_local_theta=10000.0),
}

# --tiny: the same structure (GQA ratio, biases, rope scaling, QK-norm, a 5:1 pattern with
# a window short prompts outgrow) at width 256 (whole Q4_K super-blocks of 256) and the
# real vocabulary (the tokenizer is the real one).
TINY = {
    "llama-3.2-1b": dict(layers=2, hidden=256, intermediate=512, heads=4, kv_heads=1,
                         head_dim=64),
    "qwen2.5-1.5b": dict(layers=2, hidden=256, intermediate=512, heads=4, kv_heads=2,
                         head_dim=64),
    "gemma-3-1b": dict(layers=6, hidden=256, intermediate=512, heads=4, kv_heads=1,
                       head_dim=64, sliding_window=16),
}

QUANTS = ("Q4_K_M", "Q8_0")

SMOLLM2 = "smollm2"
GEMMA_TOKENIZER = "gemma3-270m"
DEFAULT_GEMMA_FILE = ROOT / "build" / "gemma-3-270m-q4_k_m.gguf"


def tiny(shape: Shape) -> Shape:
    return replace(shape, name=f"{shape.name}-tiny", **TINY[shape.name])  # type: ignore[arg-type]


def tokenizer_file(kind: str, gemma_file: Path) -> Path:
    if kind == SMOLLM2:
        from kvloop.loading.default_model import default_model_path

        return Path(default_model_path())
    return gemma_file


def record(shape: Shape, tok_file: Path) -> str:
    """What a file records of itself: its shape and its tokenizer's source."""
    return json.dumps({**asdict(shape), "tokenizer_file": tok_file.name}, sort_keys=True)


def read_record(path: Path) -> str | None:
    """The file's `kvloop.shaped_model` record, read from the start of its header (written
    right after general.architecture, and kept there by llama.cpp's quantizer, which copies
    the keys in order): GGUFReader would parse the whole vocabulary first (seconds)."""
    if not path.exists():
        return None
    try:
        with path.open("rb") as f:
            head = f.read(1 << 16)
        if head[:4] != b"GGUF":
            return None
        pos = 24  # magic, version (u32), tensor count and key count (u64 each)
        for _ in range(min(4, int.from_bytes(head[16:24], "little"))):
            key, pos = _gguf_string(head, pos)
            vtype = int.from_bytes(head[pos:pos + 4], "little")
            pos += 4
            if vtype != 8:  # GGUFValueType.STRING: the keys before ours are strings
                return None
            value, pos = _gguf_string(head, pos)
            if key == RECORD_KEY:
                return value
    except (OSError, ValueError, UnicodeDecodeError):  # a partial or foreign file
        return None
    return None


def _gguf_string(buf: bytes, pos: int) -> tuple[str, int]:
    n = int.from_bytes(buf[pos:pos + 8], "little")
    if pos + 8 + n > len(buf):
        raise ValueError("string past the buffer")
    return buf[pos + 8:pos + 8 + n].decode(), pos + 8 + n


def copy_tokenizer(w: Any, src: Path, vocab: int) -> int:
    """Every tokenizer.* key of `src` into the writer; the token list (and its per-token
    arrays) padded with unique UNUSED tokens up to `vocab`. Returns the tokens copied."""
    import gguf

    T = gguf.GGUFValueType
    fields = gguf.GGUFReader(str(src)).fields
    n = len(fields["tokenizer.ggml.tokens"].data)
    if n > vocab:
        raise ValueError(f"{src.name} has {n} tokens, more than the {vocab} asked for")
    pad = vocab - n
    for key, f in fields.items():
        if not key.startswith("tokenizer."):
            continue
        value = f.contents()
        if f.types[0] == T.ARRAY:
            sub = f.types[1]
            if len(value) == n and pad:  # per-token arrays: tokens, token_type, scores
                if key == "tokenizer.ggml.tokens":
                    value = value + [f"<|pad_{i}|>" for i in range(n, vocab)]
                elif key == "tokenizer.ggml.token_type":
                    value = value + [int(gguf.TokenType.UNUSED)] * pad
                elif key == "tokenizer.ggml.scores":
                    value = value + [-1000.0] * pad
                else:
                    raise ValueError(f"{src.name}: no padding rule for per-token {key}")
            w.add_key_value(key, value, T.ARRAY, sub_type=sub)
        else:
            w.add_key_value(key, value, f.types[0])
    return n


def llama3_rope_factors(shape: Shape) -> np.ndarray:
    """llama.cpp's converter (LlamaModel.generate_extra_tensors): each rope frequency's
    divisor under Llama 3 scaling, stored as rope_freqs.weight."""
    assert shape.llama3_rope is not None
    factor, low, high, old = shape.llama3_rope
    out = []
    for i in range(0, shape.head_dim, 2):
        wavelen = 2 * math.pi * shape.rope_theta ** (i / shape.head_dim)
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def tensor_specs(s: Shape) -> list[tuple[str, tuple[int, ...], str]]:
    """(llama.cpp name, numpy shape (rows, cols), kind): kind "w" random F16, "b" random F32
    bias, "norm" F32 ones, "rope" Llama 3's F32 factors. Tied heads store no output.weight."""
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    specs: list[tuple[str, tuple[int, ...], str]] = [
        ("token_embd.weight", (s.vocab, s.hidden), "w")]
    if s.llama3_rope is not None:
        specs.append(("rope_freqs.weight", (s.head_dim // 2,), "rope"))
    for i in range(s.layers):
        b = f"blk.{i}."
        specs += [(b + "attn_norm.weight", (s.hidden,), "norm"),
                  (b + "attn_q.weight", (q, s.hidden), "w"),
                  (b + "attn_k.weight", (kv, s.hidden), "w"),
                  (b + "attn_v.weight", (kv, s.hidden), "w")]
        if s.attention_bias:
            specs += [(b + "attn_q.bias", (q,), "b"), (b + "attn_k.bias", (kv,), "b"),
                      (b + "attn_v.bias", (kv,), "b")]
        if s.arch == "gemma3":  # QK-norm and the sandwich norms (stored 1 + w: HF's w = 0)
            specs += [(b + "attn_q_norm.weight", (s.head_dim,), "norm"),
                      (b + "attn_k_norm.weight", (s.head_dim,), "norm"),
                      (b + "post_attention_norm.weight", (s.hidden,), "norm"),
                      (b + "post_ffw_norm.weight", (s.hidden,), "norm")]
        specs += [(b + "attn_output.weight", (s.hidden, q), "w"),
                  (b + "ffn_norm.weight", (s.hidden,), "norm"),
                  (b + "ffn_gate.weight", (s.intermediate, s.hidden), "w"),
                  (b + "ffn_up.weight", (s.intermediate, s.hidden), "w"),
                  (b + "ffn_down.weight", (s.hidden, s.intermediate), "w")]
    specs.append(("output_norm.weight", (s.hidden,), "norm"))
    if not s.tied:
        specs.append(("output.weight", (s.vocab, s.hidden), "w"))
    return specs


def add_metadata(w: Any, s: Shape) -> None:
    """The {arch}.* keys llama.cpp's converter writes for the family (and kvloop reads)."""
    w.add_name(f"{s.name} (random weights, shaped like {s.source})")
    w.add_context_length(s.context)
    w.add_embedding_length(s.hidden)
    w.add_block_count(s.layers)
    w.add_feed_forward_length(s.intermediate)
    w.add_head_count(s.heads)
    w.add_head_count_kv(s.kv_heads)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_rope_freq_base(s.rope_theta)
    w.add_layer_norm_rms_eps(s.rms_eps)
    w.add_file_type(1)  # MOSTLY_F16
    if s.arch == "llama":
        w.add_vocab_size(s.vocab)
        w.add_rope_dimension_count(s.head_dim)
    if s.sliding_window is not None:
        w.add_sliding_window(s.sliding_window)


def write_f16(s: Shape, path: Path, tok_file: Path, seed: int = 0) -> None:
    """The F16 file, tensor by tensor: each one generated in fp32 (the embedding in slices
    of rows), converted to fp16 and written before the next is made."""
    import gguf

    tmp = path.with_suffix(".gguf.part")
    w = gguf.GGUFWriter(str(tmp), s.arch)
    w.add_string(RECORD_KEY, record(s, tok_file))  # second key: read_record looks there
    add_metadata(w, s)
    copy_tokenizer(w, tok_file, s.vocab)
    specs = tensor_specs(s)
    for name, shape, kind in specs:
        dtype = np.float16 if kind == "w" else np.float32
        w.add_tensor_info(name, shape, np.dtype(dtype), math.prod(shape) * np.dtype(dtype).itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    rope = llama3_rope_factors(s) if s.llama3_rope is not None else None
    for _name, shape, kind in specs:
        if kind == "w":
            t = np.empty(shape, dtype=np.float16)
            step = max(1, (1 << 24) // shape[1])  # 16M values of fp32 at a time
            for r in range(0, shape[0], step):
                t[r:r + step] = rng.standard_normal((min(step, shape[0] - r), shape[1]),
                                                    dtype=np.float32) * STD
        elif kind == "b":
            t = rng.standard_normal(shape, dtype=np.float32) * STD
        elif kind == "norm":
            t = np.ones(shape, dtype=np.float32)
        else:
            assert rope is not None
            t = rope
        w.write_tensor_data(t)
        del t
    w.close()
    tmp.replace(path)


def quantize(src: Path, dst: Path, qtype: str, nthread: int = 2) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{qtype}")
    params.nthread = nthread
    tmp = dst.with_suffix(".gguf.part")
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), params)
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({src.name} -> {qtype}) returned {rc}")
    tmp.replace(dst)


def make(path: Path, kept: bool, verb: str, write: Callable[[], None]) -> None:
    """Write `path` unless `kept`, saying which and how long it took."""
    if kept:
        print(f"  {path}: exists with this shape, kept", flush=True)
        return
    t0 = time.perf_counter()
    write()
    print(f"  {path}: {verb} in {time.perf_counter() - t0:.1f} s "
          f"({path.stat().st_size / 2**20:.0f} MiB)", flush=True)


def build(s: Shape, out: Path, gemma_file: Path, quants: tuple[str, ...]) -> list[Path]:
    """Write (or keep) the F16 file and its quantized copies; returns the quantized paths
    (the F16 path when `quants` is empty)."""
    tok_file = tokenizer_file(s.tokenizer, gemma_file)
    if not tok_file.exists():
        raise SystemExit(f"{s.name}: tokenizer source {tok_file} is missing (make gemma)")
    out.mkdir(parents=True, exist_ok=True)
    want = record(s, tok_file)
    f16 = out / f"{s.name}-f16.gguf"
    print(f"{s.name}: {s.source}; tokenizer copied from {tok_file.name} "
          f"(padded to {s.vocab} tokens where it has fewer)", flush=True)
    make(f16, read_record(f16) == want, "written", lambda: write_f16(s, f16, tok_file))
    paths = []
    for q in quants:
        dst = out / f"{s.name}-{q.lower()}.gguf"
        kept = read_record(dst) == want and dst.stat().st_mtime >= f16.stat().st_mtime
        make(dst, kept, "quantized", lambda dst=dst, q=q: quantize(f16, dst, q))
        paths.append(dst)
    return paths or [f16]


def verify(path: Path, n: int = 4) -> None:
    """Load the file in llama.cpp and in kvloop; generate `n` tokens with each."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(path), n_ctx=256, n_threads=2, verbose=False)
    ids = llm.tokenize(b"The capital of France is")
    out: list[int] = []
    for tok in llm.generate(ids, temp=0.0, top_k=1):  # greedy
        out.append(int(tok))
        if len(out) == n:
            break
    text = llm.detokenize(out).decode(errors="replace")
    print(f"  llama.cpp {path.name}: prompt {ids} -> {out} {text!r}", flush=True)
    del llm

    from kvloop import LLM, SamplingParams

    kv = LLM(str(path))
    res = kv.generate(["The capital of France is"],
                      SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    o = res[0].outputs[0]
    print(f"  kvloop {path.name}: -> {list(o.token_ids)} {o.text!r}", flush=True)


def bench(path: Path) -> None:
    """bench_all.py on one file: kvloop as stored beside transformers (fp32, dequantized
    from the same file: Qwen2.5-1.5B's 1.54B parameters are ~6.2 GB, ~12 GB at the
    conversion's peak, within a 24 GB machine) and llama.cpp."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_all.py"), "--model", str(path),
           "--concurrency", "8", "32", "--engines", "kvloop-gguf", "transformers", "llama.cpp",
           "--write", str(ROOT / "BENCHMARKS.md")]
    print(" ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "build" / "shaped")
    ap.add_argument("--models", nargs="+", choices=sorted(SHAPES), default=list(SHAPES))
    ap.add_argument("--tiny", action="store_true", help="every model scaled down, same structure")
    ap.add_argument("--no-quantize", action="store_true", help="write the F16 files only")
    ap.add_argument("--quants", nargs="+", choices=QUANTS, default=list(QUANTS))
    ap.add_argument("--gemma-tokenizer", type=Path, default=DEFAULT_GEMMA_FILE,
                    help="Gemma 3 270M's GGUF, the Gemma tokenizer's source (make gemma)")
    ap.add_argument("--verify", action="store_true",
                    help="load each file in llama.cpp and kvloop, generate a few tokens")
    ap.add_argument("--bench", action="store_true", help="bench_all.py on each quantized file")
    args = ap.parse_args(argv)
    quants = () if args.no_quantize else tuple(args.quants)
    for name in args.models:
        s = tiny(SHAPES[name]) if args.tiny else SHAPES[name]
        paths = build(s, args.out, args.gemma_tokenizer, quants)
        if args.verify:
            for p in paths:
                verify(p)
        if args.bench:
            for p in paths:
                bench(p)


if __name__ == "__main__":
    main()
