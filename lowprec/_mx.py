"""OCP MX block quantization (MXFP8 E4M3/E5M2, MXFP4): E8M0 scales shared by 32 elements.

Semantics (see DESIGN.md §3): the block maximum is read from exact float32 exponent bits,
one of four scale rules picks the shared exponent, and elements are encoded from
``V_i * 2^-shared_exp`` by moving exponents in integer arithmetic (never a float division,
so subnormal inputs such as 2^-130 stay exact on CPU, where XLA flushes denormals).
"""

from __future__ import annotations

import dataclasses
import functools
from fractions import Fraction
from typing import Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import lowprec_formats as _data

from ._codec import _F32_INF, _F32_QNAN, _decode_bits, _encode_bits
from ._format import MXFormat, mx_format
from ._pack import _normalize_axis, _pack_last, _unpack_last
from ._rounding import check_key, check_rounding

SCALE_RULES: tuple[str, ...] = _data.SCALE_RULES
DEFAULT_SCALE_RULE = "floor"  # the OCP MX v1.0 rule; "rceil" is what NVIDIA hardware uses

_E8M0_NAN = 0xFF
_E8M0_BIAS = 127


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["elements", "scales"],
    meta_fields=["fmt", "axis", "shape", "scale_rule"],
)
@dataclasses.dataclass(frozen=True)
class MXArray:
    """A block-quantized array (a JAX pytree).

    Attributes:
      elements: uint8 element codes with the (padded) input shape; for MXFP4 packed two
        per byte along ``axis`` (even element in the low nibble), so that axis is halved.
      scales: uint8 E8M0 codes, the input shape with ``axis`` divided by the block size.
        0xFF marks a block that held a NaN or an infinity (it dequantizes to NaN).
      fmt: the :class:`MXFormat` (static).
      axis: non-negative block axis (static).
      shape: shape of the original, unpadded array (static).
      scale_rule: the rule that chose the scales, or None if unknown (static).
    """

    elements: jax.Array
    scales: jax.Array
    fmt: MXFormat
    axis: int
    shape: tuple
    scale_rule: Optional[str] = DEFAULT_SCALE_RULE

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def padded_length(self) -> int:
        """Length of the block axis after zero padding (a multiple of the block size)."""
        return self.scales.shape[self.axis] * self.fmt.block_size

    @property
    def nbytes(self) -> int:
        """Bytes of storage (elements + scales)."""
        return int(self.elements.size) + int(self.scales.size)


def _check_scale_rule(scale_rule: str) -> str:
    if scale_rule not in SCALE_RULES:
        raise ValueError(f"unknown scale_rule {scale_rule!r}; valid rules: {SCALE_RULES}")
    return scale_rule


def _floor_log2_bits(bits):
    """floor(log2 v) for the float32 pattern ``bits`` of v >= 0 (int32; v = 0 gives -150)."""
    efield = lax.shift_right_logical(bits, jnp.uint32(23)).astype(jnp.int32)
    sig = jnp.where(efield > 0, (bits & 0x7F_FFFF) | 0x80_0000, bits & 0x7F_FFFF)
    return jnp.maximum(efield, 1) - 150 + 31 - lax.clz(sig).astype(jnp.int32)


def _floor_f32(v: Fraction) -> np.float32:
    """The largest float32 not above the positive rational ``v``."""
    f = np.float32(float(v))
    if Fraction(float(f)) > v:
        f = np.nextafter(f, np.float32(0))
    return f


def _rceil_code(amax_bits, max_elem: Fraction):
    """E8M0 code of float32(amax / max_elem) rounded up to a power of two.

    Bit for bit the rule of ``jax._src.cudnn.scaled_matmul_stablehlo
    .cast_to_e8m0_with_rounding_up`` applied to the IEEE float32 quotient: mantissa > 0 →
    exponent + 1 (except at exponent 0xFE); a subnormal quotient rounds up to 2^-126 only
    when above 2^-127. Integer-only (checked against the IEEE division for every finite
    float32 amax): with max_elem = 1.f × 2^k, a normal quotient is an exact power of two
    only when amax's mantissa field equals f's, and otherwise lies in amax's binade shifted
    by k when amax's mantissa is above f, just below it otherwise. A subnormal quotient
    (amax < max_elem × 2^-126) exceeds 2^-127 iff amax > max_elem × (2^-127 + 2^-150);
    float32 patterns of non-negative values order like the values, so compare the bits.
    """
    mf = int(np.float32(float(max_elem)).view(np.uint32))
    k = (mf >> 23) - 127
    max_mant = mf & 0x7F_FFFF
    small_bits = int(np.float32(float(max_elem * Fraction(1, 2**126))).view(np.uint32))  # exact
    thr = _floor_f32(max_elem * (Fraction(1, 2**127) + Fraction(1, 2**150)))
    efield = lax.shift_right_logical(amax_bits, jnp.uint32(23)).astype(jnp.int32)
    above = ((amax_bits & 0x7F_FFFF) > max_mant).astype(jnp.int32)
    normal_code = jnp.minimum(efield - k + above, 0xFE)
    sub_code = (amax_bits > int(thr.view(np.uint32))).astype(jnp.int32)
    return jnp.where(amax_bits < small_bits, sub_code, normal_code)


def _shared_exponent(amax_bits, fmt: MXFormat, scale_rule: str):
    """Unclamped shared exponent of each block (int32) from its amax float32 bits."""
    elem = fmt.element
    emax = fmt.emax_elem
    if scale_rule == "floor":
        return _floor_log2_bits(amax_bits) - emax
    if scale_rule == "ceil":
        sig = amax_bits & 0x7F_FFFF
        not_pow2 = jnp.where(
            (amax_bits >> 23) > 0, sig != 0, (sig & (sig - 1)) != 0
        )
        return _floor_log2_bits(amax_bits) + not_pow2.astype(jnp.int32) - emax
    if scale_rule == "even":
        # Round amax's significand to the element's mantissa width, half up, on the bits.
        drop = 23 - elem.mantissa_bits
        rounded = (amax_bits + jnp.uint32(1 << (drop - 1))) & jnp.uint32(~((1 << drop) - 1) & 0xFFFF_FFFF)
        return _floor_log2_bits(rounded) - emax
    if scale_rule == "rceil":
        return _rceil_code(amax_bits, elem.max_finite_exact) - _E8M0_BIAS
    raise AssertionError(scale_rule)


def _blocked(x, axis: int, block: int):
    """Moves ``axis`` last and splits it into (n / block, block)."""
    x = jnp.moveaxis(x, axis, -1)
    return x.reshape(*x.shape[:-1], x.shape[-1] // block, block)


def _unblocked(x, axis: int):
    x = x.reshape(*x.shape[:-2], x.shape[-2] * x.shape[-1])
    return jnp.moveaxis(x, -1, axis)


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def _quantize_mx_core(x, fmt: MXFormat, axis: int, scale_rule: str, rounding: str, key):
    block = fmt.block_size
    xb = _blocked(x, axis, block)
    # Integer max of magnitudes: exact for subnormals, and NaN/Inf patterns sort on top.
    # Taken over a (block/4, 4) split of each block, last dim first: XLA:CPU then emits one
    # vectorized reduce over two dims, several times faster than its reduce over a single
    # trailing dim of 32 (splitting after the bitcast gets folded back into that form).
    quads = xb.reshape(*xb.shape[:-1], block // 4, 4)
    mag_bits = lax.bitcast_convert_type(quads, jnp.uint32) & 0x7FFF_FFFF
    amax_bits = jnp.max(jnp.max(mag_bits, axis=-1), axis=-1)
    special = amax_bits >= _F32_INF
    shared = jnp.clip(_shared_exponent(amax_bits, fmt, scale_rule), -_E8M0_BIAS, _E8M0_BIAS)
    random_bits = None
    if rounding == "stochastic":
        random_bits = _blocked(jax.random.bits(key, x.shape, jnp.uint32), axis, block)
    codes = _encode_bits(
        fmt.element, xb, rounding, "saturate", random_bits, scale_exp=shared[..., None],
        assume_finite=True,  # blocks holding a NaN/Inf are zeroed just below
    )
    codes = jnp.where(special[..., None], 0, codes).astype(jnp.uint8)
    scales = jnp.where(special, _E8M0_NAN, shared + _E8M0_BIAS).astype(jnp.uint8)
    if fmt.packed:
        codes = _pack_last(codes)  # pairs never straddle blocks, so pack while blocked
    return _unblocked(codes, axis), jnp.moveaxis(scales, -1, axis)


def _prepare(x, fmt, axis, scale_rule, rounding, pad, key):
    fmt = mx_format(fmt)
    scale_rule = _check_scale_rule(scale_rule)
    rounding = check_rounding(fmt.element, rounding)
    check_key(rounding, key)
    x = jnp.asarray(x)
    if x.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
        raise TypeError(
            f"quantize_mx takes float32, bfloat16 or float16 input, got dtype {x.dtype}; "
            "convert with x.astype(jnp.float32)"
        )
    if x.ndim == 0:
        raise ValueError("quantize_mx needs at least a 1-D array (blocks run along an axis)")
    axis = _normalize_axis(axis, x.ndim)
    n = x.shape[axis]
    block = fmt.block_size
    if n % block:
        if not pad:
            raise ValueError(
                f"axis {axis} has length {n}, not a multiple of the MX block size {block}; "
                f"pass pad=True to zero-pad it to {-(-n // block) * block} (dequantize "
                "drops the padding), or choose another axis"
            )
        widths = [(0, 0)] * x.ndim
        widths[axis] = (0, -n % block)
        x = jnp.pad(x, widths)
    return x.astype(jnp.float32), fmt, axis, scale_rule, rounding, n


def quantize_mx(
    x,
    fmt: Union[str, MXFormat],
    *,
    axis: int = -1,
    scale_rule: str = DEFAULT_SCALE_RULE,
    rounding: str = "nearest_even",
    pad: bool = False,
    key: Optional[jax.Array] = None,
) -> MXArray:
    """Block-quantizes ``x`` to an OCP MX format.

    Args:
      x: float32, bfloat16 or float16 array.
      fmt: ``"mxfp8_e4m3"`` (alias ``"mxfp8"``), ``"mxfp8_e5m2"``, ``"mxfp4"`` or an
        :class:`MXFormat`.
      axis: blocks are 32 consecutive elements along this axis (default: last).
      scale_rule: how the shared exponent follows from the block's max magnitude amax,
        with e = floor(log2 amax) read from the exact float32 bits and emax_elem = 8, 15, 2:
        ``"floor"`` (default; OCP MX v1.0 §6.3, microxcaling, gfloat): e − emax_elem;
        ``"ceil"``: ceil(log2 amax) − emax_elem; ``"even"``: amax's significand rounded
        (half up) to the element's mantissa width first; ``"rceil"`` (NVIDIA, JAX's
        ``jax.nn`` MXFP8): amax / max_elem in float32, rounded up to a power of two.
        Shared exponents are clamped to [−127, 127].
      rounding: element rounding mode (see :func:`lowprec.encode`); elements saturate to
        ± the element format's max, so under ``"floor"`` block maxima above
        1.75·2^emax_elem (FP8) or 1.5·2^emax_elem (FP4) are clipped, by design.
      pad: zero-pad the axis to a multiple of 32 instead of raising.
      key: PRNG key, for ``rounding="stochastic"`` only; element i of the padded ``x`` rounds
        up iff ``jax.random.bits(key, padded_shape, jnp.uint32)[i] < frac_i * 2**32``.

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
    x, fmt, axis, scale_rule, rounding, n = _prepare(x, fmt, axis, scale_rule, rounding, pad, key)
    shape = x.shape[:axis] + (n,) + x.shape[axis + 1 :]
    elements, scales = _quantize_mx_core(x, fmt, axis, scale_rule, rounding, key)
    return MXArray(elements, scales, fmt, axis, shape, scale_rule)


def _scale_bits(value_bits, scale_codes):
    """float32 bits of value × 2^(scale − 127), exactly (subnormal results included)."""
    sign = value_bits & jnp.uint32(0x8000_0000)
    mag = value_bits & 0x7FFF_FFFF
    ef = lax.shift_right_logical(mag, jnp.uint32(23)).astype(jnp.int32)
    nf = ef + scale_codes.astype(jnp.int32) - _E8M0_BIAS
    mant = mag & 0x7F_FFFF
    normal = lax.shift_left(jnp.clip(nf, 0, 255).astype(jnp.uint32), jnp.uint32(23)) | mant
    # Results below 2^-126: shift the significand (at most 4 bits wide) into the subnormal
    # field; nothing is lost because element values sit far above float32's last bit.
    sub = lax.shift_right_logical(mant | 0x80_0000, jnp.clip(1 - nf, 0, 31).astype(jnp.uint32))
    out = jnp.where(nf >= 1, jnp.where(nf >= 255, jnp.uint32(_F32_INF), normal), sub)
    out = jnp.where(mag == 0, jnp.uint32(0), out)
    # An infinite element (E5M2) stays ±inf under any finite scale; NaN elements and
    # NaN scales (0xFF: the block held a NaN/Inf) give NaN.
    out = jnp.where(mag == _F32_INF, jnp.uint32(_F32_INF), out)
    nan = (mag > _F32_INF) | (scale_codes == _E8M0_NAN)
    return jnp.where(nan, jnp.uint32(_F32_QNAN), out | sign)


@functools.partial(jax.jit, static_argnums=(2, 3, 4, 5))
def _dequantize_core(elements, scales, fmt: MXFormat, axis: int, n: int, dtype):
    block = fmt.block_size // 2 if fmt.packed else fmt.block_size
    codes = _blocked(elements, axis, block)
    if fmt.packed:
        codes = _unpack_last(codes)
    vb = _decode_bits(fmt.element, codes)
    sb = jnp.moveaxis(scales, axis, -1)[..., None]
    values = lax.bitcast_convert_type(_unblocked(_scale_bits(vb, sb), axis), jnp.float32)
    values = lax.slice_in_dim(values, 0, n, axis=axis)
    return values if dtype == np.dtype(np.float32) else values.astype(dtype)


def dequantize(mx: MXArray, dtype=jnp.float32) -> jax.Array:
    """Returns the values of an :class:`MXArray` as ``dtype`` (default float32).

    Values 2^(scale − 127) × element are computed exactly in float32 (subnormal results
    included); a narrower ``dtype`` rounds them. Padding added by ``pad=True`` is dropped.

    Example:
        >>> import jax.numpy as jnp
        >>> x = jnp.array([1.0, -0.5, 3.0, 6.0] * 8)
        >>> bool((dequantize(quantize_mx(x, "mxfp4")) == x).all())
        True
    """
    if not isinstance(mx, MXArray):
        raise TypeError(f"dequantize takes an MXArray (from quantize_mx), got {type(mx).__name__}")
    dtype = np.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"dtype must be a floating dtype, got {dtype}")
    return _dequantize_core(mx.elements, mx.scales, mx.fmt, mx.axis, mx.shape[mx.axis], dtype)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2, 3, 4, 5))
def _fake_quantize_mx(x, fmt, axis, scale_rule, rounding, pad, key):
    mx = quantize_mx(x, fmt, axis=axis, scale_rule=scale_rule, rounding=rounding, pad=pad, key=key)
    return dequantize(mx, x.dtype)


@_fake_quantize_mx.defjvp
def _fake_quantize_mx_jvp(fmt, axis, scale_rule, rounding, pad, primals, tangents):
    x, key = primals
    return _fake_quantize_mx(x, fmt, axis, scale_rule, rounding, pad, key), tangents[0]


def fake_quantize_mx(
    x,
    fmt: Union[str, MXFormat],
    *,
    axis: int = -1,
    scale_rule: str = DEFAULT_SCALE_RULE,
    rounding: str = "nearest_even",
    pad: bool = False,
    key: Optional[jax.Array] = None,
) -> jax.Array:
    """``dequantize(quantize_mx(x, ...), x.dtype)`` with a straight-through gradient.

    Bit-level throughout, so XLA cannot elide it under ``jit`` on GPU. bfloat16 input
    gives bfloat16 output (exact unless a value falls below bfloat16's normal range).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> x = jnp.linspace(-3.0, 3.0, 32)
        >>> jax.grad(lambda v: fake_quantize_mx(v, "mxfp4").sum())(x)[:3].tolist()
        [1.0, 1.0, 1.0]
    """
    fmt = mx_format(fmt)
    _check_scale_rule(scale_rule)
    rounding = check_rounding(fmt.element, rounding)
    check_key(rounding, key)
    return _fake_quantize_mx(jnp.asarray(x), fmt, axis, scale_rule, rounding, pad, key)


def to_gpt_oss(mx: MXArray) -> tuple[jax.Array, jax.Array]:
    """Exports an MXFP4 array in the gpt-oss / Hugging Face layout.

    Returns ``(blocks, scales)``: ``blocks`` uint8 [..., K/32, 16] (each byte holds element
    2k in its low nibble and 2k+1 in its high nibble) and ``scales`` uint8 [..., K/32]
    (E8M0 codes). The published decoder reads value = FP4_VALUES[nibble] × 2^(scale − 127).

    Raises:
      ValueError: unless ``mx`` is MXFP4, blocked along its last axis, without padding.

    Example:
        >>> import jax.numpy as jnp
        >>> blocks, scales = to_gpt_oss(quantize_mx(jnp.ones((2, 64)), "mxfp4"))
        >>> blocks.shape, scales.shape
        ((2, 2, 16), (2, 2))
    """
    if mx.fmt.name != "mxfp4":
        raise ValueError(f"the gpt-oss layout holds MXFP4 only, got {mx.fmt.name!r}")
    if mx.axis != mx.ndim - 1:
        raise ValueError(
            f"the gpt-oss layout blocks the last axis; this array is blocked along axis "
            f"{mx.axis} of {mx.ndim}: quantize with axis=-1 (transpose first if needed)"
        )
    if mx.padded_length != mx.shape[-1]:
        raise ValueError(
            f"the gpt-oss layout has no padding; last axis {mx.shape[-1]} is not a multiple of 32"
        )
    groups = mx.scales.shape[-1]
    blocks = mx.elements.reshape(*mx.elements.shape[:-1], groups, mx.fmt.block_size // 2)
    return blocks, mx.scales


def from_gpt_oss(blocks, scales, scale_rule: Optional[str] = None) -> MXArray:
    """Imports gpt-oss / Hugging Face MXFP4 ``*_blocks`` and ``*_scales`` as an :class:`MXArray`.

    Args:
      blocks: uint8 [..., G, 16] packed FP4 codes.
      scales: uint8 [..., G] E8M0 codes.
      scale_rule: the rule that produced the scales, if known (metadata only).

    Example:
        >>> import jax.numpy as jnp
        >>> mx = quantize_mx(jnp.arange(64.0).reshape(1, 64), "mxfp4")
        >>> back = from_gpt_oss(*to_gpt_oss(mx))
        >>> bool((dequantize(back) == dequantize(mx)).all())
        True
    """
    blocks = jnp.asarray(blocks)
    scales = jnp.asarray(scales)
    if blocks.dtype != jnp.uint8 or scales.dtype != jnp.uint8:
        raise TypeError(f"blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.ndim < 2 or blocks.shape[-1] != 16 or blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"expected blocks [..., G, 16] and scales [..., G], got {blocks.shape} and "
            f"{scales.shape}"
        )
    fmt = mx_format("mxfp4")
    elements = blocks.reshape(*blocks.shape[:-2], blocks.shape[-2] * 16)
    shape = tuple(scales.shape[:-1]) + (scales.shape[-1] * fmt.block_size,)
    return MXArray(elements, scales, fmt, len(shape) - 1, shape, scale_rule)
