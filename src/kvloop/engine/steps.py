"""What one engine step did, as a record for whoever watches the loop (step traces, and
later a live page): built by LLMEngine only while an observer is attached, so a run
without one pays a `None` check per step and nothing else.

    engine.observer = TraceRecorder("trace.json")   # any StepObserver
    ...
    observer.on_step(StepRecord(...))               # called by the engine after each step

Times are `time.perf_counter()` seconds, the clock of RequestMetrics: monotonic, so the
spans of a trace never run backwards when the wall clock is adjusted.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from kvloop.batch import ScheduledSeq, SchedulerOutput
from kvloop.request import Request

Phase = Literal["prefill", "decode"]


@dataclass(frozen=True, slots=True)
class SeqStep:
    """One sequence's share of a step."""

    seq_id: str  # the request id (n > 1 samples and beams: "<request id>#<i>")
    phase: Phase
    start_pos: int  # position of its first token this step
    num_tokens: int  # positions the forward ran for it, drafts included
    num_draft: int  # of those, draft tokens verified (speculation, grammar-forced)
    new_tokens: int  # tokens it gained (0 for a prefill chunk that is not the last)
    finish_reason: str | None  # set when the sequence ended in this step


@dataclass(frozen=True, slots=True)
class StepRecord:
    index: int  # the engine's step counter before the step
    start: float  # perf_counter: before scheduling
    end: float  # perf_counter: the step's outputs are made
    seqs: tuple[SeqStep, ...]
    preempted: tuple[str, ...]  # sequences this step's scheduling preempted
    kv_blocks_used: int  # after the step (finished sequences' blocks already free)
    kv_blocks_free: int
    error: str | None = None  # the forward raised: every sequence of the step failed
    # What the step cost the machine, as engine/attribution.py counts it (0 when the
    # forward raised): the roofline of this one step.
    flops: float = 0.0
    weight_bytes: float = 0.0  # the weights, read once for the whole batch
    kv_bytes: float = 0.0  # the KV cache the step's attention read

    @property
    def num_prefill_tokens(self) -> int:
        return sum(s.num_tokens for s in self.seqs if s.phase == "prefill")

    @property
    def num_decode_tokens(self) -> int:
        return sum(s.num_tokens for s in self.seqs if s.phase == "decode")

    @property
    def batch_size(self) -> int:
        return len(self.seqs)

    @property
    def step_ms(self) -> float:
        return (self.end - self.start) * 1e3


class StepObserver(Protocol):
    """Called on the engine's thread, between its steps: must be quick, and may raise
    only by bug (the engine then logs it and detaches the observer)."""

    def on_added(self, seq_id: str, arrival: float) -> None:
        """A sequence entered the waiting queue at `arrival`."""

    def on_step(self, record: StepRecord) -> None: ...

    def on_aborted(self, seq_id: str, when: float) -> None:
        """A sequence was aborted between steps (a client left, a caller gave up)."""


class StepObservers:
    """Several observers behind the engine's one `observer` slot (a trace file and the
    live page at once), called in order. A bug in one detaches all of them, as the
    engine does for one: they are the process's own code, not plug-ins."""

    def __init__(self, *observers: StepObserver) -> None:
        self.observers = observers

    def on_added(self, seq_id: str, arrival: float) -> None:
        for o in self.observers:
            o.on_added(seq_id, arrival)

    def on_step(self, record: StepRecord) -> None:
        for o in self.observers:
            o.on_step(record)

    def on_aborted(self, seq_id: str, when: float) -> None:
        for o in self.observers:
            o.on_aborted(seq_id, when)


def seq_phases(sched: SchedulerOutput, use_cache: bool) -> list[Phase]:
    """Per scheduled sequence (in `sched.seqs` order), before the forward runs.

    Decode: one new token after everything already in the cache (drafts may ride behind
    it). Prefill: positions whose tokens were known, a prompt chunk or, after a
    preemption, the recompute of prompt and generated tokens. Without a KV cache every
    step re-runs the whole sequence; there the first is the prefill and the rest decode
    (the loop's steps, each paying for the missing cache)."""
    return [_phase(s, use_cache) for s in sched.seqs]


def _phase(s: ScheduledSeq, use_cache: bool) -> Phase:
    if not use_cache:
        return "decode" if s.output_ids else "prefill"
    one_new = s.num_tokens - s.num_draft == 1
    return "decode" if one_new and s.start_pos >= len(s.prompt_ids) else "prefill"


def step_record(index: int, start: float, end: float, sched: SchedulerOutput,
                phases: Sequence[Phase], requests: Sequence[Request],
                new_tokens: Mapping[str, int], kv_blocks_free: int, kv_blocks: int,
                error: str | None = None,
                cost: tuple[float, float, float] = (0.0, 0.0, 0.0)) -> StepRecord:
    """The record of a step whose forward has run (or raised, `error`): `requests` are
    the scheduled sequences' Request objects, read now for how each one ended; `cost`
    the step's (flops, weight bytes, KV bytes)."""
    seqs = tuple(
        SeqStep(s.request_id, phase, s.start_pos, s.num_tokens, s.num_draft,
                new_tokens.get(s.request_id, 0), req.finish_reason)
        for s, phase, req in zip(sched.seqs, phases, requests, strict=True))
    return StepRecord(index, start, end, seqs, tuple(sched.preempted_ids),
                      kv_blocks - kv_blocks_free, kv_blocks_free, error, *cost)
