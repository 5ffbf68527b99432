"""The quantized products' GPU formulations (lowprec/_gpu_gemm.py), their math checked here.

On a CUDA GPU each low-precision product builds its operands for the GPU's low-precision
GEMMs: per-tensor FP8 products give cuBLASLt's FP8 GEMM lowprec's own codes read as float8,
with the scales folded in; block formats go to a bfloat16 GEMM, NVFP4's tensor scales to its
float32 output (docs/design.md §13, "GPU GEMMs"). Which GEMM XLA forms is checked on the
compile for an H100 (tests/test_gpu_compile.py); what the formulation computes is checked
here, on any backend: the ``gpu_routes_on_cpu`` fixture makes the products take their CUDA
branch, and XLA:CPU computes that program's math (conversions exact, products exact, sums
in float32), which must equal the exact product of the same codes within the float32
summation bound. Expected values come from lowprec_reference (its exact-rational encoder
and decoder, float64 products) and from the bounds derived beside each test.

What a GPU adds to that math, its FP8 accumulation, is stated in docs/design.md §13 and
held here by a model (:func:`hopper_fp8_sum`) against its documented bound; the device itself
is checked by the gpu-marked tests (run by scripts/gpu_check.sh on a machine with a GPU).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lowprec
import lowprec_reference as ref
from lowprec._gpu_gemm import FP8_DTYPES, block_bf16_exact, block_values_bf16, fp8_pair, fp8_values

from helpers.asserts import assert_bits_equal
from helpers.kernels import gpu_routes_on_cpu  # noqa: F401  (a fixture)

ON_GPU = jax.default_backend() == "gpu"
U = 2.0**-24  # float32's unit roundoff
DN = (((1,), (0,)), ((), ()))
FP8_PAIRS = [("e4m3", "e4m3"), ("e4m3", "e5m2"), ("e5m2", "e4m3")]
MODES = ["eager", "jit"]


def _run(mode, f, *args):
    return jax.jit(f)(*args) if mode == "jit" else f(*args)


def _data(shape, seed, spread=4):
    """Normal values times powers of two in [2^-spread, 2^spread] (several binades, no
    float32 subnormals anywhere in the products: XLA:CPU would flush them). Drawn by NumPy:
    jax.random run op by op compiles its programs anew for every shape (~0.75 CPU s each)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape) * np.exp2(rng.integers(-spread, spread, shape))
    return x.astype(np.float32)


def _ref_values(x, fmt, overflow="ieee"):
    """The reference's values of ``x`` rounded to ``fmt`` (float64, exact)."""
    return ref.decode(fmt, ref.encode(fmt, np.asarray(x, np.float32), "nearest_even", overflow))


def _matmul_last(a, b):
    """a [..., K] @ b [K, N] in float64."""
    return np.asarray(a, np.float64) @ np.asarray(b, np.float64)


def _assert_within(got, exact, size, k, extra=0.0):
    """|got - exact| <= (K·2^-23 + extra)·size: float32 sums of exact products, each sum of
    at most K terms off by at most K·2^-23 of the sum of magnitudes, plus ``extra`` (relative
    roundings of scales or outputs, derived at the call)."""
    got = np.asarray(got, np.float64)
    err = np.abs(got - exact)
    bound = (k * 2.0**-23 + extra) * size
    bad = err > bound
    assert not bad.any(), (f"{bad.sum()} of {bad.size} outside the bound; worst excess "
                           f"{(err - bound).max():.3g} (err {err[bad][:3]}, bound {bound[bad][:3]})")


def _jaxpr(f, *args) -> str:
    return str(jax.make_jaxpr(f)(*args))


def _dot_operand_dtypes(f, *args, primitive="dot_general") -> list:
    """(lhs, rhs) dtype names of every ``primitive`` (dot_general, ragged_dot_general) the
    traced ``f`` computes (nested jaxprs included): which GEMM the route feeds."""
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == primitive:
                found.append(tuple(str(v.aval.dtype) for v in eqn.invars[:2]))
            for p in eqn.params.values():
                for sub in (p if isinstance(p, (tuple, list)) else (p,)):
                    if hasattr(sub, "jaxpr"):
                        walk(sub.jaxpr if hasattr(sub.jaxpr, "eqns") else sub.jaxpr.jaxpr)
                    elif hasattr(sub, "eqns"):
                        walk(sub)

    walk(jax.make_jaxpr(f)(*args).jaxpr)
    return found


# -- FP8 operands: lowprec's codes, read as float8 ---------------------------------------------


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("mode", MODES)
def test_every_fp8_code_reads_as_the_reference_value(fmt, mode):
    """The FP8 GEMM's operand is the code itself (a bitcast to float8): every code reads as
    the reference decoder's value (NaN codes as NaN)."""
    codes = np.arange(256, dtype=np.uint8)
    want = ref.decode(fmt, codes)
    got = np.asarray(_run(mode, lambda c: fp8_values(c, lowprec.element_format(fmt)), codes))
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    assert_bits_equal(got[~nan], want[~nan].astype(np.float32))


def test_fp8_pairs_are_cublaslt_s():
    e4, e5, e2 = (lowprec.element_format(n) for n in ("e4m3", "e5m2", "e2m1"))
    assert fp8_pair(e4, e4) and fp8_pair(e4, e5) and fp8_pair(e5, e4)
    assert not fp8_pair(e5, e5)  # Hopper's FP8 MMA has no E5M2 x E5M2
    assert not fp8_pair(e4, e2) and not fp8_pair(e4, None)
    assert set(FP8_DTYPES) == {"e4m3", "e5m2"}


# -- per-tensor FP8 products through the route ------------------------------------------------


@pytest.mark.parametrize("lf,rf", FP8_PAIRS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", [(48, 64), (2, 24, 64)], ids=["2d", "3d"])
@pytest.mark.quick_cases(mode=("jit",), lf=("e4m3",))
def test_fp8_dot_general_route_is_the_exact_product_of_the_codes(lf, rf, mode, shape,
                                                                 gpu_routes_on_cpu):
    x, w = _data(shape, 0), _data((64, 40), 1)
    f = lambda a, b: lowprec.dot_general(a, b, (((a.ndim - 1,), (0,)), ((), ())),  # noqa: E731
                                         lhs_format=lf, rhs_format=rf)
    assert "f8_e4m3fn" in _jaxpr(f, x, w)  # the route was taken: codes read as float8
    assert _dot_operand_dtypes(f, x, w) == [("float32", "float32")]  # converted float8
    a, b = _ref_values(x, lf), _ref_values(w, rf)
    _assert_within(_run(mode, f, x, w), _matmul_last(a, b), _matmul_last(abs(a), abs(b)), 64)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.quick_first(1)
def test_fp8_quantized_backward_route(mode, gpu_routes_on_cpu):
    """dot_general(backward="quantized", grad_format="e5m2") of E4M3 operands: both backward
    products on the FP8 route too (E5M2 cotangent x E4M3 operand), each the exact product of
    the reference's codes (g and w along N for grad_x, x and g along tokens for grad_w: an
    element format has no blocks, so the codes are the forward's)."""
    x, w, g = _data((32, 64), 2), _data((64, 48), 3), _data((32, 48), 4)

    def grads(a, b, c):
        y, vjp = jax.vjp(lambda a, b: lowprec.dot_general(
            a, b, DN, lhs_format="e4m3", rhs_format="e4m3", backward="quantized",
            grad_format="e5m2"), a, b)
        return vjp(c)

    gx, gw = _run(mode, grads, x, w, g)
    a, b, c = _ref_values(x, "e4m3"), _ref_values(w, "e4m3"), _ref_values(g, "e5m2")
    _assert_within(gx, c @ b.T, abs(c) @ abs(b).T, 48)
    _assert_within(gw, a.T @ c, abs(a).T @ abs(c), 32)


def _hybrid_values(v, fmt):
    """FP8_HYBRID's quantized values: 2^e · fmt(v · 2^-e) with 2^e the smallest power of two
    at least amax / max_finite (the recipe's rceil rule; v·2^-e is exact), saturating."""
    v = np.asarray(v, np.float32)
    amax = float(np.abs(v).max())
    e = int(np.ceil(np.log2(amax / float(ref.max_finite(fmt)))))
    if amax / 2.0**(e - 1) <= float(ref.max_finite(fmt)):  # log2 rounded up past a power
        e -= 1
    return _ref_values(v * np.float32(2.0**-e), fmt, "saturate") * 2.0**e


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.quick_first(1)
def test_fp8_hybrid_recipe_route(mode, gpu_routes_on_cpu):
    """FP8_HYBRID (current per-tensor scaling, E4M3 forward, E5M2 cotangent): its three
    products on the FP8 route, each the exact product of the reference's scaled values (a
    power-of-two scale moves only the exponent, so products stay exact and the scaled
    output is one exact multiply)."""
    x, w, g = _data((2, 16, 64), 5), _data((64, 32), 6), _data((2, 16, 32), 7)
    recipe = lowprec.FP8_HYBRID

    def products(a, b, c):
        dn = (((2,), (0,)), ((), ()))
        y, vjp = jax.vjp(lambda a, b: recipe.dot_general(a, b, dn), a, b)
        return (y,) + vjp(c)

    y, gx, gw = _run(mode, products, x, w, g)
    a, b, c = _hybrid_values(x, "e4m3"), _hybrid_values(w, "e4m3"), _hybrid_values(g, "e5m2")
    _assert_within(y, a @ b, abs(a) @ abs(b), 64)
    _assert_within(gx, c @ b.T, abs(c) @ abs(b).T, 32)
    a2, c2 = a.reshape(32, 64), c.reshape(32, 32)
    _assert_within(gw, a2.T @ c2, abs(a2).T @ abs(c2), 32)


# -- block formats as bfloat16 ------------------------------------------------------------------


def _mx_values(x, fmt, axis, rule="floor"):
    """The reference's exact float64 values of ``x`` quantized to ``fmt`` along ``axis``."""
    e, s = ref.quantize_mx(x, fmt, axis=axis, scale_rule=rule)
    return ref.dequantize_mx(e, s, fmt, axis=axis)


def _nvfp4_parts(x, axis):
    """NVFP4 of ``x`` along ``axis`` by the reference: (element x block scale values, exact
    float64; the float32 tensor scale)."""
    e, s, ts = ref.quantize_nvfp4(x, axis=axis)
    block = np.repeat(ref.decode("e4m3", s), 16, axis=axis)
    return ref.decode("e2m1", e) * block, float(ts)


@pytest.mark.parametrize("lf,rf", [("mxfp8_e4m3", "mxfp8_e4m3"), ("mxfp8_e5m2", "mxfp8_e4m3"),
                                   ("mxfp6_e2m3", "mxfp6_e3m2"), ("mxfp4", "mxfp4"),
                                   ("mxint8", "mxint8"), ("mxfp8_e4m3", None)])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.quick_cases(mode=("jit",), lf=("mxfp8_e4m3", "mxfp4"))
def test_mx_route_is_branch_free_and_exact(lf, rf, mode, gpu_routes_on_cpu):
    """E8M0 block formats: each operand decoded to bfloat16 in one pass, no run-time check
    and no conditional (the portable route keeps a lax.cond on bfloat16's exactness), and
    the product the exact one of the reference's values within the float32 bound. A None
    format (a bfloat16 operand used as it is) joins the bfloat16 GEMM."""
    x, w = _data((2, 16, 64), 8), _data((64, 24), 9)
    wq = w if rf is not None else np.asarray(jnp.asarray(w, jnp.bfloat16).astype(jnp.float32))
    win = jnp.asarray(w, jnp.bfloat16) if rf is None else w
    f = lambda a, b: lowprec.dot_general(a, b, (((2,), (0,)), ((), ())),  # noqa: E731
                                         lhs_format=lf, rhs_format=rf)
    # One dot, of bfloat16 operands (the portable route has two: its branches').
    assert _dot_operand_dtypes(f, x, win) == [("bfloat16", "bfloat16")]
    a = _mx_values(x, lf, -1)
    b = _mx_values(wq, rf, 0) if rf is not None else np.asarray(wq, np.float64)
    _assert_within(_run(mode, f, x, win), a @ b, abs(a) @ abs(b), 64)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.quick_first(1)
def test_mx_ragged_route_is_branch_free_and_exact(mode, gpu_routes_on_cpu):
    """NVIDIA_MXFP8's ragged dot (per-group blocks): one bfloat16 ragged product, no
    conditional, each group's rows the exact product of the reference's MXFP8 values of its
    tokens and its expert's weight (both blocked along K) within the float32 bound."""
    x, w = _data((40, 64), 22), _data((3, 64, 24), 23)
    sizes = np.array([16, 0, 20], np.int32)  # an empty group, and 4 rows past the last one
    f = lambda a, b, g: lowprec.NVIDIA_MXFP8.ragged_dot(a, b, g)  # noqa: E731
    # One ragged product, of bfloat16 operands (the portable route has two: its branches').
    dots = _dot_operand_dtypes(f, x, w, sizes, primitive="ragged_dot_general")
    assert dots == [("bfloat16", "bfloat16")], dots
    got = np.asarray(_run(mode, f, x, w, sizes), np.float64)
    a = _mx_values(x, "mxfp8_e4m3", 1, "rceil")  # NVIDIA_MXFP8's scale rule
    start = 0
    for g, n in enumerate(sizes):
        b = _mx_values(w[g], "mxfp8_e4m3", 0, "rceil")
        rows = slice(start, start + n)
        _assert_within(got[rows], a[rows] @ b, abs(a[rows]) @ abs(b), 64)
        start += n
    assert not got[start:].any()  # rows past the last group


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.quick_first(1)
def test_nvfp4_route_applies_tensor_scales_to_the_output(mode, gpu_routes_on_cpu):
    """NVFP4: the bfloat16 GEMM of element x block-scale values (exact: <= 6 significant
    bits), its float32 output times each tensor scale: two roundings after the float32 sum,
    |y - exact| <= (K·2^-23 + 2·2^-24)·Σ|a b| with exact = Σ (e s ts)_a (e s ts)_b."""
    x, w = _data((48, 64), 10, spread=8), _data((64, 32), 11, spread=8)
    f = lambda a, b: lowprec.dot_general(a, b, DN, lhs_format="nvfp4",  # noqa: E731
                                         rhs_format="nvfp4")
    assert _dot_operand_dtypes(f, x, w) == [("bfloat16", "bfloat16")]  # portable: float32
    (a, ta), (b, tb) = _nvfp4_parts(x, 1), _nvfp4_parts(w, 0)
    exact = (a @ b) * ta * tb
    _assert_within(_run(mode, f, x, w), exact, (abs(a) @ abs(b)) * ta * tb, 64, 2 * U)


@pytest.mark.slow  # two NVFP4 recipe compiles; the dot_general NVFP4 route is quick
def test_nvfp4_training_recipe_route(request):
    """NVIDIA_NVFP4's three products (16 x 16 weight tiles, RHT, stochastic cotangents: the
    same codes on both routes) through the CUDA formulation against the portable one: each is
    within (K·2^-23 + 2·2^-24)·S (GPU: exact block products, float32 sum, two tensor-scale
    roundings) respectively (K·2^-23 + 4·2^-24)·S (portable: each value rounded once more)
    of the exact product, S = Σ|a b| of the dequantized operands, so within the sum of both."""
    from lowprec import _nvfp4_train as nt

    x, w, c = _data((64, 128), 19), _data((128, 96), 20), _data((64, 96), 21)
    recipe = lowprec.NVIDIA_NVFP4

    def products(a, b, g):
        y, vjp = jax.vjp(lambda a, b: recipe.dot_general(a, b, DN), a, b)
        return (y,) + vjp(g)

    portable = jax.jit(products)(x, w, c)
    request.getfixturevalue("gpu_routes_on_cpu")
    gpu = jax.jit(products)(x, w, c)
    # The operands each product multiplies (their float32 values, as the portable route's),
    # in one program (op by op they compiled ~380 small ones).
    @jax.jit
    def operands(x, w, c):
        wd, ww = nt.grad_words(c, recipe.seed)
        signs = nt.rht_signs(recipe.seed)
        return (nt.quantize_2d(w.T), nt.quantize_1d(x, 1), nt.quantize_1d(c, 1, wd),  # wq [N, K]
                nt.quantize_1d(nt.rht(x, signs), 0), nt.quantize_1d(nt.rht(c, signs), 0, ww))

    wq, xq, gq, xr, gr = operands(jnp.asarray(x), jnp.asarray(w), jnp.asarray(c))
    sizes = [np.abs(np.asarray(xq, np.float64)) @ np.abs(np.asarray(wq, np.float64)).T,
             np.abs(np.asarray(gq, np.float64)) @ np.abs(np.asarray(wq, np.float64)),
             np.abs(np.asarray(xr, np.float64)).T @ np.abs(np.asarray(gr, np.float64))]
    for got, want, size, k in zip(gpu, portable, sizes, (128, 96, 64)):
        _assert_within(got, np.asarray(want, np.float64), size, 2 * k, 6 * U)


def test_nvfp4_block_values_are_exact_bfloat16():
    """Every NVFP4 element x block-scale product (all 16 E2M1 codes x all 127 finite E4M3
    scale codes and the NaN code) is its exact value as a bfloat16, NaN for the NaN scale."""
    fmt = lowprec.mx_format("nvfp4")
    assert block_bf16_exact(fmt)
    codes = np.arange(16, dtype=np.uint8)
    packed = (codes[0::2] | (codes[1::2] << 4)).astype(np.uint8)  # low nibble first
    scales = np.arange(128, dtype=np.uint8)
    elements = np.tile(packed, (128, 1))
    mx = lowprec.MXArray(jnp.asarray(elements), jnp.asarray(scales[:, None]), fmt, 1, (128, 16),
                         tensor_scale=jnp.float32(1.0))
    values, ts = jax.jit(block_values_bf16)(mx)  # one program (op by op it compiled ~40)
    assert values.dtype == jnp.bfloat16 and float(ts) == 1.0
    want = ref.decode("e4m3", scales)[:, None] * ref.decode("e2m1", codes)[None, :]
    got = np.asarray(values.astype(jnp.float32), np.float64)
    nan = np.isnan(want)
    assert nan[127].all() and not nan[:127].any()
    assert np.isnan(got[nan]).all()
    assert np.array_equal(got[~nan], want[~nan])  # exact, signed zeros aside
    assert np.array_equal(np.signbit(got[~nan]), np.signbit(want[~nan]))


@pytest.mark.parametrize("fmt", ["mxfp8_e4m3", "mxfp8_e5m2", "mxfp6_e2m3", "mxfp4", "mxint8"])
@pytest.mark.quick_cases(fmt=("mxfp8_e4m3", "mxfp4"))
def test_e8m0_block_values_are_bfloat16_roundings(fmt):
    """E8M0 formats: block_values_bf16 is the exact value where bfloat16 holds it and its
    nearest-even bfloat16 otherwise (bits below bfloat16's subnormal step 2^-133, in FP8
    blocks of the smallest scales): every element code under every scale code."""
    f = lowprec.mx_format(fmt)
    assert block_bf16_exact(f)
    bits = f.element.code_bits
    codes = np.resize(np.arange(1 << bits, dtype=np.uint8), max(32, 1 << bits))
    e = np.tile(codes, (256, 1))  # [every scale, every code]
    s = np.repeat(np.arange(256, dtype=np.uint8)[:, None], e.shape[1] // 32, axis=1)
    packed = ref.pack_codes(e, bits, axis=1) if bits < 8 else e
    mx = lowprec.MXArray(jnp.asarray(packed.astype(np.uint8)), jnp.asarray(s), f, 1, e.shape)
    values, ts = jax.jit(block_values_bf16)(mx)  # one program (op by op it compiled ~45)
    assert ts is None
    want = ref.dequantize_mx(e, s, fmt, axis=1)
    # float64 -> float32 is exact (every MX value is a multiple of 2^-149) or overflows (at
    # the largest scales, as any float32 decode does); then ml_dtypes' nearest-even rounding
    # to bfloat16, subnormals included.
    with np.errstate(over="ignore"):
        want32 = want.astype(np.float32)
    ml = want32.astype(jnp.bfloat16)
    got = np.asarray(values)
    nan = np.isnan(want)
    assert np.isnan(got.astype(np.float32)[nan]).all()
    assert_bits_equal(got[~nan], ml[~nan])
    finite = np.isfinite(want32) & ~nan
    inexact = ml[finite].astype(np.float64) != want[finite]
    # Only FP8's smallest elements fall below bfloat16's step 2^-133: E4M3's 2^-9 at scales
    # below 2^-124 (codes < 3), E5M2's 2^-16 below 2^-117 (codes < 10).
    assert inexact.any() == (f.element.name in ("e4m3", "e5m2"))


# -- the FP8 accumulation of a GPU: the documented model and bound -----------------------------


def hopper_fp8_sum(products, chunk=128, bits=13):
    """The model of docs/design.md §13 for cuBLASLt's FP8 GEMM with fast accumulation off: the
    exact products summed in chunks of ``chunk`` terms by an accumulator that keeps ``bits``
    significant bits (each addition truncated toward zero, the worst rounding), each chunk's
    sum then added to a float32 total (round to nearest). ``products`` [..., K], float64."""
    p = np.asarray(products, np.float64)
    total = np.zeros(p.shape[:-1], np.float32)
    for start in range(0, p.shape[-1], chunk):
        acc = np.zeros(p.shape[:-1])
        for k in range(start, min(start + chunk, p.shape[-1])):
            acc = _truncate(acc + p[..., k], bits)
        total = (total + acc.astype(np.float32)).astype(np.float32)
    return total


def _truncate(v, bits):
    """v rounded toward zero to ``bits`` significant bits."""
    m, e = np.frexp(v)
    return np.ldexp(np.trunc(m * 2.0**bits), e - bits)


@pytest.mark.parametrize("lf,rf", FP8_PAIRS)
@pytest.mark.parametrize("k", [64, 512])
@pytest.mark.quick_cases(k=(512,))
def test_fp8_accumulation_model_is_within_the_documented_bound(lf, rf, k):
    """The model's sum of exact FP8 products, then the two scales (one rounding each), is
    within the bound docs/design.md §13 states for the GPU: |y - exact| <= (C·2^(1-p) +
    (K/C + 2)·2^-23 + 2·2^-24)·Σ|a b|·s_a·s_b for C = 128 products per promotion and p = 13
    bits, and the model is really coarser than float32 (so the bound is not idle)."""
    a = _ref_values(_data((16, k), 13), lf)
    b = _ref_values(_data((k, 8), 14), rf)
    sa, sb = np.float32(1 / 3), np.float32(448 / 5)  # scales as delayed scaling makes them
    prods = a[:, :, None] * b[None, :, :]  # exact in float64 (<= 8 significant bits each)
    prods = np.moveaxis(prods, 1, 2)  # [M, N, K]
    acc = hopper_fp8_sum(prods)
    y = ((acc * sa).astype(np.float32) * sb).astype(np.float32)
    exact = (a @ b) * np.float64(sa) * np.float64(sb)
    size = (abs(a) @ abs(b)) * np.float64(sa) * np.float64(sb)
    c = 128
    bound = (c * 2.0**(1 - 13) + (k / c + 2) * 2.0**-23 + 2 * U) * size
    assert np.all(np.abs(y - exact) <= bound)
    f32 = np.float32(a @ b)  # float32 accumulation alone is far tighter on these data
    assert np.max(np.abs(acc - f32) / (abs(a) @ abs(b))) > 2.0**-20


# -- on the device --------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU: cuBLASLt's FP8 GEMM")
@pytest.mark.parametrize("lf,rf", FP8_PAIRS)
def test_gpu_fp8_gemm_is_within_the_documented_bound(lf, rf):
    """On the device: dot_general of FP8 operands (cuBLASLt's FP8 GEMM, fast accumulation
    off) is within docs/design.md §13's bound of the exact product of the reference's codes,
    and delayed scaling's forward too (its scales folded into the GEMM)."""
    k = 4096
    x, w = _data((64, k), 15), _data((k, 48), 16)
    y = jax.jit(lambda a, b: lowprec.dot_general(a, b, DN, lhs_format=lf, rhs_format=rf))(x, w)
    a, b = _ref_values(x, lf), _ref_values(w, rf)
    c = 128
    extra = c * 2.0**(1 - 13) + (k / c + 2) * 2.0**-23 - k * 2.0**-23
    _assert_within(y, a @ b, abs(a) @ abs(b), k, extra)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU: the bfloat16 GEMM route")
@pytest.mark.parametrize("fmt", ["mxfp8_e4m3", "nvfp4"])
def test_gpu_block_formats_are_exact_products(fmt):
    """On the device: MXFP8 and NVFP4 products (bfloat16 GEMMs with float32 accumulation)
    are within the float32 bound of the exact product (NVFP4: two tensor-scale roundings)."""
    x, w = _data((64, 1024), 17), _data((1024, 48), 18)
    y = jax.jit(lambda a, b: lowprec.dot_general(a, b, DN, lhs_format=fmt, rhs_format=fmt))(x, w)
    if fmt == "nvfp4":
        (a, ta), (b, tb) = _nvfp4_parts(x, 1), _nvfp4_parts(w, 0)
        _assert_within(y, (a @ b) * ta * tb, (abs(a) @ abs(b)) * ta * tb, 1024, 2 * U)
    else:
        a, b = _mx_values(x, fmt, 1), _mx_values(w, fmt, 0)
        _assert_within(y, a @ b, abs(a) @ abs(b), 1024)
