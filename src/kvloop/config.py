"""Configuration dataclasses. Imports nothing of kvloop.

``ModelConfig`` is the one place a model's hyper-parameters live: the loader fills it from
GGUF metadata or ``config.json``; the model reads it and nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # "llama", "mistral", "qwen2", ...
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # HF-style rope scaling dict ({"rope_type": "llama3", "factor": ...}) or None.
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: biases on q/k/v projections
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def num_params(self) -> int:
        """Parameters of the transformer (embedding counted once when tied)."""
        d, f, L = self.hidden_size, self.intermediate_size, self.num_layers
        per_layer = d * (self.q_size + 2 * self.kv_size) + self.q_size * d + 3 * d * f + 2 * d
        emb = self.vocab_size * d
        head = 0 if self.tie_word_embeddings else self.vocab_size * d
        return L * per_layer + emb + head + d


def parse_size(text: str | int) -> int:
    """'2GiB' / '512MB' / '1.5G' / 1048576 -> bytes."""
    if isinstance(text, int):
        return text
    s = text.strip().upper().replace(" ", "")
    units = {"TIB": 2**40, "GIB": 2**30, "MIB": 2**20, "KIB": 2**10,
             "TB": 10**12, "GB": 10**9, "MB": 10**6, "KB": 10**3,
             "T": 2**40, "G": 2**30, "M": 2**20, "K": 2**10, "B": 1}
    for unit, mult in units.items():
        if s.endswith(unit):
            return int(float(s[: -len(unit)]) * mult)
    return int(float(s))


@dataclass(frozen=True)
class EngineConfig:
    """How the engine runs a model: cache, batching, threads."""

    use_cache: bool = True
    block_size: int = 16
    kv_cache_memory: int | str = 2 * 2**30  # bytes (or "2GiB") for all K and V blocks
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    max_model_len: int | None = None  # defaults to the model's context
    num_threads: int | None = None
    # Reorder linear weights for oneDNN (faster); False keeps F.linear, the reference path.
    pack_weights: bool = True
    # Native C++ kernels (paged attention), built at first use; False: PyTorch only.
    use_kernels: bool = True
    # Weight-only quantization of the linear layers: "none" (fp32), "int8" or "int4".
    quantization: str = "none"
