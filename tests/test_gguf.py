"""GGUF loading pinned against references kvloop does not share.

- dequantization of hand-built Q8_0 / Q4_0 / Q4_1 blocks against numbers worked out by hand
  from the ggml block layouts;
- every supported type (F32 ... Q6_K) against `gguf.quants.dequantize` of the same bytes,
  with the (rows, cols) shape order as the thing under test;
- the Llama Q/K row un-permutation: a tiny random HF Llama is converted here the way
  llama.cpp's converter does it, and kvloop must give the same logits and greedy ids from the
  GGUF as from the HF directory (and as transformers);
- `ModelConfig` read from the default GGUF against transformers' reading of the same file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from conftest import write_gguf
from kvloop import LLM, SamplingParams
from kvloop.config import ModelConfig
from kvloop.loading import gguf as kv_gguf
from kvloop.loading.gguf import GGUFFile, unpermute_qk
from kvloop.models import AttentionMetadata, PrefillSegment

# A config for GGUFFile.tensors(): it only reads the head counts (for Q/K, unused here).
_DUMMY_CONFIG = ModelConfig(
    architecture="llama", vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1,
    num_heads=1, num_kv_heads=1, head_dim=8, max_position_embeddings=64,
)
SMALL_KV = "16MiB"  # tiny models: a small KV cache keeps LLM() cheap


def load_tensors(path: Path) -> dict[str, torch.Tensor]:
    """kvloop's GGUF tensor stream as a dict (HF names)."""
    return dict(GGUFFile(path).tensors(_DUMMY_CONFIG))


def f16_bytes(x: float) -> bytes:
    return np.float16(x).tobytes()


def pack_nibbles(nibbles: list[int]) -> bytes:
    """ggml's 4-bit layout: byte k holds weight k (low nibble) and weight k+16 (high nibble)."""
    assert len(nibbles) == 32 and all(0 <= n < 16 for n in nibbles)
    return bytes(nibbles[k] | (nibbles[k + 16] << 4) for k in range(16))


# --- (a) hand-computed blocks -----------------------------------------------------------------
Q8_ROWS = [  # (d, 32 int8 quants) per row: one block per row, 2 rows
    (0.25, [*range(-16, 16)]),
    (-2.0, [-128, 127, *range(-60, 60, 4)]),
]
NIBBLES = [15, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14,
           1, 15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 0]
Q4_ROWS = [(0.5, -1.25, NIBBLES), (-0.125, 3.0, NIBBLES[::-1])]  # (d, m, nibbles) per row


@pytest.fixture(scope="module")
def hand_blocks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """One 2x32 tensor per type, built byte by byte, loaded through kvloop."""
    q8 = b"".join(f16_bytes(d) + np.array(q, dtype=np.int8).tobytes() for d, q in Q8_ROWS)
    q40 = b"".join(f16_bytes(d) + pack_nibbles(n) for d, _, n in Q4_ROWS)
    q41 = b"".join(f16_bytes(d) + f16_bytes(m) + pack_nibbles(n) for d, m, n in Q4_ROWS)

    def rows(raw: bytes) -> np.ndarray:
        return np.frombuffer(raw, dtype=np.uint8).reshape(2, -1).copy()

    path = write_gguf(tmp_path_factory.mktemp("hand") / "hand.gguf", [
        ("blk.0.ffn_up.weight", rows(q8), QT.Q8_0),
        ("blk.1.ffn_up.weight", rows(q40), QT.Q4_0),
        ("blk.2.ffn_up.weight", rows(q41), QT.Q4_1),
    ])
    t = load_tensors(path)
    return {"Q8_0": t["model.layers.0.mlp.up_proj.weight"],
            "Q4_0": t["model.layers.1.mlp.up_proj.weight"],
            "Q4_1": t["model.layers.2.mlp.up_proj.weight"]}


def test_q8_0_block_by_hand(hand_blocks: dict[str, torch.Tensor]) -> None:
    """Q8_0: w = d * q, one block of 32 per row, rows in file order."""
    w = hand_blocks["Q8_0"]
    assert w.shape == (2, 32) and w.dtype == torch.float32
    expected = torch.tensor([[d * q for q in qs] for d, qs in Q8_ROWS])
    assert torch.equal(w, expected)
    assert w[1, 0].item() == 256.0 and w[1, 1].item() == -254.0  # -2 * -128, -2 * 127


def test_q4_0_block_by_hand(hand_blocks: dict[str, torch.Tensor]) -> None:
    """Q4_0: w = d * (nibble - 8); weights 0..15 from low nibbles, 16..31 from high ones."""
    w = hand_blocks["Q4_0"]
    assert w.shape == (2, 32)
    expected = torch.tensor([[d * (n - 8) for n in nib] for d, _, nib in Q4_ROWS])
    assert torch.equal(w, expected)
    # byte 0 of row 0 is 0x1F: weight 0 = 0.5 * (15 - 8), weight 16 = 0.5 * (1 - 8)
    assert w[0, 0].item() == 3.5 and w[0, 16].item() == -3.5
    assert w[0, 1].item() == -4.0 and w[0, 17].item() == 3.5


def test_q4_1_block_by_hand(hand_blocks: dict[str, torch.Tensor]) -> None:
    """Q4_1: w = d * nibble + m, with d and m fp16 at the head of the block."""
    w = hand_blocks["Q4_1"]
    assert w.shape == (2, 32)
    expected = torch.tensor([[d * n + m for n in nib] for d, m, nib in Q4_ROWS])
    assert torch.equal(w, expected)
    assert w[0, 0].item() == 6.25 and w[0, 16].item() == -0.75  # 0.5*15-1.25, 0.5*1-1.25
    assert w[1, 0].item() == 3.0  # row 1: nibble 0 -> m


# --- (b) every supported type against gguf.quants, shape order included ------------------------
# Byte offsets of the fp16 scale fields in each block: random bytes there could be NaN/inf.
_FP16_FIELDS = {QT.Q8_0: (0,), QT.Q4_0: (0,), QT.Q4_1: (0, 2), QT.Q4_K: (0, 2), QT.Q6_K: (208,)}
RANDOM_TYPES = [QT.F32, QT.F16, QT.BF16, QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q4_K, QT.Q6_K]
ROWS = 3


def random_tensor(qtype: QT, rng: np.random.Generator) -> tuple[np.ndarray, QT | None]:
    """A (ROWS, cols) tensor of `qtype` with two blocks per row: what add_tensor takes."""
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    cols = 2 * block if block > 1 else 7
    if qtype == QT.F32:
        return rng.standard_normal((ROWS, cols)).astype(np.float32), None
    if qtype == QT.F16:
        return rng.standard_normal((ROWS, cols)).astype(np.float16), None
    if qtype == QT.BF16:  # the top half of float32s: always finite
        f32 = rng.standard_normal((ROWS, cols)).astype(np.float32)
        return (f32.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8), qtype
    raw = rng.integers(0, 256, size=(ROWS, cols // block, type_size), dtype=np.uint8)
    for off in _FP16_FIELDS[qtype]:
        scales = rng.uniform(-2, 2, size=(ROWS, cols // block)).astype(np.float16)
        raw[:, :, off:off + 2] = scales.view(np.uint8).reshape(ROWS, cols // block, 2)
    return raw.reshape(ROWS, -1), qtype


@pytest.fixture(scope="module")
def random_file(tmp_path_factory: pytest.TempPathFactory
                ) -> tuple[dict[QT, np.ndarray], dict[str, torch.Tensor]]:
    """One GGUF with a random tensor of every type; the bytes written and kvloop's load."""
    rng = np.random.default_rng(0)
    written: dict[QT, np.ndarray] = {}
    entries = []
    for i, qtype in enumerate(RANDOM_TYPES):
        data, raw = random_tensor(qtype, rng)
        written[qtype] = data
        entries.append((f"blk.{i}.ffn_up.weight", data, raw))
    path = write_gguf(tmp_path_factory.mktemp("rand") / "random.gguf", entries)
    return written, load_tensors(path)


@pytest.mark.parametrize("qtype", RANDOM_TYPES, ids=lambda q: q.name)
def test_dequantize_matches_gguf_reference(
    qtype: QT, random_file: tuple[dict[QT, np.ndarray], dict[str, torch.Tensor]]
) -> None:
    """kvloop's tensor == gguf.quants.dequantize(bytes) as (rows, cols), bit for bit."""
    written, loaded = random_file
    data = written[qtype]
    ref = gguf.quants.dequantize(data, qtype).astype(np.float32)  # [ROWS, cols]
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    cols = 2 * block if block > 1 else 7
    assert ref.shape == (ROWS, cols)
    assert np.isfinite(ref).all()
    w = loaded[f"model.layers.{RANDOM_TYPES.index(qtype)}.mlp.up_proj.weight"]
    assert w.dtype == torch.float32
    assert tuple(w.shape) == (ROWS, cols)  # numpy order: ggml's ne[] reversed
    assert torch.equal(w, torch.from_numpy(ref))


def test_unsupported_type_is_refused_by_name(tmp_path: Path) -> None:
    """A tensor in a type kvloop does not dequantize is a ModelLoadError naming the type."""
    from kvloop.errors import ModelLoadError

    raw = np.zeros((2, gguf.GGML_QUANT_SIZES[QT.IQ2_XXS][1]), dtype=np.uint8)
    path = write_gguf(tmp_path / "iq2.gguf", [("blk.0.ffn_up.weight", raw, QT.IQ2_XXS)])
    with pytest.raises(ModelLoadError, match="IQ2_XXS"):
        load_tensors(path)


# --- (c) Q/K permutation: convert a tiny HF Llama to GGUF as llama.cpp does ---------------------
def hf_to_gguf_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute (HF rotate-half -> interleaved)."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


_GGUF_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def convert_hf_llama(hf_dir: Path, out: Path) -> Path:
    """A Llama HF directory -> GGUF: llama.* metadata, GGUF tensor names, permuted Q/K rows,
    and the byte-level BPE tokenizer as tokenizer.ggml.* (model gpt2)."""
    from safetensors.numpy import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    n_head, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hidden = cfg["hidden_size"]
    theta = cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"]
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(hidden)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_rope_freq_base(float(theta))
    w.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    w.add_rope_dimension_count(hidden // n_head)
    w.add_vocab_size(cfg["vocab_size"])

    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    vocab: dict[str, int] = tok["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    assert len(tokens) == cfg["vocab_size"]
    special = {a["id"] for a in tok["added_tokens"] if a["special"]}
    types = [gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL
             for i in range(len(tokens))]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    tok_cfg = json.loads((hf_dir / "tokenizer_config.json").read_text())
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(vocab[tok_cfg["bos_token"]])
    w.add_eos_token_id(vocab[tok_cfg["eos_token"]])
    w.add_add_bos_token(bool(tok_cfg["add_bos_token"]))
    w.add_chat_template(tok_cfg["chat_template"])

    sd = load_file(str(hf_dir / "model.safetensors"))
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    for i in range(cfg["num_hidden_layers"]):
        for hf, gg in _GGUF_LAYER.items():
            t = sd[f"model.layers.{i}.{hf}"]
            if hf == "self_attn.q_proj.weight":
                t = hf_to_gguf_permute(t, n_head)
            elif hf == "self_attn.k_proj.weight":
                t = hf_to_gguf_permute(t, n_kv)
            w.add_tensor(f"blk.{i}.{gg}", np.ascontiguousarray(t))
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    if "lm_head.weight" in sd:
        w.add_tensor("output.weight", sd["lm_head.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def kv_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    """kvloop's model on a whole sequence, no cache: logits at every position. [T, V]"""
    model = llm.engine.model
    with torch.inference_mode():
        meta = AttentionMetadata(prefills=[PrefillSegment(0, len(ids))])
        return model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids)), meta))


@pytest.fixture(scope="module")
def tiny_gguf(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return convert_hf_llama(tiny_model_dir, tmp_path_factory.mktemp("conv") / "tiny.gguf")


@pytest.fixture(scope="module")
def tiny_llms(tiny_model_dir: Path, tiny_gguf: Path) -> tuple[LLM, LLM]:
    """kvloop on the HF directory and on its GGUF conversion."""
    return (LLM(tiny_model_dir, kv_cache_memory=SMALL_KV),
            LLM(tiny_gguf, kv_cache_memory=SMALL_KV))


@pytest.fixture(scope="module")
def tiny_hf_model(tiny_model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


PROBE_IDS = [0, 57, 203, 18, 111, 250, 9, 77, 300, 42, 5, 160]


def hf_logits(model: Any, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float()


def test_permute_roundtrip() -> None:
    """unpermute_qk inverts the converter's permute for Q (n_head) and K (n_kv) shapes."""
    rng = np.random.default_rng(1)
    for shape, heads in (((64, 64), 4), ((32, 64), 2), ((64,), 4), ((576, 576), 9)):
        w = rng.standard_normal(shape).astype(np.float32)
        permuted = hf_to_gguf_permute(w, heads)
        assert not np.array_equal(permuted, w)
        assert np.array_equal(unpermute_qk(permuted, heads), w)


def test_converted_config_matches_hf_dir(tiny_llms: tuple[LLM, LLM]) -> None:
    """The GGUF metadata written by the converter reads back as the HF directory's config."""
    hf, gg = tiny_llms
    a, b = hf.engine.model_config, gg.engine.model_config
    for f in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
              "num_kv_heads", "head_dim", "max_position_embeddings", "rope_theta",
              "tie_word_embeddings", "bos_token_id", "eos_token_ids"):
        assert getattr(a, f) == getattr(b, f), f
    assert a.rms_norm_eps == pytest.approx(b.rms_norm_eps)


def test_gguf_logits_equal_hf_dir_and_transformers(tiny_llms: tuple[LLM, LLM],
                                                   tiny_hf_model: Any) -> None:
    """Same weights, two formats: logits at every position agree (Q/K un-permuted right)."""
    hf, gg = tiny_llms
    a, b = kv_logits(hf, PROBE_IDS), kv_logits(gg, PROBE_IDS)
    oracle = hf_logits(tiny_hf_model, PROBE_IDS)
    assert (b - a).abs().max().item() < 1e-5
    assert (b - oracle).abs().max().item() < 1e-4


def test_gguf_greedy_ids_equal_hf_dir(tiny_llms: tuple[LLM, LLM], tiny_hf_model: Any) -> None:
    """Greedy decode from the GGUF gives the HF directory's ids and transformers' argmax chain,
    from token ids and from text (the gpt2 tokenizer metadata encodes like tokenizer.json)."""
    hf, gg = tiny_llms
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    text = "The quick brown fox"
    assert gg.tokenizer.encode(text) == hf.tokenizer.encode(text)
    outs_hf = hf.generate([PROBE_IDS, text], params)
    outs_gg = gg.generate([PROBE_IDS, text], params)
    for o_hf, o_gg in zip(outs_hf, outs_gg, strict=True):
        assert o_gg.outputs[0].token_ids == o_hf.outputs[0].token_ids
        assert len(o_gg.outputs[0].token_ids) == 12
    seq = list(PROBE_IDS)
    for _ in range(12):  # transformers, argmax over a full forward each step
        seq.append(int(hf_logits(tiny_hf_model, seq)[-1].argmax()))
    assert outs_gg[0].outputs[0].token_ids == seq[len(PROBE_IDS):]


def test_skipping_unpermute_changes_logits(
    tiny_gguf: Path, tiny_hf_model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the un-permutation the GGUF model differs from transformers: the logit test
    above can fail, so its agreement means the inverse is right."""
    monkeypatch.setattr(kv_gguf, "unpermute_qk", lambda w, n_heads: w)
    wrong = LLM(tiny_gguf, kv_cache_memory=SMALL_KV)
    diff = (kv_logits(wrong, PROBE_IDS) - hf_logits(tiny_hf_model, PROBE_IDS)).abs()
    assert diff[0].max().item() < 1e-4  # position 0: rope is the identity, order is moot
    assert diff.max().item() > 1e-2


# --- (d) the default model's config ------------------------------------------------------------
@pytest.mark.slow
def test_default_gguf_config_matches_transformers(default_gguf: Path) -> None:
    """ModelConfig from the SmolLM2 GGUF equals transformers' reading of the same file."""
    from transformers import AutoConfig

    c = GGUFFile(default_gguf).config()
    hf = AutoConfig.from_pretrained(default_gguf.parent, gguf_file=default_gguf.name)
    theta = getattr(hf, "rope_theta", None) or hf.rope_parameters["rope_theta"]
    assert (c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads) == (576, 30, 9, 3)
    assert (c.rope_theta, c.tie_word_embeddings, c.vocab_size) == (100000.0, True, 49152)
    assert c.hidden_size == hf.hidden_size
    assert c.num_layers == hf.num_hidden_layers
    assert c.num_heads == hf.num_attention_heads
    assert c.num_kv_heads == hf.num_key_value_heads
    assert c.head_dim == hf.head_dim == 64
    assert c.intermediate_size == hf.intermediate_size
    assert c.max_position_embeddings == hf.max_position_embeddings
    assert c.rope_theta == theta
    assert c.rms_norm_eps == pytest.approx(hf.rms_norm_eps)
    assert c.tie_word_embeddings == hf.tie_word_embeddings
    assert c.vocab_size == hf.vocab_size
    assert c.bos_token_id == hf.bos_token_id
    assert hf.eos_token_id in c.eos_token_ids
    assert c.rope_scaling is None and not c.attention_bias

