"""GGUF metadata arrays are bounded before they are built (issue 25, item 4).

A Python object per array entry costs ~30-100 bytes against the file's few, so a crafted
file used to multiply its size in memory before it was refused: 40M token strings peaked
at 4.0 GB, an unused 25M-value f32 key loaded at 1.46 GB. Each file here is loaded by
`kvloop generate` in a fresh process whose peak resident memory is measured.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import gguf
import pytest

from kvloop.loading.gguf_reader import GGUFHeader, SkippedArray

PEAK_LIMIT_MIB = 500


def _string(s: str) -> bytes:
    raw = s.encode()
    return struct.pack("<Q", len(raw)) + raw


def write_header(path: Path, keys: list[bytes]) -> Path:
    """A GGUF v3 file with these encoded key/value records and no tensors."""
    with open(path, "wb") as f:
        f.write(struct.pack("<IIQQ", 0x46554747, 3, 0, len(keys)))
        for record in keys:
            f.write(record)
    return path


def kv_string(key: str, value: str) -> bytes:
    return _string(key) + struct.pack("<I", gguf.GGUFValueType.STRING) + _string(value)


def kv_u32(key: str, value: int) -> bytes:
    return _string(key) + struct.pack("<II", gguf.GGUFValueType.UINT32, value)


def kv_array_header(key: str, etype: int, count: int) -> bytes:
    return _string(key) + struct.pack("<IIQ", gguf.GGUFValueType.ARRAY, etype, count)


@pytest.fixture(scope="module")
def token_bomb(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """8M one-byte token strings (72 MB) where llama.vocab_size says 49,152."""
    path = tmp_path_factory.mktemp("gguf") / "token-bomb.gguf"
    n = 8_000_000
    with open(write_header(path, [kv_string("general.architecture", "llama"),
                                  kv_u32("llama.vocab_size", 49152)]), "r+b") as f:
        f.seek(16)
        f.write(struct.pack("<Q", 3))  # one more key: the tokens
        f.seek(0, 2)
        f.write(kv_array_header("tokenizer.ggml.tokens", gguf.GGUFValueType.STRING, n))
        f.write((struct.pack("<Q", 1) + b"a") * n)
    return path


@pytest.fixture(scope="module")
def unused_floats(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An unknown key holding 25M f32 values (100 MB)."""
    path = tmp_path_factory.mktemp("gguf") / "unused-floats.gguf"
    n = 25_000_000
    with open(write_header(path, [kv_string("general.architecture", "llama")]), "r+b") as f:
        f.seek(16)
        f.write(struct.pack("<Q", 2))
        f.seek(0, 2)
        f.write(kv_array_header("attacker.blob", gguf.GGUFValueType.FLOAT32, n))
        f.write(b"\0" * (4 * n))
    return path


@pytest.fixture(scope="module")
def many_arrays(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """400 unknown keys of 65,536 uint16 values each (52 MB): each at most a per-key cap."""
    path = tmp_path_factory.mktemp("gguf") / "many-arrays.gguf"
    n, keys = 65_536, 400
    with open(write_header(path, [kv_string("general.architecture", "llama")]), "r+b") as f:
        f.seek(16)
        f.write(struct.pack("<Q", 1 + keys))
        f.seek(0, 2)
        for k in range(keys):
            f.write(kv_array_header(f"attacker.blob{k}", gguf.GGUFValueType.UINT16, n))
            f.write(b"\0" * (2 * n))
    return path


def run_measured(model: Path) -> tuple[int, str, float]:
    """`kvloop generate` on the file in a fresh process: exit status, stderr and the
    process's peak resident memory in MiB (the wrapper's only child)."""
    code = (
        "import resource, subprocess, sys, json\n"
        f"p = subprocess.run([sys.executable, '-m', 'kvloop.cli', 'generate', '--model', "
        f"{str(model)!r}, 'hi'], capture_output=True, text=True)\n"
        "peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024\n"
        "print(json.dumps([p.returncode, p.stderr, peak]))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=600, check=True)
    rc, err, peak = json.loads(out.stdout)
    return int(rc), str(err), float(peak)


def test_token_list_over_the_vocabulary_is_refused_unbuilt(token_bomb: Path) -> None:
    with pytest.raises(ValueError, match=r"tokenizer\.ggml\.tokens.*8000000 entries, more "
                                         r"than 49152"):
        GGUFHeader(token_bomb)
    rc, err, peak = run_measured(token_bomb)
    assert rc == 2, err
    assert err.startswith("kvloop: error:") and err.count("\n") == 1, err
    assert "tokenizer.ggml.tokens" in err and "Traceback" not in err
    assert peak < PEAK_LIMIT_MIB, f"peak RSS {peak:.0f} MiB"


def test_long_unknown_array_is_skipped_not_built(unused_floats: Path) -> None:
    header = GGUFHeader(unused_floats)
    assert header.metadata["attacker.blob"] == SkippedArray(gguf.GGUFValueType.FLOAT32,
                                                            25_000_000)
    rc, err, peak = run_measured(unused_floats)
    assert rc == 2, err  # no tensors: refused, as one line
    assert err.startswith("kvloop: error:") and err.count("\n") == 1, err
    assert peak < PEAK_LIMIT_MIB, f"peak RSS {peak:.0f} MiB"


def test_tokens_beyond_the_embedding_rows_are_refused(tmp_path: Path) -> None:
    """Without a vocab_size key, the token embedding's rows bound the token list."""
    import numpy as np

    path = tmp_path / "more-tokens-than-rows.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_token_list([f"t{i}" for i in range(20)])
    w.add_tensor("token_embd.weight", np.zeros((16, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="20 entries, more than the token embedding's 16"):
        GGUFHeader(path)


def test_many_arrays_share_one_budget(many_arrays: Path) -> None:
    """The budget holds over the whole header: the first array fits it, the other 399 are
    skipped, so the file's memory is not its size times an entry's Python cost."""
    header = GGUFHeader(many_arrays)
    assert header.metadata["attacker.blob0"] == [0] * 65_536
    skipped = [k for k, v in header.metadata.items() if isinstance(v, SkippedArray)]
    assert len(skipped) == 399
    rc, err, peak = run_measured(many_arrays)
    assert rc == 2, err
    assert err.startswith("kvloop: error:") and err.count("\n") == 1, err
    assert peak < PEAK_LIMIT_MIB, f"peak RSS {peak:.0f} MiB"
