"""bench_all.py's workers take turns (run_gated): one engine's step at a time, in rotation,
the parent's own work (the bandwidth probe) between rounds, and a worker that dies mid-run
is reported while the others finish. Fake workers speak the
protocol (a gate line, then wait for "go") and log when each step runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_all

FAKE_WORKER = """
import json, sys, time
name, steps, log, die_after = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
for i in range(steps):
    print({gate!r}, flush=True)
    if not sys.stdin.readline():
        sys.exit(1)
    if i == die_after:
        sys.exit(3)
    with open(log, "a") as f:
        f.write(f"{{name}} start {{i}} {{time.monotonic()}}\\n")
    time.sleep(0.05)
    with open(log, "a") as f:
        f.write(f"{{name}} end {{i}} {{time.monotonic()}}\\n")
print("unrelated output")
print({mark!r} + json.dumps({{"engine": name, "steps": steps}}), flush=True)
"""


@pytest.fixture
def fake_workers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    script = tmp_path / "worker.py"
    script.write_text(FAKE_WORKER.format(gate=bench_all.GATE, mark=bench_all.JSON_MARK))
    log = tmp_path / "steps.log"
    plan = {"a": (4, -1), "b": (4, -1), "c": (4, 1)}  # name: (steps, the step it dies at)

    def start(name: str, workload_path: Path,
              llama_cpp_path: Path | None = None) -> subprocess.Popen[str]:
        steps, die = plan[name]
        return subprocess.Popen(
            [sys.executable, str(script), name, str(steps), str(log), str(die)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    monkeypatch.setattr(bench_all, "start_worker", start)
    monkeypatch.setattr(bench_all, "TURN_PAUSE_S", 0.0)
    return log


def test_workers_take_turns_and_a_dead_one_is_reported(fake_workers: Path) -> None:
    def between() -> None:  # the parent's own work between rounds (the bandwidth probe)
        with open(fake_workers, "a") as f:
            f.write("parent between - -\n")

    results = bench_all.run_gated(["a", "b", "c"], fake_workers.parent / "workload.json",
                                  between=between)
    assert results["a"] == {"engine": "a", "steps": 4}
    assert results["b"] == {"engine": "b", "steps": 4}
    assert results["c"] == {"engine": "c", "error": "worker exited with 3"}
    lines = fake_workers.read_text().splitlines()
    # The parent's work once per round, each time with every worker at its gate: a round's
    # starts follow it (4 rounds; c's death ends its turn in the second).
    assert [line.split()[0] == "parent" for line in lines] == (
        [True] + [False] * 6 + [True] + [False] * 4 + [True] + [False] * 4 + [True] + [False] * 4)
    events = [line.split() for line in lines if not line.startswith("parent")]
    # Never two at once: every step ends before the next one starts.
    assert [e[1] for e in events] == ["start", "end"] * (len(events) // 2)
    times = [float(e[3]) for e in events]
    assert times == sorted(times)
    # In rotation: round by round, each live worker once, in order; c ran one step, then died.
    starts = [(e[0], int(e[2])) for e in events if e[1] == "start"]
    assert starts == [("a", 0), ("b", 0), ("c", 0), ("a", 1), ("b", 1),
                      ("a", 2), ("b", 2), ("a", 3), ("b", 3)]
