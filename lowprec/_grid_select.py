"""Float32 steps of the block formats that choose a grid or a scale per block by its error.

Four over Six (TransformerEngine's ``nvfp4_4over6``), IF4 and MixFP4 quantize every block
twice — to two scales, or to the FP4 and the INT4 grid — measure each candidate's error in
float32 and keep the smaller (docs/design.md §3c). Their authors compute every step as one
IEEE float32 operation, so the choice itself depends on float32 rounding: an error sum one
ulp off can flip a near-tie block. This module gives those steps on float32 *bit patterns*
with integer arithmetic, so every backend gives the IEEE result (XLA on CPU flushes
subnormals and rewrites divisions, docs/design.md §8):

* :func:`f32_add`, :func:`f32_sub`, :func:`f32_mul`, :func:`f32_div`: the IEEE operations
  (nearest even, subnormals, overflow to inf, inf and NaN operands);
  :func:`f32_div_by_integer` the quotient by a small integer constant (the recipes' 6, 7,
  6 · 256 and 6 · 448), a few operations on CPU instead of the long division;
* :func:`e2m1_nearest`, :func:`int_nearest`: the FP4 and INT4 grid points nearest a float32
  (ties to even, or toward zero where an author's code takes the first of two equal
  distances);
* :func:`block_error`: a per-block error sum accumulated left to right in float32.

Everything here takes and returns uint32 float32 patterns unless said otherwise. On CPU a
scheme's whole block choice (:meth:`GridSelectScheme.choose`) is instead one call of the
native kernel (``kernels/_grid_select_cpu.cc``), which mirrors these operations on the bits:
XLA compiles them to ~10,000 HLO lines, seconds per program.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import _nvfp4
from ._bits import F32_ABS, F32_INF, F32_MANT, F32_MANT_BITS, F32_QNAN, F32_SIGN, f32_bits
from ._decode import decode_bits
from ._encode import encode_bits
from ._scheme import ScaleScheme
from .kernels import _dispatch, _grid_select_cpu

if TYPE_CHECKING:
    from ._format import ElementFormat

# Guard bits kept below the larger addend's significand in f32_add: the sum of two 29-bit
# values stays below 2^30 (round_to_f32's bound), and with at least 4 guard bits plus a sticky
# bit a sum that loses at most one leading bit to cancellation is still rounded correctly.
_GUARD = 5


def const_bits(v: float) -> int:
    """The float32 pattern of ``v``, which must be exactly a float32 (checked)."""
    f = np.float32(v)
    assert float(f) == v, v
    return int(f.view(np.uint32))


def _is_nan(bits):
    return (bits & F32_ABS) > F32_INF


def _is_inf(bits):
    return (bits & F32_ABS) == F32_INF


def _fields(bits):
    """(sign 0/1, significand, exponent of its last bit) of finite float32 patterns: value =
    sig · 2^exp, sig < 2^24 (subnormals are not normalized; zero gives sig = 0)."""
    mag = bits & F32_ABS
    efield = lax.shift_right_logical(mag, jnp.uint32(F32_MANT_BITS)).astype(jnp.int32)
    sig = jnp.where(efield > 0, (mag & F32_MANT) | (1 << F32_MANT_BITS), mag & F32_MANT)
    sign = lax.shift_right_logical(bits, jnp.uint32(31))
    return sign, sig, jnp.maximum(efield, 1) - 150  # 150 = 127 + 23


def f32_add(a, b):
    """IEEE float32 a + b (nearest even) from the bits, for any a, b (NaN in: quiet NaN out;
    inf - inf: NaN). Exact cancellation gives +0; (-0) + (-0) is -0.

    The larger magnitude's significand is shifted up by 5 guard bits and the smaller one
    aligned to it with a sticky bit for what falls off; one integer add or subtract and one
    rounding (:func:`lowprec._nvfp4.round_to_f32`) give the IEEE sum.
    """
    a, b = jnp.broadcast_arrays(jnp.asarray(a, jnp.uint32), jnp.asarray(b, jnp.uint32))
    swap = (b & F32_ABS) > (a & F32_ABS)
    big, small = jnp.where(swap, b, a), jnp.where(swap, a, b)
    s_big, sig_big, e_big = _fields(big)
    s_small, sig_small, e_small = _fields(small)
    d = jnp.clip(e_big - e_small, 0, 30).astype(jnp.uint32)  # >= 30: only a sticky bit left
    wide_small = lax.shift_left(sig_small, jnp.uint32(_GUARD))
    aligned = lax.shift_right_logical(wide_small, d)
    sticky = lax.shift_left(aligned, d) != wide_small
    wide_big = lax.shift_left(sig_big, jnp.uint32(_GUARD))
    same = s_big == s_small
    # x - (y + f), 0 < f < 1 the dropped fraction, is (x - y - 1) + (1 - f): one less, with a
    # sticky remainder.
    total = jnp.where(same, wide_big + aligned, wide_big - aligned - sticky.astype(jnp.uint32))
    out = _nvfp4.round_to_f32(total, e_big - _GUARD, s_big, sticky)
    zero = (total == 0) & ~sticky
    out = jnp.where(zero, lax.shift_left(s_big & s_small, jnp.uint32(31)), out)
    inf_a, inf_b = _is_inf(a), _is_inf(b)
    out = jnp.where(inf_a | inf_b, jnp.where(inf_a, a, b), out)
    nan = _is_nan(a) | _is_nan(b) | (inf_a & inf_b & (a != b))
    return jnp.where(nan, jnp.uint32(F32_QNAN), out)


def f32_sub(a, b):
    """IEEE float32 a - b from the bits (:func:`f32_add` of a and -b)."""
    return f32_add(a, jnp.asarray(b, jnp.uint32) ^ jnp.uint32(F32_SIGN))


def f32_mul(a, b):
    """IEEE float32 a · b (nearest even) from the bits, for any a, b: finite operands by
    :func:`lowprec._nvfp4.f32_mul` (exact 48-bit product, one rounding); ±inf and NaN as
    IEEE 754 (inf · 0 is NaN)."""
    a, b = jnp.broadcast_arrays(jnp.asarray(a, jnp.uint32), jnp.asarray(b, jnp.uint32))
    finite = _nvfp4.f32_mul(a & ~_inf_or_nan_mask(a), b & ~_inf_or_nan_mask(b))
    sign = (a ^ b) & jnp.uint32(F32_SIGN)
    zero_a, zero_b = (a & F32_ABS) == 0, (b & F32_ABS) == 0
    inf = _is_inf(a) | _is_inf(b)
    out = jnp.where(inf, sign | jnp.uint32(F32_INF), finite)
    nan = _is_nan(a) | _is_nan(b) | (_is_inf(a) & zero_b) | (_is_inf(b) & zero_a)
    return jnp.where(nan, jnp.uint32(F32_QNAN), out)


def _inf_or_nan_mask(bits):
    """All ones where ``bits`` is inf or NaN (those operands are replaced by zero before the
    finite product, whose result is then overwritten)."""
    return jnp.where((bits & F32_ABS) >= F32_INF, jnp.uint32(0xFFFF_FFFF), jnp.uint32(0))


def f32_div(a, b):
    """IEEE float32 a / b (nearest even) from the bits, for any a, b: finite a over a nonzero
    finite b by :func:`lowprec._nvfp4.f32_div` (long division, one rounding); x / 0 is
    ±inf (0 / 0 NaN), x / ±inf is ±0, inf / finite ±inf, inf / inf and NaN operands NaN."""
    a, b = jnp.broadcast_arrays(jnp.asarray(a, jnp.uint32), jnp.asarray(b, jnp.uint32))
    sign = (a ^ b) & jnp.uint32(F32_SIGN)
    zero_b = (b & F32_ABS) == 0
    safe_b = jnp.where(zero_b | (_is_inf(b)) | _is_nan(b), jnp.uint32(const_bits(1.0)), b)
    safe_a = jnp.where((a & F32_ABS) >= F32_INF, jnp.uint32(0), a)
    out = _nvfp4.f32_div(safe_a, safe_b)
    out = jnp.where(zero_b | _is_inf(a), sign | jnp.uint32(F32_INF), out)
    out = jnp.where(_is_inf(b), sign, out)
    nan = (_is_nan(a) | _is_nan(b) | (zero_b & ((a & F32_ABS) == 0))
           | (_is_inf(a) & _is_inf(b)))
    return jnp.where(nan, jnp.uint32(F32_QNAN), out)


def f32_div_by_integer(a, d: int):
    """IEEE float32 a / d (nearest even) from the bits, for any a and a positive integer
    constant ``d`` below 2^12 (6, 7, 1536, 2688): :func:`f32_div`'s result, by
    :func:`lowprec._nvfp4.div_by_integer` on the magnitude (a few operations on CPU, where
    the long division was most of these formats' compile time; the long division elsewhere).
    A quotient by a positive divisor has the numerator's sign, and nearest-even rounding is
    symmetric, so the magnitude's quotient carries the sign; ±inf stays ±inf, NaN gives the
    quiet NaN, ±0 gives ±0."""
    a = jnp.asarray(a, jnp.uint32)
    mag = a & jnp.uint32(F32_ABS)
    q = _nvfp4.div_by_integer(jnp.where(mag >= F32_INF, jnp.uint32(0), mag), d)
    out = jnp.where(_is_inf(a), a, q | (a & jnp.uint32(F32_SIGN)))
    return jnp.where(_is_nan(a), jnp.uint32(F32_QNAN), out)


def host_div_bits(a: float, b: float) -> int:
    """The float32 pattern of the IEEE float32 quotient of two float32 constants, computed
    once on the host (NumPy's float32 division is IEEE's, nearest even) instead of in
    every program: both and the quotient normal (checked, as no flushing can then apply)."""
    q = np.float32(a) / np.float32(b)
    assert np.float32(a) == a and np.float32(b) == b, (a, b)
    assert np.isfinite(q) and abs(q) >= np.finfo(np.float32).tiny, (a, b)
    return int(q.view(np.uint32))


def f32_mul_finite(a, b):
    """IEEE float32 a · b of finite operands (overflow gives ±inf): the exact product and one
    rounding, without :func:`f32_mul`'s handling of inf and NaN operands (a smaller program)."""
    return _nvfp4.f32_mul(jnp.asarray(a, jnp.uint32), jnp.asarray(b, jnp.uint32))


def f32_mul_short(a, b):
    """IEEE float32 a · b of finite a and a finite b with at most 6 significant bits (E2M1
    and INT4 values, E4M3 scales): :func:`lowprec._nvfp4.f32_mul_short`."""
    return _nvfp4.f32_mul_short(jnp.asarray(a, jnp.uint32), jnp.asarray(b, jnp.uint32))


def f32_mul_positive(a, b):
    """IEEE float32 a · b for a finite or ±inf and b positive finite (an inf stays inf)."""
    a = jnp.asarray(a, jnp.uint32)
    return jnp.where(_is_inf(a), a, _nvfp4.f32_mul(a & ~_inf_or_nan_mask(a), b))


def f32_min_positive(a, b):
    """The smaller of two non-negative float32 patterns (they order like their values)."""
    return jnp.minimum(jnp.asarray(a, jnp.uint32), jnp.asarray(b, jnp.uint32))


# -- grids -------------------------------------------------------------------------------------

#: The E2M1 magnitudes in code order (OCP MX v1.0 §5.3.3: 0, 0.5, 1, 1.5, 2, 3, 4, 6).
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def e2m1_nearest(q, ties: str = "even", zero_sign: bool = True):
    """Bits of the E2M1 value nearest the float32 ``q`` (saturating at ±6), and its 3-bit
    magnitude index (int32): ``(value_bits, index)``.

    ``ties``: ``"even"`` (the neighbour with the even code, IEEE nearest-even: 0.25 → 0,
    0.75 → 1, 1.25 → 1, 1.75 → 2, 2.5 → 2, 3.5 → 4, 5 → 4) or ``"toward_zero"`` (the smaller
    magnitude: the first of two equal distances, as an ``argmin`` over the grid picks it).
    ``zero_sign``: whether a negative ``q`` that rounds to zero gives -0 (else +0). A NaN
    ``q`` gives garbage (callers mask NaN blocks).
    """
    mag = q & jnp.uint32(F32_ABS)
    index = jnp.zeros(q.shape, jnp.int32)
    for j in range(len(E2M1_MAGNITUDES) - 1):
        mid = jnp.uint32(const_bits((E2M1_MAGNITUDES[j] + E2M1_MAGNITUDES[j + 1]) / 2))
        up_at_tie = ties == "even" and j % 2 == 1  # the upper neighbour j + 1 is even
        above = (mag > mid) | (mag == mid) if up_at_tie else mag > mid
        index = index + above.astype(jnp.int32)
    table = jnp.asarray([const_bits(v) for v in E2M1_MAGNITUDES], jnp.uint32)
    sign = q & jnp.uint32(F32_SIGN)
    if not zero_sign:
        sign = jnp.where(index == 0, jnp.uint32(0), sign)
    return table[index] | sign, index


def plus_zero(q, values):
    """``values`` with +0 where ``q`` is exactly -0.0: TransformerEngine's E2M1 threshold
    table and the IF4/MixFP4 authors' ``sign(q) * value`` (``torch.sign(-0.0)`` is +0) give
    an exact -0.0 the +0 code, while any other value rounding to zero keeps its sign."""
    return jnp.where(q == jnp.uint32(F32_SIGN), jnp.uint32(0), values)


def e2m1_table_bits():
    """float32 patterns of the 16 E2M1 codes (sign-magnitude; code 8 is -0)."""
    mags = [const_bits(v) for v in E2M1_MAGNITUDES]
    return jnp.asarray(mags + [m | F32_SIGN for m in mags], jnp.uint32)


def e2m1_codes_of(value_bits):
    """The E2M1 code (int32) of exact E2M1 value bits (the inverse of its decode)."""
    mag = value_bits & jnp.uint32(F32_ABS)
    index = jnp.zeros(value_bits.shape, jnp.int32)
    for v in E2M1_MAGNITUDES[1:]:
        index = index + (mag >= jnp.uint32(const_bits(v))).astype(jnp.int32)
    negative = (value_bits & jnp.uint32(F32_SIGN)) != 0
    return jnp.where(negative, index | 8, index)


def int_nearest(q, k_max: int):
    """The integer nearest the float32 ``q`` (ties to even) after clamping ``q`` to
    [-k_max, k_max], as int32 (``torch.round(q.clamp(-k_max, k_max))``; -0 is 0).

    For |q| < 2^23 the float32 sum |q| + 2^23 rounds |q| to an integer (``rint_small``'s
    trick, here on the bits: :func:`f32_add`), exact for subnormal q too.
    """
    mag = jnp.minimum(q & jnp.uint32(F32_ABS), jnp.uint32(const_bits(float(k_max))))
    magic = jnp.uint32(const_bits(2.0**F32_MANT_BITS))
    k = (f32_add(mag, magic) - magic).astype(jnp.int32)
    negative = (q & jnp.uint32(F32_SIGN)) != 0
    return jnp.where(negative, -k, k)


def int_bits(k):
    """float32 patterns of small integers ``k`` (int32, |k| < 2^24), exactly."""
    return f32_bits(k.astype(jnp.float32))


# -- per-block errors -------------------------------------------------------------------------


def block_error(approx, x, axis: int, metric: str):
    """Per-block float32 error between float32 patterns ``approx`` and ``x`` (blocks along
    ``axis``): ``"mae"`` Σ |approx - x|, ``"mse"`` Σ (approx - x)², each difference, square
    and running sum rounded to float32, summed left to right over the block (the order of
    TransformerEngine's 4over6 kernel and its reference). Returned with ``axis`` removed."""
    diff = f32_sub(approx, x)
    term = diff & jnp.uint32(F32_ABS) if metric == "mae" else f32_mul(diff, diff)
    term = jnp.moveaxis(term, axis, 0)

    def step(acc, t):
        return f32_add(acc, t), None

    total, _ = lax.scan(step, jnp.zeros(term.shape[1:], jnp.uint32), term)
    return total


# -- the schemes' common part ------------------------------------------------------------------

#: E4M3 codes: the NaN code of a block holding NaN or inf (0x7F = S.1111.111), the sign bit
#: that IF4 and MixFP4 take as their grid flag, and the magnitude bits below it.
E4M3_NAN = 0x7F
E4M3_SIGN = 0x80
E4M3_MAX = 448.0  # 0b0_1111_110 = 1.75 * 2^8


class GridSelectScheme(ScaleScheme):
    """Common part of the schemes of docs/design.md §3c: E4M3 block scales (their sign bit
    free or a grid flag) over E2M1 codes, under a float32 scalar of the whole tensor that
    each scheme defines (its ``tensor_scale`` leaf); the scheme rounds every element itself
    (to the grid it chose) and hands the element encoder exact E2M1 values. Subclasses
    implement :meth:`tensor_scale_of`, :meth:`choose`, :meth:`block_factors` and
    :meth:`decode_values`."""

    tensor_scale = True
    roundings = ("nearest_even",)  # the authors' recipes have no other mode
    #: What the float32 tensor scalar is, in words (for messages and docstrings).
    tensor_scalar: ClassVar[str] = ""

    def check_scale(self) -> None:
        sc = self.scale
        layout = tuple(getattr(sc, f, None) for f in ("sign_bits", "exponent_bits",
                                                      "mantissa_bits", "bias", "nan_code"))
        if layout != (1, 4, 3, 7, E4M3_NAN):
            raise ValueError(
                f"scale scheme {self.name!r} stores E4M3 block scales, got the scale format "
                f"{getattr(sc, 'name', sc)!r}")

    def check_element(self, element: "ElementFormat", fmt_name: str) -> None:
        if (element.code_bits, element.mantissa_bits, element.max_finite) != (4, 1, 6.0):
            raise ValueError(f"{fmt_name}: {self.name} blocks hold E2M1 codes, got "
                             f"{element.name}")

    # -- options -----------------------------------------------------------------------------

    def tensor_scale_option(self, tensor_scale, fmt_name: str, func: str):
        if tensor_scale is None:
            return None
        if isinstance(tensor_scale, (int, float)) and not (
                math.isfinite(tensor_scale) and tensor_scale >= 0):
            raise ValueError(f"{func}: {fmt_name}'s tensor_scale is {self.tensor_scalar}, a "
                             f"finite non-negative number; got {tensor_scale!r}")
        ts = jnp.asarray(tensor_scale, jnp.float32)
        if ts.shape != ():
            raise ValueError(f"{func}: tensor_scale must be a scalar, got shape {ts.shape}")
        return ts

    def check_tensor_scale_leaf(self, ts, scales, fmt_name: str, shape: tuple) -> None:
        if ts is None:
            raise ValueError(f"MXArray: {fmt_name} needs its float32 tensor_scale "
                             f"({self.tensor_scalar}; quantize_mx computes it)")
        if not (hasattr(ts, "shape") and hasattr(ts, "dtype")):
            return  # a placeholder while JAX rebuilds the pytree
        batch = tuple(scales.shape)[: len(scales.shape) - len(shape)]
        if np.dtype(ts.dtype) != np.float32 or tuple(ts.shape) != batch:
            raise TypeError(f"MXArray: tensor_scale must be a float32 scalar (batch shape "
                            f"{batch}), got {np.dtype(ts.dtype)}{list(ts.shape)}")
        if isinstance(ts, jax.core.Tracer) or not isinstance(ts, (np.ndarray, np.generic,
                                                                   jax.Array)):
            return
        values = np.asarray(ts, np.float32)
        bad = ~(np.isfinite(values) & (values >= 0))
        if np.any(bad):
            raise ValueError(f"MXArray: {fmt_name} tensor_scale is {self.tensor_scalar}, a "
                             f"finite non-negative float32; got {values[bad].flat[0]!r}")

    # -- encode ------------------------------------------------------------------------------

    def tensor_scale_bits(self, bits, tensor_scale, cast, amax=None):
        if tensor_scale is not None:
            return f32_bits(tensor_scale)
        return self.tensor_scale_of(_nvfp4.finite_amax_bits(bits))

    def tensor_scale_of(self, amax_bits):
        """Bits of the tensor scalar of a tensor whose largest finite magnitude is
        ``amax_bits``."""
        raise NotImplementedError

    def encode_blocks(self, xb, amax, ts_bits, cast, inner: int):
        special = amax >= F32_INF
        # A NaN/inf block is zeroed below; its maximum must not reach the arithmetic.
        finite_amax = jnp.where(special, jnp.uint32(0), amax)
        xb = jnp.where(jnp.expand_dims(special, inner), jnp.uint32(0), xb)
        if _dispatch.cpu_grid_select_kernel(xb):
            # On CPU one custom call (the same bits, _grid_select_cpu.cc): XLA compiles this
            # module's emulation to ~10,000 HLO lines, seconds per program.
            attrs = self.kernel_attrs()
            codes, values = _dispatch.on_cpu(
                lambda *a: _grid_select_cpu.choose(*a, inner, self.name, **attrs),
                lambda *a: self.choose(*a, inner), xb, finite_amax, ts_bits)
        else:
            codes, values = self.choose(xb, finite_amax, ts_bits, inner)
        return jnp.where(special, E4M3_NAN, codes), special, values, None

    def kernel_attrs(self) -> dict:
        """The native kernel's attributes of this scheme beyond its name (``mse``, ``fp16``,
        ``e4m3_max``: ``_grid_select_cpu.choose``)."""
        raise NotImplementedError

    def choose(self, xb, amax, ts_bits, inner: int):
        """``(scale codes, element values)`` of finite blocks ``xb`` with largest magnitudes
        ``amax``: int32 codes per block and the signed E2M1 value bits each element rounds
        to, on the grid its block chose (the element encoder turns them into codes)."""
        raise NotImplementedError

    # -- decode ------------------------------------------------------------------------------

    def block_factors(self, scale_codes, tensor_scale):
        """float32 bits of what each block's element values are multiplied by (one grid's),
        NaN for a NaN block."""
        raise NotImplementedError

    def element_scale(self, scale_codes, tensor_scale):
        return lax.bitcast_convert_type(self.block_factors(scale_codes, tensor_scale),
                                        jnp.float32)


def e4m3_codes(bits, scale_fmt: "ElementFormat"):
    """E4M3 codes (int32) of non-negative float32 patterns clamped to 448 first (a cast
    after ``clamp(v, max=448)``, rounding to nearest even)."""
    clamped = jnp.minimum(bits, jnp.uint32(const_bits(E4M3_MAX)))
    return encode_bits(scale_fmt, clamped, "nearest_even", "saturate", None)


def e4m3_values(codes, scale_fmt: "ElementFormat"):
    """float32 bits of E4M3 codes (their sign bit included)."""
    return decode_bits(scale_fmt, codes)
