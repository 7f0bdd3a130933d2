"""Swap a loaded model's linear layers for weight-only quantized ones."""

from __future__ import annotations

from typing import cast

from torch import nn

from kvloop.models.base import CausalLM
from kvloop.models.linear import Linear
from kvloop.quant import QUANTIZATIONS, Int4Linear, Int4Weights, Int8Linear

# Fused layer -> the checkpoint tensors it is made of, in row order.
_SOURCES = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
}


def quantize_model(model: CausalLM, mode: str,
                   int4_source: dict[str, Int4Weights] | None = None) -> None:
    """`mode`: "none", "int8" or "int4". With int4, layers whose checkpoint tensors are
    4-bit blocks (GGUF Q4_0 / Q4_1) take those codes as they are; the rest are quantized
    from fp32. The output head stays int8 under int4: it sets every logit, and it is
    one matrix, so the extra bytes buy accuracy where it shows most."""
    if mode not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {mode!r}; one of {QUANTIZATIONS}")
    if mode == "none":
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
