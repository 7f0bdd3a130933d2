"""Fuzz the grammar surface of a `kvloop serve` it starts (issue 25): generated deep and
wide Lark grammars, JSON schemas (response_format and guided_json), regexes and tool
parameter schemas, at, past and far past kvloop's limits, for N minutes.

Records crashes (the server process died: it is restarted and the body that killed it
kept) and stalls (a concurrent greedy probe stream going more than --stall-s without a
token), and prints what it tried: per kind, the statuses it got and the slowest answer.
Not a test (it runs for minutes); the same surface is pinned by tests/test_grammar_limits.py.

    python benchmarks/fuzz_hostile.py --minutes 10 [--model PATH] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvloop.engine import grammar_limits as gl

Body = tuple[str, dict[str, Any] | bytes]  # (path, JSON body or its raw text)
CHAT = {"messages": [{"role": "user", "content": "Answer."}], "max_tokens": 4,
        "temperature": 0.0}
COMPLETION = {"prompt": "Answer:", "max_tokens": 4, "temperature": 0.0}
PROBE = {"prompt": "Once upon a time", "max_tokens": 48, "temperature": 0.0,
         "stream": True, "ignore_eos": True}


# --- generators ------------------------------------------------------------------------------
def ladder(rng: random.Random, limit: int) -> int:
    """A size near the interesting places: small, at the limit, just past, far past."""
    return rng.choice([1, 2, limit // 2, limit - 1, limit, limit + 1, 2 * limit, 3000, 10_000])


def lark_chain(rng: random.Random) -> str:
    n = ladder(rng, gl.MAX_LARK_DEPTH)
    rules = "\n".join(f'r{i}: "a" r{i + 1} | "b"' for i in range(n))
    return f'start: r0\n{rules}\nr{n}: "c"\n'


def lark_fan(rng: random.Random) -> str:
    n = min(ladder(rng, gl.MAX_LARK_RULES), 6000)
    return ("start: " + " | ".join(f"w{i}" for i in range(n)) + "\n"
            + "\n".join(f'w{i}: "x{i}" /[0-9]+/' for i in range(n)))


def lark_brackets(rng: random.Random) -> str:
    n = ladder(rng, gl.MAX_LARK_NESTING)
    open_, close = rng.choice([("(", ")"), ("[", "]"), ("(", ")*")])
    return "start: " + open_ * n + '"a"' + close * n


def lark_inline_json(rng: random.Random) -> str:
    return "start: %json " + json.dumps(ref_chain(rng))


def regex_nested(rng: random.Random) -> str:
    n = ladder(rng, gl.MAX_REGEX_NESTING)
    return "(" * n + "a|b" + ")+" * n


def regex_long(rng: random.Random) -> str:
    n = ladder(rng, gl.MAX_REGEX_CHARS) // 5 + 1
    return "[a-z]" * n


def ref_chain(rng: random.Random) -> dict[str, Any]:
    n = ladder(rng, gl.MAX_SCHEMA_DEPTH // 2)
    defs: dict[str, Any] = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "integer"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def nested_schema(rng: random.Random) -> dict[str, Any]:
    node: dict[str, Any] = {"type": "string", "pattern": "(a|b)+"}
    # Up to 3 JSON levels a step, and json.dumps stops near 1,000: deeper is deep_text's.
    for _ in range(min(ladder(rng, gl.MAX_SCHEMA_DEPTH), 300)):
        node = rng.choice([
            lambda s: {"type": "array", "items": s},
            lambda s: {"anyOf": [s, {"type": "integer"}]},
            lambda s: {"type": "object", "properties": {"k": s}, "required": ["k"]},
        ])(node)
    return node


def deep_text(rng: random.Random) -> bytes:
    """A body whose guided_json nests deeper than Python's own encoder can write."""
    n = rng.choice([gl.MAX_SCHEMA_DEPTH, 1000, 3000, 20_000])
    schema = '{"type": "array", "items": ' * n + "{}" + "}" * n
    return (json.dumps(COMPLETION)[:-1] + ', "guided_json": ' + schema + "}").encode()


def wide_schema(rng: random.Random) -> dict[str, Any]:
    n = rng.choice([10, 1000, 5000])
    return {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(n)},
            "required": [f"p{i}" for i in range(0, n, 7)]}


def any_schema(rng: random.Random) -> dict[str, Any]:
    return rng.choice([ref_chain, nested_schema, wide_schema])(rng)


GENERATORS: dict[str, Callable[[random.Random], Body]] = {
    "lark chain": lambda r: ("/v1/completions", {**COMPLETION, "guided_grammar": lark_chain(r)}),
    "lark fan": lambda r: ("/v1/completions", {**COMPLETION, "guided_grammar": lark_fan(r)}),
    "lark brackets": lambda r: ("/v1/completions",
                                {**COMPLETION, "guided_grammar": lark_brackets(r)}),
    "lark %json": lambda r: ("/v1/completions",
                             {**COMPLETION, "guided_grammar": lark_inline_json(r)}),
    "regex nested": lambda r: ("/v1/completions", {**COMPLETION, "guided_regex": regex_nested(r)}),
    "regex long": lambda r: ("/v1/completions", {**COMPLETION, "guided_regex": regex_long(r)}),
    "deep JSON text": lambda r: ("/v1/completions", deep_text(r)),
    "guided_json": lambda r: ("/v1/completions", {**COMPLETION, "guided_json": any_schema(r)}),
    "response_format": lambda r: ("/v1/chat/completions", {**CHAT, "response_format": {
        "type": "json_schema", "json_schema": {"name": "f", "schema": any_schema(r)}}}),
    "tool parameters": lambda r: ("/v1/chat/completions", {**CHAT, "tools": [
        {"type": "function", "function": {"name": "f", "parameters": any_schema(r)}}],
        "tool_choice": r.choice(["auto", "required"])}),
}


# --- the server and the probe ----------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """`kvloop serve` in a process of its own, restarted after a crash."""

    def __init__(self, args: argparse.Namespace, log_dir: Path) -> None:
        self.args, self.log_dir = args, log_dir
        self.starts = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""

    def start(self) -> None:
        self.starts += 1
        port = free_port()
        cmd = [sys.executable, "-m", "kvloop.server.cli", "--port", str(port),
               "--kv-cache-memory", self.args.kv_cache_memory, "--log-level", "warning"]
        if self.args.model:
            cmd += ["--model", self.args.model]
        env = {k: v for k, v in os.environ.items() if k != "KVLOOP_API_KEY"}
        log = (self.log_dir / f"serve-{self.starts}.log").open("w")
        self.proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"the server exited with status {self.proc.returncode}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise SystemExit("the server did not come up in 300 s")

    def dead(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(30)


@dataclass
class Stall:
    gap_s: float
    during: str  # the kind being sent when the probe's gap ended


@dataclass
class Probe:
    """Greedy streams, one after another, timing the gap between tokens."""

    server: Server
    stall_s: float
    current: list[str]  # [the kind being sent now], shared with the main loop
    stalls: list[Stall] = field(default_factory=list)
    streams: int = 0
    worst_gap_s: float = 0.0
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                self._one()
            except httpx.HTTPError:
                time.sleep(0.5)  # a crash or restart: the main loop records it

    def _one(self) -> None:
        with httpx.stream("POST", f"{self.server.url}/v1/completions", json=PROBE,
                          timeout=60) as r:
            last = time.monotonic()
            for line in r.iter_lines():
                if not line.startswith("data:"):
                    continue
                now = time.monotonic()
                gap, last = now - last, now
                self.worst_gap_s = max(self.worst_gap_s, gap)
                if gap > self.stall_s:
                    self.stalls.append(Stall(gap, self.current[0]))
        self.streams += 1


# --- the loop --------------------------------------------------------------------------------
@dataclass
class Tally:
    statuses: Counter[str] = field(default_factory=Counter)
    slowest_s: float = 0.0
    largest_kb: float = 0.0


def fuzz(args: argparse.Namespace, server: Server) -> None:
    rng = random.Random(args.seed)
    tallies: dict[str, Tally] = defaultdict(Tally)
    crashes: list[tuple[str, int, Path]] = []
    current = ["(none)"]
    probe = Probe(server, args.stall_s, current)
    thread = threading.Thread(target=probe.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60 * args.minutes
    client = httpx.Client(timeout=120)
    sent = 0
    while time.monotonic() < deadline:
        kind = rng.choice(sorted(GENERATORS))
        path, body = GENERATORS[kind](rng)
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        current[0] = kind
        t0 = time.monotonic()
        try:
            r = client.post(server.url + path, content=raw,
                            headers={"Content-Type": "application/json"})
            status = str(r.status_code)
        except httpx.HTTPError as e:
            status = type(e).__name__
        tally = tallies[kind]
        tally.statuses[status] += 1
        tally.slowest_s = max(tally.slowest_s, time.monotonic() - t0)
        tally.largest_kb = max(tally.largest_kb, len(raw) / 1024)
        sent += 1
        code = server.dead()
        if code is not None:
            kept = server.log_dir / f"crash-{len(crashes)}.json"
            kept.write_bytes(raw)
            crashes.append((kind, code, kept))
            print(f"CRASH: {kind} killed the server (exit {code}); body kept in {kept}",
                  flush=True)
            server.start()
    probe.stop.set()
    thread.join(70)
    client.close()
    print(summary(args, tallies, crashes, probe, sent))


def summary(args: argparse.Namespace, tallies: dict[str, Tally],
            crashes: list[tuple[str, int, Path]], probe: Probe, sent: int) -> str:
    lines = [f"fuzz_hostile: {sent} requests in {args.minutes:g} min (seed {args.seed})",
             f"{'kind':<18}{'sent':>6}  {'statuses':<28}{'slowest s':>10}{'largest KiB':>13}"]
    for kind in sorted(tallies):
        t = tallies[kind]
        statuses = " ".join(f"{s}x{n}" for s, n in sorted(t.statuses.items()))
        lines.append(f"{kind:<18}{sum(t.statuses.values()):>6}  {statuses:<28}"
                     f"{t.slowest_s:>10.2f}{t.largest_kb:>13.1f}")
    lines.append(f"crashes: {len(crashes)}" + "".join(
        f"\n  {kind}: exit {code}, body {path}" for kind, code, path in crashes))
    lines.append(f"probe: {probe.streams} streams, worst gap {probe.worst_gap_s:.2f} s, "
                 f"{len(probe.stalls)} stalls over {args.stall_s:g} s" + "".join(
                     f"\n  {s.gap_s:.2f} s during {s.during}" for s in probe.stalls[:20]))
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--model", default=None, help="model path (default: the default model)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stall-s", type=float, default=1.0,
                   help="a probe gap longer than this is a stall")
    p.add_argument("--kv-cache-memory", default="128MiB")
    args = p.parse_args()
    log_dir = Path(tempfile.mkdtemp(prefix="kvloop-fuzz-"))
    server = Server(args, log_dir)
    server.start()
    try:
        fuzz(args, server)
    finally:
        server.stop()
    print(f"server logs: {log_dir}")


if __name__ == "__main__":
    main()
