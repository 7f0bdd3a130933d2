"""Building and loading the native kernel extension (all of ``csrc/``, one module).

It is built on first use with ``torch.utils.cpp_extension.load`` into a kvloop-owned
cache directory and reloaded from there afterwards; ``available()`` is the one gate.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
# One extension module from all kernel sources (kvloop.h declares what they share).
_SOURCES = [_CSRC / f for f in
            ("bindings.cpp", "paged_attention.cpp", "linear.cpp", "stored_blocks.cpp",
              "gemm.cpp", "decoder.cpp", "sampling.cpp")]
_lock = threading.Lock()
_module: Any = None
_tried = False


ISAS = ("scalar", "avx2", "avx512vnni")
_FLAGS = {
    "scalar": [],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    # AVX-512 VNNI's vpdpbusd (on 256-bit registers: AVX512VL) for the int8 dot products.
    "avx512vnni": ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl",
                   "-mavx512vnni"],
}


def cpu_isas() -> list[str]:
    """The builds this CPU can run, most capable last."""
    cap = torch.backends.cpu.get_cpu_capability()  # "DEFAULT", "AVX2", "AVX512", ...
    features = torch.cpu.get_capabilities()
    isas = ["scalar"]
    if cap in ("AVX2", "AVX512"):
        isas.append("avx2")
    if cap == "AVX512" and all(features.get(f, False) for f in
                               ("avx512_f", "avx512_bw", "avx512_vl", "avx512_vnni")):
        isas.append("avx512vnni")
    return isas


def kernel_isa() -> str:
    """The build the kernels use on this CPU (see _isa); RuntimeError for a KVLOOP_ISA this
    CPU cannot run."""
    return _isa()


def _isa() -> str:
    """The instruction set to build for: the CPU's best, or ``KVLOOP_ISA`` if it can run it.

    Explicit flags rather than ``-march=native``: the build cache may sit on a home
    directory shared by machines with different CPUs, and the ISA is part of the
    extension's name, so a build is only ever reused on a CPU class it can run on.
    """
    isas = cpu_isas()
    want = os.environ.get("KVLOOP_ISA", "")
    if want:
        if want not in isas:
            raise RuntimeError(f"KVLOOP_ISA={want!r}: this CPU runs {', '.join(isas)}")
        return want
    return isas[-1]


def _build_dir(name: str) -> Path:
    root = os.environ.get("KVLOOP_EXTENSIONS_DIR")
    base = Path(root) if root else Path.home() / ".cache" / "kvloop" / "torch_extensions"
    # Extensions link against one torch's C++ ABI: keep builds of different versions apart.
    tag = f"py{sys.version_info.major}{sys.version_info.minor}_torch{torch.__version__}"
    return base / tag / name


def _build(isa: str, verbose: bool = False) -> Any:
    # Imported here so that a platform without them only fails the build, never the import.
    import fcntl

    name = f"kvloop_kernels_{isa}"
    flags = ["-O3", "-fopenmp", *_FLAGS[isa]]
    build_dir = _build_dir(name)
    build_dir.mkdir(parents=True, exist_ok=True)
    # load() recompiles only when the source or flags change (it hashes them). Its own
    # lock is a plain file that a build killed midway leaves behind, and every later
    # load() then waits on it forever. So builds here serialise on an flock (released by
    # the OS when its holder dies) and, holding it, clear any such stale file.
    stamp = _stamp(flags)
    with open(build_dir / "kvloop.flock", "w") as lockf:
        fcntl.flock(lockf, fcntl.LOCK_EX)
        built = _load_built(build_dir, name, stamp)
        if built is not None:
            return built
        (build_dir / "lock").unlink(missing_ok=True)
        from torch.utils.cpp_extension import load

        module = load(
            name=name,
            sources=[str(p) for p in _SOURCES],
            extra_include_paths=[str(_CSRC)],
            extra_cflags=flags,
            extra_ldflags=["-fopenmp"],  # resolves to the libgomp torch already loaded
            build_directory=str(build_dir),
            verbose=verbose,
        )
        (build_dir / _STAMP).write_text(f"{stamp} {_library_id(build_dir / f'{name}.so')}")
        return module


# Written beside a build that load() made: what it was built from, and the library it
# made (size and mtime: a build from other sources into the same directory, by a kvloop
# that writes no stamp, changes them). A later start whose sources, flags and torch are
# the same, and whose library is that one, imports it directly, without importing
# torch.utils.cpp_extension or running ninja to find nothing to do (together ~a tenth of
# a one-shot's time).
_STAMP = "kvloop.stamp"


def _stamp(flags: list[str]) -> str:
    import hashlib

    h = hashlib.sha256(repr((torch.__version__, sys.version, flags)).encode())
    for path in sorted(_CSRC.iterdir()):
        if path.is_file():
            h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def _load_built(build_dir: Path, name: str, stamp: str) -> Any:
    """The module built in `build_dir` from exactly these sources and flags, or None (no
    stamp, another one, or no library: load() then builds as ever)."""
    import importlib.util

    library = build_dir / f"{name}.so"
    try:
        if (build_dir / _STAMP).read_text() != f"{stamp} {_library_id(library)}":
            return None
    except OSError:
        return None
    # As torch.utils.cpp_extension.load imports what it builds.
    spec = importlib.util.spec_from_file_location(name, library)
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _library_id(library: Path) -> str:
    st = library.stat()
    return f"{st.st_size}:{st.st_mtime_ns}"


def available() -> bool:
    """Whether the native kernel can be used; builds (or loads the cached build) once.

    Never raises: a missing compiler, ninja or a build error logs one warning and returns
    False, and callers stay on the PyTorch path. ``KVLOOP_NO_KERNELS=1`` disables it.
    """
    global _module, _tried
    if _tried:  # fast path, no lock: set only after _module is final
        return _module is not None
    with _lock:
        if not _tried:
            if os.environ.get("KVLOOP_NO_KERNELS", "") not in ("", "0"):
                log.info("native kernels disabled by KVLOOP_NO_KERNELS")
            else:
                try:
                    _module = _build(_isa())
                    log.info("native kernels: %s build", _module.compiled_isa())
                except Exception as e:  # any build/load failure: fall back, never crash
                    msg = str(e).strip().splitlines()
                    log.warning("native kernels unavailable, using PyTorch: %s",
                                " | ".join(msg[-5:]) or type(e).__name__)
                    _module = None
            _tried = True
    return _module is not None


def native_module() -> Any:
    """The built extension module (raises when ``available()`` is False)."""
    if not available():
        raise RuntimeError("the native kernels are not available (see available())")
    return _module
