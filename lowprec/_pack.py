"""Packing of 4-bit codes two per byte: element 2k in the low nibble, 2k+1 in the high one.

This is the OCP MX / gpt-oss / Hugging Face MXFP4 byte layout.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from ._blocks import normalize_axis


def pack_fp4(codes, axis: int = -1) -> jnp.ndarray:
    """Packs 4-bit codes (uint8 values 0..15) two per byte along ``axis``.

    Args:
      codes: integer array; only the low 4 bits of each entry are kept.
      axis: axis to pack along; its length must be even.

    Returns:
      uint8 array with ``axis`` halved: byte k = codes[2k] | codes[2k+1] << 4.

    Example:
        >>> import jax.numpy as jnp
        >>> pack_fp4(jnp.array([0x1, 0x2, 0xF, 0x8], jnp.uint8)).tolist()
        [33, 143]
    """
    codes = jnp.asarray(codes)
    if not jnp.issubdtype(codes.dtype, jnp.integer):
        raise TypeError(f"pack_fp4 takes integer codes, got dtype {codes.dtype}")
    axis = normalize_axis(axis, codes.ndim)
    n = codes.shape[axis]
    if n % 2:
        raise ValueError(
            f"pack_fp4 needs an even length along axis {axis}, got {n}; pad the codes first"
        )
    c = jnp.moveaxis(codes.astype(jnp.uint8), axis, -1)
    return jnp.moveaxis(pack_last(c), -1, axis)


def pack_last(c):
    """Packs uint8 codes along the last axis (even length)."""
    # View each (even, odd) pair as one little-endian uint16 and fold the odd code's nibble
    # down next to the even one's: one fused elementwise pass instead of strided slices.
    pairs = lax.bitcast_convert_type(c.reshape(*c.shape[:-1], c.shape[-1] // 2, 2), jnp.uint16)
    folded = (pairs & 0xF) | (lax.shift_right_logical(pairs, jnp.uint16(4)) & 0xF0)
    return folded.astype(jnp.uint8)


def unpack_last(p):
    """Inverse of :func:`pack_last`."""
    wide = p.astype(jnp.uint16)
    pairs = (wide & 0xF) | lax.shift_left(wide & 0xF0, jnp.uint16(4))
    both = lax.bitcast_convert_type(pairs, jnp.uint8)
    return both.reshape(*p.shape[:-1], p.shape[-1] * 2)


def pack_pairs(c, axis: int):
    """Packs uint8 codes along ``axis`` (even length) in place, without a transpose."""
    if axis == c.ndim - 1:
        return pack_last(c)
    pairs = c.reshape(*c.shape[:axis], c.shape[axis] // 2, 2, *c.shape[axis + 1 :])
    even = lax.index_in_dim(pairs, 0, axis + 1, keepdims=False)
    odd = lax.index_in_dim(pairs, 1, axis + 1, keepdims=False)
    return (even & 0xF) | lax.shift_left(odd, jnp.uint8(4))


def unpack_pairs(p, axis: int):
    """Inverse of :func:`pack_pairs`. (Stacking the two nibbles fuses into the consumer as
    well as :func:`unpack_last` does, and measured ~1.2x faster in MXFP4 dequantization.)"""
    both = jnp.stack([p & 0xF, lax.shift_right_logical(p, jnp.uint8(4))], axis=axis + 1)
    return both.reshape(*p.shape[:axis], p.shape[axis] * 2, *p.shape[axis + 1 :])


def unpack_fp4(packed, axis: int = -1) -> jnp.ndarray:
    """Inverse of :func:`pack_fp4`: uint8 bytes → uint8 codes 0..15, ``axis`` doubled.

    Example:
        >>> import jax.numpy as jnp
        >>> unpack_fp4(jnp.array([0x21, 0x8F], jnp.uint8)).tolist()
        [1, 2, 15, 8]
    """
    packed = jnp.asarray(packed)
    if packed.dtype != jnp.uint8:
        raise TypeError(f"unpack_fp4 takes uint8 bytes, got dtype {packed.dtype}")
    axis = normalize_axis(axis, packed.ndim)
    return jnp.moveaxis(unpack_last(jnp.moveaxis(packed, axis, -1)), -1, axis)
