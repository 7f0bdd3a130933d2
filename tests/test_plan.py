"""`kvloop plan`: hand-computed cases, the classic 13B figures, kvloop's own measured
throughput (parsed from BENCHMARKS.md), bad input, and the CLI's table and JSON."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kvloop.cli import main
from kvloop.engine.attribution import ModelCosts
from kvloop.errors import KvloopError
from kvloop.loading.loader import load_checkpoint
from kvloop.plan import Cluster, ModelFigures, Replica, Workload, plan
from kvloop.roofline import Machine, predict
from kvloop.runner import kv_cache_bytes_per_block

BENCHMARKS = Path(__file__).resolve().parents[1] / "BENCHMARKS.md"
CLASSIC = Machine(flops=400e12, bandwidth=3.35e12)  # issue 4's example machine


def test_hand_computed_weight_kv_and_memory_cap():
    # 13B fp16, 40 layers x 40 KV heads x 128: K and V of a position are 2*40*40*128*2 bytes.
    m = ModelFigures.from_params(13e9, "fp16", num_layers=40, num_kv_heads=40, head_dim=128)
    assert m.weight_bytes == 26e9
    assert m.kv_bytes_per_token == 819_200
    assert m.flops_per_token == 26e9
    w = Workload(rate=1, prompt_tokens=2000, output_tokens=500)
    # 80 GB - 26 GB of weights = 54 GB of KV; a sequence holds 2,500 x 819,200 B = 2.048 GB.
    assert Replica(m, CLASSIC, Cluster(80e9), w).max_concurrency() == 26
    assert Replica(m, CLASSIC, Cluster(80e9), w, tp=2).max_concurrency() == 65  # 134 / 2.048
    assert Replica(m, CLASSIC, Cluster(20e9), w).max_concurrency() == 0  # weights don't fit


def test_reproduces_the_classic_13b_example():
    """Issue 4's 13B fp16 figures: 2,000-token prompt, 500 tokens, 400 TFLOP/s, 3.35 TB/s:
    ~52 TFLOP and ~130 ms of prefill, 26 GB and ~7.8 ms per decode step, ~3.9 s of decode."""
    m = ModelFigures.from_params(13e9, "fp16")
    w = Workload(rate=1, prompt_tokens=2000, output_tokens=500)
    assert m.prefill_flops(2000) == pytest.approx(52e12)
    classic = predict(13e9, 2.0, 2000, 500, CLASSIC)
    # The textbook max(memory, compute) is kvloop.roofline's figure exactly...
    r = Replica(m, CLASSIC, Cluster(80e9, overlap=True), w)
    assert r.prefill_s() == pytest.approx(classic.prefill_s) == pytest.approx(0.130, rel=1e-3)
    assert r.decode_step(1)[0] == pytest.approx(classic.decode_step_s)
    assert 500 * r.decode_step(1)[0] == pytest.approx(3.88, rel=1e-3)
    # ...and the default (memory + compute) adds 26 GFLOP / 400 TFLOP/s = 0.065 ms.
    step, memory_bound = Replica(m, CLASSIC, Cluster(80e9), w).decode_step(1)
    assert step == pytest.approx(7.76e-3 + 0.065e-3, rel=1e-3) and memory_bound
    p = Replica(m, CLASSIC, Cluster(80e9), w).point(1)
    assert p.ttft_s == pytest.approx(0.130, rel=1e-3) and p.tpot_s == pytest.approx(step)


def test_a_model_too_big_or_too_slow_for_one_machine_gets_tensor_parallelism():
    m = ModelFigures.from_params(13e9, "fp16", num_layers=40, num_kv_heads=40, head_dim=128)
    a100 = Machine(flops=312e12, bandwidth=2e12)  # the standard worked example's machine
    w = Workload(rate=10, prompt_tokens=2000, output_tokens=500)
    assert Replica(m, a100, Cluster(80e9), w).decode_step(1)[0] == pytest.approx(13.9e-3,
                                                                                  rel=0.01)
    small = plan(m, a100, Cluster(24e9), w)  # 26 GB of weights on 24 GB machines
    assert small.tensor_parallel == 2 and small.replicas is not None
    fast = plan(m, a100, Cluster(80e9), Workload(10, 2000, 500, tpot_s=0.010))  # < 13 ms
    assert fast.tensor_parallel == 2 and fast.chosen is not None
    assert fast.chosen.tpot_s <= 0.010
    served = plan(m, a100, Cluster(80e9), Workload(10, 2000, 500, tpot_s=0.05))
    assert served.tensor_parallel == 1 and served.chosen is not None
    # Enough replicas for 10 req/s at 80% of each one's capacity, and no more.
    cap = served.chosen.requests_per_s * 0.8
    assert served.replicas == -(-10 // cap) and (served.replicas - 1) * cap < 10
    none = plan(m, a100, Cluster(80e9), Workload(10, 2000, 500, tpot_s=1e-6))
    assert none.tensor_parallel is None and none.replicas is None


def _bench_all_table() -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """The default model's bench_all table: the machine's measured figures and each row."""
    text = BENCHMARKS.read_text()
    start = text.index("<!-- bench-all-avx512vnni:begin -->")
    section = text[start:text.index("<!-- bench-all-avx512vnni:end -->", start)]
    bw = re.search(r"measured bandwidth ([\d.]+) GB/s", section)
    fl = re.search(r"matmul ([\d.]+) GFLOP/s", section)
    assert bw and fl, "BENCHMARKS.md's bench_all header changed"
    lines = [ln for ln in section.splitlines() if ln.startswith("|")]
    columns = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = {}
    for ln in lines[2:]:
        cells = [c.strip() for c in ln.strip("|").split("|")]
        rows[cells[0]] = {col: float(v) for col, v in zip(columns[1:], cells[1:], strict=True)
                          if re.fullmatch(r"[\d.]+", v)}
    return {"bandwidth": float(bw[1]) * 1e9, "flops": float(fl[1]) * 1e9}, rows


def _default_model_fp32(weight_bytes: float) -> ModelFigures:
    """The default model as kvloop fp32 runs it: the engine's own FLOP counts
    (attribution's ModelCosts) and an fp32 KV cache (the table's KV pool)."""
    c = load_checkpoint(None).config  # headers only
    kv = kv_cache_bytes_per_block(c.num_layers, c.num_kv_heads, c.head_dim, 1, "fp32")
    costs = ModelCosts.of(c, int(weight_bytes), kv)
    return ModelFigures("default fp32", costs.weight_bytes, costs.kv_bytes_per_token,
                        costs.layer_flops_per_token, costs.head_flops_per_row,
                        costs.attn_flops_per_pair)


def test_predicts_kvloops_measured_throughput_within_30_percent():
    """kvloop fp32 on the default model, BENCHMARKS.md's bench_all table: batch-1 decode
    (16-token prompt, 128 tokens, timed after the first) and 32 concurrent requests (64-token
    prompts, 128 tokens each, generated tokens / wall time with prefill).

    The machine's FLOP/s is what kvloop's own 512-token fp32 prefill sustained in the same
    run (the table's prefill row times the FLOPs of a 512-token prefill): a whole forward's
    rate, below the 1024^3 GEMM's peak the header also gives. The rows checked are others."""
    machine, rows = _bench_all_table()
    col = "kvloop fp32"
    model = _default_model_fp32(rows["decode: weight bytes read per token (MB)"][col] * 1e6)
    prefill_tok_s = rows["prefill, 512-token prompt (tok/s)"][col]
    sustained = model.prefill_flops(512) * prefill_tok_s / 512
    assert sustained < machine["flops"]
    m = Machine(flops=sustained, bandwidth=machine["bandwidth"])
    batch1 = Replica(model, m, Cluster(24e9), Workload(1, 16, 128)).point(1)
    measured1 = rows["batch-1 decode, 128 tokens (tok/s)"][col]
    assert 1 / batch1.decode_step_s == pytest.approx(measured1, rel=0.30)
    b32 = Replica(model, m, Cluster(24e9), Workload(1, 64, 128)).point(32)
    measured32 = rows["generated tok/s, 32 concurrent requests"][col]
    assert b32.tokens_per_s == pytest.approx(measured32, rel=0.30)


@pytest.mark.parametrize("argv, words", [
    (["--rate", "-1"], "--rate"), (["--rate", "nan"], "--rate"),
    (["--prompt-tokens", "0"], "--prompt-tokens"), (["--tpot", "-0.1"], "--tpot"),
    (["--dtype", "fp12"], "--dtype"), (["--params", "-5"], "--params"),
    (["--memory", "0"], "--memory"), (["--utilization", "1.5"], "--utilization"),
    (["--layers", "-1"], "--layers"),
])
def test_bad_input_is_one_clear_error(argv, words, capsys):
    code = main(["plan", "--params", "1e9", "--flops", "1e12", "--bandwidth", "1e10", *argv])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("kvloop: error:") and words in err
    assert len(err.strip().splitlines()) == 1


def test_unknown_model_file_is_one_clear_error(tmp_path, capsys):
    code = main(["plan", "--model", str(tmp_path / "missing.gguf"), "--flops", "1e12",
                 "--bandwidth", "1e10"])
    err = capsys.readouterr().err
    assert code == 2 and "not found" in err and len(err.strip().splitlines()) == 1


def test_bad_figures_refused_in_the_api():
    with pytest.raises(KvloopError, match="--rate"):
        Workload(rate=0, prompt_tokens=1, output_tokens=1)
    with pytest.raises(KvloopError, match="weight bytes"):
        ModelFigures("x", weight_bytes=-1, kv_bytes_per_token=0, flops_per_token=1)


CLASSIC_ARGV = ["plan", "--params", "13e9", "--dtype", "fp16", "--layers", "40", "--kv-heads",
                "40", "--head-dim", "128", "--prompt-tokens", "2000", "--output-tokens", "500",
                "--flops", "400e12", "--bandwidth", "3.35e12", "--memory", "80e9",
                "--rate", "10", "--tpot", "0.05"]


def test_cli_table(capsys):
    assert main(CLASSIC_ARGV) == 0
    out = capsys.readouterr().out
    assert "26 GB of weights" in out and "819.2 KB of KV per token" in out
    assert "at most 26 concurrent sequences" in out
    assert re.search(r"plan: \d+ replicas x tensor parallel 1", out)


def test_cli_json_keys(capsys):
    assert main([*CLASSIC_ARGV, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert {"model", "machine", "workload", "tensor_parallel", "max_concurrency",
            "concurrency", "replicas", "machines", "per_replica", "points",
            "notes"} <= doc.keys()
    assert doc["max_concurrency"] == 26 and doc["tensor_parallel"] == 1
    assert {"concurrency", "decode_step_s", "ttft_s", "tpot_s", "tokens_per_s",
            "requests_per_s", "memory_bound", "meets_targets"} == doc["per_replica"].keys()
    assert doc["model"]["kv_bytes_per_token"] == 819_200
    assert doc["machines"] == doc["replicas"] * doc["tensor_parallel"]


def test_cli_plans_a_loaded_model(tiny_model_dir, capsys):
    code = main(["plan", "--model", str(tiny_model_dir), "--flops", "1e11", "--bandwidth",
                 "2e10", "--prompt-tokens", "16", "--output-tokens", "8", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert code == 0 and doc["model"]["weight_bytes"] > 0
    assert doc["model"]["kv_bytes_per_token"] > 0 and doc["replicas"] == 1
