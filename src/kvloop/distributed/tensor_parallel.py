"""The shard plan: which part of each layer a rank holds, and the model cut down to it.

Column-parallel (each rank computes some output features, no communication): the fused
q/k/v projection, split by KV-head groups (a rank takes whole GQA groups: its KV heads and
the query heads that read them), and the fused gate/up projection, split by MLP columns.
Row-parallel (each rank computes a partial sum over its input features, then one
all-reduce): o_proj and down_proj; a bias there is added on rank 0 only. The embedding,
the norms and the head are replicated on every rank.

Splits need not be even: the default model's 3 KV heads go 2 + 1 over two ranks (its 9
query heads 6 + 3), and its MLP columns as evenly as they divide. What cannot be split is
refused: fewer KV heads (or MLP columns) than ranks.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import cast

import torch
import torch.distributed as dist
from torch import nn

from kvloop.config import ModelConfig
from kvloop.errors import InvalidParamsError
from kvloop.models import CausalLM, create_model
from kvloop.models.linear import Linear
from kvloop.models.llama import MLP, Attention


def split_sizes(total: int, parts: int) -> list[int]:
    """`total` items over `parts` ranks as evenly as they go, the larger shares first (so
    rank 0, whose pool size the scheduler plans with, holds the most)."""
    base, extra = divmod(total, parts)
    return [base + (1 if r < extra else 0) for r in range(parts)]


@dataclass(frozen=True)
class ShardPlan:
    """What rank `rank` of `world_size` holds of every layer: KV heads [kv_start, kv_start +
    num_kv_heads) with their query heads, MLP columns [inter_start, inter_start +
    intermediate_size)."""

    rank: int
    world_size: int
    kv_start: int
    num_kv_heads: int
    q_start: int
    num_heads: int
    inter_start: int
    intermediate_size: int

    @classmethod
    def of(cls, config: ModelConfig, rank: int, world_size: int) -> ShardPlan:
        check_tensor_parallel(config, world_size)
        group = config.num_heads // config.num_kv_heads  # query heads per KV head
        kv = split_sizes(config.num_kv_heads, world_size)
        inter = split_sizes(config.intermediate_size, world_size)
        kv_start = sum(kv[:rank])
        inter_start = sum(inter[:rank])
        return cls(rank, world_size, kv_start, kv[rank], kv_start * group, kv[rank] * group,
                   inter_start, inter[rank])

    def local_config(self, config: ModelConfig) -> ModelConfig:
        """The config of this rank's shard: its heads and MLP columns (the KV cache is
        sized and indexed by its num_kv_heads)."""
        return replace(config, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                       intermediate_size=self.intermediate_size)


def check_tensor_parallel(config: ModelConfig, world_size: int) -> None:
    """InvalidParamsError unless every rank of `world_size` gets a KV head and MLP columns."""
    if world_size < 1:
        raise InvalidParamsError(f"tensor_parallel_size must be >= 1, got {world_size}",
                                 param="tensor_parallel_size")
    if config.num_heads % config.num_kv_heads:
        raise InvalidParamsError(
            f"tensor parallelism splits by KV-head groups: num_attention_heads "
            f"{config.num_heads} is not a multiple of num_key_value_heads "
            f"{config.num_kv_heads}", param="tensor_parallel_size")
    for name, count in (("num_key_value_heads", config.num_kv_heads),
                        ("intermediate_size", config.intermediate_size)):
        if count < world_size:
            raise InvalidParamsError(
                f"tensor_parallel_size {world_size} cannot split this model: its {name} "
                f"is {count}, and each rank needs at least one", param="tensor_parallel_size")


class RowParallelLinear(Linear):
    """A row-parallel layer: this rank's partial product over its input features, summed
    over the ranks by one all-reduce. A Linear, so that packing and byte counts see it as
    any other."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        dist.all_reduce(y)
        return y


def _linear(weight: torch.Tensor, bias: torch.Tensor | None,
            cls: type[Linear] = Linear) -> Linear:
    out_features, in_features = weight.shape
    lin = cls(in_features, out_features, bias=bias is not None)
    lin.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
    if bias is not None:
        lin.bias = nn.Parameter(bias.contiguous(), requires_grad=False)
    return lin


def _rows(t: torch.Tensor | None, spans: list[tuple[int, int]]) -> torch.Tensor | None:
    return None if t is None else torch.cat([t[a:b] for a, b in spans])


def _shard_attention(attn: Attention, plan: ShardPlan) -> None:
    D, Q, KV = attn.head_dim, attn.q_size, attn.kv_size
    q0, q1 = plan.q_start * D, (plan.q_start + plan.num_heads) * D
    k0, k1 = plan.kv_start * D, (plan.kv_start + plan.num_kv_heads) * D
    spans = [(q0, q1), (Q + k0, Q + k1), (Q + KV + k0, Q + KV + k1)]
    qkv, o = attn.qkv_proj, attn.o_proj
    attn.qkv_proj = _linear(cast(torch.Tensor, _rows(qkv.weight, spans)), _rows(qkv.bias, spans))
    attn.o_proj = _linear(o.weight[:, q0:q1], o.bias if plan.rank == 0 else None,
                          RowParallelLinear)
    attn.num_heads, attn.num_kv_heads = plan.num_heads, plan.num_kv_heads
    attn.q_size, attn.kv_size = plan.num_heads * D, plan.num_kv_heads * D


def _shard_mlp(mlp: MLP, plan: ShardPlan) -> None:
    i0, n = plan.inter_start, plan.intermediate_size
    spans = [(i0, i0 + n), (mlp.inter + i0, mlp.inter + i0 + n)]  # gate rows, up rows
    gu, down = mlp.gate_up_proj, mlp.down_proj
    mlp.gate_up_proj = _linear(cast(torch.Tensor, _rows(gu.weight, spans)), _rows(gu.bias, spans))
    mlp.down_proj = _linear(down.weight[:, i0:i0 + n], down.bias if plan.rank == 0 else None,
                            RowParallelLinear)
    mlp.inter = n


@torch.no_grad()
def shard_model(model: CausalLM, plan: ShardPlan) -> None:
    """Cut a loaded fp32 model (dense weights, not yet packed) down to `plan`'s shard, in
    place. Only layers built from the Llama family's Attention and MLP are split (Llama,
    Mistral, Qwen2/3, Phi-3 and the Gemma 2 layers that reuse them); others are refused."""
    for layer in model.layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if not isinstance(attn, Attention) or not isinstance(mlp, MLP):
            raise InvalidParamsError(
                f"tensor parallelism runs the Llama family's layers; "
                f"{model.config.architecture} is not supported", param="tensor_parallel_size")
        if not isinstance(attn.qkv_proj, Linear) or not isinstance(mlp.gate_up_proj, Linear):
            raise InvalidParamsError("tensor parallelism runs fp32 weights (quantization "
                                     "'none')", param="quantization")
        _shard_attention(attn, plan)
        _shard_mlp(mlp, plan)
    model.config = plan.local_config(model.config)


def load_shard(checkpoint_config: ModelConfig, weights: Iterable[tuple[str, torch.Tensor]],
               plan: ShardPlan,
               pack: bool) -> CausalLM:
    """This rank's shard of the model: every fp32 weight loaded (`weights`: the
    checkpoint's (HF name, tensor) pairs), then cut to `plan`, then (`pack`) reordered for
    oneDNN. The full layers are freed as each is replaced by its shard."""
    model = create_model(checkpoint_config)
    model.load_weights(weights)
    shard_model(model, plan)
    if pack:
        model.pack_weights()
    cast(nn.Module, model).eval()
    return model
