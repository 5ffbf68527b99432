"""Bit-exact element codecs: float → code (``encode``), code → float (``decode``), and both.

Everything is integer arithmetic on the input's bit pattern (``lax.bitcast_convert_type``),
so results never depend on how a backend treats subnormal floats (XLA on CPU flushes them),
and XLA cannot fold an encode/decode pair away under ``jit`` on GPU (openxla/xla#41605).
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import lowprec_formats as _data

from ._bits import (
    F32_ABS,
    F32_BIAS,
    F32_IMPLICIT,
    F32_INF,
    F32_MANT,
    F32_MANT_BITS,
    F32_QNAN,
    F32_SIGN,
    bits_to_f32,
    clz,
    f32_bits,
)
from ._format import ElementFormat, ElementFormatLike, array_then_format, element_format
from ._options import ElementCast
from ._rounding import (
    WORDS_PER_HASH,
    as_word32,
    check_size,
    element_words,
    hash_words,
    key_words,
    round_shift,
    rounds_away_on_overflow,
)

# (mantissa bits, exponent bias) of the float layouts encoded bit-wise, by the unsigned
# dtype holding their patterns: binary32 and binary64.
_FLOAT_LAYOUTS = {
    np.dtype(np.uint32): (23, 127),
    np.dtype(np.uint64): (52, 1023),
}


def _widened_formats() -> dict:
    """Every float dtype lowprec reads or writes through an element format of the same layout:
    float16, bfloat16 and each ml_dtypes type named in ``formats/elements.json`` that JAX
    arrays can hold (float6 cannot be a JAX array: NumPy float6 input is decoded on the host)."""
    out = {}
    for name in _data.ELEMENT_FORMATS:
        fmt = element_format(name)
        dt = fmt.storage_dtype
        if dt is None or dt in (np.dtype(np.float32), np.dtype(np.float64)):
            continue
        if fmt.code_bits in (4, 8, 16):
            out[dt] = name
    return out


# Narrow float inputs are widened to float32 patterns by decoding them as the element format
# with their layout: integer arithmetic only, so NaN sign and subnormals survive on every
# backend (XLA on GPU turns any float16 NaN into 0x7fffffff when it converts). The same table
# narrows float32 patterns to those dtypes (``dtype=`` of decode/quantize/dequantize).
_WIDENED_AS = _widened_formats()
# Dtypes with an element format that JAX cannot hold (ml_dtypes' 6-bit floats).
_HOST_ONLY = {
    element_format(n).storage_dtype: n
    for n in _data.ELEMENT_FORMATS
    if element_format(n).storage_dtype is not None and element_format(n).code_bits == 6
}
_ACCEPTED = "float16, bfloat16, float32, float64 or an ml_dtypes float (float8_*, float4_e2m1fn)"


def _code_uint(bits: int):
    return {4: jnp.uint4, 8: jnp.uint8, 16: jnp.uint16}[bits]


def codes_of_dtype_array(x):
    """(codes as uint8/uint16, element format) of a narrow float array, by bitcast."""
    fmt = element_format(_WIDENED_AS[np.dtype(x.dtype)])
    codes = lax.bitcast_convert_type(x, _code_uint(fmt.code_bits))
    if fmt.code_bits == 4:
        codes = codes.astype(jnp.uint8)
    return codes, fmt


def host_decode(x):
    """A NumPy array of a float dtype JAX cannot hold (float6) as exact float32 values; any
    other input is returned unchanged. Decoded with lowprec's integer decoder."""
    dt = getattr(x, "dtype", None)
    if isinstance(x, np.ndarray) and dt in _HOST_ONLY:
        fmt = element_format(_HOST_ONLY[dt])
        return bits_to_f32(decode_bits(fmt, jnp.asarray(x.view(np.uint8))))
    return x


def check_input_dtype(dtype, what: str = "x") -> np.dtype:
    """``dtype`` if lowprec encodes from it (float16/32/64, bfloat16, ml_dtypes floats); else
    TypeError."""
    dt = np.dtype(dtype)
    if dt in (np.dtype(np.float32), np.dtype(np.float64)) or dt in _WIDENED_AS:
        return dt
    if jnp.issubdtype(dt, jnp.floating):
        raise TypeError(
            f"{what} has dtype {dt}, which lowprec does not encode from; convert it with "
            f"{what}.astype(jnp.float32) ({_ACCEPTED} are accepted)"
        )
    raise TypeError(
        f"{what} must be a floating-point array ({_ACCEPTED}), got dtype {dt}; for "
        "codes use decode(), for numbers cast with .astype(jnp.float32)"
    )


def input_bits(x, what: str = "x"):
    """Bit patterns of a float input: uint32 (float32 layout) or uint64 (float64 layout).

    float16, bfloat16 and the ml_dtypes floats are widened exactly to float32 patterns with
    integer operations.
    """
    x = jnp.asarray(x)
    dt = check_input_dtype(x.dtype, what)
    if dt == np.dtype(np.float32):
        return lax.bitcast_convert_type(x, jnp.uint32)
    if dt == np.dtype(np.float64):
        return lax.bitcast_convert_type(x, jnp.uint64)
    codes, fmt = codes_of_dtype_array(x)
    return decode_bits(fmt, codes)


def check_float_dtype(dtype, what: str = "dtype") -> np.dtype:
    """``dtype`` as a NumPy dtype if it is a float dtype lowprec can produce; else TypeError."""
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"{what} must be a float dtype such as jnp.float32, got {dtype!r}") from None
    if dt in _HOST_ONLY:
        raise TypeError(
            f"{what}={dt} cannot be a JAX array (XLA has no 6-bit floats); ask for the codes "
            f"with encode(x, {_HOST_ONLY[dt]!r}) and view them with "
            f"np.asarray(codes).view(ml_dtypes.{dt.name})"
        )
    if dt not in (np.dtype(np.float32), np.dtype(np.float64)) and dt not in _WIDENED_AS:
        raise TypeError(
            f"{what} must be float32, float64, bfloat16 or float16 (or an ml_dtypes float: "
            f"float8_*, float4_e2m1fn), got {dt}; integer or other dtypes would silently "
            "truncate the values (for codes use encode())"
        )
    return dt


def bits_to_dtype(bits, dtype):
    """Float32 patterns ``bits`` as an array of ``dtype``, rounding to nearest even.

    Narrowing to float16/bfloat16 (and the ml_dtypes floats) goes through the element
    encoder, not a float convert, so NaN keeps its sign on every backend; widening to
    float64 is exact.
    """
    dtype = np.dtype(dtype)
    if dtype == np.dtype(np.float32):
        return bits_to_f32(bits)
    name = _WIDENED_AS.get(dtype)
    if name is not None:
        fmt = element_format(name)
        code = encode_bits(fmt, bits, "nearest_even", "ieee", None)
        return lax.bitcast_convert_type(code.astype(_code_uint(fmt.code_bits)), dtype)
    return _f32_bits_to_f64(bits)


def _f32_bits_to_f64(bits):
    """Exact float32 → float64 from the bits (needs ``jax_enable_x64``)."""
    b = bits.astype(jnp.uint64)
    sign = lax.shift_left(lax.shift_right_logical(b, jnp.uint64(31)), jnp.uint64(63))
    e = lax.shift_right_logical(b, jnp.uint64(23)) & 0xFF
    m = b & 0x7F_FFFF
    # Rebias 127 → 1023 (+896); the top exponent (inf/NaN) maps to 0x7FF with its payload.
    normal = lax.shift_left(e + 896, jnp.uint64(52)) | lax.shift_left(m, jnp.uint64(29))
    special = lax.shift_left(jnp.uint64(0x7FF), jnp.uint64(52)) | lax.shift_left(m, jnp.uint64(29))
    # A float32 subnormal m * 2^-149 is a float64 normal: convert the integer m (exact) and
    # lower its exponent field by 149.
    sub = lax.bitcast_convert_type(m.astype(jnp.float64), jnp.uint64)
    sub = jnp.where(m == 0, jnp.uint64(0), sub - lax.shift_left(jnp.uint64(149), jnp.uint64(52)))
    out = jnp.where(e == 0, sub, jnp.where(e == 0xFF, special, normal))
    return lax.bitcast_convert_type(out | sign, jnp.float64)


def encode_bits(
    fmt: ElementFormat, u, rounding: str, overflow: str, random_bits, scale_exp=None,
    assume_finite: bool = False,
):
    """Core encoder on float bit patterns (uint32: float32, uint64: float64); int32 codes.

    Options are canonical (validated by the caller). With ``scale_exp`` (an int32 array
    broadcastable to ``u``), encodes ``value * 2^-scale_exp`` exactly, by moving the
    exponent rather than multiplying (MX block scaling). ``assume_finite``: skip the
    NaN/Inf handling (the caller overwrites those results).
    """
    udt = u.dtype
    if scale_exp is None and np.dtype(udt) == np.uint32 and overflow == "ieee":
        if rounding in ("nearest_even", "stochastic") and _rebias_encodable(fmt):
            return _encode_rebias(fmt, u, random_bits if rounding == "stochastic" else None)
        if rounding.startswith("nearest") and _is_e8m0(fmt):
            return _encode_e8m0_nearest(u)
    in_mant, in_bias = _FLOAT_LAYOUTS[np.dtype(udt)]
    width = jnp.iinfo(udt).bits
    assert fmt.mantissa_bits < in_mant
    sign = lax.shift_right_logical(u, jnp.asarray(width - 1, udt))
    mag = u & jnp.asarray((1 << (width - 1)) - 1, udt)
    inf_bits = ((1 << (width - 1 - in_mant)) - 1) << in_mant
    is_nan = mag > inf_bits
    is_inf = mag == inf_bits
    in_emin = 1 - in_bias

    if (scale_exp is None and fmt.emin == in_emin and fmt.signed and fmt.zero and fmt.inf
            and fmt.nan == "ieee"):
        # Same exponent range as the input (bf16, tf32 from float32): the code is the top
        # bits of the magnitude. Rounding them carries into the exponent field by itself
        # (subnormals included) and, past the largest finite value, onto the infinity
        # pattern exactly when IEEE 754 §7.4 overflows to infinity for the mode (stochastic
        # rounding included: it overflows as the nearest modes do).
        shift = jnp.full_like(mag, in_mant - fmt.mantissa_bits, dtype=jnp.int32)
        code = round_shift(mag, shift, sign, rounding, random_bits)
        if overflow == "saturate":
            code = jnp.minimum(code, fmt.max_magnitude_code)  # ±inf → ±max too
        signed_bit = lax.shift_left(sign.astype(jnp.int32), jnp.int32(fmt.magnitude_bits))
        return jnp.where(is_nan, fmt.nan_code | signed_bit, code | signed_bit)

    efield = lax.shift_right_logical(mag, jnp.asarray(in_mant, udt)).astype(jnp.int32)
    mfield = mag & jnp.asarray((1 << in_mant) - 1, udt)
    sig = jnp.where(efield > 0, mfield | jnp.asarray(1 << in_mant, udt), mfield)
    # |x| = sig * 2^lsb_exp exactly; e_x = floor(log2 |x|) from the leading bit of sig.
    lsb_exp = jnp.maximum(efield, 1) - (in_bias + in_mant)
    if scale_exp is not None:
        lsb_exp = lsb_exp - scale_exp
    if scale_exp is None and fmt.emin >= in_emin:
        # Subnormal inputs lie below the format's lowest binade, so t = emin for them
        # whatever their exact binade: the exponent field suffices (no count-leading-zeros).
        e_x = jnp.maximum(efield, 1) - in_bias
    else:
        e_x = lsb_exp + (width - 1) - clz(sig)  # on the signed bitcast: Triton lowers it

    # The target quantum: 2^(t - M) with t the binade, or emin in the subnormal range.
    t = jnp.maximum(e_x, fmt.emin)
    shift = (t - fmt.mantissa_bits) - lsb_exp  # >= 1 since M < input mantissa bits
    mag_q = round_shift(sig, shift, sign, rounding, random_bits)
    # The code of a magnitude: (t - emin + field(emin)) << M plus the significand of the
    # rounded value, whose implicit bit (mag_q >= 2^M) adds one to the exponent field.
    code = lax.shift_left(
        t - fmt.emin + fmt.min_exponent_field - 1, jnp.int32(fmt.mantissa_bits)
    ) + mag_q
    if fmt.ties == "code" and fmt.mantissa_bits == 0 and rounding == "nearest_even":
        # P3109 precision 1: a tie between 2^e and 2^(e+1) goes to the even *code* (the
        # significand rule would always pick 2^(e+1)). Undo the round-up at ties of even codes.
        s = jnp.minimum(shift, width - 1).astype(udt)
        one = jnp.asarray(1, udt)
        tie = (sig & (lax.shift_left(one, s) - one)) == lax.shift_left(one, s - one)
        code = jnp.where(tie & ((code & 1) == 1) & (mag_q > 0), code - 1, code)

    if not fmt.zero and overflow == "ieee" and rounding.startswith("nearest"):
        # ml_dtypes quirk, reproduced under the default policy: in the lowest binade
        # (2^-127, 2^-126) every value rounds UP to 2^-126, not to the nearest power of two.
        above_min = (e_x == fmt.emin) & ((sig & (sig - 1)) != 0)
        code = jnp.where(above_min, 1, code)

    max_code = fmt.max_magnitude_code
    overflow_code = (
        fmt.inf_code if fmt.inf else fmt.nan_code if fmt.nan != "none" else max_code
    )
    if overflow == "saturate":
        to_inf = jnp.zeros_like(code, dtype=bool)
    else:
        to_inf = rounds_away_on_overflow(rounding, sign)
    code = jnp.where(code > max_code, jnp.where(to_inf, overflow_code, max_code), code)
    inf_result = overflow_code if overflow == "ieee" else max_code
    if assume_finite and fmt.signed:
        return _signed_code(fmt, code, sign)
    code = jnp.where(is_inf, inf_result, code)

    if fmt.signed:
        signed_bit = lax.shift_left(sign.astype(jnp.int32), jnp.int32(fmt.magnitude_bits))
        code = _signed_code(fmt, code, sign)
        if fmt.nan_code is not None:
            nan_result = fmt.nan_code | signed_bit
        else:
            # No NaN code (E2M1, FP6, INT8): ml_dtypes gives a zero of the opposite sign (+NaN
            # -> -0 = 0b1000, -NaN -> +0); match it bit for bit (INT8 has one zero: 0).
            nan_result = _signed_code(fmt, jnp.zeros_like(code), 1 - sign)
    else:
        # Unsigned: zero, if the format has none (E8M0), negative values and NaN have no code
        # but NaN; -0 is +0 where there is a zero (P3109 unsigned). Anything at or below the
        # smallest value rounds to it (code 0 = 2^-bias in E8M0).
        code = jnp.maximum(code, 0)
        nan_result = fmt.nan_code
        negative = (sign != 0) & (mag != 0) if fmt.zero else (sign != 0) | (mag == 0)
        is_nan = is_nan | negative
    code = jnp.where(is_nan, nan_result, code)
    return code


# -- fast paths for float32 input under "ieee" overflow (nearest and stochastic rounding) ---
# Same results as the general encoder above, bit for bit, in fewer operations: chosen from
# the format's fields; tests/test_fast_paths.py compares them with the general encoder for
# every format on samples, scripts/exhaustive_f32.py on every float32 input.


def _rebias_encodable(fmt: ElementFormat) -> bool:
    """Whether :func:`_encode_rebias` encodes ``fmt`` (static): a signed float format with
    zero and subnormals, a narrower exponent range than float32, every overflow going to
    one code just above the largest finite one (+inf for IEEE formats, the NaN code of
    all-ones formats), and a subnormal quantum whose float32 "magic" is normal."""
    over = fmt.inf_code if fmt.nan == "ieee" and fmt.inf else (
        fmt.nan_code if fmt.nan == "all_ones" else None)
    return (
        fmt.encoding == "sign_magnitude" and fmt.ties == "significand"
        and fmt.signed and fmt.zero and fmt.subnormals and over == fmt.max_magnitude_code + 1
        and fmt.emin > -126 and fmt.emax < 127 and fmt.mantissa_bits < 23
        and fmt.emin - fmt.mantissa_bits + 23 >= -126
    )


def _encode_rebias(fmt: ElementFormat, u, random_bits=None):
    """nearest_even (or, given ``random_bits``, stochastic) / "ieee" encode of float32
    patterns ``u`` (int32 codes) for the formats of :func:`_rebias_encodable`, e.g. fp16,
    e5m2, e4m3.

    Normal results: rebias the exponent field and round the mantissa by adding a bias below
    the cut (half − 1, plus the kept lsb), then shift; the carry moves into the exponent and,
    past the largest finite value, onto the overflow code, where ``min`` holds every larger
    magnitude (inf, and NaN for all-ones formats, included). Subnormal results (|x| < 2^emin):
    one float32 add of the "magic" 2^(emin − M + 23), whose ulp is the format's subnormal
    quantum, so the add rounds |x| to that quantum (to nearest even) and the difference of
    the bit patterns is the code (F. Giesen's float_to_half_fast3_rtne). Every operand of
    the add is a float32 normal except an |x| below 2^-126, which rounds to 0 whether or not
    the backend flushes it (the code is 0 either way).

    Stochastic: element i rounds away from zero iff r_i < frac_i · 2^32 (``round_shift``'s
    rule) ⇔ ⌊r_i / 2^(32 − s)⌋ < rem_i, s the bits dropped and rem_i their value, so adding
    (2^32 − 1 − r_i) >> (32 − s) below the cut carries exactly then. Normal results drop the
    fixed 23 − M bits; subnormal results s_i ≥ 23 − M bits of the significand with its
    implicit bit, the same addend up to s_i = 31, and past that the whole significand is
    below the cut (code 0 or 1: up iff r_i < ⌈sig_i / 2^(s_i − 32)⌉).
    """
    m_bits = fmt.mantissa_bits
    shift = F32_MANT_BITS - m_bits
    sign = u & jnp.uint32(F32_SIGN)
    mag = u & jnp.uint32(F32_ABS)
    over = fmt.inf_code if fmt.inf else fmt.nan_code
    # Normal path: (mag − (127 − bias) << 23 + half − 1 + lsb) >> shift, in uint32 (mag ≥
    # 2^emin here, so the rebiasing never goes below zero).
    is_sub = mag < jnp.uint32((fmt.emin + F32_BIAS) << F32_MANT_BITS)
    if random_bits is None:
        rebias = (((fmt.bias - F32_BIAS) << F32_MANT_BITS) + (1 << (shift - 1)) - 1) % (1 << 32)
        lsb = lax.shift_right_logical(mag, jnp.uint32(shift)) & 1
        normal = lax.shift_right_logical(mag + jnp.uint32(rebias) + lsb, jnp.uint32(shift))
        magic_bits = (fmt.emin - m_bits + F32_MANT_BITS + F32_BIAS) << F32_MANT_BITS
        magic = np.uint32(magic_bits).view(np.float32)
        sub = f32_bits(bits_to_f32(mag) + magic) - jnp.uint32(magic_bits)
    else:
        not_r = ~random_bits.astype(jnp.uint32)
        rebias = ((fmt.bias - F32_BIAS) << F32_MANT_BITS) % (1 << 32)
        add = lax.shift_right_logical(not_r, jnp.uint32(32 - shift))
        normal = lax.shift_right_logical(mag + jnp.uint32(rebias) + add, jnp.uint32(shift))
        efield = lax.shift_right_logical(mag, jnp.uint32(F32_MANT_BITS))
        sig = jnp.where(efield > 0, (mag & jnp.uint32(F32_MANT)) | jnp.uint32(F32_IMPLICIT),
                        mag)
        # Bits dropped: the quantum 2^(emin − M) over the input's last bit 2^(max(e, 1) − 150).
        s = (fmt.emin - m_bits + F32_BIAS + F32_MANT_BITS) - jnp.maximum(efield, 1).astype(jnp.int32)
        s_add = jnp.clip(s, 1, 31).astype(jnp.uint32)
        small = lax.shift_right_logical(
            sig + lax.shift_right_logical(not_r, jnp.uint32(32) - s_add), s_add)
        k = jnp.clip(s - 32, 0, 31).astype(jnp.uint32)
        thr = jnp.where(sig == 0, jnp.uint32(0),
                        lax.shift_right_logical(sig - 1, k) + 1)  # ⌈sig / 2^(s − 32)⌉
        tiny = (random_bits.astype(jnp.uint32) < thr).astype(jnp.uint32)
        sub = jnp.where(s <= 31, small, tiny)
    normal = jnp.minimum(normal, jnp.uint32(over))
    code = jnp.where(is_sub, sub, normal)
    if fmt.inf:  # NaN has its own code (inf is handled by the min above)
        code = jnp.where(mag > jnp.uint32(F32_INF), jnp.uint32(fmt.nan_code), code)
    code = code | lax.shift_right_logical(sign, jnp.uint32(31 - fmt.magnitude_bits))
    return code.astype(jnp.int32)


def _is_e8m0(fmt: ElementFormat) -> bool:
    """Whether ``fmt`` is E8M0: unsigned powers of two 2^(code − 127), 0xFF NaN (static)."""
    return (
        not fmt.signed and not fmt.zero and fmt.mantissa_bits == 0 and fmt.exponent_bits == 8
        and fmt.bias == F32_BIAS and fmt.nan == "all_ones" and fmt.nan_code == 0xFF
    )


def _encode_e8m0_nearest(u):
    """E8M0 encode of float32 patterns ``u`` to nearest (ties up) with "ieee" overflow, int32.

    A normal x rounds up iff its mantissa is at least one half: (u + 2^22) >> 23 is the
    code, 0xFF (NaN) from 2^127·1.5 up, inf and NaN included (``min`` caps NaN patterns).
    Float32 subnormals follow ml_dtypes: (2^-127, 2^-126) → 1 (2^-126), the rest → 0
    (2^-127). Zero and negatives (sign bit set: −0, −NaN too) have no code but NaN.
    """
    half = jnp.uint32(1 << (F32_MANT_BITS - 1))
    normal = jnp.minimum(lax.shift_right_logical(u + half, jnp.uint32(F32_MANT_BITS)), 0xFF)
    code = jnp.where(u < jnp.uint32(F32_IMPLICIT), (u > half).astype(jnp.uint32), normal)
    # u − 1 wraps for u = 0, so one unsigned compare catches +0 and every negative pattern.
    no_code = (u - jnp.uint32(1)) >= jnp.uint32(F32_ABS)
    return jnp.where(no_code, jnp.uint32(0xFF), code).astype(jnp.int32)


def encode_stochastic(fmt: ElementFormat, u, overflow: str, rng, scale_exp=None,
                      assume_finite: bool = False):
    """Stochastic :func:`encode_bits` of float patterns ``u`` with ``rng = (key, words)``.

    Caller words (uint16 or uint32, ``u``'s shape) are used as given. With a key, the words
    of the contract (``_rounding.random_bits``) are generated here, inside the encode. One
    Philox evaluation serves four neighbouring elements, but XLA fuses work per *output*
    element and would evaluate it once for each of them; so the codes of the elements that
    share an evaluation are OR-ed into one uint32 by a reduction over a minor axis of 4 (8-bit
    codes) or 2 (16-bit codes, an evaluation then serving two reductions), whose unrolled
    iterations share the evaluation, and the uint32s are reinterpreted as codes. Wider codes,
    or a last axis that does not split into such groups, take one evaluation per element.
    ``scale_exp`` (broadcastable to ``u``) and ``assume_finite`` as for :func:`encode_bits`.
    Returns int32 codes of ``u``'s shape.
    """
    key, words = rng

    def enc(bits, r32, se):
        return encode_bits(fmt, bits, "stochastic", overflow, r32, scale_exp=se,
                           assume_finite=assume_finite)

    if words is not None:
        return enc(u, as_word32(words), scale_exp)
    k = key_words(key)
    shape = check_size(u.shape)
    lanes = 4 if fmt.code_bits <= 8 else 2 if fmt.code_bits <= 16 else 1
    if lanes == 1 or not shape or shape[-1] % WORDS_PER_HASH:
        r16 = element_words(k, lax.iota(jnp.uint32, math.prod(shape)).reshape(shape))
        return enc(u, lax.shift_left(r16, jnp.uint32(16)), scale_exp)
    grouped = shape[:-1] + (shape[-1] // lanes, lanes)
    slot = lax.iota(jnp.uint32, math.prod(grouped[:-1])).reshape(grouped[:-1] + (1,))
    lane = lax.broadcasted_iota(jnp.uint32, grouped, len(grouped) - 1)
    if lanes == 4:  # slot = group: lanes 0, 1 in out0, lanes 2, 3 in out1
        out0, out1 = hash_words(k, slot)
        word = jnp.where(lane >= 2, out1, out0)
    else:  # two slots per group: the even one takes out0, the odd one out1
        out0, out1 = hash_words(k, lax.shift_right_logical(slot, jnp.uint32(1)))
        word = jnp.where((slot & 1) != 0, out1, out0)
    # The lane's 16-bit word moved to the top of a uint32 (r · 2^16: the same decision).
    r32 = jnp.where((lane & 1) != 0, word & jnp.uint32(0xFFFF_0000),
                    lax.shift_left(word, jnp.uint32(16)))
    se = None if scale_exp is None else jnp.broadcast_to(scale_exp, shape).reshape(grouped)
    width = 32 // lanes
    code = enc(u.reshape(grouped), r32, se).astype(jnp.uint32) & jnp.uint32((1 << width) - 1)
    shifted = lax.shift_left(code, lane * jnp.uint32(width))
    packed = lax.reduce(shifted, jnp.uint32(0), lax.bitwise_or, (len(grouped) - 1,))
    codes = lax.bitcast_convert_type(packed, jnp.uint8 if lanes == 4 else jnp.uint16)
    return codes.reshape(shape).astype(jnp.int32)


def encode_any(fmt: ElementFormat, u, rounding: str, overflow: str, rng, scale_exp=None,
               assume_finite: bool = False):
    """:func:`encode_bits` for every mode; stochastic rounding draws its words from
    ``rng = (key, words)`` (see :func:`encode_stochastic`), the other modes ignore it."""
    if rounding == "stochastic":
        return encode_stochastic(fmt, u, overflow, rng, scale_exp, assume_finite)
    return encode_bits(fmt, u, rounding, overflow, None, scale_exp=scale_exp,
                       assume_finite=assume_finite)


def _signed_code(fmt: ElementFormat, code, sign):
    """Adds the sign to magnitude codes (int32) of a signed format.

    fnuz/P3109 formats (NaN at the negative-zero code) have no -0: a zero keeps code 0. The
    two's-complement INT8 element stores -k as 2^8 - k (and 0 for both zeros).
    """
    sign = sign.astype(jnp.int32)
    if fmt.encoding == "twos_complement":
        return jnp.where((sign != 0) & (code != 0), (1 << fmt.code_bits) - code, code)
    signed = code | lax.shift_left(sign, jnp.int32(fmt.magnitude_bits))
    if fmt.nan == "negative_zero":
        # Only where the magnitude is 0: the overflow code of these formats is the NaN code.
        signed = jnp.where(code == 0, 0, signed)
    return signed


@functools.partial(jax.jit, static_argnums=(0,))
def _encode_jit(cast: ElementCast, x, rng):
    code = encode_any(cast.fmt, input_bits(x), cast.rounding, cast.overflow, rng)
    return code.astype(cast.fmt.code_dtype)


def encode(
    x,
    fmt: ElementFormatLike,
    *,
    rounding: str = "nearest_even",
    overflow: str = "ieee",
    key: Optional[jax.Array] = None,
    random_bits: Optional[jax.Array] = None,
) -> jax.Array:
    """Rounds ``x`` to ``fmt`` and returns the codes (bit patterns).

    Args:
      x: float16, bfloat16, float32 or float64 array, or an array of an ml_dtypes float
        (float8_*, float4_e2m1fn; float6_* as a NumPy array). float64 is rounded directly
        from its 53-bit value when ``jax_enable_x64`` is on (ml_dtypes rounds through float32
        first); with x64 off JAX itself turns float64 into float32 on entry. Narrower input
        is widened exactly with integer operations, so a NaN keeps its sign on every backend.
      fmt: element format or its name (``"fp16"``, ``"bf16"``, ``"tf32"``, ``"e4m3"``,
        ``"e5m2"``, ``"e2m1"``, ``"e8m0"``, ``"e4m3fnuz"``, ``"e2m3"``, ...: any name or alias
        of ``formats/elements.json``, such as the ml_dtypes name ``"float8_e4m3fn"``, or a
        P3109 name such as ``"p3109_k8p3se"``).
      rounding: ``"nearest_even"`` (default), ``"nearest_away"``, ``"toward_zero"``,
        ``"up"``, ``"down"``, ``"stochastic"`` (needs ``key`` or ``random_bits``); for
        e8m0 also ``"floor"`` and ``"ceil"`` (= down / up to a power of two).
      overflow: ``"ieee"`` (default; equals ml_dtypes ``astype``: e4m3 overflow → NaN,
        e5m2/fp16/bf16/tf32/e4m3ieee/e3m4 → ±inf, the fnuz formats → their NaN 0x80, e2m1 and
        FP6 saturate, e8m0 → 0xFF; directed modes follow IEEE 754 §7.4 and round toward zero
        to ±max) or ``"saturate"`` (±max, also for ±inf).
      key: PRNG key for stochastic rounding. Element i rounds away from zero iff
        ``lowprec.random_bits(key, x.shape)[i] < frac_i * 2**16``, frac_i being its
        distance from the value toward zero in units of the gap: with probability
        ⌈frac_i·2^16⌉/2^16, so E[q(x)] = x exactly when frac_i is a multiple of 2^-16
        (bf16, fp16 from float32 normals) and within 2^-16 of a gap otherwise. The
        16-bit words come from Philox2x32-10 (:func:`lowprec.random_bits`; contract in
        docs/design.md §2), drawn inside the call.
      random_bits: instead of ``key``: your own words, one per element of ``x``: uint16
        (the same rule) or uint32 (compared with ``frac_i * 2**32``), e.g. to replay a
        rounding or to use another generator.

    Returns:
      Unsigned integer codes of ``x``'s shape: uint8 (formats of up to 8 bits; FP4/FP6
      codes unpacked, one per byte), uint16 (fp16, bf16) or uint32 (tf32: the 19-bit code,
      which is the top 19 bits of the float32 pattern). A NaN input gives the format's NaN code with the
      input's sign and a fixed payload (the format's canonical NaN: the quiet bit only),
      not the input's payload — docs/design.md §9 says why. The fnuz formats have one NaN,
      0x80, and no −0: a zero result is +0.

    Example:
        >>> import jax.numpy as jnp
        >>> [hex(int(c)) for c in encode(jnp.array([1.0, 448.0, 464.0, 465.0]), "e4m3")]
        ['0x38', '0x7e', '0x7e', '0x7f']
    """
    x, fmt = array_then_format(x, fmt, "encode")
    cast = ElementCast(fmt, rounding, overflow)
    call = cast.check_call(x, key=key, random_bits=random_bits)
    return _encode_jit(cast, call.x, call.rng)


def decode_bits(fmt: ElementFormat, codes):
    """Codes (any unsigned/signed int array) → exact float32 bit patterns (uint32)."""
    c = codes.astype(jnp.uint32)
    m_bits = fmt.mantissa_bits
    if fmt.encoding == "twos_complement":
        return _decode_twos_complement(fmt, c)
    mag = c & ((1 << fmt.magnitude_bits) - 1)
    sign = (
        lax.shift_right_logical(c, jnp.uint32(fmt.magnitude_bits)) & 1
        if fmt.signed
        else jnp.zeros_like(c)
    )
    if not fmt.zero:
        # E8M0: code k is 2^(k - bias); 2^-127 is a float32 subnormal, written directly.
        normal = lax.shift_left(mag + (127 - fmt.bias), jnp.uint32(23))
        bits = jnp.where(mag == 0, jnp.uint32(1 << 22), normal)
    elif fmt.exponent_bits == 8 and fmt.bias == 127 and fmt.nan == "ieee":
        # BF16 and TF32 are truncated float32: the code is the float32 pattern's top bits,
        # subnormals, infinities and NaNs included.
        bits = lax.shift_left(mag, jnp.uint32(23 - m_bits))
    else:
        efield = lax.shift_right_logical(mag, jnp.uint32(m_bits))
        mfield = mag & fmt.mantissa_mask
        normal = lax.shift_left(efield + (127 - fmt.bias), jnp.uint32(23)) | lax.shift_left(
            mfield, jnp.uint32(23 - m_bits)
        )
        # Subnormal m * 2^(emin - M): a float32 normal for the formats of formats/ (E < 8),
        # so convert the small integer m exactly and add to its exponent field.
        as_float = lax.bitcast_convert_type(mfield.astype(jnp.float32), jnp.uint32)
        sub = jnp.where(
            mfield == 0, jnp.uint32(0), as_float + jnp.uint32(((fmt.emin - m_bits) % 512) << 23)
        )
        bits = jnp.where(efield == 0, sub, normal)
        if fmt.emin - m_bits < -126:
            # Values below 2^-126 (wide P3109 formats) are float32 subnormals: the
            # significand, shifted to units of 2^-149 (exact: every value is >= 2^-149).
            lsb = jnp.maximum(efield, 1).astype(jnp.int32) - (fmt.bias + m_bits)
            sig = jnp.where(efield > 0, mfield | (1 << m_bits), mfield)
            top = lsb + 31 - lax.clz(sig).astype(jnp.int32)  # floor(log2 value)
            tiny = lax.shift_left(sig, jnp.clip(lsb + 149, 0, 31).astype(jnp.uint32))
            bits = jnp.where((sig != 0) & (top < -126), tiny, bits)
        if fmt.nan == "ieee":
            top = efield == (1 << fmt.exponent_bits) - 1
            bits = jnp.where(top & (mfield != 0), jnp.uint32(F32_QNAN), bits)
    if fmt.inf:
        bits = jnp.where(mag == fmt.inf_code, jnp.uint32(F32_INF), bits)
    if fmt.nan == "all_ones":
        bits = jnp.where(mag == (1 << fmt.magnitude_bits) - 1, jnp.uint32(F32_QNAN), bits)
    elif fmt.nan == "negative_zero":
        # fnuz / P3109: the code with only the sign bit set is NaN (ml_dtypes reads it as -NaN).
        bits = jnp.where((mag == 0) & (sign != 0), jnp.uint32(F32_QNAN), bits)
    return bits | lax.shift_left(sign, jnp.uint32(31))


def _subtract_decodable(fmt: ElementFormat) -> bool:
    """Whether :func:`decode_f32` builds ``fmt``'s values by float subtraction (static):
    a signed or unsigned float format with zero and subnormals, whose smallest subnormal
    and whose exponent offset keep every intermediate a float32 normal, and whose specials
    are IEEE inf/NaN, an all-ones NaN, or none."""
    return (
        fmt.encoding == "sign_magnitude"
        and fmt.zero and fmt.subnormals and fmt.exponent_bits >= 1
        and fmt.nan in ("ieee", "all_ones", "none") and fmt.inf == (fmt.nan == "ieee")
        and fmt.code_bits <= 16 and fmt.mantissa_bits < 23
        and -125 <= 1 - fmt.bias - fmt.mantissa_bits and fmt.emax < 127
    )


def decode_f32(fmt: ElementFormat, codes):
    """Values of ``codes`` as float32, bit for bit those of :func:`decode_bits`.

    Fewer operations than :func:`decode_bits` for the small float formats: the magnitude's
    bits, moved into float32's layout and rebiased, are the value of every normal code; a
    subnormal code (exponent field 0) is read as if its field were 1, which adds the hidden
    2^(1 - bias), and that is subtracted in float32. Both operands and the difference are
    float32 normals (the difference lies in [2^(1 - bias - M), 2^(1 - bias)), and is exact
    by Sterbenz's lemma), so no backend's handling of subnormals can change it. Formats
    outside :func:`_subtract_decodable` take :func:`decode_bits`.
    """
    if not _subtract_decodable(fmt):
        return bits_to_f32(decode_bits(fmt, codes))
    c = codes.astype(jnp.uint32)
    m_bits = fmt.mantissa_bits
    mag = c & ((1 << fmt.magnitude_bits) - 1)
    low = mag < (1 << m_bits)  # exponent field 0: zero or subnormal
    rebias = (127 - fmt.bias) << 23
    u = lax.shift_left(mag, jnp.uint32(23 - m_bits)) + jnp.where(
        low, jnp.uint32(rebias + (1 << 23)), jnp.uint32(rebias)
    )
    hidden = np.float32(2.0 ** (1 - fmt.bias))
    bits = f32_bits(bits_to_f32(u) - jnp.where(low, hidden, np.float32(0)))
    if fmt.inf:
        inf_code = fmt.inf_code
        special = jnp.where(mag == inf_code, jnp.uint32(F32_INF), jnp.uint32(F32_QNAN))
        bits = jnp.where(mag >= inf_code, special, bits)
    elif fmt.nan == "all_ones":
        bits = jnp.where(mag == (1 << fmt.magnitude_bits) - 1, jnp.uint32(F32_QNAN), bits)
    if fmt.signed:  # the sign bit moved to bit 31; the bits below it shifted out of the mask
        bits = bits | (lax.shift_left(c, jnp.uint32(31 - fmt.magnitude_bits)) & jnp.uint32(F32_SIGN))
    return bits_to_f32(bits)


def _decode_twos_complement(fmt: ElementFormat, c):
    """Two's-complement codes (INT8: k in [-128, 127]) → float32 patterns of k × 2^(emin - M).

    |k| <= 2^(bits-1) converts exactly to float32; the scale moves its exponent field (every
    nonzero value is a float32 normal: INT8's smallest is 2^-6).
    """
    width = fmt.code_bits
    c = c & ((1 << width) - 1)
    negative = lax.shift_right_logical(c, jnp.uint32(width - 1)) != 0
    mag = jnp.where(negative, (1 << width) - c, c)
    as_float = lax.bitcast_convert_type(mag.astype(jnp.float32), jnp.uint32)
    scaled = as_float + jnp.uint32(((fmt.emin - fmt.mantissa_bits) % 512) << 23)
    bits = jnp.where(mag == 0, jnp.uint32(0), scaled)
    return bits | lax.shift_left(negative.astype(jnp.uint32), jnp.uint32(31))


@functools.partial(jax.jit, static_argnums=(0, 2))
def _decode_jit(fmt: ElementFormat, codes, dtype):
    return bits_to_dtype(f32_bits(decode_f32(fmt, codes)), dtype)


def decode(codes, fmt: ElementFormatLike, dtype=jnp.float32) -> jax.Array:
    """Returns the values of ``codes`` in ``fmt``, exactly, as ``dtype`` (default float32).

    Every value of every element format is exactly representable in float32.

    Args:
      codes: integer array of codes (as returned by :func:`encode`), or an array of the
        format's own ml_dtypes dtype (a ``float8_e4m3fn`` array for ``"e4m3"``: its bits are
        the codes). Bits above the format's width are ignored.
      fmt: element format or its name.
      dtype: float dtype of the result (float32, float64, bfloat16, float16 or an ml_dtypes
        float such as ``jnp.float8_e5m2``); values are rounded to nearest even if it is
        narrower than the format (e.g. fp16 codes decoded to bfloat16), exactly as
        ml_dtypes' ``astype`` rounds a float32.

    Example:
        >>> import jax.numpy as jnp
        >>> decode(jnp.arange(16, dtype=jnp.uint8), "e2m1").tolist()
        [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    """
    codes, fmt = array_then_format(codes, fmt, "decode")
    fmt = element_format(fmt)
    codes = _codes_from_storage(codes, fmt)
    if not jnp.issubdtype(codes.dtype, jnp.integer):
        raise TypeError(
            f"codes must be an integer array (as returned by encode), got dtype {codes.dtype}; "
            "to round numbers use quantize() or encode()"
        )
    return _decode_jit(fmt, codes, check_float_dtype(dtype))


def _codes_from_storage(codes, fmt: ElementFormat):
    """Codes held in ``fmt``'s own ml_dtypes dtype (e.g. a float8_e4m3fn array for "e4m3")
    as unsigned integers, by bitcast; any other array as a JAX array. A float array of another
    format's dtype is refused: its bits would mean something else."""
    dt = np.dtype(getattr(codes, "dtype", np.float32 if isinstance(codes, float) else np.int32))
    if dt not in _WIDENED_AS and dt not in _HOST_ONLY:
        return jnp.asarray(codes)
    if dt != fmt.storage_dtype:
        raise TypeError(
            f"codes have dtype {dt}, the storage type of "
            f"{(_WIDENED_AS.get(dt) or _HOST_ONLY.get(dt))!r}, not of {fmt.name!r}; decode them "
            f"as that format, or convert the values with encode/quantize"
        )
    if dt in _HOST_ONLY:
        return jnp.asarray(np.asarray(codes).view(np.uint8) & ((1 << fmt.code_bits) - 1))
    return codes_of_dtype_array(jnp.asarray(codes))[0]


def exactly_representable(fmt: ElementFormat, dtype) -> bool:
    """Whether every finite value of ``fmt`` is a value of the float ``dtype``."""
    info = jnp.finfo(dtype)
    return (
        fmt.mantissa_bits <= info.nmant
        and fmt.emax <= info.maxexp - 1
        and fmt.emin - fmt.mantissa_bits >= info.minexp - info.nmant
    )


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 3))
def _quantize_ste(cast: ElementCast, x, rng, dtype):
    code = encode_any(cast.fmt, input_bits(x), cast.rounding, cast.overflow, rng)
    return bits_to_dtype(f32_bits(decode_f32(cast.fmt, code)), dtype)


@_quantize_ste.defjvp
def _quantize_ste_jvp(cast, dtype, primals, tangents):
    x, rng = primals
    tx, _ = tangents
    y = _quantize_ste(cast, x, rng, dtype)
    return y, tx.astype(dtype)  # straight-through: d quantize(x) / dx := 1


_quantize_jit = jax.jit(_quantize_ste, static_argnums=(0, 3))


def quantize(
    x,
    fmt: ElementFormatLike,
    *,
    rounding: str = "nearest_even",
    overflow: str = "ieee",
    key: Optional[jax.Array] = None,
    random_bits: Optional[jax.Array] = None,
    dtype=None,
) -> jax.Array:
    """Rounds ``x`` to the values of ``fmt`` ("fake quantization"), keeping a float array.

    Equal to ``decode(encode(x, fmt, ...), fmt)``; immune to XLA's cast-pair elision on
    GPU because it never round-trips through a float8 dtype. The gradient is the
    straight-through estimator (identity), so it can sit inside a training step.

    Args:
      x, fmt, rounding, overflow, key, random_bits: as for :func:`encode`.
      dtype: result dtype (float32, float64, bfloat16 or float16). Default: ``x``'s dtype
        when every value of ``fmt`` is exactly representable in it (float32/float64 always;
        bfloat16 for the FP8/FP4 formats), otherwise an error asks you to choose (e.g.
        ``quantize(bf16_array, "fp16")``). An explicit ``dtype`` must span the format's
        range (a ValueError otherwise: e4m3 as float4_e2m1fn would turn 448 into 6); one with
        fewer significand bits only is an explicit choice of a second rounding.

    Example:
        >>> import jax.numpy as jnp
        >>> quantize(jnp.array([0.3, 2.5, 5.0, 7.0, -100.0]), "e2m1").tolist()
        [0.5, 2.0, 4.0, 6.0, -6.0]
    """
    x, fmt = array_then_format(x, fmt, "quantize")
    cast = ElementCast(fmt, rounding, overflow)
    x, rng = cast.check_call(x, key=key, random_bits=random_bits)
    if dtype is None:
        dtype = x.dtype
        if not exactly_representable(cast.fmt, x.dtype):
            raise ValueError(
                f"values of {cast.fmt.name!r} are not all representable in the input dtype "
                f"{x.dtype}; pass dtype=jnp.float32 (exact) or dtype={x.dtype.name!s} "
                "explicitly to accept a second rounding"
            )
    dtype = check_float_dtype(dtype)
    check_dtype_range(cast.fmt, dtype)
    return _quantize_jit(cast, x, rng, dtype)


def check_dtype_range(fmt: ElementFormat, dtype) -> None:
    """ValueError unless ``dtype`` spans ``fmt``'s range: its largest finite value and its
    smallest subnormal. A narrower dtype would re-round the format's values into other
    numbers (e4m3's 448 into float4_e2m1fn's 6, or small values into zero); a dtype that only
    has fewer significand bits (fp16 values as bfloat16) rounds each value to a neighbour and
    stays an explicit choice."""
    info = jnp.finfo(dtype)
    fits = (fmt.emax <= info.maxexp - 1 and fmt.max_finite <= float(info.max)
            and fmt.min_subnormal >= float(info.smallest_subnormal))
    if not fits:
        exact = [n for n in ("bfloat16", "float16", "float32") if exactly_representable(fmt, n)]
        raise ValueError(
            f"dtype={np.dtype(dtype).name} cannot hold the values of {fmt.name!r} (largest "
            f"{fmt.max_finite:g}, smallest {fmt.min_subnormal:g}; {np.dtype(dtype).name} spans "
            f"{float(info.smallest_subnormal):g} to {float(info.max):g}): they would be "
            f"rounded again into other numbers. Use dtype={exact[0]} (exact) or any wider float"
        )
