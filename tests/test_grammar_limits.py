"""Issue 25, item 1: no grammar reaches a native crash.

A 3,000-deep chain of Lark rules or JSON-schema `$ref`s overflowed llguidance's compiler
stack and segfaulted the server. Pinned here:

- each limit of kvloop.engine.grammar_limits at its value (accepted, compiles) and one
  past it (refused, the message naming the limit);
- the compile thread's stack holds chains far past the limits, where the main thread's
  8 MiB does not (both in subprocesses: a crash must not take pytest with it);
- seeded generators of deep and wide schemas, Lark grammars, regexes and tool schemas,
  run in a subprocess, never crash it;
- the three crash bodies of the issue against a real `kvloop serve` (default model): a
  400 naming the field and the limit, then the same greedy probe text as before and
  nothing running or holding KV blocks.
"""

from __future__ import annotations

import ast
import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from conftest import wait_until_idle
from kvloop.engine import grammar_limits as gl
from kvloop.engine.structured import grammar_text, schema_error
from kvloop.errors import InvalidParamsError
from kvloop.params import StructuredOutput

# --- the issue's shapes ----------------------------------------------------------------------


def lark_chain(n: int) -> str:
    """`start` and rules r0..r{n}, each naming the next: a chain of n + 2 rules."""
    rules = "\n".join(f'r{i}: "a" r{i + 1} | "b"' for i in range(n))
    return f'start: r0\n{rules}\nr{n}: "c"\n'


def ref_chain(n: int) -> dict[str, Any]:
    """`$defs` d0..d{n}, each a `$ref` to the next: a schema 2n + 2 deep."""
    defs: dict[str, Any] = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "integer"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def nested_arrays(n: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(n):
        schema = {"type": "array", "items": schema}
    return schema


# Depths exactly at the limits: lark_chain(n) is n + 2 rules long; ref_chain(n) is 2n + 2 deep.
LARK_AT_LIMIT = gl.MAX_LARK_DEPTH - 2
REFS_AT_LIMIT = (gl.MAX_SCHEMA_DEPTH - 2) // 2


def refused(so: StructuredOutput) -> str:
    with pytest.raises(InvalidParamsError) as e:
        grammar_text(so)
    assert e.value.param == "structured"
    return str(e.value)


def compiles(so: StructuredOutput) -> None:
    """Accepted by the limits and by llguidance's own validation (no tokenizer needed)."""
    is_error, messages = gl.on_compile_thread(_validate, grammar_text(so))
    assert not is_error, messages


def _validate(text: str) -> tuple[bool, list[str]]:
    import llguidance as llg

    return llg.LLMatcher.validate_grammar_with_warnings(text, limits=gl.parser_limits())


# --- each limit at its value and one past it -------------------------------------------------
def test_lark_rule_chain_at_and_past_the_limit() -> None:
    compiles(StructuredOutput(grammar=lark_chain(LARK_AT_LIMIT)))
    msg = refused(StructuredOutput(grammar=lark_chain(LARK_AT_LIMIT + 1)))
    assert f"rule chain depth is more than {gl.MAX_LARK_DEPTH}" in msg


def test_lark_rule_count_at_and_past_the_limit() -> None:
    # Wide, not deep: start picks one of many rules.
    def wide(n: int) -> str:
        return ("start: " + " | ".join(f"w{i}" for i in range(n - 1)) + "\n"
                + "\n".join(f'w{i}: "x{i}"' for i in range(n - 1)))

    compiles(StructuredOutput(grammar=wide(gl.MAX_LARK_RULES)))
    msg = refused(StructuredOutput(grammar=wide(gl.MAX_LARK_RULES + 1)))
    assert f"rule count is {gl.MAX_LARK_RULES + 1}, over the limit of {gl.MAX_LARK_RULES}" in msg


def test_lark_bracket_nesting_at_and_past_the_limit() -> None:
    def nested(n: int) -> str:
        return "start: " + "(" * n + '"a"' + ")" * n

    compiles(StructuredOutput(grammar=nested(gl.MAX_LARK_NESTING)))
    msg = refused(StructuredOutput(grammar=nested(gl.MAX_LARK_NESTING + 1)))
    assert f"bracket nesting is more than {gl.MAX_LARK_NESTING}" in msg


def test_lark_recursion_is_not_depth() -> None:
    """A rule that names itself (or an earlier rule) is recursion, not a deeper chain."""
    compiles(StructuredOutput(grammar='start: list\nlist: "[" (item ("," item)*)? "]"\n'
                                      'item: /[0-9]+/ | list\n'))


def test_regex_at_and_past_the_limits() -> None:
    compiles(StructuredOutput(regex="a" * gl.MAX_REGEX_CHARS))
    assert "regex length is" in refused(StructuredOutput(regex="a" * (gl.MAX_REGEX_CHARS + 1)))
    n = gl.MAX_REGEX_NESTING
    compiles(StructuredOutput(regex="(" * n + "a" + ")" * n))
    msg = refused(StructuredOutput(regex="(" * (n + 1) + "a" + ")" * (n + 1)))
    assert f"regex group nesting is {n + 1}, over the limit of {n}" in msg
    # Escaped and in-class parentheses are not groups.
    compiles(StructuredOutput(regex=r"\(" * (n + 1) + "[(]" * (n + 1)))


def test_regexes_inside_lark_and_schemas_are_bounded() -> None:
    long = "a" * (gl.MAX_REGEX_CHARS + 1)
    assert "regex length" in refused(StructuredOutput(grammar=f"start: /{long}/"))
    msg = refused(StructuredOutput(json_schema={"type": "string", "pattern": long}))
    assert "pattern: regex length" in msg
    msg = refused(StructuredOutput(json_schema={"type": "object",
                                                "patternProperties": {long: {}}}))
    assert "patternProperties: regex length" in msg


def test_schema_depth_at_and_past_the_limit() -> None:
    compiles(StructuredOutput(json_schema=ref_chain(REFS_AT_LIMIT)))
    msg = refused(StructuredOutput(json_schema=ref_chain(REFS_AT_LIMIT + 1)))
    assert f"depth (nesting and $ref chains) is more than {gl.MAX_SCHEMA_DEPTH}" in msg
    # Plain nesting, no $ref: nested_arrays(n) is n + 1 objects deep.
    compiles(StructuredOutput(json_schema=nested_arrays(gl.MAX_SCHEMA_DEPTH - 1)))
    refused(StructuredOutput(json_schema=nested_arrays(gl.MAX_SCHEMA_DEPTH)))


def test_schema_text_nested_past_pythons_parser_is_refused() -> None:
    text = '{"items": ' * 5000 + "{}" + "}" * 5000
    assert "over the limit" in refused(StructuredOutput(json_schema=text))


def test_recursive_schema_is_not_depth() -> None:
    tree = {"$defs": {"node": {"type": "object", "properties": {
        "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}},
        "$ref": "#/$defs/node"}
    compiles(StructuredOutput(json_schema=tree))


def test_inline_json_in_lark_is_bounded() -> None:
    deep = json.dumps(ref_chain(3000))
    assert "%json schema depth" in refused(StructuredOutput(grammar=f"start: %json {deep}"))


def test_tool_schema_error_names_the_limit() -> None:
    detail = schema_error(ref_chain(3000))
    assert detail is not None and f"over the limit of {gl.MAX_SCHEMA_DEPTH}" in detail
    assert schema_error(ref_chain(REFS_AT_LIMIT)) is None


# --- the compile thread's stack, in subprocesses ---------------------------------------------
def run_python(code: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "PYTHONPATH": SRC})


SRC = str(Path(__file__).resolve().parents[1] / "src")
CHAINS = f"""
    import sys, llguidance as llg
    sys.path.insert(0, {str(Path(__file__).parent)!r})
    from test_grammar_limits import lark_chain, ref_chain
    from kvloop.engine import grammar_limits as gl

    def validate(text):
        return llg.LLMatcher.validate_grammar_with_warnings(text, limits=gl.parser_limits())
"""


def test_the_compile_thread_holds_chains_far_past_the_limits() -> None:
    """The limits' own checks bypassed: chains 20x the limits compile on the worker's
    stack (the process lives), where 3,000 crashed the main thread."""
    depth = 20 * max(gl.MAX_LARK_DEPTH, gl.MAX_SCHEMA_DEPTH)
    r = run_python(CHAINS + f"""
    lark = llg.LLMatcher.grammar_from_lark(lark_chain({depth}))
    refs = llg.LLMatcher.grammar_from_json_schema(ref_chain({depth}))
    print(gl.on_compile_thread(validate, lark)[0], gl.on_compile_thread(validate, refs)[0])
    """)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    assert r.stdout.split() == ["False", "False"]


def test_the_same_chain_crashes_the_main_thread() -> None:
    """The control: without the worker the issue's chain still kills the process, so the
    test above is measuring the stack, not a library that stopped recursing."""
    r = run_python(CHAINS + """
    validate(llg.LLMatcher.grammar_from_lark(lark_chain(3000)))
    """)
    assert r.returncode < 0, (r.returncode, r.stderr[-2000:])


# --- seeded generators of deep and wide inputs, in a subprocess ------------------------------
FUZZ = f"""
    import random, sys
    sys.path.insert(0, {str(Path(__file__).parent)!r})
    from test_grammar_limits import generated
    from kvloop.engine import grammar_limits as gl
    from kvloop.engine.structured import grammar_text, schema_error
    from kvloop.errors import InvalidParamsError
    import llguidance as llg

    def validate(text):
        return llg.LLMatcher.validate_grammar_with_warnings(text, limits=gl.parser_limits())

    counts = {{"refused": 0, "compiled": 0, "invalid": 0}}
    for kind, so in generated(random.Random(25), 300):
        if kind == "tool":
            counts["refused" if schema_error(so.json_schema) else "compiled"] += 1
            continue
        try:
            text = grammar_text(so)
        except InvalidParamsError:
            counts["refused"] += 1
            continue
        except ValueError:
            counts["invalid"] += 1
            continue
        counts["invalid" if gl.on_compile_thread(validate, text)[0] else "compiled"] += 1
    print(counts)
"""


def generated(rng: Any, n: int) -> Iterator[tuple[str, StructuredOutput]]:
    """n constraints of random shape, about half past some limit: deep and wide schemas
    (nesting, $ref chains, anyOf fans, patterns), Lark rule chains and fans with nested
    brackets and regex tokens, nested regexes; `tool` ones go through schema_error."""
    makers = [_gen_schema, _gen_lark, _gen_regex]
    for i in range(n):
        maker = makers[i % len(makers)]
        so = maker(rng)
        yield ("tool" if maker is _gen_schema and rng.random() < 0.3 else "so"), so


def _depth(rng: Any, limit: int) -> int:
    return rng.choice([1, limit // 4, limit - 2, limit, limit + 1, 2 * limit, 3000])


def _gen_schema(rng: Any) -> StructuredOutput:
    n = _depth(rng, gl.MAX_SCHEMA_DEPTH // 2)
    if rng.random() < 0.5:
        return StructuredOutput(json_schema=ref_chain(n))
    node: dict[str, Any] = {"type": "string", "pattern": "(a|b)" * rng.randint(1, 50)}
    for _ in range(min(n, 900)):  # Python's json.dumps stops near 1,000 levels
        shape = rng.randrange(3)
        if shape == 0:
            node = {"type": "array", "items": node}
        elif shape == 1:
            node = {"anyOf": [node] + [{"type": "integer"}] * rng.randint(0, 3)}
        else:
            node = {"type": "object", "properties": {"k": node}, "required": ["k"]}
    return StructuredOutput(json_schema=node)


def _gen_lark(rng: Any) -> StructuredOutput:
    n = _depth(rng, gl.MAX_LARK_DEPTH)
    if rng.random() < 0.5:
        return StructuredOutput(grammar=lark_chain(n))
    width = rng.choice([1, 10, gl.MAX_LARK_RULES - 1, gl.MAX_LARK_RULES + 5])
    nest = _depth(rng, gl.MAX_LARK_NESTING)
    body = "(" * nest + '"x" /[0-9]+/' + ")*" * nest
    rules = "\n".join(f"w{i}: {body}" for i in range(width))
    return StructuredOutput(grammar="start: " + " | ".join(f"w{i}" for i in range(width))
                            + "\n" + rules)


def _gen_regex(rng: Any) -> StructuredOutput:
    nest = _depth(rng, gl.MAX_REGEX_NESTING)
    width = rng.choice([1, 100, gl.MAX_REGEX_CHARS // 4])
    return StructuredOutput(regex="(" * nest + "[a-z]|b" * width + ")+" * nest)


def test_generated_grammars_never_crash() -> None:
    r = run_python(FUZZ, timeout=600)
    assert r.returncode == 0, (r.returncode, r.stderr[-3000:])
    counts = ast.literal_eval(r.stdout.strip().splitlines()[-1])  # the child's outcomes
    assert counts["refused"] > 0 and counts["compiled"] > 0, counts


# --- the issue's bodies against a real server ------------------------------------------------
PROBE = {"prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0.0}


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    client: httpx.Client
    log: Path

    def probe(self) -> str:
        r = self.client.post("/v1/completions", json=PROBE)
        assert r.status_code == 200, r.text
        return str(r.json()["choices"][0]["text"])

    def assert_whole(self, probe_text: str) -> None:
        """Alive, nothing running, waiting or holding a KV block, the probe unchanged."""
        assert self.proc.poll() is None, self.log.read_text(errors="replace")[-3000:]
        wait_until_idle(lambda: self.client.get("/metrics").text)
        assert self.probe() == probe_text


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def server(default_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """`kvloop serve` in its own process: a native crash shows as its death, not ours."""
    port = _free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvloop.server.cli", "--model", str(default_gguf),
             "--port", str(port), "--kv-cache-memory", "64MiB"], stdout=out,
            stderr=subprocess.STDOUT, env={**os.environ, "KVLOOP_API_KEY": "",
                                           "PYTHONPATH": SRC})
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120)
    try:
        deadline = time.monotonic() + 600  # imports alone took 2 min on a loaded machine
        while True:
            assert proc.poll() is None, log.read_text(errors="replace")
            try:
                if client.get("/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.2)
        yield Server(proc, client, log)
    finally:
        client.close()
        proc.kill()
        proc.wait(30)


CHAT = {"messages": [{"role": "user", "content": "A number?"}], "max_tokens": 8,
        "temperature": 0.0}
ATTACKS = [
    ("completions guided_grammar", "/v1/completions",
     {**PROBE, "guided_grammar": lark_chain(3000)}, "guided_grammar",
     f"over the limit of {gl.MAX_LARK_RULES}"),
    ("chat response_format", "/v1/chat/completions",
     {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
         "name": "deep", "schema": ref_chain(3000)}}}, "response_format",
     f"over the limit of {gl.MAX_SCHEMA_DEPTH}"),
    ("chat tool parameters", "/v1/chat/completions",
     {**CHAT, "tools": [{"type": "function", "function": {
         "name": "deep", "parameters": ref_chain(3000)}}]}, "tools[0].function.parameters",
     f"over the limit of {gl.MAX_SCHEMA_DEPTH}"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("path", "body", "param", "limit"), [a[1:] for a in ATTACKS],
                         ids=[a[0] for a in ATTACKS])
def test_the_issues_bodies_get_a_400_naming_the_limit(
        server: Server, path: str, body: dict[str, Any], param: str, limit: str) -> None:
    before = server.probe()
    raw = json.dumps(body).encode()
    assert 60_000 < len(raw) < 200_000  # the issue's scale (~80-110 KB)
    r = server.client.post(path, content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["param"] == param and limit in err["message"], err
    server.assert_whole(before)


@pytest.mark.slow
def test_the_server_serves_at_the_limit_and_refuses_past_it(server: Server) -> None:
    before = server.probe()
    for so, past in ((lark_chain(LARK_AT_LIMIT), lark_chain(LARK_AT_LIMIT + 1)),):
        r = server.client.post("/v1/completions", json={**PROBE, "guided_grammar": so})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"].startswith(("a", "b", "c"))
        r = server.client.post("/v1/completions", json={**PROBE, "guided_grammar": past})
        assert r.status_code == 400 and "rule chain depth" in r.text, r.text
    for schema, past in ((ref_chain(REFS_AT_LIMIT), ref_chain(REFS_AT_LIMIT + 1)),):
        fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}
        r = server.client.post("/v1/chat/completions", json={**CHAT, "response_format": fmt})
        assert r.status_code == 200, r.text
        fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": past}}
        r = server.client.post("/v1/chat/completions", json={**CHAT, "response_format": fmt})
        assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"
    server.assert_whole(before)


@pytest.mark.slow
def test_cli_refuses_the_chain_in_one_line(default_gguf: Path, tmp_path: Path) -> None:
    grammar = tmp_path / "deep.lark"
    grammar.write_text(lark_chain(3000))
    r = subprocess.run([sys.executable, "-m", "kvloop.cli", "generate", "--model",
                        str(default_gguf), "--grammar", str(grammar), "Hi"],
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": SRC})
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvloop: error: "), r.stderr
    assert f"over the limit of {gl.MAX_LARK_RULES}" in lines[0]
