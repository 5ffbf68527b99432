"""Block quantization, the public functions: :func:`quantize_mx`, :func:`dequantize`,
:func:`fake_quantize_mx` and :func:`shared_exponents`, for the OCP MX formats (MXFP8, MXFP6,
MXFP4, MXINT8: E8M0 scales shared by blocks of 32, or any power of two from 2 to 1024) and
NVFP4 (E4M3 block scales under a float32 tensor scale).

Semantics (docs/design.md §3, §3b): the block maximum is read from exact float32 bits, the
format's scale scheme picks the block scales (an E8M0 shared exponent by a
:class:`~lowprec.ScaleRule`; NVFP4: torchao's recipe, each float32 step exact on the bits),
and elements are encoded on the bits (never a float division, so subnormal inputs such as
2^-130 stay exact on CPU, where XLA flushes denormals). Each function validates its
arguments once (into an :class:`~lowprec._options.MXCast`) and hands them to a jitted core:
the block encoder (``_mx_encode.py``) and decoder (``_mx_decode.py``).
"""

from __future__ import annotations

import functools
from typing import Optional, Union

import jax
import jax.numpy as jnp
from jax import lax

from ._bits import f32_bits
from ._dtypes import bits_to_dtype, check_float_dtype
from ._format import MXFormatLike, array_then_format, mx_format
from ._mx_decode import mx_value_bits, mx_values
from ._mx_encode import block_exponents, padded_bits, quantize_mxarray, zero_padded
from ._mxarray import MXArray
from ._options import MXCast
from ._scale_rules import ScaleRule
from .kernels._dispatch import Formulation, by_platform, on_cpu, on_cuda, quantize_formulations
from .kernels._mx_fake_cpu import fake_quantize as mx_fake_quantize_cpu
from .kernels._mx_quantize_cpu import attributes as quantize_attributes
from .kernels._mx_quantize_cpu import quantize_last
from .kernels._nvfp4_cpu import quantize_mxarray as nvfp4_quantize_cpu
from .kernels._quantize_pallas import fake_quantize_mx_pallas, quantize_mx_pallas


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def _quantize_mx_jit(x, cast: MXCast, axis: int, padded: int, forms: frozenset, rng,
                     tensor_scale):
    def xla(v):
        return quantize_mxarray(padded_bits(v, axis, padded), cast, axis, tuple(v.shape), rng,
                                tensor_scale)

    if Formulation.CPU_KERNEL in forms and cast.fmt.tensor_scale:  # NVFP4 (_dispatch decides)
        xla = functools.partial(on_cpu, functools.partial(
            nvfp4_quantize_cpu, cast=cast, axis=axis, padded=padded, rng=rng,
            tensor_scale=tensor_scale, xla=xla), xla)
    elif Formulation.CPU_KERNEL in forms:  # decided by lowprec.kernels._dispatch
        # On CPU one C++ pass over x (XLA makes two: the block maxima, then the encode
        # reading x again), with the same integer definitions, so the same bits.
        def one_pass_cpu(v):
            # float32 input as it is (the kernel reads its bits): a bitcast to uint32 here
            # would be a copy of x in XLA:CPU's program.
            elements, scales = quantize_last(zero_padded(v, axis, padded),
                                             quantize_attributes(cast.fmt, cast.scale_rule))
            return MXArray(elements, scales, cast.fmt, axis, tuple(v.shape), cast.scale_rule)

        xla = functools.partial(on_cpu, one_pass_cpu, xla)

    if Formulation.PALLAS not in forms:  # decided by lowprec.kernels._dispatch
        return xla(x)

    def one_pass_kernel(v):
        ts = None
        if cast.fmt.scheme.tensor_scale:
            # NVFP4: one pass given the tensor scale; computed, a first pass for the largest
            # magnitude (a tensor-wide scale computed from the data reads x twice).
            elements, scales, ts = quantize_mx_pallas(v, cast, tensor_scale, axis=axis)
        else:
            elements, scales = quantize_mx_pallas(v, cast, axis=axis)
        return MXArray(elements, scales, cast.fmt, axis, tuple(v.shape), cast.scale_rule, ts)

    # XLA compiles the block maximum and the encode into two passes over x (a reduction,
    # then a loop that reads x again: 1.9-2.5x the ideal bytes on an H100); the Pallas
    # kernel makes one (1.00x), from the same integer core, so the same bits
    # (benchmarks/gpu_hlo_report.py --target h100). Other backends keep XLA's fusion.
    return on_cuda(one_pass_kernel, xla, x)


def _empty_mxarray(call, cast: MXCast) -> MXArray:
    """The MXArray of an empty ``x`` (a zero in its shape): it has no blocks, so its codes
    and scales are empty — computed, they would reduce over nothing — and a tensor scale is
    the scheme's for amax 0 (or the caller's), as the block encoder would set it."""
    fmt, axis, shape = cast.fmt, call.axis, tuple(call.x.shape)
    el, sc = list(shape), list(shape)
    el[axis] = call.padded * fmt.element.code_bits // 8
    sc[axis] = call.padded // fmt.block_size
    ts = _empty_tensor_scale(call.tensor_scale, cast) if fmt.tensor_scale else None
    return MXArray(jnp.zeros(el, jnp.uint8), jnp.zeros(sc, jnp.uint8), fmt, axis, shape,
                   cast.scale_rule, ts)


@functools.partial(jax.jit, static_argnums=(1,))
def _empty_tensor_scale(tensor_scale, cast: MXCast):
    ts_bits = cast.fmt.scheme.tensor_scale_bits(jnp.zeros((0,), jnp.uint32), tensor_scale, cast)
    return lax.bitcast_convert_type(ts_bits, jnp.float32)


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
    scale_options=None,
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
      scale_options: the options value of the format's scale scheme (an instance of
        ``fmt.scheme.Options``, or a dict of its fields; None: its defaults). ``scale_rule``
        and ``nvfp4_step`` are two of those fields, given by name; a scheme's other options
        (a registered scheme of your own) are given here.

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
    cast = MXCast(mx_format(fmt, block_size), scale_rule, rounding, nvfp4_step,
                  scale_options=scale_options)
    call = cast.check_call(x, "quantize_mx", axis=axis, pad=pad, key=key, random_bits=random_bits,
                           tensor_scale=tensor_scale, scale_rule=scale_rule)
    if call.x.size == 0:
        return _empty_mxarray(call, cast)
    forms = quantize_formulations(call.x, cast, call.axis, call.rng, call.tensor_scale)
    return _quantize_mx_jit(call.x, cast, call.axis, call.padded, forms, call.rng,
                            call.tensor_scale)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _shared_exponents_jit(x, cast: MXCast, axis: int, padded: int):
    return block_exponents(padded_bits(x, axis, padded), cast, axis)


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
    cast = MXCast(mx_format(fmt, block_size), scale_rule)
    call = cast.check_call(x, "shared_exponents", axis=axis, pad=pad, exponents=True)
    if call.x.size == 0:
        return jnp.zeros(_empty_mxarray(call, cast).scales.shape, jnp.int32)
    return _shared_exponents_jit(call.x, cast, call.axis, call.padded)


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
    if mx.elements.size == 0:  # no blocks to decode
        return jnp.zeros(mx.shape, dtype)
    return _dequantize_jit(mx.elements, mx.scales, mx.fmt, mx.axis, mx.shape[mx.axis], dtype,
                           mx.tensor_scale)


# -- fake quantization --------------------------------------------------------------------


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2, 3, 4, 5))
def _fake_quantize_mx(x, cast: MXCast, axis: int, padded: int, kernel: bool, native: bool, rng,
                      tensor_scale):
    def xla(v):
        mx = quantize_mxarray(padded_bits(v, axis, padded), cast, axis, tuple(v.shape), rng,
                              tensor_scale)
        bits = mx_value_bits(mx.elements, mx.scales, cast.fmt, axis, v.shape[axis],
                             mx.tensor_scale)
        return bits_to_dtype(bits, v.dtype)

    def fused(v):
        # On CPU one custom call quantizes and decodes (kernels/_mx_fake_cpu.py), in place of
        # XLA's encoder and exact decoder.
        values, _ = mx_fake_quantize_cpu(v, cast, axis)
        return bits_to_dtype(f32_bits(values), v.dtype)

    # kernel: Pallas on CUDA, native: C++ on CPU (_dispatch.quantize_formulations decides)
    if not (kernel or native):
        return xla(x)
    # On CUDA one Pallas pass quantizes and decodes in registers (XLA: a block-max pass,
    # then the encode and decode reading x again, 1.6-1.9x the ideal bytes on an H100).
    return by_platform(x, default=xla, cpu=fused if native else None,
                       cuda=(lambda v: fake_quantize_mx_pallas(v, cast, axis=axis)) if kernel
                       else None)


@_fake_quantize_mx.defjvp
def _fake_quantize_mx_jvp(cast, axis, padded, kernel, native, primals, tangents):
    x, rng, tensor_scale = primals
    out = _fake_quantize_mx(x, cast, axis, padded, kernel, native, rng, tensor_scale)
    return out, tangents[0]  # straight-through


_fake_quantize_mx_jit = jax.jit(_fake_quantize_mx, static_argnums=(1, 2, 3, 4, 5))


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
    scale_options=None,
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
    cast = MXCast(mx_format(fmt, block_size), scale_rule, rounding, nvfp4_step,
                  scale_options=scale_options)
    call = cast.check_call(x, "fake_quantize_mx", axis=axis, pad=pad, key=key,
                           random_bits=random_bits, tensor_scale=tensor_scale,
                           scale_rule=scale_rule)
    if call.x.size == 0:  # no blocks: the (empty) values themselves
        return call.x
    ts = None if call.tensor_scale is None else lax.stop_gradient(call.tensor_scale)
    forms = quantize_formulations(call.x, cast, call.axis, call.rng, ts, fake=True)
    return _fake_quantize_mx_jit(call.x, cast, call.axis, call.padded,
                                 Formulation.PALLAS in forms, Formulation.CPU_KERNEL in forms,
                                 call.rng, ts)
