"""TraceRecorder: the engine's steps and each request's phases as a Chrome trace-event
file (the JSON Object Format, which Perfetto and chrome://tracing open).

    recorder = TraceRecorder("trace.json")   # a bad path fails here, before any work
    engine.observer = recorder               # LLMEngine calls it (a StepObserver)
    ...
    recorder.write()                         # the whole trace, replacing the file

One process, one track ("thread") for the engine and one per sequence:
- engine: a complete event ("X") per step, its args the step's prefill and decode
  tokens, batch size, step time and KV blocks used and free;
- a sequence: "queued" from arrival to its first step, a "prefill" span per step that
  ran its prompt (one per chunk when chunked; a recompute after preemption is a prefill
  with args.recompute), a "decode" span per step that ran one new token, "preempted" from
  the step that evicted it to the step that resumed it, and a "finished" instant.

The prefill step samples the first token, so an N-token reply is one prefill span and
N - 1 decode spans; each span's args.new_tokens counts the tokens it produced (they sum
to N; a decode step that verified drafts may produce several).

Recording keeps compact tuples in memory; JSON is made only by write(). Timestamps are
microseconds since the recorder was made, on the engine's monotonic clock.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from kvloop.engine.steps import StepRecord
from kvloop.errors import KvloopError

logger = logging.getLogger("kvloop.engine")

PID = 1
ENGINE_TID = 0
# Events kept at most (~100 bytes each in memory): a server traced for days stops
# recording instead of growing without bound; the file says how many were dropped.
MAX_EVENTS = 2_000_000

# (track, name, phase "X" or "i", start s, end s, args)
_Event = tuple[int, str, str, float, float, dict[str, Any]]


class TraceRecorder:
    def __init__(self, path: str | os.PathLike[str], max_events: int = MAX_EVENTS) -> None:
        self.path = Path(path)
        self.max_events = max_events
        self.t0 = time.perf_counter()
        self._lock = threading.Lock()  # the engine thread records; another may write
        self._events: list[_Event] = []
        self.num_dropped = 0
        self.num_steps = 0  # steps recorded
        self._tids: dict[str, int] = {}  # sequence id -> its track
        self._waiting: dict[str, tuple[str, float]] = {}  # seq -> ("queued"|"preempted", since)
        self._recompute: set[str] = set()  # preempted: its next prefill is a recompute
        # Written now: a path that cannot be written is refused before the model loads,
        # and the file is a valid (empty) trace even if the process dies before write().
        try:
            self._dump(self._document([]), self.path)
        except OSError as e:
            raise KvloopError(f"cannot write the trace file {self.path}: "
                              f"{e.strerror or e}") from None

    # -- StepObserver (the engine's thread) -----------------------------------------------
    def on_added(self, seq_id: str, arrival: float) -> None:
        with self._lock:
            self._track(seq_id)
            self._waiting[seq_id] = ("queued", arrival)

    def on_aborted(self, seq_id: str, when: float) -> None:
        with self._lock:
            self._end(seq_id, "abort", when)

    def on_step(self, r: StepRecord) -> None:
        with self._lock:
            self.num_steps += 1
            args: dict[str, Any] = {
                "step": r.index, "prefill_tokens": r.num_prefill_tokens,
                "decode_tokens": r.num_decode_tokens, "batch_size": r.batch_size,
                "step_ms": round(r.step_ms, 3), "kv_blocks_used": r.kv_blocks_used,
                "kv_blocks_free": r.kv_blocks_free}
            if r.preempted:
                args["preempted"] = len(r.preempted)
            if r.error is not None:
                args["error"] = r.error
            self._add((ENGINE_TID, "step", "X", r.start, r.end, args))
            for s in r.seqs:
                tid = self._track(s.seq_id)
                self._close_wait(s.seq_id, tid, r.start)
                span: dict[str, Any] = {"positions": s.num_tokens, "start_pos": s.start_pos,
                                        "new_tokens": s.new_tokens}
                if s.num_draft:
                    span["draft_tokens"] = s.num_draft
                if s.phase == "prefill" and s.seq_id in self._recompute:
                    span["recompute"] = True
                    if s.new_tokens:
                        self._recompute.discard(s.seq_id)
                self._add((tid, s.phase, "X", r.start, r.end, span))
                if s.finish_reason is not None:
                    self._end(s.seq_id, s.finish_reason, r.end)
            for seq_id in r.preempted:
                self._waiting[seq_id] = ("preempted", r.start)
                self._recompute.add(seq_id)

    # -- the file -------------------------------------------------------------------------
    def write(self) -> None:
        """Write everything recorded so far, replacing the file whole (a reader never
        sees half a trace). Raises OSError when the file cannot be written."""
        with self._lock:
            events, tids = list(self._events), dict(self._tids)
            dropped = self.num_dropped
        doc = self._document(self._metadata(tids) + [self._json(e) for e in events], dropped)
        self._dump(doc, self.path)

    def _document(self, events: list[dict[str, Any]], dropped: int = 0) -> dict[str, Any]:
        return {"traceEvents": events, "displayTimeUnit": "ms",
                "otherData": {"producer": "kvloop", "dropped_events": dropped}}

    @staticmethod
    def _dump(doc: dict[str, Any], path: Path) -> None:
        """Through a temporary file in the same directory, renamed over `path`; where no
        file can be made beside it (a write-only directory), in place."""
        text = json.dumps(doc, separators=(",", ":"))
        try:
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        except OSError:
            path.write_text(text, encoding="utf-8")
            return
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def _metadata(self, tids: dict[str, int]) -> list[dict[str, Any]]:
        meta = [self._meta("process_name", ENGINE_TID, {"name": "kvloop"}),
                self._meta("thread_name", ENGINE_TID, {"name": "engine"}),
                self._meta("thread_sort_index", ENGINE_TID, {"sort_index": 0})]
        for seq_id, tid in tids.items():
            meta.append(self._meta("thread_name", tid, {"name": seq_id}))
            meta.append(self._meta("thread_sort_index", tid, {"sort_index": tid}))
        return meta

    @staticmethod
    def _meta(name: str, tid: int, args: dict[str, Any]) -> dict[str, Any]:
        return {"name": name, "ph": "M", "pid": PID, "tid": tid, "args": args}

    def _json(self, e: _Event) -> dict[str, Any]:
        tid, name, ph, start, end, args = e
        ev: dict[str, Any] = {"name": name, "cat": "engine" if tid == ENGINE_TID else "request",
                              "ph": ph, "ts": self._us(start), "pid": PID, "tid": tid,
                              "args": args}
        if ph == "X":
            ev["dur"] = round(max(0.0, end - start) * 1e6, 3)
        else:
            ev["s"] = "t"  # an instant on its own track
        return ev

    def _us(self, t: float) -> float:
        return round(max(0.0, t - self.t0) * 1e6, 3)

    # -- bookkeeping (under the lock) -----------------------------------------------------
    def _track(self, seq_id: str) -> int:
        tid = self._tids.get(seq_id)
        if tid is None:  # forked samples and beams are first seen in a step
            tid = self._tids[seq_id] = len(self._tids) + 1
        return tid

    def _close_wait(self, seq_id: str, tid: int, until: float) -> None:
        wait = self._waiting.pop(seq_id, None)
        if wait is not None:
            self._add((tid, wait[0], "X", wait[1], until, {}))

    def _end(self, seq_id: str, reason: str, when: float) -> None:
        tid = self._tids.get(seq_id)
        if tid is None:
            return
        self._close_wait(seq_id, tid, when)  # aborted while it waited
        self._recompute.discard(seq_id)
        self._add((tid, "finished", "i", when, when, {"reason": reason}))

    def _add(self, event: _Event) -> None:
        if len(self._events) >= self.max_events:
            if not self.num_dropped:
                logger.warning("trace: %d events recorded; later ones are dropped",
                               self.max_events)
            self.num_dropped += 1
            return
        self._events.append(event)
