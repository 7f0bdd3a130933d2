"""Every failure leaves the server as `{"error": {"message", "type", "param", "code"}}`
with the right status: FastAPI's 422 becomes a 400 that names the field, the engine's
KvloopError a 400 with its own words, overload a 429, a dead engine a 503."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi.exceptions import RequestValidationError

from kvloop.errors import KvloopError, PromptTooLongError
from kvloop.params import SamplingParams
from kvloop.server.protocol import ErrorBody, ErrorResponse, SafeJSONResponse, dumps

_SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}
# Pydantic names the member of a union that failed in `loc`; it is not a field.
_UNION_TAGS = {"str", "int", "float", "bool", "none", "list", "dict"}


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorBody(message=self.message, type=self.type,
                                             param=self.param, code=self.code))

    def response(self) -> SafeJSONResponse:
        return SafeJSONResponse(self.body().model_dump(), self.status, headers=self.headers)

    def sse(self) -> str:
        """The error as a server-sent event, for failures after a stream has begun."""
        return f"data: {dumps(self.body().model_dump())}\n\n"


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def from_kvloop_error(e: KvloopError, field_names: Mapping[str, str] | None = None) -> APIError:
    """The engine's words; `param` read from them where they start with a field name
    (SamplingParams' messages do: "top_p must be in (0, 1], got 2.0")."""
    message = str(e)
    word = message.split(" ", 1)[0]
    param = None
    if e.param is not None:
        param = (field_names or {}).get(e.param, e.param)
    elif word in _SAMPLING_FIELDS:
        param = (field_names or {}).get(word, word)
    elif message.startswith("prompt"):
        param = "prompt"
    code = "context_length_exceeded" if isinstance(e, PromptTooLongError) else None
    return bad_request(message, param, code)


def _loc_to_param(loc: Sequence[Any]) -> str | None:
    parts: list[str] = []
    for item in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        elif item not in _UNION_TAGS and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", str(item)):
            parts.append(("." if parts else "") + str(item))
    return "".join(parts) or None


def _json_type(value: object) -> str:
    names = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array",
             dict: "object", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def from_validation_error(exc: RequestValidationError) -> APIError:
    errors = list(exc.errors())
    if not errors:
        return bad_request("invalid request")
    first = errors[0]
    kind, loc = first.get("type", ""), tuple(first.get("loc", ()))
    if kind == "json_invalid":
        why = (first.get("ctx") or {}).get("error", "invalid JSON")
        return bad_request(f"malformed JSON body: {why}", code="invalid_json")
    if loc == ("body",):
        if kind == "missing":
            return bad_request("the request body is empty; send a JSON object")
        return bad_request("the request body must be a JSON object")
    param = _loc_to_param(loc)
    if kind == "extra_forbidden":
        return bad_request(f"unknown or unsupported field {param!r}", param, "unknown_field")
    if kind == "missing":
        return bad_request(f"missing required field {param!r}", param)
    def under(other: str | None) -> bool:
        return other == param or (other or "").startswith((f"{param}[", f"{param}."))

    same = [e for e in errors if under(_loc_to_param(e.get("loc", ())))]
    if len(same) > 1:  # every member of a union refused it: say what came, not each refusal
        got = _json_type(first.get("input"))
        return bad_request(f"{param} has the wrong type ({got})", param, "invalid_type")
    return bad_request(f"{param}: {first.get('msg', 'invalid value')}", param)
