"""The public element API: ``encode`` (float → code), ``decode`` (code → float) and
``quantize`` (both, with a straight-through gradient).

Each validates its options once into an :class:`~lowprec._options.ElementCast` and runs a
jitted core built from the bit-level encoders (``_encode.py``, ``_encode_stochastic.py``),
decoders (``_decode.py``) and dtype conversions (``_dtypes.py``).
"""

from __future__ import annotations

import functools
from typing import Optional, Union

import jax
import jax.numpy as jnp

from ._bits import f32_bits
from ._decode import decode_f32
from ._dtypes import (
    bits_to_dtype,
    check_float_dtype,
    check_input_dtype,
    check_result_dtype,
    codes_from_storage,
    host_decode,
    input_bits,
    value_not_held,
)
from ._encode_stochastic import encode_any
from ._format import ElementFormat, ElementFormatLike, array_then_format, element_format
from ._options import ElementCast
from ._rounding import Overflow, Rounding


@functools.partial(jax.jit, static_argnums=(0,))
def _encode_jit(cast: ElementCast, x, rng):
    code = encode_any(cast.fmt, input_bits(x), cast.rounding, cast.overflow, rng)
    return code.astype(cast.fmt.code_dtype)


def encode(
    x,
    fmt: ElementFormatLike,
    *,
    rounding: Union[str, Rounding] = "nearest_even",
    overflow: Union[str, Overflow] = "ieee",
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
      rounding: a :class:`~lowprec.Rounding` member or its name: ``"nearest_even"``
        (default), ``"nearest_away"``, ``"nearest_toward_zero"``, ``"toward_zero"``, ``"up"``,
        ``"down"``, ``"stochastic"`` (needs ``key`` or ``random_bits``); for e8m0 also ``"floor"`` and
        ``"ceil"`` (= down / up to a power of two).
      overflow: an :class:`~lowprec.Overflow` member or its name: ``"ieee"`` (default; equals ml_dtypes ``astype``: e4m3 overflow → NaN,
        e5m2/fp16/bf16/tf32/e4m3ieee/e3m4 → ±inf, the fnuz formats → their NaN 0x80, e2m1 and
        FP6 saturate, e8m0 → 0xFF; directed modes follow IEEE 754 §7.4 and round toward zero
        to ±max) or ``"saturate"`` (±max, also for ±inf).
      key: PRNG key for stochastic rounding. Element i rounds away from zero iff
        ``lowprec.random_bits(key, x.shape)[i] < frac_i * 2**16``, frac_i being its
        distance from the value toward zero in units of the gap: with probability
        ⌈frac_i·2^16⌉/2^16, so E[q(x)] = x exactly when frac_i is a multiple of 2^-16
        (bf16, fp16 from float32 normals) and within 2^-16 of a gap otherwise. The
        16-bit words come from a keyed hash of the element index
        (:func:`lowprec.random_bits`; contract in docs/design.md §2), drawn inside the
        call.
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
    codes = codes_from_storage(codes, fmt)
    if not jnp.issubdtype(codes.dtype, jnp.integer):
        raise TypeError(
            f"codes must be an integer array (as returned by encode), got dtype {codes.dtype}; "
            "to round numbers use quantize() or encode()"
        )
    return _decode_jit(fmt, codes, check_float_dtype(dtype))


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
    rounding: Union[str, Rounding] = "nearest_even",
    overflow: Union[str, Overflow] = "ieee",
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
      dtype: result dtype (float32, float64, bfloat16, float16 or an ml_dtypes float). It
        must hold every value of ``fmt`` exactly — significand bits, range, infinities and
        NaN — or a ValueError names a value it misses: the result would be rounded a second
        time (e4m3's 0.1015625 as float8_e5m2 is 0.09375; its 448 as float4_e2m1fn is 6).
        Default: ``x``'s dtype when it holds them (float32/float64 always; bfloat16 for the
        FP8/FP4 formats), otherwise the same error asks you to choose (e.g.
        ``quantize(bf16_array, "fp16")``: pass ``dtype=jnp.float32``).

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
        missing = value_not_held(cast.fmt, x.dtype)
        if missing is not None:
            raise ValueError(
                f"values of {cast.fmt.name!r} are not all representable in the input dtype "
                f"{x.dtype} ({missing} is not); pass dtype=jnp.float32 (exact)"
            )
    dtype = check_float_dtype(dtype)
    check_result_dtype(cast.fmt, dtype)
    return _quantize_jit(cast, x, rng, dtype)
