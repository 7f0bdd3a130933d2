"""A start whose kernel sources, flags and torch match the stamp of the last build imports
that build directly (no torch.utils.cpp_extension, no ninja); anything else (another
stamp, a library rewritten by some other build) goes through load() as ever."""

from __future__ import annotations

import os

import pytest

from kvloop import kernels
from kvloop.kernels import build


def test_stamped_build_is_imported_directly_and_only_while_it_matches() -> None:
    if not kernels.available():
        pytest.skip("no kernel build here")
    isa = build._isa()
    name = f"kvloop_kernels_{isa}"
    directory = build._build_dir(name)
    flags = ["-O3", "-fopenmp", *build._FLAGS[isa]]
    stamp = build._stamp(flags)
    stamp_file = directory / build._STAMP
    library = directory / f"{name}.so"
    if not stamp_file.is_file():
        stamp_file.write_text(f"{stamp} {build._library_id(library)}")
    module = build._load_built(directory, name, stamp)
    assert module is not None and module.compiled_isa() == build._module.compiled_isa()
    assert build._load_built(directory, name, "0" * 64) is None  # other sources or flags
    assert stamp != build._stamp([*flags, "-DX"])
    st = library.stat()
    try:
        os.utime(library, ns=(st.st_atime_ns, st.st_mtime_ns + 1))  # rebuilt by another
        assert build._load_built(directory, name, stamp) is None
    finally:
        os.utime(library, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert build._load_built(directory, name, stamp) is not None
