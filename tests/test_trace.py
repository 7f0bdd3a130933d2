"""Step traces (`--trace FILE`): the engine's steps and each request's phases as Chrome
trace-event JSON.

Each trace is checked against a JSON schema written here from the Trace Event Format's
own description (the JSON Object Format; complete "X", instant "i" and metadata "M"
events), not from kvloop's writer, and then read as Perfetto would: tracks by tid, named
by their thread_name metadata, spans by ts and dur.

What holds for a reply of N tokens: the step that prefills the prompt samples the first
token, so its track shows one "prefill" span and N - 1 "decode" spans, and the spans'
args.new_tokens add up to N; the engine track has one "step" per forward, N in all.
"""

from __future__ import annotations

import asyncio
import json
from collections import defaultdict
from itertools import pairwise
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest

from kvloop import LLM, SamplingParams
from kvloop.cli import main
from kvloop.config import EngineConfig
from kvloop.engine.llm_engine import LLMEngine
from kvloop.engine.steps import StepRecord
from kvloop.engine.trace import TraceRecorder
from kvloop.server.app import ServerSettings, create_app
from kvloop.server.background import BackgroundServer

SMALL_KV = "16MiB"
PROMPT = "The quick brown fox"

_NUM = {"type": "number", "minimum": 0}
_ID = {"type": "integer", "minimum": 0}
TRACE_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "required": ["traceEvents"],
    "properties": {
        "traceEvents": {"type": "array", "items": {"$ref": "#/$defs/event"}},
        "displayTimeUnit": {"enum": ["ms", "ns"]},
        "otherData": {"type": "object"},
    },
    "$defs": {
        "event": {
            "type": "object",
            "required": ["name", "ph", "pid", "tid"],
            "properties": {"name": {"type": "string"}, "cat": {"type": "string"},
                           "pid": _ID, "tid": _ID, "args": {"type": "object"}},
            "oneOf": [
                {"properties": {"ph": {"const": "X"}, "ts": _NUM, "dur": _NUM},
                 "required": ["ts", "dur"]},
                {"properties": {"ph": {"const": "i"}, "ts": _NUM, "s": {"enum": ["g", "p", "t"]}},
                 "required": ["ts"]},
                {"properties": {"ph": {"const": "M"},
                                "name": {"enum": ["process_name", "process_labels",
                                                  "process_sort_index", "thread_name",
                                                  "thread_sort_index"]}},
                 "required": ["args"]},
            ],
        },
    },
}


class Trace:
    """A trace file, validated and read into tracks."""

    def __init__(self, path: Path) -> None:
        doc = json.loads(path.read_text(encoding="utf-8"))
        jsonschema.validate(doc, TRACE_SCHEMA)
        assert doc["displayTimeUnit"] == "ms"
        self.doc = doc
        events = doc["traceEvents"]
        self.names = {e["tid"]: e["args"]["name"] for e in events
                      if e["ph"] == "M" and e["name"] == "thread_name"}
        self.tracks: dict[str, list[dict]] = defaultdict(list)
        for e in events:
            if e["ph"] != "M":
                self.tracks[self.names[e["tid"]]].append(e)  # every event's track is named

    @property
    def steps(self) -> list[dict]:
        return [e for e in self.tracks["engine"] if e["name"] == "step"]

    @property
    def requests(self) -> list[str]:
        return [n for n in self.names.values() if n != "engine"]

    def spans(self, track: str, name: str | None = None) -> list[dict]:
        return [e for e in self.tracks[track]
                if e["ph"] == "X" and (name is None or e["name"] == name)]

    def life(self, track: str) -> tuple[float, float]:
        """From the track's first span's start to its last span's end (microseconds)."""
        spans = self.spans(track)
        return min(e["ts"] for e in spans), max(e["ts"] + e["dur"] for e in spans)


def run_main(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def assert_sequential(spans: list[dict]) -> None:
    """A track's spans follow each other: none starts before the one before it ended."""
    spans = sorted(spans, key=lambda e: e["ts"])
    for a, b in pairwise(spans):
        assert a["ts"] + a["dur"] <= b["ts"] + 1e-3, (a, b)


# --- kvloop generate --trace --------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 7])
def test_generate_trace_one_prefill_and_n_minus_1_decode_spans(
        tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        n: int) -> None:
    path = tmp_path / "trace.json"
    rc, out, err = run_main(["generate", PROMPT, "--model", str(tiny_model_dir), "--json",
                             "--kv-cache-memory", SMALL_KV, "--max-tokens", str(n),
                             "--ignore-eos", "--trace", str(path)], capsys)
    assert rc == 0, err
    reply = json.loads(out)
    assert len(reply["token_ids"]) == n and reply["finish_reason"] == "length"
    trace = Trace(path)
    (rid,) = trace.requests
    prefill, decode = trace.spans(rid, "prefill"), trace.spans(rid, "decode")
    assert len(prefill) == 1 and len(decode) == n - 1
    # The prompt ran once, in the prefill; each span produced tokens, N in all.
    assert prefill[0]["args"]["positions"] == reply["metrics"]["prompt_tokens"]
    assert [s["args"]["new_tokens"] for s in prefill + decode] == [1] * n
    assert [s["name"] for s in sorted(trace.spans(rid), key=lambda e: e["ts"])] == \
        ["queued", "prefill"] + ["decode"] * (n - 1)
    assert_sequential(trace.spans(rid))
    (fin,) = [e for e in trace.tracks[rid] if e["ph"] == "i"]
    assert fin["name"] == "finished" and fin["args"] == {"reason": "length"}
    # The engine track: one step per forward, each carrying the request's span of it.
    steps = trace.steps
    assert len(steps) == n
    assert [(s["ts"], s["dur"]) for s in steps] == [(s["ts"], s["dur"]) for s in prefill + decode]
    assert [s["args"]["prefill_tokens"] for s in steps] == \
        [reply["metrics"]["prompt_tokens"]] + [0] * (n - 1)
    assert [s["args"]["decode_tokens"] for s in steps] == [0] + [1] * (n - 1)
    assert all(s["args"]["batch_size"] == 1 for s in steps)
    for s in steps:
        assert s["args"]["step_ms"] == pytest.approx(s["dur"] / 1e3, abs=2e-3)
        assert s["args"]["kv_blocks_used"] + s["args"]["kv_blocks_free"] > 0
    assert_sequential(steps)


def test_chunked_prefill_is_one_span_per_chunk(tiny_model_dir: Path, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "trace.json"
    prompt = "the lazy dog jumps over " * 8
    rc, out, err = run_main(["generate", prompt, "--model", str(tiny_model_dir), "--json",
                             "--kv-cache-memory", SMALL_KV, "--max-tokens", "3", "--ignore-eos",
                             "--max-num-batched-tokens", "16", "--trace", str(path)], capsys)
    assert rc == 0, err
    prompt_tokens = json.loads(out)["metrics"]["prompt_tokens"]
    assert prompt_tokens > 32
    trace = Trace(path)
    (rid,) = trace.requests
    chunks = sorted(trace.spans(rid, "prefill"), key=lambda e: e["ts"])
    assert len(chunks) == -(-prompt_tokens // 16)
    assert [c["args"]["start_pos"] for c in chunks] == list(range(0, prompt_tokens, 16))
    assert sum(c["args"]["positions"] for c in chunks) == prompt_tokens
    # Only the last chunk reaches the prompt's end and samples the first token.
    assert [c["args"]["new_tokens"] for c in chunks] == [0] * (len(chunks) - 1) + [1]
    assert len(trace.spans(rid, "decode")) == 2


def test_speculative_decode_spans_count_their_accepted_tokens(
        tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """With drafts a decode step may produce several tokens: still one span per step, its
    draft tokens and new tokens in its args, and the tokens add up to the reply."""
    path = tmp_path / "trace.json"
    prompt = "one two three one two three one two three one two"
    rc, out, err = run_main(["generate", prompt, "--model", str(tiny_model_dir), "--json",
                             "--kv-cache-memory", SMALL_KV, "--max-tokens", "40",
                             "--ignore-eos", "--speculative", "ngram", "--trace", str(path)],
                            capsys)
    assert rc == 0, err
    metrics = json.loads(out)["metrics"]
    assert metrics["draft_tokens"] > 0
    trace = Trace(path)
    (rid,) = trace.requests
    decode = trace.spans(rid, "decode")
    assert len(trace.spans(rid, "prefill")) == 1 and len(trace.steps) == 1 + len(decode)
    assert sum(s["args"]["new_tokens"] for s in decode) == 40 - 1
    assert sum(s["args"].get("draft_tokens", 0) for s in decode) == metrics["draft_tokens"]
    assert [s["args"]["decode_tokens"] for s in trace.steps[1:]] == \
        [s["args"]["positions"] for s in sorted(decode, key=lambda e: e["ts"])]


@pytest.mark.slow
def test_generate_trace_on_the_default_model(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """The acceptance run: the real model, an 8-token reply."""
    path = tmp_path / "trace.json"
    rc, out, err = run_main(["generate", "What is a KV cache?", "--chat", "--json",
                             "--max-tokens", "8", "--ignore-eos", "--trace", str(path)], capsys)
    assert rc == 0, err
    assert len(json.loads(out)["token_ids"]) == 8
    trace = Trace(path)
    (rid,) = trace.requests
    assert len(trace.spans(rid, "prefill")) == 1 and len(trace.spans(rid, "decode")) == 7
    assert sum(s["args"]["new_tokens"] for s in trace.spans(rid)
               if s["name"] != "queued") == 8
    assert len(trace.steps) == 8


@pytest.mark.parametrize("command", ["generate", "serve"])
@pytest.mark.parametrize("bad", ["missing-dir/trace.json", "."], ids=["no-dir", "a-directory"])
def test_bad_trace_path_is_one_error_line_before_loading(
        command: str, bad: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / bad
    prompt = ["hi"] if command == "generate" else []
    # The model does not exist either: the trace's error shows the path was checked first.
    rc, out, err = run_main([command, *prompt, "--model", str(tmp_path / "no-model.gguf"),
                             "--trace", str(path)], capsys)
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"kvloop: error: cannot write the trace file {path}: "), err


def test_trace_forces_the_local_engine(tiny_model_dir: Path, tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    """A trace is of this process's engine: a --server named is not asked (it would fail:
    nothing listens there)."""
    path = tmp_path / "trace.json"
    rc, _, err = run_main(["generate", PROMPT, "--model", str(tiny_model_dir), "--max-tokens",
                           "2", "--kv-cache-memory", SMALL_KV, "--server",
                           "http://127.0.0.1:9", "--trace", str(path)], capsys)
    assert rc == 0, err
    assert len(Trace(path).steps) >= 1


# --- the engine: preemption, aborts, a failing recorder ------------------------------------------
def test_preempted_request_shows_a_preempted_span_then_a_recompute(tiny_model_dir: Path,
                                                                   tmp_path: Path) -> None:
    # 36 blocks of 16 slots (512 bytes a slot, see test_batching): four 150-token prompts
    # that each grow to 200 tokens need 52 blocks between them.
    llm = LLM(str(tiny_model_dir), kv_cache_memory=36 * 16 * 512, max_num_batched_tokens=128)
    trace = TraceRecorder(tmp_path / "trace.json")
    llm.engine.observer = trace
    prompts = [[2 + (7 * i + j) % 300 for j in range(150)] for i in range(4)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=50, ignore_eos=True))
    trace.write()
    assert llm.engine.scheduler.num_preemptions > 0
    t = Trace(tmp_path / "trace.json")
    assert sorted(t.requests) == sorted(o.request_id for o in outs)
    preempted = [r for r in t.requests if t.spans(r, "preempted")]
    assert preempted
    assert sum(s["args"].get("preempted", 0) for s in t.steps) == \
        llm.engine.scheduler.num_preemptions
    for rid in preempted:
        spans = sorted(t.spans(rid), key=lambda e: e["ts"])
        assert_sequential(spans)
        i = next(k for k, s in enumerate(spans) if s["name"] == "preempted")
        assert spans[i - 1]["name"] in ("prefill", "decode")
        gained = sum(s["args"].get("new_tokens", 0) for s in spans[:i])
        # It resumes with a prefill (in chunks, less what the prefix cache still holds) of
        # its prompt and the tokens it had generated; the last chunk samples the next one.
        j = i + 1
        while spans[j]["args"]["new_tokens"] == 0:
            j += 1
        recompute = spans[i + 1:j + 1]
        assert all(s["name"] == "prefill" and s["args"]["recompute"] for s in recompute)
        end = recompute[-1]["args"]["start_pos"] + recompute[-1]["args"]["positions"]
        assert end == 150 + gained
    for o in outs:  # every request's tokens are in its spans, preempted or not
        assert sum(s["args"].get("new_tokens", 0) for s in t.spans(o.request_id)) == 50


def test_abort_while_queued_ends_the_queued_span(tiny_model_dir: Path,
                                                 tmp_path: Path) -> None:
    engine = LLMEngine(str(tiny_model_dir), EngineConfig(kv_cache_memory=SMALL_KV))
    trace = TraceRecorder(tmp_path / "trace.json")
    engine.observer = trace
    rid = engine.add_request(None, PROMPT, SamplingParams(max_tokens=2))
    engine.abort(rid)
    trace.write()
    t = Trace(tmp_path / "trace.json")
    assert [e["name"] for e in t.tracks[rid]] == ["queued", "finished"]
    assert t.tracks[rid][1]["args"] == {"reason": "abort"}
    assert t.steps == []


def test_a_failing_observer_is_detached_and_fails_no_request(tiny_model_dir: Path,
                                                              tmp_path: Path) -> None:
    class Broken(TraceRecorder):
        def on_step(self, r: StepRecord) -> None:
            raise RuntimeError("observer bug")

    llm = LLM(str(tiny_model_dir), kv_cache_memory=SMALL_KV)
    plain = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    llm.engine.observer = Broken(tmp_path / "unused.json")
    traced = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    assert traced.outputs[0].token_ids == plain.outputs[0].token_ids
    assert traced.outputs[0].finish_reason == "length"
    assert llm.engine.observer is None


def test_observer_off_by_default(tiny_model_dir: Path) -> None:
    engine = LLMEngine(str(tiny_model_dir), EngineConfig(kv_cache_memory=SMALL_KV))
    assert engine.observer is None


# --- kvloop serve --trace -----------------------------------------------------------------------
def test_served_batch_shows_overlapping_request_tracks(tiny_model_dir: Path,
                                                       tmp_path: Path) -> None:
    path = tmp_path / "serve-trace.json"
    trace = TraceRecorder(path)
    assert Trace(path).doc["traceEvents"] == []  # a valid (empty) trace from the start
    engine = LLMEngine(str(tiny_model_dir), EngineConfig(kv_cache_memory=SMALL_KV))
    app = create_app(engine, ServerSettings(model_name="tiny"), trace=trace)
    n_tokens = 12
    with BackgroundServer(app) as server:
        async def burst() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as ac:
                return await asyncio.gather(*(
                    ac.post("/v1/completions", json={"prompt": f"{i} {PROMPT}",
                                                     "max_tokens": n_tokens,
                                                     "ignore_eos": True})
                    for i in range(6)))

        responses = asyncio.run(burst())
        assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    # Written by the server's shutdown, once its engine stopped.
    t = Trace(path)
    ids = sorted(r.json()["id"] for r in responses)
    assert sorted(t.requests) == ids
    for rid in ids:
        spans = t.spans(rid)
        assert_sequential(spans)
        assert len(t.spans(rid, "prefill")) == 1
        assert len(t.spans(rid, "decode")) == n_tokens - 1
        assert [e["args"] for e in t.tracks[rid] if e["ph"] == "i"] == [{"reason": "length"}]
    # Overlapping tracks: requests alive at once, and steps that ran several of them.
    lives = sorted(t.life(rid) for rid in ids)
    assert any(a[1] > b[0] for a, b in pairwise(lives))
    shared = [s for s in t.steps if s["args"]["batch_size"] >= 2]
    assert shared
    for step in shared:
        running = [rid for rid in ids if any(e["ts"] == step["ts"] for e in t.spans(rid))]
        assert len(running) == step["args"]["batch_size"]
