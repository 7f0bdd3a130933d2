"""Structured output: a StructuredOutput becomes a grammar, the grammar a per-sequence
matcher, and the matcher each step's allowed-token mask (the sampler applies masks and knows
nothing else of it).

The grammar engine is llguidance (Microsoft's, the one llama.cpp and vLLM also use), chosen
by benchmarks/bench_grammar_mask.py (BENCHMARKS.md): a new JSON schema compiles in ~1.2 ms
against xgrammar's 9 ms (49k vocabulary) to 45 ms (262k), paid in the request's time to
first token; per-step masks cost ~20-30 us against xgrammar's 2-4 us, both under 1% of a
decode step; and it has no dependencies beyond its own wheel, where xgrammar brings triton
into a CPU install. Grammars are validated once per text and the results cached; each sequence gets
its own matcher, which the engine advances as tokens are committed.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Sequence

import llguidance as llg
import torch
from llguidance.torch import fill_next_token_bitmask

from kvloop.errors import InvalidParamsError
from kvloop.loading.tokenizer import Tokenizer
from kvloop.params import StructuredOutput

MAX_CACHED_GRAMMARS = 256  # validated grammar texts kept (by text)


def grammar_text(so: StructuredOutput) -> str:
    """llguidance's grammar for a constraint (its JSON or Lark form)."""
    if so.json_schema is not None:
        schema = (so.json_schema if isinstance(so.json_schema, dict)
                  else _parse_schema(so.json_schema))
        return llg.LLMatcher.grammar_from_json_schema(schema)  # type: ignore[no-any-return]
    if so.json_object:
        return llg.LLMatcher.grammar_from_json_schema(  # type: ignore[no-any-return]
            {"type": "object"})
    if so.regex is not None:
        return llg.LLMatcher.grammar_from_regex(so.regex)  # type: ignore[no-any-return]
    if so.choice is not None:
        # Lark string literals are JSON strings: json.dumps quotes and escapes each choice.
        alternatives = " | ".join(json.dumps(c) for c in so.choice)
        return llg.LLMatcher.grammar_from_lark(  # type: ignore[no-any-return]
            f"start: {alternatives}")
    assert so.grammar is not None
    return llg.LLMatcher.grammar_from_lark(so.grammar)  # type: ignore[no-any-return]


def _parse_schema(text: str) -> dict:
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as e:
        raise InvalidParamsError(f"json_schema is not valid JSON: {e}",
                                 param="structured") from None
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
        self._checked: OrderedDict[str, str | None] = OrderedDict()  # grammar -> error

    def matcher(self, so: StructuredOutput) -> llg.LLMatcher:
        """A fresh matcher for `so`; InvalidParamsError naming the problem if the schema,
        regex or grammar cannot be compiled or matches nothing."""
        try:
            text = grammar_text(so)
        except InvalidParamsError:
            raise
        except Exception as e:  # llguidance's own refusal of the schema or regex
            raise InvalidParamsError(f"structured output: {e}", param="structured") from None
        error = self._check(text)
        if error:
            raise InvalidParamsError(f"structured output: {error}", param="structured")
        m = llg.LLMatcher(self._ll_tokenizer(), text, log_level=0)
        if m.is_error():
            raise InvalidParamsError(f"structured output: {m.get_error()}", param="structured")
        return m

    def fill_mask(self, m: llg.LLMatcher) -> torch.Tensor:
        """The tokens `m` allows next, as a bitmask: [ceil(V / 32)] int32."""
        mask = torch.empty(1, (self.vocab_size + 31) // 32, dtype=torch.int32)
        fill_next_token_bitmask(m, mask)
        return mask[0]

    def _check(self, text: str) -> str | None:
        if text in self._checked:
            self._checked.move_to_end(text)
            return self._checked[text]
        is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(
            text, self._ll_tokenizer())
        error = (messages[0].strip().splitlines()[0] if messages else "invalid grammar"
                 ) if is_error else None
        self._checked[text] = error
        if len(self._checked) > MAX_CACHED_GRAMMARS:
            self._checked.popitem(last=False)
        return error

    def _ll_tokenizer(self) -> llg.LLTokenizer:
        if self._ll is None:
            self._ll = llg.LLTokenizer(self._tokenizer.backend.to_str(),
                                       n_vocab=self.vocab_size, eos_token=self._eos)
        return self._ll
