"""The replicas as Ray Serve deployments: one application per replica, so the router (not
Serve's own) picks the replica, while Serve still places, health-checks and restarts each.

Imports Ray at module level: import it only after kvloop.cluster.deploy.require_ray().
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from ray import serve

from kvloop.cluster.replica import replica_stream
from kvloop.config import EngineConfig
from kvloop.engine.async_engine import AsyncEngine
from kvloop.engine.llm_engine import LLMEngine
from kvloop.params import SamplingParams
from kvloop.scheduler import SchedulerStats

APP_PREFIX = "kvloop-replica-"
# Serve queues a replica's requests beyond this in the caller's handle; the engine's own
# continuous batch and its max_waiting (a 429) are the real limit, so set it out of the way.
MAX_ONGOING = 4096


@serve.deployment(max_ongoing_requests=MAX_ONGOING, health_check_period_s=1.0,
                  health_check_timeout_s=30.0, graceful_shutdown_timeout_s=5.0)
class EngineReplica:
    """One engine in one Ray worker process, run by an AsyncEngine thread as in
    `kvloop serve` (built on that thread: see AsyncEngine.build)."""

    def __init__(self, model: str | None, config: EngineConfig,
                 max_waiting: int | None) -> None:
        self.engine = AsyncEngine.build(lambda: LLMEngine(model, config), max_waiting)

    async def generate(self, request_id: str, prompt: str | list[int],
                       params: SamplingParams, priority: int) -> AsyncIterator[object]:
        async for item in replica_stream(self.engine, request_id, prompt, params, priority):
            yield item

    def stats(self) -> SchedulerStats:
        return self.engine.stats()

    def pid(self) -> int:
        return os.getpid()

    def check_health(self) -> None:
        """Serve restarts a replica whose engine loop died for good."""
        if not self.engine.healthy:
            raise RuntimeError(f"the engine loop is not running ({self.engine.error!r})")

    def __del__(self) -> None:  # Serve's graceful shutdown; also after a failed __init__
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown(timeout=2.0)


@dataclass
class RayReplicaClient:
    """The pool's view of one deployed replica (kvloop.cluster.pool.ReplicaClient)."""

    name: str
    handle: Any  # ray.serve.handle.DeploymentHandle

    async def generate(self, request_id: str, prompt: str | list[int],
                       params: SamplingParams, priority: int) -> AsyncIterator[object]:
        response = self.handle.options(stream=True).generate.remote(request_id, prompt,
                                                                    params, priority)
        try:
            async for item in response:
                yield item
        finally:
            response.cancel()  # a no-op once it finished; else the replica aborts it

    async def stats(self) -> SchedulerStats:
        result: SchedulerStats = await self.handle.stats.remote()
        return result

    async def pid(self) -> int:
        result: int = await self.handle.pid.remote()
        return result


def deploy(model: str | None, config: EngineConfig, num_replicas: int,
           max_waiting: int | None) -> list[RayReplicaClient]:
    """Start `num_replicas` replicas on the Ray cluster this process is connected to and
    return once all are ready. Each reserves its engine's threads as Ray CPUs, so Ray
    spreads them over the cluster's machines."""
    cpus = float(config.num_threads or 1)
    clients = []
    for i in range(num_replicas):
        name = f"{APP_PREFIX}{i}"
        deployment: Any = EngineReplica  # serve.deployment made the class a Deployment
        app = deployment.options(name=name, num_replicas=1,
                                 ray_actor_options={"num_cpus": cpus}).bind(
            model, config, max_waiting)
        handle = serve.run(app, name=name, route_prefix=None)
        clients.append(RayReplicaClient(name, handle))
    return clients


def undeploy(clients: list[RayReplicaClient]) -> None:
    for c in clients:
        serve.delete(c.name)
