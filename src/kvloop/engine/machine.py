"""Measure this machine's sustained matmul FLOP/s and memory read bandwidth (a second or
two), the two numbers the roofline needs."""

from __future__ import annotations

import time

import torch

from kvloop.roofline import Machine


def _best_of(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def measure_bandwidth(nbytes: int = 512 * 2**20) -> float:
    """Bytes/s of reading a buffer far larger than the caches (a reduction reads it once)."""
    x = torch.ones(nbytes // 4)
    return nbytes / _best_of(lambda: x.sum(), 5)


def measure_flops(n: int = 1024) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    return 2 * n**3 / _best_of(lambda: a @ b, 5)


def measure_machine() -> Machine:
    return Machine(flops=measure_flops(), bandwidth=measure_bandwidth())
