"""Private helpers shared by the analysis modules: exact powers of two, input checks,
format resolution and the one argument order (array first, format second).

Powers of two are built from float32 bits, never with ``exp2``/``log2`` in floating point.
"""

from __future__ import annotations

import warnings
from typing import Union

import jax
import jax.numpy as jnp
from jax import lax

from .._format import ElementFormat, MXFormat, element_format, mx_format

FormatLike = Union[str, ElementFormat]
AnyFormatLike = Union[str, ElementFormat, MXFormat]

# float32 layout facts: 8 exponent bits biased by 127, 23 stored mantissa bits, so the
# smallest normal is 2^-126 and the smallest subnormal 2^-149 (= 2^(-126-23)).
_F32_BIAS = 127
_F32_MANT = 23
_E8M0_BIAS = 127  # E8M0 code c encodes 2^(c - 127)
_E8M0_NAN = 0xFF


def pow2(n):
    """float32 2^n from bits, exact for n in [-149, 127]; 0 below, inf above."""
    n = jnp.asarray(n, jnp.int32)
    normal = lax.shift_left(jnp.clip(n + _F32_BIAS, 1, 254).astype(jnp.uint32), jnp.uint32(_F32_MANT))
    sub = lax.shift_left(jnp.uint32(1), jnp.clip(n + 149, 0, 22).astype(jnp.uint32))
    bits = jnp.where(n >= -126, normal, jnp.where(n >= -149, sub, jnp.uint32(0)))
    bits = jnp.where(n > 127, jnp.uint32(0x7F80_0000), bits)
    return lax.bitcast_convert_type(bits, jnp.float32)


def times_pow2(v, n):
    """``v * 2^n`` for float32 ``v`` and int ``n``: exact whenever the result is normal.

    The factor is applied in two halves, each a normal float32, so 2^n itself never has to
    be representable (n is clipped to [-252, 252], far beyond float32's range).
    """
    n = jnp.clip(jnp.asarray(n, jnp.int32), -252, 252)
    a = jnp.floor_divide(n, 2)
    return (jnp.asarray(v, jnp.float32) * pow2(a)) * pow2(n - a)


def floor_log2(x):
    """floor(log2 |x|) of a float32 array from its bits (int32; 0 gives -150)."""
    bits = lax.bitcast_convert_type(jnp.asarray(x, jnp.float32), jnp.uint32) & 0x7FFF_FFFF
    efield = lax.shift_right_logical(bits, jnp.uint32(_F32_MANT)).astype(jnp.int32)
    sig = jnp.where(efield > 0, (bits & 0x7F_FFFF) | 0x80_0000, bits & 0x7F_FFFF)
    return jnp.maximum(efield, 1) - 150 + 31 - lax.clz(sig).astype(jnp.int32)


def as_f32(x, what: str = "x"):
    """``x`` as float32, refusing integer and boolean arrays (float64 is rounded first)."""
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(
            f"{what} must be a floating-point array, got dtype {x.dtype}; convert it with "
            f"{what}.astype(jnp.float32)"
        )
    return x.astype(jnp.float32)


def scalar(value):
    """A 0-d result as a Python float, or unchanged while traced (jit, vmap, grad)."""
    if isinstance(value, jax.core.Tracer):
        return value
    return float(value)


def is_format(obj) -> bool:
    return isinstance(obj, (str, ElementFormat, MXFormat))


def resolve(fmt: AnyFormatLike) -> Union[ElementFormat, MXFormat]:
    """An element or MX format object from a name or an object."""
    if isinstance(fmt, (ElementFormat, MXFormat)):
        return fmt
    if not isinstance(fmt, str):
        raise TypeError(
            f"format must be a name or a format object, got {type(fmt).__name__}: {fmt!r}"
        )
    try:
        return element_format(fmt)
    except ValueError as element_error:
        try:
            return mx_format(fmt)
        except ValueError:
            raise element_error from None


def array_first(fn_name: str, *args):
    """Returns ``args`` in the order (arrays..., format), accepting the old (format, arrays...).

    The analysis API takes the array first and the format second, as ``quantize_mx(x, fmt)``.
    The earlier order ``f(fmt, x)`` of the element helpers still works for now, with a
    DeprecationWarning that names the new call.
    """
    if is_format(args[0]) and not is_format(args[-1]):
        name = args[0] if isinstance(args[0], str) else args[0].name
        warnings.warn(
            f"{fn_name}(fmt, ...) is deprecated: lowprec.analysis takes the array first and "
            f"the format second, e.g. {fn_name}(x, {name!r})",
            DeprecationWarning,
            stacklevel=3,
        )
        return (*args[1:], args[0])
    return args
