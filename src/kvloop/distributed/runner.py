"""Rank 0's runner under tensor parallelism: before each step's forward it sends the step
to the other ranks, which run the same forward on their shards; sampling stays here."""

from __future__ import annotations

import torch

from kvloop.batch import SchedulerOutput
from kvloop.distributed.launch import TensorParallelGroup, lean_step
from kvloop.models import CausalLM
from kvloop.models.attention import KVCacheGroup
from kvloop.runner import ModelRunner


class TensorParallelRunner(ModelRunner):
    """A ModelRunner over rank 0's shard. The native C++ step is off: it runs all layers
    in one call without the all-reduces the row-parallel layers need (their forward does
    them), so every step takes the PyTorch modules' path, in fp32."""

    def __init__(self, group: TensorParallelGroup, model: CausalLM, block_size: int,
                 num_blocks: int, use_cache: bool, use_kernels: bool,
                 kv_groups: list[KVCacheGroup], kv_dtype: str) -> None:
        super().__init__(model, block_size, num_blocks, use_cache, use_kernels, kv_groups,
                         kv_dtype, native_step=False)
        self.group = group
        group.send(num_blocks)  # the other ranks size their pools as this one

    def _run_model(self, sched: SchedulerOutput) -> tuple[torch.Tensor, int]:
        self.group.send(lean_step(sched))
        return super()._run_model(sched)

    def close(self) -> None:
        self.group.close()
