"""OpenAI tool calling, translated: tools and tool_choice become a prompt and an output
constraint; the model's answer becomes tool calls.

- `tool_choice: "required"` constrains the answer to a JSON list of calls, each
  ``{"name": <a declared function>, "arguments": <valid for its parameters schema>}``
  (one call when `parallel_tool_calls` is false); a named function constrains it to that
  function's arguments object. Either way the engine sees only a StructuredOutput.
- `"auto"` leaves the answer free; a call written in the template's tool-call format
  (kvloop.server.tool_parsers) becomes `tool_calls`, anything else stays content.
- `"none"` (the default without tools) renders no tools and parses nothing.

Templates that render tools themselves (HF's `tools` variable) get them as given, with
history calls' arguments as objects (as transformers and vLLM pass them). A template that
knows nothing of tools (SmolLM2's chatml) gets them in Hermes form: the tools listed in
the system message, the assistant's past calls as ``<tool_call>`` blocks in its content,
and tool results as a user turn of ``<tool_response>`` blocks; the model is asked to
answer in the same form, which is what "auto" then parses.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from kvloop.engine.structured import schema_error
from kvloop.params import StructuredOutput
from kvloop.server.errors import bad_request
from kvloop.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    FunctionCallDelta,
    Tool,
    ToolCallDelta,
)
from kvloop.server.tool_parsers import (
    HERMES_CLOSE,
    HERMES_OPEN,
    ParsedCall,
    ToolFormat,
    detect_format,
    hermes_marker_start,
    parse_tool_calls,
    template_knows_tools,
)

Mode = Literal["none", "auto", "required", "named"]
# Arguments of a function declared without parameters: an empty object, nothing else.
NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass
class ToolPlan:
    """What one chat request does with tools."""

    mode: Mode = "none"
    tools: list[Tool] = field(default_factory=list)
    named: str | None = None  # the function tool_choice names
    fmt: ToolFormat = "hermes"  # how the model writes calls ("auto")
    knows_tools: bool = False  # the template renders tools itself
    structured: StructuredOutput | None = None  # the constraint for required / named

    @property
    def names(self) -> list[str]:
        return [t.function.name for t in self.tools]

    def read(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        """(content, calls) of a finished answer. A constrained answer that does not
        parse (cut short by max_tokens) is returned as content, with no calls."""
        if self.mode == "named":
            assert self.named is not None
            return None, [ParsedCall(self.named, text)]
        if self.mode == "required":
            try:
                return None, [ParsedCall(i["name"], json.dumps(i["arguments"],
                                                               ensure_ascii=False))
                              for i in json.loads(text)]
            except (json.JSONDecodeError, TypeError, KeyError):
                return text, []
        if self.mode == "auto":
            return parse_tool_calls(text, self.fmt, self.names)
        return text, []


def plan_tools(req: ChatCompletionRequest, template: str | None) -> ToolPlan:
    """The request's tool plan, or a 400 naming the field: a tool_choice without tools, a
    named function not among them, a duplicate name, a parameters schema the grammar
    engine refuses, a second output constraint beside a forced call."""
    tools = req.tools or []
    choice = req.tool_choice
    if choice is not None and not tools:
        raise bad_request("tool_choice needs tools", "tool_choice")
    plan = ToolPlan(tools=tools, fmt=detect_format(template),
                    knows_tools=template_knows_tools(template))
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        name = tool.function.name
        if name in seen:
            raise bad_request(f"tools declare function {name!r} twice",
                              f"tools[{i}].function.name")
        seen.add(name)
        if tool.function.parameters is not None:
            _check_schema(tool.function.parameters, f"tools[{i}].function.parameters")
    if not tools or choice == "none":
        return plan
    if choice is None or choice == "auto":
        plan.mode = "auto"
        return plan
    if any(getattr(req, f) is not None for f in (
            "response_format", "structured_outputs", "guided_json", "guided_regex",
            "guided_choice", "guided_grammar")) and not (
            req.response_format is not None and req.response_format.type == "text"):
        raise bad_request("a forced tool call (tool_choice required or a named function) "
                          "already constrains the output: drop response_format / "
                          "structured_outputs / guided_*", "tool_choice")
    if choice == "required":
        plan.mode = "required"
        calls: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": [
            {"type": "object",
             "properties": {"name": {"const": t.function.name},
                            "arguments": _arguments_schema(t)},
             "required": ["name", "arguments"], "additionalProperties": False}
            for t in tools]}}
        if req.parallel_tool_calls is False:
            calls["maxItems"] = 1
        plan.structured = StructuredOutput(json_schema=calls)
        return plan
    assert not isinstance(choice, str)
    by_name = {t.function.name: t for t in tools}
    if choice.function.name not in by_name:
        raise bad_request(f"tool_choice names function {choice.function.name!r}, which is "
                          f"not among tools ({sorted(by_name)})", "tool_choice")
    plan.mode, plan.named = "named", choice.function.name
    plan.structured = StructuredOutput(json_schema=_arguments_schema(by_name[plan.named]))
    return plan


def _arguments_schema(tool: Tool) -> dict[str, Any]:
    params = tool.function.parameters
    return NO_ARGUMENTS if params is None else params


def _check_schema(schema: dict[str, Any], param: str) -> None:
    """Refuse a schema that cannot be compiled, before anything is queued."""
    detail = schema_error(schema)
    if detail is not None:
        raise bad_request(f"{param} is not a JSON schema kvloop can follow: {detail}", param)


# --- the prompt --------------------------------------------------------------------------------
def template_inputs(messages: list[ChatMessage], plan: ToolPlan
                    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) for the chat template: `tools` is None when the template is not
    to see any (no tools, tool_choice none, or a template that does not render them:
    then they are listed in the system message instead)."""
    tools = ([t.model_dump(exclude_none=True) for t in plan.tools]
             if plan.mode != "none" else [])
    if plan.knows_tools:
        return [_native_message(m) for m in messages], (tools or None)
    out: list[dict[str, Any]] = []
    for m in messages:
        if m.role == "tool":
            block = f"<tool_response>\n{m.text()}\n</tool_response>"
            if out and out[-1].get("_tool"):  # consecutive results: one user turn
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool": True})
            continue
        msg = _plain_message(m)
        if m.tool_calls:
            blocks = [f"{HERMES_OPEN}\n" + json.dumps(
                {"name": c.function.name, "arguments": _arguments(c.function.arguments)},
                ensure_ascii=False) + f"\n{HERMES_CLOSE}" for c in m.tool_calls]
            msg["content"] = "\n".join(([msg["content"]] if msg["content"] else []) + blocks)
        out.append(msg)
    for msg in out:
        msg.pop("_tool", None)
    if tools:
        listing = hermes_tool_listing(tools)
        if out and out[0]["role"] in ("system", "developer"):
            out[0]["content"] = (out[0]["content"] + "\n\n" + listing).lstrip()
        else:
            out.insert(0, {"role": "system", "content": listing})
    return out, None


def hermes_tool_listing(tools: list[dict[str, Any]]) -> str:
    """The system-prompt text that declares `tools` to a model whose template does not."""
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou can call the functions declared below, each a JSON object "
            "inside <tools></tools>:\n"
            f"<tools>\n{lines}\n</tools>\n\n"
            "To call one, answer with its name and arguments as a JSON object inside "
            "<tool_call></tool_call> tags, one block per call:\n"
            '<tool_call>\n{"name": "<function name>", "arguments": {<arguments>}}\n'
            "</tool_call>\n"
            "Results come back inside <tool_response></tool_response> tags.")


def _plain_message(m: ChatMessage) -> dict[str, Any]:
    return {"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})}


def _native_message(m: ChatMessage) -> dict[str, Any]:
    msg = _plain_message(m)
    if m.tool_calls:
        msg["tool_calls"] = [{"id": c.id, "type": "function", "function": {
            "name": c.function.name, "arguments": _arguments(c.function.arguments)}}
            for c in m.tool_calls]
    if m.tool_call_id is not None:
        msg["tool_call_id"] = m.tool_call_id
    return msg


def _arguments(text: str) -> Any:
    """A history call's arguments as the object templates expect (the text if it is not
    JSON: the template shows what the client sent)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


# --- streaming ---------------------------------------------------------------------------------
def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def call_deltas(calls: list[ParsedCall], first_index: int = 0) -> list[ToolCallDelta]:
    """Whole calls as stream pieces: each names itself and carries all its arguments."""
    return [ToolCallDelta(index=first_index + k, id=call_id(), type="function",
                          function=FunctionCallDelta(name=c.name, arguments=c.arguments))
            for k, c in enumerate(calls)]


class StreamedAnswer:
    """One choice of a streamed answer under a tool plan: what to send as each text delta
    arrives, and at the end. A named call streams its arguments as they are written;
    "required" and the non-Hermes "auto" formats send the calls whole at the end (a list
    of calls is only known once it parses); Hermes "auto" streams content up to where a
    ``<tool_call>`` may begin and holds the rest until the answer is complete."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.text = ""
        self.sent = 0  # characters of `text` sent as content
        self.named_id: str | None = None

    def feed(self, delta: str) -> tuple[str | None, list[ToolCallDelta]]:
        """(content, tool-call pieces) to send for `delta`."""
        self.text += delta
        mode = self.plan.mode
        if mode == "none":
            return (delta or None), []
        if mode == "named":
            if not delta and self.named_id is not None:
                return None, []
            return None, [self._named_piece(delta)]
        if mode == "auto" and self.plan.fmt == "hermes":
            safe = hermes_marker_start(self.text)
            if safe > self.sent:
                content, self.sent = self.text[self.sent:safe], safe
                return content, []
        return None, []

    def finish(self, parse_text: str) -> tuple[str | None, list[ToolCallDelta], bool]:
        """(content, tool-call pieces, whether the answer is tool calls) once the answer is
        complete; `parse_text` is what `ToolPlan.read` parses (the text with the format's
        special tokens kept)."""
        mode = self.plan.mode
        if mode == "none":
            return None, [], False
        if mode == "named":
            return None, ([self._named_piece("")] if self.named_id is None else []), True
        content, calls = self.plan.read(parse_text)
        if calls:
            # The content before the calls, less what was streamed already (a Hermes
            # answer streams it as it comes; the other formats hold it to the end).
            rest = (content or "")[self.sent:] or None
            self.sent = len(self.text)
            return rest, call_deltas(calls), True
        rest = self.text[self.sent:]
        self.sent = len(self.text)
        return (rest or None), [], False

    def _named_piece(self, delta: str) -> ToolCallDelta:
        if self.named_id is None:
            self.named_id = call_id()
            return ToolCallDelta(index=0, id=self.named_id, type="function",
                                 function=FunctionCallDelta(name=self.plan.named,
                                                            arguments=delta))
        return ToolCallDelta(index=0, function=FunctionCallDelta(arguments=delta))
