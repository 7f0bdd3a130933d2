"""Tool calls written as text by a model, read back: pure string work, no model, no HTTP.

A chat template that supports tools teaches the model one way to write a call; the format
is read off the template's text (`detect_format`), and `parse_tool_calls` turns a finished
answer in that format into (content, calls). Formats:

- "hermes" (Hermes, Qwen 2/2.5/3, and kvloop's own listing for templates without tool
  support): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one block a call.
- "mistral": ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (the JSON-list form),
  or ``[TOOL_CALLS]name[ARGS]{...}`` (the newer form), after any content.
- "llama3": the whole answer is ``{"name": ..., "parameters": {...}}`` (calls separated by
  ``;``), optionally after ``<|python_tag|>``.

An answer is tool calls only if every call in it parses and names a declared function;
otherwise it is plain content, untouched (a model that half-writes a call has not called).
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, Literal

ToolFormat = Literal["hermes", "mistral", "llama3"]

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
MISTRAL_MARK = "[TOOL_CALLS]"
LLAMA_TAG = "<|python_tag|>"


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text of the arguments object


def detect_format(template: str | None) -> ToolFormat:
    """The tool-call format a chat template teaches; "hermes" when it teaches none (that
    is the format kvloop lists tools in for such templates)."""
    text = template or ""
    if MISTRAL_MARK in text:
        return "mistral"
    if HERMES_OPEN in text:
        return "hermes"
    if LLAMA_TAG in text or ("ipython" in text and '"parameters"' in text):
        return "llama3"
    return "hermes"


def template_knows_tools(template: str | None) -> bool:
    """Whether the template renders `tools` itself (HF's convention: a `tools` variable)."""
    return bool(template) and re.search(r"\btools\b", template or "") is not None


def parse_tool_calls(text: str, fmt: ToolFormat, names: Collection[str]
                     ) -> tuple[str | None, list[ParsedCall]]:
    """(content, calls) of a finished answer: content is the text before the first call,
    trailing whitespace cut (None when there is none; text after the calls is dropped);
    calls is empty when the answer is not a valid call of the functions `names`, and then
    content is the whole text, untouched."""
    parse = {"hermes": _hermes, "mistral": _mistral, "llama3": _llama3}[fmt]
    found = parse(text)
    if not found:
        return text, []
    content, raw = found
    calls = []
    for obj in raw:
        call = _call(obj, names)
        if call is None:
            return text, []
        calls.append(call)
    return (content.rstrip() or None), calls


def hermes_marker_start(text: str) -> int:
    """How much of `text` is safe to stream as content: all of it but a ``<tool_call>``
    and what follows, a tail that could still grow into one, and the whitespace before
    either (which the parsed content leaves out)."""
    i = text.find(HERMES_OPEN)
    if i < 0:
        i = len(text)
        for k in range(min(len(HERMES_OPEN) - 1, len(text)), 0, -1):
            if HERMES_OPEN.startswith(text[-k:]):
                i = len(text) - k
                break
    return len(text[:i].rstrip())


def _call(obj: Any, names: Collection[str]) -> ParsedCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict) or obj["name"] not in names:
        return None
    return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


_HERMES_BLOCK = re.compile(re.escape(HERMES_OPEN) + r"(.*?)(?:" + re.escape(HERMES_CLOSE)
                           + r"|\Z)", re.S)


def _hermes(text: str) -> tuple[str, list[Any]] | None:
    blocks = list(_HERMES_BLOCK.finditer(text))
    if not blocks:
        return None
    return text[:blocks[0].start()], [_loads(b.group(1).strip()) for b in blocks]


def _mistral(text: str) -> tuple[str, list[Any]] | None:
    i = text.find(MISTRAL_MARK)
    if i < 0:
        return None
    content, rest = text[:i], text[i:]
    objs: list[Any] = []
    for piece in rest.split(MISTRAL_MARK)[1:]:
        piece = piece.strip()
        if "[ARGS]" in piece:  # name[ARGS]{...}
            name, _, args = piece.partition("[ARGS]")
            objs.append({"name": name.strip(), "arguments": _loads(args.strip())})
            continue
        value = _loads(piece)
        objs.extend(value if isinstance(value, list) else [value])
    return content, objs


def _llama3(text: str) -> tuple[str, list[Any]] | None:
    body = text.strip()
    if body.startswith(LLAMA_TAG):
        body = body[len(LLAMA_TAG):].strip()
    if not body.startswith("{"):
        return None
    objs = [_loads(part) for part in _split_top_level(body, ";")]
    return "", objs


def _split_top_level(text: str, sep: str) -> list[str]:
    """`text` cut at `sep` outside JSON strings and brackets."""
    parts, depth, start, in_str, escaped = [], 0, 0, False, False
    for i, ch in enumerate(text):
        if in_str:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        elif ch == sep and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    parts.append(text[start:].strip())
    return [p for p in parts if p]
