"""Model architectures. Each maps (token ids, positions, attention metadata, KV caches) to
hidden states and logits, and knows nothing of requests or scheduling."""

from kvloop.config import ModelConfig
from kvloop.models.attention import AttentionMetadata, PrefillSegment
from kvloop.models.llama import LlamaForCausalLM

# Llama, Mistral and Qwen2 share one implementation; Qwen2 differs only by q/k/v biases,
# which the config's attention_bias flag switches on.
ARCHITECTURES = {"llama": LlamaForCausalLM, "mistral": LlamaForCausalLM, "qwen2": LlamaForCausalLM}


def build_model(config: ModelConfig) -> LlamaForCausalLM:
    return ARCHITECTURES[config.architecture](config)


__all__ = ["AttentionMetadata", "LlamaForCausalLM", "PrefillSegment", "build_model"]
