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

This module imports only the standard library, jinja2 and kvloop.errors: it is what a
worker imports.
"""

from __future__ import annotations

import atexit
import functools
import inspect
import json
import math
import os
import pickle
import re
import resource
import select
import signal
import string
import struct
import subprocess
import sys
import threading
import time
import types
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.runtime
import jinja2.sandbox

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


class _TemplateRaised(jinja2.TemplateError):
    """raise_exception() in a template: it refuses a conversation on purpose."""


class _RenderBudget(threading.local):
    """The limits of the render running on this thread (one per worker; several when a
    test renders in-process on threads)."""

    deadline = math.inf
    depth = 0


_budget = _RenderBudget()
_memory_limit = TEMPLATE_MAX_MEMORY  # this worker's RLIMIT_AS, named in out-of-memory errors


def _check_time() -> None:
    if time.monotonic() > _budget.deadline:
        raise TemplateLimitError(f"timed out (over {TEMPLATE_TIME_LIMIT_S:g} s)")


def _too_large(detail: str) -> TemplateLimitError:
    return TemplateLimitError(f"went over its size limit: {detail}")


def _check_chars(n: int, what: str) -> None:
    if n > TEMPLATE_MAX_CHARS:
        raise _too_large(
            f"{what} would be {n} characters (limit {TEMPLATE_MAX_CHARS})"
        )


def _check_items(n: int, what: str) -> None:
    if n > TEMPLATE_MAX_ITEMS:
        raise _too_large(
            f"{what} would have {n} items (limit {TEMPLATE_MAX_ITEMS})"
        )


def _weight(value: Any) -> int:
    """About how many characters str(value) has, counted only until it passes
    TEMPLATE_MAX_CHARS: cheap even on a list holding the same huge string a million times."""
    total, stack = 0, [value]
    while stack and total <= TEMPLATE_MAX_CHARS:
        v = stack.pop()
        if isinstance(v, str | bytes):
            total += len(v)
        elif isinstance(v, Mapping):
            total += 2 + 4 * len(v)
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list | tuple | set | frozenset):
            total += 2 + 2 * len(v)
            stack.extend(v)
        elif isinstance(v, jinja2.runtime.Namespace):  # prints its attributes
            total += 12
            stack.append(object.__getattribute__(v, "_Namespace__attrs"))
        else:
            total += 4
    return total


def _check_binop(op: str, left: Any, right: Any) -> None:
    """Refuse an operation whose result would be over a limit *before* Python builds it: one
    C-level `'A' * 2**32` is out of reach of any later check."""
    seqs = str | list | tuple
    if op == "*":
        for seq, n in ((left, right), (right, left)):
            if isinstance(seq, seqs) and isinstance(n, int) and n > 0:
                if not isinstance(seq, str):
                    _check_items(len(seq) * n, "a repeated list")
                _check_chars(_weight(seq) * n, "a repeated value")
        if (isinstance(left, int) and isinstance(right, int)
                and left.bit_length() + right.bit_length() > TEMPLATE_MAX_INT_BITS):
            raise _too_large(f"an integer product of over {TEMPLATE_MAX_INT_BITS} bits")
    elif op == "+" and isinstance(left, seqs) and isinstance(right, seqs):
        if not isinstance(left, str):
            _check_items(len(left) + len(right), "a joined list")
        _check_chars(_weight(left) + _weight(right), "a joined value")
    elif op == "**" and isinstance(left, int) and isinstance(right, int) and right > 0:
        if abs(left) > 1 and left.bit_length() * right > TEMPLATE_MAX_INT_BITS:
            raise _too_large(f"an integer power of over {TEMPLATE_MAX_INT_BITS} bits")
    elif op == "%" and isinstance(left, str):
        _check_printf(left, right)


_MAX_JSON_INDENT = 64  # real templates indent tool schemas by 2 or 4

_PRINTF_SPEC = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?")
_WIDTH = re.compile(r"\d+")


def _check_width(digits: str) -> int:
    if len(digits) > 9 or int(digits) > TEMPLATE_MAX_CHARS:
        raise _too_large(f"a field width of {digits[:12]} characters")
    return int(digits)


def _check_printf(fmt: str, args: Any) -> None:
    """`fmt % args`: each field is at most its width (or precision) plus all of `args`."""
    bound = len(fmt)
    for m in _PRINTF_SPEC.finditer(fmt):
        bound += _weight(args)
        for g in m.groups():
            if g == "*":  # the width comes from args
                values = args if isinstance(args, tuple) else (args,)
                if any(isinstance(a, int) and abs(a) > TEMPLATE_MAX_CHARS for a in values):
                    raise _too_large(f"a field width over {TEMPLATE_MAX_CHARS}")
                bound += TEMPLATE_MAX_CHARS // 2  # two such fields are over the limit
            elif g:
                bound += _check_width(g)
        _check_chars(bound, "a %-formatted string")


def _check_str_format(fmt: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
    """`fmt.format(*args, **kwargs)`, checked like `%`."""
    try:
        parsed = list(string.Formatter().parse(fmt))
    except ValueError:
        return  # str.format raises the same error itself
    bound = len(fmt)
    for _, name, spec, _ in parsed:
        if name is None:
            continue
        bound += _weight(args) + _weight(kwargs)
        for digits in _WIDTH.findall(spec or ""):
            bound += _check_width(digits)
        _check_chars(bound, "a formatted string")
    nested = "{" in "".join(spec or "" for _, _, spec, _ in parsed)  # {:{w}}
    if nested and any(isinstance(a, int) and abs(a) > TEMPLATE_MAX_CHARS
                      for a in (*args, *kwargs.values())):
        raise _too_large(f"a field width over {TEMPLATE_MAX_CHARS}")


def _check_str_call(method: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
                    ) -> tuple[Any, ...]:
    """Pre-check the str methods that can build far more text than they are given; returns
    the arguments to call with (an iterator handed to join is read once, here)."""
    text, name = method.__self__, method.__name__
    if name in ("center", "ljust", "rjust", "zfill"):
        width = args[0] if args else kwargs.get("width", 0)
        if isinstance(width, int):
            _check_chars(width, f"str.{name}()")
    elif name == "expandtabs":
        size = args[0] if args else kwargs.get("tabsize", 8)
        if isinstance(size, int):
            _check_chars(len(text) + text.count("\t") * size, "str.expandtabs()")
    elif name == "replace" and len(args) >= 2:
        _check_replace(text, args[0], args[1], args[2] if len(args) > 2 else -1)
    elif name == "join" and args:
        items = list(args[0])
        _check_join(items, text)
        args = (items, *args[1:])
    elif name == "format":  # jinja < 3.1.5 hands str.format itself to call()
        _check_str_format(text, args, kwargs)
    elif name == "format_map" and args and isinstance(args[0], Mapping):
        _check_str_format(text, (), args[0])
    return args


def _check_replace(text: str, old: Any, new: Any, count: Any) -> None:
    if isinstance(old, str) and isinstance(new, str):
        hits = text.count(old) if old else len(text) + 1
        if isinstance(count, int) and count >= 0:
            hits = min(hits, count)
        _check_chars(len(text) + hits * len(new), "a replace()")


def _check_join(items: list[Any], sep: Any) -> None:
    _check_items(len(items), "a joined list")
    _check_chars(_weight(items) + len(str(sep)) * len(items), "a join()")


# Filters that turn their input into text: its size is checked before they do.
_STRINGIFYING = frozenset({
    "string", "tojson", "pprint", "replace", "indent", "center", "wordwrap", "truncate",
    "title", "capitalize", "upper", "lower", "trim", "striptags", "urlize", "urlencode",
    "wordcount", "format", "escape", "e", "forceescape", "safe", "xmlattr",
})


def _guarded_filter(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """A filter that checks the time, pre-checks the size of what it would build (join,
    center, indent, replace, format), and checks the size of what it built."""
    signature = inspect.signature(fn)  # of the plain function, for jinja's async variants
    # An async-variant filter whose plain function takes no context is called with the eval
    # context first, which its wrapper drops: so do we, to bind the arguments by name.
    wrapped = getattr(fn, "__wrapped__", None)
    skip = int(getattr(fn, "jinja_async_variant", False) and wrapped is not None
               and getattr(wrapped, "jinja_pass_arg", None) is None)
    # The filtered value: the first parameter after any context jinja passes.
    value_param = next((p for p in signature.parameters
                        if p not in ("eval_ctx", "context", "environment", "env")), None)

    @functools.wraps(fn)  # keeps jinja's pass_eval_context marker on the wrapper
    def run(*args: Any, **kwargs: Any) -> Any:
        _check_time()
        try:
            bound = signature.bind(*args[skip:], **kwargs)
        except TypeError:
            return fn(*args, **kwargs)  # the filter reports its own misuse
        bound.apply_defaults()
        a = bound.arguments
        if name in _STRINGIFYING and value_param:  # str() of a huge list: one C-level call
            _check_chars(_weight(a[value_param]), f"|{name}")
        if name == "join":
            a["value"] = list(a["value"])
            _check_join(a["value"], a["d"])
        elif name == "center" and isinstance(a["width"], int):
            _check_chars(a["width"], "|center")
        elif name == "indent":
            text, width = str(a["s"]), a["width"]  # (weight checked above)
            pad = width if isinstance(width, int) else len(str(width))
            _check_chars(len(text) + (text.count("\n") + 1) * pad, "|indent")
        elif name == "replace":
            _check_replace(str(a["s"]), a["old"], a["new"], a["count"])
        elif name == "format" and isinstance(a["value"], str):
            _check_printf(a["value"], tuple(a["args"]) or dict(a["kwargs"]))
        elif name in ("batch", "slice"):  # filled or counted out to this many, in C or in
            count = a["linecount" if name == "batch" else "slices"]  # jinja's untraced code
            if isinstance(count, int):
                _check_items(count, f"|{name}")
        elif name == "tojson" and a["indent"] is not None:
            indent = a["indent"]  # repeated on every line, once per nesting level
            width = indent if isinstance(indent, int) else len(str(indent))
            if width > _MAX_JSON_INDENT:
                raise _too_large(f"a |tojson indent of {width} (limit {_MAX_JSON_INDENT})")
        out = fn(*args[:skip], *bound.args, **bound.kwargs)
        if isinstance(out, str):
            _check_chars(len(out), f"|{name}")
        elif isinstance(out, list):
            _check_items(len(out), f"|{name}")
        return out

    return run


def _guarded_concat(chunks: Iterable[str]) -> str:
    """The environment's `concat`, which joins every render's and macro's output: the
    output-size limit, and a deadline check per chunk."""
    parts, size = [], 0
    for chunk in chunks:
        size += len(chunk)
        _check_chars(size, "the rendered text")
        _check_time()
        parts.append(chunk)
    return "".join(parts)


def _guarded_str_join(seq: Iterable[Any]) -> str:
    """The `~` operator (compiled to runtime.str_join), size-checked before it joins."""
    items = list(seq)
    _check_chars(sum(_weight(x) for x in items), "a ~ concatenation")
    parts = [str(x) for x in items]
    _check_chars(sum(map(len, parts)), "a ~ concatenation")
    return "".join(parts)


def _checked_output(value: Any) -> Any:
    """The environment's `finalize`: every `{{ value }}` passes here before str(value), one
    C-level call that a list nesting huge strings would make huge."""
    if not isinstance(value, str):
        _check_chars(_weight(value), "an output value")
    return value


def _trace_lines(frame: types.FrameType, event: str, arg: Any) -> Any:
    """Local trace function during a render: the deadline, at every line. This is what
    stops loops that call nothing and print nothing (nested `for` over ranges), and long
    Python loops inside filters (|wordwrap, |urlize, |groupby on megabytes of text)."""
    if event == "line" and time.monotonic() > _budget.deadline:  # _check_time, inlined
        _check_time()
    return _trace_lines


def _trace_calls(frame: types.FrameType, event: str, arg: Any) -> Any:
    # Every Python frame of the render, jinja's runtime and filters included: their loops
    # over a template's (size-limited) values can run for seconds too. C-level work is what
    # the size pre-checks bound. Not this module's own checks: short, and they run often.
    return None if frame.f_code.co_filename == __file__ else _trace_lines


class _LimitedSandbox(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """The immutable sandbox, with every operation that can build big values checked
    before it runs, and macro nesting bounded."""

    intercepted_binops = frozenset({"*", "+", "**", "%"})

    def call_binop(self, context: jinja2.runtime.Context, operator: str, left: Any,
                   right: Any) -> Any:
        _check_binop(operator, left, right)
        return super().call_binop(context, operator, left, right)

    def call(__self, __context: jinja2.runtime.Context, __obj: Any,
             *args: Any, **kwargs: Any) -> Any:
        _check_time()
        if isinstance(__obj, types.BuiltinMethodType) and isinstance(
            getattr(__obj, "__self__", None), str
        ):
            args = _check_str_call(__obj, args, kwargs)
        if not isinstance(__obj, jinja2.runtime.Macro):
            return super().call(__context, __obj, *args, **kwargs)
        if _budget.depth >= TEMPLATE_MAX_MACRO_DEPTH:
            raise TemplateLimitError(
                f"recursed too deep (macros nested over {TEMPLATE_MAX_MACRO_DEPTH} deep)"
            )
        _budget.depth += 1
        try:
            return super().call(__context, __obj, *args, **kwargs)
        finally:
            _budget.depth -= 1

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        wrapper = super().wrap_str_format(value)
        if wrapper is None:
            return None
        fmt, is_map = value.__self__, value.__name__ == "format_map"

        def checked(*args: Any, **kwargs: Any) -> str:
            if is_map and len(args) == 1 and isinstance(args[0], Mapping):
                _check_str_format(fmt, (), args[0])
            else:
                _check_str_format(fmt, args, kwargs)
            out = wrapper(*args, **kwargs)
            _check_chars(len(out), "str.format()")
            return out

        return checked


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text or type(e).__name__


def _render(template: jinja2.Template, **context: Any) -> str:
    """Render under the TEMPLATE_* limits; any failure is one KvloopError line."""
    previous = sys.gettrace()
    _budget.deadline = time.monotonic() + TEMPLATE_TIME_LIMIT_S
    _budget.depth = 0
    sys.settrace(_trace_calls)
    try:
        return template.render(**context)
    except KvloopError:
        raise
    except RecursionError:
        raise TemplateLimitError("recursed too deep (Python's recursion limit)") from None
    except MemoryError:
        raise _OutOfMemory from None
    except _TemplateRaised as e:  # it reports a bad conversation ("roles must alternate")
        raise TemplateRefusedError(f"chat template error: {_one_line(e)}") from None
    except jinja2.TemplateError as e:
        raise KvloopError(f"chat template error: {_one_line(e)}") from e
    except Exception as e:  # a bug in the template (or an operand it cannot take)
        raise KvloopError(f"chat template error: {type(e).__name__}: {_one_line(e)}") from e
    finally:
        sys.settrace(previous)
        _budget.deadline = math.inf


# --- chat template rendering ------------------------------------------------------------------
def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, sort_keys: bool = False
) -> str:
    # jinja's own tojson HTML-escapes (<, >, &), which would change the prompt text.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)  # a worker sees one template, or a few (tests, the API)
def _compile_template(source: str) -> jinja2.Template:
    # Templates come from model files: untrusted code, hence the immutable sandbox, with the
    # TEMPLATE_* limits on top.
    env = _LimitedSandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols],
        finalize=_checked_output,
    )
    env.concat = _guarded_concat  # type: ignore[method-assign]
    env.filters["tojson"] = _tojson
    env.filters = {name: _guarded_filter(name, fn) for name, fn in env.filters.items()}
    del env.globals["lipsum"]  # lipsum(n=10**9): a loop in jinja's code, out of the trace's reach
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    template = env.from_string(source)
    # `~` compiles to a call of the module-level str_join: size-check it in this template's
    # namespace (root and macros share it).
    namespace = template.root_render_func.__globals__
    namespace["str_join"] = namespace["markup_join"] = _guarded_str_join
    return template


def render_in_process(source: str, context: Mapping[str, Any]) -> str:
    """Compile (cached) and render here, under the in-render limits only: what a worker runs.
    Any failure is one KvloopError line."""
    try:
        template = _compile_template(source)
    except (jinja2.TemplateError, RecursionError, MemoryError) as e:
        raise TemplateCompileError(f"chat template does not compile: {_one_line(e)}") from None
    return _render(template, **context)


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
