"""One definition of the engine's options for every face: `kvloop generate`, `chat`,
`roofline` and `serve` accept the same engine flags (quantization included), and a bad
value is one KvloopError naming the field from the Python API, the CLI and serve alike."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from kvloop import LLM
from kvloop.cli import build_parser
from kvloop.config import EngineConfig
from kvloop.errors import KvloopError


def engine_flags(parser: argparse.ArgumentParser) -> dict[str, tuple]:
    """Each engine option of a subcommand: its flags, choices, default and type."""
    (group,) = [g for g in parser._action_groups if g.title == "engine"]
    return {a.dest: (tuple(a.option_strings), a.choices and tuple(a.choices), a.default,
                     a.type) for a in group._group_actions}


def subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def test_every_face_has_the_same_engine_flags() -> None:
    subs = subcommands()
    serve = engine_flags(subs["serve"])
    assert "quantization" in serve and "kv_cache_memory" in serve
    for name in ("generate", "chat", "roofline"):
        assert engine_flags(subs[name]) == serve, name
    # --quantization offers every mode EngineConfig takes.
    from kvloop.config import QUANTIZATIONS
    assert set(serve["quantization"][1]) == set(QUANTIZATIONS)


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"max_num_batched_tokens": 0}, "max_num_batched_tokens"),
    ({"block_size": 0}, "block_size"),
    ({"quantization": "int3"}, "quantization"),
    ({"kv_cache_memory": "lots"}, "kv_cache_memory"),
    ({"max_num_seqs": -1}, "max_num_seqs"),
])
def test_bad_engine_option_is_one_error_naming_it(kwargs: dict, field: str) -> None:
    with pytest.raises(KvloopError, match=field) as e:
        EngineConfig(**kwargs)
    assert getattr(e.value, "param", None) == field
    with pytest.raises(KvloopError, match=field):
        LLM(**kwargs)  # refused before the model loads


@pytest.mark.parametrize("face", ["generate", "serve"])
@pytest.mark.parametrize(("flags", "field"), [
    (["--max-num-batched-tokens", "0"], "max_num_batched_tokens"),
    (["--block-size", "0"], "block_size"),
    (["--kv-cache-memory", "lots"], "kv_cache_memory"),
])
def test_cli_and_serve_refuse_the_same_bad_values(face: str, flags: list[str],
                                                  field: str) -> None:
    args = [sys.executable, "-m", "kvloop.cli", face, *flags]
    if face == "generate":
        args.append("hi")
    proc = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvloop: error:") and field in lines[0], \
        proc.stderr


@pytest.mark.slow
def test_serve_runs_int4(default_gguf: Path, tmp_path: Path) -> None:
    from test_server_shutdown import kvloop_serve

    with kvloop_serve(default_gguf, tmp_path, "--quantization", "int4") as server:
        r = httpx.post(f"{server.url}/v1/completions", timeout=120, json={
            "model": default_gguf.stem, "prompt": "The capital of France is", "max_tokens": 8,
            "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"]
        assert "weights int4" in server.text()  # its startup line says what it runs
