"""The replicas' figures as one SchedulerStats: /metrics reads it as it reads one engine's."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import replace

from kvloop.kv_cache import KVCacheStats
from kvloop.scheduler import SchedulerStats


def sum_stats(stats: Sequence[SchedulerStats]) -> SchedulerStats:
    """Counts and blocks add up; a block's size and dtype are the same on every replica
    (one model, one configuration), so the first replica's are taken."""
    first = stats[0]
    kvs = [s.kv for s in stats]
    kv: KVCacheStats = replace(
        first.kv,
        num_blocks=sum(k.num_blocks for k in kvs),
        num_free_blocks=sum(k.num_free_blocks for k in kvs),
        prefix_queries=sum(k.prefix_queries for k in kvs),
        prefix_hits=sum(k.prefix_hits for k in kvs),
        seq_blocks=tuple(itertools.chain.from_iterable(k.seq_blocks for k in kvs)),
        num_resident_blocks=sum(k.num_resident_blocks for k in kvs))
    per_step = [sum(col) for col in itertools.zip_longest(
        *(s.accepted_per_step for s in stats), fillvalue=0)]
    return SchedulerStats(
        num_running=sum(s.num_running for s in stats),
        num_waiting=sum(s.num_waiting for s in stats),
        kv=kv,
        num_preemptions=sum(s.num_preemptions for s in stats),
        num_draft_tokens=sum(s.num_draft_tokens for s in stats),
        num_accepted_tokens=sum(s.num_accepted_tokens for s in stats),
        accepted_per_step=tuple(per_step),
        num_forced_tokens=sum(s.num_forced_tokens for s in stats),
        num_steps=sum(s.num_steps for s in stats))
