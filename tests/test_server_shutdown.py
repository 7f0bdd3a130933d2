"""Graceful shutdown of the real `kvloop serve` process under streaming load.

SIGTERM must stop admissions (503 + Retry-After), let running requests finish within the
grace period, end the rest with an explicit error (a JSON body, or an SSE error event and
`[DONE]`), and exit 0 with no traceback in the log. Tiny random model: quick.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

NUM_STREAMS = 32
NUM_PLAIN = 4


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    log: Path

    def text(self) -> str:
        return self.log.read_text(errors="replace")


@contextmanager
def kvloop_serve(model: Path, tmp: Path, *flags: str) -> Iterator[Server]:
    """`python -m kvloop.server.cli` on a free loopback port, its log in a file (a pipe
    could fill and stall it)."""
    port = free_port()
    log = tmp / f"serve-{port}.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvloop.server.cli", "--model", str(model),
             "--port", str(port), "--kv-cache-memory", "32MiB", *flags],
            stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "KVLOOP_API_KEY": ""})
    server = Server(proc, f"http://127.0.0.1:{port}", log)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, server.text()
            try:
                if httpx.get(f"{server.url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.1)
        yield server
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


@dataclass
class Outcome:
    status: int = 0
    finish: dict[int, str] = field(default_factory=dict)
    error: dict[str, Any] | None = None
    done: bool = False  # [DONE] seen
    cut: str | None = None  # how the connection failed, if it did


async def stream_one(client: httpx.AsyncClient, body: dict, started: asyncio.Event,
                     count: list[int]) -> Outcome:
    out = Outcome()
    try:
        async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            out.status = r.status_code
            if r.status_code != 200:
                out.error = json.loads(await r.aread())
                return out
            first = True
            async for line in r.aiter_lines():
                if not line:
                    continue
                assert line.startswith("data: "), line
                assert not out.done, "data after [DONE]"
                if line == "data: [DONE]":
                    out.done = True
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    out.error = data
                    continue
                for c in data["choices"]:
                    if c["finish_reason"]:
                        out.finish[c["index"]] = c["finish_reason"]
                if first:
                    first = False
                    count[0] += 1
                    if count[0] == NUM_STREAMS:
                        started.set()
    except httpx.HTTPError as e:
        out.cut = repr(e)
    return out


async def plain_one(client: httpx.AsyncClient, body: dict) -> Outcome:
    out = Outcome()
    try:
        r = await client.post("/v1/completions", json=body)
    except httpx.HTTPError as e:
        out.cut = repr(e)
        return out
    out.status = r.status_code
    data = r.json()  # always JSON, never a plain-text 500
    if r.status_code == 200:
        out.finish = {c["index"]: c["finish_reason"] for c in data["choices"]}
    else:
        out.error = data
    return out


def run_load(server: Server, body: dict, late: bool = True
             ) -> tuple[list[Outcome], list[Outcome], httpx.Response | None]:
    """32 streams and a few plain requests; SIGTERM once every stream has its first chunk;
    then (if `late`) one new request while the server drains, which must be refused."""
    async def main() -> tuple[list[Outcome], list[Outcome], httpx.Response | None]:
        started = asyncio.Event()
        count = [0]
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=server.url, timeout=60, limits=limits) as client:
            streams = [asyncio.create_task(stream_one(client, {**body, "seed": i}, started,
                                                      count)) for i in range(NUM_STREAMS)]
            plains = [asyncio.create_task(plain_one(client, {**body, "seed": 100 + i}))
                      for i in range(NUM_PLAIN)]
            await asyncio.wait_for(started.wait(), 60)
            server.proc.send_signal(signal.SIGTERM)
            refused = None
            if late:
                await asyncio.sleep(0.3)
                async with httpx.AsyncClient(base_url=server.url, timeout=10) as fresh:
                    refused = await fresh.post("/v1/completions", json=body)
                    health = await fresh.get("/health")  # load balancers: stop routing here
                    assert health.status_code == 503, health.text
                    assert health.json()["error"]["code"] == "shutting_down"
            return (list(await asyncio.gather(*streams)), list(await asyncio.gather(*plains)),
                    refused)

    return asyncio.run(main())


def check_exit(server: Server) -> str:
    assert server.proc.wait(60) == 0, server.text()
    log = server.text()
    assert "Traceback" not in log, log
    return log


def assert_refused_late(late: httpx.Response | None) -> None:
    assert late is not None
    assert late.status_code == 503, late.text
    assert late.headers["retry-after"].isdigit()
    assert late.json()["error"]["code"] == "shutting_down"


def test_sigterm_short_grace_ends_every_request_explicitly(tiny_model_dir: Path,
                                                           tmp_path: Path) -> None:
    # Long answers and a 1 s grace: every request is still running when the grace ends.
    body = {"prompt": "The quick brown fox", "max_tokens": 1500, "ignore_eos": True,
            "temperature": 1.0}
    with kvloop_serve(tiny_model_dir, tmp_path, "--shutdown-grace", "1") as server:
        streams, plains, late = run_load(server, body)
        log = check_exit(server)
    assert_refused_late(late)
    for out in streams:
        assert out.cut is None and out.status == 200, out
        assert out.done, out  # never a silently cut stream
        assert out.error is not None and out.error["error"]["code"] == "shutting_down", out
    for out in plains:
        assert out.cut is None, out
        assert out.status == 503 and out.error is not None, out
        assert out.error["error"]["code"] == "shutting_down"
    assert "ending" in log and "still running" in log


def test_sigterm_long_grace_lets_everything_finish(tiny_model_dir: Path,
                                                   tmp_path: Path) -> None:
    body = {"prompt": "The quick brown fox", "max_tokens": 48, "ignore_eos": True,
            "temperature": 1.0}
    with kvloop_serve(tiny_model_dir, tmp_path, "--shutdown-grace", "60") as server:
        # No late request: the drain may well be over (and the port closed) before it.
        streams, plains, _ = run_load(server, body, late=False)
        check_exit(server)
    for out in streams + plains:
        assert out.cut is None and out.status == 200 and out.error is None, out
        assert out.finish == {0: "length"}, out
    assert all(out.done for out in streams)


def test_sigint_idle_server_exits_0_at_once(tiny_model_dir: Path, tmp_path: Path) -> None:
    with kvloop_serve(tiny_model_dir, tmp_path) as server:
        t0 = time.monotonic()
        server.proc.send_signal(signal.SIGINT)
        check_exit(server)
    assert time.monotonic() - t0 < 15
