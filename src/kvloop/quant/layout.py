"""Weight layouts of the native kernels (kvloop.kernels, csrc/kvloop.h), defined here so
that the quantized modules can build them without depending on the kernels."""

from __future__ import annotations

import torch

F32, Q8, Q4 = 0, 1, 2  # weight kinds, as csrc/kvloop.h numbers them
GROUP = 32


def pack_q4(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """codes [N, K] in [0, 15], scales / mins [N, K/32] (w = scale * code + min) -> the
    kernel's rows [N, K/32 * 20] uint8: all fp16 scales, all fp16 mins, then 16 bytes of
    codes per group (byte j = element j | element 16 + j << 4, GGUF's Q4_1 order)."""
    N, K = codes.shape
    nib = codes.to(torch.uint8).view(N, K // GROUP, 2, GROUP // 2)
    qs = (nib[:, :, 0] | (nib[:, :, 1] << 4)).reshape(N, K // 2)
    return torch.cat([scales.to(torch.float16).view(torch.uint8),
                      mins.to(torch.float16).view(torch.uint8), qs], dim=1).contiguous()


def unpack_q4(packed: torch.Tensor, in_features: int) -> tuple[torch.Tensor, ...]:
    """Inverse of pack_q4: (codes [N, K] uint8, scales [N, K/32], mins [N, K/32] fp32)."""
    N, nb = packed.shape[0], in_features // GROUP
    scales = packed[:, : 2 * nb].contiguous().view(torch.float16).float()
    mins = packed[:, 2 * nb : 4 * nb].contiguous().view(torch.float16).float()
    qs = packed[:, 4 * nb :].reshape(N, nb, GROUP // 2)
    codes = torch.stack([qs & 0x0F, qs >> 4], dim=2).reshape(N, in_features)
    return codes, scales, mins


def dequantize_q4(packed: torch.Tensor, in_features: int,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """pack_q4 rows -> the weights they encode, w = scale * code + min, [N, K] in `dtype`."""
    codes, scales, mins = unpack_q4(packed, in_features)
    g = codes.to(dtype).view(codes.shape[0], -1, GROUP)
    return (g * scales.to(dtype)[..., None] + mins.to(dtype)[..., None]).view(codes.shape)
