"""Chat templates: jinja2 code from the model file, rendered under hard limits.

A chat template is untrusted code, bounded twice:

- Inside the render, jinja's immutable sandbox (`_LimitedSandbox`) refuses escapes and
  pre-checks every operation that can build a big value, and a trace function checks the
  deadline at every Python line the render runs.
- Around it, the render runs in a worker process: one of a small pool of persistent
  interpreters started with subprocess (a fresh `python -I`, never a fork of a process
  holding torch's threads) that import this module and jinja2, not torch. The worker runs
  under an address-space limit (RLIMIT_AS), and is killed when a render overruns its time.
  Work done in C (``sum`` over lists, one huge ``sort``) checks no deadline and holds the
  interpreter lock for as long as it runs: in a worker it holds only the worker's, so the
  server's event loop, its other requests and /health go on, and the kill ends it at the
  limit whatever the template calls.

The parent sends the template source and the context (pickled: it trusts its own data) and
reads back a one-byte kind and a UTF-8 text (never a pickle: the worker ran untrusted code).
A worker compiles each template once and is reused; a render costs a pipe round trip.

This module imports only the standard library and kvloop.errors, and the sandbox
(kvloop.loading.template_sandbox: jinja2) where a render runs: a worker imports it as it
starts, the engine's process never (jinja2's import was ~5% of a one-shot command).
"""

from __future__ import annotations

import atexit
import json
import math
import os
import pickle
import resource
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvloop.errors import KvloopError

# --- chat template limits ---------------------------------------------------------------------
# A chat template is code from the model file: untrusted. Jinja's sandbox stops escapes;
# these bound what one render may cost, so a hostile template fails fast with one line
# instead of holding a worker for ever or eating the machine's memory. Real
# templates render in about a millisecond, a few KiB, macros nested a few deep.
# Wall time of one render: checked at every template line, and past it (plus a grace) the
# worker is killed, whatever it is doing.
TEMPLATE_TIME_LIMIT_S = 1.0
# Any string a template builds (by +, *, ~, %, format, join, filters, str methods), and its
# output: 4 Mi characters is about a million tokens, more than any context kvloop serves.
TEMPLATE_MAX_CHARS = 4 * 2**20
TEMPLATE_MAX_ITEMS = 2**20  # any list or tuple a template builds with * or +
TEMPLATE_MAX_MACRO_DEPTH = 64  # nested macro calls (tool-schema macros recurse ~10 deep)
TEMPLATE_MAX_INT_BITS = 2**16  # integers built with * or ** (C-level big-int work)

# The conversations a template is tried on at load, in turn until one renders: most
# Address space of a render worker (RLIMIT_AS): the interpreter and jinja2 take ~40 MiB of
# it, the biggest values the size limits allow a few tens more.
TEMPLATE_MAX_MEMORY = 512 * 2**20
TEMPLATE_WORKERS = 4  # render processes at most, started as renders need them


class TemplateLimitError(KvloopError):
    """A chat template ran over a render limit (time, size, recursion)."""

    def __init__(self, what: str) -> None:
        super().__init__(f"chat template {what}")
        self.what = what  # "timed out (over 1 s)": reads after "the template ..."


class _OutOfMemory(TemplateLimitError):
    """A render hit its worker's address-space limit (MemoryError)."""

    def __init__(self) -> None:
        super().__init__(f"ran out of memory (limit {_memory_limit // 2**20} MiB)")


class TemplateRefusedError(KvloopError):
    """The template refused the conversation on purpose (raise_exception: "roles must
    alternate"): a bad request, not a bad template."""


class TemplateCompileError(KvloopError):
    """The template is not valid jinja."""


_memory_limit = TEMPLATE_MAX_MEMORY  # this worker's RLIMIT_AS, named in out-of-memory errors


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text or type(e).__name__


# --- the render workers -----------------------------------------------------------------------
# A frame on the pipes: an 8-byte big-endian length, then that many bytes. A reply's bytes
# are a kind byte and UTF-8 text (surrogates passed through: the parent checks text later).
_HEADER = struct.Struct(">Q")
_OK, _LIMIT, _MEMORY, _REFUSED, _ERROR, _COMPILE, _READY = b"olmrecR"
_MAX_REPLY = 4 * TEMPLATE_MAX_CHARS + 64  # UTF-8 of the largest output allowed, and the kind
_KILL_GRACE_S = 0.5  # past the limit, for the worker's own deadline check to answer first
_START_TIMEOUT_S = 60.0  # a fresh interpreter importing jinja2, on a loaded machine


def _reply(source: str, context: Mapping[str, Any]) -> tuple[int, str]:
    """A worker's answer to one request: (kind, text)."""
    from kvloop.loading.template_sandbox import render_in_process

    try:
        return _OK, render_in_process(source, context)
    except TemplateLimitError as e:
        return (_MEMORY if isinstance(e, _OutOfMemory) else _LIMIT), e.what
    except TemplateCompileError as e:
        return _COMPILE, str(e)
    except TemplateRefusedError as e:
        return _REFUSED, str(e)
    except KvloopError as e:
        return _ERROR, str(e)


def _write_frame(fd: int, data: bytes) -> None:
    view = memoryview(_HEADER.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view):]


def _read_exact(fd: int, n: int, deadline: float = math.inf) -> bytes | None:
    """`n` bytes from `fd`; None at end of file; _Overtime when the deadline passes first."""
    data = bytearray()
    while len(data) < n:
        if deadline < math.inf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise _Overtime
        chunk = os.read(fd, n - len(data))
        if not chunk:
            return None
        data += chunk
    return bytes(data)


def _worker_main(max_memory: int = TEMPLATE_MAX_MEMORY) -> None:
    """A worker's loop: read a request from stdin, answer on stdout, until stdin closes.
    `max_memory` is its address-space limit (tests pass a smaller one)."""
    global _memory_limit
    import kvloop.loading.template_sandbox  # noqa: F401  (jinja2: before the first request)

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the server, which ends us
    resource.setrlimit(resource.RLIMIT_AS, (max_memory, max_memory))
    _memory_limit = max_memory
    sys.stdout = sys.stderr  # fd 1 carries replies only
    _write_frame(1, bytes([_READY]))
    while True:
        header = _read_exact(0, _HEADER.size)
        if header is None:
            return
        request = _read_exact(0, _HEADER.unpack(header)[0])
        if request is None:
            return
        try:
            source, context = pickle.loads(request)
            kind, text = _reply(source, context)
        except MemoryError:  # the request itself did not fit: this worker is done
            kind, text = _MEMORY, _OutOfMemory().what
        _write_frame(1, bytes([kind]) + text.encode("utf-8", "surrogatepass"))
        if kind == _MEMORY:
            return  # a fresh process rather than one whose heap has been at its limit


class _Overtime(Exception):
    """A worker did not answer by the deadline."""


class _Gone(Exception):
    """A worker ended (or answered nonsense) instead of answering."""


class _Stale(Exception):
    """A worker had ended before it was given the request (killed from outside)."""


# The worker's command: a fresh interpreter (-I: no environment, no user site, no current
# directory) that finds kvloop and jinja2 where this process found them.
_BOOT = ("import json, sys; sys.path[:0] = json.loads(sys.argv[1]); "
         "from kvloop.loading.chat_template import _worker_main; _worker_main()")


def _worker_path() -> list[str]:
    root = str(Path(__file__).resolve().parents[2])  # the directory holding kvloop/
    return [root, *(p for p in sys.path if p and p != root)]


class _Worker:
    """One render process, and the pipes to it."""

    def __init__(self) -> None:
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-I", "-c", _BOOT, json.dumps(_worker_path())],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            )
        except OSError as e:
            raise KvloopError(f"cannot start a chat template worker: {e}") from None
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self._in, self._out = self.proc.stdin.fileno(), self.proc.stdout.fileno()
        try:
            ready = self._read(time.monotonic() + _START_TIMEOUT_S)
        except (_Overtime, _Gone):
            self.kill()
            raise KvloopError("a chat template worker did not start") from None
        if ready != (_READY, ""):
            self.kill()
            raise KvloopError("a chat template worker did not start")

    def call(self, payload: bytes, deadline: float) -> tuple[int, str]:
        try:
            _write_frame(self._in, payload)
        except OSError:  # it died while idle: not this template's doing
            raise _Stale from None
        return self._read(deadline)

    def _read(self, deadline: float) -> tuple[int, str]:
        header = _read_exact(self._out, _HEADER.size, deadline)
        size = _HEADER.unpack(header)[0] if header is not None else 0
        if header is None or not 0 < size <= _MAX_REPLY:
            raise _Gone(self._exit_status())
        data = _read_exact(self._out, size, deadline)
        if data is None:
            raise _Gone(self._exit_status())
        return data[0], data[1:].decode("utf-8", "surrogatepass")

    def _exit_status(self) -> str:
        try:
            code = self.proc.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            return "its render process answered out of turn"
        return f"its render process ended (exit status {code})"

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()


class _WorkerPool:
    """Up to `size` workers, started when renders need them and reused; a render waits for
    a free one. A worker that overran or failed is killed, and replaced on demand."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._idle: list[_Worker] = []
        self._count = 0
        self._starting = 0  # prestart()'s workers not yet ready: a render waits for them
        self._cond = threading.Condition()

    def prestart(self) -> None:
        """Start one worker in the background, if none is idle or starting: the first
        render (the load-time check of a model's template) then finds it ready instead of
        waiting ~0.1 s for a process to boot, the boot overlapping the caller's own work."""
        with self._cond:
            if self._idle or self._starting or self._count >= self._size:
                return
            self._count += 1
            self._starting += 1

        def boot() -> None:
            try:
                worker = _Worker()
            except BaseException:  # a render that needs one starts it and reports why not
                with self._cond:
                    self._starting -= 1
                self._forget()
                return
            with self._cond:
                self._starting -= 1
                self._idle.append(worker)
                self._cond.notify()

        threading.Thread(target=boot, name="kvloop-template-boot", daemon=True).start()

    def acquire(self) -> _Worker:
        with self._cond:
            while not self._idle and (self._starting or self._count >= self._size):
                self._cond.wait()
            if self._idle:
                return self._idle.pop()
            self._count += 1
        try:
            return _Worker()
        except BaseException:
            self._forget()
            raise

    def release(self, worker: _Worker, reuse: bool) -> None:
        if not reuse:
            worker.kill()
            self._forget()
            return
        with self._cond:
            self._idle.append(worker)
            self._cond.notify()

    def _forget(self) -> None:
        with self._cond:
            self._count -= 1
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            idle, self._idle = self._idle, []
            self._count -= len(idle)
        for worker in idle:
            worker.kill()


_pools: dict[int, _WorkerPool] = {}
_pools_lock = threading.Lock()


def _pool() -> _WorkerPool:
    """This process's pool (a forked child must not share its parent's workers)."""
    with _pools_lock:
        pool = _pools.get(os.getpid())
        if pool is None:
            pool = _pools[os.getpid()] = _WorkerPool(TEMPLATE_WORKERS)
            atexit.register(pool.close)
        return pool


def prestart_worker() -> None:
    """Boot a render worker in the background now (see _WorkerPool.prestart)."""
    _pool().prestart()


def render_chat_template(source: str, context: Mapping[str, Any]) -> str:
    """Render template `source` with `context` in a worker process, under every TEMPLATE_*
    limit. Failures are one KvloopError line: TemplateCompileError, TemplateLimitError
    (over time, memory or size), TemplateRefusedError (the template's raise_exception), or a
    plain KvloopError for the template's bugs."""
    try:
        payload = pickle.dumps((source, dict(context)), pickle.HIGHEST_PROTOCOL)
    except Exception as e:  # an API caller's value that cannot cross to the worker
        raise KvloopError(f"chat template error: cannot pass a value: {_one_line(e)}") from None
    for _ in range(TEMPLATE_WORKERS + 1):  # past every idle worker that died unused
        try:
            return _result(*_call_worker(payload))
        except _Stale:
            continue
    raise KvloopError("chat template error: its render processes keep dying")


def _call_worker(payload: bytes) -> tuple[int, str]:
    pool = _pool()
    worker = pool.acquire()
    reuse = False
    try:
        reply = worker.call(payload, time.monotonic() + TEMPLATE_TIME_LIMIT_S + _KILL_GRACE_S)
        reuse = reply[0] != _MEMORY  # that worker exits after answering
        return reply
    except _Overtime:  # stuck in C, where no deadline check reaches: the kill ends it
        raise TemplateLimitError(f"timed out (over {TEMPLATE_TIME_LIMIT_S:g} s)") from None
    except _Gone as e:
        raise TemplateLimitError(f"crashed: {e}") from None
    finally:
        pool.release(worker, reuse)


def _result(kind: int, text: str) -> str:
    if kind == _OK:
        return text
    if kind in (_LIMIT, _MEMORY):
        raise TemplateLimitError(text)
    if kind == _REFUSED:
        raise TemplateRefusedError(text)
    if kind == _COMPILE:
        raise TemplateCompileError(text)
    if kind == _ERROR:
        raise KvloopError(text)
    raise TemplateLimitError("crashed: its render process answered nonsense")
