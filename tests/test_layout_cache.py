"""The layout cache (kvloop.loading.layout_cache): a re-quantized model's layers are
written on the first load and read on later ones, and a cache that is damaged, truncated,
stale or another model's is never used: it is rebuilt, and the model computes exactly
what a load without any cache computes."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from kvloop.engine.llm_engine import layout_cache, load_model
from kvloop.loading.loader import load_checkpoint
from kvloop.models import AttentionMetadata, PrefillSegment

pytestmark = pytest.mark.slow  # the default model, re-quantized

IDS = torch.tensor([1, 504, 3458, 314, 253, 2205, 30, 2873, 28])


def logits(model: Any) -> torch.Tensor:
    meta = AttentionMetadata(prefills=[PrefillSegment(0, len(IDS))])
    with torch.inference_mode():
        return model.compute_logits(model(IDS, torch.arange(len(IDS)), meta))


@pytest.fixture()
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("KVLOOP_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "layouts"


def load(path: Path, mode: str) -> tuple[Any, list[str]]:
    """The model, and the checkpoint tensors the load read (dequantized to fp32)."""
    ckpt = load_checkpoint(path)
    stream, asked = ckpt.weights, []

    def spy(skip: Any = ()) -> Any:
        for name, w in stream(skip):
            asked.append(name)
            yield name, w

    ckpt.weights = spy
    return load_model(ckpt, pack=False, quantization=mode), asked


@pytest.fixture(scope="module")
def reference(default_gguf: Path) -> dict[str, torch.Tensor]:
    """Each mode's logits with no cache at all."""
    old = os.environ.get("KVLOOP_LAYOUT_CACHE")
    os.environ["KVLOOP_LAYOUT_CACHE"] = "0"
    try:
        return {m: logits(load(default_gguf, m)[0]) for m in ("int8", "int4")}
    finally:
        os.environ.pop("KVLOOP_LAYOUT_CACHE")
        if old is not None:
            os.environ["KVLOOP_LAYOUT_CACHE"] = old


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_second_load_reads_the_cache_and_computes_the_same(
        default_gguf: Path, cache_dir: Path, reference: dict[str, torch.Tensor],
        mode: str) -> None:
    first, asked_first = load(default_gguf, mode)
    files = list(cache_dir.glob("*.safetensors"))
    assert len(files) == 1
    assert torch.equal(logits(first), reference[mode])
    if mode == "int8":  # int8 re-quantizes every layer from the fp32 weights
        assert any(n.endswith("_proj.weight") for n in asked_first)
    second, asked = load(default_gguf, mode)
    assert not [n for n in asked if n.endswith("_proj.weight")]  # every layer from the cache
    assert torch.equal(logits(second), reference[mode])
    assert list(cache_dir.glob("*.safetensors")) == files


def damage(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "truncated":
        path.write_bytes(bytes(data[: len(data) // 2]))
    elif how == "corrupted":  # a flipped byte in the tensor data, the header intact
        data[len(data) * 3 // 4] ^= 0x5A
        path.write_bytes(bytes(data))
    elif how == "garbage":
        path.write_bytes(b"not a safetensors file")
    elif how == "empty":
        path.write_bytes(b"")


@pytest.mark.parametrize("how", ["truncated", "corrupted", "garbage", "empty"])
def test_damaged_cache_is_rebuilt(default_gguf: Path, cache_dir: Path,
                                  reference: dict[str, torch.Tensor], how: str,
                                  caplog: pytest.LogCaptureFixture) -> None:
    load(default_gguf, "int8")
    (path,) = cache_dir.glob("*.safetensors")
    damage(path, how)
    with caplog.at_level(logging.WARNING):
        model, asked = load(default_gguf, "int8")
    assert "unusable" in caplog.text and "rebuilding" in caplog.text
    assert any(n.endswith("_proj.weight") for n in asked)  # rebuilt from the checkpoint
    assert torch.equal(logits(model), reference["int8"])
    caplog.clear()
    again, asked = load(default_gguf, "int8")  # the rebuilt file is whole again
    assert "unusable" not in caplog.text
    assert not [n for n in asked if n.endswith("_proj.weight")]
    assert torch.equal(logits(again), reference["int8"])


def test_another_layouts_file_is_never_used(default_gguf: Path, cache_dir: Path,
                                            reference: dict[str, torch.Tensor],
                                            caplog: pytest.LogCaptureFixture) -> None:
    # An int8 cache file put where the int4 one belongs (a copy from elsewhere, or a
    # hash collision): its key says what it is.
    load(default_gguf, "int8")
    (int8_file,) = cache_dir.glob("*.safetensors")
    cache = layout_cache(load_checkpoint(default_gguf), "int4")
    assert cache is not None and cache.path is not None and cache.path != int8_file
    cache.path.write_bytes(int8_file.read_bytes())
    with caplog.at_level(logging.WARNING):
        model, _ = load(default_gguf, "int4")
    assert "another model file or layout" in caplog.text
    assert torch.equal(logits(model), reference["int4"])


def test_a_changed_model_file_gets_its_own_cache(default_gguf: Path, cache_dir: Path,
                                                 tmp_path: Path,
                                                 reference: dict[str, torch.Tensor]) -> None:
    copy = tmp_path / "model.gguf"
    copy.write_bytes(default_gguf.read_bytes())
    load(copy, "int8")
    before = {p.name for p in cache_dir.glob("*.safetensors")}
    os.utime(copy, ns=(1_000_000_000, 1_000_000_000))  # rewritten: another mtime
    model, asked = load(copy, "int8")
    after = {p.name for p in cache_dir.glob("*.safetensors")}
    assert len(after - before) == 1 and any(n.endswith("_proj.weight") for n in asked)
    assert torch.equal(logits(model), reference["int8"])


def test_cache_off_writes_nothing(default_gguf: Path, cache_dir: Path,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVLOOP_LAYOUT_CACHE", "0")
    load(default_gguf, "int8")
    assert not cache_dir.exists() or not list(cache_dir.iterdir())


def test_an_unwritable_cache_costs_a_warning_not_the_load(
        default_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        reference: dict[str, torch.Tensor], caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("a file where the cache directory would go")
    monkeypatch.setenv("KVLOOP_CACHE_DIR", str(blocker))
    with caplog.at_level(logging.WARNING):
        model, _ = load(default_gguf, "int8")
    assert "not written" in caplog.text
    assert torch.equal(logits(model), reference["int8"])


_LOADER = """
import sys, torch
sys.path.insert(0, {tests!r})
from test_layout_cache import load, logits
model, asked = load(__import__('pathlib').Path({model!r}), "int8")
torch.save(logits(model), {out!r})
print(sum(n.endswith("_proj.weight") for n in asked))
"""


def test_two_processes_building_at_once(default_gguf: Path, cache_dir: Path, tmp_path: Path,
                                        reference: dict[str, torch.Tensor]) -> None:
    env = {**os.environ, "KVLOOP_CACHE_DIR": str(cache_dir.parent), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen(
        [sys.executable, "-c", _LOADER.format(tests=str(Path(__file__).parent),
                                              model=str(default_gguf),
                                              out=str(tmp_path / f"{i}.pt"))],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for i in range(2)]
    for p in procs:
        _, err = p.communicate(timeout=600)
        assert p.returncode == 0, err
    for i in range(2):
        assert torch.equal(torch.load(tmp_path / f"{i}.pt"), reference["int8"])
    files = list(cache_dir.iterdir())
    assert len(files) == 1 and files[0].suffix == ".safetensors"  # no temporary left
    model, asked = load(default_gguf, "int8")  # and the file either wrote is whole
    assert not [n for n in asked if n.endswith("_proj.weight")]
    assert torch.equal(logits(model), reference["int8"])
