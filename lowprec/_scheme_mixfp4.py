"""MixFP4 (compressed-tensors PR #687, llm-compressor PR #2657): FP4 or INT4 per 16 elements.

MixFP4 keeps NVFP4's storage in compressed-tensors' layout (a float32 ``global_scale``
divisor gs = 2688 / amax, an E4M3 scale per 16 weights, E2M1 nibbles) and, like IF4, uses the
E4M3 sign bit as a grid flag: set, the block's nibbles are sign-magnitude integers -7..7.
Unlike IF4 each grid has its own scale, the block maximum mapped to 6 (FP4) or to 7 (INT4),
and the integer grid is not stretched. lowprec follows the authors' code, each step one IEEE
float32 operation, on the bits (``_grid_select.py``):

* the choice (llm-compressor's ``MixFP4Observer``)::

      s_fp, s_int = e4m3((gs * block_amax) / 6), e4m3((gs * block_amax) / 7)
      e_fp  = sum ((sign(x) * nearest_e2m1(|x / eff_fp|)) * eff_fp - x)^2   # eff = max(s / gs, tiny)
      e_int = sum (round(clamp(x / eff_int, -7, 7)) * eff_int - x)^2

  INT4 iff e_int < e_fp; the flag is set only on a nonzero scale. ``nearest_e2m1`` is an
  ``argmin`` over the grid: a tie goes to the smaller magnitude (0.75 -> 0.5), unlike IEEE
  nearest-even; the integer rounding is ``torch.round`` (ties to even).
* the codes (compressed-tensors' ``pack_mixfp4_to_uint8``): the same roundings of
  x / (s / gs), nibble 0 in a zero-scale block;
* the values (``unpack_mixfp4_from_uint8``): nibble value * float32(s / gs).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from . import _nvfp4
from ._bits import F32_INF, F32_SIGN, f32_bits
from ._grid_select import (
    E4M3_SIGN,
    GridSelectScheme,
    block_error,
    const_bits,
    e2m1_codes_of,
    e2m1_nearest,
    e2m1_table_bits,
    e4m3_codes,
    e4m3_values,
    f32_div,
    f32_div_by_integer,
    f32_mul,
    f32_mul_short,
    int_bits,
    int_nearest,
    plus_zero,
)
from ._scheme import register

_ONE = const_bits(1.0)
_GLOBAL_NUMERATOR = const_bits(2688.0)  # 448 * 6, compressed-tensors' generate_gparam
_TINY = 0x0080_0000  # 2^-126, torch.finfo(float32).tiny
_INT4_MAX = 7


@register("mixfp4")
@dataclasses.dataclass(frozen=True, repr=False)
class MixFP4Scheme(GridSelectScheme):
    """MixFP4 block scales: an E4M3 scale per block, of its maximum mapped to 6 (E2M1 codes,
    flag clear) or to 7 (sign-magnitude INT4 codes, flag set), chosen by squared error; under
    compressed-tensors' float32 global scale (a divisor).

    Example:
        >>> import lowprec, jax.numpy as jnp
        >>> mx = lowprec.quantize_mx(jnp.arange(16.0) - 8, "mixfp4")
        >>> int(mx.scales[0]) >> 7, float(mx.tensor_scale)   # INT4; 2688 / 8
        (1, 336.0)
    """

    recipe = "MixFP4 (an E4M3 scale per block whose sign bit picks FP4 or INT4, by error)"
    tensor_scalar = "compressed-tensors' global scale, a divisor (2688 / amax)"

    def __repr__(self) -> str:
        return "MixFP4Scheme()"

    def tensor_scale_of(self, amax_bits):
        # 2688 / max(amax, 2^-126): normal operands, and a quotient of at least 2688 / FLT_MAX
        # (normal) or past FLT_MAX (inf), so XLA:CPU's own division is IEEE's here.
        divisor = jnp.maximum(amax_bits, jnp.uint32(_TINY))
        gs = _nvfp4.f32_div_hwfloat(jnp.full_like(divisor, _GLOBAL_NUMERATOR), divisor)
        return jnp.where(gs >= F32_INF, jnp.uint32(_ONE), gs)  # nan_to_num(..., 1.0)

    def kernel_attrs(self) -> dict:
        return dict(mse=True)

    def choose(self, xb, amax, ts_bits, inner: int):
        scaled_amax = f32_mul(ts_bits, amax)
        c_fp = e4m3_codes(f32_div_by_integer(scaled_amax, 6), self.scale)
        c_int = e4m3_codes(f32_div_by_integer(scaled_amax, 7), self.scale)

        def effective(codes, clamp):
            eff = f32_div(e4m3_values(codes, self.scale), ts_bits)
            return jnp.maximum(eff, jnp.uint32(_TINY)) if clamp else eff

        # The observer's choice (effective scales clamped to the smallest normal), both grids
        # in one pipeline stacked on a new leading axis (E2M1, INT4): each quotient rounded
        # both ways, the right rounding kept.
        eff = jnp.expand_dims(jnp.stack([effective(c_fp, True), effective(c_int, True)]),
                              inner + 1)
        q = f32_div(xb, eff)
        fp, _ = e2m1_nearest(q, ties="toward_zero")
        fp = plus_zero(q, fp)
        integer = int_bits(int_nearest(q, _INT4_MAX))
        grid = jnp.arange(2).reshape((2,) + (1,) * xb.ndim)
        approx = f32_mul_short(eff, jnp.where(grid == 0, fp, integer))
        e_fp, e_int = block_error(approx, jnp.broadcast_to(xb, approx.shape), inner + 1, "mse")
        pick_int = e_int < e_fp
        codes = jnp.where(pick_int, c_int, c_fp)
        # The packer's codes (effective scale s / gs, unclamped; nibble 0 where it is 0).
        eff = jnp.expand_dims(effective(codes, False), inner)
        q = f32_div(xb, jnp.where(eff == 0, jnp.uint32(_ONE), eff))
        fp, _ = e2m1_nearest(q, ties="toward_zero")
        k = int_nearest(q, _INT4_MAX)
        sign_magnitude = jnp.where(k < 0, 8 - k, k)  # -7..7 -> sign bit 8 | |k|
        values = jnp.where(jnp.expand_dims(pick_int, inner), e2m1_table_bits()[sign_magnitude],
                           plus_zero(q, fp))
        values = jnp.where(eff == 0, jnp.uint32(0), values)
        flag = pick_int & ((codes & 0x7F) != 0)
        return jnp.where(flag, codes | E4M3_SIGN, codes), values

    def block_factors(self, scale_codes, tensor_scale):
        """float32(s / gs) of each block (NaN for a NaN block)."""
        return f32_div(e4m3_values(scale_codes & 0x7F, self.scale), f32_bits(tensor_scale))

    def decode_values(self, value_bits, scale_codes, tensor_scale):
        """nibble value * float32(s / gs): the E2M1 value, or for a flagged block the
        sign-magnitude integer of the nibble (compressed-tensors' unpacker)."""
        eff = self.block_factors(scale_codes, tensor_scale)
        codes = e2m1_codes_of(value_bits)
        magnitude = int_bits(codes & 7)
        integer = jnp.where(codes >= 8, magnitude | jnp.uint32(F32_SIGN), magnitude)
        values = jnp.where((scale_codes & E4M3_SIGN) != 0, integer, value_bits)
        return f32_mul(values, eff)

