"""Packing of sub-byte codes along an axis, as a little-endian bit stream.

FP4 (4-bit codes): two per byte, element 2k in the low nibble and 2k+1 in the high one — the
OCP MX / gpt-oss / Hugging Face MXFP4 byte layout. FP6 (6-bit codes): four per three bytes,
code j of a group in bits 6j..6j+5 of the little-endian 24-bit word the three bytes form
(byte 0 = bits 0..7), so code 0 fills the low 6 bits of byte 0 — the layout of AMD
rocRoller's FP6 buffers (``getFp6``) and the same low-bits-first order as FP4.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from ._blocks import normalize_axis

#: (codes, bytes) of one packing group by code width: 2 FP4 codes per byte, 4 FP6 codes per
#: 3 bytes (lcm(6, 8) = 24 bits).
GROUPS = {4: (2, 1), 6: (4, 3), 8: (1, 1)}


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
    return _pack_axis(codes, axis, 4, "pack_fp4")


def pack_fp6(codes, axis: int = -1) -> jnp.ndarray:
    """Packs 6-bit codes (uint8 values 0..63) four to three bytes along ``axis``.

    Args:
      codes: integer array; only the low 6 bits of each entry are kept.
      axis: axis to pack along; its length must be a multiple of 4.

    Returns:
      uint8 array with ``axis`` scaled by 3/4: bytes 3k..3k+2 hold the little-endian 24-bit
      word codes[4k] | codes[4k+1] << 6 | codes[4k+2] << 12 | codes[4k+3] << 18.

    Example:
        >>> import jax.numpy as jnp
        >>> [hex(b) for b in pack_fp6(jnp.array([0x3F, 0x00, 0x15, 0x2A], jnp.uint8)).tolist()]
        ['0x3f', '0x50', '0xa9']
    """
    return _pack_axis(codes, axis, 6, "pack_fp6")


def _pack_axis(codes, axis, bits: int, func: str):
    codes = jnp.asarray(codes)
    if not jnp.issubdtype(codes.dtype, jnp.integer):
        raise TypeError(f"{func} takes integer codes, got dtype {codes.dtype}")
    axis = normalize_axis(axis, codes.ndim)
    n = codes.shape[axis]
    per = GROUPS[bits][0]
    if n % per:
        need = "an even length" if per == 2 else f"a length that is a multiple of {per}"
        raise ValueError(f"{func} needs {need} along axis {axis}, got {n}; pad the codes first")
    c = jnp.moveaxis(codes.astype(jnp.uint8), axis, -1)
    return jnp.moveaxis(pack_last(c, bits), -1, axis)


def pack_last(c, bits: int = 4):
    """Packs uint8 codes of ``bits`` bits along the last axis (a multiple of the group size)."""
    if bits == 8:
        return c
    if bits == 6:
        return _pack6(c, c.ndim - 1)
    assert bits == 4, bits
    # View each (even, odd) pair as one little-endian uint16 and fold the odd code's nibble
    # down next to the even one's: one fused elementwise pass instead of strided slices.
    pairs = lax.bitcast_convert_type(c.reshape(*c.shape[:-1], c.shape[-1] // 2, 2), jnp.uint16)
    folded = (pairs & 0xF) | (lax.shift_right_logical(pairs, jnp.uint16(4)) & 0xF0)
    return folded.astype(jnp.uint8)


def unpack_last(p, bits: int = 4):
    """Inverse of :func:`pack_last`."""
    if bits == 8:
        return p
    if bits == 6:
        return _unpack6(p, p.ndim - 1)
    assert bits == 4, bits
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


def pack_along(c, axis: int, bits: int):
    """Packs uint8 codes of ``bits`` bits along ``axis`` (whole groups), in place: FP4 by
    :func:`pack_pairs`, FP6 by :func:`_pack6`, 8 bits as they are."""
    if bits == 8:
        return c
    if bits == 4:
        return pack_pairs(c, axis)
    return _pack6(c, axis)


def unpack_along(p, axis: int, bits: int):
    """Inverse of :func:`pack_along`."""
    if bits == 8:
        return p
    if bits == 4:
        return unpack_pairs(p, axis)
    return _unpack6(p, axis)


# FP6 along any axis, in place: four 6-bit codes per three bytes, the first code in the low
# bits of the first byte. The group's codes or bytes are split off next to the axis, so along
# an axis other than the last every loop XLA:CPU emits runs innermost over the trailing axes
# (moving the axis last and back instead costs two transposes, each as much as the encode).


def native_fp6(x, axis: int) -> bool:
    """Whether FP6 packing of ``x`` along ``axis`` takes the native CPU kernel where XLA
    lowers for CPU (static): along the last axis, as ``lowprec.kernels`` decides."""
    if axis != x.ndim - 1:
        return False
    from .kernels._dispatch import cpu_fp6_kernel  # noqa: PLC0415 - kernels imports this module
    return cpu_fp6_kernel(x)


def _pack6(c, axis: int):
    """Packs uint8 codes of 6 bits along ``axis`` (a multiple of 4 long): on CPU along the
    last axis by the native kernel where it is built (the same bytes, at copy speed), else
    by :func:`_pack6_xla`."""
    if native_fp6(c, axis):
        from .kernels._dispatch import on_cpu  # noqa: PLC0415
        from .kernels._fp6_cpu import pack_last  # noqa: PLC0415
        return on_cpu(pack_last, lambda c: _pack6_xla(c, axis), c.astype(jnp.uint8))
    return _pack6_xla(c, axis)


def _pack6_xla(c, axis: int):
    """:func:`_pack6` in XLA. The group's 24-bit word is a sum over the group axis: a
    reduction, which XLA fuses with the encoder that produces the codes without recomputing
    it per output byte (slices of the group feeding a stack did, 5x slower on CPU)."""
    shape = c.shape
    g = c.reshape(*shape[:axis], shape[axis] // 4, 4, *shape[axis + 1:]).astype(jnp.uint32)
    at = [1] * g.ndim
    at[axis + 1] = 4
    shifts = jnp.array([0, 6, 12, 18], jnp.uint32).reshape(at)
    word = jnp.sum(lax.shift_left(g & 0x3F, shifts), axis=axis + 1, dtype=jnp.uint32)
    out = jnp.stack([lax.shift_right_logical(word, jnp.uint32(s)).astype(jnp.uint8)
                     for s in (0, 8, 16)], axis=axis + 1)
    return out.reshape(*shape[:axis], shape[axis] // 4 * 3, *shape[axis + 1:])


def _unpack6(p, axis: int):
    """Inverse of :func:`_pack6` (the native kernel where :func:`native_fp6` says)."""
    if native_fp6(p, axis):
        from .kernels._dispatch import on_cpu  # noqa: PLC0415
        from .kernels._fp6_cpu import unpack_last  # noqa: PLC0415
        return on_cpu(unpack_last, lambda p: _unpack6_xla(p, axis), p)
    return _unpack6_xla(p, axis)


def _unpack6_xla(p, axis: int):
    """:func:`_unpack6` in XLA."""
    shape = p.shape
    b = p.reshape(*shape[:axis], shape[axis] // 3, 3, *shape[axis + 1:])
    b0, b1, b2 = (lax.index_in_dim(b, j, axis + 1, keepdims=False) for j in range(3))
    out = jnp.stack([
        b0 & 0x3F,
        lax.shift_right_logical(b0, jnp.uint8(6)) | lax.shift_left(b1 & 0xF, jnp.uint8(2)),
        lax.shift_right_logical(b1, jnp.uint8(4)) | lax.shift_left(b2 & 0x3, jnp.uint8(4)),
        lax.shift_right_logical(b2, jnp.uint8(2)),
    ], axis=axis + 1)
    return out.reshape(*shape[:axis], shape[axis] // 3 * 4, *shape[axis + 1:])


def unpack_fp4(packed, axis: int = -1) -> jnp.ndarray:
    """Inverse of :func:`pack_fp4`: uint8 bytes → uint8 codes 0..15, ``axis`` doubled.

    Example:
        >>> import jax.numpy as jnp
        >>> unpack_fp4(jnp.array([0x21, 0x8F], jnp.uint8)).tolist()
        [1, 2, 15, 8]
    """
    return _unpack_axis(packed, axis, 4, "unpack_fp4")


def unpack_fp6(packed, axis: int = -1) -> jnp.ndarray:
    """Inverse of :func:`pack_fp6`: uint8 bytes → uint8 codes 0..63, ``axis`` scaled by 4/3.

    Example:
        >>> import jax.numpy as jnp
        >>> [hex(c) for c in unpack_fp6(jnp.array([0x3F, 0x50, 0xA9], jnp.uint8)).tolist()]
        ['0x3f', '0x0', '0x15', '0x2a']
    """
    return _unpack_axis(packed, axis, 6, "unpack_fp6")


def _unpack_axis(packed, axis, bits: int, func: str):
    packed = jnp.asarray(packed)
    if packed.dtype != jnp.uint8:
        raise TypeError(f"{func} takes uint8 bytes, got dtype {packed.dtype}")
    axis = normalize_axis(axis, packed.ndim)
    per_bytes = GROUPS[bits][1]
    if packed.shape[axis] % per_bytes:
        raise ValueError(
            f"{func} needs a length that is a multiple of {per_bytes} bytes along axis {axis}, "
            f"got {packed.shape[axis]}"
        )
    return jnp.moveaxis(unpack_last(jnp.moveaxis(packed, axis, -1), bits), -1, axis)
