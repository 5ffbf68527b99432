"""Inputs that stress a format: adversarial float32 sets and format-aware Hypothesis strategies.

Values come from the format's layout fields in the data table (via lowprec's format objects,
which only read that table), never from lowprec's codecs.
"""

from __future__ import annotations

import functools
import math
import zlib
from fractions import Fraction

import ml_dtypes
import numpy as np
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import lowprec

from .asserts import bit_pattern

#: Largest 1-D input of the codec harness (see helpers.codecs): adversarial sets fit in it.
BUCKET = 4096


def _f32(bits) -> np.ndarray:
    return np.asarray(bits, np.uint64).astype(np.uint32).view(np.float32)


# Float32 special values and edges that every format sees.
F32_SPECIALS = _f32(
    [
        0x0000_0000, 0x8000_0000,  # +-0
        0x7F80_0000, 0xFF80_0000,  # +-inf
        0x7FC0_0000, 0xFFC0_0000, 0x7F80_0001, 0xFFFF_FFFF, 0x7FBF_FFFF,  # NaNs (q, s, payloads)
        0x0000_0001, 0x8000_0001, 0x0000_0002, 0x0000_0003,  # smallest subnormals
        0x0040_0000, 0x007F_FFFF, 0x0020_0001, 0x805F_0F0F,  # larger subnormals
        0x0080_0000, 0x8080_0000, 0x0080_0001,  # smallest normals
        0x7F7F_FFFF, 0xFF7F_FFFF, 0x7F7F_FFFE,  # largest finite
        0x3F80_0000, 0xBF80_0000, 0x3F80_0001, 0x3F7F_FFFF,  # around 1
    ]
)


def float32_from_fields(sign, exp, mant) -> np.ndarray:
    """float32 values of sign bits, exponent fields and mantissa fields (arrays)."""
    bits = (np.asarray(sign, np.uint32) << 31) | (np.asarray(exp, np.uint32) << 23) | np.asarray(
        mant, np.uint32)
    return bits.astype(np.uint32).view(np.float32)


def bit_kinds(rng, sign, mant, shape) -> dict:
    """float32 arrays of ``shape`` (rows of blocks of 16) by kind, drawn from ``rng`` in this
    order: ``normal`` (standard normal), ``any_bits`` (every pattern, NaN and inf included),
    ``spread`` (each block's exponents up to 40 binades below a random top: subnormal
    scales, blocks rounding to zero), ``subnormal`` (exponent field 0 or 1); ``sign`` and
    ``mant`` give the fields of the last two."""
    blocks = (shape[0], shape[1] // 16)
    out = {"normal": rng.standard_normal(shape),
           "any_bits": rng.integers(0, 2**32, shape, dtype=np.uint64).astype(np.uint32)
           .view(np.float32)}
    exps = rng.integers(1, 255, (*blocks, 1)) - rng.integers(0, 41, (*blocks, 16))
    out["spread"] = float32_from_fields(sign, np.clip(exps, 0, 254).reshape(shape), mant)
    out["subnormal"] = float32_from_fields(sign, rng.integers(0, 2, shape), mant)
    return out


def _grid_codes(fmt: str) -> np.ndarray:
    """Positive finite codes used to build the adversarial set (all of them for <= 8 bits)."""
    f = lowprec.element_format(fmt)
    m, n_exp = f.mantissa_bits, 1 << f.exponent_bits
    if f.code_bits <= 8:
        codes = np.arange(1 << f.magnitude_bits)
    else:
        mant = sorted({0, 1, (1 << m) // 2, (1 << m) - 2, (1 << m) - 1})
        if f.exponent_bits <= 5:
            exps = range(n_exp)
        else:  # every binade near the bottom, around 1 and near the top
            exps = [*range(0, 6), *range(f.bias - 3, f.bias + 4), *range(n_exp - 6, n_exp)]
        codes = np.array([(e << m) | t for e in exps for t in mant])
    return codes[codes <= f.max_magnitude_code]


@functools.lru_cache(maxsize=None)
def adversarial_float32(fmt: str) -> np.ndarray:
    """A float32 array that stresses ``fmt`` (550-2900 distinct bit patterns, <= BUCKET).

    For each grid value v (every finite value of the 8-bit and 4-bit formats; for the 16/19-bit
    formats, the edge mantissas of every binade near the bottom, around 1 and near the top):
    v and its float32 neighbours, the midpoint to the next grid value (the tie, in every
    binade, including the subnormal ones and between 0 and the smallest subnormal) and its
    float32 neighbours, and 1/4 and 3/4 of the way (stochastic rounding). Past the largest
    finite value M, the grid is extended by one step (the overflow tie M + ulp/2, e.g. 464 for
    e4m3, 61440 for e5m2, 7 for e2m1) and 2M. E8M0 additionally gets the interior of its lowest
    binade (2^-127, 2^-126), where ml_dtypes rounds everything up. All with both signs (a
    sample of negatives for the unsigned E8M0), plus
    float32 specials (+-0, +-inf, NaNs, float32 subnormals, largest finite) and 200 log-uniform
    random values over the format's range. Values come from the format's layout fields.
    """
    f = lowprec.element_format(fmt)
    m = f.mantissa_bits
    codes = _grid_codes(fmt)

    def value(c):  # exact value of a positive magnitude code, from the layout (inputs only)
        e, t = int(c) >> m, int(c) & ((1 << m) - 1)
        if f.subnormals and e == 0:
            return Fraction(t, 1 << m) * Fraction(2) ** f.emin
        return (1 + Fraction(t, 1 << m)) * Fraction(2) ** (e - f.bias)

    if f.encoding == "tapered":  # codes do not order like values: walk the sorted values
        grid = sorted(f.magnitude_value(c) for c in range(1, 1 << f.magnitude_bits)
                      if c != f.inf_code)
        value = dict(zip(range(1, len(grid) + 1), grid)).__getitem__
        codes, top = range(1, len(grid) + 1), len(grid)
    else:
        top = f.max_magnitude_code
    near, quarter = [], []  # near: grid values and ties, also with their float32 neighbours
    for c in codes:
        v = value(c)
        w = value(c + 1) if c < top else v + Fraction(2) ** f.top_quantum_exponent
        near += [v, (v + w) / 2]
        quarter += [v + (w - v) / 4, v + 3 * (w - v) / 4]
        if c == top:
            near += [w, 2 * v]
    if f.zero:  # the tie between 0 and the smallest positive value, and either side of it
        s = value(1)
        near += [s / 2]
        quarter += [s / 4, 3 * s / 4]
    else:  # E8M0: below 2^-127, and the interior of the lowest binade (2^-127, 2^-126)
        lo = Fraction(2) ** f.emin
        near += [lo / 2]
        quarter += [lo / 4, lo * 3 / 4] + [lo * (1 + Fraction(k, 16)) for k in range(1, 16)]

    def as_f32(values):
        with np.errstate(over="ignore"):
            return np.array([float(v) for v in values], np.float64).astype(np.float32)

    near32 = as_f32(near)
    neighbours = np.concatenate(
        [
            near32,
            np.nextafter(near32, np.float32(np.inf)),
            np.nextafter(near32, np.float32(0)),
            as_f32(quarter),
        ]
    )
    rng = np.random.default_rng(1234)
    lo_e = f.emin - m - 2
    hi_e = min(f.emax + 1, 127)
    rand = np.exp2(rng.uniform(lo_e, hi_e + 1, 200)).astype(np.float32)
    pos = np.concatenate([neighbours, rand])
    pos = pos[np.isfinite(pos)]
    # An unsigned format maps every negative input to NaN: a sample of negatives is enough.
    neg = -pos if f.signed else -pos[::16]
    x = np.concatenate([pos, neg, F32_SPECIALS])
    x = np.unique(bit_pattern(x)).view(np.float32)  # dedup on bits: keeps -0 and NaNs
    assert x.size <= BUCKET, (fmt, x.size)
    return x


def _near_grid(fmt: str, dtype, salt: str = "") -> st.SearchStrategy:
    """Floats of ``dtype`` placed on, next to, or halfway between values of ``fmt``.

    A value is sign * 1.h t * 2^e with e over the format's exponent range (a few binades
    beyond each end), h the format's mantissa bits and t the remaining bits of the input
    dtype: t = 0 (a grid value), 100..0 (a tie), 011..1 / 100..01 (either side of a tie),
    1 / 11..1 (next to a grid value) or anything. Values the dtype cannot hold exactly
    (below its normal range) are rounded to it by NumPy; they are inputs either way. One
    integer is drawn per value and sliced into those fields (a composite strategy with one
    draw per field is 5x slower, and generation dominates these tests' run time).

    ``salt`` permutes the drawn integers (n -> (A n + crc32(salt)) mod M, a bijection): with
    derandomize=True every parametrization of a test replays the same Hypothesis choices, so
    without it all (rounding, overflow) cases of a format would see the same values.
    """
    f = lowprec.element_format(fmt)
    nmant = int(ml_dtypes.finfo(dtype).nmant)
    g = min(f.mantissa_bits, nmant)
    tail_bits = nmant - g
    e_lo, e_hi = f.emin - f.mantissa_bits - 3, f.emax + 2
    span = e_hi - e_lo + 1
    half = (1 << (tail_bits - 1)) if tail_bits else 0
    tails = [0, half, half - 1, half + 1, 1, (1 << tail_bits) - 1] if tail_bits else [0]
    modulus = span << (g + 4 + tail_bits)
    offset = zlib.crc32(salt.encode()) if salt else 0
    mult = (1 << 61) - 1 if salt else 1  # a prime, so coprime to the modulus

    def build(n: int) -> float:
        n = (mult * n + offset) % modulus
        n, e = divmod(n, span)
        n, head = divmod(n, 1 << g)
        n, kind = divmod(n, 8)
        n, negative = divmod(n, 2)
        tail = tails[kind] if kind < len(tails) else n & ((1 << tail_bits) - 1)
        sig = (((1 << g) | head) << tail_bits) | tail  # nmant + 1 bits
        v = math.ldexp(float(sig), e + e_lo - nmant) if e + e_lo - nmant > -1100 else 0.0
        with np.errstate(all="ignore"):
            return float(np.asarray(-v if negative else v).astype(dtype))

    return st.integers(0, modulus - 1).map(build)


def float_arrays(fmt: str, dtype, max_size: int = 32, salt: str = "") -> st.SearchStrategy:
    """1-D arrays of ``dtype`` (float16, bfloat16, float32, float64) that stress ``fmt``.

    Up to max_size / 2 of Hypothesis' own floats of that width (it favours +-0, +-inf, NaN,
    subnormals and the extremes), then :func:`_near_grid` values; at least one element. Two
    ``hypothesis.extra.numpy.arrays`` draws, concatenated: an array with ``one_of`` elements
    takes twice as long to generate. bfloat16 arrays are drawn as float32 arrays of bfloat16
    values (``hypothesis.extra.numpy`` does not know the ml_dtypes type), converted exactly.
    Pass the test's parameters as ``salt`` to vary the near-grid values between them.
    """
    dtype = np.dtype(dtype)
    is_bf16 = dtype == np.dtype(ml_dtypes.bfloat16)
    if is_bf16:
        generic = st.integers(0, 0xFFFF).map(lambda b: float(np.uint32(b << 16).view(np.float32)))
        array_dtype = np.dtype(np.float32)
    else:
        generic = st.floats(width=8 * dtype.itemsize, allow_subnormal=True)
        array_dtype = dtype
    near = _near_grid(fmt, dtype, salt)
    n_generic = max_size // 2

    @st.composite
    def strategy(draw):
        a = draw(hnp.arrays(array_dtype, st.integers(0, n_generic), elements=generic))
        lo = 0 if a.size else 1
        b = draw(hnp.arrays(array_dtype, st.integers(lo, max_size - n_generic), elements=near))
        return np.concatenate([a, b]).astype(dtype)

    return strategy()


#: adversarial(fmt): the name the codec tests use.
adversarial = adversarial_float32
