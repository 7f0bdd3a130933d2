"""One entry point for every checkpoint format: a path (or nothing, for the default model)
in, a `Checkpoint` out: the config dataclass, a weight stream, and the tokenizer."""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kvloop.config import ModelConfig
from kvloop.errors import ModelLoadError
from kvloop.loading import safetensors as st
from kvloop.loading.default_model import (  # noqa: F401  (re-exported)
    DEFAULT_MODEL_FILE,
    DEFAULT_MODEL_NAME,
    DEFAULT_MODEL_PACKAGE,
    default_model_path,
)
from kvloop.loading.gguf import GGUFFile, is_gguf
from kvloop.loading.layout_cache import LayoutCache
from kvloop.loading.tokenizer import Tokenizer
from kvloop.models.base import config_dims
from kvloop.models.registry import get_architecture
from kvloop.quant import Int4Weights
from kvloop.quant.stored import Weights

# Upper limits on a model's hyper-parameters, checked before anything is allocated: a model
# file is untrusted input, and these numbers size tables and loops. Each is far above every
# released checkpoint of the families kvloop runs (largest in brackets) and far below sizes
# that would exhaust memory before the tensors are even compared.
MAX_CONTEXT = 2**20  # [1,010,000: Qwen2.5-1M] positions; the rope table is built for all
MAX_VOCAB = 2**21  # [262,144: Gemma 3]
MAX_HIDDEN = 2**16  # [16,384: Llama 3.1 405B]
MAX_INTERMEDIATE = 2**18  # [53,248: Llama 3.1 405B]
MAX_LAYERS = 2**10  # [126: Llama 3.1 405B]
MAX_HEADS = 2**10  # [128]
MAX_HEAD_DIM = 2**10  # [256]
# The rope table (cos and sin, fp32, [context, head_dim] each) is built whole at load (the
# native decoder reads it whole), so its size is bounded on its own: 2 GiB is 2**20
# positions of head_dim 256, and refuses e.g. 2**20 positions of head_dim 1024.
MAX_ROPE_TABLE_BYTES = 2**31
_LIMITS = {
    "vocab_size": MAX_VOCAB, "hidden_size": MAX_HIDDEN, "intermediate_size": MAX_INTERMEDIATE,
    "num_layers": MAX_LAYERS, "num_heads": MAX_HEADS, "num_kv_heads": MAX_HEADS,
    "head_dim": MAX_HEAD_DIM, "max_position_embeddings": MAX_CONTEXT,
}
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


@dataclass
class Checkpoint:
    name: str
    path: Path
    config: ModelConfig
    tokenizer: Tokenizer
    # (HF name, fp32 tensor) of every weight but those named in the argument (layers
    # already built from their stored codes), read as the stream is consumed.
    weights: Callable[..., Iterator[tuple[str, torch.Tensor]]]
    # GGUF Q4_0 / Q4_1 tensors as stored (4-bit codes + group scales), for int4 layers.
    int4_weights: Callable[[], Mapping[str, Int4Weights]] = dict
    # Every linear tensor in a GGUF block format, as stored (codes + group scales), for
    # quantization "gguf"; and whether there are any (what "auto" resolves on). Mappings
    # that read a tensor when it is looked up.
    block_weights: Callable[[], Mapping[str, Weights]] = dict
    quantized_linears: bool = False
    tensor_names: frozenset[str] = frozenset()  # HF names of the tensors the file holds
    # Drops the file's pages from the process's resident set once the model holds what it
    # needs (a GGUF file's map: its header and the pages that blocks shared at tensor
    # edges, ~15 MiB of Gemma 3's). Reading again faults them back in.
    release: Callable[[], None] = lambda: None


def check_model(
    config: ModelConfig,
    shapes: Mapping[str, tuple[int, ...]],
    keys: Mapping[str, str],
    source: str,
    tensor_name: Callable[[str], str] = lambda name: name,
) -> None:
    """Refuse a model whose hyper-parameters are out of bounds, disagree with each other, or
    disagree with the file's tensors, before anything is allocated for it.

    `shapes` maps HF tensor names to shapes (from file headers), `keys` maps ModelConfig
    fields to the metadata keys they came from, `tensor_name` spells a tensor as the file
    does: every failure is one ModelLoadError line naming the key and its value.
    """
    c = config

    def key(field: str) -> str:
        return f"{keys.get(field, field)} = {getattr(c, field)}"

    def refuse(problem: str) -> ModelLoadError:
        return ModelLoadError(f"{source}: {problem}")

    for field, limit in _LIMITS.items():
        value = getattr(c, field)
        if not 0 < value <= limit:
            raise refuse(f"{key(field)} is out of range (1 to {limit})")
    if c.num_kv_heads > c.num_heads or c.num_heads % c.num_kv_heads:
        raise refuse(f"{key('num_kv_heads')} does not divide {key('num_heads')}")
    if c.head_dim % 2:
        raise refuse(f"{key('head_dim')} is odd (rotary embeddings rotate pairs)")
    # Sliding layers of Gemma have a table of their own (another rope base).
    tables = 1 if c.rope_local_theta is None else 2
    rope_bytes = tables * 2 * 4 * c.max_position_embeddings * c.head_dim
    if rope_bytes > MAX_ROPE_TABLE_BYTES:
        raise refuse(f"{key('max_position_embeddings')} with {key('head_dim')} needs a "
                     f"{rope_bytes / 2**30:.1f} GiB rope table (limit "
                     f"{MAX_ROPE_TABLE_BYTES / 2**30:g} GiB)")
    if c.sliding_window is not None and not 0 < c.sliding_window <= MAX_CONTEXT:
        raise refuse(f"{key('sliding_window')} is out of range (1 to {MAX_CONTEXT})")
    for field in ("rms_norm_eps", "rope_theta"):
        if not (math.isfinite(getattr(c, field)) and getattr(c, field) > 0):
            raise refuse(f"{key(field)} must be a positive number")
    _check_rope_scaling(c.rope_scaling, refuse)
    _check_shapes(c, shapes, key, refuse, tensor_name)


def _check_rope_scaling(scaling: dict | None, refuse: Callable[[str], ModelLoadError]) -> None:
    if not scaling:
        return
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    needs = {"default": (), "linear": ("factor",),
             "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                        "original_max_position_embeddings")}
    if kind not in needs:
        raise refuse(f"rope_scaling type {kind!r} is not supported (kvloop reads "
                     f"{sorted(needs)})")
    for name in needs[kind]:
        value = scaling.get(name)
        if isinstance(value, bool) or not isinstance(value, int | float) \
                or not math.isfinite(value) or value <= 0:
            raise refuse(f"rope_scaling {name} = {value!r:.60} must be a positive number")
    if kind == "llama3" and scaling["high_freq_factor"] == scaling["low_freq_factor"]:
        raise refuse("rope_scaling high_freq_factor must differ from low_freq_factor")


def _check_shapes(
    c: ModelConfig,
    shapes: Mapping[str, tuple[int, ...]],
    key: Callable[[str], str],
    refuse: Callable[[str], ModelLoadError],
    tensor_name: Callable[[str], str],
) -> None:
    """Each tensor the config implies is in the file with the shape the config implies."""
    if not shapes:
        raise refuse("the file has no tensors kvloop can use (no weights)")
    layers_present = {int(m.group(1)) for n in shapes if (m := _LAYER.match(n))}
    if max(layers_present, default=-1) >= c.num_layers:
        extra = min(i for i in layers_present if i >= c.num_layers)
        raise refuse(f"{key('num_layers')}, but the file has tensors for layer {extra}")
    if len(layers_present) < c.num_layers:
        raise refuse(f"{key('num_layers')}, but the file has tensors for "
                     f"{len(layers_present)} layers")
    # Dimensions as (value, the fields that set it), for the messages.
    expected = get_architecture(c.architecture).tensor_shapes(c)
    if "model.rope_freqs" in shapes:
        expected["model.rope_freqs"] = (config_dims(c)["D2"],)
    for name, dims in expected.items():
        want = tuple(d for d, _ in dims)
        if name not in shapes:
            raise refuse(f"tensor {tensor_name(name)} is missing")
        got = shapes[name]
        if tuple(got) != want:
            fields = dict.fromkeys(f for _, fs in dims for f in fs)
            raise refuse(
                f"tensor {tensor_name(name)} has shape {list(got)}, but "
                f"{', '.join(key(f) for f in fields)} make it {list(want)}"
            )


class _LayoutMerges:
    """A GGUF file's derived tokenizer merges (Tokenizer.MergesCache) in the layout cache,
    keyed like its weight layouts by the file's identity: int32 pairs of token ids."""

    DERIVATION = 1  # bump when tokenizer._derive_merges gives other merges

    def __init__(self, path: Path) -> None:
        self._path = path

    @functools.cached_property
    def _cache(self) -> LayoutCache:  # built once: its key reads and hashes the file's edges
        return LayoutCache(self._path, {"tokenizer merges": self.DERIVATION})

    def load(self) -> np.ndarray | None:
        tensors = self._cache.load()
        pairs = tensors.get("merges") if tensors is not None else None
        return None if pairs is None else pairs.numpy()

    def save(self, pairs: list[list[int]]) -> None:
        self._cache.save({"merges": torch.tensor(pairs, dtype=torch.int32).reshape(-1, 2)})


def load_checkpoint(model: str | Path | None = None) -> Checkpoint:
    """Open a model: its config checked against limits and its tensors' shapes (from the
    headers), then its tokenizer (chat template tried under its limits). Weights load
    later, when the Checkpoint's `weights` is called."""
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
        shapes = st.tensor_shapes(path)
        check_model(config, shapes, st.CONFIG_KEYS, str(path))
        tokenizer = Tokenizer.from_hf_dir(path)
        hf_path = path
        return Checkpoint(name, path, config, tokenizer,
                          lambda skip=(): ((n, w) for n, w in st.tensors(hf_path) if n not in skip),
                          tensor_names=frozenset(shapes))
    if not is_gguf(path):
        raise ModelLoadError(f"{path} is not a GGUF file or a Hugging Face model directory")
    f = GGUFFile(path)
    config = f.config()
    f.check_tensors()  # an unsupported type is named as such, not as a shape problem
    shapes = f.tensor_shapes()
    check_model(config, shapes, f.config_keys(), path.name, f.gguf_name)
    tokenizer = Tokenizer.from_gguf_metadata(f.metadata, _LayoutMerges(path))
    f.drop_vocabulary()
    return Checkpoint(name, path, config, tokenizer, lambda skip=(): f.tensors(config, skip),
                      lambda: f.int4_weights(config), lambda: f.block_weights(config),
                      f.quantized_linears(), frozenset(shapes), f.reader.release)
