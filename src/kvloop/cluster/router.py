"""Which replica serves a prompt: prefix affinity, bounded by load.

Each replica's prefix cache keys full blocks by their chain hash (kvloop.kv_cache). The
router remembers which chain hashes it sent where, so a prompt whose leading blocks went
to a replica before is likely to hit that replica's cache. Affinity alone would pile every
request of a hot prefix onto one replica, so it is bounded ("consistent hashing with
bounded loads", Mirrokni et al.): a replica may take a request only while its in-flight
count stays within `load_factor` times the mean. Among the replicas within the bound the
longest remembered prefix wins, then the least loaded, then the one holding the fewest
remembered blocks. A chat history is a prefix of the
next turn's prompt, so a conversation sticks to its replica without any session id.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

Routing = Literal["prefix", "round_robin"]


@dataclass(frozen=True)
class Candidate:
    index: int
    in_flight: int


class Router(Protocol):
    def choose(self, hashes: Sequence[int], candidates: Sequence[Candidate]) -> int | None: ...

    def record(self, index: int, hashes: Sequence[int]) -> None: ...

    def forget(self, index: int) -> None: ...


@dataclass
class _Memory:
    """Chain hashes recently sent to one replica, oldest first (an LRU, like its cache)."""

    capacity: int
    hashes: OrderedDict[int, None] = field(default_factory=OrderedDict)

    def matched(self, hashes: Sequence[int]) -> int:
        """Leading blocks of the prompt this replica was sent (the chain makes the run of
        leading matches the part its cache can hold)."""
        n = 0
        for h in hashes:
            if h not in self.hashes:
                break
            n += 1
        return n

    def add(self, hashes: Sequence[int]) -> None:
        for h in hashes:
            self.hashes[h] = None
            self.hashes.move_to_end(h)
        while len(self.hashes) > self.capacity:
            self.hashes.popitem(last=False)


class PrefixRouter:
    def __init__(self, num_replicas: int, load_factor: float = 1.5,
                 memory_blocks: int = 8192) -> None:
        self.load_factor = load_factor
        self._memory = [_Memory(memory_blocks) for _ in range(num_replicas)]
        self._next = 0  # ties among equals rotate, so cold prefixes spread

    def choose(self, hashes: Sequence[int], candidates: Sequence[Candidate]) -> int | None:
        if not candidates:
            return None
        total = sum(c.in_flight for c in candidates) + 1  # this request included
        bound = max(1, math.ceil(self.load_factor * total / len(candidates)))
        within = [c for c in candidates if c.in_flight + 1 <= bound] or list(candidates)
        n = len(self._memory)
        self._next = (self._next + 1) % n
        # Longest cached prefix, then the least loaded, then (for a cold prefix) the
        # replica sent the fewest distinct blocks: prefixes spread evenly over the caches.
        best = max(within, key=lambda c: (self._memory[c.index].matched(hashes), -c.in_flight,
                                          -len(self._memory[c.index].hashes),
                                          -((c.index - self._next) % n)))
        return best.index

    def record(self, index: int, hashes: Sequence[int]) -> None:
        self._memory[index].add(hashes)

    def forget(self, index: int) -> None:
        """The replica restarted: its cache is empty."""
        self._memory[index].hashes.clear()


class RoundRobinRouter:
    """The baseline that ignores prefixes (benchmarks and the routing test compare)."""

    def __init__(self, num_replicas: int) -> None:
        self._n = num_replicas
        self._next = 0

    def choose(self, hashes: Sequence[int], candidates: Sequence[Candidate]) -> int | None:
        if not candidates:
            return None
        up = {c.index for c in candidates}
        for _ in range(self._n):
            i, self._next = self._next, (self._next + 1) % self._n
            if i in up:
                return i
        return None

    def record(self, index: int, hashes: Sequence[int]) -> None:
        pass

    def forget(self, index: int) -> None:
        pass


def make_router(routing: Routing, num_replicas: int) -> Router:
    if routing == "round_robin":
        return RoundRobinRouter(num_replicas)
    return PrefixRouter(num_replicas)
