"""Gemma 2 in PyTorch: Gemma 3's layer (kvloop.models.gemma3) with these differences.

- no QK-norm; one rope base for every layer (no local base);
- attention logit softcapping: scores = cap * tanh(scores / cap), after the scale and
  before the mask and softmax. On the modules the decode rows gather their context
  (without_decode_kernel: the Python-facing kernel call does not cap) and attention runs
  attention.softcapped_sdpa; the native step caps in its kernel;
- sliding and global layers alternate (layer i slides when i is even), final logit
  softcapping (30 in the released models), query_pre_attn_scalar, (1 + w) norms, pre- and
  post-norms, GeGLU with tanh GELU, embeddings scaled by sqrt(hidden): as Gemma 3.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from kvloop.config import ModelConfig
from kvloop.errors import ModelLoadError
from kvloop.models import gemma3, llama
from kvloop.models.attention import (
    AttentionMetadata,
    flat_kv_index,
    map_groups,
)
from kvloop.models.base import Architecture, ConfigReader, Dim
from kvloop.quant.kv import PagedKV

SLIDING, FULL = gemma3.SLIDING, gemma3.FULL
ROPE_THETA = 10_000.0  # Gemma2Config's default
SLIDING_WINDOW = 4096
QUERY_PRE_ATTN_SCALAR = 256.0


class Gemma2DecoderLayer(gemma3.DecoderLayer):
    attention_cls = llama.Attention  # no QK-norm; the scale and softcap come from the config


class Gemma2ForCausalLM(gemma3.Gemma3ForCausalLM):
    layer_cls = Gemma2DecoderLayer

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        meta: AttentionMetadata,
        kv_caches: list[PagedKV] | None = None,  # one per layer
    ) -> torch.Tensor:  # [T, hidden], final-normed
        if self.config.attn_logit_softcapping is not None and kv_caches:
            heads, slots = self.config.num_kv_heads, kv_caches[0].num_slots
            meta = map_groups(meta, lambda m: without_decode_kernel(m, heads, slots))
        return super().forward(input_ids, positions, meta, kv_caches)

    def expected_tensors(self) -> dict[str, tuple[Dim, ...]]:
        return gemma2_tensor_shapes(self.config)


def without_decode_kernel(meta: AttentionMetadata, num_kv_heads: int,
                          num_slots: int) -> AttentionMetadata:
    """The step's metadata with decode rows meant for the paged-attention kernel (block
    tables) turned into a gather of each whole context (padding masked): the kernel does
    not softcap. Unchanged when the decode rows gather already."""
    if meta.decode_block_tables is None:
        return meta
    assert meta.decode_context_lens is not None
    ctx, tables, bs = meta.decode_context_lens, meta.decode_block_tables, meta.block_size
    B, S = ctx.shape[0], int(ctx.max())
    pos = torch.arange(S).expand(B, S)  # [B, S]
    valid = pos < ctx.unsqueeze(1)
    pos = torch.where(valid, pos, 0)  # padding reads position 0, masked
    slots = tables.gather(1, pos // bs) * bs + pos % bs  # [B, S]
    mask = None if bool(valid.all()) else torch.zeros(B, 1, 1, S).masked_fill_(
        ~valid.view(B, 1, 1, S), float("-inf"))
    return replace(meta, decode_block_tables=None, decode_context_lens=None,
                   decode_kv_index=flat_kv_index(slots, num_kv_heads, num_slots),
                   decode_shape=(B, S), decode_mask=mask)


def gemma2_tensor_shapes(c: ModelConfig) -> dict[str, tuple[Dim, ...]]:
    """Gemma 3's tensors without the QK-norm weights."""
    return {name: dims for name, dims in gemma3.gemma3_tensor_shapes(c).items()
            if not name.endswith(("q_norm.weight", "k_norm.weight"))}


def alternating_layer_types(num_layers: int) -> tuple[str, ...]:
    """HF's and llama.cpp's rule: even layers slide, odd ones are global."""
    return tuple(SLIDING if i % 2 == 0 else FULL for i in range(num_layers))


def _cap(reader: ConfigReader, key: str) -> float | None:
    # Absent and null both mean no cap (HF's configs write both caps explicitly).
    return None if reader.get(key) is None else reader.get_float(key, 0.0)


def _hf_config(reader: ConfigReader, c: ModelConfig) -> ModelConfig:
    """config.json of a Gemma2ForCausalLM."""
    act = reader.get("hidden_activation") or reader.get("hidden_act") or gemma3.ACTIVATIONS[0]
    if act not in gemma3.ACTIVATIONS:
        raise ModelLoadError(f"{reader.where('hidden_activation')} = {act!r:.60}: kvloop "
                             f"runs Gemma 2 with {gemma3.ACTIVATIONS}")
    if c.rope_scaling is not None:
        raise ModelLoadError(f"{reader.where('rope_parameters')}: rope scaling is not "
                             "supported for Gemma 2")
    layer_types = reader.get("layer_types")
    if layer_types is None:
        layer_types = alternating_layer_types(c.num_layers)
    if not isinstance(layer_types, list | tuple) or len(layer_types) != c.num_layers \
            or any(t not in (SLIDING, FULL) for t in layer_types):
        raise ModelLoadError(f"{reader.where('layer_types')} = {layer_types!r:.60}: must list "
                             f"{SLIDING!r} or {FULL!r} for each of the {c.num_layers} layers")
    return replace(
        c,
        layer_types=tuple(layer_types),
        sliding_window=reader.get_int("sliding_window", SLIDING_WINDOW),
        rope_local_theta=c.rope_theta,  # one base: the sliding layers' table is the same
        query_pre_attn_scalar=reader.get_float("query_pre_attn_scalar", QUERY_PRE_ATTN_SCALAR),
        hidden_act=act,
        final_logit_softcapping=_cap(reader, "final_logit_softcapping"),
        attn_logit_softcapping=_cap(reader, "attn_logit_softcapping"),
        rms_norm_eps=reader.get_float("rms_norm_eps", 1e-6),
        tie_word_embeddings=bool(reader.get("tie_word_embeddings", True)),
    )


def _gguf_config(reader: ConfigReader, c: ModelConfig) -> ModelConfig:
    """What the GGUF file says (window, caps) and what llama.cpp's gemma2 graph fixes (the
    alternating layers, the attention scale, the activation)."""
    # llama.cpp scales by head_dim**-0.5 except for the 27B model (46 layers), trained
    # with hidden / heads in place of head_dim.
    scalar = c.hidden_size // c.num_heads if c.num_layers == 46 else c.head_dim
    return replace(
        c,
        sliding_window=reader.get_int("attention.sliding_window"),
        layer_types=alternating_layer_types(c.num_layers),
        rope_local_theta=c.rope_theta,
        query_pre_attn_scalar=float(scalar),
        hidden_act="gelu_pytorch_tanh",
        final_logit_softcapping=_cap(reader, "final_logit_softcapping"),
        attn_logit_softcapping=_cap(reader, "attn_logit_softcapping"),
    )


def _gguf_tensor(name: str, w: np.ndarray) -> np.ndarray:
    # llama.cpp's converter stores Gemma's norm weights as 1 + w (see gemma3._gguf_tensor).
    return w - 1.0 if name.endswith("norm.weight") else w


GGUF_LAYER_NAMES = {gg: hf for gg, hf in gemma3.GGUF_LAYER_NAMES.items()
                    if not hf.endswith(("q_norm.weight", "k_norm.weight"))}

# Gemma 3's description serves (no QK-norm; one rope base: both tables are alike).
ARCHITECTURES = (
    Architecture(
        name="gemma2", model_class=Gemma2ForCausalLM, tensor_shapes=gemma2_tensor_shapes,
        gguf_layer_names=GGUF_LAYER_NAMES, gguf_global_names=gemma3.GGUF_GLOBAL_NAMES,
        gguf_permute_qk=False, gguf_config=_gguf_config, hf_config=_hf_config,
        gguf_tensor=_gguf_tensor, describe=gemma3.describe),
)
