"""Decode attention per layer call: the native paged kernel vs today's gather + SDPA path.

Default-model shapes (H=9, Hkv=3, D=64, block_size=16), contexts random in 300..500,
shuffled block tables. Each timed round calls every one of several "layers" (separate
caches) once, as a forward pass does, so K/V come from DRAM rather than a warm L3.
The gather + SDPA path is a copy of ``kvloop.models.attention.paged_attention``'s decode
branch; the runner builds its index and mask once per step, so they are built outside
the timing here too. Run: ``python benchmarks/bench_attention.py`` (~5 s).
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

from kvloop.kernels import paged_attention as pa
from kvloop.models.attention import flat_kv_index

H, HKV, D, BS = 9, 3, 64, 16
SCALE = D**-0.5


@dataclass
class Step:
    ctx: torch.Tensor  # [B] int64
    tables: torch.Tensor  # [B, max_blocks] int64, shuffled blocks
    caches: list[torch.Tensor]  # per layer [2, Hkv, slots, D]
    index: torch.Tensor  # [B * Hkv * S] rows of the flattened cache (gather path)
    mask: torch.Tensor  # [B, 1, 1, S] additive padding mask (gather path)
    S: int


def make_step(B: int, layers: int, seed: int) -> Step:
    rng = random.Random(seed)
    ctx = [rng.randint(300, 500) for _ in range(B)]
    nblocks = [math.ceil(c / BS) for c in ctx]
    num_blocks = sum(nblocks) + 8
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    tables = torch.zeros(B, max(nblocks), dtype=torch.long)
    for i, n in enumerate(nblocks):
        tables[i, :n] = torch.tensor([ids.pop() for _ in range(n)])
    ctx_t = torch.tensor(ctx)
    # What runner._metadata builds once per step for the gather path.
    S = int(ctx_t.max())
    slots = (tables[:, :, None] * BS + torch.arange(BS)).view(B, -1)[:, :S]  # [B, S]
    pad = torch.arange(S) >= ctx_t[:, None]  # [B, S]
    return Step(
        ctx=ctx_t,
        tables=tables,
        caches=[torch.randn(2, HKV, num_blocks * BS, D) for _ in range(layers)],
        index=flat_kv_index(slots, HKV, num_blocks * BS),
        mask=torch.zeros(B, 1, 1, S).masked_fill_(pad.view(B, 1, 1, S), float("-inf")),
        S=S,
    )


def gather_sdpa(q: torch.Tensor, cache: torch.Tensor, *, st: Step) -> torch.Tensor:
    """The decode branch of paged_attention as it is today. q [B, H, D] -> [B, H, D]"""
    B = q.shape[0]
    keys = cache[0].view(-1, D).index_select(0, st.index).view(B, -1, st.S, D)  # [B,Hkv,S,D]
    values = cache[1].view(-1, D).index_select(0, st.index).view(B, -1, st.S, D)
    o = F.scaled_dot_product_attention(
        q.unsqueeze(2), keys, values, attn_mask=st.mask, scale=SCALE, enable_gqa=True
    )
    return o.squeeze(2)


def kernel(q: torch.Tensor, cache: torch.Tensor, *, st: Step) -> torch.Tensor:
    return pa.paged_decode_attention(q, cache, st.tables, st.ctx, BS, SCALE)


def per_call_ms(fn: Callable[[torch.Tensor], torch.Tensor], caches: list[torch.Tensor],
                rounds: int) -> float:
    """Median over rounds of (time for one call per layer) / layers."""
    fn(caches[0])  # warm-up: first-call allocations, thread pool
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        for c in caches:
            fn(c)
        times.append((time.perf_counter() - t) / len(caches))
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description="paged decode attention: kernel vs gather+SDPA")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--min-mb", type=float, default=96.0,
                    help="K/V touched per round across layers (more than L3: cold reads)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not pa.available():
        raise SystemExit("kernel not available (build failed or KVLOOP_NO_KERNELS set)")

    print(f"H={H} Hkv={HKV} D={D} block_size={BS}, ctx 300..500, "
          f"{torch.get_num_threads()} threads, median of {args.rounds} rounds")
    print(f"{'B':>4} {'S avg':>6} {'layers':>6} {'gather+SDPA ms':>15} {'kernel ms':>10} "
          f"{'speedup':>8} {'kernel GB/s':>12} {'max |diff|':>11}")
    for B in args.batch_sizes:
        per_layer = B * 400 * HKV * D * 4 * 2  # K/V bytes one call reads, roughly
        layers = max(2, min(64, math.ceil(args.min_mb * 2**20 / per_layer)))
        st = make_step(B, layers, seed=B)
        q = torch.randn(B, H, D)
        diff = (gather_sdpa(q, st.caches[0], st=st) - kernel(q, st.caches[0], st=st)).abs().max()
        with torch.inference_mode():
            t_ref = per_call_ms(partial(gather_sdpa, q, st=st), st.caches, args.rounds)
            t_ker = per_call_ms(partial(kernel, q, st=st), st.caches, args.rounds)
        read = int(st.ctx.sum()) * HKV * D * 4 * 2
        print(f"{B:>4} {st.ctx.float().mean().item():>6.0f} {layers:>6} {t_ref:>15.3f} "
              f"{t_ker:>10.3f} {t_ref / t_ker:>7.1f}x {read / t_ker / 1e6:>12.1f} "
              f"{diff.item():>11.1e}")


if __name__ == "__main__":
    main()
