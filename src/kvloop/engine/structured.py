"""Structured output: a StructuredOutput becomes a grammar, the grammar a per-sequence
matcher, and the matcher each step's allowed-token mask (the sampler applies masks and knows
nothing else of it).

The grammar engine is llguidance (Microsoft's, the one llama.cpp and vLLM also use), chosen
by benchmarks/bench_grammar_mask.py (BENCHMARKS.md): a new JSON schema compiles in ~1.2 ms
against xgrammar's 9 ms (49k vocabulary) to 45 ms (262k), paid in the request's time to
first token; per-step masks cost ~20-30 us against xgrammar's 2-4 us, both under 1% of a
decode step; and it has no dependencies beyond its own wheel, where xgrammar brings triton
into a CPU install. Grammars are compiled once per text and cached (bounded): a matcher at
the grammar's start is kept per text, and each sequence gets its own copy, which the
engine advances as tokens are committed and which computes the masks of its draft rows.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from functools import cache
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch

from kvloop.engine.grammar_limits import (
    MAX_SCHEMA_DEPTH,
    check_lark,
    check_regex,
    check_schema,
    on_compile_thread,
    parser_limits,
)
from kvloop.errors import InvalidParamsError
from kvloop.loading.tokenizer import Tokenizer
from kvloop.params import StructuredOutput

if TYPE_CHECKING:
    import llguidance as llg

    LLMatcher = llg.LLMatcher  # one request's grammar state (the engine's handle on it)


def _llg() -> ModuleType:
    """llguidance, imported at the first grammar rather than with the engine (~0.13 s of
    every start, one-shot and server alike, that asks for no structured output)."""
    import llguidance

    return llguidance


@cache
def _fill_bitmask() -> Callable[[llg.LLMatcher, Any, int], None]:
    """llguidance's mask filler, looked up once (not per row of a step's masks).
    llguidance.numpy, not llguidance.torch: the latter's import compiles a torch.compile
    kernel kvloop does not use and pulls in dynamo and inductor (2 s of every start)."""
    from llguidance.numpy import fill_next_token_bitmask

    return fill_next_token_bitmask  # type: ignore[no-any-return]


# Fixed text longer than this at a grammar's start is refused: llguidance stops computing
# forced text at ~25,000 bytes, which only a rule that never ends reaches.
MAX_FORCED_BYTES = 16384

MAX_CACHED_GRAMMARS = 256  # validated grammar texts kept (by text)
# JSON is written compactly, as OpenAI's API returns it: one space after ':' and ','
# and none elsewhere. Free whitespace would let a small model pad with newlines until
# max_tokens, and fixing it leaves whole runs of a schema's text (keys, punctuation)
# with a single continuation, which jump-forward then appends without sampling.
JSON_OPTIONS: Any = {"whitespace_flexible": False, "item_separator": ", ",
                     "key_separator": ": "}  # llguidance's JsonCompileOptions


def grammar_text(so: StructuredOutput) -> str:
    """llguidance's grammar for a constraint (its JSON or Lark form); InvalidParamsError
    naming the limit for one deeper or larger than grammar_limits allows (checked first:
    nothing native sees it before)."""
    if so.json_schema is not None:
        schema = (so.json_schema if isinstance(so.json_schema, dict)
                  else _parse_schema(so.json_schema))
        check_schema(schema)
        return _llg().LLMatcher.grammar_from_json_schema(  # type: ignore[no-any-return]
            schema, defaults=JSON_OPTIONS)
    if so.json_object:
        return _llg().LLMatcher.grammar_from_json_schema(  # type: ignore[no-any-return]
            {"type": "object"}, defaults=JSON_OPTIONS)
    if so.regex is not None:
        check_regex(so.regex)
        return _llg().LLMatcher.grammar_from_regex(so.regex)  # type: ignore[no-any-return]
    if so.choice is not None:
        # Lark string literals are JSON strings: json.dumps quotes and escapes each choice.
        alternatives = " | ".join(json.dumps(c) for c in so.choice)
        return _llg().LLMatcher.grammar_from_lark(  # type: ignore[no-any-return]
            f"start: {alternatives}")
    assert so.grammar is not None
    check_lark(so.grammar)
    return _llg().LLMatcher.grammar_from_lark(so.grammar)  # type: ignore[no-any-return]


def one_line(message: str) -> str:
    """llguidance's multi-line message as one line: its first line and its `error:` lines
    ('regex parse error: ... error: unclosed group'); the source excerpts are dropped."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    if not lines:
        return "invalid grammar"
    return " ".join([lines[0], *(line for line in lines[1:] if line.startswith("error:"))])


def schema_error(schema: dict) -> str | None:
    """Why a JSON schema cannot be compiled (checked without a tokenizer), or None: for
    schemas that arrive inside something else, such as a tool's parameters."""
    try:
        check_schema(schema, "schema")  # worded for where the schema came from
        is_error, messages = on_compile_thread(_validate, grammar_text(
            StructuredOutput(json_schema=schema)), None)
    except InvalidParamsError as e:
        return str(e)
    except Exception as e:  # llguidance's own refusal (an unreadable schema)
        return one_line(str(e))
    return (one_line(messages[0]) if messages else "invalid schema") if is_error else None


def _validate(text: str, tokenizer: llg.LLTokenizer | None) -> tuple[bool, list[str]]:
    return _llg().LLMatcher.validate_grammar_with_warnings(  # type: ignore[no-any-return]
        text, tokenizer, limits=parser_limits())


def _parse_schema(text: str) -> dict:
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as e:
        raise InvalidParamsError(f"json_schema is not valid JSON: {e}",
                                 param="structured") from None
    except RecursionError:  # nested deeper than Python's parser goes: far past the limit
        raise InvalidParamsError(f"structured.json_schema: schema depth is over the limit "
                                 f"of {MAX_SCHEMA_DEPTH}", param="structured") from None
    if not isinstance(schema, dict):
        raise InvalidParamsError("json_schema must be a JSON object", param="structured")
    return schema


class GrammarCompiler:
    """Matchers for one tokenizer; the tokenizer's llguidance form is built on first use."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int,
                 eos_token_ids: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._ll: llg.LLTokenizer | None = None
        # Grammar text -> a matcher at its start (each request gets a copy: ~0.03 ms
        # against ~0.4 ms to compile the text again) or why the text cannot serve.
        self._compiled: OrderedDict[str, llg.LLMatcher | str] = OrderedDict()
        self._lock = threading.Lock()  # the cache and the tokenizer: prepare() is threaded

    def matcher(self, so: StructuredOutput) -> llg.LLMatcher:
        """A fresh matcher for `so`; InvalidParamsError naming the problem if the schema,
        regex or grammar cannot be compiled or matches nothing."""
        return self.prepare(so).deep_copy()

    def prepare(self, so: StructuredOutput) -> llg.LLMatcher:
        """`so` compiled (from the cache, or now): a matcher at its start, which callers
        copy and never advance. Thread-safe, and the native compile drops the GIL, so the
        async engine calls this before queueing a request, off the engine thread: a wide
        schema's ~0.5 s then delays that request alone, and `matcher` finds it cached."""
        try:
            text = grammar_text(so)
        except InvalidParamsError:
            raise
        except Exception as e:  # llguidance's own refusal of the schema or regex
            raise InvalidParamsError(f"structured output: {one_line(str(e))}",
                                     param="structured") from None
        compiled = self._compile(text)
        if isinstance(compiled, str):
            raise InvalidParamsError(f"structured output: {compiled}", param="structured")
        return compiled

    def fill_masks(self, m: llg.LLMatcher, drafts: Sequence[int] = ()) -> torch.Tensor:
        """The tokens `m` allows next, and after each draft token: [1 + len(drafts),
        ceil(V / 32)] int32 bitmasks. Row i is the mask after drafts[:i]; `m` is left as it
        was. Past a draft the grammar refuses (the model rejects it, as its mask bans it)
        the rows repeat the last mask: they are never sampled, but must be finite."""
        masks = torch.empty(1 + len(drafts), (self.vocab_size + 31) // 32, dtype=torch.int32)
        rows = masks.numpy()  # the same memory
        fill = _fill_bitmask()
        fill(m, rows, 0)
        consumed = 0
        for i, token in enumerate(drafts, start=1):
            if consumed == i - 1 and m.try_consume_tokens([token]) == 1:
                consumed += 1
                fill(m, rows, i)
            else:
                masks[i] = masks[i - 1]
        if consumed:
            m.rollback(consumed)
        return masks

    def fill_batch(self, matchers: Sequence[llg.LLMatcher]) -> torch.Tensor:
        """The next-token masks of many matchers: [len(matchers), ceil(V / 32)] int32, one
        tensor. One after another: llguidance's parallel executor (LLExecutor) measured
        slower here, its threads competing with the forward's for the 2 cores."""
        masks = torch.empty(len(matchers), (self.vocab_size + 31) // 32, dtype=torch.int32)
        rows = masks.numpy()  # the same memory
        fill = _fill_bitmask()
        for i, m in enumerate(matchers):
            fill(m, rows, i)
        return masks

    @staticmethod
    def forced_tokens(m: llg.LLMatcher) -> list[int]:
        """Tokens the grammar allows as the only continuation here (jump-forward). The
        library leaves out a last token that a longer token could still extend (the
        forced text `": "` may end a token that the next free text continues)."""
        return list(m.compute_ff_tokens())

    @staticmethod
    def valid_prefix(m: llg.LLMatcher, drafts: Sequence[int]) -> int:
        """How many leading draft tokens the grammar allows."""
        return int(m.validate_tokens(list(drafts))) if drafts else 0

    def _compile(self, text: str) -> llg.LLMatcher | str:
        """A matcher at the start of grammar `text`, or why the text cannot serve a
        request; remembered by text (the last MAX_CACHED_GRAMMARS)."""
        with self._lock:
            if text in self._compiled:
                self._compiled.move_to_end(text)
                return self._compiled[text]
        # Outside the lock: two threads compiling one new text both succeed (the same
        # result); one compiling a slow text must not hold up cache hits.
        result = on_compile_thread(self._compile_new, text, self._ll_tokenizer())
        with self._lock:
            self._compiled[text] = result
            if len(self._compiled) > MAX_CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        return result

    def _compile_new(self, text: str, tokenizer: llg.LLTokenizer) -> llg.LLMatcher | str:
        """Run on the compile thread: the native compiler recurses on its stack."""
        is_error, messages = _validate(text, tokenizer)
        if is_error:
            return one_line(messages[0]) if messages else "invalid grammar"
        return self._probe(_llg().LLMatcher(tokenizer, text, log_level=0, limits=parser_limits()))

    def _probe(self, m: llg.LLMatcher) -> llg.LLMatcher | str:
        """`m`, or why its grammar cannot serve. A grammar can be valid and still match no
        text the model could write: a regex of an empty class fails at its first mask, and
        a rule that only ever recurses forces text without end (the library stops
        computing it at a limit). Neither check moves `m` from its start."""
        if m.is_error():
            return one_line(m.get_error())
        self.fill_masks(m)
        if m.is_error():
            return f"it matches no text ({one_line(m.get_error())})"
        if len(m.compute_ff_bytes()) >= MAX_FORCED_BYTES:
            return (f"it forces more than {MAX_FORCED_BYTES} bytes of fixed text before any "
                    f"choice (a rule that never ends matches no text)")
        return m

    def _ll_tokenizer(self) -> llg.LLTokenizer:
        with self._lock:
            if self._ll is None:
                self._ll = _llg().LLTokenizer(self._tokenizer.backend.to_str(),
                                              n_vocab=self.vocab_size, eos_token=self._eos)
            return self._ll
