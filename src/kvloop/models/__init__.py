"""Model architectures. Each maps (token ids, positions, attention metadata, KV caches) to
hidden states and logits, and knows nothing of requests or scheduling. One module per
architecture (llama.py, gemma3.py); registry.py lists them."""

from typing import cast

from kvloop.config import ModelConfig
from kvloop.models.attention import AttentionMetadata, PrefillSegment
from kvloop.models.base import Architecture, CausalLM
from kvloop.models.gemma3 import Gemma3ForCausalLM
from kvloop.models.llama import LlamaForCausalLM
from kvloop.models.registry import ARCHITECTURES, create_model, get_architecture


def build_model(config: ModelConfig) -> LlamaForCausalLM:
    """`create_model`, typed as the engine and runner still expect it. Every registered
    class offers LlamaForCausalLM's interface (`CausalLM`), so the cast holds for what
    they call; it goes when they take CausalLM."""
    return cast(LlamaForCausalLM, create_model(config))


__all__ = ["ARCHITECTURES", "Architecture", "AttentionMetadata", "CausalLM",
           "Gemma3ForCausalLM", "LlamaForCausalLM", "PrefillSegment", "build_model",
           "create_model", "get_architecture"]
