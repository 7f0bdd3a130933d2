"""The roofline estimate: the classic back-of-envelope figures, and the CLI around it."""

from __future__ import annotations

import pytest

from kvloop.cli import main
from kvloop.roofline import Machine, predict


def test_classic_13b_fp16_figures():
    """13 B params, fp16, 2,000-token prompt, 500 tokens, 400 TFLOP/s, 3.35 TB/s."""
    p = predict(13e9, 2.0, 2000, 500, Machine(flops=400e12, bandwidth=3.35e12))
    assert p.prefill_flops == pytest.approx(52e12)
    assert p.prefill_s == pytest.approx(0.130, rel=1e-3)
    assert p.decode_bytes_per_step == pytest.approx(26e9)
    assert p.decode_step_s == pytest.approx(7.76e-3, rel=1e-3)
    assert p.decode_s == pytest.approx(3.88, rel=1e-3)


def test_kv_cache_reads_add_to_the_decode_step():
    m = Machine(flops=1e12, bandwidth=1e9)
    bare = predict(1e6, 4.0, 100, 10, m)
    with_kv = predict(1e6, 4.0, 100, 10, m, kv_bytes_per_token=1000)
    assert with_kv.kv_bytes_per_step == 1000 * (100 + 5)
    assert with_kv.decode_step_s == pytest.approx(bare.decode_step_s + 105_000 / 1e9)


def test_cli_prints_the_classic_figures(capsys):
    code = main(["roofline", "--params", "13e9", "--dtype", "fp16", "--prompt-tokens", "2000",
                 "--output-tokens", "500", "--flops", "400e12", "--bandwidth", "3.35e12"])
    out = capsys.readouterr().out
    assert code == 0
    for figure in ("52 TFLOP", "130 ms", "26 GB", "7.76 ms/token", "3.88 s"):
        assert figure in out, figure


def test_cli_measures_a_loaded_model(tiny_model_dir, capsys):
    code = main(["roofline", "--model", str(tiny_model_dir), "--prompt-tokens", "16",
                 "--output-tokens", "8", "--flops", "1e11", "--bandwidth", "2e10"])
    out = capsys.readouterr().out
    assert code == 0 and "measured: TTFT" in out and "of the bandwidth limit" in out


@pytest.mark.parametrize("argv", [["--dtype", "fp12"], ["--params", "-1"],
                                  ["--prompt-tokens", "0"]])
def test_cli_bad_input(argv, capsys):
    code = main(["roofline", "--params", "1e9", "--flops", "1e12", "--bandwidth", "1e10", *argv])
    assert code == 2 and capsys.readouterr().err.startswith("kvloop: error:")
