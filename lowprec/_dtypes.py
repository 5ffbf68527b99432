"""Float dtypes in and out of the element codec: which dtypes lowprec reads and writes, and
the exact conversions between them and float32 bit patterns.

Narrow float inputs (float16, bfloat16, the ml_dtypes floats) are widened to float32
patterns by decoding them as the element format of their layout, and float32 patterns are
narrowed to those dtypes by encoding them: integer operations only, so NaN signs and
subnormals survive on every backend (docs/design.md §8). NumPy arrays of the 6-bit floats,
which JAX cannot hold, are decoded on the host.
"""

from __future__ import annotations

from typing import Optional

import jax.numpy as jnp
import numpy as np
from jax import lax

import lowprec_formats as _data

from ._bits import (
    F32_BIAS,
    F32_EXP_MAX,
    F32_MANT,
    F32_MANT_BITS,
    F32_MIN_LSB_EXP,
    F32_SIGN_SHIFT,
    F64_BIAS,
    F64_EXP_MAX,
    F64_MANT_BITS,
    F64_SIGN_SHIFT,
    bits_to_f32,
)
from ._decode import decode_bits
from ._encode import encode_bits
from ._format import ElementFormat, element_format
from ._rounding import Overflow, Rounding


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
WIDENED_AS = _widened_formats()
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
    fmt = element_format(WIDENED_AS[np.dtype(x.dtype)])
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
    if dt in (np.dtype(np.float32), np.dtype(np.float64)) or dt in WIDENED_AS:
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
    if dt not in (np.dtype(np.float32), np.dtype(np.float64)) and dt not in WIDENED_AS:
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
    name = WIDENED_AS.get(dtype)
    if name is not None:
        fmt = element_format(name)
        code = encode_bits(fmt, bits, Rounding.NEAREST_EVEN, Overflow.IEEE, None)
        return lax.bitcast_convert_type(code.astype(_code_uint(fmt.code_bits)), dtype)
    return f32_bits_to_f64(bits)


def f32_bits_to_f64(bits):
    """Exact float32 → float64 from the bits (needs ``jax_enable_x64``)."""
    b = bits.astype(jnp.uint64)
    sign = lax.shift_left(lax.shift_right_logical(b, jnp.uint64(F32_SIGN_SHIFT)),
                          jnp.uint64(F64_SIGN_SHIFT))
    e = lax.shift_right_logical(b, jnp.uint64(F32_MANT_BITS)) & F32_EXP_MAX
    m = b & F32_MANT
    # Rebias 127 → 1023 (+896); the top exponent (inf/NaN) maps to 0x7FF with its payload.
    to_f64 = jnp.uint64(F64_MANT_BITS - F32_MANT_BITS)
    normal = lax.shift_left(e + (F64_BIAS - F32_BIAS), jnp.uint64(F64_MANT_BITS)) | lax.shift_left(
        m, to_f64)
    special = lax.shift_left(jnp.uint64(F64_EXP_MAX), jnp.uint64(F64_MANT_BITS)) | lax.shift_left(
        m, to_f64)
    # A float32 subnormal m * 2^-149 is a float64 normal: convert the integer m (exact) and
    # lower its exponent field by 149.
    sub = lax.bitcast_convert_type(m.astype(jnp.float64), jnp.uint64)
    sub = jnp.where(m == 0, jnp.uint64(0),
                    sub - lax.shift_left(jnp.uint64(-F32_MIN_LSB_EXP), jnp.uint64(F64_MANT_BITS)))
    out = jnp.where(e == 0, sub, jnp.where(e == F32_EXP_MAX, special, normal))
    return lax.bitcast_convert_type(out | sign, jnp.float64)


def codes_from_storage(codes, fmt: ElementFormat):
    """Codes held in ``fmt``'s own ml_dtypes dtype (e.g. a float8_e4m3fn array for "e4m3")
    as unsigned integers, by bitcast; any other array as a JAX array. A float array of another
    format's dtype is refused: its bits would mean something else."""
    dt = np.dtype(getattr(codes, "dtype", np.float32 if isinstance(codes, float) else np.int32))
    if dt not in WIDENED_AS and dt not in _HOST_ONLY:
        return jnp.asarray(codes)
    if dt != fmt.storage_dtype:
        raise TypeError(
            f"codes have dtype {dt}, the storage type of "
            f"{(WIDENED_AS.get(dt) or _HOST_ONLY.get(dt))!r}, not of {fmt.name!r}; decode them "
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


def value_not_held(fmt: ElementFormat, dtype) -> Optional[str]:
    """A value of ``fmt`` that the float ``dtype`` does not hold exactly (as text), or None
    when ``dtype`` holds every value of ``fmt``: its finite values (significand bits, largest
    value, smallest subnormal) and its infinities and NaN.

    Example:
        >>> from lowprec._format import element_format
        >>> value_not_held(element_format("e4m3"), jnp.float8_e5m2)  # 1 + 2^-3
        '1.125'
        >>> value_not_held(element_format("e4m3"), jnp.bfloat16) is None
        True
    """
    dt = np.dtype(dtype)
    info = jnp.finfo(dt)
    if fmt.exponent_bits == 0:
        # Integer-like elements (int4, ocp_int8): every value is m x 2^c with m < 2^mantissa_bits,
        # so the largest, all magnitude bits set, needs mantissa_bits - 1 bits after its leading 1.
        if fmt.mantissa_bits - 1 > info.nmant:
            return repr(fmt.max_finite)
    elif fmt.mantissa_bits > info.nmant:  # 1 + 2^-m: the format's step above 1
        return repr(1.0 + 2.0 ** -fmt.mantissa_bits)
    if fmt.emax > info.maxexp - 1 or fmt.max_finite > float(info.max):
        return repr(fmt.max_finite)
    if fmt.emin - fmt.mantissa_bits < info.minexp - info.nmant:
        return repr(fmt.min_subnormal)
    if dt in (np.dtype(np.float32), np.dtype(np.float64)):
        return None
    held = element_format(WIDENED_AS[dt])
    if fmt.inf and not held.inf:
        return "inf"
    if fmt.nan_code is not None and held.nan_code is None:
        return "NaN"
    return None


def check_result_dtype(fmt: ElementFormat, dtype) -> None:
    """ValueError unless ``dtype`` holds every value of ``fmt`` exactly (see
    :func:`value_not_held`): a result rounded to ``fmt`` and then to ``dtype`` would be
    rounded twice (e4m3's 0.1015625 becomes float8_e5m2's 0.09375)."""
    missing = value_not_held(fmt, dtype)
    if missing is None:
        return
    name = np.dtype(dtype).name
    exact = [n for n in ("bfloat16", "float16") if value_not_held(fmt, n) is None] + ["float32"]
    raise ValueError(
        f"dtype={name} cannot hold every value of {fmt.name!r} exactly ({missing} is not a "
        f"{name} value): the result would be rounded a second time. Use dtype={exact[0]} "
        "or any float holding them (float32 holds every format); to round twice on purpose, "
        "convert the result yourself"
    )