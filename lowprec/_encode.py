"""The general element encoder: float bit patterns → codes, in every mode and format.

:func:`encode_bits` rounds the exact value of a float32 or float64 bit pattern to any
element format with integer arithmetic only, so results never depend on how a backend
treats subnormal floats (XLA on CPU flushes them), and XLA cannot fold an encode/decode pair
away under ``jit`` on GPU (openxla/xla#41605). Float32 input in the default modes takes the
fast encoders of ``_encode_fast.py`` where they apply.
"""

from __future__ import annotations

from typing import Union

import numpy as np

from ._bits import F32_BIAS, F32_MANT_BITS, F64_BIAS, F64_MANT_BITS, clz
from ._encode_fast import encode_e8m0_nearest, encode_rebias, is_e8m0, rebias_encodable
from . import _tapered
from ._format import ElementFormat
from ._lazy import lazy_module
from ._rounding import Overflow, Rounding, round_shift

# Imported on first use: the checkpoint command line's native path needs no JAX.
jnp = lazy_module("jax.numpy")
lax = lazy_module("jax.lax")

# (mantissa bits, exponent bias) of the float layouts encoded bit-wise, by the unsigned
# dtype holding their patterns: binary32 and binary64.
_FLOAT_LAYOUTS = {
    np.dtype(np.uint32): (F32_MANT_BITS, F32_BIAS),
    np.dtype(np.uint64): (F64_MANT_BITS, F64_BIAS),
}


def encode_bits(
    fmt: ElementFormat, u, rounding: Union[str, Rounding], overflow: Union[str, Overflow],
    random_bits, scale_exp=None, assume_finite: bool = False,
):
    """Core encoder on float bit patterns (uint32: float32, uint64: float64); int32 codes.

    Options are canonical (validated by the caller): :class:`Rounding` and :class:`Overflow`
    members or their values, ``random_bits`` the uint32 words of stochastic rounding (as
    ``round_shift`` compares them; None otherwise). With ``scale_exp`` (an int32 array
    broadcastable to ``u``), encodes ``value * 2^-scale_exp`` exactly, by moving the
    exponent rather than multiplying (MX block scaling). ``assume_finite``: skip the
    NaN/Inf handling (the caller overwrites those results).
    """
    rounding, overflow = Rounding(rounding), Overflow(overflow)
    if fmt.encoding == "tapered":  # HiFloat8: a binade-dependent mantissa width
        assert scale_exp is None, "tapered formats are not block elements"
        return _tapered.encode_bits(fmt, u, rounding, overflow, random_bits)
    stochastic = rounding is Rounding.STOCHASTIC
    udt = u.dtype
    if scale_exp is None and np.dtype(udt) == np.uint32 and overflow is Overflow.IEEE:
        if (rounding is Rounding.NEAREST_EVEN or stochastic) and rebias_encodable(fmt):
            return encode_rebias(fmt, u, random_bits if stochastic else None)
        if rounding in (Rounding.NEAREST_EVEN, Rounding.NEAREST_AWAY) and is_e8m0(fmt):
            return encode_e8m0_nearest(u)  # both take a tie between powers of two up
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
        if overflow is Overflow.SATURATE:
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
    if fmt.ties == "code" and fmt.mantissa_bits == 0 and rounding is Rounding.NEAREST_EVEN:
        # P3109 precision 1: a tie between 2^e and 2^(e+1) goes to the even *code* (the
        # significand rule would always pick 2^(e+1)). Undo the round-up at ties of even codes.
        s = jnp.minimum(shift, width - 1).astype(udt)
        one = jnp.asarray(1, udt)
        tie = (sig & (lax.shift_left(one, s) - one)) == lax.shift_left(one, s - one)
        code = jnp.where(tie & ((code & 1) == 1) & (mag_q > 0), code - 1, code)

    if not fmt.zero and overflow is Overflow.IEEE and rounding.nearest:
        # ml_dtypes quirk, reproduced under the default policy: in the lowest binade
        # (2^-127, 2^-126) every value rounds UP to 2^-126, not to the nearest power of two.
        above_min = (e_x == fmt.emin) & ((sig & (sig - 1)) != 0)
        code = jnp.where(above_min, 1, code)

    max_code = fmt.max_magnitude_code
    overflow_code = (
        fmt.inf_code if fmt.inf else fmt.nan_code if fmt.nan != "none" else max_code
    )
    if overflow is Overflow.SATURATE:
        to_inf = jnp.zeros_like(code, dtype=bool)
    else:
        to_inf = rounding.overflows_to_inf(sign)
    code = jnp.where(code > max_code, jnp.where(to_inf, overflow_code, max_code), code)
    inf_result = overflow_code if overflow is Overflow.IEEE else max_code
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
