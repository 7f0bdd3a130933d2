"""GGUF files: metadata, the model config, and tensors renamed to the Hugging Face layout.

The weights are dequantized with the `gguf` package's own quant code (the reference
implementation of every block format), and the Llama Q/K rows are un-permuted so one model
class serves GGUF and safetensors checkpoints alike.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from kvloop.config import ModelConfig
from kvloop.errors import ModelLoadError
from kvloop.quant.int4 import GROUP_SIZE, Int4Weights

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

# GGUF architectures kvloop runs, and whether the converter permuted Q/K rows for them
# (llama.cpp applies rope to interleaved pairs for these; HF rotates halves).
ARCHITECTURES = {"llama": True, "mistral": True, "qwen2": False}

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "rope_freqs.weight": "model.rope_freqs",
}
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")


def is_gguf(path: Path) -> bool:
    try:
        with path.open("rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def hf_name(name: str) -> str | None:
    """GGUF tensor name -> HF state-dict name (None for tensors kvloop does not use)."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = _BLOCK.fullmatch(name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
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
            self.reader = gguf.GGUFReader(self.path)
        except Exception as e:  # a truncated or corrupt file: name it, don't dump a traceback
            raise ModelLoadError(f"{self.path} is not a readable GGUF file: {e}") from e
        self.metadata: dict[str, Any] = {}
        for key, field in self.reader.fields.items():
            if key.startswith("GGUF."):
                continue
            try:
                self.metadata[key] = field.contents()
            except Exception:  # exotic field types we never read
                continue
        self.architecture = str(self.metadata.get("general.architecture", ""))
        if self.architecture not in ARCHITECTURES:
            raise ModelLoadError(
                f"unsupported architecture {self.architecture!r} in {self.path.name}; "
                f"kvloop runs {sorted(ARCHITECTURES)}"
            )

    def _get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(f"{self.architecture}.{key}", default)

    def config(self) -> ModelConfig:
        arch = self.architecture
        n_heads = int(self._get("attention.head_count"))
        hidden = int(self._get("embedding_length"))
        n_kv = self._get("attention.head_count_kv", n_heads)
        n_kv = int(n_kv if not isinstance(n_kv, list) else n_kv[0])
        vocab = self._get("vocab_size") or len(self.metadata.get("tokenizer.ggml.tokens", []))
        names = {t.name for t in self.reader.tensors}
        rope_scaling = None
        if self._get("rope.scaling.type") == "linear":
            factor = float(self._get("rope.scaling.factor"))
            rope_scaling = {"rope_type": "linear", "factor": factor}
        eos = self.metadata.get("tokenizer.ggml.eos_token_id")
        eos_ids = [eos] + [
            self.metadata[k] for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
            if k in self.metadata
        ]
        return ModelConfig(
            architecture=arch,
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(self._get("feed_forward_length")),
            num_layers=int(self._get("block_count")),
            num_heads=n_heads,
            num_kv_heads=n_kv,
            head_dim=int(self._get("attention.key_length", hidden // n_heads)),
            max_position_embeddings=int(self._get("context_length", 2048)),
            rms_norm_eps=float(self._get("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(self._get("rope.freq_base", 10000.0)),
            rope_scaling=rope_scaling,
            tie_word_embeddings="output.weight" not in names,
            attention_bias="blk.0.attn_q.bias" in names,
            bos_token_id=self.metadata.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=tuple(int(e) for e in eos_ids if e is not None),
        )

    def tensors(self, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (HF name, fp32 tensor) for every weight the model uses."""
        permute = ARCHITECTURES[self.architecture]
        for t in self.reader.tensors:
            name = hf_name(t.name)
            if name is None:
                continue
            if t.tensor_type not in SUPPORTED_TYPES:
                raise ModelLoadError(
                    f"tensor {t.name} uses quantization type {t.tensor_type.name}, which kvloop "
                    f"does not support (supported: {sorted(q.name for q in SUPPORTED_TYPES)})"
                )
            w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
            # numpy order is the reverse of GGML's ne[]: (rows, cols) for a 2-D weight.
            w = w.reshape([int(d) for d in reversed(t.shape)])
            if permute and name.endswith(("q_proj.weight", "q_proj.bias")):
                w = unpermute_qk(w, config.num_heads)
            elif permute and name.endswith(("k_proj.weight", "k_proj.bias")):
                w = unpermute_qk(w, config.num_kv_heads)
            # F32 tensors are read-only views of the memory map: copy only those.
            yield name, torch.from_numpy(np.require(w, requirements=["C", "W"]))

    def int4_weights(self, config: ModelConfig) -> dict[str, Int4Weights]:
        """The Q4_0 / Q4_1 tensors as 4-bit codes with group scales and zeros, exactly as
        stored (no re-quantization), renamed and un-permuted like `tensors`."""
        permute = ARCHITECTURES[self.architecture]
        out: dict[str, Int4Weights] = {}
        for t in self.reader.tensors:
            name = hf_name(t.name)
            kind = t.tensor_type
            if name is None or kind not in (gguf.GGMLQuantizationType.Q4_0,
                                            gguf.GGMLQuantizationType.Q4_1):
                continue
            w = _unpack_q4(np.asarray(t.data), kind == gguf.GGMLQuantizationType.Q4_1)
            rows, cols = (int(d) for d in reversed(t.shape))
            codes, scales, zeros = (a.reshape(rows, -1) for a in w)
            if permute and name.endswith("q_proj.weight"):
                codes, scales, zeros = (unpermute_qk(a, config.num_heads)
                                        for a in (codes, scales, zeros))
            elif permute and name.endswith("k_proj.weight"):
                codes, scales, zeros = (unpermute_qk(a, config.num_kv_heads)
                                        for a in (codes, scales, zeros))
            assert codes.shape == (rows, cols)
            out[name] = Int4Weights(*(torch.from_numpy(np.ascontiguousarray(a))
                                      for a in (codes, scales, zeros)))
        return out


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
