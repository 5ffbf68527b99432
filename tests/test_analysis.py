"""Tests of lowprec.analysis: metrics against hand-computed cases, bounds as properties."""

import math
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lowprec
from lowprec import analysis

ELEMENTS = ("fp16", "bf16", "tf32", "e4m3", "e5m2", "e2m1")  # signed formats with a zero


def _f(x):
    return float(x)


# --------------------------------------------------------------------------------------
# SQNR and the scalar metrics
# --------------------------------------------------------------------------------------
def test_sqnr_known_powers():
    # Signal 2.0 everywhere (power 4), noise +-0.25 (power 1/16): ratio 64.
    x = jnp.full(1000, 2.0)
    noise = jnp.where(jnp.arange(1000) % 2 == 0, 0.25, -0.25)
    assert _f(analysis.sqnr_db(x, x + noise)) == pytest.approx(10 * math.log10(64), abs=1e-5)
    # [3, -4] has power 25; noise [0.5, 0] has power 0.25: 20 dB.
    x = jnp.array([3.0, -4.0])
    assert _f(analysis.sqnr_db(x, x + jnp.array([0.5, 0.0]))) == pytest.approx(20.0, abs=1e-5)


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


def test_error_stats_matches_individual_metrics():
    key = jax.random.key(0)
    x = jax.random.normal(key, (256,))
    q = lowprec.quantize(x, "e4m3")
    stats = analysis.error_stats(x, q)
    for name in ("sqnr_db", "max_abs_error", "mean_abs_error", "rms_error", "mean_error",
                 "max_rel_error", "mean_rel_error", "underflow_rate"):
        assert _f(stats[name]) == pytest.approx(_f(getattr(analysis, name)(x, q)), rel=1e-6), name
    # E4M3 round to nearest on N(0,1) data: relative error <= unit roundoff 1/16 where normal
    normal = jnp.abs(x) >= lowprec.element_format("e4m3").min_normal
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
    f = jax.jit(lambda v: analysis.ulp_error("e4m3", v, lowprec.quantize(v, "e4m3")).max())
    assert _f(f(x)) <= 0.5


# --------------------------------------------------------------------------------------
# ULPs
# --------------------------------------------------------------------------------------
def test_ulp_e4m3_by_hand():
    # e4m3: 3 mantissa bits, emin = -6, emax = 8. Spacing 2^(e - 3) in binade 2^e.
    x = jnp.array([1.0, 1.9, 448.0, 300.0, 1000.0, 2.0**-6, 0.001, 0.0, -3.0])
    expected = [2**-3, 2**-3, 2**5, 2**5, 2**5, 2**-9, 2**-9, 2**-9, 2**-2]
    assert analysis.ulp("e4m3", x).tolist() == expected


def test_ulp_other_formats_by_hand():
    assert analysis.ulp("e2m1", jnp.array([0.3, 1.0, 5.0, 6.0])).tolist() == [0.5, 0.5, 2.0, 2.0]
    assert analysis.ulp("bf16", jnp.array([1.0, 2.0**100])).tolist() == [2.0**-7, 2.0**93]
    assert analysis.ulp("fp16", jnp.array([1.0, 65504.0, 1e-7])).tolist() == [2.0**-10, 32.0, 2.0**-24]
    # bf16's subnormal spacing 2^-133 is itself a float32 subnormal, built from bits
    assert analysis.ulp("bf16", jnp.array([0.0])).tolist() == [2.0**-133]
    assert analysis.ulp("e8m0", jnp.array([1.0, 3.0, 2.0**-127])).tolist() == [1.0, 2.0, 2.0**-127]


def test_ulp_with_scale_exponent():
    # Grid of e4m3 scaled by 2^-8: 2^-20 / 2^-8 = 2^-12 is below e4m3's normal range, so the
    # spacing is the subnormal one, 2^-9, times 2^-8.
    assert analysis.ulp("e4m3", jnp.array([2.0**-20]), scale_exp=-8).tolist() == [2.0**-17]
    assert analysis.ulp("e4m3", jnp.array([1.0]), scale_exp=-8).tolist() == [2.0**-3]


def test_ulp_error_e4m3_by_hand():
    x = jnp.array([1.0625, 300.0, 0.005, 1.0, 1000.0])
    q = lowprec.quantize(x, "e4m3", overflow="saturate")
    # 1.0625 is the tie between 1 and 1.125 -> 1 (even): half an ULP (0.125).
    # 300 -> 288: 12 / 32. 0.005 -> 3 * 2^-9: (0.005859375 - f32(0.005)) / 2^-9 = 0.44.
    # 1000 saturates to 448: 552 / 32 ULPs of the top binade.
    err = analysis.ulp_error("e4m3", x, q).tolist()
    assert err[:2] == [0.5, 0.375]
    assert err[2] == pytest.approx((0.005859375 - float(np.float32(0.005))) / 2**-9, rel=1e-6)
    assert err[3:] == [0.0, 552 / 32]


def test_ulp_error_e2m1_tie_and_directed():
    assert analysis.ulp_error("e2m1", jnp.array([5.0]), jnp.array([4.0])).tolist() == [0.5]
    x = jnp.array([1.1])
    q = lowprec.quantize(x, "e4m3", rounding="toward_zero")
    assert q.tolist() == [1.0]
    assert _f(analysis.ulp_error("e4m3", x, q)[0]) == pytest.approx(0.8, rel=1e-5)


@pytest.mark.parametrize("fmt", ELEMENTS)
def test_ulp_error_bounds_hold(fmt):
    f = lowprec.element_format(fmt)
    key = jax.random.key(1)
    lo, hi = math.log2(f.min_normal), math.log2(f.max_finite) - 1
    lo, hi = max(lo, -60), min(hi, 60)
    x = jnp.exp2(jax.random.uniform(key, (4096,), minval=lo, maxval=hi))
    x = x * jnp.where(jnp.arange(4096) % 2 == 0, 1.0, -1.0)
    nearest = analysis.ulp_error(fmt, x, lowprec.quantize(x, fmt))
    assert _f(nearest.max()) <= 0.5
    for mode in ("toward_zero", "up", "down"):
        assert _f(analysis.ulp_error(fmt, x, lowprec.quantize(x, fmt, rounding=mode)).max()) < 1
    sr = lowprec.quantize(x, fmt, rounding="stochastic", key=jax.random.key(2))
    assert _f(analysis.ulp_error(fmt, x, sr).max()) < 1


def test_ulp_error_at_the_top_of_bf16():
    x = jnp.array([3.0e38, -1.0e38])
    q = lowprec.quantize(x, "bf16")
    err = analysis.ulp_error("bf16", x, q)
    assert bool(jnp.all(err <= 0.5)) and bool(jnp.all(jnp.isfinite(err)))


# --------------------------------------------------------------------------------------
# a-priori bounds
# --------------------------------------------------------------------------------------
def test_quantization_error_bound_by_hand():
    b = analysis.quantization_error_bound("e4m3", jnp.array([1.0, 300.0, 1000.0, 0.0]))
    assert b.tolist() == [2.0**-4, 16.0, 552.0, 2.0**-10]
    b = analysis.quantization_error_bound("e4m3", jnp.array([1.0]), rounding="toward_zero")
    assert b.tolist() == [0.125]


@pytest.mark.parametrize("fmt", ELEMENTS)
@pytest.mark.parametrize("rounding", ["nearest_even", "nearest_away", "toward_zero", "stochastic"])
def test_quantization_error_bound_holds(fmt, rounding):
    key = jax.random.key(3)
    f = lowprec.element_format(fmt)
    # include subnormals, values beyond max (saturated) and zeros
    scale = min(f.max_finite, 1e30)
    x = jax.random.normal(key, (2048,)) * jnp.exp2(jax.random.uniform(key, (2048,), minval=-30, maxval=2))
    x = jnp.concatenate([x, jnp.array([0.0, 2 * scale, -3 * scale, f.min_subnormal / 3])])
    kw = {"key": jax.random.key(4)} if rounding == "stochastic" else {}
    q = lowprec.quantize(x, fmt, rounding=rounding, overflow="saturate", **kw)
    bound = analysis.quantization_error_bound(fmt, x, rounding=rounding)
    assert bool(jnp.all(jnp.abs(q - x) <= bound))


@pytest.mark.parametrize("fmt", lowprec.MX_FORMAT_NAMES)
@pytest.mark.parametrize("rule", lowprec.SCALE_RULES)
def test_mx_error_bound_holds(fmt, rule):
    key = jax.random.key(5)
    x = jax.random.t(key, 2.0, (16, 128))
    q = lowprec.fake_quantize_mx(x, fmt, scale_rule=rule)
    bound = analysis.mx_error_bound(x, fmt, scale_rule=rule)
    assert bool(jnp.all(jnp.abs(q - x) <= bound))
    # and it is not vacuous: within a factor of a few of the worst actual error per block
    assert _f(jnp.max(bound)) < 10 * _f(jnp.max(jnp.abs(q - x))) + 1e-30


def test_mx_scale_exponents_by_hand():
    x = jnp.concatenate([jnp.full(32, 1.0), jnp.full(32, 100.0), jnp.zeros(32)])
    s = analysis.mx_scale_exponents(x, "mxfp8_e4m3")  # floor(log2 amax) - 8
    assert s[:32].tolist() == [-8] * 32
    assert s[32:64].tolist() == [-2] * 32
    assert s[64:].tolist() == [-127] * 32              # all-zero block: scale code 0
    s = analysis.mx_scale_exponents(x[:40], "mxfp4")   # padded internally; shape kept
    assert s.shape == (40,) and s[0] == -2 and s[39] == 4
    x2 = x.reshape(3, 32).T                             # blocks along axis 0
    s2 = analysis.mx_scale_exponents(x2, "mxfp4", axis=0)
    assert s2.shape == (32, 3) and s2[0].tolist() == [-2, 4, -127]
    nan_block = jnp.concatenate([jnp.array([jnp.nan]), jnp.ones(31)])
    assert analysis.mx_scale_exponents(nan_block, "mxfp4")[0] == 128


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
    x = jnp.array([0.0, 0.1, 0.2, 0.3, 1.0, -0.2, 6.0, 0.0])
    q = lowprec.quantize(x, "e2m1")                    # below 0.25 -> 0
    assert _f(analysis.underflow_rate(x, q)) == 3 / 8
    # MXFP4: block max 6 -> scale 2^0 -> 0.1 flushes to zero
    xb = jnp.concatenate([jnp.array([6.0]), jnp.full(31, 0.1)])
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


@pytest.mark.parametrize("fmt", ["bf16", "fp16", "e4m3", "e2m1", "mxfp8_e5m2", "mxfp4"])
def test_dot_error_bound_holds(fmt):
    ka, kb = jax.random.split(jax.random.key(6))
    a = jax.random.normal(ka, (8, 256))
    b = jax.random.normal(kb, (256, 8))
    if fmt in lowprec.MX_FORMAT_NAMES:
        qa, qb = lowprec.fake_quantize_mx(a, fmt, axis=1), lowprec.fake_quantize_mx(b, fmt, axis=0)
        ea, eb = analysis.mx_error_bound(a, fmt, axis=1), analysis.mx_error_bound(b, fmt, axis=0)
    else:
        qa, qb = lowprec.quantize(a, fmt), lowprec.quantize(b, fmt)
        ea, eb = analysis.quantization_error_bound(fmt, a), analysis.quantization_error_bound(fmt, b)
    exact = np.asarray(a, np.float64) @ np.asarray(b, np.float64)
    approx = np.asarray(jnp.dot(qa, qb, precision="highest"), np.float64)
    bound = np.asarray(analysis.dot_error_bound(a, b, ea, eb), np.float64)
    assert np.all(np.abs(approx - exact) <= bound)


# --------------------------------------------------------------------------------------
# stochastic rounding and accumulation
# --------------------------------------------------------------------------------------
def test_rounding_neighbors():
    lo, hi = analysis.rounding_neighbors("e4m3", jnp.array([1.03125, 2.0, -1.03125, 1000.0]))
    assert lo.tolist() == [1.0, 2.0, -1.125, 448.0]
    assert hi.tolist() == [1.125, 2.0, -1.0, 448.0]


def test_stochastic_rounding_is_unbiased_with_the_right_variance():
    x = jnp.array([1.03125, 1.0625, 3.3, -100.0, 2.0])
    n = 4096
    s = analysis.stochastic_rounding_stats("e4m3", x, key=jax.random.key(7), num_samples=n)
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
    sums = analysis.quantized_cumsum("e4m3", inc, init=1.0)
    s, expected = jnp.float32(1.0), []
    for v in inc:
        s = lowprec.quantize(s + v, "e4m3", overflow="saturate")
        expected.append(float(s))
    assert sums.tolist() == expected


def test_quantized_cumsum_stalls_with_nearest_and_tracks_with_stochastic():
    # bf16 spacing at 1 is 2^-7; adding 2^-9 < half of it never moves the sum.
    inc = jnp.full((512, 256), 2.0**-9)
    near = analysis.quantized_cumsum("bf16", inc[:, :1], init=1.0)
    assert bool(jnp.all(near == 1.0))
    sr = analysis.quantized_cumsum("bf16", inc, rounding="stochastic", key=jax.random.key(8), init=1.0)
    assert sr.shape == (512, 256)
    final = np.asarray(sr[-1], np.float64)
    exact = 1.0 + 512 * 2.0**-9                        # 2.0
    assert abs(final.mean() - exact) < 4 * final.std() / np.sqrt(256)
    with pytest.raises(ValueError, match="key"):
        analysis.quantized_cumsum("bf16", inc, rounding="stochastic")
    with pytest.raises(ValueError, match="axis"):
        analysis.quantized_cumsum("bf16", jnp.float32(1.0))


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
def test_importing_does_not_import_matplotlib():
    code = "import sys, lowprec, lowprec.analysis; print('matplotlib' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_plot_helpers_draw():
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    fig = Figure()
    axes = fig.subplots(2, 3)
    analysis.plot_value_grid(["e2m1", "e4m3", "bf16"], ax=axes[0, 0])
    analysis.plot_spacing(["fp16", "tf32", "e8m0"], relative=True, ax=axes[0, 1])
    analysis.plot_histograms({"a": np.linspace(-1, 1, 50)}, bins=10, ax=axes[0, 2], logy=True)
    ax = analysis.plot_curves([1, 2, 4], {"x": [1, 2, 3]}, bounds={"x": [2, 3, 4], "other": [0, 1, 1]},
                              bands={"x": ([0, 1, 2], [2, 3, 4])}, ax=axes[1, 0], logx=True,
                              legend_bounds=False)
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["x"]
    analysis.plot_grouped_bars({"g1": {"s1": 1.0, "s2": 2.0}, "g2": {"s1": 3.0}}, ax=axes[1, 1])
    import io

    fig.savefig(io.BytesIO(), format="png")   # renders every artist


def test_public_namespace():
    import lowprec.analysis as mod

    for name in mod.__all__:
        assert callable(getattr(mod, name)), name
        assert getattr(mod, name).__doc__, name
