"""EngineClient: what the server needs of the engine it serves, so that one face serves one
in-process engine (AsyncEngine) or several replicas behind a router (kvloop.cluster)
through the same routes, streaming, errors and metrics.

The server never learns which it has: it queues requests, iterates their streams, aborts
them, and reads figures. Model facts (tokenizer, context length, chat template) come from
`engine`, an LLMEngine of the same model and configuration.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from kvloop.params import SamplingParams
from kvloop.scheduler import SchedulerStats

if TYPE_CHECKING:
    from kvloop.engine.async_engine import OutputObserver, RequestStream
    from kvloop.engine.llm_engine import LLMEngine


@dataclass(frozen=True)
class ReplicaLoad:
    """One replica's figures as the router sees them (/metrics, per replica)."""

    name: str
    up: bool
    in_flight: int  # requests the router has running there now
    routed: int  # requests the router ever sent there
    restarts: int  # times it was seen down and then back
    stats: SchedulerStats | None  # its engine's last published figures (None: never read)


class EngineClient(Protocol):
    engine: LLMEngine  # model facts only: the server never steps it
    max_waiting: int | None
    observer: OutputObserver | None

    def start(self) -> None: ...

    def shutdown(self, timeout: float = 10.0) -> None: ...

    @property
    def healthy(self) -> bool: ...

    @property
    def error(self) -> BaseException | None: ...

    def stats(self) -> SchedulerStats: ...

    def replica_loads(self) -> list[ReplicaLoad]:
        """Per replica; empty for a single in-process engine."""
        ...

    async def add_request(self, request_id: str, prompt: str | list[int],
                          params: SamplingParams, priority: int = 0) -> RequestStream: ...

    def abort(self, request_id: str) -> None: ...
