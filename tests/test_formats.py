"""The element formats added as data: ml_dtypes' other floats, the MX INT8 element, IEEE P3109.

Expected values come from ml_dtypes (``astype`` and ``finfo``), gfloat 0.5 (P3109 and OCP INT8
decoding and rounding), NumPy's int8 view (two's complement), hand derivations written next
to the case, or the independent reference. The bulk of the encode/decode checks of these
formats runs in test_codec.py / test_codec_properties.py, which are parametrized over every
format of ``formats/elements.json``; this file covers what is specific to them: the data
itself, the dtype-name aliases and arrays in those dtypes, the peers' quirks (fnuz NaN and
zero, FP6 NaN, INT8's -2), and P3109 against gfloat on every code.
"""

from __future__ import annotations

import functools
import math
from fractions import Fraction

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

try:  # the P3109 / OCP INT8 oracle ([test] extra); without it only the needs_gfloat cases skip
    from gfloat import RoundMode, decode_ndarray, encode_ndarray, round_ndarray
    from gfloat.formats import format_info_ocp_int8, format_info_p3109
    from gfloat.types import Domain, Signedness
except ImportError:
    HAVE_GFLOAT = False
else:
    HAVE_GFLOAT = True

import lowprec
import lowprec_formats
import lowprec_reference as R
from helpers.asserts import assert_codes_equal, assert_same_values, bit_pattern
from helpers.codecs import CODECS
from helpers.inputs import adversarial, float_arrays
from helpers.mx import random_bits
from helpers.oracles import ml_dtype, ml_dtypes_codes, ml_dtypes_values
from helpers.tiers import full_suite


pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

WITH_ML = lowprec_formats.COLLECTIONS["with_ml_dtypes"]
NEW_ML = ("e4m3ieee", "e3m4", "e4m3fnuz", "e5m2fnuz", "e4m3b11fnuz", "e2m3", "e3m2")
FNUZ = ("e4m3fnuz", "e5m2fnuz", "e4m3b11fnuz")
# One Hypothesis strategy object per (format, dtype, salt): building one for each draw (an
# ``st.composite`` reading its function's source) cost ~1 ms, and the same object draws the
# same values.
_float_arrays = functools.lru_cache(maxsize=None)(float_arrays)
needs_gfloat = pytest.mark.skipif(not HAVE_GFLOAT, reason="gfloat is not installed ([test] extra)")


def _nan_aware_equal(fmt, got, want_codes, x, what=""):
    got_nan = np.isnan(np.asarray(lowprec.decode(np.asarray(got), fmt)))
    want_nan = np.isnan(ml_dtypes_values(fmt, want_codes))
    assert_codes_equal(got, want_codes, x, what or fmt, nan=(got_nan, want_nan))


# ============================================================================================
# The data: layouts and names.


def test_new_ml_dtypes_layouts_match_ml_dtypes_finfo():
    # The data table's raw fields, read by lowprec, give ml_dtypes' own finfo numbers.
    for fmt in NEW_ML:
        got, want = lowprec.finfo(fmt), ml_dtypes.finfo(ml_dtype(fmt))
        for field in ("bits", "nexp", "nmant", "machep", "negep", "maxexp", "minexp"):
            assert getattr(got, field) == int(getattr(want, field)), (fmt, field)
        for field in ("eps", "epsneg", "max", "min", "smallest_normal", "smallest_subnormal"):
            assert getattr(got, field) == float(getattr(want, field)), (fmt, field)


@pytest.mark.parametrize("fmt", WITH_ML)
def test_every_format_answers_to_its_ml_dtypes_name(fmt):
    dtype_name = lowprec_formats.ELEMENT_FORMATS[fmt]["ml_dtypes"]
    if dtype_name not in ("float16", "bfloat16"):
        assert dtype_name in lowprec_formats.ELEMENT_FORMATS[fmt]["aliases"]
    assert lowprec.element_format(dtype_name) is lowprec.element_format(fmt)
    assert lowprec.resolve_format(dtype_name.upper()) is lowprec.element_format(fmt)
    assert lowprec.element_format(fmt).storage_dtype == ml_dtype(fmt)


def test_specials_follow_the_data():
    # docs/design.md §1: where each family keeps its infinities and NaNs.
    e = lowprec.element_format
    assert e("e4m3ieee").inf_code == 0b0_1111_000 and e("e4m3ieee").max_finite == 240
    assert e("e3m4").inf_code == 0b0_111_0000 and e("e3m4").max_finite == 15.5
    for fmt in FNUZ:  # the all-ones magnitude is finite; the NaN is 1000 0000
        assert e(fmt).max_magnitude_code == 0x7F and e(fmt).nan_code == 0x80
        assert e(fmt).inf_code is None
    for fmt in ("e2m3", "e3m2"):
        assert e(fmt).code_bits == 6 and e(fmt).nan_code is None and e(fmt).inf_code is None
    assert e("ocp_int8").encoding == "twos_complement" and e("ocp_int8").max_finite == 127 / 64


# ============================================================================================
# ml_dtypes: the default mode is astype, bit for bit.

N_RANDOM = 1 << 22


@pytest.mark.parametrize("fmt", NEW_ML)
@pytest.mark.quick_first(1)  # every format's encoder runs in the quick codec tests
def test_default_encode_matches_ml_dtypes_on_2_22_random_patterns(fmt):
    # 2^22 uniformly random float32 bit patterns (NaNs, infinities, subnormals included).
    bits = np.random.default_rng(sum(map(ord, fmt))).integers(0, 1 << 32, N_RANDOM, np.uint64)
    x = bits.astype(np.uint32).view(np.float32)
    _nan_aware_equal(fmt, lowprec.encode(x, fmt), ml_dtypes_codes(fmt, x), x)


@pytest.mark.parametrize("fmt", FNUZ)
def test_fnuz_has_no_negative_zero_and_one_nan(fmt):
    # ml_dtypes (float8_*fnuz): -0 and negative values rounding to zero give +0 (0x00); NaN of
    # either sign, +-inf and overflow give the NaN 0x80 ("ieee"); 0x80 reads as NaN.
    tiny = float(lowprec.finfo(fmt).smallest_subnormal) / 4
    big = float(lowprec.finfo(fmt).max) * 2
    x = np.array([-0.0, -tiny, np.nan, -np.nan, np.inf, -np.inf, big, -big], np.float32)
    want = [0x00, 0x00, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80]
    assert ml_dtypes_codes(fmt, x).tolist() == want  # the peer's behaviour, as documented
    assert np.asarray(lowprec.encode(x, fmt)).tolist() == want
    assert R.encode(fmt, x).tolist() == want
    # "saturate": the infinities and overflows become +-max (0x7F / 0xFF); NaN stays 0x80.
    sat = [0x00, 0x00, 0x80, 0x80, 0x7F, 0xFF, 0x7F, 0xFF]
    assert np.asarray(lowprec.encode(x, fmt, overflow="saturate")).tolist() == sat
    assert R.encode(fmt, x, overflow="saturate").tolist() == sat
    # Directed rounding of a tiny negative value toward -inf gives -min_subnormal (0x81), not -0.
    assert np.asarray(lowprec.encode(x[1:2], fmt, rounding="down")).tolist() == [0x81]
    assert np.asarray(lowprec.encode(x[1:2], fmt, rounding="up")).tolist() == [0x00]
    # ml_dtypes reads 0x80 as a NaN with the sign bit set; so does lowprec.
    got = np.asarray(lowprec.decode(np.array([0x80], np.uint8), fmt))
    assert np.isnan(got[0]) and np.signbit(got[0]) == np.signbit(ml_dtypes_values(fmt, [0x80])[0])


@pytest.mark.parametrize("fmt", ["e2m3", "e3m2"])
def test_fp6_nan_gives_the_opposite_zero_and_inf_saturates(fmt):
    # ml_dtypes' float6 types (no NaN, no inf): +NaN -> 0b1_00000 (-0), -NaN -> +0, as float4
    # does; +-inf -> +-max (0x1F / 0x3F) in the default mode.
    x = np.array([np.nan, -np.nan, np.inf, -np.inf], np.float32)
    want = [0x20, 0x00, 0x1F, 0x3F]
    assert ml_dtypes_codes(fmt, x).tolist() == want
    assert np.asarray(lowprec.encode(x, fmt)).tolist() == want
    assert R.encode(fmt, x).tolist() == want


@pytest.mark.parametrize("fmt", ["e4m3ieee", "e3m4"])
def test_ieee_like_fp8_nan_and_infinity_codes(fmt):
    # float8_e4m3 / float8_e3m4: quiet NaN = exponent all ones, top mantissa bit (0x7C, 0x78),
    # with the input's sign; the tie just past max rounds to inf.
    f = lowprec.element_format(fmt)
    qnan = f.inf_code | (1 << (f.mantissa_bits - 1))
    top = f.max_finite_exact
    tie = float(top + Fraction(2) ** (f.emax - f.mantissa_bits) / 2)  # max + half an ulp
    x = np.array([np.nan, -np.nan, tie, -tie, np.inf], np.float32)
    want = [qnan, qnan | 0x80, f.inf_code, f.inf_code | 0x80, f.inf_code]
    assert ml_dtypes_codes(fmt, x).tolist() == want
    assert np.asarray(lowprec.encode(x, fmt)).tolist() == want


# ============================================================================================
# Arrays already in ml_dtypes dtypes.


def _every_value(fmt):
    """Every code of ``fmt`` as an array of its ml_dtypes dtype (NumPy)."""
    f = lowprec.element_format(fmt)
    codes = np.arange(1 << f.code_bits, dtype=np.uint32).astype(f.code_dtype)
    return codes.view(ml_dtype(fmt)) if f.code_bits > 4 else codes.astype(np.uint8).view(
        ml_dtype(fmt))


@pytest.mark.quick_cases(src=["e4m3", "e5m2", "e2m1", "e8m0", "e4m3fnuz"])
@pytest.mark.parametrize("src", [f for f in WITH_ML if f not in ("fp16", "bf16")])
@pytest.mark.quick_first(2)
def test_arrays_in_ml_dtypes_are_read_exactly(src):
    # Every value of the dtype, as input: decode(codes in the dtype) = decode(uint codes);
    # encode/quantize see the exact value (the float32 widening, NaN sign included). float6
    # arrays (which JAX cannot hold) are decoded on the host.
    x = _every_value(src)
    codes = bit_pattern(x)
    exact = np.asarray(lowprec.decode(codes, src))
    assert_same_values(lowprec.decode(x, src), exact, codes, f"{src} codes as dtype")
    with np.errstate(invalid="ignore"):
        wide = x.astype(np.float32)  # ml_dtypes' own widening (exact)
    assert_same_values(exact, wide, codes, f"{src} decode == ml_dtypes")
    assert np.array_equal(np.signbit(exact), np.signbit(wide))
    for dst in ("e4m3", "e2m1", "e5m2fnuz", "bf16"):
        assert_codes_equal(lowprec.encode(x, dst), lowprec.encode(exact, dst), x,
                           f"{src} -> {dst}")
    q = lowprec.quantize(x, "e2m1", dtype=jnp.float32)
    assert_same_values(q, lowprec.quantize(exact, "e2m1"), x, f"{src} quantize")


@pytest.mark.parametrize("dst", [f for f in WITH_ML if f not in ("fp16", "bf16", "e2m3", "e3m2")])
@pytest.mark.slow  # left out of the quick tier (seconds; its paths run in other quick tests)
def test_ml_dtypes_result_dtypes_round_like_astype(dst):
    # decode/quantize/dequantize(dtype=that dtype): the float32 value rounded as ml_dtypes'
    # astype rounds it (NaN aside: compared as NaN), and the array has the dtype.
    codes = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    values = np.asarray(lowprec.decode(codes, "bf16"))  # every bfloat16 value, as float32
    got = np.asarray(lowprec.decode(codes, "bf16", dtype=ml_dtype(dst)))
    assert got.dtype == ml_dtype(dst)
    got_codes = bit_pattern(got)
    _nan_aware_equal(dst, got_codes, ml_dtypes_codes(dst, values), values, f"bf16 -> {dst}")
    mx = lowprec.quantize_mx(jnp.asarray(values[:4096]), "mxfp8")
    d = np.asarray(lowprec.dequantize(mx, ml_dtype(dst)))
    want = ml_dtypes_codes(dst, np.asarray(lowprec.dequantize(mx)))
    _nan_aware_equal(dst, bit_pattern(d), want, values[:4096], f"dequantize -> {dst}")


def test_ml_dtypes_input_keeps_nan_sign():
    # Widening is integer-only (docs/design.md §8): -NaN in float8_e5m2 stays negative.
    x = np.array([np.nan, -np.nan], np.float32).astype(ml_dtypes.float8_e5m2)
    assert np.asarray(lowprec.encode(x, "e4m3")).tolist() == [0x7F, 0xFF]
    assert np.asarray(lowprec.encode(jnp.asarray(x), "fp16")).tolist() == [0x7E00, 0xFE00]


def test_mismatched_storage_dtype_and_float6_results_are_refused():
    x = np.zeros(3, ml_dtypes.float8_e4m3fn)
    with pytest.raises(TypeError, match=r"float8_e4m3fn.*'e4m3'.*'e5m2'"):
        lowprec.decode(x, "e5m2")
    with pytest.raises(TypeError, match=r"float6_e2m3fn.*encode\(x, 'e2m3'\)"):
        lowprec.decode(np.zeros(3, np.uint8), "e2m3", dtype=ml_dtypes.float6_e2m3fn)


# ============================================================================================
# The MX INT8 element: two's complement, implicit scale 2^-6.


def test_int8_decodes_as_twos_complement_over_64():
    # Oracle: NumPy's own two's-complement view of the byte, divided by 64 (exact).
    codes = np.arange(256, dtype=np.uint8)
    want = codes.view(np.int8).astype(np.float64) / 64
    for got in (lowprec.decode(codes, "ocp_int8"), R.decode("ocp_int8", codes)):
        assert np.array_equal(np.asarray(got, np.float64), want)


@needs_gfloat
def test_int8_gfloat_decodes_as_twos_complement_over_64():
    # The peer agrees with the NumPy oracle of the test above on every byte.
    codes = np.arange(256, dtype=np.uint8)
    want = codes.view(np.int8).astype(np.float64) / 64
    got = decode_ndarray(format_info_ocp_int8, codes.astype(np.int64))
    assert np.array_equal(np.asarray(got, np.float64), want)


def test_int8_encode_is_symmetric_and_saturates():
    # k/64 -> k for every k in [-127, 127]; beyond, +-127/64 (codes 0x7F, 0x81); -2 (0x80)
    # is decode-only (docs/design.md §1). NaN -> 0 (no NaN; ml_dtypes' "opposite zero" rule
    # meets a format with one zero). Ties to even: 1/128 -> 0, 3/128 -> 2/64 = 0x02.
    k = np.arange(-127, 128)
    x = np.concatenate([k / 64, [-2.0, -1.995, 5.0, -np.inf, np.nan, 1 / 128, 3 / 128, -0.0]])
    x = x.astype(np.float32)
    want = list((k % 256).astype(int)) + [0x81, 0x81, 0x7F, 0x81, 0x00, 0x00, 0x02, 0x00]
    assert np.asarray(lowprec.encode(x, "ocp_int8")).tolist() == want
    assert R.encode("ocp_int8", x).tolist() == want


@needs_gfloat
def test_int8_gfloat_saturates_to_minus_two():
    # gfloat's ocp_int8 saturates to the asymmetric -2 instead (documented difference).
    g = encode_ndarray(format_info_ocp_int8,
                       round_ndarray(format_info_ocp_int8, np.array([-1.995, -3.0]),
                                     RoundMode.TiesToEven, True))
    assert g.tolist() == [0x80, 0x80]


# ============================================================================================
# IEEE P3109 against gfloat.


def _gfloat_p3109(k, p, signed, extended):
    return format_info_p3109(k, p, Signedness.Signed if signed else Signedness.Unsigned,
                             Domain.Extended if extended else Domain.Finite)


def _p3109_params(ks):
    return [(k, p, s, e) for k in ks for p in range(1, k + 1) for s in (True, False)
            for e in (True, False)]


def _gfloat_values_equal(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    same = (got == want) & (np.signbit(got) == np.signbit(want))
    return same | (np.isnan(got) & np.isnan(want))


def _gfloat_codes(gi, x, sat):
    """gfloat's RNE codes of float64 ``x`` (its round_ndarray then encode_ndarray)."""
    return encode_ndarray(gi, round_ndarray(gi, x, RoundMode.TiesToEven, sat)).astype(np.int64)


def _p3109_inputs(gi) -> np.ndarray:
    """Every finite value, every midpoint, their float32 neighbours, the overflow region,
    zeros, infinities (not NaN: gfloat's encode of a NaN input needs no check)."""
    vals = np.unique(decode_ndarray(gi, np.arange(1 << gi.k)))
    vals = vals[np.isfinite(vals)]
    mids = (vals[1:] + vals[:-1]) / 2
    top = float(vals.max())
    x = np.concatenate([vals, mids, [top * 1.5, top * 4, np.inf, -np.inf, 0.0, -0.0]])
    with np.errstate(over="ignore"):
        x32 = x.astype(np.float32)
    with np.errstate(over="ignore"):
        x32 = np.concatenate([x32, np.nextafter(x32, np.float32(np.inf)),
                              np.nextafter(x32, np.float32(-np.inf))])
    if not gi.is_signed:  # negative numbers have no code (lowprec: NaN; gfloat: undefined)
        x32 = x32[~np.signbit(x32) | (x32 == 0)]
    return np.unique(x32)


# lowprec runs op by op (jax.disable_jit) on fixed-size arrays for these sweeps: 140 formats
# jitted would be 400 XLA compilations, while op by op each primitive compiles once per
# shape and is reused by every format (the format's constants are operands).
_SWEEP_CODES, _SWEEP_INPUTS = 1 << 16, 4096
_REFERENCE_STRIDE = 4  # the default run's share of the inputs the reference encodes (below)


def _op_by_op_decode(fmt, n_codes):
    codes = np.arange(_SWEEP_CODES, dtype=np.uint32) % n_codes
    with jax.disable_jit():
        return np.asarray(lowprec.decode(codes, fmt))[:n_codes]


def _op_by_op_encode(fmt, x, overflow):
    padded = np.zeros(_SWEEP_INPUTS, np.float32)
    assert x.size <= padded.size
    padded[: x.size] = x
    with jax.disable_jit():
        return np.asarray(lowprec.encode(padded, fmt, overflow=overflow))[: x.size]


@needs_gfloat
@pytest.mark.quick_cases(k=[3, 8])
@pytest.mark.parametrize("k", range(2, 9))
@pytest.mark.quick_first(1)
def test_p3109_decode_and_encode_match_gfloat_for_every_small_format(k):
    # Every (P, signedness, domain) of width K <= 8: decode of every code, and RNE encode
    # (saturating and not) of every value, midpoint and neighbour, lowprec and the reference.
    # The reference encodes one element at a time in exact rationals (~70 us each, half this
    # test's CPU at K = 8): in the default run it takes every 4th input, from an offset that
    # turns with the variant, so the four (signedness, domain) variants of each (K, P) share
    # out the inputs; the extended sweep gives it every input of every variant.
    stride = 1 if full_suite() else _REFERENCE_STRIDE
    for i, (k_, p, s, e) in enumerate(_p3109_params([k])):
        fmt = lowprec.element_format(lowprec_formats.p3109_name(k_, p, s, e))
        gi = _gfloat_p3109(k_, p, s, e)
        codes = np.arange(1 << k, dtype=np.uint32)
        want = decode_ndarray(gi, codes.astype(np.int64))
        assert _gfloat_values_equal(_op_by_op_decode(fmt, 1 << k), want).all(), fmt.name
        assert _gfloat_values_equal(R.decode(fmt.name, codes), want).all(), fmt.name
        x = _p3109_inputs(gi)
        for sat, overflow in ((False, "ieee"), (True, "saturate")):
            want_codes = _gfloat_codes(gi, x.astype(np.float64), sat)
            got_codes = _op_by_op_encode(fmt, x, overflow)
            assert_codes_equal(got_codes, want_codes, x, f"{fmt.name} {overflow}")
            sample = slice(i % stride, None, stride)
            assert_codes_equal(R.encode(fmt.name, x[sample], overflow=overflow),
                               want_codes[sample], x[sample], f"reference {fmt.name} {overflow}")


@needs_gfloat
@pytest.mark.parametrize("k, p", [(10, 4), (12, 7), (16, 9), (16, 11)])
def test_p3109_wide_formats_decode_like_gfloat(k, p):
    # Wider formats, every code (up to 65536), all four signedness/domain variants.
    for s in (True, False):
        for e in (True, False):
            fmt = lowprec.p3109(k, p, "signed" if s else "unsigned", "extended" if e else "finite")
            codes = np.arange(1 << k, dtype=np.uint32)
            want = decode_ndarray(_gfloat_p3109(k, p, s, e), codes.astype(np.int64))
            assert _gfloat_values_equal(_op_by_op_decode(fmt, 1 << k), want).all(), fmt.name


@needs_gfloat
def test_p3109_binary8_jitted_against_gfloat():
    # gfloat's own list of binary8 formats, through the jitted public path.
    from gfloat.formats import p3109_binary8_formats

    for gi in p3109_binary8_formats:
        fmt = lowprec.element_format(gi.name)
        codes = np.arange(256, dtype=np.uint8)
        assert _gfloat_values_equal(lowprec.decode(codes, fmt), decode_ndarray(gi, codes)).all()
        x = _p3109_inputs(gi)
        assert_codes_equal(lowprec.encode(x, fmt), _gfloat_codes(gi, x.astype(np.float64), False),
                           x, gi.name)


# binary8p1 (no mantissa bits, bias 64): 3 = 1.5 * 2 lies half-way between 2 (code 65, odd)
# and 4 (code 66, even) -> 4; 6 = 1.5 * 4 between 4 (66) and 8 (67) -> 4. The significand
# rule (E8M0, ml_dtypes) would give 4 and 8.
_P1_TIES = np.array([3.0, 6.0, -3.0, -6.0], np.float32)
_P1_TIE_CODES = [66, 66, 0x80 | 66, 0x80 | 66]


def test_p3109_precision_one_ties_go_to_the_even_code():
    fmt = lowprec.p3109(8, 1)
    assert np.asarray(lowprec.encode(_P1_TIES, fmt)).tolist() == _P1_TIE_CODES
    assert R.encode(fmt.name, _P1_TIES).tolist() == _P1_TIE_CODES


@needs_gfloat
def test_p3109_precision_one_ties_gfloat_agrees():
    gi = _gfloat_p3109(8, 1, True, True)
    assert _gfloat_codes(gi, _P1_TIES.astype(np.float64), False).tolist() == _P1_TIE_CODES


def test_p3109_unsigned_negative_numbers_are_nan():
    # Unsigned P3109: no code for a negative number -> NaN (0xFF); -0 -> +0.
    fmt = lowprec.p3109(8, 4, "unsigned")
    x = np.array([-1.0, -1e-30, -0.0, -np.inf, 1.0], np.float32)
    want = [0xFF, 0xFF, 0x00, 0xFF, int(R.encode(fmt.name, np.float32([1.0]))[0])]
    assert np.asarray(lowprec.encode(x, fmt)).tolist() == want
    assert R.encode(fmt.name, x).tolist() == want


P3109_SAMPLE = ("p3109_k8p3se", "p3109_k8p4uf", "p3109_k8p1ue", "p3109_k6p3sf", "p3109_k8p8sf",
                "ocp_int8")


@pytest.mark.quick_cases(fmt=["p3109_k8p3se", "ocp_int8"])
@pytest.mark.parametrize("fmt", P3109_SAMPLE)
@settings(max_examples=6)
@given(data=st.data())
def test_p3109_and_int8_every_mode_matches_reference(fmt, data):
    # Every rounding mode and overflow policy, eager and jit, vs the reference (which is the
    # oracle for the modes gfloat rounds differently: its stochastic rounding is another rule).
    # Through the codec harness (helpers/codecs.py): inputs zero-padded to one length, so the
    # examples of one (rounding, overflow) share a compiled program (a program per drawn
    # length was ~2.5 compiles an example), and the reference gets the words of that length.
    rounding = data.draw(st.sampled_from(lowprec_formats.ROUNDING_MODES), label="rounding")
    overflow = data.draw(st.sampled_from(lowprec_formats.OVERFLOW_POLICIES), label="overflow")
    x = data.draw(_float_arrays(fmt, np.float32, salt=f"{rounding}{overflow}"), label="x")
    key = jax.random.key(data.draw(st.integers(0, 2**31 - 1))) if rounding == "stochastic" else None
    want = CODECS["reference"].encode(fmt, x, rounding, overflow, key)
    for impl in ("eager", "jit"):
        got = CODECS[impl].encode(fmt, x, rounding, overflow, key)
        assert_codes_equal(got, want, x, f"{fmt} {rounding} {overflow} {impl}")
    if key is not None:  # unpadded: the documented words of x's own shape
        want = R.encode(fmt, x, rounding, overflow, random_bits=random_bits(key, x.shape))
        got = lowprec.encode(x, fmt, rounding=rounding, overflow=overflow, key=key)
        assert_codes_equal(got, want, x, f"{fmt} {rounding} {overflow} unpadded")


def test_p3109_names_and_errors():
    assert lowprec.p3109(8, 3) is lowprec.resolve_format("P3109_K8P3SE")
    assert lowprec.p3109(4, 2, "unsigned", "finite").name == "p3109_k4p2uf"
    with pytest.raises(ValueError, match=r"precision P=9.*K=8"):
        lowprec.p3109(8, 9)
    with pytest.raises(ValueError, match=r"width K=1"):
        lowprec.p3109(1, 1)
    with pytest.raises(ValueError, match=r"'sign'.*signed"):
        lowprec.p3109(8, 3, "sign")
    with pytest.raises(ValueError, match=r"beyond float32"):
        lowprec.p3109(16, 2)  # 15 exponent bits
    with pytest.raises(ValueError, match=r"'p3109_k8p9se'"):
        lowprec.encode(np.ones(2, np.float32), "p3109_k8p9se")


def test_adversarial_sets_cover_every_value_of_the_new_formats():
    # The codec tests' adversarial inputs hold every finite value of the <= 8-bit formats
    # (so "exact values are unchanged" there is exhaustive for them too).
    for fmt in NEW_ML:
        x = adversarial(fmt)
        values = ml_dtypes_values(fmt, np.arange(1 << lowprec.element_format(fmt).code_bits))
        finite = values[np.isfinite(values)]
        assert np.isin(finite, x).all(), fmt
    assert math.isclose(lowprec.finfo("e4m3b11fnuz").max, 30.0)
