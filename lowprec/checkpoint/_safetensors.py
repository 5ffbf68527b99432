"""Reading and writing safetensors files tensor by tensor, validating everything, no pickle.

The format (https://github.com/huggingface/safetensors#format): an 8-byte little-endian
unsigned header length N, then N bytes of UTF-8 JSON (may end in spaces), then the data.
The JSON maps each tensor name to ``{"dtype", "shape", "data_offsets": [begin, end]}``
(offsets relative to the start of the data) and may hold ``"__metadata__"``: a str → str map.
Tensors are little-endian, C-contiguous, and together cover the data exactly.

This module needs only NumPy and ml_dtypes (the ``safetensors`` package is not used, so
bfloat16 and FP8 tensors read fine and nothing is ever loaded whole).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
import threading
from typing import Iterator, Optional

import ml_dtypes
import numpy as np

from ._atomic import AtomicFile, Inputs, Transaction
from ._errors import CheckpointError

MAX_HEADER_BYTES = 100 * 1024 * 1024  # the limit the reference (Rust) implementation enforces
_COPY_CHUNK = 64 * 1024 * 1024

# safetensors dtype name → (NumPy dtype or None when there is none, bits per element)
DTYPES: dict[str, tuple[Optional[np.dtype], int]] = {
    "BOOL": (np.dtype(np.bool_), 8),
    "U8": (np.dtype(np.uint8), 8),
    "I8": (np.dtype(np.int8), 8),
    "U16": (np.dtype(np.uint16), 16),
    "I16": (np.dtype(np.int16), 16),
    "U32": (np.dtype(np.uint32), 32),
    "I32": (np.dtype(np.int32), 32),
    "U64": (np.dtype(np.uint64), 64),
    "I64": (np.dtype(np.int64), 64),
    "F16": (np.dtype(np.float16), 16),
    "BF16": (np.dtype(ml_dtypes.bfloat16), 16),
    "F32": (np.dtype(np.float32), 32),
    "F64": (np.dtype(np.float64), 64),
    "C64": (np.dtype(np.complex64), 64),
    "F8_E4M3": (np.dtype(ml_dtypes.float8_e4m3fn), 8),
    "F8_E5M2": (np.dtype(ml_dtypes.float8_e5m2), 8),
    "F8_E8M0": (np.dtype(ml_dtypes.float8_e8m0fnu), 8),
    "F8_E4M3FNUZ": (np.dtype(ml_dtypes.float8_e4m3fnuz), 8),
    "F8_E5M2FNUZ": (np.dtype(ml_dtypes.float8_e5m2fnuz), 8),
    # Sub-byte types: sizes are validated and the raw bytes copied, but not decoded.
    "F4": (None, 4),
    "F6_E2M3": (None, 6),
    "F6_E3M2": (None, 6),
}
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")

_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle", ".th")




def dtype_name(dtype) -> str:
    """The safetensors name of a NumPy/ml_dtypes dtype.

    Example:
        >>> import ml_dtypes
        >>> dtype_name(np.float32), dtype_name(ml_dtypes.bfloat16)
        ('F32', 'BF16')
    """
    dtype = np.dtype(dtype)
    for name, (np_dtype, _) in DTYPES.items():
        if np_dtype == dtype:
            return name
    raise CheckpointError(f"dtype {dtype} has no safetensors equivalent")


def numpy_dtype(name: str) -> np.dtype:
    """The NumPy/ml_dtypes dtype of a safetensors dtype name (raises for sub-byte types)."""
    if name not in DTYPES:
        raise CheckpointError(f"unknown safetensors dtype {name!r}; known: {', '.join(DTYPES)}")
    dtype = DTYPES[name][0]
    if dtype is None:
        raise CheckpointError(f"safetensors dtype {name} (sub-byte) cannot be decoded by lowprec")
    return dtype


def nbytes_of(dtype: str, shape) -> int:
    bits = DTYPES[dtype][1] * math.prod(shape)
    return -(-bits // 8)


def region_runs(view, rect, itemsize: int) -> Iterator[tuple]:
    """Contiguous byte runs ``(offset, length)`` of a region of a C-order tensor.

    The tensor is seen as a 3-D array ``view`` = (P, A, S) and the region is
    ``[p0:p1, a0:a1, s0:s1]``; the runs come in the region's own C order, so reading
    them one after another fills a C-order array of the region.

    Example:
        >>> list(region_runs((2, 4, 3), (0, 2, 1, 3, 0, 3), 1))  # rows 1-2 of both planes
        [(3, 6), (15, 6)]
        >>> list(region_runs((1, 2, 4), (0, 1, 0, 2, 1, 3), 4))  # a column slab
        [(4, 8), (20, 8)]
    """
    P, A, S = view
    p0, p1, a0, a1, s0, s1 = rect
    if not (0 <= p0 <= p1 <= P and 0 <= a0 <= a1 <= A and 0 <= s0 <= s1 <= S):
        raise ValueError(f"region {rect} is outside the view {view}")
    if p0 == p1 or a0 == a1 or s0 == s1:
        return
    if s0 == 0 and s1 == S:
        if a0 == 0 and a1 == A:
            yield p0 * A * S * itemsize, (p1 - p0) * A * S * itemsize
            return
        for p in range(p0, p1):
            yield (p * A + a0) * S * itemsize, (a1 - a0) * S * itemsize
        return
    for p in range(p0, p1):
        for a in range(a0, a1):
            yield ((p * A + a) * S + s0) * itemsize, (s1 - s0) * itemsize


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """One tensor entry of a safetensors header (offsets absolute in the file)."""

    name: str
    dtype: str
    shape: tuple
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _refuse_pickle(path: str, head: bytes) -> None:
    """Raises if ``head`` (the first 9 bytes) is not a safetensors start but a pickle/zip one.

    A safetensors file has its JSON header's '{' at byte 8 (its first byte may well be 0x80,
    a header of 128 + 256k bytes, so pickle magic alone proves nothing).
    """
    if len(head) >= 9 and head[8:9] == b"{":
        return
    is_zip = head[:4] == b"PK\x03\x04"  # torch.save's default format since PyTorch 1.6
    is_pickle = len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5
    if is_zip or is_pickle or path.lower().endswith(_PICKLE_SUFFIXES):
        raise CheckpointError(
            f"{path}: this looks like a PyTorch/pickle checkpoint, not safetensors. lowprec never "
            "loads pickles (unpickling can run arbitrary code). Convert it once, in an "
            "environment you trust, e.g. `python -c \"import torch; from safetensors.torch import "
            "save_file; save_file(torch.load('model.bin', weights_only=True), "
            "'model.safetensors')\"`, then pass the .safetensors file."
        )


def _no_duplicates(pairs):
    out = {}
    for key, value in pairs:
        if key in out:
            raise CheckpointError(f"duplicate key {key!r} in the JSON header")
        out[key] = value
    return out


class SafetensorsReader:
    """A validated, read-only view of a safetensors file; tensors are read one at a time.

    Raises :class:`CheckpointError` naming the file and the problem for: a missing file,
    a pickle checkpoint, a file shorter than its header says (truncated), header JSON that
    does not parse, unknown dtypes, bad shapes, a byte length that disagrees with
    shape × itemsize, offsets out of range, overlapping or with gaps, trailing bytes.

    Example:
        >>> import os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "a.safetensors")
        >>> with SafetensorsWriter(path, [("w", "F32", (2, 2))]) as w:
        ...     w.write("w", np.eye(2, dtype=np.float32))
        >>> with SafetensorsReader(path) as r:
        ...     r.tensors["w"].shape, r.read("w").tolist()
        ((2, 2), [[1.0, 0.0], [0.0, 1.0]])
    """

    def __init__(self, path):
        self.path = os.fspath(path)
        if not os.path.exists(self.path):
            raise CheckpointError(f"{self.path}: no such file")
        if not os.path.isfile(self.path):
            raise CheckpointError(f"{self.path}: not a regular file")
        self._file = open(self.path, "rb")
        self._seek_lock = threading.Lock()  # where there is no pread: seek + read in one go
        try:
            self._parse()
        except BaseException:
            self._file.close()
            raise

    def _fail(self, problem: str):
        raise CheckpointError(f"{self.path}: {problem}")

    def _parse(self):
        size = os.fstat(self._file.fileno()).st_size
        head = self._file.read(9)
        _refuse_pickle(self.path, head)
        head = head[:8]
        self._file.seek(8)
        if len(head) < 8:
            self._fail(
                f"file is {size} bytes; a safetensors file starts with an 8-byte header length "
                "(empty or truncated file?)"
            )
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES:
            self._fail(
                f"header length field is {n} bytes (limit {MAX_HEADER_BYTES}); not a safetensors "
                "file or corrupted"
            )
        if 8 + n > size:
            self._fail(
                f"header length field says {n} bytes but only {size - 8} follow: the file is "
                "truncated or not a safetensors file"
            )
        raw = self._file.read(n)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            self._fail(f"header is not UTF-8 ({e})")
        if not text.startswith("{"):
            self._fail("header does not start with '{'; not a safetensors file")
        try:
            header = json.loads(text, object_pairs_hook=_no_duplicates)
        except json.JSONDecodeError as e:
            self._fail(f"header is not valid JSON ({e})")
        except RecursionError:
            self._fail("header JSON is nested too deeply (not a safetensors header)")
        except CheckpointError as e:
            self._fail(str(e))
        if not isinstance(header, dict):
            self._fail("header JSON is not an object")
        metadata = header.pop("__metadata__", None) or {}
        if not isinstance(metadata, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
        ):
            self._fail("__metadata__ must map strings to strings")
        for text in [*header, *metadata, *metadata.values()]:
            # JSON's \ud800 escapes decode to lone surrogates, which no UTF-8 output (a
            # header, a report, a terminal) can hold.
            try:
                str(text).encode("utf-8")
            except UnicodeEncodeError:
                self._fail(f"name or metadata {ascii(text)[:80]} is not valid Unicode (a lone "
                           "surrogate escape); rename it in the producing tool")
        self.metadata: dict[str, str] = dict(metadata)
        self.header_size = n
        self.data_start = 8 + n
        data_size = size - self.data_start
        infos = []
        for name, entry in header.items():
            infos.append(self._entry(name, entry, data_size))
        infos.sort(key=lambda t: (t.begin, t.end))
        pos = self.data_start
        for info in infos:
            if info.begin != pos:
                what = "overlaps the previous tensor" if info.begin < pos else "leaves a gap"
                self._fail(
                    f"tensor {info.name!r} starts at data offset {info.begin - self.data_start} "
                    f"but the previous tensor ends at {pos - self.data_start}: it {what}"
                )
            pos = info.end
        if pos != size:
            self._fail(
                f"{size - pos} bytes after the last tensor are not covered by the header "
                "(corrupted or concatenated file)"
            )
        self.tensors: dict[str, TensorInfo] = {t.name: t for t in infos}

    def _entry(self, name, entry, data_size) -> TensorInfo:
        if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= set(entry):
            self._fail(f"tensor {name!r}: entry needs 'dtype', 'shape' and 'data_offsets'")
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if dtype not in DTYPES:
            self._fail(f"tensor {name!r}: unknown dtype {dtype!r} (known: {', '.join(DTYPES)})")
        if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
        ):
            self._fail(f"tensor {name!r}: shape {shape!r} is not a list of non-negative ints")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]
        ):
            self._fail(f"tensor {name!r}: data_offsets {offsets!r} is not [begin, end], 0 <= begin <= end")
        begin, end = offsets
        expected = nbytes_of(dtype, shape)
        if end - begin != expected:
            self._fail(
                f"tensor {name!r}: {dtype} {shape} needs {expected} bytes but data_offsets "
                f"{offsets} span {end - begin}"
            )
        if end > data_size:
            self._fail(
                f"tensor {name!r} ends at data offset {end} but the file holds only {data_size} "
                "data bytes: the file is truncated"
            )
        return TensorInfo(name, dtype, tuple(shape), self.data_start + begin, self.data_start + end)

    # -- reading --------------------------------------------------------------
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        self._file.close()

    def __contains__(self, name) -> bool:
        return name in self.tensors

    def _info(self, name) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise CheckpointError(f"{self.path}: no tensor named {name!r}") from None

    def _read_into(self, offset: int, out: np.ndarray):
        buf = memoryview(out.reshape(-1).view(np.uint8))
        done = 0
        while done < len(buf):  # one read(2) returns at most ~2 GiB
            if hasattr(os, "preadv"):
                got = os.preadv(self._file.fileno(), [buf[done:]], offset + done)
            else:  # pragma: no cover - Windows
                with self._seek_lock:
                    self._file.seek(offset + done)
                    got = self._file.readinto(buf[done:])
            if got <= 0:
                raise CheckpointError(
                    f"{self.path}: short read at byte {offset + done} (file changed or truncated?)"
                )
            done += got

    def read(self, name: str) -> np.ndarray:
        """Reads tensor ``name`` into a new NumPy array (its own memory, not a memmap)."""
        info = self._info(name)
        out = np.empty(info.shape, numpy_dtype(info.dtype))
        if out.nbytes:
            self._read_into(info.begin, out)
        return out

    def read_rows(self, name: str, start: int, stop: int) -> np.ndarray:
        """Reads ``tensor[start:stop]`` (along axis 0) without reading the rest."""
        info = self._info(name)
        dtype = numpy_dtype(info.dtype)
        row = math.prod(info.shape[1:]) * dtype.itemsize
        out = np.empty((stop - start, *info.shape[1:]), dtype)
        if out.nbytes:
            self._read_into(info.begin + start * row, out)
        return out

    def read_region(self, name: str, view, rect) -> np.ndarray:
        """Reads one rectangular region of tensor ``name`` seen as a 3-D array ``view``.

        ``view`` = (P, A, S) with P·A·S elements (see :func:`region_runs`), ``rect`` =
        (p0, p1, a0, a1, s0, s1). Returns a new array of shape (p1−p0, a1−a0, s1−s0),
        read with one ``pread`` per contiguous run (nothing else of the tensor is read).
        """
        info = self._info(name)
        dtype = numpy_dtype(info.dtype)
        if math.prod(view) != info.numel:
            raise CheckpointError(f"{self.path}: tensor {name!r} of shape {list(info.shape)} "
                                  f"cannot be viewed as {list(view)}")
        p0, p1, a0, a1, s0, s1 = rect
        out = np.empty((p1 - p0, a1 - a0, s1 - s0), dtype)
        flat = out.reshape(-1).view(np.uint8)
        pos = 0
        for offset, n in region_runs(view, rect, dtype.itemsize):
            self._read_into(info.begin + offset, flat[pos:pos + n])
            pos += n
        return out

    def iter_raw(self, name: str, chunk: int = _COPY_CHUNK) -> Iterator[bytes]:
        """Yields the raw bytes of tensor ``name`` in chunks (any dtype, sub-byte included)."""
        info = self._info(name)
        pos = info.begin
        while pos < info.end:
            n = min(chunk, info.end - pos)
            data = bytearray(n)
            self._read_into(pos, np.frombuffer(data, np.uint8))
            yield data
            pos += n


class SafetensorsWriter(Transaction):
    """Writes a safetensors file tensor by tensor (or region by region) atomically.

    The header (names, dtypes, shapes, metadata) is fixed up front, so every tensor's place
    in the file is known: :meth:`write` appends to a tensor (whole or
    in consecutive C-order pieces), :meth:`write_region` writes any region of a tensor
    (use one or the other for a given tensor).
    The data goes to a temp file beside ``path`` (see :mod:`lowprec.checkpoint._atomic`);
    ``commit()`` (or leaving the ``with`` block normally) checks that every byte was
    written, fsyncs and renames it onto ``path``; an error removes it and leaves ``path``
    as it was.

    Args:
      path: destination.
      entries: ``(name, safetensors dtype, shape)`` in file order.
      metadata: str → str ``__metadata__``.
      force: replace an existing regular file at ``path`` (otherwise :class:`CheckpointError`).
      inputs: the run's input files (:class:`Inputs`); ``path`` must not be or alias one.
    """

    def __init__(self, path, entries, metadata: Optional[dict] = None, *, force: bool = False,
                 inputs: Optional[Inputs] = None):
        self.path = os.fspath(path)
        header: dict = {}
        if metadata:
            bad = [k for k, v in metadata.items() if not (isinstance(k, str) and isinstance(v, str))]
            if bad:
                raise CheckpointError(f"metadata must map str to str; bad keys: {bad}")
            header["__metadata__"] = dict(metadata)
        self._order = []
        self._sizes = {}
        self._begin = {}
        self._filled = {}
        self._rows = {}
        offset = 0
        for name, dtype, shape in entries:
            if name == "__metadata__" or name in self._sizes:
                raise CheckpointError(f"{self.path}: tensor name {name!r} used twice")
            if dtype not in DTYPES:
                raise CheckpointError(f"unknown safetensors dtype {dtype!r}")
            shape = [int(d) for d in shape]
            size = nbytes_of(dtype, shape)
            header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
            self._order.append(name)
            self._sizes[name] = size
            self._rows[name] = shape[0] if shape else 1
            self._filled[name] = 0
            offset += size
        self._dtypes = {name: header[name]["dtype"] for name in self._order}
        text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
        text += b" " * (-len(text) % 8)  # 8-byte alignment of the data, as safetensors does
        data_start = 8 + len(text)
        for name in self._order:
            self._begin[name] = data_start + header[name]["data_offsets"][0]
        self.size = data_start + offset
        self._file = AtomicFile(self.path, force=force, inputs=inputs)
        self._file.pwrite(struct.pack("<Q", len(text)) + text, 0)
        self._cursor = dict.fromkeys(self._order, 0)
        self._prefix, self._next = data_start, 0  # see written_prefix
        # Pieces of a tensor are written by worker threads at their own offsets; the byte
        # counts behind the completeness check are updated under this lock.
        self._lock = threading.Lock()

    @staticmethod
    def _bytes(data) -> memoryview:
        if isinstance(data, (bytes, bytearray, memoryview)):
            return memoryview(data).cast("B")
        arr = np.ascontiguousarray(data)
        if arr.dtype.byteorder == ">":
            arr = arr.astype(arr.dtype.newbyteorder("<"))
        return memoryview(arr.reshape(-1).view(np.uint8))

    def _put(self, name: str, offset: int, buf: memoryview) -> None:
        if offset + len(buf) > self._sizes[name]:
            raise CheckpointError(
                f"tensor {name!r}: write of bytes [{offset}, {offset + len(buf)}) past its "
                f"{self._sizes[name]} bytes"
            )
        self._file.pwrite(buf, self._begin[name] + offset)
        with self._lock:
            self._filled[name] += len(buf)

    def _check_name(self, name: str) -> None:
        if name not in self._sizes:
            raise CheckpointError(f"{self.path}: no tensor named {name!r} in the header")

    def write(self, name: str, data) -> None:
        """Appends ``data`` (array or bytes, C order) to tensor ``name`` (whole or in pieces)."""
        self._check_name(name)
        buf = self._bytes(data)
        with self._lock:  # appends of one tensor come from one thread, in order
            offset = self._cursor[name]
            self._cursor[name] += len(buf)
        self._put(name, offset, buf)

    def write_rows(self, name: str, start: int, data) -> None:
        """Writes ``data`` (whole rows along axis 0 of tensor ``name``, C order) as its rows
        ``start``, ``start + 1``, ...: at their place, in any order (from worker threads)."""
        self._check_name(name)
        buf = self._bytes(data)
        row = self._sizes[name] // max(self._rows[name], 1)
        if row and len(buf) % row:
            raise CheckpointError(f"tensor {name!r}: {len(buf)} bytes are not whole rows of "
                                  f"{row} bytes")
        self._put(name, start * row, buf)

    def write_region(self, name: str, view, rect, data) -> None:
        """Writes ``data`` (shape (p1−p0, a1−a0, s1−s0), C order) into region ``rect`` of
        tensor ``name`` seen as ``view`` = (P, A, S); see :func:`region_runs`. Each byte of
        a tensor is to be written once."""
        self._check_name(name)
        dtype = numpy_dtype(self._dtypes[name])
        data = np.asarray(data)
        if data.dtype.itemsize != dtype.itemsize:  # bytes are written as they are
            raise CheckpointError(
                f"tensor {name!r} is {self._dtypes[name]}; got {data.dtype} data"
            )
        buf = self._bytes(data)
        pos = 0
        for offset, n in region_runs(view, rect, dtype.itemsize):
            self._put(name, offset, buf[pos:pos + n])
            pos += n
        if pos != len(buf):
            raise CheckpointError(f"tensor {name!r}: region {rect} holds {pos} bytes, got {len(buf)}")

    def written_prefix(self, through: Optional[str] = None) -> int:
        """How many bytes at the start of the file are written: the header and the tensors,
        in file order, up to the first one not yet complete (or, given ``through``, not
        beyond the end of that tensor)."""
        with self._lock:
            while self._next < len(self._order):
                name = self._order[self._next]
                if self._filled[name] != self._sizes[name]:
                    break
                self._prefix = self._begin[name] + self._sizes[name]
                self._next += 1
            if through is None:
                return self._prefix
            return min(self._prefix, self._begin[through] + self._sizes[through])

    def _check_complete(self):
        for name in self._order:
            if self._filled[name] != self._sizes[name]:
                raise CheckpointError(
                    f"{self.path}: tensor {name!r} was not (fully) written "
                    f"({self._filled[name]} of {self._sizes[name]} bytes)"
                )

    @property
    def atomic_file(self) -> AtomicFile:
        return self._file

    def stage(self) -> None:
        """Checks every byte was written and makes the file durable under its temp name."""
        self._check_complete()
        self._file.stage()

    def commit(self) -> None:
        self.stage()
        self._file.publish()

    finish = commit

    def abort(self) -> None:
        self._file.abort()

