"""INT4 elements and the block formats built on them: MXINT4 (E8M0 scales) and NVINT4 (NVFP4's
two-level scales), the integer formats of Chen et al. 2025, "INT v.s. FP" (arXiv 2510.25602).

Expected values come from the independent reference (``lowprec_reference``: exact rationals
for MX, NumPy float32 arithmetic for the NVFP4 recipe with the element's largest value, 7),
from hand derivations in the comments, and from a NumPy restatement of the paper's own
quantizer (its public ``quant/quant_func.py``: ``int_quant`` with ``scale_quant=True`` for
NVINT4 and ``e8_scale=True, e8_scale_op="ceil"`` for MXINT4). INT4 codes are unpacked with
NumPy (low nibble first), never with lowprec's packing.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import lowprec
import lowprec_reference as R
from lowprec import analysis
from helpers.asserts import assert_bits_equal, assert_codes_equal, assert_same_floats
from helpers.mx import MODES, ROUNDINGS, SCALE_RULES, element_codes, f64_to_f32_exact, mx_inputs, random_bits

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

# 1-D to 3-D ([batch, seq, d] along d, and along a middle axis), 2 to 4 blocks of 32.
LAYOUTS = (((64,), -1), ((2, 3, 64), -1), ((64, 2), 0), ((2, 32, 2), 1))


@functools.lru_cache(maxsize=None)
def _jitted(fmt, axis, scale_rule, rounding):
    def f(x, key, ts):
        return lowprec.quantize_mx(x, fmt, axis=axis, scale_rule=scale_rule, rounding=rounding,
                                   key=key, tensor_scale=ts)

    return jax.jit(f)


def _run(mode, x, fmt, *, axis=-1, scale_rule=None, rounding="nearest_even", key=None,
         tensor_scale=None):
    if mode == "eager":
        return lowprec.quantize_mx(jnp.asarray(x), fmt, axis=axis, scale_rule=scale_rule,
                                   rounding=rounding, key=key, tensor_scale=tensor_scale)
    ts = None if tensor_scale is None else jnp.float32(tensor_scale)
    return _jitted(fmt, axis, scale_rule, rounding)(jnp.asarray(x), key, ts)


def _key(data, rounding):
    if rounding != "stochastic":
        return None
    return jax.random.key(data.draw(st.integers(0, 2**31 - 1), label="seed"))


# ------------------------------------------------------------------------------------------
# the element
# ------------------------------------------------------------------------------------------
def test_int4_element_by_hand():
    el = lowprec.element_format("int4")
    # integers k in [-7, 7]: no exponent field, bias -2, so m x 2^(1 + 2 - 3) = m
    assert (el.code_bits, el.max_finite, el.min_subnormal, el.emax) == (4, 7.0, 1.0, 2)
    codes = np.arange(16, dtype=np.uint8)
    # two's complement nibbles: 0..7, then 0b1000 = -8, 0b1001 = -7, ..., 0b1111 = -1
    want = [0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1]
    assert np.asarray(lowprec.decode(jnp.asarray(codes), "int4")).tolist() == want
    x = np.array([2.5, 3.5, -2.5, 0.5, -0.5, 7.4, 7.5, 9.0, -8.0, -100.0, 1.5000001], np.float32)
    # nearest-even ties (2.5 -> 2, 3.5 -> 4, 0.5 -> 0), saturation at +-7, never -8
    assert np.asarray(lowprec.quantize(x, "int4", overflow="saturate")).tolist() == [
        2, 4, -2, 0, -0.0, 7, 7, 7, -7, -7, 2]
    assert R.encode("int4", x, "nearest_even", "saturate").tolist() == np.asarray(
        lowprec.encode(jnp.asarray(x), "int4", overflow="saturate")).tolist()
    assert analysis.representable_values("int4").tolist() == list(range(8))


# ------------------------------------------------------------------------------------------
# MXINT4: E8M0 scales
# ------------------------------------------------------------------------------------------
def test_mxint4_hand_vectors():
    def quantize(values, rule):
        x = np.zeros(32, np.float32)
        x[: len(values)] = values
        mx = lowprec.quantize_mx(x, "mxint4", scale_rule=rule)
        return element_codes(mx)[: len(values)].tolist(), int(np.asarray(mx.scales)[0])

    # floor: amax 7 -> floor(log2 7) - emax_elem(2) = 0, scale 2^0 (code 127); elements
    # rounded to integers: 3.5 -> 4 (tie to even), -2.5 -> -2 = 0b1110, 0.4 -> 0.
    assert quantize([7.0, 3.5, -2.5, 0.4], "floor") == ([7, 4, 0b1110, 0], 127)
    # floor with amax 7.9: same scale, 7.9 saturates to 7 (floor clips block maxima)
    assert quantize([7.9, 1.0], "floor") == ([7, 1], 127)
    # rceil: 7.9 / 7 > 1 -> rounded up to 2^1 (code 128); 7.9 / 2 = 3.95 -> 4, 1/2 -> 0 (even)
    assert quantize([7.9, 1.0], "rceil") == ([4, 0], 128)
    # rceil of exactly 7: 7 / 7 = 1 -> 2^0
    assert quantize([7.0, -1.0], "rceil") == ([7, 0b1111], 127)
    assert lowprec.mx_format("mxint4").bits_per_element == 4.25


CASES = [
    pytest.param(rule, ROUNDINGS[(2 * j) % len(ROUNDINGS)], *LAYOUTS[j % len(LAYOUTS)],
                 id=f"{rule}-{ROUNDINGS[(2 * j) % len(ROUNDINGS)]}")
    for j, rule in enumerate(SCALE_RULES)
] + [pytest.param("rceil", "stochastic", (2, 3, 64), -1, id="rceil-stochastic")]


@pytest.mark.quick_cases(rule=["rceil"])
@pytest.mark.parametrize("rule, rounding, shape, axis", CASES)
@settings(max_examples=10, deadline=None)
@given(data=st.data())
@pytest.mark.quick_first(1)
def test_mxint4_matches_reference(rule, rounding, shape, axis, data):
    x = data.draw(mx_inputs(shape, axis), label="x")
    key = _key(data, rounding)
    rbits = None if key is None else random_bits(key, x.shape)
    want_e, want_s = R.quantize_mx(x, "mxint4", axis=axis, scale_rule=rule, rounding=rounding,
                                   random_bits=rbits)
    ax = axis % x.ndim
    for mode in MODES:
        mx = _run(mode, x, "mxint4", axis=axis, scale_rule=rule, rounding=rounding, key=key)
        tag = f"mxint4 {rule} {rounding} {mode}"
        assert_codes_equal(mx.scales, want_s, x, f"{tag} scales", axis=ax, per_block=True)
        assert_codes_equal(element_codes(mx), want_e, x, f"{tag} elements", axis=ax)
    want = f64_to_f32_exact(R.dequantize_mx(want_e, want_s, "mxint4", axis=axis))
    assert_same_floats(lowprec.dequantize(mx), want, f"mxint4 {rule} dequantize")


def test_mxint4_native_and_exact_paths_agree():
    # The native C++ quantizer writes 8-bit two's-complement codes only: it must step aside for
    # INT4 (its nibbles go through XLA's native formulation or the exact path).
    from lowprec.kernels import _mx_quantize_cpu

    assert not _mx_quantize_cpu.computes(lowprec.mx_format("mxint4"))
    assert _mx_quantize_cpu.computes(lowprec.mx_format("mxint8"))
    rng = np.random.default_rng(4)
    x = (rng.standard_t(3, (4, 8, 128)) * np.exp2(rng.integers(-20, 20, (4, 8, 1)))).astype(np.float32)
    x[0, 0, :32] = 0.0
    x[1, 1, 5] = 2.0**-130
    got = {}
    for policy in ("auto", "xla"):
        previous = lowprec.kernels.set_policy(policy)
        try:
            got[policy] = lowprec.quantize_mx(jnp.asarray(x), "mxint4", scale_rule="rceil")
        finally:
            lowprec.kernels.set_policy(previous)
    e, s = R.quantize_mx(x, "mxint4", scale_rule="rceil")
    for mx in got.values():
        np.testing.assert_array_equal(element_codes(mx), e)
        np.testing.assert_array_equal(np.asarray(mx.scales), s)


# ------------------------------------------------------------------------------------------
# NVINT4: NVFP4's two-level scales over INT4
# ------------------------------------------------------------------------------------------
def test_nvint4_hand_vector():
    # amax 7: tensor scale float32(7 / 3136) (3136 = 448 * 7); the block's (7 / 7) / ts =
    # float32(1 / float32(7 / 3136)) rounds to E4M3 448 (0x7E); total = float32(ts * 448).
    # Three all-zero blocks follow (scale 2^-6, codes 0): the (64,) of the nearest_even case
    # of test_nvint4_matches_reference, whose programs this test then shares.
    x = np.zeros(64, np.float32)
    x[:4] = [7.0, -1.0, 0.49, 3.5]
    mx = lowprec.quantize_mx(jnp.asarray(x), "nvint4")
    ts = np.float32(np.float32(7.0) / np.float32(3136.0))
    assert_bits_equal(mx.tensor_scale, ts, "nvint4 tensor scale")
    assert int(np.asarray(mx.scales)[0]) == 0x7E
    total = np.float32(ts * np.float32(448.0))
    q = np.rint(np.clip(x / total, -7, 7))       # float32 quotients, ties to even
    codes = np.where(q < 0, q + 16, q).astype(np.uint8)
    np.testing.assert_array_equal(element_codes(mx), codes)
    assert element_codes(mx)[:4].tolist() == [7, 0b1111, 0, 4]
    np.testing.assert_array_equal(np.asarray(lowprec.dequantize(mx)), (q * total).astype(np.float32))
    assert lowprec.mx_format("nvint4").bits_per_element == 4.5


# The default run keeps one case per layout: nearest_even, toward_zero, down and stochastic.
# The other three modes run in the extended sweep; each still meets INT4 elements under a
# block scale in the default run (test_mxint4_matches_reference: nearest_away,
# nearest_toward_zero, up) and NVFP4's two-level scales (test_mx_formats.py:
# test_nvfp4_matches_reference, every mode), and NVINT4 differs from NVFP4 only in the
# element's largest value, which every mode's case here divides by. ~2 s of compiles each.
_NV_EXTENDED = ("nearest_away", "nearest_toward_zero", "up")
NV_CASES = [pytest.param(r, *LAYOUTS[i % len(LAYOUTS)], id=r,
                         marks=[pytest.mark.extended] if r in _NV_EXTENDED else [])
            for i, r in enumerate(ROUNDINGS)]


@pytest.mark.quick_cases(rounding=["nearest_even"])
@pytest.mark.parametrize("rounding, shape, axis", NV_CASES)
@settings(max_examples=8, deadline=None)
@given(data=st.data())
@pytest.mark.quick_first(1)
def test_nvint4_matches_reference(rounding, shape, axis, data):
    x = data.draw(mx_inputs(shape, axis), label="x")
    given_ts = data.draw(st.sampled_from([None, None, 1.0, 3.5e-3, 2.0**-140, 1e30]), label="ts")
    key = _key(data, rounding)
    rbits = None if key is None else random_bits(key, x.shape)
    e, s, ts = R.quantize_nvfp4(x, "nvint4", axis=axis, rounding=rounding, random_bits=rbits,
                                tensor_scale=given_ts)
    ax = axis % x.ndim
    for mode in MODES:
        mx = _run(mode, x, "nvint4", axis=axis, rounding=rounding, key=key, tensor_scale=given_ts)
        tag = f"nvint4 {rounding} {mode} ts={given_ts}"
        assert_bits_equal(mx.tensor_scale, np.float32(ts), tag)
        assert_codes_equal(mx.scales, s, x, f"{tag} scales", axis=ax, per_block=True, block=16)
        assert_codes_equal(element_codes(mx), e, x, f"{tag} elements", axis=ax, block=16)
    want = R.dequantize_mx(e, s, "nvint4", axis=axis, tensor_scale=ts)
    assert_same_floats(lowprec.dequantize(mx), want.astype(np.float32), "nvint4 dequantize")


def _paper_int4(x, group, scale):
    """The paper's ``int_quant(x, 4, group_size=group, clip_style="sym", ...)`` restated in
    NumPy float32 (2510.25602's public quant_func.py): s = amax / 7 per group; NVINT4
    (``scale="e4m3"``): s_of_s = max(s) / 448, s = s_of_s * e4m3(s / s_of_s); MXINT4
    (``scale="ceil"``): s = 2^ceil(log2 s), read exactly here (the paper's torch log2 is a
    float op); then clamp(round(x / s), -7, 7) * s, rounding half to even."""
    xb = x.reshape(-1, group).astype(np.float32)
    s = (np.abs(xb).max(axis=1, keepdims=True) / np.float32(7)).astype(np.float32)
    if scale == "e4m3":
        s_of_s = np.float32(s.max() / np.float32(448))
        qs = (s / s_of_s).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
        s = (s_of_s * qs).astype(np.float32)
    else:
        m, e = np.frexp(s.astype(np.float64))
        s = np.ldexp(1.0, np.where(m == 0.5, e - 1, e)).astype(np.float32)
        s_of_s = None
    q = np.clip(np.rint(xb / s), -7, 7) * s
    return q.astype(np.float32).reshape(x.shape), s_of_s


@pytest.mark.parametrize("dist", ["gaussian", "student-t(3)"])
def test_nvint4_and_mxint4_equal_the_papers_quantizer(dist):
    # [batch, seq, d] activations, blocks along d
    x = analysis.sample(dist, (4, 16, 256), seed=7)
    paper, s_of_s = _paper_int4(x, 16, "e4m3")
    # The paper divides amax by 7, then by 448 (two roundings); lowprec (torchao's form)
    # divides amax by 3136 once: the same scale, or one ulp apart.
    ts = np.asarray(lowprec.quantize_mx(jnp.asarray(x), "nvint4").tensor_scale)
    assert abs(int(np.float32(ts).view(np.int32)) - int(s_of_s.view(np.int32))) <= 1
    # With the paper's tensor scale, every value is the paper's (no block here is below
    # 2^-6 of the largest, where torchao's recipe clamps and the paper would not).
    got = lowprec.fake_quantize_mx(jnp.asarray(x), "nvint4", tensor_scale=float(s_of_s))
    np.testing.assert_array_equal(np.asarray(got), paper)
    paper_mx, _ = _paper_int4(x, 32, "ceil")
    got = lowprec.fake_quantize_mx(jnp.asarray(x), "mxint4", scale_rule="rceil")
    np.testing.assert_array_equal(np.asarray(got), paper_mx)


def test_nvfp4_scheme_serves_int4_and_e2m1_only():
    from lowprec._format import MXFormat

    scheme = lowprec.scale_scheme("nvfp4")
    for elem in ("e2m1", "int4"):
        MXFormat("x", lowprec.element_format(elem), 16, scheme)
    for elem in ("e4m3", "e2m3", "ocp_int8"):
        with pytest.raises(ValueError, match="NVFP4 scales serve signed 4-bit elements"):
            MXFormat("x", lowprec.element_format(elem), 16, scheme)


@pytest.mark.slow  # compare's compiles (seconds); its paths run in the quick tier of test_analysis.py
def test_analysis_compares_the_integer_formats():
    df = analysis.compare("gaussian", ["mxint4", "nvint4", "nvfp4"], scale_rules="rceil",
                                  seeds=2, shape=(8, 256))
    assert df["format"].tolist() == ["mxint4", "nvint4", "nvfp4"]
    assert df["bits_per_element"].tolist() == [4.25, 4.5, 4.5]
    # INT4 with a per-16 E4M3 scale beats INT4 with a per-32 power of two on Gaussian data
    assert (df["sqnr_db"].iloc[1] - df["sqnr_db"].iloc[0]) > 2
