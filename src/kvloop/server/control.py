"""A resident engine from a shell: `kvloop serve --detach`, `kvloop ps`, `kvloop stop`.

They find servers by the run files `kvloop serve` writes (kvloop.runfile), so they see
exactly what `kvloop generate` would use. Standard library and httpx only: none of these
commands imports torch or loads a model.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from kvloop import runfile
from kvloop.client import probe
from kvloop.engine_flags import default_engine_options
from kvloop.server.cli import DETACHED_LOG_ENV

READY_TIMEOUT_S = 600.0  # a model load on a slow machine, with its first-use kernel build
STOP_TIMEOUT_S = 60.0  # past the default 30 s shutdown grace: a drain that hangs is killed
_POLL_S = 0.1


def detach(serve_argv: list[str], timeout: float = READY_TIMEOUT_S) -> int:
    """Start `kvloop serve serve_argv` in a session of its own, its output in a log file
    beside the run files; return once it answers /health (0), or with the server's own
    error line if it exits first (its status: 2 for a bad flag or model file)."""
    directory = runfile.runtime_dir()
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    log = directory / f"serve-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
    with log.open("ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvloop.server.cli", *serve_argv],
            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,  # the shell's Ctrl-C and hang-up are not its own
            env={**os.environ, DETACHED_LOG_ENV: str(log)})
    run_file = directory / f"serve-{proc.pid}.json"
    deadline = time.monotonic() + timeout
    while True:
        status = proc.poll()
        if status is not None:
            _error(f"the server exited with status {status} before it answered: "
                   f"{_last_error(log)} (log: {log})")
            return 2 if status == 2 else 1
        info = runfile.read(run_file)
        if info is not None and info.url and probe(info.url) == "ok":
            print(f"kvloop: serving {info.model} at {info.url} (pid {info.pid}, log {log}); "
                  f"`kvloop stop` ends it")
            return 0
        if time.monotonic() > deadline:
            proc.kill()
            _error(f"the server did not answer within {timeout:.0f} s; stopped it "
                   f"(log: {log})")
            return 1
        time.sleep(_POLL_S)


def ps() -> int:
    """One line per running server: pid, model, address, uptime, requests finished and
    the engine options it runs with beyond the defaults."""
    servers = runfile.live()
    if not servers:
        print("no kvloop serve is running")
        return 0
    defaults = runfile.comparable_options(default_engine_options())
    rows = [("PID", "MODEL", "URL", "UPTIME", "REQUESTS", "OPTIONS")]
    for info in servers:
        served = _requests_finished(info.url)
        rows.append((str(info.pid), info.model, info.url, _duration(time.time() - info.started),
                     "?" if served is None else str(served),
                     _options(info.engine_options, defaults) or "-"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False))
              + "  " + row[-1])
    return 0


def stop(target: str | None, timeout: float = STOP_TIMEOUT_S) -> int:
    """SIGTERM the servers that match `target` (a pid or a URL; None: every one), which
    drain and exit; wait for each to be gone (killed past `timeout`)."""
    servers = runfile.live()
    if target is not None:
        servers = [i for i in servers if target in (str(i.pid), i.url, i.url + "/")]
    if not servers:
        where = f" matching {target!r}" if target is not None else ""
        _error(f"no kvloop serve{where} is running (see `kvloop ps`)")
        return 1
    for info in servers:
        with contextlib.suppress(ProcessLookupError):
            os.kill(info.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for info in servers:
        while not exited(info.pid) and time.monotonic() < deadline:
            time.sleep(_POLL_S)
        how = "stopped"
        if not exited(info.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(info.pid, signal.SIGKILL)
            how = f"killed (it had not exited {timeout:.0f} s after SIGTERM)"
        runfile.remove(info)  # a drained server removed it itself; a killed one cannot
        print(f"kvloop: {how} {info.model} at {info.url} (pid {info.pid})")
    return 0


# -- helpers ----------------------------------------------------------------------------------
def _error(message: str) -> None:
    print(f"kvloop: error: {message}", file=sys.stderr)


def _last_error(log: Path) -> str:
    """The server's own `kvloop: error:` line, else its last line of output."""
    try:
        lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "no output"
    errors = [ln.removeprefix("kvloop: error: ") for ln in lines
              if ln.startswith("kvloop: error: ")]
    return errors[-1] if errors else (lines[-1] if lines else "no output")


def exited(pid: int) -> bool:
    """Exited: no such process, or a zombie its parent has not reaped (a detached server's
    parent is whatever adopted it)."""
    if not runfile.pid_alive(pid):
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False  # no /proc: alive as far as kill(0) can tell
    return stat.rpartition(")")[2].split()[0] == "Z"


def _requests_finished(url: str) -> int | None:
    """kvloop_requests_finished_total summed over reasons, from /metrics (open without the
    API key, as it is for scrapers)."""
    try:
        text = httpx.get(f"{url}/metrics", timeout=2.0).text
    except httpx.HTTPError:
        return None
    total = 0.0
    for line in text.splitlines():
        if line.startswith("kvloop_requests_finished_total"):
            total += float(line.rsplit(maxsplit=1)[1])
    return int(total)


def _options(options: dict[str, Any], defaults: dict[str, Any]) -> str:
    """The options that differ from the defaults (both as run files store them)."""
    return " ".join(f"{k}={v}" for k, v in sorted(options.items())
                    if k in defaults and defaults[k] != v)


def _duration(seconds: float) -> str:
    s = max(0, int(seconds))
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"

