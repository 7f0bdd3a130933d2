"""The native decode path: a model's weights handed to the C++ decoder (kvloop.kernels).

The decoder runs a whole step (every layer, K/V written into the paged cache of each
layer's KV cache group) in one call; it reads the same tensors as the PyTorch modules,
nothing is copied. What it computes per layer is the architecture's description
(Architecture.describe -> kvloop.models.base.ModelSpec): one decoder for every family.
Anything the decoder does not cover stays on the modules, which are its reference.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, cast

import torch

from kvloop import dispatch, kernels
from kvloop.kernels.linear import native_linear, native_stack
from kvloop.models.base import GELU_TANH, SILU, CausalLM, LayerSpec, ModelSpec
from kvloop.models.registry import get_architecture
from kvloop.quant import BlockLinear, Int4Linear, Int8Linear, StackedLinear
from kvloop.quant.layout import F32, WIDE_ACTS_KINDS


class _NativeLinear(Protocol):
    def native_spec(self) -> tuple[int, torch.Tensor, int, torch.Tensor | None,
                                   torch.Tensor | None]: ...


def native_linear_of(module: object, wide_acts: bool = False) -> Any:
    """The native kernel over a linear module's weights (fp32, int8, int4 or a checkpoint's
    blocks), no copy. wide_acts applies to the kinds that take it (WIDE_ACTS_KINDS)."""
    kind, weight, in_features, scales, bias = cast(_NativeLinear, module).native_spec()
    return native_linear(kind, weight, in_features, scales, bias,
                         wide_acts=wide_acts and kind in WIDE_ACTS_KINDS)


# The activations the native step computes (kvloop.models.base), by its codes.
def _activation_codes() -> dict[str, int]:
    k = kernels.native_module()
    return {SILU: k.SILU, GELU_TANH: k.GELU_TANH}


def describe(model: CausalLM) -> ModelSpec | None:
    """The model as the native step's description (its architecture module's mapping), or
    None for an architecture that gives none."""
    mapping = get_architecture(model.config.architecture).describe
    return None if mapping is None else mapping(model)


def native_supported(model: CausalLM) -> bool:
    """Whether the C++ decoder computes this model: its architecture describes its layers
    (Architecture.describe) and no layer asks for what the decoder lacks (an activation
    other than SiLU or tanh GELU). Anything declined runs on the modules: a wrong answer
    is never the price of speed."""
    spec = describe(model)
    return spec is not None and all(layer.activation in (SILU, GELU_TANH)
                                    for layer in spec.layers)


def attach_native_linears(model: CausalLM) -> None:
    """Give every quantized layer its native kernel (``module.native``); its forward then
    uses it at every size.

    The layer's one layout serves every batch: small decode batches meet the int8 row
    kernels (they read only the quantized bytes); from 8 or 16 rows (kvloop.dispatch), decode
    batches and prefill alike, the int8 GEMM, which unpacks each tile of weight rows once
    for every activation row (the same int8 or, for the head, int16 activations and
    integer sums as the row kernels). The layers the int8 GEMM does not take (a head's 8-bit
    codes without VNNI) decode the weights a chunk of rows at a time into a float GEMM for such
    batches, in bf16 where AVX512-BF16 makes that ~2x faster (activations rounded to bf16),
    else fp32."""
    min_rows, bf16 = dispatch.quantized_batched_path()

    def policy(native: Any) -> None:
        if native.gemm_supported:
            native.set_int8_gemm(dispatch.int8_gemm_min_rows(native))
        else:
            native.set_batched_decode(min_rows, bf16)

    for module in model.modules():
        if isinstance(module, Int8Linear | Int4Linear | BlockLinear):
            module.native = native_linear_of(module, wide_acts=module is model.lm_head)
            policy(module.native)
    # Stacks after their parts (modules() lists a parent first).
    for module in model.modules():
        if isinstance(module, StackedLinear):
            module.native = native_stack([p.native for p in module.blocks()])
            policy(module.native)


def native_prefill_ready(model: CausalLM) -> bool:
    """Whether prefill-sized inputs through the native decoder run GEMMs at least as fast as
    the modules': every layer but the head (only sampled rows reach it) has a batched path
    (quantized layers: attach_native_linears; fp32 ones: the decoder's own). Call after
    attach_native_linears. False for an architecture the decoder does not run."""
    if not native_supported(model):
        return False
    head = model.lm_head
    return all(m.native is not None and dispatch.has_batched_path(m.native)
               for m in model.modules()
               if m is not head and isinstance(m, Int8Linear | Int4Linear | BlockLinear))


def build_native_decoder(model: CausalLM, layer_group: Sequence[int] | None = None) -> Any | None:
    """A ``Decoder`` over the model's weights (attaching the quantized layers' kernels), or
    None without the native kernels, for a model it does not compute, or when a fp32
    layer's dense weight was dropped. `layer_group`: per layer, the KV cache group whose
    block table its cache follows (None: one group)."""
    if not kernels.available() or not native_supported(model):
        return None
    spec = describe(model)
    assert spec is not None
    c = model.config
    head = model.lm_head
    # fp32 layers packed for oneDNN have no dense weight left to read; then the
    # PyTorch path serves every step. Only a tied head may lack it (the embedding is it).
    dropped = [m for m in model.linears() if m.weight.numel() == 0]
    if any(m is not head or not c.tie_word_embeddings for m in dropped):
        return None
    attach_native_linears(model)

    def native(module: object) -> Any:
        lin = getattr(module, "native", None)
        if lin is None:  # fp32: the kernel over the dense weight, ATen's GEMM for batches
            lin = native_linear_of(module)
            lin.set_batched_decode(dispatch.fp32_batched_min_rows())
        return lin

    # A tied head whose dense copy was dropped reads the embedding table, the same matrix.
    # An int8 head takes int16 activations: rounding its input to int8 moved the first
    # greedy token of 2 of 8 chat replies (benchmarks/quant_quality.py).
    lm_head = (native_linear(F32, model.embed_tokens.detach(), c.hidden_size)
               if head in dropped else native(head))
    # The embedding: its stored blocks (rows decoded as tokens look them up) or fp32.
    embed = (native(model.embed_stored) if model.embed_stored is not None
             else native_linear(F32, model.embed_tokens.detach(), c.hidden_size))
    k = kernels.native_module()
    (cos, sin), *more_ropes = spec.ropes
    dec = k.Decoder(c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps, embed, cos, sin,
                    spec.final_norm, lm_head, embed_scale=spec.embed_scale,
                    final_softcap=spec.final_softcap or 0.0)
    for cos, sin in more_ropes:
        dec.add_rope(cos, sin)
    groups = layer_group or [0] * len(spec.layers)
    for layer, group in zip(spec.layers, groups, strict=True):
        dec.add_layer(layer.attn_norm, native(layer.qkv), native(layer.o_proj), layer.mlp_norm,
                      native(layer.gate_up), native(layer.down), _layer_spec(k, layer, group),
                      layer.post_attn_norm, layer.post_mlp_norm, layer.q_norm, layer.k_norm)
    return dec


def _layer_spec(k: Any, layer: LayerSpec, group: int) -> Any:
    """The C++ decoder's plain struct for one layer (its weights go alongside)."""
    out = k.LayerSpec()
    out.post_norms = layer.post_attn_norm is not None
    out.activation = _activation_codes()[layer.activation]
    out.scale, out.window, out.group, out.rope = layer.scale, layer.window, group, layer.rope
    out.softcap = layer.attn_softcap or 0.0
    return out
