"""Hypothesis property tests of the element codecs: lowprec == the NumPy reference bit for bit.

For every (format, rounding, overflow), eager and under ``jax.jit``, on float32 arrays
(subnormals, infinities and NaNs included), on float64 arrays with ``jax.enable_x64`` (rounded
once, from the float64 value), and on float16 / bfloat16 arrays. Stochastic rounding gets the
same random words on both sides (``stochastic_bits`` in conftest). Plus properties that need
no reference: monotonicity, bracketing by the directed modes, stochastic results being one of
the two neighbours. Inputs are format-aware (``float_arrays`` in conftest): Hypothesis' own
floats mixed with values on, next to and halfway between the format's values.

Settings come from the "ci" profile in conftest.py (derandomized, no database, no deadline).
"""

from __future__ import annotations

import functools

import jax
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import lowprec_formats
from helpers.asserts import assert_codes_equal, assert_same_values
from helpers.codecs import REFERENCE as reference
from helpers.inputs import float_arrays as _float_arrays
from helpers.tiers import QUICK_ELEMENTS

element_cases = pytest.mark.element_cases
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

# Examples per test, relative to the profile's max_examples (10 in "ci"): the float32 test is
# the main one; tests whose draws each need another compiled XLA program (0.1-0.3 s) get fewer.
FEW = max(1, settings.default.max_examples // 2)

seeds = st.integers(0, 2**32 - 1)

# One strategy object per (format, dtype, salt), drawn by every example of a case: building
# one (an ``st.composite`` that reads its function's source) for each draw was ~1 ms, and a
# fresh object recomputes Hypothesis' per-strategy properties; the same object draws the
# same values.
float_arrays = functools.lru_cache(maxsize=None)(_float_arrays)


def _key(rounding, seed):
    return jax.random.key(seed) if rounding == "stochastic" else None


def _all_modes(fmt):
    modes = lowprec_formats.ROUNDING_MODES + (("floor", "ceil") if fmt == "e8m0" else ())
    return st.sampled_from(modes)


@pytest.mark.quick_cases(fmt=QUICK_ELEMENTS)
@element_cases(impls="lowprec")
@given(data=st.data())
@pytest.mark.quick_first(20)
def test_float32_encode_matches_reference(fmt, rounding, overflow, codec, data):
    x = data.draw(float_arrays(fmt, np.float32, salt=f"{rounding}{overflow}{codec}"), label="x")
    key = _key(rounding, data.draw(seeds, label="seed"))
    want = reference.encode(fmt, x, rounding, overflow, key)
    got = codec.encode(fmt, x, rounding, overflow, key)
    assert got.dtype == want.dtype
    assert_codes_equal(got, want, x, f"{fmt} {rounding} {overflow} {codec}")


# The float64 and half-precision input paths and quantize's glue do not depend on the target
# format's specials: every original format plus one per family added later ("input_paths").
@pytest.mark.quick_cases(fmt=["bf16", "e4m3", "e2m1", "e8m0", "ocp_int8"])
@element_cases(formats="input_paths", impls="alternate")
@given(data=st.data())
@pytest.mark.quick_first(12)
def test_float64_encode_matches_reference_with_x64(fmt, rounding, overflow, codec, data):
    # With jax_enable_x64 on, float64 is rounded once from its 53-bit value (the near-grid
    # values carry bits below float32 precision, e.g. just past a tie). Every (format,
    # rounding, overflow), eager or jit alternately (each combination costs a compilation).
    x = data.draw(float_arrays(fmt, np.float64, salt=f"{rounding}{overflow}"), label="x")
    assert x.dtype == np.float64
    with jax.enable_x64(True):
        key = _key(rounding, data.draw(seeds, label="seed"))
        want = reference.encode(fmt, x, rounding, overflow, key)
        got = codec.encode(fmt, x, rounding, overflow, key)
    assert_codes_equal(got, want, x, f"{fmt} {rounding} {overflow} {codec} float64")


@pytest.mark.quick_cases(fmt=["e4m3", "e2m1", "e8m0"])
@pytest.mark.parametrize("in_dtype", [np.float16, ml_dtypes.bfloat16], ids=["f16", "bf16"])
@element_cases(formats="input_paths", impls="lowprec")
@settings(max_examples=FEW)
@given(data=st.data())
@pytest.mark.quick_first(3)
def test_half_precision_encode_matches_reference(fmt, in_dtype, codec, data):
    # Rounding mode and policy are drawn (under jit each one drawn is another compiled
    # program); every float16 / bfloat16 value is covered exhaustively in the default mode by
    # test_codec.py, and the rounding logic after the exact widening is the float32 path.
    rounding = data.draw(_all_modes(fmt), label="rounding")
    overflow = data.draw(st.sampled_from(lowprec_formats.OVERFLOW_POLICIES), label="overflow")
    x = data.draw(float_arrays(fmt, in_dtype, salt=str(codec)), label="x")
    assert x.dtype == np.dtype(in_dtype)
    key = _key(rounding, data.draw(seeds, label="seed"))
    want = reference.encode(fmt, x, rounding, overflow, key)
    got = codec.encode(fmt, x, rounding, overflow, key)
    assert_codes_equal(got, want, x, f"{fmt} {rounding} {overflow} {codec} {x.dtype}")


# quantize shares encode's rounding code; three mode pairs exercise its own glue (decode,
# dtype, key plumbing) without compiling a quantize program for every mode.
QUANTIZE_MODES = [("nearest_even", "ieee"), ("toward_zero", "saturate"), ("stochastic", "ieee")]


@element_cases(formats="input_paths", impls="lowprec")
@given(data=st.data())
@pytest.mark.quick_first(5)
def test_quantize_matches_reference_decode_of_encode(fmt, codec, data):
    rounding, overflow = data.draw(st.sampled_from(QUANTIZE_MODES), label="modes")
    x = data.draw(float_arrays(fmt, np.float32, salt=str(codec)), label="x")
    key = _key(rounding, data.draw(seeds, label="seed"))
    want = reference.quantize(fmt, x, rounding, overflow, key)
    got = codec.quantize(fmt, x, rounding, overflow, key)
    assert_same_values(got, want, x, f"{fmt} {rounding} {overflow} {codec} quantize")


def _max_finite(reference_module, fmt):
    return float(reference_module.max_finite(fmt))


# The overflow policy is a parameter, not drawn: each case compiles the deterministic modes
# for one policy (eager: one program per mode), not for both.
@element_cases(impls="lowprec")
@given(data=st.data())
@pytest.mark.quick_first(5)
def test_monotonic_and_bracketed(fmt, overflow, codec, data):
    # For every deterministic mode: x <= y => q(x) <= q(y) (NaN results skipped), and on
    # in-range finite inputs down(x) <= x <= up(x), |toward_zero(x)| <= |x|, and each nearest
    # mode returns down(x) or up(x), whichever is nearer (E8M0's default-mode quirk in
    # (2^-127, 2^-126) excepted, docs/design.md §2). Values are decoded with the reference.
    import lowprec_reference

    x = data.draw(float_arrays(fmt, np.float32, salt=f"{overflow}{codec}"), label="x")
    x = np.sort(x[~np.isnan(x)])
    x64 = x.astype(np.float64)
    q = {}
    modes = ("nearest_even", "nearest_away", "toward_zero", "up", "down")
    for mode, codes in codec.encode_modes(fmt, x, modes, overflow).items():  # jit: one program
        q[mode] = reference.decode(fmt, codes)
        v = q[mode][~np.isnan(q[mode])]
        assert (v[1:] >= v[:-1]).all(), (mode, x, q[mode])
    m = _max_finite(lowprec_reference, fmt)
    ok = np.isfinite(x) & (np.abs(x64) <= m)
    if fmt == "e8m0":
        ok &= x64 >= 2.0**-127
    elif lowprec_formats.ELEMENT_FORMATS[fmt]["sign_bits"] == 0:
        ok &= ~np.signbit(x)  # an unsigned format's negative inputs encode to NaN
    down, up, tz = q["down"][ok], q["up"][ok], q["toward_zero"][ok]
    assert (down <= x64[ok]).all() and (x64[ok] <= up).all()
    assert (np.abs(tz) <= np.abs(x64[ok])).all()
    for mode in ("nearest_even", "nearest_away"):
        sel = ok.copy()
        if fmt == "e8m0" and overflow == "ieee":
            sel &= ~((x64 > 2.0**-127) & (x64 < 2.0**-126))
        near, lo, hi, xs = q[mode][sel], q["down"][sel], q["up"][sel], x64[sel]
        assert ((near == lo) | (near == hi)).all()
        assert (np.abs(near - xs) <= np.minimum(xs - lo, hi - xs)).all()


@element_cases(impls="lowprec")
@settings(max_examples=FEW)
@given(data=st.data())
@pytest.mark.quick_first(5)
def test_stochastic_result_is_a_neighbour(fmt, overflow, codec, data):
    # q(x) is the reference's toward-zero or away-from-zero rounding of x; exact values stay.
    x = data.draw(float_arrays(fmt, np.float32, salt=f"{overflow}{codec}"), label="x")
    key = jax.random.key(data.draw(seeds, label="seed"))
    got = codec.encode(fmt, x, "stochastic", overflow, key)
    tz = reference.encode(fmt, x, "toward_zero", overflow)
    away = np.where(
        np.signbit(x), reference.encode(fmt, x, "down", overflow),
        reference.encode(fmt, x, "up", overflow),
    )
    bad = (got != tz) & (got != away)
    assert not bad.any(), (x[bad], got[bad], tz[bad], away[bad])
