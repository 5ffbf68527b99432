"""MX+ (Lee et al., arXiv 2510.14557, MICRO 2025): the block maximum's exponent bits become
extra mantissa bits.

Under OCP MX's floor scale rule a block's largest magnitude, divided by the shared scale
2^e, always lies in the element format's top binade [2^emax, 2^(emax+1)), so its exponent
field carries no information. MX+ keeps the block maximum's (BM's) sign bit and spends every
other bit of its code on the significand: an E2M1 BM becomes ±1.mmm × 2^2 (4, 4.5, ..., 7.5
times the scale, instead of 4 or 6), an E4M3 BM ±1.mmmmmmm × 2^8. The BM's position in the
block is stored beside the scale; every other element is an ordinary MX element.

The paper's public text does not fix every bit; lowprec's choices (docs/design.md §3c):

* scales: OCP MX v1.0 §6.3's floor rule (MX+ builds on MX); the BM is the *first* element of
  largest magnitude;
* the BM's code: its sign bit where the element's sign bit is, the E + M remaining bits an
  integer m, value (1 + m / 2^(E+M)) · 2^emax · 2^e; m rounded to nearest even, saturating
  at all ones (a BM rounding up to 2^(emax+1) keeps the largest code, as MX elements
  saturate);
* the BM index: one byte per block (``bm_index``), 0xFF where the block has no BM in that
  binade — an all-zero block, or one whose shared exponent was clamped at -127 — whose codes
  are then all ordinary; a block holding NaN or inf has scale 0xFF and index 0xFF;
* storage: element bits + 16 / block bits per element (8 for the scale, 8 for the index: 4.5
  for MXFP4+ at 32).

The scheme of a block format decodes codes from the block's scale alone (``_scheme.py``): a
per-block side value such as the BM index has no place in :class:`~lowprec.MXArray`, so MX+
has its own array type and functions here.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ._bits import F32_ABS, F32_MANT, F32_MANT_BITS
from ._blocks import merge_blocks, normalize_axis, split_blocks
from ._dtypes import bits_to_dtype, check_float_dtype
from ._format import MXFormat, MXFormatLike, array_then_format, mx_format
from ._mx_decode import mx_value_bits
from ._mx_encode import encode_blocks, padded_bits
from ._mxarray import MXArray
from ._options import MXCast
from ._pack import pack_along, unpack_along
from ._rounding import round_shift
from .kernels._dispatch import fp6_packer, fp6_unpacker

#: The bm_index of a block without a BM (all zero, clamped, or NaN/inf).
NO_BM = 0xFF


def check_plus_format(fmt: MXFormat, func: str) -> MXFormat:
    """``fmt`` if MX+ applies to it: E8M0-scaled floating-point elements with an exponent
    field (not INT8), a block of at most 255 elements (the index is a byte)."""
    el = fmt.element
    if not (fmt.scheme.exponent_scales and el.exponent_bits > 0
            and el.encoding == "sign_magnitude" and fmt.block_size <= NO_BM):
        raise ValueError(
            f"{func}: MX+ extends E8M0-scaled floating-point MX formats (MXFP8, MXFP6, MXFP4) "
            f"whose block maximum has an exponent field to repurpose; got {fmt.name}")
    return fmt


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["elements", "scales", "bm_index"],
    meta_fields=["fmt", "axis", "shape"],
)
@dataclasses.dataclass(frozen=True)
class MXPlusArray:
    """An MX+ block-quantized array (a JAX pytree): the codes and scales of an
    :class:`~lowprec.MXArray` of ``fmt`` (floor scale rule) in which each block's maximum has
    MX+'s extended code, plus the position of that element in its block.

    Attributes:
      elements: uint8 element codes (packed as in an MXArray).
      scales: uint8 E8M0 scale codes, one per block.
      bm_index: uint8 position of each block's maximum (0xFF: none), the scales' shape.
      fmt: the base MX format (``"mxfp4"`` for MXFP4+).
      axis: the block axis; shape: the unpadded shape (static).

    Decode with :func:`dequantize_mx_plus`: :func:`lowprec.dequantize` of the same codes would
    read each block maximum as an ordinary element.

    Example:
        >>> import jax.numpy as jnp
        >>> a = quantize_mx_plus(jnp.array([7.0] + [1.0] * 31), "mxfp4")
        >>> int(a.bm_index[0]), float(dequantize_mx_plus(a)[0])   # MXFP4 would give 6
        (0, 7.0)
    """

    elements: jax.Array
    scales: jax.Array
    bm_index: jax.Array
    fmt: MXFormat
    axis: int
    shape: tuple

    def __post_init__(self):
        fmt = mx_format(self.fmt)
        check_plus_format(fmt, "MXPlusArray")
        shape = tuple(operator.index(d) for d in self.shape)
        object.__setattr__(self, "fmt", fmt)
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "axis", normalize_axis(self.axis, len(shape), "MXPlusArray axis"))
        leaves = (self.elements, self.scales, self.bm_index)
        if not all(hasattr(v, "shape") and hasattr(v, "dtype") for v in leaves):
            return  # placeholders while JAX rebuilds the pytree
        MXArray(self.elements, self.scales, fmt, self.axis, shape)  # the codes' own checks
        idx = self.bm_index
        if np.dtype(idx.dtype) != np.uint8 or tuple(idx.shape) != tuple(self.scales.shape):
            raise ValueError(
                f"MXPlusArray: bm_index must be uint8 with the scales' shape "
                f"{tuple(self.scales.shape)}, got {np.dtype(idx.dtype)}{list(idx.shape)}")
        if isinstance(idx, (np.ndarray, np.generic)) or (
                isinstance(idx, jax.Array) and not isinstance(idx, jax.core.Tracer)):
            values = np.asarray(idx)
            bad = (values >= fmt.block_size) & (values != NO_BM)
            if bad.any():
                raise ValueError(
                    f"MXPlusArray: bm_index {int(values[bad].flat[0])} is not a position in a "
                    f"block of {fmt.block_size} (or {NO_BM:#x}, no block maximum)")


def _extended_bits(fmt: MXFormat) -> int:
    """Bits of the BM's significand: every code bit but the sign (E + M)."""
    return fmt.element.magnitude_bits


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _quantize_jit(x, cast: MXCast, axis: int, padded: int):
    fmt = cast.fmt
    block = fmt.block_size
    bits = padded_bits(x, axis, padded)
    elements, scales, _ = encode_blocks(bits, cast, axis)
    inner = axis + 1
    xb = split_blocks(bits, axis, block)
    mag = xb & jnp.uint32(F32_ABS)
    index = jnp.argmax(mag, axis=inner).astype(jnp.int32)  # the first largest magnitude
    el = fmt.element
    s = scales.astype(jnp.int32) - 127
    amax = jnp.max(mag, axis=inner)
    # The BM's binade relative to the scale: floor(log2 amax) - s = emax unless s was clamped.
    amax_exp = lax.shift_right_logical(amax, jnp.uint32(F32_MANT_BITS)).astype(jnp.int32) - 127
    has_bm = (scales != 0xFF) & (amax != 0) & (amax_exp - s == el.emax)
    # m = the BM's float32 significand rounded to E + M fraction bits (nearest even), its
    # carry to 2^(emax+1) saturated at all ones.
    width = _extended_bits(fmt)
    sig = (amax & jnp.uint32(F32_MANT)) | jnp.uint32(1 << F32_MANT_BITS)
    r = round_shift(sig, jnp.full(sig.shape, F32_MANT_BITS - width, jnp.int32),
                    jnp.zeros_like(sig), "nearest_even")
    m = jnp.minimum(r, (2 << width) - 1) - (1 << width)
    bm_x = jnp.take_along_axis(xb, jnp.expand_dims(index, inner), axis=inner)
    sign = lax.shift_right_logical(jnp.squeeze(bm_x, inner), jnp.uint32(31)).astype(jnp.int32)
    bm_code = (m | (sign << width)).astype(jnp.uint8)
    packed = split_blocks(elements, axis, fmt.bytes_per_block)
    codes = unpack_along(packed, inner, el.code_bits, fp6_unpacker(packed, inner))
    at_bm = (lax.broadcasted_iota(jnp.int32, codes.shape, inner)
             == jnp.expand_dims(index, inner)) & jnp.expand_dims(has_bm, inner)
    codes = jnp.where(at_bm, jnp.expand_dims(bm_code, inner), codes)
    elements = merge_blocks(pack_along(codes, inner, el.code_bits, fp6_packer(codes, inner)),
                            axis)
    bm_index = jnp.where(has_bm, index, NO_BM).astype(jnp.uint8)
    return elements, scales, bm_index


def quantize_mx_plus(
    x,
    fmt: MXFormatLike,
    *,
    axis: int = -1,
    pad: bool = False,
    block_size: Optional[int] = None,
) -> MXPlusArray:
    """Block-quantizes ``x`` to MX+ over an E8M0-scaled MX float format (MXFP4+, MXFP6+,
    MXFP8+): the OCP floor scale of each block, ordinary elements, and each block maximum
    with its exponent bits spent on its significand.

    Args:
      x: float32, bfloat16 or float16 array (as :func:`lowprec.quantize_mx`).
      fmt: ``"mxfp4"``, ``"mxfp6_e2m3"``, ``"mxfp6_e3m2"``, ``"mxfp8_e4m3"``, ``"mxfp8_e5m2"``
        (or an MXFormat of those elements with E8M0 scales), any block size up to 128.
      axis: the block axis; pad: zero-pad it to whole blocks; block_size: another block size.

    Returns:
      An :class:`MXPlusArray`; decode it with :func:`dequantize_mx_plus`.

    Example:
        >>> import jax.numpy as jnp
        >>> x = jnp.array([5.2, -0.75, 1.0, 0.5] * 8)
        >>> a = quantize_mx_plus(x, "mxfp4")
        >>> dequantize_mx_plus(a)[:4].tolist()   # MXFP4: 6.0 for 5.2; MXFP4+: 5.0
        [5.0, -1.0, 1.0, 0.5]
    """
    x, fmt = array_then_format(x, fmt, "quantize_mx_plus")
    cast = MXCast(check_plus_format(mx_format(fmt, block_size), "quantize_mx_plus"), "floor")
    call = cast.check_call(x, "quantize_mx_plus", axis=axis, pad=pad)
    elements, scales, bm_index = _quantize_jit(call.x, cast, call.axis, call.padded)
    return MXPlusArray(elements, scales, bm_index, cast.fmt, call.axis, tuple(call.x.shape))


@functools.partial(jax.jit, static_argnums=(3, 4, 5, 6))
def _dequantize_jit(elements, scales, bm_index, fmt: MXFormat, axis: int, n: int, dtype):
    bits = mx_value_bits(elements, scales, fmt, axis, elements.shape[axis] * 8
                         // fmt.element.code_bits)
    inner = axis + 1
    block = fmt.block_size
    vb = split_blocks(bits, axis, block)
    packed = split_blocks(elements, axis, fmt.bytes_per_block)
    codes = unpack_along(packed, inner, fmt.element.code_bits,
                         fp6_unpacker(packed, inner)).astype(jnp.uint32)
    width = _extended_bits(fmt)
    bm = jnp.take_along_axis(codes, jnp.expand_dims(bm_index.astype(jnp.int32) % block, inner),
                             axis=inner)
    bm = jnp.squeeze(bm, inner)
    m = bm & jnp.uint32((1 << width) - 1)
    # (1 + m / 2^width) * 2^(emax + s): a float32 normal (s > -127 for every block with a BM).
    field = (fmt.element.emax + scales.astype(jnp.int32) - 127 + 127).astype(jnp.uint32)
    value = (lax.shift_left(field, jnp.uint32(F32_MANT_BITS))
             | lax.shift_left(m, jnp.uint32(F32_MANT_BITS - width)))
    value = value | lax.shift_left(lax.shift_right_logical(bm, jnp.uint32(width)) & 1,
                                   jnp.uint32(31))
    at_bm = (lax.broadcasted_iota(jnp.int32, vb.shape, inner)
             == jnp.expand_dims(bm_index.astype(jnp.int32), inner))
    out = merge_blocks(jnp.where(at_bm, jnp.expand_dims(value, inner), vb), axis)
    return bits_to_dtype(lax.slice_in_dim(out, 0, n, axis=axis), dtype)


def dequantize_mx_plus(a: MXPlusArray, dtype=jnp.float32) -> jax.Array:
    """The values of an :class:`MXPlusArray` as ``dtype``: each element as its MX format
    decodes it, each block maximum as ±(1 + m / 2^(E+M)) · 2^(emax + s); exact in float32
    (a narrower ``dtype`` rounds to nearest even).

    Example:
        >>> import jax.numpy as jnp
        >>> a = quantize_mx_plus(jnp.array([-3.3, 0.5] * 16), "mxfp4")
        >>> dequantize_mx_plus(a)[:2].tolist()
        [-3.25, 0.5]
    """
    if not isinstance(a, MXPlusArray):
        raise TypeError(f"dequantize_mx_plus takes an MXPlusArray (from quantize_mx_plus), got "
                        f"{type(a).__name__}")
    dtype = check_float_dtype(dtype)
    return _dequantize_jit(a.elements, a.scales, a.bm_index, a.fmt, a.axis, a.shape[a.axis],
                           dtype)

