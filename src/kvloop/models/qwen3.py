"""Qwen3 in PyTorch: the Llama layer with QK-norm.

Queries and keys are RMS-normed over head_dim (a plain RMSNorm, weight w, not Gemma's
1 + w) per head, before rope; head_dim is explicit in the config (not hidden / heads);
no q/k/v biases. The native step takes it as Llama's description with the QK-norm weights
(llama.describe).
"""

from __future__ import annotations

from kvloop.config import ModelConfig
from kvloop.models import llama
from kvloop.models.base import Architecture, ConfigReader, Dim, config_dims


class Qwen3Attention(llama.Attention):
    qk_norm_cls = llama.RMSNorm


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
        gguf_permute_qk=False, hf_config=_hf_config, describe=llama.describe),
)
