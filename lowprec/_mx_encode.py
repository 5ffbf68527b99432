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

import functools

import jax
import jax.numpy as jnp
from jax import lax

from . import _nvfp4
from ._bits import F32_ABS, F32_QNAN, F32_SIGN, bits_to_f32, f32_bits
from ._blocks import merge_blocks, split_blocks
from ._decode import decode_bits, decode_f32
from ._dtypes import input_bits
from ._encode_stochastic import encode_any
from ._format import mx_format
from ._mx_hwfloat import encode_magnitudes, magnitudes_f32, signed_codes
from ._mxarray import MXArray
from ._options import MXCast
from ._pack import pack_along
from ._scale_rules import block_amax_bits
from .kernels._dispatch import fp6_packer, hwfloat_encoder, hwfloat_values_encoder, on_cpu


def padded_bits(x, axis: int, padded: int):
    """float32 patterns of ``x`` (half precision widened exactly), zero-padded along ``axis``
    to length ``padded``. Called inside the jitted cores, on validated input."""
    return zero_padded(input_bits(x), axis, padded)


def zero_padded(v, axis: int, padded: int):
    """``v`` zero-padded along ``axis`` to length ``padded`` (+0.0 for float32 bits or
    values)."""
    n = v.shape[axis]
    if padded == n:
        return v
    widths = [(0, 0)] * v.ndim
    widths[axis] = (0, padded - n)
    return jnp.pad(v, widths)


def block_amax(bits, axis: int, block: int):
    """Largest magnitude bits of each block of float32 patterns ``bits`` along ``axis``
    (whole blocks), in the scales layout."""
    if axis == bits.ndim - 1:
        return block_amax_bits(bits, block)
    # A reduction over a non-minor axis vectorizes along the minor one as it is.
    return jnp.max(split_blocks(bits, axis, block) & F32_ABS, axis=axis + 1)


def _exact_block_codes(xb, amax, ts_bits, cast, axis: int, rng):
    """Formulation.EXACT of blocks ``xb`` (split along ``axis``) with block maxima ``amax``:
    ``(element codes, zero in blocks holding a NaN/Inf; scale codes)``, both unsized ints."""
    fmt = cast.fmt
    inner = axis + 1  # position within a block
    scale_codes, special, quotient, scale_exp = fmt.scheme.encode_blocks(
        xb, amax, ts_bits, cast, inner)
    wb = rng
    if cast.stochastic:
        key, words = rng
        wb = (key, None if words is None else split_blocks(words, axis, fmt.block_size))
    codes = encode_any(
        fmt.element, quotient, cast.rounding, "saturate", wb, scale_exp=scale_exp,
        assume_finite=True,  # blocks holding a NaN/Inf are zeroed just below
    )
    return jnp.where(jnp.expand_dims(special, inner), 0, codes), scale_codes


def encode_blocks(bits, cast: MXCast, axis: int, rng=None, tensor_scale=None, pack=None):
    """``(elements, scales, tensor_scale)`` of float32 patterns ``bits`` whose ``axis`` length
    is a multiple of the block size: uint8 element codes (packed along ``axis``), uint8 scale
    codes, and the float32 tensor scale used (None where the scheme has none).

    ``rng = (key, random_bits)`` for stochastic rounding (words of ``bits``' shape);
    ``tensor_scale``: the caller's (None: the scheme computes it from ``bits``); ``pack``: a
    last-axis packer for sub-byte codes that Triton can lower (the Pallas kernel's, which
    always takes the exact path).
    """
    fmt = cast.fmt
    scheme = fmt.scheme
    inner = axis + 1  # position within a block
    xb = split_blocks(bits, axis, fmt.block_size)
    amax = block_amax(bits, axis, fmt.block_size)
    ts_bits = scheme.tensor_scale_bits(bits, tensor_scale, cast, amax)

    def exact(xb, amax):
        codes, scale_codes = _exact_block_codes(xb, amax, ts_bits, cast, axis, rng)
        return _pack_codes(codes.astype(jnp.uint8), fmt, inner, pack), scale_codes.astype(jnp.uint8)

    # Formulation.HWFLOAT beside EXACT where lowprec.kernels says (not inside a Pallas kernel):
    # the scheme's fast encoder
    fast = hwfloat_encoder(cast) if pack is None and bits.dtype == jnp.uint32 else None
    if fast is None:
        codes, scale_codes = exact(xb, amax)
    else:

        def hwfloat_codes(xb, operand, special, at):
            """uint32 codes of float32 patterns ``xb`` whose blocks' values are per block at
            axis ``at`` (expanded there)."""
            q = fast.quotients(magnitudes_f32(xb), jnp.expand_dims(operand, at), xb, cast)
            mag = encode_magnitudes(fmt.element, lax.bitcast_convert_type(q, jnp.uint32))
            codes = signed_codes(fmt.element, mag, xb)
            return jnp.where(jnp.expand_dims(special, at), jnp.uint32(0), codes)

        def hwfloat_path(xb, operand, special):
            # Every code of a block in one loop, then packed (FP4 pairs through a 16-bit
            # view, which XLA fuses into the same loop). Encoding the even and the odd
            # elements of FP4 pairs side by side instead loops over half-blocks: at 16-element
            # blocks XLA:CPU's loop emitter then runs 8-iteration inner loops ~7x slower.
            codes = hwfloat_codes(xb, operand, special, inner).astype(jnp.uint8)
            return _pack_codes(codes, fmt, inner, None)

        def cpu_branch(xf, amax):
            # The scheme's block values by hardware float arithmetic too, computed on CPU only (so
            # with CPU's float semantics); XLA runs the taken branch only, and both give the
            # same codes (the fast encoder's scales say when). Only x, the block maxima
            # and the scale codes enter the branches (a conditional's operands are written
            # out first): the per-block operands are derived from the codes inside, where
            # XLA can fuse them into the element loop. The branches take x as float32: a
            # conditional's uint32 operand would be a materialized copy of x.
            scale_codes, hwfloat_exact = fast.scales(amax, ts_bits, cast)

            def hwfloat_branch():
                special, operand = fast.operands(scale_codes, ts_bits, cast)
                return hwfloat_path(f32_bits(xf), operand, special), scale_codes

            return lax.cond(_all(hwfloat_exact), hwfloat_branch,
                            lambda: exact(f32_bits(xf), amax))

        def elsewhere(xf, amax):
            # A GPU would sync with the host to branch: keep the one exact formulation.
            return exact(f32_bits(xf), amax)

        codes, scale_codes = on_cpu(cpu_branch, elsewhere, bits_to_f32(xb), amax)
    ts = None if ts_bits is None else lax.bitcast_convert_type(ts_bits, jnp.float32)
    return merge_blocks(codes, axis), scale_codes, ts


def _all(flags):
    """One branch for the whole array: a fast encoder's check is per tensor scale, which a
    caller may give per leading index (the ragged dot's groups)."""
    return flags if flags.ndim == 0 else jnp.all(flags)


def _pack_codes(codes, fmt, inner: int, pack):
    """uint8 codes split in blocks, packed along ``inner`` where they are sub-byte."""
    if not fmt.packed:
        return codes
    if pack is None:
        # Packing groups never straddle blocks (a block is whole bytes): pack while split.
        return pack_along(codes, inner, fmt.element.code_bits, fp6_packer(codes, inner))
    assert inner == codes.ndim - 1, "a caller's pack works along the last axis"
    return pack(codes)


def quantize_mxarray(bits, cast: MXCast, axis: int, shape: tuple, rng=None, tensor_scale=None):
    """The :class:`MXArray` of float32 patterns ``bits`` (``axis`` already padded to whole
    blocks; ``shape`` the unpadded shape), any block format. Trace-time helper."""
    elements, scales, ts = encode_blocks(bits, cast, axis, rng, tensor_scale)
    return MXArray(elements, scales, cast.fmt, axis, shape, cast.scale_rule, ts)


def block_exponents(bits, cast: MXCast, axis: int):
    """The shared exponents (int32) of the blocks of float32 patterns ``bits`` along
    ``axis`` (whole blocks), for a scheme whose scales are shared exponents."""
    return cast.fmt.scheme.exponents_of_amax(block_amax(bits, axis, cast.fmt.block_size), cast)


def encode_values(bits, cast: MXCast, axis: int, rng=None):
    """float32 patterns of ``dequantize(quantize_mx(...))`` of float32 patterns ``bits``
    (``axis`` a multiple of the block size; NVFP4-style schemes: a tensor scale and a
    hardware-float path), for XLA on CPU: the quantized values without writing, packing,
    unpacking and re-decoding the codes.

    The same bits as the two calls: the codes are :func:`encode_blocks`' (the same scheme
    steps, in the same hardware-float or exact branch), and each value is the element's
    value times the block's float32(tensor_scale × block_scale) as ``dequantize`` computes
    it. In the hardware-float branch that factor is one float32 product, correctly rounded
    (a tensor scale in the scheme's exact range gives factors of at least 2^-124 and at most
    2^125, normal, as are their products with elements of magnitude 1/2 to 6, so XLA's
    flushing cannot touch them); in the exact branch it is ``_nvfp4.lifted_product``, exact
    for every factor in a few float operations (route ``PER_BLOCK``: no second branch on
    the factors, no integer multiply). One branch per call instead of the
    encode's and the decode's: the training step's programs are ~3,600 HLO instructions
    smaller per layer (benchmarks/README.md).
    """
    fmt = cast.fmt
    scheme = fmt.scheme
    inner = axis + 1
    xb = split_blocks(bits, axis, fmt.block_size)
    amax = block_amax(bits, axis, fmt.block_size)
    ts_bits = scheme.tensor_scale_bits(bits, None, cast, amax)
    ts = lax.bitcast_convert_type(ts_bits, jnp.float32)

    def exact(xb, amax):
        codes, scale_codes = _exact_block_codes(xb, amax, ts_bits, cast, axis, rng)
        sb = jnp.expand_dims(scale_codes.astype(jnp.uint8), inner)
        route = (_nvfp4.PER_BLOCK, _nvfp4_blocks(scheme, sb, ts))
        return scheme.fast_decoder().routed_values(decode_bits(fmt.element, codes), sb, ts, route)

    # Formulation.HWFLOAT beside EXACT where lowprec.kernels says (stochastic rounding too,
    # given its words and the "divide" step)
    words = rng is not None and rng[1] is not None
    fast = hwfloat_values_encoder(cast, words) if bits.dtype == jnp.uint32 else None
    if fast is None:
        return merge_blocks(exact(xb, amax), axis)

    def cpu_formulations(xf, amax):  # CPU only: the callers of nvfp4_values choose it
        scale_codes, hwfloat_exact = fast.scales(amax, ts_bits, cast)

        def hwfloat_branch():
            xb = f32_bits(xf)
            special, operand = fast.operands(scale_codes, ts_bits, cast)
            if cast.stochastic:
                q = _nvfp4.hwfloat_sr_quotients(xb, jnp.expand_dims(operand, inner))
                words = split_blocks(rng[1], axis, fmt.block_size)
                codes = encode_any(fmt.element, q | (xb & jnp.uint32(F32_SIGN)), cast.rounding,
                                   "saturate", (None, words), assume_finite=True)
                codes = codes.astype(jnp.uint32)
            else:
                q = fast.quotients(magnitudes_f32(xb), jnp.expand_dims(operand, inner), xb, cast)
                mag = encode_magnitudes(fmt.element, lax.bitcast_convert_type(q, jnp.uint32))
                codes = signed_codes(fmt.element, mag, xb)
            total = (operand if cast.nvfp4_step != "reciprocal" else _nvfp4.hwfloat_divisors(
                scale_codes.astype(jnp.uint32), ts_bits, scheme.scale))
            values = decode_f32(fmt.element, codes) * jnp.expand_dims(total, inner)
            nan = jnp.expand_dims(special, inner)
            return jnp.where(nan, jnp.uint32(F32_QNAN), f32_bits(values))

        return lax.cond(_all(hwfloat_exact), hwfloat_branch, lambda: exact(f32_bits(xf), amax))

    return merge_blocks(cpu_formulations(bits_to_f32(xb), amax), axis)


@functools.partial(jax.jit, static_argnums=(2, 3))
def nvfp4_values(x, words, axis: int, step):
    """float32 values of ``dequantize(quantize_mx(x, "nvfp4", axis=axis, nvfp4_step=step,
    ...))`` for float32 ``x`` whose ``axis`` holds whole blocks, rounded to nearest even, or
    stochastically with the uint32 ``words`` (``random_bits=``); :func:`encode_values`
    (XLA on CPU: call it where XLA lowers for CPU only)."""
    fmt = mx_format("nvfp4")
    rounding = "nearest_even" if words is None else "stochastic"
    cast = MXCast(fmt, None, rounding, step)
    rng = None if words is None else (None, words)
    return bits_to_f32(encode_values(f32_bits(x), cast, axis, rng))


def _nvfp4_blocks(scheme, scale_codes, ts):
    """The scheme's per-block decode values (its fast decoder's ``route``, second item)."""
    return scheme.fast_decoder().route(scale_codes, ts)[1]
