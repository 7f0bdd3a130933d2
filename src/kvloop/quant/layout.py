"""Weight layouts of the native kernels (kvloop.kernels, csrc/kvloop.h), defined here so
that the quantized modules can build them without depending on the kernels.

Every quantized layout is integer codes with a scale (and optionally a min) per group of
weights along K, w = scale * code + min, computed in fp32. `GroupWeights` is that form
unpacked; `to_native` picks the most compact kernel layout that holds it exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Weight kinds, as csrc/kvloop.h numbers them:
#   F32  fp32 [N, K]
#   Q8   int8 [N, K] codes, fp32 scale per output row
#   Q4   4-bit codes, fp16 scale and min per group of 32 (pack_q4)
#   Q4F  4-bit codes, fp32 scale and min per group of 32 (pack_q4f): GGUF's Q4_K, whose
#        d * sc is exact in fp32 but not in fp16
#   Q8B  int8 [N, K] codes with a scale per group of 16 or 32 (fp16 where every one is
#        exact in fp16, else fp32), and optionally a min per group of 32
#   5-9  GGUF's Q4_K, Q5_K, Q6_K, Q5_0 and Q5_1 blocks as the file stores them, [N, K / QK
#        * block bytes] uint8 (kvloop.quant.stored.StoredRows, csrc/stored_blocks.cpp;
#        Q5_0's bits moved within each 8 blocks of a row: kernel_order)
F32, Q8, Q4, Q4F, Q8B = 0, 1, 2, 3, 4
STORED = {"Q4_K": 5, "Q5_K": 6, "Q6_K": 7, "Q5_0": 8, "Q5_1": 9}
GROUP = 32
# The kinds whose kernels take int16 activations (``wide_acts``: the output head): 8-bit
# codes, and Q6_K blocks as stored (the head of Q4_K_M files).
WIDE_ACTS_KINDS = frozenset({Q8, Q8B, STORED["Q6_K"]})


def pack_q4(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """codes [N, K] in [0, 15], scales / mins [N, K/32] (w = scale * code + min) -> the
    kernel's rows [N, K/32 * 20] uint8: all fp16 scales, all fp16 mins, then 16 bytes of
    codes per group (byte j = element j | element 16 + j << 4, GGUF's Q4_1 order)."""
    return _pack4(codes, scales.to(torch.float16), mins.to(torch.float16))


def pack_q4f(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """As pack_q4 with fp32 scales and mins: rows [N, K/32 * 24] uint8."""
    return _pack4(codes, scales.float(), mins.float())


def _pack4(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    N, K = codes.shape
    nib = codes.to(torch.uint8).view(N, K // GROUP, 2, GROUP // 2)
    qs = (nib[:, :, 0] | (nib[:, :, 1] << 4)).reshape(N, K // 2)
    return torch.cat([scales.contiguous().view(torch.uint8), mins.contiguous().view(torch.uint8),
                      qs], dim=1).contiguous()


def unpack_q4(packed: torch.Tensor, in_features: int,
              fp32: bool = False) -> tuple[torch.Tensor, ...]:
    """Inverse of pack_q4 (pack_q4f with fp32): (codes [N, K] uint8, scales [N, K/32],
    mins [N, K/32] fp32)."""
    N, nb = packed.shape[0], in_features // GROUP
    dtype, width = (torch.float32, 4) if fp32 else (torch.float16, 2)
    scales = packed[:, : width * nb].contiguous().view(dtype).float()
    mins = packed[:, width * nb : 2 * width * nb].contiguous().view(dtype).float()
    qs = packed[:, 2 * width * nb :].reshape(N, nb, GROUP // 2)
    codes = torch.stack([qs & 0x0F, qs >> 4], dim=2).reshape(N, in_features)
    return codes, scales, mins


def dequantize_q4(packed: torch.Tensor, in_features: int,
                  dtype: torch.dtype = torch.float32, fp32: bool = False) -> torch.Tensor:
    """pack_q4 (pack_q4f) rows -> the weights they encode, w = scale * code + min, [N, K]."""
    codes, scales, mins = unpack_q4(packed, in_features, fp32)
    return _apply(codes, scales, mins, dtype)


def dequantize_q8b(codes: torch.Tensor, scales: torch.Tensor,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Q8B codes [N, K] int8 and scales [N, K/G] (or [N, 2, K/32]: scales then mins) ->
    w = scale * code (+ min), [N, K] in `dtype`."""
    if scales.dim() == 3:
        return _apply(codes, scales[:, 0].float(), scales[:, 1].float(), dtype)
    return _apply(codes, scales.float(), None, dtype)


def _apply(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
           dtype: torch.dtype) -> torch.Tensor:
    N, K = codes.shape
    g = codes.to(dtype).view(N, scales.shape[1], -1)  # [N, groups, G]
    # Two roundings in fp32 (product, then sum): every format kvloop stores has an exact
    # scale * code (at most 24 significant bits), so this equals one fused rounding.
    w = g * scales.to(dtype)[..., None]
    if mins is not None:
        w = w + mins.to(dtype)[..., None]
    return w.view(N, K)


def _fp16_exact(t: torch.Tensor) -> bool:
    if t.dtype == torch.float16:
        return True
    # A slice of rows at a time: whole, Gemma 3's 262k-row head made ~25 MiB of
    # temporaries at the load's peak.
    return all(torch.equal(s.half().float(), s) for s in t.split(2**15))


@dataclass
class GroupWeights:
    """[N, K] weights as integer codes with an fp32 scale (and optionally a min) per group
    of `group` along K: w = scale * code + min, each product exact in fp32."""

    codes: torch.Tensor  # [N, K] int8 (4-bit codes in [0, 15], else in [-128, 127])
    scales: torch.Tensor  # [N, K / group] fp32, or fp16 where the file's are (Q8_0's d)
    mins: torch.Tensor | None  # [N, K / group] fp32, or None (w = scale * code)
    group: int  # 16 or 32
    bits: int  # 4 or 8

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.codes.shape[0]), int(self.codes.shape[1])

    def dequantize(self) -> torch.Tensor:  # [N, K] fp32
        return _apply(self.codes, self.scales, self.mins, torch.float32)

    def rows(self, perm: torch.Tensor) -> GroupWeights:
        """The same weights with rows reordered (GGUF's Q/K row permutation)."""
        return GroupWeights(self.codes[perm], self.scales[perm],
                            None if self.mins is None else self.mins[perm], self.group, self.bits)

    def regroup(self, group: int) -> GroupWeights:
        """The same weights with groups of `group` (a divisor of this one's): exact."""
        if group == self.group:
            return self
        r = self.group // group
        mins = None if self.mins is None else self.mins.repeat_interleave(r, dim=1)
        return GroupWeights(self.codes, self.scales.repeat_interleave(r, dim=1), mins, group,
                            self.bits)

    @classmethod
    def cat(cls, parts: list[GroupWeights]) -> GroupWeights | None:
        """Stack along the output dimension (fused q/k/v or gate/up) in one layout that
        holds every part exactly: the finer group, a min where any part has one (zero for
        the others: s*c + 0 == s*c), 8-bit codes where any part needs them. None when no
        kernel layout holds them all (a min with groups of 16)."""
        group = min(p.group for p in parts)
        with_min = any(p.mins is not None for p in parts)
        if with_min and group != GROUP:
            return None
        parts = [p.regroup(group) for p in parts]
        mins = (torch.cat([p.mins if p.mins is not None else torch.zeros_like(p.scales)
                           for p in parts]) if with_min else None)
        return cls(torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]),
                   mins, group, max(p.bits for p in parts))

    def native(self) -> tuple[int, torch.Tensor, torch.Tensor | None]:
        """(kind, weight, scales) of the most compact kernel layout that holds these weights
        exactly (fp16 scales only where every scale and min survives the round trip)."""
        if self.mins is not None and self.group != GROUP:
            raise ValueError("a min per group needs groups of 32")
        exact16 = _fp16_exact(self.scales) and (self.mins is None or _fp16_exact(self.mins))
        if self.bits == 4 and self.group == GROUP:
            mins = self.mins if self.mins is not None else torch.zeros_like(self.scales)
            pack = pack_q4 if exact16 else pack_q4f
            return (Q4 if exact16 else Q4F), pack(self.codes, self.scales, mins), None
        dtype = torch.float16 if exact16 else torch.float32
        scales = (self.scales if self.mins is None
                  else torch.stack([self.scales, self.mins], dim=1))  # [N, 2, K/32]
        return Q8B, self.codes.to(torch.int8).contiguous(), scales.to(dtype).contiguous()


def dequantize_native(kind: int, weight: torch.Tensor, in_features: int,
                      scales: torch.Tensor | None, dtype: torch.dtype = torch.float32
                      ) -> torch.Tensor:
    """A quantized kernel layout -> the weights it encodes, [N, K] in `dtype`."""
    if kind == Q8:
        assert scales is not None
        return (weight.to(dtype) * scales.to(dtype)[:, None])
    if kind in (Q4, Q4F):
        return dequantize_q4(weight, in_features, dtype, fp32=kind == Q4F)
    if kind == Q8B:
        assert scales is not None
        return dequantize_q8b(weight, scales, dtype)
    if kind in STORED.values():
        from kvloop.quant.stored import dequantize_stored  # it builds on this module

        return dequantize_stored(kind, weight, in_features).to(dtype)
    raise ValueError(f"not a quantized weight kind: {kind}")
