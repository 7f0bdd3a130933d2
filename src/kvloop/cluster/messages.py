"""What a replica streams besides RequestOutputs: the fate of the add, and of the request.

Sent as values, not raised: an exception raised inside a Ray task reaches the caller
wrapped, and the server maps errors by their type (400, 429, 500, 503)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Accepted:
    """The replica's engine queued the request (the caller's add_request returns)."""


@dataclass(frozen=True)
class Refused:
    """The engine refused the request before queueing it (bad input, overloaded)."""

    error: BaseException
    param: str | None = None  # KvloopError's field name (not kept by pickling)


@dataclass(frozen=True)
class Failed:
    """The request failed inside the replica's engine after it was queued."""

    error: BaseException
