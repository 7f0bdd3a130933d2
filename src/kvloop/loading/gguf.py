"""GGUF files: metadata, the model config, and tensors renamed to the Hugging Face layout.

The weights are dequantized with the `gguf` package's own quant code (the reference
implementation of every block format), and the Llama Q/K rows are un-permuted so one model
class serves GGUF and safetensors checkpoints alike.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Collection, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeGuard, TypeVar

import gguf
import numpy as np
import torch

from kvloop.config import ModelConfig
from kvloop.errors import ModelLoadError
from kvloop.loading.gguf_reader import GGUFHeader, TensorInfo
from kvloop.models.base import Architecture
from kvloop.models.registry import get_architecture
from kvloop.quant.int4 import GROUP_SIZE, Int4Weights
from kvloop.quant.stored import BLOCK_TYPES, Weights, stored

GGUF_MAGIC = b"GGUF"

# Block formats kvloop dequantizes (through gguf.quants); anything else is refused by name.
SUPPORTED_TYPES = {
    gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16,
    gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1,
    gguf.GGMLQuantizationType.Q5_0, gguf.GGMLQuantizationType.Q5_1,
    gguf.GGMLQuantizationType.Q2_K, gguf.GGMLQuantizationType.Q3_K,
    gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q5_K,
    gguf.GGMLQuantizationType.Q6_K,
}

_W = TypeVar("_W")
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")


def is_gguf(path: Path) -> bool:
    try:
        with path.open("rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def gguf_name(name: str, arch: Architecture) -> str:
    """HF state-dict name -> GGUF tensor name (the inverse of hf_name), for messages."""
    for gg, hf in arch.gguf_global_names.items():
        if hf == name:
            return gg
    m = _HF_LAYER.fullmatch(name)
    if m:
        for gg, hf in arch.gguf_layer_names.items():
            if hf == m.group(2):
                return f"blk.{m.group(1)}.{gg}"
    return name


def hf_name(name: str, arch: Architecture) -> str | None:
    """GGUF tensor name -> HF state-dict name (None for tensors kvloop does not use)."""
    if name in arch.gguf_global_names:
        return arch.gguf_global_names[name]
    m = _BLOCK.fullmatch(name)
    if m and m.group(2) in arch.gguf_layer_names:
        return f"model.layers.{m.group(1)}.{arch.gguf_layer_names[m.group(2)]}"
    return None


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo the converter's row permutation of a Q or K projection (HF rotate-half layout).

    The converter grouped each head's rows as (2, head_dim/2) -> (head_dim/2, 2) so that
    llama.cpp's interleaved rope sees HF's halves; the inverse swaps the two axes back.
    """
    rows = w.shape[0]
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class GGUFFile:
    """One GGUF file, opened memory-mapped."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise ModelLoadError(f"model file not found: {self.path}")
        if not is_gguf(self.path):
            raise ModelLoadError(f"{self.path} is not a GGUF file (bad magic bytes)")
        try:
            self.reader = GGUFHeader(self.path)
        except (ValueError, OSError) as e:  # truncated or corrupt: name it, no traceback
            raise ModelLoadError(f"{self.path} is not a readable GGUF file: {e}") from e
        self.metadata: dict[str, Any] = self.reader.metadata
        self.architecture = str(self.metadata.get("general.architecture", ""))
        self.arch = get_architecture(self.architecture, self.path.name)

    def drop_vocabulary(self) -> None:
        """Forget the tokenizer's arrays (tokens, scores, types, merges) once the tokenizer
        holds them: the weights' accessors keep this file open for the engine's life, and
        as Python lists a 262k vocabulary took ~30 MiB."""
        for key in [k for k, v in self.metadata.items()
                    if k.startswith("tokenizer.ggml.") and isinstance(v, list)]:
            del self.metadata[key]

    # The ConfigReader an Architecture reads its own hyper-parameters through.
    def get(self, key: str, default: Any = None) -> Any:
        return self._get(key, default)

    def get_int(self, key: str, default: int | None = None) -> int:
        return self._int(key, default)

    def get_float(self, key: str, default: float) -> float:
        return self._float(key, default)

    def where(self, key: str) -> str:
        return f"{self.path.name}: GGUF key {self.architecture}.{key}"

    def hf_name(self, name: str) -> str | None:
        return hf_name(name, self.arch)

    def gguf_name(self, name: str) -> str:
        return gguf_name(name, self.arch)

    def _get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(f"{self.architecture}.{key}", default)

    def _int(self, key: str, default: int | None = None) -> int:
        """A positive integer hyper-parameter, or one ModelLoadError line naming the key and
        the value: a crafted file must not reach the model with 0, -1 or "abc"."""
        name = f"{self.architecture}.{key}"
        value = self.metadata.get(name, default)
        if value is None:
            raise ModelLoadError(f"{self.path.name}: GGUF key {name} is missing")
        if isinstance(value, list):  # per-layer arrays (head_count_kv): one value for all
            if not value or any(v != value[0] for v in value):
                raise ModelLoadError(
                    f"{self.path.name}: GGUF key {name} = {_short(value)}: per-layer values "
                    "that differ are not supported"
                )
            value = value[0]
        if isinstance(value, bool) or not isinstance(value, int | np.integer) or value <= 0:
            raise ModelLoadError(
                f"{self.path.name}: GGUF key {name} = {_short(value)}: must be a positive integer"
            )
        return int(value)

    def _float(self, key: str, default: float) -> float:
        name = f"{self.architecture}.{key}"
        value = self.metadata.get(name, default)
        if isinstance(value, bool) or not isinstance(value, int | float | np.number) \
                or not math.isfinite(value) or value <= 0:
            raise ModelLoadError(
                f"{self.path.name}: GGUF key {name} = {_short(value)}: must be a positive number"
            )
        return float(value)

    def config_keys(self) -> dict[str, str]:
        """ModelConfig field -> the metadata it was read from, for messages."""
        a = self.architecture
        vocab = (f"{a}.vocab_size" if f"{a}.vocab_size" in self.metadata
                 else "the count of tokenizer.ggml.tokens")
        head_dim = (f"{a}.attention.key_length" if f"{a}.attention.key_length" in self.metadata
                    else f"head_dim ({a}.embedding_length / {a}.attention.head_count)")
        return {
            "vocab_size": vocab,
            "hidden_size": f"{a}.embedding_length",
            "intermediate_size": f"{a}.feed_forward_length",
            "num_layers": f"{a}.block_count",
            "num_heads": f"{a}.attention.head_count",
            "num_kv_heads": f"{a}.attention.head_count_kv",
            "head_dim": head_dim,
            "max_position_embeddings": f"{a}.context_length",
            "rms_norm_eps": f"{a}.attention.layer_norm_rms_epsilon",
            "rope_theta": f"{a}.rope.freq_base",
        }

    def config(self) -> ModelConfig:
        """The hyper-parameters, each present, of the right type and positive; their upper
        limits and their agreement with the tensors are checked by loader.check_model."""
        arch = self.architecture
        n_heads = self._int("attention.head_count")
        hidden = self._int("embedding_length")
        n_kv = self._int("attention.head_count_kv", n_heads)
        key_length = self._get("attention.key_length")
        if key_length is None and hidden % n_heads:
            raise ModelLoadError(
                f"{self.path.name}: GGUF key {arch}.embedding_length = {hidden} is not a "
                f"multiple of {arch}.attention.head_count = {n_heads}"
            )
        tokens = self.metadata.get("tokenizer.ggml.tokens")
        vocab = self._int("vocab_size", len(tokens) if isinstance(tokens, list) and tokens
                          else None)
        names = {t.name for t in self.reader.tensors}
        rope_scaling = None
        if self._get("rope.scaling.type") == "linear":
            factor = self._float("rope.scaling.factor", math.nan)
            rope_scaling = {"rope_type": "linear", "factor": factor}
        eos_ids = [self.metadata.get(k) for k in (
            "tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
            "tokenizer.ggml.eom_token_id")]
        bos = self.metadata.get("tokenizer.ggml.bos_token_id")
        config = ModelConfig(
            architecture=arch,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=self._int("feed_forward_length"),
            num_layers=self._int("block_count"),
            num_heads=n_heads,
            num_kv_heads=n_kv,
            head_dim=self._int("attention.key_length", hidden // n_heads),
            max_position_embeddings=self._int("context_length", 2048),
            rms_norm_eps=self._float("attention.layer_norm_rms_epsilon", 1e-5),
            rope_theta=self._float("rope.freq_base", 10000.0),
            rope_scaling=rope_scaling,
            tie_word_embeddings="output.weight" not in names,
            attention_bias="blk.0.attn_q.bias" in names,
            bos_token_id=int(bos) if _is_id(bos) else None,
            eos_token_ids=tuple(int(e) for e in eos_ids if _is_id(e)),
        )
        return self.arch.gguf_config(self, config)

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """HF name -> shape in numpy order ((rows, cols) for a matrix) of every tensor the
        model uses, read from the header: nothing is loaded."""
        return {name: tuple(int(d) for d in reversed(t.shape))
                for t in self.reader.tensors if (name := self.hf_name(t.name)) is not None}

    def check_tensors(self) -> None:
        """Every tensor the model uses is in a type kvloop reads, with whole blocks per row."""
        for t in self.reader.tensors:
            if self.hf_name(t.name) is None:
                continue
            if t.tensor_type not in SUPPORTED_TYPES:
                raise ModelLoadError(
                    f"tensor {t.name} uses quantization type {t.tensor_type.name}, which kvloop "
                    f"does not support (supported: {sorted(q.name for q in SUPPORTED_TYPES)})"
                )
            block = gguf.GGML_QUANT_SIZES[t.tensor_type][0]
            if len(t.shape) == 0 or int(t.shape[0]) % block:
                raise ModelLoadError(
                    f"{self.path.name}: tensor {t.name} has shape "
                    f"{[int(d) for d in reversed(t.shape)]}: rows must be whole "
                    f"{t.tensor_type.name} blocks of {block}"
                )

    def tensors(self, config: ModelConfig,
                skip: Collection[str] = ()) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (HF name, fp32 tensor) for every weight the model uses but those in `skip`
        (layers already built from their stored blocks: nothing is dequantized for them)."""
        permute = self.arch.gguf_permute_qk
        self.check_tensors()
        for t in self.reader.tensors:
            name = self.hf_name(t.name)
            if name is None or name in skip:
                continue
            w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
            # numpy order is the reverse of GGML's ne[]: (rows, cols) for a 2-D weight.
            w = w.reshape([int(d) for d in reversed(t.shape)])
            if permute and name.endswith(("q_proj.weight", "q_proj.bias")):
                w = unpermute_qk(w, config.num_heads)
            elif permute and name.endswith(("k_proj.weight", "k_proj.bias")):
                w = unpermute_qk(w, config.num_kv_heads)
            w = self.arch.gguf_tensor(name, w)
            # F32 tensors are read-only views of the memory map: copy only those.
            yield name, torch.from_numpy(np.require(w, requirements=["C", "W"]))
            self.reader.release(t.offset, t.nbytes)  # converted: its pages are not needed

    def quantized_linears(self) -> bool:
        """Whether any 2-D tensor the model uses is stored in a block format kvloop computes
        as stored (what quantization "auto" resolves to "gguf" on)."""
        return any(len(t.shape) == 2 and t.tensor_type in BLOCK_TYPES
                   and self.hf_name(t.name) is not None for t in self.reader.tensors)

    def _stored(self, kinds: Collection[gguf.GGMLQuantizationType]) -> dict[str, TensorInfo]:
        """HF name -> the 2-D tensors the model uses that are stored in one of `kinds`."""
        return {name: t for t in self.reader.tensors
                if (name := self.hf_name(t.name)) is not None and len(t.shape) == 2
                and t.tensor_type in kinds}

    def _row_order(self, name: str, rows: int, config: ModelConfig) -> np.ndarray | None:
        """The un-permutation of a Q or K projection's rows (None: rows as stored)."""
        if not self.arch.gguf_permute_qk:
            return None
        heads = {"q_proj.weight": config.num_heads, "k_proj.weight": config.num_kv_heads}
        for suffix, n in heads.items():
            if name.endswith(suffix):
                return unpermute_qk(np.arange(rows), n)
        return None

    def block_weights(self, config: ModelConfig) -> Mapping[str, Weights]:
        """Every 2-D tensor in a block format (kvloop.quant.stored), as its blocks or its
        codes and group scales, exactly as stored, renamed and un-permuted like `tensors`;
        each one read when it is looked up (one layer's worth in memory at a time)."""
        self.check_tensors()

        def read(name: str, t: TensorInfo) -> Weights:
            rows, cols = (int(d) for d in reversed(t.shape))
            # Each slice's pages dropped once read: stored() copies or decodes what it needs.
            w = stored(np.asarray(t.data), t.tensor_type, rows, cols,
                       done=lambda lo, hi: self.reader.release(t.offset + lo, hi - lo))
            order = self._row_order(name, rows, config)
            return w if order is None else w.rows(torch.from_numpy(order))

        return _Lazy(self._stored(BLOCK_TYPES), read)

    def int4_weights(self, config: ModelConfig) -> Mapping[str, Int4Weights]:
        """The Q4_0 / Q4_1 tensors as 4-bit codes with group scales and zeros, exactly as
        stored (no re-quantization), renamed and un-permuted like `tensors`; each one
        unpacked when it is looked up."""
        Q4_0, Q4_1 = gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1

        def read(name: str, t: TensorInfo) -> Int4Weights:
            rows, cols = (int(d) for d in reversed(t.shape))
            w = _unpack_q4(np.asarray(t.data), t.tensor_type == Q4_1)
            codes, scales, zeros = (a.reshape(rows, -1) for a in w)
            order = self._row_order(name, rows, config)
            if order is not None:
                codes, scales, zeros = codes[order], scales[order], zeros[order]
            assert codes.shape == (rows, cols)
            weights = Int4Weights(*(torch.from_numpy(np.ascontiguousarray(a))
                                    for a in (codes, scales, zeros)))
            self.reader.release(t.offset, t.nbytes)  # the arrays above are copies
            return weights

        return _Lazy(self._stored((Q4_0, Q4_1)), read)


class _Lazy(Mapping[str, _W]):
    """Name -> a tensor's weights, read from the map each time it is looked up."""

    def __init__(self, tensors: dict[str, TensorInfo],
                 read: Callable[[str, TensorInfo], _W]) -> None:
        self._tensors, self._read = tensors, read

    def __getitem__(self, name: str) -> _W:
        return self._read(name, self._tensors[name])

    def __contains__(self, name: object) -> bool:
        # Mapping's own `in` looks the item up: here that decodes the whole tensor, which
        # `name in blocks` checks did for every layer (twice the load's decoding, and a
        # transient copy of Gemma 3's 262k-row table).
        return name in self._tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)


def _is_id(value: Any) -> TypeGuard[int]:
    return bool(isinstance(value, int | np.integer) and not isinstance(value, bool)
                and value >= 0)


def _short(value: Any) -> str:
    """A metadata value for a one-line message (a crafted file can hold megabytes)."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _unpack_q4(raw: np.ndarray, with_min: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """GGUF Q4_0 (d, 16 bytes) / Q4_1 (d, m, 16 bytes) blocks of 32 weights -> codes
    [blocks, 32] uint8, scales and zeros [blocks] fp32 with w = scale * (q - 8) + zero.

    In a block, byte j holds weight j in its low nibble and weight j + 16 in its high one.
    """
    head = 4 if with_min else 2
    blocks = raw.reshape(-1, head + GROUP_SIZE // 2)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)[:, 0]
    qs = blocks[:, head:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.uint8)
    if with_min:  # w = d * q + m = d * (q - 8) + (m + 8 d)
        m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)[:, 0]
        return codes, d, m + 8.0 * d
    return codes, d, np.zeros_like(d)  # w = d * (q - 8)
