"""Hugging Face model directories: config.json and *.safetensors."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from kvloop.config import ModelConfig
from kvloop.errors import ModelLoadError
from kvloop.models.registry import get_architecture


def is_hf_dir(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file()


# ModelConfig field -> the config.json key it is read from, for messages.
CONFIG_KEYS = {
    "vocab_size": "vocab_size",
    "hidden_size": "hidden_size",
    "intermediate_size": "intermediate_size",
    "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "max_position_embeddings": "max_position_embeddings",
    "rms_norm_eps": "rms_norm_eps",
    "rope_theta": "rope_theta",
}


def _int(cfg: Mapping[str, Any], key: str, where: Path, default: int | None = None) -> int:
    """A positive integer from config.json, or one ModelLoadError line naming key and value."""
    value = cfg.get(key)
    if value is None:
        value = default
    if value is None:
        raise ModelLoadError(f"{where}: {key} is missing")
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ModelLoadError(f"{where}: {key} = {value!r:.60}: must be a positive integer")
    return value


def _float(cfg: Mapping[str, Any], key: str, where: Path, default: float) -> float:
    value = cfg.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) \
            or not math.isfinite(value) or value <= 0:
        raise ModelLoadError(f"{where}: {key} = {value!r:.60}: must be a positive number")
    return float(value)


def read_config(path: Path) -> ModelConfig:
    """config.json -> ModelConfig: each hyper-parameter present, of the right type and
    positive; upper limits and agreement with the tensors are loader.check_model's job."""
    where = path / "config.json"
    try:
        cfg = json.loads(where.read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read {where}: {e}") from e
    if not isinstance(cfg, dict):
        raise ModelLoadError(f"{where} is not a JSON object")
    model_type = cfg.get("model_type", "")
    arch = get_architecture(str(model_type), str(where))
    n_heads = _int(cfg, "num_attention_heads", where)
    hidden = _int(cfg, "hidden_size", where)
    if cfg.get("head_dim") is None and hidden % n_heads:
        raise ModelLoadError(f"{where}: hidden_size = {hidden} is not a multiple of "
                             f"num_attention_heads = {n_heads}")
    eos = cfg.get("eos_token_id")
    gen_path = path / "generation_config.json"
    if gen_path.is_file():
        try:
            gen = json.loads(gen_path.read_text())
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"cannot read {gen_path}: {e}") from e
        if isinstance(gen, dict):
            eos = gen.get("eos_token_id", eos)
    eos_ids = eos if isinstance(eos, list) else ([eos] if eos is not None else [])
    rope_scaling = cfg.get("rope_scaling") or None
    rope_params = cfg.get("rope_parameters") or {}
    if not isinstance(rope_params, dict):
        raise ModelLoadError(f"{where}: rope_parameters = {rope_params!r:.60}: must be an object")
    # Newer transformers write rope_theta inside rope_parameters.
    theta_cfg = cfg if "rope_theta" in cfg else {
        "rope_theta": rope_params.get("rope_theta", 10000.0)}
    if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
        rope_scaling = rope_params
    if rope_scaling is not None and not isinstance(rope_scaling, dict):
        raise ModelLoadError(f"{where}: rope_scaling = {rope_scaling!r:.60}: must be an object")
    bos = cfg.get("bos_token_id")
    config = ModelConfig(
        architecture=arch.name,
        vocab_size=_int(cfg, "vocab_size", where),
        hidden_size=hidden,
        intermediate_size=_int(cfg, "intermediate_size", where),
        num_layers=_int(cfg, "num_hidden_layers", where),
        num_heads=n_heads,
        num_kv_heads=_int(cfg, "num_key_value_heads", where, n_heads),
        head_dim=_int(cfg, "head_dim", where, hidden // n_heads),
        max_position_embeddings=_int(cfg, "max_position_embeddings", where, 2048),
        rms_norm_eps=_float(cfg, "rms_norm_eps", where, 1e-5),
        rope_theta=_float(theta_cfg, "rope_theta", where, 10000.0),
        rope_scaling=rope_scaling,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", False)),
        bos_token_id=bos if isinstance(bos, int) and not isinstance(bos, bool) else None,
        eos_token_ids=tuple(e for e in eos_ids if isinstance(e, int) and not isinstance(e, bool)),
    )
    return arch.hf_config(_Reader(cfg, where), config)


class _Reader:
    """config.json as an Architecture's ConfigReader."""

    def __init__(self, cfg: Mapping[str, Any], where: Path) -> None:
        self.cfg, self.path = cfg, where

    def get(self, key: str, default: Any = None) -> Any:
        value = self.cfg.get(key)
        return default if value is None else value

    def get_int(self, key: str, default: int | None = None) -> int:
        return _int(self.cfg, key, self.path, default)

    def get_float(self, key: str, default: float) -> float:
        value = self.cfg.get(key)
        return _float(self.cfg if value is not None else {}, key, self.path, default)

    def where(self, key: str) -> str:
        return f"{self.path}: {key}"


def tensor_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in the directory's *.safetensors, from their headers:
    nothing is loaded."""
    shapes: dict[str, tuple[int, ...]] = {}
    for file in sorted(path.glob("*.safetensors")):
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    shapes[name] = tuple(int(d) for d in f.get_slice(name).get_shape())
        except Exception as e:  # a truncated or corrupt header: name it, no traceback
            raise ModelLoadError(f"{file} is not a readable safetensors file: {e}") from e
    return shapes


def tensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors weights in {path}")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, f.get_tensor(name).float()
