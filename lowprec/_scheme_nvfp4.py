"""NVFP4's scale scheme: an E4M3 scale per block under a float32 scale of the whole tensor.

torchao's recipe (docs/design.md §3b), each float32 step computed exactly on the bits by
``_nvfp4.py``: tensor scale ts = amax / 2688 (or the caller's), block scale code =
e4m3(clamp((block_amax / 6) / ts, 2^-6, 448)), element = e2m1(x / float32(ts × block_scale))
(``nvfp4_step="divide"``, torchao <= 0.16) or e2m1(x × float32(float32(1 / ts) /
block_scale)) (``"reciprocal"``, torchao >= 0.17); value = element × float32(ts × block_scale).
A block holding NaN or inf gets the E4M3 NaN 0x7F and zero elements. No scale rule applies.
With INT4 elements (NVINT4, Chen et al. 2025) the same recipe divides by 7, the element's
largest value, instead of 6: 2688 becomes 448 * 7 = 3136.
"""

from __future__ import annotations

import dataclasses
import math
from fractions import Fraction

import numpy as np

from . import _nvfp4
from ._bits import F32_ABS, F32_INF, f32_bits
from ._decode import decode_bits
from ._format import ElementFormat
from ._lazy import lazy_module
from ._rounding import DocumentedStr
from ._scheme import FastDecoder, FastEncoder, ScaleScheme, register

# Imported on first use: the checkpoint command line's native path needs no JAX.
jax = lazy_module("jax")
jnp = lazy_module("jax.numpy")
lax = lazy_module("jax.lax")
_platform = lazy_module("lowprec._platform")


class NVFP4Step(DocumentedStr):
    """How an NVFP4 element is brought to E2M1's range before rounding (``nvfp4_step=`` of
    :func:`lowprec.quantize_mx`; docs/design.md §3b). The two differ only where the float32
    quotient lands exactly on an E2M1 rounding boundary.

    Example:
        >>> NVFP4Step("reciprocal") is NVFP4Step.RECIPROCAL
        True
    """

    DIVIDE = (
        "divide",
        "x / float32(tensor_scale * block_scale): torchao <= 0.16 "
        "(nvfp4_tensor.nvfp4_quantize), and lowprec's default.",
    )
    RECIPROCAL = (
        "reciprocal",
        "x * float32(float32(1 / tensor_scale) / block_scale): torchao >= 0.17 (its PR "
        "#4031, as NVIDIA's MSLK kernels).",
    )


DEFAULT_NVFP4_STEP = NVFP4Step.DIVIDE


@dataclasses.dataclass(frozen=True)
class NVFP4Options:
    """The options of an NVFP4 cast: the :class:`~lowprec.NVFP4Step` that brings elements to
    E2M1's range (``nvfp4_step=``; default ``"divide"``).

    Example:
        >>> NVFP4Options("reciprocal")
        NVFP4Options(nvfp4_step=<NVFP4Step.RECIPROCAL: 'reciprocal'>)
    """

    nvfp4_step: NVFP4Step = DEFAULT_NVFP4_STEP

    def __post_init__(self):
        try:
            step = NVFP4Step(self.nvfp4_step)
        except ValueError:
            raise ValueError(
                f"unknown nvfp4_step {self.nvfp4_step!r}; choose one of: "
                + "; ".join(f"{m.value!r} = {m.__doc__}" for m in NVFP4Step)) from None
        object.__setattr__(self, "nvfp4_step", step)

# The recipe's constants are those of E4M3 block scales (clamped to [2^-6, 448]); block
# maxima are divided by the element's largest value Q (6 for E2M1, 7 for INT4).


def _finite_amax_bits(bits, amax):
    """Bits of the largest finite magnitude of float32 patterns ``bits``, whose blocks' largest
    magnitudes are ``amax``. On CPU, where a branch is free, the largest block maximum when
    no block holds a NaN or an infinity (no second read of ``bits``); else, and on other
    backends, a reduction over ``bits``."""

    def whole(xf, amax):
        return _nvfp4.finite_amax_bits(lax.bitcast_convert_type(xf, jnp.uint32))

    def on_cpu(xf, amax):
        # x as float32: a conditional's uint32 operand would be a materialized copy.
        return lax.cond(jnp.any(amax >= F32_INF), whole,
                        lambda xf, a: jnp.max(a, initial=jnp.uint32(0)), xf, amax)

    return _platform.platform_dependent(lax.bitcast_convert_type(bits, jnp.float32), amax,
                                        cpu=on_cpu, default=whole)


def _trailing_zeros(n: int) -> int:
    return (n & -n).bit_length() - 1


@register("nvfp4")
class NVFP4Scheme(ScaleScheme):
    """E4M3 block scales under a float32 tensor scale (torchao's NVFP4 recipe).

    Example:
        >>> import lowprec
        >>> s = lowprec.scale_scheme("nvfp4")
        >>> s.scale.name, s.tensor_scale, s.option_names(), s.options(fmt_name="nvfp4")
        ('e4m3', True, ('nvfp4_step',), NVFP4Options(nvfp4_step=<NVFP4Step.DIVIDE: 'divide'>))
    """

    Options = NVFP4Options
    tensor_scale = True
    recipe = "the NVFP4 recipe (E4M3 of amax / 6 / tensor_scale)"

    def check_scale(self) -> None:
        sc = self.scale
        layout = tuple(getattr(sc, f, None) for f in ("sign_bits", "exponent_bits",
                                                      "mantissa_bits", "bias", "nan_code"))
        if layout != (1, 4, 3, 7, 0x7F) or sc.max_finite != 448.0:
            raise ValueError(
                f"scale scheme {self.name!r} stores E4M3 block scales (torchao's recipe clamps "
                f"them to [2^-6, 448]), got the scale format {getattr(sc, 'name', sc)!r}")

    def check_element(self, element: ElementFormat, fmt_name: str) -> None:
        # What _nvfp4's exact arithmetic relies on: 4-bit codes; every nonzero value a
        # multiple of 1/2 and at least 1/2 (products with a factor >= 2^-125 stay normal;
        # the lifted product of a tiny factor is an integer below 2^24) with at most 6
        # significant bits (_nvfp4.f32_mul_short). E2M1 (0.5 ... 6) and INT4 (1 ... 7) pass.
        values = [element.magnitude_value(m) for m in range(1, element.max_magnitude_code + 1)]
        ok = element.code_bits == 4 and element.signed and element.zero and all(
            v >= Fraction(1, 2) and (2 * v).denominator == 1
            and (2 * v).numerator.bit_length() - _trailing_zeros((2 * v).numerator) <= 6
            for v in values)
        if not ok:
            raise ValueError(
                f"{fmt_name}: NVFP4 scales serve signed 4-bit elements whose nonzero values "
                f"are multiples of 1/2, at least 1/2 (E2M1, INT4; the recipe divides block "
                f"maxima by the element's largest value), got {element.name}")

    # -- options ---------------------------------------------------------------------------

    def tensor_scale_option(self, tensor_scale, fmt_name: str, func: str):
        if tensor_scale is None:
            return None
        if isinstance(tensor_scale, (int, float)):
            if not (math.isfinite(tensor_scale) and tensor_scale > 0):
                raise ValueError(
                    f"{func}: tensor_scale must be a positive finite number, got {tensor_scale!r}"
                )
        ts = jnp.asarray(tensor_scale, jnp.float32)
        if ts.shape != ():
            raise ValueError(f"{func}: tensor_scale must be a scalar, got shape {ts.shape}")
        return ts

    def check_tensor_scale_leaf(self, ts, scales, fmt_name: str, shape: tuple) -> None:
        if ts is None:
            raise ValueError(
                f"MXArray: {fmt_name} needs its float32 tensor_scale (quantize_mx computes it)"
            )
        if not (hasattr(ts, "shape") and hasattr(ts, "dtype")):
            return  # a placeholder while JAX rebuilds the pytree
        batch = tuple(scales.shape)[: len(scales.shape) - len(shape)]
        if np.dtype(ts.dtype) != np.float32 or tuple(ts.shape) != batch:
            raise TypeError(
                f"MXArray: tensor_scale must be a float32 scalar (batch shape {batch}), got "
                f"{np.dtype(ts.dtype)}{list(ts.shape)}"
            )
        if isinstance(ts, jax.core.Tracer) or not isinstance(ts, (np.ndarray, np.generic,
                                                                   jax.Array)):
            return  # traced (or a shape stand-in): dequantize decodes an invalid one to NaN
        values = np.asarray(ts, np.float32)
        bad = ~(np.isfinite(values) & (values > 0))
        if np.any(bad):
            raise ValueError(
                f"MXArray: {fmt_name} tensor_scale must be positive and finite (it multiplies "
                f"every block scale), got {values[bad].flat[0]!r}; a zero or negative scale "
                "would zero or flip the tensor. Use the scale quantize_mx computed (amax / 2688 "
                "for NVFP4)"
            )

    # -- encode ----------------------------------------------------------------------------

    def tensor_scale_bits(self, bits, tensor_scale, cast, amax=None):
        """float32(amax / (448 * Q)) of ``bits`` (amax: the largest finite magnitude; Q the
        element's largest value: 2688 for E2M1), or the given
        scale; either raised to 2^-143 at least (2^-121 for the ``"reciprocal"`` step)."""
        q = cast.fmt.element.max_finite
        if tensor_scale is None and amax is None:
            ts_bits = _nvfp4.tensor_scale_bits(_nvfp4.finite_amax_bits(bits), q)
        elif tensor_scale is None:
            ts_bits = _nvfp4.tensor_scale_bits(_finite_amax_bits(bits, amax), q)
        else:
            ts_bits = f32_bits(tensor_scale)
        return self.clamp_tensor_scale_bits(ts_bits, cast)

    @staticmethod
    def clamp_tensor_scale_bits(ts_bits, cast):
        """A tensor scale (computed or given) raised to the least the encoder divides by:
        2^-143, or 2^-121 for the ``"reciprocal"`` step."""
        ts_bits = _nvfp4.clamp_tensor_scale_bits(ts_bits)
        if cast.scale_options.nvfp4_step == "reciprocal":
            ts_bits = jnp.maximum(ts_bits, jnp.uint32(_nvfp4.MIN_RECIPROCAL_TENSOR_SCALE_BITS))
        return ts_bits

    def encode_blocks(self, xb, amax, ts_bits, cast, inner: int):
        special = amax >= F32_INF
        codes = _nvfp4.block_scale_codes(amax, ts_bits, self.scale, cast.fmt.element.max_finite)
        if cast.scale_options.nvfp4_step == "reciprocal":
            factor = _nvfp4.reciprocal_factor_bits(codes, ts_bits, self.scale)
            quotient = _nvfp4.f32_mul(xb, jnp.expand_dims(factor, inner))
        else:
            total = jnp.expand_dims(_nvfp4.total_scale_bits(codes, ts_bits, self.scale), inner)
            quotient = _nvfp4.element_quotient_bits(xb, total)
        return jnp.where(special, self.scale.nan_code, codes), special, quotient, None

    def fast_encoder(self):
        return _NVFP4HwFloat(self)

    # -- decode ----------------------------------------------------------------------------

    def decode_values(self, value_bits, scale_codes, tensor_scale):
        """element × float32(tensor_scale × block scale), rounded to float32 (torchao's
        ``NVFP4Tensor.to_dtype``)."""
        ts_bits = f32_bits(tensor_scale)
        return _nvfp4.dequantize_bits(value_bits, scale_codes, ts_bits, self.scale)

    def fast_decoder(self):
        return _NVFP4FastDecoder(self)

    # -- analysis --------------------------------------------------------------------------

    def element_scale(self, scale_codes, tensor_scale):
        """float32 factor tensor_scale × block_scale of each block, rounded as the
        quantizer's divisor and the dequantizer's factor are (NaN for a NaN block)."""
        ts_bits = f32_bits(tensor_scale)
        total = _nvfp4.total_scale_bits(scale_codes, ts_bits, self.scale)
        nan = (decode_bits(self.scale, scale_codes) & F32_ABS) > F32_INF
        return jnp.where(nan, jnp.nan, lax.bitcast_convert_type(total, jnp.float32))


@dataclasses.dataclass(frozen=True)
class _NVFP4HwFloat(FastEncoder):
    """NVFP4's hardware-float encode (:class:`~lowprec._scheme.FastEncoder`)."""

    scheme: NVFP4Scheme

    # The same float32 steps by float arithmetic, exact for a tensor scale in [2^-118, 2^116]
    # (_nvfp4.py says why), i.e. for any tensor whose largest magnitude lies between ~2^-107
    # and ~2^127 when the scale is computed.

    def scales(self, amax, ts_bits, cast):
        special = amax >= F32_INF
        sc = self.scheme.scale
        codes = _nvfp4.hwfloat_scale_codes(amax, ts_bits, sc, cast.fmt.element.max_finite)
        codes = jnp.where(special, sc.nan_code, codes).astype(jnp.uint8)
        # The check stays a runtime value even for a tensor scale known at compile time:
        # folded, it would remove the encoder's branch, whose boundary is what keeps XLA from
        # fusing the per-block scale computation into the element loop (recomputed there for
        # every element, ~5x slower; tests/test_fast_paths.py).
        t = lax.optimization_barrier(ts_bits)
        exact = ((t >= jnp.uint32(_nvfp4.HWFLOAT_TS_MIN_BITS))
                 & (t <= jnp.uint32(_nvfp4.HWFLOAT_TS_MAX_BITS)))
        return codes, exact

    def operands(self, scale_codes, ts_bits, cast):
        codes = scale_codes.astype(jnp.uint32)
        special = codes == jnp.uint32(self.scheme.scale.nan_code)
        if cast.scale_options.nvfp4_step == "reciprocal":
            return special, _nvfp4.hwfloat_factors(codes, ts_bits, self.scheme.scale)
        return special, _nvfp4.hwfloat_divisors(codes, ts_bits, self.scheme.scale)

    def quotients(self, magnitudes, operand, x_bits, cast):
        if cast.scale_options.nvfp4_step == "reciprocal":
            return magnitudes * operand
        return _nvfp4.hwfloat_quotients(magnitudes, operand, x_bits)


@dataclasses.dataclass(frozen=True)
class _NVFP4FastDecoder(FastDecoder):
    """NVFP4's routed decode (:class:`~lowprec._scheme.FastDecoder`): the one-multiply
    product where every block's factor allows it, chosen for the whole array (CPU) or per
    block (the one-pass GPU layout), before any element is decoded."""

    scheme: NVFP4Scheme
    routes = True

    def route(self, scale_codes, tensor_scale):
        ts_bits = f32_bits(tensor_scale)
        blocks = _nvfp4.decode_blocks(scale_codes, ts_bits, self.scheme.scale)
        return _nvfp4.fast_product_serves(blocks), blocks

    def routed_values(self, value_bits, scale_codes, tensor_scale, route):
        ts_bits = f32_bits(tensor_scale)
        return _nvfp4.dequantize_bits(value_bits, scale_codes, ts_bits, self.scheme.scale, route)
