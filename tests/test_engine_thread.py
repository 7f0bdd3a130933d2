"""The served engine runs on the thread that loaded it (AsyncEngine.build).

Why it matters is a speed effect (libgomp keeps one worker pool per thread that opens
parallel regions; two pools on a 2-core machine stop its workers spin-waiting, and the
native decode step took 2x as long: see AsyncEngine.build). Speed is a benchmark's to show
(bench_serving.py); this pins the mechanism: the model is built, and every step runs, on
one thread, and `kvloop serve` uses that path.
"""

from __future__ import annotations

import asyncio
import inspect
import threading

import pytest

from conftest import slowed
from kvloop.config import EngineConfig
from kvloop.engine import structured
from kvloop.engine.async_engine import AsyncEngine
from kvloop.engine.llm_engine import LLMEngine
from kvloop.errors import InvalidParamsError, KvloopError
from kvloop.params import SamplingParams, StructuredOutput


def test_model_built_and_stepped_on_one_thread(tiny_model_dir) -> None:
    threads: dict[str, set[int]] = {"build": set(), "step": set()}

    def factory() -> LLMEngine:
        threads["build"].add(threading.get_ident())
        engine = LLMEngine(str(tiny_model_dir), EngineConfig(kv_cache_memory="16MiB"))
        step = engine.step

        def recorded_step():  # type: ignore[no-untyped-def]
            threads["step"].add(threading.get_ident())
            return step()

        engine.step = recorded_step  # type: ignore[method-assign]
        return engine

    aeng = AsyncEngine.build(factory)
    assert threads["build"] and threading.get_ident() not in threads["build"]

    async def generate() -> str:
        aeng.start()  # already running: a no-op
        stream = await aeng.add_request(
            "r", "The quick", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        outs = [out async for out in stream]
        return outs[-1].outputs[0].text

    try:
        text = asyncio.run(generate())
    finally:
        aeng.shutdown()
    assert text
    assert threads["step"] == threads["build"]  # every step on the loading thread


def test_grammars_compile_off_the_engine_thread(tiny_model_dir, monkeypatch) -> None:
    """A grammar's compile (~0.5 s for a schema of 5,000 properties, native work without
    the GIL) runs before its request is queued, on a thread of its own: on the engine
    thread it would stall every other stream for that long (issue 25's fuzz found 1-5 s
    stalls so). The engine's own compile then hits the cache."""
    callers: list[str] = []  # the thread that asked for each new grammar's compile
    compile_ = structured.on_compile_thread

    def recorded(fn, *args):  # type: ignore[no-untyped-def]
        callers.append(threading.current_thread().name)
        return compile_(fn, *args)

    monkeypatch.setattr(structured, "on_compile_thread", recorded)
    aeng = AsyncEngine.build(
        lambda: LLMEngine(str(tiny_model_dir), EngineConfig(kv_cache_memory="16MiB")))
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}

    async def generate() -> str:
        stream = await aeng.add_request("r", "The quick", SamplingParams(
            temperature=0, max_tokens=8, structured=StructuredOutput(json_schema=schema)))
        outs = [out async for out in stream]
        with pytest.raises(InvalidParamsError, match="structured"):  # refused before queueing
            await aeng.add_request("bad", "x", SamplingParams(
                structured=StructuredOutput(grammar="start: r0\nr0: r1")))
        return outs[-1].outputs[0].text

    try:
        text = asyncio.run(generate())
    finally:
        aeng.shutdown()
    assert text.startswith("{")
    assert len(callers) == 2 and "kvloop-engine" not in callers, callers


def test_a_streamed_request_takes_one_step_per_token_back_to_back(tiny_model_dir) -> None:
    """The serving loop's mechanism (issue 27): while a request runs, the engine thread
    steps back to back, one engine step per streamed token, and never waits on its inbox
    between steps (a wait there, a poll interval or a sleep, is added to every token's
    time); each step's output reaches the stream."""
    aeng = AsyncEngine.build(
        lambda: LLMEngine(str(tiny_model_dir), EngineConfig(kv_cache_memory="16MiB")))
    eng = aeng.engine
    drain = aeng._drain
    waits_while_busy = []  # inbox waits taken while the engine had a request to step

    def recorded(block: bool, timeout: float | None = None):  # type: ignore[no-untyped-def]
        if block and eng.has_unfinished_requests():
            waits_while_busy.append((eng.num_steps, timeout))
        return drain(block, timeout)

    aeng._drain = recorded  # type: ignore[method-assign]
    new_tokens = 24

    async def stream() -> list[int]:
        steps_before = eng.num_steps
        s = await aeng.add_request("r", "The quick", SamplingParams(
            temperature=0, max_tokens=new_tokens, ignore_eos=True))
        sizes = [len(out.outputs[0].token_ids) async for out in s]
        return [eng.num_steps - steps_before, *sizes]

    try:
        steps, *sizes = asyncio.run(stream())
    finally:
        aeng.shutdown()
    assert steps == new_tokens  # the prefill samples the first token, each decode one more
    assert sizes[-1] == new_tokens and len(sizes) == new_tokens  # an output per step
    assert waits_while_busy == []


def test_a_steps_outputs_cross_to_the_event_loop_in_one_batch(tiny_model_dir,
                                                               monkeypatch) -> None:
    """Four streams decoding together: each step wakes the event loop once for all of
    them (and once per request accepted), not once per stream."""
    from kvloop.engine import async_engine

    wakeups = [0]
    call_in_loop = async_engine._call_in_loop

    def counted(loop, fn):  # type: ignore[no-untyped-def]
        wakeups[0] += 1
        call_in_loop(loop, fn)

    monkeypatch.setattr(async_engine, "_call_in_loop", counted)
    # Steps slowed to >= 2 ms: otherwise r0 can finish its 12 steps (~3.5 ms) before r1 is
    # accepted, and the four never decode together.
    aeng = AsyncEngine.build(lambda: slowed(
        LLMEngine(str(tiny_model_dir), EngineConfig(kv_cache_memory="16MiB")), 0.002))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    async def run() -> list[int]:
        streams = [await aeng.add_request(f"r{i}", "The quick", params) for i in range(4)]

        async def drain(s) -> int:  # type: ignore[no-untyped-def]
            return len([out async for out in s])

        return list(await asyncio.gather(*(drain(s) for s in streams)))

    try:
        steps_before = aeng.engine.num_steps
        outputs = asyncio.run(run())
        steps = aeng.engine.num_steps - steps_before
    finally:
        aeng.shutdown()
    assert outputs == [12] * 4
    assert wakeups[0] <= steps + 4 < sum(outputs), (wakeups, steps)


def test_build_error_is_raised_in_the_caller(tmp_path) -> None:
    with pytest.raises(KvloopError):
        AsyncEngine.build(lambda: LLMEngine(str(tmp_path / "missing.gguf"), EngineConfig()))


def test_serve_builds_its_engine_on_the_engine_thread() -> None:
    from kvloop.server import cli

    assert "AsyncEngine.build(" in inspect.getsource(cli.cmd_serve)
