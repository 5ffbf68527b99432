"""GGUF, llama.cpp's file: read, requantize, dequantize, inspect and convert (one module, to
become one checkpoint Layout).

The file is parsed by ``gguf`` (llama.cpp's own Python package, the ``gguf`` extra); every
tensor lowprec decodes is checked here first. Stored tensors (ggml type: bytes per block of
values along ne[0], the NumPy last axis):

=======  ====  =====================================================================
type     id    block
=======  ====  =====================================================================
F32      0     float32
F16      1     float16
BF16     30    bfloat16
Q8_0     8     34 bytes / 32: float16 d, int8 q[32]; value d·q (read only)
MXFP4    39    17 bytes / 32: uint8 e (E8M0, value 2^(e-127)), uint8 qs[16]; byte j holds
               element j in its low nibble and element j + 16 in its high nibble (not the
               consecutive pairs of lowprec / gpt-oss / compressed-tensors): a nibble
               permutation of lowprec's MXFP4, same codes, same scales
NVFP4    40    36 bytes / 64: uint8 d[4] (UE4M3: E4M3 without sign, one per 16 values),
               uint8 qs[32]; sub-block s's element j (j < 8) in the low nibble of
               qs[8s + j], element j + 8 in its high nibble. The float32 tensor scale (the
               multiplier ModelOpt calls ``weight_scale_2``) is a separate F32 tensor named
               like the weight with ``.weight`` replaced by ``.scale``, which llama.cpp
               applies to the matmul's output (``ggml_mul``)
=======  ====  =====================================================================

What a reader refuses (naming tensor and type): a type it cannot decode, ne[0] not a
multiple of the block, a byte count that disagrees with the shape, Q8_0 scales that are not
finite, MXFP4's E8M0 0xFF (NaN
in OCP MX, 2^128 in ggml: no agreed value), UE4M3 sub-scales 0x7F (E4M3's NaN, read as 0 by
ggml) or with bit 7 set (ignored by ggml, negative in E4M3), and a ``.scale`` that is not
one finite positive float32. Every metadata key (raw bytes, in order) and every tensor
not requantized is copied unchanged; outputs are written atomically, the input never.

Requantizing (``quantize_gguf``) selects what llama.cpp's ``llama-quantize`` would: the
``*.weight`` tensors of 2+ dims whose ne[0] is a multiple of the block, except the token
embeddings and the output head (kept, as lowprec's safetensors default keeps embeddings and
lm_head; llama.cpp too gives them its higher-precision types), norms and the MoE router
(``ffn_gate_inp``, kept float32 by llama.cpp); ``include``/``exclude`` regexes change that.
Default rule: ggml's own (``scale_rule="floor_log2f"``, ``rounding="nearest_toward_zero"``,
what ``llama-quantize`` writes), any lowprec rule on request. NVFP4 output uses lowprec's
NVFP4 (its float32 tensor scale in ``.scale``).
"""

from __future__ import annotations

import os
import re
import struct
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Optional

import numpy as np

from .._lazy import lazy_module
from .._rounding import ROUNDING_MODES
from ._atomic import AtomicFile, Inputs, check_output
from ._chunk import tensor_scale
from ._engine_convert import convert_checkpoint
from ._errors import CheckpointError
from ._formats import check_scale_rule
from ._layout import make_spec
from ._layout_codes import checkpoint_mxarrays
from ._mxfp4_cast import cast_mxfp4
from ._pipeline import progress_bar
from ._report import ConversionReport, TensorReport
from ._layouts import get_layout
from ._safetensors import SafetensorsWriter
from ._source import open_source
from ._stats import ErrorStats

if TYPE_CHECKING:  # annotations only: the module imports JAX
    from .._mxarray import MXArray

# Imported on first use: the checkpoint command line's native path needs no JAX.
jnp = lazy_module("jax.numpy")

F32, F16, Q8_0, BF16, MXFP4, NVFP4 = 0, 1, 8, 30, 39, 40
_BLOCK = {F32: (1, 4), F16: (1, 2), BF16: (1, 2), Q8_0: (32, 34), MXFP4: (32, 17),
          NVFP4: (64, 36)}
_NAMES = {F32: "F32", F16: "F16", BF16: "BF16", Q8_0: "Q8_0", MXFP4: "MXFP4", NVFP4: "NVFP4"}
_FLOATS = (F32, F16, BF16)
_FORMAT_TYPE = {"mxfp4": MXFP4, "nvfp4": NVFP4}
#: The formats a GGUF file holds quantized (ggml types 39, 40).
GGUF_FORMATS = tuple(_FORMAT_TYPE)
_MAGIC = b"GGUF"
_ROWS = 1 << 20  # elements per piece when encoding or decoding a tensor
# Kept by default: embeddings, the output head, norms, the MoE router, position tables.
DEFAULT_GGUF_KEEP = r"(^|\.)(token_embd|output|position_embd|token_types)\.weight$|norm|ffn_gate_inp"


def _gguf():
    try:
        import gguf
    except ImportError:
        raise CheckpointError("GGUF needs the gguf package (llama.cpp's): "
                              "pip install 'lowprec[gguf]'") from None
    if getattr(gguf.GGMLQuantizationType, "NVFP4", None) != NVFP4:
        raise CheckpointError(f"gguf {getattr(gguf, '__version__', '?')} predates NVFP4 "
                              "(ggml type 40); pip install 'gguf>=0.19'")
    return gguf


def is_gguf(path) -> bool:
    """Whether ``path`` names a GGUF file: an existing file starting with ``GGUF``, or a
    name ending in ``.gguf``."""
    path = os.fspath(path)
    if os.path.isfile(path):
        with open(path, "rb") as f:
            return f.read(4) == _MAGIC
    return path.endswith(".gguf")


def type_name(t: int) -> str:
    try:
        return _gguf().GGMLQuantizationType(t).name
    except ValueError:
        return f"ggml type {t}"


# -- reading -----------------------------------------------------------------------------


class GGUFTensor:
    """One tensor of a GGUF file: ``name``, ggml ``type``, NumPy-order ``shape`` and its raw
    bytes ``raw`` (a read-only view of the file)."""

    def __init__(self, name, gtype, shape, raw):
        self.name, self.type, self.shape, self.raw = name, int(gtype), tuple(shape), raw

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    def __repr__(self):
        return f"GGUFTensor({self.name!r}, {type_name(self.type)}, {list(self.shape)})"


class GGUFFile:
    """A GGUF file opened read-only (memory mapped): ``fields`` (name → raw bytes of the
    key/value pair, in file order), ``tensors`` (name → :class:`GGUFTensor`, in order) and
    ``alignment``. Nothing is decoded until asked (:meth:`values`, :meth:`mxarray`)."""

    def __init__(self, path):
        gguf = _gguf()
        self.path = os.fspath(path)
        try:
            r = gguf.GGUFReader(self.path, "r")
        except (ValueError, OSError, struct.error, IndexError, KeyError) as e:
            raise CheckpointError(f"{self.path}: not a GGUF file gguf can read: {e}") from None
        self.reader = r
        data = r.data
        self.fields = {}
        for name, f in r.fields.items():
            if name.startswith("GGUF."):  # the header (version, counts): rewritten
                continue
            size = sum(int(p.nbytes) for p in f.parts)
            self.fields[name] = bytes(data[f.offset:f.offset + size])
        self.alignment = int(r.alignment)
        self.arch = self.value("general.architecture")
        self.tensors = {}
        for t in r.tensors:
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            raw = data[t.data_offset:t.data_offset + int(t.n_bytes)]
            if raw.size != int(t.n_bytes):
                raise CheckpointError(f"{self.path}: tensor {t.name!r} runs past the end of the "
                                      "file (truncated?)")
            self.tensors[t.name] = GGUFTensor(t.name, int(t.tensor_type), shape, raw)

    def value(self, key, default=None):
        """A metadata value (strings and numbers; arrays as lists), or ``default``."""
        f = self.reader.fields.get(key)
        if f is None:
            return default
        return f.contents()

    # -- checks and decoding

    def check(self, name: str) -> GGUFTensor:
        """The tensor ``name``, checked as every decoder here needs it (see module doc)."""
        t = self.tensors[name]
        if t.type not in _BLOCK:
            raise CheckpointError(f"{self.path}: tensor {name!r} is {type_name(t.type)}; lowprec "
                                  f"decodes {', '.join(_NAMES.values())} only")
        block, size = _BLOCK[t.type]
        if not t.shape or t.shape[-1] % block:
            raise CheckpointError(f"{self.path}: tensor {name!r} ({_NAMES[t.type]}) has ne[0] = "
                                  f"{t.shape[-1] if t.shape else 0}, not a multiple of {block}")
        want = t.numel // block * size
        if t.raw.size != want:
            raise CheckpointError(f"{self.path}: tensor {name!r} ({_NAMES[t.type]}, shape "
                                  f"{list(t.shape)}) holds {t.raw.size} bytes, not {want}")
        if t.type == Q8_0:
            d = np.asarray(t.raw).reshape(-1, 34)[:, :2].copy().view(np.float16)
            if not np.isfinite(d).all():
                raise CheckpointError(f"{self.path}: tensor {name!r} (Q8_0) has "
                                      f"{int((~np.isfinite(d)).sum())} non-finite block scales: refused")
        if t.type == MXFP4:
            e = t.raw.reshape(-1, 17)[:, 0]
            if (e == 0xFF).any():
                raise CheckpointError(
                    f"{self.path}: tensor {name!r} (MXFP4) has {int((e == 0xFF).sum())} blocks "
                    "with the E8M0 scale 0xFF (NaN in OCP MX, 2^128 in ggml): refused")
        if t.type == NVFP4:
            d = t.raw.reshape(-1, 36)[:, :4]
            bad = (d == 0x7F) | (d >= 0x80)
            if bad.any():
                raise CheckpointError(
                    f"{self.path}: tensor {name!r} (NVFP4) has {int(bad.sum())} sub-block scales "
                    "0x7F (E4M3 NaN) or with the sign bit set: refused")
        return t

    def tensor_scale(self, name: str) -> Optional[np.float32]:
        """The float32 ``.scale`` of an NVFP4 weight ``name`` (None: none stored, i.e. 1)."""
        sname = _scale_name(name)
        if sname not in self.tensors:
            return None
        t = self.tensors[sname]
        if t.type != F32 or t.numel != 1:
            raise CheckpointError(f"{self.path}: {sname!r} ({type_name(t.type)}, shape "
                                  f"{list(t.shape)}) is not one float32, as the tensor scale of "
                                  f"{name!r} must be")
        s = np.frombuffer(t.raw.tobytes(), np.float32)[0]
        if not (np.isfinite(s) and s > 0):
            raise CheckpointError(f"{self.path}: {sname!r} = {s}, not a finite positive scale")
        return s

    def mxarray(self, name: str) -> MXArray:
        """An MXFP4 or NVFP4 tensor as a lowprec ``MXArray`` blocked along its last axis:
        the same codes and scales, nibbles moved to lowprec's order."""
        from .._mxarray import MXArray  # noqa: PLC0415 - JAX, imported where used

        t = self.check(name)
        if t.type not in (MXFP4, NVFP4):
            raise CheckpointError(f"{self.path}: tensor {name!r} is {_NAMES[t.type]}, not MXFP4 or NVFP4")
        codes, scales = ggml_codes(t.raw, t.type, t.shape)
        if t.type == MXFP4:
            return MXArray(jnp.asarray(_pack(codes)), jnp.asarray(scales), "mxfp4",
                           len(t.shape) - 1, t.shape)
        ts = self.tensor_scale(name)
        ts = np.float32(1) if ts is None else ts
        return MXArray(jnp.asarray(_pack(codes)), jnp.asarray(scales), "nvfp4", len(t.shape) - 1,
                       t.shape, tensor_scale=jnp.float32(ts))

    def values(self, name: str) -> np.ndarray:
        """The tensor's float32 values (NVFP4 times its ``.scale``)."""
        from .._mx import dequantize  # noqa: PLC0415 - JAX, imported where used

        t = self.check(name)
        raw = np.asarray(t.raw)
        if t.type == F32:
            return raw.view(np.float32).reshape(t.shape)
        if t.type == F16:
            return raw.view(np.float16).astype(np.float32).reshape(t.shape)
        if t.type == BF16:
            return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(t.shape)
        if t.type == Q8_0:
            b = raw.reshape(-1, 34)
            d = b[:, :2].copy().view(np.float16).astype(np.float32)
            return (d * b[:, 2:].view(np.int8).astype(np.float32)).reshape(t.shape)
        return np.asarray(dequantize(self.mxarray(name), jnp.float32)).reshape(t.shape)

    def close(self):
        self.reader = None
        self.tensors = {}


def _scale_name(name: str) -> str:
    return name[: -len(".weight")] + ".scale" if name.endswith(".weight") else name + ".scale"


# -- ggml blocks <-> codes ---------------------------------------------------------------


def _unpack(p):
    p = np.asarray(p, np.uint8)
    return np.stack([p & 0xF, p >> 4], axis=-1).reshape(*p.shape[:-1], -1)


def _pack(c):
    c = np.asarray(c, np.uint8)
    return (c[..., 0::2] | (c[..., 1::2] << 4)).astype(np.uint8)


def ggml_codes(raw, gtype: int, shape) -> tuple:
    """``(element codes [..., n] uint8 in value order, scale codes [..., n / 32 or n / 16])``
    of ggml MXFP4 / NVFP4 blocks ``raw`` of a tensor of NumPy ``shape``."""
    lead, n = tuple(shape[:-1]), shape[-1]
    raw = np.asarray(raw, np.uint8)
    if gtype == MXFP4:
        b = raw.reshape(*lead, n // 32, 17)
        qs = b[..., 1:]
        codes = np.concatenate([qs & 0xF, qs >> 4], axis=-1)  # j, then j + 16
        return codes.reshape(*lead, n), b[..., 0].copy()
    b = raw.reshape(*lead, n // 64, 36)
    qs = b[..., 4:].reshape(*lead, n // 64, 4, 8)
    codes = np.concatenate([qs & 0xF, qs >> 4], axis=-1)  # per sub-block: j, then j + 8
    return codes.reshape(*lead, n), b[..., :4].reshape(*lead, n // 16).copy()


def ggml_blocks(codes, scales, gtype: int) -> np.ndarray:
    """Inverse of :func:`ggml_codes`: ggml blocks ``[..., n / block, bytes]`` (uint8).
    lowprec's -0 (code 0x8) is written as ggml's quantizer writes every zero, code 0."""
    codes = np.asarray(codes, np.uint8)
    codes = np.where(codes == 0x8, 0, codes).astype(np.uint8)
    lead, n = codes.shape[:-1], codes.shape[-1]
    scales = np.asarray(scales, np.uint8)
    if gtype == MXFP4:
        c = codes.reshape(*lead, n // 32, 32)
        qs = c[..., :16] | (c[..., 16:] << 4)
        return np.concatenate([scales.reshape(*lead, n // 32, 1), qs], axis=-1)
    c = codes.reshape(*lead, n // 64, 4, 16)
    qs = (c[..., :8] | (c[..., 8:] << 4)).reshape(*lead, n // 64, 32)
    return np.concatenate([scales.reshape(*lead, n // 64, 4), qs], axis=-1)


def mxarray_blocks(mx: MXArray) -> tuple:
    """``(ggml type, blocks uint8 [..., n / block, bytes], tensor scale or None)`` of an
    MXFP4 or NVFP4 ``MXArray`` blocked along its last axis (NVFP4: n a multiple of 64)."""
    name = mx.fmt.name
    if name not in _FORMAT_TYPE or mx.axis != len(mx.shape) - 1:
        raise CheckpointError(f"GGUF holds mxfp4 and nvfp4 blocked along the last axis (ne[0]); "
                              f"got {name} along axis {mx.axis} of {len(mx.shape)}")
    scales = np.asarray(mx.scales)
    if name == "mxfp4" and (scales == 0xFF).any():
        raise CheckpointError("an MXFP4 block holds NaN or inf (E8M0 0xFF): ggml has no NaN scale")
    if name == "nvfp4" and ((scales == 0x7F) | (scales >= 0x80)).any():
        raise CheckpointError("an NVFP4 block holds NaN or inf (E4M3 scale 0x7F): ggml has none")
    if mx.shape[-1] % _BLOCK[_FORMAT_TYPE[name]][0]:
        raise CheckpointError(f"ggml {name.upper()} needs ne[0] a multiple of "
                              f"{_BLOCK[_FORMAT_TYPE[name]][0]}, got {mx.shape[-1]}")
    gtype = _FORMAT_TYPE[name]
    ts = None if mx.tensor_scale is None else np.float32(np.asarray(mx.tensor_scale))
    return gtype, ggml_blocks(_unpack(mx.elements), scales, gtype), ts


# -- writing -----------------------------------------------------------------------------


def _string(s: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def _pad(n: int, align: int) -> int:
    return (n + align - 1) // align * align


class _Out:
    """An output tensor: ``name``, ggml ``type``, NumPy ``shape``, ``nbytes`` and ``data()``
    (called once, when its bytes are written: one tensor in memory at a time)."""

    def __init__(self, name, gtype, shape, nbytes, data):
        self.name, self.type, self.shape, self.nbytes, self.data = name, gtype, tuple(shape), nbytes, data


def write_gguf(dst, fields: dict, tensors: list, *, alignment: int = 32, force=False,
               inputs: Optional[Inputs] = None, progress=None) -> None:
    """Writes a GGUF v3 file atomically: the raw key/value pairs ``fields`` (name → bytes,
    as :class:`GGUFFile` holds them), then the ``_Out`` tensors, each aligned. As the
    safetensors outputs do (:func:`~._pipeline.write_outputs`), each tensor's bytes are
    handed to the disk once written, and those final one tensor earlier leave the page cache
    (:meth:`~._atomic.AtomicFile.start_writeback`, on a background thread): later tensors
    reuse their pages, and the final fsync waits for little."""
    head = [_MAGIC, struct.pack("<IQQ", 3, len(tensors), len(fields))]
    head += list(fields.values())
    offset = 0
    for t in tensors:
        ne = tuple(reversed(t.shape)) or (1,)
        head.append(_string(t.name) + struct.pack("<I", len(ne)) +
                    struct.pack(f"<{len(ne)}Q", *ne) + struct.pack("<IQ", t.type, offset))
        offset = _pad(offset + t.nbytes, alignment)
    header = b"".join(head)
    bar = progress_bar(sum(t.nbytes for t in tensors), "gguf", progress)
    handed = []
    try:
        # The writeback thread ends (its calls waited for) before the file is staged or
        # aborted: an aborted file's descriptor must not be used again.
        with AtomicFile(dst, force=force, inputs=inputs) as f, \
                ThreadPoolExecutor(1, thread_name_prefix="lowprec-fsync") as stager:
            f.write(header + b"\0" * (_pad(len(header), alignment) - len(header)))
            for t in tensors:
                data = np.ascontiguousarray(t.data())
                if data.nbytes != t.nbytes:  # pragma: no cover - a bug here, not bad input
                    raise AssertionError(f"{t.name}: {data.nbytes} bytes, planned {t.nbytes}")
                f.write(data.reshape(-1).view(np.uint8))
                f.write(b"\0" * (_pad(t.nbytes, alignment) - t.nbytes))
                del data
                bar.update(t.nbytes)
                # Appended in order: every byte written so far is final.
                handed.append(stager.submit(f.start_writeback, f.tell()))
            for future in handed:
                future.result()
    finally:
        bar.close()


def _raw_out(src: GGUFFile, t: GGUFTensor) -> _Out:
    return _Out(t.name, t.type, t.shape, t.raw.size, lambda: np.asarray(t.raw))


def _scalar_out(name, value) -> _Out:
    return _Out(name, F32, (1,), 4, lambda: np.asarray([value], np.float32))


# -- quantize ----------------------------------------------------------------------------


def select_gguf(t: GGUFTensor, fmt: str, include=None, exclude=None) -> tuple:
    """(quantize?, reason) for one tensor: see the module doc."""
    if t.type not in _FLOATS:
        return False, f"stored as {type_name(t.type)}"
    block = _BLOCK[_FORMAT_TYPE[fmt]][0]
    if include is not None:
        if not re.search(include, t.name):
            return False, "not matched by include"
    else:
        if not t.name.endswith(".weight") or len(t.shape) < 2:
            return False, "not a 2+ dim weight"
        if re.search(DEFAULT_GGUF_KEEP, t.name):
            return False, "kept by default (embeddings, output, norms, router)"
    if exclude is not None and re.search(exclude, t.name):
        return False, "excluded"
    if t.shape[-1] % block:
        return False, f"ne[0] = {t.shape[-1]} is not a multiple of {block}"
    return True, ""


def _float_rows(t: GGUFTensor, r0: int, r1: int) -> np.ndarray:
    """Rows r0:r1 of an F32 / F16 / BF16 tensor seen as [rows, ne[0]], as float32 (reading
    only those bytes of the mapped file)."""
    n = t.shape[-1]
    item = 4 if t.type == F32 else 2
    raw = np.asarray(t.raw[r0 * n * item:r1 * n * item])
    if t.type == F32:
        x = raw.view(np.float32)
    elif t.type == F16:
        x = raw.view(np.float16).astype(np.float32)
    else:
        x = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return x.reshape(r1 - r0, n)


def _nonfinite(src: GGUFFile, t: GGUFTensor):
    return CheckpointError(f"{src.path}: tensor {t.name!r} holds NaN or inf; ggml has no NaN "
                           "block scale: fix the tensor or --exclude it")


def _quantize_tensor(src: GGUFFile, t: GGUFTensor, fmt: str, scale_rule, rounding, stats):
    """``[_Out, ...]`` for one tensor: its blocks (and NVFP4's ``.scale``), encoded piece
    by piece (2^20 elements of whole rows of ne[0]) when written; ``stats`` is filled as
    they are. NVFP4's tensor scale needs the tensor's amax first: one more pass."""
    from .._mx import dequantize, quantize_mx  # noqa: PLC0415 - JAX, imported where used

    gtype = _FORMAT_TYPE[fmt]
    block, size = _BLOCK[gtype]
    n = t.shape[-1]
    rows = t.numel // n
    step = max(1, _ROWS // max(n, 1))
    ts = None
    if fmt == "nvfp4":
        amax = 0.0
        for r in range(0, rows, step):
            piece = _float_rows(t, r, min(r + step, rows))
            if not np.isfinite(piece).all():
                raise _nonfinite(src, t)
            amax = max(amax, float(np.abs(piece).max()))
        ts = tensor_scale(amax, make_spec("nvfp4", t.shape, "F32"))
    if fmt == "mxfp4":
        kw = dict(scale_rule=scale_rule, rounding=rounding)
    else:
        kw = dict(tensor_scale=jnp.float32(ts))
        if rounding is not None:
            kw["rounding"] = rounding

    def data():
        out = np.empty((rows, (n // block) * size), np.uint8)
        for r in range(0, rows, step):
            piece = _float_rows(t, r, min(r + step, rows))
            if not np.isfinite(piece).all():
                raise _nonfinite(src, t)
            mx = quantize_mx(jnp.asarray(piece), fmt, axis=-1, **kw)
            stats.update(piece, np.asarray(dequantize(mx, jnp.float32)))
            out[r:r + len(piece)] = mxarray_blocks(mx)[1].reshape(len(piece), -1)
        return out

    outs = [_Out(t.name, gtype, t.shape, rows * (n // block) * size, data)]
    if ts is not None:
        outs.append(_scalar_out(_scale_name(t.name), ts))
    return outs


def _check_format(fmt) -> str:
    name = getattr(fmt, "name", fmt)
    if name not in _FORMAT_TYPE:
        raise CheckpointError(f"GGUF output holds mxfp4 or nvfp4 (ggml types 39, 40), not {name!r}")
    return name


def quantize_gguf(src, dst, fmt="mxfp4", *, include=None, exclude=None, scale_rule=None,
                  rounding=None, force=False, progress=None, report=None) -> ConversionReport:
    """Requantizes the float weights of a GGUF file to ggml MXFP4 or NVFP4, every other
    tensor and every metadata key copied unchanged (see the module doc for the selection).

    ``scale_rule`` / ``rounding`` default to ggml's MXFP4 rule (``floor_log2f``,
    ``nearest_toward_zero``): what llama.cpp's own quantizer writes, byte for byte.

    Example:
        >>> import gguf, tempfile, numpy as np
        >>> d = tempfile.mkdtemp()
        >>> w = gguf.GGUFWriter(f"{d}/m.gguf", "llama")
        >>> w.add_tensor("blk.0.ffn_up.weight", np.linspace(-1, 1, 64 * 64, dtype=np.float32).reshape(64, 64))
        >>> w.add_tensor("blk.0.ffn_norm.weight", np.ones(64, np.float32))
        >>> w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
        >>> rep = quantize_gguf(f"{d}/m.gguf", f"{d}/q.gguf", "mxfp4")
        >>> [(t.name, t.format) for t in rep.tensors]
        [('blk.0.ffn_up.weight', 'mxfp4'), ('blk.0.ffn_norm.weight', 'kept')]
        >>> GGUFFile(f"{d}/q.gguf").tensors["blk.0.ffn_up.weight"]
        GGUFTensor('blk.0.ffn_up.weight', MXFP4, [64, 64])
    """
    fmt = _check_format(fmt)
    if fmt == "mxfp4":
        scale_rule = "floor_log2f" if scale_rule is None else check_scale_rule(scale_rule)
        rounding = "nearest_toward_zero" if rounding is None else rounding
    elif scale_rule is not None:
        raise CheckpointError("nvfp4 has its own scale recipe and takes no scale_rule")
    if rounding is not None and rounding not in ROUNDING_MODES:
        raise CheckpointError(f"unknown rounding {rounding!r}; choose one of: "
                              f"{', '.join(ROUNDING_MODES)}")
    start = time.perf_counter()
    f = GGUFFile(src)
    inputs = check_outputs(f.path, dst, report, force)
    plans, outs, reports, stats = [], [], [], {}
    for t in f.tensors.values():
        if t.name.endswith(".scale") and t.name[:-6] + ".weight" in f.tensors:
            sel = select_gguf(f.tensors[t.name[:-6] + ".weight"], fmt, include, exclude)[0]
            if sel:  # the tensor scale of a weight being requantized: replaced
                continue
        ok, reason = select_gguf(t, fmt, include, exclude)
        if not ok:
            outs.append(_raw_out(f, t))
            reports.append(TensorReport(t.name, t.shape, type_name(t.type), "kept", t.raw.size,
                                        t.raw.size, reason=reason))
            continue
        f.check(t.name)
        stats[t.name] = ErrorStats()
        new = _quantize_tensor(f, t, fmt, scale_rule, rounding, stats[t.name])
        outs += new
        plans.append((t, new))
    write_gguf(dst, f.fields, outs, alignment=f.alignment, force=force, inputs=inputs,
               progress=progress)
    for t, new in plans:
        s = stats[t.name]
        reports.append(TensorReport(
            t.name, t.shape, type_name(t.type), fmt, t.raw.size, sum(o.nbytes for o in new),
            scale_rule=scale_rule, sqnr_db=s.sqnr_db, max_abs_err=s.max_abs,
            max_rel_err=s.max_rel, stored_as=tuple(o.name for o in new), exact=s.exact))
    order = {t.name: i for i, t in enumerate(f.tensors.values())}
    reports.sort(key=lambda r: order[r.name])
    rep = ConversionReport(f.path, os.fspath(dst), "quantize",
                           {"format": fmt, "scale_rule": scale_rule, "rounding": rounding,
                            "container": "gguf"}, reports, time.perf_counter() - start)
    write_report(rep, report, force, inputs)
    return rep


def check_outputs(src, dst, report, force, *more) -> Inputs:
    """The inputs (``src`` and ``more``), with ``dst`` and ``report`` checked against them
    before any work (never an input, --force for regular files only)."""
    paths = [os.fspath(p) for p in (src, *more) if p is not None]
    inputs = None
    for p in paths:  # a safetensors input's checkpoint is its model folder (config.json, ...)
        if os.path.exists(p) and not (os.path.isfile(p) and is_gguf(p)):
            inputs = open_source(p).inputs
            break
    inputs = Inputs() if inputs is None else inputs
    for p in paths:
        if os.path.isfile(p):
            inputs.add(p)
        elif os.path.isdir(p):
            inputs.add_folder(p)
    check_output(dst, force=force, inputs=inputs)
    if report is not None:
        check_output(report, force=force, inputs=inputs, what="report")
    return inputs


def write_report(rep, path, force, inputs):
    if path is None:
        return
    with AtomicFile(path, force=force, inputs=inputs, what="report") as f:
        f.write(rep.to_json().encode())


# -- dequantize and inspect --------------------------------------------------------------

_OUT_DTYPES = {"float32": (F32, np.float32), "float16": (F16, np.float16), "bfloat16": (BF16, None)}


def _as_dtype(x: np.ndarray, gtype: int) -> np.ndarray:
    if gtype == F32:
        return x.astype(np.float32)
    if gtype == F16:
        with np.errstate(over="ignore"):
            y = x.astype(np.float16)
        if not np.isfinite(y[np.isfinite(x)]).all():
            raise CheckpointError("a value exceeds float16's range; dequantize to float32")
        return y
    b = x.astype(np.float32).view(np.uint32).astype(np.uint64)  # to nearest even
    b = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    return b.astype(np.uint16)


def dequantize_gguf(src, dst, *, dtype="float32", force=False, progress=None,
                    report=None) -> ConversionReport:
    """Decodes the MXFP4 / NVFP4 / Q8_0 tensors of a GGUF file (NVFP4 times its ``.scale``,
    which is then dropped; any other quantized type is refused, naming it) to ``dtype``
    (float32, float16 or bfloat16): into a GGUF file with every metadata key and every other
    tensor unchanged, or, for a ``.safetensors`` ``dst``, into plain safetensors under the
    GGUF tensor names with every tensor in ``dtype``."""
    if dtype in (None, "original"):
        dtype = "float32"
    if dtype not in _OUT_DTYPES:
        raise CheckpointError(f"dequantize GGUF to one of {', '.join(_OUT_DTYPES)}, not {dtype!r}")
    gtype = _OUT_DTYPES[dtype][0]
    start = time.perf_counter()
    f = GGUFFile(src)
    inputs = check_outputs(f.path, dst, report, force)
    scales = {_scale_name(n) for n, t in f.tensors.items() if t.type == NVFP4}
    reports, outs = [], []
    for t in f.tensors.values():
        if t.name in scales:
            continue
        f.check(t.name)  # refuses, naming it, a type lowprec does not decode (Q4_K, ...)
        if t.type in (MXFP4, NVFP4, Q8_0):
            if t.type == NVFP4:
                f.tensor_scale(t.name)
            nbytes = t.numel * np.dtype(np.uint16 if gtype != F32 else np.float32).itemsize
            outs.append(_Out(t.name, gtype, t.shape, nbytes,
                             lambda t=t: _as_dtype(f.values(t.name), gtype)))
            reports.append(TensorReport(t.name, t.shape, type_name(t.type), dtype, t.raw.size,
                                        nbytes, stored_as=(t.name,)))
        else:
            outs.append(_raw_out(f, t))
            reports.append(TensorReport(t.name, t.shape, type_name(t.type), "kept", t.raw.size,
                                        t.raw.size, reason="not quantized"))
    if os.fspath(dst).endswith(".safetensors"):
        st = {F32: "F32", F16: "F16", BF16: "BF16"}
        entries = []
        for o in outs:
            if o.type not in st:
                f.check(o.name)
            if o.type not in st:  # pragma: no cover - check() refuses these
                raise CheckpointError(f"{o.name!r}: {type_name(o.type)}")
            entries.append((o.name, st[gtype], o.shape))
        with SafetensorsWriter(dst, entries, force=force, inputs=inputs) as w:
            for o in outs:
                w.write(o.name, _as_dtype(f.values(o.name), gtype))
    else:
        write_gguf(dst, f.fields, outs, alignment=f.alignment, force=force, inputs=inputs,
                   progress=progress)
    rep = ConversionReport(f.path, os.fspath(dst), "dequantize", {"dtype": dtype,
                           "container": "gguf"}, reports, time.perf_counter() - start)
    write_report(rep, report, force, inputs)
    return rep


def inspect_gguf(src) -> ConversionReport:
    """Lists a GGUF file's tensors (ggml types, shapes, bytes); MXFP4 / NVFP4 tensors are
    checked as a decoder checks them."""
    f = GGUFFile(src)
    reports = []
    scales = {_scale_name(n) for n, t in f.tensors.items() if t.type == NVFP4}
    for t in f.tensors.values():
        if t.type in (MXFP4, NVFP4):
            f.check(t.name)
            stored = (t.name, _scale_name(t.name)) if t.type == NVFP4 and _scale_name(t.name) in f.tensors else (t.name,)
            nbytes = t.raw.size + 4 * (len(stored) - 1)
            reports.append(TensorReport(t.name, t.shape, type_name(t.type), t.type == MXFP4 and "mxfp4" or "nvfp4",
                                        nbytes, nbytes, stored_as=stored))
        elif t.name not in scales:
            reports.append(TensorReport(t.name, t.shape, type_name(t.type), "kept", t.raw.size,
                                        t.raw.size, reason=type_name(t.type)))
    return ConversionReport(f.path, None, "inspect",
                            {"container": "gguf", "architecture": f.arch,
                             "metadata_keys": len(f.fields)}, reports)


# -- convert -----------------------------------------------------------------------------


def _hf_to_gguf_name(name: str, arch: str, blocks: int) -> Optional[str]:
    """The GGUF name of a Hugging Face tensor, by gguf's own ``TensorNameMap`` (None: none)."""
    gguf = _gguf()
    archs = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}
    if arch not in archs:
        raise CheckpointError(f"the template's architecture {arch!r} is unknown to gguf "
                              f"{getattr(gguf, '__version__', '')}".rstrip())
    tmap = gguf.get_tensor_name_map(archs[arch], blocks)
    return tmap.get_name(name, try_suffixes=(".weight", ".bias"))


def _permute_rows(codes, scales, heads: int):
    """llama.cpp's Q/K row order for ``llama``-family RoPE (convert_hf_to_gguf's
    ``LlamaModel.permute``, ``heads`` the tensor's own head count): within each head the rows
    of its two halves interleaved. Rows hold whole blocks, so moving them is exact."""
    def perm(a):
        r = a.shape[0]
        return a.reshape(heads, 2, r // heads // 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)
    return perm(codes), perm(scales)


def convert_gguf(src, dst, *, template=None, to: Optional[str] = None, layout="lowprec",
                 force=False, progress=None, report=None) -> ConversionReport:
    """Moves MXFP4 / NVFP4 weights between safetensors (lowprec, gpt-oss, compressed-tensors,
    ModelOpt) and GGUF without requantizing (a nibble permutation; NVFP4's tensor scale
    as ggml's ``.scale``), or casts MXFP4 to NVFP4 exactly where it can (``to="nvfp4"``,
    :func:`lowprec.mxfp4_to_nvfp4`, the rest requantized and counted).

    * GGUF → GGUF (``to="nvfp4"``): every MXFP4 tensor cast; everything else unchanged.
    * safetensors → GGUF: needs ``template``, a GGUF of the same model written by llama.cpp's
      ``convert_hf_to_gguf.py`` (it carries the architecture, hyperparameters, tokenizer
      and the tensors that are not quantized): each quantized tensor's Hugging Face name is
      mapped by gguf's ``TensorNameMap`` to the template's tensor, whose shape must match,
      and replaces it (Q/K rows permuted for ``llama``, as llama.cpp does). Where the
      template holds that tensor in float (F32/F16/BF16/Q8_0, the usual template) the values
      must agree with it (SQNR >= 10 dB; for Q/K whichever row order agrees), so another
      model or another row order is refused, never written. A tensor with no GGUF name, and
      per-expert MoE tensors (llama.cpp stacks them), are refused.
    * GGUF → safetensors (``layout``): the MXFP4 / NVFP4 tensors under their GGUF names in
      a lowprec (or compressed-tensors / ModelOpt) file; other tensors decoded to float32.
    """
    start = time.perf_counter()
    src_gguf = is_gguf(src) and os.path.isfile(os.fspath(src))
    dst_gguf = os.fspath(dst).endswith(".gguf")
    if to is not None and to != "nvfp4":
        raise CheckpointError(f"convert casts to nvfp4 only (--to nvfp4), not {to!r}")
    check_outputs(src, dst, report, force, template)
    if src_gguf and dst_gguf:
        if template is not None:
            raise CheckpointError("a template is for safetensors → GGUF only")
        f = GGUFFile(src)
        return _rewrite(f, dst, {}, to, force, progress, report, start)
    if not src_gguf and dst_gguf:
        if template is None:
            raise CheckpointError(
                "safetensors → GGUF needs --template MODEL.gguf: a GGUF of the same model from "
                "llama.cpp's convert_hf_to_gguf.py (architecture, hyperparameters, tokenizer, "
                "unquantized tensors); lowprec writes no GGUF metadata of its own")
        f = GGUFFile(template)
        blocks = f.value(f"{f.arch}.block_count")
        n_head = f.value(f"{f.arch}.attention.head_count")
        n_head_kv = f.value(f"{f.arch}.attention.head_count_kv", n_head)
        replace = {}
        for name, (fmt, shape, load) in checkpoint_mxarrays(src).items():
            if fmt not in _FORMAT_TYPE:
                raise CheckpointError(f"{name!r} is {fmt}; GGUF takes mxfp4 and nvfp4 exactly")
            if re.search(r"\.experts\.\d+\.", name):
                raise CheckpointError(f"{name!r}: per-expert tensors are stacked by llama.cpp's "
                                      "converter; lowprec does not stack them (refused)")
            g = _hf_to_gguf_name(name, f.arch, int(blocks or 0))
            if g is None or g not in f.tensors:
                raise CheckpointError(f"{name!r} has no tensor in the template "
                                      f"({g or 'no GGUF name for it'} in {f.arch})")
            if tuple(f.tensors[g].shape) != shape:
                raise CheckpointError(f"{name!r} has shape {list(shape)}, the template's "
                                      f"{g!r} {list(f.tensors[g].shape)}")
            heads = None
            if re.search(r"attn_[qk]\.weight$", g):
                h = n_head if g.endswith("attn_q.weight") else n_head_kv
                # per-layer head counts (arrays) are left to the template check
                heads = h if isinstance(h, int) and h > 0 and shape[0] % (2 * h) == 0 else None
            replace[g] = (fmt, lambda g=g, name=name, load=load, heads=heads:
                          _placed(f, g, name, load(), heads))
        return _rewrite(f, dst, replace, to, force, progress, report, start,
                        src=os.fspath(src))
    if src_gguf:
        return _gguf_to_safetensors(GGUFFile(src), dst, layout, to, force, progress, report, start)
    raise CheckpointError("convert_gguf: neither side is GGUF")


def _placed(f: GGUFFile, g: str, name: str, mx: MXArray, heads) -> MXArray:
    """``mx`` as the template's tensor ``g`` holds it: Q/K rows in llama.cpp's RoPE order
    where ``heads`` (this tensor's head count) is given, checked by :func:`_agreeing`."""
    from .._mxarray import MXArray  # noqa: PLC0415 - JAX, imported where used

    cands = [mx]
    if heads is not None:
        codes, scales = _permute_rows(_unpack(np.asarray(mx.elements)), np.asarray(mx.scales),
                                      heads)
        permuted = MXArray(jnp.asarray(_pack(codes)), jnp.asarray(scales), mx.fmt, mx.axis,
                           mx.shape, tensor_scale=mx.tensor_scale)
        # llama.cpp's converter permutes Q/K for llama (LlamaModel.permute)
        cands = [permuted, mx] if f.arch == "llama" else [mx, permuted]
    return _agreeing(f, g, name, cands)


_AGREE_DB = 10.0  # MXFP4 / NVFP4 of the same weights: 17-21 dB; other rows or tensors: ~0


def _agreeing(f: GGUFFile, g: str, name: str, cands: list) -> MXArray:
    """The first candidate (row order) whose values agree with the template's float tensor
    ``g`` (SQNR >= 10 dB, the template being the same weights in F32/F16/BF16/Q8_0), or the
    first one when the template's tensor holds nothing to compare with (quantized, or zero).
    Refuses, naming both tensors, when none agrees: another model, or another row order
    than llama.cpp's converter wrote."""
    from .._mx import dequantize  # noqa: PLC0415 - JAX, imported where used

    t = f.tensors[g]
    if t.type not in (F32, F16, BF16, Q8_0):
        return cands[0]
    ref = f.values(g).astype(np.float64)
    power = float((ref ** 2).sum())
    if not power > 0:
        return cands[0]
    got = []
    for mx in cands:
        err = float(((np.asarray(dequantize(mx, jnp.float32), np.float64) - ref) ** 2).sum())
        db = 10 * np.log10(power / err) if err > 0 else np.inf
        if db >= _AGREE_DB:
            return mx
        got.append(f"{db:.1f} dB")
    raise CheckpointError(
        f"{name!r} does not match the template's {g!r} (SQNR {' / '.join(got)} for "
        f"{'the row orders tried' if len(cands) > 1 else 'it'}; the same weights give > "
        f"{_AGREE_DB:.0f} dB): not the same model, or rows ordered otherwise than llama.cpp's "
        "converter writes them")


def _cast(mx: MXArray, name: str, to: Optional[str], casts: dict) -> MXArray:
    if to == "nvfp4" and mx.fmt.name == "mxfp4":
        if mx.shape[-1] % 64:
            raise CheckpointError(f"{name!r}: ggml NVFP4 needs ne[0] a multiple of 64, got {mx.shape[-1]}")
        mx, casts[name] = cast_mxfp4(mx, name)
    return mx


def _rewrite(f: GGUFFile, dst, replace: dict, to, force, progress, report, start, src=None):
    """A GGUF like ``f`` with ``replace`` (GGUF name → (format, load() → MXArray)) in place
    of those tensors, and MXFP4 cast to NVFP4 where ``to`` says so. Each tensor is loaded,
    cast and encoded when its bytes are written: one in memory at a time."""
    inputs = Inputs([f.path] + ([src] if src and os.path.isfile(src) else []))
    if to is not None:
        for t in f.tensors.values():
            if t.type == MXFP4 and t.name not in replace:
                f.check(t.name)
                replace[t.name] = ("mxfp4", lambda n=t.name: f.mxarray(n))
    outs, reports, casts, done = [], [], {}, {}
    skip = {_scale_name(n) for n in replace}
    for t in f.tensors.values():
        if t.name in skip and t.name not in replace:
            continue
        if t.name not in replace:
            outs.append(_raw_out(f, t))
            reports.append(TensorReport(t.name, t.shape, type_name(t.type), "kept", t.raw.size,
                                        t.raw.size, reason="unchanged"))
            continue
        fmt, load = replace[t.name]
        fmt = "nvfp4" if to == "nvfp4" else fmt
        gtype = _FORMAT_TYPE[fmt]
        block, size = _BLOCK[gtype]
        if t.shape[-1] % block:
            raise CheckpointError(f"{t.name!r}: ggml {fmt.upper()} needs ne[0] a multiple of "
                                  f"{block}, got {t.shape[-1]}")

        def data(name=t.name, load=load):
            mx = _cast(load(), name, to, casts)
            _, blocks, ts = mxarray_blocks(mx)
            done[name] = ts
            return blocks

        new = [_Out(t.name, gtype, t.shape, t.numel // block * size, data)]
        if gtype == NVFP4:
            new.append(_Out(_scale_name(t.name), F32, (1,), 4,
                            lambda name=t.name: np.asarray([done[name]], np.float32)))
        outs += new
        reports.append((t, gtype, new))
    write_gguf(dst, f.fields, outs, alignment=f.alignment, force=force, inputs=inputs,
               progress=progress)
    final = []
    for r in reports:
        if isinstance(r, TensorReport):
            final.append(r)
            continue
        t, gtype, new = r
        c = casts.get(t.name)
        reason = "" if c is None else (f"mxfp4 → nvfp4: {c.exact}/{c.blocks} blocks exact, "
                                       f"{c.requantized} requantized")
        final.append(TensorReport(t.name, t.shape, type_name(t.type), _NAMES[gtype].lower(),
                                  t.raw.size, sum(o.nbytes for o in new), reason=reason,
                                  stored_as=tuple(o.name for o in new),
                                  exact=c is None or c.requantized == 0))
    rep = ConversionReport(src or f.path, os.fspath(dst), "convert",
                           {"container": "gguf", "to": to,
                            "casts": {n: vars(c) for n, c in casts.items()}},
                           final, time.perf_counter() - start)
    write_report(rep, report, force, inputs)
    return rep


def write_in_layout(dst, layout, entries, metadata, data, *, force: bool, inputs, progress,
                    tmp_dir=None) -> None:
    """Writes ``entries`` (name, dtype, shape; values in ``data``) in lowprec's layout to
    ``dst``, or, for another ``layout`` (any registered one ``convert`` writes), to a
    temporary lowprec file in ``tmp_dir`` (a new one beside ``dst`` if None) that
    :func:`convert_checkpoint` moves into ``layout`` at ``dst``: the path every layout's
    conversion takes."""
    def write(path, frc):
        with SafetensorsWriter(path, entries, metadata, force=frc, inputs=inputs) as w:
            for name, _, _ in entries:
                w.write(name, data[name])

    if layout is None or get_layout(layout, writes="convert") is _hub():
        write(dst, force)
        return
    if tmp_dir is None:
        where = os.path.dirname(os.path.abspath(os.fspath(dst)))
        with tempfile.TemporaryDirectory(dir=where) as d:
            write_in_layout(dst, layout, entries, metadata, data, force=force, inputs=inputs,
                            progress=progress, tmp_dir=d)
        return
    tmp = os.path.join(tmp_dir, "layout-input.safetensors")
    write(tmp, False)
    convert_checkpoint(tmp, dst, layout, force=force, progress=progress)


def _gguf_to_safetensors(f: GGUFFile, dst, layout, to, force, progress, report, start):
    """GGUF → a lowprec-layout safetensors file (then ``layout`` by convert_checkpoint)."""
    inputs = Inputs([f.path])
    scales = {_scale_name(n) for n, t in f.tensors.items() if t.type == NVFP4}
    entries, data, specs, reports, casts = [], {}, {}, [], {}
    hub = _hub()  # lowprec's layout, which convert moves into any other
    for t in f.tensors.values():
        if t.name in scales:
            continue
        if t.type in (MXFP4, NVFP4):
            mx = _cast(f.mxarray(t.name), t.name, to, casts)
            spec = specs[t.name] = hub.spec_for(mx.fmt, t.shape, "F32", None)
            parts = hub.pack(mx)
            for role, stored, dt, shape in spec.parts(t.name):
                entries.append((stored, dt, shape))
                data[stored] = parts[role]
            reports.append(TensorReport(t.name, t.shape, type_name(t.type), mx.fmt.name,
                                        t.raw.size, spec.nbytes(),
                                        stored_as=tuple(p[1] for p in spec.parts(t.name))))
        else:
            x = f.values(t.name)
            entries.append((t.name, "F32", t.shape))
            data[t.name] = x
            reports.append(TensorReport(t.name, t.shape, type_name(t.type), "kept", t.raw.size,
                                        x.nbytes, reason="decoded to float32"))
    write_in_layout(dst, layout, entries, hub.table(specs), data, force=force, inputs=inputs,
                    progress=progress)
    rep = ConversionReport(f.path, os.fspath(dst), "convert",
                           {"container": "gguf", "layout": layout, "to": to,
                            "casts": {n: vars(c) for n, c in casts.items()}},
                           reports, time.perf_counter() - start)
    write_report(rep, report, force, inputs)
    return rep


def _hub():
    """lowprec's layout: what GGUF tensors are written in before ``convert`` moves them into
    another layout."""
    return get_layout("lowprec")
