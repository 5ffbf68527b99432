"""The block decoder: MX codes (and a tensor scale) to exact values, any scale scheme.

:func:`mx_value_bits` builds every value from bits (element value times its block scale, as
the format's scale scheme computes it; float32 subnormal results included), whatever the
scales. Where the scheme has a one-multiply decode (E8M0: the element value times the float32
2^(s − 127)) and it is exact for the codes at hand, :func:`mx_values` takes it instead; on
CUDA it takes the one-pass, bit-built :func:`mx_values_blockwise`. The cores of dequantize,
fake quantization and the matmul path (docs/design.md §5).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

from ._bits import F32_ABS, F32_INF, F32_QNAN, bits_to_bf16_bits, f32_bits
from ._blocks import merge_blocks, split_blocks
from ._decode import decode_bits, decode_f32
from ._dtypes import bits_to_dtype
from ._format import MXFormat
from ._nvfp4 import PER_BLOCK
from ._pack import unpack_along
from .kernels._dispatch import (by_platform, fp6_kernel, fp6_unpacker, on_cpu, on_cuda,
                                one_multiply_decoder, routed_decoder)


def element_codes(elements, fmt: MXFormat, axis: int):
    """Element codes split in place into blocks along ``axis`` (FP4/FP6 unpacked)."""
    codes = split_blocks(elements, axis, fmt.bytes_per_block)
    return unpack_along(codes, axis + 1, fmt.element.code_bits, fp6_unpacker(codes, axis + 1))


def mx_value_bits(elements, scales, fmt: MXFormat, axis: int, n: int, tensor_scale=None,
                  route=None):
    """Exact float32 patterns (uint32) of MX codes, padding beyond ``n`` dropped.
    Trace-time core of dequantize and the matmul path: builds every value from bits
    (float32 subnormal results included), whatever the scales. NVFP4 values are element x
    float32(``tensor_scale`` x block scale), rounded to float32 (torchao's dequantization)."""
    codes = element_codes(elements, fmt, axis)
    # With a route taken (the caller's branch), the element values come from decode_f32: the
    # same bits as decode_bits with fewer operations (one exact float32 subtraction).
    vb = (decode_bits(fmt.element, codes) if route is None
          else f32_bits(decode_f32(fmt.element, codes)))
    sb = jnp.expand_dims(scales, axis + 1)
    if route is None:
        bits = fmt.scheme.decode_values(vb, sb, tensor_scale)
    else:
        bits = fmt.scheme.fast_decoder().routed_values(vb, sb, tensor_scale, route)
    return lax.slice_in_dim(merge_blocks(bits, axis), 0, n, axis=axis)


def fast_decode_applies(fmt: MXFormat) -> bool:
    """Whether the one-multiply decode serves ``fmt`` (static; ``kernels/_dispatch`` decides:
    its scale scheme's fast decoder has one for its element format, as E8M0's: element
    value × 2^(s − 127))."""
    return one_multiply_decoder(fmt) is not None


def fast_scale_min(fmt: MXFormat) -> int:
    """The smallest scale code at which the one-multiply decode of every element value is
    a float32 normal or zero (E8M0: 10 for E4M3, 17 for E5M2, 2 for E2M1)."""
    return fmt.scheme.fast_decoder().scale_min(fmt.element)


def scale_factors(fmt: MXFormat, scales):
    """float32 factor of each scale code, for the one-multiply decode of ``fmt``."""
    return fmt.scheme.fast_decoder().scale_factors(scales)


def fast_decode_exact(elements, scales, fmt: MXFormat, axis: int):
    """Scalar bool: whether the fast decode is exact for every block of these codes.

    True when every block either has a scale code of at least :func:`fast_scale_min` (the
    NaN code 0xFF included) or holds only zeros (any scale times ±0 is ±0; an all-zero
    block carries code 0). The scales alone decide in the common case; the element codes
    are read only when some scale is small.
    """
    threshold = fast_scale_min(fmt)
    big = scales >= threshold

    def small_blocks_are_zero():
        el = fmt.element
        # Sign-magnitude: the sign bit dropped (-0 is zero); two's complement: only code 0.
        mag = (1 << (el.code_bits if el.encoding == "twos_complement" else el.magnitude_bits)) - 1
        if el.code_bits == 4:  # both nibbles of a packed byte at once
            nonzero = split_blocks((elements & (mag | (mag << 4))) != 0, axis,
                                   fmt.bytes_per_block).any(axis=axis + 1)
        else:  # FP6 unpacked first; INT8's only zero is 0 (two's complement)
            mask = 0xFF if el.encoding == "twos_complement" else mag
            codes = element_codes(elements, fmt, axis)
            nonzero = ((codes & mask) != 0).any(axis=axis + 1)
        return jnp.all(big | ~nonzero)

    return lax.cond(jnp.all(big), lambda: jnp.bool_(True), small_blocks_are_zero)


def mx_value_bits_fast(elements, scales, fmt: MXFormat, axis: int, n: int, canonical_nan=True,
                       factor=None):
    """:func:`mx_value_bits` by one float multiply per element; exact (bit for bit, NaN
    made the canonical quiet NaN as there unless ``canonical_nan`` is False) when
    :func:`fast_decode_exact` holds. ``factor``: :func:`scale_factors` computed by the
    caller (else here)."""
    if factor is None:
        factor = scale_factors(fmt, scales)

    def value_bits(codes, factor):
        bits = f32_bits(decode_f32(fmt.element, codes) * factor)
        if canonical_nan:
            bits = jnp.where((bits & F32_ABS) > F32_INF, jnp.uint32(F32_QNAN), bits)
        return lax.slice_in_dim(merge_blocks(bits, axis), 0, n, axis=axis)

    def ungrouped(e, f):
        return value_bits(element_codes(e, fmt, axis), jnp.expand_dims(f, axis + 1))

    if fmt.element.code_bits != 6:
        return ungrouped(elements, factor)

    def grouped(e, f):
        # FP6 decoded in its 3-byte groups' layout: a stack of the four codes of each group
        # (the block-split formulation) loops over groups of four in XLA:CPU's element loop,
        # 2.4x slower along axis 0 and 1.2x along the last axis (4096 x 4096, measured).
        codes = _grouped_codes(e, fmt, axis)
        return value_bits(codes, _per_code(f, codes.shape, axis))

    if fp6_kernel(elements, axis):
        # On CPU the C++ FP6 kernel unpacks the codes one per byte (at copy speed), which are
        # then decoded in a loop as wide as 8-bit codes' (3.1-3.7x faster at 4096 x 4096).
        return on_cpu(ungrouped, grouped, elements, factor)
    return grouped(elements, factor)


def _grouped_codes(elements, fmt: MXFormat, axis: int):
    """Element codes as ``[..., groups, codes per group, ...]`` (a group: the bytes holding
    a whole number of codes: 1 byte for FP4's pairs, 3 for FP6's fours; 8-bit codes are
    returned as they are), built without a stack or a concatenate: the group's bytes form
    one word, broadcast over its codes, and each code shifts its bits out by its position
    (an iota). Nothing is reshaped across groups, so XLA's GPU fusion sees every code
    through one index map."""
    bits = fmt.element.code_bits
    per_bytes, per_codes = {8: (1, 1), 4: (1, 2), 6: (3, 4)}[bits]
    if bits == 8:
        return elements  # already one code per byte: the array's own layout
    shape = elements.shape
    groups = shape[axis] // per_bytes
    g = elements.reshape(*shape[:axis], groups, per_bytes, *shape[axis + 1:])
    # The group's bytes as one little-endian word, then each code shifted out of it by its
    # position (an iota): element 2k of FP4 in the low nibble, FP6's bit stream as
    # _pack.unpack_last reads it.
    word = lax.index_in_dim(g, 0, axis + 1).astype(jnp.uint32)
    for j in range(1, per_bytes):
        word = word | lax.shift_left(lax.index_in_dim(g, j, axis + 1).astype(jnp.uint32),
                                     jnp.uint32(8 * j))
    out_shape = (*shape[:axis], groups, per_codes, *shape[axis + 1:])
    pos = lax.broadcasted_iota(jnp.uint32, out_shape, axis + 1)
    codes = lax.shift_right_logical(jnp.broadcast_to(word, out_shape), pos * jnp.uint32(bits))
    return (codes & jnp.uint32((1 << bits) - 1)).astype(jnp.uint8)


def _per_code(v, grouped_shape, axis: int):
    """A per-block array broadcast to the code layout of :func:`_grouped_codes`."""
    shape = v.shape
    if len(grouped_shape) == len(shape):  # 8-bit codes, ungrouped
        block = grouped_shape[axis] // shape[axis]
        wide = jnp.broadcast_to(jnp.expand_dims(v, axis + 1),
                                (*shape[:axis], shape[axis], block, *shape[axis + 1:]))
        return wide.reshape(grouped_shape)
    groups, per_codes = grouped_shape[axis], grouped_shape[axis + 1]
    per_block = groups // shape[axis]
    wide = jnp.broadcast_to(
        jnp.expand_dims(v, (axis + 1, axis + 2)),
        (*shape[:axis], shape[axis], per_block, per_codes, *shape[axis + 1:]))
    return wide.reshape(grouped_shape)


@functools.lru_cache(maxsize=None)
def _byte_table(element) -> np.ndarray:
    """decode_bits of the codes in every byte ([256, codes per byte] uint32), computed once per
    format as a host constant, outside any mesh in context: an abstract one (lowering for a
    GPU without one) makes JAX refuse to evaluate the table at trace time."""
    bits = element.code_bits
    byte = np.arange(256, dtype=np.uint32)[:, None]
    shifts = np.arange(8 // bits, dtype=np.uint32) * bits
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())), \
            jax.ensure_compile_time_eval():
        return np.asarray(decode_bits(element, jnp.asarray((byte >> shifts) & ((1 << bits) - 1))))


def _decode_by_table(element, elements, codes, axis: int):
    """float32 patterns of the grouped element ``codes`` (see :func:`_grouped_codes`).

    8-bit codes, and FP4's bytes (both codes of a byte at once), are read from a table of
    decode_bits over every byte, a compile-time constant: one load per element (or pair),
    served from the GPU's L1 (2 KiB at most), against a dozen integer operations. XLA's
    GPU fusion does not fuse a computed index into a gather, so the index is the stored
    byte itself; FP6's codes span bytes and take the arithmetic :func:`decode_f32`."""
    bits = element.code_bits
    if bits not in (4, 8):
        return f32_bits(decode_f32(element, codes))
    per_byte = 8 // bits
    table = jnp.asarray(_byte_table(element))
    index = elements.astype(jnp.int32)
    if per_byte == 1:
        return _lookup(table[:, 0], index)
    if axis == elements.ndim - 1:  # the pair is the gather's slice: [..., bytes, 2]
        return _lookup(table, index).reshape(codes.shape)
    # Along another axis the pair dimension is not the last; a transpose of the gather
    # would be a kernel of its own, so each nibble reads its own column.
    return jnp.stack([_lookup(table[:, j], index) for j in range(per_byte)],
                     axis=axis + 1).reshape(codes.shape)


def _lookup(table, index):
    """``table[index]`` (a replicated constant read at every index), sharded like ``index``:
    under a mesh with Explicit axes JAX cannot infer a gather's output sharding."""
    sharding = jax.typeof(index).sharding
    spec = tuple(sharding.spec) + (None,) * (index.ndim - len(sharding.spec) + table.ndim - 1)
    return table.at[index].get(mode="promise_in_bounds",
                               out_sharding=NamedSharding(sharding.mesh, PartitionSpec(*spec)))


def mx_values_blockwise(elements, scales, fmt: MXFormat, axis: int, n: int, dtype,
                        tensor_scale=None):
    """:func:`mx_values` in one elementwise pass (no branch, no reduction over elements):
    exact for every element and scale, the NaN code and subnormal results included. E8M0
    formats (``fast_decode_applies``): the element's float32 value read from a table, its
    exponent moved by the block's scale on the output's own bits (the fast decoder's
    ``narrow``: float32 or bfloat16). With a ``tensor_scale`` (NVFP4): the
    product with each block's factor, lifted where it is tiny (_nvfp4.lifted_product).

    This is the GPU formulation: XLA's GPU pipeline turns the ``lax.cond`` of
    :func:`mx_values` into a select over two materialized full-size results (5-11 kernels,
    up to 6x the ideal bytes, benchmarks/gpu_hlo_report.py), while this fuses into one
    loop. Codes are decoded in their packed groups' layout (:func:`_grouped_codes`), every
    per-block quantity is computed once per block and broadcast, and only the result is
    reshaped: XLA's GPU fusion refuses to fuse values it would have to recompute through
    several index maps, which the block-split formulation made it do. The loop is
    compute-bound on a GPU. Measured on an H200 (MXFP8 to float32): a per-block select
    between the one-multiply decode and the bit-built one (73 operations per element) ran
    at 1.2 TB/s, 0.47x JAX's ``astype * scale``, the bit-built decode alone (43) at 1.54;
    this one is 33. On CPU the conditional runs one branch, so the cheaper fast decode
    alone usually runs there."""
    codes = _grouped_codes(elements, fmt, axis)
    value_bits = _decode_by_table(fmt.element, elements, codes, axis)
    per_code = _per_code(scales, codes.shape, axis)
    out_bits = {jnp.dtype(jnp.float32): 32, jnp.dtype(jnp.bfloat16): 16}.get(jnp.dtype(dtype))
    fast = fmt.scheme.fast_decoder()
    narrow = None if out_bits is None or tensor_scale is not None or fast is None else (
        fast.narrow(value_bits, per_code, fmt.element, out_bits))
    if narrow is not None:  # float32/bfloat16 patterns directly: 30-40% fewer operations
        values = lax.bitcast_convert_type(narrow.astype(jnp.dtype(f"uint{out_bits}")), dtype)
    else:
        routed = routed_decoder(fmt) if tensor_scale is not None else None
        if routed is not None:  # each block's formulation chosen in the same pass
            # The per-block values computed on the blocks, then broadcast: computed on the
            # broadcast scales, XLA wrote them out at the elements' size (4 bytes each).
            _, blocks = routed.route(scales, tensor_scale)
            blocks = tuple(_per_code(b, codes.shape, axis) for b in blocks)
            bits = routed.routed_values(value_bits, per_code, tensor_scale, (PER_BLOCK, blocks))
        else:
            bits = fmt.scheme.decode_values(value_bits, per_code, tensor_scale)
        if out_bits == 16:  # the encoder's bfloat16 in fewer operations: on a GPU XLA wrote
            # the encoder's float32 operand out in a pass of its own (on CPU this one was
            # 1.1-3x slower: keep the encoder there)
            values = lax.bitcast_convert_type(bits_to_bf16_bits(bits).astype(jnp.uint16), dtype)
        else:
            values = bits_to_dtype(bits, dtype)
    if codes.ndim > elements.ndim:  # merge the groups back
        shape = elements.shape
        values = values.reshape(*shape[:axis], codes.shape[axis] * codes.shape[axis + 1],
                                *shape[axis + 1:])
    return lax.slice_in_dim(values, 0, n, axis=axis)


def mx_values(elements, scales, fmt: MXFormat, axis: int, n: int, dtype, tensor_scale=None):
    """Exact values of MX codes as ``dtype`` (rounded to nearest even if narrower than
    float32): the fast decode when it is exact for these codes, else the bit-built one.
    On a CUDA GPU, the one-pass :func:`mx_values_blockwise` (the same bits)."""

    def exact(e, s, f):
        return bits_to_dtype(mx_value_bits(e, s, fmt, axis, n, tensor_scale), dtype)

    if not fast_decode_applies(fmt):
        if tensor_scale is None:
            return exact(elements, scales, None)

        def routed(e, s):
            # A scheme with two formulations (NVFP4's one-multiply product or the exact one)
            # branches here, before any element is decoded, on per-block values computed
            # once; each branch then decodes, scales and converts in one loop.
            decoder = routed_decoder(fmt)
            if decoder is None:
                return exact(e, s, None)
            serves, blocks = decoder.route(jnp.expand_dims(s, axis + 1), tensor_scale)

            def branch(flag):
                return lambda e, s: bits_to_dtype(
                    mx_value_bits(e, s, fmt, axis, n, tensor_scale, (flag, blocks)), dtype)

            return lax.cond(serves, branch(True), branch(False), e, s)

        def blockwise_scaled(e, s):
            return mx_values_blockwise(e, s, fmt, axis, n, dtype, tensor_scale)

        return by_platform(elements, scales, cpu=routed, cuda=blockwise_scaled,
                           default=lambda e, s: exact(e, s, None))

    def fast(e, s, f):
        return bits_to_dtype(mx_value_bits_fast(e, s, fmt, axis, n, factor=f), dtype)

    def whole_array_choice(e, s):
        # The block factors are built from the scale codes inside the fast branch, where XLA
        # computes them in the element loop (a few integer operations per block, amortized
        # over its vectorized elements: 5-25% faster than writing them out before the branch,
        # the most along axis 0), except for FP6 along the last axis decoded in XLA (no C++
        # kernel), whose loop runs over a group's four codes and pays them per code there
        # (12-18% slower, measured).
        ahead = fmt.element.code_bits == 6 and axis == e.ndim - 1 and not fp6_kernel(e, axis)
        factor = scale_factors(fmt, s) if ahead else None
        return lax.cond(fast_decode_exact(e, s, fmt, axis), fast, exact, e, s, factor)

    def blockwise(e, s):
        return mx_values_blockwise(e, s, fmt, axis, n, dtype)

    return on_cuda(blockwise, whole_array_choice, elements, scales)
