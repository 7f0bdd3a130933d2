"""Helpers shared by the benchmark scripts: prompts, timing, medians, BENCHMARKS.md sections."""

from __future__ import annotations

import platform
import re
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

TEXT = (
    "The history of computing is a story of layers. Each generation of engineers builds on "
    "the abstractions of the last, hiding complexity behind interfaces that are easier to "
    "reason about. Transistors became logic gates, gates became processors, processors ran "
    "operating systems, and operating systems hosted languages and libraries. "
)


def prompt_ids(tokenizer, n: int, salt: int = 0) -> list[int]:
    """Exactly n token ids of English text; `salt` varies the start so runs never share
    a prefix (no prefix-cache help in a prefill measurement)."""
    ids = tokenizer.encode(f"[{salt}] " + TEXT * (n // 40 + 2), add_special_tokens=False)
    return ids[:n]


def median_of(fn: Callable[[int], float], runs: int) -> float:
    return statistics.median(fn(i) for i in range(runs))


def timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def machine_line() -> str:
    """The machine a figure was taken on, the native kernels' ISA build included."""
    return (f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
            f"Python {platform.python_version()}, {isa_line()}")


def isa_line() -> str:
    from kvloop import kernels
    from kvloop.kernels import build

    if not kernels.available():
        return "native kernels: none (PyTorch only)"
    return (f"native kernels: {kernels.native_module().compiled_isa()} build "
            f"(CPU runs {', '.join(build.cpu_isas())})")


def write_section(path: Path, name: str, body: str) -> None:
    """Replace (or append) the section between <!-- name:begin --> and <!-- name:end -->."""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    block = f"{begin}\n{body.rstrip()}\n{end}"
    text = path.read_text() if path.exists() else "# kvloop benchmarks\n"
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else (
        text.rstrip() + "\n\n" + block + "\n")
    path.write_text(text)


def publish(body: str, path: Path | None, name: str) -> None:
    """Print a report and, when a BENCHMARKS.md path is given (--write), replace its
    section `name` there."""
    print(body)
    if path is not None:
        write_section(path, name, body)
