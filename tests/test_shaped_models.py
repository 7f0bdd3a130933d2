"""benchmarks/shaped_models.py --tiny end to end: the F16 files it writes have the declared
shapes and metadata, and llama.cpp's quantizer turns one into Q8_0."""

from __future__ import annotations

import sys
from pathlib import Path

import gguf
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import shaped_models as sm

T = gguf.GGMLQuantizationType


def _check(path: Path, s: sm.Shape) -> gguf.GGUFReader:
    r = gguf.GGUFReader(str(path))
    meta = {k: f.contents() for k, f in r.fields.items()
            if not k.startswith("tokenizer.ggml.") and not k.startswith("GGUF.")}
    a = s.arch
    assert meta["general.architecture"] == a
    assert meta[f"{a}.block_count"] == s.layers
    assert meta[f"{a}.embedding_length"] == s.hidden
    assert meta[f"{a}.feed_forward_length"] == s.intermediate
    assert meta[f"{a}.attention.head_count"] == s.heads
    assert meta[f"{a}.attention.head_count_kv"] == s.kv_heads
    assert meta[f"{a}.attention.key_length"] == s.head_dim
    assert meta[f"{a}.context_length"] == s.context
    assert meta[f"{a}.rope.freq_base"] == pytest.approx(s.rope_theta)
    assert meta.get(f"{a}.attention.sliding_window") == s.sliding_window
    assert len(r.fields["tokenizer.ggml.tokens"].data) == s.vocab
    assert len(r.fields["tokenizer.ggml.token_type"].data) == s.vocab
    assert meta[sm.RECORD_KEY] == sm.record(s, sm.tokenizer_file(s.tokenizer,
                                                                sm.DEFAULT_GEMMA_FILE))
    tensors = {t.name: (tuple(int(d) for d in reversed(t.shape)), t.tensor_type)
               for t in r.tensors}
    want = {name: shape for name, shape, _ in sm.tensor_specs(s)}
    assert {n: sh for n, (sh, _) in tensors.items()} == want
    assert tensors["token_embd.weight"][0] == (s.vocab, s.hidden)
    assert tensors["blk.0.attn_q.weight"][0] == (s.heads * s.head_dim, s.hidden)
    assert tensors["blk.0.attn_k.weight"][0] == (s.kv_heads * s.head_dim, s.hidden)
    assert ("blk.0.attn_q.bias" in tensors) == s.attention_bias
    assert ("rope_freqs.weight" in tensors) == (s.llama3_rope is not None)
    assert ("blk.0.attn_q_norm.weight" in tensors) == (a == "gemma3")
    assert "output.weight" not in tensors  # tied, as all three publish
    return r


def test_tiny_llama_then_q8_0(tmp_path: Path) -> None:
    """Llama-3.2-1B scaled down: its F16 file, kept on a second run (the record matches),
    then llama.cpp's Q8_0 of it."""
    s = sm.tiny(sm.SHAPES["llama-3.2-1b"])
    assert s.arch == "llama" and s.vocab == 128256 and s.llama3_rope is not None
    sm.main(["--tiny", "--models", "llama-3.2-1b", "--no-quantize", "--out", str(tmp_path)])
    f16 = tmp_path / f"{s.name}-f16.gguf"
    r = _check(f16, s)
    tokens = r.fields["tokenizer.ggml.tokens"]
    assert tokens.contents(s.vocab - 1) == f"<|pad_{s.vocab - 1}|>"
    assert r.fields["tokenizer.ggml.token_type"].contents(s.vocab - 1) == gguf.TokenType.UNUSED
    types = {t.name: t.tensor_type for t in r.tensors}
    assert types["blk.0.ffn_up.weight"] == T.F16 and types["blk.0.ffn_norm.weight"] == T.F32
    assert sm.read_record(f16) == sm.record(s, sm.tokenizer_file(s.tokenizer, Path()))
    mtime = f16.stat().st_mtime_ns
    sm.main(["--tiny", "--models", "llama-3.2-1b", "--no-quantize", "--out", str(tmp_path)])
    assert f16.stat().st_mtime_ns == mtime  # its record matches: not written again

    pytest.importorskip("llama_cpp")
    q8 = tmp_path / f"{s.name}-q8_0.gguf"
    sm.quantize(f16, q8, "Q8_0")
    r = _check(q8, s)
    types = {t.name: t.tensor_type for t in r.tensors}
    assert all(types[n] == T.Q8_0 for n, _, kind in sm.tensor_specs(s) if kind == "w")
    assert all(types[n] == T.F32 for n, _, kind in sm.tensor_specs(s) if kind != "w")
    assert sm.read_record(q8) == sm.read_record(f16)  # the quantizer kept the record


def test_tiny_qwen2(tmp_path: Path) -> None:
    """Qwen2.5-1.5B scaled down: q/k/v biases, vocabulary padded to 151,936."""
    s = sm.tiny(sm.SHAPES["qwen2.5-1.5b"])
    assert s.arch == "qwen2" and s.vocab == 151936 and s.attention_bias
    sm.main(["--tiny", "--models", "qwen2.5-1.5b", "--no-quantize", "--out", str(tmp_path)])
    _check(tmp_path / f"{s.name}-f16.gguf", s)


@pytest.mark.slow
def test_tiny_gemma3(real_gemma_path: Path, tmp_path: Path) -> None:
    """Gemma-3-1B's structure with Gemma 3 270M's tokenizer (skipped without it; ~20 s:
    262,144 tokens read twice)."""
    s = sm.tiny(sm.SHAPES["gemma-3-1b"])
    sm.write_f16(s, tmp_path / "g.gguf", real_gemma_path)
    r = gguf.GGUFReader(str(tmp_path / "g.gguf"))
    assert r.fields["gemma3.attention.sliding_window"].contents() == 16
    assert r.fields["gemma3.block_count"].contents() == 6
    assert len(r.fields["tokenizer.ggml.tokens"].data) == 262144
    names = {t.name for t in r.tensors}
    assert {"blk.5.post_ffw_norm.weight", "blk.5.attn_k_norm.weight"} <= names
