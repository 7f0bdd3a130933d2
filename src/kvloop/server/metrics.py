"""Prometheus metrics and the one log line per finished request.

Request figures (TTFT, TPOT, latency, tokens) are recorded on the engine thread as
outputs leave the engine, so a request whose client vanished still counts. Engine
figures (running, waiting, KV blocks and bytes per sequence, prefix hits, preemptions)
are read at scrape time from the engine's last published snapshot. Each app has its
own CollectorRegistry, so several servers in one process (the tests) never share
counters.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from kvloop.engine.client import ReplicaLoad
from kvloop.engine.outputs import RequestOutput
from kvloop.scheduler import SchedulerStats

logger = logging.getLogger("kvloop.server")

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
                    1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1,
                 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5)

# KV bytes of one sequence: 64 KiB to 16 GiB in steps of 4x.
_KV_BYTES_BUCKETS = tuple(float(64 * 1024 * 4 ** i) for i in range(10))


class _EngineCollector(Collector):
    def __init__(self, stats: Callable[[], SchedulerStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        st = self._stats()
        yield GaugeMetricFamily("kvloop_num_requests_running",
                                "Sequences in the running batch.", st.num_running)
        yield GaugeMetricFamily("kvloop_num_requests_waiting",
                                "Sequences waiting to be admitted (or resumed).", st.num_waiting)
        yield GaugeMetricFamily("kvloop_kv_cache_blocks_used",
                                "KV cache blocks held by requests.", st.kv.num_used_blocks)
        yield GaugeMetricFamily("kvloop_kv_cache_blocks_total",
                                "KV cache blocks in the pool.", st.kv.num_blocks)
        yield GaugeMetricFamily("kvloop_kv_cache_usage_ratio", "Fraction of KV blocks used.",
                                st.kv.num_used_blocks / max(st.kv.num_blocks, 1))
        yield GaugeMetricFamily("kvloop_kv_cache_bytes_per_block",
                                "K and V bytes of one block (over one KV cache group's "
                                "layers), as the KV cache dtype stores them.",
                                st.kv.bytes_per_block)
        dtype = GaugeMetricFamily("kvloop_kv_cache_dtype_info",
                                  "How the KV cache stores K and V (the label; value 1).",
                                  labels=["dtype"])
        dtype.add_metric([st.kv.kv_dtype], 1)
        yield dtype
        # KV each sequence holds now (sliding-window layers only their window's blocks).
        seq_bytes = st.kv.seq_kv_bytes
        kv_buckets = [(f"{b:.0f}", sum(1 for x in seq_bytes if x <= b))
                      for b in _KV_BYTES_BUCKETS]
        kv_buckets.append(("+Inf", len(seq_bytes)))
        yield HistogramMetricFamily(
            "kvloop_kv_cache_bytes_per_sequence",
            "KV cache bytes held by each sequence now in the cache (shared blocks counted "
            "for each sharer).", buckets=kv_buckets, sum_value=sum(seq_bytes))
        yield GaugeMetricFamily("kvloop_prefix_cache_hit_rate",
                                "Prompt tokens found in the prefix cache / tokens looked up.",
                                st.kv.prefix_hit_rate)
        yield CounterMetricFamily("kvloop_engine_steps",
                                  "Engine steps run (the figures here are as of the last).",
                                  st.num_steps)
        yield CounterMetricFamily("kvloop_num_preemptions",
                                  "Requests preempted (KV blocks ran out).", st.num_preemptions)
        yield CounterMetricFamily("kvloop_spec_draft_tokens",
                                  "Speculative draft tokens verified by the model.",
                                  st.num_draft_tokens)
        yield CounterMetricFamily("kvloop_spec_accepted_tokens",
                                  "Speculative draft tokens the model accepted.",
                                  st.num_accepted_tokens)
        yield CounterMetricFamily("kvloop_forced_tokens",
                                  "Structured output: tokens the grammar forced that ran "
                                  "without a step of their own (jump-forward).",
                                  st.num_forced_tokens)
        # Drafts accepted per verifying step, as a histogram with one bucket per count.
        steps = st.accepted_per_step
        cumulative, buckets = 0, []
        for j, n in enumerate(steps):
            cumulative += n
            buckets.append((str(j), cumulative))
        buckets.append(("+Inf", cumulative))
        yield HistogramMetricFamily(
            "kvloop_spec_accepted_per_step",
            "Draft tokens accepted in each step that verified drafts.", buckets=buckets,
            sum_value=sum(j * n for j, n in enumerate(steps)))


class _ReplicaCollector(Collector):
    """Per-replica load behind a router (nothing for a single in-process engine): the
    engine figures above are the replicas' sums, these say how the load is spread."""

    def __init__(self, loads: Callable[[], list[ReplicaLoad]]) -> None:
        self._loads = loads

    def collect(self) -> Iterator[Metric]:
        loads = self._loads()
        if not loads:
            return
        families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {
            "up": GaugeMetricFamily("kvloop_replica_up", "1 while the router sends to the "
                                    "replica, 0 while it is down.", labels=["replica"]),
            "in_flight": GaugeMetricFamily("kvloop_replica_requests_in_flight",
                                           "Requests the router has running on the replica.",
                                           labels=["replica"]),
            "routed": CounterMetricFamily("kvloop_replica_requests_routed",
                                          "Requests the router sent to the replica.",
                                          labels=["replica"]),
            "restarts": CounterMetricFamily("kvloop_replica_restarts",
                                            "Times the replica went down and came back.",
                                            labels=["replica"]),
            "running": GaugeMetricFamily("kvloop_replica_num_requests_running",
                                         "Sequences in the replica's running batch.",
                                         labels=["replica"]),
            "waiting": GaugeMetricFamily("kvloop_replica_num_requests_waiting",
                                         "Sequences waiting on the replica.", labels=["replica"]),
            "blocks": GaugeMetricFamily("kvloop_replica_kv_cache_blocks_used",
                                        "KV cache blocks held on the replica.",
                                        labels=["replica"]),
            "hits": GaugeMetricFamily("kvloop_replica_prefix_cache_hit_rate",
                                      "The replica's prefix-cache hit rate (tokens).",
                                      labels=["replica"]),
        }
        for load in loads:
            label = [load.name]
            families["up"].add_metric(label, float(load.up))
            families["in_flight"].add_metric(label, load.in_flight)
            families["routed"].add_metric(label, load.routed)
            families["restarts"].add_metric(label, load.restarts)
            if load.stats is not None:
                st = load.stats
                families["running"].add_metric(label, st.num_running)
                families["waiting"].add_metric(label, st.num_waiting)
                families["blocks"].add_metric(label, st.kv.num_used_blocks)
                families["hits"].add_metric(label, st.kv.prefix_hit_rate)
        yield from families.values()


class ServerMetrics:
    """An OutputObserver for AsyncEngine: histograms, counters and request logs."""

    def __init__(self, stats: Callable[[], SchedulerStats],
                 loads: Callable[[], list[ReplicaLoad]] = list) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("kvloop_time_to_first_token_seconds",
                              "Time from arrival to the first generated token.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("kvloop_time_per_output_token_seconds",
                              "Mean time per generated token after the first, per request.",
                              buckets=_TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("kvloop_e2e_request_latency_seconds",
                             "Time from arrival to the last token.",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("kvloop_prompt_tokens",
                                     "Prompt tokens of admitted requests.", registry=r)
        self.cached_tokens = Counter("kvloop_prompt_tokens_cached",
                                     "Prompt tokens served from the prefix cache.", registry=r)
        self.generation_tokens = Counter("kvloop_generation_tokens",
                                         "Tokens generated.", registry=r)
        self.finished = Counter("kvloop_requests_finished", "Requests finished, by reason.",
                                ["finish_reason"], registry=r)
        r.register(_EngineCollector(stats))
        r.register(_ReplicaCollector(loads))

    # -- OutputObserver (engine thread) -------------------------------------------------------
    def on_output(self, out: RequestOutput, first: bool) -> None:
        if first:
            self.prompt_tokens.inc(len(out.prompt_token_ids))
        self.generation_tokens.inc(sum(len(c.delta_token_ids) for c in out.outputs))
        if not out.finished:
            return
        m = out.metrics
        self.cached_tokens.inc(m.num_cached_tokens)
        if m.ttft is not None:
            self.ttft.observe(m.ttft)
        if m.tpot is not None:
            self.tpot.observe(m.tpot)
        if m.e2e_latency is not None:
            self.e2e.observe(m.e2e_latency)
        reasons = [c.finish_reason or "abort" for c in out.outputs]
        for reason in reasons:
            self.finished.labels(reason).inc()
        log_request(out.request_id, ",".join(dict.fromkeys(reasons)), out)

    def on_abort(self, request_id: str, last: RequestOutput | None) -> None:
        self.finished.labels("abort").inc()
        log_request(request_id, "abort (client gone)", last)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f} ms"


def log_request(request_id: str, reason: str, out: RequestOutput | None) -> None:
    if out is None:
        logger.info("%s finished: %s before its first token", request_id, reason)
        return
    m = out.metrics
    completion = sum(len(c.token_ids) for c in out.outputs)
    logger.info(
        "%s finished: %s | prompt %d tokens (%d cached) | completion %d tokens | "
        "TTFT %s | TPOT %s | e2e %s | preemptions %d",
        request_id, reason, len(out.prompt_token_ids), m.num_cached_tokens, completion,
        _ms(m.ttft), _ms(m.tpot), _ms(m.e2e_latency), m.num_preemptions,
    )
