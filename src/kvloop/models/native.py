"""The native decode path: a model's weights handed to the C++ decoder (kvloop.kernels).

The decoder runs a whole decode step (every layer, K/V written into the paged cache) in
one call; it reads the same tensors as the PyTorch modules, nothing is copied. Prefill
and anything the decoder does not cover stay on the modules, which are its reference.
"""

from __future__ import annotations

from typing import Any, Protocol, cast

import torch

from kvloop import dispatch, kernels
from kvloop.kernels.linear import native_linear
from kvloop.models.base import CausalLM
from kvloop.models.llama import DecoderLayer, LlamaForCausalLM
from kvloop.models.registry import get_architecture
from kvloop.quant import BlockLinear, Int4Linear, Int8Linear
from kvloop.quant.layout import F32, Q8, Q8B


class _NativeLinear(Protocol):
    def native_spec(self) -> tuple[int, torch.Tensor, int, torch.Tensor | None,
                                   torch.Tensor | None]: ...


def native_linear_of(module: object, float_acts: bool = False) -> Any:
    """The native kernel over a linear module's weights (fp32, int8, int4 or a checkpoint's
    blocks), no copy. float_acts applies to the 8-bit kinds only."""
    kind, weight, in_features, scales, bias = cast(_NativeLinear, module).native_spec()
    return native_linear(kind, weight, in_features, scales, bias,
                         float_acts=float_acts and kind in (Q8, Q8B))


def native_supported(model: CausalLM) -> bool:
    """Whether the C++ decoder computes this model (it hard-codes the Llama layer: pre-norms
    only, SiLU, no QK-norm, full attention, no softcapping). An architecture must say it is
    that layer (Architecture.native); a model of it whose config asks for more (a sliding
    window that can bite: Mistral, Phi-3, Qwen with use_sliding_window) is declined too.
    Anything declined runs on the modules: a wrong answer is never the price of speed."""
    c = model.config
    if not get_architecture(c.architecture).native:
        return False
    window_bites = c.sliding_window is not None and c.sliding_window < \
        c.max_position_embeddings and any(c.is_sliding(i) for i in range(c.num_layers))
    return not (window_bites or c.hidden_act != "silu" or c.attn_logit_softcapping is not None
                or c.final_logit_softcapping is not None)


def attach_native_linears(model: CausalLM) -> None:
    """Give every quantized layer its native kernel (``module.native``); its forward then
    uses it at every size.

    The layer's one layout serves every batch: decode-sized batches meet the int8 kernels
    (they read only the quantized bytes); from the policy's row count on (kvloop.dispatch:
    prefill and large decode batches, compute-bound) the kernel decodes the weights a
    chunk of rows at a time into a GEMM, in bf16 where AVX512-BF16 makes that ~2x faster
    (activations rounded to bf16, finer than the int8 kernels' per-block rounding; the
    head's logits too, a step of 2^-8 of the logit, below the int8 weights' own error:
    benchmarks/quant_quality.py), else in fp32."""
    min_rows, bf16 = dispatch.quantized_batched_path()
    for module in model.modules():
        if isinstance(module, Int8Linear | Int4Linear | BlockLinear):
            module.native = native_linear_of(module, float_acts=module is model.lm_head)
            module.native.set_batched_decode(min_rows, bf16)


def native_prefill_ready(model: CausalLM) -> bool:
    """Whether prefill-sized inputs through the native decoder run GEMMs at least as fast as
    the modules': every layer but the head (only sampled rows reach it) has a batched path
    (quantized layers: attach_native_linears; fp32 ones: the decoder's own). Call after
    attach_native_linears. False for an architecture the decoder does not run."""
    if not native_supported(model):
        return False
    head = model.lm_head
    return all(m.native is not None and m.native.batched_min_rows > 0
               for m in model.modules()
               if m is not head and isinstance(m, Int8Linear | Int4Linear | BlockLinear))


def build_native_decoder(model: CausalLM) -> Any | None:
    """A ``Decoder`` over the model's weights (attaching the quantized layers' kernels), or
    None without the native kernels, for an architecture it does not compute, or when a
    fp32 layer's dense weight was dropped."""
    if not kernels.available() or not native_supported(model):
        return None
    model = cast(LlamaForCausalLM, model)  # the one layer shape the decoder computes
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
    # An int8 head keeps fp32 activations: rounding its input to int8 moved the first
    # greedy token of 2 of 8 chat replies (benchmarks/quant_quality.py).
    lm_head = (native_linear(F32, model.embed_tokens.detach(), c.hidden_size)
               if head in dropped else native(head))
    # The embedding: its stored blocks (rows decoded as tokens look them up) or fp32.
    embed = (native(model.embed_stored) if model.embed_stored is not None
             else native_linear(F32, model.embed_tokens.detach(), c.hidden_size))
    dec = kernels.native_module().Decoder(
        c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps, embed, model.rope.cos,
        model.rope.sin, model.norm.weight.detach(), lm_head)
    for layer in model.layers:
        layer = cast(DecoderLayer, layer)
        attn, mlp = layer.self_attn, layer.mlp
        dec.add_layer(layer.input_layernorm.weight.detach(), native(attn.qkv_proj),
                      native(attn.o_proj), layer.post_attention_layernorm.weight.detach(),
                      native(mlp.gate_up_proj), native(mlp.down_proj))
    return dec
