"""Bit-exact element codecs: float → code (``encode``), code → float (``decode``), and both.

Everything is integer arithmetic on the input's bit pattern (``lax.bitcast_convert_type``),
so results never depend on how a backend treats subnormal floats (XLA on CPU flushes them),
and XLA cannot fold an encode/decode pair away under ``jit`` on GPU (openxla/xla#41605).
"""

from __future__ import annotations

import functools
from typing import Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ._format import ElementFormat, element_format
from ._rounding import (
    check_key,
    check_overflow,
    check_rounding,
    round_shift,
    rounds_away_on_overflow,
)

FormatLike = Union[str, ElementFormat]

# (unsigned dtype, mantissa bits, exponent bias) of the float inputs handled bit-wise.
_FLOAT_LAYOUTS = {
    np.dtype(np.float32): (jnp.uint32, 23, 127),
    np.dtype(np.float64): (jnp.uint64, 52, 1023),
}
_F32_INF = 0x7F80_0000
_F32_QNAN = 0x7FC0_0000


def _as_float_input(x, what: str = "x"):
    """Returns ``x`` as a float32/float64 JAX array, or raises a clear TypeError."""
    x = jnp.asarray(x)
    if x.dtype in (jnp.float16, jnp.bfloat16):
        return x.astype(jnp.float32)  # exact widening
    if x.dtype in _FLOAT_LAYOUTS:
        return x
    if jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(
            f"{what} has dtype {x.dtype}, which lowprec does not encode from; convert it with "
            f"{what}.astype(jnp.float32) (float16, bfloat16, float32, float64 are accepted)"
        )
    raise TypeError(
        f"{what} must be a floating-point array (float16, bfloat16, float32 or float64), got "
        f"dtype {x.dtype}; for codes use decode(), for numbers cast with .astype(jnp.float32)"
    )


def _encode_bits(
    fmt: ElementFormat, x, rounding: str, overflow: str, random_bits, scale_exp=None,
    assume_finite: bool = False,
):
    """Core encoder on the bit pattern of a float32/float64 array; returns int32 codes.

    With ``scale_exp`` (an int32 array broadcastable to ``x``), encodes ``x * 2^-scale_exp``
    exactly, by moving the exponent rather than multiplying (MX block scaling).
    ``assume_finite``: skip the NaN/Inf handling (the caller overwrites those results).
    """
    udt, in_mant, in_bias = _FLOAT_LAYOUTS[np.dtype(x.dtype)]
    width = jnp.iinfo(udt).bits
    assert fmt.mantissa_bits < in_mant
    u = lax.bitcast_convert_type(x, udt)
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
        shift = jnp.full(mag.shape, in_mant - fmt.mantissa_bits, jnp.int32)
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
        to_inf = jnp.zeros(code.shape, bool)
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


@functools.partial(jax.jit, static_argnums=(0, 2, 3))
def _encode_jit(fmt, x, rounding, overflow, key):
    random_bits = None
    if rounding == "stochastic":
        random_bits = jax.random.bits(key, x.shape, jnp.uint32)
    code = _encode_bits(fmt, x, rounding, overflow, random_bits)
    return code.astype(fmt.code_dtype)


def encode(
    fmt: FormatLike,
    x,
    *,
    rounding: str = "nearest_even",
    overflow: str = "ieee",
    key: Optional[jax.Array] = None,
) -> jax.Array:
    """Rounds ``x`` to ``fmt`` and returns the codes (bit patterns).

    Args:
      fmt: element format or its name (``"fp16"``, ``"bf16"``, ``"tf32"``, ``"e4m3"``,
        ``"e5m2"``, ``"e2m1"``, ``"e8m0"`` or an alias such as ``"fp8_e4m3fn"``).
      x: float16, bfloat16, float32 or float64 array. float64 is rounded directly from its
        53-bit value when ``jax_enable_x64`` is on (ml_dtypes rounds through float32 first);
        with x64 off JAX itself turns float64 into float32 on entry.
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
      top 19 bits of the float32 pattern).

    Example:
        >>> import jax.numpy as jnp
        >>> [hex(int(c)) for c in encode("e4m3", jnp.array([1.0, 448.0, 464.0, 465.0]))]
        ['0x38', '0x7e', '0x7e', '0x7f']
    """
    fmt = element_format(fmt)
    rounding = check_rounding(fmt, rounding)
    overflow = check_overflow(overflow)
    check_key(rounding, key)
    x = _as_float_input(x)
    return _encode_jit(fmt, x, rounding, overflow, key)


def _decode_bits(fmt: ElementFormat, codes):
    """Codes (any unsigned/signed int array) → float32 bit pattern as uint32."""
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
            bits = jnp.where(top, jnp.where(mfield == 0, jnp.uint32(_F32_INF), jnp.uint32(_F32_QNAN)), bits)
    if fmt.nan == "all_ones":
        bits = jnp.where(mag == (1 << fmt.magnitude_bits) - 1, jnp.uint32(_F32_QNAN), bits)
    return bits | lax.shift_left(sign, jnp.uint32(31))


@functools.partial(jax.jit, static_argnums=(0, 2))
def _decode_jit(fmt, codes, dtype):
    values = lax.bitcast_convert_type(_decode_bits(fmt, codes), jnp.float32)
    return values if dtype == np.dtype(np.float32) else values.astype(dtype)


def decode(fmt: FormatLike, codes, dtype=jnp.float32) -> jax.Array:
    """Returns the values of ``codes`` in ``fmt``, exactly, as ``dtype`` (default float32).

    Every value of every element format is exactly representable in float32.

    Args:
      fmt: element format or its name.
      codes: integer array of codes (as returned by :func:`encode`). Bits above the
        format's width are ignored.
      dtype: float dtype of the result; values are rounded to it if it is narrower than
        the format (e.g. fp16 codes decoded to bfloat16).

    Example:
        >>> import jax.numpy as jnp
        >>> decode("e2m1", jnp.arange(16, dtype=jnp.uint8)).tolist()
        [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    """
    fmt = element_format(fmt)
    codes = jnp.asarray(codes)
    if not jnp.issubdtype(codes.dtype, jnp.integer):
        raise TypeError(
            f"codes must be an integer array (as returned by encode), got dtype {codes.dtype}; "
            "to round numbers use quantize() or encode()"
        )
    dtype = np.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"dtype must be a floating dtype, got {dtype}")
    return _decode_jit(fmt, codes, dtype)


def _exactly_representable(fmt: ElementFormat, dtype) -> bool:
    """Whether every finite value of ``fmt`` is a value of the float ``dtype``."""
    info = jnp.finfo(dtype)
    return (
        fmt.mantissa_bits <= info.nmant
        and fmt.emax <= info.maxexp - 1
        and fmt.emin - fmt.mantissa_bits >= info.minexp - info.nmant
    )


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 2, 3, 5))
def _quantize_ste(fmt, x, rounding, overflow, key, dtype):
    bits = None if rounding != "stochastic" else jax.random.bits(key, x.shape, jnp.uint32)
    xin = _as_float_input(x)
    code = _encode_bits(fmt, xin, rounding, overflow, bits)
    return lax.bitcast_convert_type(_decode_bits(fmt, code), jnp.float32).astype(dtype)


@_quantize_ste.defjvp
def _quantize_ste_jvp(fmt, rounding, overflow, dtype, primals, tangents):
    x, key = primals
    tx, _ = tangents
    y = _quantize_ste(fmt, x, rounding, overflow, key, dtype)
    return y, tx.astype(dtype)  # straight-through: d quantize(x) / dx := 1


_quantize_jit = jax.jit(_quantize_ste, static_argnums=(0, 2, 3, 5))


def quantize(
    fmt: FormatLike,
    x,
    *,
    rounding: str = "nearest_even",
    overflow: str = "ieee",
    key: Optional[jax.Array] = None,
    dtype=None,
) -> jax.Array:
    """Rounds ``x`` to the values of ``fmt`` ("fake quantization"), keeping a float array.

    Equal to ``decode(fmt, encode(fmt, x, ...))``; immune to XLA's cast-pair elision on
    GPU because it never round-trips through a float8 dtype. The gradient is the
    straight-through estimator (identity), so it can sit inside a training step.

    Args:
      fmt, x, rounding, overflow, key: as for :func:`encode`.
      dtype: result dtype. Default: ``x``'s dtype when every value of ``fmt`` is exactly
        representable in it (float32/float64 always; bfloat16 for the FP8/FP4 formats),
        otherwise an error asks you to choose (e.g. ``quantize("fp16", bf16_array)``).

    Example:
        >>> import jax.numpy as jnp
        >>> quantize("e2m1", jnp.array([0.3, 2.5, 5.0, 7.0, -100.0])).tolist()
        [0.5, 2.0, 4.0, 6.0, -6.0]
    """
    fmt = element_format(fmt)
    rounding = check_rounding(fmt, rounding)
    overflow = check_overflow(overflow)
    check_key(rounding, key)
    x = jnp.asarray(x)
    _as_float_input(x)  # type check only: the STE keeps x's own dtype for tangents
    if dtype is None:
        dtype = x.dtype
        if not _exactly_representable(fmt, x.dtype):
            raise ValueError(
                f"values of {fmt.name!r} are not all representable in the input dtype "
                f"{x.dtype}; pass dtype=jnp.float32 (exact) or dtype={x.dtype.name!s} "
                "explicitly to accept a second rounding"
            )
    return _quantize_jit(fmt, x, rounding, overflow, key, np.dtype(dtype))
