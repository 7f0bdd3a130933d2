"""`kvloop serve --replicas N`: check that Ray is there (one clear error if not), connect,
deploy the replicas and put a ReplicaPool in front of them."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from kvloop.cluster.pool import ReplicaPool
from kvloop.cluster.router import Routing
from kvloop.config import EngineConfig
from kvloop.engine.llm_engine import LLMEngine
from kvloop.errors import KvloopError

INSTALL_HINT = "pip install 'kvloop[cluster]'"


def require_ray() -> None:
    """Ray Serve is an optional extra: say what to install instead of a traceback."""
    try:
        importlib.import_module("ray")
        importlib.import_module("ray.serve")
    except ImportError as e:
        raise KvloopError(f"--replicas > 1 runs the replicas on Ray Serve, which is not "
                          f"installed ({e}): {INSTALL_HINT}", "replicas") from None


@dataclass
class Cluster:
    """What `kvloop serve` holds while it serves replicas: the pool, and how to undo it."""

    pool: ReplicaPool
    clients: list[Any]

    def close(self) -> None:
        from kvloop.cluster import ray_serve

        ray_serve.undeploy(self.clients)


def start_cluster(model: str | None, config: EngineConfig, num_replicas: int,
                  max_waiting: int | None, address: str | None = None,
                  routing: Routing = "prefix") -> Cluster:
    """Connect to the Ray cluster at `address` (None: start a local one, or join the one
    RAY_ADDRESS names), deploy the replicas, and load the model's facts locally."""
    require_ray()
    import ray

    from kvloop.cluster import ray_serve

    if not ray.is_initialized():
        ray.init(address=address, include_dashboard=False, log_to_driver=False)
    clients = ray_serve.deploy(model, config, num_replicas, max_waiting)
    pool = ReplicaPool(LLMEngine(model, config), clients, routing, max_waiting)
    return Cluster(pool, list(clients))
