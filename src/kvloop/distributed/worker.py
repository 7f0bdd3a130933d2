"""Ranks 1..N-1 of tensor parallelism: each loads its shard, then runs every step rank 0
sends (the same forward on its heads and MLP columns, joining the all-reduces) until rank 0
sends None or exits. Sampling, scheduling and detokenizing happen on rank 0 only.

Across machines (torchrun sets MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE):
    python -m kvloop.distributed.worker --model PATH [engine options as JSON]
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time

import torch

from kvloop.config import EngineConfig, resolve_kv_cache_dtype
from kvloop.distributed.launch import init_groups
from kvloop.distributed.tensor_parallel import ShardPlan, load_shard
from kvloop.loading.loader import load_checkpoint
from kvloop.models.attention import kv_cache_groups
from kvloop.runner import ModelRunner


def _exit_with_parent(parent_pid: int) -> None:
    """End this rank when the engine's process is gone (a worker spawned on one machine)."""
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, daemon=True, name="kvloop-tp-parent-watch").start()


def serve_steps(rank: int, world_size: int, init_method: str, model: str | None,
                config: EngineConfig) -> None:
    """Join the groups, load this rank's shard, then run rank 0's steps until told to stop."""
    threads = max(1, (config.num_threads or torch.get_num_threads()) // world_size)
    torch.set_num_threads(threads)
    steps = init_groups(rank, world_size, init_method)
    try:
        checkpoint = load_checkpoint(model)
        plan = ShardPlan.of(checkpoint.config, rank, world_size)
        shard = load_shard(checkpoint.config, checkpoint.weights(set()), plan,
                           config.pack_weights)
        box: list[object] = [None]
        torch.distributed.broadcast_object_list(box, src=0, group=steps)  # the pool's size
        num_blocks = int(box[0])  # type: ignore[call-overload]
        runner = ModelRunner(shard, config.block_size, num_blocks, config.use_cache,
                             config.use_kernels, kv_cache_groups(checkpoint.config),
                             resolve_kv_cache_dtype(config.kv_cache_dtype, "none"),
                             native_step=False)
        while True:
            box = [None]
            torch.distributed.broadcast_object_list(box, src=0, group=steps)
            if box[0] is None:
                return
            runner.hidden_states(box[0])  # type: ignore[arg-type]
    finally:
        torch.distributed.destroy_process_group()


def run_worker(rank: int, world_size: int, init_method: str, model: str | None,
               config: EngineConfig, parent_pid: int) -> None:
    """A process spawned by rank 0 on this machine."""
    _exit_with_parent(parent_pid)
    serve_steps(rank, world_size, init_method, model, config)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="a tensor parallel rank > 0 (under torchrun)")
    p.add_argument("--model", default=None)
    p.add_argument("--options", default="{}",
                   help="the engine's options as JSON (those rank 0 was given that shape "
                        "the forward: kv_cache_dtype, block_size, threads, ...)")
    args = p.parse_args(argv)
    options = json.loads(args.options)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    config = EngineConfig(**{"quantization": "none", **options,
                             "tensor_parallel_size": world_size})
    serve_steps(rank, world_size, "env://", args.model, config)


if __name__ == "__main__":
    main()
