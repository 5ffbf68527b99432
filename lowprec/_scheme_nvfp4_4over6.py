"""Four over Six (Cook et al., arXiv 2512.02010): NVFP4 whose blocks scale to 4 or to 6.

An E2M1 block scaled so that its maximum lands on 6 has no value between 4 and 6, so values
near the maximum carry the largest errors; scaled to 4 (a 1.5x larger block scale), the top
of the grid is 0.5-1-1.5-2-3-4 finer. 4/6 quantizes every 16-element block both ways and
keeps the one with the smaller error. lowprec follows TransformerEngine's ``nvfp4_4over6``
recipe (``NVFP4QuantizerRef._quantize_blockwise_4over6_reference`` and the CUDA kernel it
mirrors), each step one IEEE float32 operation, computed on the bits (``_grid_select.py``)::

    global_encode = min((6 * E) / amax, FLT_MAX)        # E = 256 (TE's default) or 448
    global_decode = 1 / global_encode
    base          = (block_amax / 6) * global_encode
    s6, s4        = e4m3(min(base, 448)), e4m3(min(base * 1.5, 448))
    q(s)          = e2m1(clamp(x * min(1 / (s * global_decode), FLT_MAX), -6, 6))
    error(s)      = sum_i |((q_i * s) * amax) / (6 * E) - x_i|     (MAE; or squared: MSE)

left to right over the block in float32; the block keeps s4 iff error(s4) < error(s6) (a tie
keeps 6). TE's fast-math error path (``NVTE_NVFP4_4OVER6_ERR_USE_FAST_MATH``) compares
|q_i * s - x_i * global_encode| instead: the E2M1 x E4M3 product rounded to FP16, which is
exact (at most 6 significant bits, between 2^-10 and 2688). The tensor scalar stored is TE's
``amax`` (its dequantizer reads it), and values decode as TE's ``dequantize_fp4_kernel``
computes them: q * ((s * amax) * float32(1 / (6 * E))).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from ._bits import F32_MAX, f32_bits
from ._grid_select import (
    GridSelectScheme,
    block_error,
    const_bits,
    e2m1_nearest,
    e4m3_codes,
    e4m3_values,
    f32_div,
    f32_div_by_integer,
    f32_min_positive,
    host_div_bits,
    f32_mul,
    f32_mul_finite,
    f32_mul_short,
    plus_zero,
)
from ._scheme import register

#: The choices of each parameter (the first is TransformerEngine's default).
ERRORS = ("mae", "mse")
ERROR_DOMAINS = ("input", "fp16")
E4M3_BOUNDS = (256, 448)
_ONE = const_bits(1.0)
_THREE_HALVES = const_bits(1.5)


@register("nvfp4_4over6")
@dataclasses.dataclass(frozen=True, repr=False)
class FourOverSixScheme(GridSelectScheme):
    """Four over Six block scales: E4M3 scales of each block's maximum mapped to 6 or to 4,
    whichever quantizes the block with the smaller float32 error, under the tensor's amax.

    Attributes:
      error: ``"mae"`` (TransformerEngine's default) or ``"mse"`` (the paper's, and the
        ``fouroversix`` library's, default selection rule).
      error_domain: ``"input"`` (TE's default: errors of the dequantized values) or
        ``"fp16"`` (TE's fast-math path: errors of q * s against x * global_encode).
      e4m3_max: the E4M3 bound of the global scale: 256 (TE's default for 4/6, the paper's
        choice: 1.5 * 256 = 384 leaves the map-to-4 scale in E4M3's range) or 448.

    Example:
        >>> import lowprec
        >>> s = lowprec.mx_format("nvfp4_4over6").scheme
        >>> s.error, s.error_domain, s.e4m3_max, s.tensor_scale
        ('mae', 'input', 256, True)
    """

    error: str = "mae"
    error_domain: str = "input"
    e4m3_max: int = 256

    recipe = "Four over Six (E4M3 scales of the block maximum mapped to 4 or 6, by error)"
    tensor_scalar = "the tensor's amax (TransformerEngine's convention)"

    def __post_init__(self):
        super().__post_init__()
        for field, valid in (("error", ERRORS), ("error_domain", ERROR_DOMAINS),
                             ("e4m3_max", E4M3_BOUNDS)):
            if getattr(self, field) not in valid:
                raise ValueError(f"Four over Six: {field}={getattr(self, field)!r}; choose one "
                                 f"of {valid}")

    def __repr__(self) -> str:
        return (f"FourOverSixScheme(error={self.error!r}, error_domain={self.error_domain!r}, "
                f"e4m3_max={self.e4m3_max})")

    @property
    def _denominator(self) -> int:
        return const_bits(6.0 * self.e4m3_max)  # 1536 = 3 * 2^9 or 2688 = 21 * 2^7

    def tensor_scale_of(self, amax_bits):
        return amax_bits

    def kernel_attrs(self) -> dict:
        return dict(mse=self.error == "mse", fp16=self.error_domain == "fp16",
                    e4m3_max=self.e4m3_max)

    def choose(self, xb, amax, ts_bits, inner: int):
        encode = f32_min_positive(f32_div(self._denominator, ts_bits), F32_MAX)
        # TE replaces a zero global scale (an infinite amax) by 1; lowprec's amax is finite.
        encode = jnp.where(encode == 0, jnp.uint32(_ONE), encode)
        decode = f32_div(_ONE, encode)
        base = f32_mul(f32_div_by_integer(amax, 6), encode)
        # Both candidates at once, stacked on a new leading axis (map to 6, map to 4): one
        # copy of the element pipeline in the program, half the compile time of two.
        codes = e4m3_codes(jnp.stack([base, f32_mul(base, _THREE_HALVES)]), self.scale)
        s = jnp.expand_dims(e4m3_values(codes, self.scale), inner + 1)
        factor = f32_min_positive(f32_div(_ONE, f32_mul_finite(s, decode)), F32_MAX)
        q = f32_mul_finite(xb, factor)
        values, _ = e2m1_nearest(q)  # saturating: TE clamps to ±6 first
        values = plus_zero(q, values)  # TE's table: an exact -0.0 gets the +0 code
        if self.error_domain == "fp16":
            approx, target = f32_mul_short(s, values), f32_mul_finite(xb, encode)
        else:
            approx = f32_div_by_integer(f32_mul_finite(f32_mul_short(s, values), ts_bits),
                                        6 * self.e4m3_max)
            target = xb
        e6, e4 = block_error(approx, jnp.broadcast_to(target, approx.shape), inner + 1,
                             self.error)
        pick4 = e4 < e6  # non-negative float32 errors (inf included) order as integers
        return (jnp.where(pick4, codes[1], codes[0]),
                jnp.where(jnp.expand_dims(pick4, inner), values[1], values[0]))

    def block_factors(self, scale_codes, tensor_scale):
        inverse = host_div_bits(1.0, 6.0 * self.e4m3_max)  # float32(1 / (6 E)), TE's factor_inv
        ts = f32_bits(tensor_scale)
        return f32_mul(f32_mul(e4m3_values(scale_codes, self.scale), ts), inverse)

    def decode_values(self, value_bits, scale_codes, tensor_scale):
        """q * ((s * amax) * float32(1 / (6 E))), as TE's ``dequantize_fp4_kernel``; a NaN
        scale code gives NaN."""
        return f32_mul(value_bits, self.block_factors(scale_codes, tensor_scale))
