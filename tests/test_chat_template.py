"""A chat template from outside the checkpoint: base models (Gemma 3 270M) ship none, and
chatting with one then fails with one clear error that says how to supply it
(`--chat-template FILE` on the CLI and the server, `chat_template=` in the API)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from conftest import write_tiny_gemma3
from kvloop import LLM, SamplingParams
from kvloop.config import EngineConfig
from kvloop.engine.llm_engine import LLMEngine
from kvloop.errors import InvalidParamsError, KvloopError, ModelLoadError
from kvloop.server.app import ServerSettings, create_app
from kvloop.server.background import BackgroundServer
from test_cli import run_cli, run_main

SMALL_KV = "16MiB"
# A template unlike the tiny models' own, so that its use shows in the rendered text.
TEMPLATE = ("{{ bos_token }}{% for m in messages %}[{{ m['role'] | upper }}] {{ m['content'] }}\n"
            "{% endfor %}{% if add_generation_prompt %}[ASSISTANT] {% endif %}")
GREEDY3 = SamplingParams(max_tokens=3, temperature=0)
CHAT = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def base_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Gemma 3 whose tokenizer carries no chat template, as a base model's."""
    d = write_tiny_gemma3(tmp_path_factory.mktemp("base-gemma3"))
    cfg_path = d / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("chat_template", None)
    cfg_path.write_text(json.dumps(cfg))
    for name in ("chat_template.jinja", "chat_template.json"):
        (d / name).unlink(missing_ok=True)
    return d


@pytest.fixture(scope="module")
def template_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    p = tmp_path_factory.mktemp("tpl") / "chat.jinja"
    p.write_text(TEMPLATE)
    return p


def test_no_template_is_one_clear_error(base_model: Path) -> None:
    llm = LLM(str(base_model), kv_cache_memory=SMALL_KV)
    assert not llm.tokenizer.chat_template
    with pytest.raises(KvloopError, match=r"no chat template.*--chat-template FILE"):
        llm.tokenizer.encode_chat(CHAT)
    # Plain prompts still work.
    assert llm.generate("hello", GREEDY3)[0].outputs[0].token_ids


def test_api_template_renders_and_does_not_leak(base_model: Path) -> None:
    llm = LLM(str(base_model), kv_cache_memory=SMALL_KV, chat_template=TEMPLATE)
    text = llm.tokenizer.apply_chat_template(CHAT)
    bos = llm.tokenizer.id_to_token(llm.tokenizer.bos_token_id)
    assert text == f"{bos}[USER] hello there\n[ASSISTANT] "
    assert llm.tokenizer.encode_chat(CHAT) == llm.tokenizer.encode(text, False, parse_special=True)
    # An engine sharing the checkpoint but not the option keeps the file's (absent) template.
    other = LLMEngine(config=EngineConfig(kv_cache_memory=SMALL_KV),
                      checkpoint=llm.engine.checkpoint)
    assert not other.tokenizer.chat_template


def test_template_replaces_the_models_own(tiny_model_dir: Path) -> None:
    own = LLM(str(tiny_model_dir), kv_cache_memory=SMALL_KV)
    assert own.tokenizer.chat_template and own.tokenizer.chat_template != TEMPLATE
    llm = LLM(str(tiny_model_dir), kv_cache_memory=SMALL_KV, chat_template=TEMPLATE)
    assert "[ASSISTANT] " in llm.tokenizer.apply_chat_template(CHAT)


@pytest.mark.parametrize("bad", ["", "   ", 42, "x" * ((1 << 20) + 1)])
def test_bad_template_values_are_refused(bad: object) -> None:
    with pytest.raises(InvalidParamsError, match="chat_template must be"):
        EngineConfig(chat_template=bad)  # type: ignore[arg-type]


def test_broken_template_is_refused_at_load(base_model: Path) -> None:
    with pytest.raises(ModelLoadError, match="--chat-template does not compile"):
        LLM(str(base_model), kv_cache_memory=SMALL_KV, chat_template="{% for m in messages %}")


def test_cli_generate_chat(base_model: Path, template_file: Path,
                           capsys: pytest.CaptureFixture[str]) -> None:
    args = ["generate", "hello there", "--model", str(base_model), "--kv-cache-memory", SMALL_KV,
            "--max-tokens", "3", "--temperature", "0", "--chat", "--json"]
    rc, out, err = run_main(args, capsys)
    assert rc != 0 and out == ""
    assert len(err.strip().splitlines()) == 1 and "--chat-template FILE" in err
    rc, out, err = run_main([*args, "--chat-template", str(template_file)], capsys)
    assert rc == 0, err
    llm = LLM(str(base_model), kv_cache_memory=SMALL_KV, chat_template=TEMPLATE)
    want = llm.generate([llm.tokenizer.encode_chat(CHAT)], GREEDY3)[0].outputs[0]
    assert json.loads(out)["token_ids"] == want.token_ids


@pytest.mark.parametrize("kind", ["missing", "binary"])
def test_cli_unreadable_template_file(base_model: Path, tmp_path: Path, kind: str,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "t.jinja"
    if kind == "binary":
        path.write_bytes(b"\xff\xfe{{ x }}")
    rc, out, err = run_main(["generate", "hi", "--model", str(base_model), "--chat",
                             "--chat-template", str(path)], capsys)
    assert rc != 0 and out == ""
    line = err.strip()
    assert len(line.splitlines()) == 1 and "--chat-template" in line, err
    assert ("No such file" in line) if kind == "missing" else ("not UTF-8" in line)


def test_cli_chat_says_so_before_reading_input(base_model: Path, template_file: Path) -> None:
    r = run_cli("chat", "--model", str(base_model), "--kv-cache-memory", SMALL_KV,
                stdin="hello\n")
    assert r.returncode != 0
    assert "no chat template" in r.stderr and "Traceback" not in r.stderr
    r = run_cli("chat", "--model", str(base_model), "--kv-cache-memory", SMALL_KV,
                "--chat-template", str(template_file), "--max-tokens", "2", stdin="hello\n")
    assert r.returncode == 0, r.stderr


def test_server_chat(base_model: Path) -> None:
    body = {"model": "tiny", "messages": CHAT, "max_tokens": 2, "temperature": 0}
    plain = LLMEngine(str(base_model), EngineConfig(kv_cache_memory=SMALL_KV))
    with BackgroundServer(create_app(plain, ServerSettings(model_name="tiny"))) as server:
        r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 400, r.text
        assert "--chat-template FILE" in r.json()["error"]["message"]
        # Completions on the same server are unaffected.
        r = httpx.post(f"{server.url}/v1/completions", json={
            "model": "tiny", "prompt": "hello", "max_tokens": 2}, timeout=60)
        assert r.status_code == 200, r.text
    templated = LLMEngine(str(base_model), EngineConfig(kv_cache_memory=SMALL_KV,
                                                        chat_template=TEMPLATE))
    with BackgroundServer(create_app(templated, ServerSettings(model_name="tiny"))) as server:
        r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == len(
            templated.tokenizer.encode_chat(CHAT))


def test_serve_flag_reaches_the_engine(template_file: Path) -> None:
    """`kvloop serve --chat-template FILE` parses into the engine's options."""
    import argparse

    from kvloop.engine_flags import engine_options
    from kvloop.server.cli import add_serve_parser

    p = argparse.ArgumentParser()
    add_serve_parser(p.add_subparsers(dest="cmd"))
    args = p.parse_args(["serve", "--chat-template", str(template_file)])
    assert engine_options(args)["chat_template"] == TEMPLATE
