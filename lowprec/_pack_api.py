"""The public packing functions (``lowprec.pack_fp4`` and friends): argument checks, the
axis moved last, and the FP6 kernel that ``lowprec.kernels`` chooses handed to ``_pack.py``
(which chooses nothing)."""

from __future__ import annotations

import jax.numpy as jnp

from ._blocks import normalize_axis
from ._pack import GROUPS, pack_last, unpack_last
from .kernels._dispatch import fp6_packer, fp6_unpacker


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
    return jnp.moveaxis(pack_last(c, bits, fp6_packer(c, c.ndim - 1)), -1, axis)


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
    p = jnp.moveaxis(packed, axis, -1)
    return jnp.moveaxis(unpack_last(p, bits, fp6_unpacker(p, p.ndim - 1)), -1, axis)
