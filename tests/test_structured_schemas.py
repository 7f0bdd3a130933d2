"""Issue 13's structured-output acceptance on the default model, over the constraints of
tests/structured_schemas.py (JSON schemas, regexes, choices, a Lark grammar):

- each constraint alone, greedy and sampled (seeded): the output is checked by an
  independent oracle (json.loads + jsonschema with format checking, re.fullmatch, the choice
  list, a hand-written recogniser of the Lark grammar) and ends with "stop";
- all of them in one batch of 32 with unconstrained requests: the constrained outputs are
  checked the same way, and the unconstrained ones keep the exact tokens they get in a batch
  without constrained neighbours;
- bad constraints are refused before anything is queued, through the Python API, the CLI
  and the server (tiny model: the refusal does not depend on the weights).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest

from kvloop import LLM, SamplingParams
from kvloop.errors import InvalidParamsError
from kvloop.params import StructuredOutput
from structured_schemas import CHOICES, LARK, LARK_PROMPT, RECURSIVE, REGEXES, SCHEMAS

MAX_TOKENS = 200

# --- oracles -------------------------------------------------------------------------------------
_RFC3339_DATE = r"(\d{4})-(\d{2})-(\d{2})"
_RFC3339_TIME = r"(\d{2}):(\d{2}):(\d{2})(\.\d+)?([Zz]|[+-](\d{2}):(\d{2}))"


def _valid_date(y: str, m: str, d: str) -> bool:
    # RFC 3339 full-date: any 4-digit year (0000 too, which datetime refuses).
    year, month, day = int(y), int(m), int(d)
    leap = year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)
    days = [31, 29 if leap else 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31]
    return 1 <= month <= 12 and 1 <= day <= days[month - 1]


def _is_date(s: object) -> bool:
    m = re.fullmatch(_RFC3339_DATE, s) if isinstance(s, str) else None
    return not isinstance(s, str) or bool(m and _valid_date(*m.groups()))


def _is_date_time(s: object) -> bool:
    if not isinstance(s, str):
        return True
    m = re.fullmatch(f"{_RFC3339_DATE}[Tt]{_RFC3339_TIME}", s)
    if not m:
        return False
    _y, _mo, _d, hh, mm, ss, _frac, _z, oh, om = m.groups()
    return (_valid_date(_y, _mo, _d) and int(hh) <= 23 and int(mm) <= 59 and int(ss) <= 60
            and (oh is None or (int(oh) <= 23 and int(om) <= 59)))


def format_checker() -> jsonschema.FormatChecker:
    """jsonschema's checkers for email and uuid, and RFC 3339 date and date-time here
    (jsonschema checks date-time only with an optional package, and its date checker
    refuses year 0000, which RFC 3339 allows)."""
    checker = jsonschema.FormatChecker(["email", "uuid"])
    checker.checks("date")(_is_date)
    checker.checks("date-time")(_is_date_time)
    return checker


FORMATS = format_checker()


class _LarkRecogniser:
    """A recursive-descent recogniser of LARK: expr := term (OP term){0,3};
    term := NUMBER | "(" expr ")"; OP one of " + ", " - ", " * "; NUMBER 1-3 digits."""

    def __init__(self, text: str) -> None:
        self.text, self.pos = text, 0

    def accepts(self) -> bool:
        return self._expr() and self.pos == len(self.text)

    def _expr(self) -> bool:
        if not self._term():
            return False
        for _ in range(3):
            op = self.text[self.pos:self.pos + 3]
            if op not in (" + ", " - ", " * "):
                break
            self.pos += 3
            if not self._term():
                return False
        return True

    def _term(self) -> bool:
        if self.text.startswith("(", self.pos):
            self.pos += 1
            if not self._expr() or not self.text.startswith(")", self.pos):
                return False
            self.pos += 1
            return True
        m = re.compile(r"[0-9]{1,3}").match(self.text, self.pos)
        if not m:
            return False
        self.pos = m.end()
        return True


def test_lark_recogniser_is_right() -> None:
    """The oracle for the Lark grammar, on hand-picked texts."""
    for good in ("7", "1 + 2", "(1 - 2) * 30", "((5))", "1 + 2 + 3 + 4", "(1 + 2 + 3 + 4) * 9"):
        assert _LarkRecogniser(good).accepts(), good
    for bad in ("", "1+2", "1 + ", "(1", "1 + 2 + 3 + 4 + 5", "1234", "a", "1 / 2", "()"):
        assert not _LarkRecogniser(bad).accepts(), bad


def _schema_check(schema: dict) -> Callable[[str], None]:
    jsonschema.Draft202012Validator.check_schema(schema)

    def check(text: str) -> None:
        jsonschema.validate(json.loads(text), schema, format_checker=FORMATS)
    return check


def _regex_check(regex: str) -> Callable[[str], None]:
    def check(text: str) -> None:
        assert re.fullmatch(regex, text), f"{text!r} does not match {regex!r}"
    return check


def _choice_check(choices: list[str]) -> Callable[[str], None]:
    def check(text: str) -> None:
        assert text in choices, f"{text!r} not in {choices}"
    return check


def _lark_check(text: str) -> None:
    assert _LarkRecogniser(text).accepts(), f"{text!r} is not in the grammar"


# (name, constraint, prompt, check(output text) raising on a wrong output)
Case = tuple[str, StructuredOutput, str, Callable[[str], None]]
CASES: list[Case] = (
    [(f"json-{n}", StructuredOutput(json_schema=s), p, _schema_check(s)) for n, s, p in SCHEMAS]
    + [(f"regex-{n}", StructuredOutput(regex=r), p, _regex_check(r)) for n, r, p in REGEXES]
    + [(f"choice-{n}", StructuredOutput(choice=c), p, _choice_check(c)) for n, c, p in CHOICES]
    + [("lark-arithmetic", StructuredOutput(grammar=LARK), LARK_PROMPT, _lark_check)]
)
FREE_PROMPTS = ["Name three fruits.", "Write a haiku about the sea.", "What is 12 times 7?"]
BATCH = 32
assert len(CASES) + len(FREE_PROMPTS) == BATCH, "one batch of 32: every constraint + free ones"


def chat_ids(llm: LLM, text: str) -> list[int]:
    return llm.tokenizer.encode_chat([{"role": "user", "content": text}])


def constrained_params(i: int, so: StructuredOutput, temperature: float) -> SamplingParams:
    # Seeds differ per case (and are irrelevant at temperature 0).
    return SamplingParams(temperature=temperature, seed=1000 + i, max_tokens=MAX_TOKENS,
                          structured=so)


def check_output(case: Case, comp: Any) -> None:
    name, _so, _prompt, check = case
    assert comp.finish_reason == "stop", (name, comp.finish_reason, comp.text)
    check(comp.text)


def test_data_module_shape() -> None:
    """The data the tests (and the benchmarks) rely on: >= 22 schemas, valid as JSON
    schemas, unique names; every free string and array bounded."""
    assert len(SCHEMAS) >= 22 and len({n for n, _, _ in SCHEMAS}) == len(SCHEMAS)

    def walk(node: Any) -> Iterator[dict]:
        if isinstance(node, dict):
            yield node
            for v in node.values():
                yield from walk(v)
        elif isinstance(node, list):
            for v in node:
                yield from walk(v)

    for name, schema, prompt in SCHEMAS:
        assert prompt and isinstance(schema, dict)
        jsonschema.Draft202012Validator.check_schema(schema)
        for sub in walk(schema):
            types = sub.get("type")
            types = types if isinstance(types, list) else [types]
            if "string" in types and "format" not in sub and "pattern" not in sub:
                assert "maxLength" in sub, (name, sub)
            if "array" in types:
                assert "maxItems" in sub, (name, sub)


# --- each constraint alone -----------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
@pytest.mark.parametrize("index", range(len(CASES)), ids=[c[0] for c in CASES])
def test_constraint_alone(kv_default: LLM, index: int, temperature: float) -> None:
    """One constrained request alone: its output passes the oracle and ends with "stop"."""
    case = CASES[index]
    out = kv_default.generate(chat_ids(kv_default, case[2]),
                              constrained_params(index, case[1], temperature))
    check_output(case, out[0].outputs[0])


@pytest.mark.slow
def test_recursive_schema_greedy(kv_default: LLM) -> None:
    """A schema that refers to itself compiles, and the greedy output validates and ends
    (greedy only: see RECURSIVE in structured_schemas.py)."""
    name, schema, prompt = RECURSIVE
    out = kv_default.generate(chat_ids(kv_default, prompt), SamplingParams(
        temperature=0, max_tokens=MAX_TOKENS, structured=StructuredOutput(json_schema=schema)))
    check_output((name, StructuredOutput(json_schema=schema), prompt, _schema_check(schema)),
                 out[0].outputs[0])


# --- one batch of 32 -----------------------------------------------------------------------------
_batches: dict[float, tuple[list[Any], list[Any]]] = {}


def batch_outputs(llm: LLM, temperature: float) -> tuple[list[Any], list[Any]]:
    """(the 32-request batch's outputs, the free requests' outputs run without their
    constrained neighbours), run once per temperature for the tests that read them."""
    if temperature not in _batches:
        free = [(chat_ids(llm, p), SamplingParams(temperature=temperature, seed=7 + j,
                                                  max_tokens=48))
                for j, p in enumerate(FREE_PROMPTS)]
        constrained = [(chat_ids(llm, prompt), constrained_params(i, so, temperature))
                       for i, (_n, so, prompt, _c) in enumerate(CASES)]
        # The free requests first, in the middle and last, the constraints around them.
        mixed = [free[0], *constrained[:15], free[1], *constrained[15:], free[2]]
        outs = llm.generate([p for p, _ in mixed], [s for _, s in mixed])
        alone = llm.generate([p for p, _ in free], [s for _, s in free])
        _batches[temperature] = (outs, alone)
    return _batches[temperature]


FREE_AT = (0, 16, 31)  # where the free requests sit in the batch


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_batch_constrained_outputs_pass(kv_default: LLM, temperature: float) -> None:
    """In one batch of 32, every constrained output passes its oracle and ends with "stop"."""
    outs, _ = batch_outputs(kv_default, temperature)
    assert len(outs) == BATCH
    constrained = [o for i, o in enumerate(outs) if i not in FREE_AT]
    failures = []
    for case, out in zip(CASES, constrained, strict=True):
        try:
            check_output(case, out.outputs[0])
        except (AssertionError, ValueError, jsonschema.ValidationError) as e:
            failures.append(f"{case[0]}: {str(e).splitlines()[0]}")
    assert not failures, failures


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_batch_unconstrained_tokens_unchanged(kv_default: LLM, temperature: float) -> None:
    """The unconstrained requests of the batch get exactly the tokens they get in a batch
    of their own (same seeds): the constrained neighbours' masks do not leak into them."""
    outs, alone = batch_outputs(kv_default, temperature)
    for pos, ref in zip(FREE_AT, alone, strict=True):
        got = outs[pos].outputs[0]
        assert got.token_ids == ref.outputs[0].token_ids
        assert len(got.token_ids) > 8  # long enough to overlap many constrained steps


# --- bad constraints are refused before anything is queued --------------------------------------
# (id, constraint, words the error must contain, xfail reason or None)
BAD: list[tuple[str, StructuredOutput, str, str | None]] = [
    ("schema-not-json", StructuredOutput(json_schema='{"type": "object",'), "not valid JSON",
     None),
    ("schema-invalid-type", StructuredOutput(json_schema={"type": "frob"}), "frob", None),
    ("schema-unsupported-keyword", StructuredOutput(json_schema={
        "type": "array", "items": {"type": "integer"}, "uniqueItems": True}),
     "uniqueItems", None),
    ("schema-unsupported-format", StructuredOutput(json_schema={
        "type": "string", "format": "frob"}), "format", None),
    ("schema-missing-ref", StructuredOutput(json_schema={"$ref": "#/$defs/nope"}), "nope", None),
    ("schema-empty-enum", StructuredOutput(json_schema={"enum": []}), "Unsatisfiable", None),
    ("schema-min-above-max", StructuredOutput(json_schema={
        "type": "integer", "minimum": 5, "maximum": 3}), "Unsatisfiable", None),
    # The parse error's detail is on llguidance's later lines: it must not be cut off.
    ("schema-bad-pattern", StructuredOutput(json_schema={"type": "string", "pattern": "("}),
     "unclosed group", None),
    ("regex-does-not-compile", StructuredOutput(regex="a{3,1}"), "invalid regex", None),
    ("regex-unclosed-group", StructuredOutput(regex="("), "unclosed group", None),
    # Compile fine but match nothing: an empty output or a runaway request otherwise.
    ("regex-matches-nothing", StructuredOutput(regex=r"[^\s\S]"), "matches no text", None),
    ("lark-syntax-error", StructuredOutput(grammar='start: ("a"'), "Expected token", None),
    ("lark-undefined-rule", StructuredOutput(grammar="start: nowhere"), "nowhere", None),
    ("lark-never-terminates", StructuredOutput(grammar='start: a\na: "x" a'), "matches no text",
     None),
]


# Already covered by tests/test_structured.py (API) and tests/test_server.py (server).
COVERED_API = frozenset({"schema-not-json", "schema-invalid-type", "lark-undefined-rule"})
COVERED_SERVER = frozenset({"schema-invalid-type"})


def _bad_params(covered: frozenset[str] = frozenset()) -> list[Any]:
    return [pytest.param(so, words, id=name, marks=[pytest.mark.xfail(strict=True,
                                                                      reason=why)] if why else [])
            for name, so, words, why in BAD if name not in covered]


@pytest.fixture(scope="module")
def tiny_llm(tiny_model_dir: Path) -> LLM:
    return LLM(str(tiny_model_dir), kv_cache_memory="16MiB")


@pytest.mark.parametrize(("structured", "words"), _bad_params(COVERED_API))
def test_bad_constraint_refused_by_the_api(tiny_llm: LLM, structured: StructuredOutput,
                                           words: str) -> None:
    """LLM.generate raises InvalidParamsError (param "structured", one line naming the
    problem) and nothing is left queued."""
    with pytest.raises(InvalidParamsError) as info:
        tiny_llm.generate("hi", SamplingParams(max_tokens=8, structured=structured))
    msg = str(info.value)
    assert info.value.param == "structured" and "\n" not in msg and words in msg, msg
    assert not tiny_llm.engine.has_unfinished_requests()


def _cli_flags(so: StructuredOutput, tmp_path: Path) -> list[str]:
    if so.json_schema is not None:
        f = tmp_path / "schema.json"
        f.write_text(so.json_schema if isinstance(so.json_schema, str)
                     else json.dumps(so.json_schema))
        return ["--json-schema", str(f)]
    if so.grammar is not None:
        f = tmp_path / "grammar.lark"
        f.write_text(so.grammar)
        return ["--grammar", str(f)]
    assert so.regex is not None
    return ["--regex", so.regex]


@pytest.mark.parametrize(("structured", "words"), _bad_params())
def test_bad_constraint_refused_by_the_cli(tiny_model_dir: Path, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str],
                                           structured: StructuredOutput, words: str) -> None:
    """`kvloop generate --json-schema FILE / --regex / --grammar FILE`: one `kvloop: error:`
    line naming the problem, exit status 2, nothing on stdout."""
    from kvloop.cli import main

    capsys.readouterr()
    rc = main(["generate", "hi", "--model", str(tiny_model_dir), "--kv-cache-memory", "16MiB",
               "--max-tokens", "8", *_cli_flags(structured, tmp_path)])
    out, err = capsys.readouterr()
    assert rc == 2 and out == "", (rc, out, err)
    assert err.startswith("kvloop: error:") and err.count("\n") == 1 and words in err, err


def _server_body(so: StructuredOutput) -> tuple[str, str, dict]:
    """(route, the field the constraint goes in, body): each kind through another field."""
    if so.json_schema is not None:
        schema = so.json_schema if isinstance(so.json_schema, dict) else None
        if schema is None:  # schema text: vLLM's guided_json takes it as a string
            return "/v1/completions", "guided_json", {"prompt": "hi",
                                                      "guided_json": so.json_schema}
        return "/v1/chat/completions", "response_format", {
            "messages": [{"role": "user", "content": "hi"}],
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "x", "schema": schema}}}
    if so.grammar is not None:
        return "/v1/completions", "guided_grammar", {"prompt": "hi",
                                                     "guided_grammar": so.grammar}
    return "/v1/chat/completions", "structured_outputs", {
        "messages": [{"role": "user", "content": "hi"}],
        "structured_outputs": {"regex": so.regex}}


@pytest.fixture(scope="module")
def tiny_http(tiny_model_dir: Path) -> Iterator[httpx.Client]:
    from test_server import serve, tiny_engine

    with serve(tiny_engine(tiny_model_dir)) as server, \
            httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


@pytest.mark.parametrize(("structured", "words"), _bad_params(COVERED_SERVER))
def test_bad_constraint_refused_by_the_server(tiny_http: httpx.Client,
                                              structured: StructuredOutput,
                                              words: str) -> None:
    """A 400 whose param is the field the constraint came in, its message naming the
    problem; nothing queued (the server is idle right after)."""
    from test_server import assert_error, wait_idle

    route, field, body = _server_body(structured)
    r = tiny_http.post(route, json={**body, "max_tokens": 8})
    assert_error(r, 400, param=field, words=words)
    wait_idle(tiny_http)


def test_json_whitespace_is_bounded(tiny_llm: LLM) -> None:
    """With the newline token strongly favoured, a schema-constrained output still ends
    within max_tokens and parses: the grammar leaves no room for unbounded whitespace (with
    llguidance's default, flexible whitespace, it wrote newlines until max_tokens, as sampled
    outputs of the default model did at temperature 1)."""
    newline = tiny_llm.tokenizer.encode("\n", add_special_tokens=False)
    assert len(newline) == 1
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}},
              "required": ["a"], "additionalProperties": False}
    out = tiny_llm.generate("hi", SamplingParams(
        temperature=0, max_tokens=64, logit_bias={newline[0]: 100.0},
        structured=StructuredOutput(json_schema=schema)))[0].outputs[0]
    assert out.finish_reason == "stop", out.text
    jsonschema.validate(json.loads(out.text), schema)
