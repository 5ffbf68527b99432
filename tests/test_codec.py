"""Element codecs (encode / decode / quantize), deterministic tests.

Expected values come only from the independent NumPy reference (``lowprec_reference``),
ml_dtypes / ``lax.reduce_precision``, the spec (docs/design.md §1, §2), or a hand
derivation written next to the case. Parametrization over formats, modes and the
{reference, eager, jit} implementation axis comes from the ``element_cases`` marker
(tests/conftest.py).

Contents: exhaustive decode; default mode == ml_dtypes (random float32 bit patterns, every
float16/bfloat16 value, adversarial sets) and TF32 == reduce_precision; every (format,
rounding, overflow) on the adversarial sets vs the reference; exact values unchanged;
monotonicity and bracketing; the Rounding/Overflow members; hand-derived codes; stochastic rounding (documented random
words, neighbours, unbiasedness); shapes, dtypes, float64, vmap; quantize (STE, dtype
rules); errors.
"""

from __future__ import annotations

import math
from fractions import Fraction

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import lax

import lowprec
import lowprec_formats
from helpers.asserts import assert_bits_equal, assert_codes_equal, assert_same_values, bit_pattern
from helpers.codecs import REFERENCE as reference, reference_words, replay_random_bits, sweep
from helpers.inputs import adversarial
from helpers.oracles import ml_dtypes_codes, ml_dtypes_values, ref_values
from helpers.tiers import QUICK_ELEMENTS

element_cases = pytest.mark.element_cases

# Widening float32 signalling NaNs (in the adversarial sets and random bit patterns) to float64
# raises NumPy's "invalid" flag; the values are still NaN, so the warning is noise.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered in cast:RuntimeWarning")

# docs/design.md §1, "max finite" column (bf16 ≈ 3.39e38 = (2 - 2^-7) 2^127, tf32 ≈ 3.40e38 =
# (2 - 2^-10) 2^127, e8m0 = 2^127).
SPEC_MAX_FINITE = {
    "fp16": Fraction(65504),
    "bf16": (2 - Fraction(1, 2**7)) * Fraction(2) ** 127,
    "tf32": (2 - Fraction(1, 2**10)) * Fraction(2) ** 127,
    "e4m3": Fraction(448),
    "e5m2": Fraction(57344),
    "e2m1": Fraction(6),
    "e8m0": Fraction(2) ** 127,
    # ml_dtypes' other floats (their finfo.max): e4m3ieee 0b0_1110_111 = 1.875 * 2^(14-7);
    # e3m4 0b0_110_1111 = (1 + 15/16) * 2^(6-3); the fnuz formats use the all-ones code:
    # e4m3fnuz 1.875 * 2^(15-8), e5m2fnuz 1.75 * 2^(31-16), e4m3b11fnuz 1.875 * 2^(15-11);
    # FP6 (no specials) e2m3 1.875 * 2^(3-1), e3m2 1.75 * 2^(7-3). MX INT8: 127 / 64.
    "e4m3ieee": Fraction(240),
    "e3m4": Fraction(31, 2),
    "e4m3fnuz": Fraction(240),
    "e5m2fnuz": Fraction(57344),
    "e4m3b11fnuz": Fraction(30),
    "e2m3": Fraction(15, 2),
    "e3m2": Fraction(28),
    "ocp_int8": Fraction(127, 64),
    "int4": Fraction(7),   # INT4 k in [-7, 7] (2510.25602's NVINT4/MXINT4 element)
    # UE5M3 (CUDA 13.4 __nv_fp8_ue5m3: no sign, E5 bias 15, M3, NaN only 0xFF): 0b11111_110
    # = 1.75 * 2^(31-15) = 114688. HiFloat8 (arXiv 2409.16626): dot 11, exponent +15, mantissa
    # 0 (1.5 * 2^15 is the infinity code) = 2^15.
    "ue5m3": Fraction(114688),
    "hif8": Fraction(2) ** 15,
}
# Smallest positive value: 2^(emin - mantissa bits) = 2^(1 - bias - M), e8m0: 2^-127 (code 0).
SPEC_MIN_POSITIVE = {
    "fp16": Fraction(2) ** -24,
    "bf16": Fraction(2) ** -133,
    "tf32": Fraction(2) ** -136,
    "e4m3": Fraction(2) ** -9,
    "e5m2": Fraction(2) ** -16,
    "e2m1": Fraction(1, 2),
    "e8m0": Fraction(2) ** -127,
    "e4m3ieee": Fraction(2) ** -9,  # 1 - 7 - 3
    "e3m4": Fraction(2) ** -6,  # 1 - 3 - 4
    "e4m3fnuz": Fraction(2) ** -10,  # 1 - 8 - 3
    "e5m2fnuz": Fraction(2) ** -17,  # 1 - 16 - 2
    "e4m3b11fnuz": Fraction(2) ** -13,  # 1 - 11 - 3
    "e2m3": Fraction(2) ** -3,  # 1 - 1 - 3
    "e3m2": Fraction(2) ** -4,  # 1 - 3 - 2
    "ocp_int8": Fraction(2) ** -6,  # the implicit scale of MX INT8
    "int4": Fraction(1),  # integers
    "ue5m3": Fraction(2) ** -17,  # 1 - 15 - 3
    "hif8": Fraction(2) ** -22,  # the denormal mode's 2^(1 - 23)
}
# README table, "encode returns" column.
SPEC_CODE_DTYPE = {
    "fp16": np.uint16, "bf16": np.uint16, "tf32": np.uint32,
    "e4m3": np.uint8, "e5m2": np.uint8, "e2m1": np.uint8, "e8m0": np.uint8,
    "e4m3ieee": np.uint8, "e3m4": np.uint8, "e4m3fnuz": np.uint8, "e5m2fnuz": np.uint8,
    "e4m3b11fnuz": np.uint8, "e2m3": np.uint8, "e3m2": np.uint8, "ocp_int8": np.uint8,
    "int4": np.uint8,
    "ue5m3": np.uint8, "hif8": np.uint8,
}


def code_bits(fmt: str) -> int:
    d = lowprec_formats.ELEMENT_FORMATS[fmt]
    return d["sign_bits"] + d["exponent_bits"] + d["mantissa_bits"]


def every_code(fmt: str) -> np.ndarray:
    n = 1 << code_bits(fmt)
    return np.arange(n, dtype=np.uint32).astype(SPEC_CODE_DTYPE[fmt])


def test_the_spec_tables_agree_with_both_implementations():
    import lowprec_reference

    assert set(SPEC_MAX_FINITE) == set(lowprec_formats.COLLECTIONS["all_elements"])
    for fmt, m in SPEC_MAX_FINITE.items():
        f = lowprec.element_format(fmt)
        assert f.max_finite_exact == m, fmt
        assert lowprec_reference.max_finite(fmt) == m, fmt
        assert Fraction(f.min_subnormal) == SPEC_MIN_POSITIVE[fmt], fmt
    # The exhaustive tests below really are exhaustive: 16 / 64 / 256 / 65536 / 2^19 codes.
    assert [code_bits(f) for f in ("e2m1", "e2m3", "e3m2", "e4m3", "e5m2", "e8m0", "e4m3fnuz",
                                   "ocp_int8", "fp16", "bf16", "tf32")] == [
        4, 6, 6, 8, 8, 8, 8, 8, 16, 16, 19,
    ]


# ============================================================================================
# Decode: every code.


@element_cases(formats="with_ml_dtypes", impls="all")
def test_decode_every_code_matches_ml_dtypes(fmt, codec):
    codes = every_code(fmt)
    assert_same_values(
        codec.decode(fmt, codes), ml_dtypes_values(fmt, codes), codes, f"{fmt} decode"
    )


def _tf32_reference_codes() -> np.ndarray:
    # The reference decodes ~80k codes/s, too slow for all 2^19 TF32 codes in CI: every code
    # of the binades that hold the specials, subnormals, 1 and the largest values, plus every
    # 37th code (all binades, both signs). All 2^19 are checked against the spec layout below.
    fields = np.arange(1 << 19, dtype=np.uint32)
    exp = (fields >> 10) & 0xFF
    keep = np.isin(exp, [0, 1, 2, 126, 127, 128, 253, 254, 255]) | (fields % 37 == 0)
    return fields[keep]


@element_cases(impls="lowprec")
def test_decode_every_code_matches_reference(fmt, codec):
    codes = _tf32_reference_codes() if fmt == "tf32" else every_code(fmt)
    assert_same_values(
        codec.decode(fmt, codes), reference.decode(fmt, codes), codes, f"{fmt} decode"
    )


@element_cases(impls="all")
def test_decode_tf32_is_the_top_19_bits_of_a_float32(codec):
    # docs/design.md §1: TF32 = 1/8/10, bias 127, "float32 container, low 13 bits zero": the value of
    # code c is the float32 whose bit pattern is c << 13 (subnormals, inf and NaN included).
    codes = every_code("tf32") if not codec.is_reference else _tf32_reference_codes()
    want = (codes.astype(np.uint32) << 13).view(np.float32)
    assert_same_values(codec.decode("tf32", codes), want, codes, "tf32 decode")


# Quick tier: the formats of QUICK_ELEMENTS (the conversion after decode is format-blind).
@pytest.mark.quick_cases(fmt=QUICK_ELEMENTS)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32],
                         ids=["bf16", "f16", "f32"])
@element_cases(formats="with_ml_dtypes")
def test_decode_to_a_narrower_dtype_rounds_the_exact_value(fmt, dtype):
    # decode(dtype=d) = the exact float32 value rounded once to d (NumPy / ml_dtypes astype of
    # a float32 is a single correct rounding).
    codes = every_code(fmt)
    got = np.asarray(lowprec.decode(codes, fmt, dtype=dtype))
    assert got.dtype == np.dtype(dtype)
    exact = ml_dtypes_values(fmt, codes)
    with np.errstate(all="ignore"):
        want = exact.astype(np.dtype(dtype))
    nan = np.isnan(exact)
    assert np.array_equal(np.isnan(got.astype(np.float32)), nan)
    bits = np.uint16 if got.dtype.itemsize == 2 else np.uint32
    assert np.array_equal(got[~nan].view(bits), want[~nan].view(bits))


def test_decode_to_float64_with_x64():
    codes = every_code("e5m2")
    with jax.enable_x64(True):
        got = np.asarray(lowprec.decode(codes, "e5m2", dtype=jnp.float64))
    assert got.dtype == np.float64
    want = ml_dtypes_values("e5m2", codes).astype(np.float64)
    assert np.array_equal(got, want, equal_nan=True)


@pytest.mark.parametrize(
    "fmt,codes,high",
    [
        ("e2m1", np.arange(16, dtype=np.uint8), 0xF0),  # high nibble of a byte
        ("e4m3", np.arange(256, dtype=np.int32), 0x7FFF_FF00),  # int32 codes, bits 8..30 set
        ("tf32", np.arange(0, 1 << 19, 97, dtype=np.uint32), 0xFFF8_0000),  # bits 19..31
    ],
)
def test_decode_ignores_bits_above_the_code_width(fmt, codes, high):
    # decode's docstring: "Bits above the format's width are ignored."
    plain = np.asarray(lowprec.decode(codes, fmt))
    dirty = np.asarray(lowprec.decode(codes | codes.dtype.type(high), fmt))
    assert_same_values(dirty, plain, codes, f"{fmt} high bits")


def test_decode_accepts_signed_codes():
    # int8 -128 = 0x80 (e4m3 -0), -1 = 0xFF (e4m3 NaN), 0x38 = 1.0, -72 = 0xB8 (-1.0).
    got = np.asarray(lowprec.decode(np.array([-128, -1, 0x38, -72], np.int8), "e4m3"))
    assert got[0] == 0 and np.signbit(got[0])
    assert np.isnan(got[1])
    assert got[2:].tolist() == [1.0, -1.0]


# ============================================================================================
# Default mode (nearest_even, "ieee") == ml_dtypes astype, bit for bit.

N_RANDOM = 1 << 21


def _random_float32(seed: int, n: int = N_RANDOM) -> np.ndarray:
    bits = np.random.default_rng(seed).integers(0, 1 << 32, size=n, dtype=np.uint64)
    return bits.astype(np.uint32).view(np.float32)



def _assert_codes_match_nan_aware(fmt, got, want_codes, want_values, x):
    # NaN payloads aside (docs/design.md §2): where the expected value is NaN, lowprec's must be NaN;
    # everywhere else the codes are equal. Which codes are NaN, the oracle says (ml_dtypes;
    # TF32: the float32 of the code's bits shifted up 13), not lowprec's decode.
    if fmt == "tf32":
        got_nan = np.isnan((np.asarray(got).astype(np.uint32) << 13).view(np.float32))
    else:
        got_nan = np.isnan(ml_dtypes_values(fmt, got))
    assert_codes_equal(got, want_codes, x, fmt, nan=(got_nan, np.isnan(want_values)))


@element_cases(formats="with_ml_dtypes", impls="lowprec")
def test_default_encode_matches_ml_dtypes_on_random_bit_patterns(
    fmt, codec):
    # 2^21 uniformly random float32 bit patterns: every sign/exponent combination (NaNs, infs
    # and subnormals about 1/256 of them each), with random low bits.
    x = _random_float32(seed=sum(map(ord, fmt)))
    want = ml_dtypes_codes(fmt, x)
    got = codec.encode(fmt, x)
    assert got.dtype == SPEC_CODE_DTYPE[fmt]
    _assert_codes_match_nan_aware(fmt, got, want, ml_dtypes_values(fmt, want), x)


@element_cases(formats="with_ml_dtypes", impls="all")
def test_default_encode_matches_ml_dtypes_on_adversarial_inputs(fmt, codec):
    x = adversarial(fmt)
    got = sweep(codec.name, fmt, "nearest_even", "ieee")
    want = ml_dtypes_codes(fmt, x)
    _assert_codes_match_nan_aware(fmt, got, want, ml_dtypes_values(fmt, want), x)


# Quick tier: the formats of QUICK_ELEMENTS (the exact widening before rounding is
# format-blind; every format's rounding runs quick in the float32 sweeps).
@pytest.mark.quick_cases(fmt=QUICK_ELEMENTS)
@pytest.mark.parametrize("in_dtype", [np.float16, ml_dtypes.bfloat16], ids=["f16", "bf16"])
@element_cases(formats="with_ml_dtypes", impls="lowprec")
def test_default_encode_of_every_half_precision_value_matches_ml_dtypes(
    fmt, codec, in_dtype):
    # Every float16 / bfloat16 bit pattern as input. Widening to float32 is exact, so the
    # ml_dtypes codes of the widened values are the correctly rounded ones.
    x = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(in_dtype)
    wide = x.astype(np.float32)
    want = ml_dtypes_codes(fmt, wide)
    got = codec.encode(fmt, x)
    _assert_codes_match_nan_aware(fmt, got, want, ml_dtypes_values(fmt, want), wide)


def _tf32_by_reduce_precision(x: np.ndarray):
    rp = np.asarray(lax.reduce_precision(jnp.asarray(x), exponent_bits=8, mantissa_bits=10))
    bits = bit_pattern(rp)
    finite_or_inf = ~np.isnan(rp)
    assert not (bits[finite_or_inf] & 0x1FFF).any()  # a TF32 value: low 13 bits zero
    return (bits >> 13).astype(np.uint32), rp


@element_cases(impls="lowprec")
def test_tf32_default_equals_reduce_precision_on_random_bit_patterns(codec):
    # docs/design.md §2: TF32 nearest_even = lax.reduce_precision(x, 8, 10); TF32 code = top 19 bits.
    x = _random_float32(seed=19)
    want, rp = _tf32_by_reduce_precision(x)
    _assert_codes_match_nan_aware("tf32", codec.encode("tf32", x), want, rp, x)


@element_cases(impls="all")
def test_tf32_default_equals_reduce_precision_on_adversarial_inputs(codec):
    x = adversarial("tf32")
    want, rp = _tf32_by_reduce_precision(x)
    _assert_codes_match_nan_aware("tf32", sweep(codec.name, "tf32", "nearest_even", "ieee"),
                                  want, rp, x)


# ============================================================================================
# Every (format, rounding, overflow) on the adversarial sets.


@element_cases(impls="lowprec")
def test_every_mode_matches_reference_on_adversarial_inputs(fmt, rounding, overflow, codec):
    # Ties in every binade (subnormal ones included), their float32 neighbours, the overflow
    # threshold, float32 subnormals, +-0, +-inf, NaNs; stochastic with a fixed key.
    got = sweep(codec.name, fmt, rounding, overflow)
    want = sweep("reference", fmt, rounding, overflow)
    assert got.dtype == want.dtype == SPEC_CODE_DTYPE[fmt]
    assert_codes_equal(got, want, adversarial(fmt), f"{fmt} {rounding} {overflow}")


@element_cases(impls="all")
def test_exactly_representable_values_are_unchanged(fmt, rounding, overflow, codec):
    # A value of the format is its own rounding in every mode (stochastic included) and under
    # both overflow policies. The exact inputs are found with the reference: the finite x whose
    # nearest code decodes back to x; their code must not depend on the mode.
    x = adversarial(fmt)
    nearest = sweep("reference", fmt, "nearest_even", "ieee")
    exact = np.isfinite(x) & (ref_values(fmt, nearest) == x)
    if not lowprec_formats.ELEMENT_FORMATS[fmt]["zero"]:
        exact &= x != 0  # e8m0 has no zero
    got = sweep(codec.name, fmt, rounding, overflow)
    assert_codes_equal(got[exact], nearest[exact], x[exact], f"{fmt} {rounding} {overflow}")
    if code_bits(fmt) <= 8:  # the adversarial set holds every finite value of these formats
        values = ref_values(fmt, every_code(fmt))
        # ... except MX INT8's -2 (code 0x80): encoders keep the symmetric range +-127/64
        # (docs/design.md §1), so -2 rounds to -127/64 and its code is decode-only.
        finite = np.isfinite(values) & (np.abs(values) <= float(SPEC_MAX_FINITE[fmt]))
        assert set(nearest[exact].tolist()) == set(every_code(fmt)[finite].tolist())


def _sorted_non_nan(x):
    keep = ~np.isnan(x)
    order = np.argsort(x[keep], kind="stable")
    return np.flatnonzero(keep)[order]


@element_cases(roundings="deterministic", impls="all")
def test_deterministic_modes_are_monotonic(fmt, rounding, overflow, codec):
    # x <= y  =>  q(x) <= q(y), for every non-stochastic mode, on the adversarial set sorted by
    # value (+-inf included). Results that are NaN (e4m3 overflow, e8m0 of x <= 0) have no
    # order and are skipped.
    x = adversarial(fmt)
    idx = _sorted_non_nan(x)
    q = ref_values(fmt, sweep(codec.name, fmt, rounding, overflow))[idx]
    q = q[~np.isnan(q)]
    with np.errstate(invalid="ignore"):  # inf - inf
        drops = np.flatnonzero(np.diff(q) < 0)
    assert drops.size == 0, f"not monotonic: q goes {q[drops[0]]} -> {q[drops[0] + 1]}"


def _in_range(fmt, x):
    """Finite x with |x| <= max finite (and x >= 2^-127 for e8m0, which has no zero; x >= 0
    for the other unsigned formats, whose negative inputs encode to NaN)."""
    m = float(SPEC_MAX_FINITE[fmt])
    with np.errstate(invalid="ignore"):
        ok = np.isfinite(x) & (np.abs(x.astype(np.float64)) <= m)
    if fmt == "e8m0":
        ok &= x >= float(SPEC_MIN_POSITIVE["e8m0"])
    elif lowprec_formats.ELEMENT_FORMATS[fmt]["sign_bits"] == 0:
        ok &= ~np.signbit(x)
    return ok


@element_cases(impls="all")
def test_directed_modes_bracket_the_input(fmt, overflow, codec
):
    # down(x) <= x <= up(x) and |toward_zero(x)| <= |x|, for x within the format's range (past
    # it, "saturate" and E2M1's clamping return max < x by design; below 2^-127 E8M0 has only
    # 2^-127 to offer). Both neighbours are actually used: the bounds are not vacuous.
    x = adversarial(fmt)
    ok = _in_range(fmt, x)
    xs = x[ok].astype(np.float64)
    down = ref_values(fmt, sweep(codec.name, fmt, "down", overflow))[ok]
    up = ref_values(fmt, sweep(codec.name, fmt, "up", overflow))[ok]
    tz = ref_values(fmt, sweep(codec.name, fmt, "toward_zero", overflow))[ok]
    assert (down <= xs).all() and (xs <= up).all()
    assert (np.abs(tz) <= np.abs(xs)).all()
    assert ((down < xs) & (xs < up)).sum() > 100  # many inputs strictly between neighbours
    assert ((tz == down) | (tz == up)).all()  # toward zero is one of the two neighbours


@element_cases(roundings="nearest", impls="all")
def test_nearest_modes_pick_the_nearer_neighbour(fmt, rounding, overflow, codec):
    # nearest(x) is down(x) or up(x), and no farther from x than the other one. Exceptions by
    # design: E8M0's default-mode quirk in (2^-127, 2^-126) (docs/design.md §2), checked elsewhere.
    x = adversarial(fmt)
    ok = _in_range(fmt, x)
    if fmt == "e8m0" and overflow == "ieee":
        ok &= ~((x > 2.0**-127) & (x < 2.0**-126))
    xs = x[ok].astype(np.float64)
    near = ref_values(fmt, sweep(codec.name, fmt, rounding, overflow))[ok]
    down = ref_values(fmt, sweep("reference", fmt, "down", overflow))[ok]
    up = ref_values(fmt, sweep("reference", fmt, "up", overflow))[ok]
    assert ((near == down) | (near == up)).all()
    # Differences of float32-exact values: exact in float64 except in the far tails, where
    # they are still correctly ordered (a single rounding of each side is monotonic).
    assert (np.abs(near - xs) <= np.minimum(xs - down, up - xs)).all()


@element_cases(formats=["e8m0"], impls="all")
def test_e8m0_floor_and_ceil_are_down_and_up(overflow, codec):
    for alias, mode in (("floor", "down"), ("ceil", "up")):
        assert_codes_equal(
            sweep(codec.name, "e8m0", alias, overflow), sweep(codec.name, "e8m0", mode, overflow),
            what=f"e8m0 {alias} vs {mode}",
        )


# -- Rounding and Overflow members are the names --------------------------------------------


def test_rounding_and_overflow_members_are_the_documented_names():
    # docs/design.md §2: the six modes and two policies of formats/elements.json, plus E8M0's
    # floor and ceil. Members are their strings (equal, same hash, str() is the name), and
    # each documents itself.
    names = lowprec_formats.ROUNDING_MODES + ("floor", "ceil")
    assert tuple(m.value for m in lowprec.Rounding) == names
    assert tuple(p.value for p in lowprec.Overflow) == lowprec_formats.OVERFLOW_POLICIES
    for enum_type in (lowprec.Rounding, lowprec.Overflow):
        for member in enum_type:
            assert enum_type(member.value) is member
            assert member == member.value and hash(member) == hash(member.value)
            assert str(member) == f"{member}" == member.value
            assert member.__doc__ and member.__doc__ != enum_type.__doc__


@element_cases(roundings="deterministic", impls=("eager",))
def test_members_encode_as_the_reference_does_their_names(fmt, rounding, overflow, codec):
    # Every encoder entry point accepts the members where it accepts the strings.
    x = adversarial(fmt)
    got = codec.encode(fmt, x, lowprec.Rounding(rounding), lowprec.Overflow(overflow))
    assert_codes_equal(got, sweep("reference", fmt, rounding, overflow), x,
                       f"{fmt} {rounding} {overflow}")


def test_validation_returns_members():
    from lowprec._options import ElementCast

    cast = ElementCast("e8m0", "floor", "saturate")
    assert cast.rounding is lowprec.Rounding.DOWN and cast.overflow is lowprec.Overflow.SATURATE
    assert ElementCast("e8m0", lowprec.Rounding.CEIL).rounding is lowprec.Rounding.UP


# ============================================================================================
# Hand-derived codes. Each case: (format, rounding, overflow, x, code), with the derivation.
# e4m3: bias 7, 3 mantissa bits, 1.0 = 0 0111 000 = 0x38, max 0 1111 110 = 1.75*2^8 = 448,
#   NaN = S 1111 111, no inf, min subnormal 2^(1-7-3) = 2^-9.
# e5m2: bias 15, 2 mantissa bits, max 0 11110 11 = 1.75*2^15 = 57344, inf 0x7C.
# e2m1: bias 1, 1 mantissa bit, codes 0..7 = 0, .5, 1, 1.5, 2, 3, 4, 6; sign = 0b1000.
# e8m0: code k = 2^(k-127); 0xFE = 2^127 max, 0xFF NaN, 0x00 = 2^-127.
# fp16: bias 15, 10 mantissa bits, 1.0 = 0x3C00, max 0x7BFF = 65504, inf 0x7C00.
# bf16: 1.0 = 0x3F80; tf32: the top 19 bits of the float32, 1.0 = 0x3F800000 >> 13 = 0x1FC00.

NE, NA, TZ, UP, DN = "nearest_even", "nearest_away", "toward_zero", "up", "down"
IEEE, SAT = "ieee", "saturate"
INF, NAN = float("inf"), float("nan")

HAND_CASES = [
    # --- e4m3
    ("e4m3", NE, IEEE, 1.0, 0x38, "exponent field 7, mantissa 0"),
    ("e4m3", NE, IEEE, 448.0, 0x7E, "max finite"),
    ("e4m3", NE, IEEE, 464.0, 0x7E, "464 = 448 + 16, the midpoint of 448 (mantissa 110, even) and "
     "480 (mantissa 111 in the extended grid, odd): ties-to-even keeps 448"),
    ("e4m3", NE, IEEE, 465.0, 0x7F, "past the midpoint: 480 > max overflows; no inf, so NaN"),
    ("e4m3", NE, IEEE, -465.0, 0xFF, "same, sign bit kept on the NaN"),
    ("e4m3", NA, IEEE, 464.0, 0x7F, "tie away from zero -> 480 -> overflow -> NaN"),
    ("e4m3", NE, SAT, 465.0, 0x7E, "saturate: overflow clamps to 448"),
    ("e4m3", NE, SAT, 1e30, 0x7E, "saturate"),
    ("e4m3", NE, IEEE, INF, 0x7F, "ieee: +inf -> NaN (no inf in e4m3fn)"),
    ("e4m3", NE, SAT, INF, 0x7E, "saturate: +inf -> +448"),
    ("e4m3", NE, SAT, -INF, 0xFE, "saturate: -inf -> -448"),
    ("e4m3", NE, SAT, NAN, 0x7F, "NaN stays NaN under saturate"),
    ("e4m3", TZ, IEEE, 1000.0, 0x7E, "IEEE 7.4: toward zero carries overflow to max"),
    ("e4m3", UP, IEEE, 1000.0, 0x7F, "toward +inf carries positive overflow to inf -> NaN code"),
    ("e4m3", DN, IEEE, 1000.0, 0x7E, "toward -inf carries positive overflow to +max"),
    ("e4m3", UP, IEEE, -1000.0, 0xFE, "toward +inf carries negative overflow to -max"),
    ("e4m3", DN, IEEE, -1000.0, 0xFF, "toward -inf carries negative overflow to -inf -> NaN"),
    ("e4m3", NE, IEEE, 1.0625, 0x38, "1 + 1/16: midpoint of 1 (0x38, even) and 1.125 (0x39)"),
    ("e4m3", NA, IEEE, 1.0625, 0x39, "tie away from zero"),
    ("e4m3", NE, IEEE, -1.0625, 0xB8, "negative tie, even"),
    ("e4m3", NA, IEEE, -1.0625, 0xB9, "negative tie, away"),
    ("e4m3", NE, IEEE, 0.1, 0x1D, "float32 0.1 = 0.100000001 in [2^-4, 2^-3), step 2^-7: "
     "0.1 / 2^-7 = 12.8 -> 13 = 8 + 5: exponent field -4 + 7 = 3, mantissa 5: 0 0011 101"),
    ("e4m3", NE, IEEE, 2.0**-9, 0x01, "min subnormal"),
    ("e4m3", NE, IEEE, 2.0**-10, 0x00, "midpoint of 0 (even) and 2^-9: rounds to +0"),
    ("e4m3", NA, IEEE, 2.0**-10, 0x01, "same tie, away from zero"),
    ("e4m3", NE, IEEE, -(2.0**-10), 0x80, "negative tie to zero keeps the sign: -0"),
    ("e4m3", NE, IEEE, 3 * 2.0**-11, 0x01, "0.75 * 2^-9 is nearer 2^-9"),
    ("e4m3", NE, IEEE, 7 * 2.0**-10, 0x04, "3.5 * 2^-9: tie, 3 (odd) / 4 (even) steps"),
    ("e4m3", UP, IEEE, 2.0**-20, 0x01, "up: tiny positive -> min subnormal"),
    ("e4m3", DN, IEEE, 2.0**-20, 0x00, "down: tiny positive -> +0"),
    ("e4m3", DN, IEEE, -(2.0**-20), 0x81, "down: tiny negative -> -min subnormal"),
    ("e4m3", TZ, IEEE, -(2.0**-20), 0x80, "toward zero: tiny negative -> -0"),
    ("e4m3", UP, IEEE, -(2.0**-20), 0x80, "up: tiny negative -> -0"),
    ("e4m3", NE, IEEE, -0.0, 0x80, "-0 keeps its sign"),
    ("e4m3", TZ, IEEE, 447.0, 0x7D, "447 in [256, 512), step 32: 416 + 31 -> 416 = 0 1111 101"),
    # --- e5m2
    ("e5m2", NE, IEEE, 57344.0, 0x7B, "max finite"),
    ("e5m2", NE, IEEE, 61439.0, 0x7B, "below the midpoint 61440 of 57344 and 65536"),
    ("e5m2", NE, IEEE, 61440.0, 0x7C, "midpoint of 57344 (mantissa 11, odd) and 65536 (even, "
     "exponent field 31 = inf): ties-to-even -> 65536 -> overflow -> +inf"),
    ("e5m2", NE, IEEE, -61440.0, 0xFC, "-inf"),
    ("e5m2", TZ, IEEE, 61440.0, 0x7B, "toward zero -> max"),
    ("e5m2", NE, SAT, 61440.0, 0x7B, "saturate -> max"),
    ("e5m2", NE, SAT, -INF, 0xFB, "saturate: -inf -> -max"),
    ("e5m2", TZ, IEEE, INF, 0x7C, "inf converts exactly to inf in every mode"),
    ("e5m2", UP, IEEE, -1e6, 0xFB, "toward +inf: negative overflow -> -max"),
    ("e5m2", DN, IEEE, -1e6, 0xFC, "toward -inf: negative overflow -> -inf"),
    ("e5m2", NE, IEEE, 2.0**-16, 0x01, "min subnormal 2^(1-15-2)"),
    ("e5m2", NE, IEEE, 1.125, 0x3C, "midpoint of 1 (0x3C, even) and 1.25 (0x3D)"),
    ("e5m2", NE, IEEE, 1.375, 0x3E, "midpoint of 1.25 (0x3D, odd) and 1.5 (0x3E, even)"),
    # --- e2m1
    ("e2m1", NE, IEEE, 5.0, 0x6, "midpoint of 4 (0b110, even) and 6 (0b111)"),
    ("e2m1", NA, IEEE, 5.0, 0x7, "tie away -> 6"),
    ("e2m1", NE, IEEE, 7.0, 0x7, "midpoint of 6 (odd) and 8 (even, overflow): no inf or NaN, "
     "so ieee saturates to 6"),
    ("e2m1", NE, IEEE, 100.0, 0x7, "saturates"),
    ("e2m1", NE, IEEE, -100.0, 0xF, "saturates to -6"),
    ("e2m1", NE, IEEE, INF, 0x7, "no inf: +6"),
    ("e2m1", UP, IEEE, INF, 0x7, "no inf: +6"),
    ("e2m1", NE, IEEE, -INF, 0xF, "no inf: -6"),
    ("e2m1", NE, IEEE, 0.25, 0x0, "midpoint of 0 (even) and 0.5 (odd)"),
    ("e2m1", NA, IEEE, 0.25, 0x1, "tie away -> 0.5"),
    ("e2m1", NE, IEEE, 0.75, 0x2, "midpoint of 0.5 (code 1, odd) and 1.0 (code 2, even)"),
    ("e2m1", NE, IEEE, 2.5, 0x4, "midpoint of 2 (code 4, even) and 3 (code 5)"),
    ("e2m1", NE, IEEE, 3.5, 0x6, "midpoint of 3 (code 5, odd) and 4 (code 6, even)"),
    ("e2m1", NE, IEEE, NAN, 0x8, "no NaN code: +NaN -> 0b1000 (-0), as ml_dtypes"),
    ("e2m1", NE, IEEE, -NAN, 0x0, "-NaN -> 0b0000 (+0), as ml_dtypes"),
    ("e2m1", TZ, SAT, NAN, 0x8, "the NaN rule does not depend on mode or policy"),
    ("e2m1", NE, IEEE, -0.0, 0x8, "-0"),
    ("e2m1", UP, IEEE, 0.1, 0x1, "up -> 0.5"),
    ("e2m1", DN, IEEE, 0.1, 0x0, "down -> +0"),
    ("e2m1", DN, IEEE, -0.1, 0x9, "down -> -0.5"),
    ("e2m1", UP, IEEE, -0.1, 0x8, "up -> -0"),
    ("e2m1", TZ, IEEE, 5.9, 0x6, "toward zero -> 4"),
    ("e2m1", UP, IEEE, 4.1, 0x7, "up -> 6"),
    # --- e8m0
    ("e8m0", NE, IEEE, 1.0, 127, "2^0"),
    ("e8m0", NE, IEEE, 3.0, 129, "3 = 1.5 * 2^1, midpoint of 2 (significand 1, odd, on the 2^1 "
     "grid) and 4 (significand 2, even): ties-to-even -> 4 = 2^2"),
    ("e8m0", NA, IEEE, 3.0, 129, "tie away -> 4"),
    ("e8m0", NE, IEEE, 0.75, 127, "midpoint of 0.5 and 1 -> 1"),
    ("e8m0", NE, IEEE, 2.9, 128, "nearer 2"),
    ("e8m0", "floor", IEEE, 3.0, 128, "floor -> 2"),
    ("e8m0", "ceil", IEEE, 3.0, 129, "ceil -> 4"),
    ("e8m0", "floor", IEEE, 0.75, 126, "floor -> 0.5"),
    ("e8m0", "ceil", IEEE, 2.0, 128, "exact"),
    ("e8m0", NE, IEEE, 0.0, 0xFF, "no zero: NaN"),
    ("e8m0", DN, SAT, 0.0, 0xFF, "no zero: NaN, in every mode and policy"),
    ("e8m0", NE, IEEE, -1.0, 0xFF, "no sign: NaN"),
    ("e8m0", NE, IEEE, NAN, 0xFF, "NaN"),
    ("e8m0", NE, IEEE, INF, 0xFF, "ieee: inf -> NaN"),
    ("e8m0", NE, SAT, INF, 0xFE, "saturate: inf -> 2^127"),
    ("e8m0", NE, IEEE, 2.0**127, 0xFE, "max"),
    ("e8m0", NE, IEEE, 1.5 * 2.0**127, 0xFF, "tie of 2^127 and 2^128 -> 2^128: overflow -> NaN"),
    ("e8m0", NE, SAT, 1.5 * 2.0**127, 0xFE, "saturate"),
    ("e8m0", TZ, IEEE, 1.5 * 2.0**127, 0xFE, "toward zero -> 2^127"),
    ("e8m0", NE, IEEE, 2.0**-127, 0x00, "2^-127 (a float32 subnormal) is code 0"),
    ("e8m0", NE, IEEE, 2.0**-130, 0x00, "below 2^-127 -> 0x00"),
    ("e8m0", UP, IEEE, 2.0**-149, 0x00, "up from the smallest float32 -> 2^-127"),
    ("e8m0", NE, IEEE, 1.1 * 2.0**-127, 0x01, "docs/design.md §2 quirk: (2^-127, 2^-126) -> 2^-126"),
    ("e8m0", NE, SAT, 1.1 * 2.0**-127, 0x00, "saturate rounds to nearest: 1.1 < 1.5 -> 2^-127"),
    ("e8m0", NA, SAT, 1.5 * 2.0**-127, 0x01, "tie -> up"),
    ("e8m0", DN, IEEE, 1.9 * 2.0**-127, 0x00, "down -> 2^-127"),
    ("e8m0", UP, IEEE, 1.1 * 2.0**-127, 0x01, "up -> 2^-126"),
    # --- fp16
    ("fp16", NE, IEEE, 65504.0, 0x7BFF, "max"),
    ("fp16", NE, IEEE, 65519.0, 0x7BFF, "below the midpoint 65520 of 65504 and 65536"),
    ("fp16", NE, IEEE, 65520.0, 0x7C00, "midpoint; 65504 has odd mantissa 0x3FF -> 65536 = inf"),
    ("fp16", TZ, IEEE, 65520.0, 0x7BFF, "toward zero -> max"),
    ("fp16", NE, SAT, 1e6, 0x7BFF, "saturate"),
    ("fp16", NE, IEEE, 2.0**-24, 0x0001, "min subnormal"),
    ("fp16", NE, IEEE, 2.0**-25, 0x0000, "midpoint of 0 (even) and 2^-24"),
    ("fp16", NE, IEEE, 3 * 2.0**-26, 0x0001, "0.75 * 2^-24 -> 2^-24"),
    ("fp16", NE, IEEE, 1 + 2.0**-11, 0x3C00, "midpoint of 1 (even) and 1 + 2^-10"),
    ("fp16", NE, IEEE, 1 + 3 * 2.0**-11, 0x3C02, "midpoint of 0x3C01 (odd) and 0x3C02"),
    ("fp16", NE, IEEE, -2.0, 0xC000, "-2: sign, exponent field 16"),
    # --- bf16
    ("bf16", NE, IEEE, 1 + 2.0**-8, 0x3F80, "midpoint of 1 (even) and 1 + 2^-7"),
    ("bf16", NE, IEEE, 1 + 3 * 2.0**-8, 0x3F82, "midpoint of 0x3F81 (odd) and 0x3F82"),
    ("bf16", NE, IEEE, float(np.float32(3.4028235e38)), 0x7F80,
     "float32 max 0x7F7FFFFF: low half 0xFFFF > 0x8000 rounds up to 0x7F80 = inf"),
    ("bf16", NE, SAT, float(np.float32(3.4028235e38)), 0x7F7F, "saturate"),
    ("bf16", NE, IEEE, 2.0**-149, 0x0000, "smallest float32 -> +0 (bf16 min subnormal 2^-133)"),
    ("bf16", UP, IEEE, 2.0**-149, 0x0001, "up -> 2^-133"),
    # --- tf32
    ("tf32", NE, IEEE, 1.0, 0x1FC00, "0x3F800000 >> 13"),
    ("tf32", NE, IEEE, 1 + 2.0**-11, 0x1FC00, "midpoint of 1 (even) and 1 + 2^-10"),
    ("tf32", NE, IEEE, 1 + 3 * 2.0**-11, 0x1FC02, "midpoint of 0x1FC01 (odd) and 0x1FC02"),
    ("tf32", NA, IEEE, 1 + 2.0**-11, 0x1FC01, "tie away"),
    ("tf32", NE, IEEE, -2.0, 0x60000, "0xC0000000 >> 13"),
]


def _hand_input(x: float) -> np.float32:
    if math.isnan(x):  # np.float32(-nan) keeps the sign bit; make sure
        bits = 0x7FC00000 | (0x80000000 if math.copysign(1, x) < 0 else 0)
        return np.array([bits], np.uint32).view(np.float32)[0]
    return np.float32(x)  # e.g. 0.1, 5.9 round to float32; derivations allow for it


@element_cases(impls="all")
def test_hand_derived_codes(codec):
    # One encode per (format, rounding, overflow) of the table, its cases as one array (the
    # padded program the sweeps compile); each case is checked and named on failure.
    groups: dict = {}
    for case in HAND_CASES:
        groups.setdefault(case[:3], []).append(case)
    wrong = []
    for (fmt, rounding, overflow), cases in groups.items():
        x32 = np.array([_hand_input(c[3]) for c in cases], np.float32)
        got = codec.encode(fmt, x32, rounding, overflow)
        assert got.shape == x32.shape
        for (_, _, _, x, code, why), g in zip(cases, got.tolist()):
            if g != code:
                wrong.append(f"{fmt} {rounding} {overflow} x={x!r}: got {g:#x}, want {code:#x} "
                             f"({why})")
    assert not wrong, f"{codec}: {len(wrong)} of {len(HAND_CASES)} hand-derived codes differ:\n" \
                      + "\n".join(wrong)


# ============================================================================================
# Stochastic rounding.

# (format, x, lower code, upper code, frac) with x = lo + frac (hi - lo), derived by hand.
STOCHASTIC_RULE_CASES = [
    ("e2m1", 0.25, 0x0, 0x1, Fraction(1, 2)),  # between 0 and 0.5
    ("e2m1", 1.25, 0x2, 0x3, Fraction(1, 2)),  # between 1 and 1.5
    ("e2m1", 5.0, 0x6, 0x7, Fraction(1, 2)),  # between 4 and 6
    ("e2m1", -2.5, 0xC, 0xD, Fraction(1, 2)),  # between -2 and -3
    ("e2m1", 2.25, 0x4, 0x5, Fraction(1, 4)),  # between 2 and 3
    ("e2m1", 0.375, 0x0, 0x1, Fraction(3, 4)),  # between 0 and 0.5
    ("e4m3", 1 + 2.0**-5, 0x38, 0x39, Fraction(1, 4)),  # between 1 and 1.125
    ("e4m3", -(1 + 7 * 2.0**-6), 0xB8, 0xB9, Fraction(7, 8)),  # between -1 and -1.125
    ("e8m0", 1.25, 127, 128, Fraction(1, 4)),  # between 1 and 2
    ("e8m0", 3.5, 128, 129, Fraction(3, 4)),  # between 2 and 4
    ("e8m0", 1.5 * 2.0**-127, 0, 1, Fraction(1, 2)),  # between 2^-127 and 2^-126
    ("fp16", 1 + 2.0**-12, 0x3C00, 0x3C01, Fraction(1, 4)),  # between 1 and 1 + 2^-10
]


@pytest.mark.parametrize("fmt,shape", [("e2m1", (3, 4)), ("e4m3", ()), ("e8m0", (5,))],
                         ids=str)
@element_cases(impls="all")
def test_stochastic_uses_the_documented_random_words(fmt, shape, codec):
    # Element i rounds up iff random_bits(key, x.shape)[i] < frac_i * 2^16, the 16-bit words
    # being the word hash keyed by jax.random.bits(key, (2,), uint32), replayed here by the
    # NumPy reference. lowprec is called directly (no padding): the words are those of x's
    # shape. The reference takes 32-bit words compared with frac * 2^32; r * 2^16 decides alike.
    key = jax.random.key(7)
    cases = [c for c in STOCHASTIC_RULE_CASES if c[0] == fmt]
    size = int(np.prod(shape))
    words = replay_random_bits(key, shape).reshape(-1)
    assert words.dtype == np.uint16
    x = np.array([cases[i % len(cases)][1] for i in range(size)], np.float32).reshape(shape)
    want = [
        hi if words[i] < frac * 2**16 else lo
        for i, (_, _, lo, hi, frac) in enumerate(cases[i % len(cases)] for i in range(size))
    ]
    if codec.is_reference:
        import lowprec_reference

        got = lowprec_reference.encode(fmt, x, "stochastic",
                                       random_bits=reference_words(words).reshape(shape))
    elif codec.name == "eager":
        got = lowprec.encode(x, fmt, rounding="stochastic", key=key)
    else:
        got = jax.jit(lambda v, k: lowprec.encode(v, fmt, rounding="stochastic", key=k))(x, key)
    got = np.asarray(got)
    assert got.shape == shape
    assert got.reshape(-1).tolist() == want


@element_cases(impls="all")
def test_stochastic_rounds_to_one_of_the_two_neighbours(fmt, overflow, codec):
    # The result is the reference's toward-zero or away-from-zero rounding of x (up for x > 0,
    # down for x < 0), under the same overflow policy; both occur.
    x = adversarial(fmt)
    got = sweep(codec.name, fmt, "stochastic", overflow)
    tz = sweep("reference", fmt, "toward_zero", overflow)
    away = np.where(np.signbit(x), sweep("reference", fmt, "down", overflow),
                    sweep("reference", fmt, "up", overflow))
    bad = (got != tz) & (got != away)
    assert not bad.any(), f"x={x[bad][:5]} got={got[bad][:5]} tz={tz[bad][:5]} away={away[bad][:5]}"
    differ = tz != away
    assert (got[differ] == tz[differ]).sum() > 100 and (got[differ] == away[differ]).sum() > 100


# Unbiasedness. For an in-range x between neighbours lo < hi (magnitudes), x = lo + frac (hi -
# lo), the magnitude rounds away from zero iff the element's 16-bit word r < frac 2^16
# (docs/design.md §2). The words are uniform on {0, ..., 2^16 - 1}, and the r below frac 2^16
# are 0 .. ceil(frac 2^16) - 1, so the magnitude rounds up with probability
#     p = ceil(frac 2^16) / 2^16,   0 <= p - frac < 2^-16
# (p = frac exactly when frac is a multiple of 2^-16), and E[q(x)] = x + (p - frac)(hi - lo).
# With N independent words, the fraction p_hat of ups obeys Hoeffding's inequality
#     P(|p_hat - p| >= t) <= 2 exp(-2 N t^2),
# exact for every N (no normal approximation). Choosing t = sqrt(ln(2 / delta) / (2 N)) with
# delta = 2e-9 (the two-sided 6-sigma normal tail, 2 Phi(-6) = 1.97e-9) bounds the false-
# failure probability of each check by 2e-9, and of this whole test (7 formats x 2
# implementations x 6 values = 84 checks) by 1.7e-7 (union bound). The key is fixed, so the
# outcome is deterministic; the probability is over the choice of key. With N = 2^15,
# t = sqrt(ln(1e9) / 2^16) = 0.0178: any rule that ignores frac (always down, always up,
# nearest) is off by >= 0.1 in p for the values below and fails. (Small biases are the
# business of the bit-exact comparison with the reference.)
N_STOCHASTIC = 1 << 15
DELTA = 2e-9
T_HOEFFDING = math.sqrt(math.log(2 / DELTA) / (2 * N_STOCHASTIC))

# (base b, grid step u) of a binade per format, and the subnormal step (0 for e8m0, whose
# lowest interval (2^-127, 2^-126) is used instead). x = +-(b + f u) for f below.
_STOCHASTIC_GRID = {
    "fp16": (1.0, 2.0**-10, 2.0**-24),
    "bf16": (1.0, 2.0**-7, 2.0**-133),
    "tf32": (1.0, 2.0**-10, 2.0**-136),
    "e4m3": (256.0, 32.0, 2.0**-9),
    "e5m2": (2.0**-14, 2.0**-16, 2.0**-16),
    "e2m1": (2.0, 1.0, 0.5),
    "e8m0": (1.0, 1.0, None),
}


def _stochastic_values(fmt):
    b, u, sub = _STOCHASTIC_GRID[fmt]
    vals = [b + 0.25 * u, -(b + 0.1 * u), b + 0.5 * u, -(b + 0.9 * u), b + 0.7 * u]
    vals.append(0.3 * sub if sub else 2.0**-127 * 1.3)
    if fmt == "e8m0":  # unsigned: negatives are NaN
        vals = [abs(v) for v in vals]
    return np.array(vals, np.float32)  # 0.1 u etc. round to float32; frac is computed exactly


# One format per code path of the encoder (16-bit, 19-bit, 8-bit with and without inf, 4-bit,
# unsigned): the formats added later share these paths, and each of their modes is compared
# bit for bit with the reference, stochastic included.
@element_cases(formats="original_elements", impls="lowprec")
def test_stochastic_rounding_is_unbiased(fmt, codec):
    xs = _stochastic_values(fmt)
    x = np.repeat(xs, N_STOCHASTIC)
    key = jax.random.key(0)
    if codec.name == "eager":
        codes = np.asarray(lowprec.encode(x, fmt, rounding="stochastic", key=key))
    else:
        codes = np.asarray(
            jax.jit(lambda v, k: lowprec.encode(v, fmt, rounding="stochastic", key=k))(x, key)
        )
    # Neighbours by the reference: toward zero, and away from zero (up for x > 0, else down).
    lo_codes = reference.encode(fmt, xs, "toward_zero")
    hi_codes = np.where(xs < 0, reference.encode(fmt, xs, "down"), reference.encode(fmt, xs, "up"))
    lo_v, hi_v = ref_values(fmt, lo_codes), ref_values(fmt, hi_codes)
    for j, xj in enumerate(xs):
        c = codes[j * N_STOCHASTIC:(j + 1) * N_STOCHASTIC]
        assert lo_codes[j] != hi_codes[j]
        assert np.isin(c, [lo_codes[j], hi_codes[j]]).all()
        frac = (abs(Fraction(float(xj))) - abs(Fraction(lo_v[j]))) / (
            abs(Fraction(hi_v[j])) - abs(Fraction(lo_v[j]))
        )
        p = Fraction(math.ceil(frac * 2**16), 2**16)  # exact: frac is a Fraction
        assert 0 <= p - frac < Fraction(1, 2**16)
        p_hat = float(np.mean(c == hi_codes[j]))
        assert abs(p_hat - float(p)) <= T_HOEFFDING, (fmt, float(xj), p_hat, float(p))
        # The same statement for the mean value: mean q - x = (p_hat - p + p - frac)(hi - lo),
        # so |mean q - x| <= (t + (p - frac)) (hi - lo), the 16-bit words' bias included.
        mean = lo_v[j] + p_hat * (hi_v[j] - lo_v[j])
        bias = float(p - frac)
        assert abs(mean - float(xj)) <= (T_HOEFFDING + bias) * abs(hi_v[j] - lo_v[j])


def test_stochastic_is_a_function_of_the_key():
    x = np.full(4096, 1.25, np.float32)  # a tie for e2m1 (between 1 and 1.5): p = 1/2
    a = np.asarray(lowprec.encode(x, "e2m1", rounding="stochastic", key=jax.random.key(1)))
    b = np.asarray(lowprec.encode(x, "e2m1", rounding="stochastic", key=jax.random.key(1)))
    c = np.asarray(lowprec.encode(x, "e2m1", rounding="stochastic", key=jax.random.key(2)))
    assert np.array_equal(a, b)
    assert not np.array_equal(a, c)  # equal with probability 2^-4096 for independent keys
    # Legacy uint32[2] keys work as well (jax.random.bits accepts both).
    d = np.asarray(lowprec.encode(x, "e2m1", rounding="stochastic", key=jax.random.PRNGKey(1)))
    assert np.isin(d, [2, 3]).all()


# ============================================================================================
# Shapes, input dtypes, float64, jit, vmap.


# Quick tier: the formats of QUICK_ELEMENTS (each format's code dtype is also checked, quick,
# by test_every_mode_matches_reference_on_adversarial_inputs).
@pytest.mark.quick_cases(fmt=QUICK_ELEMENTS)
@pytest.mark.parametrize("shape", [(), (3, 5)], ids=str)
@element_cases(impls="lowprec")
def test_codes_keep_shape_and_have_the_documented_dtype(fmt, shape, codec
):
    x = adversarial(fmt)[: int(np.prod(shape))].reshape(shape)
    got = codec.encode(fmt, x)
    assert got.shape == shape and got.dtype == SPEC_CODE_DTYPE[fmt]
    assert_codes_equal(got, reference.encode(fmt, x), x, fmt)


@element_cases(impls="lowprec", formats=["e5m2"])
def test_empty_arrays(codec):
    x = np.zeros((2, 0, 3), np.float32)
    got = codec.encode("e5m2", x)
    assert got.shape == (2, 0, 3) and got.dtype == np.uint8
    assert codec.decode("e5m2", got).shape == (2, 0, 3)


@element_cases(formats=["fp16", "e4m3", "e8m0"])
def test_python_scalars_and_lists_are_float32(fmt):
    # A Python float becomes a float32 array (JAX's default with x64 off).
    got = lowprec.encode(0.1, fmt)
    assert got.shape == () and int(got) == int(reference.encode(fmt, np.float32(0.1)))
    got = lowprec.encode([0.1, -3.0], fmt)
    assert got.tolist() == reference.encode(fmt, np.array([0.1, -3.0], np.float32)).tolist()


# (format, float64 x, code from float64, code through float32): x lies just above a tie of
# the format by less than half a float32 ulp, so float32(x) is exactly the tie.
FLOAT64_CASES = [
    # 1 + 2^-4 + 2^-30: above the e4m3 tie 1.0625 of 1.0 (0x38) and 1.125 (0x39) -> 0x39;
    # float32 rounds it to 1.0625 (2^-30 < half ulp 2^-24), a tie -> even 0x38.
    ("e4m3", 1 + 2.0**-4 + 2.0**-30, 0x39, 0x38),
    # 1 + 2^-8 + 2^-40: above the bf16 tie of 0x3F80 and 0x3F81 -> 0x3F81; via float32 -> 0x3F80.
    ("bf16", 1 + 2.0**-8 + 2.0**-40, 0x3F81, 0x3F80),
    # -(1 + 2^-11 + 2^-50): fp16 tie of -1 (0xBC00) and -(1 + 2^-10) (0xBC01), magnitude above
    # it -> 0xBC01; via float32 the tie -> even 0xBC00.
    ("fp16", -(1 + 2.0**-11 + 2.0**-50), 0xBC01, 0xBC00),
    # 1e-300 is far below every format: nearest gives +0 either way (float32 flushes it to 0).
    ("tf32", 1e-300, 0x0, 0x0),
    # 2^-1074, the smallest float64, rounds up to the fp16 min subnormal only when 'up' sees it
    # (tested below); nearest: +0.
    ("fp16", 5e-324, 0x0, 0x0),
]


@pytest.mark.parametrize("fmt,x,code64,code32", FLOAT64_CASES, ids=[c[0] for c in FLOAT64_CASES])
@element_cases(impls="all")
def test_float64_input_is_rounded_once_from_float64(fmt, x, code64, code32, codec):
    x64 = np.array([x], np.float64)
    with jax.enable_x64(True):
        got = codec.encode(fmt, x64)
    assert int(got[0]) == code64
    # Rounding float32(x) instead gives the double-rounded code (what JAX hands lowprec with
    # x64 off, and what ml_dtypes' astype from float64 computes, docs/design.md §2).
    assert int(codec.encode(fmt, x64.astype(np.float32))[0]) == code32


@element_cases(impls="all")
def test_float64_tiny_and_huge(codec):
    with jax.enable_x64(True):
        x = np.array([5e-324, -5e-324, 1e300, -1e300, 2.0**-1022], np.float64)
        up = codec.encode("fp16", x, "up")
        sat = codec.encode("fp16", x, "nearest_even", "saturate")
        ne = codec.encode("fp16", x)
    # up: +tiny -> min subnormal 0x0001; -tiny -> -0 (0x8000); 1e300 -> +inf (toward +inf
    # carries positive overflow to inf); -1e300 -> -max (0xFBFF); 2^-1022 -> 0x0001.
    assert up.tolist() == [0x0001, 0x8000, 0x7C00, 0xFBFF, 0x0001]
    assert sat.tolist() == [0x0000, 0x8000, 0x7BFF, 0xFBFF, 0x0000]
    assert ne.tolist() == [0x0000, 0x8000, 0x7C00, 0xFC00, 0x0000]


@pytest.mark.quick_cases(fmt=["e2m1"])
@element_cases(formats=["fp16", "e2m1", "e8m0"])
def test_vmap_over_a_batch(fmt):
    import lowprec_reference

    rng = np.random.default_rng(5)
    x = (rng.standard_normal((4, 32)) * 4.0 ** rng.integers(-6, 6, (4, 32))).astype(np.float32)
    x[0, :3] = [np.inf, -0.0, np.nan]
    got = jax.vmap(lambda r: lowprec.encode(r, fmt, rounding="up", overflow="saturate"))(x)
    assert_codes_equal(np.asarray(got), reference.encode(fmt, x, "up", "saturate"), x, "vmap")
    # decode and quantize under vmap.
    codes = reference.encode(fmt, x)
    values = jax.vmap(lambda c: lowprec.decode(c, fmt))(codes)
    assert np.array_equal(np.asarray(values, np.float64), reference.decode(fmt, codes),
                          equal_nan=True)
    q = jax.vmap(lambda r: lowprec.quantize(r, fmt, dtype=jnp.float32))(x)
    assert np.array_equal(np.asarray(q, np.float64), reference.decode(fmt, codes), equal_nan=True)
    # Stochastic with one key per row: row i uses the words of keys[i] for shape (32,).
    keys = jax.random.split(jax.random.key(3), 4)
    got = jax.vmap(lambda k, r: lowprec.encode(r, fmt, rounding="stochastic", key=k))(keys, x)
    for i in range(4):
        bits = reference_words(replay_random_bits(keys[i], (32,)))
        want = lowprec_reference.encode(fmt, x[i], "stochastic", random_bits=bits)
        assert_codes_equal(np.asarray(got[i]), want, x[i], f"vmap stochastic row {i}")


# ============================================================================================
# quantize.


@element_cases(impls="lowprec")
def test_quantize_default_mode_is_decode_of_encode(fmt, codec
):
    x = adversarial(fmt)
    want = ref_values(fmt, sweep("reference", fmt, "nearest_even", "ieee"))
    assert_same_values(codec.quantize(fmt, x), want, x, f"{fmt} quantize")


@pytest.mark.quick_cases(fmt=["e4m3", "e2m1"])
@pytest.mark.parametrize("mode", ["eager", "jit"])
@element_cases(formats=["bf16", "e4m3", "e2m1", "e8m0"])
def test_quantize_gradient_is_straight_through(fmt, mode):
    # STE: d sum(quantize(x)) / dx = 1 everywhere, also where the forward value is 0, max,
    # inf or NaN (overflow); under jit; with stochastic rounding.
    x = jnp.asarray(adversarial(fmt)[:512])
    loss = lambda v: jnp.sum(lowprec.quantize(v, fmt, dtype=jnp.float32))  # noqa: E731
    grad = jax.grad(loss)
    if mode == "jit":
        grad = jax.jit(grad)
    g = np.asarray(grad(x))
    assert g.dtype == np.float32 and (g == 1).all()
    key = jax.random.key(0)
    sloss = lambda v: jnp.sum(  # noqa: E731
        lowprec.quantize(v, fmt, rounding="stochastic", key=key, dtype=jnp.float32) * 3.0
    )
    assert (np.asarray(jax.grad(sloss)(x)) == 3).all()


def test_quantize_gradient_keeps_bfloat16():
    x = jnp.asarray(np.linspace(-500, 500, 33, dtype=np.float32)).astype(jnp.bfloat16)
    g = jax.grad(lambda v: jnp.sum(lowprec.quantize(v, "e4m3").astype(jnp.float32)))(x)
    assert g.dtype == jnp.bfloat16 and (np.asarray(g, np.float32) == 1).all()


# (format, input dtype, result dtype or None for ValueError). Default result dtype = the
# input's when every value of the format is exactly one of the input dtype's values:
#   bf16 (8 exp bits, 7 mantissa, min subnormal 2^-133) holds e4m3 (3 mantissa bits, 2^-9 ..
#   448), e5m2, e2m1, e8m0 (2^-127 is a bf16 subnormal, 2^127 normal), but not fp16 (10
#   mantissa bits) or tf32.
#   float16 (5 exp bits, 10 mantissa, 2^-24 .. 65504) holds e4m3, e5m2 (same exponent range),
#   e2m1 and fp16 itself, not bf16/tf32/e8m0 (exponent range).
#   float32 / float64 hold everything.
QUANTIZE_DTYPE_RULES = [
    ("e4m3", jnp.bfloat16, jnp.bfloat16),
    ("e5m2", jnp.bfloat16, jnp.bfloat16),
    ("e2m1", jnp.bfloat16, jnp.bfloat16),
    ("e8m0", jnp.bfloat16, jnp.bfloat16),
    ("bf16", jnp.bfloat16, jnp.bfloat16),
    ("fp16", jnp.bfloat16, None),
    ("tf32", jnp.bfloat16, None),
    ("e4m3", jnp.float16, jnp.float16),
    ("e5m2", jnp.float16, jnp.float16),
    ("e2m1", jnp.float16, jnp.float16),
    ("fp16", jnp.float16, jnp.float16),
    ("bf16", jnp.float16, None),
    ("tf32", jnp.float16, None),
    ("e8m0", jnp.float16, None),
    ("tf32", jnp.float32, jnp.float32),
    ("e8m0", jnp.float32, jnp.float32),
]


@pytest.mark.parametrize("fmt,in_dtype,out_dtype", QUANTIZE_DTYPE_RULES,
                         ids=[f"{f}-{jnp.dtype(i).name}" for f, i, _ in QUANTIZE_DTYPE_RULES])
def test_quantize_result_dtype(fmt, in_dtype, out_dtype):
    x32 = np.array([0.1, -3.0, 300.0, 2.0**-20, 1.5], np.float32)
    x = jnp.asarray(x32).astype(in_dtype)
    if out_dtype is None:
        with pytest.raises(ValueError, match=rf"'{fmt}'.*{jnp.dtype(in_dtype).name}"):
            lowprec.quantize(x, fmt)
        # dtype=float32 always works, and equals the reference's exact values.
        got = lowprec.quantize(x, fmt, dtype=jnp.float32)
        assert got.dtype == jnp.float32
        out_dtype = jnp.float32
    else:
        got = lowprec.quantize(x, fmt)
        assert got.dtype == out_dtype
    xin = np.asarray(x).astype(np.float32)  # exact widening of the input
    want = reference.decode(fmt, reference.encode(fmt, xin))
    assert np.array_equal(np.asarray(got).astype(np.float64), want, equal_nan=True)


def test_quantize_float64_with_x64_keeps_float64():
    with jax.enable_x64(True):
        x = jnp.asarray(np.array([1 + 2.0**-4 + 2.0**-30, 0.1], np.float64))
        q = lowprec.quantize(x, "e4m3")
        assert q.dtype == jnp.float64
        # 1 + 2^-4 + 2^-30 -> 1.125 (see FLOAT64_CASES); 0.1 -> 0.1015625 (13 * 2^-7).
        assert np.asarray(q).tolist() == [1.125, 0.1015625]


def test_quantize_never_rounds_twice_into_a_narrower_dtype():
    # fp16's 1 + 3 * 2^-10 is no bfloat16 (7 significand bits): the result would be rounded
    # again (to 1 + 2^-8 by ml_dtypes' RNE), so the dtype is refused, naming fp16's step above 1.
    x = np.array([1 + 3 * 2.0**-10, 65504.0, 2.0**-24, -0.1], np.float32)
    assert float(x.astype(np.float16).astype(ml_dtypes.bfloat16)[0]) != float(np.float16(x[0]))
    with pytest.raises(ValueError, match=r"dtype=bfloat16 cannot hold every value of 'fp16' "
                                         r"exactly \(1.0009765625 is not a bfloat16 value\)"):
        lowprec.quantize(x, "fp16", dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match=r"not all representable in the input dtype bfloat16"):
        lowprec.quantize(jnp.asarray(x, jnp.bfloat16), "fp16")
    got = np.asarray(lowprec.quantize(x, "fp16", dtype=jnp.float32))
    assert_bits_equal(got, x.astype(np.float16).astype(np.float32))


# ============================================================================================
# Errors: the message names the bad value.

X = np.array([1.0, 2.0], np.float32)
KEY = jax.random.key(0)

LOWPREC_ERRORS = [
    ("unknown format", lambda: lowprec.encode(X, "e3m9"), ValueError, r"'e3m9'"),
    ("unknown format decode", lambda: lowprec.decode(np.zeros(2, np.uint8), "fp12"), ValueError,
     r"'fp12'"),
    ("unknown format quantize", lambda: lowprec.quantize(X, "fp7"), ValueError, r"'fp7'"),
    ("unknown format element_format", lambda: lowprec.element_format("e9m9"), ValueError,
     r"'e9m9'"),
    ("block format", lambda: lowprec.encode(X, "mxfp8"), ValueError, r"'mxfp8'"),
    ("unknown rounding", lambda: lowprec.encode(X, "e4m3", rounding="nearest"), ValueError,
     r"'nearest'"),
    ("unknown rounding quantize", lambda: lowprec.quantize(X, "bf16", rounding="RNE"),
     ValueError, r"'RNE'"),
    ("floor on e4m3", lambda: lowprec.encode(X, "e4m3", rounding="floor"), ValueError,
     r"'floor'.*'e4m3'"),
    ("ceil on fp16", lambda: lowprec.quantize(X, "fp16", rounding="ceil"), ValueError,
     r"'ceil'.*'fp16'"),
    ("Rounding.FLOOR on e4m3", lambda: lowprec.encode(X, "e4m3", rounding=lowprec.Rounding.FLOOR),
     ValueError, r"'floor'.*'e4m3'"),
    ("unknown overflow", lambda: lowprec.encode(X, "e5m2", overflow="clip"), ValueError,
     r"'clip'"),
    ("unknown overflow quantize", lambda: lowprec.quantize(X, "e5m2", overflow="inf"),
     ValueError, r"'inf'"),
    ("stochastic without key", lambda: lowprec.encode(X, "e4m3", rounding="stochastic"),
     ValueError, r"stochastic.*key"),
    ("stochastic without key quantize",
     lambda: lowprec.quantize(X, "e4m3", rounding="stochastic"), ValueError, r"stochastic.*key"),
    ("key without stochastic", lambda: lowprec.encode(X, "e4m3", rounding="up", key=KEY),
     ValueError, r"key.*rounding='up'"),
    ("key without stochastic, member",
     lambda: lowprec.encode(X, "e4m3", rounding=lowprec.Rounding.UP, key=KEY), ValueError,
     r"key.*rounding='up'"),
    ("key with default rounding", lambda: lowprec.quantize(X, "e4m3", key=KEY), ValueError,
     r"key.*rounding='nearest_even'"),
    ("integer input", lambda: lowprec.encode(np.array([1, 2], np.int32), "e4m3"), TypeError,
     r"int32"),
    ("uint8 input", lambda: lowprec.encode(np.array([1, 2], np.uint8), "e4m3"), TypeError,
     r"uint8"),
    ("bool input", lambda: lowprec.encode(np.array([True]), "e2m1"), TypeError, r"bool"),
    ("integer input quantize", lambda: lowprec.quantize(np.arange(3), "bf16"), TypeError,
     r"int32"),
    ("float codes", lambda: lowprec.decode(X, "e4m3"), TypeError, r"float32"),
    ("integer decode dtype", lambda: lowprec.decode(np.zeros(2, np.uint8), "e4m3",
                                                    dtype=jnp.int32), TypeError, r"int32"),
    ("fp16 of bf16", lambda: lowprec.quantize(jnp.zeros(2, jnp.bfloat16), "fp16"), ValueError,
     r"'fp16'.*bfloat16"),
]


@pytest.mark.parametrize("call,exc,match", [c[1:] for c in LOWPREC_ERRORS],
                         ids=[c[0] for c in LOWPREC_ERRORS])
def test_errors_name_the_bad_value(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


@pytest.mark.parametrize(
    "kind", ["format", "rounding", "overflow", "floor", "stochastic", "key", "int", "float"]
)
@element_cases(impls="lowprec")
def test_errors_are_raised_at_trace_time_under_jit(kind, codec):
    # Under jax.jit the same checks run while tracing, with the same messages.
    fn, exc, match = {
        "format": (lambda v, k: lowprec.encode(v, "e3m9"), ValueError, "'e3m9'"),
        "rounding": (lambda v, k: lowprec.encode(v, "e4m3", rounding="odd"), ValueError, "'odd'"),
        "overflow": (lambda v, k: lowprec.encode(v, "e4m3", overflow="wrap"), ValueError,
                     "'wrap'"),
        "floor": (lambda v, k: lowprec.encode(v, "e5m2", rounding="floor"), ValueError,
                  "'floor'.*'e5m2'"),
        "stochastic": (lambda v, k: lowprec.encode(v, "e4m3", rounding="stochastic"),
                       ValueError, "stochastic.*key"),
        "key": (lambda v, k: lowprec.encode(v, "e4m3", rounding="down", key=k), ValueError,
                "rounding='down'"),
        "int": (lambda v, k: lowprec.encode(v.astype(jnp.int32), "e4m3"), TypeError, "int32"),
        "float": (lambda v, k: lowprec.decode(v, "e4m3"), TypeError, "float32"),
    }[kind]
    call = jax.jit(fn) if codec.name == "jit" else fn
    with pytest.raises(exc, match=match):
        call(jnp.asarray(X), KEY)


@pytest.mark.parametrize(
    "call,exc,match",
    [
        (lambda r: r.encode("e3m9", X), ValueError, "'e3m9'"),
        (lambda r: r.encode("e4m3", X, "nearest"), ValueError, "'nearest'"),
        (lambda r: r.encode("e4m3", X, "floor"), ValueError, "'floor'"),
        (lambda r: r.encode("e4m3", X, "nearest_even", "clip"), ValueError, "'clip'"),
        (lambda r: r.encode("e4m3", X, "stochastic"), ValueError, "stochastic"),
        (lambda r: r.encode("e4m3", np.array([1, 2], np.int32)), TypeError, "int32"),
        (lambda r: r.decode("e4m3", X), TypeError, "float32"),
    ],
    ids=["format", "rounding", "floor", "overflow", "stochastic", "int", "float"],
)
def test_reference_rejects_the_same_inputs(call, exc, match):
    import lowprec_reference

    with pytest.raises(exc, match=match):
        call(lowprec_reference)
