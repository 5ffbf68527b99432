"""Block quantization: the OCP MX formats (MXFP8, MXFP6, MXFP4, MXINT8: E8M0 scales shared
by blocks of 32, or any power of two from 2 to 1024) and NVFP4 (E4M3 block scales under a
float32 tensor scale).

Semantics (docs/design.md §3): the block maximum is read from exact float32 bits, a
:class:`~lowprec.ScaleRule` picks the shared exponent, and elements are encoded from
``V_i * 2^-shared_exp`` by moving exponents in integer arithmetic (never a float division,
so subnormal inputs such as 2^-130 stay exact on CPU, where XLA flushes denormals). NVFP4
follows torchao's recipe, each float32 step computed exactly on the bits (``_nvfp4.py``).
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

from . import _nvfp4
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
from ._decode import decode_bits, decode_f32
from ._dtypes import bits_to_dtype, check_float_dtype, host_decode
from ._encode_stochastic import encode_any
from ._format import MXFormat, MXFormatLike, array_then_format, mx_format
from ._options import MXCast, check_no_scale_rule, check_random_bits, check_tensor_scale
from ._pack import pack_along, unpack_along
from ._scale_rules import (
    ScaleRule,
    block_amax_bits,
    check_scale_rule,
    scale_codes_of_amax,
)
from ._sharding import check_mx_input


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["elements", "scales", "tensor_scale"],
    meta_fields=["fmt", "axis", "shape", "scale_rule"],
)
@dataclasses.dataclass(frozen=True)
class MXArray:
    """A block-quantized array (a JAX pytree). Validates itself on construction.

    Attributes:
      elements: uint8 element codes with the (padded) input shape; sub-byte codes are packed
        along ``axis`` as a little-endian bit stream: FP4 two per byte (even element in the
        low nibble), so that axis is halved; FP6 four per three bytes (axis times 3/4).
        MXINT8 codes are two's-complement bytes.
      scales: uint8 scale codes (E8M0; E4M3 for NVFP4), the input shape with ``axis``
        divided by the block size. The scale format's NaN (0xFF; NVFP4: 0x7F) marks a block
        that held a NaN or an infinity (it dequantizes to NaN).
      fmt: the :class:`MXFormat` (static; a format name is resolved).
      axis: the block axis (static; a negative axis is normalized).
      shape: shape of the original, unpadded array (static).
      scale_rule: the :class:`~lowprec.ScaleRule` that chose the scales, or None if
        unknown or not applicable (NVFP4) (static).
      tensor_scale: the float32 scalar multiplying every block scale, for formats that have
        one (NVFP4); None otherwise.

    Construction checks (statically, so also under ``jit``) that both arrays are uint8 and
    that their shapes agree with ``shape``, ``axis``, the block size and the packing, and
    that a tensor scale is present exactly when the format has one.
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
    tensor_scale: Optional[jax.Array] = None

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
            _check_tensor_scale_leaf(self.tensor_scale, self.scales, fmt, shape)

    def __repr__(self) -> str:
        def leaf(v):
            if hasattr(v, "shape") and hasattr(v, "dtype"):
                return f"{np.dtype(v.dtype).name}{list(v.shape)}"
            return repr(v)

        rule = None if self.scale_rule is None else self.scale_rule.value
        ts = "" if self.tensor_scale is None else f", tensor_scale={leaf(self.tensor_scale)}"
        return (
            f"MXArray(elements={leaf(self.elements)}, scales={leaf(self.scales)}, "
            f"fmt={self.fmt!r}, axis={self.axis}, shape={self.shape}, scale_rule={rule!r}{ts})"
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
        """Bytes of storage (elements + scales, + 4 for a float32 tensor scale)."""
        extra = 0 if self.tensor_scale is None else 4 * int(np.prod(self.tensor_scale.shape))
        return int(np.prod(self.elements.shape)) + int(np.prod(self.scales.shape)) + extra


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
    want_el = shape[:axis] + (blocks * fmt.bytes_per_block,) + shape[axis + 1 :]
    ok = len(el) == len(sc) >= nd and el[: len(el) - nd] == sc[: len(sc) - nd]
    if not ok or sc[len(sc) - nd :] != want_sc:
        raise ValueError(
            f"MXArray: scales have shape {sc} but {fmt.name} over shape {shape} blocked along "
            f"axis {axis} needs {want_sc} (one {fmt.scale.name.upper()} code per "
            f"{fmt.block_size} elements)"
        )
    if el[len(el) - nd :] != want_el:
        packing = {
            4: " (FP4: two codes per byte along the block axis)",
            6: " (FP6: four codes per three bytes along the block axis)",
        }.get(fmt.element.code_bits, "")
        raise ValueError(
            f"MXArray: elements have shape {el} but {fmt.name} over shape {shape} blocked "
            f"along axis {axis} needs {want_el}{packing} (scales {sc})"
        )


def _check_tensor_scale_leaf(ts, scales, fmt: MXFormat, shape: tuple) -> None:
    if not fmt.tensor_scale:
        if ts is not None:
            raise ValueError(f"MXArray: {fmt.name} has no tensor scale, got tensor_scale={ts!r}")
        return
    if ts is None:
        raise ValueError(
            f"MXArray: {fmt.name} needs its float32 tensor_scale (quantize_mx computes it)"
        )
    if not (hasattr(ts, "shape") and hasattr(ts, "dtype")):
        return  # a placeholder while JAX rebuilds the pytree
    batch = tuple(scales.shape)[: len(scales.shape) - len(shape)]
    if np.dtype(ts.dtype) != np.float32 or tuple(ts.shape) != batch:
        raise TypeError(
            f"MXArray: tensor_scale must be a float32 scalar (batch shape {batch}), got "
            f"{np.dtype(ts.dtype)}{list(ts.shape)}"
        )
    if isinstance(ts, jax.core.Tracer) or not isinstance(ts, (np.ndarray, np.generic, jax.Array)):
        return  # traced (or a shape stand-in): dequantize decodes an invalid one to NaN
    values = np.asarray(ts, np.float32)
    bad = ~(np.isfinite(values) & (values > 0))
    if np.any(bad):
        raise ValueError(
            f"MXArray: {fmt.name} tensor_scale must be positive and finite (it multiplies every "
            f"block scale), got {values[bad].flat[0]!r}; a zero or negative scale would zero or "
            "flip the tensor. Use the scale quantize_mx computed (amax / 2688)"
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
    a multiple of the block size, for E8M0-scaled formats. Trace-time core of quantize_mx,
    the matmul path and the Pallas quantize kernel (which passes a last-axis FP4 ``pack``
    that Triton can lower).
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
            # Packing groups never straddle blocks (a block is whole bytes): pack while split.
            codes = pack_along(codes, inner, fmt.element.code_bits)
        else:
            assert inner == codes.ndim - 1, "a caller's pack works along the last axis"
            codes = pack(codes)
    return merge_blocks(codes, axis), scale_codes.astype(jnp.uint8)


def _padded_shape(shape, axis: int, padded: int) -> tuple:
    return tuple(shape[:axis]) + (padded,) + tuple(shape[axis + 1 :])


def finite_amax_bits(bits):
    """Bits of the largest finite magnitude of float32 patterns (0 if there is none)."""
    mag = bits & F32_ABS
    return jnp.max(jnp.where(mag < F32_INF, mag, jnp.uint32(0)), initial=jnp.uint32(0))


def quantize_nvfp4_blocks(bits, cast: MXCast, axis: int, rng=None, tensor_scale=None):
    """``(elements, scales, tensor_scale)`` of float32 patterns for NVFP4-style formats
    (E4M3 block scales under a float32 tensor scale; docs/design.md §3b).

    ``tensor_scale``: a float32 scalar, or None to take float32(amax / 2688) of ``bits``;
    either is raised to 2^-143 at least (2^-121 for the ``"reciprocal"`` step).
    ``rng`` as for :func:`quantize_blocks`.
    """
    fmt = cast.fmt
    if tensor_scale is None:
        ts_bits = _nvfp4.tensor_scale_bits(finite_amax_bits(bits))
    else:
        ts_bits = lax.bitcast_convert_type(jnp.asarray(tensor_scale, jnp.float32), jnp.uint32)
    ts_bits = _nvfp4.clamp_tensor_scale_bits(ts_bits)
    reciprocal = cast.nvfp4_step == "reciprocal"
    if reciprocal:
        ts_bits = jnp.maximum(ts_bits, jnp.uint32(_nvfp4.MIN_RECIPROCAL_TENSOR_SCALE_BITS))
    inner = axis + 1
    xb = split_blocks(bits, axis, fmt.block_size)
    amax = _block_amax(xb, inner)
    special = amax >= F32_INF
    scale_codes = _nvfp4.block_scale_codes(amax, ts_bits, fmt.scale)
    if reciprocal:
        factor = _nvfp4.reciprocal_factor_bits(scale_codes, ts_bits, fmt.scale)
        quotient = _nvfp4.f32_mul(xb, jnp.expand_dims(factor, inner))
    else:
        total = jnp.expand_dims(_nvfp4.total_scale_bits(scale_codes, ts_bits, fmt.scale), inner)
        quotient = _nvfp4.element_quotient_bits(xb, total)
    if cast.stochastic:
        key, words = rng
        rng = (key, None if words is None else split_blocks(words, axis, fmt.block_size))
    codes = encode_any(fmt.element, quotient, cast.rounding, "saturate", rng,
                       assume_finite=True)  # blocks holding a NaN/Inf are zeroed just below
    codes = jnp.where(jnp.expand_dims(special, inner), 0, codes).astype(jnp.uint8)
    scale_codes = jnp.where(special, fmt.scale.nan_code, scale_codes).astype(jnp.uint8)
    if fmt.packed:
        codes = pack_along(codes, inner, fmt.element.code_bits)
    return merge_blocks(codes, axis), scale_codes, lax.bitcast_convert_type(ts_bits, jnp.float32)


def quantize_mxarray(bits, cast: MXCast, axis: int, shape: tuple, rng=None, tensor_scale=None):
    """The :class:`MXArray` of float32 patterns ``bits`` (``axis`` already padded to whole
    blocks; ``shape`` the unpadded shape), any block format. Trace-time helper."""
    if cast.fmt.tensor_scale:
        elements, scales, ts = quantize_nvfp4_blocks(bits, cast, axis, rng, tensor_scale)
    else:
        (elements, scales), ts = quantize_blocks(bits, cast, axis, rng), None
    return MXArray(elements, scales, cast.fmt, axis, shape, cast.scale_rule, ts)


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def _quantize_mx_jit(x, cast: MXCast, axis: int, padded: int, kernel_ok: bool, rng, tensor_scale):
    def xla(v):
        return quantize_mxarray(padded_bits(v, axis, padded), cast, axis, tuple(v.shape), rng,
                                tensor_scale)

    if not (kernel_ok and _pallas_quantize_serves(x, cast, axis, padded)):
        return xla(x)
    from ._quantize_pallas import quantize_mx_pallas

    def one_pass_kernel(v):
        elements, scales = quantize_mx_pallas(v, cast, axis=axis)
        return MXArray(elements, scales, cast.fmt, axis, tuple(v.shape), cast.scale_rule)

    # XLA compiles the block maximum and the encode into two passes over x (a reduction,
    # then a loop that reads x again: 1.9-2.5x the ideal bytes on an H100); the Pallas
    # kernel makes one (1.00x), from the same integer core, so the same bits
    # (benchmarks/gpu_hlo_report.py --target h100). Other backends keep XLA's fusion.
    return lax.platform_dependent(x, cuda=one_pass_kernel, default=xla)


def _unsharded(x) -> bool:
    """False for an array laid out over several devices (a concrete array's sharding, or a
    traced one's Explicit mesh axes): the Pallas kernels are single-device custom calls,
    which XLA's partitioner would run on gathered inputs, so sharded inputs keep XLA's
    formulation (partitioned like any elementwise program). Traced inputs over Auto axes
    carry no layout at trace time: they take the kernel."""
    sharding = getattr(x, "sharding", None)
    if sharding is not None and not isinstance(x, jax.core.Tracer):
        return len(sharding.device_set) <= 1
    try:
        spec = jax.typeof(x).sharding.spec
    except Exception:  # noqa: BLE001 - no sharding in the type
        return True
    return all(s is None for s in spec)


def _pallas_quantize_serves(x, cast: MXCast, axis: int, padded: int, fake: bool = False) -> bool:
    """Whether quantize_mx (``fake``: fake_quantize_mx) takes its Pallas kernel on CUDA
    (static): blocks along the last axis or axis 0 of a 2-D array (zero padding included),
    float32/bfloat16/float16 input,
    a format and rounding the kernel serves, JAX able to compile for CUDA, and Pallas with
    its Triton backend importable."""
    if x.ndim == 0 or x.size == 0 or not (axis == x.ndim - 1 or (axis == 0 and x.ndim == 2)):
        return False  # (a padded block axis is padded in the kernel)
    if x.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
        return False
    from . import _gemv  # local: _gemv imports this module

    if not _gemv.cuda_kernels_possible():
        return False
    try:
        from ._quantize_pallas import pallas_fake_quantize_applies, pallas_quantize_applies
        from jax.experimental.pallas import triton  # noqa: F401
    except ImportError:
        return False
    if fake:
        return pallas_fake_quantize_applies(cast)
    return pallas_quantize_applies(cast, axis0=axis != x.ndim - 1)


def quantize_mx(
    x,
    fmt: MXFormatLike,
    *,
    axis: int = -1,
    scale_rule: Union[str, ScaleRule, None] = None,
    rounding: str = "nearest_even",
    pad: bool = False,
    key: Optional[jax.Array] = None,
    random_bits: Optional[jax.Array] = None,
    block_size: Optional[int] = None,
    tensor_scale=None,
    nvfp4_step: Optional[str] = None,
) -> MXArray:
    """Block-quantizes ``x`` to an OCP MX format or NVFP4.

    Args:
      x: float32, bfloat16 or float16 array, or an array of an ml_dtypes float (float8_*,
        float4_e2m1fn; NumPy float6_*): narrow floats are widened exactly, with integer
        operations.
      fmt: ``"mxfp8_e4m3"`` (alias ``"mxfp8"``), ``"mxfp8_e5m2"``, ``"mxfp6_e2m3"`` (alias
        ``"mxfp6"``), ``"mxfp6_e3m2"``, ``"mxfp4"``, ``"mxint8"``, ``"nvfp4"``, a name with a
        block size (``"mxfp4_b16"``) or an :class:`MXFormat`.
      axis: blocks are consecutive elements along this axis (default: last).
      scale_rule: a :class:`~lowprec.ScaleRule` or its name (None: ``"floor"``): how the
        shared exponent follows from the block's max magnitude amax, with e = floor(log2
        amax) read from the exact float32 bits and emax_elem = floor(log2 max_elem) (8, 15,
        2 for E4M3, E5M2, E2M1; 2, 4 for E2M3, E3M2; 0 for INT8): ``"floor"`` (OCP MX v1.0
        §6.3, microxcaling, gfloat): e − emax_elem; ``"ceil"``: ceil(log2 amax) − emax_elem;
        ``"even"``: amax's significand rounded (half up) to the element's precision first;
        ``"rceil"`` (NVIDIA, JAX's ``jax.nn`` MXFP8): amax / max_elem in float32, rounded up
        to a power of two. Shared exponents are clamped to [−127, 127]. NVFP4 has its own
        scale recipe and takes no scale rule.
      rounding: element rounding mode (see :func:`lowprec.encode`); elements saturate to
        ± the element format's max, so under ``"floor"`` block maxima above
        1.75·2^emax_elem (FP8) or 1.5·2^emax_elem (FP4) are clipped, by design.
      pad: zero-pad the axis to a multiple of the block size instead of raising.
      key: PRNG key, for ``rounding="stochastic"`` only: element i of the padded ``x``
        (row-major) rounds away from zero iff ``lowprec.random_bits(key,
        padded_shape)[i] < frac_i * 2**16`` (see :func:`lowprec.encode`).
      random_bits: instead of ``key``: your own words (uint16, or uint32 compared with
        ``frac_i * 2**32``) of the padded shape.
      block_size: another block size for ``fmt`` (a power of two from 2 to 1024); same as
        ``mx_format(fmt, block_size=...)``.
      tensor_scale: NVFP4 only: the float32 scale of the whole tensor; None computes
        float32(amax / 2688) from ``x`` (torchao's ``per_tensor_amax_to_scale``), with amax
        the largest finite magnitude. Pass a calibrated value (or 1.0 for block scales
        alone) to fix it. Either is raised to 2^-143 at least (so that no block divisor
        underflows to 0; 2^-121 with ``nvfp4_step="reciprocal"``, so that no reciprocal
        overflows), and the MXArray holds the scale used.
      nvfp4_step: NVFP4 only: how elements are divided by their scales before rounding to
        E2M1. ``"divide"`` (default; torchao <= 0.16): x / float32(tensor_scale ·
        block_scale). ``"reciprocal"`` (torchao >= 0.17, its PR #4031): x · float32(
        float32(1 / tensor_scale) / block_scale). Both are bit-exact against their torchao
        version; they differ only where the float32 quotient lands on an E2M1 rounding
        boundary. The default keeps the codes of earlier lowprec releases and checkpoints.

    Returns:
      An :class:`MXArray`. A block holding any NaN or ±inf gets the scale format's NaN code
      (E8M0 0xFF; E4M3 0x7F) and zero element codes (it dequantizes to NaN). An all-zero
      block gets scale code 0 (2^-127; NVFP4: the smallest scale 2^-6, code 0x08). −0.0
      keeps its sign (element code 0x80, or 0x8 for FP4, 0x20 for FP6; INT8 has no −0).

    Example:
        >>> import jax.numpy as jnp
        >>> mx = quantize_mx(jnp.linspace(-1.0, 1.0, 64), "mxfp4")
        >>> mx.elements.shape, mx.scales.tolist()
        ((32,), [125, 125])
        >>> nv = quantize_mx(jnp.linspace(-1.0, 1.0, 32), "nvfp4")
        >>> nv.scales.shape, float(nv.tensor_scale) == float(jnp.float32(1.0) / 2688)
        ((2,), True)
    """
    x, fmt = array_then_format(x, fmt, "quantize_mx")
    fmt = mx_format(fmt, block_size)
    check_no_scale_rule(fmt, scale_rule, "quantize_mx")
    cast = MXCast(fmt, scale_rule, rounding, nvfp4_step)
    cast.check_key(key, random_bits)
    ts = check_tensor_scale(cast.fmt, tensor_scale, "quantize_mx")
    x = jnp.asarray(host_decode(x))
    axis, n, padded = check_block_input(x.shape, x.dtype, cast.fmt, axis, pad, "quantize_mx")
    check_mx_input(x, cast.fmt, axis)  # MX blocks must not straddle shard boundaries
    check_random_bits(random_bits, _padded_shape(x.shape, axis, padded), "the padded shape")
    return _quantize_mx_jit(x, cast, axis, padded, _unsharded(x), (key, random_bits), ts)


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
    scale_rule: Union[str, ScaleRule, None] = None,
    pad: bool = False,
    block_size: Optional[int] = None,
) -> jax.Array:
    """The shared exponent of every MX block of ``x``, without quantizing the elements.

    Equal to ``quantize_mx(x, fmt, ...).scales − 127`` (so a block holding a NaN or an
    infinity, scale code 0xFF, gives 128), at the cost of one read of ``x``.

    Args:
      x: float32, bfloat16 or float16 array.
      fmt: block format or its name.
      axis: the block axis (default: last).
      scale_rule: a :class:`~lowprec.ScaleRule` or its name (None: ``"floor"``).
      pad: zero-pad the axis to a multiple of the block size instead of raising (zeros do
        not change a block's maximum).
      block_size: another block size for ``fmt``.

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
    fmt = mx_format(fmt, block_size)
    if fmt.tensor_scale:
        raise ValueError(
            f"shared_exponents: {fmt.name} block scales are E4M3 values under a tensor scale, "
            "not shared exponents; quantize_mx(x, ...).scales holds them"
        )
    cast = MXCast(fmt, scale_rule)
    x = jnp.asarray(host_decode(x))
    axis, _, padded = check_block_input(x.shape, x.dtype, cast.fmt, axis, pad, "shared_exponents")
    return _shared_exponents_jit(x, cast, axis, padded)


# -- dequantization -----------------------------------------------------------------------


def _element_codes(elements, fmt: MXFormat, axis: int):
    """Element codes split in place into blocks along ``axis`` (FP4/FP6 unpacked)."""
    codes = split_blocks(elements, axis, fmt.bytes_per_block)
    return unpack_along(codes, axis + 1, fmt.element.code_bits)


def mx_value_bits(elements, scales, fmt: MXFormat, axis: int, n: int, tensor_scale=None):
    """Exact float32 patterns (uint32) of MX codes, padding beyond ``n`` dropped.
    Trace-time core of dequantize and the matmul path: builds every value from bits
    (float32 subnormal results included), whatever the scales. NVFP4 values are element x
    float32(``tensor_scale`` x block scale), rounded to float32 (torchao's dequantization)."""
    vb = decode_bits(fmt.element, _element_codes(elements, fmt, axis))
    sb = jnp.expand_dims(scales, axis + 1)
    if fmt.tensor_scale:
        ts_bits = lax.bitcast_convert_type(jnp.asarray(tensor_scale, jnp.float32), jnp.uint32)
        bits = merge_blocks(_nvfp4.dequantize_bits(vb, sb, ts_bits, fmt.scale), axis)
    else:
        bits = merge_blocks(scale_bits_by_e8m0(vb, sb), axis)
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
        if el.code_bits == 4:  # both nibbles of a packed byte at once
            nonzero = split_blocks((elements & (mag | (mag << 4))) != 0, axis,
                                   fmt.bytes_per_block).any(axis=axis + 1)
        else:  # FP6 unpacked first; INT8's only zero is 0 (two's complement)
            mask = 0xFF if el.encoding == "twos_complement" else mag
            codes = _element_codes(elements, fmt, axis)
            nonzero = ((codes & mask) != 0).any(axis=axis + 1)
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


def mx_values_blockwise(elements, scales, fmt: MXFormat, axis: int, n: int, dtype):
    """:func:`mx_values` in one elementwise pass (no branch, no reduction): each block takes
    the fast decode when its scale code is at least :func:`fast_scale_min` (exact for every
    element, the NaN code included), the bit-built one otherwise (exact everywhere). Bit
    for bit what the whole-array choice of :func:`mx_values` gives, since both are exact
    wherever they are used; for ``fast_decode_applies`` formats only.

    This is the GPU formulation: XLA's GPU pipeline turns the ``lax.cond`` of
    :func:`mx_values` into a select over two materialized full-size results (5-7 kernels,
    up to 6x the ideal bytes, benchmarks/gpu_hlo_report.py), while this fuses into one
    loop. Codes are decoded in their packed groups' layout (:func:`_grouped_codes`), every
    per-block quantity is computed once per block and broadcast, and only the result is
    reshaped: XLA's GPU fusion refuses to fuse values it would have to recompute through
    several index maps, which the block-split formulation made it do. On CPU the
    conditional runs one branch, so the cheaper fast decode alone usually runs there."""
    codes = _grouped_codes(elements, fmt, axis)
    factor = _per_code(e8m0_factor(scales), codes.shape, axis)
    big = _per_code(scales >= fast_scale_min(fmt), codes.shape, axis)
    sb = _per_code(scales, codes.shape, axis)
    fast = f32_bits(decode_f32(fmt.element, codes) * factor)
    fast = jnp.where((fast & F32_ABS) > F32_INF, jnp.uint32(F32_QNAN), fast)
    exact = scale_bits_by_e8m0(decode_bits(fmt.element, codes), sb)
    values = bits_to_dtype(jnp.where(big, fast, exact), dtype)
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
        return exact(elements, scales, None)

    def fast(e, s, f):
        return bits_to_dtype(mx_value_bits_fast(e, s, fmt, axis, n, factor=f), dtype)

    def whole_array_choice(e, s):
        # The block factors are computed before the branch (one per block, then broadcast),
        # not redone for every element inside the branch's fused loop.
        factor = e8m0_factor(s)
        return lax.cond(fast_decode_exact(e, s, fmt, axis), fast, exact, e, s, factor)

    def blockwise(e, s):
        return mx_values_blockwise(e, s, fmt, axis, n, dtype)

    return lax.platform_dependent(elements, scales, cuda=blockwise, default=whole_array_choice)


@functools.partial(jax.jit, static_argnums=(2, 3, 4, 5))
def _dequantize_jit(elements, scales, fmt: MXFormat, axis: int, n: int, dtype, tensor_scale):
    return mx_values(elements, scales, fmt, axis, n, dtype, tensor_scale)


def dequantize(mx: MXArray, dtype=jnp.float32) -> jax.Array:
    """Returns the values of an :class:`MXArray` as ``dtype`` (default float32).

    Values 2^(scale − 127) × element are computed exactly in float32 (subnormal results
    included; NVFP4: element × float32(tensor scale × E4M3 block scale) in float32, as
    torchao's ``to_dtype``); a
    narrower ``dtype`` (bfloat16, float16, an ml_dtypes float) rounds them to nearest even.
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
    return _dequantize_jit(mx.elements, mx.scales, mx.fmt, mx.axis, mx.shape[mx.axis], dtype,
                           mx.tensor_scale)


# -- fake quantization --------------------------------------------------------------------


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2, 3, 4))
def _fake_quantize_mx(x, cast: MXCast, axis: int, padded: int, kernel_ok: bool, rng,
                      tensor_scale):
    def xla(v):
        mx = quantize_mxarray(padded_bits(v, axis, padded), cast, axis, tuple(v.shape), rng,
                              tensor_scale)
        bits = mx_value_bits(mx.elements, mx.scales, cast.fmt, axis, v.shape[axis],
                             mx.tensor_scale)
        return bits_to_dtype(bits, v.dtype)

    if not (kernel_ok and _pallas_quantize_serves(x, cast, axis, padded, fake=True)):
        return xla(x)
    from ._quantize_pallas import fake_quantize_mx_pallas

    # On CUDA one Pallas pass quantizes and decodes in registers (XLA: a block-max pass,
    # then the encode and decode reading x again, 1.6-1.9x the ideal bytes on an H100).
    return lax.platform_dependent(
        x, cuda=lambda v: fake_quantize_mx_pallas(v, cast, axis=axis), default=xla)


@_fake_quantize_mx.defjvp
def _fake_quantize_mx_jvp(cast, axis, padded, kernel_ok, primals, tangents):
    x, rng, tensor_scale = primals
    out = _fake_quantize_mx(x, cast, axis, padded, kernel_ok, rng, tensor_scale)
    return out, tangents[0]  # straight-through


_fake_quantize_mx_jit = jax.jit(_fake_quantize_mx, static_argnums=(1, 2, 3, 4))


def fake_quantize_mx(
    x,
    fmt: MXFormatLike,
    *,
    axis: int = -1,
    scale_rule: Union[str, ScaleRule, None] = None,
    rounding: str = "nearest_even",
    pad: bool = False,
    key: Optional[jax.Array] = None,
    random_bits: Optional[jax.Array] = None,
    block_size: Optional[int] = None,
    tensor_scale=None,
    nvfp4_step: Optional[str] = None,
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
    fmt = mx_format(fmt, block_size)
    check_no_scale_rule(fmt, scale_rule, "fake_quantize_mx")
    cast = MXCast(fmt, scale_rule, rounding, nvfp4_step)
    cast.check_key(key, random_bits)
    ts = check_tensor_scale(cast.fmt, tensor_scale, "fake_quantize_mx")
    x = jnp.asarray(host_decode(x))
    axis, _, padded = check_block_input(x.shape, x.dtype, cast.fmt, axis, pad, "fake_quantize_mx")
    check_random_bits(random_bits, _padded_shape(x.shape, axis, padded), "the padded shape")
    if ts is not None:
        ts = lax.stop_gradient(ts)
    return _fake_quantize_mx_jit(x, cast, axis, padded, _unsharded(x), (key, random_bits), ts)
