"""OCP MX block quantization (MXFP8 E4M3/E5M2, MXFP4): E8M0 scales shared by 32 elements.

Semantics (docs/design.md §3): the block maximum is read from exact float32 bits, a
:class:`~lowprec.ScaleRule` picks the shared exponent, and elements are encoded from
``V_i * 2^-shared_exp`` by moving exponents in integer arithmetic (never a float division,
so subnormal inputs such as 2^-130 stay exact on CPU, where XLA flushes denormals).
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from typing import Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ._bits import (
    E8M0_BIAS,
    E8M0_NAN,
    F32_ABS,
    F32_INF,
    F32_MANT_BITS,
    F32_QNAN,
    bits_to_f32,
    f32_bits,
    scale_bits_by_e8m0,
)
from ._blocks import (
    check_block_input,
    merge_blocks,
    normalize_axis,
    padded_bits,
    split_blocks,
)
from ._codec import (
    bits_to_dtype,
    check_float_dtype,
    decode_bits,
    decode_f32,
    encode_any,
)
from ._format import MXFormat, MXFormatLike, array_then_format, mx_format
from ._options import MXCast, check_random_bits
from ._pack import pack_pairs, unpack_pairs
from ._scale_rules import (
    DEFAULT_SCALE_RULE,
    ScaleRule,
    block_amax_bits,
    check_scale_rule,
    scale_codes_of_amax,
)
from ._sharding import check_mx_input


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["elements", "scales"],
    meta_fields=["fmt", "axis", "shape", "scale_rule"],
)
@dataclasses.dataclass(frozen=True)
class MXArray:
    """A block-quantized array (a JAX pytree). Validates itself on construction.

    Attributes:
      elements: uint8 element codes with the (padded) input shape; for MXFP4 packed two
        per byte along ``axis`` (even element in the low nibble), so that axis is halved.
      scales: uint8 E8M0 codes, the input shape with ``axis`` divided by the block size.
        0xFF marks a block that held a NaN or an infinity (it dequantizes to NaN).
      fmt: the :class:`MXFormat` (static; a format name is resolved).
      axis: the block axis (static; a negative axis is normalized).
      shape: shape of the original, unpadded array (static).
      scale_rule: the :class:`~lowprec.ScaleRule` that chose the scales, or None if
        unknown (static).

    Construction checks (statically, so also under ``jit``) that both arrays are uint8 and
    that their shapes agree with ``shape``, ``axis``, the block size and FP4 packing.
    Leading dimensions beyond ``shape`` are accepted when both arrays carry the same ones:
    they are the batch dimensions of an MXArray built under ``vmap`` (or stacked), which
    only ``vmap``/``scan`` over them may consume.

    Example:
        >>> import jax.numpy as jnp
        >>> MXArray(jnp.zeros((64,), jnp.uint8), jnp.zeros((2,), jnp.uint8), "mxfp8", 0, (64,))
        MXArray(elements=uint8[64], scales=uint8[2], fmt=MXFormat('mxfp8_e4m3'), axis=0, shape=(64,), scale_rule=None)
        >>> MXArray(jnp.zeros((32,), jnp.uint8), jnp.zeros((2,), jnp.uint8), "mxfp8", 0, (64,))
        Traceback (most recent call last):
        ...
        ValueError: MXArray: elements have shape (32,) but mxfp8_e4m3 over shape (64,) blocked along axis 0 needs (64,) (scales (2,))
    """

    elements: jax.Array
    scales: jax.Array
    fmt: MXFormat
    axis: int
    shape: tuple
    scale_rule: Optional[ScaleRule] = None

    def __post_init__(self):
        fmt = self.fmt
        if isinstance(fmt, str):
            fmt = mx_format(fmt)
        if not isinstance(fmt, MXFormat):
            raise TypeError(f"MXArray fmt must be an MXFormat or its name, got {fmt!r}")
        try:
            shape = tuple(operator.index(d) for d in self.shape)
        except TypeError:
            raise TypeError(f"MXArray shape must be a tuple of ints, got {self.shape!r}") from None
        if any(d < 0 for d in shape) or not shape:
            raise ValueError(f"MXArray shape must be a non-empty tuple of sizes, got {shape}")
        axis = normalize_axis(self.axis, len(shape), "MXArray axis")
        rule = None if self.scale_rule is None else check_scale_rule(self.scale_rule)
        object.__setattr__(self, "fmt", fmt)
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "axis", axis)
        object.__setattr__(self, "scale_rule", rule)
        # Leaves are arrays, tracers or ShapeDtypeStructs — or placeholders when JAX rebuilds
        # the pytree internally (e.g. vmap axis specs); only arrays are checked.
        if all(hasattr(v, "shape") and hasattr(v, "dtype") for v in (self.elements, self.scales)):
            _check_leaves(self.elements, self.scales, fmt, axis, shape)

    def __repr__(self) -> str:
        def leaf(v):
            if hasattr(v, "shape") and hasattr(v, "dtype"):
                return f"{np.dtype(v.dtype).name}{list(v.shape)}"
            return repr(v)

        rule = None if self.scale_rule is None else self.scale_rule.value
        return (
            f"MXArray(elements={leaf(self.elements)}, scales={leaf(self.scales)}, "
            f"fmt={self.fmt!r}, axis={self.axis}, shape={self.shape}, scale_rule={rule!r})"
        )

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def padded_length(self) -> int:
        """Length of the block axis after zero padding (a multiple of the block size)."""
        return -(-self.shape[self.axis] // self.fmt.block_size) * self.fmt.block_size

    @property
    def nbytes(self) -> int:
        """Bytes of storage (elements + scales)."""
        return int(np.prod(self.elements.shape)) + int(np.prod(self.scales.shape))


def _check_leaves(elements, scales, fmt: MXFormat, axis: int, shape: tuple) -> None:
    for what, v in (("elements", elements), ("scales", scales)):
        if np.dtype(v.dtype) != np.uint8:
            raise TypeError(
                f"MXArray {what} must be uint8 codes, got dtype {np.dtype(v.dtype)}"
                + (" (E8M0 scale codes are 0..255)" if what == "scales" else "")
            )
    el, sc = tuple(elements.shape), tuple(scales.shape)
    nd = len(shape)
    blocks = -(-shape[axis] // fmt.block_size)
    want_sc = shape[:axis] + (blocks,) + shape[axis + 1 :]
    per_block = fmt.block_size // 2 if fmt.packed else fmt.block_size
    want_el = shape[:axis] + (blocks * per_block,) + shape[axis + 1 :]
    ok = len(el) == len(sc) >= nd and el[: len(el) - nd] == sc[: len(sc) - nd]
    if not ok or sc[len(sc) - nd :] != want_sc:
        raise ValueError(
            f"MXArray: scales have shape {sc} but {fmt.name} over shape {shape} blocked along "
            f"axis {axis} needs {want_sc} (one E8M0 code per {fmt.block_size} elements)"
        )
    if el[len(el) - nd :] != want_el:
        packing = " (FP4: two codes per byte along the block axis)" if fmt.packed else ""
        raise ValueError(
            f"MXArray: elements have shape {el} but {fmt.name} over shape {shape} blocked "
            f"along axis {axis} needs {want_el}{packing} (scales {sc})"
        )


# -- quantization -------------------------------------------------------------------------


def _block_amax(xb, inner: int):
    """Largest magnitude bits of each block of float32 patterns split along ``inner``."""
    if inner == xb.ndim - 1:
        return block_amax_bits(xb)
    # A reduction over a non-minor axis vectorizes along the minor one as it is.
    return jnp.max(xb & F32_ABS, axis=inner)


def quantize_blocks(bits, cast: MXCast, axis: int, rng=None, pack=None):
    """Element and scale codes (uint8) of float32 patterns ``bits`` whose ``axis`` length is
    a multiple of the block size. Trace-time core of quantize_mx, the matmul path and the
    Pallas quantize kernel (which passes a last-axis ``pack`` that Triton can lower).
    ``rng = (key, random_bits)`` for stochastic rounding (words of ``bits``' shape).

    Blocks are split in place (``axis`` → (blocks, block) by a reshape): a block axis other
    than the last costs no transpose, and the per-block scales come out in their layout.
    """
    fmt = cast.fmt
    inner = axis + 1  # position within a block
    xb = split_blocks(bits, axis, fmt.block_size)
    scale_codes, special = scale_codes_of_amax(_block_amax(xb, inner), fmt, cast.scale_rule)
    if cast.stochastic:
        key, words = rng
        rng = (key, None if words is None else split_blocks(words, axis, fmt.block_size))
    codes = encode_any(
        fmt.element, xb, cast.rounding, "saturate", rng,
        scale_exp=jnp.expand_dims(scale_codes - E8M0_BIAS, inner),
        assume_finite=True,  # blocks holding a NaN/Inf are zeroed just below
    )
    codes = jnp.where(jnp.expand_dims(special, inner), 0, codes).astype(jnp.uint8)
    if fmt.packed:
        if pack is None:
            codes = pack_pairs(codes, inner)  # pairs never straddle blocks: pack while split
        else:
            assert inner == codes.ndim - 1, "a caller's pack works along the last axis"
            codes = pack(codes)
    return merge_blocks(codes, axis), scale_codes.astype(jnp.uint8)


def _padded_shape(shape, axis: int, padded: int) -> tuple:
    return tuple(shape[:axis]) + (padded,) + tuple(shape[axis + 1 :])


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _quantize_mx_jit(x, cast: MXCast, axis: int, padded: int, rng):
    return quantize_blocks(padded_bits(x, axis, padded), cast, axis, rng)


def quantize_mx(
    x,
    fmt: MXFormatLike,
    *,
    axis: int = -1,
    scale_rule: Union[str, ScaleRule] = DEFAULT_SCALE_RULE,
    rounding: str = "nearest_even",
    pad: bool = False,
    key: Optional[jax.Array] = None,
    random_bits: Optional[jax.Array] = None,
) -> MXArray:
    """Block-quantizes ``x`` to an OCP MX format.

    Args:
      x: float32, bfloat16 or float16 array (half precision is widened exactly, with
        integer operations).
      fmt: ``"mxfp8_e4m3"`` (alias ``"mxfp8"``), ``"mxfp8_e5m2"``, ``"mxfp4"`` or an
        :class:`MXFormat`.
      axis: blocks are 32 consecutive elements along this axis (default: last).
      scale_rule: a :class:`~lowprec.ScaleRule` or its name: how the shared exponent
        follows from the block's max magnitude amax, with e = floor(log2 amax) read from
        the exact float32 bits and emax_elem = 8, 15, 2: ``"floor"`` (default; OCP MX v1.0
        §6.3, microxcaling, gfloat): e − emax_elem; ``"ceil"``: ceil(log2 amax) −
        emax_elem; ``"even"``: amax's significand rounded (half up) to the element's
        mantissa width first; ``"rceil"`` (NVIDIA, JAX's ``jax.nn`` MXFP8): amax / max_elem
        in float32, rounded up to a power of two. Shared exponents are clamped to
        [−127, 127].
      rounding: element rounding mode (see :func:`lowprec.encode`); elements saturate to
        ± the element format's max, so under ``"floor"`` block maxima above
        1.75·2^emax_elem (FP8) or 1.5·2^emax_elem (FP4) are clipped, by design.
      pad: zero-pad the axis to a multiple of 32 instead of raising.
      key: PRNG key, for ``rounding="stochastic"`` only: element i of the padded ``x``
        (row-major) rounds away from zero iff ``lowprec.random_bits(key,
        padded_shape)[i] < frac_i * 2**16`` (see :func:`lowprec.encode`).
      random_bits: instead of ``key``: your own words (uint16, or uint32 compared with
        ``frac_i * 2**32``) of the padded shape.

    Returns:
      An :class:`MXArray`. A block holding any NaN or ±inf gets scale 0xFF and zero
      element codes (it dequantizes to NaN). An all-zero block gets scale code 0
      (2^-127). −0.0 keeps its sign (element code 0x80, or 0x8 for FP4).

    Example:
        >>> import jax.numpy as jnp
        >>> mx = quantize_mx(jnp.linspace(-1.0, 1.0, 64), "mxfp4")
        >>> mx.elements.shape, mx.scales.tolist()
        ((32,), [125, 125])
    """
    x, fmt = array_then_format(x, fmt, "quantize_mx")
    cast = MXCast(fmt, scale_rule, rounding)
    cast.check_key(key, random_bits)
    x = jnp.asarray(x)
    axis, n, padded = check_block_input(x.shape, x.dtype, cast.fmt, axis, pad, "quantize_mx")
    check_mx_input(x, cast.fmt, axis)  # MX blocks must not straddle shard boundaries
    check_random_bits(random_bits, _padded_shape(x.shape, axis, padded), "the padded shape")
    elements, scales = _quantize_mx_jit(x, cast, axis, padded, (key, random_bits))
    return MXArray(elements, scales, cast.fmt, axis, tuple(x.shape), cast.scale_rule)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _shared_exponents_jit(x, cast: MXCast, axis: int, padded: int):
    xb = split_blocks(padded_bits(x, axis, padded), axis, cast.fmt.block_size)
    codes, _ = scale_codes_of_amax(_block_amax(xb, axis + 1), cast.fmt, cast.scale_rule)
    return codes - E8M0_BIAS


def shared_exponents(
    x,
    fmt: MXFormatLike,
    *,
    axis: int = -1,
    scale_rule: Union[str, ScaleRule] = DEFAULT_SCALE_RULE,
    pad: bool = False,
) -> jax.Array:
    """The shared exponent of every MX block of ``x``, without quantizing the elements.

    Equal to ``quantize_mx(x, fmt, ...).scales − 127`` (so a block holding a NaN or an
    infinity, scale code 0xFF, gives 128), at the cost of one read of ``x``.

    Args:
      x: float32, bfloat16 or float16 array.
      fmt: block format or its name.
      axis: the block axis (default: last).
      scale_rule: a :class:`~lowprec.ScaleRule` or its name (default ``"floor"``).
      pad: zero-pad the axis to a multiple of the block size instead of raising (zeros do
        not change a block's maximum).

    Returns:
      int32 array: ``x``'s shape with ``axis`` divided by the block size (rounded up).

    Example:
        >>> import jax.numpy as jnp
        >>> x = jnp.concatenate([jnp.full(32, 1.0), jnp.full(32, 100.0)])
        >>> shared_exponents(x, "mxfp8_e4m3").tolist()            # floor(log2 amax) - 8
        [-8, -2]
        >>> shared_exponents(x, "mxfp8_e4m3", scale_rule="rceil").tolist()
        [-8, -2]
    """
    x, fmt = array_then_format(x, fmt, "shared_exponents")
    cast = MXCast(fmt, scale_rule)
    x = jnp.asarray(x)
    axis, _, padded = check_block_input(x.shape, x.dtype, cast.fmt, axis, pad, "shared_exponents")
    return _shared_exponents_jit(x, cast, axis, padded)


# -- dequantization -----------------------------------------------------------------------


def _element_codes(elements, fmt: MXFormat, axis: int):
    """Element codes split in place into blocks along ``axis`` (FP4 unpacked)."""
    per_block = fmt.block_size // 2 if fmt.packed else fmt.block_size
    codes = split_blocks(elements, axis, per_block)
    return unpack_pairs(codes, axis + 1) if fmt.packed else codes


def mx_value_bits(elements, scales, fmt: MXFormat, axis: int, n: int):
    """Exact float32 patterns (uint32) of MX codes, padding beyond ``n`` dropped.
    Trace-time core of dequantize and the matmul path: builds every value from bits
    (float32 subnormal results included), whatever the scales."""
    vb = decode_bits(fmt.element, _element_codes(elements, fmt, axis))
    bits = merge_blocks(scale_bits_by_e8m0(vb, jnp.expand_dims(scales, axis + 1)), axis)
    return lax.slice_in_dim(bits, 0, n, axis=axis)


# The fast decode: element value (float32, exact) times the block's scale 2^(s - 127), a
# float32 built from the code's bits, in one float multiply. The product of a value with at
# most 24 significant bits and a power of two is exact whenever it is a float32 normal, and
# overflows to inf exactly as the bit-built path does. What it cannot do on every backend is
# a subnormal result (XLA on CPU flushes them, docs/design.md §8), so it is used only when no
# block can produce one: see fast_decode_exact.


def fast_decode_applies(fmt: MXFormat) -> bool:
    """Whether the fast decode serves ``fmt`` (static): E8M0 scale codes, as it builds them,
    and elements of at most 8 bits whose every nonzero value is a float32 normal (so no
    operand of the multiply can be flushed)."""
    sc, el = fmt.scale, fmt.element
    lowest = el.emin - (el.mantissa_bits if el.subnormals else 0)
    return (
        not sc.signed and not sc.zero and sc.mantissa_bits == 0 and sc.exponent_bits == 8
        and sc.bias == E8M0_BIAS and sc.nan_code == E8M0_NAN
        and el.code_bits <= 8 and el.mantissa_bits < F32_MANT_BITS and lowest >= -126
    )


def fast_scale_min(fmt: MXFormat) -> int:
    """The smallest scale code at which even the element's smallest nonzero magnitude,
    2^(emin - M) (2^emin without subnormals), times 2^(s - 127) is at least 2^-126, a
    float32 (and bfloat16) normal: s >= 1 - (emin - M). 10 for E4M3, 17 for E5M2, 2 for
    E2M1."""
    el = fmt.element
    lowest = el.emin - (el.mantissa_bits if el.subnormals else 0)
    return max(1, 1 - lowest)


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
        mag = (1 << el.magnitude_bits) - 1  # drops the sign bit
        mask = mag | (mag << 4) if fmt.packed else mag
        per_block = fmt.block_size // 2 if fmt.packed else fmt.block_size
        nonzero = split_blocks((elements & mask) != 0, axis, per_block).any(axis=axis + 1)
        return jnp.all(big | ~nonzero)

    return lax.cond(jnp.all(big), lambda: jnp.bool_(True), small_blocks_are_zero)


def e8m0_factor(scales):
    """float32 2^(s - 127) of E8M0 codes, from the bits: the exponent field is ``s``; code 0
    gives the subnormal 2^-127 (0 where the backend flushes subnormals: only all-zero blocks
    use it on the fast path) and 0xFF a quiet NaN."""
    s = scales.astype(jnp.uint32)
    low = jnp.where((s == 0) | (s == E8M0_NAN), jnp.uint32(1 << 22), jnp.uint32(0))
    return bits_to_f32(lax.shift_left(s, jnp.uint32(F32_MANT_BITS)) | low)


def mx_value_bits_fast(elements, scales, fmt: MXFormat, axis: int, n: int, canonical_nan=True,
                       factor=None):
    """:func:`mx_value_bits` by one float multiply per element; exact (bit for bit, NaN
    made the canonical quiet NaN as there unless ``canonical_nan`` is False) when
    :func:`fast_decode_exact` holds. ``factor``: ``e8m0_factor(scales)`` computed by the
    caller (else here)."""
    if factor is None:
        factor = e8m0_factor(scales)
    v = decode_f32(fmt.element, _element_codes(elements, fmt, axis))
    bits = f32_bits(v * jnp.expand_dims(factor, axis + 1))
    if canonical_nan:
        bits = jnp.where((bits & F32_ABS) > F32_INF, jnp.uint32(F32_QNAN), bits)
    return lax.slice_in_dim(merge_blocks(bits, axis), 0, n, axis=axis)


def mx_values(elements, scales, fmt: MXFormat, axis: int, n: int, dtype):
    """Exact values of MX codes as ``dtype`` (rounded to nearest even if narrower than
    float32): the fast decode when it is exact for these codes, else the bit-built one."""

    def exact(e, s, f):
        return bits_to_dtype(mx_value_bits(e, s, fmt, axis, n), dtype)

    if not fast_decode_applies(fmt):
        return exact(elements, scales, None)

    def fast(e, s, f):
        return bits_to_dtype(mx_value_bits_fast(e, s, fmt, axis, n, factor=f), dtype)

    # The block factors are computed before the branch (one per block, then broadcast), not
    # redone for every element inside the branch's fused loop.
    factor = e8m0_factor(scales)
    pred = fast_decode_exact(elements, scales, fmt, axis)
    return lax.cond(pred, fast, exact, elements, scales, factor)


@functools.partial(jax.jit, static_argnums=(2, 3, 4, 5))
def _dequantize_jit(elements, scales, fmt: MXFormat, axis: int, n: int, dtype):
    return mx_values(elements, scales, fmt, axis, n, dtype)


def dequantize(mx: MXArray, dtype=jnp.float32) -> jax.Array:
    """Returns the values of an :class:`MXArray` as ``dtype`` (default float32).

    Values 2^(scale − 127) × element are computed exactly in float32 (subnormal results
    included); a narrower ``dtype`` (bfloat16, float16) rounds them to nearest even.
    Padding added by ``pad=True`` is dropped.

    Example:
        >>> import jax.numpy as jnp
        >>> x = jnp.array([1.0, -0.5, 3.0, 6.0] * 8)
        >>> bool((dequantize(quantize_mx(x, "mxfp4")) == x).all())
        True
    """
    if not isinstance(mx, MXArray):
        raise TypeError(f"dequantize takes an MXArray (from quantize_mx), got {type(mx).__name__}")
    dtype = check_float_dtype(dtype)
    return _dequantize_jit(mx.elements, mx.scales, mx.fmt, mx.axis, mx.shape[mx.axis], dtype)


# -- fake quantization --------------------------------------------------------------------


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2, 3))
def _fake_quantize_mx(x, cast: MXCast, axis: int, padded: int, rng):
    elements, scales = quantize_blocks(padded_bits(x, axis, padded), cast, axis, rng)
    return bits_to_dtype(mx_value_bits(elements, scales, cast.fmt, axis, x.shape[axis]), x.dtype)


@_fake_quantize_mx.defjvp
def _fake_quantize_mx_jvp(cast, axis, padded, primals, tangents):
    x, rng = primals
    return _fake_quantize_mx(x, cast, axis, padded, rng), tangents[0]  # straight-through


_fake_quantize_mx_jit = jax.jit(_fake_quantize_mx, static_argnums=(1, 2, 3))


def fake_quantize_mx(
    x,
    fmt: MXFormatLike,
    *,
    axis: int = -1,
    scale_rule: Union[str, ScaleRule] = DEFAULT_SCALE_RULE,
    rounding: str = "nearest_even",
    pad: bool = False,
    key: Optional[jax.Array] = None,
    random_bits: Optional[jax.Array] = None,
) -> jax.Array:
    """``dequantize(quantize_mx(x, fmt, ...), x.dtype)`` with a straight-through gradient.

    Bit-level throughout, so XLA cannot elide it under ``jit`` on GPU. bfloat16 input
    gives bfloat16 output (exact unless a value falls below bfloat16's normal range).
    Arguments as for :func:`quantize_mx`.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> x = jnp.linspace(-3.0, 3.0, 32)
        >>> jax.grad(lambda v: fake_quantize_mx(v, "mxfp4").sum())(x)[:3].tolist()
        [1.0, 1.0, 1.0]
    """
    x, fmt = array_then_format(x, fmt, "fake_quantize_mx")
    cast = MXCast(fmt, scale_rule, rounding)
    cast.check_key(key, random_bits)
    x = jnp.asarray(x)
    axis, _, padded = check_block_input(x.shape, x.dtype, cast.fmt, axis, pad, "fake_quantize_mx")
    check_random_bits(random_bits, _padded_shape(x.shape, axis, padded), "the padded shape")
    return _fake_quantize_mx_jit(x, cast, axis, padded, (key, random_bits))
