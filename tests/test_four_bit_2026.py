"""The 2026 four-bit block formats that choose per block (docs/design.md §3c): Four over Six,
IF4, MixFP4.

Expected values come from the independent reference (``lowprec_reference.four_bit``: each
recipe restated in NumPy float32, one operation at a time), from the authors' own code run on
CPU (the literal fixtures below), and from hand derivations in the comments.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import lowprec
from lowprec_reference import four_bit as R4
from helpers.mx import MODES, element_codes, mx_inputs

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

FOUR_OVER_SIX = {"nvfp4_4over6": {}, "nvfp4_4over6_mse": {"error": "mse"},
                 "nvfp4_4over6_fp16": {"error_domain": "fp16"}}
SELECTING = (*FOUR_OVER_SIX, "if4", "mixfp4")


def reference(fmt, x2d):
    """(codes, scales, tensor scalar) of the reference for a float32 [rows, n] array."""
    if fmt in FOUR_OVER_SIX:
        return R4.quantize_4over6(x2d, **FOUR_OVER_SIX[fmt])
    return {"if4": R4.quantize_if4, "mixfp4": R4.quantize_mixfp4}[fmt](x2d)


def reference_values(fmt, codes, scales, ts):
    if fmt in FOUR_OVER_SIX:
        return R4.dequantize_4over6(codes, scales, ts)
    return {"if4": R4.dequantize_if4, "mixfp4": R4.dequantize_mixfp4}[fmt](codes, scales, ts)


@functools.lru_cache(maxsize=None)
def _jitted(fmt, axis, values):
    """quantize_mx, with ``values`` also the dequantize of its result, as one program (each
    compile of these exact float32 pipelines takes seconds: one of both costs ~1 s more than
    quantize alone, ~1.6 s less than the two apart)."""

    def run(x):
        mx = lowprec.quantize_mx(x, fmt, axis=axis)
        return mx, (lowprec.dequantize(mx) if values else None)

    return jax.jit(run)


def quantize(mode, x, fmt, axis=-1, values=True):
    """(MXArray, its dequantized values or None) of ``quantize_mx(x, fmt, axis=axis)``:
    eagerly (the values by an eager dequantize) or in one jitted program."""
    if mode == "eager":
        mx = lowprec.quantize_mx(jnp.asarray(x), fmt, axis=axis)
        return mx, (lowprec.dequantize(mx) if values else None)
    return _jitted(fmt, axis, values)(jnp.asarray(x))


def as_rows(a, axis):
    """``a`` with ``axis`` moved last and the rest flattened: the reference's [rows, n]."""
    a = np.moveaxis(np.asarray(a), axis, -1)
    return a.reshape(-1, a.shape[-1])


def assert_bits(got, want, what):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    same = (got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got) & np.isnan(want))
    assert same.all(), f"{what}: {np.count_nonzero(~same)} differ, e.g. {got[~same][:4]} vs {want[~same][:4]}"


# ============================================================================================
# lowprec against the reference, eager and jit, on 2-D and 3-D layouts with special values.
# Every test of this file uses the 2-D layout [4, 64] where it can, so that each format is
# compiled once per mode (an exact float32 pipeline on the bits compiles in ~5 s).

ROWS = ((4, 64), -1)
LAYOUT_CASES = [(f, *ROWS) for f in SELECTING] + [
    (f, (2, 32, 2), 1) for f in ("nvfp4_4over6", "if4", "mixfp4")]  # [batch, d, seq]


def modes_for(fmt, shape):
    """The modes a case runs: eager at [4, 64], jit in the 3-D layout, so that each scheme
    runs in both modes (and its block code at a last and a middle block axis) with one
    compile per mode: the eager programs (quantize_mx and dequantize, each jitted inside
    lowprec) are those of every other [4, 64] test in this file, and the jit program
    quantizes and dequantizes at once. The error variants of Four over Six
    (error="mse", error_domain="fp16") are options of the one scheme, traced the same way:
    eager at [4, 64]. Every pipeline compile saved is ~1.5 s."""
    del fmt  # every format alike
    return ("jit",) if shape != ROWS[0] else ("eager",)


# Quick tier: one selecting format here; if4 and mixfp4 run in the quick tier in their own
# tie tests (test_if4_e2m1_ties_go_to_the_even_code, test_mixfp4_grids_flag_and_ties).
# MODES: every case runs one of them (modes_for), and the two layouts each take one.
assert set(MODES) == {"eager", "jit"}


@pytest.mark.quick_cases(shape=[(4, 64)], fmt=["nvfp4_4over6"])
@pytest.mark.parametrize("fmt, shape, axis", LAYOUT_CASES, ids=str)
@settings(max_examples=6, deadline=None)
@given(data=st.data())
def test_selecting_formats_match_reference(fmt, shape, axis, data):
    x = data.draw(mx_inputs(shape, axis), label="x")
    want_codes, want_scales, want_ts = reference(fmt, as_rows(x, axis))
    values = reference_values(fmt, want_codes, want_scales, want_ts)
    for mode in modes_for(fmt, shape):
        mx, deq = quantize(mode, x, fmt, axis)
        tag = f"{fmt} {shape} axis {axis} {mode}"
        assert mx.fmt == lowprec.mx_format(fmt) and mx.shape == x.shape
        np.testing.assert_array_equal(as_rows(mx.scales, axis), want_scales, tag + " scales")
        np.testing.assert_array_equal(as_rows(element_codes(mx), axis), want_codes,
                                      tag + " codes")
        assert np.float32(mx.tensor_scale) == want_ts, tag
        assert_bits(as_rows(deq, axis), values, tag + " dequantize")


# One format in the quick tier (each compiles its exact pipeline for two more shapes, ~3 CPU s);
# the quick tier runs the other two against their authors' code below.
@pytest.mark.quick_cases(fmt=["if4"])
@pytest.mark.parametrize("fmt", SELECTING)
def test_selecting_formats_on_wide_and_tiny_data(fmt):
    """Log-normal spread over ~30 binades (subnormal E4M3 scales, blocks whose scale rounds
    to 0) and a tensor near float32's subnormal range (every float32 step subnormal)."""
    rng = np.random.default_rng(11)
    wide = (rng.standard_normal((4, 64)) * np.exp(rng.standard_normal((4, 64)) * 4))
    tiny = rng.standard_t(3, (4, 64)) * 1e-36
    for x in (wide.astype(np.float32), tiny.astype(np.float32)):
        codes, scales, ts = reference(fmt, x)
        mx = lowprec.quantize_mx(jnp.asarray(x), fmt)
        np.testing.assert_array_equal(np.asarray(mx.scales), scales)
        np.testing.assert_array_equal(element_codes(mx), codes)
        assert_bits(lowprec.dequantize(mx), reference_values(fmt, codes, scales, ts), fmt)


# ============================================================================================
# Against the authors' own code, run on CPU (PyTorch 2.13): TransformerEngine's
# NVFP4QuantizerRef._quantize_blockwise_reference with nvfp4_use_4over6=True (its MAE, MSE
# and fast-math error paths, E4M3 bound 256), the fouroversix reference quantizer's
# quantize(fp4_format=DataType.if4, scale_rule=ScaleRule.mse), and MixFP4's observer
# (llm-compressor PR #2657) and packer (compressed-tensors PR #687). Packed bytes (element
# 2k in the low nibble) and scale bytes, row-major, of the input built by _fixture_input.


def _fixture_input():
    rng = np.random.default_rng(2026)
    x = (rng.standard_normal((4, 64)) * np.exp(rng.standard_normal((4, 64)) * 1.5))
    x = x.astype(np.float32)
    x[3, :16] *= np.float32(1e-6)  # a block whose E4M3 scale underflows to 0
    x[3, 16:32] = 0.0
    x[3, 16:24] = -0.0
    x[3, 32:48] = [6, 4, 5, 3, 2.5, 1.75, 0.75, 0.25, -5, -3.5, -1.25, 1e-30, -1e-38, 7, 0.5, 1]
    return x


PEER_FIXTURES = {
    "nvfp4_4over6": (
        "7d0f8128890088f10888188812080f0800088800f01900a37100088808818889290a0999f2218980"
        "820090890891b8600aea8881070801a880187904a14905209899b10a70da9100082208cb88a0af04"
        "1080900008007899902001802782188077f77f777777777f000000000000000045352301cd096811"
        "00900a88088108f0", "53696b685362645a5e58745b00005978"),
    "nvfp4_4over6_mse": (
        "6c0e8118880088e10888188812080f0800088800f01900a37100088808818889290a0999f2218980"
        "820090890891b8600aea8881070801a880187904a14905209899b10a70da9100082208cb88a0af04"
        "1080900008007899902001802782188077f77f777777777f000000000000000045352301cd096811"
        "00900a88088108f0", "58696b685362645a5e58745b00005978"),
    "nvfp4_4over6_fp16": (
        "7d0f8128890088f10888188812080f0800088800f01900a37100088808818889290a0999f2218980"
        "820090890891b8600aea8881070801a880187904a14905209899b10a70da9100082208cb88a0af04"
        "1080900008007899902001802782188077f77f777777777f000000000000000045352301cd096811"
        "00900a88088108f0", "53696b685362645a5e58745b00005978"),
    "if4": (
        "7d090110000000a00888188812080f0800088800f00900a37100088808818889290a0999f2218980"
        "830090890892c8700fcf0000070001f080187904a14905209899b10a70da9100082208cb88a0af04"
        "108090000800789990200180278218800000000000000000000000000000000046352201db0f7010"
        "00900a88088108f0", "da70726f5964eb61645e7a620000db7e"),
    "mixfp4": (
        "7b0f0110000000f10888188812080f0800088800f00900a37100088808818889290a0999f2218980"
        "830090890892c87009c900000700019080187904a14905209899b10a70da9100082208cb88a0af04"
        "108090000800789990200180278218800000000000000000000000000000000046352301cd097011"
        "00900a88088108f0", "d870726f5964e961645e7a620000d97e"),
}


@pytest.mark.quick_cases(fmt=["nvfp4_4over6", "if4", "mixfp4"])  # the variants: one compile each
@pytest.mark.parametrize("fmt", sorted(PEER_FIXTURES))
def test_selecting_formats_match_their_authors_code(fmt):
    x = _fixture_input()
    want_elements, want_scales = PEER_FIXTURES[fmt]
    for mode in modes_for(fmt, ROWS[0]):
        mx, _ = quantize(mode, x, fmt, values=False)
        assert bytes(np.asarray(mx.elements).ravel()).hex() == want_elements, (fmt, mode)
        assert bytes(np.asarray(mx.scales).ravel()).hex() == want_scales, (fmt, mode)
    # The reference restates the same recipes: it agrees with the authors too.
    codes, scales, _ = reference(fmt, x)
    assert bytes(scales.ravel()).hex() == want_scales
    assert bytes((codes[:, 0::2] | codes[:, 1::2] << 4).ravel()).hex() == want_elements


# ============================================================================================
# Facts of the recipes, derived by hand.


def test_four_over_six_worked_block():
    """A block [4.6, 0.1 x 15] alone in its tensor (amax = 4.6, E = 256): global encode
    1536 / 4.6, base = 4.6 / 6 * 1536 / 4.6 ~ 256 (E4M3 0x78); map-to-4 scale 1.5 * 256 = 384
    (0x7C). Scaled to 6: 4.6 -> 6, 0.1 -> 0.13 -> 0; to 4: 4.6 -> 4, 0.1 -> 0.087 -> 0. Both
    reproduce 4.6 and lose the 0.1s: equal errors, and a tie keeps 6 (scale 0x78)."""
    x = np.zeros((4, 64), np.float32)  # the zero blocks change nothing but the shape
    x[0, :16] = [4.6] + [0.1] * 15
    mx = lowprec.quantize_mx(jnp.asarray(x), "nvfp4_4over6")
    assert np.asarray(mx.scales)[0, 0] == 0x78
    assert element_codes(mx)[0, :16].tolist() == [7] + [0] * 15
    # Block [5, 4, 3, 2] repeated (amax 5): scaled to 6 (factor 1.2) -> 6, 4.8 -> 4, 3.6 -> 4,
    # 2.4 -> 2, values q * 5/6 = 5, 3.33, 3.33, 1.67 (MAE 4/3 per four); scaled to 4 (0.8)
    # -> 4, 3.2 -> 3, 2.4 -> 2, 1.6 -> 1.5, values q * 5/4 = 5, 3.75, 2.5, 1.875 (MAE 7/8):
    # map-to-4 wins.
    y = np.zeros((4, 64), np.float32)
    y[0, :16] = [5.0, 4.0, 3.0, 2.0] * 4
    mx = lowprec.quantize_mx(jnp.asarray(y), "nvfp4_4over6")
    assert np.asarray(mx.scales)[0, 0] == 0x7C
    assert element_codes(mx)[0, :16].tolist() == [6, 5, 4, 3] * 4  # 4, 3, 2, 1.5
    np.testing.assert_allclose(np.asarray(lowprec.dequantize(mx))[0, :16],
                               [5, 3.75, 2.5, 1.875] * 4, rtol=1e-6)


def test_te_conventions_zero_scales_and_negative_zero():
    """TE's 4over6: a block whose scale underflows to 0 gets encode factor FLT_MAX, so its
    nonzero elements saturate to ±6 (codes 0x7 / 0xF) — values still 0; an exact -0.0 gets
    the +0 code, and a negative value that rounds to 0 keeps its sign (code 8)."""
    x = np.zeros((4, 64), np.float32)
    x[0, :3] = [1.0, -1e-3, -0.0]  # scale e4m3(1/6 * 1536) = 256: -1e-3 * 6 rounds to -0
    x[0, 16:19] = [3e-9, -3e-9, -0.0]  # base below 2^-10: the E4M3 scale rounds to 0
    mx = lowprec.quantize_mx(jnp.asarray(x), "nvfp4_4over6")
    assert np.asarray(mx.scales)[0, :2].tolist() == [0x78, 0]
    assert element_codes(mx)[0, :3].tolist() == [7, 8, 0]
    assert element_codes(mx)[0, 16:19].tolist() == [7, 15, 0]
    assert np.asarray(lowprec.dequantize(mx))[0, 16:19].tolist() == [0, 0, 0]
    codes = element_codes(lowprec.quantize_mx(jnp.asarray(x), "if4"))
    assert codes[0, 16:19].tolist() == [0, 0, 0]  # the authors zero q where s = 0


def test_if4_flag_grid_and_twos_complement_codes():
    """An evenly spaced block k * 6/7 (k = -7..7) lies on IF4's INT4 grid (k * 6/7 on the
    scale of maximum 6): INT4 is chosen (flag 0x80 on the scale e4m3((6 / 6) * 2688 / 6) =
    448 = 0x7E), and the nibbles are two's-complement k (-7 -> 0x9, -1 -> 0xF)."""
    k = np.arange(-7, 8, dtype=np.float32)
    x = np.zeros((4, 64), np.float32)
    x[0, :15] = k * np.float32(6 / 7)
    mx = lowprec.quantize_mx(jnp.asarray(x), "if4")
    assert int(mx.scales[0, 0]) == 0x7E | 0x80
    assert element_codes(mx)[0, :15].tolist() == [int(v) & 0xF for v in k]
    np.testing.assert_allclose(np.asarray(lowprec.dequantize(mx))[0, :16], x[0, :16], rtol=3e-7)


def test_if4_e2m1_ties_go_to_the_even_code():
    """IF4's FP4 branch rounds E2M1 ties to the even code (the authors' np.round/torch.round
    ties to even, on 2|q|, |q| or |q|/2). Block 0 holds 2688 alone, so amax = 2688 and encode
    = 2688 / amax = 1; every other block is 256 * [6, t, 0.5 x 14] with t a tie of E2M1 (or
    its negation): s = e4m3((1536 / 6) * 1) = 256 (0x78, a power of two) so q = x / 256 is
    exact and lands on the tie. Each such block picks FP4: its error is t's half step alone,
    where INT4 (grid k * 6/7) misses fourteen 0.5s by 0.5 - 3/7 each. The expected code of a
    tie between codes j and j + 1 is the even one, sign bit 8 for negative t (-0.25 gives
    -0, code 8, as the authors' sign(q) * 0 packs)."""
    ties = {0.25: 0, 0.75: 2, 1.25: 2, 1.75: 4, 2.5: 4, 3.5: 6, 5.0: 6}  # tie -> even code
    blocks, expected = [np.array([2688.0] + [0.0] * 15, np.float32)], []
    for sign in (1, -1):
        for t, code in ties.items():
            blocks.append(np.float32(sign * 256) * np.array([6.0, t] + [0.5] * 14, np.float32))
            expected.append(code | (8 if sign < 0 else 0))
    # A zero block last makes 16 blocks: the [4, 64] of this file's other if4 tests (their
    # program: quantize_mx is jitted inside lowprec), blocks in row-major order.
    x = np.concatenate(blocks + [np.zeros(16, np.float32)]).reshape(4, 64)
    mx = lowprec.quantize_mx(jnp.asarray(x), "if4")
    scales, codes = np.asarray(mx.scales).ravel(), element_codes(mx).reshape(-1, 16)
    assert scales[1:15].tolist() == [0x78] * 14, "every tie block should be FP4 with scale 256"
    assert scales[15] == 0 and not codes[15].any(), "the zero block: scale 0, codes 0"
    got = codes[1:15, 1].tolist()
    assert got == expected, dict(zip([f"{s}{t}" for s in "+-" for t in ties], got))
    ref_codes, ref_scales, _ = R4.quantize_if4(x)
    assert element_codes(mx).tolist() == ref_codes.tolist()
    assert np.asarray(mx.scales).tolist() == ref_scales.tolist()


def test_mixfp4_grids_flag_and_ties():
    """MixFP4's INT4 block has its own scale, the maximum mapped to 7: [-7..7] (amax 7,
    gs = 384) -> e4m3(384 * 7 / 7) = 384 (0x7C), flag set, sign-magnitude nibbles (-7 -> 0xF).
    Its E2M1 rounding is an argmin (ties to the smaller magnitude): 0.75 and 3.5 go down."""
    x = np.zeros((4, 64), np.float32)
    x[0, :15] = np.arange(-7, 8)
    mx = lowprec.quantize_mx(jnp.asarray(x), "mixfp4")
    assert float(mx.tensor_scale) == 384.0 and int(mx.scales[0, 0]) == 0x7C | 0x80
    assert element_codes(mx)[0, :16].tolist() == [15, 14, 13, 12, 11, 10, 9, 0, 1, 2, 3, 4, 5,
                                                  6, 7, 0]
    assert np.asarray(lowprec.dequantize(mx)).tolist() == x.tolist()
    # Ties: E2M1 points plus 0.75 and 3.5, under gs = 1 (tensor_scale=1): s_fp = e4m3(6 / 6)
    # = 1 (0x38) keeps the grid points exact, so FP4 wins (INT4's scale 6/7 -> 0.875 misses
    # them); the argmin sends 0.75 to 0.5 (code 1) and 3.5 to 3 (code 5), where IEEE
    # nearest-even would give 1.0 and 4.
    y = np.zeros((4, 64), np.float32)
    y[0, :16] = [6, 4, 3, 2, 1.5, 1, 0.5, 0, 0.75, 3.5, 6, 4, 3, 2, 1.5, 1]
    mx = lowprec.quantize_mx(jnp.asarray(y), "mixfp4", tensor_scale=1.0)
    assert int(mx.scales[0, 0]) == 0x38
    assert element_codes(mx)[0, :16].tolist() == [7, 6, 5, 4, 3, 2, 1, 0, 1, 5, 7, 6, 5, 4, 3, 2]


def _division_operands():
    """float32 patterns covering every exponent field (subnormals, normals, inf/NaN) with
    edge significands (0, 1, all ones) and random ones, both signs: 2 x 256 x 32."""
    rng = np.random.default_rng(37)
    mant = np.concatenate([[0, 1, 0x7F_FFFF, 0x40_0000],
                           rng.integers(0, 1 << 23, 28)]).astype(np.uint32)
    exp = np.arange(256, dtype=np.uint32) << 23
    mags = (exp[:, None] | mant[None, :]).ravel()
    return np.concatenate([mags, mags | np.uint32(1 << 31)])


@functools.lru_cache(maxsize=None)
def _divide_by_integers():
    """One program: (f32_div_by_integer, the long division f32_div) by each divisor."""
    from lowprec import _grid_select as G

    return jax.jit(lambda a: [(G.f32_div_by_integer(a, d), G.f32_div(a, G.const_bits(float(d))))
                              for d in DIVISORS])


DIVISORS = (6, 7, 1536, 2688)  # Four over Six's and IF4's and MixFP4's integer divisors


def test_division_by_an_integer_is_the_ieee_quotient():
    """The selecting formats divide by 6, 7, 6 * 256 and 6 * 448 with the cheap
    division by an integer constant (on CPU a float division where it is exact, integer
    steps for subnormal quotients): NumPy's float32 division (IEEE, nearest even, subnormals
    kept) and the long division give the same bits, signs, infinities and NaNs included."""
    a = _division_operands()
    for d, (fast, long_division) in zip(DIVISORS, _divide_by_integers()(jnp.asarray(a))):
        with np.errstate(all="ignore"):
            want = (a.view(np.float32) / np.float32(d)).view(np.uint32)
        fast, long_division = np.asarray(fast), np.asarray(long_division)
        for got, what in ((fast, "f32_div_by_integer"), (long_division, "f32_div")):
            nan = np.isnan(want.view(np.float32))
            assert np.isnan(got.view(np.float32))[nan].all(), f"{what} / {d}: NaN lost"
            bad = (got != want) & ~nan
            assert not bad.any(), (f"{what} / {d}: {np.count_nonzero(bad)} differ, e.g. "
                                   f"{a[bad][:3]} -> {got[bad][:3]} want {want[bad][:3]}")


# ============================================================================================
# API behaviour.


@pytest.mark.parametrize("fmt", SELECTING)
def test_selecting_formats_refuse_other_roundings_and_bad_tensor_scales(fmt):
    x = jnp.ones((32,), jnp.float32)
    with pytest.raises(ValueError, match=f"{fmt} elements round nearest_even"):
        lowprec.quantize_mx(x, fmt, rounding="stochastic", key=jax.random.key(0))
    with pytest.raises(ValueError, match="finite non-negative"):
        lowprec.quantize_mx(x, fmt, tensor_scale=-1.0)
    elements, scales = jnp.zeros((16,), jnp.uint8), jnp.full((2,), 0x38, jnp.uint8)
    with pytest.raises(ValueError, match="finite non-negative"):
        lowprec.MXArray(elements, scales, fmt, 0, (32,), tensor_scale=jnp.float32(np.inf))
    with pytest.raises(ValueError, match="needs its float32 tensor_scale"):
        lowprec.MXArray(elements, scales, fmt, 0, (32,))
    ok = lowprec.MXArray(elements, scales, fmt, 0, (32,), tensor_scale=jnp.float32(2.0))
    assert ok.fmt.scheme.tensor_scale and ok.fmt.bits_per_element == 4.5


@pytest.mark.slow  # ~3 compiles of the exact pipeline; the block functions of every scheme
# are in the quick tier (test_scale_schemes), the matmul's float32 path too (test_matmul)
def test_selecting_format_fake_quantize_and_matmul():
    """fake_quantize_mx gives the format's values (the reference's dequantized values, which
    dequantize(quantize_mx) gives in test_selecting_formats_match_reference) with a
    straight-through gradient; a dot with an operand quantized to the format equals the
    float64 dot of its values within the float32 accumulation bound (docs/design.md §5).
    IF4: the decode with the most steps."""
    fmt = "if4"
    rng = np.random.default_rng(5)
    a = rng.standard_normal((3, 4, 64)).astype(np.float32)  # [batch, seq, d]
    w = rng.standard_normal((64, 8)).astype(np.float32)
    deq = reference_values(fmt, *reference(fmt, as_rows(a, -1))).reshape(a.shape)
    # The values and the gradient of the sum (cotangent ones) from one vjp: its forward is
    # fake_quantize_mx's own program (jax.grad compiled a second one, ~6 s).
    fq, vjp = jax.vjp(lambda v: lowprec.fake_quantize_mx(v, fmt), jnp.asarray(a))
    assert_bits(fq, deq, "fake_quantize_mx")
    (g,) = vjp(jnp.ones_like(fq))
    np.testing.assert_array_equal(np.asarray(g), np.ones_like(a))
    got = np.asarray(lowprec.matmul(jnp.asarray(a), jnp.asarray(w), lhs_format=fmt), np.float64)
    want = deq.astype(np.float64) @ w.astype(np.float64)
    bound = 64 * 2.0**-23 * (np.abs(deq).astype(np.float64) @ np.abs(w).astype(np.float64))
    assert np.all(np.abs(got - want) <= bound + 1e-30)


@pytest.mark.slow  # a scheme of its own, so a compile of its own; e4m3_max is a constant of
# the same pipeline that the quick tier runs at 256
def test_four_over_six_parameters_are_checked():
    import dataclasses

    scheme = lowprec.mx_format("nvfp4_4over6").scheme
    with pytest.raises(ValueError, match="error='l1'"):
        dataclasses.replace(scheme, error="l1")
    with pytest.raises(ValueError, match="e4m3_max=300"):
        dataclasses.replace(scheme, e4m3_max=300)
    # The E4M3 bound 448 variant, built directly: its global encode scale is 2688 / amax.
    fmt448 = lowprec.MXFormat("nvfp4_4over6_448", lowprec.element_format("e2m1"), 16,
                              dataclasses.replace(scheme, e4m3_max=448))
    x = np.random.default_rng(9).standard_normal((4, 64)).astype(np.float32)
    mx = lowprec.quantize_mx(jnp.asarray(x), fmt448)  # another scheme: its own compile
    codes, scales, _ = R4.quantize_4over6(x, e4m3_max=448)
    np.testing.assert_array_equal(np.asarray(mx.scales), scales)
    np.testing.assert_array_equal(element_codes(mx), codes)
    assert_bits(lowprec.dequantize(mx), R4.dequantize_4over6(codes, scales, np.max(np.abs(x)),
                                                             e4m3_max=448), "448")


# ============================================================================================
# MX+ (docs/design.md §3c): block maxima with their exponent bits spent on the significand.

PLUS_CASES = [("mxfp4", (4, 64), -1), ("mxfp4", (2, 32, 2), 1), ("mxfp6_e2m3", (4, 64), -1),
              ("mxfp8_e4m3", (64, 4), 0), ("mxfp8_e5m2", (4, 64), -1)]


@functools.lru_cache(maxsize=None)
def _jitted_plus(fmt, axis):
    return jax.jit(lambda x: lowprec.quantize_mx_plus(x, fmt, axis=axis))


@pytest.mark.quick_cases(fmt=["mxfp4"])
@pytest.mark.parametrize("fmt, shape, axis", PLUS_CASES, ids=str)
@settings(max_examples=6, deadline=None)
@given(data=st.data())
def test_mx_plus_matches_reference(fmt, shape, axis, data):
    x = data.draw(mx_inputs(shape, axis), label="x")
    rows = as_rows(x, axis)
    codes, scales, index = R4.quantize_mx_plus(rows, fmt)
    values = R4.dequantize_mx_plus(codes, scales, index, fmt)
    for mode in MODES:
        a = (lowprec.quantize_mx_plus(jnp.asarray(x), fmt, axis=axis) if mode == "eager"
             else _jitted_plus(fmt, axis)(jnp.asarray(x)))
        assert isinstance(a, lowprec.MXPlusArray) and a.shape == x.shape
        mx = lowprec.MXArray(a.elements, a.scales, a.fmt, a.axis, a.shape)
        np.testing.assert_array_equal(as_rows(a.scales, axis), scales, f"{fmt} {mode}")
        np.testing.assert_array_equal(as_rows(a.bm_index, axis), index, f"{fmt} {mode}")
        np.testing.assert_array_equal(as_rows(element_codes(mx), axis), codes, f"{fmt} {mode}")
        assert_bits(as_rows(lowprec.dequantize_mx_plus(a), axis), values, f"{fmt} {mode}")


def test_mx_plus_worked_blocks():
    """MXFP4+ by hand (block 32, floor rule: shared_exp = floor(log2 amax) - 2):
    * [7, 1, ...]: shared_exp 0; the BM 7 = 1.75 * 2^2 -> m = 6 (0b110): code 0b0110, exact
      (MXFP4 clips it to 6);
    * [-7.9, 1, ...]: 7.9 / 4 = 1.975 rounds to 2 (the carry): saturates at m = 7, -7.5
      (code 0b1111);
    * [5.2, 5.2, ...]: two maxima, the first is the BM (index 0); 5.2 / 4 = 1.3 -> 1.25 (m = 2);
      the second is an ordinary E2M1 element: 5.2 -> 6 (the tie-free nearest);
    * all zeros: no BM (0xFF); a NaN: scale 0xFF, no BM."""
    x = np.zeros((4, 64), np.float32)
    x[0, :32] = [7.0] + [1.0] * 31
    x[1, :32] = [-7.9] + [1.0] * 31
    x[2, :2] = [5.2, 5.2]
    x[3, 32] = np.nan
    a = lowprec.quantize_mx_plus(jnp.asarray(x), "mxfp4")
    mx = lowprec.MXArray(a.elements, a.scales, a.fmt, a.axis, a.shape)
    codes = element_codes(mx)
    assert np.asarray(a.bm_index).tolist() == [[0, 0xFF], [0, 0xFF], [0, 0xFF], [0xFF, 0xFF]]
    assert codes[0, 0] == 0b0110 and codes[1, 0] == 0b1111 and codes[2, :2].tolist() == [2, 7]
    v = np.asarray(lowprec.dequantize_mx_plus(a))
    assert v[0, 0] == 7.0 and v[1, 0] == -7.5 and v[2, :2].tolist() == [5.0, 6.0]
    assert np.asarray(a.scales)[3, 1] == 0xFF and np.isnan(v[3, 32:]).all()
    assert not v[3, :32].any()


def test_mx_plus_never_worse_than_mx_and_changes_only_the_maximum():
    """The BM grid (1 + m/8) * 2^2 contains E2M1's top binade {4, 6}, so MX+'s block maximum
    is at least as close as MXFP4's, and every other element keeps its MXFP4 code."""
    rng = np.random.default_rng(8)
    x = (rng.standard_normal((4, 64)) * np.exp(rng.standard_normal((4, 64)))).astype(np.float32)
    a = lowprec.quantize_mx_plus(jnp.asarray(x), "mxfp4")
    mx = lowprec.quantize_mx(jnp.asarray(x), "mxfp4")
    plus_codes = element_codes(lowprec.MXArray(a.elements, a.scales, a.fmt, a.axis, a.shape))
    idx = np.asarray(a.bm_index).astype(int)
    at_bm = np.zeros(x.shape, bool)
    for r, b in zip(*np.nonzero(idx != 0xFF)):
        at_bm[r, b * 32 + idx[r, b]] = True
    np.testing.assert_array_equal(plus_codes[~at_bm], element_codes(mx)[~at_bm])
    err_plus = np.abs(np.asarray(lowprec.dequantize_mx_plus(a)) - x)[at_bm]
    err_mx = np.abs(np.asarray(lowprec.dequantize(mx)) - x)[at_bm]
    assert at_bm.sum() == 8 and (err_plus <= err_mx).all() and (err_plus < err_mx).any()


def test_mx_plus_refuses_what_it_cannot_extend():
    x = jnp.ones((32,), jnp.float32)
    for fmt in ("mxint8", "nvfp4", "if4"):
        with pytest.raises(ValueError, match="MX\\+ extends E8M0-scaled floating-point"):
            lowprec.quantize_mx_plus(x, fmt)
    a = lowprec.quantize_mx_plus(x, "mxfp4")
    with pytest.raises(ValueError, match="bm_index 40 is not a position in a block of 32"):
        lowprec.MXPlusArray(a.elements, a.scales, jnp.array([40], jnp.uint8), "mxfp4", 0, (32,))
    with pytest.raises(ValueError, match="bm_index must be uint8 with the scales' shape"):
        lowprec.MXPlusArray(a.elements, a.scales, jnp.zeros((2,), jnp.uint8), "mxfp4", 0, (32,))
    with pytest.raises(TypeError, match="takes an MXPlusArray"):
        lowprec.dequantize_mx_plus(lowprec.quantize_mx(x, "mxfp4"))


def test_mxfp4_at_block_16_is_blackwells_scale_vec_4x():
    """Blackwell's scale_vec::4X MXFP4: E2M1 elements, an E8M0 scale per 16 (4.5 bits per
    element) — lowprec's MXFP4 at block size 16, named "mxfp4_b16", equal to the exact
    reference at k = 16."""
    fmt = lowprec.mx_format("mxfp4_b16")
    assert (fmt.element.name, fmt.scale.name, fmt.block_size, fmt.bits_per_element) == (
        "e2m1", "e8m0", 16, 4.5)
    x = _fixture_input()
    mx = lowprec.quantize_mx(jnp.asarray(x), "mxfp4_b16")
    import lowprec_reference as R

    codes, scales = R.quantize_mx(x, "mxfp4", block_size=16)
    np.testing.assert_array_equal(np.asarray(mx.scales), scales)
    np.testing.assert_array_equal(element_codes(mx), codes)


@pytest.mark.slow  # ~7 CPU s of tracing every platform's branch; the quick tier runs these
# formats' CPU programs (above) and lowers NVFP4, whose division steps they share, for CUDA
# (test_gpu_compile.py)
def test_2026_formats_lower_for_cuda():
    """Every new path lowers for an NVIDIA GPU (no GPU needed: docs/design.md §8, §15): the
    exact float32 pipelines are integer arithmetic, and none reaches a CPU-only kernel."""
    from helpers.kernels import lower_for_cuda

    x = jnp.zeros((4, 64), jnp.float32)
    calls = {
        "nvfp4_4over6": lambda v: lowprec.fake_quantize_mx(v, "nvfp4_4over6"),
        "if4": lambda v: lowprec.dequantize(lowprec.quantize_mx(v, "if4")),
        "mixfp4": lambda v: lowprec.fake_quantize_mx(v, "mixfp4"),
        "mx+": lambda v: lowprec.dequantize_mx_plus(lowprec.quantize_mx_plus(v, "mxfp4")),
        "hif8": lambda v: lowprec.quantize(v, "hif8"),
    }
    for name, fn in calls.items():
        text = lower_for_cuda(fn, x)
        assert "func.func public @main" in text, name
        assert "@lowprec_" not in text, name  # the native CPU kernels: lowprec_mx_quantize, ...
