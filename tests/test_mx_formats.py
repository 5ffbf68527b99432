"""The block formats added as data: MXFP6 (E2M3, E3M2), MXINT8, NVFP4, and any block size.

Expected values come from the independent reference (``lowprec_reference``: exact rationals for
MX, NumPy float32 arithmetic for NVFP4's recipe), a vectorized restatement of torchao's NVFP4
recipe written here, gfloat's block quantizer, or hand derivations in the comments
(OCP MX v1.0 §5-6; docs/design.md §3, §3b, §4). Element codes of packed formats are unpacked
with NumPy (FP4) or the reference's bit-stream unpacker (FP6), never with lowprec's packing.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import lowprec
import lowprec.kernels
import lowprec_reference as R
from helpers.asserts import assert_bits_equal, assert_codes_equal, assert_same_floats, bit_pattern
from helpers.kernels import lower_for_cuda
from helpers.mx import (
    MODES,
    NEW_MX_FORMATS,
    ROUNDINGS,
    SCALE_RULES,
    element_codes,
    f64_to_f32_exact,
    mx_inputs,
    random_bits,
)

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")


@functools.lru_cache(maxsize=None)
def _jitted_quantize(fmt, axis, scale_rule, rounding, pad=False):
    def f(x, key, ts):
        return lowprec.quantize_mx(x, fmt, axis=axis, scale_rule=scale_rule, rounding=rounding,
                                   pad=pad, key=key, tensor_scale=ts)

    return jax.jit(f)


def run(mode, x, fmt, *, axis=-1, scale_rule=None, rounding="nearest_even", pad=False, key=None,
        tensor_scale=None):
    if mode == "eager":
        return lowprec.quantize_mx(jnp.asarray(x), fmt, axis=axis, scale_rule=scale_rule,
                                   rounding=rounding, pad=pad, key=key, tensor_scale=tensor_scale)
    ts = None if tensor_scale is None else jnp.float32(tensor_scale)
    return _jitted_quantize(fmt, axis, scale_rule, rounding, pad)(jnp.asarray(x), key, ts)


def _block(mx_fmt) -> int:
    return lowprec.mx_format(mx_fmt).block_size


def _inputs(draw, shape, axis, block):
    """Hypothesis inputs with blocks of ``block`` along ``axis`` (helpers.mx builds blocks of
    32, which any power-of-two block up to 32 divides; larger blocks join several)."""
    return draw(mx_inputs(shape, axis))


def _compare(x, fmt, rule, rounding, axis, key, ctx):
    rbits = None if key is None else random_bits(key, x.shape)
    want_codes, want_scales = R.quantize_mx(x, fmt, axis=axis, scale_rule=rule,
                                            rounding=rounding, random_bits=rbits)
    ax = axis % x.ndim
    for mode in MODES:
        mx = run(mode, x, fmt, axis=axis, scale_rule=rule, rounding=rounding, key=key)
        tag = f"{ctx} {fmt} {rule} {rounding} {mode}"
        assert mx.fmt == lowprec.mx_format(fmt) and mx.shape == x.shape
        assert_codes_equal(mx.scales, want_scales, x, f"{tag} scales", axis=ax, per_block=True,
                           block=_block(fmt))
        assert_codes_equal(element_codes(mx), want_codes, x, f"{tag} elements", axis=ax,
                           block=_block(fmt))
        if mode == "eager":
            want = f64_to_f32_exact(R.dequantize_mx(want_codes, want_scales, fmt, axis=axis))
            assert_same_floats(lowprec.dequantize(mx), want, f"{tag} dequantize")


# ============================================================================================
# MXFP6 and MXINT8 against the reference, every scale rule and rounding.

LAYOUTS = (((64,), -1), ((2, 64), -1), ((64, 2), 0), ((2, 32, 2), 1))
CASES = [
    pytest.param(fmt, rule, ROUNDINGS[(i + 2 * j) % len(ROUNDINGS)],
                 *LAYOUTS[(i + j) % len(LAYOUTS)],
                 id=f"{fmt}-{rule}-{ROUNDINGS[(i + 2 * j) % len(ROUNDINGS)]}")
    for i, fmt in enumerate(NEW_MX_FORMATS)
    for j, rule in enumerate(SCALE_RULES)
]


@pytest.mark.quick_cases(rule=["rceil"])
@pytest.mark.parametrize("fmt, rule, rounding, shape, axis", CASES)
@settings(max_examples=10, deadline=None)
@given(data=st.data())
@pytest.mark.quick_first(1)
def test_new_mx_formats_match_reference(fmt, rule, rounding, shape, axis, data):
    x = data.draw(mx_inputs(shape, axis), label="x")
    key = None
    if rounding == "stochastic":
        key = jax.random.key(data.draw(st.integers(0, 2**31 - 1), label="seed"))
    _compare(x, fmt, rule, rounding, axis, key, "float32")


@pytest.mark.quick_cases(rounding=["toward_zero"])
@pytest.mark.parametrize("fmt", NEW_MX_FORMATS)
@pytest.mark.parametrize("rounding", ["nearest_away", "toward_zero", "up", "down"])
@pytest.mark.quick_first(1)
def test_new_mx_formats_directed_modes_on_gaussian_blocks(fmt, rounding):
    rng = np.random.default_rng(sum(map(ord, fmt + rounding)))
    x = (rng.standard_normal((3, 64)) * np.exp2(rng.integers(-40, 40, (3, 1)))).astype(np.float32)
    x[0, :2] = [-0.0, 0.0]
    _compare(x, fmt, "floor", rounding, -1, None, "gaussian")


def test_mxint8_hand_vectors():
    # INT8 elements are k/64, |k| <= 127 (two's complement codes); emax_elem = 0.
    def codes_and_scale(values, rule):
        x = np.zeros(32, np.float32)
        x[: len(values)] = values
        mx = lowprec.quantize_mx(x, "mxint8", scale_rule=rule)
        e, s = R.quantize_mx(x, "mxint8", scale_rule=rule)
        assert np.array_equal(np.asarray(mx.elements), e) and np.array_equal(np.asarray(mx.scales), s)
        return np.asarray(mx.elements)[: len(values)].tolist(), int(np.asarray(mx.scales)[0])

    # floor: amax 1.5 -> floor(log2) = 0 -> shared 0 (scale 127). 1.5*64 = 96 = 0x60;
    # -1 -> -64 = 0xC0; 0.5 -> 32; 1/128 -> tie between 0 and 1 -> 0 (even).
    assert codes_and_scale([1.5, -1.0, 0.5, 1 / 128], "floor") == ([0x60, 0xC0, 0x20, 0], 127)
    # floor: amax 3 -> shared 1 (128): 3/2 = 1.5 -> 96; -1/2 -> -32 = 0xE0.
    assert codes_and_scale([3.0, -1.0], "floor") == ([0x60, 0xE0], 128)
    # floor clips: amax 1.995 stays in binade 0 -> 1.995*64 = 127.68 rounds to 128 > 127 ->
    # saturates to 127 (0x7F); the negative side saturates symmetrically to -127 (0x81).
    assert codes_and_scale([1.995, -1.995], "floor") == ([0x7F, 0x81], 127)
    # ceil: amax 1.5 -> ceil(log2 1.5) = 1 -> scale 128; 0.75*64 = 48 = 0x30.
    assert codes_and_scale([1.5], "ceil") == ([0x30], 128)
    # even: amax rounded half up to 7 significant bits (6 fraction bits in [1, 2)):
    # 1.99 * 64 = 127.36 -> 127 -> binade 0 (scale 127; 1.99 -> 127 = 0x7F);
    # 1.995 * 64 = 127.68 -> 128 = 2^7 -> binade 1 (scale 128; 1.995/2*64 = 63.84 -> 64).
    assert codes_and_scale([1.99], "even") == ([0x7F], 127)
    assert codes_and_scale([1.995], "even") == ([0x40], 128)
    # rceil: amax / (127/64): 1.984375 -> exactly 1 -> scale 127 (code 127 = 0x7F);
    # 1.99 -> just above 1 -> rounded up to 2 -> scale 128 (1.99/2*64 = 63.68 -> 64).
    assert codes_and_scale([127 / 64], "rceil") == ([0x7F], 127)
    assert codes_and_scale([1.99], "rceil") == ([0x40], 128)


@pytest.mark.slow  # left out of the quick tier (seconds; its paths run in other quick tests)
def test_mx_blocks_match_gfloat_quantize_block():
    # gfloat's block quantizer (OCP MX, floor scale, RNE, saturating) on Gaussian blocks for
    # MXFP6 E2M3/E3M2, MXFP4 and MXINT8. Differences by design: gfloat computes floor(log2
    # amax) in float64 (fine for these inputs) and lets INT8 reach -2 (code 0x80): blocks
    # whose scaled minimum is at or below -127.5/64 are excluded for MXINT8 and checked apart.
    from gfloat import BlockFormatInfo, compute_scale_amax, quantize_block
    from gfloat.formats import (format_info_ocp_e2m1, format_info_ocp_e2m3,
                                format_info_ocp_e3m2, format_info_ocp_e8m0,
                                format_info_ocp_int8)

    rng = np.random.default_rng(3)
    x = (rng.standard_normal((64, 32)) * np.exp2(rng.integers(-20, 20, (64, 1)))).astype(np.float32)
    for fmt, etype in (("mxfp6_e2m3", format_info_ocp_e2m3), ("mxfp6_e3m2", format_info_ocp_e3m2),
                       ("mxfp4", format_info_ocp_e2m1), ("mxint8", format_info_ocp_int8)):
        bfi = BlockFormatInfo(fmt, etype, 32, format_info_ocp_e8m0)
        got = np.asarray(lowprec.fake_quantize_mx(jnp.asarray(x), fmt))
        checked = 0
        for b in range(x.shape[0]):
            want = quantize_block(bfi, x[b].astype(np.float64), compute_scale_amax)
            if fmt == "mxint8":
                scale = compute_scale_amax(etype.emax, x[b].astype(np.float64))
                if (x[b] / scale <= -127.5 / 64).any():
                    assert (want / scale == -2).any()  # gfloat's asymmetric -2
                    continue
            assert np.array_equal(got[b].astype(np.float64), want), (fmt, b)
            checked += 1
        assert checked >= 40, (fmt, checked)


# ============================================================================================
# Block size as a parameter.

BLOCK_CASES = [("mxfp8_e4m3", 2), ("mxfp4", 2), ("mxfp4", 16), ("mxfp6_e2m3", 4),
               ("mxfp6_e3m2", 128), ("mxint8", 64), ("mxfp8_e5m2", 1024), ("nvfp4", 32)]


@pytest.mark.quick_cases(base=["mxint8", "nvfp4"])
@pytest.mark.parametrize("base, block", BLOCK_CASES, ids=[f"{f}-{b}" for f, b in BLOCK_CASES])
@pytest.mark.quick_first(1)
def test_any_block_size_matches_reference(base, block):
    fmt = lowprec.mx_format(base, block_size=block)
    assert fmt.block_size == block and fmt.name == f"{base}_b{block}"
    assert lowprec.resolve_format(fmt.name) == fmt == lowprec.mx_format(f"{base}_b{block}")
    rng = np.random.default_rng(block)
    n = max(2048, block)
    x = (rng.standard_normal((2, n)) * np.exp2(rng.integers(-30, 30, (2, n // 32)).repeat(32, 1)))
    x = x.astype(np.float32)
    x[0, 5] = np.nan
    if fmt.tensor_scale:
        e, s, ts = R.quantize_mx(x, fmt.name)
    else:
        (e, s), ts = R.quantize_mx(x, fmt.name), None
    for mode in MODES:
        mx = run(mode, x, fmt)
        assert np.asarray(mx.scales).shape == (2, n // block)
        assert_codes_equal(mx.scales, s, x, f"{fmt.name} scales", axis=1, per_block=True,
                           block=block)
        assert_codes_equal(element_codes(mx), e, x, f"{fmt.name} elements", axis=1, block=block)
    want = R.dequantize_mx(e, s, fmt.name, tensor_scale=ts)
    assert_same_floats(lowprec.dequantize(mx), want.astype(np.float32), fmt.name)
    # The keyword form is the same format, and the block axis may be another axis.
    mx0 = lowprec.quantize_mx(jnp.asarray(x.T), base, axis=0, block_size=block)
    assert mx0.fmt == fmt
    np.testing.assert_array_equal(np.asarray(mx0.scales), np.asarray(mx.scales).T)


@pytest.mark.parametrize("block", [2, 4, 16, 64])
@pytest.mark.slow  # left out of the quick tier (seconds; its paths run in other quick tests)
def test_block_size_pad_shared_exponents_and_matmul(block):
    fmt = lowprec.mx_format("mxfp8_e4m3", block_size=block)
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((3, 70)) * 10).astype(np.float32)  # 70: not a multiple of 4..64
    if 70 % block:
        with pytest.raises(ValueError, match=rf"block size {block}.*pad=True"):
            lowprec.quantize_mx(x, fmt)
    mx = lowprec.quantize_mx(x, fmt, pad=True)
    padded = -(-70 // block) * block
    xp = np.zeros((3, padded), np.float32)
    xp[:, :70] = x
    e, s = R.quantize_mx(xp, fmt.name)
    np.testing.assert_array_equal(element_codes(mx), e)
    np.testing.assert_array_equal(np.asarray(lowprec.shared_exponents(x, fmt, pad=True)),
                                  s.astype(np.int32) - 127)
    w = (rng.standard_normal((padded, 5))).astype(np.float32)
    y = np.asarray(lowprec.matmul(jnp.asarray(xp), jnp.asarray(w), lhs_format=fmt, rhs_format=fmt))
    qa = np.asarray(lowprec.fake_quantize_mx(xp, fmt), np.float64)
    qb = np.asarray(lowprec.fake_quantize_mx(w, fmt, axis=0), np.float64)
    exact = qa @ qb
    bound = padded * 2.0**-23 * (np.abs(qa) @ np.abs(qb))
    assert (np.abs(y - exact) <= bound).all()


def test_block_size_errors():
    with pytest.raises(ValueError, match=r"block_size 3 is not supported.*2, 4, 8"):
        lowprec.mx_format("mxfp4", block_size=3)
    with pytest.raises(ValueError, match=r"2048"):
        lowprec.quantize_mx(jnp.ones(2048), "mxfp8", block_size=2048)
    with pytest.raises(ValueError, match=r"block of 2 6-bit codes.*block_size >= 4"):
        lowprec.mx_format("mxfp6_e2m3", block_size=2)
    with pytest.raises(ValueError, match=r"names block size 16 but block_size=32"):
        lowprec.mx_format("mxfp4_b16", block_size=32)
    with pytest.raises(TypeError, match="block_size must be an integer"):
        lowprec.mx_format("mxfp4", block_size=16.0)
    with pytest.raises(ValueError, match="gpt-oss layout holds MXFP4 only"):
        lowprec.to_gpt_oss(lowprec.quantize_mx(jnp.ones((2, 32)), "mxfp4", block_size=16))
    with pytest.raises(ValueError, match="mxfp4_gemv takes an MXFP4"):
        lowprec.kernels.mxfp4_gemv(lowprec.quantize_mx(jnp.ones((2, 32)), "mxfp4_b16"),
                           jnp.ones(32, jnp.bfloat16))


# ============================================================================================
# NVFP4.


def torchao_nvfp4_recipe(x2d, per_tensor_scale, version=(0, 16)):
    """torchao's ``_nvfp4_quantize`` (two-level path), restated with vectorized NumPy float32
    operations for a 2-D array blocked along its last axis:

        block_scale = amax(|x|) / F4_E2M1_MAX
        scaled = block_scale / per_tensor_scale, clamped to [E4M3_EPS, F8E4M3_MAX]
        scale_fp8 = scaled.to(float8_e4m3fn); total = per_tensor_scale * scale_fp8
        data = clamp(x / total, -6, 6), cast to E2M1 (round to nearest even)

    with per_tensor_scale = amax / (F8E4M3_MAX * F4_E2M1_MAX). Finite inputs only. torchao
    0.17 (its PR #4031) changed the element step to

        reciprocal = (1.0 / per_tensor_scale) / scale_fp8.to(float32)
        data = clamp(x * reciprocal, -6, 6), cast to E2M1
    """
    f32 = np.float32
    xb = x2d.reshape(x2d.shape[0], -1, 16).astype(f32)
    with np.errstate(all="ignore"):
        block_scale = np.abs(xb).max(-1) / f32(6.0)
        scaled = np.clip(block_scale / f32(per_tensor_scale), f32(2.0**-6), f32(448.0))
        scale_fp8 = scaled.astype(ml_dtypes.float8_e4m3fn)
        if version >= (0, 17):
            reciprocal = (f32(1.0) / f32(per_tensor_scale)) / scale_fp8.astype(f32)
            scaled_x = xb * reciprocal[..., None]
        else:
            scaled_x = xb / (f32(per_tensor_scale) * scale_fp8.astype(f32))[..., None]
        data = np.clip(scaled_x, f32(-6), f32(6)).astype(ml_dtypes.float4_e2m1fn)
    return bit_pattern(data).reshape(x2d.shape), bit_pattern(scale_fp8)


@pytest.mark.parametrize("magnitude", [-130, -100, -20, 0, 20, 100])
@pytest.mark.slow  # left out of the quick tier (seconds; its paths run in other quick tests)
def test_nvfp4_matches_the_published_recipe(magnitude):
    rng = np.random.default_rng(magnitude + 200)
    x = rng.standard_normal((16, 256)) * np.exp2(rng.integers(-12, 12, (16, 16)).repeat(16, 1))
    x = (x * 2.0**magnitude).astype(np.float32)
    x[0, :16] = 0.0  # an all-zero block: scale clamps to 2^-6
    amax = np.float32(np.abs(x).max())
    ts = np.float32(amax / np.float32(448.0 * 6.0))  # per_tensor_amax_to_scale
    want_e, want_s = torchao_nvfp4_recipe(x, ts)
    for mode in MODES:
        mx = run(mode, x, "nvfp4")
        assert_bits_equal(mx.tensor_scale, ts)
        np.testing.assert_array_equal(np.asarray(mx.scales), want_s)
        np.testing.assert_array_equal(element_codes(mx), want_e)
    # A given tensor scale (calibrated, or 1: single-level scaling) is used as is.
    for given in (np.float32(0.37), np.float32(1.0)):
        want_e, want_s = torchao_nvfp4_recipe(x, given)
        mx = lowprec.quantize_mx(jnp.asarray(x), "nvfp4", tensor_scale=float(given))
        np.testing.assert_array_equal(np.asarray(mx.scales), want_s)
        np.testing.assert_array_equal(element_codes(mx), want_e)


NV_LAYOUTS = (((64,), -1), ((2, 64), -1), ((64, 2), 0), ((2, 32, 2), 1))


@pytest.mark.quick_cases(rounding=["stochastic"])
@pytest.mark.parametrize("rounding", ROUNDINGS)
@settings(max_examples=8, deadline=None)
@given(data=st.data())
def test_nvfp4_matches_reference(rounding, data):
    shape, axis = NV_LAYOUTS[ROUNDINGS.index(rounding) % len(NV_LAYOUTS)]
    x = data.draw(mx_inputs(shape, axis), label="x")
    given_ts = data.draw(st.sampled_from([None, None, 1.0, 3.5e-3, 2.0**-140, 1e30]), label="ts")
    key = None
    if rounding == "stochastic":
        key = jax.random.key(data.draw(st.integers(0, 2**31 - 1), label="seed"))
    rbits = None if key is None else random_bits(key, x.shape)
    e, s, ts = R.quantize_nvfp4(x, axis=axis, rounding=rounding, random_bits=rbits,
                                tensor_scale=given_ts)
    ax = axis % len(shape)
    for mode in MODES:
        mx = run(mode, x, "nvfp4", axis=axis, rounding=rounding, key=key, tensor_scale=given_ts)
        tag = f"nvfp4 {rounding} {mode} ts={given_ts}"
        assert_bits_equal(mx.tensor_scale, np.float32(ts), tag)
        assert_codes_equal(mx.scales, s, x, f"{tag} scales", axis=ax, per_block=True, block=16)
        assert_codes_equal(element_codes(mx), e, x, f"{tag} elements", axis=ax, block=16)
    want = R.dequantize_mx(e, s, "nvfp4", axis=axis, tensor_scale=ts)
    assert_same_floats(lowprec.dequantize(mx), want.astype(np.float32), "nvfp4 dequantize")


def test_nvfp4_hand_vector():
    # Block [6, -1, 0.25, 3.5, 0, ...] alone in the tensor: amax 6, tensor scale
    # ts = float32(6 / 2688) = 0.002232143. Block scale: (6 / 6) / ts = 447.99997 (float32) ->
    # E4M3 rounds to 448 = 0x7E. total = ts * 448 = 1.0 exactly in float32, so the elements
    # are E2M1(x): 6 -> 0x7, -1 -> 0xA, 0.25 -> tie 0 | 0.5 -> 0 (even), 3.5 -> tie 3 | 4 ->
    # 4 = 0x6 (even mantissa). Second block all zeros: scale clamps to 2^-6 = 0x08.
    x = np.zeros(32, np.float32)
    x[:4] = [6.0, -1.0, 0.25, 3.5]
    mx = lowprec.quantize_mx(x, "nvfp4")
    assert element_codes(mx)[:4].tolist() == [0x7, 0xA, 0x0, 0x6]
    assert np.asarray(mx.scales).tolist() == [0x7E, 0x08]
    assert float(mx.tensor_scale) == float(np.float32(6.0) / np.float32(2688.0))
    # Packed low nibble first: byte 0 = 0x7 | 0xA << 4.
    assert int(np.asarray(mx.elements)[0]) == 0xA7
    np.testing.assert_array_equal(np.asarray(lowprec.dequantize(mx))[:4], [6.0, -1.0, 0.0, 4.0])


@pytest.mark.slow  # left out of the quick tier (seconds; its paths run in other quick tests)
def test_nvfp4_special_blocks_and_zero_tensor():
    x = np.zeros((3, 16), np.float32)
    x[0, 3] = np.inf
    x[1, :] = 2.0
    x[2, 0] = np.nan
    mx = lowprec.quantize_mx(x, "nvfp4")
    # amax over finite values only: 2 -> ts = 2 / 2688; the inf/NaN blocks get the E4M3 NaN.
    assert float(mx.tensor_scale) == float(np.float32(2.0) / np.float32(2688.0))
    assert np.asarray(mx.scales)[:, 0].tolist() == [0x7F, 0x7E, 0x7F]
    v = np.asarray(lowprec.dequantize(mx))
    assert np.isnan(v[[0, 2]]).all() and (v[1] == 2.0).all()
    z = lowprec.quantize_mx(-np.zeros(16, np.float32), "nvfp4")
    assert float(z.tensor_scale) == 1.0 and np.asarray(z.scales).tolist() == [0x08]
    assert (element_codes(z) == 0x8).all()  # -0 keeps its sign


@pytest.mark.slow  # left out of the quick tier (seconds; its paths run in other quick tests)
def test_nvfp4_fake_quantize_matmul_and_pytree():
    rng = np.random.default_rng(9)
    x = jnp.asarray(rng.standard_normal((4, 64)).astype(np.float32))
    mx = lowprec.quantize_mx(x, "nvfp4")
    want = np.asarray(lowprec.dequantize(mx))
    assert_same_floats(lowprec.fake_quantize_mx(x, "nvfp4"), want, "eager")
    assert_same_floats(jax.jit(lambda v: lowprec.fake_quantize_mx(v, "nvfp4"))(x), want, "jit")
    g = jax.grad(lambda v: lowprec.fake_quantize_mx(v, "nvfp4").sum())(x)
    np.testing.assert_array_equal(np.asarray(g), 1.0)
    leaves, treedef = jax.tree_util.tree_flatten(mx)
    assert len(leaves) == 3 and jax.tree_util.tree_unflatten(treedef, leaves).fmt == mx.fmt
    w = jnp.asarray(rng.standard_normal((64, 3)).astype(np.float32))
    wq = lowprec.quantize_mx(w, "nvfp4", axis=0)
    y = np.asarray(lowprec.matmul(x, wq, lhs_format="nvfp4"))
    qa = want.astype(np.float64)
    qb = np.asarray(lowprec.dequantize(wq), np.float64)
    bound = 64 * 2.0**-23 * (np.abs(qa) @ np.abs(qb))
    assert (np.abs(y - qa @ qb) <= bound).all()


def test_nvfp4_errors():
    x = jnp.ones(32)
    with pytest.raises(ValueError, match=r"nvfp4 block scales follow the NVFP4 recipe.*'rceil'"):
        lowprec.quantize_mx(x, "nvfp4", scale_rule="rceil")
    with pytest.raises(ValueError, match=r"mxfp8_e4m3 has no tensor scale"):
        lowprec.quantize_mx(x, "mxfp8", tensor_scale=1.0)
    with pytest.raises(ValueError, match=r"positive finite.*-1.0"):
        lowprec.quantize_mx(x, "nvfp4", tensor_scale=-1.0)
    with pytest.raises(ValueError, match=r"tensor_scale must be a scalar"):
        lowprec.quantize_mx(x, "nvfp4", tensor_scale=jnp.ones(2))
    with pytest.raises(ValueError, match=r"E4M3 values under a tensor scale"):
        lowprec.shared_exponents(x, "nvfp4")
    mx = lowprec.quantize_mx(x, "nvfp4")
    with pytest.raises(ValueError, match=r"needs its float32 tensor_scale"):
        lowprec.MXArray(mx.elements, mx.scales, mx.fmt, 0, (32,))
    with pytest.raises(TypeError, match=r"tensor_scale must be a float32 scalar"):
        lowprec.MXArray(mx.elements, mx.scales, mx.fmt, 0, (32,), None, jnp.ones(2))
    with pytest.raises(ValueError, match=r"mxfp4 has no tensor scale"):
        lowprec.MXArray(mx.elements, mx.scales[:1], "mxfp4", 0, (32,), None, jnp.float32(1))


# ============================================================================================
# Storage and the matmul path of the new formats.


@pytest.mark.parametrize("fmt", ["mxfp6_e2m3", "mxfp6_e3m2"])
def test_fp6_storage_is_four_codes_in_three_bytes(fmt):
    x = np.linspace(-5, 5, 64, dtype=np.float32)
    mx = lowprec.quantize_mx(x, fmt)
    assert mx.elements.shape == (48,) and mx.nbytes == 48 + 2
    codes = element_codes(mx)
    b = np.asarray(mx.elements)
    # Byte 0 holds code 0 in its low 6 bits and code 1's low 2 bits on top (docs/design.md §4).
    assert int(b[0]) == (int(codes[0]) | (int(codes[1]) & 0x3) << 6)
    with pytest.raises(ValueError, match=r"needs \(48,\) \(FP6: four codes per three bytes"):
        lowprec.MXArray(jnp.zeros(64, jnp.uint8), mx.scales, fmt, 0, (64,))


@pytest.mark.parametrize("fmt", ["mxfp6_e2m3", "mxfp6_e3m2", "mxint8", "e4m3fnuz",
                                 "p3109_k8p3se", "e3m4"])
@pytest.mark.slow  # left out of the quick tier (seconds; its paths run in other quick tests)
def test_matmul_operand_formats(fmt):
    # |lowprec - exact dot of the quantized operands| <= K 2^-23 sum |a_i b_i| (docs/design.md
    # §5); MX INT8 and FP6 values take the bfloat16 path (<= 8 significant bits).
    rng = np.random.default_rng(11)
    a = rng.standard_normal((3, 64)).astype(np.float32)
    b = rng.standard_normal((64, 4)).astype(np.float32)
    y = np.asarray(lowprec.matmul(a, b, lhs_format=fmt, rhs_format=fmt))
    if isinstance(lowprec.resolve_format(fmt), lowprec.MXFormat):
        qa = np.asarray(lowprec.fake_quantize_mx(a, fmt), np.float64)
        qb = np.asarray(lowprec.fake_quantize_mx(b, fmt, axis=0), np.float64)
    else:
        qa = np.asarray(lowprec.quantize(a, fmt), np.float64)
        qb = np.asarray(lowprec.quantize(b, fmt), np.float64)
    bound = 64 * 2.0**-23 * (np.abs(qa) @ np.abs(qb))
    assert (np.abs(y - qa @ qb) <= bound).all()
    mxa = lowprec.quantize_mx(a, fmt) if isinstance(lowprec.resolve_format(fmt),
                                                     lowprec.MXFormat) else None
    if mxa is not None:
        y2 = np.asarray(lowprec.matmul(mxa, b, rhs_format=fmt))
        np.testing.assert_array_equal(y2, y)


@pytest.mark.slow  # left out of the quick tier (seconds; its paths run in other quick tests)
def test_mxfp6_quantized_backward():
    rng = np.random.default_rng(12)
    x = jnp.asarray(rng.standard_normal((32, 64)).astype(np.float32))
    w = jnp.asarray(rng.standard_normal((64, 32)).astype(np.float32))
    g = jax.grad(lambda v: lowprec.matmul(v, w, lhs_format="mxfp6", rhs_format="mxint8",
                                          backward="quantized", grad_format="mxfp6_e3m2").sum())(x)
    assert g.shape == x.shape and bool(jnp.isfinite(g).all())


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0, 0.0, -0.0])
@pytest.mark.quick_first(2)
def test_nvfp4_invalid_tensor_scale_refused_or_nan(bad):
    """A tensor scale that is not positive and finite multiplies every block scale: a concrete
    one is refused by MXArray; a traced one (no value at construction) decodes to NaN, never
    to ±inf, zeros or sign-flipped values."""
    x = jnp.linspace(-3.0, 3.0, 64).reshape(2, 32)
    nv = lowprec.quantize_mx(x, "nvfp4")
    parts = dict(elements=nv.elements, scales=nv.scales, fmt=nv.fmt, axis=nv.axis, shape=nv.shape)
    with pytest.raises(ValueError, match="tensor_scale must be positive and finite"):
        lowprec.MXArray(**parts, tensor_scale=jnp.float32(bad))
    decode = jax.jit(lambda ts: lowprec.dequantize(lowprec.MXArray(**parts, tensor_scale=ts)))
    assert np.isnan(np.asarray(decode(jnp.float32(bad)))).all()
    # The valid scale still decodes to values (no NaN).
    assert not np.isnan(np.asarray(decode(nv.tensor_scale))).any()


def _near_ties(rng, rows=64):
    """Elements placed on E2M1 rounding boundaries (0.25, 0.75, ..., 5) times the block's
    float32(ts * s): there the divide step's quotient is the boundary itself (a tie) while
    the reciprocal step's product may land an ulp to either side."""
    x = rng.standard_normal((rows, 256)).astype(np.float32) * np.float32(rng.uniform(0.1, 30))
    ts = np.float32(np.abs(x).max() / np.float32(2688.0))
    xb = x.reshape(rows, -1, 16)
    s = np.clip(np.abs(xb).max(-1) / np.float32(6) / ts, np.float32(2.0**-6), np.float32(448))
    total = (ts * s.astype(ml_dtypes.float8_e4m3fn).astype(np.float32))[..., None]
    amax = np.abs(xb).max(-1)
    ties = np.float32([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    pick = rng.integers(0, len(ties), xb.shape) * (rng.random(xb.shape) < 0.5)
    xb[...] = np.where(pick > 0, (ties[pick] * total).astype(np.float32), xb)
    xb[..., 0] = amax  # keep each block's amax (so its scale) and the tensor's (so ts)
    assert np.float32(np.abs(x).max() / np.float32(2688.0)) == ts
    return x, ts


def test_exact_division_is_ieee_float32_division():
    """_nvfp4.f32_div, the NVFP4 element division (and delayed scaling's) wherever XLA's own
    float32 division is not correctly rounded (a GPU: PTX div.full; measured on an H200, it
    moved quotients that land exactly on E2M1 boundaries by an ulp), against NumPy's IEEE
    division: random patterns over every binade (subnormals, zeros, overflow to inf
    included), infinite divisors, and exact quotients q * b / b = q at every E2M1 rounding
    boundary."""
    from lowprec._nvfp4 import f32_div

    rng = np.random.default_rng(11)
    n = 1 << 16
    finite = lambda v: v[np.isfinite(v.view(np.float32))]  # noqa: E731
    a = finite(rng.integers(0, 1 << 32, 4 * n, dtype=np.uint64).astype(np.uint32))[:n]
    b = finite(rng.integers(0, 1 << 32, 4 * n, dtype=np.uint64).astype(np.uint32))[:n]
    b = np.where(b & 0x7FFF_FFFF == 0, np.uint32(0x3F80_0000), b)
    # Exact quotients: b in [1, 2) with 21 significant bits (so q * b is a float32 for every
    # boundary q, which has at most 4), a = q * b; the division must give q itself.
    ties = np.float32([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    bt = (np.float32(1) + rng.integers(0, 1 << 20, n).astype(np.float32) * np.float32(2.0**-20))
    qt = ties[rng.integers(0, len(ties), n)] * np.float32(2.0) ** rng.integers(-100, 100, n)
    at = (qt.astype(np.float32) * bt).astype(np.float32)
    assert np.all(at / bt == qt.astype(np.float32))  # the products are exact
    infs = np.uint32([0x7F80_0000, 0xFF80_0000] * 8)  # x / ±inf = ±0
    a = np.concatenate([a, at.view(np.uint32), a[:16]])
    b = np.concatenate([b, bt.view(np.uint32), infs])
    with np.errstate(all="ignore"):
        want = (a.view(np.float32) / b.view(np.float32)).view(np.uint32)
    got = np.asarray(jax.jit(f32_div)(jnp.asarray(a), jnp.asarray(b)))
    assert_codes_equal(got, want, a.view(np.float32), "a / b")


def test_exact_product_is_ieee_float32_multiplication():
    """_nvfp4.f32_mul, the element product of NVFP4's "reciprocal" step, against NumPy's IEEE
    float32 product: random finite patterns over every binade (subnormal results, zeros and
    overflow to inf included). On a GPU the quantize kernel runs PTX mul.rn.f32 in its place
    (IEEE, subnormals kept), which this equality makes the same bits."""
    from lowprec._nvfp4 import f32_mul

    rng = np.random.default_rng(12)
    n = 1 << 16
    finite = lambda v: v[np.isfinite(v.view(np.float32))]  # noqa: E731
    a = finite(rng.integers(0, 1 << 32, 4 * n, dtype=np.uint64).astype(np.uint32))[:n]
    b = finite(rng.integers(0, 1 << 32, 4 * n, dtype=np.uint64).astype(np.uint32))[:n]
    # Products near the subnormal range and near overflow, where rounding is delicate.
    near = rng.integers(0x3000_0000, 0x4F00_0000, n, dtype=np.uint64).astype(np.uint32)
    a = np.concatenate([a, near, near])
    b = np.concatenate([b, rng.integers(0x0080_0000, 0x1000_0000, n).astype(np.uint32),
                        rng.integers(0x6F00_0000, 0x7F00_0000, n).astype(np.uint32)])
    # Overflowing products whose 24-bit significand rounds up to 2^24 (1.75 x 1.1428... =
    # 1.99999... x 2): past 2^128 the carry must still give ±inf (it once wrapped to -0).
    carry_a = np.uint32([0x55DF_FFFF, 0xD5DF_FFFF, 0x7F5F_FFFF, 0x65DF_FFFF])
    carry_b = np.uint32([0x7B12_4925, 0x7B12_4925, 0x7F12_4925, 0x6B12_4925])
    a, b = np.concatenate([a, carry_a]), np.concatenate([b, carry_b])
    with np.errstate(all="ignore"):
        want = (a.view(np.float32) * b.view(np.float32)).view(np.uint32)
    got = np.asarray(jax.jit(f32_mul)(jnp.asarray(a), jnp.asarray(b)))
    assert_codes_equal(got, want, a.view(np.float32), "a * b")


def _delayed_step(x, w):
    cfg = lowprec.DelayedScaling(amax_history_len=2, margin=1)
    dn = (((1,), (0,)), ((), ()))
    loss = lambda a, b, st: jnp.sum(lowprec.delayed_dot_general(a, b, st, dn, cfg))  # noqa: E731
    return jax.grad(loss, argnums=(0, 1, 2))(x, w, cfg.init())


_FLOAT_DIVIDE = re.compile(r"stablehlo\.divide\b[^\n]*tensor<[^>]*f32>")


_DIVIDING = {
    "nvfp4 divide": lambda x, w: lowprec.quantize_mx(x, "nvfp4", nvfp4_step="divide"),
    "nvfp4 reciprocal": lambda x, w: lowprec.quantize_mx(x, "nvfp4", nvfp4_step="reciprocal"),
    "nvfp4 stochastic": lambda x, w: lowprec.quantize_mx(
        x, "nvfp4", rounding="stochastic", key=jax.random.key(0)),
    "delayed scaling step": _delayed_step,
}


# Quick tier: the NVFP4 quantizer's default step and delayed scaling (~1.4 CPU s each: a
# CPU lowering and a CUDA lowering of every platform's branch); the other steps share their
# division code and run in the default run.
@pytest.mark.quick_cases(name=["nvfp4 divide", "delayed scaling step"])
@pytest.mark.parametrize("name", list(_DIVIDING))
def test_programs_lowered_for_cuda_divide_no_floats(name):
    """Where XLA lowers for a CUDA GPU (whose float32 division is not correctly rounded), the
    NVFP4 quantizer and delayed scaling hold no float32 division: their quotients are long
    divisions on the bits (or, inside the NVFP4 quantize kernel, PTX's IEEE div.rn.f32). On
    CPU XLA's formulation of the same programs does divide floats (the check can fail; with
    the kernels on, NVFP4 is one native custom call there, hence the policy "xla")."""
    x = jax.ShapeDtypeStruct((64, 32), jnp.float32)
    w = jax.ShapeDtypeStruct((32, 16), jnp.float32)
    fn = _DIVIDING[name]
    previous = lowprec.kernels.set_policy("xla")
    try:
        cpu = jax.jit(fn).trace(x, w).lower(lowering_platforms=("cpu",)).as_text()
    finally:
        lowprec.kernels.set_policy(previous)
    assert _FLOAT_DIVIDE.search(cpu), "the CPU program divides floats (the pattern matches)"
    cuda = lower_for_cuda(fn, x, w)
    assert not _FLOAT_DIVIDE.findall(cuda), _FLOAT_DIVIDE.findall(cuda)[:3]


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.slow  # left out of the quick tier (seconds; its paths run in other quick tests)
def test_nvfp4_steps_match_their_torchao_versions(seed):
    x, ts = _near_ties(np.random.default_rng(seed))
    old_e, old_s = torchao_nvfp4_recipe(x, ts)
    new_e, new_s = torchao_nvfp4_recipe(x, ts, version=(0, 17))
    np.testing.assert_array_equal(old_s, new_s)  # the block scales are the same
    assert (old_e != new_e).any(), "no input where the two torchao versions differ"
    for step, want in (("divide", old_e), ("reciprocal", new_e), (None, old_e)):
        for f in (lowprec.quantize_mx, jax.jit(lowprec.quantize_mx, static_argnames=(
                "fmt", "nvfp4_step"))):
            mx = f(jnp.asarray(x), fmt="nvfp4", nvfp4_step=step)
            assert_bits_equal(mx.tensor_scale, ts)
            np.testing.assert_array_equal(np.asarray(mx.scales), new_s)
            np.testing.assert_array_equal(element_codes(mx), want)
    # Dequantization is the same for both (torchao's to_dtype did not change).
    a = lowprec.quantize_mx(jnp.asarray(x), "nvfp4", nvfp4_step="reciprocal")
    got = np.asarray(lowprec.dequantize(a))
    vals = new_e.view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    total = (ts * new_s.view(ml_dtypes.float8_e4m3fn).astype(np.float32)).repeat(16, 1)
    np.testing.assert_array_equal(got, (vals * total).astype(np.float32))


def test_nvfp4_reciprocal_step_guards_its_reciprocal():
    # A tiny tensor: torchao 0.17 computes 1 / ts = inf (ts < 2^-128) and NaN/inf codes;
    # lowprec raises ts to 2^-121, where (1 / ts) / s <= 2^127 for every block scale >= 2^-6.
    x = (np.random.default_rng(5).standard_normal((2, 64)) * 2.0**-125).astype(np.float32)
    ts = np.float32(np.abs(x).max() / np.float32(2688.0))
    with np.errstate(all="ignore"):
        assert np.isinf(np.float32(1.0) / ts)
    mx = lowprec.quantize_mx(jnp.asarray(x), "nvfp4", nvfp4_step="reciprocal")
    floor = np.float32(2.0**-121)
    assert np.asarray(mx.tensor_scale) == floor
    want_e, want_s = torchao_nvfp4_recipe(x, floor, version=(0, 17))
    np.testing.assert_array_equal(np.asarray(mx.scales), want_s)
    np.testing.assert_array_equal(element_codes(mx), want_e)
    with pytest.raises(ValueError, match="unknown nvfp4_step 'torchao'"):
        lowprec.quantize_mx(jnp.asarray(x), "nvfp4", nvfp4_step="torchao")
    with pytest.raises(ValueError, match="nvfp4_step applies to NVFP4"):
        lowprec.quantize_mx(jnp.asarray(x), "mxfp4", nvfp4_step="divide")


def test_nvfp4_exact_float32_product_matches_ieee():
    """The reciprocal step's product x * factor is built on the bits (XLA:CPU flushes
    subnormal operands and results): it must equal IEEE float32 multiplication (NumPy's, which
    keeps subnormals) for normal, subnormal, tiny and huge operands of both signs."""
    from lowprec import _nvfp4

    rng = np.random.default_rng(11)
    n = 200_000
    a = rng.integers(0, 0x7F80_0000, n, dtype=np.uint32) | (rng.integers(0, 2, n, dtype=np.uint32) << 31)
    b = rng.integers(0, 0x7F80_0000, n, dtype=np.uint32)
    a[:1000] &= 0x807F_FFFF  # subnormal operands
    b[1000:2000] = rng.integers(0x0200_0000, 0x0400_0000, 1000, dtype=np.uint32)  # tiny products
    with np.errstate(all="ignore"):
        want = bit_pattern(a.view(np.float32) * b.view(np.float32))
    got = np.asarray(jax.jit(_nvfp4.f32_mul)(jnp.asarray(a), jnp.asarray(b)))
    np.testing.assert_array_equal(got, want)


# -- the scale-scheme table --------------------------------------------------------------------


def test_every_block_format_names_a_described_scale_scheme():
    """formats/elements.json: each block format names an entry of 'scale_schemes', whose
    fields say what its scale codes are (an element format) and whether a float32 tensor
    scale goes with them; the OCP MX formats use E8M0 alone, NVFP4 E4M3 under a tensor
    scale (OCP MX v1.0 §5.4.1; docs/design.md §3b)."""
    import lowprec_formats as F

    assert set(F.SCALE_SCHEMES) == {"e8m0", "nvfp4", "nvfp4_4over6", "if4", "mixfp4"}
    for name, entry in F.SCALE_SCHEMES.items():
        assert set(entry) == {"scale", "tensor_scale", "doc"}, name
        assert entry["scale"] in F.ELEMENT_FORMATS and isinstance(entry["tensor_scale"], bool)
    assert dict(F.SCALE_SCHEMES["e8m0"], doc=None) == {"scale": "e8m0", "tensor_scale": False,
                                                       "doc": None}
    assert dict(F.SCALE_SCHEMES["nvfp4"], doc=None) == {"scale": "e4m3", "tensor_scale": True,
                                                        "doc": None}
    # The 2026 four-bit formats (docs/design.md §3c): E4M3 block scales under a tensor scalar.
    for name in ("nvfp4_4over6", "if4", "mixfp4"):
        assert dict(F.SCALE_SCHEMES[name], doc=None) == {"scale": "e4m3", "tensor_scale": True,
                                                         "doc": None}
    schemes = {"nvfp4": "nvfp4", "nvfp4_4over6": "nvfp4_4over6",
               "nvfp4_4over6_mse": "nvfp4_4over6", "nvfp4_4over6_fp16": "nvfp4_4over6",
               "if4": "if4", "mixfp4": "mixfp4", "nvint4": "nvfp4"}
    for name, spec in F.MX_FORMATS.items():
        assert "scale" not in spec and "tensor_scale" not in spec, name
        assert spec["scheme"] == schemes.get(name, "e8m0"), name
