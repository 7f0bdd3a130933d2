"""ReplicaPool: the EngineClient of several engine replicas, so the server's one code path
serves them as it serves one in-process AsyncEngine.

Each request goes where the router sends it (prefix affinity within a load bound) and is
pumped back by one task per request onto the same RequestStream the server iterates for a
local engine. A replica's failure (its process died, Ray lost it) marks it down: the
router stops sending there, and a request of it that has delivered nothing yet is retried
on another replica; one that has already streamed tokens ends with EngineDeadError (the
server's 503). A health task reads each replica's figures a few times a second, which
also notices the replica again once Ray Serve has restarted it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvloop.cluster.messages import Accepted, Failed, Refused
from kvloop.cluster.router import Candidate, Routing, make_router
from kvloop.cluster.stats import sum_stats
from kvloop.engine.async_engine import (
    EngineDeadError,
    OutputObserver,
    RequestFailedError,
    RequestStream,
)
from kvloop.engine.client import ReplicaLoad
from kvloop.engine.llm_engine import LLMEngine
from kvloop.engine.outputs import RequestOutput
from kvloop.kv_cache import prompt_block_hashes
from kvloop.params import SamplingParams
from kvloop.scheduler import SchedulerStats

logger = logging.getLogger("kvloop.cluster")

# Leading blocks of a prompt the router compares: system prompts and chat histories sit
# there; the rest of a long prompt adds little to the choice and costs hashing.
ROUTE_BLOCKS = 32
HEALTH_PERIOD_S = 0.2
HEALTH_TIMEOUT_S = 2.0


class ReplicaClient(Protocol):
    """One replica as the pool talks to it (kvloop.cluster.ray, or a fake in tests)."""

    name: str

    def generate(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                 priority: int) -> AsyncIterator[object]:
        """Accepted or Refused first; then RequestOutputs, or Failed. Closing the iterator
        early (an abort) must abort the request on the replica."""
        ...

    async def stats(self) -> SchedulerStats: ...


@dataclass
class _Replica:
    index: int
    client: ReplicaClient
    up: bool = True
    in_flight: int = 0
    routed: int = 0
    restarts: int = 0
    stats: SchedulerStats | None = None


@dataclass
class _Live:
    """One request in flight: its pump task, its caller's sink, its last output."""

    sink: asyncio.Queue[RequestOutput | BaseException | None]
    ack: asyncio.Future[None]
    task: asyncio.Task[None] | None = None
    last: RequestOutput | None = None
    aborted: bool = False


class _ReplicaLost(Exception):
    """The replica could not serve: its process died or its engine loop did."""


@dataclass
class ReplicaPool:
    """An EngineClient over replicas. `engine` is a local LLMEngine of the same model and
    configuration, never stepped: it gives the server the tokenizer, chat template and
    context length, and compiles grammars before a request leaves (bad ones fail here)."""

    engine: LLMEngine
    clients: Sequence[ReplicaClient]
    routing: Routing = "prefix"
    max_waiting: int | None = None  # each replica enforces its own (a 429 comes back)
    observer: OutputObserver | None = None
    _replicas: list[_Replica] = field(init=False)
    _live: dict[str, _Live] = field(init=False, default_factory=dict)
    _health: asyncio.Task[None] | None = field(init=False, default=None)
    _stopped: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        self._replicas = [_Replica(i, c) for i, c in enumerate(self.clients)]
        self._router = make_router(self.routing, len(self._replicas))
        self._block_size = self.engine.config.block_size

    # -- lifecycle (on the server's event loop) ------------------------------------------------
    def start(self) -> None:
        if self._health is None:
            self._health = asyncio.get_running_loop().create_task(self._watch_health())

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopped = True
        if self._health is not None:
            self._health.cancel()
        for request_id, live in list(self._live.items()):
            self._end(request_id, live, EngineDeadError("the server stopped"))

    @property
    def healthy(self) -> bool:
        return not self._stopped and any(r.up for r in self._replicas)

    @property
    def error(self) -> BaseException | None:
        if self.healthy:
            return None
        return EngineDeadError("no replica is up" if not self._stopped else "stopped")

    # -- figures ---------------------------------------------------------------------------------
    def stats(self) -> SchedulerStats:
        known = [r.stats for r in self._replicas if r.stats is not None]
        return sum_stats(known) if known else self.engine.stats()

    def replica_loads(self) -> list[ReplicaLoad]:
        return [ReplicaLoad(r.client.name, r.up, r.in_flight, r.routed, r.restarts, r.stats)
                for r in self._replicas]

    # -- requests --------------------------------------------------------------------------------
    async def add_request(self, request_id: str, prompt: str | list[int],
                          params: SamplingParams, priority: int = 0) -> RequestStream:
        """As AsyncEngine.add_request: returns once a replica queued it, or raises what the
        replica refused it with (or EngineDeadError when no replica is up)."""
        if self._stopped:
            raise EngineDeadError("the server stopped")
        if params.structured is not None:  # bad grammars fail here, off the event loop
            params.validate()
            await asyncio.to_thread(self.engine.grammars.prepare, params.structured)
        hashes = (prompt_block_hashes(prompt, self._block_size, ROUTE_BLOCKS)
                  if isinstance(prompt, list) else [])
        loop = asyncio.get_running_loop()
        live = _Live(asyncio.Queue(), loop.create_future())
        self._live[request_id] = live
        live.task = loop.create_task(self._serve(request_id, live, prompt, params, priority,
                                                 hashes))
        try:
            await live.ack
        except asyncio.CancelledError:
            self.abort(request_id)  # the caller left before a replica took it
            raise
        return RequestStream(request_id, live.sink)

    def abort(self, request_id: str) -> None:
        """A no-op for unknown or finished requests; cancels the pump, which aborts the
        request on its replica (its KV blocks are freed there)."""
        live = self._live.pop(request_id, None)
        if live is None:
            return
        live.aborted = True
        if live.task is not None:
            live.task.cancel()
        if not live.ack.done():
            live.ack.cancel()
        live.sink.put_nowait(None)
        if self.observer is not None:
            try:
                self.observer.on_abort(request_id, live.last)
            except Exception:  # a metrics bug must not fail the request
                logger.exception("output observer failed")

    # -- the pump ----------------------------------------------------------------------------------
    async def _serve(self, request_id: str, live: _Live, prompt: str | list[int],
                     params: SamplingParams, priority: int, hashes: list[int]) -> None:
        try:
            await self._route(request_id, live, prompt, params, priority, hashes)
        except Exception as e:  # a bug here must fail the request, never leave it waiting
            logger.exception("routing %s failed", request_id)
            self._end(request_id, live, RequestFailedError(f"routing failed: {e!r}"))

    async def _route(self, request_id: str, live: _Live, prompt: str | list[int],
                     params: SamplingParams, priority: int, hashes: list[int]) -> None:
        tried: set[int] = set()
        while True:
            index = self._router.choose(hashes, [Candidate(r.index, r.in_flight)
                                                 for r in self._replicas
                                                 if r.up and r.index not in tried])
            if index is None:
                down = sum(not r.up for r in self._replicas)
                self._end(request_id, live, EngineDeadError(
                    f"no replica could take this request ({down} of {len(self._replicas)} "
                    f"down; Ray Serve restarts them): retry shortly"))
                return
            replica = self._replicas[index]
            try:
                await self._run_on(replica, request_id, live, prompt, params, priority, hashes)
                return
            except _ReplicaLost as e:
                self._mark_down(replica, e)
                if live.last is not None:  # tokens were streamed: a retry would repeat them
                    self._end(request_id, live, EngineDeadError(
                        f"replica {replica.client.name} failed while this request ran: "
                        f"{e}"))
                    return
                logger.warning("replica %s failed before %s produced anything; retrying "
                               "it on another replica", replica.client.name, request_id)
                tried.add(index)

    async def _run_on(self, replica: _Replica, request_id: str, live: _Live,
                      prompt: str | list[int], params: SamplingParams, priority: int,
                      hashes: list[int]) -> None:
        replica.in_flight += 1
        replica.routed += 1
        stream = replica.client.generate(request_id, prompt, params, priority)
        try:
            async for item in stream:
                if isinstance(item, Accepted):
                    self._router.record(replica.index, hashes)
                    if not live.ack.done():
                        live.ack.set_result(None)
                elif isinstance(item, Refused):
                    if isinstance(item.error, EngineDeadError):
                        raise _ReplicaLost(str(item.error))
                    if item.param is not None:
                        item.error.param = item.param  # type: ignore[attr-defined]
                    self._end(request_id, live, item.error)
                    return
                elif isinstance(item, Failed):
                    if isinstance(item.error, EngineDeadError):
                        raise _ReplicaLost(str(item.error))
                    self._end(request_id, live, item.error)
                    return
                elif isinstance(item, RequestOutput):
                    self._deliver(request_id, live, item)
                    if item.finished:
                        return
        except (asyncio.CancelledError, _ReplicaLost):
            raise
        except Exception as e:  # the transport: the replica's process is gone or unreachable
            first_line = (str(e).strip().splitlines() or [""])[0]  # Ray's are pages long
            raise _ReplicaLost(f"{type(e).__name__}: {first_line}") from e
        finally:
            replica.in_flight -= 1
            with contextlib.suppress(Exception):
                await stream.aclose()  # type: ignore[attr-defined]

    def _deliver(self, request_id: str, live: _Live, out: RequestOutput) -> None:
        first, live.last = live.last is None, out
        if out.finished:
            self._live.pop(request_id, None)
        if self.observer is not None:
            try:
                self.observer.on_output(out, first)
            except Exception:  # a metrics bug must not fail the request
                logger.exception("output observer failed")
        live.sink.put_nowait(out)

    def _end(self, request_id: str, live: _Live, error: BaseException) -> None:
        """The request cannot go on: its caller gets `error` (from add_request before it
        was accepted, from its stream after)."""
        if self._live.get(request_id) is live:
            del self._live[request_id]
        if not live.ack.done():
            live.ack.set_exception(error)
        else:
            live.sink.put_nowait(error)

    # -- health ------------------------------------------------------------------------------------
    def _mark_down(self, replica: _Replica, why: BaseException | str) -> None:
        if replica.up:
            logger.warning("replica %s is down (%s); routing around it until it is back",
                           replica.client.name, why)
        replica.up = False

    async def _watch_health(self) -> None:
        while True:
            await asyncio.gather(*(self._probe(r) for r in self._replicas))
            await asyncio.sleep(HEALTH_PERIOD_S)

    async def _probe(self, replica: _Replica) -> None:
        try:
            stats = await asyncio.wait_for(replica.client.stats(), HEALTH_TIMEOUT_S)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self._mark_down(replica, e)
            return
        if not replica.up:
            # Back (Ray Serve restarted it): a fresh process, its prefix cache empty.
            replica.up = True
            replica.restarts += 1
            self._router.forget(replica.index)
            logger.info("replica %s is back", replica.client.name)
        replica.stats = stats
