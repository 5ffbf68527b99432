"""The block encoder: float32 bit patterns to element and scale codes, any scale scheme.

Blocks are split in place (``axis`` → (blocks, block) by a reshape: a block axis other than
the last costs no transpose, and per-block values come out in the MXArray scales layout).
Each block's largest magnitude is read from exact float32 bits (an integer max: NaN and inf
patterns sort above every finite one); the format's scale scheme turns it into the block's
scale codes and tells the element encoder what to round (``_scheme.py``). Elements saturate
to ± the element maximum (OCP MX v1.0 §6.3); a block holding NaN or inf keeps zero codes
under the scale format's NaN. Trace-time code: the public functions (``_mx.py``), the matmul
path and the Pallas quantize kernel call it on validated input.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from ._bits import F32_ABS
from ._blocks import merge_blocks, split_blocks
from ._dtypes import input_bits
from ._encode_stochastic import encode_any
from ._mxarray import MXArray
from ._options import MXCast
from ._pack import pack_along
from ._scale_rules import block_amax_bits


def padded_bits(x, axis: int, padded: int):
    """float32 patterns of ``x`` (half precision widened exactly), zero-padded along ``axis``
    to length ``padded``. Called inside the jitted cores, on validated input."""
    bits = input_bits(x)
    n = x.shape[axis]
    if padded != n:
        widths = [(0, 0)] * x.ndim
        widths[axis] = (0, padded - n)
        bits = jnp.pad(bits, widths)  # +0.0
    return bits


def block_amax(xb, inner: int):
    """Largest magnitude bits of each block of float32 patterns split along ``inner``."""
    if inner == xb.ndim - 1:
        return block_amax_bits(xb)
    # A reduction over a non-minor axis vectorizes along the minor one as it is.
    return jnp.max(xb & F32_ABS, axis=inner)


def encode_blocks(bits, cast: MXCast, axis: int, rng=None, tensor_scale=None, pack=None):
    """``(elements, scales, tensor_scale)`` of float32 patterns ``bits`` whose ``axis`` length
    is a multiple of the block size: uint8 element codes (packed along ``axis``), uint8 scale
    codes, and the float32 tensor scale used (None where the scheme has none).

    ``rng = (key, random_bits)`` for stochastic rounding (words of ``bits``' shape);
    ``tensor_scale``: the caller's (None: the scheme computes it from ``bits``); ``pack``: a
    last-axis packer for sub-byte codes that Triton can lower (the Pallas kernel's).
    """
    fmt = cast.fmt
    scheme = fmt.scheme
    ts_bits = scheme.tensor_scale_bits(bits, tensor_scale, cast)
    inner = axis + 1  # position within a block
    xb = split_blocks(bits, axis, fmt.block_size)
    scale_codes, special, quotient, scale_exp = scheme.encode_blocks(
        xb, block_amax(xb, inner), ts_bits, cast, inner)
    if cast.stochastic:
        key, words = rng
        rng = (key, None if words is None else split_blocks(words, axis, fmt.block_size))
    codes = encode_any(
        fmt.element, quotient, cast.rounding, "saturate", rng, scale_exp=scale_exp,
        assume_finite=True,  # blocks holding a NaN/Inf are zeroed just below
    )
    codes = jnp.where(jnp.expand_dims(special, inner), 0, codes).astype(jnp.uint8)
    if fmt.packed:
        if pack is None:
            # Packing groups never straddle blocks (a block is whole bytes): pack while split.
            codes = pack_along(codes, inner, fmt.element.code_bits)
        else:
            assert inner == codes.ndim - 1, "a caller's pack works along the last axis"
            codes = pack(codes)
    ts = None if ts_bits is None else lax.bitcast_convert_type(ts_bits, jnp.float32)
    return merge_blocks(codes, axis), scale_codes.astype(jnp.uint8), ts


def quantize_mxarray(bits, cast: MXCast, axis: int, shape: tuple, rng=None, tensor_scale=None):
    """The :class:`MXArray` of float32 patterns ``bits`` (``axis`` already padded to whole
    blocks; ``shape`` the unpadded shape), any block format. Trace-time helper."""
    elements, scales, ts = encode_blocks(bits, cast, axis, rng, tensor_scale)
    return MXArray(elements, scales, cast.fmt, axis, shape, cast.scale_rule, ts)


def block_exponents(bits, cast: MXCast, axis: int):
    """The shared exponents (int32) of the blocks of float32 patterns ``bits`` along
    ``axis`` (whole blocks), for a scheme whose scales are shared exponents."""
    xb = split_blocks(bits, axis, cast.fmt.block_size)
    return cast.fmt.scheme.exponents_of_amax(block_amax(xb, axis + 1), cast)
