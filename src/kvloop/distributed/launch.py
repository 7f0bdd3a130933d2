"""The ranks' processes and their process groups.

On one machine (`tensor_parallel_size` N > 1), the engine's process is rank 0 and spawns
ranks 1..N-1 (kvloop.distributed.worker), which meet it over gloo on 127.0.0.1 and a free
port. Across machines, each process is started by torchrun (or by hand) with MASTER_ADDR,
MASTER_PORT, RANK and WORLD_SIZE set: rank 0 runs the engine, the others `python -m
kvloop.distributed.worker` (README).

Two groups: the default one carries the layers' all-reduces with a short timeout (a rank
that died fails the step instead of hanging it); a second carries rank 0's step messages,
for which the other ranks may wait as long as the engine stays idle.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.process import BaseProcess
from typing import Any

import torch.distributed as dist

from kvloop.batch import SchedulerOutput

# A collective of the layers waits this long for the other ranks.
COLLECTIVE_TIMEOUT = timedelta(seconds=120)
# The other ranks wait this long for rank 0's next step (an idle server).
IDLE_TIMEOUT = timedelta(days=365)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_groups(rank: int, world_size: int, init_method: str) -> dist.ProcessGroup:
    """Join the default group (the all-reduces) and return the step messages' group."""
    dist.init_process_group("gloo", init_method=init_method, rank=rank,
                            world_size=world_size, timeout=COLLECTIVE_TIMEOUT)
    group = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    assert group is not None
    return group


def lean_step(sched: SchedulerOutput) -> SchedulerOutput:
    """What the other ranks need of a step to run its forward: tokens, positions, block
    tables, copy-on-write pairs; not the prompts and outputs the sampler reads."""
    seqs = [type(s)(s.request_id, s.token_ids, s.start_pos, s.block_ids, s.sample, s.params,
                    (), (), group_block_ids=s.group_block_ids) for s in sched.seqs]
    n = len(sched.decodes)
    return SchedulerOutput(seqs[:n], seqs[n:], sched.use_cache,
                           blocks_to_copy=sched.blocks_to_copy)


@dataclass
class TensorParallelGroup:
    """Rank 0's side: the step channel to ranks 1..N-1, and the processes it started."""

    world_size: int
    steps: dist.ProcessGroup
    processes: list[BaseProcess] = field(default_factory=list)
    closed: bool = False

    @classmethod
    def start(cls, world_size: int, model: str, config: Any) -> TensorParallelGroup:
        """Rank 0 of `world_size`: joined to ranks started by torchrun when RANK and
        WORLD_SIZE say so, else to ranks 1..N-1 spawned here, each loading `model` with
        the engine config `config`."""
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            if int(os.environ["RANK"]) != 0 or int(os.environ["WORLD_SIZE"]) != world_size:
                raise RuntimeError(f"the engine runs on rank 0 of tensor_parallel_size "
                                   f"{world_size}; the environment says RANK "
                                   f"{os.environ['RANK']} of WORLD_SIZE "
                                   f"{os.environ['WORLD_SIZE']}")
            return cls(world_size, init_groups(0, world_size, "env://"))
        from kvloop.distributed.worker import run_worker

        init_method = f"tcp://127.0.0.1:{free_port()}"
        ctx = multiprocessing.get_context("spawn")
        processes: list[BaseProcess] = []
        for rank in range(1, world_size):
            p = ctx.Process(target=run_worker, args=(rank, world_size, init_method, model,
                                                     config, os.getpid()),
                            name=f"kvloop-tp-rank{rank}", daemon=True)
            p.start()
            processes.append(p)
        try:
            steps = init_groups(0, world_size, init_method)
        except BaseException:
            for started in processes:
                started.kill()
            raise
        return cls(world_size, steps, processes)

    def send(self, message: object) -> None:
        """Broadcast `message` (a step, the pool's size, or None: stop) to every rank."""
        dead = [p.name for p in self.processes if not p.is_alive()]
        if dead:
            raise RuntimeError(f"tensor parallel rank process {', '.join(dead)} exited; "
                               f"the engine cannot run a step without it")
        dist.broadcast_object_list([message], src=0, group=self.steps)

    def close(self) -> None:
        """Stop the other ranks and leave the groups (a later engine may form new ones)."""
        if self.closed:
            return
        self.closed = True
        try:
            if all(p.is_alive() for p in self.processes):
                dist.broadcast_object_list([None], src=0, group=self.steps)
        finally:
            for p in self.processes:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
            dist.destroy_process_group()
