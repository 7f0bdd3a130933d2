"""Swap a loaded model's linear layers for weight-only quantized ones."""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterator, Mapping
from typing import cast

import torch
from torch import nn
from tqdm import tqdm

from kvloop import kernels
from kvloop.kernels.linear import native_stack
from kvloop.models.base import CausalLM
from kvloop.models.linear import Linear
from kvloop.quant import (
    QUANTIZATIONS,
    BlockLinear,
    Int4Linear,
    Int4Weights,
    Int8Linear,
    StackedLinear,
)
from kvloop.quant.layout import WIDE_ACTS_KINDS
from kvloop.quant.stored import StoredRows, Weights, cat

log = logging.getLogger(__name__)

# Fused layer -> the checkpoint tensors it is made of, in row order.
_SOURCES = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
}


EMBEDDING = "model.embed_tokens.weight"


def _decoder_linears(model: CausalLM, source: Collection[str]
                     ) -> Iterator[tuple[str, nn.Module, str, list[str]]]:
    """(path, owner module, attribute, checkpoint tensor names) of every linear layer of
    the decoder layers, fused ones naming their parts in row order (or the fused tensor
    itself where the checkpoint, `source`, stores it so: Phi-3)."""
    for i, layer in enumerate(model.layers):
        for fused, parts in _SOURCES.items():
            owner_name, attr = fused.split(".")
            whole = f"model.layers.{i}.{fused}.weight"
            names = [whole] if whole in source else [f"model.layers.{i}.{p}.weight"
                                                     for p in parts]
            yield f"layers.{i}.{fused}", cast(nn.Module, getattr(layer, owner_name)), attr, names


def quantize_model(model: CausalLM, mode: str,
                   int4_source: Mapping[str, Int4Weights] | None = None,
                   block_source: Mapping[str, Weights] | None = None) -> None:
    """`mode`: "none", "int8", "int4" or "gguf", on a model whose weights are loaded. With
    int4, layers whose checkpoint tensors are 4-bit blocks (GGUF Q4_0 / Q4_1,
    `int4_source`) take those codes as they are (use_stored_int4); the rest are quantized
    from fp32. The output head is never 4-bit: it sets every logit, and it is one matrix,
    so the extra bytes buy accuracy where it shows most. A tied head whose table the
    checkpoint stores in blocks is that table (use_stored_embedding); another becomes
    int8. With "gguf" every layer takes its checkpoint's blocks as stored
    (`block_source`), see `use_stored_blocks`.
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
    todo = [(o, a) for _, o, a, _ in _decoder_linears(model, ())
            if isinstance(getattr(o, a), Linear)]
    # A first load that re-quantizes shows its progress (after a second: quick ones don't);
    # later loads read the result from the layout cache.
    for owner, attr in tqdm(todo, desc=f"quantizing to {mode}", unit="layer", delay=1.0,
                            leave=False):
        lin = getattr(owner, attr)
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
    for _, owner, attr, names in _decoder_linears(model, source):
        lin = getattr(owner, attr)
        if isinstance(lin, Linear) and all(n in source for n in names):
            setattr(owner, attr, Int4Linear(Int4Weights.cat([source[n] for n in names]),
                                            lin.bias))
            taken.update(names)
    return taken


def use_stored_blocks(model: CausalLM, source: Mapping[str, Weights]) -> set[str]:
    """Every linear layer whose checkpoint tensors are all in a block format becomes a
    BlockLinear over those blocks; the head too (for tied embeddings: the embedding
    table's blocks). Fused layers (q/k/v, gate/up) whose parts differ in format become a
    StackedLinear of the parts, each in its own layout, where some part is read as
    stored (kvloop.quant.stored.cat: q/k Q4_K with v Q6_K, q/k Q5_0 with v Q8_0), else
    one layout that holds every part exactly (GroupWeights.cat); where none can, or where
    a part is stored dense (F32/F16/BF16), the layer stays fp32. The head takes
    int16 activations (see _attach_native), which the kernels take with 8-bit codes and
    Q6_K blocks (WIDE_ACTS_KINDS): a head stored in another block format is held as codes
    and scales. Returns the tensor names it took (the embedding's not among them: the
    lookup still reads it), so that it can run before the weights are loaded and the
    loader skips them.

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
        w = cat([source[n] for n in names])
        if is_head and isinstance(w, StoredRows) and w.native()[0] not in WIDE_ACTS_KINDS:
            w = w.groups()
        if w is None:
            log.info("%s: formats with no common exact layout, kept fp32", names)
            return
        ws = w if isinstance(w, list) else [w]
        shape = (sum(p.shape[0] for p in ws), ws[0].shape[1])
        if shape != (lin.out_features, lin.in_features):
            log.warning("%s: stored blocks have shape %s, kept fp32", names, shape)
            return
        new: nn.Module = (BlockLinear(ws[0], lin.bias) if len(ws) == 1
                          else StackedLinear([BlockLinear(p) for p in ws], lin.bias))
        _attach_native(new, is_head)
        setattr(owner, attr, new)
        taken.update(n for n in names if n != EMBEDDING)

    for _, owner, attr, names in _decoder_linears(model, source):
        swap(owner, attr, names)
    head = ("lm_head.weight" if "lm_head.weight" in source or not model.config.tie_word_embeddings
            else EMBEDDING)
    swap(cast(nn.Module, model), "lm_head", [head], is_head=True)
    return taken


def use_stored_embedding(model: CausalLM, source: Mapping[str, Weights]) -> set[str]:
    """The embedding table as its stored blocks, when the checkpoint stores it so: each
    looked-up row is decoded (the values the fp32 table would hold, at a quarter of its
    memory or less). With tied embeddings and a head built from the same blocks
    (use_stored_blocks), the head is the table: one copy serves both. A tied head still
    fp32 (or to be re-quantized) gets the dense matrix decoded from the blocks. Returns
    the tensor name taken (the loader skips it), or nothing."""
    if EMBEDDING not in source:
        return set()
    head = model.lm_head
    tied = model.config.tie_word_embeddings
    table = head if tied and isinstance(head, BlockLinear) else BlockLinear(source[EMBEDDING])
    if tuple(table.weight_q.shape[:1]) != tuple(model.embed_tokens.shape[:1]):
        return set()  # not this model's table (load_weights will say what is wrong)
    owner = cast(nn.Module, model)
    owner.embed_stored = table
    owner.embed_tokens = nn.Parameter(torch.empty(0), requires_grad=False)  # not held
    if tied and isinstance(head, Linear):
        # A tied head still fp32 (int8 / int4 modes: only decoder layers are re-quantized)
        # is the table as stored: the checkpoint's own weights exactly, held once. An int8
        # copy re-quantized from it would cost its bytes again and a dense fp32 matrix
        # while it is built, and can only be as close to the stored values or further.
        _attach_native(table, is_head=True)
        owner.lm_head = table
    return {EMBEDDING}


def _attach_native(layer: nn.Module, is_head: bool) -> None:
    """The layer's native kernel, when the kernels are built (the decode step re-attaches
    them with more). The head takes int16 activations: int8 rounding of its input moved
    greedy tokens (kvloop.models.native)."""
    if isinstance(layer, StackedLinear):
        for part in layer.blocks():
            _attach_native(part, is_head)
        if kernels.available() and layer.native is None:
            layer.native = native_stack([p.native for p in layer.blocks()])
        return
    assert isinstance(layer, BlockLinear)
    if kernels.available() and layer.native is None:
        kind, weight, k, scales, bias = layer.native_spec()
        layer.native = kernels.native_linear(kind, weight, k, scales, bias,
                                             wide_acts=is_head and kind in WIDE_ACTS_KINDS)


def quantized_layers(model: CausalLM) -> dict[str, torch.Tensor]:
    """The int8 / int4 layers' tensors by layer path (`layers.3.mlp.down_proj.int8.qweight`,
    `lm_head.int8.scales`, ...): what a layout cache keeps (biases are checkpoint tensors,
    loaded as ever)."""
    out: dict[str, torch.Tensor] = {}
    paths = [(p, getattr(o, a)) for p, o, a, _ in _decoder_linears(model, ())]
    for path, m in [*paths, ("lm_head", model.lm_head)]:
        if isinstance(m, Int8Linear):
            out[f"{path}.int8.qweight"], out[f"{path}.int8.scales"] = m.qweight, m.scales
        elif isinstance(m, Int4Linear):
            out[f"{path}.int4.packed"] = m.native_packed
    return out


def use_cached_layers(model: CausalLM, tensors: Mapping[str, torch.Tensor],
                      checkpoint_names: Collection[str]) -> set[str]:
    """Install the layers `quantized_layers` gave (before the weights are loaded: biases
    arrive later, into the same Parameter objects). Every decoder layer and the head must
    be there with the shapes this model wants, or ValueError (before anything changes);
    the head too unless it is tied (a tied head is the stored table, or quantized anew).
    Returns the checkpoint tensor names the loader can skip."""
    plan: list[tuple[nn.Module, str, nn.Module]] = []
    taken: set[str] = set()
    decoder = [(p, o, a, n) for p, o, a, n in _decoder_linears(model, checkpoint_names)]
    tied = model.config.tie_word_embeddings
    head = [("lm_head", cast(nn.Module, model), "lm_head", [] if tied else ["lm_head.weight"])]
    if tied and not any(n.startswith("lm_head.") for n in tensors):
        head = []  # the stored embedding table serves as the head (use_stored_embedding)
    for path, owner, attr, names in [*decoder, *head]:
        lin = getattr(owner, attr)
        if not isinstance(lin, Linear):
            raise ValueError(f"{path} is not an fp32 layer to replace")
        shape = (lin.out_features, lin.in_features)
        if f"{path}.int8.qweight" in tensors:
            q, sc = tensors[f"{path}.int8.qweight"], tensors[f"{path}.int8.scales"]
            if tuple(q.shape) != shape or q.dtype != torch.int8 or tuple(sc.shape) != shape[:1]:
                raise ValueError(f"{path}: cached int8 layer of the wrong shape")
            new: nn.Module = Int8Linear(q, sc, lin.bias)
        elif f"{path}.int4.packed" in tensors:
            new = Int4Linear.from_packed(tensors[f"{path}.int4.packed"], lin.in_features, lin.bias)
            if new.out_features != lin.out_features:
                raise ValueError(f"{path}: cached int4 layer of the wrong shape")
        else:
            raise ValueError(f"{path} is not in the cache")
        plan.append((owner, attr, new))
        taken.update(names)
    for owner, attr, new in plan:
        setattr(owner, attr, new)
    return taken
