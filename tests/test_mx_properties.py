"""Property tests: lowprec's MX quantizer equals the independent reference bit for bit.

Every (element format × scale rule × rounding mode) is checked eagerly and under
``jax.jit`` against ``lowprec_reference.quantize_mx`` (pure NumPy / Fraction, no JAX):
scale codes and element codes (FP4 unpacked with NumPy, low nibble first). Stochastic
rounding gives the reference the same 32-bit words lowprec documents it consumes,
``lowprec.random_bits(key, padded_shape)``, replayed by the NumPy reference.

``scale_rule="rceil"`` is also compared with JAX's own MXFP8 quantizer
(``jax._src.cudnn.scaled_matmul_stablehlo.quantize``), the NVIDIA recipe.

Inputs are built block by block from a random top exponent plus per-element offsets, so
the shared scales range over the whole E8M0 span, blocks mix magnitudes, and maxima land
on and around powers of two and element overflow; zeros, float32 subnormals (2^-130),
±inf, NaN and float32's largest values are sprinkled in.

Each parametrized case uses one array layout (rotated across cases so every format, rule
and rounding meets every layout somewhere): compiles, not examples, dominate CPU time.
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
from helpers.asserts import assert_codes_equal, assert_same_floats, bit_pattern
from helpers.mx import (
    BLOCK,
    MODES,
    MX_FORMATS,
    ROUNDINGS,
    SCALE_RULES,
    as_float32,
    block_bits,
    element_codes,
    f32,
    f64_to_f32_exact,
    mx_inputs,
    random_bits,
    run_quantize,
)

# (shape, axis): blocks along the last axis, along axis 0 and along a middle axis; 1-D to
# 3-D; 2 to 4 blocks.
LAYOUTS = (
    ((64,), -1),
    ((2, 64), -1),
    ((64, 2), 0),
    ((96,), 0),
    ((2, 32, 2), 1),
    ((32, 3), 0),
)

# Eager quantize_mx runs the same jitted program as jax.jit(quantize_mx) (its inner
# _quantize_mx_jit): each case checks one of the two call paths, alternating, so that every
# format, rule and rounding meets both across the cases at one compile per case, not two.
CASES = [
    pytest.param(
        fmt, rule, rounding, *LAYOUTS[(i + j + k) % len(LAYOUTS)], MODES[(i + j + k) % 2],
        id=f"{fmt}-{rule}-{rounding}-{MODES[(i + j + k) % 2]}",
    )
    for i, fmt in enumerate(MX_FORMATS)
    for j, rule in enumerate(SCALE_RULES)
    for k, rounding in enumerate(ROUNDINGS)
]


def _draw_key(data, rounding):
    if rounding != "stochastic":
        return None
    return jax.random.key(data.draw(st.integers(0, 2**31 - 1), label="seed"))


def _check_against_reference(x, fmt, rule, rounding, axis, key, context, modes=MODES):
    shape = x.shape
    rbits = None if key is None else random_bits(key, shape)
    want_codes, want_scales = R.quantize_mx(
        x, fmt, axis=axis, scale_rule=rule, rounding=rounding, random_bits=rbits
    )
    for mode in modes:
        mx = run_quantize(mode, jnp.asarray(x), fmt, axis=axis, scale_rule=rule,
                          rounding=rounding, key=key)
        ctx = f"{context} {fmt} {rule} {rounding} {mode} shape={shape} axis={axis}"
        assert isinstance(mx, lowprec.MXArray)
        assert mx.shape == shape and mx.axis == axis % len(shape) and mx.scale_rule == rule
        assert mx.elements.dtype == jnp.uint8 and mx.scales.dtype == jnp.uint8
        ax = axis % len(shape)
        assert_codes_equal(mx.scales, want_scales, x, f"{ctx} scales", axis=ax, per_block=True)
        assert_codes_equal(element_codes(mx), want_codes, x, f"{ctx} elements", axis=ax)
        if mode == modes[0]:
            # dequantize(quantize_mx(x)) == the reference's values of its own codes.
            want = f64_to_f32_exact(R.dequantize_mx(want_codes, want_scales, fmt, axis=axis))
            assert_same_floats(lowprec.dequantize(mx), want, f"{ctx} dequantize")


@pytest.mark.quick_cases(rule=["rceil"], rounding=["nearest_even", "stochastic"])
@pytest.mark.parametrize("fmt, rule, rounding, shape, axis, mode", CASES)
@settings(max_examples=25, deadline=None)
@given(data=st.data())
@pytest.mark.quick_first(2)
def test_quantize_matches_reference(fmt, rule, rounding, shape, axis, mode, data):
    x = data.draw(mx_inputs(shape, axis), label="x")
    key = _draw_key(data, rounding)
    _check_against_reference(x, fmt, rule, rounding, axis, key, "float32", modes=(mode,))


# One rounding per (format, rule), rotated; the layout is the float32 case's for the same
# configuration, so lowprec's eager path reuses that compile.
BF16_CASES = [
    pytest.param(
        fmt, rule, ROUNDINGS[(i * len(SCALE_RULES) + j) % len(ROUNDINGS)],
        *LAYOUTS[(i + j + (i * len(SCALE_RULES) + j) % len(ROUNDINGS)) % len(LAYOUTS)],
        id=f"{fmt}-{rule}-{ROUNDINGS[(i * len(SCALE_RULES) + j) % len(ROUNDINGS)]}",
    )
    for i, fmt in enumerate(MX_FORMATS)
    for j, rule in enumerate(SCALE_RULES)
]


@pytest.mark.parametrize("fmt, rule, rounding, shape, axis", BF16_CASES)
@settings(max_examples=12, deadline=None)
@given(data=st.data())
@pytest.mark.quick_first(2)
def test_bfloat16_input_matches_reference(fmt, rule, rounding, shape, axis, data):
    """bfloat16 input quantizes as its exact float32 value; the reference reads the bf16."""
    x = data.draw(mx_inputs(shape, axis, dtype=ml_dtypes.bfloat16), label="x")
    key = _draw_key(data, rounding)
    _check_against_reference(x, fmt, rule, rounding, axis, key, "bfloat16")
    # And bfloat16 quantizes exactly like its float32 widening.
    want = lowprec.quantize_mx(as_float32(x), fmt, axis=axis, scale_rule=rule,
                               rounding=rounding, key=key)
    got = lowprec.quantize_mx(jnp.asarray(x), fmt, axis=axis, scale_rule=rule,
                              rounding=rounding, key=key)
    np.testing.assert_array_equal(np.asarray(got.elements), np.asarray(want.elements))
    np.testing.assert_array_equal(np.asarray(got.scales), np.asarray(want.scales))


@functools.lru_cache(maxsize=None)
def _jitted_dequantize(dtype):
    return jax.jit(lambda mx: lowprec.dequantize(mx, dtype))


# Scale codes worth hitting: the extremes (2^-127 gives float32 subnormal values, 2^127
# overflows to inf for large elements), the NaN code, and around 127.
_SCALES = st.one_of(st.sampled_from([0, 1, 2, 3, 9, 20, 126, 127, 128, 200, 240, 254, 255]),
                    st.integers(0, 255))


@pytest.mark.parametrize("fmt", MX_FORMATS)
@pytest.mark.parametrize("shape, axis", [((2, 64), -1), ((64, 2), 0)])
@settings(max_examples=30, deadline=None)
@given(data=st.data())
@pytest.mark.quick_first(3)
def test_dequantize_matches_reference(fmt, shape, axis, data):
    """dequantize == reference dequantize_mx cast to float32, on arbitrary codes.

    Every element byte and scale code may occur (E4M3 NaN, E5M2 inf/NaN codes, scale 0xFF,
    2^±127), so decoding is checked independently of quantization. The float64 reference
    values are float32 values (the cast is checked exact, overflow to inf aside), so the
    comparison is bit for bit, float32 subnormal results included.
    """
    n_blocks = int(np.prod(shape)) // BLOCK
    scale_shape = list(shape)
    scale_shape[axis] //= BLOCK
    scales = np.array(data.draw(st.lists(_SCALES, min_size=n_blocks, max_size=n_blocks)),
                      np.uint8).reshape(scale_shape)
    codes = np.frombuffer(data.draw(st.binary(min_size=int(np.prod(shape)),
                                              max_size=int(np.prod(shape)))), np.uint8)
    codes = codes.reshape(shape)
    if fmt == "mxfp4":
        codes = codes & 0x0F
        m = np.moveaxis(codes, axis, -1)
        packed = np.moveaxis(m[..., 0::2] | (m[..., 1::2] << 4), -1, axis)  # low nibble first
    else:
        packed = codes
    mx = lowprec.MXArray(jnp.asarray(packed), jnp.asarray(scales), lowprec.mx_format(fmt),
                         axis % len(shape), shape, None)
    want = f64_to_f32_exact(R.dequantize_mx(codes, scales, fmt, axis=axis))
    for got in (lowprec.dequantize(mx), _jitted_dequantize(jnp.float32)(mx)):
        assert got.dtype == jnp.float32 and got.shape == shape
        assert_same_floats(got, want, f"{fmt} dequantize")
    # Every block with scale 0xFF is NaN throughout.
    nan_block = np.repeat(scales == 0xFF, BLOCK, axis=axis)
    assert np.isnan(np.asarray(got)[nan_block]).all()


# -- JAX's own MXFP8 quantizer (rceil) -----------------------------------------------------------


def _jax_config(dtype):
    from jax._src.cudnn.scaled_matmul_stablehlo import BlockScaleConfig

    return BlockScaleConfig(
        mode="mxfp8",
        block_size=32,
        data_type=dtype,
        scale_type=jnp.float8_e8m0fnu,
        global_scale=None,
        infer_only=False,
    )


@functools.lru_cache(maxsize=None)
def _jax_quantizer(dtype_name):
    from jax._src.cudnn.scaled_matmul_stablehlo import quantize

    config = _jax_config(getattr(jnp, dtype_name))
    return jax.jit(lambda x: quantize(x, config))


_JAX_DTYPES = {"mxfp8_e4m3": "float8_e4m3fn", "mxfp8_e5m2": "float8_e5m2"}
_ELEMENT_MAX = {"mxfp8_e4m3": 448.0, "mxfp8_e5m2": 57344.0}


def _compare_with_jax(x, fmt):
    """lowprec rceil == JAX mxfp8 quantize on float32 ``x`` [..., K], bit for bit.

    Excluded, each a documented difference, not a lowprec error:
      * blocks holding a NaN: JAX's e8m0 cast turns the NaN quotient (exponent 0xFF,
        mantissa > 0) into 0xFF + 1 = 0x00; lowprec gives 0xFF (docs/design.md §3: NaN block → 0xFF).
      * blocks holding ±inf: both give scale 0xFF, but JAX then divides by 2^128 = inf
        (elements 0 / NaN) while lowprec stores zero codes: scales compared, elements not.
      * XLA's CPU backend flushes float32 subnormals to zero: JAX's quotient amax / max_elem
        is flushed when amax < max_elem·2^-126, and so is an element quotient x / 2^s below
        2^-126; lowprec computes those exactly (IEEE). Such blocks are skipped.
    """
    elems_j, scales_j = _jax_quantizer(_JAX_DTYPES[fmt])(jnp.asarray(x))
    elems_j = bit_pattern(elems_j)
    scales_j = bit_pattern(scales_j)
    xb = x.reshape(*x.shape[:-1], -1, BLOCK).astype(np.float64)
    mag = np.abs(xb)
    has_nan = np.isnan(xb).any(-1)
    has_inf = np.isinf(xb).any(-1)
    finite = ~(has_nan | has_inf)
    with np.errstate(invalid="ignore"):
        amax = np.where(finite, mag.max(-1), 0.0)
        scale = np.exp2(scales_j.astype(np.float64) - 127)
        tiny_q = ((mag > 0) & (mag / scale[..., None] < 2.0**-126)).any(-1)
    flushed = (amax < _ELEMENT_MAX[fmt] * 2.0**-126) & (amax > 0) | tiny_q
    keep_scale = ~has_nan & ~(finite & flushed)
    keep_elems = finite & ~flushed
    for mode in MODES:
        mx = run_quantize(mode, jnp.asarray(x), fmt, axis=-1, scale_rule="rceil")
        s = np.asarray(mx.scales)
        e = np.asarray(mx.elements).reshape(xb.shape)
        bad = np.argwhere(keep_scale & (s != scales_j))
        assert bad.size == 0, (
            f"{fmt} {mode}: scale differs from JAX at block {bad[0]}: lowprec "
            f"{s[tuple(bad[0])]:#x}, JAX {scales_j[tuple(bad[0])]:#x}; block "
            f"{bit_pattern(xb[tuple(bad[0])].astype(np.float32)).tolist()}"
        )
        ej = elems_j.reshape(xb.shape)
        bad = np.argwhere(keep_elems[..., None] & (e != ej))
        assert bad.size == 0, (
            f"{fmt} {mode}: element differs from JAX at {bad[0]}: lowprec {e[tuple(bad[0])]:#x},"
            f" JAX {ej[tuple(bad[0])]:#x}; input {xb[tuple(bad[0])]!r}"
        )
    return int(keep_elems.sum())


@pytest.mark.parametrize("fmt", ["mxfp8_e4m3", "mxfp8_e5m2"])
@settings(max_examples=40, deadline=None)
@given(bits=block_bits(8, min_exp=-100, max_exp=127, specials=True, max_spread=24))
def test_rceil_matches_jax_mxfp8_quantize(fmt, bits):
    """Blocks of one random top exponent in [-100, 127] each, plus specials."""
    _compare_with_jax(f32(bits).reshape(2, 4 * BLOCK), fmt)


@pytest.mark.parametrize("fmt", ["mxfp8_e4m3", "mxfp8_e5m2"])
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.quick_first(1)
def test_rceil_matches_jax_on_many_magnitudes(fmt, seed):
    """512 blocks of Gaussian data, each scaled by 2^u, u uniform in [-105, 120]."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((64, 8, BLOCK)) * np.exp2(rng.integers(-105, 121, (64, 8, 1)))
    # Some blocks with one dominant element, some with a max exactly max_elem · 2^k.
    x[::5, :, 3] *= 2.0**20  # may overflow to inf in float32: those blocks compare scales
    x[::7, :, 0] = _ELEMENT_MAX[fmt] * np.exp2(rng.integers(-100, 100, (len(x[::7]), 8)))
    with np.errstate(over="ignore"):
        x = x.astype(np.float32).reshape(64, 8 * BLOCK)
    compared = _compare_with_jax(x, fmt)
    assert compared >= 400  # the exclusions must not swallow the test


@pytest.mark.parametrize("fmt", ["mxfp8_e4m3", "mxfp8_e5m2"])
@pytest.mark.quick_first(1)
def test_rceil_scale_equals_jax_e8m0_rounding_of_ieee_quotients(fmt):
    """The rceil scale == JAX's ``cast_to_e8m0_with_rounding_up`` of the IEEE quotient.

    Covers what the end-to-end comparison above must skip: on CPU, XLA flushes the float32
    quotient amax / max_elem to zero when it is subnormal. Here the quotient is divided by
    NumPy (IEEE, subnormals kept) and only the bit-level rounding rule runs in JAX (a bitcast
    and integer ops: no flushing), including the subnormal rule "round up iff mantissa >
    0x400000" and amax down to float32's smallest subnormal.
    """
    from jax._src.cudnn.scaled_matmul_stablehlo import cast_to_e8m0_with_rounding_up

    max_elem = np.float32(_ELEMENT_MAX[fmt])
    rng = np.random.default_rng(11)
    bits = rng.integers(1, 0x7F80_0000, 3000, dtype=np.uint32)  # every positive finite float
    bits[:1000] = rng.integers(1, 0x0C00_0000, 1000)  # dense near the bottom (< ~2^-104)
    edges = []
    with np.errstate(over="ignore"):
        for k in range(-149, 128):  # powers of two, max_elem * 2^k, and their neighbours
            for v in (np.float32(2.0**k), np.float32(float(max_elem) * 2.0**k)):
                if np.isfinite(v) and v > 0:
                    edges += [v, np.nextafter(v, np.float32(0)),
                              np.nextafter(v, np.float32(np.inf))]
    # Subnormal-quotient boundary: amax / max_elem = 2^-127 (mantissa exactly 0x400000).
    edges += [np.float32(float(max_elem) * 2.0**-127 * t) for t in (1.0, 1.25, 1.5, 1.99)]
    amax = np.concatenate([bits.view(np.float32), np.array(edges, np.float32)])
    amax = amax[np.isfinite(amax) & (amax > 0)]
    with np.errstate(all="ignore"):
        q = amax / max_elem  # float32 / float32 in NumPy: IEEE, subnormal results kept
    assert q.dtype == np.float32 and (q[amax < max_elem * 2.0**-126] != 0).any()
    want = np.asarray(cast_to_e8m0_with_rounding_up(jnp.asarray(q)))
    x = np.zeros((amax.size, BLOCK), np.float32)
    x[:, 0] = amax
    x[:, 1] = -amax / 2  # a second, smaller element of the other sign
    for mode in MODES:
        got = np.asarray(run_quantize(mode, jnp.asarray(x), fmt, scale_rule="rceil").scales)[:, 0]
        bad = np.flatnonzero(got != want)
        assert bad.size == 0, (
            f"{fmt} {mode}: amax bits {int(bit_pattern(amax[bad[0]])):#010x}: lowprec scale "
            f"{got[bad[0]]:#x}, JAX rounding of the IEEE quotient {want[bad[0]]:#x}"
        )
