"""GGUF block formats as stored, without re-quantization, in one of two forms:

- `StoredRows`: the tensor's blocks as the file stores them, a row of weights its blocks
  back to back, which the native kernels read as they lie (csrc/stored_blocks.cpp: Q4_K,
  Q5_K, Q6_K, Q5_0 and Q5_1); Q5_0's bits are moved within each 8 blocks of a row
  (`kernel_order`), no byte added;
- `GroupWeights` (`decode`): each block's integer codes, and a scale (and min) per group
  computed exactly as the `gguf` package's dequantization computes them, so that scale *
  code + min in fp32 equals its weights bit for bit (tests/test_block_formats.py holds them
  to it). Every format has this form; the kernels' Q4 and Q8B layouts hold it (Q8_0 and
  Q4_0 / Q4_1 take no more bytes there than stored). A fused layer whose parts differ in
  format keeps each part's own form (`cat`).

Per format (w as gguf.quants computes it; why scale * code is exact in fp32):
  Q8_0  32 weights: d (fp16), 32 int8 q            w = d * q               11 + 8 bits
  Q5_0  32: d, 4 bytes high bits, 16 bytes nibbles   w = d * (q - 16)        11 + 5
  Q5_1  32: d, m, high bits, nibbles                 w = d * q + m           11 + 5
  Q4_0  32: d, nibbles                               w = d * (q - 8)  = d q + (-8 d), the
        sum exact as the result is (11 + 4 bits)
  Q4_1  32: d, m, nibbles                            w = d * q + m
  Q4_K  256: d, dmin, 12 bytes of 6-bit sc/m for 8 sub-blocks of 32, 128 bytes nibbles
        w = (d * sc) * q - dmin * m: scale d * sc (17 bits), code q (4): 21 bits; min
        -(dmin * m) exact; one rounding in the sum, as in gguf's
  Q5_K  as Q4_K with a fifth bit per weight (32 bytes): 22 bits
  Q6_K  256: 128 bytes low nibbles, 64 bytes high 2 bits, 16 int8 sc, d: 16 sub-blocks
        of 16, w = (d * sc) * (q - 32): 18 + 5 bits
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import gguf
import numpy as np
import torch

from kvloop.quant.layout import GROUP, Q4, STORED, GroupWeights, dequantize_q4, unpack_q4

T = gguf.GGMLQuantizationType
BLOCK_TYPES = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K)
# The formats the kernels read as stored, and their kernel layout kinds.
STORED_KINDS = {T.__members__[name]: kind for name, kind in STORED.items()}
_FORMAT_OF = {kind: fmt for fmt, kind in STORED_KINDS.items()}


def _f16(b: np.ndarray, at: int) -> np.ndarray:  # [n, size] uint8 blocks -> [n] fp32
    """Each block's fp16 field at byte `at`, widened: a strided read of the blocks seen as
    fp16 (every block size is even), not a copy of the field's bytes first."""
    return b.view(np.float16)[:, at // 2].astype(np.float32)


def _lo_hi(qs: np.ndarray, width: int) -> np.ndarray:
    """[n, chunks * width] bytes -> [n, chunks * 2 * width]: each chunk's low nibbles, then
    its high ones."""
    n = qs.shape[0]
    q = qs.reshape(n, -1, 1, width)
    return np.concatenate([q & 0x0F, q >> 4], axis=2).reshape(n, -1)


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """12 bytes of a Q4_K / Q5_K super-block -> 8 six-bit scales and 8 mins."""
    a, b, c = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = np.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 6) << 4)], axis=1)
    mn = np.concatenate([b & 0x3F, (c >> 4) | ((b >> 6) << 4)], axis=1)
    return sc.astype(np.float32), mn.astype(np.float32)


def decode(raw: np.ndarray, kind: gguf.GGMLQuantizationType, rows: int,
           cols: int) -> GroupWeights:
    """A tensor's stored bytes (rows of whole blocks) -> its codes and group scales."""
    block, size = gguf.GGML_QUANT_SIZES[kind]
    b = np.asarray(raw, dtype=np.uint8).reshape(rows * cols // block, size)
    n = b.shape[0]
    mins: np.ndarray | None = None
    codes: np.ndarray
    qh: np.ndarray
    high: np.ndarray
    bits, group = 8, 32
    if kind in (T.Q4_0, T.Q4_1):
        head = 2 if kind == T.Q4_0 else 4
        d = _f16(b, 0)
        codes = _lo_hi(b[:, head:], 16)
        mins = -8.0 * d if kind == T.Q4_0 else _f16(b, 2)
        scales, bits = d, 4
    elif kind in (T.Q5_0, T.Q5_1):
        head = 2 if kind == T.Q5_0 else 4
        d = _f16(b, 0)
        qh = np.ascontiguousarray(b[:, head : head + 4]).view(np.uint32)  # [n, 1], LE
        high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)  # [n, 32]
        q = _lo_hi(b[:, head + 4 :], 16) | (high << 4)
        if kind == T.Q5_0:
            codes, scales = q.astype(np.int8) - 16, d
        else:
            codes, scales, mins = q, d, _f16(b, 2)
    elif kind == T.Q8_0:
        codes, scales = b[:, 2:].view(np.int8), _f16(b, 0)
    elif kind in (T.Q4_K, T.Q5_K):
        d, dmin = _f16(b, 0), _f16(b, 2)
        sc, mn = _k_scales(b[:, 4:16])
        scales = (d[:, None] * sc).reshape(-1)  # [n * 8]
        mins = -(dmin[:, None] * mn).reshape(-1)
        if kind == T.Q4_K:
            codes, bits = _lo_hi(b[:, 16:], 32), 4
        else:  # bit j of byte i: the fifth bit of element i of sub-block j
            qh = b[:, 16:48]
            high = (qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1
            codes = _lo_hi(b[:, 48:], 32) | (high.reshape(n, -1) << 4)
    elif kind == T.Q6_K:
        d = _f16(b, 208)
        sc = b[:, 192:208].view(np.int8).astype(np.float32)
        scales = (d[:, None] * sc).reshape(-1)  # [n * 16]
        # Two halves of 128 weights: element h*128 + 64*s + i has low bits from nibble s of
        # ql byte h*64 + i, high bits from bits 2t.. of qh byte h*32 + i (t = element/32).
        lo = _lo_hi(b[:, 0:128], 64)
        qh = b[:, 128:192].reshape(n, 2, 1, 32)
        hi = ((qh >> np.array([0, 2, 4, 6], dtype=np.uint8)[None, None, :, None]) & 3)
        codes = (lo | (hi.reshape(n, -1) << 4)).astype(np.int8) - 32
        group = 16
    else:
        raise ValueError(f"{kind.name} is not a block format kvloop stores as is")

    def t(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a))

    # int8 holds every format's codes ([0, 31], or signed within [-128, 127]): half the
    # bytes of int16 for the largest tensor a model holds (Gemma 3's 262k-row table:
    # 160 MiB, not 320), and the layout the kernels take (Q8B) without another copy.
    # Contiguous before the reshape: numpy's reshape copy of a strided [n, 32] (Q8_0's codes
    # between their scales) was ~4x slower than this copy.
    codes_t = t(np.ascontiguousarray(np.asarray(codes).astype(np.int8, copy=False))
                .reshape(rows, cols))
    scales_t = t(np.asarray(scales, dtype=np.float32).reshape(rows, -1))
    mins_t = None if mins is None else t(np.asarray(mins, dtype=np.float32).reshape(rows, -1))
    return GroupWeights(codes_t, scales_t, mins_t, group, bits)


# Q5_0 rows as the kernels read them: each 8 consecutive blocks of a row (256 weights) as
# one 176-byte group, laid out as a Q5_K super-block is: the 8 blocks' fp16 scales, a plane
# of fifth bits (byte l, bit j: element l of block j), then the nibbles (byte l of the c-th
# 32: element l of block 2c low, of block 2c + 1 high). The same bits, moved: a group's
# codes then come out of a shift and masks where the file's layout took a byte shuffle and
# a compare per block, and 8 scales out of one load. A row's last blocks short of 8 stay
# as the file has them.
Q5_0_GROUP_BYTES = 8 * 22


def _q5_0_groups(b: np.ndarray) -> int:
    return b.shape[1] // Q5_0_GROUP_BYTES


def _transpose_bits(x: np.ndarray) -> np.ndarray:
    """Each uint64 of x as an 8 x 8 bit matrix (byte i: row i, bit j: column j), transposed:
    three rounds of swapping off-diagonal blocks (2 x 2 bits, then 4 x 4, then 8 x 8 within
    the word). 20x numpy's unpackbits / packbits round trip on Gemma 3's Q5_0 layers."""
    for shift, mask in ((7, 0x00AA00AA00AA00AA), (14, 0x0000CCCC0000CCCC),
                        (28, 0x00000000F0F0F0F0)):
        t = (x ^ (x >> np.uint64(shift))) & np.uint64(mask)
        x = x ^ t ^ (t << np.uint64(shift))
    return x


def _q5_0_to_kernel(b: np.ndarray) -> np.ndarray:  # [rows, row bytes] -> the same, moved
    rows, n = b.shape[0], _q5_0_groups(b)
    out = b.copy()
    if n == 0:
        return out
    blk = b[:, : n * Q5_0_GROUP_BYTES].reshape(rows, n, 8, 22)
    g = out[:, : n * Q5_0_GROUP_BYTES].reshape(rows, n, Q5_0_GROUP_BYTES)
    g[..., 0:16] = blk[..., 0:2].reshape(rows, n, 16)
    # qh's bit l (little-endian) is element l: the 8 x 32 bit matrix transposed, as 4
    # matrices of 8 x 8 (qh's byte k of each block: elements 8k..8k+7)
    words = np.ascontiguousarray(blk[..., 2:6].swapaxes(-1, -2)).view(np.uint64)  # [.., 4, 1]
    g[..., 16:48] = _transpose_bits(words).view(np.uint8).reshape(rows, n, 32)
    # file byte i: element i low, 16 + i high; blocks 2c (a) and 2c + 1 (b) -> 32 bytes of
    # element l of a low, of b high
    q = blk[..., 6:22].reshape(rows, n, 4, 2, 16)
    a, c = q[:, :, :, 0], q[:, :, :, 1]
    g[..., 48:] = np.concatenate([(a & 0x0F) | (c << 4), (a >> 4) | (c & 0xF0)],
                                 axis=-1).reshape(rows, n, 128)
    return out


def _q5_0_to_file(b: np.ndarray) -> np.ndarray:  # _q5_0_to_kernel's inverse
    rows, n = b.shape[0], _q5_0_groups(b)
    out = b.copy()
    if n == 0:
        return out
    g = b[:, : n * Q5_0_GROUP_BYTES].reshape(rows, n, Q5_0_GROUP_BYTES)
    blk = out[:, : n * Q5_0_GROUP_BYTES].reshape(rows, n, 8, 22)
    blk[..., 0:2] = g[..., 0:16].reshape(rows, n, 8, 2)
    words = np.ascontiguousarray(g[..., 16:48]).view(np.uint64)  # [rows, n, 4]
    blk[..., 2:6] = _transpose_bits(words).view(np.uint8).reshape(rows, n, 4, 8).swapaxes(-1, -2)
    q = g[..., 48:].reshape(rows, n, 4, 2, 16)  # [..., c, (elements 0-15, 16-31), 16]
    lo, hi = q[:, :, :, 0], q[:, :, :, 1]
    blk[..., 6:22] = np.stack([(lo & 0x0F) | (hi << 4), (lo >> 4) | (hi & 0xF0)],
                              axis=3).reshape(rows, n, 8, 16)
    return out


def kernel_order(fmt: gguf.GGMLQuantizationType, b: np.ndarray) -> np.ndarray:
    """A stored format's rows ([rows, row bytes] uint8) as the file has them -> as the
    kernels read them (Q5_0: the groups above; every other format: as they are)."""
    return _q5_0_to_kernel(b) if fmt == T.Q5_0 else b


def file_order(fmt: gguf.GGMLQuantizationType, b: np.ndarray) -> np.ndarray:
    """kernel_order's inverse."""
    return _q5_0_to_file(b) if fmt == T.Q5_0 else b


@dataclass
class StoredRows:
    """[N, K] weights as a GGUF tensor's blocks: `raw` [N, K / QK * block bytes] uint8, row
    n its blocks back to back (a GGUF tensor's rows already are) in `kernel_order`, so
    reordering or stacking rows is reordering or stacking `raw`'s. `stored` builds one
    from a file's bytes."""

    raw: torch.Tensor
    fmt: gguf.GGMLQuantizationType
    in_features: int

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.raw.shape[0]), self.in_features

    def rows(self, perm: torch.Tensor) -> StoredRows:
        """The same weights with rows reordered (GGUF's Q/K row permutation)."""
        return StoredRows(self.raw[perm].contiguous(), self.fmt, self.in_features)

    def groups(self) -> GroupWeights:
        """The same weights as codes and group scales (exact), decoded a slice of rows at a
        time (a K-quant head's 128k rows whole made about twice its codes in temporaries)."""
        b = self.raw.numpy()
        return _decode_in_slices(b, self.fmt, *self.shape, _slices(b), lambda lo, hi: None,
                                 lambda rows: file_order(self.fmt, rows))

    def dequantize(self) -> torch.Tensor:  # [N, K] fp32, the gguf package's values
        return self.groups().dequantize()

    def native(self) -> tuple[int, torch.Tensor, torch.Tensor | None]:
        """(kind, weight, scales) of the kernel layout: the blocks themselves."""
        return STORED_KINDS[self.fmt], self.raw, None


@dataclass
class Q4Rows:
    """[N, K] weights in the kernels' Q4 layout (kvloop.quant.layout.pack_q4: a row's fp16
    scales, its fp16 mins, then 16 bytes of codes per group of 32), built from GGUF Q4_1
    blocks by moving their bytes: a Q4_1 block's d, m and nibbles are that layout's scale,
    min and codes as they are (w = d * q + m; the same nibble order), so no block is
    decoded and re-packed. `packed` equals what GroupWeights.native() packs from the same
    blocks' `decode` byte for byte (tests/test_block_formats.py)."""

    packed: torch.Tensor  # [N, K / 32 * 20] uint8
    in_features: int

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.packed.shape[0]), self.in_features

    def rows(self, perm: torch.Tensor) -> Q4Rows:
        """The same weights with rows reordered (GGUF's Q/K row permutation)."""
        return Q4Rows(self.packed[perm].contiguous(), self.in_features)

    def groups(self) -> GroupWeights:
        """The same weights as codes and group scales (exact)."""
        codes, scales, mins = unpack_q4(self.packed, self.in_features)
        return GroupWeights(codes.to(torch.int8), scales, mins, GROUP, 4)

    def dequantize(self) -> torch.Tensor:  # [N, K] fp32, the gguf package's values
        return dequantize_q4(self.packed, self.in_features)

    def native(self) -> tuple[int, torch.Tensor, torch.Tensor | None]:
        """(kind, weight, scales) of the kernel layout: the packed rows."""
        return Q4, self.packed, None


def _q4_rows(raw: np.ndarray, rows: int, cols: int) -> Q4Rows | None:
    """Q4_1 blocks -> Q4Rows, or None where some d or m is NaN (GroupWeights.native then
    picks fp32 scales, Q4F, as it always has: NaN fails its fp16 round-trip check)."""
    nb = cols // GROUP
    b = np.asarray(raw, dtype=np.uint8).reshape(rows, nb, 20)
    half = np.ascontiguousarray(b[:, :, 0:4]).view(np.uint16)
    if np.any(((half & 0x7C00) == 0x7C00) & ((half & 0x03FF) != 0)):
        return None
    packed = np.concatenate([b[:, :, 0:2].reshape(rows, 2 * nb), b[:, :, 2:4].reshape(rows, 2 * nb),
                             b[:, :, 4:].reshape(rows, 16 * nb)], axis=1)
    return Q4Rows(torch.from_numpy(packed), cols)


Weights = GroupWeights | StoredRows | Q4Rows
# Stored bytes read (copied or decoded) at a time: see `stored`.
SLICE_BYTES = 2 * 2**20


def stored(raw: np.ndarray, kind: gguf.GGMLQuantizationType, rows: int, cols: int,
           done: Callable[[int, int], None] | None = None) -> Weights:
    """A tensor's stored bytes -> StoredRows where the kernels read its format as stored
    (and its rows are whole blocks), Q4Rows for Q4_1 (its blocks are the Q4 layout's
    bytes, moved), else its codes and group scales (`decode`).

    Rows of whole blocks are read a slice of about SLICE_BYTES at a time into the result's
    own memory, and `done(start, end)` hears each slice's byte range once it is read, so
    that a caller reading from a memory map can drop those pages. Decoded whole, Gemma 3's
    170 MiB embedding table held its mapped pages and about twice its size in temporaries
    at once: the load's peak, 1.3x the memory the engine then kept."""
    block, size = gguf.GGML_QUANT_SIZES[kind]
    if cols % block or rows * cols == 0:
        return decode(raw, kind, rows, cols)
    b = np.asarray(raw, dtype=np.uint8).reshape(rows, cols // block * size)
    spans = _slices(b)

    def read(lo: int, hi: int) -> None:
        if done is not None:
            done(lo * b.shape[1], hi * b.shape[1])

    if kind in STORED_KINDS:
        data = np.empty_like(b)
        for lo, hi in spans:
            data[lo:hi] = kernel_order(kind, b[lo:hi])
            read(lo, hi)
        return StoredRows(torch.from_numpy(data), kind, cols)
    if kind == T.Q4_1:
        q4 = _q4_rows(b, rows, cols)
        if q4 is not None:
            read(0, rows)
            return q4
    return _decode_in_slices(b, kind, rows, cols, spans, read)


def _slices(b: np.ndarray) -> list[tuple[int, int]]:
    """[rows, row bytes] -> the row ranges of about SLICE_BYTES each."""
    rows = b.shape[0]
    step = max(1, SLICE_BYTES // max(1, b.shape[1]))
    return [(r, min(r + step, rows)) for r in range(0, rows, step)]


def _decode_in_slices(b: np.ndarray, kind: gguf.GGMLQuantizationType, rows: int, cols: int,
                      spans: list[tuple[int, int]], read: Callable[[int, int], None],
                      to_file: Callable[[np.ndarray], np.ndarray] = lambda rows: rows,
                      ) -> GroupWeights:
    """`decode` of [rows, row bytes] blocks a slice of rows at a time, into one result
    (each slice first through `to_file`: a StoredRows' bytes back in the file's order)."""
    if not spans:  # no rows
        return decode(b, kind, rows, cols)
    out: GroupWeights | None = None
    for lo, hi in spans:
        part = decode(to_file(b[lo:hi]), kind, hi - lo, cols)
        if out is None:
            def like(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
                return torch.empty((rows, *t.shape[1:]), dtype=dtype or t.dtype)
            # Q8_0's scales are its blocks' fp16 d: held as such, exactly, they take half
            # the bytes, and the kernel layout (fp16 scales) takes them without a second
            # copy (Gemma 3's table: 10 MiB, not 20 + 10 at the load's peak).
            out = GroupWeights(like(part.codes),
                               like(part.scales, torch.float16 if kind == T.Q8_0 else None),
                               None if part.mins is None else like(part.mins),
                               part.group, part.bits)
        out.codes[lo:hi] = part.codes
        out.scales[lo:hi] = part.scales
        if out.mins is not None and part.mins is not None:
            out.mins[lo:hi] = part.mins
        read(lo, hi)
    assert out is not None
    return out


def cat(parts: list[Weights]) -> Weights | list[Weights] | None:
    """Stack along the output dimension (fused q/k/v or gate/up), in the fewest bytes that
    hold every part exactly: the parts' blocks when all are stored in one format the
    kernels read as stored; when some are and formats differ, the parts side by side
    (adjacent ones of one format joined: a list, kvloop.quant.block.StackedLinear); when
    none is, one GroupWeights layout (GroupWeights.cat; None where there is none).
    Q4Rows parts are stacked as rows where every part is one (the same bytes as
    GroupWeights.cat then native() of their groups), else taken as their groups."""
    if all(isinstance(p, Q4Rows) for p in parts):
        q4 = [p for p in parts if isinstance(p, Q4Rows)]
        if len(q4) == 1:
            return q4[0]
        if len({p.in_features for p in q4}) == 1:
            return Q4Rows(torch.cat([p.packed for p in q4]), q4[0].in_features)
    parts = [p.groups() if isinstance(p, Q4Rows) else p for p in parts]
    runs: list[Weights] = []
    for p in parts:
        last = runs[-1] if runs else None
        if (isinstance(p, StoredRows) and isinstance(last, StoredRows)
                and last.fmt == p.fmt and last.in_features == p.in_features):
            runs[-1] = StoredRows(torch.cat([last.raw, p.raw]), p.fmt, p.in_features)
        else:
            runs.append(p)
    if len(runs) == 1:
        return runs[0]
    if any(isinstance(p, StoredRows) for p in runs):
        return runs
    return GroupWeights.cat([p for p in runs if isinstance(p, GroupWeights)])


def dequantize_stored(kind: int, weight: torch.Tensor, in_features: int) -> torch.Tensor:
    """A stored kind's rows ([N, row bytes] uint8) -> the weights, [N, K] fp32."""
    return StoredRows(weight, _FORMAT_OF[kind], in_features).dequantize()
