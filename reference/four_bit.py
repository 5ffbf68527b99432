"""Reference statements of the 2026 four-bit block formats that choose per block.

Each function restates its authors' recipe as they compute it, one IEEE binary32 operation
at a time (NumPy float32 scalars and arrays, subnormals kept), over blocks of consecutive
elements along the last axis. Codes are returned unpacked (one E2M1 nibble per byte) with
the per-block scale bytes and the tensor's float32 scalar.

* Four over Six (Cook et al., arXiv 2512.02010), as TransformerEngine's ``nvfp4_4over6``
  recipe (``NVFP4QuantizerRef._quantize_blockwise_4over6_reference``): both the map-to-6
  scale e4m3(base) and the map-to-4 scale e4m3(1.5 base), base = (block_amax / 6) ·
  (6E / amax), E = 256 by default; each block keeps the candidate with the smaller error
  (ties keep 6). The E2M1 rounding is TransformerEngine's threshold table (``cast_to_fp4x2``:
  ties to even, and an exact -0.0 to code 0).

Example:
    >>> import numpy as np
    >>> x = np.array([[4.6] + [0.1] * 15], np.float32)
    >>> codes, scales, amax = quantize_4over6(x)
    >>> int(scales[0, 0]), float(dequantize_4over6(codes, scales, amax)[0, 0])
    (112, 4.5)
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np

from .element import _fmt, decode, encode, max_finite
from .mx import dequantize_mx, mx_block_size, mx_element_format, quantize_mx

__all__ = [
    "dequantize_4over6",
    "dequantize_if4",
    "dequantize_mixfp4",
    "mixfp4_global_scale",
    "quantize_4over6",
    "quantize_if4",
    "quantize_mixfp4",
    "quantize_mx_plus",
    "dequantize_mx_plus",
]

_F32 = np.float32
_FLT_MAX = np.finfo(np.float32).max

# TransformerEngine's cast_to_fp4x2: magnitude intervals of each E2M1 code, closed where the
# tie goes to that code (the even one). Upper bounds of codes 0..6; above 5.0 is code 7.
_E2M1_UPPER = ((0.25, True), (0.75, False), (1.25, True), (1.75, False), (2.5, True),
               (3.5, False), (5.0, True))
_E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)


def _e2m1_te(q: np.ndarray) -> np.ndarray:
    """E2M1 codes of float32 ``q`` (already clamped to ±6) by TransformerEngine's table: a
    magnitude belongs to the first code whose upper bound it does not pass (ties at closed
    bounds stay, at open ones go up); the sign bit is set for q < 0 (so -0.0 gives +0)."""
    mag = np.abs(q)
    code = np.zeros(q.shape, np.uint8)
    for upper, closed in _E2M1_UPPER:
        code += (mag > upper) if closed else (mag >= upper)
    return np.where(q < 0, code | 8, code).astype(np.uint8)


def _e2m1_value(codes: np.ndarray) -> np.ndarray:
    v = _E2M1_VALUES[codes & 7]
    return np.where(codes & 8, -v, v).astype(np.float32)


def _e4m3_of(v: np.ndarray) -> np.ndarray:
    """E4M3 codes of non-negative float32 values after ``clamp(v, max=448)`` (nearest even,
    the reference's exact encoder)."""
    return encode("e4m3", np.minimum(v.astype(np.float32), _F32(448.0)), "nearest_even",
                  "saturate").astype(np.uint8)


def _blocks(x, block_size: int):
    x = np.asarray(x, np.float32)
    if x.ndim != 2 or x.shape[1] % block_size:
        raise ValueError(f"expected [rows, n] with n a multiple of {block_size}, got {x.shape}")
    return x.reshape(x.shape[0], -1, block_size)


def _amax(x) -> np.float32:
    """The largest finite magnitude (0 for none)."""
    a = np.abs(np.asarray(x, np.float32))
    a = a[np.isfinite(a)]
    return _F32(a.max()) if a.size else _F32(0)


def _sequential_error(approx, x, metric: str):
    """Σ over the last axis, left to right, of |approx - x| (MAE) or (approx - x)² (MSE), every
    step a float32 operation."""
    total = np.zeros(approx.shape[:-1], np.float32)
    for i in range(approx.shape[-1]):
        d = (approx[..., i] - x[..., i]).astype(np.float32)
        term = np.abs(d) if metric == "mae" else (d * d).astype(np.float32)
        total = (total + term).astype(np.float32)
    return total


def quantize_4over6(x, *, error: str = "mae", error_domain: str = "input",
                    e4m3_max: int = 256, block_size: int = 16, amax=None):
    """Four over Six, TransformerEngine's recipe, of a float32 ``[rows, n]`` array.

    Per tensor (``amax``: the largest finite magnitude, or the caller's): global_encode =
    min((6E) / amax, FLT_MAX) (1 if that is 0), global_decode = 1 / global_encode. Per block
    of ``block_size``: base = (block_amax / 6) · global_encode; candidates s6 = e4m3(min(base,
    448)) and s4 = e4m3(min(base · 1.5, 448)); for each, enc = min(1 / (s · global_decode),
    FLT_MAX), codes = E2M1(clamp(x · enc, -6, 6)) and the error Σ|approx - target| (MAE) or
    its squares (MSE) left to right, with approx = ((q · s) · amax) / (6E) and target = x
    (``error_domain="input"``), or approx = q · s and target = x · global_encode (``"fp16"``,
    TE's fast-math path; q · s is exact in FP16). s4 is kept iff its error is smaller. A
    block holding NaN or inf gets scale 0x7F and zero codes.

    Returns:
      ``(codes, scales, amax)``: uint8 E2M1 codes [rows, n], uint8 E4M3 scale codes
      [rows, n / block_size], float32 amax.
    """
    blocks = _blocks(x, block_size)
    amax = _amax(x) if amax is None else _F32(amax)
    six, denom = _F32(6.0), _F32(6.0 * e4m3_max)
    with np.errstate(all="ignore"):
        encode_g = min(denom / amax, _FLT_MAX)
        encode_g = _F32(1.0) if encode_g == 0 else _F32(encode_g)
        decode_g = _F32(1.0) / encode_g
        special = ~np.all(np.isfinite(blocks), axis=-1)
        xb = np.where(special[..., None], _F32(0), blocks).astype(np.float32)
        vec_max = np.max(np.abs(xb), axis=-1)
        base = ((vec_max / six).astype(np.float32) * encode_g).astype(np.float32)
        results = []
        for scale in (base, (base * _F32(1.5)).astype(np.float32)):
            codes_s = _e4m3_of(scale)
            s = decode("e4m3", codes_s).astype(np.float32)
            enc = np.minimum((_F32(1.0) / (s * decode_g).astype(np.float32)), _FLT_MAX)
            enc = enc.astype(np.float32)
            q = np.clip((xb * enc[..., None]).astype(np.float32), -six, six)
            codes = _e2m1_te(q)
            qv = _e2m1_value(codes)
            if error_domain == "fp16":
                approx = (qv * s[..., None]).astype(np.float32)
                target = (xb * encode_g).astype(np.float32)
            else:
                approx = (((qv * s[..., None]).astype(np.float32) * amax).astype(np.float32)
                          / denom).astype(np.float32)
                target = xb
            results.append((codes_s, codes, _sequential_error(approx, target, error)))
    (s6, c6, e6), (s4, c4, e4) = results
    pick4 = e4 < e6
    scales = np.where(special, np.uint8(0x7F), np.where(pick4, s4, s6)).astype(np.uint8)
    codes = np.where(pick4[..., None], c4, c6)
    codes = np.where(special[..., None], np.uint8(0), codes).astype(np.uint8)
    return codes.reshape(x.shape), scales, amax


def dequantize_4over6(codes, scales, amax, *, e4m3_max: int = 256, block_size: int = 16):
    """Values of Four over Six codes as TransformerEngine's ``dequantize_fp4_kernel``
    computes them: q · ((s · amax) · float32(1 / (6E))), float32; a NaN scale gives NaN."""
    codes = np.asarray(codes, np.uint8)
    q = _e2m1_value(codes).reshape(codes.shape[0], -1, block_size)
    s = decode("e4m3", np.asarray(scales, np.uint8)).astype(np.float32)
    inverse = _F32(1.0) / _F32(6.0 * e4m3_max)
    with np.errstate(all="ignore"):
        factor = ((s * _F32(amax)).astype(np.float32) * inverse).astype(np.float32)
        out = (q * factor[..., None]).astype(np.float32)
    return out.reshape(codes.shape)


# -- IF4 --------------------------------------------------------------------------------------


def _e2m1_round(q: np.ndarray) -> np.ndarray:
    """The IF4 authors' ``fake_quantize_to_e2m1`` (nearest mode): sign(q) times
    round(2|q|)/2 below 2, round(|q|) below 4, 2·round(|q|/2) above (``np.round`` ties to
    even, as ``torch.round``), float32; sign(±0) is 0 (an exact -0.0 gives +0). |q| is
    clamped to 6 first: the authors' step gives 8 for |q| >= 7 (a block whose E4M3 scale is
    subnormal and rounded down), which has no E2M1 code (their packer then overflows the
    nibble); lowprec saturates there, like every other E2M1 encoder (docs/design.md §3c)."""
    a = np.minimum(np.abs(q), _F32(6.0)).astype(np.float32)
    step1 = (np.round((2 * a).astype(np.float32)) / 2).astype(np.float32)
    step2 = np.round(a)
    step3 = (2 * np.round((a / 2).astype(np.float32))).astype(np.float32)
    mag = np.where(a < 2, step1, np.where(a < 4, step2, step3)).astype(np.float32)
    return (np.sign(q) * mag).astype(np.float32)


def _e2m1_code_of_value(v: np.ndarray) -> np.ndarray:
    """E2M1 codes of exact E2M1 values (the sign bit from the float's sign, -0 included)."""
    idx = np.searchsorted(_E2M1_VALUES, np.abs(v))
    return np.where(np.signbit(v), idx | 8, idx).astype(np.uint8)


_SEVEN_SIXTHS = _F32(1.16666666)  # the authors' literals; float32(7/6)
_SIX_SEVENTHS = _F32(0.8571428571)  # float32(6/7)


def quantize_if4(x, *, error: str = "mse", block_size: int = 16, amax=None):
    """IF4 of a float32 ``[rows, n]`` array, by the authors' reference quantizer.

    encode = min(2688 / amax, FLT_MAX) (the authors' quotient, bounded: theirs overflows to
    inf below amax ~ 7.9e-36); s = e4m3((block_amax / 6) · encode) (all zero when amax = 0);
    q = x · (1 / ((1 / encode) · s)), 0 where s = 0; FP candidate f = E2M1-round(q) with
    approximation ((f · s) · amax) / 2688; INT candidate k = round(clamp(q · float32(7/6), -7,
    7)) with approximation (((k · s) · amax) · float32(6/7)) / 2688; the squared errors summed
    left to right; INT4 iff its error is smaller; scale code + 128 for INT4. FP codes are the
    E2M1 codes of f (-0 for a negative q rounding to 0), INT codes the two's-complement
    nibbles of k. A block holding NaN or inf gets 0x7F and zero codes.

    Returns ``(codes, scales, amax)`` as :func:`quantize_4over6`.
    """
    blocks = _blocks(x, block_size)
    amax = _amax(x) if amax is None else _F32(amax)
    d = _F32(2688.0)
    with np.errstate(all="ignore"):
        special = ~np.all(np.isfinite(blocks), axis=-1)
        xb = np.where(special[..., None], _F32(0), blocks).astype(np.float32)
        if amax == 0:
            s_codes = np.zeros(xb.shape[:-1], np.uint8)
        else:
            encode = _F32(min(d / amax, _FLT_MAX))  # the authors' is inf below ~7.9e-36
            hp = ((np.max(np.abs(xb), axis=-1) / _F32(6.0)).astype(np.float32) * encode)
            s_codes = _e4m3_of(hp.astype(np.float32))
            decode_scale = _F32(_F32(1.0) / encode)
        s = decode("e4m3", s_codes).astype(np.float32)[..., None]
        if amax == 0:
            q = np.zeros_like(xb)
        else:
            inv = (_F32(1.0) / (decode_scale * s).astype(np.float32)).astype(np.float32)
            q = np.where(s != 0, (xb * inv).astype(np.float32), _F32(0)).astype(np.float32)
        f = _e2m1_round(q)
        k = np.round(np.clip((q * _SEVEN_SIXTHS).astype(np.float32), -7, 7)).astype(np.float32)
        fp_approx = ((((f * s).astype(np.float32) * amax).astype(np.float32)) / d)
        int_approx = (((((k * s).astype(np.float32) * amax).astype(np.float32))
                       * _SIX_SEVENTHS).astype(np.float32) / d)
        e_fp = _sequential_error(fp_approx.astype(np.float32), xb, error)
        e_int = _sequential_error(int_approx.astype(np.float32), xb, error)
    pick_int = e_int < e_fp
    int_codes = (k.astype(np.int32) & 0xF).astype(np.uint8)
    codes = np.where(pick_int[..., None], int_codes, _e2m1_code_of_value(f))
    scales = np.where(pick_int, s_codes + 128, s_codes)
    scales = np.where(special, 0x7F, scales).astype(np.uint8)
    codes = np.where(special[..., None], 0, codes).astype(np.uint8)
    return codes.reshape(np.shape(x)), scales, amax


def dequantize_if4(codes, scales, amax, *, block_size: int = 16):
    """Values of IF4 codes as the authors' reference computes its candidates: ((f · s) ·
    amax) / 2688 in an E2M1 block, (((k · s) · amax) · float32(6/7)) / 2688 in an INT4 block
    (k the nibble as two's complement); NaN for a NaN scale (0x7F / 0xFF)."""
    codes = np.asarray(codes, np.uint8)
    c = codes.reshape(codes.shape[0], -1, block_size)
    scales = np.asarray(scales, np.uint8)
    s = decode("e4m3", scales & 0x7F).astype(np.float32)[..., None]
    is_int = (scales >= 128)[..., None]
    k = np.where(c >= 8, c.astype(np.int32) - 16, c).astype(np.float32)
    d, amax = _F32(2688.0), _F32(amax)
    with np.errstate(all="ignore"):
        fp = (((_e2m1_value(c) * s).astype(np.float32) * amax).astype(np.float32) / d)
        integer = (((((k * s).astype(np.float32) * amax).astype(np.float32)) * _SIX_SEVENTHS)
                   .astype(np.float32) / d)
    return np.where(is_int, integer, fp).astype(np.float32).reshape(codes.shape)


# -- MixFP4 -----------------------------------------------------------------------------------

_TINY = _F32(np.finfo(np.float32).tiny)


def mixfp4_global_scale(x) -> np.float32:
    """compressed-tensors' ``generate_gparam`` for NVFP4: 2688 / max(amax, tiny) in float32,
    1.0 where that is not finite."""
    with np.errstate(all="ignore"):
        gs = _F32(_F32(2688.0) / max(_amax(x), _TINY))
    return gs if np.isfinite(gs) else _F32(1.0)


def _argmin_e2m1(q: np.ndarray) -> np.ndarray:
    """sign(q) times the grid value nearest |q| clamped to 6, the first of two equal
    distances (the smaller magnitude) — ``argmin`` over the E2M1 grid — float32."""
    mag = np.minimum(np.abs(q), _F32(6.0)).astype(np.float32)
    dist = np.abs(mag[..., None] - _E2M1_VALUES)
    return (np.sign(q) * _E2M1_VALUES[np.argmin(dist, axis=-1)]).astype(np.float32)


def quantize_mixfp4(x, *, block_size: int = 16, global_scale=None):
    """MixFP4 of a float32 ``[rows, n]`` array: llm-compressor's ``MixFP4Observer`` chooses
    each block's scale and grid, compressed-tensors' ``pack_mixfp4_to_uint8`` writes the
    nibbles.

    Observer: m_fp = e4m3(clamp((gs · block_amax) / 6, 0, 448)), m_int likewise over 7;
    eff = max(m / gs, tiny); E2M1 error Σ ((argmin-E2M1(x / eff_fp)) · eff_fp - x)², INT4 error
    Σ (round(x / eff_int) clamped to ±7 · eff_int - x)², left to right; INT4 iff smaller; the
    flag (bit 7) only on a nonzero magnitude. Packer: eff = m / gs; nibbles of x / eff (E2M1:
    sign bit from the rounded value, -0 included; INT4: sign-magnitude, -0 is 0), 0 where
    eff = 0. A block holding NaN or inf gets 0x7F and zero codes.

    Returns ``(codes, scales, global_scale)``.
    """
    blocks = _blocks(x, block_size)
    gs = mixfp4_global_scale(x) if global_scale is None else _F32(global_scale)
    with np.errstate(all="ignore"):
        special = ~np.all(np.isfinite(blocks), axis=-1)
        xb = np.where(special[..., None], _F32(0), blocks).astype(np.float32)
        scaled_amax = (gs * np.max(np.abs(xb), axis=-1)).astype(np.float32)
        m_fp = _e4m3_of((scaled_amax / _F32(6.0)).astype(np.float32))
        m_int = _e4m3_of((scaled_amax / _F32(7.0)).astype(np.float32))
        eff_fp = np.maximum((decode("e4m3", m_fp).astype(np.float32) / gs), _TINY)
        eff_int = np.maximum((decode("e4m3", m_int).astype(np.float32) / gs), _TINY)
        eff_fp, eff_int = eff_fp.astype(np.float32)[..., None], eff_int.astype(np.float32)[..., None]
        fp_approx = (_argmin_e2m1((xb / eff_fp).astype(np.float32)) * eff_fp).astype(np.float32)
        k_int = np.clip(np.round((xb / eff_int).astype(np.float32)), -7, 7).astype(np.float32)
        int_approx = (k_int * eff_int).astype(np.float32)
        pick_int = _sequential_error(int_approx, xb, "mse") < _sequential_error(fp_approx, xb, "mse")
        mags = np.where(pick_int, m_int, m_fp).astype(np.uint8)
        flag = pick_int & ((mags & 0x7F) != 0)
        eff = (decode("e4m3", mags).astype(np.float32) / gs).astype(np.float32)[..., None]
        zero = eff == 0
        q = (xb / np.where(zero, _F32(1.0), eff)).astype(np.float32)
        fp_codes = _e2m1_code_of_value(_argmin_e2m1(q))
        k = np.clip(np.round(q), -7, 7)
        int_codes = np.where(k < 0, 8, 0) | np.abs(k).astype(np.uint8)
    codes = np.where(pick_int[..., None], int_codes, fp_codes)
    codes = np.where(zero | special[..., None], 0, codes).astype(np.uint8)
    scales = np.where(special, 0x7F, np.where(flag, mags | 0x80, mags)).astype(np.uint8)
    return codes.reshape(np.shape(x)), scales, gs


def dequantize_mixfp4(codes, scales, global_scale, *, block_size: int = 16):
    """Values of MixFP4 codes, compressed-tensors' ``unpack_mixfp4_from_uint8`` in float32:
    the nibble's E2M1 value, or its sign-magnitude integer in a flagged block, times
    float32((s & 0x7F) / gs); NaN for a NaN scale."""
    codes = np.asarray(codes, np.uint8)
    c = codes.reshape(codes.shape[0], -1, block_size)
    scales = np.asarray(scales, np.uint8)
    with np.errstate(all="ignore"):
        eff = (decode("e4m3", scales & 0x7F).astype(np.float32) / _F32(global_scale))
        eff = eff.astype(np.float32)[..., None]
        mag = (c & 7).astype(np.float32)
        integer = np.where(c >= 8, -mag, mag).astype(np.float32)
        v = np.where((scales >= 128)[..., None], integer, _e2m1_value(c))
        out = (v * eff).astype(np.float32)
    return out.reshape(codes.shape)


# -- MX+ --------------------------------------------------------------------------------------

NO_BM = 0xFF


def quantize_mx_plus(x, fmt: str):
    """MX+ of a float32 ``[rows, n]`` array over the MX format ``fmt`` (``"mxfp4"``, ...,
    blocks along the last axis).

    Each block: shared_exp by the floor rule (:func:`lowprec_reference.shared_exponent`);
    every element's ordinary code (:func:`lowprec_reference.quantize_mx`); then, if the block
    is finite and amax / 2^shared_exp ≥ 2^emax_elem (not all zero, exponent not clamped), the
    first element of magnitude amax gets code sign · 2^(E+M) + m with m the integer nearest
    (amax / 2^(shared_exp + emax_elem) - 1) · 2^(E+M) (ties to even), at most 2^(E+M) - 1;
    bm_index its position, else 0xFF.

    Returns ``(codes, scales, bm_index)``: unpacked uint8 codes, uint8 scales and indices.
    """
    x = np.asarray(x, np.float32)
    codes, scales = quantize_mx(x, fmt, scale_rule="floor")
    elem = mx_element_format(fmt)
    f = _fmt(elem)
    width = f.exponent_bits + f.mantissa_bits
    emax = math.frexp(float(max_finite(elem)))[1] - 1
    block = mx_block_size(fmt)
    codes = codes.copy()
    bm_index = np.full(scales.shape, NO_BM, np.uint8)
    for r in range(x.shape[0]):
        for b in range(x.shape[1] // block):
            v = x[r, b * block:(b + 1) * block]
            if scales[r, b] == 0xFF or not np.any(v):
                continue
            i = int(np.argmax(np.abs(v)))  # the first largest magnitude
            shared = int(scales[r, b]) - 127
            t = Fraction(float(abs(v[i]))) / Fraction(2) ** (shared + emax)
            if t < 1:
                continue  # the shared exponent was clamped: no BM in the top binade
            scaled = (t - 1) * 2**width
            m = math.floor(scaled)
            frac = scaled - m
            if frac > Fraction(1, 2) or (frac == Fraction(1, 2) and m % 2 == 1):
                m += 1
            m = min(m, 2**width - 1)
            codes[r, b * block + i] = (int(np.signbit(v[i])) << width) | m
            bm_index[r, b] = i
    return codes, scales, bm_index


def dequantize_mx_plus(codes, scales, bm_index, fmt: str) -> np.ndarray:
    """Values of MX+ codes: the MX decode (:func:`lowprec_reference.dequantize_mx`) with
    each block maximum's code read as ±(1 + m / 2^(E+M)) · 2^(emax + shared_exp)."""
    codes, scales = np.asarray(codes, np.uint8), np.asarray(scales, np.uint8)
    out = np.asarray(dequantize_mx(codes, scales, fmt), np.float64).copy()
    elem = mx_element_format(fmt)
    f = _fmt(elem)
    width = f.exponent_bits + f.mantissa_bits
    emax = math.frexp(float(max_finite(elem)))[1] - 1
    block = mx_block_size(fmt)
    for r, b in zip(*np.nonzero(np.asarray(bm_index) != NO_BM)):
        i = int(bm_index[r, b])
        c = int(codes[r, b * block + i])
        m, negative = c & (2**width - 1), c >> width
        value = (1 + Fraction(m, 2**width)) * Fraction(2) ** (emax + int(scales[r, b]) - 127)
        out[r, b * block + i] = -float(value) if negative else float(value)
    return out
