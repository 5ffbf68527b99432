"""Tests of the independent reference (lowprec_reference) against ml_dtypes, JAX and hand values.

The reference is the oracle for lowprec's own tests, so it is checked here against third
parties (ml_dtypes ``astype``, ``lax.reduce_precision``, JAX's MX scale rule) and against values
derived by hand from the specs. None of these tests touches lowprec itself.
"""

from __future__ import annotations

import dataclasses
import doctest
import math
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest

import lowprec_formats
import lowprec_reference as ref
import lowprec_reference.element
import lowprec_reference.mx
from helpers.asserts import assert_bits_equal, assert_codes_equal, bit_pattern
from helpers.oracles import ml_dtype, ml_dtypes_codes
from helpers.tiers import QUICK_ELEMENTS, QUICK_MX

WITH_ML = lowprec_formats.COLLECTIONS["with_ml_dtypes"]
# The quick tier's formats (pytest -m "not slow"): one per code path of the reference's
# encoder and decoder (the default run checks every format). The exhaustive decode leaves
# out the 2^16-code formats, whose decoding test_codec.py runs quick against this reference.
QUICK_WITH_ML = tuple(f for f in QUICK_ELEMENTS if f in WITH_ML)
QUICK_DECODE = tuple(f for f in QUICK_WITH_ML if f not in ("fp16", "bf16"))
ALL = lowprec_formats.COLLECTIONS["all_elements"]
F32 = np.float32


def f32(*values) -> np.ndarray:
    return np.array(values, np.float64).astype(np.float32)


def assert_same_codes(fmt: str, got: np.ndarray, want: np.ndarray, x: np.ndarray) -> None:
    """Bits equal, except that NaN outputs only need to be NaN on both sides."""
    nan = (np.isnan(ref.decode(fmt, got)), np.isnan(ref.decode(fmt, want)))
    assert_codes_equal(got, want, x, fmt, nan=nan)


def neighbours(x: np.ndarray, steps: int = 2) -> np.ndarray:
    """x together with its float32 neighbours up to ``steps`` ulps away on either side."""
    x = x.astype(np.float32)
    out = [x]
    up, down = x, x
    for _ in range(steps):
        with np.errstate(over="ignore"):
            up = np.nextafter(up, F32(np.inf))
            down = np.nextafter(down, F32(-np.inf))
        out += [up, down]
    return np.concatenate(out)


def adversarial_f32(fmt: str, rng: np.random.Generator, max_codes: int = 600) -> np.ndarray:
    """Every (or a sample of the) grid values of ``fmt``, all midpoints, their float32
    neighbours, both signs, the overflow boundary, and float32 specials."""
    codes = ref.all_codes(fmt).astype(np.int64)
    mags = codes[codes < (1 << (lowprec_reference.element._fmt(fmt).magnitude_bits))]
    if len(mags) > max_codes:
        mags = np.unique(np.concatenate([mags[:64], mags[-64:], rng.choice(mags, max_codes)]))
    vals = sorted({ref.value_of_code(fmt, int(c)) for c in mags} - {math.inf} - {math.nan},
                  key=lambda v: (isinstance(v, float), v))
    vals = [v for v in vals if isinstance(v, Fraction)]
    top = ref.max_finite(fmt)
    # Extended-grid points just past max: next grid value and the tie with it.
    f = lowprec_reference.element._fmt(fmt)
    spacing = Fraction(2) ** (math.floor(math.log2(top)) - f.mantissa_bits)
    extra = [top + spacing / 2, top + spacing, top * 2, top * 4]
    mids = [(a + b) / 2 for a, b in zip(vals, vals[1:])]
    pts = np.array([float(v) for v in vals + mids + extra if float(v) < 3.4e38], np.float64)
    pts = pts.astype(np.float32)
    specials = f32(0.0, np.inf, np.nan, 2.0**-149, 2.0**-127, 2.0**-126, 3.4028234663852886e38,
                   1.5, 3.0, 0.75, 1e-30, 1e30)
    x = neighbours(np.concatenate([pts, specials]))
    return np.concatenate([x, -x])


def random_f32(rng: np.random.Generator, n: int) -> np.ndarray:
    bits = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    return bits.view(np.float32)


# ---------------------------------------------------------------------------------------------
# Format facts and decoding.


def test_layouts_derived_from_data():
    facts = {  # name: (code bits, max finite)
        "fp16": (16, Fraction(65504)),
        "bf16": (16, (2 - Fraction(1, 2**7)) * 2**127),
        "tf32": (19, (2 - Fraction(1, 2**10)) * 2**127),
        "e4m3": (8, Fraction(448)),
        "e5m2": (8, Fraction(57344)),
        "e2m1": (4, Fraction(6)),
        "e8m0": (8, Fraction(2) ** 127),
    }
    for name, (bits, top) in facts.items():
        assert len(ref.all_codes(name)) == 2**bits
        assert ref.max_finite(name) == top
    assert ref.value_of_code("e4m3", 0b0_1111_110) == 448
    assert math.isnan(ref.value_of_code("e4m3", 0b0_1111_111))
    assert math.isnan(ref.value_of_code("e4m3", 0b1_1111_111))
    assert ref.value_of_code("e4m3", 0b0_1111_000) == 256  # all-ones exponent is normal
    assert ref.value_of_code("e5m2", 0x7B) == 57344 and ref.value_of_code("e5m2", 0x7C) == math.inf
    assert [ref.value_of_code("e2m1", c) for c in range(8)] == [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    assert [ref.value_of_code("e2m1", c) for c in range(8, 16)] == [0, -0.5, -1, -1.5, -2, -3, -4, -6]
    # Smallest subnormals: 2^(1 - bias - mantissa_bits).
    for name, e in {"fp16": -24, "bf16": -133, "tf32": -136, "e4m3": -9, "e5m2": -16, "e2m1": -1}.items():
        assert ref.value_of_code(name, 1) == Fraction(2) ** e
    for c in range(255):
        assert ref.value_of_code("e8m0", c) == Fraction(2) ** (c - 127)
    assert math.isnan(ref.value_of_code("e8m0", 255))
    assert ref.code_dtype("fp16") == np.uint16 and ref.code_dtype("tf32") == np.uint32
    assert ref.code_dtype("e2m1") == np.uint8
    # Aliases.
    assert ref.value_of_code("float8_e4m3fn", 0x7E) == 448
    assert ref.max_finite("ue8m0") == 2**127


def test_nan_codes_from_data_are_nan():
    for name in ALL:
        code = lowprec_formats.ELEMENT_FORMATS[name]["nan_code"]
        if code is not None:
            assert math.isnan(ref.value_of_code(name, int(code, 16)))


@pytest.mark.quick_cases(fmt=QUICK_DECODE)
@pytest.mark.parametrize("fmt", WITH_ML)
def test_decode_all_codes_matches_ml_dtypes(fmt):
    codes = ref.all_codes(fmt)
    got = ref.decode(fmt, codes)
    with np.errstate(invalid="ignore"):
        want = codes.view(ml_dtype(fmt)).astype(np.float64)
    assert got.dtype == np.float64
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got[~nan], want[~nan])
    np.testing.assert_array_equal(np.signbit(got[~nan]), np.signbit(want[~nan]))


def test_decode_tf32_is_top_19_bits_of_float32():
    rng = np.random.default_rng(0)
    codes = np.unique(np.concatenate([
        rng.integers(0, 2**19, 20000), np.arange(0, 2**19, 2**19 // 512), [0x3FC00, 0x7FC00, 0x3FBFF],
    ])).astype(np.uint32)
    got = ref.decode("tf32", codes)
    with np.errstate(invalid="ignore"):
        want = (codes << np.uint32(13)).view(np.float32).astype(np.float64)
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got[~nan], want[~nan])
    np.testing.assert_array_equal(np.signbit(got[~nan]), np.signbit(want[~nan]))


def test_negative_zero():
    assert ref.is_negative_code("fp16", 0x8000) and ref.value_of_code("fp16", 0x8000) == 0
    assert not ref.is_negative_code("fp16", 0)
    assert np.signbit(ref.decode("e2m1", np.array([8], np.uint8)))[0]
    assert not ref.is_negative_code("e8m0", 0xFF)


# ---------------------------------------------------------------------------------------------
# Default encode against ml_dtypes.


@pytest.mark.quick_cases(fmt=QUICK_WITH_ML)
@pytest.mark.parametrize("fmt", WITH_ML)
def test_encode_default_matches_ml_dtypes_adversarial(fmt):
    rng = np.random.default_rng(1)
    x = adversarial_f32(fmt, rng, max_codes=500)
    got = ref.encode(fmt, x)
    assert got.dtype == ref.code_dtype(fmt) and got.shape == x.shape
    assert_same_codes(fmt, got, ml_dtypes_codes(fmt, x), x)


@pytest.mark.quick_cases(fmt=QUICK_WITH_ML)
@pytest.mark.parametrize("fmt", WITH_ML)
def test_encode_default_matches_ml_dtypes_random(fmt):
    rng = np.random.default_rng(2)
    top = float(ref.max_finite(fmt))
    tiny = float(ref.value_of_code(fmt, 1))
    log_lo, log_hi = math.log2(tiny) - 3, min(math.log2(top) + 2, 127.9)
    in_range = (2.0 ** rng.uniform(log_lo, log_hi, 2000)) * rng.choice([-1, 1], 2000)
    x = np.concatenate([random_f32(rng, 1500), in_range.astype(np.float32)]).reshape(50, -1)
    assert_same_codes(fmt, ref.encode(fmt, x), ml_dtypes_codes(fmt, x), x)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "e2m1", "fp16"])
def test_encode_from_bfloat16_and_float16_inputs(fmt):
    rng = np.random.default_rng(3)
    x32 = (rng.standard_normal(1000) * 8).astype(np.float32)
    for dt in (ml_dtypes.bfloat16, np.float16):
        x = x32.astype(dt)
        x_exact = x.astype(np.float32)  # exact widening
        np.testing.assert_array_equal(ref.encode(fmt, x), ref.encode(fmt, x_exact))
        assert_same_codes(fmt, ref.encode(fmt, x), ml_dtypes_codes(fmt, x_exact), x_exact)


def test_e8m0_lowest_binade_follows_ml_dtypes_quirk():
    # ml_dtypes (and XLA) send every float32 strictly inside (2^-127, 2^-126) to 2^-126.
    bits = np.arange((1 << 22) + 1, 1 << 23, 997, dtype=np.uint32)
    x = bits.view(np.float32)
    assert (ml_dtypes_codes("e8m0", x) == 1).all()
    assert (ref.encode("e8m0", x) == 1).all()
    assert (ref.encode("e8m0", x, rounding="nearest_away") == 1).all()
    # Correct rounding elsewhere: 1.1 * 2^-127 is nearer to 2^-127 (code 0).
    y = f32(1.1 * 2.0**-127)
    assert ref.encode("e8m0", y, overflow="saturate").tolist() == [0]
    assert ref.encode("e8m0", y, rounding="down").tolist() == [0]
    assert ref.encode("e8m0", y, rounding="up").tolist() == [1]
    assert ref.encode("e8m0", f32(1.6 * 2.0**-127), overflow="saturate").tolist() == [1]


# ---------------------------------------------------------------------------------------------
# Hand-derived values.


def test_hand_values_default_mode():
    e = ref.encode
    # e4m3: spacing 32 in [256, 512); 464 is the tie 448|480 -> even mantissa 110 = 448.
    assert e("e4m3", f32(464, 465, -465, 480, np.inf, -np.inf, 1e30)).tolist() == [
        0x7E, 0x7F, 0xFF, 0x7F, 0x7F, 0xFF, 0x7F]
    # e5m2: spacing 8192 in [32768, 65536); 61440 ties 57344|65536 -> even -> overflow -> inf.
    assert e("e5m2", f32(61440, 61439, -61440, np.inf)).tolist() == [0x7C, 0x7B, 0xFC, 0x7C]
    # e2m1: 5 ties 4|6 -> 4 (even mantissa); 7 ties 6|8 -> 8 overflows -> saturates to 6.
    assert e("e2m1", f32(5, 7, 100, -np.inf, 0.25, 0.26, 0.75, 1.25, 2.5)).tolist() == [
        0x6, 0x7, 0x7, 0xF, 0x0, 0x1, 0x2, 0x2, 0x4]
    assert e("e2m1", f32(np.nan, -np.nan)).tolist() == [0b1000, 0b0000]  # as ml_dtypes
    # e8m0: ties go up (3 -> 4, 0.75 -> 1, 6 -> 8); tiny -> 2^-127; 0/neg/NaN/inf -> 0xFF.
    assert e("e8m0", f32(3, 0.75, 6, 1.5 * 2.0**127, 2.0**-130, 2.0**-149, 0, -0.0, -1,
                          np.nan, np.inf)).tolist() == [
        129, 127, 130, 0xFF, 0x00, 0x00, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF]
    assert e("e8m0", f32(3), rounding="nearest_away").tolist() == [129]
    # fp16: 65520 ties 65504|65536 -> inf; subnormal tie 2^-25 -> 0 (even), 3*2^-25 -> 2*2^-24.
    assert e("fp16", f32(65520, 65519, 2.0**-25, 3 * 2.0**-25, -(2.0**-26))).tolist() == [
        0x7C00, 0x7BFF, 0x0000, 0x0002, 0x8000]
    # Signed zeros and signs of underflow.
    assert e("e4m3", f32(-0.0, 0.0, -(2.0**-20))).tolist() == [0x80, 0x00, 0x80]
    # NaN keeps its sign bit where the format has a signed NaN code.
    assert e("e4m3", f32(np.nan, -np.nan)).tolist() == [0x7F, 0xFF]
    assert e("tf32", f32(np.nan)).tolist() == [0x3FE00]


def test_tf32_is_float32_rounded_to_10_bits():
    rng = np.random.default_rng(4)
    b = rng.integers(0, 2**32, 6000, dtype=np.uint64).astype(np.uint32)
    ties = (b & ~np.uint32(0x1FFF)) | np.uint32(0x1000)
    b = np.concatenate([b, ties, np.array([0x7F7FF000, 0x7F7FEFFF, 0x00001000, 0x00003000],
                                           np.uint32)])
    x = b.view(np.float32)
    got = ref.encode("tf32", x)
    assert got.dtype == np.uint32
    finite = np.isfinite(x)
    wide = b.astype(np.uint64)
    rne = (wide + 0xFFF + ((wide >> 13) & 1)) >> 13  # carries into inf exactly like IEEE RNE
    np.testing.assert_array_equal(got[finite], rne[finite])
    np.testing.assert_array_equal(got[np.isinf(x)], wide[np.isinf(x)] >> 13)
    assert np.isnan(ref.decode("tf32", got[np.isnan(x)])).all()
    # And against XLA's reduce_precision(x, exponent_bits=8, mantissa_bits=10).
    jax = pytest.importorskip("jax")
    y = bit_pattern(jax.lax.reduce_precision(jax.numpy.asarray(x), 8, 10)) >> 13
    np.testing.assert_array_equal(got[finite], y[finite])


def test_directed_modes_hand_values():
    e = ref.encode
    x = f32(1.0625, -1.0625, 1.1875, 1.125, -1.125)  # e4m3 spacing 0.125 in [1, 2)
    assert e("e4m3", x, "nearest_even").tolist() == [0x38, 0xB8, 0x3A, 0x39, 0xB9]
    assert e("e4m3", x, "nearest_away").tolist() == [0x39, 0xB9, 0x3A, 0x39, 0xB9]
    assert e("e4m3", x, "toward_zero").tolist() == [0x38, 0xB8, 0x39, 0x39, 0xB9]
    assert e("e4m3", x, "up").tolist() == [0x39, 0xB8, 0x3A, 0x39, 0xB9]
    assert e("e4m3", x, "down").tolist() == [0x38, 0xB9, 0x39, 0x39, 0xB9]
    # IEEE 754 §7.4 overflow in each mode (e4m3 overflow value = NaN, sign kept).
    big = f32(1000, -1000, 449, -449)
    assert e("e4m3", big, "toward_zero").tolist() == [0x7E, 0xFE, 0x7E, 0xFE]
    assert e("e4m3", big, "up").tolist() == [0x7F, 0xFE, 0x7F, 0xFE]
    assert e("e4m3", big, "down").tolist() == [0x7E, 0xFF, 0x7E, 0xFF]
    assert e("e4m3", big, "nearest_away").tolist() == [0x7F, 0xFF, 0x7E, 0xFE]
    assert e("e5m2", f32(1e6, -1e6), "up").tolist() == [0x7C, 0xFB]
    assert e("e5m2", f32(1e6, -1e6), "down").tolist() == [0x7B, 0xFC]
    assert e("fp16", f32(1e6), "toward_zero").tolist() == [0x7BFF]
    # ±inf inputs are exact: unaffected by the rounding direction.
    for mode in ("toward_zero", "up", "down"):
        assert e("e5m2", f32(np.inf, -np.inf), mode).tolist() == [0x7C, 0xFC]
        assert e("e4m3", f32(np.inf, -np.inf), mode).tolist() == [0x7F, 0xFF]
        assert e("e2m1", f32(np.inf, -np.inf), mode).tolist() == [0x7, 0xF]
    # Underflow keeps the sign; 'up' of a tiny positive gives the smallest subnormal.
    assert e("e4m3", f32(1e-6, -1e-6), "up").tolist() == [0x01, 0x80]
    assert e("e4m3", f32(1e-6, -1e-6), "down").tolist() == [0x00, 0x81]
    # e8m0 floor / ceil (MX scale rules) = down / up.
    x = f32(3, 2, 0.75, 2.0**-130, 1.5 * 2.0**127)
    assert e("e8m0", x, "floor").tolist() == [128, 128, 126, 0, 254]
    assert e("e8m0", x, "ceil").tolist() == [129, 128, 127, 0, 0xFF]
    assert e("e8m0", x, "ceil", overflow="saturate").tolist() == [129, 128, 127, 0, 254]
    assert e("e8m0", np.array([1e39]), "toward_zero").tolist() == [254]
    assert e("e8m0", f32(np.inf), "down").tolist() == [0xFF]


def test_saturate_policy():
    e = ref.encode
    for mode in ("nearest_even", "nearest_away", "toward_zero", "up", "down"):
        assert e("e4m3", f32(1000, -np.inf, np.nan), mode, "saturate").tolist()[:2] == [0x7E, 0xFE]
        assert e("e5m2", f32(61440, -np.inf), mode, "saturate").tolist() == [0x7B, 0xFB]
        assert e("fp16", f32(np.inf, -1e9), mode, "saturate").tolist() == [0x7BFF, 0xFBFF]
        assert e("e8m0", f32(np.inf, 2.0**127 * 1.9, -np.inf, 0), mode, "saturate").tolist() == [
            0xFE, 0xFE, 0xFF, 0xFF]
    assert np.isnan(ref.decode("e4m3", e("e4m3", f32(np.nan), overflow="saturate")))[0]
    assert e("e2m1", f32(np.nan, 7), overflow="saturate").tolist() == [0b1000, 0x7]


def test_float64_rounds_once():
    # 1.0625 + 2^-40 is just above the e4m3 tie 1|1.125, so it rounds up; through float32
    # it would first become the tie 1.0625 and then round to even (1.0).
    x = np.array([1.0625 + 2.0**-40])
    assert ref.encode("e4m3", x).tolist() == [0x39]
    assert ref.encode("e4m3", x.astype(np.float32)).tolist() == [0x38]
    assert ref.encode("bf16", np.array([1.0 + 2.0**-8 + 2.0**-40])).tolist() == [0x3F81]


def test_stochastic_rounding_edges():
    e = ref.encode

    def sr(fmt, values, words, overflow="ieee"):
        x = f32(*values)
        r = np.array(words, np.uint32)
        return e(fmt, x, "stochastic", overflow, random_bits=r).tolist()

    # 1.0625 lies halfway between 1 (0x38) and 1.125 (0x39): up iff r < 2^31.
    assert sr("e4m3", [1.0625] * 4, [0, 2**31 - 1, 2**31, 2**32 - 1]) == [0x39, 0x39, 0x38, 0x38]
    assert sr("e4m3", [-1.0625] * 2, [0, 2**32 - 1]) == [0xB9, 0xB8]
    # frac = 1/4: up iff r < 2^30.
    assert sr("e4m3", [1.03125] * 2, [2**30 - 1, 2**30]) == [0x39, 0x38]
    # Exactly representable values never move.
    assert sr("e4m3", [1.0, 448.0, 0.0, -0.0], [0, 0, 0, 0]) == [0x38, 0x7E, 0x00, 0x80]
    assert sr("e4m3", [1.0, 448.0], [2**32 - 1] * 2) == [0x38, 0x7E]
    # r = 2^32-1 rounds up only if frac > 1 - 2^-32 (impossible for these grids): down.
    assert sr("e5m2", [1.2, 3.1], [2**32 - 1] * 2) == [0x3C, 0x42]  # 1.0, 3.0
    # Overflow after stochastic rounding: as for the nearest modes.
    assert sr("e4m3", [460.0, 460.0], [0, 2**32 - 1]) == [0x7F, 0x7E]
    assert sr("e4m3", [460.0], [0], "saturate") == [0x7E]
    assert sr("e5m2", [60000.0], [0]) == [0x7C]
    assert sr("e2m1", [6.5], [0]) == [0x7]
    # e8m0: 3 = 2 + 1/2 of the way to 4.
    assert sr("e8m0", [3.0, 3.0, 2.0**-130], [2**31 - 1, 2**31, 0]) == [129, 128, 0]


def test_stochastic_rounding_probability_is_exact():
    # With r over an even lattice of 2^12 words, the number rounding up is ceil(frac * 2^12).
    x = np.full(4096, 1.0 + 0.125 / 3, np.float64)  # frac = 1/3 of the e4m3 spacing
    r = (np.arange(4096, dtype=np.uint64) << np.uint64(20)).astype(np.uint32)
    codes = ref.encode("e4m3", x, "stochastic", random_bits=r)
    assert int((codes == 0x39).sum()) == math.ceil(4096 / 3)
    assert set(codes.tolist()) == {0x38, 0x39}


def test_errors_name_the_bad_value():
    x = f32(1.0)
    with pytest.raises(ValueError, match=r"'e3m9'.*e4m3"):
        ref.encode("e3m9", x)
    with pytest.raises(ValueError, match="mxfp4"):
        ref.encode("mxfp4", x)
    with pytest.raises(ValueError, match=r"'nearest'.*nearest_even"):
        ref.encode("e4m3", x, rounding="nearest")
    with pytest.raises(ValueError, match="'floor'"):
        ref.encode("e4m3", x, rounding="floor")
    with pytest.raises(ValueError, match=r"'clip'.*saturate"):
        ref.encode("e4m3", x, overflow="clip")
    with pytest.raises(ValueError, match="random_bits"):
        ref.encode("e4m3", x, rounding="stochastic")
    with pytest.raises(TypeError, match="uint32"):
        ref.encode("e4m3", x, "stochastic", random_bits=np.zeros(1, np.int64))
    with pytest.raises(ValueError, match="shape"):
        ref.encode("e4m3", x, "stochastic", random_bits=np.zeros(2, np.uint32))
    with pytest.raises(TypeError, match="int64"):
        ref.encode("e4m3", np.array([1, 2]))
    with pytest.raises(TypeError, match="complex64"):
        ref.encode("e5m2", x.astype(np.complex64))
    with pytest.raises(TypeError):
        ref.decode("e4m3", x)
    with pytest.raises(ValueError, match="out of range"):
        ref.decode("e4m3", np.array([256]))


# ---------------------------------------------------------------------------------------------
# MX block quantization.


def block(*head, fill=0.0, n=32):
    x = np.full(n, fill, np.float32)
    x[: len(head)] = head
    return x


def test_mx_floor_clips_block_max_by_design():
    e, s = ref.quantize_mx(block(480.0, 1.0, -3.0), "mxfp8_e4m3")
    assert s.tolist() == [127] and e[:3].tolist() == [0x7E, 0x38, 0xC4]
    assert ref.dequantize_mx(e, s, "mxfp8_e4m3")[0] == 448.0
    e, s = ref.quantize_mx(block(7.0), "mxfp4")  # 7 -> floor(log2 7) - 2 = 0 -> clip to 6
    assert s.tolist() == [127] and e[0] == 0x7


def test_mx_zero_nan_inf_and_negative_zero_blocks():
    x = np.stack([block(), block(-0.0, 0.0, -0.0), block(1.0, np.nan), block(2.0, -np.inf),
                  block(-0.0, 1.0)])
    for fmt, neg_zero in (("mxfp8_e4m3", 0x80), ("mxfp8_e5m2", 0x80), ("mxfp4", 0x8)):
        for rule in lowprec_formats.SCALE_RULES:
            e, s = ref.quantize_mx(x, fmt, scale_rule=rule)
            assert s[:, 0].tolist()[:4] == [0, 0, 0xFF, 0xFF]
            assert (e[0] == 0).all() and (e[2:4] == 0).all()
            assert e[1, :3].tolist() == [neg_zero, 0, neg_zero]  # -0 keeps its sign
            assert e[4, 0] == neg_zero
            d = ref.dequantize_mx(e, s, fmt)
            assert np.isnan(d[2:4]).all() and not np.isnan(d[[0, 1, 4]]).any()
            assert np.signbit(d[1, 0]) and (d[0] == 0).all()


def test_mx_tiny_inputs_clamp_the_scale():
    x = block(fill=2.0**-130)
    for fmt, code in (("mxfp8_e4m3", 0x20), ("mxfp8_e5m2", 0x30), ("mxfp4", 0x0)):
        e, s = ref.quantize_mx(x, fmt)  # shared exp clamps to -127; element 2^-3 (FP4: 0)
        assert s.tolist() == [0] and (e == code).all()
    e, s = ref.quantize_mx(x, "mxfp8_e4m3")
    assert (ref.dequantize_mx(e, s, "mxfp8") == 2.0**-130).all()


@pytest.mark.quick_cases(fmt=QUICK_MX)
@pytest.mark.parametrize("fmt", lowprec_formats.COLLECTIONS["e8m0_scaled_mx"])
def test_mx_element_max_times_power_of_two_is_exact(fmt):
    elem = ref.mx_element_format(fmt)
    top = float(ref.max_finite(elem))
    emax = math.floor(math.log2(top))
    ks = np.arange(-115, 127 - emax)  # top x 2^k < 2^128, 2^k a float32 normal
    x = np.zeros((len(ks), 32), np.float32)
    x[:, 0] = top * 2.0**ks
    x[:, 1] = -(2.0**ks)
    # 0.5 is a value of every MX element format (INT8: 32/64) but INT4's (integers): 1 there
    x[:, 2] = (1.0 if elem == "int4" else 0.5) * 2.0**ks
    e, s = ref.quantize_mx(x, fmt)  # floor: e = emax_elem + k -> shared exp k
    np.testing.assert_array_equal(s[:, 0], ks + 127)
    np.testing.assert_array_equal(ref.dequantize_mx(e, s, fmt), x.astype(np.float64))


def test_mx_scale_rules_hand_values():
    se = ref.shared_exponent
    assert [se(256.0, "e4m3", "ceil"), se(257.0, "e4m3", "ceil"), se(256.0, "e4m3")] == [0, 1, 0]
    # even: 480 = 1.111b x 2^8 stays; 488 = 1.11101b rounds to 1.111b; 496 = 1.1111b -> 2^9.
    assert [se(v, "e4m3", "even") for v in (480.0, 488.0, 496.0)] == [0, 0, 1]
    assert [se(v, "e2m1", "even") for v in (6.0, 7.0)] == [0, 1]
    # rceil: 448 / 448 = 1 -> 2^0; 449/448 > 1 -> 2^1; 6/6 -> 0.
    assert [se(v, "e4m3", "rceil") for v in (448.0, 449.0, 224.0)] == [0, 1, -1]
    assert se(6.0, "e2m1", "rceil") == 0 and se(57344.0, "e5m2", "rceil") == 0
    assert [se(0.0, "e4m3", r) for r in lowprec_formats.SCALE_RULES] == [-127] * len(
        lowprec_formats.SCALE_RULES)
    # even_e2m1 (compressed-tensors): 448 = 1.75 x 2^8 rounds (to 1 fraction bit) up to 2^9,
    # 447 = 1.746... stays; for E2M1 it is even: 7 = 1.75 x 4 -> 8.
    assert [se(v, "e4m3", "even_e2m1") for v in (447.0, 448.0)] == [0, 1]
    assert [se(v, "e2m1", "even_e2m1") for v in (6.0, 7.0)] == [0, 1]
    # floor_log2f (ggml): log2 of the float32 just below 8, 8 (1 - 2^-24), is 3 - 8.6e-8,
    # which rounds to 3.0 in float32 (its spacing below 3 is 2^-22); below 4 it stays 2 -
    # 1.19e-7 (spacing 2^-23 below 2), so only the first moves up.
    below = [float(np.nextafter(np.float32(2.0**k), np.float32(0))) for k in (3, 2)]
    assert [se(v, "e2m1", "floor_log2f") for v in below] == [1, -1]
    assert [se(v, "e2m1", "floor") for v in below] == [0, -1]
    assert se(3.4028234663852886e38, "e2m1", "floor") == 125
    assert se(3.4028234663852886e38, "e4m3", "even") == 128 - 8  # carry into exponent 255
    # floor(log2) read exactly: a float32 just below 2^k is in binade k-1.
    below = float(np.nextafter(F32(2.0**20), F32(0)))
    assert se(below, "e4m3") == 19 - 8 and se(below, "e4m3", "ceil") == 20 - 8
    with pytest.raises(ValueError, match=r"'round'.*floor"):
        se(1.0, "e4m3", "round")


def test_mx_even_rule_bits_equal_exact_round_half_up():
    rng = np.random.default_rng(5)
    amax = np.abs(random_f32(rng, 3000))
    amax = amax[np.isfinite(amax) & (amax > 0)]
    for elem in ("e4m3", "e5m2", "e2m1"):
        m = lowprec_formats.ELEMENT_FORMATS[elem]["mantissa_bits"]
        emax = math.floor(math.log2(ref.max_finite(elem)))
        for a in amax[:1000].tolist():
            e = math.frexp(a)[1] - 1
            q = Fraction(2) ** (e - m)
            rounded = math.floor(Fraction(a) / q + Fraction(1, 2)) * q
            want = max(-127, min(127, (math.frexp(float(rounded))[1] - 1) - emax))
            assert ref.shared_exponent(a, elem, "even") == want, (a, elem)


def test_mx_rceil_matches_jax_cast_to_e8m0_with_rounding_up():
    pytest.importorskip("jax")
    from jax._src.cudnn.scaled_matmul_stablehlo import cast_to_e8m0_with_rounding_up

    rng = np.random.default_rng(6)
    amax = np.abs(random_f32(rng, 4000))
    amax = amax[np.isfinite(amax)]
    pow2 = (2.0 ** np.arange(-149, 128)).astype(np.float32)
    with np.errstate(over="ignore"):
        near = [neighbours(pow2 * F32(448)), neighbours(pow2 * F32(6)), neighbours(pow2 * F32(57344))]
    amax = np.concatenate([amax, pow2, *near,
                           f32(0, 2.0**-149, 448 * 2.0**-127, 448 * 2.0**-128, 3e38)])
    amax = amax[np.isfinite(amax) & (amax >= 0)]
    for elem in ("e4m3", "e5m2", "e2m1"):
        with np.errstate(all="ignore"):
            q = amax / F32(float(ref.max_finite(elem)))
        want = np.asarray(cast_to_e8m0_with_rounding_up(q)).astype(np.int64)
        got = np.array([ref.shared_exponent(float(a), elem, "rceil") for a in amax.tolist()]) + 127
        np.testing.assert_array_equal(got, want)


def test_mx_rceil_matches_jax_quantize_mxfp8():
    jax = pytest.importorskip("jax")
    from jax._src.cudnn import scaled_matmul_stablehlo as sm

    rng = np.random.default_rng(7)
    x = (rng.standard_normal((6, 64)) * 2.0 ** rng.integers(-30, 30, (6, 1))).astype(np.float32)
    x[0, :32] = 448.0 * 2.0**-3  # exactly max_elem x 2^k: q is a power of two
    for data_type, fmt in ((ml_dtypes.float8_e4m3fn, "mxfp8_e4m3"), (ml_dtypes.float8_e5m2, "mxfp8_e5m2")):
        config = dataclasses.replace(jax.nn.get_scaled_dot_general_config("mxfp8"), data_type=data_type)
        xq, sq = sm.quantize(jax.numpy.asarray(x), config)
        e, s = ref.quantize_mx(x, fmt, scale_rule="rceil")
        assert_bits_equal(s, sq, f"{fmt} scales")
        assert_bits_equal(e, xq, f"{fmt} elements")


@pytest.mark.quick_cases(fmt=QUICK_MX)
@pytest.mark.parametrize("fmt", lowprec_formats.COLLECTIONS["e8m0_scaled_mx"])
@pytest.mark.parametrize("rule", lowprec_formats.SCALE_RULES)
def test_mx_elements_are_saturating_element_encode(fmt, rule):
    rng = np.random.default_rng(8)
    x = (rng.standard_normal((3, 64)) * 2.0 ** rng.integers(-20, 20, (3, 1))).astype(np.float32)
    x[1, 5] = -0.0
    elem = ref.mx_element_format(fmt)
    for rounding in ("nearest_even", "nearest_away", "toward_zero"):
        e, s = ref.quantize_mx(x, fmt, scale_rule=rule, rounding=rounding)
        assert e.dtype == np.uint8 and s.dtype == np.uint8 and s.shape == (3, 2)
        scale = np.repeat(2.0 ** (s.astype(np.float64) - 127), 32, axis=1)
        want = ref.encode(elem, x.astype(np.float64) / scale, rounding, "saturate")  # exact
        np.testing.assert_array_equal(e, want)
        d = ref.dequantize_mx(e, s, fmt)
        np.testing.assert_array_equal(d, ref.decode(elem, e) * scale)
    r = rng.integers(0, 2**32, x.shape, dtype=np.uint64).astype(np.uint32)
    e, s = ref.quantize_mx(x, fmt, scale_rule=rule, rounding="stochastic", random_bits=r)
    scale = np.repeat(2.0 ** (s.astype(np.float64) - 127), 32, axis=1)
    want = ref.encode(elem, x.astype(np.float64) / scale, "stochastic", "saturate", random_bits=r)
    np.testing.assert_array_equal(e, want)


def test_mx_axis_pad_and_errors():
    rng = np.random.default_rng(9)
    x = rng.standard_normal((64, 3)).astype(np.float32)
    e0, s0 = ref.quantize_mx(x, "mxfp4", axis=0)
    e1, s1 = ref.quantize_mx(x.T, "mxfp4", axis=-1)
    assert s0.shape == (2, 3) and e0.shape == (64, 3)
    np.testing.assert_array_equal(e0, e1.T)
    np.testing.assert_array_equal(s0, s1.T)
    np.testing.assert_array_equal(ref.dequantize_mx(e0, s0, "mxfp4", axis=0),
                                  ref.dequantize_mx(e1, s1, "mxfp4").T)

    y = rng.standard_normal((2, 40)).astype(np.float32)
    with pytest.raises(ValueError, match=r"40.*pad=True"):
        ref.quantize_mx(y, "mxfp8")
    e, s = ref.quantize_mx(y, "mxfp8", pad=True)
    assert e.shape == (2, 64) and s.shape == (2, 2) and (e[:, 40:] == 0).all()
    padded = np.concatenate([y, np.zeros((2, 24), np.float32)], axis=1)
    np.testing.assert_array_equal(ref.quantize_mx(padded, "mxfp8")[0], e)
    r = np.zeros((2, 64), np.uint32)
    ref.quantize_mx(y, "mxfp8", rounding="stochastic", random_bits=r, pad=True)
    ref.quantize_mx(y, "mxfp8", rounding="stochastic", random_bits=r[:, :40], pad=True)

    with pytest.raises(ValueError, match="random_bits"):
        ref.quantize_mx(x.T, "mxfp8", rounding="stochastic")
    with pytest.raises(ValueError, match=r"'mxfp5'.*mxfp4"):
        ref.quantize_mx(x, "mxfp5")
    with pytest.raises(TypeError, match="float64"):
        ref.quantize_mx(x.astype(np.float64), "mxfp4", axis=0)
    with pytest.raises(ValueError, match="'floor'"):
        ref.quantize_mx(x.T, "mxfp4", rounding="floor")
    with pytest.raises(ValueError, match="multiple of 32"):
        ref.dequantize_mx(e0, s0, "mxfp4")
    with pytest.raises(ValueError, match="shape"):
        ref.dequantize_mx(e0, s0[:1], "mxfp4", axis=0)


def test_mx_bfloat16_input_matches_float32():
    rng = np.random.default_rng(10)
    x = rng.standard_normal((2, 32)).astype(ml_dtypes.bfloat16)
    for rule in lowprec_formats.SCALE_RULES:
        a = ref.quantize_mx(x, "mxfp8_e5m2", scale_rule=rule)
        b = ref.quantize_mx(x.astype(np.float32), "mxfp8_e5m2", scale_rule=rule)
        np.testing.assert_array_equal(a[0], b[0])
        np.testing.assert_array_equal(a[1], b[1])


# ---------------------------------------------------------------------------------------------
# gpt-oss decoder.


def test_gpt_oss_decoder_hand_vector():
    assert ref.FP4_VALUES.tolist() == [0, .5, 1, 1.5, 2, 3, 4, 6, -0.0, -.5, -1, -1.5, -2, -3, -4, -6]
    assert np.signbit(ref.FP4_VALUES[8])
    blocks = np.zeros((2, 16), np.uint8)
    blocks[0, 0] = 0x21  # element 0 = nibble 1 (0.5), element 1 = nibble 2 (1.0)
    blocks[1, 15] = 0xF7  # element 30 = 6, element 31 = -6
    scales = np.array([128, 125], np.uint8)
    d = ref.decode_gpt_oss(blocks, scales)
    assert d.shape == (64,)
    assert d[:3].tolist() == [1.0, 2.0, 0.0]
    assert d[62:].tolist() == [6 * 2.0**-2, -6 * 2.0**-2]


def test_gpt_oss_decoder_agrees_with_dequantize_mx():
    rng = np.random.default_rng(11)
    x = (rng.standard_normal((3, 2, 64)) * 10).astype(np.float32)
    e, s = ref.quantize_mx(x, "mxfp4")
    packed = (e[..., 0::2] | (e[..., 1::2] << 4)).astype(np.uint8)  # even element: low nibble
    blocks = packed.reshape(3, 2, 2, 16)
    np.testing.assert_array_equal(ref.decode_gpt_oss(blocks, s), ref.dequantize_mx(e, s, "mxfp4"))
    with pytest.raises(ValueError):
        ref.decode_gpt_oss(blocks[..., :8], s)


# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("module", [ref, lowprec_reference.element, lowprec_reference.mx])
def test_reference_docstring_examples(module):
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0
