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

#: (codes, bytes) of one packing group by code width: 2 FP4 codes per byte, 4 FP6 codes per
#: 3 bytes (lcm(6, 8) = 24 bits).
GROUPS = {4: (2, 1), 6: (4, 3), 8: (1, 1)}


def pack_last(c, bits: int = 4, pack6=None):
    """Packs uint8 codes of ``bits`` bits along the last axis (a multiple of the group size);
    FP6 by ``pack6`` where given (see :func:`pack_along`)."""
    if bits == 8:
        return c
    if bits == 6:
        return _pack6(c, c.ndim - 1, pack6)
    assert bits == 4, bits
    # View each (even, odd) pair as one little-endian uint16 and fold the odd code's nibble
    # down next to the even one's: one fused elementwise pass instead of strided slices.
    pairs = lax.bitcast_convert_type(c.reshape(*c.shape[:-1], c.shape[-1] // 2, 2), jnp.uint16)
    folded = (pairs & 0xF) | (lax.shift_right_logical(pairs, jnp.uint16(4)) & 0xF0)
    return folded.astype(jnp.uint8)


def unpack_last(p, bits: int = 4, unpack6=None):
    """Inverse of :func:`pack_last`."""
    if bits == 8:
        return p
    if bits == 6:
        return _unpack6(p, p.ndim - 1, unpack6)
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


def pack_along(c, axis: int, bits: int, pack6=None):
    """Packs uint8 codes of ``bits`` bits along ``axis`` (whole groups), in place: FP4 by
    :func:`pack_pairs`, FP6 by :func:`pack6_xla` or by ``pack6`` where the caller gives one
    (a function of the codes giving the same bytes along the last axis: the native CPU kernel
    that ``lowprec.kernels`` chooses; this module chooses nothing), 8 bits as they are."""
    if bits == 8:
        return c
    if bits == 4:
        return pack_pairs(c, axis)
    return _pack6(c, axis, pack6)


def unpack_along(p, axis: int, bits: int, unpack6=None):
    """Inverse of :func:`pack_along` (``unpack6``: the inverse of its ``pack6``)."""
    if bits == 8:
        return p
    if bits == 4:
        return unpack_pairs(p, axis)
    return _unpack6(p, axis, unpack6)


# FP6 along any axis, in place: four 6-bit codes per three bytes, the first code in the low
# bits of the first byte. The group's codes or bytes are split off next to the axis, so along
# an axis other than the last every loop XLA:CPU emits runs innermost over the trailing axes
# (moving the axis last and back instead costs two transposes, each as much as the encode).


def _pack6(c, axis: int, pack6=None):
    """Packs uint8 codes of 6 bits along ``axis`` (a multiple of 4 long): by the caller's
    ``pack6`` (along the last axis) where given, else by :func:`pack6_xla`."""
    if pack6 is not None:
        assert axis == c.ndim - 1, "a given FP6 packer works along the last axis"
        return pack6(c.astype(jnp.uint8))
    return pack6_xla(c, axis)


def pack6_xla(c, axis: int):
    """FP6 packing in XLA. The group's 24-bit word is a sum over the group axis: a
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


def _unpack6(p, axis: int, unpack6=None):
    """Inverse of :func:`_pack6`."""
    if unpack6 is not None:
        assert axis == p.ndim - 1, "a given FP6 unpacker works along the last axis"
        return unpack6(p)
    return unpack6_xla(p, axis)


def unpack6_xla(p, axis: int):
    """Inverse of :func:`pack6_xla`."""
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
