"""Back-of-envelope limits of inference on a machine: prefill is compute-bound, decode is
memory-bound. Pure arithmetic (no torch), so it can describe machines we do not have.

    prefill time  ~ 2 * params * prompt_tokens / FLOP/s
    decode step   ~ bytes of weights (+ KV cache read) / memory bandwidth
"""

from __future__ import annotations

from dataclasses import dataclass

BYTES_PER_PARAM = {"fp32": 4.0, "float32": 4.0, "fp16": 2.0, "float16": 2.0, "bf16": 2.0,
                   "bfloat16": 2.0, "int8": 1.0, "q8_0": 34 / 32, "int4": 0.5,
                   "q4_0": 18 / 32, "q4_1": 20 / 32}


@dataclass(frozen=True)
class Machine:
    flops: float  # sustained FLOP/s of the matmuls
    bandwidth: float  # sustained bytes/s of memory reads

    def describe(self) -> str:
        return f"{self.flops / 1e9:,.0f} GFLOP/s, {self.bandwidth / 1e9:,.1f} GB/s"


@dataclass(frozen=True)
class Prediction:
    prefill_flops: float
    prefill_s: float
    decode_bytes_per_step: float  # weights read once per step
    kv_bytes_per_step: float  # the KV cache read at the mean context of decode
    decode_step_s: float  # weights + KV
    decode_s: float
    output_tokens: int

    @property
    def ttft_s(self) -> float:
        return self.prefill_s

    @property
    def tokens_per_s(self) -> float:
        return 1.0 / self.decode_step_s


def predict(num_params: float, bytes_per_param: float, prompt_tokens: int, output_tokens: int,
            machine: Machine, kv_bytes_per_token: float = 0.0) -> Prediction:
    """`kv_bytes_per_token`: K and V of one position over all layers (0 ignores the cache,
    as the classic estimate does)."""
    flops = 2.0 * num_params * prompt_tokens
    weight_bytes = num_params * bytes_per_param
    mean_context = prompt_tokens + output_tokens / 2
    kv_bytes = kv_bytes_per_token * mean_context
    step = (weight_bytes + kv_bytes) / machine.bandwidth
    return Prediction(flops, flops / machine.flops, weight_bytes, kv_bytes, step,
                      step * output_tokens, output_tokens)


def report(p: Prediction, machine: Machine) -> str:
    lines = [
        f"machine: {machine.describe()}",
        f"prefill: {p.prefill_flops / 1e12:,.3g} TFLOP -> {p.prefill_s * 1e3:,.3g} ms "
        "(compute-bound)",
        f"decode: {p.decode_bytes_per_step / 1e9:,.3g} GB of weights"
        + (f" + {p.kv_bytes_per_step / 1e6:,.3g} MB of KV cache" if p.kv_bytes_per_step else "")
        + f" per step -> {p.decode_step_s * 1e3:,.3g} ms/token ({p.tokens_per_s:,.1f} tok/s), "
        f"{p.decode_s:,.3g} s for {p.output_tokens} tokens (memory-bound)",
    ]
    return "\n".join(lines)
