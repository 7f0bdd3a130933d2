"""The `kvloop` command line: what it prints, what it exits with, and that it only translates.

Most tests call `kvloop.cli.main(argv)` in-process (fast); a few run the real entry point,
`python -m kvloop.cli`, as a subprocess: streaming, the interactive chat over stdin, exit
status and stderr of a bad input, and the default model once (slow).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import write_tiny_model
from kvloop import LLM, SamplingParams
from kvloop.cli import main

SMALL_KV = "16MiB"
PROMPT = "The quick brown"
METRIC_KEYS = {"ttft_s", "decode_tokens_per_s", "positions_processed"}


def run_cli(*args: str, stdin: str = "", timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -m kvloop.cli ARGS` with `stdin` fed and closed; text out, UTF-8."""
    env = {**os.environ, "PYTHONIOENCODING": "utf-8"}
    return subprocess.run(
        [sys.executable, "-m", "kvloop.cli", *args], input=stdin, capture_output=True,
        text=True, encoding="utf-8", timeout=timeout, env=env, check=False,
    )


def run_main(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """`kvloop.cli.main(argv)` in-process: (exit status, stdout, stderr)."""
    capsys.readouterr()
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def gen_json(model: Path, capsys: pytest.CaptureFixture[str], *flags: str,
             prompt: str = PROMPT) -> dict:
    """`kvloop generate PROMPT --json` in-process; the one JSON object it prints."""
    rc, out, err = run_main(["generate", prompt, "--model", str(model), "--json",
                             "--kv-cache-memory", SMALL_KV, *flags], capsys)
    assert rc == 0, err
    lines = out.splitlines()
    assert len(lines) == 1, f"expected one JSON line, got {out!r}"
    obj = json.loads(lines[0])
    assert isinstance(obj, dict)
    return obj


@pytest.fixture(scope="module")
def tiny_llm(tiny_model_dir: Path) -> LLM:
    """The API on the same tiny model: what the CLI's output must equal."""
    return LLM(tiny_model_dir, kv_cache_memory=SMALL_KV)


@pytest.fixture(scope="module")
def tiny64(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Llama with a 64-token context."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny64-cli"), max_position_embeddings=64)


# --- generate ----------------------------------------------------------------------------------
def test_generate_streams_text_then_figures_line(tiny_model_dir: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """`python -m kvloop.cli generate`: the text on stdout (then a newline), one figures line
    on stderr with TTFT, tok/s and positions processed; the same text --json reports."""
    ref = gen_json(tiny_model_dir, capsys, "--max-tokens", "5")
    p = run_cli("generate", PROMPT, "--model", str(tiny_model_dir), "--max-tokens", "5",
                "--kv-cache-memory", SMALL_KV)
    assert p.returncode == 0, p.stderr
    assert p.stdout == ref["text"] + "\n"
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    figures = lines[0]
    for word in ("TTFT", "tok/s", "positions processed"):
        assert word in figures
    assert f"{ref['metrics']['positions_processed']} positions processed" in figures
    assert "Traceback" not in p.stdout + p.stderr


def test_generate_json_is_one_object(tiny_model_dir: Path, tiny_llm: LLM,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    """--json prints exactly one object: text, token_ids, finish_reason, metrics; its tokens
    are the API's greedy tokens."""
    obj = gen_json(tiny_model_dir, capsys, "--max-tokens", "5", "--ignore-eos")
    assert {"text", "token_ids", "finish_reason", "metrics"} <= obj.keys()
    assert obj["metrics"].keys() >= METRIC_KEYS
    assert isinstance(obj["text"], str)
    assert len(obj["token_ids"]) == 5 and all(isinstance(t, int) for t in obj["token_ids"])
    assert obj["finish_reason"] == "length"
    m = obj["metrics"]
    assert m["ttft_s"] > 0 and m["decode_tokens_per_s"] > 0
    api = tiny_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=5,
                                                   ignore_eos=True))[0].outputs[0]
    assert obj["token_ids"] == api.token_ids and obj["text"] == api.text
    # With the cache: the prompt once, then one position per generated token but the last.
    assert m["positions_processed"] == m["prompt_tokens"] + 5 - 1


def test_no_cache_same_tokens_triangular_positions(tiny_model_dir: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """--no-cache re-reads the whole sequence each step: same greedy tokens, and positions
    processed P + (P+1) + ... + (P+n-1) instead of P + n - 1."""
    n = 6
    cached = gen_json(tiny_model_dir, capsys, "--max-tokens", str(n), "--ignore-eos")
    uncached = gen_json(tiny_model_dir, capsys, "--max-tokens", str(n), "--ignore-eos",
                        "--no-cache")
    assert uncached["token_ids"] == cached["token_ids"]
    assert uncached["text"] == cached["text"]
    p = cached["metrics"]["prompt_tokens"]
    assert uncached["metrics"]["prompt_tokens"] == p
    assert cached["metrics"]["positions_processed"] == p + n - 1
    assert uncached["metrics"]["positions_processed"] == sum(p + i for i in range(n))


def test_stop_string_ends_the_text(tiny_model_dir: Path,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    """--stop S: the text ends just before the first S, finish_reason "stop"."""
    full = gen_json(tiny_model_dir, capsys, "--max-tokens", "16", "--ignore-eos")
    text = full["text"]
    stop = next((c for c in text if c.isascii() and c.isalpha()), None)
    assert stop is not None, f"no ASCII letter in {text!r} to stop on"
    cut = gen_json(tiny_model_dir, capsys, "--max-tokens", "16", "--ignore-eos",
                   "--stop", stop)
    assert cut["text"] == text[: text.index(stop)]
    assert cut["finish_reason"] == "stop"
    assert len(cut["token_ids"]) < 16
    assert cut["token_ids"] == full["token_ids"][: len(cut["token_ids"])]


def test_chat_flag_applies_the_template(tiny_model_dir: Path, tiny_llm: LLM,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    """--chat (and --system) wrap the prompt in the model's chat template, as LLM.chat does."""
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPT}]
    obj = gen_json(tiny_model_dir, capsys, "--max-tokens", "4", "--ignore-eos", "--chat",
                   "--system", "Be brief.")
    assert obj["metrics"]["prompt_tokens"] == len(tiny_llm.tokenizer.encode_chat(msgs))
    api = tiny_llm.chat(msgs, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert obj["token_ids"] == api[0].outputs[0].token_ids
    plain = gen_json(tiny_model_dir, capsys, "--max-tokens", "4", "--ignore-eos", "--chat")
    assert plain["metrics"]["prompt_tokens"] == len(
        tiny_llm.tokenizer.encode_chat(msgs[1:]))


# --- chat ---------------------------------------------------------------------------------------
def test_chat_two_turns_then_eof(tiny_model_dir: Path, tiny_llm: LLM) -> None:
    """`kvloop chat`: two lines on stdin then EOF: two replies (the API's, with the history
    carried over), a figures line each, exit 0."""
    p = run_cli("chat", "--model", str(tiny_model_dir), "--max-tokens", "4", "--ignore-eos",
                "--kv-cache-memory", SMALL_KV, stdin="hello\nthe fox\n")
    assert p.returncode == 0, p.stderr
    assert "Traceback" not in p.stdout + p.stderr
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    history = [{"role": "user", "content": "hello"}]
    r1 = tiny_llm.chat(history, params)[0].outputs[0].text
    history += [{"role": "assistant", "content": r1}, {"role": "user", "content": "the fox"}]
    r2 = tiny_llm.chat(history, params)[0].outputs[0].text
    assert p.stdout == f">>> {r1}\n>>> {r2}\n>>> "
    figures = [line for line in p.stderr.splitlines() if "positions processed" in line]
    assert len(figures) == 2
    assert all("TTFT" in f and "tok/s" in f and "4 tokens" in f for f in figures)


def test_chat_reports_a_too_long_turn_and_goes_on(
    tiny64: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A turn that outgrows the context is one `kvloop: error:` line; the session continues
    (the bad turn is dropped from the history) and ends with status 0."""
    import io

    long_line = "the quick brown fox jumps over the lazy dog " * 12
    monkeypatch.setattr(sys, "stdin", io.StringIO(f"{long_line}\nhi\n"))
    rc, out, err = run_main(["chat", "--model", str(tiny64), "--max-tokens", "3",
                             "--ignore-eos", "--kv-cache-memory", SMALL_KV], capsys)
    assert rc == 0
    errors = [line for line in err.splitlines() if line.startswith("kvloop: error:")]
    assert len(errors) == 1 and "context is 64" in errors[0]
    assert len([line for line in err.splitlines() if "positions processed" in line]) == 1
    assert out.count(">>> ") == 3
    assert "Traceback" not in out + err


def test_chat_rejects_bad_params_before_loading(capsys: pytest.CaptureFixture[str]) -> None:
    """`kvloop chat` validates sampling flags like generate: exit 2, one line."""
    rc, out, err = run_main(["chat", "--model", "/nonexistent", "--top-p", "1.5"], capsys)
    assert rc == 2
    assert err == "kvloop: error: top_p must be a finite number in (0, 1], got 1.5\n"
    assert out == ""


# --- bad input through the real entry point ------------------------------------------------------
@pytest.mark.parametrize(("flags", "words"), [
    (["--model", "{missing}"], ("model path not found", "no-such.gguf")),
    (["--model", "{text}"], ("readme.txt", "not a GGUF file")),
    (["--model", "{tiny}", "--temperature", "-1"], ("temperature", ">= 0")),
    (["--model", "{tiny64}", "--long"], ("prompt has", "context is 64")),
], ids=["missing_file", "not_gguf", "temperature", "prompt_too_long"])
def test_subprocess_bad_input_exits_2_one_line(
    flags: list[str], words: tuple[str, ...], tmp_path: Path, tiny_model_dir: Path,
    tiny64: Path,
) -> None:
    """The real entry point: exit 2, stderr exactly one `kvloop: error:` line naming the
    problem, nothing on stdout, no traceback (every case runs in-process in test_errors.py)."""
    text = tmp_path / "readme.txt"
    text.write_text("not a model")
    paths = {"{missing}": str(tmp_path / "no-such.gguf"), "{text}": str(text),
             "{tiny}": str(tiny_model_dir), "{tiny64}": str(tiny64)}
    prompt = "Hello"
    argv = []
    for f in flags:
        if f == "--long":
            prompt = "the quick brown fox jumps over the lazy dog " * 12
        else:
            argv.append(paths.get(f, f))
    p = run_cli("generate", prompt, *argv, "--kv-cache-memory", SMALL_KV)
    assert p.returncode == 2
    assert p.stdout == ""
    lines = p.stderr.splitlines()
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith("kvloop: error: ")
    for word in words:
        assert word in lines[0]
    assert "Traceback" not in p.stderr


def test_unparsable_flag_is_one_kvloop_error_line(capsys: pytest.CaptureFixture[str]) -> None:
    """A flag argparse cannot parse (--max-tokens abc) exits 2 with one `kvloop: error:` line."""
    with pytest.raises(SystemExit) as info:
        main(["generate", "hi", "--max-tokens", "abc"])
    out, err = capsys.readouterr()
    assert info.value.code == 2
    assert "Traceback" not in out + err
    assert err.startswith("kvloop: error:") and "--max-tokens" in err
    assert len(err.strip().splitlines()) == 1


# --- issue 10: values the engine cannot represent, refused as one line before the model loads ---
HOSTILE_FLAGS = [
    (["--threads", "-1"], "num_threads"),
    (["--threads", "1000000"], "num_threads"),
    (["--threads", "0"], "num_threads"),
    (["--kv-cache-memory", "abc"], "kv_cache_memory"),
    (["--kv-cache-memory", "1e400"], "kv_cache_memory"),
    (["--kv-cache-memory=-1GiB"], "kv_cache_memory"),
    (["--kv-cache-memory", "nan"], "kv_cache_memory"),
    (["--seed", str(2**70)], "seed"),
    (["--top-k", str(2**70)], "top_k"),
    (["--stop-token-id", str(2**70), "--min-tokens", "2"], "stop_token_ids"),
    (["--num-beams", "2", "--length-penalty", "1e308"], "length_penalty"),
    (["--repetition-penalty", "1e-300"], "repetition_penalty"),
    (["--temperature", "nan"], "temperature"),
    (["--temperature", "inf"], "temperature"),
    (["--logit-bias", f"{2**70}=1"], "logit_bias"),
    (["--logit-bias", "5=nan"], "logit_bias"),
    (["--num-beams", "0"], "num_beams"),
    (["--num-beams", "3", "--logprobs", "2"], "logprobs"),
    (["--num-beams", "2", "--stop", "x"], "stop"),
    (["--n", "2", "--num-return-sequences", "2"], "num_return_sequences"),
]


@pytest.mark.parametrize("command", ["generate", "chat"])
@pytest.mark.parametrize(("flags", "param"), HOSTILE_FLAGS,
                         ids=[" ".join(f)[:40] for f, _ in HOSTILE_FLAGS])
def test_hostile_flag_is_one_error_line_before_loading(
    command: str, flags: list[str], param: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each used to be a traceback (or a hang, or 0.5 tok/s): now exit 2 and exactly one
    `kvloop: error:` line naming the option, before the (missing) model is even looked at."""
    prompt = ["hi"] if command == "generate" else []
    rc, out, err = run_main([command, *prompt, "--model", "/nonexistent", *flags], capsys)
    assert rc == 2, err
    assert out == ""
    assert err.startswith(f"kvloop: error: {param} ") and err.count("\n") == 1, err
    assert "Traceback" not in err


def test_too_many_threads_names_the_cpu_count(capsys: pytest.CaptureFixture[str]) -> None:
    cpus = os.cpu_count()
    rc, _, err = run_main(["generate", "hi", "--model", "/nonexistent", "--threads", "1000000"],
                          capsys)
    assert rc == 2 and f"this machine has {cpus} CPUs" in err


def test_a_reader_that_goes_away_ends_the_command_quietly(tiny_model_dir: Path) -> None:
    """`kvloop generate ... | head -c 1`: once the reader has closed the pipe, the next
    write ends the command with status 1 and nothing on stderr (no BrokenPipeError
    traceback, then or at exit)."""
    env = {**os.environ, "PYTHONIOENCODING": "utf-8"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvloop.cli", "generate", PROMPT, "--model",
         str(tiny_model_dir), "--kv-cache-memory", SMALL_KV, "--max-tokens", "1000",
         "--ignore-eos"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    assert proc.stdout is not None and proc.stderr is not None
    assert proc.stdout.read(1)  # streaming has begun
    proc.stdout.close()
    err = proc.stderr.read().decode("utf-8")
    assert proc.wait(timeout=120) == 1, err
    assert err == ""


def test_undecodable_prompt_bytes_exit_2_one_line(tmp_path: Path) -> None:
    """`kvloop generate $'abc\\xff'`: Python passes the byte on as a lone surrogate; the CLI
    names the byte and stops before loading anything (the model path does not exist)."""
    env = {**os.environ, "PYTHONIOENCODING": "utf-8"}
    p = subprocess.run(
        [sys.executable, "-m", "kvloop.cli", "generate", b"abc\xff",
         "--model", str(tmp_path / "none.gguf")],
        capture_output=True, timeout=120, env=env, check=False)
    err = p.stderr.decode("utf-8")
    assert p.returncode == 2, err
    assert p.stdout == b""
    assert err == ("kvloop: error: PROMPT is not valid UTF-8 text (undecodable byte 0xff at "
                   "character 3)\n")


def test_undecodable_system_message_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = run_main(["generate", "hi", "--chat", "--system", "x\udcfe",
                           "--model", "/nonexistent"], capsys)
    assert rc == 2
    assert err == ("kvloop: error: --system is not valid UTF-8 text (undecodable byte 0xfe "
                   "at character 1)\n")


def test_binary_prompts_file_exit_2_one_line(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "prompts.bin"
    f.write_bytes(b"fine first line\nsecond \x89PNG\x00\xff\n")
    rc, out, err = run_main(["generate", "--prompts-file", str(f), "--model", "/nonexistent"],
                            capsys)
    assert rc == 2 and out == ""
    assert err == (f"kvloop: error: --prompts-file {f} is not UTF-8 text (byte 0x89 on line "
                   f"2, at byte 23)\n")


def test_prompts_file_crlf_lines_are_stripped(tiny_model_dir: Path, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "prompts.txt"
    f.write_bytes(b"The quick brown\r\n\r\nCaf\xc3\xa9\r\n")
    rc, out, err = run_main(["generate", "--prompts-file", str(f), "--json", "--model",
                             str(tiny_model_dir), "--kv-cache-memory", SMALL_KV,
                             "--max-tokens", "2", "--ignore-eos"], capsys)
    assert rc == 0, err
    objs = [json.loads(line) for line in out.splitlines()]
    assert len(objs) == 2


def test_chat_skips_a_non_utf8_line_and_goes_on(tiny_model_dir: Path, tiny_llm: LLM) -> None:
    """`kvloop chat < binary`: the bad line is one `kvloop: error:` line and is skipped, the
    next line is answered as if it came first, and the session exits 2 (something was
    refused); no traceback."""
    env = {**os.environ, "PYTHONIOENCODING": "utf-8"}
    p = subprocess.run(
        [sys.executable, "-m", "kvloop.cli", "chat", "--model", str(tiny_model_dir),
         "--max-tokens", "3", "--ignore-eos", "--kv-cache-memory", SMALL_KV],
        input=b"\x89PNG\r\n\x00\xff\xfe\nhello\n", capture_output=True, timeout=300,
        env=env, check=False)
    out, err = p.stdout.decode("utf-8"), p.stderr.decode("utf-8")
    assert p.returncode == 2, err
    assert "Traceback" not in out + err
    errors = [line for line in err.splitlines() if line.startswith("kvloop: error:")]
    assert errors == ["kvloop: error: input line 1 is not valid UTF-8 text (byte 0x89 at "
                      "byte 0); skipped",
                      "kvloop: error: input line 2 is not valid UTF-8 text (byte 0xff at "
                      "byte 1); skipped"]
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    reply = tiny_llm.chat([{"role": "user", "content": "hello"}], params)[0].outputs[0].text
    assert out == f">>> >>> >>> {reply}\n>>> "  # the skipped lines left no history


def test_parse_special_tokenizes_control_tokens(tiny_model_dir: Path, tiny_llm: LLM,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """By default a special-token string in the prompt is plain text; --parse-special makes
    it the control token, exactly as tokenizer.encode(text, parse_special=True)."""
    tok = tiny_llm.tokenizer
    special = tok.eos_token
    assert special is not None
    prompt = f"The quick{special} brown"
    raw = gen_json(tiny_model_dir, capsys, "--max-tokens", "1", "--ignore-eos",
                   "--parse-special", prompt=prompt)
    plain = gen_json(tiny_model_dir, capsys, "--max-tokens", "1", "--ignore-eos",
                     prompt=prompt)
    want = tok.encode(prompt, parse_special=True)
    assert raw["metrics"]["prompt_tokens"] == len(want)
    assert plain["metrics"]["prompt_tokens"] == len(tok.encode(prompt))
    assert len(tok.encode(prompt)) > len(want)  # the string spelled out, not one id
    rc, _, err = run_main(["generate", "hi", "--chat", "--parse-special",
                           "--model", "/nonexistent"], capsys)
    assert rc == 2 and "--parse-special" in err


# --- the default model --------------------------------------------------------------------------
@pytest.mark.slow
def test_default_model_chat_json() -> None:
    """`kvloop generate --chat "What is 2+2?" --max-tokens 8 --json` on SmolLM2: exit 0, text."""
    p = run_cli("generate", "--chat", "What is 2+2?", "--max-tokens", "8", "--json",
                timeout=600)
    assert p.returncode == 0, p.stderr
    obj = json.loads(p.stdout)
    assert obj["text"].strip()
    assert 1 <= len(obj["token_ids"]) <= 8
    assert obj["finish_reason"] in ("stop", "length")
    assert obj["metrics"].keys() >= METRIC_KEYS


def test_speculative_ngram_same_text_and_accepted_figure(tiny_model_dir: Path,
                                                         capsys: pytest.CaptureFixture[str]
                                                         ) -> None:
    """--speculative ngram gives the same greedy text; the figures line and the JSON
    metrics report drafted and accepted tokens."""
    prompt = "one two three one two three one two three one two"
    plain = gen_json(tiny_model_dir, capsys, "--max-tokens", "40", "--ignore-eos",
                     prompt=prompt)
    spec = gen_json(tiny_model_dir, capsys, "--max-tokens", "40", "--ignore-eos",
                    "--speculative", "ngram", prompt=prompt)
    assert spec["token_ids"] == plain["token_ids"]
    assert spec["metrics"]["draft_tokens"] > 0
    assert plain["metrics"]["draft_tokens"] == 0
    rc, _, err = run_main(["generate", prompt, "--model", str(tiny_model_dir),
                             "--kv-cache-memory", SMALL_KV, "--max-tokens", "40",
                             "--ignore-eos", "--speculative", "ngram"], capsys)
    assert rc == 0, err
    mean = spec["metrics"]["mean_accepted_length"]
    assert mean >= 1.0 and f"{mean:.2f} tokens/step accepted" in err
    rc, _, err = run_main(["generate", prompt, "--speculative", "ngram",
                           "--num-speculative-tokens", "99"], capsys)
    assert rc == 2 and err.count("\n") == 1 and "num_speculative_tokens" in err


def test_structured_output_flags(tiny_model_dir: Path, tmp_path: Path,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    """--choice / --regex / --json-schema FILE constrain the output; a bad constraint or
    two at once is one error line, exit 2."""
    out = gen_json(tiny_model_dir, capsys, "--max-tokens", "10", "--choice", "alpha",
                   "--choice", "beta")
    assert out["text"] in ("alpha", "beta") and out["finish_reason"] == "stop"
    out = gen_json(tiny_model_dir, capsys, "--max-tokens", "10", "--regex", "[0-9]{3}")
    assert re.fullmatch("[0-9]{3}", out["text"])
    schema = tmp_path / "s.json"
    schema.write_text('{"type": "object", "properties": {"a": {"type": "boolean"}}, '
                      '"required": ["a"], "additionalProperties": false}')
    out = gen_json(tiny_model_dir, capsys, "--max-tokens", "40", "--json-schema", str(schema))
    assert isinstance(json.loads(out["text"])["a"], bool)
    for flags in (["--regex", "("], ["--regex", "a", "--choice", "b"],
                  ["--json-schema", str(tmp_path / "missing.json")]):
        rc, _, err = run_main(["generate", "hi", "--model", str(tiny_model_dir),
                               "--kv-cache-memory", SMALL_KV, *flags], capsys)
        assert rc == 2 and err.count("\n") == 1 and err.startswith("kvloop: error:"), err
