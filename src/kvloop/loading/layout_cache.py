"""An on-disk cache of weight layouts that take real work to build (int8 / int4
re-quantization), so that later starts read them instead of rebuilding them.

One safetensors file per (model file, layout), in ``$KVLOOP_CACHE_DIR/layouts`` (default
``~/.cache/kvloop/layouts``, beside the kernels' build cache); ``KVLOOP_LAYOUT_CACHE=0``
turns it off. A file is named by a hash of its key and holds the key itself:

- the model file's identity: its resolved path, size, modification time and inode, and a
  digest of its first and last 64 KiB (a file replaced in place, even with the same
  mtime, reads differently there);
- the layout: the quantization, kvloop's layout version (bumped when a layout changes),
  the kernels' ISA build and torch's version;

and a CRC-32 of every tensor's bytes. A file whose key differs (a hash collision or a
copy from elsewhere), that is truncated or corrupt (safetensors cannot parse it, a CRC
differs, a tensor is missing), is never used: it is rebuilt and replaced. Writes go to a
private temporary file renamed into place (atomic on POSIX), so two processes building
at once each write a whole file and a reader only ever sees a whole one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import zlib
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

log = logging.getLogger(__name__)

LAYOUT_VERSION = 2  # bump when a cached layout's meaning changes
_EDGE = 64 * 1024  # bytes of the model file's start and end that are hashed


def cache_dir() -> Path | None:
    """Where layouts are cached, or None when KVLOOP_LAYOUT_CACHE=0 turns the cache off."""
    if os.environ.get("KVLOOP_LAYOUT_CACHE", "1") == "0":
        return None
    root = os.environ.get("KVLOOP_CACHE_DIR")
    base = Path(root) if root else Path.home() / ".cache" / "kvloop"
    return base / "layouts"


def file_identity(path: Path) -> dict[str, object]:
    """What tells this model file from another one, or from itself rewritten."""
    real = path.resolve()
    st = real.stat()
    h = hashlib.sha256()
    with open(real, "rb") as f:
        h.update(f.read(_EDGE))
        f.seek(max(0, st.st_size - _EDGE))
        h.update(f.read(_EDGE))
    return {"path": str(real), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "inode": st.st_ino, "edges_sha256": h.hexdigest()}


class LayoutCache:
    """The cached layouts of one model file in one layout (`layout`: the quantization and
    anything else that decides the bytes)."""

    def __init__(self, model_path: Path, layout: dict[str, object],
                 directory: Path | None = None) -> None:
        self.key = json.dumps({"model": file_identity(model_path), "layout": layout,
                               "version": LAYOUT_VERSION, "torch": torch.__version__},
                              sort_keys=True)
        self.directory = directory if directory is not None else cache_dir()
        digest = hashlib.sha256(self.key.encode()).hexdigest()[:32]
        self.path = (self.directory / f"{digest}.safetensors") if self.directory else None

    def load(self) -> dict[str, torch.Tensor] | None:
        """The cached tensors, or None (absent, stale or damaged: the caller rebuilds)."""
        if self.path is None or not self.path.is_file():
            return None
        try:
            with safe_open(str(self.path), framework="pt") as f:
                meta = f.metadata() or {}
                if meta.get("kvloop_key") != self.key:
                    raise ValueError("built for another model file or layout")
                crcs = json.loads(meta["kvloop_crc32"])
                if sorted(crcs) != sorted(f.keys()):
                    raise ValueError("its tensors are not the ones it lists")
                # Copied out of the map: safetensors places tensors at any byte offset,
                # and vectorized kernels (PyTorch's int8 GEMM among them) assume the
                # allocator's alignment (a misaligned cached int8 head crashed one).
                out = {name: f.get_tensor(name).clone() for name in crcs}
            for name, t in out.items():
                if _crc32(t) != crcs[name]:
                    raise ValueError(f"tensor {name} is damaged (CRC-32 differs)")
            return out
        except Exception as e:  # unreadable in any way: never used, rebuilt
            log.warning("layout cache %s is unusable (%s): rebuilding it", self.path,
                        str(e).splitlines()[0][:200] if str(e) else type(e).__name__)
            return None

    def save(self, tensors: dict[str, torch.Tensor]) -> None:
        """Write the tensors (atomically: a temporary file renamed into place). A cache
        that cannot be written (read-only home, full disk) costs a warning, not the load."""
        if self.path is None:
            return
        tensors = {name: t.contiguous() for name, t in tensors.items()}
        meta = {"kvloop_key": self.key,
                "kvloop_crc32": json.dumps({n: _crc32(t) for n, t in tensors.items()})}
        tmp = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".tmp-",
                                       suffix=".safetensors")
            os.close(fd)
            save_file(tensors, tmp, metadata=meta)
            os.replace(tmp, self.path)
            tmp = None
        except OSError as e:
            log.warning("layout cache %s not written: %s", self.path, e)
        finally:
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)


def _crc32(t: torch.Tensor) -> int:
    data: Any = t.contiguous().view(torch.uint8).numpy()  # a buffer, no copy
    return zlib.crc32(data)
