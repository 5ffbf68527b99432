"""IF4 (Cook et al., arXiv 2603.28765): per 16-element block, FP4 or scaled INT4 by error.

Each block is scaled as an NVFP4 block (an E4M3 scale of its maximum mapped to 6, under a
global scale of 6 · 448 / amax), then rounded both to E2M1 and to the integers -7..7 times
6/7 (the INT4 grid stretched to the same maximum); the candidate with the smaller float32
squared error is kept, and the choice is the sign bit of the E4M3 scale code, unused in
NVFP4 (set: INT4). INT4 codes are two's-complement nibbles. lowprec follows the authors'
reference quantizer (``fouroversix``, ``quantize/pytorch/reference.py``:
``compute_nv_scale_factors`` and ``select_intfloat``), each step one IEEE float32 operation,
on the bits (``_grid_select.py``)::

    encode = min(2688 / amax, FLT_MAX)                     # 6 * 448
    s      = e4m3((block_amax / 6) * encode)
    q      = x * (1 / ((1 / encode) * s))                  # 0 where s = 0
    fp     = e2m1(q)                 -> ((fp * s) * amax) / 2688
    k      = round(clamp(q * float32(7/6), -7, 7))  -> (((k * s) * amax) * float32(6/7)) / 2688

and the errors are summed left to right (the authors' ``torch.sum`` leaves its order to the
backend). Two choices where the authors' code breaks: the bound FLT_MAX on encode (their
2688 / amax is inf below amax ~ 7.9e-36, and every scale NaN), and E2M1 rounding that
saturates at 6 (their 2 round(|q| / 2) gives 8 for |q| >= 7, reached when a block's E4M3
scale is subnormal and rounded down, and their packer then overflows the nibble). Values decode as those two expressions; the tensor scalar stored is amax.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from ._bits import F32_MAX, f32_bits
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
    f32_min_positive,
    f32_mul,
    f32_mul_finite,
    f32_mul_positive,
    f32_mul_short,
    int_bits,
    int_nearest,
    plus_zero,
)
from ._scheme import register

ERRORS = ("mse", "mae")
_ONE = const_bits(1.0)
_AMAX_DIVISOR = const_bits(2688.0)  # 6 * 448: E2M1's and E4M3's largest values
_AMAX_DIVISOR_INT = 2688  # the same, as the integer divisor of f32_div_by_integer
# float32(7/6) and float32(6/7): the authors write 1.16666666 and 0.8571428571, which round
# to these same float32 values (0x3F955555 and 0x3F5B6DB7).
_SEVEN_SIXTHS = int(np.float32(7 / 6).view(np.uint32))
_SIX_SEVENTHS = int(np.float32(6 / 7).view(np.uint32))
_INT4_MAX = 7


@register("if4")
@dataclasses.dataclass(frozen=True, repr=False)
class IF4Scheme(GridSelectScheme):
    """IF4 block scales: an NVFP4-style E4M3 scale per block whose sign bit says whether the
    block's codes are E2M1 (clear) or two's-complement INT4 times 6/7 (set), chosen by the
    float32 error (``error``: ``"mse"``, the authors' default, or ``"mae"``).

    Example:
        >>> import lowprec, jax.numpy as jnp
        >>> x = jnp.asarray([3.0, 2.5, 2.0, 1.5] * 4)       # evenly spaced: INT4 fits better
        >>> int(lowprec.quantize_mx(x, "if4").scales[0]) >> 7
        1
    """

    error: str = "mse"

    recipe = "IF4 (an NVFP4 scale whose sign bit picks the FP4 or the INT4 grid, by error)"
    tensor_scalar = "the tensor's amax (the IF4 authors' convention)"

    def __post_init__(self):
        super().__post_init__()
        if self.error not in ERRORS:
            raise ValueError(f"IF4: error={self.error!r}; choose one of {ERRORS}")

    def __repr__(self) -> str:
        return f"IF4Scheme(error={self.error!r})"

    def tensor_scale_of(self, amax_bits):
        return amax_bits

    def kernel_attrs(self) -> dict:
        return dict(mse=self.error == "mse")

    def choose(self, xb, amax, ts_bits, inner: int):
        # The authors' 2688 / amax overflows for amax below ~7.9e-36 (their scales are then
        # NaN); lowprec bounds it by FLT_MAX, as TransformerEngine's NVFP4 recipes do.
        encode = f32_min_positive(f32_div(_AMAX_DIVISOR, ts_bits), F32_MAX)
        codes = e4m3_codes(f32_mul(f32_div_by_integer(amax, 6), encode), self.scale)
        codes = jnp.where(ts_bits == 0, 0, codes)  # the authors' zero scales for amax = 0
        s = jnp.expand_dims(e4m3_values(codes, self.scale), inner)
        factor = f32_div(_ONE, f32_mul_finite(f32_div(_ONE, encode), s))
        q = jnp.where(s == 0, jnp.uint32(0), f32_mul_finite(xb, factor))
        fp, _ = e2m1_nearest(q)
        fp = plus_zero(q, fp)
        k = int_nearest(f32_mul_finite(q, _SEVEN_SIXTHS), _INT4_MAX)
        # Both candidates' approximations in one pipeline, stacked on a new leading axis:
        # (((v * s) * amax) * c) / 2688 with c = 1 for E2M1 (a product by 1 is exact) and
        # float32(6/7) for INT4.
        v = jnp.stack([fp, int_bits(k)])
        c = jnp.asarray([_ONE, _SIX_SEVENTHS], jnp.uint32).reshape((2,) + (1,) * xb.ndim)
        approx = f32_div_by_integer(
            f32_mul_positive(f32_mul_finite(f32_mul_short(s, v), ts_bits), c), _AMAX_DIVISOR_INT)
        e_fp, e_int = block_error(approx, jnp.broadcast_to(xb, approx.shape), inner + 1,
                                  self.error)
        pick_int = e_int < e_fp
        # INT4 blocks: the E2M1 value whose code is the two's-complement nibble of k.
        int_values = e2m1_table_bits()[k & 0xF]
        values = jnp.where(jnp.expand_dims(pick_int, inner), int_values, fp)
        return jnp.where(pick_int, codes | E4M3_SIGN, codes), values

    def block_factors(self, scale_codes, tensor_scale):
        """float32(s * amax): each block's factor before the final division by 2688 (and,
        for INT4 blocks, the product with 6/7), NaN for a NaN block."""
        return f32_mul(e4m3_values(scale_codes & 0x7F, self.scale), f32_bits(tensor_scale))

    def decode_values(self, value_bits, scale_codes, tensor_scale):
        """((e * s) * amax) / 2688 for an E2M1 block, (((k * s) * amax) * 6/7) / 2688 for an
        INT4 block (k the nibble as a two's-complement integer); NaN for a NaN scale."""
        ts = f32_bits(tensor_scale)
        s = e4m3_values(scale_codes & 0x7F, self.scale)
        codes = e2m1_codes_of(value_bits)
        k = jnp.where(codes >= 8, codes - 16, codes)
        fp = f32_div_by_integer(f32_mul(f32_mul(value_bits, s), ts), _AMAX_DIVISOR_INT)
        integer = f32_div_by_integer(
            f32_mul(f32_mul(f32_mul(int_bits(k), s), ts), _SIX_SEVENTHS), _AMAX_DIVISOR_INT)
        return jnp.where((scale_codes & E4M3_SIGN) != 0, integer, fp)
