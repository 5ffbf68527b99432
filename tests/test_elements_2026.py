"""The 2026 element formats: HiFloat8 (tapered, arXiv 2409.16626) and UE5M3 (CUDA 13.4).

Both are in the ``all_elements`` collection, so the codec, property and fast-path tests run
them in every mode against the reference (tests/test_codec.py, test_codec_properties.py).
This file checks facts of their specifications, derived by hand in the comments.
"""

from __future__ import annotations

from fractions import Fraction

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import lowprec
import lowprec_reference as R

ALL_CODES = jnp.arange(256, dtype=jnp.uint8)

# HiFloat8 codes and values from the paper's encoding (§2): sign | dot | exponent | mantissa.
HIF8_FACTS = {
    0x00: 0.0,                  # zero (one only)
    0x01: 2.0**-22,             # 0 0000 001: denormal j = 1 -> 2^(1 - 23)
    0x07: 2.0**-16,             # j = 7
    0x08: 1.0,                  # 0 0001 000: dot 0 (E = 0), M = 000
    0x0F: 1.875,                # M = 111
    0x10: 2.0,                  # 0 001 0 000: dot 1, exponent field 0 -> E = +1
    0x18: 0.5,                  # 0 001 1 000: exponent sign set -> E = -1
    0x20: 4.0,                  # 0 01 00 000: dot 2, field 00 -> E = +(2 + 0)
    0x2F: 15.0,                 # 0 01 01 111: E = +3, 1.875 * 8
    0x40: 16.0,                 # 0 10 000 00: dot 3, E = +4
    0x50: 2.0**-4,              # 0 10 100 00: E = -4
    0x60: 256.0,                # 0 11 0000 0: dot 4, E = +8
    0x6E: 2.0**15,              # 0 11 0111 0: E = +15, the largest finite
    0x70: 2.0**-8,              # 0 11 1000 0: E = -8
    0x7E: 2.0**-15,             # 0 11 1111 0: E = -15, the smallest normal
    0x7F: 1.5 * 2.0**-15,
    0x81: -(2.0**-22),
}


def test_hifloat8_codes_decode_as_the_paper_defines():
    v = np.asarray(lowprec.decode(ALL_CODES, "hif8"), np.float64)
    for code, want in HIF8_FACTS.items():
        assert v[code] == want, hex(code)
    assert v[0x6F] == np.inf and v[0xEF] == -np.inf and np.isnan(v[0x80])
    assert np.isnan(v).sum() == 1 and np.isinf(v).sum() == 2
    np.testing.assert_array_equal(v, R.decode("hif8", np.arange(256, dtype=np.uint8)))


def test_hifloat8_precision_per_binade():
    """The abstract: 7 exponents with a 3-bit mantissa (0, +-1, +-2, +-3), 8 with 2 bits
    (+-4..7), 16 with 1 bit (+-8..15), and denormals adding 7 binades (2^-22..2^-16): 38
    binades in all."""
    v = np.asarray(lowprec.decode(ALL_CODES[:0x80], "hif8"), np.float64)
    v = v[np.isfinite(v) & (v > 0)]
    binade = np.floor(np.log2(v)).astype(int)
    counts = {int(e): int((binade == e).sum()) for e in np.unique(binade)}
    mantissa_bits = {e: int(np.log2(n)) for e, n in counts.items() if n > 1}
    assert sorted(e for e, m in mantissa_bits.items() if m == 3) == [-3, -2, -1, 0, 1, 2, 3]
    assert sorted(e for e, m in mantissa_bits.items() if m == 2) == [-7, -6, -5, -4, 4, 5, 6, 7]
    assert len([e for e, m in mantissa_bits.items() if m == 1]) == 15  # +15's 1.5 is +inf
    assert [e for e, n in counts.items() if n == 1] == [*range(-22, -15), 15]
    assert len(counts) == 38


def test_hifloat8_rounding_at_its_edges():
    """TA (ties away, the paper's rounding) as lowprec's nearest_away: 1.25 * 2^15 (the tie
    between 2^15 and the infinity code's 1.5 * 2^15) overflows to +inf; nearest_even keeps
    2^15 (0x6E is the even code). 2^-23 (the tie between 0 and 2^-22) rounds away to 0x01,
    to even 0x00. Between the denormals 2^-21 (0x02) and 2^-20 (0x03), 1.5 * 2^-21 ties to
    the even code 0x02. There is no -0: negative underflow gives 0x00; NaN gives 0x80."""
    x = jnp.asarray(np.float32([1.25 * 2**15, 2.0**-23, 1.5 * 2**-21, -1e-30, -0.0, np.nan]))
    away = np.asarray(lowprec.encode(x, "hif8", rounding="nearest_away")).tolist()
    even = np.asarray(lowprec.encode(x, "hif8")).tolist()
    assert away == [0x6F, 0x01, 0x03, 0x00, 0x00, 0x80]
    assert even == [0x6E, 0x00, 0x02, 0x00, 0x00, 0x80]
    assert lowprec.encode(jnp.float32(1e6), "hif8", overflow="saturate") == 0x6E
    q = lowprec.quantize(jnp.asarray(np.float32([3.3, -100.0, 1000.0])), "hif8").tolist()
    assert q == [3.25, -96.0, 1024.0]  # 1.625 * 2; 1.5 * 2^6 (2 bits); 1 * 2^10 (1 bit)


def test_hifloat8_finfo():
    info = lowprec.finfo("hif8")
    assert (info.max, info.smallest_normal, info.smallest_subnormal) == (2.0**15, 2.0**-15,
                                                                          2.0**-22)
    assert info.eps == 0.125 and info.bits == 8
    assert R.max_finite("hif8") == Fraction(2**15)


def test_ue5m3_layout_and_specials():
    """UE5M3 (PTX .ue5m3, CUDA __nv_fp8_ue5m3): no sign, 5 exponent bits (bias 15), 3
    mantissa bits, subnormals, no infinity, NaN only 0xFF. So 1.0 = 0b01111_000 = 0x78, the
    largest value 0b11111_110 = 1.75 * 2^16 = 114688 (auto-round's FLOAT8_UE5M3_MAX), the
    smallest 2^(1 - 15 - 3) = 2^-17. Under "ieee" overflow is NaN (no infinity), under
    "saturate" (CUDA's __NV_SATFINITE) the largest value; negatives are NaN."""
    v = np.asarray(lowprec.decode(ALL_CODES, "ue5m3"), np.float64)
    assert v[0x78] == 1.0 and v[0xFE] == 114688.0 and v[0x01] == 2.0**-17 and v[0] == 0
    assert np.isnan(v).sum() == 1 and np.isnan(v[0xFF]) and not np.isinf(v).any()
    np.testing.assert_array_equal(v, R.decode("ue5m3", np.arange(256, dtype=np.uint8)))
    x = jnp.asarray(np.float32([122880.0, 1e9, -1.0, 3.0, 2.0**-18]))
    assert np.asarray(lowprec.encode(x, "ue5m3")).tolist() == [0xFF, 0xFF, 0xFF, 0x84, 0x00]
    assert np.asarray(lowprec.encode(x, "ue5m3", overflow="saturate")).tolist()[:2] == [0xFE,
                                                                                      0xFE]


def test_ue5m3_against_ml_dtypes_when_it_has_the_type():
    """ml_dtypes announced float8_e5m3fnu; 0.6.0 (the version here) does not have it."""
    dtype = getattr(ml_dtypes, "float8_e5m3fnu", None)
    if dtype is None:
        pytest.skip(f"ml_dtypes {ml_dtypes.__version__} has no float8_e5m3fnu")
    x = np.random.default_rng(0).standard_normal(4096).astype(np.float32) * 100
    x = np.abs(x)
    want = x.astype(dtype).view(np.uint8)
    np.testing.assert_array_equal(np.asarray(lowprec.encode(jnp.asarray(x), "ue5m3")), want)


def test_2026_elements_encode_under_jit_like_eager():
    rng = np.random.default_rng(3)
    x = jnp.asarray((rng.standard_normal(512) * np.exp(rng.uniform(-20, 12, 512)))
                    .astype(np.float32))
    for fmt in ("hif8", "ue5m3"):
        eager = np.asarray(lowprec.encode(x, fmt))
        np.testing.assert_array_equal(np.asarray(jax.jit(lambda a: lowprec.encode(a, fmt))(x)),
                                      eager)
        np.testing.assert_array_equal(eager, R.encode(fmt, np.asarray(x)))
