"""What every architecture offers: the model interface the runner, the quantization pass and
the native step call, and the record (`Architecture`) through which the loader reads a
checkpoint of it: config mapping, tensor names and shapes, and how its layers map onto the
native step's per-layer description (LayerSpec).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from kvloop.config import ModelConfig
from kvloop.models.attention import AttentionMetadata
from kvloop.models.linear import Linear
from kvloop.quant.kv import PagedKV


class CausalLM(Protocol):
    """A decoder-only language model over the paged KV cache. Weights arrive by their HF
    names; linear layers named ``qkv_proj`` / ``o_proj`` / ``gate_up_proj`` /
    ``down_proj`` under ``layers[i].self_attn`` and ``.mlp`` (the quantization pass swaps
    them), the head is ``lm_head``."""

    config: ModelConfig
    embed_tokens: nn.Parameter  # [vocab, hidden] fp32; empty when embed_stored holds it
    # The embedding table as a checkpoint's blocks (kvloop.quant.BlockLinear: rows decoded
    # as tokens look them up), or None; with tied embeddings it is the head itself.
    embed_stored: nn.Module | None
    layers: nn.ModuleList

    @property
    def lm_head(self) -> nn.Module: ...

    def __call__(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        meta: AttentionMetadata,
        kv_caches: list[PagedKV] | None = None,  # one per layer
    ) -> torch.Tensor: ...  # [T, hidden], final-normed

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...  # [N, hidden] -> [N, V]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor: ...  # [T] -> [T, hidden] fp32

    # `preloaded`: checkpoint tensors whose layers were built already (from stored codes).
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]],
                     preloaded: Collection[str] = ()) -> None: ...

    def pack_weights(self) -> None: ...

    def linears(self) -> list[Linear]: ...

    def decode_read_bytes(self) -> int:
        """Weight bytes one decode step reads (kvloop.models.llama.weight_read_bytes)."""
        ...

    def modules(self) -> Iterator[nn.Module]: ...

    def eval(self) -> nn.Module: ...  # inference mode for the modules (nn.Module's)


class ConfigReader(Protocol):
    """A checkpoint's metadata, as the loader's readers expose it to an architecture: each
    read checked (present, of the right type, positive) and a bad value refused in one
    ModelLoadError line naming its key. Keys are config.json keys, or GGUF keys after the
    ``<architecture>.`` prefix."""

    def get(self, key: str, default: Any = None) -> Any: ...

    def get_int(self, key: str, default: int | None = None) -> int: ...

    def get_float(self, key: str, default: float) -> float: ...

    def where(self, key: str) -> str:
        """The key as a message names it ("gemma3.attention.sliding_window = 512")."""
        ...


# One dimension of an expected tensor shape: its size and the ModelConfig fields that set
# it (for the loader's messages).
Dim = tuple[int, tuple[str, ...]]


def config_dims(c: ModelConfig) -> dict[str, Dim]:
    """The dimensions tensor shapes are made of, by short name."""
    return {
        "V": (c.vocab_size, ("vocab_size",)), "H": (c.hidden_size, ("hidden_size",)),
        "Q": (c.q_size, ("num_heads", "head_dim")),
        "KV": (c.kv_size, ("num_kv_heads", "head_dim")),
        "FF": (c.intermediate_size, ("intermediate_size",)),
        "D": (c.head_dim, ("head_dim",)), "D2": (c.head_dim // 2, ("head_dim",)),
    }


def _same_config(reader: ConfigReader, config: ModelConfig) -> ModelConfig:
    return config


def _same_tensor(name: str, w: np.ndarray) -> np.ndarray:
    return w


SILU, GELU_TANH = "silu", "gelu_pytorch_tanh"  # the gated MLPs' activations


@dataclass(frozen=True)
class LayerSpec:
    """One decoder layer as the native step computes it: its weights and the families'
    differences as data (pre-norm with Llama's w or Gemma's folded 1 + w, Gemma's post-norms,
    QK-norm, activation, attention scale and soft-capping, window, rope table). Linear
    layers are the model's own modules (fused q/k/v with its bias, fused gate/up)."""

    attn_norm: torch.Tensor  # [hidden] the factor the norm multiplies by
    qkv: nn.Module  # [q; k; v] rows
    o_proj: nn.Module
    mlp_norm: torch.Tensor  # [hidden]
    gate_up: nn.Module  # [gate; up] rows
    down: nn.Module
    scale: float  # attention: softmax(q . k * scale)
    activation: str = SILU
    # Gemma's "sandwich": each block's output normed before its residual add.
    post_attn_norm: torch.Tensor | None = None  # [hidden]
    post_mlp_norm: torch.Tensor | None = None  # [hidden]
    q_norm: torch.Tensor | None = None  # [head_dim]: QK-norm, per head before rope
    k_norm: torch.Tensor | None = None
    window: int = 0  # sliding window (keys a query sees, its own included); 0: all
    rope: int = 0  # index into ModelSpec.ropes
    attn_softcap: float | None = None  # scores = cap * tanh(scores / cap) (Gemma 2)


@dataclass(frozen=True)
class ModelSpec:
    """A whole model as the native step computes it (kvloop.models.native)."""

    layers: list[LayerSpec]
    ropes: list[tuple[torch.Tensor, torch.Tensor]]  # (cos, sin) [max_positions, head_dim]
    final_norm: torch.Tensor  # [hidden]
    embed_scale: float = 1.0  # multiplies the embedding rows (Gemma: sqrt(hidden))
    final_softcap: float | None = None  # logits = cap * tanh(logits / cap)


@dataclass(frozen=True)
class Architecture:
    """One architecture as the loader and the engine see it."""

    name: str  # GGUF general.architecture / HF model_type
    model_class: Callable[[ModelConfig], CausalLM]
    # Expected tensors (HF names) and their shapes, checked against the file's headers.
    tensor_shapes: Callable[[ModelConfig], dict[str, tuple[Dim, ...]]]
    # GGUF tensor names -> HF names: per-layer suffixes (blk.N.<gguf> -> model.layers.N.<hf>)
    # and whole-model names.
    gguf_layer_names: Mapping[str, str] = field(default_factory=dict)
    gguf_global_names: Mapping[str, str] = field(default_factory=dict)
    # Whether llama.cpp's converter permuted the Q/K rows (interleaved rope in llama.cpp).
    gguf_permute_qk: bool = False
    # The architecture's own hyper-parameters, on top of those every architecture has
    # (which the loader's readers fill): from GGUF metadata and from config.json.
    gguf_config: Callable[[ConfigReader, ModelConfig], ModelConfig] = _same_config
    hf_config: Callable[[ConfigReader, ModelConfig], ModelConfig] = _same_config
    # A GGUF tensor as llama.cpp stores it -> the HF convention load_weights expects.
    gguf_tensor: Callable[[str, np.ndarray], np.ndarray] = _same_tensor
    # How a model of it maps onto the native step's description (kvloop.models.native);
    # None: the native step does not run this architecture.
    describe: Callable[[Any], ModelSpec] | None = None
