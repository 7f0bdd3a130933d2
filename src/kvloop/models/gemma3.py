"""Gemma 3 (text) in PyTorch, over the paged KV cache.

What sets it apart from Llama (HF's modeling_gemma3, llama.cpp's gemma3 graph):
- layers alternate five sliding-window ("local") layers and one global one; local layers
  see the last `sliding_window` positions and rotate with rope base 10,000, global layers
  see everything and use `rope_theta` (and its scaling, if any);
- RMSNorm multiplies by (1 + w), computed in fp32; each attention and MLP block is
  wrapped in a pre-norm and a post-norm before the residual add;
- queries and keys are RMS-normed over head_dim (QK-norm) before rope;
- the MLP is GeGLU with tanh-approximated GELU;
- embeddings are scaled by sqrt(hidden), the scale rounded to the model's dtype first;
- attention scale query_pre_attn_scalar**-0.5; tied embeddings; optional final logit
  softcapping (Gemma 2 has it, Gemma 3 does not).
Module names follow LlamaForCausalLM's (qkv_proj, gate_up_proj, ...) so that the
quantization pass treats both alike.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterable
from dataclasses import replace
from typing import Any, cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from kvloop.config import ModelConfig
from kvloop.errors import ModelLoadError
from kvloop.models import llama
from kvloop.models.attention import AttentionMetadata, layer_metadata
from kvloop.models.base import (
    GELU_TANH,
    Architecture,
    ConfigReader,
    Dim,
    ModelSpec,
    config_dims,
)
from kvloop.models.linear import Linear
from kvloop.models.rope import RotaryEmbedding
from kvloop.quant.kv import PagedKV

SLIDING, FULL = "sliding_attention", "full_attention"
# Defaults of HF's Gemma3TextConfig, for config.json files that leave them out.
SLIDING_WINDOW_PATTERN = 6  # every 6th layer global, the rest local
LOCAL_ROPE_THETA = 10_000.0
GLOBAL_ROPE_THETA = 1_000_000.0
ACTIVATIONS = ("gelu_pytorch_tanh",)


def _param(*shape: int) -> nn.Parameter:
    # Uninitialised: every parameter is overwritten by load_weights.
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + w). `weight` holds w as checkpoints store it (zero-centred);
    `scale` the factor 1 + w, folded once at load, so the forward is one fused op."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = _param(dim)
        self.scale = _param(dim)
        self.eps = eps

    def fold(self) -> None:
        self.scale.copy_(1.0 + self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim]
        return F.rms_norm(x, (x.shape[-1],), self.scale, self.eps)


class Attention(llama.Attention):
    """Llama's attention with (1 + w) QK-norm; its scale is query_pre_attn_scalar**-0.5."""

    qk_norm_cls = GemmaRMSNorm


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


class MLP(llama.MLP):
    """GeGLU with tanh-approximated GELU."""

    act = staticmethod(gelu_tanh)


class DecoderLayer(nn.Module):
    attention_cls: Callable[[ModelConfig], Any] = Attention  # Gemma 2's has no QK-norm

    def __init__(self, config: ModelConfig, index: int) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.sliding = config.is_sliding(index)
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.self_attn = self.attention_cls(config)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.mlp = MLP(config)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: PagedKV | None,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(x), rope, kv_cache, meta)
        x = x + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(x))
        return x + self.post_feedforward_layernorm(h)

    def norms(self) -> list[GemmaRMSNorm]:
        return [m for m in self.modules() if isinstance(m, GemmaRMSNorm)]


class Gemma3ForCausalLM(nn.Module):
    layer_cls: Callable[[ModelConfig, int], nn.Module] = DecoderLayer  # Gemma 2's

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = _param(config.vocab_size, config.hidden_size)
        self.embed_stored: nn.Module | None = None  # set by the loader (CausalLM)
        self.layers = nn.ModuleList(self.layer_cls(config, i) for i in range(config.num_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, config.vocab_size)
        # Global layers: rope_theta with its scaling; local ones their own base, unscaled.
        self.rope = RotaryEmbedding(config)
        self.local_rope = RotaryEmbedding(replace(
            config, rope_theta=config.rope_local_theta or config.rope_theta, rope_scaling=None))
        # HF rounds sqrt(hidden) to the model dtype before scaling (fp32 here).
        self.embed_scale = float(torch.tensor(math.sqrt(config.hidden_size), dtype=torch.float32))

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        meta: AttentionMetadata,
        kv_caches: list[PagedKV] | None = None,  # one per layer
    ) -> torch.Tensor:  # [T, hidden], final-normed
        c = self.config
        x = self.embed(input_ids) * self.embed_scale  # [T, hidden]
        rope_global = self.rope.cos_sin(positions)
        rope_local = self.local_rope.cos_sin(positions)
        num_slots = kv_caches[0].num_slots if kv_caches else 0
        layers = [cast(DecoderLayer, layer) for layer in self.layers]
        metas = layer_metadata(meta, positions, [layer.sliding for layer in layers],
                               c.sliding_window, c.num_kv_heads, num_slots)
        for i, layer in enumerate(layers):
            cache = None if kv_caches is None else kv_caches[i]
            x = layer(x, rope_local if layer.sliding else rope_global, cache, metas[i])
        return self.norm(x)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        return llama.embed_rows(self.embed_stored, self.embed_tokens, input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, V]
        logits = self.lm_head(hidden)
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def linears(self) -> list[Linear]:
        """The fp32 linear layers (quantized ones are other modules)."""
        return [m for m in self.modules() if isinstance(m, Linear)]

    def expected_tensors(self) -> dict[str, tuple[Dim, ...]]:
        """The HF-named tensors a checkpoint of this model holds (Gemma 2's differ)."""
        return gemma3_tensor_shapes(self.config)

    def decode_read_bytes(self) -> int:
        return llama.weight_read_bytes(
            self, self.embed_stored, self.lm_head,
            (m.scale for m in self.modules() if isinstance(m, GemmaRMSNorm)))

    def pack_weights(self) -> None:
        """Switch every fp32 linear layer to oneDNN's layout (after load_weights)."""
        for lin in self.linears():
            lin.pack()

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]],
                     preloaded: Collection[str] = ()) -> None:
        """Copy HF-named tensors in, fusing q/k/v and gate/up as they arrive."""
        c = self.config
        loaded: set[str] = set(preloaded)  # layers built already (from stored codes)
        qkv_rows = {"q_proj": (0, c.q_size), "k_proj": (c.q_size, c.kv_size),
                    "v_proj": (c.q_size + c.kv_size, c.kv_size)}
        norm_names = ("input_layernorm", "post_attention_layernorm",
                      "pre_feedforward_layernorm", "post_feedforward_layernorm")
        for name, w in weights:
            if name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
                if name == "lm_head.weight" and c.tie_word_embeddings:
                    continue  # stored although tied: the embedding is the head
                # (the head's weight only when asked: a head built from stored codes has none)
                target = (self.embed_tokens if name == "model.embed_tokens.weight"
                          else self.norm.weight if name == "model.norm.weight"
                          else self.lm_head.weight)
                target.copy_(w)
                loaded.add(name)
                continue
            parts = name.split(".")
            if parts[:2] != ["model", "layers"] or len(parts) < 5:
                continue
            layer = cast(DecoderLayer, self.layers[int(parts[2])])
            module, leaf = parts[4] if len(parts) > 5 else parts[3], parts[-1]
            attn, mlp = layer.self_attn, layer.mlp
            if module in qkv_rows:
                start, size = qkv_rows[module]
                dest = attn.qkv_proj.weight if leaf == "weight" else attn.qkv_proj.bias
                if dest is None:
                    raise ValueError(f"unexpected bias {name} for a model without attention bias")
                dest[start:start + size].copy_(w)
            elif module == "o_proj":
                attn.o_proj.weight.copy_(w)
            elif module in ("q_norm", "k_norm"):
                cast(GemmaRMSNorm, getattr(attn, module)).weight.copy_(w)
            elif module == "gate_proj":
                mlp.gate_up_proj.weight[: mlp.inter].copy_(w)
            elif module == "up_proj":
                mlp.gate_up_proj.weight[mlp.inter:].copy_(w)
            elif module == "down_proj":
                mlp.down_proj.weight.copy_(w)
            elif module in norm_names:
                cast(GemmaRMSNorm, getattr(layer, module)).weight.copy_(w)
            else:
                continue
            loaded.add(name)
        if c.tie_word_embeddings and isinstance(self.lm_head, Linear) and self.embed_stored is None:
            # One tensor for both: at Gemma's 262k vocabulary a copy would be ~60% of the
            # weights again.
            self.lm_head.weight = self.embed_tokens
        for m in self.modules():
            if isinstance(m, GemmaRMSNorm):
                m.fold()
        expected = len(self.expected_tensors())
        if len(loaded) != expected:
            raise ValueError(
                f"checkpoint has {len(loaded)} of the {expected} tensors this model needs"
            )


def describe(model: Gemma3ForCausalLM) -> ModelSpec:
    """Gemma's layer as the native step's description: (1 + w) norms (the folded `scale`)
    before and after each block, QK-norm where the attention has it (Gemma 3, not 2),
    GeGLU with tanh GELU, query_pre_attn_scalar**-0.5, attention softcapping (Gemma 2);
    local layers their window and rope table 1 (the local base), global ones table 0.
    Embeddings scaled by sqrt(hidden), logits by the final softcap."""
    c = model.config

    def factor(norm: nn.Module) -> torch.Tensor:
        return cast(torch.Tensor, norm.scale).detach()

    layers = []
    for module in model.layers:
        layer = cast(DecoderLayer, module)
        layers.append(llama.block_spec(
            layer.self_attn, layer.mlp, factor, layer.input_layernorm,
            layer.pre_feedforward_layernorm, activation=GELU_TANH,
            post_attn_norm=factor(layer.post_attention_layernorm),
            post_mlp_norm=factor(layer.post_feedforward_layernorm),
            window=(c.sliding_window or 0) if layer.sliding else 0,
            rope=1 if layer.sliding else 0))
    ropes = [(model.rope.cos, model.rope.sin), (model.local_rope.cos, model.local_rope.sin)]
    return ModelSpec(layers, ropes, model.norm.scale.detach(), embed_scale=model.embed_scale,
                     final_softcap=c.final_logit_softcapping)


def gemma3_tensor_shapes(c: ModelConfig) -> dict[str, tuple[Dim, ...]]:
    """HF name -> expected shape of every tensor a Gemma 3 checkpoint must hold: Llama's,
    and per layer the norms around the MLP and the QK-norm weights."""
    d = config_dims(c)
    H, D = d["H"], d["D"]
    shapes = llama.llama_tensor_shapes(c)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "pre_feedforward_layernorm.weight": (H,),
            p + "post_feedforward_layernorm.weight": (H,),
            p + "self_attn.q_norm.weight": (D,), p + "self_attn.k_norm.weight": (D,),
        }
    return shapes


def pattern_layer_types(num_layers: int, pattern: int) -> tuple[str, ...]:
    """HF's rule: layer i is global when (i + 1) is a multiple of `pattern`."""
    return tuple(FULL if (i + 1) % pattern == 0 else SLIDING for i in range(num_layers))


def _gguf_config(reader: ConfigReader, c: ModelConfig) -> ModelConfig:
    """What the GGUF file says (the window) and what llama.cpp's gemma3 graph fixes (the
    5:1 pattern, the local rope base, the attention scale, the activation)."""
    # llama.cpp scales by head_dim**-0.5 except for the 27B model (62 layers), which
    # Google trained with hidden / heads (168) in place of head_dim.
    scalar = c.hidden_size // c.num_heads if c.num_layers == 62 else c.head_dim
    cap = reader.get("final_logit_softcapping")
    return replace(
        c,
        sliding_window=reader.get_int("attention.sliding_window"),
        layer_types=pattern_layer_types(c.num_layers, SLIDING_WINDOW_PATTERN),
        rope_local_theta=LOCAL_ROPE_THETA,
        query_pre_attn_scalar=float(scalar),
        hidden_act="gelu_pytorch_tanh",
        final_logit_softcapping=(None if cap is None
                                 else reader.get_float("final_logit_softcapping", 0.0)),
    )


def _positive(reader: ConfigReader, key: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) \
            or not math.isfinite(value) or value <= 0:
        raise ModelLoadError(f"{reader.where(key)} = {value!r:.60}: must be a positive number")
    return float(value)


def _hf_config(reader: ConfigReader, c: ModelConfig) -> ModelConfig:
    """config.json of a Gemma3ForCausalLM (transformers 4.5x or 5.x spelling)."""
    if reader.get("attn_logit_softcapping") is not None:
        raise ModelLoadError(f"{reader.where('attn_logit_softcapping')}: attention logit "
                             "softcapping is not supported")
    if reader.get("use_bidirectional_attention"):
        raise ModelLoadError(f"{reader.where('use_bidirectional_attention')}: only causal "
                             "attention is supported")
    act = reader.get("hidden_activation") or reader.get("hidden_act") or ACTIVATIONS[0]
    if act not in ACTIVATIONS:
        raise ModelLoadError(f"{reader.where('hidden_activation')} = {act!r:.60}: kvloop "
                             f"runs Gemma 3 with {ACTIVATIONS}")
    layer_types = reader.get("layer_types")
    if layer_types is None:
        pattern = reader.get_int("sliding_window_pattern", SLIDING_WINDOW_PATTERN)
        layer_types = pattern_layer_types(c.num_layers, pattern)
    if not isinstance(layer_types, list | tuple) or len(layer_types) != c.num_layers \
            or any(t not in (SLIDING, FULL) for t in layer_types):
        raise ModelLoadError(f"{reader.where('layer_types')} = {layer_types!r:.60}: must list "
                             f"{SLIDING!r} or {FULL!r} for each of the {c.num_layers} layers")
    # transformers 5 nests rope settings per layer type; 4.x had flat keys.
    params = reader.get("rope_parameters")
    if isinstance(params, dict) and FULL in params:
        full = params[FULL] or {}
        local = params.get(SLIDING) or {}
        if not isinstance(full, dict) or not isinstance(local, dict):
            raise ModelLoadError(f"{reader.where('rope_parameters')}: must map layer types "
                                 "to objects")
        if local.get("rope_type", "default") != "default":
            raise ModelLoadError(f"{reader.where('rope_parameters')}: rope scaling on sliding "
                                 "layers is not supported")
        theta = _positive(reader, "rope_parameters", full.get("rope_theta", GLOBAL_ROPE_THETA))
        local_theta = _positive(reader, "rope_parameters",
                                local.get("rope_theta", LOCAL_ROPE_THETA))
        scaling = full if full.get("rope_type", "default") != "default" else None
    else:
        theta = reader.get_float("rope_theta", GLOBAL_ROPE_THETA)
        local_theta = reader.get_float("rope_local_base_freq", LOCAL_ROPE_THETA)
        scaling = reader.get("rope_scaling") or None
    cap = reader.get("final_logit_softcapping")
    return replace(
        c,
        layer_types=tuple(layer_types),
        sliding_window=reader.get_int("sliding_window", 4096),
        rope_theta=theta,
        rope_local_theta=local_theta,
        rope_scaling=scaling,
        query_pre_attn_scalar=reader.get_float("query_pre_attn_scalar", 256.0),
        hidden_act=act,
        final_logit_softcapping=(None if cap is None
                                 else reader.get_float("final_logit_softcapping", 0.0)),
        rms_norm_eps=reader.get_float("rms_norm_eps", 1e-6),
        tie_word_embeddings=bool(reader.get("tie_word_embeddings", True)),
    )


def _gguf_tensor(name: str, w: np.ndarray) -> np.ndarray:
    # llama.cpp's converter stores Gemma's norm weights as 1 + w; HF's layout (and
    # transformers' own GGUF loader) has w.
    return w - 1.0 if name.endswith("norm.weight") else w


GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

# GGUF calls it "gemma3", a Gemma3ForCausalLM config.json "gemma3_text".
ARCHITECTURES = tuple(
    Architecture(
        name=name, model_class=Gemma3ForCausalLM, tensor_shapes=gemma3_tensor_shapes,
        gguf_layer_names=GGUF_LAYER_NAMES, gguf_global_names=GGUF_GLOBAL_NAMES,
        gguf_permute_qk=False, gguf_config=_gguf_config, hf_config=_hf_config,
        gguf_tensor=_gguf_tensor, describe=describe)
    for name in ("gemma3", "gemma3_text")
)
