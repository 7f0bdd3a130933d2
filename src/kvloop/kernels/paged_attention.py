"""Paged attention read straight from the block-table KV cache (C++ kernel + references).

The kernel (``csrc/paged_attention.cpp``) walks each sequence's blocks in place, so the
per-step gather of the whole context into ``[B, Hkv, S, D]`` disappears; each K/V row is
read once per GQA group, softmax is online in fp32. It is built on first use with
``torch.utils.cpp_extension.load`` into a kvloop-owned cache directory and reloaded from
there afterwards (see ``available``).

Cache layout (as in ``kvloop.models.attention``): ``[2, Hkv, num_slots, D]``, K then V,
slot = block_id * block_size + offset. The K/V of the query tokens must already be in
the cache when these are called.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
# One extension module from all kernel sources (kvloop.h declares what they share).
_SOURCES = [_CSRC / f for f in
            ("bindings.cpp", "paged_attention.cpp", "linear.cpp", "decoder.cpp")]
_lock = threading.Lock()
_module: Any = None
_tried = False


def _isa() -> str:
    """The instruction set to build for: AVX2+FMA intrinsics where the CPU has them.

    Explicit ``-mavx2 -mfma`` rather than ``-march=native``: the build cache may sit on a
    home directory shared by machines with different CPUs, and the ISA is part of the
    extension's name, so a build is only ever reused on a CPU class it can run on.
    """
    cap = torch.backends.cpu.get_cpu_capability()  # "DEFAULT", "AVX2", "AVX512", ...
    return "avx2" if cap in ("AVX2", "AVX512") else "scalar"


def _build_dir(name: str) -> Path:
    root = os.environ.get("KVLOOP_EXTENSIONS_DIR")
    base = Path(root) if root else Path.home() / ".cache" / "kvloop" / "torch_extensions"
    # Extensions link against one torch's C++ ABI: keep builds of different versions apart.
    tag = f"py{sys.version_info.major}{sys.version_info.minor}_torch{torch.__version__}"
    return base / tag / name


def _build(isa: str, verbose: bool = False) -> Any:
    # Imported here so that a platform without them only fails the build, never the import.
    import fcntl

    from torch.utils.cpp_extension import load

    name = f"kvloop_kernels_{isa}"
    flags = ["-O3", "-fopenmp"] + (["-mavx2", "-mfma", "-mf16c"] if isa == "avx2" else [])
    build_dir = _build_dir(name)
    build_dir.mkdir(parents=True, exist_ok=True)
    # load() recompiles only when the source or flags change (it hashes them). Its own
    # lock is a plain file that a build killed midway leaves behind, and every later
    # load() then waits on it forever. So builds here serialise on an flock (released by
    # the OS when its holder dies) and, holding it, clear any such stale file.
    with open(build_dir / "kvloop.flock", "w") as lockf:
        fcntl.flock(lockf, fcntl.LOCK_EX)
        (build_dir / "lock").unlink(missing_ok=True)
        return load(
            name=name,
            sources=[str(p) for p in _SOURCES],
            extra_include_paths=[str(_CSRC)],
            extra_cflags=flags,
            extra_ldflags=["-fopenmp"],  # resolves to the libgomp torch already loaded
            build_directory=str(build_dir),
            verbose=verbose,
        )


def available() -> bool:
    """Whether the native kernel can be used; builds (or loads the cached build) once.

    Never raises: a missing compiler, ninja or a build error logs one warning and returns
    False, and callers stay on the PyTorch path. ``KVLOOP_NO_KERNELS=1`` disables it.
    """
    global _module, _tried
    if _tried:  # fast path, no lock: set only after _module is final
        return _module is not None
    with _lock:
        if not _tried:
            if os.environ.get("KVLOOP_NO_KERNELS", "") not in ("", "0"):
                log.info("native kernels disabled by KVLOOP_NO_KERNELS")
            else:
                try:
                    _module = _build(_isa())
                except Exception as e:  # any build/load failure: fall back, never crash
                    msg = str(e).strip().splitlines()
                    log.warning("paged-attention kernel unavailable, using PyTorch: %s",
                                " | ".join(msg[-5:]) or type(e).__name__)
                    _module = None
            _tried = True
    return _module is not None


def native_module() -> Any:
    """The built extension module (raises when ``available()`` is False)."""
    if not available():
        raise RuntimeError("the native kernels are not available (see available())")
    return _module


_ext = native_module


def paged_attention_varlen(
    q: torch.Tensor,  # [T, H, D] fp32
    kv_cache: torch.Tensor,  # [2, Hkv, slots, D] fp32
    block_tables: torch.Tensor,  # [N, max_blocks] int32/int64, padded
    query_start: torch.Tensor | None,  # [N + 1] int64 row offsets into q; None: 1 row each
    context_lens: torch.Tensor,  # [N] int64, cached tokens including the query rows
    block_size: int,
    scale: float,
) -> torch.Tensor:  # [T, H, D]
    """Decode rows and prefill chunks in one call.

    Sequence n owns rows ``query_start[n]:query_start[n+1]`` of q: the last L of its
    ``context_lens[n]`` positions. Row i of them sees keys ``0 .. ctx - L + i`` (causal).
    """
    return _ext().paged_attention_varlen(
        q.contiguous(), kv_cache, block_tables, query_start, context_lens, block_size, scale
    )


def paged_decode_attention(
    q: torch.Tensor,  # [B, H, D] fp32, one query token per sequence
    kv_cache: torch.Tensor,  # [2, Hkv, slots, D] fp32
    block_tables: torch.Tensor,  # [B, max_blocks] int32/int64, padded
    context_lens: torch.Tensor,  # [B] int64, >= 1
    block_size: int,
    scale: float,
) -> torch.Tensor:  # [B, H, D]
    return _ext().paged_attention_varlen(
        q.contiguous(), kv_cache, block_tables, None, context_lens, block_size, scale
    )


def paged_prefill_attention(
    q: torch.Tensor,  # [L, H, D] fp32, the chunk's last L positions of the context
    kv_cache: torch.Tensor,  # [2, Hkv, slots, D] fp32
    block_table: torch.Tensor,  # [max_blocks] int32/int64
    context_len: int,  # cached tokens including the chunk, >= L
    block_size: int,
    scale: float,
) -> torch.Tensor:  # [L, H, D]
    """One prefill chunk over its cached prefix, causal inside the chunk."""
    L = q.shape[0]
    return _ext().paged_attention_varlen(
        q.contiguous(), kv_cache, block_table.view(1, -1), torch.tensor([0, L]),
        torch.tensor([context_len]), block_size, scale,
    )


# ---- references: plain PyTorch, the kernel's oracle in tests ----


def _context_kv(
    kv_cache: torch.Tensor, table: torch.Tensor, ctx: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:  # 2 x [Hkv, ctx, D]
    pos = torch.arange(ctx)
    slots = table.long()[pos // block_size] * block_size + pos % block_size  # [ctx]
    return kv_cache[0][:, slots], kv_cache[1][:, slots]


def paged_prefill_attention_reference(
    q: torch.Tensor,  # [L, H, D]
    kv_cache: torch.Tensor,  # [2, Hkv, slots, D]
    block_table: torch.Tensor,  # [max_blocks]
    context_len: int,
    block_size: int,
    scale: float,
) -> torch.Tensor:  # [L, H, D]
    L = q.shape[0]
    k, v = _context_kv(kv_cache, block_table, context_len, block_size)  # [Hkv, ctx, D]
    keys = torch.arange(context_len)
    mask = keys[None, :] <= (torch.arange(L)[:, None] + context_len - L)  # [L, ctx]
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),  # [1, H, L, D]
        attn_mask=mask, scale=scale, enable_gqa=True,
    )
    return o[0].transpose(0, 1)


def paged_decode_attention_reference(
    q: torch.Tensor,  # [B, H, D]
    kv_cache: torch.Tensor,  # [2, Hkv, slots, D]
    block_tables: torch.Tensor,  # [B, max_blocks]
    context_lens: torch.Tensor,  # [B]
    block_size: int,
    scale: float,
) -> torch.Tensor:  # [B, H, D]
    """Gather each row's context, then SDPA: one sequence at a time, so no padding mask
    (and no read of padded table entries) can leak into the result."""
    out = torch.empty_like(q)
    for b in range(q.shape[0]):
        out[b : b + 1] = paged_prefill_attention_reference(
            q[b : b + 1], kv_cache, block_tables[b], int(context_lens[b]), block_size, scale
        )
    return out
