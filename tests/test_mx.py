"""MX block quantization: hand-derived vectors, padding, dequantize, fake-quant, gpt-oss, errors.

Expected codes below are derived by hand in the comments from OCP MX v1.0 and docs/design.md §3:
value = 2^(scale − 127) × element; floor: shared = floor(log2 amax) − emax_elem with
emax_elem = 8 (E4M3), 15 (E5M2), 2 (E2M1); elements saturate to ± the element maximum.
Each hand vector is checked against lowprec and, separately, against the independent
reference (``lowprec_reference``), so a disagreement says which side is off.

Code layouts used in the derivations: E4M3 = s.eeee.mmm (bias 7), E5M2 = s.eeeee.mm
(bias 15), E2M1 = s.ee.m (bias 1: 0, .5, 1, 1.5, 2, 3, 4, 6 for codes 0..7).
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import lowprec
import lowprec_reference as R
from helpers.asserts import assert_bits_equal, assert_same_floats, bit_pattern
from helpers.mx import (
    BLOCK,
    MODES,
    MX_FORMATS,
    ROUNDINGS,
    SCALE_RULES,
    element_codes,
    f64_to_f32_exact,
    random_bits,
    run_quantize,
)
from helpers.tiers import QUICK_MX

DIRECTED = ("nearest_even", "nearest_away", "toward_zero", "up", "down")


def block(values, n=BLOCK):
    """float32 block: ``values`` first, zeros after."""
    x = np.zeros(n, np.float32)
    x[: len(values)] = np.asarray(values, np.float64).astype(np.float32)
    return x


def quantize_both(x, fmt, axis=-1, modes=("eager",), **kw):
    """((lowprec codes, scales), (reference codes, scales)); lowprec run in each of ``modes``
    (checked equal). Eager only by default: jit is covered by the property tests, and every
    extra configuration costs a compile."""
    got = []
    for mode in modes:
        mx = run_quantize(mode, jnp.asarray(x), fmt, axis=axis, **kw)
        got.append((element_codes(mx), np.asarray(mx.scales)))
    for other in got[1:]:
        np.testing.assert_array_equal(got[0][0], other[0])
        np.testing.assert_array_equal(got[0][1], other[1])
    ref = R.quantize_mx(np.asarray(x), fmt, axis=axis, **kw)
    return got[0], (np.asarray(ref[0]), np.asarray(ref[1]))


def check_hand(x, fmt, want_codes, want_scale, **kw):
    """The first len(want_codes) elements and the (single-block) scale equal the hand values."""
    (codes, scales), (rcodes, rscales) = quantize_both(x, fmt, **kw)
    want = [int(c) for c in want_codes]
    n = len(want)
    tag = f"{fmt} {kw}"
    assert [int(c) for c in codes[:n]] == want and int(scales[0]) == want_scale, (
        f"lowprec {tag}: codes {[hex(int(c)) for c in codes[:n]]} scale {int(scales[0])}, "
        f"hand-derived {[hex(c) for c in want]} scale {want_scale}"
    )
    assert [int(c) for c in rcodes[:n]] == want and int(rscales[0]) == want_scale, (
        f"reference {tag}: codes {[hex(int(c)) for c in rcodes[:n]]} scale {int(rscales[0])}, "
        f"hand-derived {[hex(c) for c in want]} scale {want_scale}"
    )


# -- hand-derived vectors --------------------------------------------------------------------


@pytest.mark.parametrize("rounding", DIRECTED)
@pytest.mark.quick_first(2)  # every mode rounds mxfp4's ties in the quick tier (below)
def test_floor_e4m3_block_max_480_clips_to_448(rounding):
    # floor(log2 480) = 8 (256 <= 480 < 512), shared = 8 - 8 = 0 -> scale code 127.
    # 480 / 2^0 = 480 > 448 = E4M3 max: saturates to 448 = 0.1111.110 = 0x7E in every
    # mode (also toward_zero/down, which would give 448 anyway), -480 -> 0xFE.
    # 1.0 = 0.0111.000 = 0x38; -3.5 = -1.75 * 2^1 = 1.1000.110 = 0xC6.
    x = block([480.0, -480.0, 1.0, -3.5])
    check_hand(x, "mxfp8_e4m3", [0x7E, 0xFE, 0x38, 0xC6], 127, rounding=rounding)


@pytest.mark.parametrize("k", [-120, -37, -1, 0, 1, 20, 119])
@pytest.mark.quick_first(2)
def test_element_max_times_power_of_two_is_kept_exactly(k):
    s = 2.0**k
    x = block([448 * s, s, -3 * s])
    # floor: floor(log2(448 * 2^k)) = 8 + k -> shared k, scale 127 + k. Elements 448 = 0x7E,
    # 1 = 0x38, -3 = -1.5 * 2^1 = 1.1000.100 = 0xC4 (exact).
    # even: 448 = 1.110b * 2^8 already has 3 mantissa bits -> same as floor.
    # rceil: 448 * 2^k / 448 = 2^k exactly (mantissa 0, no round-up) -> same as floor.
    for rule in ("floor", "even", "rceil"):
        check_hand(x, "mxfp8_e4m3", [0x7E, 0x38, 0xC4], 127 + k, scale_rule=rule)
    # ceil: ceil(log2(448 * 2^k)) = 9 + k -> shared k + 1. 224 = 1.75 * 2^7 = 0.1110.110 = 0x76,
    # 0.5 = 0.0110.000 = 0x30, -1.5 = 1.0111.100 = 0xBC.
    check_hand(x, "mxfp8_e4m3", [0x76, 0x30, 0xBC], 128 + k, scale_rule="ceil")
    # E5M2 max 57344 = 1.75 * 2^15 = 0.11110.11 = 0x7B; 1 = 0.01111.00 = 0x3C.
    if k <= 110:
        y = block([57344 * s, s])
        check_hand(y, "mxfp8_e5m2", [0x7B, 0x3C], 127 + k, scale_rule="floor")
    # E2M1 max 6 = 1.5 * 2^2 = 0.11.1 = 0x7; 1 = 0.01.0 = 0x2.
    z = block([6 * s, s])
    check_hand(z, "mxfp4", [0x7, 0x2], 127 + k, scale_rule="floor")


# E4M3 ties with block max 256 (floor: floor(log2 256) - 8 = 0, scale 127; 256 = 0.1111.000 =
# 0x78). In [1, 2) the E4M3 spacing is 2^-3:
#   1.0625 is half-way between 1.0 (0x38, mantissa 000 even) and 1.125 (0x39, odd);
#   1.1875 is half-way between 1.125 (0x39, odd) and 1.25 (0x3A, even);
#   2^-10 is half-way between 0 (even) and the smallest subnormal 2^-9 (0x01, odd);
#   3 * 2^-10 = 1.5 * 2^-9 is half-way between 2^-9 (0x01) and 2^-8 (0x02).
# Negative codes add 0x80; "up" is toward +inf and "down" toward -inf.
E4M3_TIES = [256.0, 1.0625, 1.1875, -1.0625, -1.1875, 2.0**-10, 3 * 2.0**-10]
E4M3_TIE_CODES = {
    "nearest_even": [0x78, 0x38, 0x3A, 0xB8, 0xBA, 0x00, 0x02],
    "nearest_away": [0x78, 0x39, 0x3A, 0xB9, 0xBA, 0x01, 0x02],
    "toward_zero": [0x78, 0x38, 0x39, 0xB8, 0xB9, 0x00, 0x01],
    "up": [0x78, 0x39, 0x3A, 0xB8, 0xB9, 0x01, 0x02],
    "down": [0x78, 0x38, 0x39, 0xB9, 0xBA, 0x00, 0x01],
}
# E2M1 with block max 6 (floor(log2 6) - 2 = 0, scale 127; 6 = 0x7):
#   5 between 4 (0x6, mantissa 0 even) and 6 (0x7); 2.5 between 2 (0x4) and 3 (0x5);
#   0.25 between 0 and 0.5 (0x1); 0.75 between 0.5 (0x1, odd) and 1 (0x2, even); -5.
E2M1_TIES = [6.0, 5.0, 2.5, 0.25, 0.75, -5.0]
E2M1_TIE_CODES = {
    "nearest_even": [0x7, 0x6, 0x4, 0x0, 0x2, 0xE],
    "nearest_away": [0x7, 0x7, 0x5, 0x1, 0x2, 0xF],
    "toward_zero": [0x7, 0x6, 0x4, 0x0, 0x1, 0xE],
    "up": [0x7, 0x7, 0x5, 0x1, 0x2, 0xE],
    "down": [0x7, 0x6, 0x4, 0x0, 0x1, 0xF],
}
# E5M2 with block max 57344 (floor(log2 57344) - 15 = 0, scale 127; 0x7B). Spacing in [1, 2)
# is 2^-2: 1.125 between 1.0 (0x3C, even) and 1.25 (0x3D); 1.375 between 1.25 (0x3D) and
# 1.5 (0x3E, even).
E5M2_TIES = [57344.0, 1.125, 1.375, -1.125]
E5M2_TIE_CODES = {
    "nearest_even": [0x7B, 0x3C, 0x3E, 0xBC],
    "nearest_away": [0x7B, 0x3D, 0x3E, 0xBD],
    "toward_zero": [0x7B, 0x3C, 0x3D, 0xBC],
    "up": [0x7B, 0x3D, 0x3E, 0xBC],
    "down": [0x7B, 0x3C, 0x3D, 0xBD],
}


@pytest.mark.parametrize("rounding", DIRECTED)
@pytest.mark.parametrize(
    "fmt, values, table",
    [
        ("mxfp8_e4m3", E4M3_TIES, E4M3_TIE_CODES),
        ("mxfp4", E2M1_TIES, E2M1_TIE_CODES),
        ("mxfp8_e5m2", E5M2_TIES, E5M2_TIE_CODES),
    ],
    ids=["e4m3", "e2m1", "e5m2"],
)
@pytest.mark.quick_cases(fmt=["mxfp4"])  # every mode, one format: the others run by default
def test_ties_and_directed_rounding(fmt, values, table, rounding):
    check_hand(block(values), fmt, table[rounding], 127, rounding=rounding)


def test_stochastic_uses_documented_random_bits():
    # E2M1, block max 6 -> shared 0. 0.25 lies half-way between 0 and 0.5 (frac 1/2): it
    # rounds up (code 0x1) iff r < 2^15 (r the element's 16-bit word); -0.25 likewise to
    # -0.5 (0x9) or -0 (0x8). 1.125 lies a quarter of the way from 1 (0x2) to 1.5 (0x3)
    # (E2M1 spacing in [1, 2) is 0.5): up iff r < 2^14. 6 is exact. ``random_bits`` gives
    # the words in the reference's 32-bit form r * 2^16.
    x = block([6.0, 0.25, -0.25, 1.125] * 8)
    for seed in range(6):
        key = jax.random.key(seed)
        r = random_bits(key, x.shape)
        want = []
        for i in range(BLOCK):
            up = [False, r[i] < 2**31, r[i] < 2**31, r[i] < 2**30][i % 4]
            want.append([0x7, 0x0, 0x8, 0x2][i % 4] + int(up))
        for mode in MODES:
            mx = run_quantize(mode, jnp.asarray(x), "mxfp4", rounding="stochastic", key=key)
            assert element_codes(mx).tolist() == want and np.asarray(mx.scales).tolist() == [127]
        rc, rs = R.quantize_mx(x, "mxfp4", rounding="stochastic", random_bits=r)
        assert np.asarray(rc).tolist() == want and np.asarray(rs).tolist() == [127]


@pytest.mark.quick_cases(rule=["rceil"])
@pytest.mark.parametrize("fmt", MX_FORMATS)
@pytest.mark.parametrize("rule", SCALE_RULES)
@pytest.mark.quick_first(1)
def test_inf_and_nan_blocks_get_scale_ff_and_leave_other_blocks_alone(fmt, rule):
    # A block holding +inf, NaN or -inf gets scale 0xFF (E8M0 NaN) and dequantizes to NaN
    # throughout; the finite block between them quantizes exactly as it would alone.
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((4, BLOCK)) * 10).astype(np.float32)
    x[0, 5] = np.inf
    x[2, 17] = np.nan
    x[3, 31] = -np.inf
    layouts = [(-1, x)] + ([(0, np.ascontiguousarray(x.T))] if rule == "floor" else [])
    alone = lowprec.quantize_mx(jnp.asarray(x[1]), fmt, scale_rule=rule)
    for axis, xx in layouts:
        (codes, scales), (rcodes, rscales) = quantize_both(xx, fmt, axis=axis, scale_rule=rule)
        assert scales.reshape(-1).tolist() == [0xFF, int(alone.scales[0]), 0xFF, 0xFF]
        assert np.asarray(rscales).reshape(-1).tolist() == scales.reshape(-1).tolist()
        row1 = codes[1] if axis == -1 else codes[:, 1]
        np.testing.assert_array_equal(row1, element_codes(alone))
        mx = lowprec.quantize_mx(jnp.asarray(xx), fmt, axis=axis, scale_rule=rule)
        v = np.asarray(lowprec.dequantize(mx))
        v = v if axis == -1 else v.T
        assert np.isnan(v[[0, 2, 3]]).all()
        assert_same_floats(v[1], lowprec.dequantize(alone), f"{fmt} {rule}")


@pytest.mark.quick_cases(rule=["floor"])
@pytest.mark.parametrize("fmt", MX_FORMATS)
@pytest.mark.parametrize("rule", SCALE_RULES)
@pytest.mark.quick_first(1)
def test_all_zero_block(fmt, rule):
    # amax = 0: scale code 0 (2^-127) by definition (docs/design.md §3), elements zero.
    # lowprec documents that -0.0 keeps its sign: code 0x80 (FP8) / 0x8 (FP4).
    x = np.zeros((2, BLOCK), np.float32)
    x[1] = -0.0
    (codes, scales), (rcodes, rscales) = quantize_both(x, fmt, scale_rule=rule)
    neg_zero = 0x8 if fmt == "mxfp4" else 0x80
    assert scales.tolist() == [[0], [0]] and np.asarray(rscales).tolist() == [[0], [0]]
    assert (codes[0] == 0).all() and (codes[1] == neg_zero).all()
    v = np.asarray(lowprec.dequantize(lowprec.quantize_mx(jnp.asarray(x), fmt, scale_rule=rule)))
    assert (v == 0).all() and not np.signbit(v[0]).any() and np.signbit(v[1]).all()


@pytest.mark.parametrize("rule", SCALE_RULES)
@pytest.mark.quick_first(2)
def test_float32_subnormal_2_pow_minus_130(rule):
    # amax = 2^-130 = 2^19 * 2^-149 (float32 subnormal 0x00080000).
    #   floor: floor(log2) - 8 = -138 -> clamped to -127 -> scale code 0.
    #   ceil: 2^-130 is a power of two, ceil = floor -> code 0. even: a power of two is
    #   unchanged by mantissa rounding -> code 0. rceil: 2^-130 / 448 ~ 2^-138.8 is a float32
    #   subnormal with mantissa field ~ 2^10.2 <= 0x400000 -> not rounded up -> code 0.
    # Element: 2^-130 / 2^-127 = 2^-3. E4M3: exponent field -3 + 7 = 4 -> 0.0100.000 = 0x20;
    # E5M2: -3 + 15 = 12 -> 0.01100.00 = 0x30; E2M1: 0.125 < 0.25 (half the smallest
    # subnormal 0.5) -> 0, sign kept (-2^-130 -> 0x8).
    x = block([2.0**-130, -(2.0**-130)] * 16)
    check_hand(x, "mxfp8_e4m3", [0x20, 0xA0], 0, scale_rule=rule)
    check_hand(x, "mxfp8_e5m2", [0x30, 0xB0], 0, scale_rule=rule)
    check_hand(x, "mxfp4", [0x0, 0x8], 0, scale_rule=rule)
    # Dequantize: 2^-127 * 2^-3 = 2^-130 exactly, a float32 subnormal (no flush to zero).
    for fmt in ("mxfp8_e4m3", "mxfp8_e5m2"):
        mx = lowprec.quantize_mx(jnp.asarray(x), fmt, scale_rule=rule)
        assert bit_pattern(lowprec.dequantize(mx))[:2].tolist() == [
            0x0008_0000, 0x8008_0000]


def test_power_of_two_amax_floor_vs_ceil():
    p = np.float32(2.0**10)
    above = np.nextafter(p, np.float32(np.inf))  # 2^10 (1 + 2^-23)
    below = np.nextafter(p, np.float32(0))  # 2^10 (1 - 2^-24)
    # amax = 2^10: floor = ceil = 10 -> shared 2, scale 129; element 256 = 0.1111.000 = 0x78.
    for rule in SCALE_RULES:
        check_hand(block([p]), "mxfp8_e4m3", [0x78], 129, scale_rule=rule)
    # amax = 2^10 (1 + 2^-23): floor -> 129, element 256 (1 + 2^-23) rounds to 256 = 0x78;
    # ceil -> ceil(log2) = 11, shared 3, scale 130, element 128 (1 + 2^-23) -> 128 =
    # 0.1110.000 = 0x70.
    check_hand(block([above]), "mxfp8_e4m3", [0x78], 129, scale_rule="floor")
    check_hand(block([above]), "mxfp8_e4m3", [0x70], 130, scale_rule="ceil")
    # amax = 2^10 (1 - 2^-24), a float32 just below a power of two: floor(log2) = 9 ->
    # shared 1, scale 128; element 512 (1 - 2^-24) rounds to 512 > 448 -> saturates to 0x7E
    # (the floor rule's clipping). ceil -> 10 -> shared 2, scale 129, element 256 (1 - 2^-24)
    # -> 256 = 0x78. even: mantissa rounded half up at 3 bits carries to 2^10 -> 129, 0x78.
    # rceil: amax / 448 ~ 2.29 has mantissa > 0 -> rounded up to 2^2 -> 129, 0x78.
    check_hand(block([below]), "mxfp8_e4m3", [0x7E], 128, scale_rule="floor")
    for rule in ("ceil", "even", "rceil"):
        check_hand(block([below]), "mxfp8_e4m3", [0x78], 129, scale_rule=rule)


@pytest.mark.parametrize("k", [-3, 0, 5, 100])
def test_e2m1_block_max_6_vs_7(k):
    s = 2.0**k
    # floor, max 6 * 2^k: floor(log2 6) = 2 = emax -> shared k, scale 127 + k; 6 = 0x7,
    # 1.5 = 0.01.1 = 0x3.  Max 7 * 2^k: floor(log2 7) = 2 -> also shared k, and 7 > 6 (the
    # element max; FLOOR clips maxima above 1.5 * 2^emax) saturates to 6 = 0x7.
    check_hand(block([6 * s, 1.5 * s]), "mxfp4", [0x7, 0x3], 127 + k, scale_rule="floor")
    check_hand(block([7 * s, 1.5 * s]), "mxfp4", [0x7, 0x3], 127 + k, scale_rule="floor")
    # ceil, max 7 * 2^k: ceil(log2 7) = 3 -> shared k + 1; 3.5 is a tie between 3 (0x5) and
    # 4 (0x6, even mantissa) -> 0x6; 0.75 a tie between 0.5 (0x1) and 1 (0x2) -> 0x2.
    # even: 7 = 1.11b * 2^2, plus half an ulp (1) = 8 -> 2^3 -> the same as ceil.
    # rceil: 7 * 2^k / 6 = 1.17 * 2^k -> up to 2^(k+1) -> the same as ceil.
    for rule in ("ceil", "even", "rceil"):
        check_hand(block([7 * s, 1.5 * s]), "mxfp4", [0x6, 0x2], 128 + k, scale_rule=rule)
    # ceil, max 6 * 2^k: ceil(log2 6) = 3 -> shared k + 1; 3 = 0x5, 0.75 -> 0x2 (tie, even).
    check_hand(block([6 * s, 1.5 * s]), "mxfp4", [0x5, 0x2], 128 + k, scale_rule="ceil")
    # even/rceil keep 6 * 2^k at shared k (6 = 1.10b rounds to itself; 6 / 6 = 1 exactly).
    for rule in ("even", "rceil"):
        check_hand(block([6 * s, 1.5 * s]), "mxfp4", [0x7, 0x3], 127 + k, scale_rule=rule)


def test_even_rule_rounds_amax_mantissa_first():
    # 496 = 1.1111b * 2^8. even: add half an E4M3 ulp (2^(8-4) = 16) -> 512, mask -> 2^9:
    # shared 9 - 8 = 1, scale 128; element 248 is a tie between 240 (0.1110.111 = 0x77) and
    # 256 (0.1111.000 = 0x78, even) -> 0x78. floor keeps shared 0 and clips 496 to 0x7E.
    check_hand(block([496.0]), "mxfp8_e4m3", [0x78], 128, scale_rule="even")
    check_hand(block([496.0]), "mxfp8_e4m3", [0x7E], 127, scale_rule="floor")
    # 480 = 1.111b * 2^8 already fits 3 bits: even keeps shared 0, and 480 saturates to 0x7E.
    check_hand(block([480.0]), "mxfp8_e4m3", [0x7E], 127, scale_rule="even")


def test_rceil_hand_vectors():
    # 449 / 448 = 1.0022 in float32 has mantissa > 0 -> rounded up to 2^1: scale 128; element
    # 224.5 -> 224 (spacing 16 in [128, 256)) = 0x76.
    check_hand(block([449.0]), "mxfp8_e4m3", [0x76], 128, scale_rule="rceil")
    # 448 / 448 = 1 exactly -> scale 127, element 0x7E.
    check_hand(block([448.0]), "mxfp8_e4m3", [0x7E], 127, scale_rule="rceil")
    # Subnormal quotient above 2^-127: amax = 672 * 2^-127 = 1.3125 * 2^-118 (a float32
    # normal); amax / 448 = 1.5 * 2^-127 = float32 subnormal with mantissa 0x600000 > 0x400000
    # -> rounded up to 2^-126: scale 1. Element 672 * 2^-127 / 2^-126 = 336 = 1.3125 * 2^8,
    # a tie between 320 (0.1111.010 = 0x7A, even) and 352 (0x7B) -> 0x7A.
    check_hand(block([672 * 2.0**-127]), "mxfp8_e4m3", [0x7A], 1, scale_rule="rceil")
    # amax = 448 * 2^-127: quotient 2^-127 = mantissa 0x400000, not above -> scale 0;
    # element 448 = 0x7E.
    check_hand(block([448 * 2.0**-127]), "mxfp8_e4m3", [0x7E], 0, scale_rule="rceil")


def test_amax_float32_max():
    # amax = float32 max = (2 - 2^-23) * 2^127.
    # floor: floor(log2) = 127 -> shared 119, scale 246; element (2 - 2^-23) * 2^8 ~ 512
    #   -> saturates to 448 = 0x7E.
    # ceil: 128 -> shared 120, scale 247; element (2 - 2^-23) * 2^7 rounds to 256 = 0x78.
    # even: adding half an E4M3 ulp carries into exponent field 255, read as 2^128 -> as ceil.
    # rceil: amax / 448 = 1.14 * 2^119 (field 246, mantissa > 0) -> 247 -> as ceil.
    # Under ceil/even/rceil the block thus dequantizes to 256 * 2^120 = 2^128 = +inf in
    # float32: inherent to those rules (the reference and JAX's rceil agree), noted here.
    x = block([np.finfo(np.float32).max])
    check_hand(x, "mxfp8_e4m3", [0x7E], 246, scale_rule="floor")
    for rule in ("ceil", "even", "rceil"):
        check_hand(x, "mxfp8_e4m3", [0x78], 247, scale_rule=rule)
    # E2M1: floor -> 127 - 2 = 125, scale 252, ~8 saturates to 6 = 0x7; ceil/even/rceil ->
    # shared 126, scale 253, ~4 rounds to 4 = 0x6.
    check_hand(x, "mxfp4", [0x7], 252, scale_rule="floor")
    for rule in ("ceil", "even", "rceil"):
        check_hand(x, "mxfp4", [0x6], 253, scale_rule=rule)


@pytest.mark.quick_cases(fmt=["mxfp4"])
@pytest.mark.parametrize("fmt", MX_FORMATS)
def test_float16_input_matches_reference(fmt):
    rng = np.random.default_rng(9)
    x = (rng.standard_normal((4, 64)) * np.exp2(rng.integers(-24, 14, (4, 1)))).astype(np.float16)
    x[0, 3] = np.inf
    x[1, :32] = 0
    x[2, 5] = np.float16(6e-8)  # a float16 subnormal
    for rule in SCALE_RULES:
        (codes, scales), (rcodes, rscales) = quantize_both(x, fmt, scale_rule=rule)
        np.testing.assert_array_equal(codes, rcodes)
        np.testing.assert_array_equal(scales, rscales)


# -- padding ------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", MX_FORMATS)
def test_length_not_multiple_of_32_raises(fmt):
    with pytest.raises(ValueError, match="pad=True"):
        lowprec.quantize_mx(jnp.ones(40), fmt)
    with pytest.raises(ValueError, match="pad=True"):
        lowprec.quantize_mx(jnp.ones((40, 2)), fmt, axis=0)
    with pytest.raises(ValueError, match="pad=True"):
        lowprec.fake_quantize_mx(jnp.ones(33), fmt)


PAD_LAYOUTS = [((3, 40), -1), ((40, 3), 0), ((70,), 0)]


@pytest.mark.quick_cases(fmt=["mxfp4"])
@pytest.mark.parametrize(
    "fmt, rounding, shape, axis",
    [
        (fmt, rounding, *PAD_LAYOUTS[(i + j) % len(PAD_LAYOUTS)])
        for i, fmt in enumerate(MX_FORMATS)
        for j, rounding in enumerate(["nearest_even", "stochastic"])
    ],
)
@pytest.mark.quick_first(1)
def test_pad_round_trip(fmt, rounding, shape, axis):
    rng = np.random.default_rng(1)
    x = (rng.standard_normal(shape) * 3).astype(np.float32)
    n = shape[axis]
    padded_n = -(-n // BLOCK) * BLOCK
    widths = [(0, 0)] * len(shape)
    widths[axis] = (0, padded_n - n)
    xp = np.pad(x, widths)
    key = jax.random.key(7) if rounding == "stochastic" else None
    for mode in MODES:
        mx = run_quantize(mode, jnp.asarray(x), fmt, axis=axis, rounding=rounding, pad=True,
                          key=key)
        assert mx.shape == shape and mx.padded_length == padded_n
        # Same as quantizing the explicitly zero-padded array (with the same key: the random
        # words are drawn for the padded shape).
        full = lowprec.quantize_mx(jnp.asarray(xp), fmt, axis=axis, rounding=rounding, key=key)
        np.testing.assert_array_equal(np.asarray(mx.elements), np.asarray(full.elements))
        np.testing.assert_array_equal(np.asarray(mx.scales), np.asarray(full.scales))
        v = np.asarray(lowprec.dequantize(mx))
        assert v.shape == shape  # the padding is dropped
        np.testing.assert_array_equal(
            v, np.take(np.asarray(lowprec.dequantize(full)), np.arange(n), axis=axis))
    rbits = None if key is None else random_bits(key, xp.shape)
    rcodes, rscales = R.quantize_mx(x, fmt, axis=axis, rounding=rounding, random_bits=rbits,
                                    pad=True)
    np.testing.assert_array_equal(np.asarray(rscales), np.asarray(mx.scales))
    rcodes = np.asarray(rcodes)
    if rcodes.shape[axis] == n:  # the reference may drop the padding codes or keep them
        np.testing.assert_array_equal(rcodes, np.take(element_codes(mx), np.arange(n), axis=axis))
    else:
        np.testing.assert_array_equal(rcodes, element_codes(mx))


def test_pad_is_a_no_op_on_full_blocks():
    x = jnp.arange(64.0)
    a = lowprec.quantize_mx(x, "mxfp4", pad=True)
    b = lowprec.quantize_mx(x, "mxfp4")
    assert a.shape == b.shape == (64,)
    np.testing.assert_array_equal(np.asarray(a.elements), np.asarray(b.elements))


# -- dequantize ---------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", MX_FORMATS)
@pytest.mark.quick_first(1)
def test_dequantize_to_bfloat16_rounds_the_exact_value(fmt):
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((4, 64)) * np.exp2(rng.integers(-20, 20, (4, 1)))).astype(np.float32)
    mx = lowprec.quantize_mx(jnp.asarray(x), fmt)
    exact = f64_to_f32_exact(R.dequantize_mx(element_codes(mx), np.asarray(mx.scales), fmt))
    got = lowprec.dequantize(mx, jnp.bfloat16)
    assert got.dtype == jnp.bfloat16
    # MX element values x 2^(scale-127) in bf16's normal range are bf16 values (<= 3
    # mantissa bits): the cast is exact here.
    np.testing.assert_array_equal(np.asarray(got).astype(np.float32), exact)
    assert_bits_equal(got, exact.astype(ml_dtypes.bfloat16))


def test_dequantize_keeps_e5m2_infinite_elements():
    # OCP MX v1.0: value = X × P_i; with X = 2^(scale − 127) a finite power of two and P_i =
    # ±inf (E5M2 0x7C / 0xFC), the value is ±inf (as lowprec.decode(0x7C, "e5m2") is); only
    # X = NaN (scale 0xFF) or P_i = NaN (0x7D..0x7F) makes NaN. quantize_mx never emits these
    # codes, but MXArrays can be built from stored codes.
    codes = np.zeros(32, np.uint8)
    codes[:4] = [0x7C, 0xFC, 0x7D, 0x3C]  # +inf, -inf, NaN, 1.0
    for scale in (0, 127, 254):
        mx = lowprec.MXArray(jnp.asarray(codes), jnp.asarray([scale], jnp.uint8),
                             lowprec.mx_format("mxfp8_e5m2"), 0, (32,), None)
        want = f64_to_f32_exact(R.dequantize_mx(codes, np.array([scale], np.uint8),
                                                "mxfp8_e5m2"))
        assert want[0] == np.inf and want[1] == -np.inf and np.isnan(want[2])
        assert_same_floats(lowprec.dequantize(mx), want, f"scale {scale}")


def test_dequantize_rejects_non_mxarray_and_integer_dtype():
    with pytest.raises(TypeError, match="ndarray|Array"):
        lowprec.dequantize(np.zeros(32, np.uint8))
    mx = lowprec.quantize_mx(jnp.ones(32), "mxfp4")
    with pytest.raises(TypeError, match="int32"):
        lowprec.dequantize(mx, jnp.int32)


def test_mxarray_is_a_pytree():
    mx = lowprec.quantize_mx(jnp.ones((2, 64)), "mxfp8_e4m3")
    leaves, treedef = jax.tree_util.tree_flatten(mx)
    assert len(leaves) == 2
    back = jax.tree_util.tree_unflatten(treedef, leaves)
    assert back.fmt == mx.fmt and back.shape == mx.shape and back.axis == mx.axis
    assert mx.nbytes == 2 * 64 + 2 * 2


# -- fake quantization ---------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _jitted_fake(fmt, rule):
    return jax.jit(lambda v: lowprec.fake_quantize_mx(v, fmt, scale_rule=rule))


@pytest.mark.quick_cases(fmt=QUICK_MX)
@pytest.mark.parametrize("fmt", MX_FORMATS)
@pytest.mark.quick_first(1)
def test_fake_quantize_equals_dequantize_of_quantize(fmt):
    rng = np.random.default_rng(3)
    x = jnp.asarray((rng.standard_normal((3, 64)) * 5).astype(np.float32))
    want = np.asarray(lowprec.dequantize(lowprec.quantize_mx(x, fmt, scale_rule="rceil")))
    assert_same_floats(lowprec.fake_quantize_mx(x, fmt, scale_rule="rceil"), want, "eager")
    assert_same_floats(_jitted_fake(fmt, "rceil")(x), want, "jit")
    # vmap over rows (each row quantized on its own) == quantizing the batch along axis -1.
    vm = jax.vmap(lambda r: lowprec.fake_quantize_mx(r, fmt, scale_rule="rceil"))(x)
    assert_same_floats(vm, want, "vmap")


@pytest.mark.quick_cases(fmt=QUICK_MX)
@pytest.mark.parametrize("fmt", MX_FORMATS)
@pytest.mark.quick_first(1)
def test_fake_quantize_gradient_is_straight_through(fmt):
    x = jnp.linspace(-500.0, 700.0, 64).reshape(2, 32)  # includes clipped values under floor
    g = jax.grad(lambda v: (lowprec.fake_quantize_mx(v, fmt) * 3.0).sum())(x)
    np.testing.assert_array_equal(np.asarray(g), np.full(x.shape, 3.0, np.float32))
    g = jax.jit(jax.grad(lambda v: lowprec.fake_quantize_mx(v, fmt, axis=0).sum()))(x.T)
    np.testing.assert_array_equal(np.asarray(g), np.ones(x.T.shape, np.float32))
    # Stochastic too (the key is not differentiated).
    key = jax.random.key(0)
    g = jax.grad(lambda v: lowprec.fake_quantize_mx(v, fmt, rounding="stochastic", key=key).sum())(x)
    np.testing.assert_array_equal(np.asarray(g), np.ones(x.shape, np.float32))


@pytest.mark.quick_cases(fmt=QUICK_MX)
@pytest.mark.parametrize("fmt", MX_FORMATS)
@pytest.mark.quick_first(1)
def test_fake_quantize_bfloat16_in_bfloat16_out(fmt):
    rng = np.random.default_rng(4)
    x = jnp.asarray((rng.standard_normal((2, 64)) * 9).astype(np.float32)).astype(jnp.bfloat16)
    y = lowprec.fake_quantize_mx(x, fmt)
    assert y.dtype == jnp.bfloat16 and y.shape == x.shape
    # Same values as the float32 path (exact in bf16 for these magnitudes).
    want = np.asarray(lowprec.dequantize(lowprec.quantize_mx(x.astype(jnp.float32), fmt)))
    np.testing.assert_array_equal(np.asarray(y).astype(np.float32), want)
    g = jax.grad(lambda v: lowprec.fake_quantize_mx(v, fmt).astype(jnp.float32).sum())(x)
    assert g.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(g).astype(np.float32), np.ones(x.shape, np.float32))


# -- gpt-oss / Hugging Face MXFP4 layout ----------------------------------------------------------

# The published decoder (docs/design.md §4): value = FP4_VALUES[nibble] * 2^(scale - 127), low
# nibble first.
FP4_VALUES = [+0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
              -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def tiny_gpt_oss_decode(blocks, scales):
    blocks = np.asarray(blocks)
    scales = np.asarray(scales).astype(np.int64)
    lut = np.array(FP4_VALUES, np.float64)
    out = np.empty(blocks.shape[:-1] + (32,), np.float64)
    out[..., 0::2] = lut[blocks & 0x0F]
    out[..., 1::2] = lut[blocks >> 4]
    out = out * np.exp2(scales - 127)[..., None]
    return out.reshape(*blocks.shape[:-2], blocks.shape[-2] * 32)


@pytest.mark.parametrize("rule", SCALE_RULES)
@pytest.mark.quick_first(1)
def test_gpt_oss_export_decodes_to_dequantize(rule):
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((2, 3, 96)) * np.exp2(rng.integers(-30, 30, (2, 3, 1)))).astype(
        np.float32)
    mx = lowprec.quantize_mx(jnp.asarray(x), "mxfp4", scale_rule=rule)
    blocks, scales = lowprec.to_gpt_oss(mx)
    assert blocks.shape == (2, 3, 3, 16) and blocks.dtype == jnp.uint8
    assert scales.shape == (2, 3, 3) and scales.dtype == jnp.uint8
    want = np.asarray(lowprec.dequantize(mx))
    assert_same_floats(f64_to_f32_exact(tiny_gpt_oss_decode(blocks, scales)), want, "tiny")
    assert_same_floats(
        f64_to_f32_exact(R.decode_gpt_oss(np.asarray(blocks), np.asarray(scales))), want, "ref")


def test_gpt_oss_hand_example():
    # Block: 1, -0.5, 6, 0, then zeros; floor(log2 6) - 2 = 0 -> scale 127. Codes 0x2, 0x9,
    # 0x7, 0x0 -> bytes (low nibble = even element): 0x92, 0x07, then 0x00.
    mx = lowprec.quantize_mx(jnp.asarray(block([1.0, -0.5, 6.0, 0.0])[None]), "mxfp4")
    blocks, scales = lowprec.to_gpt_oss(mx)
    assert np.asarray(blocks).tolist() == [[[0x92, 0x07] + [0] * 14]]
    assert np.asarray(scales).tolist() == [[127]]


def test_from_gpt_oss_round_trip():
    rng = np.random.default_rng(6)
    x = (rng.standard_normal((4, 128)) * 100).astype(np.float32)
    mx = lowprec.quantize_mx(jnp.asarray(x), "mxfp4", scale_rule="rceil")
    back = lowprec.from_gpt_oss(*lowprec.to_gpt_oss(mx))
    assert back.shape == mx.shape and back.axis == 1 and back.fmt == mx.fmt
    np.testing.assert_array_equal(np.asarray(back.elements), np.asarray(mx.elements))
    np.testing.assert_array_equal(np.asarray(back.scales), np.asarray(mx.scales))
    assert_same_floats(lowprec.dequantize(back), lowprec.dequantize(mx), "round trip")
    # And from arbitrary bytes: every nibble and scale decodes by the published rule.
    blocks = rng.integers(0, 256, (3, 2, 16), dtype=np.uint8)
    scales = rng.integers(100, 150, (3, 2), dtype=np.uint8)
    v = lowprec.dequantize(lowprec.from_gpt_oss(blocks, scales))
    assert v.shape == (3, 64)
    assert_same_floats(v, f64_to_f32_exact(tiny_gpt_oss_decode(blocks, scales)), "bytes")
    b2, s2 = lowprec.to_gpt_oss(lowprec.from_gpt_oss(blocks, scales))
    np.testing.assert_array_equal(np.asarray(b2), blocks)
    np.testing.assert_array_equal(np.asarray(s2), scales)


def test_gpt_oss_errors():
    x = jnp.ones((64, 64))
    with pytest.raises(ValueError, match="mxfp8_e4m3"):
        lowprec.to_gpt_oss(lowprec.quantize_mx(x, "mxfp8_e4m3"))
    with pytest.raises(ValueError, match="axis"):
        lowprec.to_gpt_oss(lowprec.quantize_mx(x, "mxfp4", axis=0))
    with pytest.raises(ValueError, match="multiple of 32"):
        lowprec.to_gpt_oss(lowprec.quantize_mx(jnp.ones((2, 40)), "mxfp4", pad=True))
    with pytest.raises(ValueError, match="16"):
        lowprec.from_gpt_oss(np.zeros((2, 8), np.uint8), np.zeros((2,), np.uint8))
    with pytest.raises(TypeError, match="uint8"):
        lowprec.from_gpt_oss(np.zeros((2, 16), np.int32), np.zeros((2,), np.uint8))


# -- argument errors ----------------------------------------------------------------------------


def test_unknown_names_are_named_in_the_error():
    x = jnp.ones(32)
    with pytest.raises(ValueError, match="mxfp5"):
        lowprec.quantize_mx(x, "mxfp5")
    with pytest.raises(ValueError, match="'round'"):
        lowprec.quantize_mx(x, "mxfp4", scale_rule="round")
    with pytest.raises(ValueError, match="'banker'"):
        lowprec.quantize_mx(x, "mxfp8_e4m3", rounding="banker")
    with pytest.raises(ValueError, match="'floor'"):  # an E8M0-only mode, not an element one
        lowprec.quantize_mx(x, "mxfp8_e5m2", rounding="floor")
    for fn in (lowprec.quantize_mx, lowprec.fake_quantize_mx):
        with pytest.raises(ValueError, match="'round'"):
            fn(x, "mxfp4", scale_rule="round")
        with pytest.raises(ValueError, match="mxfp5"):
            fn(x, "mxfp5")


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.uint8, jnp.bool_])
def test_integer_input_is_rejected(dtype):
    x = jnp.ones(32, dtype)
    name = jnp.dtype(dtype).name
    with pytest.raises(TypeError, match=name):
        lowprec.quantize_mx(x, "mxfp8_e4m3")
    with pytest.raises(TypeError, match=name):
        lowprec.fake_quantize_mx(x, "mxfp4")


def test_stochastic_needs_a_key_and_other_modes_refuse_one():
    x = jnp.ones(32)
    with pytest.raises(ValueError, match="key"):
        lowprec.quantize_mx(x, "mxfp4", rounding="stochastic")
    with pytest.raises(ValueError, match="key"):
        lowprec.fake_quantize_mx(x, "mxfp4", rounding="stochastic")
    with pytest.raises(ValueError, match="key"):
        lowprec.quantize_mx(x, "mxfp4", key=jax.random.key(0))


@pytest.mark.parametrize("key,what", [
    (0, "int 0"), (jnp.uint32(3), "uint32 array of shape ()"),
    (jnp.ones(3, jnp.uint32), "uint32 array of shape (3,)"),
    (jax.random.split(jax.random.key(0)), "key<fry> array of shape (2,)"),
])
def test_a_key_that_is_no_prng_key_is_refused_naming_it(key, what):
    """key=0 used to reach JAX's internals ("invalid PRNG key data: expected key_data.ndim
    >= 1"); every entry point now names what it got and what a key is."""
    x = jnp.ones(32)
    phrase = rf"key must be one PRNG key \(jax.random.key\(seed\).*\), got {re.escape(what)}"
    for call in (lambda: lowprec.quantize(x, "e4m3", rounding="stochastic", key=key),
                 lambda: lowprec.encode(x, "e4m3", rounding="stochastic", key=key),
                 lambda: lowprec.quantize_mx(x, "mxfp4", rounding="stochastic", key=key),
                 lambda: lowprec.fake_quantize_mx(x, "nvfp4", rounding="stochastic", key=key)):
        with pytest.raises(TypeError, match=phrase):
            call()


def test_legacy_prng_keys_are_accepted_as_typed_ones():
    x = jnp.linspace(-1.0, 1.0, 64)
    new = lowprec.quantize_mx(x, "mxfp4", rounding="stochastic", key=jax.random.key(7))
    old = lowprec.quantize_mx(x, "mxfp4", rounding="stochastic", key=jax.random.PRNGKey(7))
    np.testing.assert_array_equal(np.asarray(new.elements), np.asarray(old.elements))


@pytest.mark.parametrize("fmt", ["mxfp8_e4m3", "mxfp6_e2m3", "mxfp4", "mxint8", "nvfp4"])
@pytest.mark.quick_first(2)
def test_zero_size_arrays_give_empty_results(fmt):
    """An empty array has no blocks: empty codes and scales of the shapes the format's packing
    gives (NumPy's "zero-size array to reduction operation" used to escape instead), an
    empty dequantized and fake-quantized array, and NVFP4's tensor scale for amax 0 (1.0:
    its recipe's scale of an all-zero tensor), eager and under jit."""
    f = lowprec.mx_format(fmt)
    for shape, axis in [((0,), -1), ((0, 64), -1), ((4, 0), -1), ((2, 0, 32), 1)]:
        x = jnp.zeros(shape, jnp.bfloat16)
        ax = axis % len(shape)
        n = shape[ax]
        want_el = shape[:ax] + (n * f.element.code_bits // 8,) + shape[ax + 1:]
        want_sc = shape[:ax] + (n // f.block_size,) + shape[ax + 1:]
        for mx in (lowprec.quantize_mx(x, fmt, axis=axis),
                   jax.jit(lambda v: lowprec.quantize_mx(v, fmt, axis=axis))(x)):
            assert (mx.elements.shape, mx.scales.shape, mx.shape) == (want_el, want_sc, shape)
            assert mx.elements.dtype == mx.scales.dtype == jnp.uint8  # MXArray's code dtype
            if f.tensor_scale:
                assert float(mx.tensor_scale) == R.nvfp4_tensor_scale(np.zeros(shape, np.float32)) == 1.0
            back = lowprec.dequantize(mx, jnp.float16)
            assert (back.shape, back.dtype) == (shape, jnp.float16)
        fake = lowprec.fake_quantize_mx(x, fmt, axis=axis)
        assert (fake.shape, fake.dtype) == (shape, jnp.bfloat16)
        if f.scheme.exponent_scales:
            assert lowprec.shared_exponents(x, fmt, axis=axis).shape == want_sc


def test_bad_axis_and_rank():
    with pytest.raises(ValueError, match="axis 2"):
        lowprec.quantize_mx(jnp.ones((2, 32)), "mxfp4", axis=2)
    with pytest.raises(ValueError, match="1-D"):
        lowprec.quantize_mx(jnp.float32(1.0), "mxfp4")


def test_aliases_and_defaults():
    x = jnp.linspace(-3.0, 3.0, 64)
    a = lowprec.quantize_mx(x, "mxfp8")
    b = lowprec.quantize_mx(x, "mxfp8_e4m3", scale_rule="floor")
    assert a.fmt == b.fmt and a.scale_rule == "floor" == lowprec.ScaleRule.FLOOR
    np.testing.assert_array_equal(np.asarray(a.elements), np.asarray(b.elements))
    assert {r.value for r in lowprec.ScaleRule} == set(SCALE_RULES)
    assert set(ROUNDINGS) <= set(lowprec.Rounding)


@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8_e4m3", "mxfp6_e2m3", "nvfp4"])
@pytest.mark.parametrize("path", ["eager", "jit"])
@pytest.mark.quick_cases(fmt=["mxfp4", "nvfp4"], path=["jit"])
def test_transpose_moves_codes_scales_and_block_axis_as_the_values(fmt, path):
    # A [batch, seq, d] array blocked along d; the transposed MXArray must hold exactly the
    # transposed values (dequantize commutes with transpose) and be the quantization of the
    # transposed float array blocked along the axis d moved to (same blocks, same codes).
    x = jax.random.normal(jax.random.key(3), (2, 3, 64), jnp.float32) * 7
    mx = lowprec.quantize_mx(x, fmt, axis=2)
    axes = (2, 0, 1)
    op = (lambda m: m.transpose(axes)) if path == "eager" else jax.jit(lambda m: m.transpose(axes))
    t = op(mx)
    assert (t.shape, t.axis) == ((64, 2, 3), 0)
    assert_bits_equal(lowprec.dequantize(t), jnp.transpose(lowprec.dequantize(mx), axes))
    again = lowprec.quantize_mx(jnp.transpose(x, axes), fmt, axis=0)
    assert_bits_equal(lowprec.dequantize(t), lowprec.dequantize(again))


def test_transpose_refuses_what_is_not_a_permutation():
    mx = lowprec.quantize_mx(jnp.ones((2, 64)), "mxfp4", axis=1)
    with pytest.raises(ValueError, match=r"not a permutation of range\(2\)"):
        mx.transpose((1, 1))
    with pytest.raises(ValueError, match="axes"):
        mx.transpose((0, 2))
