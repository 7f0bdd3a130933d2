"""One replica's side of a request: the stream a ReplicaPool reads (messages.py), over an
AsyncEngine. The Ray Serve deployment serves it across processes; LocalReplicaClient
serves it in this process (tests, and a pool without Ray)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

from kvloop.cluster.messages import Accepted, Failed, Refused
from kvloop.engine.async_engine import AsyncEngine, RequestStream
from kvloop.params import SamplingParams
from kvloop.scheduler import SchedulerStats


async def replica_stream(engine: AsyncEngine, request_id: str, prompt: str | list[int],
                         params: SamplingParams, priority: int) -> AsyncIterator[object]:
    """Accepted or Refused, then the request's outputs or Failed. Closed early (the
    caller aborted), it aborts the request, which frees its KV blocks."""
    try:
        stream: RequestStream = await engine.add_request(request_id, prompt, params, priority)
    except Exception as e:  # refused before queueing: sent as a value (messages.py)
        yield Refused(e, getattr(e, "param", None))
        return
    yield Accepted()
    try:
        async for out in stream:
            yield out
    except Exception as e:
        yield Failed(e)
    finally:
        if not stream.finished:
            engine.abort(request_id)


@dataclass
class LocalReplicaClient:
    """A replica in this process (kvloop.cluster.pool.ReplicaClient)."""

    name: str
    engine: AsyncEngine

    def generate(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                 priority: int) -> AsyncIterator[object]:
        return replica_stream(self.engine, request_id, prompt, params, priority)

    async def stats(self) -> SchedulerStats:
        return self.engine.stats()
