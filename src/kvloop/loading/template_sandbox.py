"""The chat template sandbox: jinja2's immutable sandbox with kvloop's limits on top, and the
render under them (kvloop.loading.chat_template says why and how a render is bounded).

Only render workers import this module (chat_template starts them): it is where jinja2 is.
"""

from __future__ import annotations

import functools
import inspect
import json
import math
import re
import string
import sys
import threading
import time
import types
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.runtime
import jinja2.sandbox

from kvloop.errors import KvloopError
from kvloop.loading.chat_template import (
    TEMPLATE_MAX_CHARS,
    TEMPLATE_MAX_INT_BITS,
    TEMPLATE_MAX_ITEMS,
    TEMPLATE_MAX_MACRO_DEPTH,
    TEMPLATE_TIME_LIMIT_S,
    TemplateCompileError,
    TemplateLimitError,
    TemplateRefusedError,
    _one_line,
    _OutOfMemory,
)


class _TemplateRaised(jinja2.TemplateError):
    """raise_exception() in a template: it refuses a conversation on purpose."""


class _RenderBudget(threading.local):
    """The limits of the render running on this thread (one per worker; several when a
    test renders in-process on threads)."""

    deadline = math.inf
    depth = 0


_budget = _RenderBudget()


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
