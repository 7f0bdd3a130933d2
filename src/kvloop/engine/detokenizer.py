"""Streaming detokenization: token ids in, text deltas out.

Decoding token by token does not work: a byte-level BPE token can hold half of a UTF-8
character (an emoji is often 2-4 tokens), and SentencePiece decoders treat the first token
of a sequence specially (they drop its leading space). So, as vLLM and HF's TextStreamer do,
we decode a short window twice: ``ids[prefix:read]`` (text already emitted, kept as context)
and ``ids[prefix:]``; the delta is what the second adds to the first. While the window ends
in an incomplete character the decode ends in U+FFFD, and we hold the delta back.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvloop.loading.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens kept as context for the first output tokens (vLLM uses the same 5): enough
# for the decoder to see that the output does not start a sequence.
_PROMPT_CONTEXT = 5
# Drop consumed ids once this many sit before the window, so memory and slicing stay O(1).
_TRIM_AT = 64


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas that never split a character."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids: list[int] = list(prompt_ids[-_PROMPT_CONTEXT:]) if prompt_ids else []
        self._prefix_offset = 0  # start of the decode window (context, already emitted)
        self._read_offset = len(self._ids)  # everything before this has been emitted
        self._prefix_text: str | None = None  # decode(ids[prefix:read]), cached
        self._text = ""

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return self._text

    def add(self, token_id: int) -> str:
        """Append one token; return the new text ("" while a character is incomplete)."""
        self._ids.append(token_id)
        prefix_text = self._window_prefix()
        new_text = self._decode(self._ids[self._prefix_offset :])
        # An incomplete UTF-8 sequence decodes to U+FFFD: wait for the bytes that finish it.
        # A skipped special token adds no text: nothing to emit, keep the window.
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""
        return self._emit(new_text[len(prefix_text) :])

    def flush(self) -> str:
        """At the end of the stream: emit whatever is held back (U+FFFD for broken bytes)."""
        prefix_text = self._window_prefix()
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text):
            return ""
        return self._emit(new_text[len(prefix_text) :])

    # ------------------------------------------------------------------------------------
    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def _window_prefix(self) -> str:
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        return self._prefix_text

    def _emit(self, delta: str) -> str:
        # The tokens just emitted become the next window's context.
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._prefix_text = None
        if self._prefix_offset >= _TRIM_AT:
            del self._ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        self._text += delta
        return delta
