"""Tensor parallelism over torch.distributed (gloo, CPU): each rank holds a shard of every
layer's attention heads and MLP columns, rank 0 runs the engine and sends each step to the
others (kvloop.distributed.worker), and every rank joins one all-reduce after the attention
output and one after the MLP down projection per layer."""

from kvloop.distributed.tensor_parallel import (
    ShardPlan,
    check_tensor_parallel,
    load_shard,
    shard_model,
)

__all__ = ["ShardPlan", "check_tensor_parallel", "load_shard", "shard_model"]
