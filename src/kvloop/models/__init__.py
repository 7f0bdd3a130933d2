"""Model architectures. Each maps (token ids, positions, attention metadata, KV caches) to
hidden states and logits, and knows nothing of requests or scheduling. One module per
architecture (llama.py, gemma3.py); registry.py lists them."""

from kvloop.models.attention import AttentionMetadata, PrefillSegment
from kvloop.models.base import Architecture, CausalLM
from kvloop.models.gemma3 import Gemma3ForCausalLM
from kvloop.models.llama import LlamaForCausalLM
from kvloop.models.registry import ARCHITECTURES, create_model, get_architecture

__all__ = ["ARCHITECTURES", "Architecture", "AttentionMetadata", "CausalLM",
           "Gemma3ForCausalLM", "LlamaForCausalLM", "PrefillSegment",
           "create_model", "get_architecture"]
