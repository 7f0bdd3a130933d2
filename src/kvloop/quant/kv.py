"""KV cache dtypes: how the paged cache stores K and V, and how they are read back.

One layer's cache is a ``PagedKV``: ``data [2, Hkv, slots, D]`` (K then V, slot = block *
block_size + offset) in fp32, bf16 or fp16, or int8 codes with ``scales [2, Hkv, slots]``
fp16: one symmetric absmax scale per token per head (llama.cpp's q8_0 cache keeps one per
32 elements, vLLM's fp8 cache one per tensor; per token per head needs no calibration and
costs 2 bytes a row). Attention always computes in fp32 over what is stored.

An int8 cache stores its K rows rotated: codes of ``H k``, H the (unnormalised) Walsh-
Hadamard transform over blocks of ``key_block(D)`` elements (the largest power of two
dividing D: all of a 64- or 128-dim head). Keys have outlier channels, a few dimensions
many times larger than the rest, and one absmax scale per row then leaves the other
channels a handful of codes; the rotation spreads every channel over the whole block.
H H = b I, so scores need no un-rotation: q . k = (H q / b) . (H k), and attention over an
int8 cache rotates its queries instead (a few adds per query element), never the cached
keys. V is stored as it is (its channels are even, and rotating it would cost an
un-rotation of every output). On the default model's held prompts (module path, 32
greedy tokens each) per-row int8 matched the fp32 cache on 4 of 8, with K rotated on 8.

The rounding here (round to nearest even everywhere; int8: scale = fp16(absmax / 127) in
fp32, code = clamp(round(x / scale), -127, 127)) is the one the native writer
(kernels/csrc/kv_dtype.h) implements: both paths store the same bits (a test checks).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Storage dtype of each KV cache dtype's values (int8: the codes).
KV_CACHE_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "int8": torch.int8,
}
# fp16, not fp32: 2 bytes instead of 4 a row (64 + 2 vs 64 + 4 bytes at head_dim 64), and
# its 11-bit mantissa scales the row by at most 2^-11 off, far below the codes' own
# rounding (up to 1/254 of the row's absmax).
SCALE_DTYPE = torch.float16
INT8_MAX = 127


def kv_dtype_name(dtype: torch.dtype) -> str:
    for name, d in KV_CACHE_DTYPES.items():
        if d == dtype:
            return name
    raise ValueError(f"no KV cache dtype stores {dtype}")


def key_block(head_dim: int) -> int:
    """The int8 cache's K rotation block: the largest power of two dividing head_dim."""
    return head_dim & -head_dim


def hadamard(x: torch.Tensor, block: int) -> torch.Tensor:
    """x [..., D] -> H x over each block of `block` elements (a power of two dividing D),
    unnormalised (entries +-1: H H = block * I), as a new tensor. Butterflies in the native
    writer's order (kv_dtype.h, fwht), each output one fp32 add or subtract, so the two
    produce the same bits."""
    shape, D = x.shape, x.shape[-1]
    h = 1
    while h < block:
        y = x.reshape(*shape[:-1], D // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        x = torch.stack((a + b, a - b), dim=-2).reshape(shape)
        h *= 2
    return x


def kv_bytes_per_row(kv_dtype: str, head_dim: int) -> int:
    """Bytes of one token's K (or V) for one kv head: its values (int8: codes and scale)."""
    dtype = KV_CACHE_DTYPES[kv_dtype]
    elem = torch.empty((), dtype=dtype).element_size()
    scale = torch.empty((), dtype=SCALE_DTYPE).element_size() if kv_dtype == "int8" else 0
    return head_dim * elem + scale


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] fp32 -> (codes [..., D] int8, scales [...] fp16): x ~= scale * code.

    An all-zero row has scale 0 and codes 0; a row with a NaN gets a NaN scale (codes 0),
    so the NaN shows in attention's output as it would from an fp32 cache."""
    x = x.float()
    scales = (x.abs().amax(dim=-1) / INT8_MAX).to(SCALE_DTYPE)  # [...]
    s = scales.float().unsqueeze(-1)  # [..., 1], the rounded scale the codes are taken at
    q = torch.where(s > 0, x / s, 0.0).round_().clamp_(-INT8_MAX, INT8_MAX)
    return q.to(torch.int8), scales


def dequantize(data: torch.Tensor, scales: torch.Tensor | None = None,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Stored values [..., D] (int8 codes with their scales [...]) -> `dtype`. code * scale
    is exact in fp32 (7 + 11 significant bits), so the result does not depend on `dtype`."""
    if scales is None:
        return data.to(dtype)
    return data.to(dtype) * scales.to(dtype).unsqueeze(-1)


def round_trip(x: torch.Tensor, kv_dtype: str, keys: bool = False) -> torch.Tensor:
    """x [..., D] fp32 as a `kv_dtype` cache stores it and attention reads it back (fp32),
    in x's own basis (int8 keys: un-rotated, see the module docstring)."""
    if kv_dtype == "fp32":
        return x
    if kv_dtype == "int8":
        b = key_block(x.shape[-1]) if keys else 1
        back = dequantize(*quantize_int8(hadamard(x, b)))
        return hadamard(back, b) / b
    return x.to(KV_CACHE_DTYPES[kv_dtype]).float()


@dataclass(frozen=True)
class PagedKV:
    """One layer's paged K/V (see the module docstring). The runner owns them; the model's
    attention writes the step's new K/V (`write`) and reads contexts back as fp32
    (`gather`), or hands `data` and `scales` to the native kernels, which read them in
    place."""

    data: torch.Tensor  # [2, Hkv, slots, D] fp32 / bf16 / fp16 values, or int8 codes
    scales: torch.Tensor | None = None  # [2, Hkv, slots] fp16, int8 only: x = scale * code

    @classmethod
    def allocate(cls, kv_dtype: str, num_kv_heads: int, num_slots: int,
                 head_dim: int) -> PagedKV:
        """Uninitialised (pages are mapped as they are first written)."""
        data = torch.empty(2, num_kv_heads, num_slots, head_dim,
                           dtype=KV_CACHE_DTYPES[kv_dtype])
        scales = (torch.empty(2, num_kv_heads, num_slots, dtype=SCALE_DTYPE)
                  if kv_dtype == "int8" else None)
        return cls(data, scales)

    @property
    def kv_dtype(self) -> str:
        return kv_dtype_name(self.data.dtype)

    @property
    def num_kv_heads(self) -> int:
        return self.data.shape[1]

    @property
    def num_slots(self) -> int:
        return self.data.shape[2]

    @property
    def key_block(self) -> int:
        """The block K rows are rotated over (1: not rotated; int8 only, see the module
        docstring)."""
        return key_block(self.data.shape[-1]) if self.scales is not None else 1

    def rotate_queries(self, q: torch.Tensor) -> torch.Tensor:
        """q [..., D] into the basis K is stored in: H q / b (exact: b is a power of two),
        so that q' . k_stored = q . k. q itself when keys are not rotated."""
        b = self.key_block
        return q if b == 1 else hadamard(q, b) / b

    @property
    def nbytes(self) -> int:
        n = self.data.numel() * self.data.element_size()
        return n + (0 if self.scales is None else self.scales.numel() * self.scales.element_size())

    def zero_(self, num_slots: int) -> None:
        """Zero slots [0, num_slots): values 0 (int8: codes and scales)."""
        self.data[:, :, :num_slots].zero_()
        if self.scales is not None:
            self.scales[:, :, :num_slots].zero_()

    def copy_slots(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Slots src -> dst ([N] int64 each), K and V (and int8 scales)."""
        self.data[:, :, dst] = self.data[:, :, src]
        if self.scales is not None:
            self.scales[:, :, dst] = self.scales[:, :, src]

    def write(
        self,
        slots: torch.Tensor,  # [T] int64
        k: torch.Tensor,  # [T, Hkv, D] fp32
        v: torch.Tensor,  # [T, Hkv, D] fp32
    ) -> tuple[torch.Tensor, torch.Tensor]:  # K, V [T, Hkv, D] fp32 as stored
        """Store the step's new K/V at `slots`; returns them as the cache now holds them
        (int8 K in its rotated basis: attend with rotate_queries), so that a prefill chunk
        attending to its own fresh K/V sees what a later chunk (or a prefix-cache hit, or
        the native step) reads from the cache: the output does not depend on how a prompt
        was chunked. fp32: k and v themselves, untouched."""
        out = []
        for i, x in enumerate((k, v)):
            if self.scales is not None:
                if i == 0:
                    x = hadamard(x, self.key_block)
                codes, scales = quantize_int8(x)  # [T, Hkv, D], [T, Hkv]
                self.data[i].index_copy_(1, slots, codes.transpose(0, 1))
                self.scales[i].index_copy_(1, slots, scales.transpose(0, 1))
                out.append(dequantize(codes, scales))
            elif self.data.dtype != torch.float32:
                stored = x.to(self.data.dtype)
                self.data[i].index_copy_(1, slots, stored.transpose(0, 1))
                out.append(stored.float())
            else:
                self.data[i].index_copy_(1, slots, x.transpose(0, 1))
                out.append(x)
        return out[0], out[1]

    def gather(self, i: int, index: torch.Tensor, B: int, S: int) -> torch.Tensor:
        """K (i = 0) or V (i = 1) rows `index` ([B * Hkv * S] rows of the flattened
        [Hkv * slots, D] cache, see models.attention.flat_kv_index) -> [B, Hkv, S, D] fp32,
        contiguous; int8 K in the basis it is stored in (attend with rotate_queries).

        A dim-0 index_select over whole rows was measured ~5x faster here than selecting
        along the slot dimension and transposing; the dtype conversion after it is one
        more pass over the gathered rows only (fp32: none)."""
        D = self.data.shape[-1]
        rows = self.data[i].view(-1, D).index_select(0, index)  # [B * Hkv * S, D]
        if self.scales is not None:
            rows = dequantize(rows, self.scales[i].view(-1).index_select(0, index))
        elif rows.dtype != torch.float32:
            rows = rows.float()
        return rows.view(B, -1, S, D)
