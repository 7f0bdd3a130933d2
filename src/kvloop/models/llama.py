"""The Llama family (Llama 2/3, SmolLM2, Mistral, Qwen2 with q/k/v biases) in PyTorch; Qwen3
(kvloop.models.qwen3) and Phi-3 (kvloop.models.phi3) are variants of these classes.

A model maps (token ids, positions, attention metadata, KV caches) to hidden states, and
hidden states at the sampled rows to logits. It knows nothing of requests or scheduling.
Weights use the HF layout; Q/K/V and gate/up are fused into one matmul each, because at
decode every extra kernel launch and weight pass is pure overhead.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from dataclasses import replace
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from kvloop.config import ModelConfig
from kvloop.errors import ModelLoadError
from kvloop.models.attention import AttentionMetadata, layer_metadata, paged_attention
from kvloop.models.base import (
    Architecture,
    ConfigReader,
    Dim,
    LayerSpec,
    ModelSpec,
    config_dims,
)
from kvloop.models.linear import Linear
from kvloop.models.rope import RotaryEmbedding
from kvloop.quant import BlockLinear
from kvloop.quant.kv import PagedKV


def embed_rows(stored: nn.Module | None, table: torch.Tensor,
               input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden] fp32
    """Embedding rows: decoded from the table's stored blocks (kvloop.quant.BlockLinear)
    where the loader kept them so, else looked up in the fp32 table."""
    if stored is not None:
        return cast(BlockLinear, stored).rows(input_ids)
    return F.embedding(input_ids, table)


def weight_read_bytes(model: nn.Module, embed_stored: nn.Module | None, lm_head: nn.Module,
                      norms: Iterable[torch.Tensor]) -> int:
    """Weight bytes one decode step reads, for every family: each linear layer (the head
    included; each knows its own bytes, fp32 or quantized) and the norms' weights `norms`.
    Of the embedding table only one row per token is read, so its stored blocks count only
    where they are the tied head."""
    linears = sum(int(getattr(m, "weight_bytes", 0)) for m in model.modules()
                  if m is not embed_stored or m is lm_head)
    return linears + sum(t.numel() * t.element_size() for t in norms)


def _param(*shape: int) -> nn.Parameter:
    # Uninitialised: every parameter is overwritten by load_weights.
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = _param(dim)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # One fused op; bitwise equal to HF's x * rsqrt(mean(x^2) + eps) * w here.
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class Attention(nn.Module):
    """Grouped-query attention with rope over the paged KV cache; the variants of the other
    families are settings of it: QK-norm (`qk_norm_cls`, Qwen3 and Gemma 3), the scale
    (config.query_pre_attn_scalar, Gemma) and score softcapping (Gemma 2)."""

    # A per-head norm of queries and keys before rope, built as cls(head_dim, eps); None:
    # no QK-norm.
    qk_norm_cls: Callable[[int, float], nn.Module] | None = None

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size,
                               bias=config.attention_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size)
        self.scale = (config.query_pre_attn_scalar or self.head_dim) ** -0.5
        self.softcap = config.attn_logit_softcapping
        if self.qk_norm_cls is not None:
            self.q_norm = self.qk_norm_cls(self.head_dim, config.rms_norm_eps)
            self.k_norm = self.qk_norm_cls(self.head_dim, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin: [T, 1, D]
        kv_cache: PagedKV | None,  # [2, Hkv, slots, D]
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        qkv = self.qkv_proj(x)  # [T, q + 2kv]
        T = x.shape[0]
        qk_size = self.q_size + self.kv_size
        qk = qkv[:, :qk_size].reshape(T, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.qk_norm_cls is not None:
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=1)
        qk = RotaryEmbedding.rotate(qk, *rope)  # queries and keys rotated in one pass
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, qk_size:].view(T, self.num_kv_heads, self.head_dim)
        o = paged_attention(q, k, v, kv_cache, meta, self.scale, self.softcap)  # [T, H, D]
        return self.o_proj(o.reshape(T, self.q_size))


class MLP(nn.Module):
    """Gated MLP: down(act(gate) * up); SwiGLU here, a family may set another `act`."""

    act: Callable[[torch.Tensor], torch.Tensor] = staticmethod(F.silu)

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.inter = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * self.inter)
        self.down_proj = Linear(self.inter, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.inter, dim=-1)  # [T, I] each
        return self.down_proj(self.act(gate) * up)


class DecoderLayer(nn.Module):
    attention_cls: Callable[[ModelConfig], Any] = Attention  # a variant's attention (Qwen3)

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = self.attention_cls(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: PagedKV | None,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    layer_cls: Callable[[ModelConfig], nn.Module] = DecoderLayer

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = _param(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(self.layer_cls(config) for _ in range(config.num_layers))
        self.embed_stored: nn.Module | None = None  # set by the loader (CausalLM)
        # Mistral (every layer), Qwen2/3 with use_sliding_window (the upper layers): these
        # layers see only the last `sliding_window` positions.
        self.sliding = [config.is_sliding(i) for i in range(config.num_layers)]
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, config.vocab_size)
        self.rope = RotaryEmbedding(config)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        meta: AttentionMetadata,
        kv_caches: list[PagedKV] | None = None,  # one per layer
    ) -> torch.Tensor:  # [T, hidden], final-normed
        c = self.config
        x = self.embed(input_ids)
        rope = self.rope.cos_sin(positions)
        # Each layer's KV cache group's metadata, windowed for sliding layers.
        metas = layer_metadata(meta, positions, self.sliding, c.sliding_window,
                               c.num_kv_heads, kv_caches[0].num_slots if kv_caches else 0)
        for i, layer in enumerate(self.layers):
            x = layer(x, rope, None if kv_caches is None else kv_caches[i], metas[i])
        return self.norm(x)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        return embed_rows(self.embed_stored, self.embed_tokens, input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, V]
        return self.lm_head(hidden)

    def linears(self) -> list[Linear]:
        """The fp32 linear layers (quantized ones are other modules)."""
        return [m for m in self.modules() if isinstance(m, Linear)]

    def expected_tensors(self) -> dict[str, tuple[Dim, ...]]:
        """The HF-named tensors a checkpoint of this model holds (a variant's own)."""
        return llama_tensor_shapes(self.config)

    def decode_read_bytes(self) -> int:
        return weight_read_bytes(self, self.embed_stored, self.lm_head,
                                 (m.weight for m in self.modules() if isinstance(m, RMSNorm)))

    def pack_weights(self) -> None:
        """Switch every fp32 linear layer to oneDNN's layout, dropping the dense weight (for
        the modules' forward: the native decoder reads the dense weights instead)."""
        for lin in self.linears():
            lin.pack()

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]],
                     preloaded: Collection[str] = ()) -> None:
        """Copy HF-named tensors in, fusing q/k/v and gate/up as they arrive (Phi-3 stores
        them fused already: qkv_proj, gate_up_proj)."""
        c = self.config
        loaded: set[str] = set(preloaded)  # layers built already (from stored codes)
        qkv_rows = {"q_proj": (0, c.q_size), "k_proj": (c.q_size, c.kv_size),
                    "v_proj": (c.q_size + c.kv_size, c.kv_size)}
        for name, w in weights:
            if name == "model.rope_freqs":
                self.rope.scale_by(w)
                continue
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
                continue  # rotary caches and other tensors kvloop computes itself
            layer = cast(DecoderLayer, self.layers[int(parts[2])])
            module, leaf = parts[4] if len(parts) > 5 else parts[3], parts[-1]
            attn, mlp = layer.self_attn, layer.mlp
            if module in qkv_rows:
                start, size = qkv_rows[module]
                dest = attn.qkv_proj.weight if leaf == "weight" else attn.qkv_proj.bias
                if dest is None:
                    raise ValueError(f"unexpected bias {name} for a model without attention bias")
                dest[start:start + size].copy_(w)
            elif module == "qkv_proj" and leaf == "weight":
                attn.qkv_proj.weight.copy_(w)  # [q; k; v] rows, as kvloop fuses them
            elif module == "o_proj":
                attn.o_proj.weight.copy_(w)
            elif module in ("q_norm", "k_norm") and hasattr(attn, module):
                cast(RMSNorm, getattr(attn, module)).weight.copy_(w)  # Qwen3
            elif module == "gate_proj":
                mlp.gate_up_proj.weight[: mlp.inter].copy_(w)
            elif module == "up_proj":
                mlp.gate_up_proj.weight[mlp.inter:].copy_(w)
            elif module == "gate_up_proj":
                mlp.gate_up_proj.weight.copy_(w)  # [gate; up] rows, as kvloop fuses them
            elif module == "down_proj":
                mlp.down_proj.weight.copy_(w)
            elif module == "input_layernorm":
                layer.input_layernorm.weight.copy_(w)
            elif module == "post_attention_layernorm":
                layer.post_attention_layernorm.weight.copy_(w)
            else:
                continue
            loaded.add(name)
        # Held once: the head reads the embedding's matrix (a table kept as stored blocks
        # gave the head its own: kvloop.models.quantize.use_stored_embedding).
        if c.tie_word_embeddings and isinstance(self.lm_head, Linear) and self.embed_stored is None:
            self.lm_head.weight = nn.Parameter(self.embed_tokens.detach(), requires_grad=False)
        expected = self.expected_tensors().keys()
        if loaded != expected:
            missing = sorted(expected - loaded)
            raise ValueError(
                f"checkpoint has {len(loaded & expected)} of the {len(expected)} tensors this "
                f"model needs (missing: {', '.join(missing[:3])})"
            )


def llama_tensor_shapes(c: ModelConfig) -> dict[str, tuple[Dim, ...]]:
    """HF name -> expected shape of every tensor a Llama-family checkpoint must hold."""
    d = config_dims(c)
    V, H, Q, KV, FF = d["V"], d["H"], d["Q"], d["KV"], d["FF"]
    shapes: dict[str, tuple[Dim, ...]] = {
        "model.embed_tokens.weight": (V, H), "model.norm.weight": (H,),
    }
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (V, H)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
            p + "self_attn.q_proj.weight": (Q, H), p + "self_attn.k_proj.weight": (KV, H),
            p + "self_attn.v_proj.weight": (KV, H), p + "self_attn.o_proj.weight": (H, Q),
            p + "mlp.gate_proj.weight": (FF, H), p + "mlp.up_proj.weight": (FF, H),
            p + "mlp.down_proj.weight": (H, FF),
        }
        if c.attention_bias:
            shapes |= {p + "self_attn.q_proj.bias": (Q,), p + "self_attn.k_proj.bias": (KV,),
                       p + "self_attn.v_proj.bias": (KV,)}
    return shapes


# llama.cpp's tensor names for the family -> HF's.
GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "rope_freqs.weight": "model.rope_freqs",
}


SLIDING, FULL = "sliding_attention", "full_attention"


def silu_mlp(reader: ConfigReader, config: ModelConfig) -> ModelConfig:
    """The family's MLP gate is SiLU: any other hidden_act is refused, not run as SiLU."""
    act = reader.get("hidden_act", "silu")
    if act != "silu":
        raise ModelLoadError(f"{reader.where('hidden_act')} = {act!r:.60}: kvloop runs "
                             f"{config.architecture} with 'silu'")
    return config


def every_layer_sliding(reader: ConfigReader, config: ModelConfig) -> ModelConfig:
    """Mistral, Phi-3: a sliding_window, when config.json sets one, applies to every layer
    (HF's MistralAttention / Phi3Attention pass it to each)."""
    if reader.get("sliding_window") is None:
        return config
    return replace(config, sliding_window=reader.get_int("sliding_window"),
                   layer_types=(SLIDING,) * config.num_layers)


def qwen_sliding(reader: ConfigReader, config: ModelConfig) -> ModelConfig:
    """Qwen2/Qwen3: a window only with use_sliding_window (HF drops the window otherwise),
    on the layers layer_types marks (by default those from max_window_layers up)."""
    if not reader.get("use_sliding_window", False):
        return config
    n = config.num_layers
    layer_types = reader.get("layer_types")
    if layer_types is None:
        first = reader.get_int("max_window_layers", 28)
        layer_types = [SLIDING if i >= first else FULL for i in range(n)]
    if not isinstance(layer_types, list | tuple) or len(layer_types) != n \
            or any(t not in (SLIDING, FULL) for t in layer_types):
        raise ModelLoadError(f"{reader.where('layer_types')} = {layer_types!r:.60}: must list "
                             f"{SLIDING!r} or {FULL!r} for each of the {n} layers")
    return replace(config, sliding_window=reader.get_int("sliding_window", 4096),
                   layer_types=tuple(layer_types))


def _qwen2_hf_config(reader: ConfigReader, config: ModelConfig) -> ModelConfig:
    # Qwen2 checkpoints have q/k/v biases unless config.json says otherwise.
    config = replace(config, attention_bias=bool(reader.get("attention_bias", True)))
    return qwen_sliding(reader, config)


def _no_extras(reader: ConfigReader, config: ModelConfig) -> ModelConfig:
    return config


def block_spec(attn: Attention, mlp: MLP, factor: Callable[[nn.Module], torch.Tensor],
               attn_norm: nn.Module, mlp_norm: nn.Module, **differences: Any) -> LayerSpec:
    """One layer's description from the attention and MLP modules every family shares;
    `factor` reads a norm's multiplier (Llama's weight, Gemma's folded 1 + w), and
    `differences` are the family's own LayerSpec fields (window, activation, post-norms)."""
    qk_norm = attn.qk_norm_cls is not None
    return LayerSpec(
        attn_norm=factor(attn_norm), qkv=attn.qkv_proj, o_proj=attn.o_proj,
        mlp_norm=factor(mlp_norm), gate_up=mlp.gate_up_proj, down=mlp.down_proj,
        scale=attn.scale, q_norm=factor(attn.q_norm) if qk_norm else None,
        k_norm=factor(attn.k_norm) if qk_norm else None, attn_softcap=attn.softcap,
        **differences)


def describe(model: LlamaForCausalLM) -> ModelSpec:
    """The Llama layer as the native step's description: pre-norms, SiLU, head_dim**-0.5;
    Mistral's and Qwen2's sliding layers their window, Qwen2's biases in the fused q/k/v,
    QK-norm where the attention has it (Qwen3)."""
    c = model.config

    def factor(norm: nn.Module) -> torch.Tensor:
        return cast(torch.Tensor, norm.weight).detach()

    layers = []
    for i, module in enumerate(model.layers):
        layer = cast(DecoderLayer, module)
        layers.append(block_spec(
            layer.self_attn, layer.mlp, factor, layer.input_layernorm,
            layer.post_attention_layernorm,
            window=(c.sliding_window or 0) if model.sliding[i] else 0))
    return ModelSpec(layers, [(model.rope.cos, model.rope.sin)], model.norm.weight.detach())


def _family(name: str, permute_qk: bool,
            hf_config: Callable[[ConfigReader, ModelConfig], ModelConfig] = _no_extras,
            ) -> Architecture:
    def read(reader: ConfigReader, config: ModelConfig) -> ModelConfig:
        return hf_config(reader, silu_mlp(reader, config))

    return Architecture(
        name=name, model_class=LlamaForCausalLM, tensor_shapes=llama_tensor_shapes,
        gguf_layer_names=GGUF_LAYER_NAMES, gguf_global_names=GGUF_GLOBAL_NAMES,
        gguf_permute_qk=permute_qk, hf_config=read, describe=describe)


# Llama, Mistral and Qwen2 share one implementation; Qwen2 differs by q/k/v biases, which
# the config's attention_bias flag switches on, Mistral by its sliding window. llama.cpp's
# converter permutes the Q/K rows of Llama and Mistral (its rope pairs neighbours) but not
# of Qwen2. Llama 3's rope scaling is the config's rope_scaling (kvloop.models.rope).
ARCHITECTURES = (
    _family("llama", permute_qk=True),
    _family("mistral", permute_qk=True, hf_config=every_layer_sliding),
    _family("qwen2", permute_qk=False, hf_config=_qwen2_hf_config),
)
