"""Phi-3 in PyTorch: the Llama layer, with Q/K/V and gate/up stored fused.

HF's Phi3 checkpoints hold `self_attn.qkv_proj.weight` ([q; k; v] rows) and
`mlp.gate_up_proj.weight` ([gate; up] rows): the layout kvloop fuses Llama's into, so
they load as they are (LlamaForCausalLM.load_weights accepts both names). No biases; a
sliding_window, when set, applies to every layer (as Mistral's). Rope: plain, or linear /
Llama-3 scaling; the long-context "longrope" ("su"/"yarn") variants and a partial rotary
factor are refused at load (one line naming the key).
"""

from __future__ import annotations

from dataclasses import replace

from kvloop.config import ModelConfig
from kvloop.errors import ModelLoadError
from kvloop.models import llama
from kvloop.models.base import Architecture, ConfigReader, Dim, config_dims


class Phi3ForCausalLM(llama.LlamaForCausalLM):
    def expected_tensors(self) -> dict[str, tuple[Dim, ...]]:
        return phi3_tensor_shapes(self.config)


def phi3_tensor_shapes(c: ModelConfig) -> dict[str, tuple[Dim, ...]]:
    """Llama's tensors, with q/k/v and gate/up each stored as one fused tensor; no q/k/v
    biases (_hf_config refuses them)."""
    H = config_dims(c)["H"]
    QKV: Dim = (c.q_size + 2 * c.kv_size, ("num_heads", "num_kv_heads", "head_dim"))
    FF2: Dim = (2 * c.intermediate_size, ("intermediate_size",))
    shapes = llama.llama_tensor_shapes(c)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        for part in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                     "mlp.gate_proj", "mlp.up_proj"):
            del shapes[f"{p}{part}.weight"]
            shapes.pop(f"{p}{part}.bias", None)
        shapes |= {p + "self_attn.qkv_proj.weight": (QKV, H),
                   p + "mlp.gate_up_proj.weight": (FF2, H)}
    return shapes


def _hf_config(reader: ConfigReader, config: ModelConfig) -> ModelConfig:
    params = reader.get("rope_parameters")
    factor = reader.get("partial_rotary_factor", 1.0)
    if isinstance(params, dict):
        factor = params.get("partial_rotary_factor", factor)
    if factor != 1.0:
        raise ModelLoadError(f"{reader.where('partial_rotary_factor')} = {factor!r:.60}: "
                             "kvloop rotates whole heads (partial_rotary_factor 1.0)")
    if reader.get("attention_bias", False):
        raise ModelLoadError(f"{reader.where('attention_bias')}: Phi-3 has no q/k/v biases")
    return llama.every_layer_sliding(reader, llama.silu_mlp(reader, config))


def _gguf_config(reader: ConfigReader, config: ModelConfig) -> ModelConfig:
    """llama.cpp's phi3 keys: the window (every layer, as in HF), and what kvloop refuses:
    a rope over part of each head, and longrope (its factor tensors come with these keys)."""
    dims = reader.get("rope.dimension_count")
    if dims is not None and dims != config.head_dim:
        raise ModelLoadError(f"{reader.where('rope.dimension_count')} = {dims!r:.60}: kvloop "
                             f"rotates whole heads ({config.head_dim})")
    for key in ("rope.scaling.attn_factor", "rope.scaling.original_context_length"):
        if reader.get(key) is not None:
            raise ModelLoadError(f"{reader.where(key)}: longrope scaling is not supported")
    if reader.get("attention.sliding_window") is None:
        return config
    return replace(config, sliding_window=reader.get_int("attention.sliding_window"),
                   layer_types=(llama.SLIDING,) * config.num_layers)


# llama.cpp's phi3 tensors: attn_qkv fused, and ffn_up holding [gate; up].
GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_qkv.weight": "self_attn.qkv_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_up.weight": "mlp.gate_up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

# After fusing, the layer is Llama's exactly: the native step runs it as it runs Llama
# (a sliding window included).
ARCHITECTURES = (
    Architecture(
        name="phi3", model_class=Phi3ForCausalLM, tensor_shapes=phi3_tensor_shapes,
        gguf_layer_names=GGUF_LAYER_NAMES, gguf_global_names=GGUF_GLOBAL_NAMES,
        gguf_permute_qk=False, gguf_config=_gguf_config, hf_config=_hf_config,
        describe=llama.describe),
)
