"""Bit-exact element codecs: float → code (``encode``), code → float (``decode``), and both.

Everything is integer arithmetic on the input's bit pattern (``lax.bitcast_convert_type``),
so results never depend on how a backend treats subnormal floats (XLA on CPU flushes them),
and XLA cannot fold an encode/decode pair away under ``jit`` on GPU (openxla/xla#41605).
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ._bits import F32_INF, F32_QNAN, F32_SIGN, bits_to_f32, f32_bits
from ._format import ElementFormat, ElementFormatLike, array_then_format, element_format
from ._options import ElementCast
from ._rounding import round_shift, rounds_away_on_overflow

# (mantissa bits, exponent bias) of the float layouts encoded bit-wise, by the unsigned
# dtype holding their patterns: binary32 and binary64.
_FLOAT_LAYOUTS = {
    np.dtype(np.uint32): (23, 127),
    np.dtype(np.uint64): (52, 1023),
}
# Half-precision inputs are widened to float32 patterns by decoding them as the element
# format with their layout: integer arithmetic only, so NaN sign and subnormals survive on
# every backend (XLA on GPU turns any float16 NaN into 0x7fffffff when it converts).
_WIDENED_AS = {np.dtype(jnp.float16): "fp16", np.dtype(jnp.bfloat16): "bf16"}
_ACCEPTED = "float16, bfloat16, float32 or float64"


def check_input_dtype(dtype, what: str = "x") -> np.dtype:
    """``dtype`` if lowprec encodes from it ({float16, bfloat16, float32, float64}); else TypeError."""
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

    float16 / bfloat16 are widened exactly to float32 patterns with integer operations.
    """
    x = jnp.asarray(x)
    dt = check_input_dtype(x.dtype, what)
    if dt == np.dtype(np.float32):
        return lax.bitcast_convert_type(x, jnp.uint32)
    if dt == np.dtype(np.float64):
        return lax.bitcast_convert_type(x, jnp.uint64)
    return decode_bits(element_format(_WIDENED_AS[dt]), lax.bitcast_convert_type(x, jnp.uint16))


def check_float_dtype(dtype, what: str = "dtype") -> np.dtype:
    """``dtype`` as a NumPy dtype if it is a float dtype lowprec can produce; else TypeError."""
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"{what} must be a float dtype such as jnp.float32, got {dtype!r}") from None
    if dt not in (np.dtype(np.float32), np.dtype(np.float64)) and dt not in _WIDENED_AS:
        raise TypeError(
            f"{what} must be float32, float64, bfloat16 or float16, got {dt}; integer or other "
            "dtypes would silently truncate the values (for codes use encode())"
        )
    return dt


def bits_to_dtype(bits, dtype):
    """Float32 patterns ``bits`` as an array of ``dtype``, rounding to nearest even.

    Narrowing to float16/bfloat16 goes through the element encoder, not a float convert,
    so NaN keeps its sign on every backend; widening to float64 is exact.
    """
    dtype = np.dtype(dtype)
    if dtype == np.dtype(np.float32):
        return bits_to_f32(bits)
    name = _WIDENED_AS.get(dtype)
    if name is not None:
        code = encode_bits(element_format(name), bits, "nearest_even", "ieee", None)
        return lax.bitcast_convert_type(code.astype(jnp.uint16), dtype)
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
            and rounding != "stochastic"):
        # Same exponent range as the input (bf16, tf32 from float32): the code is the top
        # bits of the magnitude. Rounding them carries into the exponent field by itself
        # (subnormals included) and, past the largest finite value, onto the infinity
        # pattern exactly when IEEE 754 §7.4 overflows to infinity for the mode.
        shift = jnp.full_like(mag, in_mant - fmt.mantissa_bits, dtype=jnp.int32)
        code = round_shift(mag, shift, sign, rounding)
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
        e_x = lsb_exp + (width - 1) - lax.clz(sig).astype(jnp.int32)

    # The target quantum: 2^(t - M) with t the binade, or emin in the subnormal range.
    t = jnp.maximum(e_x, fmt.emin)
    shift = (t - fmt.mantissa_bits) - lsb_exp  # >= 1 since M < input mantissa bits
    mag_q = round_shift(sig, shift, sign, rounding, random_bits)
    # The code of a magnitude: (t - emin + field(emin)) << M plus the significand of the
    # rounded value, whose implicit bit (mag_q >= 2^M) adds one to the exponent field.
    code = lax.shift_left(
        t - fmt.emin + fmt.min_exponent_field - 1, jnp.int32(fmt.mantissa_bits)
    ) + mag_q

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
        return code | lax.shift_left(sign.astype(jnp.int32), jnp.int32(fmt.magnitude_bits))
    code = jnp.where(is_inf, inf_result, code)

    if fmt.signed:
        signed_bit = lax.shift_left(sign.astype(jnp.int32), jnp.int32(fmt.magnitude_bits))
        code = code | signed_bit
        if fmt.nan_code is not None:
            nan_result = fmt.nan_code | signed_bit
        else:
            # No NaN code (E2M1): ml_dtypes gives a zero of the opposite sign (+NaN -> -0 =
            # 0b1000, -NaN -> +0); match it bit for bit.
            nan_result = signed_bit ^ fmt.sign_mask
    else:
        # Unsigned, zero-less scale format: anything at or below the smallest value rounds
        # to it (code 0 = 2^-bias); zero, negatives and NaN have no code but NaN.
        code = jnp.maximum(code, 0)
        nan_result = fmt.nan_code
        is_nan = is_nan | (sign != 0) | (mag == 0)
    code = jnp.where(is_nan, nan_result, code)
    return code


def _random_bits(cast: ElementCast, key, shape):
    return jax.random.bits(key, shape, jnp.uint32) if cast.stochastic else None


@functools.partial(jax.jit, static_argnums=(0,))
def _encode_jit(cast: ElementCast, x, key):
    code = encode_bits(
        cast.fmt, input_bits(x), cast.rounding, cast.overflow, _random_bits(cast, key, x.shape)
    )
    return code.astype(cast.fmt.code_dtype)


def encode(
    x,
    fmt: ElementFormatLike,
    *,
    rounding: str = "nearest_even",
    overflow: str = "ieee",
    key: Optional[jax.Array] = None,
) -> jax.Array:
    """Rounds ``x`` to ``fmt`` and returns the codes (bit patterns).

    Args:
      x: float16, bfloat16, float32 or float64 array. float64 is rounded directly from its
        53-bit value when ``jax_enable_x64`` is on (ml_dtypes rounds through float32 first);
        with x64 off JAX itself turns float64 into float32 on entry. Half-precision input
        is widened with integer operations, so a NaN keeps its sign on every backend.
      fmt: element format or its name (``"fp16"``, ``"bf16"``, ``"tf32"``, ``"e4m3"``,
        ``"e5m2"``, ``"e2m1"``, ``"e8m0"`` or an alias such as ``"float8_e4m3fn"``).
      rounding: ``"nearest_even"`` (default), ``"nearest_away"``, ``"toward_zero"``,
        ``"up"``, ``"down"``, ``"stochastic"`` (needs ``key``); for e8m0 also ``"floor"``
        and ``"ceil"`` (= down / up to a power of two).
      overflow: ``"ieee"`` (default; equals ml_dtypes ``astype``: e4m3 overflow → NaN,
        e5m2/fp16/bf16/tf32 → ±inf, e2m1 saturates, e8m0 → 0xFF; directed modes follow
        IEEE 754 §7.4 and round toward zero to ±max) or ``"saturate"`` (±max, also for ±inf).
      key: PRNG key for stochastic rounding. Element i rounds up iff
        ``jax.random.bits(key, x.shape, jnp.uint32)[i] < frac_i * 2**32``.

    Returns:
      Unsigned integer codes of ``x``'s shape: uint8 (8-bit formats and unpacked FP4
      codes 0..15), uint16 (fp16, bf16) or uint32 (tf32: the 19-bit code, which is the
      top 19 bits of the float32 pattern). A NaN input gives the format's NaN code with the
      input's sign (payloads are not kept).

    Example:
        >>> import jax.numpy as jnp
        >>> [hex(int(c)) for c in encode(jnp.array([1.0, 448.0, 464.0, 465.0]), "e4m3")]
        ['0x38', '0x7e', '0x7e', '0x7f']
    """
    x, fmt = array_then_format(x, fmt, "encode")
    cast = ElementCast(fmt, rounding, overflow)
    cast.check_key(key)
    x = jnp.asarray(x)
    check_input_dtype(x.dtype)
    return _encode_jit(cast, x, key)


def decode_bits(fmt: ElementFormat, codes):
    """Codes (any unsigned/signed int array) → exact float32 bit patterns (uint32)."""
    c = codes.astype(jnp.uint32)
    m_bits = fmt.mantissa_bits
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
    elif fmt.exponent_bits == 8 and fmt.bias == 127:
        # BF16 and TF32 are truncated float32: the code is the float32 pattern's top bits,
        # subnormals, infinities and NaNs included.
        bits = lax.shift_left(mag, jnp.uint32(23 - m_bits))
    else:
        efield = lax.shift_right_logical(mag, jnp.uint32(m_bits))
        mfield = mag & fmt.mantissa_mask
        normal = lax.shift_left(efield + (127 - fmt.bias), jnp.uint32(23)) | lax.shift_left(
            mfield, jnp.uint32(23 - m_bits)
        )
        # Subnormal m * 2^(emin - M): every such value is a float32 normal here (E < 8), so
        # convert the small integer m exactly and add to its exponent field.
        as_float = lax.bitcast_convert_type(mfield.astype(jnp.float32), jnp.uint32)
        sub = jnp.where(
            mfield == 0, jnp.uint32(0), as_float + jnp.uint32(((fmt.emin - m_bits) % 512) << 23)
        )
        bits = jnp.where(efield == 0, sub, normal)
        if fmt.inf:
            top = efield == (1 << fmt.exponent_bits) - 1
            bits = jnp.where(top, jnp.where(mfield == 0, jnp.uint32(F32_INF), jnp.uint32(F32_QNAN)), bits)
    if fmt.nan == "all_ones":
        bits = jnp.where(mag == (1 << fmt.magnitude_bits) - 1, jnp.uint32(F32_QNAN), bits)
    return bits | lax.shift_left(sign, jnp.uint32(31))


def _subtract_decodable(fmt: ElementFormat) -> bool:
    """Whether :func:`decode_f32` builds ``fmt``'s values by float subtraction (static):
    a signed or unsigned float format with zero and subnormals, whose smallest subnormal
    and whose exponent offset keep every intermediate a float32 normal, and whose specials
    are IEEE inf/NaN, an all-ones NaN, or none."""
    return (
        fmt.zero and fmt.subnormals and fmt.exponent_bits >= 1
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


@functools.partial(jax.jit, static_argnums=(0, 2))
def _decode_jit(fmt: ElementFormat, codes, dtype):
    return bits_to_dtype(f32_bits(decode_f32(fmt, codes)), dtype)


def decode(codes, fmt: ElementFormatLike, dtype=jnp.float32) -> jax.Array:
    """Returns the values of ``codes`` in ``fmt``, exactly, as ``dtype`` (default float32).

    Every value of every element format is exactly representable in float32.

    Args:
      codes: integer array of codes (as returned by :func:`encode`). Bits above the
        format's width are ignored.
      fmt: element format or its name.
      dtype: float dtype of the result (float32, float64, bfloat16, float16); values are
        rounded to nearest even if it is narrower than the format (e.g. fp16 codes decoded
        to bfloat16).

    Example:
        >>> import jax.numpy as jnp
        >>> decode(jnp.arange(16, dtype=jnp.uint8), "e2m1").tolist()
        [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    """
    codes, fmt = array_then_format(codes, fmt, "decode")
    fmt = element_format(fmt)
    codes = jnp.asarray(codes)
    if not jnp.issubdtype(codes.dtype, jnp.integer):
        raise TypeError(
            f"codes must be an integer array (as returned by encode), got dtype {codes.dtype}; "
            "to round numbers use quantize() or encode()"
        )
    return _decode_jit(fmt, codes, check_float_dtype(dtype))


def exactly_representable(fmt: ElementFormat, dtype) -> bool:
    """Whether every finite value of ``fmt`` is a value of the float ``dtype``."""
    info = jnp.finfo(dtype)
    return (
        fmt.mantissa_bits <= info.nmant
        and fmt.emax <= info.maxexp - 1
        and fmt.emin - fmt.mantissa_bits >= info.minexp - info.nmant
    )


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 3))
def _quantize_ste(cast: ElementCast, x, key, dtype):
    code = encode_bits(
        cast.fmt, input_bits(x), cast.rounding, cast.overflow, _random_bits(cast, key, x.shape)
    )
    return bits_to_dtype(decode_bits(cast.fmt, code), dtype)


@_quantize_ste.defjvp
def _quantize_ste_jvp(cast, dtype, primals, tangents):
    x, key = primals
    tx, _ = tangents
    y = _quantize_ste(cast, x, key, dtype)
    return y, tx.astype(dtype)  # straight-through: d quantize(x) / dx := 1


_quantize_jit = jax.jit(_quantize_ste, static_argnums=(0, 3))


def quantize(
    x,
    fmt: ElementFormatLike,
    *,
    rounding: str = "nearest_even",
    overflow: str = "ieee",
    key: Optional[jax.Array] = None,
    dtype=None,
) -> jax.Array:
    """Rounds ``x`` to the values of ``fmt`` ("fake quantization"), keeping a float array.

    Equal to ``decode(encode(x, fmt, ...), fmt)``; immune to XLA's cast-pair elision on
    GPU because it never round-trips through a float8 dtype. The gradient is the
    straight-through estimator (identity), so it can sit inside a training step.

    Args:
      x, fmt, rounding, overflow, key: as for :func:`encode`.
      dtype: result dtype (float32, float64, bfloat16 or float16). Default: ``x``'s dtype
        when every value of ``fmt`` is exactly representable in it (float32/float64 always;
        bfloat16 for the FP8/FP4 formats), otherwise an error asks you to choose (e.g.
        ``quantize(bf16_array, "fp16")``).

    Example:
        >>> import jax.numpy as jnp
        >>> quantize(jnp.array([0.3, 2.5, 5.0, 7.0, -100.0]), "e2m1").tolist()
        [0.5, 2.0, 4.0, 6.0, -6.0]
    """
    x, fmt = array_then_format(x, fmt, "quantize")
    cast = ElementCast(fmt, rounding, overflow)
    cast.check_key(key)
    x = jnp.asarray(x)
    check_input_dtype(x.dtype)
    if dtype is None:
        dtype = x.dtype
        if not exactly_representable(cast.fmt, x.dtype):
            raise ValueError(
                f"values of {cast.fmt.name!r} are not all representable in the input dtype "
                f"{x.dtype}; pass dtype=jnp.float32 (exact) or dtype={x.dtype.name!s} "
                "explicitly to accept a second rounding"
            )
    return _quantize_jit(cast, x, key, check_float_dtype(dtype))
