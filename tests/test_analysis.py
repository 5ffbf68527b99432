"""Tests of lowprec.analysis: metrics against hand-computed cases, bounds as properties,
comparisons against direct computations, intervals against published t tables, plots drawn
with awkward data (inf, NaN, zeros)."""

import math
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lowprec
from helpers.tiers import QUICK_ELEMENTS, QUICK_MX
from lowprec import analysis

ELEMENTS = ("fp16", "bf16", "tf32", "e4m3", "e5m2", "e2m1")  # signed formats with a zero


def _f(x):
    return float(x)


def _student_t(seed, df, shape):
    """Heavy-tailed float32 test data from NumPy: an eager jax.random.t is a compile of its
    own (a gamma sampler's loop) for every new shape, ~0.6 CPU s each. (The [8, 256] tests
    share one jax.random.t program, and their asserted margins were measured on its data.)"""
    return np.random.default_rng(seed).standard_t(df, shape).astype(np.float32)


# --------------------------------------------------------------------------------------
# SQNR and the scalar metrics
# --------------------------------------------------------------------------------------
def test_sqnr_known_powers():
    # Signal 2.0 everywhere (power 4), noise +-0.25 (power 1/16): ratio 64.
    x = np.full(1000, 2.0, np.float32)                 # NumPy: no eager compiles
    noise = np.where(np.arange(1000) % 2 == 0, 0.25, -0.25).astype(np.float32)
    assert _f(analysis.sqnr_db(x, x + noise)) == pytest.approx(10 * math.log10(64), abs=1e-5)
    # [3, -4] has power 25; noise [0.5, 0] has power 0.25: 20 dB.
    x = np.array([3.0, -4.0], np.float32)
    assert _f(analysis.sqnr_db(x, x + np.array([0.5, 0.0], np.float32))) == pytest.approx(20.0, abs=1e-5)


def test_sqnr_exact_is_inf_and_scale_invariant():
    x = jnp.array([1.0, -2.0, 3.0])
    assert _f(analysis.sqnr_db(x, x)) == math.inf
    # Squares of 1e30 overflow float32; the metric normalizes by max |x| first.
    big = x * 1e30
    assert _f(analysis.sqnr_db(big, big * (1 + 2.0**-10))) == pytest.approx(
        _f(analysis.sqnr_db(x, x * (1 + 2.0**-10))), abs=1e-3
    )
    assert _f(analysis.sqnr_db(big, big * (1 + 2.0**-10))) == pytest.approx(20 * math.log10(2**10), abs=1e-3)


def test_sqnr_of_zero_signal():
    assert _f(analysis.sqnr_db(jnp.zeros(3), jnp.zeros(3))) == math.inf
    assert _f(analysis.sqnr_db(jnp.zeros(3), jnp.array([0.0, 1.0, 0.0]))) == -math.inf


def test_sqnr_float64_numpy_inputs():
    x = np.array([1.0, 2.0, 3.0, 4.0])
    noise = np.array([0.1, -0.1, 0.1, -0.1])
    expected = 10 * np.log10(np.sum(x**2) / np.sum(noise**2))
    assert _f(analysis.sqnr_db(x, x + noise)) == pytest.approx(expected, rel=1e-5)


def test_abs_and_signed_errors():
    r = jnp.array([1.0, 2.0, -4.0, 0.0])
    a = jnp.array([1.5, 2.0, -3.0, -0.5])  # errors +0.5, 0, +1, -0.5
    assert _f(analysis.max_abs_error(r, a)) == 1.0
    assert _f(analysis.mean_abs_error(r, a)) == 0.5
    assert _f(analysis.mean_error(r, a)) == 0.25
    assert _f(analysis.rms_error(r, a)) == pytest.approx(math.sqrt((0.25 + 1 + 0.25) / 4))


def test_relative_errors_conventions():
    r = jnp.array([2.0, -4.0, 0.0, 0.0, 8.0])
    a = jnp.array([2.5, -3.0, 0.0, 1.0, 8.0])
    assert analysis.relative_error(r, a).tolist() == [0.25, 0.25, 0.0, math.inf, 0.0]
    # max/mean over the nonzero references only: (0.25, 0.25, 0)
    assert _f(analysis.max_rel_error(r, a)) == 0.25
    assert _f(analysis.mean_rel_error(r, a)) == pytest.approx(0.5 / 3)
    # no nonzero reference at all
    assert _f(analysis.max_rel_error(jnp.zeros(2), jnp.ones(2))) == 0.0
    assert _f(analysis.mean_rel_error(jnp.zeros(2), jnp.ones(2))) == 0.0


@pytest.mark.slow  # left out of the quick tier (seconds; its paths run in other quick tests)
def test_error_stats_matches_individual_metrics():
    x = np.random.default_rng(0).standard_normal(256).astype(np.float32)  # NumPy: no compiles
    q = np.asarray(lowprec.quantize(x, "e4m3"))
    stats = analysis.error_stats(x, q)
    for name in ("sqnr_db", "max_abs_error", "mean_abs_error", "rms_error", "mean_error",
                 "max_rel_error", "mean_rel_error", "underflow_rate"):
        assert _f(stats[name]) == pytest.approx(_f(getattr(analysis, name)(x, q)), rel=1e-6), name
    # E4M3 round to nearest on N(0,1) data: relative error <= unit roundoff 1/16 where normal
    normal = np.abs(x) >= lowprec.element_format("e4m3").min_normal
    assert _f(analysis.max_rel_error(x[normal], q[normal])) <= 1 / 16


def test_metrics_reject_bad_input():
    with pytest.raises(ValueError, match="same shape"):
        analysis.sqnr_db(jnp.zeros(3), jnp.zeros(4))
    with pytest.raises(TypeError, match="floating"):
        analysis.sqnr_db(jnp.arange(3), jnp.arange(3))


def test_metrics_are_jittable_and_vmappable():
    x = jnp.linspace(-2.0, 2.0, 64)
    q = lowprec.quantize(x, "bf16")
    eager = _f(analysis.sqnr_db(x, q))
    assert _f(jax.jit(analysis.sqnr_db)(x, q)) == pytest.approx(eager)
    batched = jax.vmap(analysis.sqnr_db)(jnp.stack([x, x]), jnp.stack([q, q]))
    assert batched.shape == (2,)
    assert np.allclose(np.asarray(batched), eager)
    f = jax.jit(lambda v: analysis.ulp_error(v, lowprec.quantize(v, "e4m3"), "e4m3").max())
    assert _f(f(x)) <= 0.5


# --------------------------------------------------------------------------------------
# ULPs
# --------------------------------------------------------------------------------------
def test_ulp_e4m3_by_hand():
    # e4m3: 3 mantissa bits, emin = -6, emax = 8. Spacing 2^(e - 3) in binade 2^e.
    x = jnp.array([1.0, 1.9, 448.0, 300.0, 1000.0, 2.0**-6, 0.001, 0.0, -3.0])
    expected = [2**-3, 2**-3, 2**5, 2**5, 2**5, 2**-9, 2**-9, 2**-9, 2**-2]
    assert analysis.ulp(x, "e4m3").tolist() == expected


def test_ulp_other_formats_by_hand():
    assert analysis.ulp(jnp.array([0.3, 1.0, 5.0, 6.0]), "e2m1").tolist() == [0.5, 0.5, 2.0, 2.0]
    assert analysis.ulp(jnp.array([1.0, 2.0**100]), "bf16").tolist() == [2.0**-7, 2.0**93]
    assert analysis.ulp(jnp.array([1.0, 65504.0, 1e-7]), "fp16").tolist() == [2.0**-10, 32.0, 2.0**-24]
    # bf16's subnormal spacing 2^-133 is itself a float32 subnormal, built from bits
    assert analysis.ulp(jnp.array([0.0]), "bf16").tolist() == [2.0**-133]
    assert analysis.ulp(jnp.array([1.0, 3.0, 2.0**-127]), "e8m0").tolist() == [1.0, 2.0, 2.0**-127]


def test_quantization_error_bound_keeps_a_subnormal_spacing():
    # bf16's spacing below 2^-126 is 2^-133 (7 fraction bits below the smallest normal
    # exponent), itself a float32 subnormal: half of it, 2^-134, bounds round to nearest and
    # the whole spacing the directed modes. Read in NumPy, which does not flush subnormals.
    x = jnp.array([0.0, 2.0**-133 / 3, -(2.0**-130), 2.0**-127])
    near = np.asarray(analysis.quantization_error_bound(x, "bf16"))
    assert near.tolist() == [2.0**-134] * 4, near.tolist()
    up = np.asarray(analysis.quantization_error_bound(x, "bf16", rounding="up"))
    assert up.tolist() == [2.0**-133] * 4, up.tolist()
    # NaN in, NaN out; beyond bf16's max_finite (2 - 2^-7) 2^127 the clipping term, for
    # float32's largest (2 - 2^-23) 2^127: 2^120 - 2^104, over the half spacing 2^119.
    big = float(np.finfo(np.float32).max)
    edge = np.asarray(analysis.quantization_error_bound(jnp.array([np.nan, big]), "bf16"))
    assert np.isnan(edge[0]) and edge[1] == 2.0**120 - 2.0**104, edge.tolist()


def test_ulp_with_scale_exponent():
    # Grid of e4m3 scaled by 2^-8: 2^-20 / 2^-8 = 2^-12 is below e4m3's normal range, so the
    # spacing is the subnormal one, 2^-9, times 2^-8.
    assert analysis.ulp(jnp.array([2.0**-20]), "e4m3", scale_exp=-8).tolist() == [2.0**-17]
    assert analysis.ulp(jnp.array([1.0]), "e4m3", scale_exp=-8).tolist() == [2.0**-3]


def test_ulp_error_e4m3_by_hand():
    x = jnp.array([1.0625, 300.0, 0.005, 1.0, 1000.0])
    q = lowprec.quantize(x, "e4m3", overflow="saturate")
    # 1.0625 is the tie between 1 and 1.125 -> 1 (even): half an ULP (0.125).
    # 300 -> 288: 12 / 32. 0.005 -> 3 * 2^-9: (0.005859375 - f32(0.005)) / 2^-9 = 0.44.
    # 1000 saturates to 448: 552 / 32 ULPs of the top binade.
    err = analysis.ulp_error(x, q, "e4m3").tolist()
    assert err[:2] == [0.5, 0.375]
    assert err[2] == pytest.approx((0.005859375 - float(np.float32(0.005))) / 2**-9, rel=1e-6)
    assert err[3:] == [0.0, 552 / 32]


def test_ulp_error_e2m1_tie_and_directed():
    assert analysis.ulp_error(jnp.array([5.0]), jnp.array([4.0]), "e2m1").tolist() == [0.5]
    x = jnp.array([1.1])
    q = lowprec.quantize(x, "e4m3", rounding="toward_zero")
    assert q.tolist() == [1.0]
    assert _f(analysis.ulp_error(x, q, "e4m3")[0]) == pytest.approx(0.8, rel=1e-5)


@pytest.mark.quick_cases(fmt=["bf16", "e4m3", "e2m1"])
@pytest.mark.parametrize("fmt", ELEMENTS)
@pytest.mark.quick_first(1)
def test_ulp_error_bounds_hold(fmt):
    f = lowprec.element_format(fmt)
    lo, hi = math.log2(f.min_normal), math.log2(f.max_finite) - 1
    lo, hi = max(lo, -60), min(hi, 60)
    # NumPy inputs and one program for the five roundings (eagerly, each call, op and
    # reduction is a compile of its own).
    x = np.exp2(np.random.default_rng(1).uniform(lo, hi, 4096)).astype(np.float32)
    x[1::2] *= -1

    @jax.jit
    def worst(v):
        modes = ("nearest_even", "toward_zero", "up", "down")
        errs = [analysis.ulp_error(v, lowprec.quantize(v, fmt, rounding=m), fmt).max() for m in modes]
        sr = lowprec.quantize(v, fmt, rounding="stochastic", key=jax.random.key(2))
        return jnp.stack(errs + [analysis.ulp_error(v, sr, fmt).max()])

    nearest, *directed = np.asarray(worst(x)).tolist()
    assert nearest <= 0.5, (fmt, nearest)
    assert max(directed) < 1, (fmt, directed)          # toward_zero, up, down, stochastic


def test_ulp_error_at_the_top_of_bf16():
    x = jnp.array([3.0e38, -1.0e38])
    q = lowprec.quantize(x, "bf16")
    err = analysis.ulp_error(x, q, "bf16")
    assert bool(jnp.all(err <= 0.5)) and bool(jnp.all(jnp.isfinite(err)))


# --------------------------------------------------------------------------------------
# a-priori bounds
# --------------------------------------------------------------------------------------
def test_quantization_error_bound_by_hand():
    b = analysis.quantization_error_bound(jnp.array([1.0, 300.0, 1000.0, 0.0]), "e4m3")
    assert b.tolist() == [2.0**-4, 16.0, 552.0, 2.0**-10]
    b = analysis.quantization_error_bound(jnp.array([1.0]), "e4m3", rounding="toward_zero")
    assert b.tolist() == [0.125]


@pytest.mark.quick_cases(fmt=["bf16", "e4m3", "e2m1"])
@pytest.mark.parametrize("fmt", ELEMENTS)
@pytest.mark.parametrize("rounding", ["nearest_even", "nearest_away", "toward_zero", "stochastic"])
@pytest.mark.quick_first(4)
def test_quantization_error_bound_holds(fmt, rounding):
    f = lowprec.element_format(fmt)
    # include subnormals, values beyond max (saturated) and zeros; NumPy inputs and one
    # program (eagerly, each op and call is a compile of its own)
    scale = min(f.max_finite, 1e30)
    rng = np.random.default_rng(3)
    x = rng.standard_normal(2048) * np.exp2(rng.uniform(-30, 2, 2048))
    x = np.concatenate([x, [0.0, 2 * scale, -3 * scale, f.min_subnormal / 3]]).astype(np.float32)
    kw = {"key": jax.random.key(4)} if rounding == "stochastic" else {}

    @jax.jit
    def within(v):
        q = lowprec.quantize(v, fmt, rounding=rounding, overflow="saturate", **kw)
        return jnp.abs(q - v) <= analysis.quantization_error_bound(v, fmt, rounding=rounding)

    ok = np.asarray(within(x))
    assert ok.all(), f"{fmt} {rounding}: over the bound at {x[~ok][:3]}"


# Every E8M0-scaled block format (MXINT8's fixed-point element included); NVFP4 has no scale
# rule and its own tests below.
ANALYSIS_MX = [f for f in lowprec.MX_FORMAT_NAMES if not lowprec.mx_format(f).tensor_scale]


@pytest.mark.parametrize("fmt", ANALYSIS_MX)
@pytest.mark.parametrize("rule", [r.value for r in lowprec.ScaleRule])
@pytest.mark.slow  # left out of the quick tier (seconds; its paths run in other quick tests)
def test_mx_quantization_error_bound_holds(fmt, rule):
    x = _student_t(5, 2.0, (16, 128))
    # One program (eagerly, each call and each reduction below is a compile of its own).
    err, bound = jax.jit(lambda v: (
        jnp.abs(lowprec.fake_quantize_mx(v, fmt, scale_rule=rule) - v),
        analysis.quantization_error_bound(v, fmt, scale_rule=rule)))(x)
    err, bound = np.asarray(err), np.asarray(bound)
    assert np.all(err <= bound), f"{fmt} {rule}: {np.count_nonzero(err > bound)} over the bound"
    # and it is not vacuous: within a factor of a few of the worst actual error per block
    assert bound.max() < 10 * err.max() + 1e-30, (fmt, rule)


def test_mx_scale_exponents_by_hand():
    # Inputs built and results read in NumPy: each eager jnp op or index is a compile.
    x = np.concatenate([np.full(32, 1.0), np.full(32, 100.0), np.zeros(32)]).astype(np.float32)
    s = np.asarray(analysis.mx_scale_exponents(x, "mxfp8_e4m3"))  # floor(log2 amax) - 8
    assert s[:32].tolist() == [-8] * 32
    assert s[32:64].tolist() == [-2] * 32
    assert s[64:].tolist() == [-127] * 32              # all-zero block: scale code 0
    s = np.asarray(analysis.mx_scale_exponents(x[:40], "mxfp4"))   # padded internally; shape kept
    assert s.shape == (40,) and s[0] == -2 and s[39] == 4
    x2 = x.reshape(3, 32).T                             # blocks along axis 0
    s2 = np.asarray(analysis.mx_scale_exponents(x2, "mxfp4", axis=0))
    assert s2.shape == (32, 3) and s2[0].tolist() == [-2, 4, -127]
    nan_block = np.concatenate([[np.nan], np.ones(31)]).astype(np.float32)
    assert np.asarray(analysis.mx_scale_exponents(nan_block, "mxfp4"))[0] == 128


def test_clipping_rate_constructed_blocks():
    # Four MXFP8 E4M3 blocks of 32 (E4M3 max = 448 = 1.75 * 2^8):
    #  0: max 1.9    floor: scale 2^-8, limit 1.75 -> 1.9 clipped
    #  1: max 1.5    floor: limit 1.75 -> nothing clipped
    #  2: 1.99, 1.8  floor: limit 1.75 -> both clipped
    #  3: zeros      nothing to clip
    blocks = np.full((4, 32), 0.25, np.float32)
    blocks[0, 5] = 1.9
    blocks[1, 7] = 1.5
    blocks[2, 0], blocks[2, 1] = 1.99, -1.8
    blocks[3] = 0
    x = jnp.asarray(blocks.reshape(-1))
    rate = lambda rule: _f(analysis.mx_clipping_rate(x, "mxfp8_e4m3", scale_rule=rule))
    assert rate("floor") == 3 / 128
    assert rate("ceil") == 0 and rate("rceil") == 0
    # even: 1.9 rounds (3 mantissa bits) to 1.875 -> same scale, clipped; 1.99 rounds to 2
    # -> scale 2^-7, limit 3.5, so block 2 is not clipped.
    assert rate("even") == 1 / 128
    # The clipped elements are exactly those that saturate to +-limit = +-1.75
    q = np.asarray(lowprec.fake_quantize_mx(x, "mxfp8_e4m3", scale_rule="floor"))
    assert np.flatnonzero(np.abs(q) == 1.75).tolist() == [5, 64, 65]
    assert q[[5, 64, 65]].tolist() == [1.75, 1.75, -1.75]


def test_clipping_rate_scalar_limit_and_mxfp4():
    x = jnp.array([1.0, -500.0, 448.0, 449.0, jnp.nan])
    assert _f(analysis.clipping_rate(x, 448.0)) == pytest.approx(2 / 5)
    blocks = jnp.concatenate([jnp.full(31, 0.1), jnp.array([7.9]), jnp.full(31, 0.1), jnp.array([5.9])])
    assert _f(analysis.mx_clipping_rate(blocks, "mxfp4")) == 1 / 64   # 7.9 > 6 * 2^0


def test_underflow_rate():
    x = np.array([0.0, 0.1, 0.2, 0.3, 1.0, -0.2, 6.0, 0.0], np.float32)
    q = lowprec.quantize(x, "e2m1")                    # below 0.25 -> 0
    assert _f(analysis.underflow_rate(x, q)) == 3 / 8
    # MXFP4: block max 6 -> scale 2^0 -> 0.1 flushes to zero
    xb = np.concatenate([[6.0], np.full(31, 0.1)]).astype(np.float32)
    assert _f(analysis.underflow_rate(xb, lowprec.fake_quantize_mx(xb, "mxfp4"))) == 31 / 32


def test_dot_error_bound_by_hand():
    a = jnp.array([1.0, 2.0])
    b = jnp.array([3.0, 4.0])
    ea, eb = a / 16, b / 16
    # |a|.eb + ea.|b| + ea.eb = 11/16 + 11/16 + 11/256
    assert _f(analysis.dot_error_bound(a, b, ea, eb, accumulation_eps=0)) == 1.41796875
    gamma = 2 * 2.0**-24 / (1 - 2 * 2.0**-24)
    expected = 1.41796875 + gamma * float(jnp.dot(jnp.abs(a) + ea, jnp.abs(b) + eb))
    assert _f(analysis.dot_error_bound(a, b, ea, eb)) == pytest.approx(expected, rel=1e-6)
    with pytest.raises(ValueError, match="void"):
        analysis.dot_error_bound(jnp.ones((1, 4)), jnp.ones((4, 1)), jnp.zeros((1, 4)),
                                 jnp.zeros((4, 1)), accumulation_eps=0.5)


@pytest.mark.quick_cases(fmt=["e4m3", "mxfp4"])
@pytest.mark.parametrize("fmt", ["bf16", "fp16", "e4m3", "e2m1", "mxfp8_e5m2", "mxfp4"])
@pytest.mark.quick_first(1)
def test_dot_error_bound_holds(fmt):
    rng = np.random.default_rng(6)                     # NumPy inputs: no eager compiles
    a = rng.standard_normal((8, 256)).astype(np.float32)
    b = rng.standard_normal((256, 8)).astype(np.float32)

    @jax.jit  # one program (eagerly, each call is a compile of its own)
    def approx_and_bound(a, b):
        if fmt in lowprec.MX_FORMAT_NAMES:
            qa, qb = lowprec.fake_quantize_mx(a, fmt, axis=1), lowprec.fake_quantize_mx(b, fmt, axis=0)
            ea, eb = analysis.quantization_error_bound(a, fmt, axis=1), analysis.quantization_error_bound(b, fmt, axis=0)
        else:
            qa, qb = lowprec.quantize(a, fmt), lowprec.quantize(b, fmt)
            ea, eb = analysis.quantization_error_bound(a, fmt), analysis.quantization_error_bound(b, fmt)
        return jnp.dot(qa, qb, precision="highest"), analysis.dot_error_bound(a, b, ea, eb)

    approx, bound = (np.asarray(v, np.float64) for v in approx_and_bound(a, b))
    exact = a.astype(np.float64) @ b.astype(np.float64)
    assert np.all(np.abs(approx - exact) <= bound), (fmt, np.count_nonzero(np.abs(approx - exact) > bound))


# --------------------------------------------------------------------------------------
# stochastic rounding and accumulation
# --------------------------------------------------------------------------------------
def test_rounding_neighbors():
    lo, hi = analysis.rounding_neighbors(jnp.array([1.03125, 2.0, -1.03125, 1000.0]), "e4m3")
    assert lo.tolist() == [1.0, 2.0, -1.125, 448.0]
    assert hi.tolist() == [1.125, 2.0, -1.0, 448.0]


def test_stochastic_rounding_is_unbiased_with_the_right_variance():
    x = jnp.array([1.03125, 1.0625, 3.3, -100.0, 2.0])
    n = 4096
    s = analysis.stochastic_rounding_stats(x, "e4m3", key=jax.random.key(7), num_samples=n)
    # hand: 1.03125 lies 1/32 above 1 and 3/32 below 1.125: variance 3/1024
    expected_var = np.asarray(s["expected_variance"], np.float64)
    assert expected_var[0] == 3 / 1024 and expected_var[1] == 1 / 256 and expected_var[4] == 0
    se = np.sqrt(expected_var / n)
    bias = np.asarray(s["bias"], np.float64)
    assert np.all(np.abs(bias[:4]) < 4 * se[:4]) and bias[4] == 0
    ratio = np.asarray(s["variance"][:4], np.float64) / expected_var[:4]
    assert np.all((ratio > 0.85) & (ratio < 1.15))


def test_quantized_cumsum_nearest_matches_a_python_loop():
    inc = jnp.array([0.3, 0.7, 0.01, 5.0, -2.2, 0.04], jnp.float32)
    sums = analysis.quantized_cumsum(inc, "e4m3", init=1.0)
    s, expected = jnp.float32(1.0), []
    for v in inc:
        s = lowprec.quantize(s + v, "e4m3", overflow="saturate")
        expected.append(float(s))
    assert sums.tolist() == expected


def test_quantized_cumsum_stalls_with_nearest_and_tracks_with_stochastic():
    # bf16 spacing at 1 is 2^-7; adding 2^-9 < half of it never moves the sum.
    # Built and read in NumPy: each eager jnp op and index is a compile of its own.
    inc = np.full((512, 256), 2.0**-9, np.float32)
    near = analysis.quantized_cumsum(inc[:, :1], "bf16", init=1.0)
    assert np.all(np.asarray(near) == 1.0)
    sr = analysis.quantized_cumsum(inc, "bf16", rounding="stochastic", key=jax.random.key(8), init=1.0)
    assert sr.shape == (512, 256)
    final = np.asarray(sr, np.float64)[-1]
    exact = 1.0 + 512 * 2.0**-9                        # 2.0
    assert abs(final.mean() - exact) < 4 * final.std() / np.sqrt(256)
    with pytest.raises(ValueError, match="key"):
        analysis.quantized_cumsum(inc, "bf16", rounding="stochastic")
    with pytest.raises(ValueError, match="axis"):
        analysis.quantized_cumsum(jnp.float32(1.0), "bf16")


# --------------------------------------------------------------------------------------
# value tables
# --------------------------------------------------------------------------------------
def test_representable_values_counts_by_hand():
    # distinct finite values = 2 * (positive finite codes) + 1 (zero)
    expected = {
        "fp16": 2 * (31 * 1024 - 1) + 1,
        "bf16": 2 * (255 * 128 - 1) + 1,
        "tf32": 2 * (255 * 1024 - 1) + 1,
        "e4m3": 2 * (127 - 1) + 1,       # 0x00..0x7E, 0x7F is NaN
        "e5m2": 2 * (124 - 1) + 1,       # 0x00..0x7B
        "e2m1": 15,
        "e8m0": 255,                     # 2^-127 .. 2^127, unsigned, no zero
    }
    for name, count in expected.items():
        assert len(analysis.representable_values(name, negative=True)) == count, name
        assert analysis.format_info(name)["finite_values"] == count, name
    assert analysis.representable_values("e2m1").tolist() == [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    v = analysis.representable_values("e8m0")
    assert v[0] == 2.0**-127 and v[-1] == 2.0**127 and np.all(v[1:] / v[:-1] == 2)
    e4 = analysis.representable_values("e4m3")
    assert e4[-1] == 448 and e4[1] == 2.0**-9 and np.all(np.diff(e4) > 0)
    # the cached array is not exposed for mutation
    e4[0] = 5
    assert analysis.representable_values("e4m3")[0] == 0


def test_value_spacing():
    v, g = analysis.value_spacing("e4m3")
    assert np.all(g[(v >= 1) & (v < 2)] == 0.125)
    assert np.all(g[v < 2.0**-6] == 2.0**-9)           # subnormal spacing
    assert g[-1] == 32 and v[-1] == 416


def test_format_info():
    info = analysis.format_info("e4m3")
    assert info["max_finite"] == 448 and info["min_normal"] == 2**-6 and info["min_subnormal"] == 2**-9
    assert info["unit_roundoff"] == 1 / 16
    assert info["dynamic_range_binades"] == pytest.approx(math.log2(448) + 9)
    assert info["normal_binades"] == 15 and info["inf"] is False and info["nan"] is True
    assert analysis.format_info("fp16")["dynamic_range_binades"] == pytest.approx(math.log2(65504) + 24)
    assert analysis.format_info("e2m1")["nan"] is False
    names = [row["name"] for row in analysis.format_table()]
    assert names == list(lowprec.ELEMENT_FORMAT_NAMES)


def test_markdown_table():
    text = analysis.markdown_table([{"a": 1, "b": 0.5, "c": True}, {"a": 2, "b": 1e-9, "c": False}])
    assert text.splitlines() == ["| a | b | c |", "|---|---|---|", "| 1 | 0.5 | yes |", "| 2 | 1e-09 | no |"]
    assert analysis.markdown_table([], columns=["x"]).splitlines() == ["| x |", "|---|"]


# --------------------------------------------------------------------------------------
# plots and import hygiene
# --------------------------------------------------------------------------------------
def test_importing_imports_neither_matplotlib_nor_pandas():
    code = ("import sys, lowprec, lowprec.analysis; "
            "print('matplotlib' in sys.modules, 'pandas' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False False"




def test_public_namespace():
    import lowprec.analysis as mod

    assert mod.__all__ == sorted(mod.__all__, key=str.lower) or len(set(mod.__all__)) == len(mod.__all__)
    for name in mod.__all__:
        obj = getattr(mod, name)
        if name == "DISTRIBUTIONS":
            assert isinstance(obj, tuple) and "gaussian" in obj
            continue
        assert callable(obj) and obj.__doc__, name
    # the submodules are private; the package __init__ holds the one export list
    for sub in ("_metrics", "_ulp", "_bounds", "_mx_stats", "_stochastic", "_values", "_compare", "_plots"):
        assert not hasattr(getattr(mod, sub), "__all__"), sub


# --------------------------------------------------------------------------------------
# one argument order; Python floats
# --------------------------------------------------------------------------------------
def test_array_first_everywhere_and_the_old_order_warns():
    x = jnp.array([1.0625, 300.0, 0.005])
    q = lowprec.quantize(x, "e4m3")
    new = {
        "ulp": analysis.ulp(x, "e4m3"),
        "ulp_error": analysis.ulp_error(x, q, "e4m3"),
        "bound": analysis.quantization_error_bound(x, "e4m3"),
        "neighbors": analysis.rounding_neighbors(x, "e4m3")[0],
        "cumsum": analysis.quantized_cumsum(x, "e4m3"),
    }
    with pytest.warns(DeprecationWarning, match=r"write lowprec.analysis.ulp\(x, fmt\)"):
        old = analysis.ulp("e4m3", x)
    assert old.tolist() == new["ulp"].tolist()
    with pytest.warns(DeprecationWarning, match=r"ulp_error\(x, q, fmt\)"):
        assert analysis.ulp_error("e4m3", x, q).tolist() == new["ulp_error"].tolist()
    with pytest.warns(DeprecationWarning):
        assert analysis.quantization_error_bound("e4m3", x).tolist() == new["bound"].tolist()
    with pytest.warns(DeprecationWarning):
        assert analysis.rounding_neighbors("e4m3", x)[0].tolist() == new["neighbors"].tolist()
    with pytest.warns(DeprecationWarning):
        assert analysis.quantized_cumsum("e4m3", x).tolist() == new["cumsum"].tolist()


def test_scalar_metrics_are_python_floats_eagerly_and_arrays_when_traced():
    x = jnp.linspace(-2.0, 2.0, 64)
    q = lowprec.quantize(x, "bf16")
    for name in ("sqnr_db", "max_abs_error", "mean_abs_error", "rms_error", "mean_error",
                 "max_rel_error", "mean_rel_error", "underflow_rate", "overflow_rate", "nan_rate"):
        assert type(getattr(analysis, name)(x, q)) is float, name
    assert type(analysis.clipping_rate(x, 1.0)) is float
    assert type(analysis.mx_clipping_rate(jnp.ones(32), "mxfp4")) is float
    assert all(type(v) is float for v in analysis.error_stats(x, q).values())
    traced = jax.jit(analysis.sqnr_db)(x, q)
    assert isinstance(traced, jax.Array) and traced.shape == ()


def test_where_mask_selects_elements():
    r = jnp.array([1.0, 2.0, 4.0, 8.0])
    a = jnp.array([1.5, 2.0, 5.0, 8.0])               # errors 0.5, 0, 1, 0
    keep = jnp.array([True, True, False, False])
    assert analysis.max_abs_error(r, a, where=keep) == 0.5
    assert analysis.mean_abs_error(r, a, where=keep) == 0.25
    assert analysis.mean_rel_error(r, a, where=~keep) == pytest.approx(0.125)
    # SQNR over the first two: signal 1 + 4, noise 0.25 -> 10 log10(20)
    assert analysis.sqnr_db(r, a, where=keep) == pytest.approx(10 * math.log10(20), rel=1e-6)
    with pytest.raises(TypeError, match="boolean"):
        analysis.sqnr_db(r, a, where=jnp.ones(4))


def test_overflow_and_nan_are_counted_not_hidden():
    # e4m3 under the default policy: |x| > 464 becomes NaN (ml_dtypes' behaviour; 464, the
    # tie between 448 and the next binade step 480, rounds to even: 448).
    x = np.array([1.0, 2.0, 464.0, 465.0, 1000.0, -3.0, 0.001, 0.0], np.float32)
    q = np.asarray(lowprec.quantize(x, "e4m3"))
    assert np.isnan(q).sum() == 2
    assert analysis.overflow_rate(x, q) == 2 / 8
    assert analysis.nan_rate(x, q) == 2 / 8
    assert math.isnan(analysis.sqnr_db(x, q))              # the plain metric does not hide it
    s = analysis.error_stats(x, q)
    finite = np.isfinite(np.asarray(q))
    assert s["sqnr_db"] == pytest.approx(analysis.sqnr_db(x[finite], q[finite]), rel=1e-6)
    assert s["overflow_rate"] == s["nan_rate"] == 0.25 and math.isfinite(s["sqnr_db"])
    # e5m2: overflow to inf is an overflow but not a NaN
    x5 = np.array([1.0, 1e6], np.float32)
    q5 = lowprec.quantize(x5, "e5m2")
    assert analysis.overflow_rate(x5, q5) == 0.5
    assert analysis.nan_rate(x5, q5) == 0.0
    # NaN in the reference is not counted as a NaN produced by quantization
    assert analysis.nan_rate(np.array([np.nan, 1.0], np.float32), np.array([np.nan, 1.0], np.float32)) == 0.0


# --------------------------------------------------------------------------------------
# MX on its own grid
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ANALYSIS_MX)
@pytest.mark.parametrize("rule", ["floor", "rceil"])
@pytest.mark.slow  # left out of the quick tier (seconds; its paths run in other quick tests)
def test_mx_ulp_error_is_one_call_and_equals_the_scaled_element_grid(fmt, rule):
    x = _student_t(11, 3.0, (8, 96))
    elem = lowprec.mx_format(fmt).element.name

    @jax.jit  # one program (eagerly, each call is a compile of its own)
    def calls(v):
        q = lowprec.fake_quantize_mx(v, fmt, scale_rule=rule)
        s = analysis.mx_scale_exponents(v, fmt, scale_rule=rule)
        return (s, analysis.ulp_error(v, q, fmt, scale_rule=rule),
                analysis.ulp_error(v, q, elem, scale_exp=s), analysis.ulp(v, fmt, scale_rule=rule),
                analysis.ulp(v, elem, scale_exp=s))

    s, one_call, by_grid, ulp_one_call, ulp_by_grid = calls(x)
    assert one_call.tolist() == by_grid.tolist(), (fmt, rule)
    assert ulp_one_call.tolist() == ulp_by_grid.tolist(), (fmt, rule)
    # round to nearest on the scaled grid: at most half an ULP except for clipped elements
    clipped = np.abs(np.asarray(x)) > lowprec.mx_format(fmt).element.max_finite * np.exp2(np.asarray(s, np.float64))
    err = np.asarray(one_call)
    assert np.all(err[~clipped] <= 0.5)
    if rule == "rceil":
        assert not clipped.any()
    with pytest.raises(ValueError, match="scale_exp"):
        analysis.ulp(x, fmt, scale_exp=s)


def test_mx_ulp_by_hand():
    # MXFP4 block with max 6 -> floor scale 2^(2-2) = 1: FP4's own grid
    x = np.concatenate([[6.0, 1.0, 0.3], np.zeros(29)]).astype(np.float32)
    assert np.asarray(analysis.ulp(x, "mxfp4"))[:3].tolist() == [2.0, 0.5, 0.5]
    # max 100 under MXFP8 E4M3 floor: scale 2^(6-8): 100 sits in binade 2^6 -> ulp 2^3
    y = np.concatenate([[100.0, 1.0], np.zeros(30)]).astype(np.float32)
    assert np.asarray(analysis.ulp(y, "mxfp8_e4m3"))[:2].tolist() == [8.0, 2.0**-3]


# --------------------------------------------------------------------------------------
# compare: one call, element and MX alike, over seeds
# --------------------------------------------------------------------------------------
pd = pytest.importorskip("pandas")


def _keys(df, cols=("format", "scale_rule", "block_size")):
    """The key columns as plain lists, <NA> as None."""
    return [[None if pd.isna(v) else v for v in row] for row in df[list(cols)].astype(object).values.tolist()]


@pytest.mark.slow  # left out of the quick tier (seconds; its paths run in other quick tests)
def test_compare_matches_direct_computations_on_an_array():
    x = _student_t(12, 3.0, (32, 128))
    df = analysis.compare(x, ["e4m3", "bf16", "mxfp4"], scale_rules=["floor", "rceil"])
    # nullable dtypes (not object columns holding None): <NA> for element formats
    assert _keys(df) == [
        ["e4m3", None, None], ["bf16", None, None], ["mxfp4", "floor", 32], ["mxfp4", "rceil", 32]]
    assert {c: str(df[c].dtype) for c in ("format", "scale_rule", "block_size")} == {
        "format": "string", "scale_rule": "string", "block_size": "Int64"}
    assert df["bits_per_element"].tolist() == [8.0, 16.0, 4.25, 4.25]
    assert df["n_seeds"].tolist() == [1, 1, 1, 1]
    assert "sqnr_db_lo" not in df                         # one evaluation: no interval
    for _, row in df.iterrows():
        if pd.isna(row["scale_rule"]):
            q = lowprec.quantize(jnp.asarray(x), row["format"])
            u = analysis.ulp_error(x, q, row["format"])
            limit = lowprec.element_format(row["format"]).max_finite
            clip = float(np.mean(np.abs(x) > limit))
        else:
            q = lowprec.fake_quantize_mx(jnp.asarray(x), row["format"], scale_rule=row["scale_rule"])
            u = analysis.ulp_error(x, q, row["format"], scale_rule=row["scale_rule"])
            clip = analysis.mx_clipping_rate(x, row["format"], scale_rule=row["scale_rule"])
        assert row["sqnr_db"] == pytest.approx(analysis.sqnr_db(x, q), rel=1e-6)
        assert row["max_abs_error"] == pytest.approx(analysis.max_abs_error(x, q), rel=1e-6)
        assert row["mean_rel_error"] == pytest.approx(analysis.mean_rel_error(x, q), rel=1e-5)
        assert row["underflow_rate"] == analysis.underflow_rate(x, q)
        assert row["clip_rate"] == pytest.approx(clip)
        u = np.asarray(u, np.float64)
        assert row["ulp_max"] == pytest.approx(u.max(), rel=1e-6)
        assert row["ulp_p50"] == pytest.approx(np.quantile(u, 0.5), rel=1e-4)
        assert row["ulp_p99"] == pytest.approx(np.quantile(u, 0.99), rel=1e-4)
    # MXFP4: floor clips, rceil never does; FP4 underflows a lot on heavy tails
    mx = df[df["format"] == "mxfp4"].set_index("scale_rule")
    assert mx.loc["floor", "clip_rate"] > 0 and mx.loc["rceil", "clip_rate"] == 0
    assert mx.loc["rceil", "underflow_rate"] > 0.1


def test_compare_counts_e4m3_overflow_and_mx_nan_blocks():
    x = np.ones((2, 32), np.float32)
    x[0, 0] = 1000.0     # e4m3: NaN (overflow); MX: fine
    x[1, 3] = np.inf     # MX: the whole block becomes NaN; e4m3: inf input -> NaN (not counted)
    df = analysis.compare(x, ["e4m3", "mxfp8_e4m3"], scale_rules="rceil").set_index("format")
    assert df.loc["e4m3", "overflow_rate"] == 1 / 64
    assert df.loc["e4m3", "nan_rate"] == 2 / 64
    assert df.loc["mxfp8_e4m3", "overflow_rate"] == 31 / 64   # finite inputs of the inf block
    assert df.loc["mxfp8_e4m3", "nan_rate"] == 32 / 64         # ... and the inf itself
    assert not df["sqnr_db"].isna().any()                     # measured over the finite pairs


@pytest.mark.slow
def test_compare_over_seeds_gives_means_and_t_intervals():
    kw = dict(scale_rules=["floor", "rceil"], seeds=[3, 4, 5, 6], shape=(8, 256))
    runs = analysis.compare("laplace", ["e5m2", "mxfp8_e4m3"], per_seed=True, phase="dither", **kw)
    assert len(runs) == 12 and sorted(set(runs["seed"])) == [3, 4, 5, 6]
    # each per-seed row is the array comparison of that seed's sample, drawn at the seed's
    # dithered scale 2^phase
    one = analysis.compare(analysis.sample("laplace", (8, 256), seed=5, phase="dither"), "e5m2")
    row5 = runs[(runs["seed"] == 5) & (runs["format"] == "e5m2")]
    assert row5["sqnr_db"].item() == one["sqnr_db"].item()
    assert row5["phase"].item() == analysis.phase_of("dither", 5)
    summary = analysis.summarize(runs)
    assert summary.equals(analysis.compare("laplace", ["e5m2", "mxfp8_e4m3"], phase="dither", **kw))
    row = summary[summary["format"] == "e5m2"].iloc[0]
    v = runs[runs["format"] == "e5m2"]["sqnr_db"].to_numpy()
    half = 3.182 * v.std(ddof=1) / 2                      # t(0.975, 3) = 3.182 (tables)
    assert row["sqnr_db"] == pytest.approx(v.mean())
    assert row["sqnr_db_hi"] - row["sqnr_db"] == pytest.approx(half, rel=1e-3)
    assert row["n_seeds"] == 4
    # rates stay inside [0, 1]
    assert (summary["clip_rate_lo"] >= 0).all() and (summary["underflow_rate_hi"] <= 1).all()
    # the default stratifies the phases: seed 5 is the third of four, in [1/2, 3/4); four
    # values leave no room for a harmonic fit (3 degrees of freedom kept): the plain interval
    strat = analysis.compare("laplace", "e5m2", per_seed=True, **kw)
    assert strat["phase"].tolist() == analysis.stratified_phases([3, 4, 5, 6]).tolist()
    v = strat["sqnr_db"].to_numpy()
    row = analysis.summarize(strat).iloc[0]
    assert row["sqnr_db"] == pytest.approx(v.mean())
    assert row["sqnr_db_hi"] - row["sqnr_db"] == pytest.approx(3.182 * v.std(ddof=1) / 2, rel=1e-3)


@pytest.mark.slow
def test_paired_delta_by_hand():
    runs = analysis.compare("gaussian", "mxfp8_e4m3", scale_rules=["floor", "even", "rceil"],
                            seeds=5, shape=(8, 256), per_seed=True)
    d = analysis.paired_delta(runs, metric="sqnr_db", within="scale_rule", baseline="rceil")
    assert d["scale_rule"].tolist() == ["floor", "even"] and (d["baseline"] == "rceil").all()
    fl = runs[runs.scale_rule == "floor"].sort_values("seed")["sqnr_db"].to_numpy()
    rc = runs[runs.scale_rule == "rceil"].sort_values("seed")["sqnr_db"].to_numpy()
    m, lo, hi = analysis.confidence_interval(fl - rc)
    row = d[d.scale_rule == "floor"].iloc[0]
    assert (row["delta"], row["delta_lo"], row["delta_hi"]) == pytest.approx((m, lo, hi))
    assert row["delta_hi"] < 0                            # floor clips: worse than rceil
    by_format = analysis.paired_delta(
        analysis.compare("gaussian", ["e4m3", "e5m2"], seeds=3, shape=(8, 256), per_seed=True),
        within="format", baseline="e4m3")
    assert by_format["format"].tolist() == ["e5m2"] and 5 < -by_format["delta"].item() < 7
    # pairing across block sizes: the baseline is a size (nullable Int64, not a string)
    by_size = analysis.paired_delta(
        analysis.compare("gaussian", "mxfp4", scale_rules="rceil", block_sizes=[16, 32], seeds=3,
                         shape=(8, 256), per_seed=True),
        within="block_size", baseline=32)
    assert by_size["block_size"].tolist() == [16] and by_size["baseline"].tolist() == [32]
    assert str(by_size["baseline"].dtype) == "Int64"


@pytest.mark.slow
def test_compare_inputs_and_errors():
    calls = []

    def make(seed):
        calls.append(seed)
        return np.full((2, 64), 0.3 + seed, np.float32)

    df = analysis.compare({"fn": make, "arr": np.ones((2, 64), np.float32)}, "e2m1", seeds=None)
    assert df["input"].tolist() == ["fn", "arr"] and calls == list(range(10))
    assert df["n_seeds"].tolist() == [10, 1]
    with pytest.raises(ValueError, match="fixed array"):
        analysis.compare(np.ones(64, np.float32), "e4m3", seeds=3)
    with pytest.raises(ValueError, match="block_size 3 is not supported"):
        analysis.compare(np.ones(64, np.float32), "mxfp4", block_sizes=[32, 3])
    with pytest.raises(ValueError, match="unknown distribution"):
        analysis.compare("cauchy", "e4m3")
    with pytest.raises(ValueError, match="unknown scale_rule"):
        analysis.compare("gaussian", "mxfp4", scale_rules=["round"])
    with pytest.raises(ValueError, match="unknown format .fp5."):
        analysis.compare("gaussian", "fp5")
    # stochastic rounding: seeds seed the rounding of a fixed array
    sr = analysis.compare(np.full((1, 64), 1.1, np.float32), "e4m3", rounding="stochastic", seeds=4)
    assert sr["n_seeds"].item() == 4 and sr["sqnr_db_lo"].item() < sr["sqnr_db_hi"].item()


def test_sample_distributions():
    for name in analysis.DISTRIBUTIONS:
        x = analysis.sample(name, (64, 1024), seed=0)
        assert x.dtype == np.float32 and x.shape == (64, 1024), name
        assert np.array_equal(x, analysis.sample(name, (64, 1024), seed=0)), name
        assert not np.array_equal(x, analysis.sample(name, (64, 1024), seed=1)), name
    var = lambda n: float(analysis.sample(n, (256, 1024), phase=0.0).astype(np.float64).var())
    assert var("gaussian") == pytest.approx(1.0, rel=0.02)
    assert var("laplace") == pytest.approx(2.0, rel=0.03)      # Laplace(1): variance 2
    assert var("uniform") == pytest.approx(1 / 3, rel=0.02)
    assert var("student-t(5)") == pytest.approx(5 / 3, rel=0.1)  # nu / (nu - 2)
    out = analysis.sample("gauss+outliers", (256, 1024), phase=0.0)
    assert 0.0007 < np.mean(np.abs(out) > 10) < 0.0013        # 0.1 % scaled by 100


def test_row_subsets_cover_the_rows_once():
    x = np.arange(40.0).reshape(20, 2)
    parts = analysis.row_subsets(x, 4, seed=1)
    rows = np.concatenate([parts(i)[:, 0] for i in range(4)])
    assert sorted(rows.tolist()) == x[:, 0].tolist()
    with pytest.raises(ValueError, match="range"):
        parts(4)
    with pytest.raises(ValueError, match="2-D"):
        analysis.row_subsets(np.ones(5), 2)
    equal = analysis.row_subsets(x, 3, size=6, seed=2)
    chunks = [equal(i)[:, 0] for i in range(3)]
    assert all(c.shape == (6,) for c in chunks)
    assert len(set(np.concatenate(chunks).tolist())) == 18             # disjoint
    with pytest.raises(ValueError, match="need 21 rows"):
        analysis.row_subsets(x, 3, size=7)


@pytest.mark.parametrize("level, dof, t", [
    # two-sided Student-t quantiles from the standard tables
    (0.95, 1, 12.706), (0.95, 2, 4.303), (0.95, 4, 2.776), (0.95, 9, 2.262),
    (0.95, 19, 2.093), (0.95, 29, 2.045), (0.99, 9, 3.250), (0.90, 5, 2.015),
])
def test_confidence_interval_uses_student_t(level, dof, t):
    values = np.arange(dof + 1, dtype=np.float64)
    m, lo, hi = analysis.confidence_interval(values, level)
    assert m == pytest.approx(values.mean())
    assert (hi - m) / (values.std(ddof=1) / math.sqrt(dof + 1)) == pytest.approx(t, abs=6e-4)
    assert m - lo == pytest.approx(hi - m)


def test_confidence_interval_edge_cases():
    assert analysis.confidence_interval([2.0])[0] == 2.0
    assert all(math.isnan(v) for v in analysis.confidence_interval([2.0])[1:])
    m, lo, hi = analysis.confidence_interval([1.0, math.inf])
    assert m == math.inf and math.isnan(lo) and math.isnan(hi)
    with pytest.raises(ValueError, match="level"):
        analysis.confidence_interval([1.0, 2.0], 1.5)


def test_markdown_table_formats_dataframes_and_0d_arrays():
    rows = [{"name": "e4m3", "sqnr": jnp.float32(31.52223), "rate": np.float64(0.00863), "rule": None}]
    text = analysis.markdown_table(rows, floatfmt={"sqnr": ".2f", "rate": ".2%"})
    assert text.splitlines()[-1] == "| e4m3 | 31.52 | 0.86% | — |"
    frame = pd.DataFrame([{"a": 1.23456, "b": "x"}])
    assert analysis.markdown_table(frame, floatfmt=".2f").splitlines()[-1] == "| 1.23 | x |"


def test_value_tables_reject_block_formats_clearly():
    with pytest.raises(ValueError, match="element format 'e2m1'"):
        analysis.format_info(lowprec.mx_format("mxfp4"))
    with pytest.raises(ValueError, match="block"):
        analysis.representable_values("mxfp4")


# --------------------------------------------------------------------------------------
# plots: drawn, robust to inf / NaN / zero, annotated
# --------------------------------------------------------------------------------------
def _render(fig):
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=40)   # draws every artist
    assert buf.tell() > 1000


def test_plot_helpers_draw():
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(14, 8), layout="constrained")
    axes = fig.subplots(3, 3)
    analysis.plot_value_grid(["e2m1", "e4m3", "bf16"], ax=axes[0, 0])
    analysis.plot_spacing(["fp16", "tf32", "e8m0"], relative=True, ax=axes[0, 1])
    ax = analysis.plot_spacing(["tf32", "fp16"], relative=True, envelope=True, ax=axes[0, 2])
    widths = [line.get_linewidth() for line in ax.get_lines()]
    assert widths[0] > widths[1]                          # coinciding curves both visible
    ax = analysis.plot_curves([1, 2, 4], {"x": [1, 2, 3], "y": [1, 2, 3]},
                              bounds={"x": [2, 3, 4], "other": [0, 1, 1]},
                              bands={"x": ([0, 1, 2], [2, 3, 4])},
                              errors={"y": ([0.5, 1.5, 2.5], [1.5, 2.5, 3.5])},
                              ax=axes[1, 0], logx=True, legend_bounds=False)
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["x", "y"]
    markers = [line.get_marker() for line in ax.get_lines()[:2]]
    assert markers[0] != markers[1]                       # distinct markers
    analysis.plot_grouped_bars({"g1": {"s1": 1.0, "s2": (2.0, 1.5, 2.5)}, "g2": {"s1": 3.0}},
                               ax=axes[1, 1])
    analysis.plot_estimates({"g": {"a": (18.8, 18.7, 18.9), "b": 31.5}}, ax=axes[1, 2])
    _render(fig)


def test_histograms_survive_inf_nan_and_zero_and_say_so():
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    fig = Figure(layout="constrained")
    a, b = fig.subplots(1, 2)
    data = {"rel": np.array([0.0, 0.0, 1e-3, 0.01, 0.1, np.inf, np.nan, -np.inf, 0.2])}
    analysis.plot_histograms(data, bins=10, ax=a)
    assert a.get_legend().get_texts()[0].get_text() == "rel\n  (1 NaN, 1 +inf, 1 −inf not shown)"
    analysis.plot_histograms(data, bins=10, log_x=True, ax=b)
    label = b.get_legend().get_texts()[0].get_text()
    assert "2 zero (22.2%)" in label and "1 NaN" in label
    assert b.get_xscale() == "log"
    _render(fig)


@pytest.mark.slow  # left out of the quick tier (seconds; its paths run in other quick tests)
def test_error_vs_magnitude_and_delta_bars():
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    x = np.asarray(analysis.sample("student-t(3)", (8, 256)))
    x[0, :3] = [0.0, 1000.0, np.nan]
    q4 = np.asarray(lowprec.fake_quantize_mx(jnp.asarray(np.nan_to_num(x)), "mxfp4"))
    q8 = np.asarray(lowprec.quantize(jnp.asarray(x), "e4m3"))
    fig = Figure(figsize=(10, 4), layout="constrained")
    a, b = fig.subplots(1, 2)
    analysis.plot_error_vs_magnitude(x, {"mxfp4": q4, "e4m3": q8}, ax=a)
    labels = [t.get_text() for t in a.get_legend().get_texts()]
    assert "% → 0" in labels[0] and "NaN not shown" in labels[1]
    assert "1 zeros of x not shown" in a.get_xlabel()
    runs = analysis.compare({"t3": "student-t(3)", "gauss": "gaussian"}, ["mxfp4", "mxfp8_e4m3"],
                            scale_rules=["floor", "rceil"], seeds=3, shape=(8, 256), per_seed=True)
    d = analysis.paired_delta(runs, baseline="rceil")
    ax = analysis.plot_delta_bars(d, group="input", series="format", ax=b)
    lo, hi = ax.get_xlim()
    assert lo < min(0, d["delta_lo"].min()) and hi > max(0, d["delta_hi"].max())
    assert ax.get_xlabel() == "Δ vs rceil"
    _render(fig)


# --------------------------------------------------------------------------------------
# the other element formats (ml_dtypes' FP8/FP6, MX INT8, P3109), NVFP4, any block size
# --------------------------------------------------------------------------------------
import lowprec_reference as R  # noqa: E402

# One of each kind: IEEE-like with inf, fnuz (bias +1, one NaN), bias 11, the FP6 pair,
# MX INT8's fixed-point element (no normal numbers), P3109 signed/unsigned, precision 1
# (powers of two only) and P = K (no exponent field).
NEW_ELEMENTS = ["e4m3ieee", "e3m4", "e4m3fnuz", "e5m2fnuz", "e4m3b11fnuz", "e2m3", "e3m2",
                "ocp_int8", "p3109_k8p3se", "p3109_k8p4ue", "p3109_k8p1se", "p3109_k8p8se",
                "p3109_k6p3sf"]


def _reference_values(fmt):
    """Distinct finite values >= 0 of ``fmt`` from the reference decoder (float64, exact)."""
    v = R.decode(fmt, R.all_codes(fmt))
    return np.unique(v[np.isfinite(v) & (v >= 0)] + 0.0)   # + 0.0: -0 -> +0


@pytest.mark.parametrize("fmt", NEW_ELEMENTS)
@pytest.mark.quick_first(4)
def test_new_element_formats_ulp_is_the_gap_to_the_next_value(fmt):
    # The spacing at a grid value v is the distance to the next value; for the largest one,
    # from the previous if that lies in the same binade, else the binade's width (precision
    # 1: powers of two only). Derived from the reference's decoding of every code.
    v = _reference_values(fmt)
    top_binade = 2.0 ** math.floor(math.log2(v[-1]))
    last = v[-1] - v[-2] if v[-2] >= top_binade else top_binade
    expected = np.append(np.diff(v), last)
    # One call: the grid values, then 4x the largest (eagerly, each call and index compiles)
    got = np.asarray(analysis.ulp(np.append(v, 4 * v[-1]).astype(np.float32), fmt), np.float64)
    np.testing.assert_array_equal(got[:-1], expected)
    # and beyond the largest value the top binade's spacing continues
    assert got[-1] == expected[-1], (fmt, got[-1], expected[-1])


@pytest.mark.parametrize("fmt", NEW_ELEMENTS)
def test_new_element_formats_value_tables_match_the_reference(fmt):
    v = _reference_values(fmt)
    info = analysis.format_info(fmt)
    assert info["max_finite"] == v[-1] == float(R.max_finite(fmt))
    assert info["min_subnormal"] == v[1]
    signed = lowprec.element_format(fmt).signed
    assert info["finite_values"] == (2 * (len(v) - 1) + 1 if signed else len(v)) + (
        fmt == "ocp_int8")                       # INT8's code 0x80 is -2, with no +2
    np.testing.assert_array_equal(analysis.representable_values(fmt), v)
    values, gaps = analysis.value_spacing(fmt)
    np.testing.assert_array_equal(gaps, np.diff(v[1:]))


def test_value_table_of_formats_without_normal_numbers():
    # MX INT8 element: k/64, k in [-128, 127]: no exponent, one spacing 2^-6, 7 bits at the top
    info = analysis.format_info("ocp_int8")
    assert info["min_normal"] is None and info["eps"] == 2**-6 and info["normal_binades"] == 0
    assert info["decimal_digits"] == pytest.approx(7 * math.log10(2))
    assert analysis.format_info("e2m3")["decimal_digits"] == pytest.approx(4 * math.log10(2))
    assert analysis.format_info("e2m3")["min_normal"] == 1.0     # E2M3: bias 1, emin 0


@pytest.mark.quick_cases(fmt=QUICK_ELEMENTS + ("p3109_k8p3se",))
@pytest.mark.parametrize("fmt, rounding", [(f, "toward_zero" if i % 3 == 2 else "nearest_even")
                                           for i, f in enumerate(NEW_ELEMENTS)])
@pytest.mark.quick_first(1)
def test_new_element_formats_bounds_and_ulp_errors_hold(fmt, rounding):
    f = lowprec.element_format(fmt)
    top = float(R.max_finite(fmt))
    # NumPy inputs and one program for the three calls (eagerly, each jnp op is a compile).
    rng = np.random.default_rng(21)
    x = rng.standard_normal(1024) * np.exp2(rng.uniform(-12, 4, 1024)) * (top / 4)
    x = np.concatenate([x, [0.0, 3 * top, -2 * top]]).astype(np.float32)
    if not f.signed:
        x = np.abs(x)                          # unsigned: negative inputs are NaN

    @jax.jit
    def calls(v):
        q = lowprec.quantize(v, fmt, rounding=rounding, overflow="saturate")
        return q, analysis.quantization_error_bound(v, fmt, rounding=rounding), analysis.ulp_error(v, q, fmt)

    q, bound, ulp_err = calls(x)
    q, bound, ulp_err = np.asarray(q), np.asarray(bound), np.asarray(ulp_err)
    over = ~(np.abs(q - x) <= bound)
    assert not over.any(), f"{fmt} {rounding}: {np.count_nonzero(over)} over the bound, e.g. {x[over][:3]}"
    inside = np.abs(x) <= top
    err = ulp_err[inside]
    assert err.max() <= (0.5 if rounding == "nearest_even" else 1.0) and err.max() > 0.25
    # compare: clipping = |x| beyond the reference max; the median ULP error within half
    row = analysis.compare(x, fmt, rounding=rounding, overflow="saturate").iloc[0]
    assert row["clip_rate"] == pytest.approx(np.mean(~inside))
    assert row["ulp_p50"] <= (0.5 if rounding == "nearest_even" else 1.0) and row["ulp_max"] == pytest.approx(
        float(ulp_err.max()), rel=1e-6)


def test_mxint8_ulp_is_a_fixed_point_grid():
    # MXINT8 block with max 1.5 -> floor scale 2^0: the grid k/64; max 100 -> 2^6: k
    x = np.concatenate([[1.5, 0.01], np.zeros(30), [100.0, 0.3], np.zeros(30)]).astype(np.float32)
    u = np.asarray(analysis.ulp(x, "mxint8"))
    assert u[:2].tolist() == [2.0**-6, 2.0**-6] and u[32:34].tolist() == [1.0, 1.0]
    q = lowprec.fake_quantize_mx(x, "mxint8")
    assert np.asarray(q)[33] == 0.0
    assert np.asarray(analysis.ulp_error(x, q, "mxint8"))[33] == pytest.approx(0.3)


def _nvfp4_blocks():
    # Three NVFP4 blocks of 16. amax 2688 -> tensor scale 2688 / 2688 = 1 (exact);
    # block scales e4m3(amax / 6): 448, e4m3(1.05) = 1 (so 6.3 > 6 is clipped), and
    # e4m3(0.55) = 0.5625 (E4M3 spacing 1/16 in [0.5, 1): 0.5625 is the nearest).
    # Built in NumPy: each eager jnp op (and each eager index below) is a compile of its own.
    return jnp.asarray(np.concatenate([[2688.0], np.zeros(15), [6.3, 1.0], np.zeros(14),
                                       [3.3, 0.3], np.zeros(14)]).astype(np.float32))


@pytest.mark.slow  # left out of the quick tier (seconds; its paths run in other quick tests)
def test_nvfp4_ulp_and_ulp_error_by_hand():
    x = _nvfp4_blocks()
    u = np.asarray(analysis.ulp(x, "nvfp4"))
    # x / factor in E2M1's grid: 2688/448 = 6 (spacing 2) -> 896; 6.3 (top binade) -> 2;
    # 1.0 -> 0.5; 3.3/0.5625 = 5.87 (binade [4, 8): 2) -> 1.125; 0.3/0.5625 (subnormal 0.5)
    assert [u[i].item() for i in (0, 16, 17, 32, 33)] == [896.0, 2.0, 0.5, 1.125, 0.28125]
    q = lowprec.fake_quantize_mx(x, "nvfp4")
    assert np.asarray(q)[16] == 6.0                          # clipped to 6 x 1
    assert np.asarray(analysis.ulp_error(x, q, "nvfp4"))[16] == pytest.approx(0.3 / 2, rel=1e-6)
    with pytest.raises(ValueError, match="scale_rule"):
        analysis.ulp(x, "nvfp4", scale_rule="floor")


@pytest.mark.slow
def test_nvfp4_bound_holds_and_is_tight():
    x = jax.random.t(jax.random.key(23), 3.0, (8, 256)) * 1e-3   # shape shared: one compile

    @jax.jit  # one program (eagerly, each call and reduction is a compile of its own)
    def calls(v):
        q = lowprec.fake_quantize_mx(v, "nvfp4")
        return (jnp.abs(q - v), analysis.quantization_error_bound(v, "nvfp4"),
                analysis.ulp_error(v, q, "nvfp4"))

    err, bound, ulps = (np.asarray(a) for a in calls(x))
    assert np.all(err <= bound), f"{np.count_nonzero(err > bound)} over the bound"
    assert bound.max() < 4 * err.max()
    # NVFP4's clipping stays within half an ULP: a block scale rounded to nearest E4M3 leaves
    # amax / factor <= 6 (1 + 2^-4) = 6.375 < 7, half way to the next (absent) value 8
    assert ulps.max() <= 0.5 + 1e-6


@pytest.mark.slow
def test_compare_new_block_formats_and_block_sizes():
    x = np.asarray(jax.random.t(jax.random.key(24), 3.0, (8, 256)))
    df = analysis.compare(x, ["mxint8", "mxfp4"], scale_rules=["floor", "rceil"],
                          block_sizes=[8, 64])
    keys = _keys(df)
    assert keys == [["mxint8_b8", "floor", 8], ["mxint8_b8", "rceil", 8],
                    ["mxint8_b64", "floor", 64], ["mxint8_b64", "rceil", 64],
                    ["mxfp4_b8", "floor", 8], ["mxfp4_b8", "rceil", 8],
                    ["mxfp4_b64", "floor", 64], ["mxfp4_b64", "rceil", 64]]
    # bits: element bits + 8 scale bits / block size
    elem_bits = {"mxint8": 8, "mxfp4": 4}
    for _, row in df.iterrows():
        base = row["format"].rsplit("_b", 1)[0]
        assert row["bits_per_element"] == elem_bits[base] + 8 / row["block_size"]
        q = lowprec.fake_quantize_mx(jnp.asarray(x), base, scale_rule=row["scale_rule"],
                                     block_size=row["block_size"])
        assert row["sqnr_db"] == pytest.approx(analysis.sqnr_db(x, q), rel=1e-6)
    # NVFP4: its own block size, no scale rule (one row whatever rules are asked for)
    nv = analysis.compare(x, ["nvfp4"], scale_rules=["floor", "rceil"])
    assert _keys(nv, ("format", "scale_rule", "block_size", "bits_per_element")) == [
        ["nvfp4", None, 16, 4.5]]
    q = lowprec.fake_quantize_mx(jnp.asarray(x), "nvfp4")
    assert nv["sqnr_db"].item() == pytest.approx(analysis.sqnr_db(x, q), rel=1e-6)
    assert nv["clip_rate"].item() == pytest.approx(analysis.mx_clipping_rate(x, "nvfp4"))
    assert nv["ulp_max"].item() == pytest.approx(
        float(analysis.ulp_error(x, q, "nvfp4").max()), rel=1e-6)
    with pytest.raises(ValueError, match="block_size 48"):
        analysis.compare(x, "mxfp4", block_sizes=[48])
    with pytest.raises(ValueError, match="whole"):
        analysis.compare(x, "mxfp6_e2m3", block_sizes=[2])


# --------------------------------------------------------------------------------------
# compare: edge cases, metrics, scale phase, tidy export, per-block view
# --------------------------------------------------------------------------------------
@pytest.mark.slow
def test_compare_axis_out_of_range_raises_instead_of_wrapping():
    x = np.ones((4, 64), np.float32)
    for axis in (5, 2, -3):
        with pytest.raises(ValueError, match=f"axis {axis} is out of range"):
            analysis.compare(x, ["e4m3", "mxfp4"], axis=axis)
    assert analysis.compare(x, "mxfp4", scale_rules="rceil", axis=-2, pad=True)["sqnr_db"].notna().all()


@pytest.mark.slow
def test_compare_partial_blocks_follow_quantize_mx():
    x = np.random.default_rng(30).standard_normal((4, 40), dtype=np.float32)
    # quantize_mx refuses a length that is not a multiple of the block size ...
    with pytest.raises(ValueError, match="not a multiple"):
        lowprec.quantize_mx(jnp.asarray(x), "mxfp4")
    with pytest.raises(ValueError, match="pass pad=True"):
        analysis.compare(x, "mxfp4")
    # ... and so does compare; element formats have no blocks, so any length is fine
    assert analysis.compare(x, "e4m3")["n_seeds"].item() == 1
    # with pad=True: the zero-padded quantization, padding dropped (as quantize_mx(pad=True))
    padded = analysis.compare(x, "mxfp4", scale_rules="floor", pad=True)
    q = lowprec.fake_quantize_mx(jnp.asarray(x), "mxfp4", scale_rule="floor", pad=True)
    assert q.shape == x.shape
    assert padded["sqnr_db"].item() == pytest.approx(analysis.sqnr_db(x, q), rel=1e-6)


@pytest.mark.slow
def test_compare_never_scores_nothing_as_infinite_sqnr():
    with pytest.raises(ValueError, match="empty"):
        analysis.compare(np.zeros((0, 32), np.float32), ["e4m3", "mxfp4"])
    with pytest.raises(ValueError, match="no finite element"):
        analysis.compare(np.full((2, 32), np.nan, np.float32), "mxfp4")
    with pytest.raises(ValueError, match="no finite element"):
        analysis.compare(lambda s: np.full((2, 32), np.inf, np.float32), "e4m3", seeds=1)
    # every element overflows E4M3 to NaN: nothing finite to score -> NaN, counted as overflow
    big = analysis.compare(np.full((1, 32), 1000.0, np.float32), "e4m3").iloc[0]
    assert big["overflow_rate"] == 1 and np.isnan(big["sqnr_db"]) and np.isnan(big["rmse"])
    # a signal of zeros: reproduced exactly, but its SQNR is 0/0, not +inf
    zero = analysis.compare(np.zeros((1, 32), np.float32), ["e4m3", "mxfp4"], scale_rules="rceil")
    assert zero["sqnr_db"].isna().all() and (zero["rmse"] == 0).all()
    # an exact nonzero reproduction is a true +inf
    assert analysis.compare(np.ones((1, 32), np.float32), "e4m3")["sqnr_db"].item() == np.inf


def test_compare_bias_rmse_nmse_cosine_matmul_by_hand():
    x = np.asarray(jax.random.t(jax.random.key(31), 4.0, (8, 256)))
    df = analysis.compare(x, ["e5m2", "mxfp4"], scale_rules="floor")
    # the matmul operand: a standard Gaussian of x's shape seeded by it, its rows (length K =
    # 256, the block axis) the columns of W; quantized with the same configuration
    W = np.random.default_rng([8, 256, 0x6D6D]).standard_normal((8, 256)).astype(np.float32)
    for _, row in df.iterrows():
        fmt = row["format"]
        if fmt == "mxfp4":
            quant = lambda a: lowprec.fake_quantize_mx(jnp.asarray(a), fmt, scale_rule="floor")
        else:
            quant = lambda a: lowprec.quantize(jnp.asarray(a), fmt)
        q64, x64 = np.asarray(quant(x), np.float64), x.astype(np.float64)
        e = q64 - x64
        assert row["bias"] == pytest.approx(e.mean(), rel=1e-4, abs=1e-9)
        assert row["rmse"] == pytest.approx(np.sqrt(np.mean(e**2)), rel=1e-5)
        assert row["nmse"] == pytest.approx(np.sum(e**2) / np.sum(x64**2), rel=1e-5)
        assert row["nmse"] == pytest.approx(10 ** (-row["sqnr_db"] / 10), rel=1e-5)
        cos = np.sum(x64 * q64) / np.sqrt(np.sum(x64**2) * np.sum(q64**2))
        assert row["cosine"] == pytest.approx(cos, rel=1e-6)
        qW = np.asarray(quant(W), np.float64)
        y = x64 @ W.T.astype(np.float64)
        # float64 products here; compare forms the error from the exact differences in float32
        assert row["matmul_rel_error"] == pytest.approx(
            np.linalg.norm(q64 @ qW.T - y) / np.linalg.norm(y), rel=1e-5)
    # interval bounds respect the metric's range (cosine <= 1)
    runs = analysis.compare("gaussian", "mxfp8_e4m3", scale_rules="rceil", seeds=3, shape=(8, 256))
    assert runs["cosine_hi"].item() <= 1 and runs["nmse_lo"].item() >= 0


@pytest.mark.slow  # left out of the quick tier (seconds; its paths run in other quick tests)
def test_compare_frames_have_no_object_columns():
    runs = analysis.compare({"g": lambda s: analysis.sample("gaussian", (8, 256), seed=s),
                             "a": np.ones((8, 256), np.float32)}, ["bf16", "nvfp4"], per_seed=True)
    assert not [c for c in runs.columns if runs[c].dtype == object]
    assert str(runs["seed"].dtype) == "Int64" and runs["seed"].isna().sum() == 2   # the array
    for frame in (analysis.summarize(runs), analysis.paired_delta(runs, within="format", baseline="bf16")):
        assert not [c for c in frame.columns if frame[c].dtype == object], frame.dtypes


def test_scale_phase_is_a_period_of_one_octave_for_mx():
    # x * 2 is exact and power-of-two scales follow it: every MX metric is periodic in log2 sigma
    kw = dict(scale_rules=["floor", "rceil"], seeds=[0, 1], shape=(8, 256), per_seed=True)
    a = analysis.compare("student-t(3)", ["mxfp8_e4m3", "mxfp4"], phase=0.3, **kw)
    b = analysis.compare("student-t(3)", ["mxfp8_e4m3", "mxfp4"], phase=1.3, **kw)
    assert (a["phase"] == 0.3).all() and (b["phase"] == 1.3).all()
    for m in ("sqnr_db", "nmse", "cosine", "clip_rate", "underflow_rate", "ulp_max"):
        assert np.array_equal(a[m].to_numpy(), b[m].to_numpy()), m
    x0 = analysis.sample("student-t(3)", (8, 256), seed=0, phase=0.3)
    assert np.array_equal(analysis.sample("student-t(3)", (8, 256), seed=0, phase=1.3), 2 * x0)
    # but within an octave the metric moves (that is why the default dithers it)
    c = analysis.compare("student-t(3)", ["mxfp8_e4m3", "mxfp4"], phase=0.8, **kw)
    assert not np.array_equal(a["sqnr_db"].to_numpy(), c["sqnr_db"].to_numpy())


@pytest.mark.slow  # left out of the quick tier (seconds; its paths run in other quick tests)
def test_dithered_phase_by_default_for_distributions_only():
    runs = analysis.compare({"g": "gaussian", "f": lambda s: analysis.sample("gaussian", (8, 256), seed=s)},
                            "mxfp4", scale_rules="rceil", seeds=6, shape=(8, 256), per_seed=True)
    g, f = runs[runs["input"] == "g"], runs[runs["input"] == "f"]
    ph = g["phase"].to_numpy()
    # a distribution's 6 seeds get one phase in each sixth of the octave (stratified)
    assert ((0 <= ph) & (ph < 1)).all() and (np.floor(ph * 6) == np.arange(6)).all()
    assert ph.tolist() == analysis.stratified_phases(range(6)).tolist()
    assert (f["phase"] == 0).all()                     # a function keeps its own scale
    dith = analysis.compare("gaussian", "mxfp4", scale_rules="rceil", seeds=6, shape=(8, 256),
                            per_seed=True, phase="dither")
    assert dith["phase"].tolist() == [analysis.phase_of("dither", s) for s in range(6)]
    assert "stratum" not in dith
    # phase="dither" dithers arrays too, and then seeds are allowed (they pick the phases)
    arr = analysis.compare(np.ones((1, 32), np.float32), "e4m3", phase="dither", seeds=3, per_seed=True)
    assert len(arr) == 3 and len(set(arr["phase"])) == 3
    # phase=0.0 is the unit scale, NumPy's own draw; a phase p multiplies it by 2^p in float64
    # before the one rounding to float32; sample's default is the seed's dithered phase
    ref = np.random.default_rng(4).standard_normal((3, 5))
    assert np.array_equal(analysis.sample("gaussian", (3, 5), seed=4, phase=0.0), ref.astype(np.float32))
    assert np.array_equal(analysis.sample("gaussian", (3, 5), seed=4),
                          (ref * 2.0 ** analysis.phase_of("dither", 4)).astype(np.float32))
    assert np.array_equal(analysis.sample("gaussian", (3, 5), seed=4, phase=0.3),
                          (ref * 2.0**0.3).astype(np.float32))
    with pytest.raises(ValueError, match="phase must be"):
        analysis.compare("gaussian", "e4m3", phase="random")
    with pytest.raises(ValueError, match="finite"):
        analysis.sample("gaussian", (2,), phase=float("inf"))


def test_phase_sweep_equals_compare_at_each_phase():
    kw = dict(scale_rules=["floor", "rceil"], shape=(8, 256))
    sw = analysis.phase_sweep("gaussian", "mxfp4", phases=[0.0, 0.5], seeds=3, baseline="rceil", **kw)
    assert sw["phase"].tolist() == [0.0, 0.0, 0.5, 0.5]
    for p in (0.0, 0.5):
        runs = analysis.compare("gaussian", "mxfp4", seeds=3, phase=p, per_seed=True, **kw)
        d = analysis.paired_delta(runs, baseline="rceil")
        got = sw[(sw["phase"] == p) & (sw["scale_rule"] == "floor")]
        assert got["delta"].item() == d["delta"].item()
        assert got["sqnr_db"].item() == analysis.summarize(runs)["sqnr_db"].iloc[0]
    assert sw[sw["scale_rule"] == "rceil"]["delta"].isna().all()
    with pytest.raises(TypeError, match="phase"):
        analysis.phase_sweep("gaussian", "mxfp4", phase=0.5)


@pytest.mark.slow  # left out of the quick tier (seconds; its paths run in other quick tests)
def test_long_format_holds_every_number_once():
    df = analysis.compare("laplace", ["e4m3", "mxfp4"], scale_rules="rceil", seeds=2, shape=(8, 256))
    tidy = analysis.long_format(df)
    assert len(tidy) == len(df) * len(analysis._compare.METRICS)
    for _, r in tidy.sample(20, random_state=0).iterrows():
        src = df[df["format"] == r["format"]].iloc[0]
        assert r["value"] == src[r["metric"]] or (np.isnan(r["value"]) and np.isnan(src[r["metric"]]))
        assert r["lo"] == src[r["metric"] + "_lo"] or np.isnan(r["lo"])
    assert str(tidy["metric"].dtype) == "string" and not [c for c in tidy if tidy[c].dtype == object]
    # per-seed frames keep seed and phase; a paired_delta frame becomes metric "delta"
    runs = analysis.compare("laplace", "mxfp4", scale_rules=["floor", "rceil"], seeds=2, shape=(8, 256),
                            per_seed=True)
    assert {"seed", "phase"} <= set(analysis.long_format(runs).columns)
    d = analysis.long_format(analysis.paired_delta(runs))
    assert d["metric"].tolist() == ["delta"] and d["baseline"].tolist() == ["rceil"]
    with pytest.raises(ValueError, match="no metric"):
        analysis.long_format(pd.DataFrame({"a": [1]}))


def test_block_stats_by_hand_and_pooled():
    x = np.asarray(jax.random.t(jax.random.key(32), 3.0, (8, 256)))
    b = analysis.block_stats(x, "mxfp4", scale_rule="floor")
    assert len(b) == 64 and (b["n"] == 32).all()
    xb = x.reshape(-1, 32).astype(np.float64)
    q = np.asarray(lowprec.fake_quantize_mx(jnp.asarray(x), "mxfp4", scale_rule="floor"), np.float64).reshape(-1, 32)
    # floor: scale 2^(floor(log2 amax) - emax_elem), emax(E2M1) = 2
    amax = np.abs(xb).max(1)
    assert np.array_equal(b["amax"], amax)
    assert np.array_equal(b["scale"], 2.0 ** (np.floor(np.log2(amax)) - 2))
    sig, noise = (xb**2).sum(1), ((q - xb) ** 2).sum(1)
    assert np.allclose(b["sqnr_db"], 10 * np.log10(sig / noise))
    assert np.array_equal(b["clip_rate"], (np.abs(xb) > 6 * b["scale"].to_numpy()[:, None]).mean(1))
    assert np.array_equal(b["underflow_rate"], ((xb != 0) & (q == 0)).mean(1))
    # pooling the blocks' signal and noise gives compare's tensor SQNR
    pooled = 10 * np.log10(sig.sum() / noise.sum())
    assert pooled == pytest.approx(analysis.compare(x, "mxfp4", scale_rules="floor")["sqnr_db"].item(), abs=1e-4)
    # axis, padding and NVFP4 follow quantize_mx's rules
    with pytest.raises(ValueError, match="out of range"):
        analysis.block_stats(x, "mxfp4", axis=2)
    with pytest.raises(ValueError, match="pass pad=True"):
        analysis.block_stats(x[:, :40], "mxfp4")
    assert analysis.block_stats(x[:, :40], "mxfp4", pad=True)["n"].tolist() == [32, 8] * 8
    with pytest.raises(ValueError, match="own scale recipe"):
        analysis.block_stats(x, "nvfp4", scale_rule="floor")
    nv = analysis.block_stats(x, "nvfp4")
    assert len(nv) == 128 and (nv["clip_rate"] <= 1 / 16).all()


def test_matmul_rel_error_follows_the_random_walk_prediction():
    # x and W are both standard Gaussian (phase 0) and quantized alike, with independent,
    # zero-mean errors of relative power rho = NMSE each: ||q(x)q(W) - xW||^2 / ||xW||^2 is
    # about rho + rho + rho^2 (notebook 4's prediction), whatever the format
    x = analysis.sample("gaussian", (32, 128), seed=9, phase=0.0)
    df = analysis.compare(x, ["e4m3", "mxfp4", "bf16"], scale_rules="rceil")
    for _, row in df.iterrows():
        rho = row["nmse"]
        predicted = np.sqrt(2 * rho + rho**2)
        assert 0.85 < row["matmul_rel_error"] / predicted < 1.15, (row["format"], row["matmul_rel_error"], predicted)


def test_dithered_phases_are_uniform_over_the_octave():
    # p ~ U[0, 1), i.e. sigma = 2^p log-uniform over one octave: 2000 seeds, counts per tenth
    # within 5 standard deviations of 200 (binomial sd = sqrt(2000 * 0.1 * 0.9) = 13.4)
    p = np.array([analysis.phase_of("dither", s) for s in range(2000)])
    assert ((0 <= p) & (p < 1)).all()
    counts = np.histogram(p, bins=10, range=(0, 1))[0]
    assert np.all(np.abs(counts - 200) < 5 * 13.4), counts
    # independent of the data's own stream: the phase is not a function of the first draw
    first = np.array([np.random.default_rng(s).random() for s in range(2000)])
    assert abs(np.corrcoef(p, first)[0, 1]) < 0.1


# --------------------------------------------------------------------------------------
# Phases, intervals and provenance (issue 36, point 4)
# --------------------------------------------------------------------------------------
def test_stratified_phases_cover_the_octave_once_each():
    for n in (1, 2, 7, 8):
        p = analysis.stratified_phases(range(n))
        assert (np.floor(p * n) == np.arange(n)).all(), (n, p)
        # the position inside the stratum is the seed's own dithered draw
        assert np.allclose(p * n - np.arange(n), [analysis.phase_of("dither", s) for s in range(n)])
    assert analysis.stratified_phases([5, 3]).tolist() == [analysis.phase_of("dither", 5) / 2,
                                                           (1 + analysis.phase_of("dither", 3)) / 2]
    with pytest.raises(ValueError, match="at least one seed"):
        analysis.stratified_phases([])
    with pytest.raises(ValueError, match="stratified_phases"):
        analysis.sample("gaussian", (4,), phase="stratified")


def test_harmonic_interval_on_an_even_grid_by_the_dft():
    # Phases on the grid i/n make 1, cos 2 pi k p, sin 2 pi k p orthogonal: the fit's intercept
    # is the plain mean, and the residual sum of squares is what the DFT leaves outside
    # frequencies 0, 1, 2: sum y^2 - n mean^2 - (2/n) (|Y_1|^2 + |Y_2|^2) (n > 4). The
    # intercept's variance is s^2 / n, s^2 = RSS / (n - 5); t quantiles from published tables.
    rng = np.random.default_rng(2)
    for n, t in ((8, 3.1824), (12, 2.3646)):
        p = np.arange(n) / n
        y = 0.4 * np.cos(2 * np.pi * p + 1) + 0.1 * np.sin(4 * np.pi * p) + 0.05 * rng.standard_normal(n)
        Y = np.fft.fft(y)
        rss = np.sum(y**2) - n * y.mean() ** 2 - 2 / n * (abs(Y[1]) ** 2 + abs(Y[2]) ** 2)
        m, lo, hi = analysis.confidence_interval(y, phases=p)
        assert m == pytest.approx(y.mean(), abs=1e-12)
        assert hi - m == pytest.approx(t * np.sqrt(rss / (n - 5) / n), rel=1e-4), n
    # fewer harmonics where values are few (3 degrees of freedom kept), none below 6 values
    p6, y6 = np.arange(6) / 6, rng.standard_normal(6)
    Y = np.fft.fft(y6)
    rss = np.sum(y6**2) - 6 * y6.mean() ** 2 - 2 / 6 * abs(Y[1]) ** 2
    assert analysis.confidence_interval(y6, phases=p6)[2] - y6.mean() == pytest.approx(
        3.1824 * np.sqrt(rss / 3 / 6), rel=1e-4)
    y5 = rng.standard_normal(5)
    assert analysis.confidence_interval(y5, phases=np.arange(5) / 5) == analysis.confidence_interval(y5)
    assert analysis.confidence_interval(y6, phases=p6, harmonics=0) == analysis.confidence_interval(y6)
    with pytest.raises(ValueError, match="one phase per value"):
        analysis.confidence_interval([1.0, 2.0, 3.0], phases=[0.1, 0.2])


# Quick tier: the stratified design (the same interval code; ~2 CPU s of NumPy studies each).
@pytest.mark.quick_cases(design=["stratified"])
@pytest.mark.parametrize("design", ["stratified", "dither"])
def test_harmonic_interval_covers_the_octave_mean_and_is_tighter(design):
    # A metric periodic in the phase (sinusoid, two harmonics, a kinked wave, flat) plus
    # independent noise, 8 seeds: over 1500 studies the interval covers the octave mean in
    # 95 % +- 2.5 % of them; where the phase's effect dominates it is several times narrower
    # than the independent interval, which counts that effect as noise.
    rng = np.random.default_rng(3)
    n, studies = 8, 1500
    shapes = {"sin": lambda p: 0.2 * np.sin(2 * np.pi * p),
              "two harmonics": lambda p: 0.2 * np.sin(2 * np.pi * p) + 0.08 * np.cos(4 * np.pi * p),
              "kink": lambda p: 0.3 * np.maximum(0, np.sin(2 * np.pi * p)),
              "flat": lambda p: 0 * p}
    grid = (np.arange(100_000) + 0.5) / 100_000
    for name, f in shapes.items():
        truth = f(grid).mean()
        cover, width, width_iid = 0, [], []
        for _ in range(studies):
            p = (np.arange(n) + rng.random(n)) / n if design == "stratified" else rng.random(n)
            y = f(p) + 0.02 * rng.standard_normal(n)
            _, lo, hi = analysis.confidence_interval(y, phases=p)
            cover += lo <= truth <= hi
            width.append(hi - lo)
            _, lo, hi = analysis.confidence_interval(y)
            width_iid.append(hi - lo)
        assert 0.925 < cover / studies < 0.975, (name, cover / studies)
        if name == "sin":   # random phases clump: less gain than evenly spread ones
            assert np.median(width_iid) > (4 if design == "stratified" else 2.5) * np.median(width)


def test_frames_carry_their_provenance():
    runs = analysis.compare({"g": "gaussian", "a": np.ones((2, 32), np.float32)}, "mxfp4",
                            scale_rules="rceil", seeds=None, shape=(2, 32), per_seed=True)
    for frame in (runs, analysis.summarize(runs, level=0.9)):
        a = frame.attrs
        assert a["seeds"] == {"g": tuple(range(10)), "a": (None,)}
        assert a["phase"] == {"g": "stratified", "a": None} and a["shape"] == (2, 32)
        assert a["lowprec_version"] == lowprec.__version__
        # this test runs from a git checkout: the commit it ran from, marked if edited
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], capture_output=True,
                              text=True, cwd=lowprec.__file__.rsplit("/", 2)[0]).stdout.strip()
        assert a["commit"] in (head, head + "+uncommitted"), a["commit"]
    assert analysis.summarize(runs, level=0.9).attrs["level"] == 0.9
    assert "octave mean" in analysis.summarize(runs).attrs["interval"]
    fixed = analysis.compare(np.ones((2, 32), np.float32), "e4m3", phase=0.25, per_seed=True)
    assert fixed.attrs["phase"] == {"array": 0.25} and fixed.attrs["shape"] is None


def test_paired_delta_refuses_an_unknown_baseline():
    runs = analysis.compare("gaussian", "mxfp4", scale_rules=["floor", "rceil"], seeds=2,
                            shape=(2, 32), per_seed=True)
    with pytest.raises(ValueError, match=r"baseline 'bogus' is not a scale_rule .*'floor', 'rceil'"):
        analysis.paired_delta(runs, baseline="bogus")
    with pytest.raises(ValueError, match="baseline 64 is not a block_size"):
        analysis.paired_delta(runs, within="block_size", baseline=64)
    d = analysis.paired_delta(runs, baseline="floor")
    assert d["scale_rule"].tolist() == ["rceil"] and d.attrs["seeds"] == {"gaussian": (0, 1)}
    with pytest.raises(ValueError, match="baseline 'bogus'"):
        analysis.phase_sweep("gaussian", "mxfp4", scale_rules=["floor", "rceil"], phases=1,
                             seeds=2, shape=(2, 32), baseline="bogus")



def test_random_hadamard_is_the_recipes_rotation_and_orthogonal():
    from lowprec import _nvfp4_train

    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 64, 3)).astype(np.float32)
    x[0, 5, 1] = 40.0
    # The recipe's signs under jit (integer steps: the same values; eagerly, its key, hash and
    # sign arithmetic are a dozen programs of their own)
    recipe_signs = jax.jit(_nvfp4_train.rht_signs, static_argnums=(0, 1))
    for block in (2, 32):   # (16: below, bit for bit against the recipe's own rotation)
        # M = H diag(s) / sqrt(n) per block of n along the axis, H by Sylvester's recursion
        h = np.ones((1, 1))
        while h.shape[0] < block:
            h = np.block([[h, h], [h, -h]])
        s = np.asarray(recipe_signs(7, block), np.float64)
        m = h * s[None, :] / np.sqrt(block)
        want = np.einsum("ij,bkjc->bkic", m, x.astype(np.float64).reshape(2, 64 // block, block, 3))
        got = np.asarray(analysis.random_hadamard(x, block, seed=7, axis=1))
        assert got.dtype == np.float32 and got.shape == x.shape
        np.testing.assert_allclose(got, want.reshape(x.shape), rtol=0, atol=1e-5 * np.abs(x).max())
        back = np.asarray(analysis.random_hadamard(got, block, seed=7, axis=1, inverse=True))
        np.testing.assert_allclose(back, x, rtol=0, atol=1e-5 * np.abs(x).max())
        assert np.linalg.norm(got) == pytest.approx(np.linalg.norm(x), rel=1e-6)
    # block 16 along axis 0 is the NVFP4 training recipe's wgrad rotation, bit for bit
    v = rng.standard_normal((32, 5)).astype(np.float32)
    # (the recipe's rht under jit, as its training steps run it: eagerly, each of its
    # butterfly's primitives is a compile of its own)
    recipe = jax.jit(lambda v: _nvfp4_train.rht(v, _nvfp4_train.rht_signs(3)))
    np.testing.assert_array_equal(np.asarray(analysis.random_hadamard(v, 16, seed=3, axis=0)),
                                  np.asarray(recipe(v)))
    # an outlier is spread evenly over its block
    one = np.zeros((1, 32), np.float32)
    one[0, 9] = 8.0
    y = np.asarray(analysis.random_hadamard(one, 32))
    assert np.allclose(np.abs(y), 8 / np.sqrt(32))
    with pytest.raises(ValueError, match="power of two"):
        analysis.random_hadamard(x, 24, axis=1)
    with pytest.raises(ValueError, match="not a multiple of the rotation's block 32"):
        analysis.random_hadamard(np.ones((2, 48), np.float32), 32)
