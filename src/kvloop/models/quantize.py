"""Swap a loaded model's linear layers for weight-only quantized ones."""

from __future__ import annotations

import logging
from typing import cast

from torch import nn

from kvloop import kernels
from kvloop.models.base import CausalLM
from kvloop.models.linear import Linear
from kvloop.quant import (
    QUANTIZATIONS,
    BlockLinear,
    GroupWeights,
    Int4Linear,
    Int4Weights,
    Int8Linear,
)
from kvloop.quant.layout import Q8B

log = logging.getLogger(__name__)

# Fused layer -> the checkpoint tensors it is made of, in row order.
_SOURCES = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
}


def quantize_model(model: CausalLM, mode: str,
                   int4_source: dict[str, Int4Weights] | None = None,
                   block_source: dict[str, GroupWeights] | None = None) -> None:
    """`mode`: "none", "int8", "int4" or "gguf". With int4, layers whose checkpoint tensors
    are 4-bit blocks (GGUF Q4_0 / Q4_1) take those codes as they are; the rest are
    quantized from fp32. The output head stays int8 under int4: it sets every logit, and
    it is one matrix, so the extra bytes buy accuracy where it shows most. With "gguf"
    every layer takes its checkpoint's blocks as stored (`block_source`), see
    `use_stored_blocks`."""
    if mode not in QUANTIZATIONS or mode == "auto":
        raise ValueError(f"unknown quantization {mode!r}; one of {QUANTIZATIONS[1:]}")
    if mode == "none":
        return
    if mode == "gguf":
        use_stored_blocks(model, block_source or {})
        return
    source = int4_source or {}
    for i, layer in enumerate(model.layers):
        for fused, parts in _SOURCES.items():
            owner_name, attr = fused.split(".")
            owner = cast(nn.Module, getattr(layer, owner_name))
            lin = cast(Linear, getattr(owner, attr))
            if mode == "int8":
                new: nn.Module = Int8Linear.from_dense(lin.weight, lin.bias)
            else:
                names = [f"model.layers.{i}.{p}.weight" for p in parts]
                if all(n in source for n in names):
                    w = Int4Weights.cat([source[n] for n in names])
                else:
                    w = Int4Weights.from_dense(lin.weight)
                new = Int4Linear(w, lin.bias)
            setattr(owner, attr, new)
    # Through nn.Module's setattr: the interface exposes the head read-only.
    head = cast(Linear, model.lm_head)
    cast(nn.Module, model).lm_head = Int8Linear.from_dense(head.weight)


def use_stored_blocks(model: CausalLM, source: dict[str, GroupWeights]) -> None:
    """Every linear layer whose checkpoint tensors are all in a block format becomes a
    BlockLinear over those blocks; the head too (for tied embeddings: the embedding
    table's blocks). Fused layers (q/k/v, gate/up) whose parts differ in format are put
    in one layout that holds every part exactly (GroupWeights.cat: Q5_0 and Q8_0 parts,
    for instance, are both 8-bit codes with fp16 scales per 32); where none can, or where
    a part is stored dense (F32/F16/BF16), the layer stays fp32.

    The blocks decode to exactly the fp32 weights the loader dequantized (the `gguf`
    package's arithmetic: tests/test_block_formats.py), and no architecture's gguf_tensor
    hook changes a 2-D weight (tests/test_families.py), so nothing is compared here: a
    comparison cost ~40% of the load. The layers get their native kernel here when the
    kernels are built (the decode step re-attaches them with more)."""
    def swap(owner: nn.Module, attr: str, names: list[str], is_head: bool = False) -> None:
        lin = cast(Linear, getattr(owner, attr))
        if not all(n in source for n in names):
            return
        w = GroupWeights.cat([source[n] for n in names])
        if w is None:
            log.info("%s: formats with no common exact layout, kept fp32", names)
            return
        if w.shape != (lin.out_features, lin.in_features):
            log.warning("%s: stored blocks have shape %s, kept fp32", names, w.shape)
            return
        new = BlockLinear(w, lin.bias)
        if kernels.available():
            # The head keeps fp32 activations (int8 rounding of its input moved greedy
            # tokens: see kvloop.models.native).
            kind, weight, k, scales, bias = new.native_spec()
            new.native = kernels.native_linear(kind, weight, k, scales, bias,
                                               float_acts=is_head and kind == Q8B)
        setattr(owner, attr, new)

    for i, layer in enumerate(model.layers):
        for fused, parts in _SOURCES.items():
            owner_name, attr = fused.split(".")
            # A checkpoint that stores the fused tensor itself (Phi-3) names it so.
            whole = f"model.layers.{i}.{fused}.weight"
            names = [whole] if whole in source else [f"model.layers.{i}.{p}.weight"
                                                     for p in parts]
            swap(cast(nn.Module, getattr(layer, owner_name)), attr, names)
    head = ("lm_head.weight" if "lm_head.weight" in source or not model.config.tie_word_embeddings
            else "model.embed_tokens.weight")
    swap(cast(nn.Module, model), "lm_head", [head], is_head=True)
