"""Rotary position embeddings (HF rotate-half layout), with linear and Llama-3 scaling."""

from __future__ import annotations

import math

import torch

from kvloop.config import ModelConfig

_BUILD_SLICE = 2**14  # positions per slice when the cos/sin table is built


def inv_frequencies(config: ModelConfig) -> torch.Tensor:  # [head_dim / 2]
    dim = config.head_dim
    inv_freq = 1.0 / (
        config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    )
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif kind == "llama3":
        # Long wavelengths are slowed by `factor`, short ones kept, the band between blended.
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_ctx = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        mid = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
        inv_freq = torch.where(mid, blended, scaled)
    elif kind not in ("default",):
        raise ValueError(f"unsupported rope scaling type {kind!r}")
    return inv_freq


class RotaryEmbedding(torch.nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.inv_freq = inv_frequencies(config)
        self._build(config.max_position_embeddings)

    def _build(self, max_positions: int) -> None:
        # The table covers the whole context the model declares (the native decoder reads it
        # whole; the loader bounds that context), one row per position of the D/2 angles
        # (rotate-half pairs element i with i + D/2 at one angle: a full [P, D] row repeats
        # its halves; at Gemma 3's 32k positions of D = 256, twice, that was 64 MiB more).
        # Built in slices, so that the peak is the table itself rather than about twice it
        # in temporaries: it matters at 2**20 positions. Each entry is computed exactly as
        # in one pass.
        half = self.inv_freq.shape[0]
        self.cos = torch.empty(max_positions, half, dtype=self.inv_freq.dtype)  # [P, D/2]
        self.sin = torch.empty(max_positions, half, dtype=self.inv_freq.dtype)
        for start in range(0, max_positions, _BUILD_SLICE):
            t = torch.arange(start, min(start + _BUILD_SLICE, max_positions),
                             dtype=torch.float32)
            freqs = torch.outer(t, self.inv_freq)  # [slice, D/2]
            self.cos[start:start + len(t)] = freqs.cos()
            self.sin[start:start + len(t)] = freqs.sin()

    def scale_by(self, rope_freqs: torch.Tensor) -> None:
        """GGUF `rope_freqs`: per-frequency divisors llama.cpp stores for Llama-3 scaling."""
        self.inv_freq = self.inv_freq / rope_freqs.float()
        self._build(self.cos.shape[0])

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Once per step, shared by all layers: [T, 1, D] each (the halves repeated)."""
        cos, sin = self.cos[positions], self.sin[positions]  # [T, D/2]
        return (torch.cat((cos, cos), dim=-1).unsqueeze(1),
                torch.cat((sin, sin), dim=-1).unsqueeze(1))

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, D] (queries and keys together: one pass instead of two)."""
        return x * cos + _rotate_half(x) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
