"""Swap a loaded model's linear layers for weight-only quantized ones."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
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


def _layers(model: CausalLM, source: Mapping[str, object]
            ) -> Iterator[tuple[nn.Module, str, list[str]]]:
    """(owner module, attribute, checkpoint tensor names) of every linear layer of the
    decoder layers, fused ones naming their parts in row order (or the fused tensor itself
    where the checkpoint stores it so: Phi-3)."""
    for i, layer in enumerate(model.layers):
        for fused, parts in _SOURCES.items():
            owner_name, attr = fused.split(".")
            whole = f"model.layers.{i}.{fused}.weight"
            names = [whole] if whole in source else [f"model.layers.{i}.{p}.weight"
                                                     for p in parts]
            yield cast(nn.Module, getattr(layer, owner_name)), attr, names


def quantize_model(model: CausalLM, mode: str,
                   int4_source: Mapping[str, Int4Weights] | None = None,
                   block_source: Mapping[str, GroupWeights] | None = None) -> None:
    """`mode`: "none", "int8", "int4" or "gguf", on a model whose weights are loaded. With
    int4, layers whose checkpoint tensors are 4-bit blocks (GGUF Q4_0 / Q4_1,
    `int4_source`) take those codes as they are (use_stored_int4); the rest are quantized
    from fp32. The output head stays int8 under int4: it sets every logit, and it is one
    matrix, so the extra bytes buy accuracy where it shows most. With "gguf" every layer
    takes its checkpoint's blocks as stored (`block_source`), see `use_stored_blocks`.
    Layers that are quantized already (built from stored codes before the weights were
    loaded) are left as they are."""
    if mode not in QUANTIZATIONS or mode == "auto":
        raise ValueError(f"unknown quantization {mode!r}; one of {QUANTIZATIONS[1:]}")
    if mode == "none":
        return
    if mode == "gguf":
        use_stored_blocks(model, block_source or {})
        return
    if mode == "int4" and int4_source:
        use_stored_int4(model, int4_source)
    for owner, attr, _ in _layers(model, {}):
        lin = getattr(owner, attr)
        if not isinstance(lin, Linear):
            continue
        new: nn.Module = (Int8Linear.from_dense(lin.weight, lin.bias) if mode == "int8"
                          else Int4Linear(Int4Weights.from_dense(lin.weight), lin.bias))
        setattr(owner, attr, new)
    head = model.lm_head
    if isinstance(head, Linear):
        # Through nn.Module's setattr: the interface exposes the head read-only.
        cast(nn.Module, model).lm_head = Int8Linear.from_dense(head.weight)


def use_stored_int4(model: CausalLM, source: Mapping[str, Int4Weights]) -> set[str]:
    """Every decoder linear layer whose checkpoint tensors are all GGUF Q4_0 / Q4_1 becomes
    an Int4Linear over those codes (exactly the stored weights). Returns the tensor names
    it took: the loader need not read them as fp32."""
    taken: set[str] = set()
    for owner, attr, names in _layers(model, source):
        lin = getattr(owner, attr)
        if isinstance(lin, Linear) and all(n in source for n in names):
            setattr(owner, attr, Int4Linear(Int4Weights.cat([source[n] for n in names]),
                                            lin.bias))
            taken.update(names)
    return taken


def use_stored_blocks(model: CausalLM, source: Mapping[str, GroupWeights]) -> set[str]:
    """Every linear layer whose checkpoint tensors are all in a block format becomes a
    BlockLinear over those blocks; the head too (for tied embeddings: the embedding
    table's blocks). Fused layers (q/k/v, gate/up) whose parts differ in format are put
    in one layout that holds every part exactly (GroupWeights.cat: Q5_0 and Q8_0 parts,
    for instance, are both 8-bit codes with fp16 scales per 32); where none can, or where
    a part is stored dense (F32/F16/BF16), the layer stays fp32. Returns the tensor names
    it took (the embedding's not among them: the lookup still reads it), so that it can
    run before the weights are loaded and the loader skips them.

    The blocks decode to exactly the fp32 weights the loader would dequantize (the `gguf`
    package's arithmetic: tests/test_block_formats.py), and no architecture's gguf_tensor
    hook changes a 2-D weight (test_no_architecture_transforms_a_stored_matrix), so
    nothing is compared here: a comparison cost ~40% of the load. The layers get their
    native kernel here when the kernels are built (the decode step re-attaches them with
    more)."""
    taken: set[str] = set()

    def swap(owner: nn.Module, attr: str, names: list[str], is_head: bool = False) -> None:
        lin = getattr(owner, attr)
        if not isinstance(lin, Linear) or not all(n in source for n in names):
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
        taken.update(n for n in names if n != "model.embed_tokens.weight")

    for owner, attr, names in _layers(model, source):
        swap(owner, attr, names)
    head = ("lm_head.weight" if "lm_head.weight" in source or not model.config.tie_word_embeddings
            else "model.embed_tokens.weight")
    swap(cast(nn.Module, model), "lm_head", [head], is_head=True)
    return taken
