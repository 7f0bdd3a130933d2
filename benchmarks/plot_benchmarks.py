"""Charts of the published benchmarks: PNGs drawn from BENCHMARKS.md's own tables (the
figures as published, so a chart never disagrees with its table), linked from a section of
BENCHMARKS.md. `make bench` runs it after the benchmarks.

    python benchmarks/plot_benchmarks.py [--benchmarks BENCHMARKS.md] [--out benchmarks/figures]

Per `bench_all.py` section (one per model and kernel ISA): generated tokens/s against
concurrent requests for kvloop and each peer (batch-1 decode as 1 request), batch-1
decode and prefill tokens/s, and the fraction of measured bandwidth a batch-1 decode
reaches. The speculative decoding section: tokens/s per engine and setting, per table.
The structured-output section: time per output token unconstrained, constrained and
with jump-forward.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
SECTION = re.compile(r"<!-- (?P<name>[\w.-]+):begin -->\n(?P<body>.*?)<!-- (?P=name):end -->",
                     re.S)
CONCURRENT = re.compile(r"generated tok/s, (\d+) concurrent requests")


@dataclass
class Table:
    header: list[str]
    rows: list[list[str]]

    def column(self, name: str) -> int | None:
        return self.header.index(name) if name in self.header else None

    def row(self, prefix: str) -> list[str] | None:
        return next((r for r in self.rows if r[0].startswith(prefix)), None)


def number(cell: str) -> float | None:
    """A table cell's figure: '1,163.5' -> 1163.5, '78.0%' -> 0.78, '7.03 ms' -> 7.03;
    None for '—', 'n/a' and words."""
    m = re.match(r"^\s*([\d,]*\.?\d+)\s*(%|ms\b|s\b)?", cell)
    if m is None:
        return None
    value = float(m.group(1).replace(",", ""))
    return value / 100 if m.group(2) == "%" else value


def tables(body: str) -> list[Table]:
    """The markdown tables of a section, in order."""
    out: list[Table] = []
    lines = body.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("|") and i + 1 < len(lines) and lines[i + 1].startswith("|---"):
            header = [c.strip() for c in lines[i].strip().strip("|").split("|")]
            rows = []
            i += 2
            while i < len(lines) and lines[i].startswith("|"):
                rows.append([c.strip() for c in lines[i].strip().strip("|").split("|")])
                i += 1
            out.append(Table(header, rows))
        else:
            i += 1
    return out


def sections(text: str) -> dict[str, str]:
    return {m.group("name"): m.group("body") for m in SECTION.finditer(text)}


def title(body: str) -> str:
    m = re.search(r"^## (.+)$", body, re.M)
    return m.group(1) if m else ""


def isa_of(body: str) -> str:
    m = re.search(r"native kernels: (\w+) build", body)
    return m.group(1) if m else "no native kernels"


def plot_bench_all(name: str, body: str, out: Path) -> Path | None:
    """Four panels from a bench_all table; None when the section has no such table."""
    import matplotlib.pyplot as plt

    t = next((t for t in tables(body) if t.header and t.header[0] == "figure"), None)
    if t is None:
        return None
    engines = [h for h in t.header[1:] if not h.startswith("best kvloop")]
    concurrent = sorted((int(m.group(1)), r) for r in t.rows if (m := CONCURRENT.match(r[0])))
    decode, prefill = t.row("batch-1 decode"), t.row("prefill")
    fraction = t.row("decode: fraction of measured bandwidth")
    fig, (a, d, b, c) = plt.subplots(1, 4, figsize=(19, 4.5))
    for j, engine in enumerate(engines, start=1):
        xs, ys = [], []
        for n, row in [(1, decode), *concurrent]:
            v = number(row[j]) if row is not None else None
            if v is not None:
                xs.append(n)
                ys.append(v)
        a.plot(xs, ys, marker="o", label=engine)
    a.set_xscale("log", base=2)
    a.set_xticks(sorted({1, *(n for n, _ in concurrent)}))
    a.get_xaxis().set_major_formatter("{x:.0f}")
    a.set_xlabel("concurrent requests (1: batch-1 decode)")
    a.set_ylabel("generated tokens/s")
    a.set_title("throughput against concurrency")
    a.legend(fontsize=8)
    for ax, row, label in ((d, decode, "batch-1 decode tokens/s"),
                           (b, prefill, "prefill tokens/s (512-token prompt)"),
                           (c, fraction, "batch-1 decode / measured bandwidth")):
        vals = [number(row[j]) if row is not None else None for j in range(1, len(engines) + 1)]
        shown = [(e, v) for e, v in zip(engines, vals, strict=True) if v is not None]
        ax.barh([e for e, _ in shown], [v for _, v in shown], color="tab:blue")
        ax.set_title(label)
        ax.invert_yaxis()
        if ax is c:
            ax.axvline(1.0, color="grey", linestyle="--", linewidth=1)
    fig.suptitle(f"{title(body)} ({isa_of(body)} build)", fontsize=11)
    fig.tight_layout()
    return save(fig, out / f"{name}.png")


def plot_speculative(name: str, body: str, out: Path) -> Path | None:
    """tok/s per engine and setting, one panel per table that has them."""
    import matplotlib.pyplot as plt

    ts = [t for t in tables(body) if t.column("tok/s") is not None]
    if not ts:
        return None
    heads = re.findall(r"^### (.+)$", body, re.M)
    fig, axes = plt.subplots(len(ts), 1, figsize=(10, 3.2 * len(ts)), squeeze=False)
    for k, (t, ax) in enumerate(zip(ts, axes[:, 0], strict=True)):
        col = t.column("tok/s")
        assert col is not None
        shown = [(r[0], v) for r in t.rows if (v := number(r[col])) is not None]
        ax.barh([s for s, _ in shown], [v for _, v in shown],
                color=["tab:orange" if "," in s else "tab:blue" for s, _ in shown])
        ax.invert_yaxis()
        ax.set_xlabel("tokens/s (batch 1)")
        ax.set_title(heads[k] if k < len(heads) else "", fontsize=10)
    fig.suptitle(f"{title(body)} ({isa_of(body)} build)", fontsize=11)
    fig.tight_layout()
    return save(fig, out / f"{name}.png")


def plot_structured(name: str, body: str, out: Path) -> Path | None:
    """Time per output token without a grammar, with one, and with jump-forward."""
    import matplotlib.pyplot as plt

    t = next((t for t in tables(body) if t.column("TPOT constrained") is not None), None)
    if t is None:
        return None
    cols = [c for c in ("TPOT unconstrained", "TPOT constrained", "TPOT with jump-forward")
            if t.column(c) is not None]
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(cols)
    for k, c in enumerate(cols):
        j = t.column(c)
        assert j is not None
        vals = [number(r[j]) or 0.0 for r in t.rows]
        ax.bar([i + k * width for i in range(len(t.rows))], vals, width, label=c)
    ax.set_xticks([i + width * (len(cols) - 1) / 2 for i in range(len(t.rows))],
                  [f"{r[0]} concurrent" for r in t.rows])
    ax.set_ylabel("ms per output token")
    ax.legend(fontsize=8)
    ax.set_title(f"{title(body)} ({isa_of(body)} build)", fontsize=10)
    fig.tight_layout()
    return save(fig, out / f"{name}.png")


def save(fig: object, path: Path) -> Path:
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)  # type: ignore[attr-defined]
    plt.close(fig)  # type: ignore[arg-type]
    return path


def plot_all(text: str, out: Path) -> list[tuple[str, Path]]:
    """Every chart BENCHMARKS.md's text has data for: (section name, PNG path)."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display here
    drawn = []
    for name, body in sections(text).items():
        if name.startswith("bench-all"):
            path = plot_bench_all(name, body, out)
        elif name == "speculative":
            path = plot_speculative(name, body, out)
        elif name.startswith("bench-structured"):
            path = plot_structured(name, body, out)
        else:
            continue
        if path is not None:
            drawn.append((name, path))
    return drawn


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--benchmarks", type=Path, default=HERE.parent / "BENCHMARKS.md")
    ap.add_argument("--out", type=Path, default=HERE / "figures")
    args = ap.parse_args(argv)
    text = args.benchmarks.read_text()
    drawn = plot_all(text, args.out)
    base = args.benchmarks.resolve().parent
    lines = ["## Charts", "",
             "`python benchmarks/plot_benchmarks.py`: drawn from the tables of this file "
             "(the published figures), one chart per section below.", ""]
    for name, path in drawn:
        rel = path.resolve().relative_to(base) if path.resolve().is_relative_to(base) else path
        lines.append(f"- `{name}`: ![{name}]({rel})")
        print(path)
    from common import write_section

    write_section(args.benchmarks, "charts", "\n".join(lines))


if __name__ == "__main__":
    main()
