"""The checkpoint pipeline's native passes over host memory (``_ckpt_cpu.cc``): which calls
they serve, a check before first use, and the calls.

They are plain C functions of lowprec's native library (no XLA handler: they read and write
NumPy buffers between the pipeline's XLA programs), called through :mod:`ctypes`, which
releases the GIL, so the pipeline's worker threads run them at once. Each computes what NumPy
code in :mod:`lowprec.checkpoint` computes (the fallback where the library is not built, its
check fails, or the kernel policy is ``"xla"``); ``tests/test_checkpoint_native.py`` compares
them. They depend on no XLA FFI version, so they serve wherever the library loads. The
fused quantize passes (:func:`quantize`, :func:`quantize_nvfp4`) compute what the library's
``quantize_mx`` and then :func:`stats` would: the MX kernel's own loops on the calling thread
(no XLA call), NVFP4's steps in IEEE float32, and the statistics of each chunk in the same
order as :func:`stats` (``tests/test_checkpoint_native.py`` compares them bit for bit).
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
from typing import Optional

import ml_dtypes
import numpy as np

from ._cpu_native import LIBRARY

_ENV_VAR = "LOWPREC_KERNELS"  # lowprec.kernels.ENV_VAR (tests/test_checkpoint_nojax.py checks)

#: The slots of :func:`stats`' result, in order (ErrorStats' fields, then the clipped count).
STATS = ("count", "sum_x2", "sum_e2", "max_abs", "max_rel", "nonfinite", "nan_in", "inf_in",
         "inf_saturated", "finite_to_nonfinite", "nonfinite_changed", "clipped", "clip_total")
#: Input and output dtypes the passes read or write, by their code in the library.
KINDS = {np.dtype(np.float32): 0, np.dtype(ml_dtypes.bfloat16): 1, np.dtype(np.float16): 2,
         np.dtype(np.float64): 3}
_P, _I32, _I64, _F64, _F32 = (ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_double,
                              ctypes.c_float)
_SIGNATURES = {
    "lowprec_ckpt_stats": [_P, _I32, _I64, _P, _I32, _P, _I32, _P, _P, _I64, _I32, _F64, _F32,
                           _I64, _I64, _I64, _P],
    "lowprec_ckpt_decode": [_P, _P, _I32, _P, _P, _I64, _I32, _I64, _I32, _P, _I32, _P],
    "lowprec_ckpt_decode_scaled": [_P, _I32, _P, _P, _P, _I64, _I32, _I64, _I32, _P, _I32, _P],
    "lowprec_ckpt_amax": [_P, _I32, _I64, _I64, _P],
    "lowprec_ckpt_quantize": [_P, _I32, _I64, _P, _P, _P, _P, _P, _F64, _P],
    "lowprec_ckpt_quantize_nvfp4": [_P, _I32, _I64, _F32, _P, _P, _P, _P, _F64, _P],
    "lowprec_cpu_has_avx2": [],
}
#: The tensor scales :func:`quantize_nvfp4` takes: [2^-118, 2^116], where lowprec's NVFP4
#: products are normal floats (lowprec/_nvfp4.py), so IEEE float32 steps are its exact ones.
NVFP4_TENSOR_SCALES = (float.fromhex("0x1p-118"), float.fromhex("0x1p116"))


@functools.lru_cache(maxsize=None)
def _library() -> tuple[Optional[ctypes.CDLL], str]:
    if not LIBRARY.is_file():
        return None, "the native library was not built"
    try:
        lib = ctypes.CDLL(str(LIBRARY))
        for name, argtypes in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, ctypes.c_int32
    except (OSError, AttributeError) as error:
        return None, f"the native library at {LIBRARY} lacks them ({error}): reinstall lowprec"
    problem = _self_check(lib)
    if problem:
        return None, f"they failed their check: {problem}"
    return lib, f"the checkpoint passes run natively ({LIBRARY})"


def available() -> bool:
    """Whether the native passes serve the checkpoint pipeline here: the kernel policy
    (:func:`lowprec.kernels.set_policy`: ``"xla"`` turns them off, for the NumPy code), the
    library built, and its check passed (once per process)."""
    return _policy_allows() and _library()[0] is not None


def _policy_allows() -> bool:
    # The policy lives in _dispatch, which imports JAX; where it is not imported yet, no
    # set_policy ran in this process, so the policy is the environment's. An empty or "auto"
    # value allows the passes; anything else is left to _dispatch (which refuses a bad one).
    dispatch = sys.modules.get("lowprec.kernels._dispatch")
    if dispatch is None and os.environ.get(_ENV_VAR, "") in ("", "auto"):
        return True
    from ._dispatch import kernels_enabled  # noqa: PLC0415 - imports JAX

    return kernels_enabled()


def has_avx2() -> bool:
    """Whether this CPU runs the library's AVX2 loops (the MX quantization kernel's among
    them: :func:`quantize` serves only where it does, as ``quantize_mx`` takes that kernel
    only there)."""
    lib = _library()[0]
    return lib is not None and bool(lib.lowprec_cpu_has_avx2())


def status() -> str:
    """Why :func:`available` is what it is (the policy aside), in a few words."""
    return _library()[1]


def _ptr(a) -> Optional[int]:
    return None if a is None else a.ctypes.data


def _kind(a: np.ndarray, what: str) -> int:
    try:
        return KINDS[a.dtype]
    except KeyError:
        raise TypeError(f"{what}: dtype {a.dtype} is not one the native passes read") from None


def _codes_args(codes, code_bits, elut, factors, block):
    if factors is not None:
        factors = np.ascontiguousarray(factors, np.float32)
    if codes is None:
        return None, 0, None, factors, block
    codes = np.ascontiguousarray(codes).view(np.uint8)
    elut = np.ascontiguousarray(elut, np.float32)
    if elut.size < 1 << code_bits:
        raise ValueError(f"the code table holds {elut.size} values, not {1 << code_bits}")
    return codes, code_bits, elut, factors, block


def stats(x: np.ndarray, q: Optional[np.ndarray] = None, *, codes=None, code_bits: int = 8,
          elut=None, factors=None, block: int = 0, clip: int = 0, max_finite: float = 0.0,
          cast_scale: float = 1.0, view=None, lib=None) -> np.ndarray:
    """float64[13] (:data:`STATS`) of a piece: its input ``x`` (float32, bfloat16 or float16)
    against its decoded values, ``q`` (same dtypes) or the packed ``codes`` (``code_bits`` 4,
    6 or 8 per element) decoded as ``elut[code] * factors[i // block]`` in float32.
    ``clip``: 1 counts the blocks of ``block`` elements along A of ``view`` = (P, A, S) whose
    largest magnitude exceeds factor x ``max_finite``; 2 the elements with
    ``|float32(x / cast_scale)| > max_finite``."""
    lib = lib or _library()[0]
    x = np.ascontiguousarray(x)
    n = x.size
    qk = 0
    if q is not None:
        q = np.ascontiguousarray(q)
        if q.size != n:
            raise ValueError(f"q holds {q.size} values for {n} inputs")
        qk = _kind(q, "q")
    codes, code_bits, elut, factors, block = _codes_args(codes, code_bits, elut, factors, block)
    if clip == 1 and factors is None:
        raise ValueError("counting clipped blocks needs each block's factor")
    P, A, S = view if view is not None else (1, n, 1)
    out = np.zeros(len(STATS), np.float64)
    status = lib.lowprec_ckpt_stats(
        _ptr(x), _kind(x, "x"), n, _ptr(q), qk, _ptr(codes), code_bits, _ptr(elut),
        _ptr(factors), block, clip, float(max_finite), float(cast_scale), P, A, S, _ptr(out))
    if status:
        raise ValueError("lowprec_ckpt_stats refused its arguments")
    return out


_CODE_BITS, _BLOCK = 4, 7  # places in the MX kernel's attributes (_mx_quantize_cpu.attributes)


def quantize(x: np.ndarray, attrs, *, elut=None, ftable=None, max_finite: float = 0.0,
             stats: bool = True, lib=None) -> tuple:
    """``(elements, scales, statistics or None)``: MX quantization of ``x`` (float32,
    bfloat16 or float16; blocks along its last axis, a whole number of them) by the MX
    quantization kernel's loops (``attrs``: :func:`lowprec.kernels._mx_quantize_cpu.attributes`),
    packed codes and E8M0 scale codes in ``x``'s shape with the last axis in bytes and in
    blocks; with ``stats``, float64[13] (:data:`STATS`) of the codes against ``x`` computed in
    the same pass, as :func:`stats` computes them for those codes (``elut``: the element
    format's value per code; ``ftable``: float32[256], each scale code's factor; clip = 1).
    ``attrs`` may also be their values in order as an int64 array."""
    lib = lib or _library()[0]
    x = np.ascontiguousarray(x)
    if isinstance(attrs, np.ndarray):  # the values in order, as int64
        ints = attrs
    else:
        ints = np.array([int(v) for _, v in attrs], np.int64)
    bits, block = int(ints[_CODE_BITS]), int(ints[_BLOCK])
    *lead, n = x.shape
    elements = np.empty((*lead, n * bits // 8), np.uint8)
    scales = np.empty((*lead, n // block), np.uint8)
    out = np.zeros(len(STATS), np.float64) if stats else None
    if stats:
        if elut.dtype != np.float32 or ftable.dtype != np.float32:
            elut, ftable = np.ascontiguousarray(elut, np.float32), np.ascontiguousarray(ftable, np.float32)
        if elut.size < 1 << bits or ftable.size != 256:
            raise ValueError("the element table or the factor table has the wrong size")
    if n % block or lib.lowprec_ckpt_quantize(
            _ptr(x), _kind(x, "x"), x.size, _ptr(ints), _ptr(elements), _ptr(scales),
            _ptr(elut) if stats else None, _ptr(ftable) if stats else None, float(max_finite),
            _ptr(out)):
        raise ValueError("lowprec_ckpt_quantize refused its arguments")
    return elements, scales, out


def quantize_nvfp4(x: np.ndarray, ts, *, elut=None, ftable=None, max_finite: float = 0.0,
                   stats: bool = True, lib=None) -> tuple:
    """:func:`quantize` for NVFP4 (lowprec's recipe, the "divide" step) under the float32
    tensor scale ``ts`` (in :data:`NVFP4_TENSOR_SCALES`): blocks of 16 along the last axis,
    packed E2M1 codes and E4M3 scale codes; ``ftable``: float32(ts x scale) per scale code."""
    lib = lib or _library()[0]
    x = np.ascontiguousarray(x)
    *lead, n = x.shape
    elements = np.empty((*lead, n // 2), np.uint8)
    scales = np.empty((*lead, n // 16), np.uint8)
    out = np.zeros(len(STATS), np.float64) if stats else None
    if stats and (elut.dtype != np.float32 or ftable.dtype != np.float32 or elut.size < 16
                  or ftable.size != 256):
        raise ValueError("the element table or the factor table has the wrong size or dtype")
    if n % 16 or lib.lowprec_ckpt_quantize_nvfp4(
            _ptr(x), _kind(x, "x"), x.size, float(np.float32(ts)), _ptr(elements),
            _ptr(scales), _ptr(elut) if stats else None, _ptr(ftable) if stats else None,
            float(max_finite), _ptr(out)):
        raise ValueError("lowprec_ckpt_quantize_nvfp4 refused its arguments")
    return elements, scales, out


def decode(out: np.ndarray, q: Optional[np.ndarray] = None, *, codes=None, code_bits: int = 8,
           elut=None, factors=None, block: int = 0, canonical_nan: bool = False,
           saturate: bool = False, scale_codes=None, lib=None) -> tuple[int, int, float]:
    """Writes decoded values into ``out`` (float32, bfloat16, float16 or float64; C order):
    ``q`` (float32) narrowed, or the packed ``codes`` decoded as :func:`stats` does (NaN made
    lowprec's canonical NaN if ``canonical_nan``). Returns (non-finite values written, finite
    values that overflowed ``out``'s dtype, the largest overflowing magnitude); overflowed
    values are clamped to the largest finite value only with ``saturate`` (else ``out`` is
    partly written and the caller refuses the tensor). With ``scale_codes`` (uint8, one per
    block), ``factors`` is a table of 256 (float32, a factor per scale code): block b's
    factor is ``factors[scale_codes[b]]``, looked up by the pass (``out`` a whole number of
    blocks, ``block`` x ``code_bits`` a whole number of bytes)."""
    lib = lib or _library()[0]
    if not out.flags.c_contiguous:
        raise ValueError("out must be C-contiguous")
    n = out.size
    if scale_codes is not None:
        scale_codes = np.ascontiguousarray(scale_codes).view(np.uint8).reshape(-1)
        codes, code_bits, elut, factors, block = _codes_args(codes, code_bits, elut, factors,
                                                             block)
        if (codes is None or factors is None or factors.size != 256 or block <= 0
                or scale_codes.size * block != n or codes.size * 8 != n * code_bits):
            raise ValueError("decoding by scale codes needs codes, a table of 256 factors and "
                             "a scale code per block of the output")
        counts = np.zeros(4, np.float64)
        status = lib.lowprec_ckpt_decode_scaled(
            _ptr(codes), code_bits, _ptr(elut), _ptr(factors), _ptr(scale_codes), block,
            int(canonical_nan), n, _kind(out, "out"), _ptr(out), int(saturate), _ptr(counts))
        if status == 1:
            raise ValueError("lowprec_ckpt_decode_scaled refused its arguments")
        return int(counts[0]), int(counts[1]), float(counts[2])
    if q is not None:
        q = np.ascontiguousarray(q, np.float32)
        if q.size != n:
            raise ValueError(f"q holds {q.size} values for {n} outputs")
    codes, code_bits, elut, factors, block = _codes_args(codes, code_bits, elut, factors, block)
    counts = np.zeros(4, np.float64)
    status = lib.lowprec_ckpt_decode(
        _ptr(q), _ptr(codes), code_bits, _ptr(elut), _ptr(factors), block, int(canonical_nan),
        n, _kind(out, "out"), _ptr(out), int(saturate), _ptr(counts))
    if status == 1:
        raise ValueError("lowprec_ckpt_decode refused its arguments")
    return int(counts[0]), int(counts[1]), float(counts[2])


def amax(x: np.ndarray, rows: int = 1, lib=None) -> np.ndarray:
    """float32[rows]: the largest finite magnitude of each of ``rows`` equal rows of ``x``
    (float64 rounded to float32 first), 0 where a row has none."""
    lib = lib or _library()[0]
    x = np.ascontiguousarray(x)
    out = np.zeros(rows, np.float32)
    if lib.lowprec_ckpt_amax(_ptr(x), _kind(x, "x"), x.size, rows, _ptr(out)):
        raise ValueError("lowprec_ckpt_amax refused its arguments")
    return out


def _self_check(lib) -> str:
    """'' if the passes give the results derived here, else the problem."""
    # Statistics: x = (1, 2, -3, 0.5, inf, nan) against q = (1, 2.5, -3, 0, max, nan).
    # Finite pairs: 4 (count), sum x^2 = 1 + 4 + 9 + 0.25 = 14.25, errors (0, -0.5, 0, 0.5)
    # so sum e^2 = 0.5, max |e| = 0.5, max |e|/|x| = 0.5 / 0.5 = 1; inf -> max is saturated,
    # NaN stays NaN (not changed); two non-finite, one NaN in, one inf in.
    x = np.array([1, 2, -3, 0.5, np.inf, np.nan], np.float32)
    q = np.array([1, 2.5, -3, 0, 448, np.nan], np.float32)
    want = [4, 14.25, 0.5, 0.5, 1, 2, 1, 1, 1, 0, 1, 0, 0]
    # Decoding: FP4 bytes 0x21 (low nibble first: codes 1, 2 = 0.5, 1.0) and 0xF7 (codes 7,
    # 15 = 6.0, -6.0) times a factor 4, to bfloat16: 2, 4, 24, -24 (0x4000, 0x4080, 0x41C0,
    # 0xC1C0).
    e2m1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float32)
    out = np.zeros(4, ml_dtypes.bfloat16)
    try:
        got = stats(x, q, lib=lib)
        counts = decode(out, codes=np.array([0x21, 0xF7], np.uint8), code_bits=4, elut=e2m1,
                        factors=np.array([4], np.float32), block=4, lib=lib)
        # The same codes in two blocks of 2, by scale codes 129 and 127 of a table holding
        # 4 and 1 there (as E8M0's 2^(c - 127)): 2, 4, 6, -6 (0x4000, 0x4080, 0x40C0, 0xC0C0).
        scaled = np.zeros(4, ml_dtypes.bfloat16)
        ftable = np.zeros(256, np.float32)
        ftable[127], ftable[129] = 1, 4
        counts_scaled = decode(scaled, codes=np.array([0x21, 0xF7], np.uint8), code_bits=4,
                               elut=e2m1, factors=ftable, block=2,
                               scale_codes=np.array([129, 127], np.uint8), lib=lib)
        top = amax(np.array([[-3, np.inf], [np.nan, 0.25]], ml_dtypes.bfloat16), rows=2, lib=lib)
        fused = _check_quantize(lib)
    except (ValueError, TypeError, ctypes.ArgumentError) as error:
        return f"{type(error).__name__}: {error}"
    if got.tolist() != want:
        return f"statistics {got.tolist()} differ from the derived {want}"
    if out.view(np.uint16).tolist() != [0x4000, 0x4080, 0x41C0, 0xC1C0] or counts != (0, 0, 0.0):
        return "decoded FP4 values differ from the derived ones"
    if scaled.view(np.uint16).tolist() != [0x4000, 0x4080, 0x40C0, 0xC0C0] or counts_scaled != (0, 0, 0.0):
        return "FP4 values decoded by scale codes differ from the derived ones"
    if top.tolist() != [3.0, 0.25]:
        return "largest finite magnitudes differ from the derived ones"
    return fused


def _check_quantize(lib) -> str:
    """'' if :func:`quantize` gives a known MXFP8 block as derived here, else the problem.
    E4M3 under the floor rule, bfloat16 input: 30 ones, a 1.5 and a -0. amax 1.5 has
    floor(log2) 0, so the shared exponent is 0 - 8 (E4M3's largest binade), scale code
    127 - 8 = 119; 1 x 2^8 is E4M3's exponent field 8 + 7 = 15, code 0x78; 1.5 x 2^8 adds
    the top mantissa bit, 0x7C; -0 keeps its sign, 0x80. Decoded, every element is exact:
    sum x^2 = 30 + 2.25 = 32.25, no error, no clipped block (1.5 <= 448 x 2^-8)."""
    from ._mx_quantize_cpu import attributes  # noqa: PLC0415 - imports JAX

    x = np.ones(32, ml_dtypes.bfloat16)
    x[3], x[-1] = 1.5, -0.0
    e4m3 = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    with np.errstate(over="ignore"):  # code 255 (2^128) is the NaN code, set below
        ftable = np.ldexp(1.0, np.arange(256) - 127).astype(np.float32)
    ftable[255] = np.nan
    elements, scales, got = quantize(x, attributes("mxfp8_e4m3", "floor"), elut=e4m3,
                                     ftable=ftable, max_finite=448.0, lib=lib)
    want = np.full(32, 0x78, np.uint8)
    want[3], want[-1] = 0x7C, 0x80
    if not (np.array_equal(elements, want) and scales.tolist() == [119]):
        return "MXFP8 codes of a known block differ from the derived ones"
    if got.tolist() != [32, 32.25, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1]:
        return f"the fused statistics {got.tolist()} differ from the derived ones"
    return ""
