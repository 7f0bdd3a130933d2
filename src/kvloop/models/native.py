"""The native decode path: a model's weights handed to the C++ decoder (kvloop.kernels).

The decoder runs a whole decode step (every layer, K/V written into the paged cache) in
one call; it reads the same tensors as the PyTorch modules, nothing is copied. Prefill
and anything the decoder does not cover stay on the modules, which are its reference.
"""

from __future__ import annotations

from typing import Any, Protocol, cast

import torch

from kvloop import kernels
from kvloop.kernels.linear import native_linear, packed_bf16
from kvloop.models.base import CausalLM
from kvloop.models.linear import Linear
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


# Batches from this many rows run a quantized layer's bf16 copy (see attach_native_linears).
BF16_MIN_ROWS = 16
# fp32 layers: decode batches up to 64 rows keep the native kernels (measured faster than
# oneDNN there), prefill-sized inputs run oneDNN's packed fp32 GEMM, as the modules do.
FP32_BATCHED_MIN_ROWS = 65


def bf16_gemm_fast() -> bool:
    """Whether this CPU has bf16 dot products (AVX512-BF16), which oneDNN's bf16 GEMM uses:
    ~2.3x the fp32 rate here. Without them bf16 is emulated, slower than the int8 kernels."""
    return bool(torch.cpu._is_avx512_bf16_supported())


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
    uses it wherever it measured faster than PyTorch's kernel (int8: every row count,
    prefill included; int4: decode-sized inputs, or every size with the bf16 copy).

    Where bf16 GEMMs are fast, each layer also gets a bf16 copy of its weights (2 bytes a
    weight) for batches of ``BF16_MIN_ROWS`` rows or more: prefill and large decode
    batches are compute-bound, and there the bf16 GEMM is ~2x faster. Its activations are
    rounded to bf16, finer than the int8 kernels' per-block rounding; the head's output
    (the logits) too, a step of 2^-8 of the logit, below the int8 weights' own error
    (benchmarks/quant_quality.py). Decode batches below that size still read only the
    quantized bytes."""
    wide = bf16_gemm_fast()
    for module in model.modules():
        if isinstance(module, Int8Linear | Int4Linear | BlockLinear):
            module.native = native_linear_of(module, float_acts=module is model.lm_head)
            if wide:
                module.native.set_batched(packed_bf16(module.dequantize()), BF16_MIN_ROWS)


def native_prefill_ready(model: CausalLM) -> bool:
    """Whether prefill-sized inputs through the native decoder run GEMMs at least as fast as
    the modules': every layer but the head (only sampled rows reach it) has oneDNN's path
    for large inputs (fp32 packed, or a quantized layer's bf16 copy), or is int8, whose
    native kernel the modules use at every size anyway. Call after attach_native_linears.
    False for an architecture the decoder does not run."""
    if not native_supported(model):
        return False
    head = model.lm_head
    for m in model.modules():
        if m is head:
            continue
        if isinstance(m, Int8Linear | BlockLinear):  # native at every size in the modules too
            ok = m.native is not None
        elif isinstance(m, Int4Linear):
            ok = m.native is not None and m.native.batched_min_rows > 0
        elif isinstance(m, Linear):
            ok = m.packed is not None
        else:
            continue
        if not ok:
            return False
    return True


def build_native_decoder(model: CausalLM) -> Any | None:
    """A ``Decoder`` over the model's weights (attaching the quantized layers' kernels), or
    None without the native kernels, for an architecture it does not compute, or when a
    fp32 layer's dense weight was dropped."""
    if not kernels.available() or not native_supported(model):
        return None
    model = cast(LlamaForCausalLM, model)  # the one layer shape the decoder computes
    c = model.config
    head = model.lm_head
    # fp32 layers packed without keep_dense have no dense weight left to read; then the
    # PyTorch path serves every step. Only a tied head may lack it (the embedding is it).
    dropped = [m for m in model.linears() if m.weight.numel() == 0]
    if any(m is not head or not c.tie_word_embeddings for m in dropped):
        return None
    attach_native_linears(model)

    def native(module: object) -> Any:
        lin = getattr(module, "native", None)
        if lin is None:  # fp32: the kernel over the dense weight, oneDNN's for prefill
            lin = native_linear_of(module)
            packed = getattr(module, "packed", None)
            if packed is not None:
                lin.set_batched(packed, FP32_BATCHED_MIN_ROWS)
        return lin

    # A tied head whose dense copy was dropped reads the embedding table, the same matrix.
    # An int8 head keeps fp32 activations: rounding its input to int8 moved the first
    # greedy token of 2 of 8 chat replies (benchmarks/quant_quality.py).
    lm_head = (native_linear(F32, model.embed_tokens.detach(), c.hidden_size)
               if head in dropped else native(head))
    dec = kernels.native_module().Decoder(
        c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps,
        model.embed_tokens.detach(), model.rope.cos, model.rope.sin,
        model.norm.weight.detach(), lm_head)
    for layer in model.layers:
        layer = cast(DecoderLayer, layer)
        attn, mlp = layer.self_attn, layer.mlp
        dec.add_layer(layer.input_layernorm.weight.detach(), native(attn.qkv_proj),
                      native(attn.o_proj), layer.post_attention_layernorm.weight.detach(),
                      native(mlp.gate_up_proj), native(mlp.down_proj))
    return dec
