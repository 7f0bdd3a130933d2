"""EngineConfig and parse_size: every engine option out of range is one InvalidParamsError
naming the option, raised on construction (before any model loads), for the Python API, the
CLI and the server alike. Issue 10, item 5: these used to hang, divide by zero or traceback."""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path
from typing import Any

import pytest

from kvloop.config import (
    MAX_BLOCK_SIZE,
    MAX_SIZE_BYTES,
    MIN_KV_CACHE_TOKENS,
    QUANTIZATIONS,
    EngineConfig,
    parse_size,
)
from kvloop.errors import InvalidParamsError

CPUS = os.cpu_count() or 1

REFUSED: list[tuple[str, dict[str, Any], str]] = [
    ("block_size 0", {"block_size": 0}, "block_size"),  # was ZeroDivisionError
    ("block_size -1", {"block_size": -1}, "block_size"),
    ("block_size huge", {"block_size": MAX_BLOCK_SIZE + 1}, "block_size"),
    ("block_size float", {"block_size": 16.0}, "block_size"),
    ("block_size bool", {"block_size": True}, "block_size"),
    ("max_num_seqs 0", {"max_num_seqs": 0}, "max_num_seqs"),  # was a hang
    ("max_num_batched_tokens 0", {"max_num_batched_tokens": 0}, "max_num_batched_tokens"),
    ("max_num_batched_tokens -1", {"max_num_batched_tokens": -1}, "max_num_batched_tokens"),
    ("max_num_batched_tokens 2**70", {"max_num_batched_tokens": 2**70},
     "max_num_batched_tokens"),
    ("max_model_len 1", {"max_model_len": 1}, "max_model_len"),
    ("max_model_len 0", {"max_model_len": 0}, "max_model_len"),
    ("num_threads -1", {"num_threads": -1}, "num_threads"),
    ("num_threads 0", {"num_threads": 0}, "num_threads"),
    ("num_threads above the CPUs", {"num_threads": CPUS + 1}, "num_threads"),
    ("num_threads 1000", {"num_threads": 1000 + CPUS}, "num_threads"),
    ("kv_cache_memory garbage", {"kv_cache_memory": "abc"}, "kv_cache_memory"),
    ("kv_cache_memory 1e400", {"kv_cache_memory": "1e400"}, "kv_cache_memory"),
    ("kv_cache_memory nan", {"kv_cache_memory": "nan"}, "kv_cache_memory"),
    ("kv_cache_memory inf GiB", {"kv_cache_memory": "infGiB"}, "kv_cache_memory"),
    ("kv_cache_memory negative", {"kv_cache_memory": "-1GiB"}, "kv_cache_memory"),
    ("kv_cache_memory negative int", {"kv_cache_memory": -5}, "kv_cache_memory"),
    ("kv_cache_memory 0", {"kv_cache_memory": 0}, "kv_cache_memory"),
    ("kv_cache_memory absurd", {"kv_cache_memory": "2PB"}, "kv_cache_memory"),
    ("kv_cache_memory absurd int", {"kv_cache_memory": 10**400}, "kv_cache_memory"),
    ("kv_cache_memory unit only", {"kv_cache_memory": "GiB"}, "kv_cache_memory"),
    ("kv_cache_memory bool", {"kv_cache_memory": True}, "kv_cache_memory"),
    ("quantization unknown", {"quantization": "int3"}, "quantization"),
    ("use_cache int", {"use_cache": 1}, "use_cache"),
    ("enable_prefix_caching str", {"enable_prefix_caching": "no"}, "enable_prefix_caching"),
]


@pytest.mark.parametrize(("kwargs", "param"), [(k, p) for _, k, p in REFUSED],
                         ids=[name for name, _, _ in REFUSED])
def test_bad_option_is_refused_naming_it(kwargs: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidParamsError) as info:
        EngineConfig(**kwargs)
    assert info.value.param == param
    msg = str(info.value)
    assert msg.startswith(param) and "\n" not in msg and len(msg) < 300, msg


def test_too_many_threads_says_how_many_cpus() -> None:
    with pytest.raises(InvalidParamsError, match=f"this machine has {CPUS} CPUs"):
        EngineConfig(num_threads=1000 + CPUS)


@pytest.mark.parametrize("kwargs", [
    {},
    {"block_size": 1, "max_num_seqs": 1, "max_num_batched_tokens": 1, "max_model_len": 2},
    {"block_size": MAX_BLOCK_SIZE},
    {"num_threads": 1}, {"num_threads": CPUS},
    {"kv_cache_memory": 1}, {"kv_cache_memory": MAX_SIZE_BYTES},
    *({"quantization": q} for q in QUANTIZATIONS),
], ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()) or "defaults")
def test_boundary_options_are_accepted(kwargs: dict[str, Any]) -> None:
    EngineConfig(**kwargs)


def test_kv_cache_memory_is_parsed_at_construction() -> None:
    assert EngineConfig(kv_cache_memory="16MiB").kv_cache_memory == 16 * 2**20
    assert EngineConfig(kv_cache_memory=" 1.5 G ").kv_cache_memory == 3 * 2**29
    cfg = EngineConfig(kv_cache_memory="2GiB")
    assert dataclasses.replace(cfg, block_size=32).kv_cache_memory == 2 * 2**30


@pytest.mark.parametrize(("text", "size"), [
    ("2GiB", 2 * 2**30), ("512MB", 512 * 10**6), ("1.5G", 3 * 2**29), (1048576, 1048576),
    ("65536", 65536), ("1e3", 1000), ("0", 0), ("1_000KB", 10**6), ("1PiB", None),
    ("1024TiB", MAX_SIZE_BYTES),
])
def test_parse_size_valid(text: str | int, size: int | None) -> None:
    if size is None:  # no PiB unit: "1PiB" is not a size
        with pytest.raises(InvalidParamsError):
            parse_size(text)
    else:
        assert parse_size(text) == size


@pytest.mark.parametrize("text", ["abc", "", "1e400", "nan", "-inf", "inf", "-1", "-0.5KB",
                                  "1e16", str(10**400), "1.5.5G", 10**400, -1, math.inf])
def test_parse_size_refuses_garbage_with_a_kvloop_error(text: Any) -> None:
    with pytest.raises(InvalidParamsError) as info:
        parse_size(text, param="max_body_bytes")
    assert info.value.param == "max_body_bytes"
    assert isinstance(info.value, ValueError)  # callers catching ValueError still work


def test_quantization_names_match_the_quant_package() -> None:
    """config lists them itself (it sits below quant in the layers); they must agree."""
    from kvloop.quant import QUANTIZATIONS as QUANT_MODES

    assert QUANTIZATIONS == QUANT_MODES


# --- the KV capacity check the engine calls once it knows the model's shapes -------------------
def test_kv_capacity_one_byte_is_refused() -> None:
    """kv_cache_memory=1 used to serve a one-block (16-token) context without a word."""
    cfg = EngineConfig(kv_cache_memory=1)
    with pytest.raises(InvalidParamsError, match="raise kv_cache_memory") as info:
        cfg.check_kv_capacity(bytes_per_block=8192, model_context=2048)
    assert info.value.param == "kv_cache_memory"


def test_kv_capacity_needs_the_minimum_context_or_the_models_whole_context() -> None:
    per_block, block = 8192, 16
    need = MIN_KV_CACHE_TOKENS // block
    ok = EngineConfig(kv_cache_memory=need * per_block, block_size=block)
    assert ok.check_kv_capacity(per_block, model_context=2048) == need
    short = EngineConfig(kv_cache_memory=need * per_block - 1, block_size=block)
    with pytest.raises(InvalidParamsError, match=f"at least {need}"):
        short.check_kv_capacity(per_block, model_context=2048)
    # A model whose whole context is shorter than the minimum needs only that context.
    tiny = EngineConfig(kv_cache_memory=4 * per_block, block_size=block)
    assert tiny.check_kv_capacity(per_block, model_context=64) == 4
    with pytest.raises(InvalidParamsError):
        tiny.check_kv_capacity(per_block, model_context=65)


def test_kv_capacity_unchecked_without_a_cache() -> None:
    assert EngineConfig(use_cache=False, kv_cache_memory=1).check_kv_capacity(8192, 2048) == 0


# --- the offline API: bad options are InvalidParamsError before any model loads ---------------
@pytest.mark.parametrize(("kwargs", "param"), [
    ({"block_size": 0}, "block_size"),
    ({"max_num_seqs": 0}, "max_num_seqs"),
    ({"max_num_batched_tokens": 0}, "max_num_batched_tokens"),
    ({"kv_cache_memory": "abc"}, "kv_cache_memory"),
    ({"num_threads": -1}, "num_threads"),
    ({"kv_cache_mem": "1GiB"}, "kv_cache_mem"),  # a typo: unknown option, not a TypeError
], ids=["block_size", "max_num_seqs", "max_num_batched_tokens", "kv_cache_memory",
        "num_threads", "unknown option"])
def test_llm_refuses_bad_engine_options(tmp_path: Path, kwargs: dict[str, Any],
                                        param: str) -> None:
    from kvloop import LLM

    # No model at this path: the options must be refused before anything is loaded.
    with pytest.raises(InvalidParamsError) as info:
        LLM(str(tmp_path / "no-such-model"), **kwargs)
    assert info.value.param == param
