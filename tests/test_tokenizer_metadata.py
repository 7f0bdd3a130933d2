"""Malformed tokenizer metadata (issue 25, item 5): a tokenizer field of the wrong type, an
embedded tokenizer.json that does not parse, merges of tokens the vocabulary lacks: each is
one `kvloop: error:` line naming the key and exit status 2, from `kvloop generate` and from
`kvloop serve` at start, never a traceback."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import gguf
import pytest
from tokenizers import pre_tokenizers

from conftest import write_gguf
from kvloop.errors import ModelLoadError
from kvloop.loading.gguf import GGUFFile
from kvloop.loading.tokenizer import Tokenizer
from test_hostile_files import GOOD_METADATA, good_tensors

ALPHABET = sorted(pre_tokenizers.ByteLevel.alphabet())  # 256 byte-level tokens: ids 0..255

# case -> (tokenizer keys to write over the good ones, the key the error must name)
BAD_FIELDS: dict[str, tuple[dict[str, Any], str]] = {
    "bos_string": ({"tokenizer.ggml.bos_token_id": "1"}, "tokenizer.ggml.bos_token_id"),
    "eos_array": ({"tokenizer.ggml.eos_token_id": [1, 2]}, "tokenizer.ggml.eos_token_id"),
    "hf_json_invalid": ({"tokenizer.huggingface.json": "{not json"},
                        "tokenizer.huggingface.json"),
    "merges_not_covered": ({"tokenizer.ggml.merges": ["zz qq"]}, "tokenizer.ggml.merges"),
    "chat_template_int": ({"tokenizer.chat_template": 5}, "tokenizer.chat_template"),
    "token_type_strings": ({"tokenizer.ggml.token_type": ["x"] * len(ALPHABET)},
                           "tokenizer.ggml.token_type"),
    "add_bos_string": ({"tokenizer.ggml.add_bos_token": "yes"}, "tokenizer.ggml.add_bos_token"),
}


def add_value(w: gguf.GGUFWriter, key: str, value: Any) -> None:
    """Write `value` under `key` with the GGUF type its Python type suggests."""
    if isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, str):
        w.add_string(key, value)
    elif isinstance(value, int):
        w.add_uint32(key, value)
    else:
        w.add_array(key, value)


def write_tokenizer_gguf(path: Path, changes: dict[str, Any]) -> Path:
    """The tiny Llama of test_hostile_files with a byte-level tokenizer whose keys `changes`
    replaces."""
    tokenizer = {
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt2",
        "tokenizer.ggml.tokens": ALPHABET,
        "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2, **changes,
    }

    def add(w: gguf.GGUFWriter) -> None:
        for key, value in {**GOOD_METADATA, **tokenizer}.items():
            add_value(w, key, value)

    entries = [(name, data, None) for name, data in good_tensors().items()]
    return write_gguf(path, entries, "llama", add)


def run_kvloop(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONIOENCODING": "utf-8"}
    return subprocess.run([sys.executable, "-m", "kvloop.cli", *args], capture_output=True,
                          text=True, timeout=timeout, env=env, check=False)


def assert_one_error_line(proc: subprocess.CompletedProcess[str], key: str) -> None:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in lines if line.startswith("kvloop: error:")]
    assert len(errors) == 1 and key in errors[0], proc.stderr


def test_the_baseline_tokenizer_loads(tmp_path: Path) -> None:
    """The helper's file is good: every refusal below comes from its one bad field."""
    path = write_tokenizer_gguf(tmp_path / "good.gguf", {})
    tok = Tokenizer.from_gguf_metadata(GGUFFile(path).metadata)
    assert tok.bos_token_id == 1 and tok.eos_token_ids == (2,)


@pytest.mark.parametrize("case", BAD_FIELDS)
def test_bad_field_is_a_model_load_error_naming_the_key(tmp_path: Path, case: str) -> None:
    changes, key = BAD_FIELDS[case]
    metadata = GGUFFile(write_tokenizer_gguf(tmp_path / "bad.gguf", changes)).metadata
    with pytest.raises(ModelLoadError) as info:
        Tokenizer.from_gguf_metadata(metadata)
    assert key in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("case", BAD_FIELDS)
def test_generate_on_a_bad_field_is_one_error_line(tmp_path: Path, case: str) -> None:
    changes, key = BAD_FIELDS[case]
    path = write_tokenizer_gguf(tmp_path / "bad.gguf", changes)
    assert_one_error_line(run_kvloop("generate", "hi", "--model", str(path)), key)


@pytest.mark.parametrize("case", ["eos_array", "merges_not_covered", "chat_template_int"])
def test_serve_on_a_bad_field_is_one_error_line_at_start(tmp_path: Path, case: str) -> None:
    changes, key = BAD_FIELDS[case]
    path = write_tokenizer_gguf(tmp_path / "bad.gguf", changes)
    assert_one_error_line(run_kvloop("serve", "--model", str(path), "--port", "0"), key)


# --- a Hugging Face directory: the same reads of tokenizer_config / generation_config ------------
# case -> (file, keys to write over its own, the key the error must name)
BAD_HF_FIELDS: dict[str, tuple[str, dict[str, Any], str]] = {
    "eos_string": ("generation_config.json", {"eos_token_id": "2"}, "eos_token_id"),
    "eos_strings": ("generation_config.json", {"eos_token_id": ["x"]}, "eos_token_id"),
    "chat_template_int": ("tokenizer_config.json", {"chat_template": 5}, "chat_template"),
    "add_bos_string": ("tokenizer_config.json", {"add_bos_token": "yes"}, "add_bos_token"),
    "bos_int": ("tokenizer_config.json", {"bos_token": 5}, "bos_token"),
}


def hf_copy(tiny_model_dir: Path, dest: Path, file: str, changes: dict[str, Any]) -> Path:
    shutil.copytree(tiny_model_dir, dest)
    path = dest / file
    values = json.loads(path.read_text()) if path.is_file() else {}
    path.write_text(json.dumps({**values, **changes}))
    return dest


@pytest.mark.parametrize("case", BAD_HF_FIELDS)
def test_bad_hf_tokenizer_field_names_file_and_key(tiny_model_dir: Path, tmp_path: Path,
                                                   case: str) -> None:
    file, changes, key = BAD_HF_FIELDS[case]
    with pytest.raises(ModelLoadError) as info:
        Tokenizer.from_hf_dir(hf_copy(tiny_model_dir, tmp_path / "hf", file, changes))
    assert f"{file}: {key}" in str(info.value) and "\n" not in str(info.value)


def test_chat_template_file_not_utf8_is_one_error(tiny_model_dir: Path, tmp_path: Path) -> None:
    d = hf_copy(tiny_model_dir, tmp_path / "hf", "tokenizer_config.json", {})
    (d / "chat_template.jinja").write_bytes(b"{{ '\xff' }}")
    with pytest.raises(ModelLoadError, match=r"chat_template\.jinja"):
        Tokenizer.from_hf_dir(d)


def test_generate_on_a_bad_hf_field_is_one_error_line(tiny_model_dir: Path,
                                                      tmp_path: Path) -> None:
    file, changes, key = BAD_HF_FIELDS["eos_string"]
    d = hf_copy(tiny_model_dir, tmp_path / "hf", file, changes)
    assert_one_error_line(run_kvloop("generate", "hi", "--model", str(d)), key)
