"""kvloop.loading.gguf_reader against the `gguf` package's own reader: the same metadata
values and the same tensor bytes, on the real default model and on crafted files; and one
ValueError line for every broken header."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from kvloop.loading.gguf_reader import GGUFHeader


def reference(path: Path) -> tuple[dict[str, Any], list[gguf.ReaderTensor]]:
    r = gguf.GGUFReader(path)
    meta = {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}
    return meta, r.tensors


def assert_same_as_gguf(path: Path) -> None:
    meta, tensors = reference(path)
    h = GGUFHeader(path)
    assert h.metadata.keys() == meta.keys()
    for k, v in meta.items():
        got = h.metadata[k]
        assert type(got) is type(v), k
        if isinstance(v, float):  # NaN == NaN here
            assert struct.pack("<d", got) == struct.pack("<d", v), k
        else:
            assert got == v, k
    assert [t.name for t in h.tensors] == [t.name for t in tensors]
    for mine, ref in zip(h.tensors, tensors, strict=True):
        assert mine.tensor_type == ref.tensor_type
        assert mine.shape == tuple(int(d) for d in ref.shape)
        assert mine.offset == ref.data_offset and mine.nbytes == ref.n_bytes
        assert mine.data.dtype == ref.data.dtype and mine.data.shape == ref.data.shape
        assert np.array_equal(mine.data.view(np.uint8), ref.data.view(np.uint8))


@pytest.mark.slow
def test_default_model_reads_as_gguf_reads_it(default_gguf: Path) -> None:
    assert_same_as_gguf(default_gguf)


def crafted(path: Path, alignment: int | None = None) -> Path:
    w = gguf.GGUFWriter(str(path), "llama")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    w.add_uint8("t.u8", 255)
    w.add_int8("t.i8", -128)
    w.add_uint16("t.u16", 65535)
    w.add_int16("t.i16", -32768)
    w.add_uint32("t.u32", 2**32 - 1)
    w.add_int32("t.i32", -(2**31))
    w.add_uint64("t.u64", 2**64 - 1)
    w.add_int64("t.i64", -(2**63))
    w.add_float32("t.f32", 1.5)
    w.add_float64("t.f64", float("nan"))
    w.add_bool("t.bool", True)
    w.add_string("t.str", "caf\u00e9 \u4f60\u597d")
    w.add_string("t.empty", "")
    w.add_array("t.strs", ["a", "", "\u00e9\u00e9", "<|im_end|>"] * 50)
    w.add_array("t.ints", list(range(-5, 300)))
    w.add_array("t.floats", [0.25, -1.0, 3.0])
    w.add_array("t.empty_array", [])
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((3, 64)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((5, 32)).astype(np.float16))
    w.add_tensor("vec", rng.standard_normal(7).astype(np.float32))
    q = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32),
                             gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("q8", q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("alignment", [None, 64, 1])
def test_crafted_file_reads_as_gguf_reads_it(tmp_path: Path, alignment: int | None) -> None:
    assert_same_as_gguf(crafted(tmp_path / "t.gguf", alignment))


def _header(n_tensors: int, n_kv: int, version: int = 3) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_kv)


def _str(s: bytes) -> bytes:
    return struct.pack("<Q", len(s)) + s


@pytest.mark.parametrize(("data", "words"), [
    (b"", "empty"),
    (b"GGUX" + b"\0" * 20, "magic"),
    (_header(0, 0, version=1), "version 1"),
    (_header(0, 2**60), "past the end"),
    (_header(2**60, 0), "past the end"),
    (_header(0, 1) + struct.pack("<Q", 2**62), "past the end"),  # key length
    (_header(0, 1) + _str(b"k") + struct.pack("<I", 99), "unknown value type"),
    (_header(0, 1) + _str(b"k") + struct.pack("<IIQ", 9, 8, 2**40), "past the end"),
    (_header(0, 1) + _str(b"k") + struct.pack("<IIQ", 9, 4, 2**40), "past the end"),
    (_header(0, 1) + _str(b"k") + struct.pack("<I", 8) + _str(b"\xff\xfe"), "UTF-8"),
    (_header(0, 2) + (_str(b"k") + struct.pack("<IB", 0, 1)) * 2, "duplicate metadata"),
    (_header(0, 1) + _str(b"general.alignment") + struct.pack("<II", 4, 3), "power of two"),
    (_header(1, 0) + _str(b"t") + struct.pack("<I", 9) + b"\0" * 64, "dimensions"),
    (_header(1, 0) + _str(b"t") + struct.pack("<IQIQ", 1, 4, 999, 0) + b"\0" * 16,
     "unknown type"),
    (_header(1, 0) + _str(b"t") + struct.pack("<IQIQ", 1, 2**40, 0, 0) + b"\0" * 16,
     "past the end"),
    (_header(1, 0) + _str(b"t") + struct.pack("<IQIQ", 1, 33, 8, 0) + b"\0" * 64,
     "whole Q8_0 blocks"),
    (_header(2, 0) + (_str(b"t") + struct.pack("<IQIQ", 1, 4, 0, 0)) * 2 + b"\0" * 64,
     "duplicate tensor"),
])
def test_broken_header_is_one_value_error(tmp_path: Path, data: bytes, words: str) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(data)
    with pytest.raises(ValueError, match=words) as e:
        GGUFHeader(path)
    assert "\n" not in str(e.value)
