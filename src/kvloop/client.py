"""The CLI's client of a resident `kvloop serve`: find it, ask it, read its answer.

Imports only the standard library and kvloop's light modules (no torch, no tokenizer, no
engine, and no httpx: importing it cost ~0.1 s, a third of a whole resident command, where
http.client costs ~10 ms): a command that reaches a running server answers at once. The server
does the tokenizing and templating; the `return_details` extension of its API sends back
what `kvloop generate --local` prints (token ids, log-probs, the engine's metrics).

Discovery, in order: --server URL or $KVLOOP_SERVER; else the run files `kvloop serve`
writes (kvloop.runfile), the newest live one that serves what the command asks for. A
running server that serves another model, or runs with engine options the command sets
otherwise, is not used: the command says so in one line and runs one-shot.
"""

from __future__ import annotations

import http.client
import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from kvloop import runfile
from kvloop.errors import KvloopError, RemoteError
from kvloop.params import SamplingParams
from kvloop.runfile import SERVER_ENV, RunInfo, comparable_options, model_identity

API_KEY_ENV = "KVLOOP_API_KEY"
_PROBE_S = 2.0  # /health of a local server answers in milliseconds
_CONNECT_S = 5.0
# Between two chunks of a stream: a long prompt's prefill on a busy server, at most.
_READ_S = 600.0
_MAX_PROMPTS = 64  # per /v1/completions list: the server's default cap
# Engine options whose flag is not the option's name.
_FLAGS = {"use_cache": "--no-cache", "num_threads": "--threads",
          "enable_prefix_caching": "--no-prefix-caching", "jump_forward": "--no-jump-forward"}


@dataclass(frozen=True)
class Remote:
    url: str
    api_key: str | None = None
    info: RunInfo | None = None

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass
class Completion:
    """One choice as the server's return_details tell it: the fields the CLI prints."""

    index: int
    text: str
    finish_reason: str | None
    token_ids: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    cumulative_logprob: float = 0.0
    score: float | None = None


@dataclass
class Answer:
    """The answer to one prompt: its choices and the engine's metrics."""

    outputs: list[Completion] = field(default_factory=list)
    metrics: dict[str, Any] = field(default_factory=dict)


# -- discovery ------------------------------------------------------------------------------------
def discover(server: str | None, model: str | None, asked: dict[str, Any]) -> Remote | None:
    """The server this command should use, or None (run one-shot).

    `server`: --server (else $KVLOOP_SERVER); `model`: --model as given (None: whatever the
    server serves); `asked`: the engine options the command sets to other than defaults."""
    key = os.environ.get(API_KEY_ENV) or None
    url = server or os.environ.get(SERVER_ENV) or None
    if url:
        url = url.rstrip("/")
        info = next((i for i in runfile.live() if i.url == url), None)
        why = _mismatch(info, model, asked) if info is not None else None
        if why:
            _note(f"the engine at {url} {why}; running one-shot")
            return None
        return Remote(url, key, info)
    first_why = None
    for info in runfile.live():
        state = probe(info.url)
        if state == "refused":  # a recycled pid, or a server that lost its socket
            runfile.remove(info)
            continue
        if state != "ok":
            continue
        why = _mismatch(info, model, asked)
        if why is None:
            return Remote(info.url, key, info)
        first_why = first_why or f"the engine at {info.url} {why}"
    if first_why:
        _note(f"{first_why}; running one-shot")
    return None


def _note(message: str) -> None:
    print(f"kvloop: {message}", file=sys.stderr)


def probe(url: str) -> str:
    """'ok', 'refused' (nothing listens there) or 'busy' (draining, slow, failing)."""
    try:
        with _exchange(url, "GET", "/health", None, {}, _PROBE_S, _PROBE_S) as r:
            r.read()
            return "ok" if r.status == 200 else "busy"
    except _Unreachable as e:
        return "refused" if isinstance(e.__cause__, ConnectionRefusedError) else "busy"
    except (OSError, http.client.HTTPException):
        return "busy"


def _mismatch(info: RunInfo, model: str | None, asked: dict[str, Any]) -> str | None:
    """Why `info`'s server does not serve what the command asks for; None if it does."""
    if model is not None and model_identity(model) != info.model_identity:
        return f"serves {info.model}, not {model}"
    theirs = info.engine_options
    differ = [k for k, v in comparable_options(asked).items() if theirs.get(k) != v]
    if differ:
        k = differ[0]
        return (f"runs other engine options ({_FLAGS.get(k, '--' + k.replace('_', '-'))}: "
                f"{theirs.get(k)!r} there, {asked[k]!r} asked)")
    return None


# -- requests -------------------------------------------------------------------------------------
def sampling_body(p: SamplingParams, chat: bool) -> dict[str, Any]:
    """SamplingParams (already validated here) as the API's fields."""
    body: dict[str, Any] = {
        "max_tokens": p.max_tokens, "temperature": p.temperature, "top_k": p.top_k,
        "top_p": p.top_p, "min_p": p.min_p, "repetition_penalty": p.repetition_penalty,
        "presence_penalty": p.presence_penalty, "frequency_penalty": p.frequency_penalty,
        "min_tokens": p.min_tokens, "seed": p.seed, "stop": list(p.stop),
        "stop_token_ids": list(p.stop_token_ids), "ignore_eos": p.ignore_eos,
        "return_details": True,
    }
    if p.logit_bias:
        body["logit_bias"] = {str(k): v for k, v in p.logit_bias.items()}
    if p.logprobs is not None:
        body.update({"logprobs": True, "top_logprobs": p.logprobs} if chat
                    else {"logprobs": p.logprobs})
    if p.num_beams > 1:  # the beam-only fields are refused without beams
        body.update(num_beams=p.num_beams, n=p.num_return_sequences or 1,
                    length_penalty=p.length_penalty, early_stopping=p.early_stopping)
    else:
        body["n"] = p.n
    s = p.structured
    if s is not None:
        body["structured_outputs"] = {k: v for k, v in (
            ("json", s.json_schema), ("regex", s.regex), ("choice", s.choice),
            ("grammar", s.grammar), ("json_object", s.json_object or None)) if v is not None}
    return body


class _Unreachable(Exception):
    """No connection to the server (its cause: the OS's error)."""


@contextmanager
def _exchange(url: str, method: str, path: str, body: dict[str, Any] | None,
              headers: dict[str, str], connect_s: float,
              read_s: float) -> Iterator[http.client.HTTPResponse]:
    """One request to the server at `url` (http or https, with any path prefix) and its
    response, read within the block. Connecting fails as _Unreachable; anything after as
    http.client's errors or OSError (the caller says which request broke). The OS's proxy
    settings are not consulted: this client talks to an engine its user started."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise _Unreachable(f"{url} is not an http:// or https:// URL")
    kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    try:
        conn = kind(parts.hostname, parts.port, timeout=connect_s)
    except ValueError as e:  # a port that is not a number
        raise _Unreachable(str(e)) from None
    try:
        try:
            conn.connect()
        except OSError as e:
            raise _Unreachable(str(e) or type(e).__name__) from e
        assert conn.sock is not None
        conn.sock.settimeout(read_s)  # between chunks of a stream, not for the whole answer
        data = json.dumps(body).encode() if body is not None else None
        sent = {"Content-Type": "application/json", **headers} if data is not None else headers
        conn.request(method, parts.path.rstrip("/") + path, body=data, headers=sent)
        yield conn.getresponse()
    finally:
        conn.close()


def stream(remote: Remote, path: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The chunks of a streamed answer. A stream that breaks off (the server died) or
    carries an error is one RemoteError; a refused request is a KvloopError (400) or a
    RemoteError."""
    try:
        with _exchange(remote.url, "POST", path, {**body, "stream": True}, remote.headers(),
                       _CONNECT_S, _READ_S) as r:
            if r.status != 200:
                raise _refused(remote, r.status, r.reason, r.read())
            while raw := r.readline():
                line = raw.decode("utf-8", errors="replace").strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    return
                chunk = json.loads(data)
                if "error" in chunk:
                    raise RemoteError(f"the engine at {remote.url} failed: "
                                      f"{_message(chunk)}")
                yield chunk
    except (_Unreachable, OSError, http.client.HTTPException) as e:
        raise _lost(remote, e) from None
    # The server ends every stream with [DONE]; the connection closing first is a server
    # gone mid-answer (http.client's chunked reader reports that as the end of the body).
    raise _lost(remote, ConnectionError("the stream ended before [DONE]"))


def post(remote: Remote, path: str, body: dict[str, Any]) -> dict[str, Any]:
    try:
        with _exchange(remote.url, "POST", path, body, remote.headers(), _CONNECT_S,
                       _READ_S) as r:
            status, reason, raw = r.status, r.reason, r.read()
    except (_Unreachable, OSError, http.client.HTTPException) as e:
        raise _lost(remote, e) from None
    if status != 200:
        raise _refused(remote, status, reason, raw)
    try:
        data: dict[str, Any] = json.loads(raw)
    except ValueError:
        raise RemoteError(f"the engine at {remote.url} answered with no JSON") from None
    return data


def _lost(remote: Remote, e: Exception) -> RemoteError:
    if isinstance(e, _Unreachable):
        return RemoteError(f"cannot reach the engine at {remote.url} ({e}); start one with "
                           f"`kvloop serve --detach`, or run one-shot with --local")
    return RemoteError(f"lost the engine at {remote.url} mid-answer "
                       f"({str(e) or type(e).__name__})")


def _message(body: Any) -> str:
    err = body.get("error") if isinstance(body, dict) else None
    return str(err.get("message", err)) if isinstance(err, dict) else str(body)


def _refused(remote: Remote, status: int, reason: str, raw: bytes) -> Exception:
    try:
        message = _message(json.loads(raw))
    except ValueError:
        message = raw.decode("utf-8", errors="replace").strip() or reason
    if status == 400:  # the request itself: a user mistake, as a local run says it
        return KvloopError(message)
    if status == 401:
        return RemoteError(f"the engine at {remote.url} needs its API key: set "
                           f"${API_KEY_ENV} ({message})")
    return RemoteError(f"the engine at {remote.url} answered {status}: {message}")


# -- answers --------------------------------------------------------------------------------------
def _completion(choice: dict[str, Any], text: str) -> tuple[Completion, dict[str, Any]]:
    details = choice.get("kvloop")
    if not isinstance(details, dict):
        raise RemoteError("the engine's answer has no details (a kvloop server older than "
                          "this client?); run one-shot with --local")
    tops = details.get("top_logprobs")
    comp = Completion(
        index=choice["index"], text=text, finish_reason=choice.get("finish_reason"),
        token_ids=details["token_ids"], logprobs=details.get("logprobs"),
        top_logprobs=[[(t, lp) for t, lp in row] for row in tops] if tops is not None else None,
        cumulative_logprob=details.get("cumulative_logprob", 0.0), score=details.get("score"))
    return comp, details["metrics"]


def stream_text(remote: Remote, body: dict[str, Any], chat: bool) -> Iterator[str | Answer]:
    """A one-choice answer streamed: text pieces as they come, then the Answer."""
    path = "/v1/chat/completions" if chat else "/v1/completions"
    parts: list[str] = []
    for chunk in stream(remote, path, body):
        for choice in chunk.get("choices", []):
            piece = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
            if piece:
                parts.append(piece)
                yield piece
            if choice.get("finish_reason") is not None:
                comp, metrics = _completion(choice, "".join(parts))
                yield Answer([comp], metrics)
                return
    raise RemoteError(f"the engine at {remote.url} ended the answer before it was complete")


def complete(remote: Remote, prompts: list[str], body: dict[str, Any],
             chat_system: str | None, chat: bool) -> list[Answer]:
    """Several prompts, or several choices, not streamed: one Answer per prompt."""
    if chat:
        answers = []
        for text in prompts:
            msgs = [{"role": "system", "content": chat_system}] if chat_system else []
            data = post(remote, "/v1/chat/completions",
                        {**body, "messages": [*msgs, {"role": "user", "content": text}]})
            answers.extend(_answers(data, 1, chat=True))
        return answers
    answers = []
    for start in range(0, len(prompts), _MAX_PROMPTS):
        batch = prompts[start:start + _MAX_PROMPTS]
        data = post(remote, "/v1/completions", {**body, "prompt": batch})
        answers.extend(_answers(data, len(batch), chat=False))
    return answers


def _answers(data: dict[str, Any], num_prompts: int, chat: bool) -> list[Answer]:
    per_prompt = max(len(data["choices"]) // num_prompts, 1)
    answers = [Answer() for _ in range(num_prompts)]
    for choice in data["choices"]:
        text = (choice["message"].get("content") or "") if chat else choice["text"]
        k, i = divmod(choice["index"], per_prompt)
        comp, metrics = _completion({**choice, "index": i}, text)
        answers[k].outputs.append(comp)
        answers[k].metrics = metrics
    return answers
