"""Bounds on a grammar before llguidance's native compiler sees it, and the thread it
compiles on.

llguidance compiles a grammar by recursion on the caller's native stack: a chain of 3,000
Lark rules, or of 3,000 JSON-schema `$ref`s, overflowed the 8 MiB main stack and the
segfault took the whole server with it (issue 25). Two fences, each enough on its own for
what the other lets through:

- the limits below refuse (an InvalidParamsError naming the limit) any schema, Lark
  grammar or regex deeper or larger than real use needs, before native code runs;
- every compile runs on one worker thread whose stack (COMPILE_STACK_BYTES) holds a
  grammar many times deeper than the limits allow (tests/test_grammar_limits.py measures
  the margin in a subprocess).

The scans here are plain Python and recurse at most a limit deep, so the checks themselves
cannot overflow either stack.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    import llguidance as llg

from kvloop.errors import InvalidParamsError

# Depth of a JSON schema: its JSON nesting, a `$ref` counting as one level plus its
# target's depth. Real schemas (OpenAI allows 10 levels of objects) stay far below; the
# JSON reader inside llguidance stops at 128 levels, wrapping included, and a forced tool
# call wraps the parameters in ~6 more, so 100 keeps every accepted schema compilable.
MAX_SCHEMA_DEPTH = 100
MAX_LARK_RULES = 2000  # rules and terminals of one Lark grammar
MAX_LARK_DEPTH = 128  # longest chain of rules each naming the next
# Bracket nesting inside one Lark rule: llguidance's own parser refuses past 28 ("too deeply
# nested"); checked here too so the message names the limit.
MAX_LARK_NESTING = 28
MAX_REGEX_NESTING = 64  # groups inside groups in one regex
MAX_REGEX_CHARS = 10_000  # one regex: the regex constraint, a Lark /.../ or a "pattern"


@cache
def parser_limits() -> llg.LLParserLimits:
    """llguidance's own limits (llguidance.LLParserLimits), set rather than left to defaults
    that may change: compile fuel, per-step fuel (a mask step past it errs that request
    alone), lexer states (1-2 KB each) and grammar size (symbols). llguidance loads here,
    at the first grammar, not with the engine: ~0.13 s of every start that uses none."""
    import llguidance as llg

    return llg.LLParserLimits(
        max_items_in_row=2000, initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000,
        step_max_items=50_000, max_lexer_states=100_000, max_grammar_size=200_000)


# Measured: a Lark rule chain costs ~3 KB of native stack a level (1 MiB held 250 levels,
# not 500). 256 MiB is address space reserved once, touched only as deep as a compile goes,
# and holds ~80,000 levels: hundreds of times MAX_LARK_DEPTH and MAX_SCHEMA_DEPTH.
COMPILE_STACK_BYTES = 256 << 20

T = TypeVar("T")
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def on_compile_thread(fn: Callable[..., T], *args: Any) -> T:
    """fn(*args) on the compile thread (its big stack), returning or raising as fn did.
    One thread: compiles are ~1 ms, and they drop the GIL, so callers wait little."""
    return _compile_pool().submit(fn, *args).result()


def _compile_pool() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            # stack_size applies to threads started while it is set: start the one worker
            # now, then put the process's default back.
            old = threading.stack_size(COMPILE_STACK_BYTES)
            try:
                pool = ThreadPoolExecutor(1, thread_name_prefix="kvloop-grammar")
                pool.submit(lambda: None).result()
            finally:
                threading.stack_size(old)
            _pool = pool
        return _pool


def _over(what: str, value: int | str, limit: int, param: str) -> InvalidParamsError:
    return InvalidParamsError(f"{what} is {value}, over the limit of {limit}", param=param)


# --- regexes -------------------------------------------------------------------------------
def check_regex(regex: str, where: str = "structured.regex") -> None:
    """A regex's length and group nesting, within MAX_REGEX_CHARS and MAX_REGEX_NESTING."""
    if len(regex) > MAX_REGEX_CHARS:
        raise _over(f"{where}: regex length", len(regex), MAX_REGEX_CHARS, "structured")
    depth = deepest = 0
    escaped = in_class = False
    for ch in regex:
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = True
        elif in_class:
            in_class = ch != "]"
        elif ch == "[":
            in_class = True
        elif ch == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif ch == ")":
            depth = max(0, depth - 1)
    if deepest > MAX_REGEX_NESTING:
        raise _over(f"{where}: regex group nesting", deepest, MAX_REGEX_NESTING, "structured")


# --- JSON schemas --------------------------------------------------------------------------
def check_schema(schema: Any, where: str = "structured.json_schema: schema") -> None:
    """A schema's depth, `$ref`s followed, within MAX_SCHEMA_DEPTH; its patterns' regexes
    within the regex limits. `where` starts each error message."""
    _SchemaDepth(schema, where).depth(schema, 0)


class _SchemaDepth:
    """Longest path through a schema's nesting and its local `$ref`s: what llguidance's
    compiler recurses over. A `$ref` already on the path (a recursive schema) adds nothing:
    the compiler names it rather than recursing again. Each target is measured once."""

    def __init__(self, root: Any, where: str) -> None:
        self.root, self.where = root, where
        self.measured: dict[str, int] = {}
        self.open: set[str] = set()

    def depth(self, node: Any, level: int) -> int:
        if level > MAX_SCHEMA_DEPTH:
            raise self.too_deep()
        if isinstance(node, list):
            return 1 + max((self.depth(v, level + 1) for v in node), default=0)
        if not isinstance(node, dict):
            return 0
        deepest = 0
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str):
                deepest = max(deepest, self.ref(value, level + 1))
            elif key == "pattern" and isinstance(value, str):
                check_regex(value, f"{self.where} pattern")
            elif key == "patternProperties" and isinstance(value, dict):
                for regex in value:  # each key is a regex too
                    check_regex(str(regex), f"{self.where} patternProperties")
                deepest = max(deepest, self.depth(value, level + 1))
            else:
                deepest = max(deepest, self.depth(value, level + 1))
        return 1 + deepest

    def too_deep(self) -> InvalidParamsError:
        return _over(f"{self.where} depth (nesting and $ref chains)",
                     f"more than {MAX_SCHEMA_DEPTH}", MAX_SCHEMA_DEPTH, "structured")

    def ref(self, ref: str, level: int) -> int:
        if ref in self.measured:
            if level + self.measured[ref] > MAX_SCHEMA_DEPTH:
                raise self.too_deep()
            return self.measured[ref]
        target = _pointer(self.root, ref)
        if ref in self.open or target is None:  # recursion, or not ours to resolve
            return 1
        self.open.add(ref)
        self.measured[ref] = found = 1 + self.depth(target, level)
        self.open.discard(ref)
        return found


def _pointer(root: Any, ref: str) -> Any:
    """The node a local JSON pointer (`#/$defs/a`) names, or None."""
    if not ref.startswith("#"):
        return None
    node = root
    for part in ref[1:].split("/")[1:]:
        key = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and key in node:
            node = node[key]
        elif isinstance(node, list) and key.isdecimal() and int(key) < len(node):
            node = node[int(key)]
        else:
            return None
    return node


# --- Lark grammars -------------------------------------------------------------------------
_RULE_HEAD = re.compile(r"^[ \t]*[?!]?([A-Za-z_]\w*)(?:\.-?\d+)?[ \t]*:", re.M)
# One piece of a rule body: a string, a regex, a comment, an inline %json, a name, a bracket.
_PIECE = re.compile(r'''"(?:[^"\\\n]|\\.)*"i?|/(?![/*])(?:[^/\\\n]|\\.)+/[imslux]*|//[^\n]*'''
                    r'''|%json\b|[A-Za-z_]\w*|[()\[\]{}]''')


def check_lark(text: str) -> None:
    """A Lark grammar's rule count, rule-chain depth, bracket nesting and regexes within
    the limits; an inline `%json` schema within the schema limits."""
    heads = list(_RULE_HEAD.finditer(text))
    if len(heads) > MAX_LARK_RULES:
        raise _over("structured.grammar: rule count", len(heads), MAX_LARK_RULES, "structured")
    names: dict[str, set[str]] = {}
    for i, head in enumerate(heads):
        end = heads[i + 1].start() if i + 1 < len(heads) else len(text)
        names.setdefault(head.group(1), set()).update(_body_names(text, head.end(), end))
    _RuleDepth(names).check()


def _body_names(text: str, start: int, end: int) -> Iterator[str]:
    """The names a rule body uses; checks its nesting, its regexes and inline schemas."""
    depth = 0
    pos = start
    while (m := _PIECE.search(text, pos, end)) is not None:
        piece, pos = m.group(), m.end()
        if piece == "%json":
            pos = _inline_schema(text, pos)
        elif piece in "([{":
            depth += 1
            if depth > MAX_LARK_NESTING:
                raise _over("structured.grammar: bracket nesting",
                            f"more than {MAX_LARK_NESTING}", MAX_LARK_NESTING, "structured")
        elif piece in ")]}":
            depth = max(0, depth - 1)
        elif piece.startswith("/") and not piece.startswith("//"):
            check_regex(piece[1:piece.rindex("/")], "structured.grammar")
        elif piece[0].isalpha() or piece[0] == "_":
            yield piece


def _inline_schema(text: str, pos: int) -> int:
    """Check the `%json { ... }` schema at `pos`; where the text after it starts."""
    start = text.find("{", pos)
    if start < 0:
        return pos
    try:
        schema, end = json.JSONDecoder().raw_decode(text, start)
    except (json.JSONDecodeError, RecursionError):
        raise InvalidParamsError("structured.grammar: %json is not a JSON object within "
                                 f"the schema depth limit of {MAX_SCHEMA_DEPTH}",
                                 param="structured") from None
    check_schema(schema, "structured.grammar: %json schema")
    return int(end)


class _RuleDepth:
    """Longest chain of rules each using the next, a rule already on the chain (recursion)
    adding nothing: what the compiler recurses over."""

    def __init__(self, uses: dict[str, set[str]]) -> None:
        self.uses = uses
        self.measured: dict[str, int] = {}
        self.open: set[str] = set()

    def check(self) -> None:
        for name in self.uses:
            self.depth(name, 1)

    def depth(self, name: str, level: int) -> int:
        if name not in self.uses or name in self.open:
            return 0
        found = self.measured.get(name)
        if found is None:
            if level > MAX_LARK_DEPTH:
                found = MAX_LARK_DEPTH + 1
            else:
                self.open.add(name)
                found = 1 + max((self.depth(n, level + 1) for n in self.uses[name]),
                                default=0)
                self.open.discard(name)
                self.measured[name] = found
        if level - 1 + found > MAX_LARK_DEPTH:
            raise _over("structured.grammar: rule chain depth", f"more than {MAX_LARK_DEPTH}",
                        MAX_LARK_DEPTH, "structured")
        return found
