"""Each model family's distinguishing feature, shown to matter.

tests/test_model_parity.py runs one tiny random model per family (conftest.write_tiny_*)
against transformers' greedy decoding. Here, for each family, the feature that sets it
apart is switched off in kvloop's model (or its config) and the logits must then leave
transformers' by far more than the parity tolerance: the agreement there is the feature
computed right, not a feature that never mattered. Also: which families the native decode
step runs (and which it must decline), the config mapping of each, softcapped attention
against a hand-written reference, and the error for an unsupported architecture.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from conftest import add_bpe_tokenizer, require_native_kernels
from kvloop import LLM, SamplingParams
from kvloop.errors import ModelLoadError
from kvloop.loading.loader import Checkpoint, load_checkpoint
from kvloop.models import AttentionMetadata, PrefillSegment, create_model
from kvloop.models.attention import softcapped_sdpa
from kvloop.models.llama import LlamaForCausalLM
from kvloop.models.registry import ARCHITECTURES
from test_model_parity import TINY_FAMILIES, compare_greedy, hf_greedy

KV = "64MiB"
PROMPT_LEN = 130  # past every tiny model's 16-token window


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {name: write(root / name) for name, write in TINY_FAMILIES.items()}


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    g = torch.Generator().manual_seed(3)
    return torch.randint(2, 320, (PROMPT_LEN,), generator=g).tolist()


def hf_model(path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def full_logits(model: Any, ids: list[int]) -> torch.Tensor:  # [T, V]
    """kvloop's model on a whole sequence, no cache."""
    with torch.inference_mode():
        meta = AttentionMetadata(prefills=[PrefillSegment(0, len(ids))])
        return model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids)), meta))


def hf_logits(model: Any, ids: list[int]) -> torch.Tensor:  # [T, V]
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float()


def built(ck: Checkpoint, make: Callable[[Any], Any] = create_model, **config: Any) -> Any:
    """The checkpoint's model with some config fields replaced, its weights loaded."""
    model = make(replace(ck.config, **config))
    model.load_weights(ck.weights())
    return model


def _zero_qkv_bias(model: Any) -> None:
    for layer in model.layers:
        layer.self_attn.qkv_proj.bias.zero_()


def _swap_gate_up(model: Any) -> None:
    """What reading Phi-3's fused gate_up_proj as [up; gate] would compute."""
    for layer in model.layers:
        w = layer.mlp.gate_up_proj.weight
        w.copy_(torch.cat(w.chunk(2)[::-1]))


# family -> (what is switched off, how: config fields, or a change to the loaded model, or
# another model class). Every entry must break the agreement with transformers.
KNOCKOUTS: dict[str, list[tuple[str, dict[str, Any]]]] = {
    "llama3": [("rope scaling", {"config": {"rope_scaling": None}})],
    "qwen2": [("q/k/v biases", {"edit": _zero_qkv_bias})],
    "qwen3": [("QK-norm", {"make": LlamaForCausalLM})],
    "mistral": [("sliding window", {"config": {"sliding_window": None}})],
    "phi3": [("fused gate/up order", {"edit": _swap_gate_up})],
    "gemma2": [("attention softcapping", {"config": {"attn_logit_softcapping": None}}),
               ("final softcapping", {"config": {"final_logit_softcapping": None}}),
               ("sliding window", {"config": {"sliding_window": None}}),
               ("query_pre_attn_scalar", {"config": {"query_pre_attn_scalar": 32.0}})],
}
CASES = [(fam, what, how) for fam, items in KNOCKOUTS.items() for what, how in items]


@pytest.mark.parametrize(("family", "what", "how"), CASES,
                         ids=[f"{f}-{w.replace(' ', '_')}" for f, w, _ in CASES])
def test_distinguishing_feature_matters(family: str, what: str, how: dict[str, Any],
                                        family_dirs: dict[str, Path],
                                        prompt: list[int]) -> None:
    path = family_dirs[family]
    ck = load_checkpoint(path)
    ref = hf_logits(hf_model(path), prompt)
    # The model as loaded agrees with transformers ...
    assert (full_logits(built(ck), prompt) - ref).abs().max().item() < 1e-4
    # ... and without the feature it does not.
    model = built(ck, how.get("make", create_model), **how.get("config", {}))
    if "edit" in how:
        with torch.no_grad():
            how["edit"](model)
    assert (full_logits(model, prompt) - ref).abs().max().item() > 1e-2, what


def test_every_family_is_registered_and_written() -> None:
    assert set(TINY_FAMILIES) - {"llama3"} <= set(ARCHITECTURES)
    assert set(KNOCKOUTS) | {"llama", "gemma3"} == set(TINY_FAMILIES)


def test_config_mapping(family_dirs: dict[str, Path]) -> None:
    """What each family's config.json turns into."""
    c = {name: load_checkpoint(d).config for name, d in family_dirs.items()}
    assert c["llama3"].rope_scaling is not None
    assert c["llama3"].rope_scaling["rope_type"] == "llama3"
    assert c["qwen2"].attention_bias and c["qwen2"].sliding_window is None
    assert c["qwen3"].head_dim == 32 and not c["qwen3"].attention_bias
    assert c["mistral"].sliding_window == 16
    assert all(c["mistral"].is_sliding(i) for i in range(2))
    assert c["phi3"].architecture == "phi3" and c["phi3"].sliding_window is None
    g2 = c["gemma2"]
    assert g2.layer_types == ("sliding_attention", "full_attention") * 2
    assert (g2.attn_logit_softcapping, g2.final_logit_softcapping) == (3.0, 5.0)
    assert (g2.query_pre_attn_scalar, g2.sliding_window, g2.head_dim) == (24.0, 16, 32)
    assert g2.tie_word_embeddings and g2.hidden_act == "gelu_pytorch_tanh"


@pytest.mark.parametrize("family", sorted(TINY_FAMILIES))
def test_native_step_runs_every_family(family: str, family_dirs: dict[str, Path]) -> None:
    """The C++ decode step computes every family's layers, windows included (the registry
    side: test_native_families.test_every_registered_family_runs_natively)."""
    require_native_kernels()
    llm = LLM(family_dirs[family], kv_cache_memory=KV)
    assert llm.engine.runner.decoder is not None


def test_native_step_takes_mistral_whose_window_never_bites(tmp_path: Path) -> None:
    """A window as long as the context is full attention: the native step may run it."""
    require_native_kernels()
    d = TINY_FAMILIES["mistral"](tmp_path / "m", sliding_window=4096,
                                 max_position_embeddings=4096)
    assert LLM(d, kv_cache_memory=KV).engine.runner.decoder is not None


@pytest.mark.parametrize("family", ["mistral", "qwen3", "gemma2"])
@pytest.mark.parametrize("engine", [
    {"use_kernels": False},  # gather + SDPA everywhere
    {"use_cache": False},  # recompute: every step prefills the whole sequence
    {"max_num_batched_tokens": 24, "enable_prefix_caching": True},  # chunks, cached prefix
], ids=["no-kernels", "no-cache", "chunked-prefix"])
def test_module_path_families_on_every_engine_path(family: str, engine: dict[str, Any],
                                                   family_dirs: dict[str, Path]) -> None:
    """Windows, QK-norm and softcapping on the other engine paths: greedy ids
    equal transformers' (two rounds: the second reuses the cached prefix blocks). The
    prompts have one length: see test_decode_padding_reads_only_written_slots."""
    path = family_dirs[family]
    hf = hf_model(path)
    g = torch.Generator().manual_seed(4)
    prefix = torch.randint(2, 320, (40,), generator=g).tolist()
    prompts = [prefix + torch.randint(2, 320, (n,), generator=g).tolist() for n in (20, 20)]
    refs = [hf_greedy(hf, ids, 24) for ids in prompts]
    llm = LLM(path, kv_cache_memory=KV, **engine)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for _ in range(2):
        outs = llm.generate(prompts, params)
        for out, (want, logits) in zip(outs, refs, strict=True):
            assert compare_greedy(out.outputs[0].token_ids, want, logits) == len(want)


@pytest.mark.parametrize(("family", "mode"), [
    ("qwen3", "int8"), ("phi3", "int8"), ("phi3", "int4"), ("gemma2", "int8")])
def test_quantization_pass_swaps_each_family(family: str, mode: str,
                                             family_dirs: dict[str, Path],
                                             prompt: list[int]) -> None:
    """The quantization pass finds every family's fused layers (Phi-3's int4 codes come
    from its fp32 weights: its checkpoint has no separate q/k/v to take 4-bit blocks from).
    Close to fp32, not equal: random weights quantize worse than trained ones, int4 much
    worse (the tiny Llama's int4 logits move by ~40% of their range too)."""
    path = family_dirs[family]
    ref = full_logits(LLM(path, kv_cache_memory=KV).engine.model, prompt)
    llm = LLM(path, kv_cache_memory=KV, quantization=mode)
    assert not any(type(m).__name__ == "Linear" for m in llm.engine.model.modules())
    err = (full_logits(llm.engine.model, prompt) - ref).abs().max().item()
    assert 0 < err < (0.15 if mode == "int8" else 0.8) * ref.abs().max().item()
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    assert len(llm.generate([prompt[:20]], params)[0].outputs[0].token_ids) == 8


def test_decode_padding_reads_only_written_slots(tiny_model_dir: Path) -> None:
    """The gather decode path (no kernels) with contexts of two lengths, over a cache whose
    unwritten slots hold NaN (as reused memory may): the same ids as over a clean cache."""
    prompts = [list(range(2, 12)), list(range(2, 40))]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    clean = [o.outputs[0].token_ids for o in LLM(
        tiny_model_dir, kv_cache_memory=KV, use_kernels=False).generate(prompts, params)]
    llm = LLM(tiny_model_dir, kv_cache_memory=KV, use_kernels=False)
    bs = llm.engine.runner.block_size
    for cache in llm.engine.runner.kv_caches or []:
        cache.data[:, :, bs:] = float("nan")  # block 0 stays zeroed, as the runner leaves it
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == clean


@pytest.mark.parametrize("mask_kind", ["causal", "bool", "additive"])
def test_softcapped_sdpa_matches_hand_reference(mask_kind: str) -> None:
    """scale, cap (cap * tanh(s / cap)), mask, softmax, as HF's eager Gemma 2 attention;
    grouped-query heads share their K/V head."""
    torch.manual_seed(0)
    B, H, Hkv, L, S, D, cap, scale = 2, 4, 2, 5, 5, 8, 2.0, 0.7
    q, k, v = torch.randn(B, H, L, D) * 3, torch.randn(B, Hkv, S, D), torch.randn(B, Hkv, S, D)
    seen = torch.rand(L, S) > 0.3
    seen[:, 0] = True  # every query sees something
    kw: dict[str, Any] = {"causal": {"is_causal": True}, "bool": {"attn_mask": seen},
                          "additive": {"attn_mask": torch.zeros(L, S).masked_fill(
                              ~seen, float("-inf"))}}[mask_kind]
    allowed = torch.ones(L, S, dtype=torch.bool).tril() if mask_kind == "causal" else seen
    out = softcapped_sdpa(q, k, v, scale=scale, softcap=cap, **kw)
    for b in range(B):
        for h in range(H):
            s = q[b, h] @ k[b, h // 2].T * scale  # [L, S]
            s = cap * torch.tanh(s / cap)
            s = s.masked_fill(~allowed, float("-inf"))
            torch.testing.assert_close(out[b, h], s.softmax(-1) @ v[b, h // 2])
    # The cap bites here: plain attention differs.
    plain = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), scale=scale,
        attn_mask=allowed)
    assert (plain - out).abs().max().item() > 1e-2


def _edit_config(d: Path, **changes: Any) -> None:
    cfg = json.loads((d / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (d / "config.json").write_text(json.dumps(cfg))


def test_qwen_use_sliding_window_marks_the_upper_layers(tmp_path: Path) -> None:
    d = TINY_FAMILIES["qwen2"](tmp_path / "q", num_hidden_layers=3)
    _edit_config(d, use_sliding_window=True, sliding_window=8, max_window_layers=1,
                 layer_types=None)
    c = load_checkpoint(d).config
    assert c.sliding_window == 8
    assert c.layer_types == ("full_attention", "sliding_attention", "sliding_attention")


@pytest.mark.parametrize(("family", "changes", "message"), [
    ("phi3", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                  "partial_rotary_factor": 0.75}}, "partial_rotary_factor"),
    ("phi3", {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4,
                                  "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
                                  "original_max_position_embeddings": 64}}, "longrope"),
    ("llama", {"hidden_act": "gelu"}, "hidden_act"),
    ("qwen3", {"hidden_act": "relu"}, "hidden_act"),
    ("gemma2", {"hidden_activation": "gelu"}, "hidden_activation"),
    ("gemma2", {"layer_types": ["sliding_attention"]}, "layer_types"),
], ids=["phi3-partial-rotary", "phi3-longrope", "llama-gelu", "qwen3-relu", "gemma2-gelu",
        "gemma2-layer-types"])
def test_what_a_family_cannot_run_is_refused(family: str, changes: dict[str, Any],
                                             message: str, tmp_path: Path) -> None:
    d = TINY_FAMILIES[family](tmp_path / family)
    _edit_config(d, **changes)
    with pytest.raises(ModelLoadError, match=message):
        load_checkpoint(d)


def test_unsupported_architecture_names_it_and_lists_the_families(tmp_path: Path) -> None:
    d = TINY_FAMILIES["llama"](tmp_path / "m")
    _edit_config(d, model_type="falcon")
    with pytest.raises(ModelLoadError) as e:
        load_checkpoint(d)
    msg = str(e.value)
    assert "unsupported architecture 'falcon'" in msg
    for name in ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3"):
        assert repr(name) in msg


# --- GGUF: each family converted as llama.cpp's convert_hf_to_gguf.py writes it --------------
_LLAMA_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
GGUF_LAYER_NAMES: dict[str, dict[str, str]] = {
    "llama": _LLAMA_LAYER,
    "qwen2": _LLAMA_LAYER,
    "qwen3": _LLAMA_LAYER | {"self_attn.q_norm.weight": "attn_q_norm.weight",
                             "self_attn.k_norm.weight": "attn_k_norm.weight"},
    "phi3": {"input_layernorm.weight": "attn_norm.weight",
             "post_attention_layernorm.weight": "ffn_norm.weight",
             "self_attn.qkv_proj.weight": "attn_qkv.weight",
             "self_attn.o_proj.weight": "attn_output.weight",
             "mlp.gate_up_proj.weight": "ffn_up.weight",  # [gate; up], as HF stores it
             "mlp.down_proj.weight": "ffn_down.weight"},
    "gemma2": {k: v for k, v in _LLAMA_LAYER.items() if "bias" not in k} | {
        "post_attention_layernorm.weight": "post_attention_norm.weight",
        "pre_feedforward_layernorm.weight": "ffn_norm.weight",
        "post_feedforward_layernorm.weight": "post_ffw_norm.weight"},
}
GGUF_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight",
               "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}


def llama3_rope_factors(cfg: dict[str, Any], head_dim: int) -> np.ndarray:
    """llama.cpp's converter (LlamaModel.generate_extra_tensors): the divisor of each rope
    frequency under Llama 3 scaling, stored as rope_freqs.weight."""
    rope = cfg["rope_parameters"]
    base, factor = rope["rope_theta"], rope["factor"]
    low, high = rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * base ** (i / head_dim)
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def convert_to_gguf(hf_dir: Path, out: Path, arch: str,
                    extra: Callable[[Any], None] | None = None) -> Path:
    """An HF directory -> GGUF: `arch`.* metadata, llama.cpp's tensor names, Llama's Q/K
    rows permuted (its rope pairs neighbours), Gemma's norms stored as 1 + w, Llama 3's
    rope factors as a tensor; the byte-level BPE tokenizer as tokenizer.ggml.*."""
    from safetensors.numpy import load_file

    from test_gguf import hf_to_gguf_permute

    cfg = json.loads((hf_dir / "config.json").read_text())
    n_head, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_head
    w = gguf.GGUFWriter(str(out), arch)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(float(cfg["rope_parameters"]["rope_theta"]))
    w.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    if cfg.get("sliding_window") is not None:
        w.add_sliding_window(cfg["sliding_window"])
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if cfg.get(key) is not None:
            getattr(w, f"add_{key}")(float(cfg[key]))
    if extra is not None:
        extra(w)

    add_bpe_tokenizer(w, hf_dir)

    gemma = arch.startswith("gemma")
    names = GGUF_LAYER_NAMES[arch]
    for name, t in load_file(str(hf_dir / "model.safetensors")).items():
        if name.startswith("model.layers."):
            _, _, i, suffix = name.split(".", 3)
            gg = f"blk.{i}.{names[suffix]}"  # KeyError: a tensor the converter misses
        else:
            gg, suffix = GGUF_GLOBAL[name], ""
            if name == "lm_head.weight" and cfg.get("tie_word_embeddings"):
                continue
        if arch == "llama" and suffix in ("self_attn.q_proj.weight", "self_attn.k_proj.weight"):
            t = hf_to_gguf_permute(t, n_head if "q_proj" in suffix else n_kv)
        if gemma and name.endswith("norm.weight"):
            t = (t + 1.0).astype(np.float32)
        w.add_tensor(gg, np.ascontiguousarray(t))
    rope = cfg["rope_parameters"]
    if rope.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_rope_factors(cfg, head_dim))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


# family -> (llama.cpp architecture, writer overrides: llama.cpp fixes Gemma 2's attention
# scale at head_dim**-0.5, so that model uses it).
GGUF_FAMILIES = {"llama3": ("llama", {}), "qwen2": ("qwen2", {}), "qwen3": ("qwen3", {}),
                 "phi3": ("phi3", {}), "gemma2": ("gemma2", {"query_pre_attn_scalar": 32})}


@pytest.mark.parametrize("family", sorted(GGUF_FAMILIES))
def test_gguf_matches_transformers(family: str, tmp_path: Path, prompt: list[int]) -> None:
    arch, overrides = GGUF_FAMILIES[family]
    d = TINY_FAMILIES[family](tmp_path / "hf", **overrides)
    hf = hf_model(d)
    path = convert_to_gguf(d, tmp_path / f"{family}.gguf", arch)
    llm = LLM(path, kv_cache_memory=KV)
    hf_cfg = load_checkpoint(d).config
    got = llm.engine.model_config
    assert got.architecture == arch
    for field in ("sliding_window", "layer_types", "attn_logit_softcapping",
                  "final_logit_softcapping", "query_pre_attn_scalar", "attention_bias",
                  "head_dim"):
        assert getattr(got, field) == getattr(hf_cfg, field), field
    ref = hf_logits(hf, prompt)
    assert (full_logits(llm.engine.model, prompt) - ref).abs().max().item() < 1e-4
    want, logits = hf_greedy(hf, prompt[:40], 16)
    got_ids = llm.generate([prompt[:40]], SamplingParams(temperature=0, max_tokens=16,
                                                         ignore_eos=True))[0].outputs[0]
    assert compare_greedy(got_ids.token_ids, want, logits) == len(want)


@pytest.mark.parametrize(("extra", "message"), [
    (lambda w: w.add_rope_scaling_orig_ctx_len(64), "longrope"),
    (lambda w: w.add_rope_scaling_attn_factors(1.2), "longrope"),
], ids=["original-context", "attn-factor"])
def test_gguf_phi3_longrope_is_refused(extra: Callable[[Any], None], message: str,
                                       tmp_path: Path) -> None:
    """llama.cpp writes these keys with longrope's factor tensors, which kvloop does not
    apply: one error, not a model with the wrong rope."""
    d = TINY_FAMILIES["phi3"](tmp_path / "hf")
    path = convert_to_gguf(d, tmp_path / "p.gguf", "phi3", extra)
    with pytest.raises(ModelLoadError, match=message):
        load_checkpoint(path)
