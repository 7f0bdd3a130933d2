"""LiveFeed: the engine's per-step records folded into the state a live page draws (the
recent steps, a row per request, the KV block pool, the roofline of the last step).

    feed = LiveFeed(engine.kv_block_map, machine=None)  # a StepObserver
    engine.observer = feed                               # or StepObservers(trace, feed)
    ...
    update = feed.snapshot(after_step=-1)                # any thread, JSON-ready

Why it costs the engine nothing measurable: the engine thread only appends a compact
tuple per step and updates a few dict entries per scheduled sequence, under a lock held
for microseconds. Readers (the server's event streams) poll `snapshot` at their own pace
and never hand the engine anything to wait on: a slow or vanished browser slows only its
own stream. The one costly read, the block map (a pass over the whole pool), is taken on
the engine thread at the step after a reader asked for it (`want_map`), so it is paid at
most once per reader's poll, and never when nobody watches. It is also taken when the last known
sequence finishes, so an idle pool's picture is current.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvloop.engine.steps import StepRecord
from kvloop.kv_cache import BlockMap
from kvloop.roofline import Machine

MAX_STEPS = 600  # recent steps kept (a minute of 100 ms steps) for a page that connects
MAX_FINISHED = 64  # finished requests kept as rows
# Rows of unfinished sequences kept at most: a sequence the engine dropped without a
# finish reason in a step record (a pruned beam) must not grow a server's memory forever.
MAX_ROWS = 4096


@dataclass(slots=True)
class _Row:
    """One sequence as the page lists it."""

    seq_id: str
    arrival: float
    phase: str = "queued"  # queued, prefill, decode, preempted, finished
    prompt_done: int = 0  # positions prefilled so far (prompt, or recompute)
    output_tokens: int = 0
    first_token: float | None = None
    last_token: float | None = None
    finish_reason: str | None = None

    def json(self, t0: float) -> dict[str, Any]:
        ttft = None if self.first_token is None else self.first_token - self.arrival
        tps = None
        if (self.first_token is not None and self.last_token is not None
                and self.output_tokens > 1 and self.last_token > self.first_token):
            # Decode speed: tokens after the first over the time they took.
            tps = (self.output_tokens - 1) / (self.last_token - self.first_token)
        return {"id": self.seq_id, "phase": self.phase, "arrival": round(self.arrival - t0, 4),
                "prefilled": self.prompt_done, "tokens": self.output_tokens,
                "ttft_s": None if ttft is None else round(ttft, 4),
                "tokens_per_s": None if tps is None else round(tps, 2),
                "finish_reason": self.finish_reason}


class LiveFeed:
    """A StepObserver holding what the live page shows; see the module docstring."""

    def __init__(self, block_map: Callable[[], BlockMap], machine: Machine | None = None,
                 max_steps: int = MAX_STEPS) -> None:
        self._block_map = block_map
        self.machine = machine
        self.t0 = time.perf_counter()
        self._lock = threading.Lock()
        # (index, start s since t0, step ms, prefill tokens, decode tokens, batch, drafted,
        #  accepted, kv used, kv free, flops, weight bytes, kv bytes, preempted, error)
        self._steps: deque[tuple[Any, ...]] = deque(maxlen=max_steps)
        self._rows: dict[str, _Row] = {}
        self._finished: deque[_Row] = deque(maxlen=MAX_FINISHED)
        self._map: BlockMap | None = None
        self._map_step = -1  # the step after which the map was taken
        self._map_wanted = False
        self.num_steps = 0
        self.version = 0  # bumped by every change: a reader with this version skips a poll
        self.map_serial = 0  # bumped by every block map taken

    # -- StepObserver (the engine's thread) -----------------------------------------------
    def on_added(self, seq_id: str, arrival: float) -> None:
        with self._lock:
            self._rows[seq_id] = _Row(seq_id, arrival)
            self.version += 1

    def on_aborted(self, seq_id: str, when: float) -> None:
        with self._lock:
            self.version += 1
            row = self._rows.pop(seq_id, None)
            if row is not None:
                row.phase, row.finish_reason = "finished", "abort"
                self._finished.append(row)
            # An abort frees blocks between steps: the picture must not keep them.
            if self._map_wanted or not self._rows:
                self._take_map(self.num_steps - 1)

    def on_step(self, r: StepRecord) -> None:
        with self._lock:
            self.num_steps += 1
            self.version += 1
            drafted = sum(s.num_draft for s in r.seqs)
            # Accepted drafts: tokens gained beyond the one a verify step always yields.
            accepted = sum(max(0, s.new_tokens - 1) for s in r.seqs if s.num_draft)
            self._steps.append((
                r.index, round(r.start - self.t0, 4), round(r.step_ms, 3),
                r.num_prefill_tokens, r.num_decode_tokens, r.batch_size, drafted, accepted,
                r.kv_blocks_used, r.kv_blocks_free, r.flops, r.weight_bytes, r.kv_bytes,
                len(r.preempted), r.error))
            for s in r.seqs:
                row = self._rows.get(s.seq_id)
                if row is None:  # a forked sample or beam, first seen in a step
                    row = self._rows[s.seq_id] = _Row(s.seq_id, r.start)
                    if len(self._rows) > MAX_ROWS:  # the oldest row goes
                        del self._rows[next(iter(self._rows))]
                row.phase = s.phase
                if s.phase == "prefill":
                    row.prompt_done = s.start_pos + s.num_tokens
                if s.new_tokens:
                    row.output_tokens += s.new_tokens
                    row.last_token = r.end
                    if row.first_token is None:
                        row.first_token = r.end
                if s.finish_reason is not None or r.error is not None:
                    row.phase = "finished"
                    row.finish_reason = s.finish_reason or "error"
                    self._finished.append(self._rows.pop(s.seq_id))
            for seq_id in r.preempted:
                if (row := self._rows.get(seq_id)) is not None:
                    row.phase = "preempted"
            if self._map_wanted or not self._rows:
                self._take_map(r.index)

    def _take_map(self, step: int) -> None:
        self._map = self._block_map()
        self._map_step = step
        self._map_wanted = False
        self.version += 1
        self.map_serial += 1

    # -- readers (any thread) -------------------------------------------------------------
    def want_map(self) -> int:
        """Ask the engine thread for a block map at its next step; returns the serial to
        wait past for it (a reader that waits sends a map one step old, not one poll)."""
        with self._lock:
            self._map_wanted = True
            return self.map_serial

    def snapshot(self, after_step: int = -1) -> dict[str, Any]:
        """What changed since step `after_step` (the steps), and the state now (rows, the
        block map as of `kv.step`, the last step's roofline). JSON-ready."""
        now = time.perf_counter()
        with self._lock:
            steps = [s for s in self._steps if s[0] > after_step]
            rows = [r.json(self.t0) for r in self._rows.values()]
            done = [r.json(self.t0) for r in self._finished]
            block_map, map_step = self._map, self._map_step
            last = self._steps[-1] if self._steps else None
            version = self.version
        for row in rows:  # a running request's speed so far, at this moment
            row["age_s"] = round(now - self.t0 - row["arrival"], 3)
        return {"version": version, "t": round(now - self.t0, 4),
                "steps": [_step_json(s) for s in steps], "requests": rows + done,
                "kv": _map_json(block_map, map_step),
                "roofline": self._roofline(last)}

    def _roofline(self, last: tuple[Any, ...] | None) -> dict[str, Any]:
        """The last step's achieved bytes/s and FLOP/s, against the machine's measured
        limits where the server measured them (None: "not measured" on the page)."""
        m = self.machine
        out: dict[str, Any] = {"bandwidth": m.bandwidth if m else None,
                               "peak_flops": m.flops if m else None,
                               "bytes_per_s": None, "flops_per_s": None}
        if last is not None and last[2] > 0 and last[14] is None:
            secs = last[2] / 1e3
            out["bytes_per_s"] = (last[11] + last[12]) / secs
            out["flops_per_s"] = last[10] / secs
            out["step"] = last[0]
        return out


def _step_json(s: tuple[Any, ...]) -> dict[str, Any]:
    (index, start, ms, prefill, decode, batch, drafted, accepted, used, free, flops,
     weight_bytes, kv_bytes, preempted, error) = s
    return {"i": index, "t": start, "ms": ms, "prefill": prefill, "decode": decode,
            "batch": batch, "drafted": drafted, "accepted": accepted, "kv_used": used,
            "kv_free": free, "flops": flops, "bytes": weight_bytes + kv_bytes,
            "preempted": preempted, "error": error}


def _map_json(m: BlockMap | None, step: int) -> dict[str, Any] | None:
    """The pool as a states string, plus per block an index into the list of its owners
    (-1: none): the page colours a used block by its owner."""
    if m is None:
        return None
    names: dict[str, int] = {}
    owner_of = [names.setdefault(o, len(names)) if o else -1 for o in m.owners]
    return {"step": step, "states": m.states, "owners": list(names), "owner_of": owner_of,
            "used": m.num_used, "bytes_per_block": m.bytes_per_block,
            "used_bytes": m.num_used * m.bytes_per_block,
            "total_bytes": len(m.states) * m.bytes_per_block}
