"""AsyncEngine: one background thread owns the (not thread-safe) LLMEngine; asyncio code
talks to it through a thread-safe inbox and gets outputs back on per-request queues.

    aeng = AsyncEngine(engine); aeng.start()
    stream = await aeng.add_request("cmpl-1", prompt_ids, params)   # raises before queueing
    async for out in stream: ...                                     # RequestOutput per step
    aeng.abort("cmpl-1")                                             # frees its KV blocks

The thread drains the inbox (adds, aborts) between steps, runs `step()` while there is
work and blocks on the inbox when idle, so concurrent callers join one continuous batch.

Failures are contained at three depths. The engine itself fails only the requests whose
work raised (their streams raise RequestFailedError). Should anything escape the step
anyway, a supervisor fails the requests in flight, resets the engine's bookkeeping and
restarts the loop. Only a loop that keeps failing (MAX_RESTARTS within RESTART_WINDOW_S)
is declared dead: then every pending request fails with EngineDeadError and every later
one is refused (a server reports 503).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Protocol

from kvloop.engine.client import ReplicaLoad
from kvloop.engine.llm_engine import LLMEngine, release_free_heap
from kvloop.engine.outputs import RequestOutput
from kvloop.params import SamplingParams
from kvloop.scheduler import SchedulerStats

logger = logging.getLogger("kvloop.engine")

# While requests exist but a step scheduled nothing (rare: all waiting on blocks), wait on
# the inbox this long instead of spinning.
_IDLE_POLL_S = 0.005
# The supervisor restarts a failed loop, unless it failed this often within the window:
# then the failure is not transient and serving 503s is the honest answer.
MAX_RESTARTS = 3
RESTART_WINDOW_S = 60.0


class EngineDeadError(RuntimeError):
    """The engine loop failed (or was shut down); the request cannot be served."""


class RequestFailedError(RuntimeError):
    """This request failed inside the engine (its step's forward or its own work raised);
    the engine and every other request go on."""


class EngineOverloadedError(RuntimeError):
    """The waiting queue is full; the caller should retry later."""


class OutputObserver(Protocol):
    """Hooks called on the engine thread (metrics, request logs); must be quick."""

    def on_output(self, out: RequestOutput, first: bool) -> None: ...

    def on_abort(self, request_id: str, last: RequestOutput | None) -> None: ...


@dataclass
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    priority: int
    loop: asyncio.AbstractEventLoop
    sink: asyncio.Queue[RequestOutput | BaseException | None]
    ack: asyncio.Future[None]


@dataclass
class _Abort:
    request_id: str


class _Stop:
    pass


_Item = RequestOutput | BaseException | None  # what a stream's sink carries (None: aborted)
_Sink = asyncio.Queue[_Item]


@dataclass
class _Stream:
    """The engine thread's record of one live request."""

    loop: asyncio.AbstractEventLoop
    sink: _Sink
    last: RequestOutput | None = None

    def push(self, item: RequestOutput | BaseException | None) -> None:
        _call_in_loop(self.loop, lambda: self.sink.put_nowait(item))


@dataclass
class RequestStream:
    """The caller's end of one request: iterate for RequestOutputs until finished.

    Ends quietly when the request is aborted; raises EngineDeadError if the engine died.
    """

    request_id: str
    _sink: asyncio.Queue[RequestOutput | BaseException | None]
    finished: bool = field(default=False, init=False)

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iter()

    async def _iter(self) -> AsyncIterator[RequestOutput]:
        while not self.finished:
            item = await self._sink.get()
            if item is None:  # aborted
                self.finished = True
                return
            if isinstance(item, BaseException):
                self.finished = True
                raise item
            self.finished = item.finished
            yield item


class AsyncEngine:
    def __init__(self, engine: LLMEngine, max_waiting: int | None = None,
                 observer: OutputObserver | None = None) -> None:
        self.engine = engine
        self.max_waiting = max_waiting
        self.observer = observer
        self._inbox: queue.SimpleQueue[_Add | _Abort | _Stop] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}  # engine thread only
        self._lock = threading.Lock()  # guards the four fields below
        self._error: BaseException | None = None
        self._stopped = False
        self._pending_adds = 0  # in the inbox, not yet handed to the engine
        self._stats: SchedulerStats = engine.stats()
        self._thread = threading.Thread(target=self._run, name="kvloop-engine", daemon=True)

    @classmethod
    def build(cls, factory: Callable[[], LLMEngine], max_waiting: int | None = None,
              observer: OutputObserver | None = None) -> AsyncEngine:
        """Construct the engine on the thread that will run it, start that thread's loop,
        and return once the engine is ready (a load error is raised here, in the caller).

        Why the same thread: OpenMP (libgomp, under torch and the native kernels) keeps one
        pool of worker threads per thread that opens parallel regions. Loading a model on
        the main thread leaves a pool there; the loop thread then makes a second, and once
        libgomp manages more threads than there are CPUs, its workers stop spin-waiting
        between parallel regions and sleep on a futex instead. A decode step opens hundreds
        of short regions, so each step paid a wake-up per region: on 2 cores the default
        model's native step took 8.9 ms a token on a second thread against 4.4 ms on the
        first (benchmarks/bench_serving.py; see README's Serving section). Built here, the
        model's every parallel region opens on this one thread."""
        ready: queue.SimpleQueue[AsyncEngine | BaseException] = queue.SimpleQueue()

        def main() -> None:
            try:
                aeng = cls(factory(), max_waiting, observer)
            except BaseException as e:  # handed to the caller, raised there
                ready.put(e)
                return
            aeng._thread = threading.current_thread()  # start() finds it alive
            ready.put(aeng)
            aeng._run()

        threading.Thread(target=main, name="kvloop-engine", daemon=True).start()
        got = ready.get()
        if isinstance(got, BaseException):
            raise got
        return got

    # -- lifecycle --------------------------------------------------------------------------
    def start(self) -> None:
        if not self._thread.is_alive():
            self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop; requests still running fail with EngineDeadError."""
        with self._lock:
            self._stopped = True
        self._inbox.put(_Stop())
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def error(self) -> BaseException | None:
        return self._error

    @property
    def healthy(self) -> bool:
        return self._error is None and not self._stopped and self._thread.is_alive()

    # -- figures (any thread) -------------------------------------------------------------
    def stats(self) -> SchedulerStats:
        """The engine's figures as of its last step, add or abort (a snapshot: the engine
        itself must not be touched from another thread)."""
        return self._stats

    def replica_loads(self) -> list[ReplicaLoad]:
        """One in-process engine has no replicas to report (EngineClient)."""
        return []

    def num_queued(self) -> int:
        """Sequences accepted but not yet running: in the inbox or the engine's queue."""
        with self._lock:
            return self._pending_adds + self._stats.num_waiting

    # -- requests (event loop) -------------------------------------------------------------
    async def add_request(self, request_id: str, prompt: str | list[int],
                          params: SamplingParams, priority: int = 0) -> RequestStream:
        """Queue a request; raises the engine's KvloopError (bad input),
        EngineOverloadedError or EngineDeadError before anything runs."""
        if params.structured is not None:
            # Compiled here, off the engine thread: a wide schema takes ~0.5 s of native
            # work (without the GIL), which on the engine thread would stall every stream.
            # The engine's own compile then finds it cached; a bad grammar raises here.
            params.validate()
            await asyncio.to_thread(self.engine.grammars.prepare, params.structured)
        loop = asyncio.get_running_loop()
        sink: asyncio.Queue[RequestOutput | BaseException | None] = asyncio.Queue()
        ack: asyncio.Future[None] = loop.create_future()
        with self._lock:
            if self._error is not None or self._stopped:
                raise EngineDeadError(f"the engine is not running ({self._error!r})")
            if (self.max_waiting is not None
                    and self._pending_adds + self._stats.num_waiting >= self.max_waiting):
                raise EngineOverloadedError(
                    f"{self._pending_adds + self._stats.num_waiting} sequences are already "
                    f"waiting (limit {self.max_waiting})")
            self._pending_adds += params.n
            # Under the lock, so a dying loop cannot miss this command (see _fail_all).
            self._inbox.put(_Add(request_id, prompt, params, priority, loop, sink, ack))
        try:
            await ack
        except asyncio.CancelledError:
            self.abort(request_id)  # the caller left before the engine took it
            raise
        return RequestStream(request_id, sink)

    def abort(self, request_id: str) -> None:
        """Thread-safe, non-blocking; a no-op for unknown or finished requests."""
        self._inbox.put(_Abort(request_id))

    # -- the engine thread -----------------------------------------------------------------
    def _run(self) -> None:
        """The supervisor: run the loop; if it raises, fail what was in flight, reset the
        engine and run it again, unless it keeps failing."""
        restarts: list[float] = []
        while True:
            try:
                self._loop()
            except Exception as e:
                now = time.monotonic()
                restarts = [t for t in restarts if now - t < RESTART_WINDOW_S] + [now]
                if len(restarts) > MAX_RESTARTS:
                    logger.exception("engine loop failed %d times in %.0f s; giving up",
                                     len(restarts), RESTART_WINDOW_S)
                    self._fail_all(e)
                    return
                logger.exception("engine loop failed; failing its requests and restarting")
                self._recover(e)
                continue
            except BaseException as e:  # interpreter shutdown and the like: no restart
                self._fail_all(e)
                return
            self._fail_all(None)
            return

    def _loop(self) -> None:
        """Serve the inbox and step the engine until asked to stop."""
        eng = self.engine
        trimmed = True  # since the engine last went idle
        while True:
            busy = eng.has_unfinished_requests()
            if not busy and not trimmed:
                # A burst is over: the C heap's free pages (its steps' activations, logits,
                # prompt log-probs) go back to the OS, so that a served request returns its
                # memory instead of holding the process at the burst's peak.
                release_free_heap()
                trimmed = True
            if self._apply(self._drain(block=not busy)):
                return
            if not eng.has_unfinished_requests():
                continue
            trimmed = False
            steps = eng.num_steps
            outputs = eng.step()
            # Figures first: a caller woken by its final output already sees them.
            self._publish()
            self._dispatch(outputs)
            if (eng.num_steps == steps and not outputs
                    and self._apply(self._drain(block=True, timeout=_IDLE_POLL_S))):
                return

    def _recover(self, error: Exception) -> None:
        """The loop raised: the engine's bookkeeping is unknown, so every request in it
        fails (with a clear error) and the engine starts over empty."""
        exc = RequestFailedError(f"the engine loop failed while this request ran and was "
                                 f"restarted: {error!r}")
        for stream in self._streams.values():
            stream.push(exc)
        self._streams.clear()
        self.engine.reset()
        self._publish()

    def _drain(self, block: bool, timeout: float | None = None) -> list[_Add | _Abort | _Stop]:
        cmds: list[_Add | _Abort | _Stop] = []
        if block:
            try:
                cmds.append(self._inbox.get(timeout=timeout))
            except queue.Empty:
                return cmds
        while True:
            try:
                cmds.append(self._inbox.get_nowait())
            except queue.Empty:
                return cmds

    def _apply(self, cmds: list[_Add | _Abort | _Stop]) -> bool:
        """Run inbox commands in order; True when asked to stop."""
        stop = False
        adds = 0
        failure: Exception | None = None
        for cmd in cmds:
            if isinstance(cmd, _Stop):
                stop = True
            elif isinstance(cmd, _Add):
                adds += cmd.params.n
                self._add(cmd)
            else:
                try:
                    self._abort(cmd.request_id)
                except Exception as e:  # the rest of the batch is still served first
                    failure = failure or e
        if cmds:
            self._publish(adds)
        if failure is not None:
            raise failure  # the engine's bookkeeping is in doubt: the supervisor resets it
        return stop

    def _add(self, cmd: _Add) -> None:
        def settle(exc: BaseException | None) -> None:
            if cmd.ack.done():  # the caller was cancelled
                return
            if exc is None:
                cmd.ack.set_result(None)
            else:
                cmd.ack.set_exception(exc)

        try:
            self.engine.add_request(cmd.request_id, cmd.prompt, cmd.params, cmd.priority)
        except Exception as e:  # bad input (KvloopError) or a bug: that request fails alone
            _call_in_loop(cmd.loop, functools.partial(settle, e))  # `e` dies with the clause
            return
        self._streams[cmd.request_id] = _Stream(cmd.loop, cmd.sink)
        _call_in_loop(cmd.loop, lambda: settle(None))

    def _abort(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return
        self.engine.abort(request_id)
        stream.push(None)
        if self.observer is not None:
            try:
                self.observer.on_abort(request_id, stream.last)
            except Exception:  # a metrics bug must not take the engine down
                logger.exception("output observer failed")

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        """Hand a step's outputs to their streams: one wake-up of each event loop per step
        (a batch of puts), not one per stream."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[_Sink, _Item]]] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            first, stream.last = stream.last is None, out
            if out.finished:
                del self._streams[out.request_id]
            item = out if out.error is None else RequestFailedError(out.error)
            batches.setdefault(stream.loop, []).append((stream.sink, item))
            if self.observer is not None:
                try:
                    self.observer.on_output(out, first)
                except Exception:  # a metrics bug must not take the engine down
                    logger.exception("output observer failed")
        for loop, items in batches.items():
            _call_in_loop(loop, functools.partial(_put_all, items))

    def _publish(self, adds_done: int = 0) -> None:
        stats = self.engine.stats()
        with self._lock:
            self._stats = stats
            self._pending_adds -= adds_done

    def _fail_all(self, error: BaseException | None) -> None:
        with self._lock:
            self._error = error
            self._stopped = True
            leftover = self._drain(block=False)
        exc = EngineDeadError(
            "the engine stopped" if error is None else f"the engine loop failed: {error!r}")
        for cmd in leftover:
            if isinstance(cmd, _Add):
                _call_in_loop(cmd.loop, functools.partial(_fail_future, cmd.ack, exc))
        for stream in self._streams.values():
            stream.push(exc)
        self._streams.clear()


def _call_in_loop(loop: asyncio.AbstractEventLoop, fn: Callable[[], object]) -> None:
    """Schedule `fn` on `loop` from the engine thread; a closed loop has nobody to tell."""
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(fn)


def _put_all(items: list[tuple[_Sink, _Item]]) -> None:
    for sink, item in items:
        sink.put_nowait(item)


def _fail_future(fut: asyncio.Future[None], exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
