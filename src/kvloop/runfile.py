"""Run files: how `kvloop generate` and `kvloop chat` find a resident `kvloop serve`.

A running server writes one small JSON file per process into the user's runtime directory
(address, model file identity, engine options, pid) and removes it on exit. A file left by
a server that died without removing it is recognised (dead pid) and removed by whoever
reads it. Standard library only: the CLI reads these before deciding whether it needs
torch at all.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

RUNTIME_DIR_ENV = "KVLOOP_RUNTIME_DIR"  # tests and odd setups: where run files live
SERVER_ENV = "KVLOOP_SERVER"  # a server to use, named by its URL (instead of the run files)
_PREFIX, _SUFFIX = "serve-", ".json"


def runtime_dir() -> Path:
    """$KVLOOP_RUNTIME_DIR, else $XDG_RUNTIME_DIR/kvloop (per user, cleared at logout),
    else ~/.cache/kvloop/run, else /tmp/kvloop-$UID."""
    if os.environ.get(RUNTIME_DIR_ENV):
        return Path(os.environ[RUNTIME_DIR_ENV])
    if os.environ.get("XDG_RUNTIME_DIR"):
        return Path(os.environ["XDG_RUNTIME_DIR"]) / "kvloop"
    home = Path.home()
    if home.is_dir() and os.access(home, os.W_OK):
        return home / ".cache" / "kvloop" / "run"
    import tempfile  # here and below, not at the top: every CLI command imports this module

    return Path(tempfile.gettempdir()) / f"kvloop-{os.getuid()}"


def model_identity(path: str | os.PathLike[str]) -> dict[str, Any]:
    """What makes two model paths the same model: the resolved file, its size and mtime
    (a file replaced in place is another model)."""
    real = os.path.realpath(path)
    # An HF directory: its config stands for it (the directory's own mtime moves whenever
    # a file beside the weights is added).
    probe = os.path.join(real, "config.json") if os.path.isdir(real) else real
    try:
        st = os.stat(probe)
    except OSError:
        return {"path": real}
    return {"path": real, "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def comparable_options(options: dict[str, Any]) -> dict[str, Any]:
    """Engine options as a run file stores them: JSON values, a chat template by its hash
    (it can be long, and only sameness matters)."""
    out = dict(options)
    if out.get("chat_template") is not None:
        import hashlib

        out["chat_template"] = hashlib.sha256(out["chat_template"].encode()).hexdigest()
    return out


@dataclass
class RunInfo:
    url: str  # http://HOST:PORT of the server
    pid: int
    model: str  # the served model's name, for `kvloop ps`
    model_identity: dict[str, Any]
    engine_options: dict[str, Any]
    api_key_required: bool = False  # the key itself is never written down
    started: float = field(default_factory=time.time)
    log: str | None = None  # --detach: where its output goes

    @property
    def path(self) -> Path:
        return runtime_dir() / f"{_PREFIX}{self.pid}{_SUFFIX}"


def write(info: RunInfo) -> Path:
    """Write `info` atomically (readers never see half a file), readable by the user only."""
    directory = info.path.parent
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    import tempfile

    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".serve-", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(asdict(info), f)
    os.replace(tmp, info.path)
    return info.path


def remove(info: RunInfo) -> None:
    with contextlib.suppress(FileNotFoundError):
        info.path.unlink()


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, someone else's (a recycled pid)
        return True
    return True


def live() -> list[RunInfo]:
    """The run files of servers whose process is alive, newest first; files of dead
    processes and unreadable ones are removed on the way."""
    directory = runtime_dir()
    if not directory.is_dir():
        return []
    found = []
    for path in directory.glob(f"{_PREFIX}*{_SUFFIX}"):
        info = read(path)
        if info is None or not pid_alive(info.pid):
            with contextlib.suppress(OSError):
                path.unlink()
            continue
        found.append(info)
    return sorted(found, key=lambda i: -i.started)


def read(path: Path) -> RunInfo | None:
    """The run file at `path`, or None if it is missing or unreadable."""
    try:
        data = json.loads(path.read_text())
        return RunInfo(**data)
    except (OSError, ValueError, TypeError):
        return None
