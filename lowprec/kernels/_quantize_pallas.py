"""One-pass Pallas (Triton) kernels for MX block quantization and fake quantization, which
quantize_mx and fake_quantize_mx run on CUDA.

XLA compiles ``quantize_mx`` to a block-max reduction and an encode that reads the input
again: two or three passes, 1.9-2.5x the bytes of one on an H100 (benchmarks/
gpu_hlo_report.py --target h100). These kernels read each tile of the input once and run
lowprec's own quantization core (``_mx_encode.encode_blocks``: the same integer operations, so
the same bits) on it in registers, writing element and scale codes (1.00x the ideal bytes,
no register spills); the fake-quantization kernel decodes the codes again in registers
(the bit-built decode of dequantize) and writes values of x's dtype. Blocks run along the
last axis (any leading dims) or along axis 0 of a 2-D array (tiles transposed in
registers); a length that is not a multiple of the block size is zero-padded in the load.
Deterministic rounding modes, E8M0-scaled formats (FP6's packing along the last axis only),
and NVFP4 along the last axis: its tensor scale comes in as an operand when given (one pass)
or, computed, from a first kernel's partial maxima (:func:`_amax_kernel`), which every
program reduces again (two passes; x is read twice).
Other backends, and every other case, keep XLA's formulation (``_dispatch.quantize_kernel``
decides which calls qualify; ``_mx._quantize_mx_jit`` then chooses with
``lax.platform_dependent``).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from .._blocks import merge_blocks, split_blocks
from .._decode import decode_bits
from .._dtypes import bits_to_dtype, input_bits
from .._mx_encode import encode_blocks
from .._options import MXCast
from .._scheme_nvfp4 import NVFP4Scheme
from .. import _nvfp4
from ._dispatch import pallas_fake_quantize_applies, pallas_quantize_applies


def _pack_pairs(codes):
    """Packs uint8 codes two per byte along the last axis with operations Triton lowers
    (the XLA path's uint16 view is a bitcast between widths, which Triton refuses)."""
    lo, hi = jnp.unstack(codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2), axis=-1)
    return lo | lax.shift_left(hi, jnp.uint8(4))


def _kernel(x_ref, *refs, cast: MXCast, rows: int, cols: int, pcols: int, br: int, bc: int,
            amax_parts: int = 0, ieee: bool = False):
    """refs: element codes, scale codes; NVFP4: first its tensor scale [1] (float32) or,
    with ``amax_parts``, the partial maxima [parts] of :func:`_amax_kernel`, and last the
    tensor scale used [1] (stored by program (0, 0)). ``ieee``: compiled for a GPU (not the
    interpreter), NVFP4's element division or product is PTX's IEEE instruction."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plt

    i, j = pl.program_id(0), pl.program_id(1)
    tensor_scale = None
    if len(refs) == 4:  # NVFP4
        ts_in, e_ref, s_ref, ts_out = refs
        if amax_parts:
            # Every program reduces the partial maxima (a few hundred words, from L2) and
            # derives the tensor scale float32(amax / 2688) as quantize_mx does.
            width = pl.next_power_of_2(amax_parts)
            parts = plt.load(ts_in.at[pl.ds(0, width)],
                             mask=lax.iota(jnp.int32, width) < amax_parts, other=jnp.uint32(0))
            with _nvfp4.one_platform():
                ts_bits = _nvfp4.tensor_scale_bits(jnp.max(parts))
        else:
            ts_bits = lax.bitcast_convert_type(ts_in[0], jnp.uint32)
        ts_bits = NVFP4Scheme.clamp_tensor_scale_bits(ts_bits, cast)
        tensor_scale = lax.bitcast_convert_type(ts_bits, jnp.float32)
        plt.store(ts_out.at[pl.ds(0, 1)], tensor_scale[None], mask=((i == 0) & (j == 0))[None])
    else:
        e_ref, s_ref = refs
    row_ok = (i * br + lax.iota(jnp.int32, br)) < rows

    def cols_ok(width, n=pcols):  # columns of an array whose row holds `width` per tile
        return (j * width + lax.iota(jnp.int32, width)) < n * width // bc

    # Columns past x's end (pad=True: up to the padded length pcols) read as +0, the
    # zero padding of quantize_mx.
    x = plt.load(
        x_ref.at[pl.ds(i * br, br), pl.ds(j * bc, bc)],
        mask=row_ok[:, None] & cols_ok(bc, cols)[None, :], other=jnp.zeros((), x_ref.dtype),
    )
    if cast.fmt.element.code_bits == 6:
        codes, scales, _ = encode_blocks(input_bits(x), cast, 1, None, pack=lambda c: c)
        # FP6: four codes in three bytes; e_ref is [rows, groups, 3] (a view of the
        # [rows, groups·3] codes) and each byte plane is stored with a stride of 3.
        g = bc // 4
        for k, plane in enumerate(_fp6_byte_planes(codes)):
            plt.store(e_ref.at[pl.ds(i * br, br), pl.ds(j * g, g), pl.ds(k, 1)],
                      plane[:, :, None], mask=(row_ok[:, None] & cols_ok(g)[None, :])[:, :, None])
        plt.store(s_ref.at[pl.ds(i * br, br), pl.ds(j * (bc // 32), bc // 32)], scales,
                  mask=row_ok[:, None] & cols_ok(bc // 32)[None, :])
        return
    # NVFP4's element step: div.rn.f32 / mul.rn.f32 compiled, the integer versions (the
    # same bits) in the interpreter.
    with _nvfp4.one_platform(ieee_instructions=ieee):
        elements, scales, _ = encode_blocks(input_bits(x), cast, 1, None, tensor_scale,
                                            pack=_pack_pairs)
    for ref, val in ((e_ref, elements), (s_ref, scales)):
        width = val.shape[1]
        plt.store(ref.at[pl.ds(i * br, br), pl.ds(j * width, width)], val,
                  mask=row_ok[:, None] & cols_ok(width)[None, :])


def _fp6_byte_planes(codes):
    """[rows, n] FP6 codes → the three byte planes [rows, n/4] of the packed stream (four
    codes c0..c3 little-endian in 24 bits, as _pack.pack_last), split with size-2 unstacks."""
    pairs = jnp.unstack(codes.reshape(*codes.shape[:-1], codes.shape[-1] // 4, 2, 2), axis=-1)
    (c0, c2), (c1, c3) = (jnp.unstack(p, axis=-1) for p in pairs)
    u8 = jnp.uint8
    return (c0 | lax.shift_left(c1, u8(6)),
            lax.shift_right_logical(c1, u8(2)) | lax.shift_left(c2, u8(4)),
            lax.shift_right_logical(c2, u8(4)) | lax.shift_left(c3, u8(2)))


def _kernel_axis0(x_ref, e_ref, s_ref, *, cast: MXCast, rows: int, cols: int, prows: int,
                  br: int, bc: int):
    """Blocks along the rows of a 2-D x: each [br, bc] tile is transposed in registers and
    quantized along its last axis by the same core, and the codes transposed back."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plt

    i, j = pl.program_id(0), pl.program_id(1)
    col_ok = (j * bc + lax.iota(jnp.int32, bc)) < cols
    row_ok = (i * br + lax.iota(jnp.int32, br)) < rows  # rows past x's end read as +0
    x = plt.load(x_ref.at[pl.ds(i * br, br), pl.ds(j * bc, bc)],
                 mask=row_ok[:, None] & col_ok[None, :], other=jnp.zeros((), x_ref.dtype))
    elements, scales, _ = encode_blocks(input_bits(x.T), cast, 1, None, pack=_pack_pairs)
    for ref, val in ((e_ref, elements.T), (s_ref, scales.T)):
        h = val.shape[0]
        ok = (i * h + lax.iota(jnp.int32, h)) < prows * h // br
        plt.store(ref.at[pl.ds(i * h, h), pl.ds(j * bc, bc)], val,
                  mask=ok[:, None] & col_ok[None, :])


@functools.partial(jax.jit, static_argnames=("cast", "axis", "block_rows", "block_cols",
                                             "interpret"))
def quantize_mx_pallas(x, cast: MXCast, tensor_scale=None, *, axis: int = -1,
                       block_rows: int = None, block_cols: int = 256, interpret: bool = False):
    """(elements, scales) of ``x`` (float32/bfloat16/float16) blocked along its last axis,
    or along axis 0 of a 2-D ``x`` (``axis=0``): the arrays ``quantize_mx(x, cast.fmt,
    axis=axis, ..., pad=True)`` holds (a length that is not a multiple of the block size is
    zero-padded, in the kernel). NVFP4 (last axis) also returns the tensor scale used: the
    given ``tensor_scale`` (a float32 scalar) raised as ``quantize_mx`` raises it, or, for
    None, float32(amax / 2688) from a first pass over ``x`` (:func:`_amax_kernel`) — the
    elements, scales and tensor scale ``quantize_mx(x, "nvfp4", tensor_scale=...)`` gives."""
    from jax.experimental import pallas as pl

    if axis == 0 and x.ndim == 2:
        return _quantize_axis0(x, cast, interpret)
    if axis not in (-1, x.ndim - 1):
        raise ValueError(f"quantize_mx_pallas: blocks along the last axis or axis 0 of a 2-D "
                         f"array, got axis {axis} of a {x.ndim}-D array")
    *lead, cols = x.shape
    rows = math.prod(lead)
    fmt = cast.fmt
    if not pallas_quantize_applies(cast):
        raise ValueError(f"quantize_mx_pallas: {fmt.name} is not served (see pallas_quantize_applies)")
    per_block = fmt.bytes_per_block
    blocks = -(-cols // fmt.block_size)  # zero-padded to whole blocks
    el_shape = (rows, blocks * per_block)
    if fmt.element.code_bits == 6:
        el_shape = (rows, blocks * per_block // 3, 3)  # byte planes (same memory)
    out_shape = (
        jax.ShapeDtypeStruct(el_shape, jnp.uint8),
        jax.ShapeDtypeStruct((rows, blocks), jnp.uint8),
    )
    params = {}
    if not interpret:
        from jax.experimental.pallas import triton as plt

        params["compiler_params"] = plt.CompilerParams(num_warps=4)
    if block_rows is None:
        # NVFP4's element step (operand scaling, an IEEE division or product, the E2M1
        # rounding) holds ~3x the registers of the MX encode per element: 8 rows keep it
        # below 70 registers without spills (16: 96-128).
        block_rows = 8 if isinstance(fmt.scheme, NVFP4Scheme) else 16
    operands = [x.reshape(rows, cols)]
    parts = 0
    if isinstance(fmt.scheme, NVFP4Scheme):
        if tensor_scale is None:  # computed: the largest finite magnitude first
            operands.append(_amax_parts(operands[0], interpret))
            parts = operands[1].shape[0]
        else:
            operands.append(jnp.asarray(tensor_scale, jnp.float32).reshape(1))
        out_shape += (jax.ShapeDtypeStruct((1,), jnp.float32),)
    out = pl.pallas_call(
        functools.partial(_kernel, cast=cast, rows=rows, cols=cols,
                          pcols=blocks * fmt.block_size, br=block_rows, bc=block_cols,
                          amax_parts=parts, ieee=not interpret),
        out_shape=out_shape,
        grid=(-(-rows // block_rows), -(-blocks * fmt.block_size // block_cols)),
        interpret=interpret,
        name="lowprec_quantize_mx",
        **params,
    )(*operands)
    codes = (out[0].reshape(*lead, -1), out[1].reshape(*lead, -1))
    return codes + (out[2].reshape(()),) if len(out) == 3 else codes


#: Programs of the NVFP4 maximum pass: each reduces a run of row tiles to one word, which
#: every program of the quantize pass then reads (a few hundred words).
_AMAX_PROGRAMS = 256


def _amax_kernel(x_ref, o_ref, *, rows: int, cols: int, br: int, bc: int, tiles: int):
    """Program p: the largest finite magnitude (float32 bits) of row tiles p·tiles .. on."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plt

    p = pl.program_id(0)
    col_tiles = -(-cols // bc)

    def body(t, acc):
        ct = jnp.int32(col_tiles)
        r0 = (p * tiles + lax.div(t, ct)) * br
        c0 = lax.rem(t, ct) * bc
        ok = (((r0 + lax.iota(jnp.int32, br)) < rows)[:, None]
              & ((c0 + lax.iota(jnp.int32, bc)) < cols)[None, :])
        x = plt.load(x_ref.at[pl.ds(r0, br), pl.ds(c0, bc)], mask=ok,
                     other=jnp.zeros((), x_ref.dtype))
        mag = input_bits(x) & jnp.uint32(0x7FFF_FFFF)
        finite = jnp.where(mag < jnp.uint32(0x7F80_0000), mag, jnp.uint32(0))  # below inf
        return jnp.maximum(acc, jnp.max(finite))

    acc = lax.fori_loop(0, tiles * col_tiles, body, jnp.uint32(0))
    plt.store(o_ref.at[pl.ds(p, 1)], acc[None])


def _amax_parts(x2, interpret: bool, br: int = 16, bc: int = 256):
    """[programs] uint32: partial largest finite magnitudes of the rows of ``x2`` (bits)."""
    from jax.experimental import pallas as pl

    rows, cols = x2.shape
    row_tiles = -(-rows // br)
    tiles = -(-row_tiles // _AMAX_PROGRAMS)
    programs = -(-row_tiles // tiles)
    params = {}
    if not interpret:
        from jax.experimental.pallas import triton as plt

        params["compiler_params"] = plt.CompilerParams(num_warps=4)
    return pl.pallas_call(
        functools.partial(_amax_kernel, rows=rows, cols=cols, br=br, bc=bc, tiles=tiles),
        out_shape=jax.ShapeDtypeStruct((programs,), jnp.uint32),
        grid=(programs,),
        interpret=interpret,
        name="lowprec_nvfp4_amax",
        **params,
    )(x2)


def _quantize_axis0(x, cast: MXCast, interpret: bool, br: int = 64, bc: int = 64):
    from jax.experimental import pallas as pl

    rows, cols = x.shape
    fmt = cast.fmt
    if not pallas_quantize_applies(cast, axis0=True):
        raise ValueError(f"quantize_mx_pallas: {fmt.name} along axis 0 is not served "
                         "(see pallas_quantize_applies)")
    blocks = -(-rows // fmt.block_size)
    out_shape = (
        jax.ShapeDtypeStruct((blocks * fmt.bytes_per_block, cols), jnp.uint8),
        jax.ShapeDtypeStruct((blocks, cols), jnp.uint8),
    )
    params = {}
    if not interpret:
        from jax.experimental.pallas import triton as plt

        params["compiler_params"] = plt.CompilerParams(num_warps=4)
    return pl.pallas_call(
        functools.partial(_kernel_axis0, cast=cast, rows=rows, cols=cols,
                          prows=blocks * fmt.block_size, br=br, bc=bc),
        out_shape=out_shape,
        grid=(-(-blocks * fmt.block_size // br), -(-cols // bc)),
        interpret=interpret,
        name="lowprec_quantize_mx",
        **params,
    )(x)


# -- fake quantization: quantize and decode in registers ----------------------------------


def _fake_kernel(x_ref, o_ref, *, cast: MXCast, rows: int, cols: int, br: int, bc: int):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plt

    i, j = pl.program_id(0), pl.program_id(1)
    ok = (((i * br + lax.iota(jnp.int32, br)) < rows)[:, None]
          & ((j * bc + lax.iota(jnp.int32, bc)) < cols)[None, :])
    where = o_ref.at[pl.ds(i * br, br), pl.ds(j * bc, bc)]
    x = plt.load(x_ref.at[pl.ds(i * br, br), pl.ds(j * bc, bc)], mask=ok,
                 other=jnp.zeros((), x_ref.dtype))
    plt.store(where, _fake_values(x, cast, x_ref.dtype), mask=ok)


def _fake_values(x, cast: MXCast, dtype):
    """Fake-quantized values of a tile blocked along its last axis. Codes are left
    unpacked (an identity "pack"), then decoded exactly from the bits as dequantize's
    bit-built path: the same values, never a float8 type (no cast pair to elide)."""
    fmt = cast.fmt
    codes, scales, _ = encode_blocks(input_bits(x), cast, 1, None, pack=lambda c: c)
    vb = split_blocks(decode_bits(fmt.element, codes), 1, fmt.block_size)
    bits = merge_blocks(fmt.scheme.decode_values(vb, scales[:, :, None], None), 1)
    return bits_to_dtype(bits, dtype)


def _fake_kernel_axis0(x_ref, o_ref, *, cast: MXCast, rows: int, cols: int, br: int, bc: int):
    """Blocks along the rows of a 2-D x: the tile transposed in registers, fake-quantized
    along its last axis by :func:`_fake_values`, and transposed back."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plt

    i, j = pl.program_id(0), pl.program_id(1)
    ok = (((i * br + lax.iota(jnp.int32, br)) < rows)[:, None]
          & ((j * bc + lax.iota(jnp.int32, bc)) < cols)[None, :])
    x = plt.load(x_ref.at[pl.ds(i * br, br), pl.ds(j * bc, bc)], mask=ok,
                 other=jnp.zeros((), x_ref.dtype))
    values = _fake_values(x.T, cast, x_ref.dtype).T
    plt.store(o_ref.at[pl.ds(i * br, br), pl.ds(j * bc, bc)], values, mask=ok)


@functools.partial(jax.jit, static_argnames=("cast", "axis", "block_rows", "block_cols",
                                             "interpret"))
def fake_quantize_mx_pallas(x, cast: MXCast, *, axis: int = -1, block_rows: int = 16,
                            block_cols: int = 256, interpret: bool = False):
    """``dequantize(quantize_mx(x, ..., pad=True), x.dtype)`` of ``x``
    (float32/bfloat16/float16, blocks along the last axis) in one pass: the fake quantization of
    :func:`lowprec.fake_quantize_mx` on CUDA for the casts
    :func:`pallas_fake_quantize_applies` accepts (bit for bit: the same quantization core and the bit-built decode)."""
    from jax.experimental import pallas as pl

    if not pallas_fake_quantize_applies(cast):
        raise ValueError(f"fake_quantize_mx_pallas: {cast.fmt.name} is not served "
                         "(see pallas_fake_quantize_applies)")
    params = {}
    if not interpret:
        from jax.experimental.pallas import triton as plt

        params["compiler_params"] = plt.CompilerParams(num_warps=4)
    if axis == 0 and x.ndim == 2:
        rows, cols = x.shape
        br, bc = 64, 64
        return pl.pallas_call(
            functools.partial(_fake_kernel_axis0, cast=cast, rows=rows, cols=cols, br=br,
                              bc=bc),
            out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
            grid=(-(-rows // br), -(-cols // bc)),
            interpret=interpret,
            name="lowprec_fake_quantize_mx",
            **params,
        )(x)
    if axis not in (-1, x.ndim - 1):
        raise ValueError(f"fake_quantize_mx_pallas: blocks along the last axis or axis 0 of a "
                         f"2-D array, got axis {axis} of a {x.ndim}-D array")
    *lead, cols = x.shape
    rows = math.prod(lead)
    out = pl.pallas_call(
        functools.partial(_fake_kernel, cast=cast, rows=rows, cols=cols, br=block_rows,
                          bc=block_cols),
        out_shape=jax.ShapeDtypeStruct((rows, cols), x.dtype),
        grid=(-(-rows // block_rows), -(-cols // block_cols)),
        interpret=interpret,
        name="lowprec_fake_quantize_mx",
        **params,
    )(x.reshape(rows, cols))
    return out.reshape(x.shape)
