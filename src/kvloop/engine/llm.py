"""LLM: the offline Python API.

    llm = LLM()                                   # the default model
    outs = llm.generate(["Hi", "Bye"], SamplingParams(max_tokens=32))
    for delta in llm.stream("Once upon a time"): print(delta, end="")
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

from kvloop.config import EngineConfig
from kvloop.engine.llm_engine import LLMEngine
from kvloop.engine.outputs import RequestOutput
from kvloop.errors import InvalidParamsError
from kvloop.params import SamplingParams

Messages = list[dict[str, str]]
Prompt = str | list[int]


def engine_config(**options: Any) -> EngineConfig:
    """EngineConfig from keyword options; an unknown name is an InvalidParamsError (a typo
    such as `kv_cache_mem=` would otherwise be a TypeError from the dataclass)."""
    known = {f.name for f in fields(EngineConfig)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise InvalidParamsError(
            f"unknown engine option {unknown[0]!r}; the options are {', '.join(sorted(known))}",
            param=unknown[0])
    return EngineConfig(**options)


class LLM:
    def __init__(self, model: str | Path | None = None, **engine_options: Any) -> None:
        """`engine_options` are EngineConfig fields (use_cache, kv_cache_memory, ...).

        A bad option raises InvalidParamsError naming it before the model is loaded.
        `load_seconds`: how long the engine took to be ready (model, tokenizer, caches)."""
        config = engine_config(**engine_options)
        start = time.perf_counter()
        self.engine = LLMEngine(model, config)
        self.load_seconds = time.perf_counter() - start
        self.tokenizer = self.engine.tokenizer

    def close(self) -> None:
        """Release what outlives a call: the tensor parallel ranks, when there are any."""
        self.engine.close()

    # -- batch ---------------------------------------------------------------------------------
    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Run every prompt through continuous batching; outputs in prompt order."""
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        prompt_list = list(prompts)  # type: ignore[arg-type]
        param_list = (list(params) if isinstance(params, Sequence)
                      else [params or SamplingParams()] * len(prompt_list))
        if len(param_list) != len(prompt_list):
            raise ValueError("give one SamplingParams, or one per prompt")
        ids: list[str] = []
        try:
            for prompt, p in zip(prompt_list, param_list, strict=True):
                ids.append(self.engine.add_request(None, prompt, p))
        except Exception:
            for rid in ids:  # a bad prompt leaves nothing half-started behind
                self.engine.abort(rid)
            raise
        return self._run(ids, use_tqdm)

    def chat(self, messages: Messages | Sequence[Messages],
             params: SamplingParams | None = None, use_tqdm: bool = False) -> list[RequestOutput]:
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.tokenizer.encode_chat(m) for m in convs]  # type: ignore[arg-type]
        return self.generate(prompts, params, use_tqdm)  # type: ignore[arg-type]

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        bar = _progress_bar(len(ids)) if use_tqdm else None
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            for rid in ids:
                self.engine.abort(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [results[rid] for rid in ids]

    # -- streaming -----------------------------------------------------------------------------
    def stream_outputs(self, prompt: Prompt,
                       params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield the request's output after every step that changed it (deltas filled in)."""
        rid = self.engine.add_request(None, prompt, params)
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.request_id == rid:
                        yield out
                        if out.finished:
                            return
        finally:
            self.engine.abort(rid)  # a no-op once finished; frees blocks if the caller stops

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[str]:
        """Yield text deltas; none splits a UTF-8 character or shows part of a stop string."""
        for out in self.stream_outputs(prompt, params):
            if out.outputs[0].delta:
                yield out.outputs[0].delta

    def stream_chat(self, messages: Messages,
                    params: SamplingParams | None = None) -> Iterator[str]:
        return self.stream(self.tokenizer.encode_chat(messages), params)


def _progress_bar(total: int) -> Any:
    """A tqdm bar over `total` requests. tqdm.auto loads only when a bar is asked for: it
    pulls in asyncio (~40 ms of a one-shot command that shows none)."""
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="requests", unit="req")
