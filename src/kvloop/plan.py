"""Capacity planning: how many machines a workload needs, from the roofline of one.

Pure arithmetic (no torch), over kvloop.roofline's Machine, so it can plan for machines and
models we do not have. For a batch of B sequences decoding at a mean context C:

    decode step  ~ (weights + B * KV bytes per token * C) / bandwidth + B * FLOPs per token / FLOP/s
    prefill      ~ max(prompt FLOPs / FLOP/s, (weights + prompt KV) / bandwidth)

The decode step adds its memory and compute times instead of taking the larger (the
textbook roofline's max): on a CPU the same cores stream the weights and run the FMAs of a
thin matmul, and kvloop's measured steps track the sum (tests/test_plan.py checks both
against BENCHMARKS.md). `overlap=True` gives the max, for machines that overlap the two.

Concurrency is capped by the KV cache: each sequence holds prompt + output positions of K
and V, and the memory left beside the weights holds only so many. Over concurrency the plan
picks the busiest batch that still meets the TTFT and TPOT targets, then the tensor-parallel
degree (the smallest that fits the model and meets the targets) and the replicas of it that
serve the request rate.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from kvloop.errors import InvalidParamsError
from kvloop.roofline import BYTES_PER_PARAM, Machine

TP_DEGREES = (1, 2, 4, 8, 16, 32, 64)
MAX_LISTED_CONCURRENCY = 4096  # a plan looks no further: no engine batches more on one host


def _positive(name: str, value: float, allow_zero: bool = False) -> None:
    # NaN fails both comparisons: refused like a negative.
    ok = value >= 0 if allow_zero else value > 0
    if not (ok and math.isfinite(value)):
        rule = ">= 0" if allow_zero else "> 0"
        raise InvalidParamsError(f"{name} must be a finite number {rule}, got {value}")


@dataclass(frozen=True)
class ModelFigures:
    """What a model costs per step, in the roofline's terms (kvloop.engine.attribution's
    ModelCosts for a loaded model; `from_params` for one described by its size)."""

    name: str
    weight_bytes: float  # read once per decode step, whatever its batch
    kv_bytes_per_token: float  # K and V of one position over every layer, as stored
    flops_per_token: float  # the layers' matmuls for one position (2 x their parameters)
    head_flops_per_row: float = 0.0  # the output head, only for rows that are sampled
    attn_flops_per_pair: float = 0.0  # QK^T and PV of one (query, key) pair, every layer
    num_layers: int = 0  # for tensor parallelism's all-reduces (two per layer per step)
    hidden_size: int = 0

    def __post_init__(self) -> None:
        _positive("weight bytes", self.weight_bytes)
        _positive("flops per token", self.flops_per_token)
        for name in ("kv_bytes_per_token", "head_flops_per_row", "attn_flops_per_pair"):
            _positive(name.replace("_", " "), getattr(self, name), allow_zero=True)

    @classmethod
    def from_params(cls, params: float, dtype: str = "fp16", num_layers: int = 0,
                    num_kv_heads: int = 0, head_dim: int = 0, num_heads: int | None = None,
                    kv_dtype: str | None = None, name: str | None = None) -> ModelFigures:
        """A model known by its size: every parameter read per step and 2 FLOPs per
        parameter per position (the classic estimate, head included). KV per token from
        layers x KV heads x head dim x 2 (K and V) x the cache's bytes; zero without them."""
        _positive("--params", params)
        dtype, kv_dtype = dtype.lower(), (kv_dtype or dtype).lower()
        for flag, d in (("--dtype", dtype), ("--kv-dtype", kv_dtype)):
            if d not in BYTES_PER_PARAM:
                raise InvalidParamsError(f"unknown {flag} {d!r}; one of {sorted(BYTES_PER_PARAM)}")
        for flag, n in (("--layers", num_layers), ("--kv-heads", num_kv_heads),
                        ("--head-dim", head_dim), ("--heads", num_heads or 0)):
            if n < 0:
                raise InvalidParamsError(f"{flag} must be >= 0, got {n}")
        heads = num_heads or num_kv_heads  # without --heads: multi-head attention
        return cls(name=name or f"{params / 1e9:,.3g}B {dtype}",
                   weight_bytes=params * BYTES_PER_PARAM[dtype],
                   kv_bytes_per_token=2.0 * num_layers * num_kv_heads * head_dim
                   * BYTES_PER_PARAM[kv_dtype],
                   flops_per_token=2.0 * params,
                   attn_flops_per_pair=4.0 * num_layers * heads * head_dim,
                   num_layers=num_layers, hidden_size=heads * head_dim)

    def prefill_flops(self, prompt_tokens: int) -> float:
        pairs = prompt_tokens * (prompt_tokens + 1) / 2  # query i sees positions 0..i
        return (self.flops_per_token * prompt_tokens + self.head_flops_per_row
                + self.attn_flops_per_pair * pairs)


@dataclass(frozen=True)
class Workload:
    rate: float  # requests per second, all replicas together
    prompt_tokens: int
    output_tokens: int
    ttft_s: float | None = None  # targets; None: no limit
    tpot_s: float | None = None

    def __post_init__(self) -> None:
        _positive("--rate", self.rate)
        for flag, n in (("--prompt-tokens", self.prompt_tokens),
                        ("--output-tokens", self.output_tokens)):
            if n < 1:
                raise InvalidParamsError(f"{flag} must be >= 1, got {n}")
        for flag, t in (("--ttft", self.ttft_s), ("--tpot", self.tpot_s)):
            if t is not None:
                _positive(flag, t)

    @property
    def context(self) -> int:
        """Positions one sequence holds in the KV cache at its end."""
        return self.prompt_tokens + self.output_tokens


@dataclass(frozen=True)
class Cluster:
    """What one replica may use beside the roofline figures of `kvloop.roofline.Machine`."""

    memory: float  # bytes per machine for weights and KV cache
    # Of a replica's capacity the plan fills: at 1, queues grow without bound.
    utilization: float = 0.8
    link_bandwidth: float | None = None  # between tensor-parallel ranks; None: not counted
    link_latency_s: float = 0.0  # per all-reduce
    overlap: bool = False  # memory and compute time overlap (max) instead of adding up

    def __post_init__(self) -> None:
        _positive("--memory", self.memory)
        if not 0 < self.utilization <= 1:
            raise InvalidParamsError(f"--utilization must be in (0, 1], got {self.utilization}")
        if self.link_bandwidth is not None:
            _positive("--link-bandwidth", self.link_bandwidth)
        _positive("--link-latency", self.link_latency_s, allow_zero=True)


@dataclass(frozen=True)
class Point:
    """One replica's figures at one concurrency."""

    concurrency: int
    decode_step_s: float  # one decode step of `concurrency` sequences
    ttft_s: float
    tpot_s: float  # mean time per output token, the prefills that interleave included
    tokens_per_s: float  # generated tokens per second
    requests_per_s: float
    memory_bound: bool  # the step's bytes take longer than its FLOPs
    meets_targets: bool


@dataclass
class Plan:
    model: ModelFigures
    machine: Machine
    cluster: Cluster
    workload: Workload
    tensor_parallel: int | None  # None: no degree up to the largest tried meets the targets
    max_concurrency: int  # the KV cache's cap per replica at that degree
    points: list[Point] = field(default_factory=list)  # at that degree, by concurrency
    chosen: Point | None = None
    replicas: int | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def machines(self) -> int | None:
        if self.replicas is None or self.tensor_parallel is None:
            return None
        return self.replicas * self.tensor_parallel

    def to_json(self) -> dict[str, Any]:
        return {
            "model": asdict(self.model),
            "machine": {"flops": self.machine.flops, "bandwidth": self.machine.bandwidth,
                        **asdict(self.cluster)},
            "workload": asdict(self.workload),
            "tensor_parallel": self.tensor_parallel,
            "max_concurrency": self.max_concurrency,
            "concurrency": self.chosen.concurrency if self.chosen else None,
            "replicas": self.replicas,
            "machines": self.machines,
            "per_replica": asdict(self.chosen) if self.chosen else None,
            "points": [asdict(p) for p in self.points],
            "notes": self.notes,
        }


class Replica:
    """The roofline of one replica: `tp` machines holding a model split by heads and
    columns, each reading and computing 1/tp of it."""

    def __init__(self, model: ModelFigures, machine: Machine, cluster: Cluster,
                 workload: Workload, tp: int = 1) -> None:
        self.m, self.machine, self.cluster, self.w, self.tp = model, machine, cluster, workload, tp

    def max_concurrency(self) -> int:
        """Sequences whose whole context fits the KV memory left beside the weights."""
        free = self.tp * self.cluster.memory - self.m.weight_bytes
        if free <= 0:
            return 0
        if self.m.kv_bytes_per_token == 0:  # the cache is not counted: no cap from it
            return MAX_LISTED_CONCURRENCY
        per_seq = self.m.kv_bytes_per_token * self.w.context
        return min(int(free // per_seq), MAX_LISTED_CONCURRENCY)

    def _time(self, nbytes: float, flops: float) -> tuple[float, bool]:
        mem = nbytes / self.tp / self.machine.bandwidth
        compute = flops / self.tp / self.machine.flops
        total = max(mem, compute) if self.cluster.overlap else mem + compute
        return total, mem >= compute

    def _allreduce_s(self, rows: int) -> float:
        # Two all-reduces of [rows, hidden] activations per layer (after attention and after
        # the MLP); a ring moves 2 (tp - 1) / tp of the data over each link.
        if self.tp == 1 or self.cluster.link_bandwidth is None:
            return 0.0
        nbytes = rows * self.m.hidden_size * 4 * 2 * (self.tp - 1) / self.tp
        return 2 * self.m.num_layers * (self.cluster.link_latency_s
                                        + nbytes / self.cluster.link_bandwidth)

    def prefill_s(self) -> float:
        p = self.w.prompt_tokens
        nbytes = self.m.weight_bytes + self.m.kv_bytes_per_token * p
        mem = nbytes / self.tp / self.machine.bandwidth
        compute = self.m.prefill_flops(p) / self.tp / self.machine.flops
        # A prompt's GEMMs reuse each weight across its rows: their loads hide behind the
        # FMAs, so the longer of the two bounds it (a short prompt is bytes-bound).
        return max(mem, compute) + self._allreduce_s(p)

    def decode_step(self, batch: int) -> tuple[float, bool]:
        mean_context = self.w.prompt_tokens + self.w.output_tokens / 2
        nbytes = self.m.weight_bytes + batch * self.m.kv_bytes_per_token * mean_context
        flops = batch * (self.m.flops_per_token + self.m.head_flops_per_row
                         + self.m.attn_flops_per_pair * mean_context)
        t, memory_bound = self._time(nbytes, flops)
        return t + self._allreduce_s(batch), memory_bound

    def point(self, batch: int) -> Point:
        step, memory_bound = self.decode_step(batch)
        prefill = self.prefill_s()
        # Steady state: while a sequence makes its output tokens, the requests that replace
        # the other batch - 1 are prefilled in between its steps; the replica's time per
        # `output_tokens` steps holds `batch` prefills (its own included).
        tpot = step + (batch - 1) * prefill / self.w.output_tokens
        cycle = batch * prefill + self.w.output_tokens * step
        # A new request waits for the step in flight (none when it runs alone), then its
        # prefill. Queueing for a free slot is what `Cluster.utilization` leaves room for.
        ttft = prefill + (step if batch > 1 else 0.0)
        tokens_per_s = batch * self.w.output_tokens / cycle
        meets = ((self.w.ttft_s is None or ttft <= self.w.ttft_s)
                 and (self.w.tpot_s is None or tpot <= self.w.tpot_s))
        return Point(batch, step, ttft, tpot, tokens_per_s,
                     tokens_per_s / self.w.output_tokens, memory_bound, meets)


def _listed(cap: int) -> list[int]:
    """Concurrencies the table shows: powers of two up to the cap, and the cap."""
    out = [b for b in (2**i for i in range(13)) if b <= cap]
    return [*out, cap] if cap and cap not in out else out


def plan(model: ModelFigures, machine: Machine, cluster: Cluster, workload: Workload) -> Plan:
    _positive("--flops", machine.flops)
    _positive("--bandwidth", machine.bandwidth)
    notes = []
    if model.kv_bytes_per_token == 0:
        notes.append("KV cache not counted (no layers / KV heads / head dim given): "
                     "concurrency is not capped by memory and decode steps read weights only")
    last: Plan | None = None
    for tp in TP_DEGREES:
        replica = Replica(model, machine, cluster, workload, tp)
        cap = replica.max_concurrency()
        points = [replica.point(b) for b in _listed(cap)]
        result = Plan(model, machine, cluster, workload, tp, cap, points, notes=notes)
        last = result
        if cap == 0:
            continue  # the weights alone do not fit: split them further
        # TPOT grows with the batch and throughput with it: the busiest batch within the
        # targets, searched over every concurrency, not only the listed ones.
        best = None
        for b in range(1, cap + 1):
            p = replica.point(b)
            if p.meets_targets and (best is None or p.tokens_per_s > best.tokens_per_s):
                best = p
        if best is None:
            continue
        result.chosen = best
        if best.concurrency not in {p.concurrency for p in points}:
            result.points = sorted([*points, best], key=lambda p: p.concurrency)
        result.replicas = max(1, math.ceil(workload.rate
                                           / (best.requests_per_s * cluster.utilization)))
        if tp > 1 and cluster.link_bandwidth is None:
            notes.append("tensor parallelism's all-reduces not counted (give --link-bandwidth)")
        if tp > 1:
            notes.append(f"tensor parallelism {tp}: one machine "
                         + ("cannot hold the weights and one sequence's KV cache"
                            if Replica(model, machine, cluster, workload, 1).max_concurrency()
                            == 0 else "cannot meet the latency targets"))
        return result
    assert last is not None
    last.tensor_parallel = None
    notes.append(f"no tensor-parallel degree up to {TP_DEGREES[-1]} fits the model and "
                 "meets the targets")
    return last


def report(p: Plan) -> str:
    m, w = p.model, p.workload
    lines = [
        f"model: {m.name}: {m.weight_bytes / 1e9:,.3g} GB of weights read per step, "
        f"{m.kv_bytes_per_token / 1e3:,.4g} KB of KV per token, "
        f"{m.flops_per_token / 1e9:,.3g} GFLOP per token",
        f"machine: {p.machine.describe()}, {p.cluster.memory / 1e9:,.3g} GB of memory",
        f"workload: {w.rate:g} req/s, {w.prompt_tokens} prompt + {w.output_tokens} output "
        f"tokens; targets TTFT "
        + (f"{w.ttft_s * 1e3:,.4g} ms" if w.ttft_s is not None else "none")
        + ", TPOT " + (f"{w.tpot_s * 1e3:,.4g} ms" if w.tpot_s is not None else "none"),
    ]
    if p.tensor_parallel is not None:
        lines.append(f"per replica ({p.tensor_parallel} machine"
                     f"{'s' if p.tensor_parallel > 1 else ''}): at most {p.max_concurrency} "
                     f"concurrent sequences of {w.context} tokens in the KV memory")
    header = ("concurrency", "step ms", "TTFT ms", "TPOT ms", "tok/s", "req/s", "bound",
              "targets")
    rows = [header]
    for pt in p.points:
        mark = " *" if p.chosen is not None and pt.concurrency == p.chosen.concurrency else ""
        rows.append((f"{pt.concurrency}{mark}", f"{pt.decode_step_s * 1e3:,.2f}",
                     f"{pt.ttft_s * 1e3:,.1f}", f"{pt.tpot_s * 1e3:,.2f}",
                     f"{pt.tokens_per_s:,.1f}", f"{pt.requests_per_s:,.3g}",
                     "memory" if pt.memory_bound else "compute",
                     "met" if pt.meets_targets else "missed"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    for r in rows:
        lines.append("  ".join(c.rjust(wd) for c, wd in zip(r, widths, strict=True)))
    if p.chosen is not None and p.replicas is not None:
        lines.append(
            f"plan: {p.replicas} replica{'s' if p.replicas > 1 else ''} x tensor parallel "
            f"{p.tensor_parallel} = {p.machines} machine{'s' if p.machines != 1 else ''}, "
            f"each replica at {p.chosen.concurrency} concurrent sequences "
            f"({p.chosen.tokens_per_s:,.1f} tok/s, {p.chosen.requests_per_s:,.3g} req/s, "
            f"filled to {p.cluster.utilization:.0%}) for {w.rate:g} req/s")
    else:
        lines.append("plan: none meets the targets")
    lines += [f"note: {n}" for n in p.notes]
    return "\n".join(lines)
