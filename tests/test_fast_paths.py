"""The fast paths behind lowprec's hot functions give the general paths' bits, and the random
words of stochastic rounding follow their documented contract.

Each fast path is chosen from a format's fields, so the tests run over every format of the
data table (a format added later is checked without a new test): the general path is the
oracle where it is independent enough (the float64 encoder for float32 inputs, the bit-built
MX decode), and the NumPy reference or ml_dtypes otherwise. Contents: default-mode and
stochastic encode fast paths vs the general encoder; decode by float subtraction vs the
integer decode; MX decode by float multiply vs the bit-built decode, and the predicate
choosing it; the word hash's known answers and the word contract (replayed by the NumPy
reference); the exact rounding probability of 16-bit words; caller-supplied words; matmul
operand layouts. The words' statistics are tested in test_random_words.py.
"""

from __future__ import annotations

import functools
import math
import os
import re
import sys
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import lowprec
import lowprec_formats
import lowprec_reference as R
from helpers.asserts import assert_codes_equal, assert_same_floats, bit_pattern
from helpers.codecs import reference_words, replay_random_bits
from helpers.inputs import adversarial
from helpers.mx import element_codes, f64_to_f32_exact
from helpers.tiers import QUICK_ELEMENTS, QUICK_MX, full_suite
from lowprec import _decode, _dtypes, _encode, _encode_fast, _mx_decode, _random

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks"))
import gpu_hlo_report  # noqa: E402  (its HLO op counts)

ELEMENTS = tuple(lowprec_formats.ELEMENT_FORMATS)
MX = tuple(lowprec_formats.MX_FORMATS)
# The fast decode multiplies by an E8M0 scale: NVFP4 (E4M3 scales) never takes it.
E8M0_MX = lowprec_formats.COLLECTIONS["e8m0_scaled_mx"]

# Float32 inputs that reach every branch of an encoder: a fixed sample of all bit patterns
# plus the adversarial set of the format (ties, binade edges, overflow, subnormals, NaNs).
N_RANDOM = 1 << 16


def _inputs(fmt: str) -> np.ndarray:
    rng = np.random.default_rng(20260515)
    bits = rng.integers(0, 2**32, N_RANDOM, dtype=np.uint64).astype(np.uint32)
    return np.concatenate([bits, bit_pattern(np.asarray(adversarial(fmt), np.float32))])


def _general(fmt, u32: np.ndarray, rounding: str, words=None) -> np.ndarray:
    """The general encoder on the same values as float64 bit patterns (no fast path takes
    float64 input; every float32 is a float64, rounded once from its exact value)."""
    return _general_modes(fmt, u32, (rounding,), words)[0]


def _general_modes(fmt, u32: np.ndarray, roundings, words=None) -> list:
    """:func:`_general` for each of ``roundings``, widened and encoded in one program (a
    program per mode, and the widening op by op, were ~7 compiles a format)."""
    f = lowprec.element_format(fmt)

    def run(u, w):
        u64 = lax.bitcast_convert_type(_dtypes.f32_bits_to_f64(u), jnp.uint64)
        return [_encode.encode_bits(f, u64, r, "ieee", w if r == "stochastic" else None)
                for r in roundings]

    with jax.enable_x64(True):
        w = None if words is None else jnp.asarray(words)
        return [np.asarray(a) for a in jax.jit(run)(jnp.asarray(u32), w)]


def _fast(fmt, u32: np.ndarray, roundings, words=None) -> list:
    """The float32 encoders (their fast paths) for each of ``roundings``, in one program."""
    f = lowprec.element_format(fmt)
    w = None if words is None else jnp.asarray(words)
    run = jax.jit(lambda v, r: [_encode.encode_bits(f, v, m, "ieee", r if m == "stochastic" else None)
                                for m in roundings])
    return [np.asarray(a) for a in run(jnp.asarray(u32), w)]


def _fast_modes(fmt: str):
    f = lowprec.element_format(fmt)
    modes = []
    if _encode_fast.rebias_encodable(f):
        modes += ["nearest_even", "stochastic"]
    if _encode_fast.is_e8m0(f):
        modes += ["nearest_even", "nearest_away"]
    return modes


def test_fast_paths_cover_the_formats_the_issue_names():
    # fp16 and e8m0 are the default-mode encoders that were slow; E4M3/E5M2 share fp16's path.
    assert {"fp16", "e4m3", "e5m2"} <= {n for n in ELEMENTS if "stochastic" in _fast_modes(n)}
    assert "e8m0" in {n for n in ELEMENTS if "nearest_away" in _fast_modes(n)}
    # Stochastic rounding with 16-bit words (the key's): the formats of the CPU speed issue.
    with16 = {n for n in ELEMENTS if _encode_fast.stochastic16_encoder(lowprec.element_format(n))}
    assert {"fp16", "bf16", "tf32", "e4m3", "e5m2", "e8m0"} <= with16


@pytest.mark.quick_cases(fmt=["bf16", "e4m3", "e2m1"])
@pytest.mark.parametrize("fmt", ELEMENTS)
def test_fast_encode_equals_the_general_encoder(fmt):
    modes = _fast_modes(fmt)
    if not modes:
        pytest.skip(f"no float32 fast path for {fmt}")
    u = _inputs(fmt)
    words = np.random.default_rng(7).integers(0, 2**32, u.size, dtype=np.uint64).astype(np.uint32)
    words[:64] = [0, 1, 2**31, 2**32 - 1] * 16  # the extreme words
    w = words if "stochastic" in modes else None
    for rounding, got, want in zip(modes, _fast(fmt, u, modes, w), _general_modes(fmt, u, modes, w)):
        assert_codes_equal(got, want, u.view(np.float32), f"{fmt} {rounding}")


def _subnormal_range_inputs(fmt: str, n: int = 1 << 14) -> np.ndarray:
    """Float32 patterns of both signs from 40 binades below the format's smallest normal up
    to 4 above it, and float32 subnormals: where stochastic results become subnormal."""
    f = lowprec.element_format(fmt)
    rng = np.random.default_rng(11)
    mant = rng.integers(0, 1 << 23, n, dtype=np.uint32)
    field = np.clip(rng.integers(f.emin - 40, f.emin + 4, n) + 127, 0, 254).astype(np.uint32)
    sign = rng.integers(0, 2, n, dtype=np.uint32) << np.uint32(31)
    return sign | (field << np.uint32(23)) | mant


# The internal encoders are also run eagerly (op by op, not one fused program: what a caller
# under jax.disable_jit gets) for one format of each encoder family: the 16-bit float
# rebias (bf16), the 8-bit one (e4m3), E8M0; 16-bit wide (fp16), FP4 (e2m1). Each primitive
# dispatched eagerly is a compile of its own, ~30 per format for the same operations.
_EAGER_ENCODERS = ("bf16", "e4m3", "e8m0", "fp16", "e2m1")


@pytest.mark.quick_cases(fmt=["bf16", "e4m3", "e8m0"])
@pytest.mark.parametrize("fmt", ELEMENTS)
@pytest.mark.quick_first(1)
def test_stochastic16_encoders_equal_the_general_encoder(fmt):
    """The encoders of 16-bit words (given the complement 0xFFFF − r) against the general
    float64 encoder comparing r · 2^16 with frac · 2^32, on every branch's inputs, the
    extreme words included; under jit, and eagerly for one format per encoder family."""
    f = lowprec.element_format(fmt)
    enc = _encode_fast.stochastic16_encoder(f)
    if enc is None:
        pytest.skip(f"no 16-bit stochastic fast path for {fmt}")
    u = np.concatenate([_inputs(fmt), _subnormal_range_inputs(fmt)])
    r16 = np.random.default_rng(8).integers(0, 1 << 16, u.size, dtype=np.uint32)
    r16[:256] = [0, 1, 0x8000, 0xFFFF] * 64
    nr = jnp.asarray(r16 ^ np.uint32(0xFFFF))
    want = _general(fmt, u, "stochastic", r16 << np.uint32(16))
    runs = {"jit": lambda: jax.jit(lambda v, w: enc(f, v, w))(jnp.asarray(u), nr)}
    if fmt in _EAGER_ENCODERS:  # each primitive dispatched eagerly is a compile (~30 a format)
        runs["eager"] = lambda: enc(f, jnp.asarray(u), nr)
    for mode, run in runs.items():
        assert_codes_equal(np.asarray(run()), want, u.view(np.float32),
                           f"{fmt} stochastic16 {mode}")


@pytest.mark.quick_cases(fmt=["bf16", "e4m3", "e2m1"])
@pytest.mark.parametrize("fmt", ELEMENTS)
@pytest.mark.quick_first(1)
def test_decode_by_subtraction_equals_the_integer_decode(fmt):
    f = lowprec.element_format(fmt)
    codes = jnp.arange(1 << min(f.code_bits, 16), dtype=jnp.uint32)
    # The integer decode and the jitted subtraction in one program (one compile, not two).
    want, jitted = jax.jit(lambda c: (_decode.decode_bits(f, c), _decode.decode_f32(f, c)))(codes)
    want = np.asarray(want)
    runs = {"jit": lambda: jitted}
    if fmt in _EAGER_ENCODERS:  # op by op for one format per family (see above)
        runs["eager"] = lambda: _decode.decode_f32(f, codes)
    for mode, run in runs.items():
        assert_codes_equal(bit_pattern(run()), want, None, f"{fmt} {mode}")


# -- MX: decode by float multiply -------------------------------------------------------------


@pytest.mark.quick_cases(fmt=QUICK_MX)
@pytest.mark.parametrize("fmt", MX)
def test_fast_mx_decode_equals_the_bit_built_decode(fmt):
    """Every element code with every scale code at or above the fast path's threshold, in
    both block layouts (block axis last, and first)."""
    f = lowprec.mx_format(fmt)
    if not _mx_decode.fast_decode_applies(f):
        pytest.skip(f"{fmt}: scales are not E8M0")
    threshold = _mx_decode.fast_scale_min(f)
    # The threshold keeps the smallest nonzero element magnitude at or above 2^-126.
    smallest = f.element.min_subnormal if f.element.subnormals else f.element.min_normal
    assert Fraction(smallest) * Fraction(2) ** (threshold - 127) >= Fraction(2) ** -126
    assert Fraction(smallest) * Fraction(2) ** (threshold - 128) < Fraction(2) ** -126 or threshold == 1
    n_codes = 1 << f.element.code_bits
    scales = np.arange(threshold, 256, dtype=np.uint8)
    # One row per scale code, holding every element code (in as many blocks as that takes).
    per_row = f.block_size * -(-n_codes // f.block_size)
    codes = np.resize(np.arange(n_codes, dtype=np.uint8), (scales.size, per_row))
    nb = per_row // f.block_size
    sc = np.repeat(scales[:, None], nb, axis=1)
    packed = R.pack_codes(codes, f.element.code_bits, axis=1)  # FP4/FP6 along the blocks
    for axis, el, s in ((1, packed, sc), (0, packed.T, sc.T)):
        n = codes.shape[1]
        args = (jnp.asarray(el), jnp.asarray(s), f, axis, n)
        # Both decodes in one program (one compile per layout, not two).
        want, got = jax.jit(lambda e, t: (_mx_decode.mx_value_bits(e, t, f, axis, n),
                                          _mx_decode.mx_value_bits_fast(e, t, f, axis, n)))(el, s)
        assert_codes_equal(np.asarray(got), np.asarray(want), None, f"{fmt} axis {axis}")


# The predicate jitted: called eagerly, each of its ~5 primitives is a compile of its own.
_fast_decode_exact = jax.jit(_mx_decode.fast_decode_exact, static_argnums=(2, 3))


@pytest.mark.parametrize("fmt", MX)
@pytest.mark.quick_first(2)
def test_fast_decode_predicate(fmt):
    f = lowprec.mx_format(fmt)
    if not _mx_decode.fast_decode_applies(f):
        pytest.skip(f"{fmt}: scales are not E8M0")
    t = _mx_decode.fast_scale_min(f)

    def ok(codes, scales):  # one element code per block, repeated over the block
        el = np.repeat(np.asarray(codes, np.uint8), f.block_size)
        el = R.pack_codes(el, f.element.code_bits)[None]
        return bool(_fast_decode_exact(jnp.asarray(el), jnp.asarray([scales], jnp.uint8), f, 1))

    assert ok([1, 1], [t, 255])  # large scales, and the NaN code
    assert ok([1, 0], [t, 0])  # an all-zero block may carry any scale (0 = 2^-127 here)
    if f.element.encoding == "sign_magnitude":  # -0 is zero too (INT8 has no -0: 0x80 is -2)
        assert ok([1, 1 << f.element.magnitude_bits], [t, 1])
    assert not ok([1, 1], [t, t - 1])  # a nonzero block below the threshold
    assert not ok([0, 1], [t, 0])


@pytest.mark.quick_cases(fmt=QUICK_MX, axis=[1])
@pytest.mark.parametrize("fmt", E8M0_MX)
@pytest.mark.parametrize("axis", [0, 1])
def test_dequantize_with_small_scales_and_zero_blocks_matches_reference(fmt, axis):
    """dequantize takes the fast decode when blocks with small scales hold only zeros, and
    the bit-built one when they do not: both equal the reference."""
    f = lowprec.mx_format(fmt)
    rng = np.random.default_rng(3)
    codes = rng.integers(0, 1 << f.element.code_bits, (4, 64), dtype=np.uint8)
    scales = np.array([[127, 0], [200, 1], [120, 0], [0, 254]], np.uint8)
    for zero_small in (True, False):
        c = codes.copy()
        if zero_small:
            c[:, 32:][scales[:, 1] < _mx_decode.fast_scale_min(f)] = 0
            c[3, :32] = 0
        packed = R.pack_codes(c, f.element.code_bits, axis=1)
        el, sc, shape = (packed, scales, (4, 64)) if axis == 1 else (packed.T, scales.T, (64, 4))
        mx = lowprec.MXArray(jnp.asarray(el), jnp.asarray(sc), f, axis, shape, None)
        want = f64_to_f32_exact(R.dequantize_mx(c if axis == 1 else c.T, sc, fmt, axis=axis))
        for got in (lowprec.dequantize(mx), jax.jit(lowprec.dequantize)(mx)):
            assert_same_floats(got, want, f"{fmt} axis {axis} zero_small={zero_small}")
        assert bool(_fast_decode_exact(mx.elements, mx.scales, f, axis)) == zero_small or not _mx_decode.fast_decode_applies(f)


@pytest.mark.quick_cases(fmt=QUICK_MX, axis=[1])
@pytest.mark.parametrize("fmt", E8M0_MX)
@pytest.mark.parametrize("axis", [0, 1])
def test_one_pass_gpu_dequantize_matches_reference(fmt, axis):
    """The CUDA formulation of dequantize (``mx_values_blockwise``: a per-block choice of the
    fast or the bit-built decode in one elementwise pass, codes decoded in their packed
    groups) gives the reference's values for every element code under every scale code,
    small scales (subnormal results) and the NaN code included; as bfloat16, the
    reference's float32 rounded to nearest even by ml_dtypes. It runs on any backend; on
    CUDA it is what dequantize compiles to."""
    import ml_dtypes

    f = lowprec.mx_format(fmt)
    if not _mx_decode.fast_decode_applies(f):
        pytest.skip(f"{fmt}: the whole-array path serves it on every backend")
    n_codes = 1 << f.element.code_bits
    scales = np.arange(256, dtype=np.uint8)
    per_row = f.block_size * -(-n_codes // f.block_size)
    codes = np.resize(np.arange(n_codes, dtype=np.uint8), (scales.size, per_row))
    sc = np.repeat(scales[:, None], per_row // f.block_size, axis=1)
    want = f64_to_f32_exact(R.dequantize_mx(codes, sc, fmt, axis=1))
    packed = R.pack_codes(codes, f.element.code_bits, axis=1)
    el, s = (packed, sc) if axis == 1 else (packed.T, sc.T)
    want = want if axis == 1 else want.T
    dtypes = (jnp.float32, jnp.bfloat16)
    # Both result dtypes in one program (a program each: one compile more per case).
    gots = jax.jit(lambda e, t: [_mx_decode.mx_values_blockwise(e, t, f, axis, per_row, d)
                                 for d in dtypes])(jnp.asarray(el), jnp.asarray(s))
    for dtype, got in zip(dtypes, gots):
        expect = want if dtype == jnp.float32 else want.astype(ml_dtypes.bfloat16)
        assert_same_floats(np.asarray(got).astype(np.float32), np.asarray(expect).astype(np.float32),
                           f"{fmt} axis {axis} {np.dtype(dtype).name}")


def test_float32_bits_to_bfloat16_rounds_like_ml_dtypes():
    """_bits.bits_to_bf16_bits (dequantize's float32 → bfloat16 step) against ml_dtypes'
    round-to-nearest-even cast for every bfloat16 pattern's neighbourhood: each top half
    with low halves below, at and above the tie, and the carries (into the exponent, onto
    infinity); NaN is the quiet NaN with its sign (the element encoder's rule)."""
    import ml_dtypes
    from lowprec import _bits

    low = np.array([0, 1, 0x7FFF, 0x8000, 0x8001, 0xC000, 0xFFFF], np.uint32)
    bits = ((np.arange(1 << 16, dtype=np.uint32)[:, None] << 16) | low).ravel()
    got = np.asarray(jax.jit(_bits.bits_to_bf16_bits)(jnp.asarray(bits))).astype(np.uint16)
    with np.errstate(invalid="ignore"):  # NaN inputs
        want = bits.view(np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)
    nan = np.isnan(bits.view(np.float32))
    want = np.where(nan, (want & 0x8000) | 0x7FC0, want)
    np.testing.assert_array_equal(got, want)


# Tensor scales around NVFP4's decode boundaries: 1; a product total of 2^-125 (the least
# the one-multiply product serves); totals with subnormal products and subnormal totals
# (2^-140 times E4M3's 2^-9 .. 448); the largest (products overflow to inf); and ordinary ones.
_NVFP4_TENSOR_SCALES = (1.0, 2.0**-125, 2.0**-125 * 1.0625, 2.0**-131, 2.0**-140, 3.0 * 2.0**-150,
                        float.fromhex("0x1.fffffep127"), 0.0123, 7.5e-30)


@pytest.mark.quick_cases(axis=[1])
@pytest.mark.parametrize("axis", [0, 1])
def test_one_pass_gpu_nvfp4_dequantize_matches_reference(axis):
    """The CUDA formulation of NVFP4 dequantize (``mx_values_blockwise`` with a tensor scale:
    each block's product lifted below 2^-125, _nvfp4.lifted_product) gives the reference's
    float32(element × float32(tensor scale × block scale)) for all 16 element codes under
    all 256 E4M3 scale codes (NaN included) and tensor scales from 2^-150 to the float32
    maximum, as float32 and as bfloat16 (the float32 rounded by ml_dtypes). It runs on any
    backend; on CUDA it is what dequantize compiles to."""
    f = lowprec.mx_format("nvfp4")
    codes = np.tile(np.arange(16, dtype=np.uint8), (256, 1))  # one 16-element block per row
    sc = np.arange(256, dtype=np.uint8)[:, None]
    packed = R.pack_codes(codes, 4, axis=1)
    el, s = (packed, sc) if axis == 1 else (packed.T, sc.T)
    import ml_dtypes

    for dtype in (jnp.float32, jnp.bfloat16):
        run = jax.jit(lambda e, t, ts, d=dtype: _mx_decode.mx_values_blockwise(
            e, t, f, axis, 16, d, ts))
        for ts in _NVFP4_TENSOR_SCALES:
            want = R.dequantize_mx(codes, sc, "nvfp4", axis=1, tensor_scale=np.float32(ts))
            want = f64_to_f32_exact(want if axis == 1 else want.T)
            if dtype == jnp.bfloat16:  # the float32 result rounded to nearest even
                want = want.astype(ml_dtypes.bfloat16).astype(np.float32)
            got = run(jnp.asarray(el), jnp.asarray(s), jnp.float32(ts))
            got = np.asarray(got).astype(np.float32)
            assert_same_floats(got, want, f"nvfp4 axis {axis} {np.dtype(dtype).name} ts {ts!r}")


@pytest.mark.slow  # 2.7M products; quick: test_one_pass_gpu_nvfp4_dequantize_matches_reference runs it
def test_lifted_product_equals_the_exact_product():
    """The one-pass decode's block product (_nvfp4.lifted_product) against the general exact
    one (f32_mul_short) on totals of every magnitude and both signs, subnormal ones included,
    across 2^-126..2^-124 (where the lift starts: 2^-125) every pattern within 4096 of each
    binade edge (the edges themselves included) and every 183rd between them (odd: both
    parities, so rint's ties), times every E2M1 value. The extended sweep takes every third
    pattern of the range instead (6.7M products, ~9 s of CPU)."""
    from lowprec import _nvfp4

    f = lowprec.mx_format("nvfp4")
    rng = np.random.default_rng(5)
    lo, hi = (1 << 23) - 4096, (3 << 23) + 4096  # 2^-126 .. 2^-124, widened by 4096 patterns
    if full_suite():
        lifted = np.arange(lo, hi, 3)
    else:
        lifted = np.concatenate([np.arange(lo, hi, 183)] + [
            np.arange(edge - 4096, edge + 4096) for edge in (1 << 23, 2 << 23, 3 << 23)])
    totals = np.concatenate([np.arange(0, 1 << 16, 7),  # subnormal totals
                             lifted,
                             rng.integers(0, 0x7F80_0000, 1 << 14)]).astype(np.uint32)
    totals = np.concatenate([totals, totals[::5] | np.uint32(0x8000_0000)])  # negative scales
    values = _decode.decode_bits(f.element, jnp.arange(16, dtype=jnp.uint32))
    # 6.7M totals x 16 values: in chunks of totals (one program; the last chunk padded by
    # repeating its head), the products broadcast inside it, so no 107M-element operand or
    # result is ever held (it peaked at 4 GiB).
    chunk = 1 << 18

    @jax.jit
    def both(t):
        t, v = jnp.broadcast_to(t[:, None], (t.size, 16)), jnp.broadcast_to(values, (t.size, 16))
        return _nvfp4.lifted_product(t, v), _nvfp4.f32_mul_short(t, v)

    for start in range(0, totals.size, chunk):
        part = totals[start:start + chunk]
        padded = np.resize(part, chunk)
        lifted, exact = (np.asarray(a)[: part.size] for a in both(jnp.asarray(padded)))
        np.testing.assert_array_equal(lifted, exact, f"totals from index {start}")


# The formats whose scheme chooses per block by its float32 error (Four over Six and its
# variants, IF4, MixFP4; docs/design.md §3c) compile a pipeline of seconds per layout: their
# blocks along a leading axis are checked against the reference in the default run by
# tests/test_four_bit_2026.py (its [batch, d, seq] layout, blocks along axis 1; Four over
# Six's variants change only the per-block error measure, not the layout), so here they run
# in the extended sweep only.
SELECTING_MX = ("nvfp4_4over6", "nvfp4_4over6_mse", "nvfp4_4over6_fp16", "if4", "mixfp4")
_AXIS_CASES = [pytest.param(f, marks=pytest.mark.extended) if f in SELECTING_MX else f
               for f in MX]


@pytest.mark.quick_cases(fmt=["mxfp4"])
@pytest.mark.parametrize("fmt", _AXIS_CASES)
def test_quantize_along_axis_0_equals_axis_1_of_the_transpose(fmt):
    """Blocks split in place along a leading axis give the codes of the transposed array
    blocked along its last axis, bit for bit (FP4 packed along the block axis in both)."""
    rng = np.random.default_rng(11)
    w = (rng.standard_normal((96, 5)) * 2.0 ** rng.integers(-30, 30, (96, 5))).astype(np.float32)
    w[:32, 1] = 0.0
    w[40, 2] = np.inf
    nvfp4 = lowprec.mx_format(fmt).tensor_scale  # its own scale recipe: no rule to pick
    for rule in (None,) if nvfp4 else ("floor", "rceil"):
        a = lowprec.quantize_mx(jnp.asarray(w), fmt, axis=0, scale_rule=rule)
        b = lowprec.quantize_mx(jnp.asarray(w.T), fmt, axis=1, scale_rule=rule)
        assert_codes_equal(np.asarray(a.elements), np.asarray(b.elements).T, None, f"{fmt} {rule}")
        assert_codes_equal(np.asarray(a.scales), np.asarray(b.scales).T, None, f"{fmt} {rule}")
        if not nvfp4:
            e = lowprec.shared_exponents(jnp.asarray(w), fmt, axis=0, scale_rule=rule)
            assert np.array_equal(np.asarray(e), np.asarray(a.scales).astype(np.int32) - 127)


# -- random words -------------------------------------------------------------------------------

def _word_hash_by_hand(k0: int, k1: int, i: int) -> int:
    """docs/design.md §2's hash in Python integers, each step reduced modulo 2^32."""
    x = (i * 0x9E3779B9 + k0) % 2**32
    x ^= (x >> 16) ^ k1
    x = (x * 0x7FEB352D) % 2**32
    x ^= x >> 15
    return (x * 0x846CA68B) % 2**32


# (k0, k1, i) -> hash: the values follow from the arithmetic above, e.g. for (0, 0, 1):
# x = 0x9E3779B9; x ^ (x >> 16) = 0x9E37E78E; times 0x7FEB352D mod 2^32 = 0x641E19F6;
# ^ (x >> 15) = 0x641ED1CA; times 0x846CA68B mod 2^32 = 0x01FCE4AE.
WORD_HASH_KAT = [
    (0, 0, 0, 0x00000000),
    (0, 0, 1, 0x01FCE4AE),
    (1, 2, 3, 0x776443F6),
    (0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF, None),
    (0x243F6A88, 0x85A308D3, 0x13198A2E, None),
]


@pytest.mark.parametrize("k0,k1,i,want", WORD_HASH_KAT, ids=str)
def test_word_hash_known_answers(k0, k1, i, want):
    by_hand = _word_hash_by_hand(k0, k1, i)
    if want is not None:
        assert by_hand == want
    got = _random.word_hash((jnp.uint32(k0), jnp.uint32(k1)), jnp.uint32(i))
    assert int(got) == by_hand
    assert R.word_hash(k0, k1, i) == by_hand
    # The word is the top half; the encoders' complement is 0xFFFF minus it.
    k, idx = (jnp.uint32(k0), jnp.uint32(k1)), jnp.uint32(i)
    assert int(_random.element_words(k, idx)) == by_hand >> 16
    assert int(_random.word_complements(k, idx)) == 0xFFFF - (by_hand >> 16)


@pytest.mark.quick_cases(shape=[(3, 5)])
@pytest.mark.parametrize("impl", ["threefry2x32", "rbg", "raw"])
@pytest.mark.parametrize("shape", [(), (7,), (3, 5), (2, 3, 8)], ids=str)
def test_random_bits_follow_the_documented_contract(impl, shape):
    key = jax.random.PRNGKey(5) if impl == "raw" else jax.random.key(5, impl=impl)
    got = lowprec.random_bits(key, shape)
    assert got.dtype == jnp.uint16 and got.shape == shape
    assert np.array_equal(np.asarray(got), replay_random_bits(key, shape))
    assert np.array_equal(np.asarray(jax.jit(lowprec.random_bits, static_argnums=1)(key, shape)),
                          np.asarray(got))


def test_random_bits_are_a_prefix_stable_stream():
    # Word i depends on the key and i only, not on the shape.
    key = jax.random.key(9)
    long = np.asarray(lowprec.random_bits(key, (1000,)))
    assert np.array_equal(np.asarray(lowprec.random_bits(key, (10, 7))).ravel(), long[:70])


# Every shape for one format of each code width and fast path (the grouping depends on those
# alone); the other formats take one even and one odd last axis.
_WORD_SHAPES = [(8,), (3, 4), (5, 3), (2, 2, 6), ()]
_EVERY_SHAPE = ("fp16", "bf16", "tf32", "e4m3", "e5m2", "e2m1", "e8m0")


@pytest.mark.quick_cases(fmt=["e4m3"])
@pytest.mark.parametrize("fmt", ELEMENTS)
def test_key_equals_its_words_given(fmt):
    """The words generated inside the encoder (each element hashing its own index, fast
    encoder or general) are those of random_bits, and rounding with them matches the
    reference. Every shape of a format in one jitted program (a program per shape and call
    cost ~0.6 s a case), and eagerly (the concrete-argument checks) on the first shape of one
    format per code width and fast path."""
    shapes = _WORD_SHAPES if fmt in _EVERY_SHAPE else _WORD_SHAPES[1:3]
    rng = np.random.default_rng(4)
    xs = []
    for shape in shapes:
        x = (rng.standard_normal(shape) * 2.0 ** rng.integers(-20, 10, shape)).astype(np.float32)
        xs.append(x if lowprec.element_format(fmt).signed else np.abs(x))
    key = jax.random.key(13)

    def calls(x, k):
        words = lowprec.random_bits(k, x.shape)
        return (words, lowprec.encode(x, fmt, rounding="stochastic", key=k),
                lowprec.encode(x, fmt, rounding="stochastic", random_bits=words),
                lowprec.quantize(x, fmt, rounding="stochastic", key=k, dtype=jnp.float32))

    jitted = jax.jit(lambda xs, k: [calls(x, k) for x in xs])(xs, key)
    runs = [("jit", shape, x, out) for shape, x, out in zip(shapes, xs, jitted)]
    if fmt in _EVERY_SHAPE:
        runs.append(("eager", shapes[0], xs[0], calls(jnp.asarray(xs[0]), key)))
    for mode, shape, x, (words, by_key, by_words, q) in runs:
        tag = f"{fmt} {shape} {mode}"
        replayed = replay_random_bits(key, shape)  # the documented words, by NumPy
        assert np.array_equal(np.asarray(words), replayed), f"{tag} random_bits"
        want = R.encode(fmt, x, "stochastic", random_bits=reference_words(replayed))
        assert_codes_equal(np.asarray(by_key), want, x, f"{tag} key")
        assert_codes_equal(np.asarray(by_words), want, x, f"{tag} words")
        assert np.array_equal(np.asarray(q, np.float64), R.decode(fmt, want), equal_nan=True), tag


_MX_WORD_LAYOUTS = [((4, 64), 1), ((64, 4), 0), ((64, 3), 0)]
# Every layout for one format per element code width with E8M0 scales (8, 4 bits) and for
# NVFP4's two-level scales; the others take the odd-width layout.
_MX_EVERY_LAYOUT = ("mxfp8_e4m3", "mxfp4", "nvfp4")
# Formats whose scheme rounds its elements itself to nearest (docs/design.md §3c) take no
# random words.
_MX_WORD_FORMATS = [f for f in MX if lowprec.mx_format(f).scheme.roundings is None]


@pytest.mark.slow  # test_mx / test_mx_formats check the MX words in the quick tier
@pytest.mark.parametrize("fmt", _MX_WORD_FORMATS)
def test_mx_key_equals_its_words_given(fmt):
    """quantize_mx with a key rounds with the words of random_bits (given instead, the same
    codes, equal to the reference's), and fake_quantize_mx with the key gives their values;
    every layout of a format in one jitted program, and eagerly on the first layout of the
    formats that take every layout."""
    layouts = _MX_WORD_LAYOUTS if fmt in _MX_EVERY_LAYOUT else _MX_WORD_LAYOUTS[-1:]
    xs = [np.random.default_rng(6).standard_normal(shape).astype(np.float32)
          for shape, _ in layouts]
    key = jax.random.key(21)

    def calls(x, k, axis):
        words = lowprec.random_bits(k, x.shape)
        a = lowprec.quantize_mx(x, fmt, axis=axis, rounding="stochastic", key=k)
        b = lowprec.quantize_mx(x, fmt, axis=axis, rounding="stochastic", random_bits=words)
        fq = lowprec.fake_quantize_mx(x, fmt, axis=axis, rounding="stochastic", key=k)
        return words, a, b, fq, lowprec.dequantize(a)

    axes = tuple(axis for _, axis in layouts)
    jitted = jax.jit(lambda xs, k: [calls(x, k, axis) for x, axis in zip(xs, axes)])(xs, key)
    runs = [("jit", x, axis, out) for x, axis, out in zip(xs, axes, jitted)]
    if fmt in _MX_EVERY_LAYOUT:
        runs.append(("eager", xs[0], axes[0], calls(jnp.asarray(xs[0]), key, axes[0])))
    for mode, x, axis, (words, a, b, fq, deq) in runs:
        tag = f"{fmt} {x.shape} axis {axis} {mode}"
        replayed = replay_random_bits(key, x.shape)  # the documented words, by NumPy
        assert np.array_equal(np.asarray(words), replayed), f"{tag} random_bits"
        e, s = R.quantize_mx(x, fmt, axis=axis, rounding="stochastic",
                             random_bits=reference_words(replayed))[:2]
        for name, mx in (("key", a), ("words", b)):
            assert_codes_equal(element_codes(mx), e, x, f"{tag} {name} elements", axis=axis)
            assert_codes_equal(np.asarray(mx.scales), s, x, f"{tag} {name} scales", axis=axis,
                               per_block=True)
        assert_same_floats(fq, deq, f"{tag} fake_quantize_mx")


# Rounding up with probability ⌈frac·2^16⌉/2^16: checked over all 2^16 words, so the count of
# ups is exact (no statistics). (fmt, x, exact): x is rounded to float32 first; frac is that
# float32's exact distance from the value toward zero in units of the gap, and ``exact`` says
# whether frac is a multiple of 2^-16 (then the rounding is exactly unbiased).
EXACT_PROBABILITY_CASES = [
    ("e4m3", 1 + 1 / 24, False),  # frac = 349525/2^20, about 1/3: 20 bits dropped
    ("e5m2", 1.25 + 0.25 * 2 / 7, False),
    ("e2m1", 2.2, False),
    ("e8m0", 1.25, True),  # frac 1/4
    ("bf16", 1 + 2.0**-7 * 12345 / 2**16, True),  # 16 bits dropped: always a multiple
    ("fp16", 1 + 2.0**-10 * 3 / 8, True),  # 13 bits dropped
]


@pytest.mark.parametrize("fmt,x,exact", EXACT_PROBABILITY_CASES, ids=[c[0] for c in EXACT_PROBABILITY_CASES])
def test_sixteen_bit_words_round_up_with_probability_ceil_frac(fmt, x, exact):
    xf = np.float32(x)
    lo, hi = (R.encode(fmt, np.array([xf]), m)[0] for m in ("toward_zero", "up"))
    assert lo != hi
    v_lo, v_hi = (Fraction(float(R.decode(fmt, np.array([c]))[0])) for c in (lo, hi))
    frac = (Fraction(float(xf)) - v_lo) / (v_hi - v_lo)
    assert ((frac * 2**16).denominator == 1) == exact
    words = jnp.arange(1 << 16, dtype=jnp.uint32).astype(jnp.uint16)
    got = np.asarray(lowprec.encode(jnp.full(words.shape, xf), fmt, rounding="stochastic",
                                    random_bits=words))
    assert set(got.tolist()) <= {int(lo), int(hi)}
    ups = int((got == hi).sum())
    assert ups == math.ceil(frac * 2**16)
    # The bias bound of the contract: 0 <= P(up) - frac < 2^-16, and 0 for multiples of 2^-16.
    p = Fraction(ups, 2**16)
    assert 0 <= p - frac < Fraction(1, 2**16)
    assert (p == frac) == exact


def test_random_bits_argument_errors():
    # Words of the right dtype and shapes, as NumPy: their values do not matter here, and
    # lowprec.random_bits called eagerly compiles each of its primitives per shape.
    x = jnp.ones((4,))
    key = jax.random.key(0)
    w = np.arange(4, dtype=np.uint16)
    with pytest.raises(ValueError, match="not both"):
        lowprec.encode(x, "e4m3", rounding="stochastic", key=key, random_bits=w)
    with pytest.raises(ValueError, match="random_bits is only used by rounding='stochastic'"):
        lowprec.encode(x, "e4m3", random_bits=w)
    with pytest.raises(TypeError, match="uint16 or uint32"):
        lowprec.encode(x, "e4m3", rounding="stochastic", random_bits=w.astype(np.int32))
    with pytest.raises(ValueError, match=r"shape \(3,\)"):
        lowprec.quantize(x, "e4m3", rounding="stochastic", random_bits=w[:3])
    with pytest.raises(ValueError, match="padded shape"):
        lowprec.quantize_mx(jnp.ones(40), "mxfp8", pad=True, rounding="stochastic",
                            random_bits=np.arange(40, dtype=np.uint16))
    lowprec.quantize_mx(jnp.ones(40), "mxfp8", pad=True, rounding="stochastic",
                        random_bits=np.arange(64, dtype=np.uint16))


# -- matmul operand layouts ------------------------------------------------------------------


def _bound_check(out, a64, b64):
    exact = a64 @ b64
    bound = a64.shape[-1] * 2.0**-23 * (np.abs(a64) @ np.abs(b64)) + 1e-30
    assert np.all(np.abs(np.asarray(out, np.float64) - exact) <= bound)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["mxfp8_e4m3", "mxfp4"])
def test_kn_weight_layout_equals_k_major(fmt):
    """w [K, N] blocked along axis 0 (used without a transpose) and w.T [N, K] blocked along
    axis 1 hold the same codes and give the same product within the accumulation bound."""
    rng = np.random.default_rng(8)
    x = rng.standard_normal((5, 96)).astype(np.float32)
    w = rng.standard_normal((96, 7)).astype(np.float32)
    wq = lowprec.quantize_mx(w, fmt, axis=0)
    wtq = lowprec.quantize_mx(w.T, fmt, axis=1)
    nt = (((1,), (1,)), ((), ()))
    a = jax.jit(lambda u, v: lowprec.matmul(u, v, lhs_format=fmt))(x, wq)
    b = jax.jit(lambda u, v: lowprec.dot_general(u, v, nt, lhs_format=fmt))(x, wtq)
    c = jax.jit(lambda u, v: lowprec.matmul(u, v, lhs_format=fmt, rhs_format=fmt))(x, w)
    a64 = np.asarray(lowprec.dequantize(lowprec.quantize_mx(x, fmt, axis=1)), np.float64)
    b64 = np.asarray(lowprec.dequantize(wq), np.float64)
    for out in (a, b, c):
        _bound_check(out, a64, b64)


@pytest.mark.slow
@pytest.mark.parametrize("backward", ["ste", "quantized"])
def test_contracting_leading_axes_forward_and_gradients(backward):
    """lhs [K, M] and rhs [K, N] both contracted over axis 0 (neither transposed), against
    the same product written with transposed operands."""
    rng = np.random.default_rng(12)
    a = rng.standard_normal((64, 3)).astype(np.float32)
    b = rng.standard_normal((64, 4)).astype(np.float32)
    kw = dict(lhs_format="mxfp8", rhs_format="mxfp8", backward=backward)
    if backward == "quantized":
        kw.update(grad_format="mxfp8_e5m2", pad=True)  # backward blocks run along M and N

    def lead(u, v):
        return lowprec.dot_general(u, v, (((0,), (0,)), ((), ())), **kw)

    def last(u, v):
        return lowprec.dot_general(u.T, v.T, (((1,), (1,)), ((), ())), **kw)

    g = rng.standard_normal((3, 4)).astype(np.float32)
    outs, grads = [], []
    for f in (lead, last):
        y, vjp = jax.vjp(jax.jit(f), jnp.asarray(a), jnp.asarray(b))
        outs.append(np.asarray(y, np.float64))
        grads.append([np.asarray(t, np.float64) for t in vjp(jnp.asarray(g))])
    a64 = np.asarray(lowprec.dequantize(lowprec.quantize_mx(a, "mxfp8", axis=0)), np.float64)
    b64 = np.asarray(lowprec.dequantize(lowprec.quantize_mx(b, "mxfp8", axis=0)), np.float64)
    _bound_check(outs[0], a64.T, b64)
    _bound_check(outs[1], a64.T, b64)
    # The two layouts quantize the same values along the same axes; their gradients differ
    # at most by float32 accumulation order (sums of 4 or 3 products here).
    if backward == "ste":  # exact: the float gradient at the quantized values
        _bound_check(grads[0][0], b64, g.T.astype(np.float64))  # d/da[k, m] = sum_n b[k, n] g[m, n]
        _bound_check(grads[0][1], a64, g.astype(np.float64))
    for ga, gb in zip(*grads):
        assert ga.shape == gb.shape
        assert np.max(np.abs(ga - gb)) <= 8 * 2.0**-23 * (np.abs(ga).max() + np.abs(gb).max())


# -- the block encoder's hardware-float path (CPU) at the edges of where it is taken ---------
# _mx_hwfloat.py: on CPU the block encoder divides by float arithmetic when a scheme proves the
# result is the exact path's bits for the whole array, and takes the exact path otherwise.
# Each case below builds an array right at one edge of that decision, with float32
# subnormals (which XLA:CPU flushes in arithmetic) in every block, and checks both the
# decision and the codes against the reference.

def _hwfloat_decision(x, fmt, rule=None, tensor_scale=None):
    """Whether the hardware-float path serves quantize_mx(x, fmt) along the last axis."""
    bits = jnp.asarray(np.asarray(x, np.float32).view(np.uint32))
    return bool(_hwfloat_decision_of_bits(bits, tensor_scale, fmt=fmt, rule=rule))


# Jitted: op by op, the decision dispatched ~60 primitives, each a compile of its own.
@functools.partial(jax.jit, static_argnames=("fmt", "rule"))
def _hwfloat_decision_of_bits(bits, tensor_scale, *, fmt, rule):
    from lowprec._mx_encode import block_amax
    from lowprec._options import MXCast

    cast = MXCast(fmt, scale_rule=rule)
    amax = block_amax(bits, 1, cast.fmt.block_size)
    ts = cast.fmt.scheme.tensor_scale_bits(bits, tensor_scale, cast, amax)
    return cast.fmt.scheme.fast_encoder().scales(amax, ts, cast)[1]


def _blocks_with_subnormals(top_exponent: int, n_blocks: int = 4, block: int = 32):
    """float32 blocks whose largest magnitude is 2^top_exponent, holding float32 subnormals
    of both signs (the smallest, 2^-149, and larger ones), zeros and normals below the top."""
    rng = np.random.default_rng(top_exponent & 0xFFFF)
    x = rng.standard_normal((n_blocks, block)).astype(np.float32) * np.float32(2.0) ** (top_exponent - 3)
    sub = (rng.integers(1, 1 << 23, (n_blocks, 8), dtype=np.uint32)
           | (rng.integers(0, 2, (n_blocks, 8), dtype=np.uint32) << np.uint32(31)))
    x[:, 1:9] = sub.view(np.float32)
    x[:, 9] = np.float32(2.0 ** -149)
    x[:, 10] = -0.0
    x[:, 0] = np.float32(2.0) ** top_exponent
    return x


def _assert_quantize_mx_is_the_reference(x, fmt, rule=None, tensor_scale=None):
    kw = {} if rule is None else {"scale_rule": rule}
    if tensor_scale is None:
        want = R.quantize_mx(x, fmt, **kw)
    else:
        want = R.quantize_mx(x, fmt, tensor_scale=np.float32(tensor_scale))
    want_codes, want_scales = want[0], want[1]
    for tag, f in (("eager", lowprec.quantize_mx),
                   ("jit", jax.jit(lowprec.quantize_mx, static_argnames=("fmt", "scale_rule")))):
        extra = {} if tensor_scale is None else {"tensor_scale": jnp.float32(tensor_scale)}
        mx = f(jnp.asarray(x), fmt=fmt, **kw, **extra)
        assert_codes_equal(mx.scales, want_scales, x, f"{fmt} {rule} {tag} scales", axis=1,
                           per_block=True, block=lowprec.mx_format(fmt).block_size)
        assert_codes_equal(element_codes(mx), want_codes, x, f"{fmt} {rule} {tag} elements",
                           axis=1, block=lowprec.mx_format(fmt).block_size)


E8M0_NATIVE = [f for f in lowprec_formats.COLLECTIONS["e8m0_scaled_mx"]]


@pytest.mark.quick_cases(fmt=["mxfp8_e4m3", "mxfp4"])
@pytest.mark.parametrize("fmt", E8M0_NATIVE)
@pytest.mark.quick_first(1)
def test_hwfloat_block_path_edges_e8m0(fmt):
    """E8M0 schemes: the hardware-float multiply by 2^-s is taken down to the smallest shared
    exponent s_min = -126 - (emin - M - 1) (below it a flushed subnormal could have become
    a nonzero element) and up to s = 126 (2^-127 is itself subnormal). Derivation in
    _scheme_e8m0.py; s of a block with largest magnitude 2^k under "floor" is k - emax."""
    f = lowprec.mx_format(fmt)
    el = f.element
    s_min = -126 - (el.emin - el.mantissa_bits - 1)
    emax = R.shared_exponent(1.0, f.element.name, "floor")  # s of amax = 1 is -emax
    for s, hwfloat in ((s_min, True), (s_min - 1, False), (126, True)):
        top = s - emax
        if top > 127:
            continue  # no float32 block maximum gives this exponent for this element
        x = _blocks_with_subnormals(top)
        assert R.shared_exponent(float(np.abs(x).max()), f.element.name, "floor") == s
        if s == s_min - 1:  # one block past the edge sends the whole array the exact way
            x = np.concatenate([_blocks_with_subnormals(top + 1), x[:1]])
        assert _hwfloat_decision(x, fmt, "floor") == hwfloat, (fmt, s)
        _assert_quantize_mx_is_the_reference(x, fmt, "floor")


@pytest.mark.parametrize("tensor_scale,hwfloat", [
    (2.0 ** -118, True), (np.nextafter(np.float32(2.0 ** -118), np.float32(0)), False),
    (2.0 ** 116, True), (np.nextafter(np.float32(2.0 ** 116), np.float32(np.inf)), False),
    (1.0, True),
], ids=["ts_min", "below_ts_min", "ts_max", "above_ts_max", "one"])
@pytest.mark.quick_first(1)
def test_hwfloat_block_path_edges_nvfp4(tensor_scale, hwfloat):
    """NVFP4: float32 division serves tensor scales in [2^-118, 2^116] (_nvfp4.py derives
    the bounds); blocks sized so their E4M3 scales span the clamp at both ends, with float32
    subnormals in every block."""
    ts = float(np.float32(tensor_scale))
    # Block maxima from ts * 6 * 2^-12 (scale clamped up to 2^-9... the E4M3 smallest) to
    # ts * 6 * 2^9 (clamped down to 448), and float32's range at either end.
    tops = np.clip(np.round(np.log2(ts * 6)) + np.arange(-12, 10, 3), -140, 127).astype(int)
    x = np.concatenate([_blocks_with_subnormals(int(t), n_blocks=2, block=16).reshape(2, 16)
                        for t in tops]).reshape(-1, 32)
    assert _hwfloat_decision(x, "nvfp4", tensor_scale=jnp.float32(ts)) == hwfloat
    _assert_quantize_mx_is_the_reference(x, "nvfp4", tensor_scale=ts)


# What the hardware-float path compiles to on CPU: every quotient stays inside the element loop.
# XLA writes a division's results out first (a whole extra pass over memory) when the loop
# that consumes them reads each twice; _nvfp4.hwfloat_quotients hands them over through abs
# for that reason. A float32 array of the input's size among the fusions' outputs is that
# pass (the codes are bytes; the exact path's intermediates are integers).

_HLO_ARRAY = re.compile(r"\b(f32|u32|s32|u8|pred)\[([\d,]*)\]")


def _large_fusions(fn, shape, kinds, *args):
    """(name, dims, arithmetic operations of its fused computation, as
    benchmarks/gpu_hlo_report.py counts them) of the fusions of ``jax.jit(fn)(x, *args)`` on
    CPU (x float32 of ``shape``) whose outputs include an array of an element type in
    ``kinds`` with at least half as many elements as x."""
    x = jnp.zeros(shape, jnp.float32)
    # XLA's formulation, which these tests read: with the kernels on, MX and NVFP4 quantize
    # on CPU is one native custom call (tests/test_native_*.py check its bits against it).
    with lowprec.kernels.policy("xla"):
        txt = jax.jit(fn).lower(x, *args).compile().as_text()
    sizes = gpu_hlo_report.fused_op_counts(txt)
    big = []
    for line in txt.splitlines():
        m = re.match(r"\s*(?:ROOT )?%(\S+) = (.*?) fusion\(.*calls=%([\w.-]+)", line)
        for kind, dims in (_HLO_ARRAY.findall(m.group(2)) if m else ()):
            n = int(np.prod([int(d) for d in dims.split(",") if d]))
            if kind in kinds and n >= x.size // 2:
                big.append((m.group(1), dims, sizes.get(m.group(3), 0)))
    return big


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU hardware-float path")
@pytest.mark.parametrize("fmt,kw", [
    ("nvfp4", {}), ("mxfp4_b16", {}), ("nvfp4", {"nvfp4_step": "reciprocal"}),
    ("nvfp4", {"axis": 0}), ("mxfp4", {}), ("mxfp8_e4m3", {}), ("mxfp6_e2m3", {"axis": 0}),
], ids=["nvfp4", "mxfp4_b16", "nvfp4_reciprocal", "nvfp4_axis0", "mxfp4", "mxfp8_e4m3",
        "mxfp6_axis0"])
@pytest.mark.quick_first(1)
def test_hwfloat_path_keeps_quotients_in_the_element_loop(fmt, kw):
    assert _large_fusions(lambda x: lowprec.quantize_mx(x, fmt, **kw), (256, 512), {"f32"}) == []


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU hardware-float path")
@pytest.mark.slow  # two compiled programs read; quick: test_hwfloat_path_keeps_quotients_... reads one
def test_constant_tensor_scale_compiles_the_same_element_loop():
    """A tensor scale known at compile time (a Python float) must not change the element
    loop: folding the hardware-float path's range check away once let XLA fuse the per-block scale
    computation (an E4M3 encode and decode) into the loop over elements, recomputing it for
    every element (~5x slower)."""
    shape = (256, 512)
    traced = _large_fusions(lambda x, t: lowprec.quantize_mx(x, "nvfp4", tensor_scale=t), shape,
                            {"u8"}, jnp.float32(0.5))
    folded = _large_fusions(lambda x: lowprec.quantize_mx(x, "nvfp4", tensor_scale=0.5), shape,
                            {"u8"})
    # The hardware-float branch's loop is the shortest one (the exact branch's is ~4x longer).
    assert traced and folded
    assert min(n for *_, n in folded) <= min(n for *_, n in traced), (folded, traced)
