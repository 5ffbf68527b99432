"""Quantized dot_general / matmul: accuracy bound, peers, gradients, errors.

The reference for every result is the float64 dot of the quantized operand values, which are
built independently of the matmul code path (``quantize_mx`` + ``dequantize`` along the
contraction axis, or ``quantize`` for element formats). The claim checked is docs/design.md §5:
products are exact and only float32 accumulation errs,
|result − exact| ≤ K·2^-23·Σ|a_i b_i| (+ one output rounding for bfloat16/float16 outputs).

Magnitudes are kept inside float32's normal range: XLA on CPU flushes subnormals.
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
import lowprec_formats
from lowprec import OPERAND_FORMAT_NAMES, BackwardMode, dot_general, matmul

MX = ("mxfp8_e4m3", "mxfp8_e5m2", "mxfp4")
ELEMENTS = ("e4m3", "e5m2", "bf16", "fp16", "tf32")
FORMATS = MX + ELEMENTS + (None,)
MODES = ("eager", "jit")
SHAPES = ((3, 64, 5), (1, 32, 1), (4, 96, 7))  # (M, K, N)
# One shape per format keeps compiles (the slow part on CPU) to one per (format, mode).
FORMAT_SHAPES = [(f, SHAPES[i % len(SHAPES)]) for i, f in enumerate(FORMATS)]
FEW = settings(max_examples=6, deadline=None, derandomize=True)
F32_U2 = 2.0**-23


# -- helpers ------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _jitted(**kwargs):
    return jax.jit(functools.partial(matmul, **kwargs))


def run_matmul(mode, a, b, **kwargs):
    if mode == "eager":
        return matmul(a, b, **kwargs)
    return _jitted(**kwargs)(a, b)


def qvalues(x, fmt, axis, **kw):
    """float64 values of x quantized as the matmul should (independent code path)."""
    if fmt is None:
        return np.asarray(x, np.float64)
    if isinstance(fmt, str) and fmt.lower() in lowprec_formats.ALIASES and (
        lowprec_formats.ALIASES[fmt.lower()] in lowprec_formats.MX_FORMATS
    ):
        mx = lowprec.quantize_mx(x, fmt, axis=axis, pad=True, **kw)
        return np.asarray(lowprec.dequantize(mx), np.float64)
    return np.asarray(lowprec.quantize(x, fmt, dtype=jnp.float32), np.float64)


def assert_within_bound(result, a64, b64, out_dtype=np.float32):
    """|result − a64 @ b64| ≤ K·2^-23·(|a64| @ |b64|), plus one rounding to ``out_dtype``."""
    exact = a64 @ b64
    mag = np.abs(a64) @ np.abs(b64)
    k = a64.shape[-1]
    bound = k * F32_U2 * mag + k * 2.0**-52 * mag  # float32 sums + float64 reference slack
    if out_dtype == jnp.bfloat16:
        bound = bound + 2.0**-8 * (np.abs(exact) + bound)
    elif out_dtype == np.float16:
        bound = bound + 2.0**-11 * (np.abs(exact) + bound) + 2.0**-25
    r = np.asarray(np.asarray(result, np.float32), np.float64)
    assert r.shape == exact.shape
    nan = np.isnan(exact)
    np.testing.assert_array_equal(np.isnan(r), nan)
    err = np.abs(r - exact)[~nan]
    assert np.all(err <= bound[~nan]), f"max excess {np.max(err - bound[~nan])}"


def random_operand(seed, shape, exp, zero_block=False):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32) * np.float32(2.0**exp)
    if zero_block and shape[-1] >= 32:
        x[..., :32] = 0.0  # an all-zero MX block (scale code 0)
    return jnp.asarray(x)


# -- accuracy bound -----------------------------------------------------------------------------


@pytest.mark.quick_cases(mode=["jit"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fmt,shape", FORMAT_SHAPES, ids=[str(f) for f in FORMATS])
@FEW
@given(
    seed=st.integers(0, 2**31),
    ea=st.integers(-20, 20),
    eb=st.integers(-20, 20),
    zero_block=st.booleans(),
)
@pytest.mark.quick_first(1)
def test_float_operands_within_float32_accumulation_bound(mode, fmt, seed, shape, ea, eb, zero_block):
    if fmt in ELEMENTS:  # no scaling: stay inside the element range
        ea, eb = ea % 7 - 3, eb % 7 - 3
    m, k, n = shape
    a = random_operand(seed, (m, k), ea, zero_block)
    b = random_operand(seed + 1, (k, n), eb)
    out = run_matmul(mode, a, b, lhs_format=fmt, rhs_format=fmt)
    assert out.dtype == jnp.float32 and out.shape == (m, n)
    assert_within_bound(out, qvalues(a, fmt, 1), qvalues(b, fmt, 0))


@pytest.mark.quick_cases(mode=["jit"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fmt,shape", FORMAT_SHAPES[:3], ids=MX)
@FEW
@given(seed=st.integers(0, 2**31), spread=st.integers(0, 40))
@pytest.mark.quick_first(1)
def test_prequantized_random_codes_within_bound(mode, fmt, seed, shape, spread):
    """Arbitrary element and scale codes (NaN scale 0xFF excluded), not only quantize_mx's."""
    m, k, n = shape
    rng = np.random.default_rng(seed)
    f = lowprec.mx_format(fmt)
    nan_codes = {0x7F, 0xFF} if f.element.name == "e4m3" else set()
    if f.element.name == "e5m2":
        nan_codes = set(range(0x7C, 0x80)) | set(range(0xFC, 0x100))  # inf/NaN codes

    def operand(rows, axis):
        codes = rng.integers(0, 256 if not f.packed else 16, size=(rows, k), dtype=np.uint8)
        for c in nan_codes:
            codes[codes == c] = 0x01
        scales = rng.integers(127 - spread, 128 + spread, size=(rows, k // 32), dtype=np.uint8)
        if f.packed:
            codes = np.asarray(lowprec.pack_fp4(jnp.asarray(codes)))
        mx = lowprec.MXArray(jnp.asarray(codes), jnp.asarray(scales), f, 1, (rows, k), None)
        if axis == 0:  # the rhs [K, N]: blocks along axis 0
            mx = lowprec.MXArray(mx.elements.T, mx.scales.T, f, 0, (k, rows), None)
        return mx

    a, b = operand(m, 1), operand(n, 0)
    out = run_matmul(mode, a, b)
    a64 = np.asarray(lowprec.dequantize(a), np.float64)
    b64 = np.asarray(lowprec.dequantize(b), np.float64)
    assert_within_bound(out, a64, b64)


@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("fmt", ["mxfp8_e4m3", "mxfp4", "bf16"])
@pytest.mark.slow  # left out of the quick tier (seconds; its paths run in other quick tests)
def test_narrow_output_adds_one_rounding(fmt, out_dtype):
    a = random_operand(0, (5, 64), 0)
    b = random_operand(1, (64, 6), 0)
    out = matmul(a, b, lhs_format=fmt, rhs_format=fmt, preferred_element_type=out_dtype)
    assert out.dtype == out_dtype
    assert_within_bound(out, qvalues(a, fmt, 1), qvalues(b, fmt, 0), out_dtype)
    # Accumulation is float32 throughout: the narrow output is the float32 result rounded once.
    wide = matmul(a, b, lhs_format=fmt, rhs_format=fmt)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(wide.astype(out_dtype)))


@pytest.mark.parametrize("in_dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
@pytest.mark.slow  # left out of the quick tier (seconds; its paths run in other quick tests)
def test_narrow_inputs(in_dtype):
    a = random_operand(2, (4, 64), 1).astype(in_dtype)
    b = random_operand(3, (64, 3), -1).astype(in_dtype)
    for fmt in ("mxfp8_e4m3", None):
        out = matmul(a, b, lhs_format=fmt, rhs_format=fmt)
        a32, b32 = a.astype(jnp.float32), b.astype(jnp.float32)
        assert_within_bound(out, qvalues(a32, fmt, 1), qvalues(b32, fmt, 0))


@pytest.mark.slow  # left out of the quick tier (seconds; its paths run in other quick tests)
def test_mixed_formats_and_prequantized_weight():
    x = random_operand(4, (6, 64), 2)
    w = random_operand(5, (64, 8), -3)
    w_mx = lowprec.quantize_mx(w, "mxfp4", axis=0)
    for lhs_fmt in ("mxfp8_e4m3", "fp16", "bf16", None):
        out = matmul(x, w_mx, lhs_format=lhs_fmt)
        assert_within_bound(out, qvalues(x, lhs_fmt, 1), qvalues(w, "mxfp4", 0))
    # A pre-quantized operand equals quantizing the float operand in the call.
    np.testing.assert_array_equal(
        np.asarray(matmul(x, w_mx, lhs_format="mxfp8")),
        np.asarray(matmul(x, w, lhs_format="mxfp8", rhs_format="mxfp4")),
    )


@pytest.mark.slow  # left out of the quick tier (seconds; its paths run in other quick tests)
def test_dot_general_batch_and_several_contracting_dims():
    # lhs [B, K1, M, K2] x rhs [K2, B, N, K1]: several contracting dims flatten in the given order.
    lhs = random_operand(6, (2, 4, 3, 16), 0)
    rhs = random_operand(7, (16, 2, 5, 4), 0)
    dn = (((3, 1), (0, 3)), ((0,), (1,)))
    out = dot_general(lhs, rhs, dn, lhs_format="mxfp8", rhs_format="mxfp8")
    ref = jax.lax.dot_general(lhs, rhs, dn)
    assert out.shape == ref.shape == (2, 3, 5)
    l3 = jnp.transpose(lhs, (0, 2, 3, 1)).reshape(2, 3, 64)  # (B, M, K2*K1)
    r3 = jnp.transpose(rhs, (1, 2, 0, 3)).reshape(2, 5, 64)  # (B, N, K2*K1)
    for bi in range(2):
        a64, b64 = qvalues(l3[bi], "mxfp8", 1), qvalues(r3[bi], "mxfp8", 1)
        assert_within_bound(out[bi], a64, b64.T)


@pytest.mark.slow  # left out of the quick tier (seconds; its paths run in other quick tests)
def test_matmul_shapes():
    w = random_operand(8, (64, 4), 0)
    v = random_operand(9, (64,), 0)
    kw = dict(lhs_format="e4m3", rhs_format="mxfp8")  # e4m3: a quick compile, same layouts
    assert matmul(random_operand(1, (2, 3, 64), 0), w, **kw).shape == (2, 3, 4)
    assert matmul(random_operand(1, (64,), 0), w, **kw).shape == (4,)
    assert matmul(random_operand(1, (5, 64), 0), v, **kw).shape == (5,)
    batched = matmul(random_operand(1, (2, 5, 64), 0), random_operand(2, (2, 64, 3), 0), **kw)
    assert batched.shape == (2, 5, 3)


@pytest.mark.slow  # left out of the quick tier (seconds; its paths run in other quick tests)
def test_pad_zero_pads_the_contraction():
    a = random_operand(10, (3, 40), 0)
    b = random_operand(11, (40, 2), 0)
    out = matmul(a, b, lhs_format="mxfp8", rhs_format="mxfp4", pad=True)
    assert_within_bound(out, qvalues(a, "mxfp8", 1), qvalues(b, "mxfp4", 0))


def test_nan_block_propagates():
    a = np.ones((2, 64), np.float32)
    a[0, 3] = np.inf
    out = np.asarray(matmul(jnp.asarray(a), jnp.ones((64, 3)), lhs_format="mxfp8", rhs_format="mxfp8"))
    assert np.isnan(out[0]).all() and (out[1] == 64).all()


# -- the bfloat16 / float32 dispatch ------------------------------------------------------------


@pytest.mark.parametrize("fmt,threshold", [("mxfp8_e4m3", 10), ("mxfp8_e5m2", 17), ("mxfp4", 2)])
@pytest.mark.quick_first(1)
def test_bf16_path_decision(fmt, threshold):
    from lowprec._qdot import mx_bf16_exact as _mx_bf16_exact

    f = lowprec.mx_format(fmt)

    def mx(code, scale, zero_second_block=False):
        codes = np.full((1, 64), code, np.uint8)
        if zero_second_block:
            codes[0, 32:] = 0x0  # an all-zero block...
        scales = np.array([[scale, 0 if zero_second_block else scale]], np.uint8)  # ...scale 0
        el = lowprec.pack_fp4(jnp.asarray(codes)) if f.packed else jnp.asarray(codes)
        return lowprec.MXArray(el, jnp.asarray(scales), f, 1, (1, 64), None)

    # The smallest nonzero element (code 1, the smallest subnormal) times 2^(threshold-127)
    # is exactly 2^-126, bfloat16's smallest normal.
    values = np.asarray(lowprec.dequantize(mx(0x01, threshold)))
    assert (values == 2.0**-126).all()
    assert bool(_mx_bf16_exact(mx(0x01, threshold)))
    assert bool(_mx_bf16_exact(mx(0x01, threshold, zero_second_block=True)))  # zeros: any scale
    assert bool(_mx_bf16_exact(mx(0x00, 0)))  # all-zero operand
    assert not bool(_mx_bf16_exact(mx(0x01, threshold - 1)))  # 2^-127 could be exact, but...
    assert not bool(_mx_bf16_exact(mx(0x01, 1)))  # ...tiny scales with nonzero codes: float32
    assert bool(_mx_bf16_exact(mx(0x01, 255)))  # NaN blocks are fine (bfloat16 has NaN)
    # Sign bits are not magnitudes: a block of -0 codes counts as zeros.
    neg_zero = 0x88 if f.packed else 0x80
    el = jnp.full((1, 32 if f.packed else 64), neg_zero, jnp.uint8)
    assert bool(_mx_bf16_exact(lowprec.MXArray(el, jnp.zeros((1, 2), jnp.uint8), f, 1, (1, 64), None)))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.quick_cases(mode=["jit"])
def test_float32_branch_with_tiny_scales(mode):
    """Scale codes 0 and 1 put values below 2^-126: the float32 dot must be taken (and be right)."""
    from lowprec._qdot import mx_bf16_exact as _mx_bf16_exact

    f = lowprec.mx_format("mxfp8_e4m3")
    rng = np.random.default_rng(3)
    codes = rng.integers(0, 0x7F, size=(2, 64), dtype=np.uint8)  # no NaN code
    scales = np.array([[1, 130], [127, 0]], np.uint8)
    lhs = lowprec.MXArray(jnp.asarray(codes), jnp.asarray(scales), f, 1, (2, 64), None)
    assert not bool(_mx_bf16_exact(lhs))
    rhs = random_operand(4, (64, 3), 100)  # products land back in the normal range
    out = run_matmul(mode, lhs, rhs)
    a64 = np.asarray(lowprec.dequantize(lhs), np.float64)
    assert np.any((a64 != 0) & (np.abs(a64) < 2.0**-133))  # not bfloat16-representable
    if jax.default_backend() == "cpu":
        a64 = np.where(np.abs(a64) < 2.0**-126, 0.0, a64)  # XLA:CPU flushes subnormal inputs
    assert_within_bound(out, a64, np.asarray(rhs, np.float64))


def test_format_aliases_and_objects():
    a = random_operand(5, (2, 64), 0)
    b = random_operand(6, (64, 2), 0)
    ref = np.asarray(matmul(a, b, lhs_format="mxfp8_e4m3", rhs_format="e4m3"))
    for lf, rf in (("MXFP8", "fp8_e4m3fn"), (lowprec.mx_format("mxfp8"), lowprec.element_format("e4m3"))):
        np.testing.assert_array_equal(np.asarray(matmul(a, b, lhs_format=lf, rhs_format=rf)), ref)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() == "cpu", reason="XLA:CPU flushes float32 subnormals in dots")
def test_extreme_scales_use_float32_path():
    # lhs value 2^-135 is a float32 subnormal bfloat16 cannot hold; times 2^100 it is 2^-35.
    f = lowprec.mx_format("mxfp8_e4m3")
    lhs = lowprec.MXArray(jnp.full((1, 32), 0x01, jnp.uint8), jnp.ones((1, 1), jnp.uint8), f, 1, (1, 32), None)
    rhs = jnp.full((32, 1), 2.0**100, jnp.float32)
    assert float(matmul(lhs, rhs)[0, 0]) == 32 * 2.0**-35


# -- peers: JAX's MXFP8 path ---------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _jax_mxfp8_jitted():
    from jax._src.cudnn import scaled_matmul_stablehlo as sm

    cfg = jax.nn.get_scaled_dot_general_config("mxfp8")
    return sm, cfg, jax.jit(lambda x: sm.quantize(x, cfg))


def _jax_mxfp8():
    """JAX's own MXFP8 quantizer (private module), jitted, and its config."""
    try:
        return _jax_mxfp8_jitted()
    except (ImportError, AttributeError) as e:  # pragma: no cover - depends on the JAX version
        pytest.skip(f"JAX's MXFP8 quantizer is not available in jax {jax.__version__}: {e}")


def _jax_dequantize(sm, q, scales):
    # The documented formula: element * 2^(scale - 127), with e8m0_to_dtype's scale decoding.
    s = sm.e8m0_to_dtype(jax.lax.bitcast_convert_type(scales, jnp.uint8), jnp.float32)
    return np.asarray(q.astype(jnp.float32) * jnp.repeat(s, 32, axis=-1), np.float64)


DN3 = (((2,), (2,)), ((0,), (0,)))


@pytest.mark.parametrize("mode", MODES)
@settings(max_examples=5, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**31), ea=st.integers(-20, 20), eb=st.integers(-20, 20))
@pytest.mark.slow  # left out of the quick tier (seconds; its paths run in other quick tests)
def test_rceil_matches_jax_quantizer_and_dequantize_formula(mode, seed, ea, eb):
    sm, cfg, jax_quantize = _jax_mxfp8()
    a = random_operand(seed, (2, 4, 64), ea)
    b = random_operand(seed + 1, (2, 6, 64), eb)
    aq, asc = jax_quantize(a)
    bq, bsc = jax_quantize(b)
    kw = dict(lhs_format="mxfp8", rhs_format="mxfp8", scale_rule="rceil")
    f = functools.partial(dot_general, dimension_numbers=DN3, **kw)
    out = f(a, b) if mode == "eager" else jax.jit(f)(a, b)
    a64, b64 = _jax_dequantize(sm, aq, asc), _jax_dequantize(sm, bq, bsc)
    np.testing.assert_array_equal(a64, qvalues(a, "mxfp8", 2, scale_rule="rceil"))
    for bi in range(2):
        assert_within_bound(out[bi], a64[bi], b64[bi].T)


def test_matches_lax_scaled_dot():
    """jax.lax.scaled_dot decomposes to dequantize + bf16 dot and runs on CPU in jax 0.10."""
    sm, cfg, jax_quantize = _jax_mxfp8()
    if not hasattr(jax.lax, "scaled_dot"):
        pytest.skip(f"jax.lax.scaled_dot does not exist in jax {jax.__version__}")
    a = random_operand(20, (1, 8, 64), 3)
    b = random_operand(21, (1, 5, 64), -2)
    aq, asc = jax_quantize(a)
    bq, bsc = jax_quantize(b)
    theirs = jax.lax.scaled_dot(aq, bq, lhs_scale=asc, rhs_scale=bsc, dimension_numbers=DN3, preferred_element_type=jnp.float32)
    ours = dot_general(a, b, DN3, lhs_format="mxfp8", rhs_format="mxfp8", scale_rule="rceil")
    a64, b64 = _jax_dequantize(sm, aq, asc), _jax_dequantize(sm, bq, bsc)
    assert_within_bound(theirs[0], a64[0], b64[0].T)
    assert_within_bound(ours[0], a64[0], b64[0].T)


@pytest.mark.slow  # left out of the quick tier (seconds; its paths run in other quick tests)
def test_matches_jax_nn_scaled_dot_general():
    _, cfg, _ = _jax_mxfp8()
    a = random_operand(30, (1, 8, 64), 0)
    b = random_operand(31, (1, 4, 64), 0)
    try:
        theirs = jax.nn.scaled_dot_general(a, b, DN3, configs=[cfg, cfg, cfg])
    except NotImplementedError as e:
        pytest.skip(
            f"jax.nn.scaled_dot_general has no {jax.default_backend()} lowering in jax "
            f"{jax.__version__} ({str(e)[:90]}); compared via its quantizer and jax.lax.scaled_dot instead"
        )
    ours = dot_general(a, b, DN3, lhs_format="mxfp8", rhs_format="mxfp8", scale_rule="rceil")
    a64 = qvalues(a, "mxfp8", 2, scale_rule="rceil")
    b64 = qvalues(b, "mxfp8", 2, scale_rule="rceil")
    assert_within_bound(theirs[0], a64[0], b64[0].T)
    assert_within_bound(ours[0], a64[0], b64[0].T)


# -- gradients ----------------------------------------------------------------------------------


def _loss(x, w, c, **kw):
    return jnp.sum(c * matmul(x, w, **kw))  # d loss / d out = c


GRAD_CASES = [
    # (forward format, grad format)
    ("mxfp8_e4m3", "mxfp8_e5m2"),
    ("mxfp4", "mxfp8_e4m3"),
    ("e4m3", "e5m2"),
    ("bf16", None),
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fmt", ["mxfp8_e4m3", "mxfp4", "fp16", None], ids=str)
@pytest.mark.slow  # left out of the quick tier (seconds; its paths run in other quick tests)
def test_ste_gradient_is_float_gradient_at_quantized_values(mode, fmt):
    x = random_operand(40, (32, 64), 0)
    w = random_operand(41, (64, 32), -2)
    c = random_operand(42, (32, 32), 0)
    kw = dict(lhs_format=fmt, rhs_format=fmt)
    grad = jax.grad(functools.partial(_loss, c=c, **kw), argnums=(0, 1))
    gx, gw = grad(x, w) if mode == "eager" else jax.jit(grad)(x, w)
    qx, qw = qvalues(x, fmt, 1), qvalues(w, fmt, 0)
    c64 = np.asarray(c, np.float64)
    assert_within_bound(gx, c64, qw.T)
    assert_within_bound(gw, qx.T, c64)
    # ... which is jax.grad of the float dot of the fake-quantized operands.
    if fmt in MX:
        fq = lambda v, axis: lowprec.fake_quantize_mx(v, fmt, axis=axis)  # noqa: E731
    elif fmt is None:
        fq = lambda v, axis: v  # noqa: E731
    else:
        fq = lambda v, axis: lowprec.quantize(v, fmt)  # noqa: E731
    ref = jax.grad(
        lambda x, w: jnp.sum(c * jnp.dot(fq(x, 1), fq(w, 0), precision="highest")), argnums=(0, 1)
    )(x, w)
    assert_within_bound(ref[0], c64, qw.T)
    np.testing.assert_allclose(np.asarray(gx), np.asarray(ref[0]), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(gw), np.asarray(ref[1]), rtol=1e-5, atol=1e-5)


# Every case jitted; eagerly (jax.grad dispatching the backward op by op, a compile each)
# the first, whose MX operand and gradient formats take the blocked backward path that the
# others vary in formats only; the other eager cases run in the extended sweep.
_GRAD_MODE_CASES = [pytest.param(mode, fmt, gfmt, id=f"{mode}-{fmt}-{gfmt}",
                                 marks=[pytest.mark.extended] if mode == "eager" and i else [])
                    for mode in MODES for i, (fmt, gfmt) in enumerate(GRAD_CASES)]


@pytest.mark.quick_cases(mode=["jit"])
@pytest.mark.parametrize("mode, fmt, gfmt", _GRAD_MODE_CASES)
@pytest.mark.quick_first(1)
def test_quantized_backward_blocks_along_reduction_axes(mode, fmt, gfmt):
    # x [T, K] @ w [K, N]; grad_x = Q(g)·Q(w)ᵀ blocked along N, grad_w = Q(x)ᵀ·Q(g) along T.
    t, k, n = 64, 32, 96
    x = random_operand(50, (t, k), 1)
    w = random_operand(51, (k, n), -1)
    c = random_operand(52, (t, n), -4)
    kw = dict(lhs_format=fmt, rhs_format=fmt, backward="quantized", grad_format=gfmt)
    grad = jax.grad(functools.partial(_loss, c=c, **kw), argnums=(0, 1))
    gx, gw = grad(x, w) if mode == "eager" else jax.jit(grad)(x, w)
    assert gx.dtype == gw.dtype == jnp.float32
    assert_within_bound(gx, qvalues(c, gfmt, 1), qvalues(w, fmt, 1).T)
    assert_within_bound(gw, qvalues(x, fmt, 0).T, qvalues(c, gfmt, 0))


@pytest.mark.slow
def test_quantized_backward_with_prequantized_weight_and_padding():
    x = random_operand(60, (40, 64), 0)  # 40 tokens: grad_w would need pad (not asked here)
    w = random_operand(61, (64, 48), 0)  # 48 output features: grad_x blocks of 32 need pad
    w_mx = lowprec.quantize_mx(w, "mxfp4", axis=0)
    c = random_operand(62, (40, 48), 0)
    kw = dict(lhs_format="mxfp8", backward="quantized", grad_format="mxfp8_e5m2")
    jax.eval_shape(lambda x: _loss(x, w_mx, c, **kw), x)  # the forward dot needs no padding
    # ... its backward dots do: checked when the backward pass is traced (eval_shape: no compile).
    with pytest.raises(ValueError, match=r"backward grad_lhs \(reduces over rhs's free dims\), "
                                         r"cotangent: contraction length 48 .* pass pad=True"):
        jax.eval_shape(jax.grad(lambda x: _loss(x, w_mx, c, **kw)), x)
    gx = jax.grad(lambda x: _loss(x, w_mx, c, pad=True, **kw))(x)
    # The MXFP4 weight is dequantized, then re-quantized along N for the backward dot.
    w_back = qvalues(lowprec.dequantize(w_mx), "mxfp4", 1)
    assert_within_bound(gx, qvalues(c, "mxfp8_e5m2", 1), w_back.T)


@pytest.mark.slow
def test_gradients_under_vmap():
    w = random_operand(70, (64, 32), 0)
    xs = random_operand(71, (2, 32, 64), 0)
    c = random_operand(72, (32, 32), 0)
    kw = dict(lhs_format="mxfp8", rhs_format="mxfp8", backward="quantized", grad_format="mxfp8")
    g = jax.grad(functools.partial(_loss, c=c, **kw), argnums=(0, 1))
    gx_v, gw_v = jax.vmap(g, in_axes=(0, None))(xs, w)
    g = jax.jit(g)
    for i in range(2):
        gx, gw = g(xs[i], w)
        np.testing.assert_allclose(np.asarray(gx_v[i]), np.asarray(gx), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(np.asarray(gw_v[i]), np.asarray(gw), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
def test_gradient_dtypes_follow_inputs(dtype):
    x = random_operand(73, (4, 32), 0).astype(dtype)
    w = random_operand(74, (32, 8), 0).astype(dtype)
    # Dtypes are decided as the backward is traced (eval_shape: nothing compiled).
    gx, gw = jax.eval_shape(jax.grad(
        lambda x, w: matmul(x, w, lhs_format="e4m3", rhs_format="e4m3").sum(), (0, 1)), x, w)
    assert gx.dtype == gw.dtype == dtype


@pytest.mark.slow  # left out of the quick tier (seconds; its paths run in other quick tests)
def test_forward_under_vmap():
    w = random_operand(75, (64, 8), 0)
    xs = random_operand(76, (4, 3, 64), 0)
    f = functools.partial(matmul, lhs_format="mxfp4", rhs_format="mxfp8")
    out = jax.vmap(f, in_axes=(0, None))(xs, w)
    for i in range(4):
        assert_within_bound(out[i], qvalues(xs[i], "mxfp4", 1), qvalues(w, "mxfp8", 0))


# -- scale options: a scheme's knobs, taken as quantize_mx takes them ----------------------------

_MIDS = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 4, np.float32)  # E2M1 ties


def _rceil_values(x):
    """MXFP8 E4M3 values under scale rule "rceil", by the independent reference."""
    import lowprec_reference as R

    e, sc = R.quantize_mx(x, "mxfp8", scale_rule="rceil")
    return R.dequantize_mx(e, sc, "mxfp8")


def _nvfp4_reciprocal_values(x):
    """NVFP4 values with the "reciprocal" element step, restated from torchao 0.17 (its PR
    #4031) in NumPy float32 (blocks of 16 along the last axis, finite input): per tensor
    ts = amax / (448 * 6); per block s = E4M3(clip(amax_b / 6 / ts, 2^-6, 448)); each element
    E2M1(clip(x * float32(float32(1 / ts) / s), -6, 6)), nearest even; value = code * (ts * s).
    """
    f32 = np.float32
    xb = x.reshape(*x.shape[:-1], -1, 16).astype(f32)
    ts = f32(np.abs(x).max() / f32(448.0 * 6.0))
    s = np.clip(np.abs(xb).max(-1) / f32(6.0) / ts, f32(2.0**-6), f32(448.0))
    s = s.astype(ml_dtypes.float8_e4m3fn).astype(f32)
    codes = np.clip(xb * ((f32(1.0) / ts) / s)[..., None], f32(-6), f32(6))
    codes = codes.astype(ml_dtypes.float4_e2m1fn).astype(f32)
    return (codes * (ts * s)[..., None]).reshape(x.shape).astype(np.float64)


def _scale_option_cases():
    rng = np.random.default_rng(38)
    mx8 = (rng.standard_normal((2, 3, 32)) * np.exp2(rng.integers(-8, 8, (2, 3, 1)))).astype(
        np.float32)
    signs = np.where(rng.random((2, 3, 32)) < 0.5, -1, 1).astype(np.float32)
    ties = (np.broadcast_to(_MIDS, (2, 3, 32)) * signs * np.float32(1.3)).astype(np.float32)
    return [
        ("mxfp8", {"scale_rule": "rceil"}, mx8, _rceil_values),
        ("mxfp8", lowprec.mx_format("mxfp8").scheme.Options(scale_rule="rceil"), mx8,
         _rceil_values),
        ("nvfp4", {"nvfp4_step": "reciprocal"}, ties, _nvfp4_reciprocal_values),
    ]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", range(3), ids=["rceil_dict", "rceil_options", "nvfp4_recip"])
@pytest.mark.quick_cases(mode=["jit"])
def test_scale_options_reach_the_dot_quantizer(mode, case):
    """dot_general(..., scale_options=) quantizes its operands as the option says: against a
    one-hot rhs (every output one exact product, the other terms zero) the product of
    [batch, seq, d] activations is their quantized values, the reference's (rceil) or
    torchao 0.17's recipe restated (NVFP4's reciprocal step); the default differs on this
    input, so the option was applied."""
    fmt, options, x, want = _scale_option_cases()[case]
    eye = jnp.eye(32, dtype=jnp.float32)
    f = functools.partial(dot_general, dimension_numbers=(((2,), (0,)), ((), ())),
                          lhs_format=fmt, scale_options=options)
    out = f(x, eye) if mode == "eager" else jax.jit(f)(x, eye)
    np.testing.assert_array_equal(np.asarray(out, np.float64), want(x))
    default = dot_general(x, eye, (((2,), (0,)), ((), ())), lhs_format=fmt)
    assert not np.array_equal(np.asarray(default), np.asarray(out))


@pytest.mark.parametrize("case", range(2), ids=["rceil_dict", "rceil_options"])
def test_ragged_dot_takes_scale_options(case):
    """ragged_dot(..., scale_options=) quantizes its groups as the option says (as
    dot_general does, above): one-hot experts make each output row the row's quantized
    values, the reference's rceil ones; the default (floor) differs on this input. A knob
    the format does not take is refused with quantize_mx's message."""
    fmt, options, x, want = _scale_option_cases()[case]
    x2 = x.reshape(6, 32)
    experts = jnp.stack([jnp.eye(32, dtype=jnp.float32)] * 2)
    groups = jnp.array([4, 2], jnp.int32)
    out = lowprec.ragged_dot(x2, experts, groups, lhs_format=fmt, scale_options=options)
    np.testing.assert_array_equal(np.asarray(out, np.float64), want(x).reshape(6, 32))
    default = lowprec.ragged_dot(x2, experts, groups, lhs_format=fmt)
    assert not np.array_equal(np.asarray(default), np.asarray(out))
    with pytest.raises(ValueError, match="nvfp4_step applies to NVFP4"):
        lowprec.ragged_dot(x2, experts, groups, lhs_format=fmt,
                           scale_options={"nvfp4_step": "reciprocal"})


def test_scale_options_refused_as_quantize_mx_refuses_them():
    """A knob the operand format's scheme does not take is refused with quantize_mx's own
    message; so is scale_options on a dot that quantizes no operand to an MX format."""
    x, w = jnp.ones((2, 64)), jnp.ones((64, 3))
    for fmt, options in (("mxfp8", {"nvfp4_step": "reciprocal"}),
                         ("nvfp4", {"scale_rule": "rceil"}), ("mxfp4", {"no_such": 1})):
        with pytest.raises(ValueError) as quantizer:
            lowprec.quantize_mx(x, fmt, scale_options=options)
        with pytest.raises(ValueError) as dot:
            matmul(x, w, lhs_format=fmt, scale_options=options)
        assert str(dot.value) == str(quantizer.value) and "drop it" in str(dot.value)
    with pytest.raises(ValueError) as dot:  # the backward's cotangent format too
        matmul(x, w, grad_format="mxfp8", backward="quantized",
               scale_options={"nvfp4_step": "reciprocal"})
    assert "nvfp4_step applies to NVFP4" in str(dot.value)
    with pytest.raises(ValueError, match="no operand is quantized to an MX format"):
        matmul(x, w, lhs_format="e4m3", scale_options={"scale_rule": "rceil"})


# -- errors -------------------------------------------------------------------------------------

DN = (((1,), (0,)), ((), ()))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(lhs_format="mxfp5"), "valid formats: None, 'mxfp8_e4m3'"),
        (dict(rhs_format="e8m0"), "scale format"),
        (dict(scale_rule="nearest"), "valid rules"),
        (dict(rounding="stochastic"), "quantize_mx"),
        (dict(rounding="sideways"), "valid modes"),
        (dict(overflow="wrap"), "valid policies"),
        (dict(backward="fp8"), "valid modes: \\('ste', 'quantized'\\)"),
        (dict(grad_format="mxfp8"), "backward='quantized'"),
        (dict(grad_format="nope", backward="quantized"), "unknown grad_format"),
    ],
)
def test_bad_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        dot_general(jnp.ones((2, 32)), jnp.ones((32, 2)), DN, **kwargs)


def test_shape_and_layout_errors():
    a, b = jnp.ones((2, 64)), jnp.ones((64, 3))
    with pytest.raises(ValueError, match="not a multiple of the MX block size 32; pass pad=True"):
        matmul(jnp.ones((2, 40)), jnp.ones((40, 3)), lhs_format="mxfp8")
    with pytest.raises(ValueError, match="mismatched shapes: lhs contracting axis 1 has length 64"):
        matmul(a, jnp.ones((32, 3)))
    with pytest.raises(ValueError, match="mismatched shapes: lhs batch"):
        dot_general(jnp.ones((2, 4, 32)), jnp.ones((3, 32, 4)), (((2,), (1,)), ((0,), (0,))))
    with pytest.raises(ValueError, match="out of range"):
        dot_general(a, b, (((2,), (0,)), ((), ())))
    with pytest.raises(ValueError, match="dimension_numbers must be"):
        dot_general(a, b, ((1, 0), ()))
    w_mx = lowprec.quantize_mx(jnp.ones((64, 3)), "mxfp8", axis=0)
    with pytest.raises(ValueError, match="blocked along axis 1, which is not its contracting axis 0"):
        matmul(a, lowprec.quantize_mx(jnp.ones((64, 64)), "mxfp8", axis=1))
    with pytest.raises(ValueError, match="rhs_format='mxfp4' was given"):
        matmul(a, w_mx, rhs_format="mxfp4")
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        matmul(jnp.ones((2, 64), jnp.int32), b)
    with pytest.raises(TypeError, match="preferred_element_type"):
        matmul(a, b, preferred_element_type=jnp.int32)
    with pytest.raises(ValueError, match="Use dot_general"):
        matmul(jnp.ones((2, 3, 64)), jnp.ones((3, 64, 5, 1)))


def test_public_constants():
    assert tuple(BackwardMode) == ("ste", "quantized")
    assert set(MX) | set(ELEMENTS) <= set(OPERAND_FORMAT_NAMES)
    assert "e8m0" not in OPERAND_FORMAT_NAMES
