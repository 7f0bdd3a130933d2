"""benchmarks/plot_benchmarks.py: charts drawn from BENCHMARKS.md's own tables."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import plot_benchmarks as pb

BENCH_ALL = """<!-- bench-all-avx2:begin -->
## kvloop and llama.cpp on a model

`python benchmarks/bench_all.py` on x86_64, native kernels: avx2 build (CPU runs scalar, avx2).

| figure | kvloop as-stored | llama.cpp as-stored | best kvloop / llama.cpp |
|---|---:|---:|---:|
| batch-1 decode, 128 tokens (tok/s) | 166.7 | 117.2 | 1.42x (as-stored) |
| prefill, 512-token prompt (tok/s) | 1,163.5 | 277.7 | 4.19x (as-stored) |
| generated tok/s, 8 concurrent requests | 298.8 | 134.2 | 2.23x (as-stored) |
| generated tok/s, 32 concurrent requests | 402.1 | — | n/a |
| decode: fraction of measured bandwidth | 51.5% | 36.2% | 1.42x (as-stored) |
<!-- bench-all-avx2:end -->
"""

STRUCTURED = """<!-- bench-structured:begin -->
## Structured output

native kernels: avx512vnni build (CPU runs scalar, avx2, avx512vnni).

| concurrency | requests | TPOT unconstrained | TPOT constrained | TPOT with jump-forward |
|---|---|---|---|---|
| 1 | 23 | 7.03 ms | 7.55 ms | 6.03 ms |
| 32 | 32 | 46.66 ms | 50.16 ms | 40.87 ms |
<!-- bench-structured:end -->
"""


def test_cells_read_as_the_figures_they_print() -> None:
    assert pb.number("1,163.5") == 1163.5
    assert pb.number("51.5%") == pytest.approx(0.515)
    assert pb.number("7.03 ms") == 7.03
    assert pb.number("—") is None and pb.number("n/a") is None
    assert pb.number("1.42x (as-stored)") == 1.42


def test_tables_of_a_section() -> None:
    body = pb.sections(BENCH_ALL)["bench-all-avx2"]
    (t,) = pb.tables(body)
    assert t.header[:3] == ["figure", "kvloop as-stored", "llama.cpp as-stored"]
    row = t.row("generated tok/s, 32")
    assert row is not None and row[2] == "—"
    assert pb.isa_of(body) == "avx2"
    assert pb.title(body) == "kvloop and llama.cpp on a model"


def test_charts_are_png_files_linked_from_the_markdown(tmp_path: Path) -> None:
    md = tmp_path / "BENCHMARKS.md"
    md.write_text("# kvloop benchmarks\n\n" + BENCH_ALL + "\n" + STRUCTURED)
    pb.main(["--benchmarks", str(md), "--out", str(tmp_path / "figures")])
    for name in ("bench-all-avx2", "bench-structured"):
        png = tmp_path / "figures" / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
        assert f"![{name}](figures/{name}.png)" in md.read_text()
    # Drawn again: the charts section is replaced, not appended twice.
    pb.main(["--benchmarks", str(md), "--out", str(tmp_path / "figures")])
    assert md.read_text().count("<!-- charts:begin -->") == 1
