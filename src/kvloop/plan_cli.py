"""`kvloop plan`: flags in, kvloop.plan's arithmetic, a table or JSON out.

    kvloop plan --params 13e9 --dtype fp16 --layers 40 --kv-heads 40 --head-dim 128 \
        --flops 312e12 --bandwidth 2e12 --memory 80e9 --rate 10 --prompt-tokens 2000 \
        --output-tokens 500 --tpot 0.05
    kvloop plan --model FILE.gguf --rate 2 ...   (a model file's own figures; this machine's)

A model file is loaded as kvloop runs it (its --quantization and --kv-cache-dtype), so the
plan counts the bytes its decode step reads (the models' decode_read_bytes) and the FLOPs the
engine charges requests (kvloop.engine.attribution), not a second count of them.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import TYPE_CHECKING

from kvloop.engine_flags import add_engine_flags, engine_options
from kvloop.errors import InvalidParamsError

if TYPE_CHECKING:  # kvloop.plan (dataclasses, inspect: ~20 ms) loads for `kvloop plan` only:
    from kvloop.plan import ModelFigures  # every other command builds this parser too


def add_plan_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="how many replicas (or tensor-parallel degree) a workload "
                       "needs, from the roofline and the KV memory limit")
    g = p.add_argument_group("model given by its figures (else --model's file is loaded)")
    g.add_argument("--params", type=float, default=None, help="parameter count, e.g. 13e9")
    g.add_argument("--dtype", default="fp16", help="weights' type (fp32, fp16, bf16, int8, "
                   "int4, q8_0, q4_0, q4_1)")
    g.add_argument("--layers", type=int, default=0)
    g.add_argument("--kv-heads", type=int, default=0)
    g.add_argument("--head-dim", type=int, default=0)
    g.add_argument("--heads", type=int, default=None,
                   help="query heads (default: --kv-heads), for attention's FLOPs")
    g.add_argument("--kv-dtype", default=None, help="KV cache type (default: --dtype)")
    g = p.add_argument_group("machine (default: measured here)")
    g.add_argument("--flops", type=float, default=None, help="sustained FLOP/s")
    g.add_argument("--bandwidth", type=float, default=None, help="memory bytes/s")
    g.add_argument("--memory", type=float, default=None,
                   help="bytes per machine for weights and KV cache (default: a model file's "
                        "weights + --kv-cache-memory; with --params, this machine's memory)")
    g.add_argument("--overlap", action="store_true",
                   help="decode steps overlap memory and compute (max, not sum)")
    g.add_argument("--link-bandwidth", type=float, default=None,
                   help="bytes/s between tensor-parallel ranks (default: not counted)")
    g.add_argument("--link-latency", type=float, default=0.0, help="seconds per all-reduce")
    g = p.add_argument_group("workload")
    g.add_argument("--rate", type=float, default=1.0, help="requests per second (default 1)")
    g.add_argument("--prompt-tokens", type=int, default=512)
    g.add_argument("--output-tokens", type=int, default=128)
    g.add_argument("--ttft", type=float, default=None, help="time-to-first-token target (s)")
    g.add_argument("--tpot", type=float, default=None, help="time-per-output-token target (s)")
    g.add_argument("--utilization", type=float, default=0.8,
                   help="share of a replica's capacity to fill (default 0.8)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_engine_flags(p)


def _physical_memory() -> float:
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def _loaded_model(args: argparse.Namespace) -> tuple[ModelFigures, float]:
    """A model file's figures as kvloop runs it, and the KV memory its engine reserves."""
    from kvloop.config import parse_size
    from kvloop.engine.llm import LLM  # deferred: torch loads only for a model file
    from kvloop.plan import ModelFigures

    llm = LLM(args.model, **engine_options(args))
    e, c = llm.engine, llm.engine.model_config
    costs = e.costs
    model = ModelFigures(name=e.checkpoint.name, weight_bytes=costs.weight_bytes,
                         kv_bytes_per_token=costs.kv_bytes_per_token,
                         flops_per_token=costs.layer_flops_per_token,
                         head_flops_per_row=costs.head_flops_per_row,
                         attn_flops_per_pair=costs.attn_flops_per_pair,
                         num_layers=c.num_layers, hidden_size=c.hidden_size)
    return model, float(parse_size(args.kv_cache_memory, "kv_cache_memory"))


def cmd_plan(args: argparse.Namespace) -> int:
    from kvloop.plan import Cluster, ModelFigures, Workload, plan, report
    from kvloop.roofline import Machine

    # Everything cheap is checked before a model loads or the machine is measured.
    workload = Workload(args.rate, args.prompt_tokens, args.output_tokens, args.ttft, args.tpot)
    for flag, v in (("--flops", args.flops), ("--bandwidth", args.bandwidth),
                    ("--memory", args.memory)):
        if v is not None and not v > 0:
            raise InvalidParamsError(f"{flag} must be > 0, got {v}")
    if args.params is not None:
        model = ModelFigures.from_params(args.params, args.dtype, args.layers, args.kv_heads,
                                         args.head_dim, args.heads, args.kv_dtype)
        memory = args.memory or _physical_memory()
    else:
        engine_options(args)  # a bad engine flag is refused before the load
        model, kv_memory = _loaded_model(args)
        memory = args.memory or model.weight_bytes + kv_memory
    cluster = Cluster(memory, args.utilization, args.link_bandwidth, args.link_latency,
                      args.overlap)
    flops, bandwidth = args.flops, args.bandwidth
    if flops is None or bandwidth is None:
        from kvloop.engine.machine import measure_bandwidth, measure_flops

        flops = flops or measure_flops()
        bandwidth = bandwidth or measure_bandwidth()
    result = plan(model, Machine(flops, bandwidth), cluster, workload)
    print(json.dumps(result.to_json(), indent=2) if args.json else report(result))
    return 0
