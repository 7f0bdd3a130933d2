"""A GGUF header reader: metadata and tensor directory in one pass over the memory-mapped file.

`gguf.GGUFReader` (the `gguf` package) builds a numpy view per array element while it
opens a file: 3.2 s for the default model's 49,152-token vocabulary here and ~23 s for
Gemma 3's 262,144, most of kvloop's start-up. This reader walks the same header with
`struct` on the map (strings decoded as they are met, numeric arrays taken whole with
`np.frombuffer`): ~0.05 s and ~0.3 s. It reads what kvloop uses (metadata values as Python
objects, as `ReaderField.contents()` gives them, and each tensor's type, shape and bytes
as views of the map) and nothing else; tests/test_gguf_reader.py holds it equal to
`gguf.GGUFReader` on real and crafted files. The `gguf` package keeps every other job:
type constants, block sizes, the reference dequantization, writing files.

A model file is untrusted input: every length and count is checked against the bytes
that remain before it is used, so a crafted header fails with one ValueError line instead
of reading past the map or allocating what it claims.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

GGUF_MAGIC = 0x46554747  # b"GGUF", little-endian
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ARRAY_DEPTH = 8  # arrays of arrays: deeper is a crafted file
# A Python object per array entry costs ~30-100 bytes against the file's 1-8, so the arrays
# of a crafted file are bounded before any is built (README's Security section):
# - tokens, scores and token types hold one entry per vocabulary entry: at most the
#   `<arch>.vocab_size` key (when it came first) and never over MAX_VOCAB (the largest
#   published vocabularies hold ~262k); after the header, at most the embedding's rows;
# - merges: at most MAX_MERGES;
# - the arrays of every other key together hold at most MAX_KEPT_ENTRIES entries (nested
#   arrays' included): one that would pass that budget is skipped, not built (kvloop reads
#   no such array; its value is a SkippedArray saying what was there). A budget over the
#   whole header, not a cap per key: many keys just under a cap multiplied memory as one
#   long array did. (Real files hold a few per-layer arrays of tens of entries.)
MAX_VOCAB = 1 << 20
MAX_MERGES = 1 << 21
MAX_KEPT_ENTRIES = 1 << 16
VOCAB_KEYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type")
MERGES_KEY = "tokenizer.ggml.merges"

V = gguf.GGUFValueType
_SCALARS: dict[int, str] = {  # value type -> struct format (little-endian)
    V.UINT8: "<B", V.INT8: "<b", V.UINT16: "<H", V.INT16: "<h", V.UINT32: "<I",
    V.INT32: "<i", V.FLOAT32: "<f", V.UINT64: "<Q", V.INT64: "<q", V.FLOAT64: "<d",
    V.BOOL: "<?",
}
_NUMPY: dict[int, np.dtype] = {t: np.dtype(f) for t, f in _SCALARS.items()}
# Element types of tensors whose bytes are items, not blocks (as gguf.GGUFReader types them).
_ITEM_DTYPES: dict[int, type] = {
    gguf.GGMLQuantizationType.F32: np.float32, gguf.GGMLQuantizationType.F16: np.float16,
    gguf.GGMLQuantizationType.F64: np.float64, gguf.GGMLQuantizationType.I8: np.int8,
    gguf.GGMLQuantizationType.I16: np.int16, gguf.GGMLQuantizationType.I32: np.int32,
    gguf.GGMLQuantizationType.I64: np.int64,
}


@dataclass(frozen=True)
class SkippedArray:
    """The value of a metadata array too long to build that kvloop never reads."""

    element_type: int
    count: int


@dataclass(frozen=True)
class TensorInfo:
    name: str
    tensor_type: gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # GGML order (ne[0], the innermost, first), as the file stores it
    offset: int  # of its first byte in the file
    nbytes: int
    # A read-only view of the map: items shaped in numpy order (rows, cols) for the item
    # types, bytes shaped (rows, bytes per row) for block formats, as gguf.GGUFReader.
    data: np.ndarray


class GGUFHeader:
    """A GGUF file's metadata (key -> Python value) and tensors (in file order)."""

    def __init__(self, path: str | Path) -> None:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            if size == 0:
                raise ValueError("the file is empty")
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._buf = memoryview(self._map)
        self._pos = 0
        self._kept_left = MAX_KEPT_ENTRIES  # of other keys' array entries (see above)
        self.metadata: dict[str, Any] = {}
        self.tensors: list[TensorInfo] = []
        self._read()

    def release(self, offset: int = 0, nbytes: int | None = None) -> None:
        """Drop the map's pages over [offset, offset + nbytes) (all of it by default) from
        this process's resident set. A tensor converted into its kernel layout is never read
        from the map again, but its pages would stay resident (and in the process's peak)
        until the map closes. The map is private and read-only, so a page read again later
        is faulted back in from the file: releasing can cost time, never correctness."""
        end = len(self._map) if nbytes is None else min(offset + nbytes, len(self._map))
        start = offset - offset % mmap.PAGESIZE
        if end > start and hasattr(mmap, "MADV_DONTNEED"):  # Linux, macOS
            self._map.madvise(mmap.MADV_DONTNEED, start, end - start)

    # ---- the walk ----
    def _need(self, n: int, what: str) -> None:
        if n < 0 or self._pos + n > len(self._buf):
            raise ValueError(f"{what} runs past the end of the file (offset {self._pos}, "
                             f"{n} bytes, file {len(self._buf)} bytes)")

    def _scalar(self, fmt: str, what: str) -> Any:
        n = struct.calcsize(fmt)
        self._need(n, what)
        (value,) = struct.unpack_from(fmt, self._buf, self._pos)
        self._pos += n
        return value

    def _string(self, what: str) -> str:
        n = self._scalar("<Q", what)
        self._need(n, what)
        raw = self._buf[self._pos : self._pos + n]
        self._pos += n
        try:
            return str(raw, "utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"{what} is not UTF-8 text") from None

    def _array_limit(self, key: str) -> tuple[int, bool]:
        """(most entries, refuse beyond it: else skip) for the array under `key`."""
        if key in VOCAB_KEYS:
            vocab = self.metadata.get(f"{self.metadata.get('general.architecture')}.vocab_size")
            if isinstance(vocab, int) and not isinstance(vocab, bool) and vocab > 0:
                return min(vocab, MAX_VOCAB), True
            return MAX_VOCAB, True
        if key == MERGES_KEY:
            return MAX_MERGES, True
        return self._kept_left, False

    def _value(self, vtype: int, what: str, depth: int = 0, key: str | None = None) -> Any:
        if vtype in _SCALARS:
            return self._scalar(_SCALARS[vtype], what)
        if vtype == V.STRING:
            return self._string(what)
        if vtype != V.ARRAY:
            raise ValueError(f"{what} has unknown value type {vtype}")
        if depth >= MAX_ARRAY_DEPTH:
            raise ValueError(f"{what} nests arrays more than {MAX_ARRAY_DEPTH} deep")
        etype = self._scalar("<I", what)
        count = self._scalar("<Q", what)
        if key is not None:  # a key's own array (not one nested in it)
            limit, refuse = self._array_limit(key)
            if count > limit and refuse:
                raise ValueError(f"{what} holds {count} entries, more than {limit} (the "
                                 "vocabulary size, or kvloop's cap for this key)")
            if count > limit:
                self._skip_array(etype, count, what, depth)
                return SkippedArray(etype, count)
            if not refuse:
                self._kept_left -= count
        elif count > self._kept_left:  # nested: cannot be skipped alone, and kvloop reads none
            raise ValueError(f"{what}: nested arrays hold more than {MAX_KEPT_ENTRIES} entries")
        else:
            self._kept_left -= count
        if etype in _NUMPY:  # numbers: one view, converted whole
            dtype = _NUMPY[etype]
            self._need(count * dtype.itemsize, what)
            arr = np.frombuffer(self._buf, dtype, count, self._pos)
            self._pos += count * dtype.itemsize
            return arr.tolist()
        # Strings (or arrays): each element takes at least 8 bytes of length.
        self._need(count * 8, what)
        if etype == V.STRING:
            return self._strings(count, what)
        return [self._value(etype, what, depth + 1) for _ in range(count)]

    def _strings(self, count: int, what: str) -> list[str]:
        """`count` strings, as `_string` reads each (the same checks, the same errors), in
        one loop with no call per element: a vocabulary and its merges are ~100k of them,
        which read one `_string` call at a time were a tenth of a one-shot's load."""
        buf, pos, size, unpack = self._buf, self._pos, len(self._buf), struct.unpack_from
        out: list[str] = []
        append = out.append
        try:
            for _ in range(count):
                if pos + 8 > size:
                    self._pos = pos
                    self._need(8, what)
                (n,) = unpack("<Q", buf, pos)
                pos += 8
                if pos + n > size:
                    self._pos = pos
                    self._need(n, what)
                append(str(buf[pos : pos + n], "utf-8"))
                pos += n
        except UnicodeDecodeError:
            raise ValueError(f"{what} is not UTF-8 text") from None
        self._pos = pos
        return out

    def _skip_array(self, etype: int, count: int, what: str, depth: int) -> None:
        """Move past an array's elements without building them."""
        if etype in _NUMPY:
            self._need(count * _NUMPY[etype].itemsize, what)
            self._pos += count * _NUMPY[etype].itemsize
            return
        self._need(count * 8, what)
        for _ in range(count):
            if etype == V.STRING:
                n = self._scalar("<Q", what)
                self._need(n, what)
                self._pos += n
            elif etype == V.ARRAY:
                if depth + 1 >= MAX_ARRAY_DEPTH:
                    raise ValueError(f"{what} nests arrays more than {MAX_ARRAY_DEPTH} deep")
                inner, n = self._scalar("<I", what), self._scalar("<Q", what)
                self._skip_array(inner, n, what, depth + 1)
            else:
                raise ValueError(f"{what} has unknown value type {etype}")

    def _read(self) -> None:
        if self._scalar("<I", "the magic number") != GGUF_MAGIC:
            raise ValueError("GGUF magic invalid")
        version = self._scalar("<I", "the version")
        if version not in SUPPORTED_VERSIONS:
            raise ValueError(f"GGUF version {version} is not supported (kvloop reads "
                             f"{', '.join(map(str, SUPPORTED_VERSIONS))})")
        n_tensors = self._scalar("<Q", "the tensor count")
        n_kv = self._scalar("<Q", "the key count")
        # Each key takes at least 12 bytes, each tensor at least 24: a count beyond what
        # the file can hold is refused before any loop.
        self._need(n_kv * 12 + n_tensors * 24, "the header")
        for i in range(n_kv):
            key = self._string(f"metadata key {i}")
            if key in self.metadata:
                raise ValueError(f"duplicate metadata key {key!r:.60}")
            vtype = self._scalar("<I", f"metadata {key!r:.60}")
            self.metadata[key] = self._value(vtype, f"metadata {key!r:.60}", key=key)
        infos = []
        for i in range(n_tensors):
            name = self._string(f"tensor name {i}")
            n_dims = self._scalar("<I", f"tensor {name!r:.60}")
            if not 1 <= n_dims <= MAX_DIMS:
                raise ValueError(f"tensor {name!r:.60} has {n_dims} dimensions (1 to "
                                 f"{MAX_DIMS})")
            self._need(8 * n_dims, f"tensor {name!r:.60}")
            dims = struct.unpack_from(f"<{n_dims}Q", self._buf, self._pos)
            self._pos += 8 * n_dims
            raw_type = self._scalar("<I", f"tensor {name!r:.60}")
            offset = self._scalar("<Q", f"tensor {name!r:.60}")
            infos.append((name, dims, raw_type, offset))
        align = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if (isinstance(align, bool) or not isinstance(align, int) or align <= 0
                or align & (align - 1)):
            raise ValueError(f"general.alignment = {align!r:.60} is not a power of two")
        data_start = -(-self._pos // align) * align
        names: set[str] = set()
        for name, dims, raw_type, offset in infos:
            self.tensors.append(self._tensor(name, dims, raw_type, data_start + offset))
            if name in names:
                raise ValueError(f"duplicate tensor {name!r:.60}")
            names.add(name)
        self._check_vocabulary()

    def _check_vocabulary(self) -> None:
        """Tokens, scores and token types: one per row of the token embedding, at most."""
        embedding = next((t for t in self.tensors if t.name == "token_embd.weight"), None)
        if embedding is None or len(embedding.shape) != 2:
            return
        rows = embedding.shape[1]
        for key in VOCAB_KEYS:
            value = self.metadata.get(key)
            if isinstance(value, list) and len(value) > rows:
                raise ValueError(f"metadata {key!r} holds {len(value)} entries, more than "
                                 f"the token embedding's {rows} rows")

    def _tensor(self, name: str, dims: tuple[int, ...], raw_type: int,
                offset: int) -> TensorInfo:
        try:
            kind = gguf.GGMLQuantizationType(raw_type)
            block, type_size = gguf.GGML_QUANT_SIZES[kind]
        except (ValueError, KeyError):
            raise ValueError(f"tensor {name!r:.60} has unknown type {raw_type}") from None
        n = int(np.prod(dims, dtype=object))
        if dims[0] % block:
            raise ValueError(f"tensor {name!r:.60}: rows of {dims[0]} are not whole "
                             f"{kind.name} blocks of {block}")
        nbytes = n // block * type_size
        if offset + nbytes > len(self._buf):
            raise ValueError(f"tensor {name!r:.60} ({nbytes} bytes at offset {offset}) runs "
                             f"past the end of the file ({len(self._buf)} bytes)")
        np_dims = tuple(int(d) for d in reversed(dims))
        data: np.ndarray
        if kind in _ITEM_DTYPES:
            data = np.frombuffer(self._buf, _ITEM_DTYPES[kind], n, offset).reshape(np_dims)
        else:  # blocks: bytes per row
            row_bytes = np_dims[-1] // block * type_size
            data = np.frombuffer(self._buf, np.uint8, nbytes, offset).reshape(
                (*np_dims[:-1], row_bytes))
        return TensorInfo(name, kind, tuple(int(d) for d in dims), offset, nbytes, data)
