"""The OpenAI wire format (plus vLLM's sampling extensions) as pydantic models.

Requests are strict: an unknown field or a value of the wrong type is a 400 naming it,
never silently ignored or coerced ("0.5" is not a number, NaN is not a temperature).
Ranges are not checked here: SamplingParams owns them, so HTTP, the CLI and the Python
API reject the same values with the same words.
"""

from __future__ import annotations

import json
import re
import time
from typing import Annotated, Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

# OpenAI's own cap on `n`; bounds the work one request can ask for.
MAX_N = 128


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class StructuredOutputs(_Strict):
    """vLLM's structured_outputs: exactly one of these."""

    json_schema: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class SamplingRequest(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None  # optional here; when given it must name the served model
    max_tokens: int | None = None
    temperature: float | None = None  # OpenAI default 1.0
    top_p: float | None = None
    n: int = Field(1, le=MAX_N)  # >= 1 is SamplingParams' rule
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # JSON keys are strings: token id -> bias
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted, unused
    # vLLM extensions.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    priority: int = 0  # lower runs first
    # Beam search: vLLM's `use_beam_search` with `best_of` beams (default `n`), or
    # `num_beams` directly; `n` sequences are returned.
    use_beam_search: bool = False
    best_of: int | None = Field(None, le=MAX_N)
    num_beams: int | None = Field(None, le=MAX_N)
    length_penalty: float | None = None
    early_stopping: bool | Literal["never"] | None = None
    # kvloop extensions: opt out of speculative decoding, or cap this request's drafts.
    speculative: bool | None = None
    num_speculative_tokens: int | None = None
    # kvloop extension: each choice's `kvloop` details (token ids, log-probs, the engine's
    # per-request metrics) on its last chunk, or on the choice when not streamed. What
    # `kvloop generate` prints needs them; other clients never see the field unless asked.
    return_details: bool = False
    # Sent by the official SDKs; accepted and ignored, as they change nothing served here.
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    # Structured output: OpenAI's response_format, and vLLM's structured_outputs and its
    # older guided_* fields.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


# An empty text is a prompt (the engine starts from BOS); an empty list or token list is not.
_Ids = Annotated[list[int], Field(min_length=1)]
Prompt = (str | Annotated[list[str], Field(min_length=1)] | _Ids
          | Annotated[list[_Ids], Field(min_length=1)])


class CompletionRequest(SamplingRequest):
    prompt: Prompt
    logprobs: int | None = None
    # The prompt comes back before the completion, with its log-probs when logprobs is
    # set; max_tokens 0 then scores the prompt alone.
    echo: bool = False
    suffix: str | None = None  # only None is supported
    prompt_logprobs: int | None = None  # vLLM: the prompt's log-probs (top N) per choice
    # kvloop extension: control-token strings in the prompt ("<|im_start|>") become their
    # control tokens. Off by default: user text is text.
    parse_special_tokens: bool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str  # a JSON text, as OpenAI sends it


class ToolCall(_Strict):
    """A call the assistant made, in a history message (and in a response)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDefinition(_Strict):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None  # accepted: required/named calls are always constrained


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant turns that called tools
    tool_call_id: str | None = None  # a tool turn: the call it answers

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None  # default: "auto" with tools, else "none"
    parallel_tool_calls: bool | None = None  # default true: several calls in one answer


# --- responses ---------------------------------------------------------------------------------
class _Out(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PromptTokensDetails(_Out):
    cached_tokens: int = 0


class UsageCosts(_Out):
    """kvloop extension (`return_details`): what the request made the machine do
    (kvloop.engine.attribution): the positions the model ran, their FLOPs, and the bytes
    read: its share of each step's weights and its KV cache; over its decode, bytes/s."""

    positions_processed: int
    flops: float
    weight_bytes: float
    kv_bytes: float
    decode_bytes_per_s: float | None = None


class Usage(_Out):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    kvloop: UsageCosts | None = None  # only with return_details (left out otherwise)


class CompletionLogprobs(_Out):
    tokens: list[str] = Field(default_factory=list)
    # None only for the first token of an echoed prompt (nothing predicts it).
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] | None = None
    text_offset: list[int] = Field(default_factory=list)


class ChoiceDetails(_Out):
    """kvloop extension (`return_details`): the engine's own account of one choice, so a
    client without a tokenizer prints what `kvloop generate --local` prints."""

    token_ids: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None  # [[token id, log-prob], ...]
    cumulative_logprob: float = 0.0
    score: float | None = None  # beam search
    metrics: dict[str, float | int | None]  # RequestMetrics.as_dict() of its prompt


class CompletionChoice(_Out):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM: the stop string or token id that ended it
    # vLLM: with prompt_logprobs, per prompt token {token id: {logprob, rank, decoded_token}}.
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None
    kvloop: ChoiceDetails | None = None  # only with return_details (left out otherwise)


def _now() -> int:
    return int(time.time())


class CompletionResponse(_Out):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class TopLogprob(_Out):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(_Out):
    content: list[TokenLogprob] | None = None


class ResponseFunctionCall(_Out):
    name: str
    arguments: str


class ResponseToolCall(_Out):
    id: str
    type: Literal["function"] = "function"
    function: ResponseFunctionCall


class AssistantMessage(_Out):
    role: Literal["assistant"] = "assistant"
    content: str | None  # None when the answer is tool calls
    tool_calls: list[ResponseToolCall] | None = None  # left out of the JSON when None


class ChatChoice(_Out):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    kvloop: ChoiceDetails | None = None  # only with return_details (left out otherwise)


class ChatCompletionResponse(_Out):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None


class FunctionCallDelta(_Out):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(_Out):
    """One streamed piece of a tool call: the first names it (index, id, type, function
    name), later ones add to its arguments; the client joins them by index."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta | None = None


class ChatDelta(_Out):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(_Out):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    kvloop: ChoiceDetails | None = None  # only with return_details (left out otherwise)


class ChatCompletionChunk(_Out):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class ModelCard(_Out):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "kvloop"
    max_model_len: int


class ModelList(_Out):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorBody(_Out):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(_Out):
    error: ErrorBody


# Written as \uXXXX escapes: U+2028/U+2029 are line breaks to JavaScript and to splitters
# like Python's str.splitlines (httpx's aiter_lines), which would cut an SSE event in two;
# a lone surrogate (from a client's "\ud800" echoed in an error) cannot be encoded as UTF-8.
_UNSAFE = re.compile("[\u2028\u2029\ud800-\udfff]")


def dumps(data: Any) -> str:
    """Compact JSON, UTF-8 kept except for the characters above. They can only occur
    inside strings, so the escapes are always valid JSON."""
    text = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return _UNSAFE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


class SafeJSONResponse(JSONResponse):
    """A JSON body written by `dumps`."""

    def render(self, content: Any) -> bytes:
        return dumps(content).encode("utf-8")


def dump_chunk(chunk: BaseModel) -> str:
    """One SSE event. A chat delta leaves out its unset fields, as OpenAI's does."""
    data = dump_response(chunk)
    for choice in data.get("choices", []):
        if isinstance(choice.get("delta"), dict):
            choice["delta"] = _without_none(choice["delta"])
    return f"data: {dumps(data)}\n\n"


def dump_response(resp: BaseModel) -> dict[str, Any]:
    """A response as JSON, without the `kvloop` extension (on choices and usage) where it
    was not asked for."""
    data: dict[str, Any] = resp.model_dump(mode="json")
    for choice in data.get("choices", []):
        if choice.get("kvloop", False) is None:
            del choice["kvloop"]
    usage = data.get("usage")
    if isinstance(usage, dict) and usage.get("kvloop", False) is None:
        del usage["kvloop"]
    return data


def dump_chat_response(resp: ChatCompletionResponse) -> dict[str, Any]:
    """A chat response as JSON: `tool_calls` only on messages that have them (OpenAI's
    shape); `content` stays, null beside tool calls."""
    data = dump_response(resp)
    for choice in data["choices"]:
        if choice["message"].get("tool_calls") is None:
            choice["message"].pop("tool_calls", None)
    return data


def _without_none(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_none(v) for v in value]
    return value
