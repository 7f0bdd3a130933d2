"""Rotary position embeddings (HF rotate-half layout), with linear and Llama-3 scaling."""

from __future__ import annotations

import math

import torch

from kvloop.config import ModelConfig

_BUILD_SLICE = 2**14  # positions per slice when the cos/sin table is built
# Positions the tables cover at first; they grow (`reserve`) as sequences get longer.
INITIAL_POSITIONS = 1024


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
    """cos and sin of each position's D/2 angles, [P, D/2] tables (rotate-half pairs
    element i with i + D/2 at one angle: a full [P, D] row would repeat its halves).

    The tables cover the positions sequences have reached, not the whole context the model
    declares: Gemma 3's two tables for 32k positions of D = 256 took 64 MiB, a tenth of the
    engine's memory, for contexts few requests reach. `reserve` grows them in place
    (`resize_`), so that whoever holds these tensors (the native decoder) reads the new rows
    at its next step; the runner reserves before each step."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.inv_freq = inv_frequencies(config)
        self.max_positions = config.max_position_embeddings
        half = self.inv_freq.shape[0]
        self.cos = torch.empty(0, half, dtype=self.inv_freq.dtype)  # [P, D/2]
        self.sin = torch.empty(0, half, dtype=self.inv_freq.dtype)
        self._fill(0, min(self.max_positions, INITIAL_POSITIONS))

    @property
    def positions(self) -> int:
        """The positions the tables cover now."""
        return int(self.cos.shape[0])

    def reserve(self, positions: int) -> None:
        """Tables for positions 0..positions - 1 at least: at least doubled when they grow,
        within the model's context (a position beyond it is the caller's error)."""
        have = self.positions
        if positions > have:
            self._fill(have, min(max(positions, 2 * have), self.max_positions))

    def _fill(self, start: int, end: int) -> None:
        # Built in slices, so that the peak is the table itself rather than about twice it
        # in temporaries: it matters at 2**20 positions. Each entry is computed exactly as
        # in one pass (an element-wise product, then cos / sin).
        self.cos.resize_(end, self.inv_freq.shape[0])
        self.sin.resize_(end, self.inv_freq.shape[0])
        for lo in range(start, end, _BUILD_SLICE):
            t = torch.arange(lo, min(lo + _BUILD_SLICE, end), dtype=torch.float32)
            freqs = torch.outer(t, self.inv_freq)  # [slice, D/2]
            self.cos[lo:lo + len(t)] = freqs.cos()
            self.sin[lo:lo + len(t)] = freqs.sin()

    def scale_by(self, rope_freqs: torch.Tensor) -> None:
        """GGUF `rope_freqs`: per-frequency divisors llama.cpp stores for Llama-3 scaling."""
        self.inv_freq = self.inv_freq / rope_freqs.float()
        self._fill(0, self.positions)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Once per step, shared by all layers: [T, 1, D] each (the halves repeated)."""
        if positions.numel():
            self.reserve(int(positions.max()) + 1)
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
