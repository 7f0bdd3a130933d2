"""Qwen3 in PyTorch: the Llama layer with QK-norm.

Queries and keys are RMS-normed over head_dim (a plain RMSNorm, weight w, not Gemma's
1 + w) per head, before rope; head_dim is explicit in the config (not hidden / heads);
no q/k/v biases. The C++ decode step has no QK-norm, so Qwen3 runs on the modules.
"""

from __future__ import annotations

import torch

from kvloop.config import ModelConfig
from kvloop.models import llama
from kvloop.models.attention import AttentionMetadata, paged_attention
from kvloop.models.base import Architecture, ConfigReader, Dim, config_dims
from kvloop.models.rope import RotaryEmbedding


class Qwen3Attention(llama.Attention):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.q_norm = llama.RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = llama.RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin: [T, 1, D]
        kv_cache: torch.Tensor | None,  # [2, Hkv, slots, D]
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        T = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, q + 2kv]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.reshape(T, self.num_heads, self.head_dim))  # [T, H, D]
        k = self.k_norm(k.reshape(T, self.num_kv_heads, self.head_dim))  # [T, Hkv, D]
        qk = RotaryEmbedding.rotate(torch.cat([q, k], dim=1), *rope)  # one pass for both
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = v.reshape(T, self.num_kv_heads, self.head_dim)
        o = paged_attention(q, k, v, kv_cache, meta, self.scale)  # [T, H, D]
        return self.o_proj(o.reshape(T, self.q_size))


class Qwen3DecoderLayer(llama.DecoderLayer):
    attention_cls = Qwen3Attention


class Qwen3ForCausalLM(llama.LlamaForCausalLM):
    layer_cls = Qwen3DecoderLayer

    def expected_tensors(self) -> dict[str, tuple[Dim, ...]]:
        return qwen3_tensor_shapes(self.config)


def qwen3_tensor_shapes(c: ModelConfig) -> dict[str, tuple[Dim, ...]]:
    """Llama's tensors and, per layer, the two QK-norm weights [head_dim]."""
    shapes = llama.llama_tensor_shapes(c)
    D = config_dims(c)["D"]
    for i in range(c.num_layers):
        p = f"model.layers.{i}.self_attn."
        shapes |= {p + "q_norm.weight": (D,), p + "k_norm.weight": (D,)}
    return shapes


def _hf_config(reader: ConfigReader, config: ModelConfig) -> ModelConfig:
    return llama.qwen_sliding(reader, llama.silu_mlp(reader, config))


# llama.cpp's qwen3 tensors: Llama's names (Q/K not permuted) and the QK-norm weights.
GGUF_LAYER_NAMES = {**llama.GGUF_LAYER_NAMES,
                    "attn_q_norm.weight": "self_attn.q_norm.weight",
                    "attn_k_norm.weight": "self_attn.k_norm.weight"}

ARCHITECTURES = (
    Architecture(
        name="qwen3", model_class=Qwen3ForCausalLM, tensor_shapes=qwen3_tensor_shapes,
        gguf_layer_names=GGUF_LAYER_NAMES, gguf_global_names=llama.GGUF_GLOBAL_NAMES,
        gguf_permute_qk=False, hf_config=_hf_config, native=False),
)
