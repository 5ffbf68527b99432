"""The decode-time MXFP4 weight-only product: Pallas kernel, XLA route and dispatch.

On CPU the kernel runs in the Pallas interpreter, which pads out-of-range block reads
with NaN (floats) / the integer minimum — so a missing mask shows up as a wrong or NaN
result. The Triton lowering itself (power-of-two tiles, supported ops) is checked on CPU
too, by lowering for the "cuda" platform, which JAX does without a GPU. Tests marked
``gpu`` run the compiled kernel and need one.

Expected values never come from lowprec's decoder: weights are built from random codes
and decoded in the test with the gpt-oss / OCP table (docs/design.md §4),
FP4_VALUES[nibble] × 2^(scale − 127), in float64. The claim (docs/design.md §5): products
are exact, only float32 sums round, |y − exact| ≤ K·2^-23·Σ|w_i x_i|.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import lowprec
import lowprec.kernels
from helpers.kernels import cuda_branches, fused_mxdot  # noqa: F401  (fixtures)
from helpers.kernels import lower_for_cuda as _lower_for_cuda
from lowprec import _gemv
from lowprec.kernels import _dispatch
from lowprec.kernels._gemv_pallas import KernelConfig, default_config, mxfp4_matmul_pallas

from helpers import tiers
from helpers.asserts import assert_same_floats

pytest.importorskip("jax.experimental.pallas")

ON_GPU = jax.default_backend() == "gpu"
needs_gpu = pytest.mark.skipif(not ON_GPU, reason="needs a GPU (the compiled Triton kernel)")
# The spec's E2M1 table, low nibble = even element (docs/design.md §4).
FP4_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
)
DN = (((1,), (1,)), ((), ()))  # x [M, K] · W [N, K] over K
TRITON_CALL = "__gpu$xla.gpu.triton"


def _triton_lowering_available() -> bool:
    try:
        from jax._src.lib import triton  # noqa: F401  (the dialect bindings, in every jaxlib)
        from jax._src.pallas.triton import pallas_call_registration  # noqa: F401
    except ImportError:
        return False
    return True


needs_triton_lowering = pytest.mark.skipif(
    not _triton_lowering_available(), reason="this jaxlib cannot lower Pallas to Triton"
)


# -- operands built from codes, decoded independently ---------------------------------------------


@dataclasses.dataclass
class Weight:
    mx: lowprec.MXArray
    values: np.ndarray  # float64 [N, K]


def make_weight(rng, n, k, scale_lo=120, scale_hi=134, zero_blocks=0.0, nan_rows=()) -> Weight:
    """Random MXFP4 codes and scales for an [N, K] weight; padding nibbles past K are 0."""
    groups = -(-k // 32)
    nibbles = rng.integers(0, 16, size=(n, groups * 32), dtype=np.uint8)
    nibbles[:, k:] = 0
    scales = rng.integers(scale_lo, scale_hi + 1, size=(n, groups), dtype=np.uint8)
    zero = rng.random((n, groups)) < zero_blocks
    nib3 = nibbles.reshape(n, groups, 32)
    nib3[zero] = 0
    scales[zero] = 0  # what quantize_mx writes for an all-zero block
    for r in nan_rows:
        scales[r, groups // 2] = 0xFF
    packed = nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)
    values = FP4_VALUES[nibbles] * np.exp2(np.repeat(scales.astype(np.float64), 32, axis=1) - 127)
    values[np.repeat(scales == 0xFF, 32, axis=1)] = np.nan
    mx = lowprec.MXArray(jnp.asarray(packed), jnp.asarray(scales), "mxfp4", 1, (n, k))
    return Weight(mx, values[:, :k])


def make_tokens(rng, m, k, integers=False):
    if integers:
        x = rng.integers(-8, 9, size=(m, k)).astype(np.float32)
    else:
        x = rng.standard_normal((m, k)).astype(np.float32)
    return jnp.asarray(x.astype(ml_dtypes.bfloat16))  # rounded by ml_dtypes: nothing compiled


def f64(x) -> np.ndarray:
    """float64 values of a float32 / bfloat16 array, converted by NumPy (exact; an eager
    jnp conversion would compile a program per shape)."""
    return np.asarray(x).astype(np.float64)


def assert_within_bound(y, x64, w64, underflow=False):
    """|y − x64 @ w64.T| ≤ K·2^-23·(|x64| @ |w64|.T) (+ K·2^-149 when ``underflow``);
    NaN exactly where the exact product is NaN, the same infinity where it is infinite."""
    with np.errstate(invalid="ignore"):
        exact = x64 @ w64.T
        k = x64.shape[-1]
        bound = k * 2.0**-23 * (np.abs(x64) @ np.abs(w64).T) * (1 + 2.0**-20)
        if underflow:
            bound = bound + k * 2.0**-149
        y = np.asarray(y, np.float64)
        assert y.shape == exact.shape
        np.testing.assert_array_equal(np.isnan(y), np.isnan(exact))
        inf = np.isinf(exact)
        np.testing.assert_array_equal(y[inf], exact[inf])
        finite = np.isfinite(exact)
        err = np.abs(y - exact)[finite]
        assert np.all(err <= bound[finite]), f"max excess {np.max(err - bound[finite])}"


# Jitted: run eagerly, the reshape, kernel and split sum would each compile a program.
_pallas_jit = jax.jit(mxfp4_matmul_pallas, static_argnames=("k", "cfg", "interpret"))


def pallas(x, w: Weight, cfg=None, interpret=not ON_GPU):
    m, k = x.shape
    cfg = cfg or default_config(m, w.mx.shape[0], k)
    return _pallas_jit(x, w.mx.elements, w.mx.scales, k=k, cfg=cfg, interpret=interpret)


# -- the kernel (interpreted on CPU) -------------------------------------------------------------

# (M, N, K): M ∈ {1, 4, 16} and odd counts; gpt-oss K = 2880 = 90 blocks; K not a multiple
# of 32 (a padded MXArray); N not a multiple of any tile.
SHAPES = [
    (1, 20, 96), (1, 37, 2880), (4, 64, 2880), (16, 50, 2880), (3, 33, 100), (20, 17, 160),
    (1, 1, 32), (16, 130, 4096),
]


@pytest.mark.quick_cases(k=[32, 100])
@pytest.mark.parametrize("m,n,k", SHAPES, ids=[f"M{m}-N{n}-K{k}" for m, n, k in SHAPES])
def test_kernel_within_float32_sum_bound(m, n, k):
    rng = np.random.default_rng(m * 1000 + n + k)
    w = make_weight(rng, n, k, zero_blocks=0.1)
    x = make_tokens(rng, m, k)
    y = pallas(x, w)
    assert y.shape == (m, n) and y.dtype == jnp.float32
    assert_within_bound(y, f64(x), w.values)


CONFIGS = [
    KernelConfig(16, 1, 1, "fma", 1),  # one block per step, no split
    KernelConfig(16, 2, 3, "fma", 4),  # splits not dividing the steps: empty tail programs
    KernelConfig(32, 8, 2, "fma", 2),  # a step wider than K/32 on small K
    KernelConfig(16, 1, 4, "dot", 16),
    KernelConfig(64, 4, 5, "dot", 16),
]


@pytest.mark.quick_cases(cfg=CONFIGS[1::3], k=[224])
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c.inner}-n{c.block_n}-g{c.block_groups}-s{c.splits}-m{c.block_m}")
@pytest.mark.parametrize("m,n,k", [(3, 45, 2880), (5, 19, 224)])
@pytest.mark.quick_first(1)
def test_kernel_configs_mask_every_edge(cfg, m, n, k):
    rng = np.random.default_rng(k + cfg.splits)
    w = make_weight(rng, n, k)
    x = make_tokens(rng, m, k)
    assert_within_bound(pallas(x, w, cfg), f64(x), w.values)


@pytest.mark.quick_cases(inner=["dot"])
@pytest.mark.parametrize("inner", ["fma", "dot"])
def test_kernel_exact_sums_are_bit_identical_to_exact_and_generic(inner):
    """Integer tokens |x| ≤ 8 and scales 2^-2..2^2 make every product a multiple of 2^-3
    below 192, so every partial sum of K = 2880 terms (< 2^20) is exact in float32 in any
    order: kernel, generic dot_general and the float64 product must agree bit for bit."""
    rng = np.random.default_rng(7)
    m = 16 if inner == "dot" else 4
    w = make_weight(rng, 72, 2880, scale_lo=125, scale_hi=129, zero_blocks=0.05)
    x = make_tokens(rng, m, 2880, integers=True)
    cfg = dataclasses.replace(default_config(m, 72, 2880), inner=inner, block_m=16 if inner == "dot" else 4)
    got = np.asarray(pallas(x, w, cfg), np.float64)
    exact = f64(x) @ w.values.T
    np.testing.assert_array_equal(got, exact)
    np.testing.assert_array_equal(np.asarray(lowprec.dot_general(x, w.mx, DN), np.float64), exact)


def test_kernel_nan_scale_and_nonfinite_tokens_follow_the_generic_path():
    """A 0xFF scale makes its row NaN (whatever the tokens); inf tokens give ±inf or NaN
    exactly as the generic dot does (inf·0 = NaN)."""
    rng = np.random.default_rng(3)
    n, k = 24, 256
    w = make_weight(rng, n, k, nan_rows=(5, 17))
    x = np.asarray(make_tokens(rng, 4, k), np.float32)
    x[1, 40] = np.inf
    x[2, 100] = -np.inf
    x[3, :] = 0.0
    x = jnp.asarray(x, jnp.bfloat16)
    got = np.asarray(pallas(x, w))
    generic = np.asarray(lowprec.dot_general(x, w.mx, DN))
    np.testing.assert_array_equal(np.isnan(got), np.isnan(generic))
    assert np.isnan(got[:, [5, 17]]).all()
    inf = np.isinf(generic)
    assert inf.any()
    np.testing.assert_array_equal(got[inf], generic[inf])
    assert_within_bound(got, f64(x), w.values)


def test_kernel_config_validation():
    with pytest.raises(ValueError, match="block_n must be a power of two"):
        KernelConfig(24, 1, 1, "fma", 1)
    with pytest.raises(ValueError, match="splits must be a positive int"):
        KernelConfig(16, 1, 0, "fma", 1)
    with pytest.raises(ValueError, match="inner='dot' needs block_m == 16"):
        KernelConfig(16, 1, 1, "dot", 8)
    with pytest.raises(ValueError, match="inner must be one of"):
        KernelConfig(16, 1, 1, "wmma", 1)


@pytest.mark.parametrize("m,n,k", [(1, 2880, 2880), (4, 4096, 4096), (16, 8192, 8192), (16, 16384, 8192), (7, 100, 100)])
def test_default_config_is_a_valid_tiling(m, n, k):
    cfg = default_config(m, n, k)
    assert cfg.inner == ("fma" if m <= 4 else "dot")
    assert cfg.block_m >= min(m, 16) or cfg.inner == "dot"
    steps = -(-(-(-k // 32)) // cfg.block_groups)
    assert 1 <= cfg.splits <= steps  # every split owns at least one step


# -- the Triton lowering, checked without a GPU -------------------------------------------------


MODEL_SHAPES = [(m, n, k) for m in (1, 4, 16) for n, k in ((2880, 2880), (4096, 4096), (8192, 8192), (16384, 8192))]


@needs_triton_lowering
@pytest.mark.parametrize("m,n,k", MODEL_SHAPES + [(3, 33, 100), (20, 17, 160)])
@pytest.mark.quick_cases(m=[1, 3], n=[2880, 33])  # a model shape and a ragged one
def test_kernel_lowers_to_triton_for_every_shape(m, n, k, monkeypatch):
    """The Pallas → Triton lowering accepts the kernel (power-of-two tiles over any K;
    K = 2880 is 90 blocks) and the Triton module verifies. A block shape that is not a power
    of two, such as (8, 3, 16), fails here as it fails on a GPU."""
    from jax._src.pallas.triton import lowering

    verified = []
    real = lowering.lower_jaxpr_to_triton_module

    def checked(*a, **kw):
        result = real(*a, **kw)
        verified.append(result.module.operation.verify())
        return result

    monkeypatch.setattr(lowering, "lower_jaxpr_to_triton_module", checked)
    groups = -(-k // 32)
    specs = (
        jax.ShapeDtypeStruct((m, k), jnp.bfloat16),
        jax.ShapeDtypeStruct((n, groups * 16), jnp.uint8),
        jax.ShapeDtypeStruct((n, groups), jnp.uint8),
    )
    cfg = default_config(m, n, k)
    text = _lower_for_cuda(
        lambda x, e, s: mxfp4_matmul_pallas(x, e, s, k=k, cfg=cfg, interpret=False), *specs
    )
    assert text.count(TRITON_CALL) == 1
    assert verified == [True]


def _as_k_by_n(w):
    """The same weight as a [K, N] MXArray blocked along axis 0 (codes transposed)."""
    n, k = w.shape
    return lowprec.MXArray(w.elements.T, w.scales.T, w.fmt, 0, (k, n))


def _decode_case(m=4, n=64, k=2880, dtype=jnp.bfloat16, fmt="mxfp4"):
    """Shapes only (what a lowering needs): the weight's MXArray of abstract leaves from
    eval_shape, nothing compiled (the fixture clearing JAX's caches recompiled it per test)."""
    x = jax.ShapeDtypeStruct((m, k), dtype)
    w = jax.eval_shape(lambda v: lowprec.quantize_mx(v, fmt, axis=1),
                       jax.ShapeDtypeStruct((n, k), jnp.float32))
    return x, w


@needs_triton_lowering
@pytest.mark.parametrize(
    "call",
    [
        lambda x, w: lowprec.dot_general(x, w, DN),
        lambda x, w: lowprec.dot_general(x, w, DN, preferred_element_type=jnp.bfloat16),
        lambda x, w: lowprec.matmul(x, _as_k_by_n(w)),  # b [K, N] blocked along axis 0
        lambda x, w: lowprec.dot_general(w, x[0], (((1,), (0,)), ((), ()))),  # W x
        lambda x, w: jax.vmap(lambda t: lowprec.dot_general(t, w, DN))(x[:, None]),
    ],
    ids=["x.WT", "bf16-out", "matmul-KN", "W.x", "vmap"],
)
@pytest.mark.quick_first(1)
def test_dot_general_picks_the_kernel_for_decode_shapes_on_cuda(call, cuda_branches):
    x, w = _decode_case()
    assert TRITON_CALL in _lower_for_cuda(call, x, w)
    # The same program lowered for the CPU holds no kernel (the generic quantized dot).
    assert TRITON_CALL not in jax.jit(call).trace(x, w).lower(lowering_platforms=("cpu",)).as_text()


@needs_triton_lowering
@pytest.mark.parametrize(
    "case,kwargs",
    [
        (dict(m=17), {}),  # more tokens than MAX_TOKENS
        (dict(dtype=jnp.float32), {}),  # float32 activations
        (dict(fmt="mxfp8_e4m3"), {}),  # not MXFP4
        (dict(), dict(lhs_format="mxfp8_e4m3")),  # activations quantized too
    ],
    ids=["17-tokens", "f32-tokens", "mxfp8-weight", "quantized-tokens"],
)
@pytest.mark.quick_first(1)
def test_other_shapes_keep_the_generic_path_on_cuda(case, kwargs, cuda_branches):
    x, w = _decode_case(**case)
    text = _lower_for_cuda(lambda a, b: lowprec.dot_general(a, b, DN, **kwargs), x, w)
    assert TRITON_CALL not in text


@pytest.mark.skipif(ON_GPU, reason="on a GPU dot_general runs the kernel (other summation order)")
def test_dispatch_on_cpu_is_the_generic_path_itself():
    """On CPU dot_general of a decode shape is the generic quantized dot: the same values
    as with the route check switched off (bit for bit), and within the bound."""
    rng = np.random.default_rng(11)
    w = make_weight(rng, 40, 2880)
    x = make_tokens(rng, 4, 2880)
    from lowprec import _options, _qdot

    spec = _options.DotSpec.create(None, None, None, "floor", "nearest_even", "ieee", False, "ste", jnp.float32)
    spec = spec.with_mx_operand("rhs", w.mx.fmt)

    @jax.jit  # both calls in one program (run eagerly, each op compiled its own: 32 programs)
    def both(x, w):
        w3 = lowprec.MXArray(w.elements[None], w.scales[None], w.fmt, 2, (1, 40, 2880))
        return lowprec.dot_general(x, w, DN), _qdot._qdot_canonical(x[None], w3, spec.lhs, spec.rhs)[0]

    y, generic = both(x, w.mx)
    assert_within_bound(y, f64(x), w.values)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(generic))


# -- the XLA route ---------------------------------------------------------------------------------


def test_every_mxfp4_value_is_a_bfloat16_value():
    """The XLA route's premise: FP4_VALUES[c] × 2^(s − 127) is exactly a bfloat16 (bfloat16
    subnormals included) for every code and scale, or overflows both float32 and bfloat16."""
    v = FP4_VALUES[:, None] * np.exp2(np.arange(255, dtype=np.float64)[None, :] - 127)
    finite = np.abs(v) < 2.0**128  # float32's and bfloat16's shared limit
    as_bf16 = v[finite].astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)
    np.testing.assert_array_equal(as_bf16, v[finite])
    # |v| ≥ 2^128 only at scale 254 (v = 2, 3, 4, 6) and 253 (v = 4, 6), either sign.
    assert (~finite).sum() == 2 * (4 + 2)


@pytest.mark.parametrize("m,n,k", [(1, 37, 2880), (16, 50, 100)])
def test_xla_route_within_bound(m, n, k):
    rng = np.random.default_rng(n)
    w = make_weight(rng, n, k, zero_blocks=0.1, nan_rows=(3,))
    x = make_tokens(rng, m, k)
    y = jax.jit(_gemv.mxfp4_matmul, static_argnums=2)(x, w.mx, "xla")
    assert_within_bound(y, f64(x), w.values)


@pytest.mark.slow  # left out of the quick tier (seconds; its paths run in other quick tests)
def test_xla_route_exact_sums_bit_identical():
    rng = np.random.default_rng(5)
    w = make_weight(rng, 30, 2880, scale_lo=125, scale_hi=129)
    x = make_tokens(rng, 16, 2880, integers=True)
    # Jitted (op by op the route compiled ~45 programs).
    got = np.asarray(jax.jit(_gemv.mxfp4_matmul, static_argnums=2)(x, w.mx, "xla"), np.float64)
    np.testing.assert_array_equal(got, f64(x) @ w.values.T)


def test_unknown_route():
    rng = np.random.default_rng(0)
    w = make_weight(rng, 4, 32)
    with pytest.raises(ValueError, match="unknown route 'cublas'"):
        _gemv.mxfp4_matmul(make_tokens(rng, 1, 32), w.mx, "cublas")


# -- mxfp4_gemv, the explicit entry point -----------------------------------------------------------


@pytest.mark.parametrize("x_shape", [(96,), (3, 96), (2, 2, 96)])
@pytest.mark.quick_cases(x_shape=[(2, 2, 96)])
def test_mxfp4_gemv_shapes(x_shape):
    rng = np.random.default_rng(len(x_shape))
    w = make_weight(rng, 20, 96)
    x = jnp.asarray(rng.standard_normal(x_shape), jnp.bfloat16)
    y = lowprec.kernels.mxfp4_gemv(w.mx, x)
    assert y.shape == x_shape[:-1] + (20,) and y.dtype == jnp.float32
    assert_within_bound(np.asarray(y).reshape(-1, 20), f64(x).reshape(-1, 96), w.values)


def test_mxfp4_gemv_block_rows():
    rng = np.random.default_rng(1)
    w = make_weight(rng, 20, 96)
    x = make_tokens(rng, 1, 96)[0]
    assert_within_bound(lowprec.kernels.mxfp4_gemv(w.mx, x, block_rows=16)[None], f64(x)[None], w.values)
    with pytest.raises(ValueError, match="block_rows: KernelConfig.block_n must be a power of two"):
        lowprec.kernels.mxfp4_gemv(w.mx, x, block_rows=24)


def test_mxfp4_gemv_errors():
    w = lowprec.quantize_mx(jnp.ones((4, 64)), "mxfp4")
    with pytest.raises(TypeError, match=r"bfloat16 array of shape \(64,\) or \(\.\.\., 64\)"):
        lowprec.kernels.mxfp4_gemv(w, jnp.ones(64))
    with pytest.raises(TypeError, match=r"got bfloat16\[63\]"):
        lowprec.kernels.mxfp4_gemv(w, jnp.ones(63, jnp.bfloat16))
    with pytest.raises(ValueError, match=r"MXFP4 MXArray of shape \[N, K\] blocked along axis 1"):
        lowprec.kernels.mxfp4_gemv(lowprec.quantize_mx(jnp.ones((4, 64)), "mxfp8"), jnp.ones(64, jnp.bfloat16))
    with pytest.raises(ValueError, match="blocked along axis 1"):
        lowprec.kernels.mxfp4_gemv(lowprec.quantize_mx(jnp.ones((64, 4)), "mxfp4", axis=0), jnp.ones(64, jnp.bfloat16))


# -- on a GPU ---------------------------------------------------------------------------------------


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("m,n,k", [(1, 2880, 2880), (4, 4096, 4096), (16, 1000, 2880), (3, 33, 100)])
def test_gpu_compiled_kernel_within_bound_and_matches_interpreter(m, n, k):
    rng = np.random.default_rng(m + n + k)
    w = make_weight(rng, n, k, zero_blocks=0.05, nan_rows=(1,))
    x = make_tokens(rng, m, k)
    compiled = pallas(x, w, interpret=False)
    assert_within_bound(compiled, f64(x), w.values)
    interpreted = pallas(x, w, interpret=True)
    # Same algorithm, possibly other summation orders inside a block: both within the bound,
    # and within twice the bound of each other.
    assert_within_bound(interpreted, f64(x), w.values)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("inner", ["fma", "dot"])
def test_gpu_compiled_kernel_exact_sums(inner):
    rng = np.random.default_rng(9)
    m = 16 if inner == "dot" else 4
    w = make_weight(rng, 300, 2880, scale_lo=125, scale_hi=129)
    x = make_tokens(rng, m, 2880, integers=True)
    cfg = dataclasses.replace(default_config(m, 300, 2880), inner=inner, block_m=16 if inner == "dot" else 4)
    np.testing.assert_array_equal(np.asarray(pallas(x, w, cfg, interpret=False), np.float64), f64(x) @ w.values.T)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("route", _gemv.ROUTES)
def test_gpu_routes_keep_tiny_scales_exact(route):
    """Scale codes 0..3 (values down to 2^-128: bfloat16 subnormals) times tokens near
    2^100: the XLA route relies on the GPU dot keeping bfloat16 subnormals, the kernel
    scales block sums instead. Both must stay within the bound (+ the underflow term)."""
    rng = np.random.default_rng(2)
    w = make_weight(rng, 64, 256, scale_lo=0, scale_hi=3)
    x = jnp.asarray(np.asarray(make_tokens(rng, 4, 256), np.float32) * 2.0**100, jnp.bfloat16)
    y = _gemv.mxfp4_matmul(x, w.mx, route)
    assert_within_bound(y, f64(x), w.values, underflow=True)


@pytest.mark.gpu
@needs_gpu
def test_gpu_dot_general_runs_the_kernel():
    rng = np.random.default_rng(4)
    w = make_weight(rng, 256, 2880)
    x = make_tokens(rng, 4, 2880)
    f = jax.jit(lambda a, b: lowprec.dot_general(a, b, DN))
    assert (TRITON_CALL in f.lower(x, w.mx).as_text()
            or lowprec.kernels.current_policy().gpu_route != "pallas")
    assert_within_bound(f(x, w.mx), f64(x), w.values)


# -- the one-pass Pallas quantize kernel (a GPU candidate beside XLA's two passes) -----------------

from lowprec._options import MXCast  # noqa: E402
from lowprec.kernels._quantize_pallas import fake_quantize_mx_pallas, quantize_mx_pallas  # noqa: E402

QUANT_FORMATS = ("mxfp8_e4m3", "mxfp8_e5m2", "mxfp4")


def _specials(shape, seed, spread=30):
    """Normal values over 2^±spread with a NaN, an inf, an all-zero block, a tiny value, a
    −0 and a block maximum past E4M3's under FLOOR."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32) * np.exp2(rng.integers(-spread, spread, shape)).astype(np.float32)
    x[0, 3] = np.nan
    x[1, 70] = -np.inf
    x[2, 64:96] = 0.0
    x[2, 65] = -0.0
    x[3, 100] = 2.0**-140
    x[4, 32:64] = 448.0 * 1.0625  # above E4M3's max under FLOOR: saturates
    return x


# Every rule from float32; half-precision input (widened by the same integer code) with one.
# One case per format: its calls (kernel and quantize_mx, every rule and input dtype) are the
# outputs of one jitted program, each checked on its own (a program per call cost ~2x the CPU).
QUANT_CASES = [(f, r, np.float32) for f in QUANT_FORMATS + ("mxfp6_e2m3", "mxfp6_e3m2", "mxint8")
               for r in lowprec.ScaleRule] + [
    (f, "rceil", d) for f in QUANT_FORMATS for d in (jnp.bfloat16, np.float16)
]


def _default_run_cases(cases, formats):
    """The (format, rule, dtype) cases the default run interprets (each interpreted kernel
    costs ~0.3 s of CPU to compile): of every format, FLOOR and one other rule from
    float32, the other rules taking turns over the formats so that every rule runs through
    the kernel, and each half-precision dtype with two formats (the widening is before any
    format's code). The rules themselves are checked for every format against the
    reference in tests/test_mx.py; here the kernel's schedule (tiles, partial tiles, loads)
    is what is compared. The extended sweep (LOWPREC_FULL_SUITE=1) runs every case."""
    if tiers.full_suite():
        return cases
    others = list(lowprec.ScaleRule)[1:]  # after FLOOR
    halves: dict = {}  # dtype name -> the formats it runs with
    kept = []
    for f, r, d in cases:
        if d is np.float32:
            keep = r in (lowprec.ScaleRule.FLOOR, others[formats.index(f) % len(others)])
        else:
            with_dtype = halves.setdefault(np.dtype(d).name, [])
            keep = len(with_dtype) < 2
            with_dtype.append(f)
        if keep:
            kept.append((f, r, d))
    return kept


def _quant_input(dtype):
    return jnp.asarray(_specials((21, 352), 1, spread=8 if dtype == np.float16 else 30), dtype)


@pytest.mark.slow  # seconds a format; test_pallas_quantize_keeps_leading_dims_and_nearest_away is quick
@pytest.mark.parametrize("fmt", QUANT_FORMATS + ("mxfp6_e2m3", "mxfp6_e3m2", "mxint8"))
def test_pallas_quantize_is_bit_identical_to_quantize_mx(fmt):
    """Same integer core, other schedule: quantize_mx's codes and scales bit for bit, on a
    shape whose rows and columns leave partial tiles, for every scale rule (and bfloat16 and
    float16 input under one; the default run's subset: _default_run_cases)."""
    cases = [(r, d) for f, r, d in _default_run_cases(QUANT_CASES, QUANT_FORMATS + (
        "mxfp6_e2m3", "mxfp6_e3m2", "mxint8")) if f == fmt]
    xs = {np.dtype(d).name: _quant_input(d) for _, d in cases}

    @jax.jit
    def run(xs):
        out = []
        for rule, dtype in cases:
            x = xs[np.dtype(dtype).name]
            cast = MXCast(lowprec.mx_format(fmt), rule, "nearest_even")
            got = quantize_mx_pallas(x, cast, block_rows=8, block_cols=128, interpret=not ON_GPU)
            want = lowprec.quantize_mx(x, fmt, scale_rule=rule)
            out.append((got, (want.elements, want.scales)))
        return out

    for (rule, dtype), (got, want) in zip(cases, run(xs)):
        for part, a, b in zip(("elements", "scales"), got, want):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b),
                                          err_msg=f"{fmt} {rule} {np.dtype(dtype).name}: {part}")


@pytest.mark.parametrize("fmt", QUANT_FORMATS + ("mxint8", "mxfp6_e2m3"))
@pytest.mark.parametrize("cols", [340, 20])
@pytest.mark.slow  # left out of the quick tier (seconds; its paths run in other quick tests)
def test_pallas_kernels_zero_pad_like_quantize_mx(fmt, cols):
    """A last axis that is not a multiple of 32: the kernels pad with zeros in the load,
    giving quantize_mx(..., pad=True)'s codes and fake_quantize_mx(..., pad=True)'s values."""
    x = jnp.asarray(_specials((21, 352), 6)[:, :cols])
    cast = MXCast(lowprec.mx_format(fmt), "floor", "nearest_even")

    @jax.jit  # kernels and references in one program (a program each cost ~1.5x the CPU)
    def run(x):
        want = lowprec.quantize_mx(x, fmt, scale_rule="floor", pad=True)
        return (quantize_mx_pallas(x, cast, block_rows=8, block_cols=128, interpret=not ON_GPU),
                (want.elements, want.scales),
                fake_quantize_mx_pallas(x, cast, block_rows=8, block_cols=128,
                                        interpret=not ON_GPU),
                lowprec.fake_quantize_mx(x, fmt, scale_rule="floor", pad=True))

    (elements, scales), (want_elements, want_scales), fake, want_fake = run(x)
    np.testing.assert_array_equal(np.asarray(elements), np.asarray(want_elements))
    np.testing.assert_array_equal(np.asarray(scales), np.asarray(want_scales))
    assert_same_floats(fake, want_fake)


@pytest.mark.parametrize("fmt", QUANT_FORMATS + ("mxint8",))
@pytest.mark.parametrize("rows", [100, 128])
@pytest.mark.slow  # left out of the quick tier (seconds; its paths run in other quick tests)
def test_pallas_kernels_along_axis_0_like_quantize_mx(fmt, rows):
    """Blocks along axis 0 of a 2-D array (a [K, N] weight): tiles transposed in registers,
    quantize_mx(..., axis=0)'s codes (zero-padded: 100 rows) and fake_quantize_mx's values,
    under FLOOR and RCEIL (in the default run one of them a format, in turns: each
    interpreted kernel costs ~0.5 s of CPU; the extended sweep runs both)."""
    x = jnp.asarray(_specials((rows, 128), 7))
    rules = ("floor", "rceil")
    if not tiers.full_suite():
        rules = rules[(QUANT_FORMATS + ("mxint8",)).index(fmt) % 2:][:1]

    @jax.jit  # every rule's kernels and references in one program
    def run(x):
        out = []
        for rule in rules:
            cast = MXCast(lowprec.mx_format(fmt), rule, "nearest_even")
            want = lowprec.quantize_mx(x, fmt, axis=0, scale_rule=rule, pad=True)
            out.append((quantize_mx_pallas(x, cast, axis=0, interpret=not ON_GPU),
                        (want.elements, want.scales),
                        fake_quantize_mx_pallas(x, cast, axis=0, interpret=not ON_GPU),
                        lowprec.fake_quantize_mx(x, fmt, axis=0, scale_rule=rule, pad=True)))
        return out

    for rule, ((elements, scales), (want_elements, want_scales), fake, want_fake) in zip(
            rules, run(x)):
        tag = f"{fmt} {rows} rows {rule}"
        np.testing.assert_array_equal(np.asarray(elements), np.asarray(want_elements),
                                      err_msg=f"{tag}: elements")
        np.testing.assert_array_equal(np.asarray(scales), np.asarray(want_scales),
                                      err_msg=f"{tag}: scales")
        assert_same_floats(fake, want_fake, f"{tag}: fake_quantize_mx")


def test_pallas_quantize_keeps_leading_dims_and_nearest_away():
    x = jnp.asarray(_specials((6, 128), 2).reshape(2, 3, 128))
    cast = MXCast(lowprec.mx_format("mxfp4"), "rceil", "nearest_away")
    elements, scales = quantize_mx_pallas(x, cast, interpret=not ON_GPU)
    want = lowprec.quantize_mx(x, "mxfp4", scale_rule="rceil", rounding="nearest_away")
    assert elements.shape == (2, 3, 64) and scales.shape == (2, 3, 4)
    np.testing.assert_array_equal(np.asarray(elements), np.asarray(want.elements))
    np.testing.assert_array_equal(np.asarray(scales), np.asarray(want.scales))


@needs_triton_lowering
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("fmt", QUANT_FORMATS)
@pytest.mark.quick_first(2)
def test_pallas_quantize_lowers_to_triton(fmt, dtype):
    cast = MXCast(lowprec.mx_format(fmt), "rceil", "nearest_even")
    spec = jax.ShapeDtypeStruct((16384, 16384), dtype)
    assert _lower_for_cuda(lambda v: quantize_mx_pallas(v, cast), spec).count(TRITON_CALL) == 1


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("fmt", QUANT_FORMATS)
def test_gpu_compiled_quantize_kernel_is_bit_identical(fmt):
    x = jnp.asarray(_specials((1000, 4096), 3))
    for rule in lowprec.ScaleRule:
        cast = MXCast(lowprec.mx_format(fmt), rule, "nearest_even")
        elements, scales = quantize_mx_pallas(x, cast)
        want = lowprec.quantize_mx(x, fmt, scale_rule=rule)
        np.testing.assert_array_equal(np.asarray(elements), np.asarray(want.elements))
        np.testing.assert_array_equal(np.asarray(scales), np.asarray(want.scales))


# -- NVFP4 quantize: one pass given the tensor scale, two computing it --------------------------------

# Both element steps, a given and a computed tensor scale, float32 and bfloat16 input (each
# case compiles the whole NVFP4 core for the interpreter: ~3-5 s of CPU). The padded case
# also takes a last axis that is not a multiple of 16, leading dims, and the largest
# magnitude reduced over several programs (one case, not a test of its own: a compile less).
NVFP4_CASES = [("divide", 0.0123, np.float32, False), ("divide", None, jnp.bfloat16, True),
               ("reciprocal", None, np.float32, False), ("reciprocal", 0.0123, jnp.bfloat16, False)]


@pytest.mark.parametrize("step,ts,dtype,padded", NVFP4_CASES,
                         ids=[f"{s}-ts={t}-{np.dtype(d).name}" + ("-padded" if p else "")
                              for s, t, d, p in NVFP4_CASES])
@pytest.mark.slow  # ~5 s a case; the quick tier traces the kernel (..._lowers_to_triton below)
def test_pallas_nvfp4_quantize_is_bit_identical_to_quantize_mx(step, ts, dtype, padded,
                                                                monkeypatch):
    """The kernel runs quantize_mx's NVFP4 core (torchao's recipe, each float32 step exact on
    the bits) on its tiles: the same element codes, E4M3 scale codes and tensor scale as
    XLA's formulation, for a given scale and for the computed float32(amax / 2688) (NaN,
    inf, zero blocks and subnormals in x). The padded case: a last axis that is not a
    multiple of 16 (zero-padded in the load), leading dims, and the largest magnitude
    reduced over several programs that each loop over row tiles (the last one partly past
    x's end)."""
    if padded:
        from lowprec.kernels import _quantize_pallas

        monkeypatch.setattr(_quantize_pallas, "_AMAX_PROGRAMS", 3)
        x = jnp.asarray(_specials((60, 352), 5, spread=6)[:, :330].reshape(3, 20, 330))
        x = x.at[2, 19, 7].set(1000.0).astype(dtype)  # the largest magnitude, in the last row tile
    else:
        x = jnp.asarray(_specials((21, 352), 1, spread=8 if dtype == np.float32 else 4), dtype)
    cast = MXCast(lowprec.mx_format("nvfp4"), None, "nearest_even", step)

    @jax.jit  # kernel and quantize_mx in one program (called one by one: 13.0 CPU s for the 4 cases, 10.0 so)
    def run(x):
        want = lowprec.quantize_mx(x, "nvfp4", tensor_scale=ts, nvfp4_step=step, pad=padded)
        return (quantize_mx_pallas(x, cast, ts, block_cols=128, interpret=not ON_GPU),
                (want.elements, want.scales, want.tensor_scale))

    (elements, scales, t), (want_elements, want_scales, want_t) = run(x)
    np.testing.assert_array_equal(np.asarray(elements), np.asarray(want_elements))
    np.testing.assert_array_equal(np.asarray(scales), np.asarray(want_scales))
    assert_same_floats(t, want_t)
    if padded:
        assert elements.shape == (3, 20, 168) and scales.shape == (3, 20, 21)
        assert float(t) == float(np.float32(1000.0) / np.float32(2688))


@needs_triton_lowering
@pytest.mark.parametrize("step", ["divide", "reciprocal"])
@pytest.mark.quick_first(1)
def test_pallas_nvfp4_quantize_lowers_to_triton(step):
    cast = MXCast(lowprec.mx_format("nvfp4"), None, "nearest_even", step)
    spec = jax.ShapeDtypeStruct((4096, 4096), jnp.float32)
    assert _lower_for_cuda(lambda v: quantize_mx_pallas(v, cast, jnp.float32(1)),
                           spec).count(TRITON_CALL) == 1
    assert _lower_for_cuda(lambda v: quantize_mx_pallas(v, cast), spec).count(TRITON_CALL) == 2


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("step", ["divide", "reciprocal"])
def test_gpu_compiled_nvfp4_quantize_is_bit_identical_to_the_cpu(step):
    """On the GPU quantize_mx takes the kernels; the CPU's XLA formulation is the oracle."""
    x = _specials((1000, 4096), 3, spread=10)
    cpu = jax.devices("cpu")[0]
    for ts in (1.0, None):
        got = lowprec.quantize_mx(jnp.asarray(x), "nvfp4", tensor_scale=ts, nvfp4_step=step)
        want = jax.jit(lambda v: lowprec.quantize_mx(v, "nvfp4", tensor_scale=ts,
                                                     nvfp4_step=step))(jax.device_put(x, cpu))
        np.testing.assert_array_equal(np.asarray(got.elements), np.asarray(want.elements))
        np.testing.assert_array_equal(np.asarray(got.scales), np.asarray(want.scales))
        assert_same_floats(got.tensor_scale, want.tensor_scale)


# -- the one-pass Pallas fake quantization (fake_quantize_mx on CUDA) ------------------------------

FAKE_FORMATS = ("mxfp8_e4m3", "mxfp8_e5m2", "mxfp6_e2m3", "mxfp6_e3m2", "mxfp4", "mxint8")
FAKE_CASES = [(f, r, np.float32) for f in FAKE_FORMATS for r in lowprec.ScaleRule] + [
    (f, "rceil", jnp.bfloat16) for f in FAKE_FORMATS
]


@pytest.mark.slow  # seconds a format; quick: test_pallas_fake_quantize_lowers_to_triton traces it
@pytest.mark.parametrize("fmt", FAKE_FORMATS)
def test_pallas_fake_quantize_is_bit_identical_to_the_xla_path(fmt):
    """One pass, quantize and decode in registers: the values of the XLA formulation
    (dequantize(quantize_mx(x))) bit for bit, specials and partial tiles included, for every
    scale rule (and bfloat16 input under one; the default run's subset: _default_run_cases);
    one program per format (see above)."""
    cases = [(r, d) for f, r, d in _default_run_cases(FAKE_CASES, FAKE_FORMATS) if f == fmt]
    xs = {np.dtype(d).name: jnp.asarray(_specials((21, 352), 5, spread=8 if d == jnp.bfloat16
                                                  else 30), d) for _, d in cases}

    @jax.jit
    def run(xs):
        out = []
        for rule, dtype in cases:
            x = xs[np.dtype(dtype).name]
            cast = MXCast(lowprec.mx_format(fmt), rule, "nearest_even")
            out.append((fake_quantize_mx_pallas(x, cast, block_rows=8, block_cols=128,
                                                interpret=not ON_GPU),
                        lowprec.dequantize(lowprec.quantize_mx(x, fmt, scale_rule=rule), dtype)))
        return out

    for (rule, dtype), (got, want) in zip(cases, run(xs)):
        assert got.dtype == dtype
        assert_same_floats(got, want, f"{fmt} {rule} {np.dtype(dtype).name}")


@needs_triton_lowering
@pytest.mark.parametrize("fmt", FAKE_FORMATS)
@pytest.mark.quick_first(2)
def test_pallas_fake_quantize_lowers_to_triton(fmt):
    cast = MXCast(lowprec.mx_format(fmt), "rceil", "nearest_even")
    spec = jax.ShapeDtypeStruct((4096, 4096), jnp.float32)
    assert _lower_for_cuda(lambda v: fake_quantize_mx_pallas(v, cast), spec).count(TRITON_CALL) == 1


@needs_triton_lowering
@pytest.mark.slow  # ~6 s of lowerings; quick: test_kernel_policy_xla_turns_each_kernel_off's cases
def test_quantize_and_fake_quantize_take_the_kernels_on_cuda_only(cuda_branches):
    """The public functions choose the one-pass kernels when lowered for CUDA (last axis or
    axis 0 of a 2-D array, deterministic rounding) and XLA's formulation for the CPU."""
    x = jax.ShapeDtypeStruct((64, 256), jnp.float32)
    for f in (lambda v: lowprec.quantize_mx(v, "mxfp8"),
              lambda v: lowprec.fake_quantize_mx(v, "mxfp4")):
        assert TRITON_CALL in _lower_for_cuda(f, x)
        assert TRITON_CALL not in jax.jit(f).trace(x).lower(lowering_platforms=("cpu",)).as_text()
    x3 = jax.ShapeDtypeStruct((4, 64, 32), jnp.float32)
    assert TRITON_CALL not in _lower_for_cuda(lambda v: lowprec.quantize_mx(v, "mxfp8", axis=1), x3)
    assert TRITON_CALL in _lower_for_cuda(lambda v: lowprec.quantize_mx(v, "mxfp8", axis=0), x)
    assert TRITON_CALL in _lower_for_cuda(lambda v: lowprec.quantize_mx(v, "mxfp6"), x)
    # NVFP4: one kernel given the tensor scale, two (the largest magnitude first) computing it.
    assert _lower_for_cuda(lambda v: lowprec.quantize_mx(v, "nvfp4", tensor_scale=1.0),
                           x).count(TRITON_CALL) == 1
    assert _lower_for_cuda(lambda v: lowprec.quantize_mx(v, "nvfp4"), x).count(TRITON_CALL) == 2
    for f in (lambda v: lowprec.quantize_mx(v, "mxfp6", axis=0),  # FP6 along axis 0: XLA
              lambda v: lowprec.quantize_mx(v, "nvfp4", axis=0),  # NVFP4: the last axis only
              lambda v: lowprec.quantize_mx(v, "nvfp4", rounding="stochastic",
                                            key=jax.random.key(0))):
        assert TRITON_CALL not in _lower_for_cuda(f, x)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("fmt", FAKE_FORMATS)
def test_gpu_compiled_fake_quantize_kernel_is_bit_identical(fmt):
    x = jnp.asarray(_specials((1000, 4096), 4))
    for rule in lowprec.ScaleRule:
        cast = MXCast(lowprec.mx_format(fmt), rule, "nearest_even")
        want = lowprec.dequantize(lowprec.quantize_mx(x, fmt, scale_rule=rule))
        assert_same_floats(fake_quantize_mx_pallas(x, cast), want)


# -- the fused MX x MX product (dot_general's bfloat16 branch on CUDA) ----------------------------

from lowprec.kernels._mxdot_pallas import mxdot_pallas  # noqa: E402

MXDOT_FORMATS = [("mxfp8_e4m3", "mxfp8_e4m3"), ("mxfp8_e5m2", "mxfp8_e4m3")]


@pytest.mark.parametrize("fa,fb", MXDOT_FORMATS)
@pytest.mark.parametrize("m,n,k", [(70, 50, 96), (16, 33, 256)])
@pytest.mark.quick_first(1)
def test_mxdot_kernel_within_float32_sum_bound(fa, fb, m, n, k):
    """Values decoded independently (the reference's MX decode, float64): products exact,
    float32 sums within K·2^-23·Σ|a_i b_i|; partial tiles in M, N and K (K = 96: a half
    step of 64) masked."""
    import lowprec_reference as R

    rng = np.random.default_rng(7)
    x = (rng.standard_normal((m, k)) * 2.0 ** rng.integers(-6, 6, (m, k))).astype(np.float32)
    w = (rng.standard_normal((n, k)) * 2.0 ** rng.integers(-6, 6, (n, k))).astype(np.float32)
    qa, qb = lowprec.quantize_mx(jnp.asarray(x), fa), lowprec.quantize_mx(jnp.asarray(w), fb)
    va = R.dequantize_mx(np.asarray(qa.elements), np.asarray(qa.scales), fa, axis=1)
    vb = R.dequantize_mx(np.asarray(qb.elements), np.asarray(qb.scales), fb, axis=1)
    got = mxdot_pallas(qa.elements, qa.scales, qb.elements, qb.scales, fa=qa.fmt, fb=qb.fmt,
                       block_m=32, block_n=16, block_k=64, interpret=not ON_GPU)
    exact = va @ vb.T
    bound = k * 2.0**-23 * (np.abs(va) @ np.abs(vb).T)
    assert np.all(np.abs(np.asarray(got, np.float64) - exact) <= bound)


@pytest.mark.slow  # left out of the quick tier (seconds; its paths run in other quick tests)
def test_mxdot_kernel_exact_sums_match_the_generic_path_bit_for_bit():
    """Small integers: every partial sum is exact, so any summation order gives the same
    float32, and the kernel equals dot_general's generic path bit for bit."""
    rng = np.random.default_rng(8)
    x = rng.integers(-8, 9, (40, 128)).astype(np.float32)
    w = rng.integers(-8, 9, (24, 128)).astype(np.float32)
    qa, qb = lowprec.quantize_mx(jnp.asarray(x), "mxfp8"), lowprec.quantize_mx(jnp.asarray(w), "mxfp8")
    got = mxdot_pallas(qa.elements, qa.scales, qb.elements, qb.scales, fa=qa.fmt, fb=qb.fmt,
                       block_m=16, block_n=16, block_k=64, interpret=not ON_GPU)
    want = lowprec.dot_general(qa, qb, DN)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(got), x @ w.T)


def _mxdot_calls():
    """(call, args) of dot_general on pre-quantized MXFP8 operands and on float32 operands
    quantized in the call: the two ways into the fused MX dot."""
    a = jax.ShapeDtypeStruct((256, 512), jnp.float32)
    q = jax.eval_shape(lambda v: lowprec.quantize_mx(v, "mxfp8", axis=1), a)
    return [(lambda p, r: lowprec.dot_general(p, r, DN), (q, q)),
            (lambda p, r: lowprec.dot_general(p, r, DN, lhs_format="mxfp8", rhs_format="mxfp8"),
             (a, a))]


@needs_triton_lowering
def test_dot_general_takes_the_fused_mx_kernel_on_cuda_only(cuda_branches, fused_mxdot):
    for f, args in _mxdot_calls():
        assert "lowprec_mxdot" in _lower_for_cuda(f, *args)
        cpu = jax.jit(f).trace(*args).lower(lowering_platforms=("cpu",)).as_text()
        assert "lowprec_mxdot" not in cpu


@needs_triton_lowering
def test_dot_general_leaves_the_fused_mx_kernel_off_by_default(cuda_branches):
    """Policy.fused_mxdot is off (the kernel measured 4x slower than decoding for cuBLAS): the
    program lowered for CUDA holds no fused MX dot, for pre-quantized or float operands."""
    assert lowprec.kernels.current_policy().fused_mxdot is False
    for f, args in _mxdot_calls():
        assert "lowprec_mxdot" not in _lower_for_cuda(f, *args)


@pytest.mark.gpu
@needs_gpu
def test_gpu_compiled_mxdot_within_bound(fused_mxdot):
    rng = np.random.default_rng(9)
    x = jnp.asarray(rng.standard_normal((1000, 2880)).astype(np.float32))
    w = jnp.asarray(rng.standard_normal((700, 2880)).astype(np.float32))
    qa, qb = lowprec.quantize_mx(x, "mxfp8"), lowprec.quantize_mx(w, "mxfp8")
    va = np.asarray(lowprec.dequantize(qa), np.float64)
    vb = np.asarray(lowprec.dequantize(qb), np.float64)
    got = np.asarray(jax.jit(lambda p, r: lowprec.dot_general(p, r, DN))(qa, qb), np.float64)
    bound = 2880 * 2.0**-23 * (np.abs(va) @ np.abs(vb).T)
    assert np.all(np.abs(got - va @ vb.T) <= bound)


# -- the kernel policy (lowprec.kernels) -------------------------------------------------------

_KERNEL_CALLS = {
    # name: (call, its arguments' shapes, the kernel's name in the CUDA-lowered program)
    "quantize_mx": (lambda v: lowprec.quantize_mx(v, "mxfp8"),
                    lambda: (jax.ShapeDtypeStruct((64, 256), jnp.float32),), "lowprec_quantize_mx"),
    "fake_quantize_mx": (lambda v: lowprec.fake_quantize_mx(v, "mxfp4"),
                         lambda: (jax.ShapeDtypeStruct((64, 256), jnp.float32),),
                         "lowprec_fake_quantize_mx"),
    "mxdot": (lambda p, r: lowprec.dot_general(p, r, DN),
              lambda: (jax.eval_shape(lambda v: lowprec.quantize_mx(v, "mxfp8"),
                                      jax.ShapeDtypeStruct((256, 512), jnp.float32)),) * 2,
              "lowprec_mxdot"),
    "mxfp4 decode product": (lambda x, w: lowprec.dot_general(x, w, DN), _decode_case,
                             "lowprec_mxfp4_matmul"),
}


@needs_triton_lowering
@pytest.mark.parametrize("name", list(_KERNEL_CALLS))
@pytest.mark.quick_first(2)
def test_kernel_policy_xla_turns_each_kernel_off(name, cuda_branches, fused_mxdot):
    """lowprec.kernels.set_policy("xla"): the program lowered for CUDA holds no Pallas kernel
    (XLA's formulation, the same bits); "auto" brings the kernel back."""
    import lowprec.kernels

    call, args, kernel = _KERNEL_CALLS[name]
    assert lowprec.kernels.get_policy() == "auto"
    assert kernel in _lower_for_cuda(call, *args())
    previous = lowprec.kernels.set_policy("xla")
    try:
        text = _lower_for_cuda(call, *args())
        assert kernel not in text and TRITON_CALL not in text
    finally:
        lowprec.kernels.set_policy(previous)
    assert kernel in _lower_for_cuda(call, *args())


@needs_triton_lowering
@pytest.mark.parametrize("name", list(_KERNEL_CALLS))
@pytest.mark.quick_first(1)
def test_kernels_step_aside_under_an_explicit_mesh(name, cuda_branches, fused_mxdot):
    """Under a mesh with Explicit axes (JAX's default axis type) the programs lowered for CUDA
    hold no Pallas kernel, and lowering succeeds: JAX 0.11's Triton lowering of a kernel's
    reductions fails there (it failed for the quantize kernels before they stepped aside)."""
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType, use_abstract_mesh

    call, make_args, kernel = _KERNEL_CALLS[name]
    args = make_args()
    mesh = AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=AbstractDevice(
        device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu"))
    with use_abstract_mesh(mesh):
        text = jax.jit(call).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert kernel not in text and TRITON_CALL not in text
    assert kernel in _lower_for_cuda(call, *args)  # outside the mesh the kernel is back


def test_kernel_policy_from_the_environment_and_bad_values(monkeypatch, cuda_branches):
    import lowprec.kernels

    monkeypatch.setenv("LOWPREC_KERNELS", "xla")
    assert lowprec.kernels.get_policy() == "xla"
    x = jax.ShapeDtypeStruct((64, 256), jnp.float32)
    assert TRITON_CALL not in _lower_for_cuda(lambda v: lowprec.quantize_mx(v, "mxfp8"), x)
    previous = lowprec.kernels.set_policy("auto")  # the process's choice wins
    try:
        assert lowprec.kernels.get_policy() == "auto"
    finally:
        lowprec.kernels.set_policy(previous)
    monkeypatch.setenv("LOWPREC_KERNELS", "triton")
    with pytest.raises(ValueError, match=r"unknown kernel policy 'triton' \(environment variable "
                                         r"LOWPREC_KERNELS\); valid policies: 'auto', 'xla'"):
        lowprec.quantize_mx(jnp.ones(32), "mxfp8")
    with pytest.raises(ValueError, match=r"unknown kernel policy 'off' \(set_policy\)"):
        lowprec.kernels.set_policy("off")


def test_kernel_policy_is_a_static_argument_of_the_jitted_cores(monkeypatch, cuda_branches):
    """The decision is part of the jit cache key of lowprec's cores: a program traced under
    one policy is never reused under the other (here the environment changes the policy,
    which clears no cache; the same bits either way on CPU)."""
    from lowprec import _mx

    x = jnp.asarray(_specials((8, 128), 9))
    before = _mx._quantize_mx_jit._cache_size()
    auto = lowprec.quantize_mx(x, "mxfp8")
    monkeypatch.setenv("LOWPREC_KERNELS", "xla")
    xla = lowprec.quantize_mx(x, "mxfp8")
    assert _mx._quantize_mx_jit._cache_size() == before + 2
    np.testing.assert_array_equal(np.asarray(auto.elements), np.asarray(xla.elements))
    np.testing.assert_array_equal(np.asarray(auto.scales), np.asarray(xla.scales))


def test_kernels_serve_only_the_scale_scheme_they_were_built_for(cuda_branches):
    """The MX kernels hard-wire E8M0 arithmetic with blocks of 32; NVFP4's quantization has
    its own (the tensor scale an operand, blocks of 16 or 32, the last axis); its fake
    quantization, and any other scheme, keep XLA's formulation, whatever the shapes."""
    from lowprec._options import MXCast

    x = jnp.zeros((64, 256), jnp.float32)
    assert _dispatch.quantize_kernel(x, MXCast("mxfp4"), 1)
    assert _dispatch.quantize_kernel(x, MXCast("mxfp4"), 1, fake=True)
    assert _dispatch.quantize_kernel(x, MXCast("nvfp4"), 1)
    assert not _dispatch.quantize_kernel(x, MXCast("nvfp4"), 0)
    assert not _dispatch.quantize_kernel(x, MXCast("nvfp4_b64"), 1)
    assert not _dispatch.quantize_kernel(x, MXCast("nvfp4"), 1, fake=True)
    assert not _dispatch.quantize_kernel(x, MXCast("mxfp4", rounding="stochastic"), 1)
    assert not _dispatch.quantize_kernel(x, MXCast("mxfp4_b16"), 1)


# -- one decision point: the formulations of a call, the policy as one value -------------------


def test_quantize_formulations_name_every_candidate_of_a_call(monkeypatch):
    """The dispatch returns what a quantize_mx call may take: EXACT always; HWFLOAT only for
    nearest-even rounding of a scheme with that path (the scheme's proof is for round to
    nearest even, docs/design.md §12); the kernels where their predicates say (for fake
    quantization the fused C++ kernel's, E8M0 formats only); neither kernel under
    LOWPREC_KERNELS=xla."""
    F = _dispatch.Formulation
    x = jnp.zeros((4, 8, 64), jnp.float32)  # [batch, seq, d], blocked along d
    for fmt in ("mxfp8", "mxfp6_e2m3", "mxfp4", "nvfp4"):
        cast = MXCast(fmt)
        forms = _dispatch.quantize_formulations(x, cast, 2)
        assert {F.EXACT, F.HWFLOAT} <= forms, fmt
        assert (F.CPU_KERNEL in forms) == _dispatch.cpu_quantize_kernel(x, cast, 2, None, None)
        assert (F.PALLAS in forms) == _dispatch.quantize_kernel(x, cast, 2)
        fake = _dispatch.quantize_formulations(x, cast, 2, fake=True)
        assert (F.CPU_KERNEL in fake) == _dispatch.cpu_mx_fused_values(x, cast), fmt
        assert not (fmt == "nvfp4" and F.CPU_KERNEL in fake)  # its fused call: the recipe's
        up = _dispatch.quantize_formulations(x, MXCast(fmt, rounding="up"), 2)
        assert F.HWFLOAT not in up and F.CPU_KERNEL not in up
    assert F.HWFLOAT not in _dispatch.quantize_formulations(x, MXCast("mixfp4"), 2)
    monkeypatch.setenv("LOWPREC_KERNELS", "xla")
    assert _dispatch.quantize_formulations(x, MXCast("mxfp8"), 2) == {F.EXACT, F.HWFLOAT}


def test_policy_is_one_frozen_value_set_and_restored(monkeypatch):
    """set_policy sets any field (a Policy, the kernel policy, or keywords), returns the
    settings before, which restore everything; the policy() context manager restores them
    however its block ends; the kernel policy left unset is the environment's."""
    from lowprec.kernels import Policy, current_policy, policy, set_policy

    p = current_policy()
    assert (p.gpu_route, p.fused_mxdot) == ("pallas", False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.gpu_route = "xla"
    before = set_policy(gpu_route="xla")
    try:
        assert current_policy().gpu_route == "xla" and current_policy().kernels == p.kernels
        set_policy("xla", fused_mxdot=True)
        assert current_policy() == Policy("xla", "xla", True)
        set_policy(None)  # the kernel policy back to the environment's; the others kept
        monkeypatch.setenv("LOWPREC_KERNELS", "xla")
        assert current_policy() == Policy("xla", "xla", True)
        monkeypatch.setenv("LOWPREC_KERNELS", "auto")
        assert current_policy() == Policy("auto", "xla", True)
        set_policy(Policy(fused_mxdot=True))  # a whole Policy: every field
        assert current_policy() == Policy("auto", "pallas", True)
    finally:
        set_policy(before)
    assert current_policy() == Policy("auto", "pallas", False)
    with pytest.raises(RuntimeError, match="inside"):
        with policy("xla", gpu_route="xla") as inside:
            assert inside == current_policy() == Policy("xla", "xla", False)
            raise RuntimeError("inside")
    assert current_policy() == Policy("auto", "pallas", False)


def test_policy_refuses_bad_fields_naming_them():
    from lowprec.kernels import Policy, current_policy, set_policy

    with pytest.raises(ValueError, match=r"unknown gpu_route 'cuda'; valid routes: 'pallas'"):
        set_policy(gpu_route="cuda")
    with pytest.raises(TypeError, match=r"fused_mxdot must be True or False, got 1"):
        set_policy(fused_mxdot=1)
    with pytest.raises(ValueError, match=r"unknown kernel policy 'off' \(Policy.kernels\)"):
        Policy("off")
    assert current_policy() == Policy("auto", "pallas", False)  # nothing was set


@needs_triton_lowering
def test_policy_fields_are_read_while_tracing(cuda_branches):
    """gpu_route and fused_mxdot decide the program lowered for CUDA, set by the context
    manager: the decode-time MXFP4 product leaves its kernel for XLA's route under
    gpu_route="xla", the MXFP8 dot takes the fused kernel under fused_mxdot=True."""
    call, args, kernel = _KERNEL_CALLS["mxfp4 decode product"]
    assert kernel in _lower_for_cuda(call, *args())
    with lowprec.kernels.policy(gpu_route="xla"):
        text = _lower_for_cuda(call, *args())
        assert kernel not in text and TRITON_CALL not in text
    call, args, kernel = _KERNEL_CALLS["mxdot"]
    assert kernel not in _lower_for_cuda(call, *args())
    with lowprec.kernels.policy(fused_mxdot=True):
        assert kernel in _lower_for_cuda(call, *args())
    assert kernel not in _lower_for_cuda(call, *args())


@pytest.mark.parametrize("name, field, value", [("GPU_ROUTE", "gpu_route", "xla"),
                                                ("FUSED_MXDOT", "fused_mxdot", True)])
def test_old_module_knobs_warn_and_still_work(name, field, value):
    """_dispatch.GPU_ROUTE / FUSED_MXDOT, the knobs before Policy, read and set the policy's
    field for one release, with a DeprecationWarning naming the new spelling."""
    default = getattr(_dispatch.current_policy(), field)
    match = rf"{name} is deprecated; use lowprec.kernels.set_policy\({field}=...\)"
    with pytest.warns(DeprecationWarning, match=match):
        assert getattr(_dispatch, name) == default
    try:
        with pytest.warns(DeprecationWarning, match=match):
            setattr(_dispatch, name, value)
        assert getattr(_dispatch.current_policy(), field) == value
    finally:
        _dispatch.set_policy(**{field: default})
    with pytest.raises(AttributeError, match="no attribute 'NO_SUCH_KNOB'"):
        _dispatch.NO_SUCH_KNOB  # noqa: B018
