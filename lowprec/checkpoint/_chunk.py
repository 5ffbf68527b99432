"""Encoding and decoding one piece of a tensor (see :func:`lowprec.checkpoint._layout.pieces`).

A piece of an MX tensor is a region of its (P, A, S) view, given as a 3-D array
(p, a, s) — or 2-D (p, a) when s = 1 — with the blocks along axis 1; a piece of a cast
tensor has any shape. The codecs are the library's: :func:`lowprec.quantize_mx`,
:func:`lowprec.dequantize`, :func:`lowprec.to_gpt_oss` / :func:`lowprec.from_gpt_oss`,
:func:`lowprec.encode` / :func:`lowprec.decode`. Decoded values are, bit for bit, those of
the in-memory API on the whole tensor: blocks never straddle pieces, and a per-tensor scale
(FP8 casts, NVFP4) is computed over the whole tensor first (:func:`finite_amax`,
:func:`tensor_scale`) and passed to every piece (NVFP4: ``quantize_mx(..., tensor_scale=)``).

At disk speed: a piece blocked along its last axis is a run of whole blocks. Where the
native library serves (:mod:`lowprec.kernels._ckpt_cpu`), one pass reads it once: the MX
quantization kernel's loops (the code ``quantize_mx`` runs; NVFP4 by its IEEE float32
steps, for tensor scales where those are its exact ones) write the codes a chunk at a time,
and the chunk's error statistics are computed from those codes while they are at hand,
exactly as the separate statistics pass would compute them: no compiled program, no copy.
Elsewhere it is encoded as ``(blocks, block size)`` padded to a power of two of blocks
(:func:`encode_blocks`: a handful of compiled programs serve every tensor; half-precision
input widened inside the program), and its error statistics and its decoding read the
stored codes as a :class:`CodedPiece` (``value = table[code] × factor``, the library's
decode bit for bit) in one native pass each, with no second quantize or dequantize; where
that library is not built the NumPy code here computes the same numbers.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Optional

import ml_dtypes
import numpy as np

from .._lazy import jit_on_first_call, lazy_module
from .._scheme_e8m0 import E8M0Scheme
from .._scheme_nvfp4 import NVFP4Scheme, NVFP4Step
from ..kernels import _ckpt_cpu
from ._errors import CheckpointError
from ._formats import cast_dtype
from ._layout import TensorSpec
from ._safetensors import numpy_dtype
from ._stats import ErrorStats

if TYPE_CHECKING:  # annotations only: the module imports JAX
    from .._options import MXCast

# Imported on first use: the checkpoint command line's native path needs no JAX.
jnp = lazy_module("jax.numpy")
lax = lazy_module("jax.lax")

# The float dtypes read as they are (by lowprec's functions and the native passes); others
# go through float32.
_FLOAT_INPUTS = (np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16))


def finite_amax(x: np.ndarray) -> float:
    """max |x| over the finite elements of ``x`` (0 if there are none).

    Example:
        >>> finite_amax(np.array([1.0, -3.0, np.inf, np.nan]))
        3.0
    """
    x = np.asarray(x)
    if x.size and native() and x.dtype in _ckpt_cpu.KINDS:
        return float(_ckpt_cpu.amax(x)[0])
    with np.errstate(over="ignore"):  # float64 beyond float32's range: inf, not counted
        a = np.abs(np.asarray(x, np.float32).reshape(-1))
    a = a[np.isfinite(a)]
    return float(a.max()) if a.size else 0.0


def finite_amax_rows(x: np.ndarray) -> np.ndarray:
    """float32 max |x| over the finite elements of each row of the 2-D ``x`` (0 for a row
    with none).

    Example:
        >>> finite_amax_rows(np.array([[1.0, -3.0], [np.inf, 0.5]], np.float32)).tolist()
        [3.0, 0.5]
    """
    x = np.asarray(x)
    if x.size and native() and x.dtype in _ckpt_cpu.KINDS:
        return _ckpt_cpu.amax(x, rows=x.shape[0])
    with np.errstate(over="ignore"):
        a = np.abs(x.astype(np.float32))
    a = np.where(np.isfinite(a), a, np.float32(0))
    return a.max(axis=1) if a.size else np.zeros(x.shape[0], np.float32)


def tensor_scale(amax, spec: TensorSpec) -> np.float32:
    """The per-tensor scale from the tensor's finite max magnitude ``amax`` (see
    :func:`finite_amax`). FP8: float32(amax) / float32(max_fp8); 1 if amax is 0. NVFP4: the
    library's, float32(amax / 2688) raised to at least 2^-143 (1 if amax is 0), which is
    what ``quantize_mx`` computes from the whole tensor.

    Example:
        >>> from lowprec.checkpoint._layout import make_spec
        >>> float(tensor_scale(896.0, make_spec("e4m3", (4,), "F32")))
        2.0
        >>> float(tensor_scale(5376.0, make_spec("nvfp4", (16,), "F32")))
        2.0
    """
    if spec.is_mx:
        host = _host_tensor_scale(amax, spec)
        if host is not None:
            return host
        from .._options import MXCast  # noqa: PLC0415 - JAX, imported where it is used

        amax_bits = jnp.asarray([np.float32(amax).view(np.uint32)], jnp.uint32)
        return np.uint32(_tensor_scale_bits(amax_bits, MXCast(spec.format))).view(np.float32)
    elem = spec.format
    amax = np.float32(amax)
    if not amax > 0:
        return np.float32(1)
    s = amax / np.float32(elem.max_finite)
    return s if np.isfinite(s) and s > 0 else np.float32(1)


@jit_on_first_call(static_argnums=(1,))
def _tensor_scale_bits(amax_bits, cast: MXCast):
    # The scheme computes it from the finite max magnitude of what it is given: here a single
    # value, the whole tensor's amax. One compiled program (op by op, each of its dozens of
    # integer steps would be compiled on its own: ~50 MB of peak memory).
    return cast.fmt.scheme.tensor_scale_bits(amax_bits, None, cast)


@jit_on_first_call(static_argnums=(0,))
def _element_scales(fmt, tensor_scale):
    """What block scale code c multiplies its elements by, for every c (one program)."""
    return fmt.scheme.element_scale(jnp.arange(256, dtype=jnp.uint8), tensor_scale)


def _host_element_scales(fmt, ts) -> Optional[np.ndarray]:
    """:func:`_element_scales` in NumPy, without JAX, for E8M0-scaled formats (the codes' int32
    exponents c - 127) and NVFP4 under a tensor scale in ``_ckpt_cpu.NVFP4_TENSOR_SCALES``
    (float32(ts x E4M3 block scale): every such product is a normal float32, so NumPy's IEEE
    product is the scheme's; NaN for a NaN code); None for any other scheme.
    ``tests/test_checkpoint_native.py`` compares them with the library's."""
    if isinstance(fmt.scheme, E8M0Scheme) and not fmt.tensor_scale:
        return np.arange(256, dtype=np.int32) - np.int32(127)
    lo, hi = _ckpt_cpu.NVFP4_TENSOR_SCALES
    if isinstance(fmt.scheme, NVFP4Scheme) and ts is not None and lo <= ts <= hi:
        block = _host_values(fmt.scale)
        if block is None or block.size != 256:
            return None
        with np.errstate(invalid="ignore"):
            factor = np.float32(ts) * block
        factor[np.isnan(block)] = np.nan  # the library's NaN, whatever the code's sign
        return factor
    return None


def _host_tensor_scale(amax, spec: TensorSpec) -> Optional[np.float32]:
    """:func:`tensor_scale` of NVFP4 in NumPy, without JAX: float32(amax / (448 x 6)), the
    IEEE quotient as the scheme's integer division rounds it, 1 for amax 0, raised to at
    least 2^-143; None for another format or step. ``tests/test_checkpoint_native.py``
    compares it with the library's over every binade."""
    if not _is_nvfp4(spec.format):
        return None
    amax = np.float32(amax)
    if not (np.isfinite(amax) and amax >= 0):
        return None
    if amax == 0:
        return np.float32(1)
    with np.errstate(under="ignore"):
        ts = amax / (np.float32(448) * np.float32(spec.format.element.max_finite))
    return max(ts, np.float32(float.fromhex("0x1p-143")))


def check_scales(values, where: str) -> None:
    """Refuses stored per-tensor or per-channel scales (an FP8 weight's, NVFP4's tensor or
    global scale) that are not positive and finite: decoding with them would give NaN, ±inf,
    zeros or flipped signs without a word. ``where`` names the stored tensor in the message.

    Example:
        >>> check_scales(np.float32([0.5, 2.0]), "w_scale")
        >>> check_scales(np.float32([0.5, -2.0]), "w_scale")
        Traceback (most recent call last):
        ...
        lowprec.checkpoint._errors.CheckpointError: w_scale: 1 of 2 scale(s) not positive and finite (e.g. -2.0); a scale must be a positive finite number: the file is damaged or not in the layout its names claim
    """
    v = np.asarray(values, np.float32).reshape(-1)  # BF16/F16 scales widen exactly
    with np.errstate(invalid="ignore"):
        bad = ~(np.isfinite(v) & (v > 0))
    if bad.any():
        raise CheckpointError(
            f"{where}: {int(np.count_nonzero(bad))} of {v.size} scale(s) not positive and finite "
            f"(e.g. {float(v[np.argmax(bad)])!r}); a scale must be a positive finite number: the "
            "file is damaged or not in the layout its names claim")


def _as_piece(x: np.ndarray) -> np.ndarray:
    """(p, a, s) → (p, a) when s = 1, so that the block axis is the last one."""
    return x.reshape(x.shape[:2]) if x.ndim == 3 and x.shape[2] == 1 else x


@functools.lru_cache(maxsize=None)
def _scale_values(scale_fmt) -> np.ndarray:
    """The value of each uint8 scale code (float64; decoded once per scale format)."""
    host = _host_values(scale_fmt)
    if host is not None:
        return host.astype(np.float64)
    from .._codec import decode  # noqa: PLC0415 - JAX, imported where it is used

    # The codes as a NumPy array: jnp.arange would compile a program of its own.
    return np.asarray(decode(np.arange(256, dtype=np.uint8), scale_fmt), np.float64)


def _host_values(elem) -> Optional[np.ndarray]:
    """float32 value of every code of ``elem`` by ml_dtypes, without JAX, where ``elem`` is
    an ml_dtypes float of one byte or less (FP8, FP6, FP4, E8M0), else None. The library's
    decode gives the same bits, NaNs included (``tests/test_checkpoint_native.py`` compares
    every code); MX INT8 and the formats ml_dtypes lacks take that decode."""
    dt = elem.storage_dtype
    if dt is None or dt.kind != "V" or dt.itemsize != 1:
        return None
    return np.arange(1 << elem.code_bits, dtype=np.uint8).view(dt).astype(np.float32)


def _scale_nan(scale_fmt) -> np.ndarray:
    """For each uint8 scale code: whether it is the scale format's NaN (E8M0: 0xFF; E4M3:
    0x7F and 0xFF), i.e. marks a block that held a NaN or an infinity."""
    return np.isnan(_scale_values(scale_fmt))


def _mx_clipped(x, scales: np.ndarray, fmt, ts=None) -> tuple:
    """(blocks whose max magnitude exceeds max_elem × scale, i.e. got saturated; blocks).
    ``x``: a piece with the blocks along axis 1; ``scales`` its scale codes; ``ts`` the
    NVFP4 tensor scale (a block's scale is then float32(ts × E4M3 block scale), as the
    quantizer divides by it)."""
    x = np.asarray(x)
    if x.dtype != np.float32:
        x = x.astype(np.float32)
    mag = x.view(np.uint32) & np.uint32(0x7FFF_FFFF)
    amax = mag.reshape(x.shape[0], -1, fmt.block_size, *x.shape[2:]).max(axis=2)
    codes = scales.reshape(amax.shape)
    # A block is clipped iff its max |x| exceeds max_elem times what its scheme scales its
    # elements by: 2^e for shared-exponent scales, else the float32 factor (NVFP4: float32(ts x
    # E4M3 block scale), the quantizer's divisor). Both products are exact in float64; a NaN
    # block (its scale code the scale format's NaN) is never clipped.
    factor = np.asarray(_element_scales(fmt, ts))
    if np.issubdtype(factor.dtype, np.integer):
        factor = np.ldexp(1.0, factor)
    limits = factor.astype(np.float64) * fmt.element.max_finite
    nan = _scale_nan(fmt.scale)
    with np.errstate(invalid="ignore"):
        clipped = (amax.view(np.float32) > limits[codes]) & ~nan[codes]
    return int(np.count_nonzero(clipped)), int(scales.size)


# -- a piece as codes: what the native passes read ---------------------------------------
@functools.lru_cache(maxsize=None)
def element_table(elem) -> np.ndarray:
    """float32 value of every code of an element format of at most 8 bits (FP4: 16 values,
    FP6: 64, FP8 and INT8: 256), by the library's decode: a decoded element is
    ``table[code]``."""
    host = _host_values(elem)
    if host is not None:
        return host
    from .._codec import decode  # noqa: PLC0415 - JAX, imported where it is used

    codes = np.arange(1 << elem.code_bits, dtype=np.uint8)  # not jnp: no program of its own
    return np.asarray(decode(codes, elem), np.float32)


def factor_table(fmt, ts=None) -> np.ndarray:
    """float32 factor of every uint8 scale code of block format ``fmt`` (NVFP4: under the
    tensor scale ``ts``): what the code multiplies its block's elements by (E8M0: 2^(c −
    127); NVFP4: float32(ts × E4M3 block scale)), NaN for the scale format's NaN codes (a
    block that held a NaN or an infinity decodes to NaN). A decoded value is ``element ×
    factor`` rounded to float32, which is the library's decode bit for bit."""
    key = None if ts is None else int(np.float32(ts).view(np.uint32))
    return _factor_table(fmt, key)


@functools.lru_cache(maxsize=256)
def _factor_table(fmt, ts_bits) -> np.ndarray:
    ts = None if ts_bits is None else np.uint32(ts_bits).view(np.float32)
    factor = _host_element_scales(fmt, ts)
    if factor is None:
        factor = np.asarray(_element_scales(fmt, ts))
    with np.errstate(over="ignore"):
        if np.issubdtype(factor.dtype, np.integer):  # shared exponents: exact powers of two
            factor = np.ldexp(np.float64(1), factor)
        table = factor.astype(np.float32)
    table[_scale_nan(fmt.scale)] = np.nan
    table.setflags(write=False)
    return table


@dataclasses.dataclass(frozen=True, eq=False)
class CodedPiece:
    """A piece as its stored codes: value i is ``table[code i] × factors[i // block]``,
    one float32 multiply rounded to nearest even (``factors`` None: the table value), NaN
    results made the library's canonical NaN if ``canonical_nan`` (the MX decode does so;
    NumPy arithmetic, as the FP8 casts' ``values × scale``, keeps them). ``codes``: packed
    uint8 (``code_bits`` 4, 6 or 8 per element) in the piece's C order. What every layout
    reduces a piece to for the native passes (:mod:`lowprec.kernels._ckpt_cpu`)."""

    codes: np.ndarray
    code_bits: int
    table: np.ndarray
    factors: Optional[np.ndarray]
    block: int
    canonical_nan: bool
    #: Instead of ``factors``: each block's scale code (uint8), its factor ``ftable[code]``
    #: (float32[256]), looked up by the native decode a chunk at a time.
    scale_codes: Optional[np.ndarray] = None
    ftable: Optional[np.ndarray] = None

    @property
    def size(self) -> int:
        return self.codes.size * 8 // self.code_bits

    def block_factors(self) -> Optional[np.ndarray]:
        """Each block's factor (``factors``, or looked up from the scale codes)."""
        if self.scale_codes is None:
            return self.factors
        return np.take(self.ftable, self.scale_codes)

    def args(self) -> dict:
        """The arguments of :func:`lowprec.kernels._ckpt_cpu.stats` (and ``decode``)."""
        return dict(codes=self.codes, code_bits=self.code_bits, elut=self.table,
                    factors=self.block_factors(), block=self.block)

    def decode_args(self) -> dict:
        """The arguments of :func:`lowprec.kernels._ckpt_cpu.decode`: the scale codes and
        their table where the piece has them (no per-block factors made here)."""
        if self.scale_codes is None:
            return self.args()
        return dict(codes=self.codes, code_bits=self.code_bits, elut=self.table,
                    factors=self.ftable, scale_codes=self.scale_codes, block=self.block)


def native() -> bool:
    """Whether the native passes serve the pipeline here (see :mod:`lowprec.kernels._ckpt_cpu`;
    else the NumPy code below, the same numbers)."""
    return _ckpt_cpu.available()


def mx_coded(elements, scales, fmt, ts=None) -> Optional[CodedPiece]:
    """The :class:`CodedPiece` of MX codes blocked along the last axis (``elements``: their
    packed bytes, ``scales``: their scale codes, in C order), or None where the native
    passes do not read the element codes."""
    el = fmt.element
    if el.code_bits not in (4, 6, 8):
        return None
    scales = np.asarray(scales).view(np.uint8).reshape(-1)
    # The blocks' factors are not made here (a lookup per block was ~0.15 of the ~1 ms a
    # piece of 2^20 elements took to decode): the native decode looks them up from the scale
    # codes a chunk at a time, and the other passes by block_factors().
    ts_key = None if ts is None else int(np.float32(ts).view(np.uint32))
    table, ftable, table_nan, table_inf, nan_codes, zero_codes = _coded_tables(fmt, ts_key)
    # NaNs made canonical only where one can come out: a NaN code, a NaN block's factor, or
    # an infinite code in a block of factor 0 (any other product of a code and a factor is
    # finite or infinite). That pass over every element was ~0.5 of the decode's 1.2 ns per
    # element (FP4 to bfloat16, AVX2, thread CPU time). Whether a piece holds one of the few
    # scale codes of a NaN or zero factor: a comparison per such code.
    canonical = bool(table_nan or any((scales == c).any() for c in nan_codes)
                     or (table_inf and any((scales == c).any() for c in zero_codes)))
    return CodedPiece(np.asarray(elements).view(np.uint8).reshape(-1), el.code_bits,
                      table, None, fmt.block_size, canonical, scales, ftable)


@functools.lru_cache(maxsize=256)
def _coded_tables(fmt, ts_key) -> tuple:
    """What :func:`mx_coded` needs of a format (and NVFP4 tensor scale, as its float32
    bits), found once: (element table, factor table, whether an element value is NaN,
    whether one is infinite, the scale codes of a NaN factor, those of a zero factor)."""
    table = element_table(fmt.element)
    ftable = _factor_table(fmt, ts_key)
    with np.errstate(invalid="ignore"):
        nan_codes = np.flatnonzero(np.isnan(ftable)).astype(np.uint8)
        zero_codes = np.flatnonzero(ftable == 0).astype(np.uint8)
    return (table, ftable, bool(np.isnan(table).any()), bool(np.isinf(table).any()),
            nan_codes, zero_codes)


# -- encoding a piece -------------------------------------------------------------------
_MIN_ROWS = 64  # fewest blocks (or cast elements / 32) a program is compiled for


def _bucket(n: int) -> int:
    """The padded length a piece of ``n`` rows is encoded at: the next power of two (at
    least :data:`_MIN_ROWS`), so every tensor of a checkpoint reuses a few compiled programs
    (one per power of two up to the piece size) instead of one per tensor shape."""
    return max(_MIN_ROWS, 1 << max(0, int(n) - 1).bit_length())


def _padded(x: np.ndarray, rows: int) -> np.ndarray:
    """``x`` (rows first) zero-padded to ``rows`` rows."""
    if x.shape[0] == rows:
        return x
    out = np.zeros((rows, *x.shape[1:]), x.dtype)
    out[: x.shape[0]] = x
    return out


@jit_on_first_call(static_argnums=(1, 2))
def _blocks_program(x, fmt, scale_rule, ts):
    from .._dtypes import input_bits  # noqa: PLC0415 - JAX, imported where it is used
    from .._mx import quantize_mx  # noqa: PLC0415

    # Half-precision input widened to float32 patterns here, with integer operations (exact,
    # NaN payloads kept), so the native one-pass quantizer serves it too.
    if x.dtype != jnp.float32:
        x = lax.bitcast_convert_type(input_bits(x), jnp.float32)
    mx = quantize_mx(x, fmt, scale_rule=scale_rule, tensor_scale=ts)
    return mx.elements, mx.scales, mx.tensor_scale


def encode_blocks(x: np.ndarray, fmt, scale_rule=None, ts=None) -> tuple:
    """``(elements, scales, tensor scale used)`` of ``x`` (float32, bfloat16 or float16)
    blocked along its last axis, as :func:`lowprec.quantize_mx` gives them (the same bits:
    blocks are independent, and NVFP4's tensor scale ``ts`` is given), in ``x``'s shape
    with the last axis in bytes and in blocks. Runs one compiled program per block format
    and power-of-two number of blocks (:func:`_bucket`), whatever ``x``'s shape."""
    *lead, a = x.shape
    block = fmt.block_size
    nb = x.size // block
    blocks = _padded(np.ascontiguousarray(x).reshape(nb, block), _bucket(nb))
    el, sc, ts_used = _blocks_program(jnp.asarray(blocks), fmt, scale_rule,
                                      None if ts is None else np.float32(ts))
    el = np.asarray(el)[:nb].reshape(*lead, a * fmt.element.code_bits // 8)
    return el, np.asarray(sc)[:nb].reshape(*lead, a // block), ts_used


def encode_rows(x: np.ndarray, fmt, scale_rule=None) -> tuple:
    """``(elements, scales)`` of the 2-D ``x`` (float32, bfloat16 or float16) blocked along
    its last axis, as :func:`encode_blocks` gives them (the same bits): by the MX
    quantization kernel's loops on this thread (the fused pass without its statistics) where
    they serve this format and rule, else by :func:`encode_blocks`' program. For writers that
    compute their statistics elsewhere (the engine layouts)."""
    if x.ndim == 2 and x.dtype in _FLOAT_INPUTS and native():
        plan = _fused_plan(fmt, scale_rule)
        if plan is not None:
            elements, scales, _ = _ckpt_cpu.quantize(x, plan.attrs, stats=False)
            return elements, scales
    elements, scales, _ = encode_blocks(x, fmt, scale_rule)
    return elements, scales


@jit_on_first_call(static_argnums=(1,))
def _cast_program(y, elem):
    from .._codec import encode  # noqa: PLC0415 - JAX, imported where it is used

    return encode(y, elem, overflow="saturate")


def encode_cast(y: np.ndarray, elem) -> np.ndarray:
    """Codes of float32 ``y`` in element format ``elem``, saturating (any shape), by one
    compiled program per power-of-two size."""
    flat = y.reshape(-1)
    n = flat.size
    codes = _cast_program(jnp.asarray(_padded(flat, 32 * _bucket(-(-n // 32)))), elem)
    return np.asarray(codes)[:n].reshape(y.shape)


def quantize_chunk(x: np.ndarray, spec: TensorSpec, scale=None,
                   stats: Optional[ErrorStats] = None) -> dict:
    """Quantizes one piece ``x`` of a tensor stored as ``spec``.

    Returns ``{role: stored array}`` in the piece's shape (without the per-tensor scale,
    which the caller passes as ``scale``: the whole tensor's :func:`tensor_scale`, needed for
    NVFP4 and FP8 with ``fp8_scale="tensor"``); updates ``stats``. The statistics come from
    the stored codes (no second decode pass), by the native pass where it serves.

    Example:
        >>> from lowprec.checkpoint._layout import make_spec
        >>> parts = quantize_chunk(np.ones((2, 64), np.float32), make_spec("mxfp4", (2, 64), "F32"))
        >>> {k: v.shape for k, v in parts.items()}
        {'elements': (2, 32), 'scales': (2, 2)}
    """
    x = np.asarray(x)
    if spec.is_mx:
        return _quantize_mx_piece(_as_piece(x), spec, scale, stats)
    return _quantize_cast_piece(x, spec, scale, stats)


@dataclasses.dataclass(frozen=True, eq=False)
class _FusedPlan:
    """What the fused native pass needs for one block format and rule, computed once."""

    attrs: np.ndarray  # the MX kernel's attributes, int64
    elut: np.ndarray  # float32 value of each element code
    ftable: np.ndarray  # float32 factor of each scale code (NaN: the scale's NaN codes)
    nan_codes: np.ndarray  # bool per scale code: marks a NaN block
    max_finite: float


@functools.lru_cache(maxsize=None)  # asked per piece: ~16 us of Python each time
def _is_nvfp4(fmt) -> bool:
    """Whether ``fmt`` is lowprec's NVFP4 quantized by the "divide" step, which the native
    NVFP4 pass computes: E2M1 elements in blocks of 16 under E4M3 scales and a tensor scale."""
    return (isinstance(fmt.scheme, NVFP4Scheme) and fmt.block_size == 16
            and fmt.element.name == "e2m1" and fmt.scheme.scale.name == "e4m3"
            and scale_options(fmt).nvfp4_step == NVFP4Step.DIVIDE)


@functools.lru_cache(maxsize=None)
def _max_finite(elem) -> float:
    """``elem.max_finite``, which computes exact fractions on every call (~27 us of Python,
    asked per piece)."""
    return float(elem.max_finite)


def scale_options(fmt, scale_rule=None):
    """``MXCast(fmt, scale_rule=scale_rule).scale_options`` (the pipeline's casts round to
    nearest even) without ``lowprec._options``, which imports JAX: both ask the scheme
    (``cast_options``). ``tests/test_checkpoint_native.py`` compares the two for every
    block format and rule."""
    return fmt.scheme.cast_options(None, fmt.name, scale_rule=scale_rule)


@functools.lru_cache(maxsize=None)
def _fused_plan(fmt, scale_rule) -> Optional[_FusedPlan]:
    """The fused pass's plan where the MX quantization kernel's loops encode this block
    format and rule on this CPU (what ``quantize_mx`` itself runs for float32 blocked along
    the last axis: :func:`lowprec.kernels._mx_quantize_cpu.serves`), else None."""
    from ..kernels import _mx_quantize_cpu  # noqa: PLC0415 - its kernel's registration

    rule = getattr(scale_options(fmt, scale_rule), "scale_rule", None)
    # serves() without its vector_quantizer() (that loads and checks the XLA handlers,
    # ~0.3 s of compiles, which this pass does not call): the library's own AVX2 test.
    if not (_mx_quantize_cpu.computes(fmt, "nearest_even") and fmt.block_size == 32
            and _mx_quantize_cpu.takes_rule(rule) and _ckpt_cpu.has_avx2()):
        return None
    ftable = factor_table(fmt)
    attrs = np.array([int(v) for _, v in _mx_quantize_cpu.attributes(fmt, rule)], np.int64)
    return _FusedPlan(attrs, element_table(fmt.element), ftable, np.isnan(ftable),
                      float(fmt.element.max_finite))


def _parts(elements, scales, spec: TensorSpec) -> dict:
    # gpt-oss's blocks are the same bytes, [..., K/32, 16] (lowprec.to_gpt_oss)
    return {spec.code_role: elements, "scales": scales}


_NONFINITE = _ckpt_cpu.STATS.index("nonfinite")


def _nan_blocks(v: np.ndarray, nan_codes: np.ndarray, scales: np.ndarray) -> int:
    """The blocks of a piece whose scale code is a NaN code (``nan_codes``: bool per code),
    given its statistics ``v``: every element of such a block decodes to NaN and is counted
    non-finite, so a piece with none (nearly all) has no NaN block and its scales are not
    looked at (a lookup per block cost ~0.5 ms per piece of 2^20 elements)."""
    if v[_NONFINITE] == 0:
        return 0
    return int(np.count_nonzero(nan_codes[scales]))


def _quantize_mx_piece(x: np.ndarray, spec: TensorSpec, scale, stats) -> dict:
    fmt = spec.format
    if fmt.tensor_scale and scale is None:
        raise ValueError(f"{fmt.name}: pass the whole tensor's scale (tensor_scale())")
    ts = np.float32(scale) if fmt.tensor_scale else None
    lo, hi = _ckpt_cpu.NVFP4_TENSOR_SCALES
    if (x.ndim == 2 and x.dtype in _FLOAT_INPUTS and ts is not None and lo <= ts <= hi and native()
            and _is_nvfp4(fmt)):
        # NVFP4 in one native pass too, where its IEEE float32 steps are the exact ones.
        ftable = factor_table(fmt, ts)
        elements, scales, v = _ckpt_cpu.quantize_nvfp4(
            x, ts, elut=element_table(fmt.element), ftable=ftable,
            max_finite=_max_finite(fmt.element), stats=stats is not None)
        if stats is not None:
            stats.add_vector(v)
            stats.nan_blocks += _nan_blocks(v, np.isnan(ftable), scales)
        return _parts(elements, scales, spec)
    if x.ndim == 2 and x.dtype in _FLOAT_INPUTS and native():
        plan = _fused_plan(fmt, spec.scale_rule)
        if plan is not None:
            # One native pass: the kernel's codes (bf16/f16 widened exactly on the way) and,
            # from them, the statistics the separate pass below would compute, bit for bit.
            elements, scales, v = _ckpt_cpu.quantize(
                x, plan.attrs, elut=plan.elut, ftable=plan.ftable, max_finite=plan.max_finite,
                stats=stats is not None)
            if stats is not None:
                stats.add_vector(v)
                stats.nan_blocks += _nan_blocks(v, plan.nan_codes, scales)
            return _parts(elements, scales, spec)
    # Not served by a native pass: the library's quantize_mx (JAX, imported here).
    from .._mx import MXArray, dequantize, quantize_mx  # noqa: PLC0415

    xin = x if x.dtype in _FLOAT_INPUTS else x.astype(np.float32)
    mx = None
    if x.ndim == 2:  # blocks along the last axis: a run of whole blocks
        elements, scales, ts = encode_blocks(xin, fmt, spec.scale_rule, ts)
    else:  # blocks along axis 1 of (p, a, s)
        mx = quantize_mx(jnp.asarray(xin), fmt, axis=1, scale_rule=spec.scale_rule,
                         tensor_scale=ts)
        elements, scales, ts = np.asarray(mx.elements), np.asarray(mx.scales), mx.tensor_scale
    ts = None if ts is None else np.float32(ts)
    if stats is not None:
        coded = mx_coded(elements, scales, fmt, ts) if x.ndim == 2 else None
        if native() and x.dtype in _FLOAT_INPUTS:
            factors = factor_table(fmt, ts)[scales]
            clip = dict(clip=1, max_finite=fmt.element.max_finite,
                        view=x.shape if x.ndim == 3 else (*x.shape, 1))
            if coded is not None:
                v = _ckpt_cpu.stats(x, **coded.args(), **clip)
            else:
                if mx is None:
                    mx = MXArray(jnp.asarray(elements), jnp.asarray(scales), fmt, 1, x.shape,
                                 spec.scale_rule, ts)
                v = _ckpt_cpu.stats(x, np.asarray(dequantize(mx)), factors=factors,
                                    block=fmt.block_size, **clip)
            stats.add_vector(v)
            stats.nan_blocks += int(np.count_nonzero(np.isnan(factors)))
        else:
            if mx is None:
                mx = MXArray(jnp.asarray(elements), jnp.asarray(scales), fmt, 1, x.shape,
                             spec.scale_rule, ts)
            stats.update(x, np.asarray(dequantize(mx)))
            stats.add_clipped(*_mx_clipped(xin, scales, fmt, ts))
            stats.add_nan_blocks(scales, _scale_nan(fmt.scale))
    return _parts(elements, scales, spec)


def _quantize_cast_piece(x: np.ndarray, spec: TensorSpec, scale, stats) -> dict:
    elem = spec.format
    x32 = x.astype(np.float32)
    if spec.fp8_scale == "tensor":
        scale = np.float32(1) if scale is None else np.float32(scale)
        with np.errstate(over="ignore", invalid="ignore"):
            y = np.divide(x32, scale, out=x32)  # float32 division, as ever (not XLA's)
    else:
        scale, y = None, x32
    codes = encode_cast(y, elem)
    if stats is not None:
        if native() and x.dtype in _FLOAT_INPUTS:
            if elem.code_bits == 8:
                decoded = dict(codes=codes, code_bits=8, elut=element_table(elem),
                               factors=None if scale is None else np.float32([scale]),
                               block=max(codes.size, 1))
            else:  # BF16 / FP16: the codes are the values
                decoded = dict(q=codes.view(numpy_dtype(cast_dtype(elem))))
            stats.add_vector(_ckpt_cpu.stats(
                x, **decoded, clip=2, max_finite=elem.max_finite,
                cast_scale=np.float32(1) if scale is None else scale))
        else:
            stats.update(x, _decode_values(codes, spec, scale))
            with np.errstate(invalid="ignore"):
                stats.add_clipped(np.count_nonzero(np.abs(y) > elem.max_finite), y.size)
    return {"values": codes}


def _decode_values(codes: np.ndarray, spec: TensorSpec, scale) -> np.ndarray:
    from .._codec import decode  # noqa: PLC0415 - JAX, imported where it is used

    elem = spec.format
    values = np.asarray(decode(jnp.asarray(codes.view(elem.code_dtype)), elem))
    if spec.fp8_scale == "tensor":
        with np.errstate(over="ignore"):
            values = values * np.float32(scale)
    return values


# -- decoding a piece -------------------------------------------------------------------
def coded_piece(parts: dict, spec: TensorSpec, shape) -> Optional[CodedPiece]:
    """The :class:`CodedPiece` of the stored ``parts`` of one piece (see
    :func:`dequantize_chunk`), or None where the native passes do not decode it (blocks along
    a strided axis, BF16/FP16 casts); raises CheckpointError for parts of the wrong size."""
    if not spec.is_mx:
        elem = spec.format
        if elem.code_bits != 8:
            return None
        factors = None
        if spec.fp8_scale == "tensor":
            factors = np.asarray(parts["scale"], np.float32).reshape(1)
        codes = np.asarray(parts["values"]).view(np.uint8).reshape(-1)
        return CodedPiece(codes, 8, element_table(elem), factors, max(codes.size, 1), False)
    p, a, s = (int(d) for d in shape)
    fmt = spec.format
    if s != 1:
        return None
    elements, scales = np.asarray(parts[spec.code_role]), np.asarray(parts["scales"])
    want = (p * spec.part_length("elements", a), p * spec.part_length("scales", a))
    if (elements.size, scales.size) != want:
        raise CheckpointError(
            f"cannot decode {fmt.name} data of shape {list(spec.shape)}: {elements.size} element "
            f"bytes and {scales.size} scales for a piece of {p} x {a} values (need {want[0]} and "
            f"{want[1]})")
    ts = None
    if fmt.tensor_scale:
        ts = np.asarray(parts["scale"], np.float32).reshape(())
    return mx_coded(elements, scales, fmt, ts)


def decode_coded(coded: CodedPiece, shape, dtype, *, saturate: bool = False,
                 name: str = "") -> tuple:
    """``(values, saturated, non-finite values)``: ``coded`` decoded into a new array of
    ``shape`` and NumPy ``dtype`` (float32, bfloat16, float16 or float64) by the native pass,
    narrowed as :func:`narrow` does (refused, or clamped with ``saturate``)."""
    out = np.empty(shape, dtype)
    nonfinite, over, top = _ckpt_cpu.decode(out, **coded.decode_args(),
                                            canonical_nan=coded.canonical_nan,
                                            saturate=saturate)
    if over and not saturate:
        raise _overflow_error(name, over, top, out.dtype)
    return out, over, nonfinite


def dequantize_chunk(parts: dict, spec: TensorSpec, shape, dtype) -> np.ndarray:
    """Values of the stored ``parts`` of one piece, as NumPy ``dtype``, in shape ``shape``.

    For MX, ``shape`` is the piece's (p, a, s) in the tensor's (P, A, S) view (the whole
    tensor is the piece ``spec.view``); the parts may come in any shape holding the
    piece's bytes in C order. For casts, ``shape`` is any shape of the values.

    Example:
        >>> from lowprec.checkpoint._layout import make_spec
        >>> spec = make_spec("mxfp8", (1, 32), "F32")
        >>> x = np.linspace(-1, 1, 32, dtype=np.float32).reshape(1, 32)
        >>> got = dequantize_chunk(quantize_chunk(x, spec), spec, (1, 32, 1), np.float32)
        >>> got.shape, float(np.abs(got.reshape(1, 32) - x).max()) < 2**-4
        ((1, 32, 1), True)
    """
    dtype = np.dtype(dtype)
    if native() and dtype in _ckpt_cpu.KINDS:
        coded = coded_piece(parts, spec, shape)
        if coded is not None:
            return _decode_unchecked(coded, shape, dtype)
    if not spec.is_mx:
        values = _decode_values(np.asarray(parts["values"]), spec, parts.get("scale"))
        return values.astype(dtype).reshape(shape)
    from .._mx import MXArray, dequantize  # noqa: PLC0415 - JAX, imported where it is used

    p, a, s = (int(d) for d in shape)
    try:
        fmt = spec.format
        scales = np.asarray(parts["scales"]).reshape(p, spec.part_length("scales", a), s)
        # gpt-oss's blocks [.., K/32, 16] are lowprec's packed elements, in rows of 16
        elements = np.asarray(parts[spec.code_role]).reshape(
            p, spec.part_length("elements", a), s)
        piece = (p, a, s)
        if s == 1:
            elements, scales, piece = elements[..., 0], scales[..., 0], (p, a)
        ts = None
        if fmt.tensor_scale:
            ts = jnp.asarray(np.asarray(parts["scale"], np.float32).reshape(()))
        mx = MXArray(elements=jnp.asarray(elements), scales=jnp.asarray(scales), fmt=fmt,
                     axis=1, shape=piece, scale_rule=spec.scale_rule, tensor_scale=ts)
        values = dequantize(mx, dtype) if dtype in _FLOAT_INPUTS else np.asarray(dequantize(mx)).astype(dtype)
    except (ValueError, TypeError) as e:  # wrong sizes; MXArray's own validation
        raise CheckpointError(f"cannot decode {spec.format.name} data of shape {list(spec.shape)}: {e}") from None
    return np.asarray(values).reshape(p, a, s)


def _decode_unchecked(coded: CodedPiece, shape, dtype) -> np.ndarray:
    """``coded`` decoded into ``dtype`` as astype would narrow it (overflow to inf)."""
    out = np.empty(shape, dtype)
    _ckpt_cpu.decode(out, **coded.decode_args(), canonical_nan=coded.canonical_nan,
                     saturate=False)
    return out


def wide_dtype(np_dtype) -> np.dtype:
    """The dtype decoding happens in before narrowing: float64 for F64, else float32 (every
    decoded value is exact or defined there: MX/NVFP4 values, FP8 value × scale)."""
    return np.dtype(np.float64) if np.dtype(np_dtype) == np.float64 else np.dtype(np.float32)


class _Overflow(CheckpointError):
    """Decoded values that do not fit the output dtype (the message names the tensor)."""


def _overflow_error(name: str, n: int, top: float, np_dtype) -> CheckpointError:
    np_dtype = np.dtype(np_dtype)
    limit = float(np.finfo(np_dtype).max) if np_dtype != np.dtype("bfloat16") else float.fromhex("0x1.fep127")
    return _Overflow(
        f"{name}: {n} finite value(s) up to {top:.6g} do not fit {np_dtype.name} "
        f"(largest finite {limit:.6g}) and would become inf; decode to a wider dtype "
        "(--dtype float32 or bfloat16) or pass --saturate (saturate=True) to clamp them "
        "to the largest finite value (counted in the report)")


def narrow(values: np.ndarray, np_dtype, name: str, saturate: bool) -> tuple:
    """``values`` (float32/float64) as ``np_dtype``; returns ``(narrowed, saturated)``.

    Finite values beyond the dtype's largest finite value (65504 in float16) would round to
    ±inf: that is refused (CheckpointError naming the tensor, its largest magnitude and the
    fixes) unless ``saturate``, which clamps them to ±max finite and counts them.
    NaN/±inf decoded values (NaN blocks) stay what they are.
    """
    np_dtype = np.dtype(np_dtype)
    if np_dtype == values.dtype:
        return values, 0
    if (native() and values.dtype == np.float32 and np_dtype in _ckpt_cpu.KINDS):
        out = np.empty(values.shape, np_dtype)
        _, n, top = _ckpt_cpu.decode(out, values, saturate=saturate)
        if n and not saturate:
            raise _overflow_error(name, n, top, np_dtype)
        return out, n
    with np.errstate(over="ignore", invalid="ignore"):
        out = values.astype(np_dtype)
        overflow = np.isinf(out) & np.isfinite(values)
    n = int(np.count_nonzero(overflow))
    if not n:
        return out, 0
    top = float(np.max(np.abs(values[overflow])))
    if not saturate:
        raise _overflow_error(name, n, top, np_dtype)
    limit = float(np.finfo(np_dtype).max) if np_dtype != np.dtype("bfloat16") else float.fromhex("0x1.fep127")
    out[overflow] = np.where(values[overflow] > 0, limit, -limit).astype(np_dtype)
    return out, n


def count_nonfinite(values: np.ndarray) -> int:
    """NaN and ±inf values of a decoded piece."""
    return int(values.size - np.count_nonzero(np.isfinite(values)))


def decode_piece(parts: dict, spec: TensorSpec, shape, np_dtype, *, saturate: bool,
                 name: str, where: str = "") -> tuple:
    """``(values, saturated, non-finite values)`` of one piece's stored ``parts`` (see
    :func:`dequantize_chunk`) in the output dtype ``np_dtype``: decoded (in float32, or
    float64 for F64) and narrowed as :func:`narrow` does, in one native pass where it serves
    (else :func:`dequantize_chunk`, :func:`narrow` and a count: the same values). ``where``
    prefixes the errors of parts that do not decode (the file's path)."""
    np_dtype = np.dtype(np_dtype)
    try:
        if native() and np_dtype in _ckpt_cpu.KINDS:
            coded = coded_piece(parts, spec, shape)
            if coded is not None:
                return decode_coded(coded, shape, np_dtype, saturate=saturate, name=name)
        values = dequantize_chunk(parts, spec, shape, wide_dtype(np_dtype))
    except _Overflow:
        raise
    except CheckpointError as e:
        raise CheckpointError(f"{where}{e}") from None
    values, saturated = narrow(np.asarray(values), np_dtype, name, saturate)
    return values, saturated, count_nonfinite(values)
