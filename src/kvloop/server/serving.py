"""OpenAI requests in, engine requests out, and back: the translation behind the routes.

Each handler checks what only the face can know (the model name, the context budget of
the tokenized prompt, fields kvloop does not support), builds SamplingParams (which
validate themselves), hands the request to the AsyncEngine and either streams its deltas
as server-sent events or waits for the final output. All refusals happen before the
engine queues anything; a client that leaves aborts its requests at once (every prompt of
a list: they are queued together, under the same disconnect watch). On shutdown the
server stops admitting (`draining`) and ends what is still running with `end_all`, each
client told in its own format (kvloop.server.lifecycle).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from kvloop.engine.async_engine import (
    EngineDeadError,
    EngineOverloadedError,
    RequestFailedError,
    RequestStream,
)
from kvloop.engine.client import EngineClient
from kvloop.engine.outputs import CompletionOutput, RequestOutput
from kvloop.errors import KvloopError
from kvloop.params import SamplingParams, StructuredOutput, check_prompt_logprobs
from kvloop.server.errors import APIError, bad_request, from_kvloop_error
from kvloop.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChoiceDetails,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    PromptTokensDetails,
    ResponseFunctionCall,
    ResponseToolCall,
    SamplingRequest,
    TokenLogprob,
    TopLogprob,
    Usage,
    UsageCosts,
    dump_chat_response,
    dump_chunk,
    dump_response,
)
from kvloop.server.protocol import SafeJSONResponse as JSONResponse
from kvloop.server.tools import StreamedAnswer, ToolPlan, call_id, plan_tools, template_inputs

logger = logging.getLogger("kvloop.server")

RETRY_AFTER_S = 1
DEFAULT_MAX_PROMPTS = 64  # prompts in one /v1/completions list
DEFAULT_MAX_TOKENS = 1024  # chat requests that give no max_tokens
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass(eq=False)  # hashed by identity: live jobs sit in a set
class _Job:
    """One HTTP request: its id, its prompts (token ids) and their engine streams."""

    request_id: str
    prompts: list[list[int]]
    params: SamplingParams
    choices_per_prompt: int
    engine_ids: list[str] = field(default_factory=list)
    streams: list[RequestStream] = field(default_factory=list)
    # Set when the server, not the client, ends the job (shutdown): what its client is told.
    failure: APIError | None = None
    # echo: each prompt's text, sent before its completion (with its log-probs, if asked).
    echo_texts: list[str] | None = None
    structured_field: str = "response_format"  # the field a constraint came in, for errors
    details: bool = False  # return_details: each choice's ChoiceDetails at its end


@dataclass
class _Delta:
    """New text and tokens of one choice, for one streamed chunk."""

    index: int
    output: CompletionOutput
    text: str
    token_ids: list[int]
    ending: bool


class _JobStream(StreamingResponse):
    """A streamed answer that settles its job however the response ends: a client gone
    before the body generator first ran cancels it unstarted, and an unstarted
    generator's `finally` never runs."""

    def __init__(self, on_close: Callable[[], None], *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


class OpenAIServing:
    def __init__(self, engine: EngineClient, model_name: str,
                 max_prompts: int = DEFAULT_MAX_PROMPTS,
                 default_max_tokens: int = DEFAULT_MAX_TOKENS) -> None:
        self.engine = engine
        self.model_name = model_name
        self.max_prompts = max_prompts
        self.default_max_tokens = default_max_tokens
        # Shutdown: `draining` refuses new requests; live jobs finish or are ended by
        # end_all(). Only touched on the event loop.
        self.draining = False
        self._jobs: set[_Job] = set()
        # Read-only facts of the loaded model: safe to read off the engine thread.
        llm = engine.engine
        self.tokenizer = llm.tokenizer
        self.max_model_len = llm.max_model_len
        self.max_prompt_logprobs = llm.config.max_prompt_logprobs
        self.vocab_size = llm.model_config.vocab_size
        self.eos = frozenset(llm.eos_token_ids())
        self._token_text: dict[int, str] = {}

    # -- routes ---------------------------------------------------------------------------------
    async def completions(self, req: CompletionRequest, raw: Request) -> Response:
        self._check_common(req)
        if req.suffix is not None:
            raise bad_request("suffix is not supported", "suffix", "unsupported")
        prompts = await self._completion_prompts(req.prompt, req.parse_special_tokens)
        max_tokens = 16 if req.max_tokens is None else req.max_tokens  # OpenAI's default
        if max_tokens == 0 and not req.echo:
            raise bad_request("max_tokens 0 only makes sense with echo (it scores the prompt)",
                              "max_tokens")
        for ids in prompts:
            self._check_context(ids, max_tokens, "prompt", "max_tokens")
        # The prompt's own log-probs: echo with logprobs (OpenAI's legacy API, how
        # lm-evaluation-harness scores), or vLLM's prompt_logprobs; echo with max_tokens 0
        # still runs the prompt, so it asks for them too.
        prompt_logprobs = req.prompt_logprobs
        if req.echo and (req.logprobs is not None or max_tokens == 0):
            prompt_logprobs = max(prompt_logprobs or 0, req.logprobs or 0)
        params = self._params(req, max_tokens, req.logprobs, {"logprobs": "logprobs"},
                              prompt_logprobs)
        self._check_prompt_logprobs(req, prompts, prompt_logprobs)
        job = _Job(f"cmpl-{uuid.uuid4().hex}", prompts, params, req.n,
                   details=req.return_details)
        job.structured_field = _constraint_field(req)
        if req.echo:
            job.echo_texts = [p if isinstance(p, str) else self.tokenizer.decode(
                ids, skip_special_tokens=False) for p, ids in zip(
                    _prompt_items(req.prompt), prompts, strict=True)]
        await self._submit(job, req.priority, raw)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return self._sse(job, raw, self._completion_chunks(job, include_usage))
        finals = await self._collect(job, raw)
        if job.params.prompt_logprobs is None:
            return self._completion_response(req, job, finals)
        # Up to max_prompt_logprobs entries to translate and write (megabytes of JSON):
        # off the event loop, so the other streams' tokens keep flowing meanwhile.
        return await asyncio.to_thread(self._completion_response, req, job, finals)

    def _completion_response(self, req: CompletionRequest, job: _Job,
                             finals: list[RequestOutput]) -> Response:
        choices = []
        for k, out in enumerate(finals):
            for c in out.outputs:
                echo = job.echo_texts[k] if job.echo_texts is not None else None
                lp = self._completion_logprobs(c.token_ids, c.logprobs, c.top_logprobs,
                                               len(echo or ""))
                choices.append(CompletionChoice(
                    index=k * job.choices_per_prompt + c.index,
                    text=(echo or "") + c.text,
                    logprobs=self._with_prompt(lp, out, echo, req.logprobs),
                    finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                    prompt_logprobs=self._vllm_prompt_logprobs(out, req.prompt_logprobs),
                    kvloop=_details(job, c, out)))
        resp = CompletionResponse(id=job.request_id, model=self.model_name, choices=choices,
                                  usage=_usage(finals, job))
        return JSONResponse(dump_response(resp), headers=_id_header(job))

    async def chat(self, req: ChatCompletionRequest, raw: Request) -> Response:
        self._check_common(req)
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
        # A thread: checking the tools' schemas compiles them (native work, up to ~0.5 s
        # for a wide one), which must not hold the event loop other streams are sent from.
        plan = await asyncio.to_thread(plan_tools, req, self.tokenizer.chat_template)
        messages, tools = template_inputs(req.messages, plan)
        try:
            ids = await asyncio.to_thread(self.tokenizer.encode_chat, messages, True, tools)
        except KvloopError as e:  # no template, a refused conversation, or unencodable text
            raise bad_request(str(e), "messages") from e
        limit = req.max_completion_tokens if req.max_completion_tokens is not None \
            else req.max_tokens
        # OpenAI's default is the room the context has left; bounded, so one request that
        # names no limit cannot hold a seat for a whole 8k context.
        max_tokens = limit if limit is not None else max(
            min(self.default_max_tokens, self.max_model_len - len(ids)), 1)
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        self._check_context(ids, max_tokens, "messages", param)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = self._params(req, max_tokens, logprobs,
                              {"logprobs": "top_logprobs", "max_tokens": param},
                              forced=plan.structured)
        job = _Job(f"chatcmpl-{uuid.uuid4().hex}", [ids], params, req.n,
                   details=req.return_details)
        job.structured_field = "tools" if plan.structured else _constraint_field(req)
        await self._submit(job, req.priority, raw)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return self._sse(job, raw, self._chat_chunks(job, include_usage, plan))
        out = (await self._collect(job, raw))[0]
        choices = [self._chat_choice(c, plan).model_copy(update={
            "kvloop": _details(job, c, out)}) for c in out.outputs]
        resp = ChatCompletionResponse(id=job.request_id, model=self.model_name,
                                      choices=choices, usage=_usage([out], job))
        return JSONResponse(dump_chat_response(resp), headers=_id_header(job))

    def _chat_choice(self, c: CompletionOutput, plan: ToolPlan) -> ChatChoice:
        ids, lps, tops = self._message_tokens(c, c.token_ids, c.logprobs, c.top_logprobs)
        message, finish = AssistantMessage(content=c.text), c.finish_reason
        if plan.mode != "none":
            content, calls = plan.read(self._tool_text(plan, c, ids))
            if calls:
                message = AssistantMessage(content=content, tool_calls=[ResponseToolCall(
                    id=call_id(), function=ResponseFunctionCall(
                        name=call.name, arguments=call.arguments)) for call in calls])
                finish = "tool_calls" if finish == "stop" else finish
        return ChatChoice(index=c.index, message=message, logprobs=self._chat_logprobs(
            ids, lps, tops), finish_reason=finish, stop_reason=c.stop_reason)

    def _tool_text(self, plan: ToolPlan, c: CompletionOutput, message_ids: list[int]) -> str:
        """The answer as the tool parser reads it: Mistral's [TOOL_CALLS] and Llama's
        <|python_tag|> are special tokens, which the plain text leaves out."""
        if plan.mode == "auto" and plan.fmt != "hermes":
            return self.tokenizer.decode(message_ids, skip_special_tokens=False)
        return c.text

    # -- checks and translation -----------------------------------------------------------------
    def _check_common(self, req: SamplingRequest) -> None:
        if self.draining:
            raise _shutting_down()
        if req.model is not None and req.model != self.model_name:
            raise APIError(400, f"model {req.model!r} is not served here (this server serves "
                           f"{self.model_name!r}; see GET /v1/models)", param="model",
                           code="model_not_found")

    async def _completion_prompts(self, prompt: str | list[str] | list[int] | list[list[int]],
                                  parse_special: bool = False) -> list[list[int]]:
        items = _prompt_items(prompt)
        if not items:
            raise bad_request("prompt is empty", "prompt")
        if len(items) > self.max_prompts:
            # Each prompt is a request of its own: the list is work one client asks for.
            raise bad_request(f"prompt holds {len(items)} prompts; at most {self.max_prompts} "
                              f"are allowed in one request", "prompt", "too_many_prompts")
        texts = [p for p in items if isinstance(p, str)]
        # Off the event loop, all in one hop: a long prompt must not stall other streams.
        encoded = iter(await asyncio.to_thread(self._encode_all, texts, parse_special)
                       if texts else [])
        out = []
        for p in items:
            ids = next(encoded) if isinstance(p, str) else list(p)
            # An empty text is a prompt (the engine starts it from BOS); no ids is not.
            if not ids and not isinstance(p, str):
                raise bad_request("prompt is empty", "prompt")
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise bad_request(f"prompt token ids must be in [0, {self.vocab_size}), "
                                  f"got {bad[:5]}", "prompt")
            out.append(ids)
        return out

    def _encode_all(self, texts: list[str], parse_special: bool) -> list[list[int]]:
        try:
            if parse_special:  # the opt-in: control-token strings become control tokens
                return [self.tokenizer.encode(t, parse_special=True) for t in texts]
            return [self.tokenizer.encode(t) for t in texts]
        except KvloopError as e:  # text the tokenizer refuses (a lone surrogate)
            raise bad_request(str(e), "prompt") from e

    def _check_context(self, ids: list[int], max_tokens: int, prompt_param: str,
                       max_param: str) -> None:
        if len(ids) >= self.max_model_len:
            raise bad_request(
                f"this model's maximum context length is {self.max_model_len} tokens, but the "
                f"prompt has {len(ids)} tokens (room is needed for at least one generated "
                f"token)", prompt_param, "context_length_exceeded")
        if max_tokens >= 1 and len(ids) + max_tokens > self.max_model_len:
            raise bad_request(
                f"this model's maximum context length is {self.max_model_len} tokens; you "
                f"asked for {len(ids) + max_tokens} ({len(ids)} in the prompt, {max_tokens} "
                f"for the completion): lower {max_param} or shorten the prompt",
                max_param, "context_length_exceeded")

    def _check_prompt_logprobs(self, req: CompletionRequest, prompts: list[list[int]],
                               top: int | None) -> None:
        """The engine's cap on prompt tokens x top log-probs, over every prompt of the list
        (each is scored, and all of them are one answer), named as the client asked:
        `logprobs` with echo, else `prompt_logprobs`."""
        asked = "prompt_logprobs" if req.prompt_logprobs is not None and (
            not req.echo or (req.prompt_logprobs >= (req.logprobs or 0))) else "logprobs"
        try:
            check_prompt_logprobs(sum(len(ids) for ids in prompts), top,
                                  self.max_prompt_logprobs)
        except KvloopError as e:
            raise from_kvloop_error(e, {"prompt_logprobs": asked}) from e

    def _logit_bias(self, bias: dict[str, float] | None) -> dict[int, float] | None:
        if not bias:
            return None
        out = {}
        for key, value in bias.items():
            try:
                tok = int(key)
            except ValueError:
                raise bad_request(f"logit_bias keys must be token ids, got {key!r}",
                                  "logit_bias") from None
            # The sampler would only find out mid-step, when a bad id would take the
            # whole batch down: refuse it here.
            if not 0 <= tok < self.vocab_size:
                raise bad_request(f"logit_bias token id {tok} is not in [0, {self.vocab_size})",
                                  "logit_bias")
            out[tok] = value
        return out

    def _params(self, req: SamplingRequest, max_tokens: int, logprobs: int | None,
                names: dict[str, str], prompt_logprobs: int | None = None,
                forced: StructuredOutput | None = None) -> SamplingParams:
        """SamplingParams from the request; unset fields keep the engine's defaults.
        `forced`: the constraint of a forced tool call, in place of the request's own."""
        kw: dict[str, Any] = {"max_tokens": max_tokens, "logprobs": logprobs,
                              "prompt_logprobs": prompt_logprobs,
                              "logit_bias": self._logit_bias(req.logit_bias), "seed": req.seed}
        for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                     "presence_penalty", "frequency_penalty", "min_tokens", "ignore_eos",
                     "length_penalty", "early_stopping", "speculative", "num_speculative_tokens"):
            value = getattr(req, name)
            if value is not None:
                kw[name] = value
        structured = ("tools", forced) if forced is not None else _structured(req)
        if structured is not None:
            field, kw["structured"] = structured
            names = {**names, "structured": field}
        if req.stop is not None:
            kw["stop"] = [req.stop] if isinstance(req.stop, str) else list(req.stop)
        if req.stop_token_ids is not None:
            kw["stop_token_ids"] = list(req.stop_token_ids)
        if req.best_of is not None and not req.use_beam_search and req.best_of != req.n:
            raise bad_request("best_of is only supported with use_beam_search (it is the "
                              "number of beams)", "best_of", "unsupported")
        if req.num_beams is not None:
            # `is not None`, not `or`: 0 and -3 are values SamplingParams must refuse.
            beams = req.num_beams
        elif req.use_beam_search:
            beams = req.best_of if req.best_of is not None else req.n
        else:
            beams = 1
        if beams != 1 or req.use_beam_search:
            # Beam search returns the n best of `beams` beams (vLLM's best_of/n).
            kw.update(num_beams=beams, num_return_sequences=req.n, n=1)
            names = {"num_beams": "best_of" if req.use_beam_search else "num_beams",
                     "num_return_sequences": "n", **names}
        else:
            kw["n"] = req.n
        try:
            return SamplingParams(**kw)
        except KvloopError as e:
            raise from_kvloop_error(e, names) from e

    # -- engine ---------------------------------------------------------------------------------
    async def _submit(self, job: _Job, priority: int, raw: Request) -> None:
        """Queue every prompt of the job at once, or none of them.

        All adds are sent together (one engine drain takes them all, not one per step),
        and a client that leaves meanwhile aborts every prompt of the job."""
        if self.draining:
            raise _shutting_down()
        job.engine_ids = ([job.request_id] if len(job.prompts) == 1
                          else [f"{job.request_id}-{k}" for k in range(len(job.prompts))])
        self._jobs.add(job)
        try:
            async with _abort_on_disconnect(raw, lambda: self._abort(job)):
                results = await asyncio.gather(
                    *(self.engine.add_request(rid, prompt, job.params, priority)
                      for rid, prompt in zip(job.engine_ids, job.prompts, strict=True)),
                    return_exceptions=True)
            errors = [r for r in results if isinstance(r, BaseException)]
            if errors:
                raise errors[0]
            job.streams = [r for r in results if isinstance(r, RequestStream)]
        except BaseException as e:
            self._abort(job)
            self._jobs.discard(job)
            mapped = _engine_error(e, {"structured": job.structured_field})
            if mapped is e:
                raise
            raise mapped from e

    def _abort(self, job: _Job) -> None:
        for rid in job.engine_ids:
            self.engine.abort(rid)

    def _done(self, job: _Job) -> None:
        self._jobs.discard(job)
        if not all(s.finished for s in job.streams) or len(job.streams) < len(job.engine_ids):
            self._abort(job)  # cancelled or failed midway: nothing may keep running

    # -- shutdown -------------------------------------------------------------------------------
    @property
    def num_jobs(self) -> int:
        """HTTP requests whose prompts are queued or running."""
        return len(self._jobs)

    def end_all(self, error: APIError) -> None:
        """End every live job now; each client is told `error` (a JSON body, or an SSE
        error event before [DONE])."""
        for job in list(self._jobs):
            job.failure = error
            self._abort(job)

    async def _collect(self, job: _Job, raw: Request) -> list[RequestOutput]:
        last: dict[int, RequestOutput] = {}
        try:
            async with _abort_on_disconnect(raw, lambda: self._abort(job)):
                try:
                    async for k, out in _merge(job.streams):
                        last[k] = out
                except (EngineDeadError, RequestFailedError) as e:
                    raise _engine_error(e) from e
        finally:
            self._done(job)
        if job.failure is not None:
            raise job.failure
        if len(last) < len(job.prompts) or not all(o.finished for o in last.values()):
            # Only our own abort ends a stream early: the client is gone, answer anyway.
            raise APIError(499, "request aborted", code="aborted")
        return [last[k] for k in range(len(job.prompts))]

    def _sse(self, job: _Job, raw: Request, events: AsyncIterator[str]) -> StreamingResponse:
        async def body() -> AsyncIterator[str]:
            async with _abort_on_disconnect(raw, lambda: self._abort(job)):
                try:
                    async for event in events:
                        if job.failure is not None:
                            break
                        yield event
                except EngineDeadError as e:
                    yield _dead(e).sse()
                except RequestFailedError as e:
                    yield _failed(e).sse()
                except Exception as e:  # headers are sent: the error goes in the stream
                    logger.exception("%s failed mid-stream", job.request_id)
                    yield APIError(500, f"internal error: {e!r}", "internal_error").sse()
                finally:
                    # Cancelled by a disconnect, or done: either way nothing may keep running.
                    self._done(job)
                if job.failure is not None:  # ended by the server: say so, never just stop
                    yield job.failure.sse()
            yield "data: [DONE]\n\n"

        return _JobStream(lambda: self._done(job), body(), media_type="text/event-stream",
                          headers={**_SSE_HEADERS, **_id_header(job)})

    # -- streaming ------------------------------------------------------------------------------
    async def _deltas(self, job: _Job, finals: dict[int, RequestOutput]
                      ) -> AsyncIterator[_Delta]:
        """What each choice gained since it was last sent, one item per changed choice:
        the engine's per-step deltas (an output that arrives whole, a beam search's, has
        all of it as its delta)."""
        ended: set[int] = set()  # choices whose last chunk was sent
        want_lp = job.params.logprobs is not None
        async for k, out in _merge(job.streams):
            finals[k] = out
            for c in out.outputs:
                idx = k * job.choices_per_prompt + c.index
                if idx in ended:
                    continue
                ending = c.finish_reason is not None
                if not (c.delta or ending or (want_lp and c.delta_token_ids)):
                    continue
                if ending:
                    ended.add(idx)
                yield _Delta(idx, c, c.delta, c.delta_token_ids, ending)

    async def _completion_chunks(self, job: _Job, include_usage: bool) -> AsyncIterator[str]:
        finals: dict[int, RequestOutput] = {}
        offsets: dict[int, int] = {}  # choice -> text offset of its next token
        top = job.params.logprobs
        async for d in self._deltas(job, finals):
            k = d.index // job.choices_per_prompt
            echo = None
            if job.echo_texts is not None and d.index not in offsets:
                echo = job.echo_texts[k]  # the choice's first chunk: the prompt comes first
                offsets[d.index] = len(echo)
            if echo is not None and finals[k].prompt_logprobs is not None:
                # The scored prompt: a large event, written off the event loop.
                yield await asyncio.to_thread(self._completion_event, job, d, finals[k],
                                              echo, offsets, top)
            else:
                yield self._completion_event(job, d, finals[k], echo, offsets, top)
        if include_usage:
            yield dump_chunk(CompletionResponse(
                id=job.request_id, model=self.model_name, choices=[],
                usage=_usage([finals[k] for k in sorted(finals)], job)))

    def _completion_event(self, job: _Job, d: _Delta, out: RequestOutput, echo: str | None,
                          offsets: dict[int, int], top: int | None) -> str:
        """One SSE event of a streamed completion: choice `d`'s new text (after the prompt,
        on its first event with echo) and its log-probs; advances its text offset."""
        lp = self._completion_logprobs(d.token_ids, d.output.delta_logprobs,
                                       d.output.delta_top_logprobs, offsets.get(d.index, 0))
        lp = self._with_prompt(lp, out, echo, top)
        if lp is not None and lp.tokens:
            offsets[d.index] = lp.text_offset[-1] + len(lp.tokens[-1])
        choice = CompletionChoice(
            index=d.index, text=(echo or "") + d.text, logprobs=lp,
            finish_reason=d.output.finish_reason if d.ending else None,
            stop_reason=d.output.stop_reason if d.ending else None,
            kvloop=_details(job, d.output, out) if d.ending else None)
        return dump_chunk(CompletionResponse(id=job.request_id, model=self.model_name,
                                             choices=[choice]))

    async def _chat_chunks(self, job: _Job, include_usage: bool,
                           plan: ToolPlan) -> AsyncIterator[str]:
        def chunk(choices: list[ChatChunkChoice], usage: Usage | None = None) -> str:
            return dump_chunk(ChatCompletionChunk(id=job.request_id, model=self.model_name,
                                                  choices=choices, usage=usage))

        # The role first, as OpenAI does: the client sees the reply begin at once.
        for i in range(job.choices_per_prompt):
            yield chunk([ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))])
        finals: dict[int, RequestOutput] = {}
        answers: dict[int, StreamedAnswer] = {}
        # Log-probs of tokens whose text is held back (a tool call being written): they go
        # out with the next chunk the choice sends, so each token's is sent exactly once.
        held: dict[int, list[TokenLogprob]] = {}
        async for d in self._deltas(job, finals):
            answer = answers.setdefault(d.index, StreamedAnswer(plan))
            content, calls = answer.feed(d.text)
            finish = d.output.finish_reason if d.ending else None
            lp = self._chat_logprobs(*self._message_tokens(
                d.output, d.token_ids, d.output.delta_logprobs, d.output.delta_top_logprobs))
            if d.ending:
                ids = self._message_tokens(d.output, d.output.token_ids, None, None)[0]
                more, end_calls, is_calls = answer.finish(
                    self._tool_text(plan, d.output, ids))
                content = (content or "") + (more or "") or None
                calls += end_calls
                if is_calls and finish == "stop":
                    finish = "tool_calls"
            if plan.mode != "none":
                if lp is not None and lp.content is not None:
                    held.setdefault(d.index, []).extend(lp.content)
                if not (content or calls or d.ending):
                    continue
                if d.index in held:
                    lp = ChatLogprobs(content=held.pop(d.index))
            yield chunk([ChatChunkChoice(
                index=d.index, delta=ChatDelta(content=content, tool_calls=calls or None),
                logprobs=lp, finish_reason=finish,
                stop_reason=d.output.stop_reason if d.ending else None,
                kvloop=_details(job, d.output, finals[0]) if d.ending else None)])
        if include_usage and finals:
            yield chunk([], _usage([finals[0]], job))

    # -- logprobs -------------------------------------------------------------------------------
    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._token_text[token_id] = text
        return text

    def _completion_logprobs(self, ids: Sequence[int], lps: list[float] | None,
                             tops: list[list[tuple[int, float]]] | None,
                             offset: int) -> CompletionLogprobs | None:
        """OpenAI's completions logprobs of tokens `ids` (their log-probs `lps`, top
        alternatives `tops`), the first at text offset `offset`; None when not asked for."""
        if lps is None:
            return None
        tokens = [self.token_text(t) for t in ids]
        offsets = []
        for tok in tokens:
            offsets.append(offset)
            offset += len(tok)
        top: list[dict[str, float] | None] | None = (
            [{self.token_text(t): lp for t, lp in row} for row in tops]
            if tops is not None else None)
        return CompletionLogprobs(tokens=tokens, token_logprobs=list[float | None](lps),
                                  top_logprobs=top, text_offset=offsets)

    def _with_prompt(self, lp: CompletionLogprobs | None, out: RequestOutput,
                     echo: str | None, top: int | None) -> CompletionLogprobs | None:
        """`lp` preceded by the prompt's tokens and log-probs, when echoing with logprobs:
        the first prompt token has none (nothing predicts it), as in OpenAI's API."""
        if echo is None or top is None or lp is None:
            return lp
        plp = out.prompt_logprobs or [None] * len(out.prompt_token_ids)
        tokens = [self.token_text(t) for t in out.prompt_token_ids]
        offsets, offset = [], 0
        for tok in tokens:
            offsets.append(offset)
            offset += len(tok)
        return CompletionLogprobs(
            tokens=tokens + lp.tokens,
            token_logprobs=[e[0] if e else None for e in plp] + list(lp.token_logprobs),
            top_logprobs=([{self.token_text(t): v for t, v in e[1]} if e and e[1] else None
                           for e in plp] + list(lp.top_logprobs or []))
            if top else None,
            text_offset=offsets + lp.text_offset)

    def _vllm_prompt_logprobs(self, out: RequestOutput, asked: int | None
                              ) -> list[dict[str, dict[str, Any]] | None] | None:
        """vLLM's prompt_logprobs: per prompt token, {token id: logprob, rank, text} for the
        token itself and its top alternatives; None for the first."""
        if asked is None or out.prompt_logprobs is None:
            return None
        result: list[dict[str, dict[str, Any]] | None] = []
        for tok, entry in zip(out.prompt_token_ids, out.prompt_logprobs, strict=True):
            if entry is None:
                result.append(None)
                continue
            lp, alts = entry
            ranks = {t: r for r, (t, _) in enumerate(alts or [], start=1)}
            row = {str(tok): {"logprob": lp, "rank": ranks.get(tok),
                              "decoded_token": self.token_text(tok)}}
            for t, v in alts or []:
                row.setdefault(str(t), {"logprob": v, "rank": ranks[t],
                                        "decoded_token": self.token_text(t)})
            result.append(row)
        return result

    def _message_tokens(self, c: CompletionOutput, ids: list[int], lps: list[float] | None,
                        tops: list[list[tuple[int, float]]] | None
                        ) -> tuple[list[int], list[float] | None,
                                   list[list[tuple[int, float]]] | None]:
        """The tokens of the message itself: an end-of-turn token that ended the reply is
        not part of it (OpenAI's chat logprobs list only the message's tokens)."""
        if c.finish_reason == "stop" and c.stop_reason is None and ids and ids[-1] in self.eos:
            n = len(ids) - 1
            return ids[:n], lps[:n] if lps is not None else None, tops[:n] if tops else tops
        return ids, lps, tops

    def _chat_logprobs(self, ids: Sequence[int], lps: list[float] | None,
                       tops: list[list[tuple[int, float]]] | None) -> ChatLogprobs | None:
        if lps is None:
            return None
        tops = tops or []
        content = []
        for i, (t, lp) in enumerate(zip(ids, lps, strict=False)):
            text = self.token_text(t)
            top = [TopLogprob(token=self.token_text(a), logprob=b,
                              bytes=list(self.token_text(a).encode()))
                   for a, b in (tops[i] if i < len(tops) else [])]
            content.append(TokenLogprob(token=text, logprob=lp, bytes=list(text.encode()),
                                        top_logprobs=top))
        return ChatLogprobs(content=content)


# --- helpers -----------------------------------------------------------------------------------
def _constraint_field(req: SamplingRequest) -> str:
    """The field an output constraint came in (for the engine's compile errors)."""
    for name in ("structured_outputs", "guided_json", "guided_regex", "guided_choice",
                 "guided_grammar"):
        if getattr(req, name) is not None:
            return name
    return "response_format"


def _structured(req: SamplingRequest) -> tuple[str, StructuredOutput] | None:
    """The request's output constraint and the field it came in: OpenAI's response_format,
    vLLM's structured_outputs, or one of vLLM's older guided_* fields (one of them)."""
    found: list[tuple[str, StructuredOutput]] = []
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        found.append(("response_format", StructuredOutput(json_object=True)))
    elif rf is not None and rf.type == "json_schema":
        schema = (rf.json_schema or {}).get("schema")
        if not isinstance(schema, dict):
            raise bad_request("response_format json_schema needs a 'schema' object",
                              "response_format")
        found.append(("response_format", StructuredOutput(json_schema=schema)))
    so = req.structured_outputs
    if so is not None:
        found.append(("structured_outputs", StructuredOutput(
            json_schema=so.json_schema, regex=so.regex, choice=so.choice, grammar=so.grammar,
            json_object=bool(so.json_object))))
    for name, kw in (("guided_json", "json_schema"), ("guided_regex", "regex"),
                     ("guided_choice", "choice"), ("guided_grammar", "grammar")):
        if getattr(req, name) is not None:
            found.append((name, StructuredOutput(**{kw: getattr(req, name)})))
    if len(found) > 1:
        raise bad_request(f"give one output constraint, got {[f for f, _ in found]}",
                          found[1][0])
    return found[0] if found else None


def _prompt_items(prompt: str | list[str] | list[int] | list[list[int]]
                  ) -> list[str | list[int]]:
    """The request's prompts, one item each: a text or a list of token ids."""
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(isinstance(p, int) for p in prompt):
        return [[int(t) for t in prompt]]  # type: ignore[arg-type]  # one prompt of ids
    return list(prompt)  # type: ignore[arg-type]


def _details(job: _Job, c: CompletionOutput, out: RequestOutput) -> ChoiceDetails | None:
    """The return_details extension of choice `c` (a final output) of `out`, if asked."""
    if not job.details:
        return None
    return ChoiceDetails(token_ids=list(c.token_ids), logprobs=c.logprobs,
                         top_logprobs=c.top_logprobs, cumulative_logprob=c.cumulative_logprob,
                         score=c.score, metrics=out.metrics.as_dict())


def _usage(finals: Sequence[RequestOutput], job: _Job) -> Usage:
    prompt = sum(len(o.prompt_token_ids) for o in finals)
    completion = sum(len(c.token_ids) for o in finals for c in o.outputs)
    cached = sum(o.metrics.num_cached_tokens for o in finals)
    costs = None
    if job.details:  # the engine's account, summed over the request's prompts
        ms = [o.metrics for o in finals]
        rates = [r for m in ms if (r := m.decode_bytes_per_s) is not None]
        costs = UsageCosts(positions_processed=sum(m.positions_processed for m in ms),
                           flops=sum(m.flops for m in ms),
                           weight_bytes=sum(m.weight_bytes for m in ms),
                           kv_bytes=sum(m.kv_bytes for m in ms),
                           decode_bytes_per_s=rates[0] if len(rates) == 1 else None)
    return Usage(prompt_tokens=prompt, completion_tokens=completion,
                 total_tokens=prompt + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached), kvloop=costs)


def _id_header(job: _Job) -> dict[str, str]:
    return {"X-Request-Id": job.request_id}


def _engine_error(e: BaseException, names: dict[str, str] | None = None) -> BaseException:
    """The HTTP face of an engine refusal; anything else passes through unchanged."""
    if isinstance(e, KvloopError):
        return from_kvloop_error(e, names)
    if isinstance(e, EngineOverloadedError):
        return APIError(429, f"the server is busy: {e}; retry later", "rate_limit_error",
                        code="server_busy", headers={"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(e, EngineDeadError):
        return _dead(e)
    if isinstance(e, RequestFailedError):
        return _failed(e)
    return e


def _dead(e: EngineDeadError) -> APIError:
    return APIError(503, str(e), "service_unavailable", code="engine_dead")


def _failed(e: RequestFailedError) -> APIError:
    # This request alone failed inside the engine; the engine and the others go on.
    return APIError(500, str(e), "internal_error", code="request_failed")


def _shutting_down() -> APIError:
    return APIError(503, "the server is shutting down; retry on another instance or later",
                    "service_unavailable", code="shutting_down",
                    headers={"Retry-After": str(RETRY_AFTER_S)})


async def _merge(streams: Sequence[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several streams as they come, tagged with the stream's position."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(k: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                queue.put_nowait((k, out))
            queue.put_nowait((k, None))
        except Exception as e:
            queue.put_nowait((k, e))

    tasks = [asyncio.create_task(pump(k, s)) for k, s in enumerate(streams)]
    try:
        done = 0
        while done < len(streams):
            k, item = await queue.get()
            if item is None:
                done += 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield k, item
    finally:
        for t in tasks:
            t.cancel()


@contextlib.asynccontextmanager
async def _abort_on_disconnect(raw: Request, abort: Callable[[], None]) -> AsyncIterator[None]:
    """Call `abort` as soon as the client disconnects while the body runs.

    Reading `receive` after the request body is done returns only when the connection
    closes (or the response completes), so a waiting task hears it at once, whatever the
    ASGI server's spec version says about streaming cancellation.
    """
    async def watch() -> None:
        while True:
            message = await raw.receive()
            if message["type"] == "http.disconnect":
                abort()
                return

    task = asyncio.create_task(watch())
    try:
        yield
    finally:
        task.cancel()
