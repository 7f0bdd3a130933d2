"""The one list of architectures kvloop runs. The loader reads checkpoints through it, the
engine builds models from it, the native step asks it whether it can run a model."""

from __future__ import annotations

from kvloop.config import ModelConfig
from kvloop.errors import ModelLoadError
from kvloop.models import gemma2, gemma3, llama, phi3, qwen3
from kvloop.models.base import Architecture, CausalLM

# GGUF general.architecture values and HF model_type values, each to its record.
ARCHITECTURES: dict[str, Architecture] = {
    a.name: a for family in (llama, qwen3, phi3, gemma2, gemma3) for a in family.ARCHITECTURES
}


def get_architecture(name: str, source: str = "") -> Architecture:
    """The record for `name`, or one ModelLoadError naming it and listing what is
    supported (`source` says where the name was read)."""
    arch = ARCHITECTURES.get(name)
    if arch is None:
        where = f" in {source}" if source else ""
        raise ModelLoadError(
            f"unsupported architecture {name!r}{where}; kvloop runs {sorted(ARCHITECTURES)}")
    return arch


def create_model(config: ModelConfig) -> CausalLM:
    """An uninitialised model of the config's architecture (load_weights fills it)."""
    return get_architecture(config.architecture).model_class(config)
