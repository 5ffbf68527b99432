"""The quantized ragged dot (``Recipe.ragged_dot``, ``lowprec.ragged_dot``): each group is its
own dot, forward and backward.

Expected values are computed here, per group, from operands quantized by the independent
reference (``lowprec_reference``: exact rational quantizers): the forward product along K,
grad_lhs along N, grad_rhs along the group's own tokens (its last block zero-padded), each a
float64 NumPy matmul, which the result must match within float32 accumulation,
|err| <= K 2^-23 sum|a_i b_i| (+ an ulp of the output). On CPU the forward also equals
``lax.ragged_dot`` of the reference-quantized values exactly (same sums, in the same order).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import lowprec
import lowprec_reference as ref
from lowprec import FP8_HYBRID, NVIDIA_MXFP8, OCP_MXFP8, Recipe
from lowprec import _nvfp4_train as nt

from helpers.asserts import assert_bits_equal

SIZES = (21, 0, 37, 9)  # an empty group, none a multiple of 32, 13 rows in no group
M, K, N = 80, 80, 40  # K and N not multiples of 32: recipes pad them
DN = (((1,), (0,)), ((), ()))


def _groups(sizes, m=M):
    """(start, stop) rows of each group, as lax.ragged_dot assigns them (clipped at m)."""
    ends = np.minimum(np.cumsum(sizes), m)
    starts = np.concatenate([[0], ends[:-1]])
    return list(zip(starts.tolist(), ends.tolist()))


def _operands(sizes=SIZES, m=M, k=K, n=N, seed=0):
    """Tokens, per-expert weights and a cotangent; row and expert magnitudes vary over 2^±6,
    so that groups and experts get different scales. NumPy arrays (drawn and sliced without
    compiling: jax.random and slicing run op by op compile a program per shape)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)) * np.exp2(rng.integers(-6, 6, (m, 1)))
    w = rng.standard_normal((len(sizes), k, n)) * np.exp2(rng.integers(-6, 6, (len(sizes), 1, 1)))
    g = rng.standard_normal((m, n))
    return (x.astype(np.float32), w.astype(np.float32), g.astype(np.float32),
            jnp.asarray(sizes, jnp.int32))


def _ref_q(x, fmt, axis, rule="floor"):
    """float64 values of ``x`` quantized by the reference: MX blocks along ``axis`` (zero-padded
    to whole blocks; NVFP4 with the tensor scale of ``x`` itself), element formats one by one,
    None as it is."""
    x = np.asarray(x, np.float32)
    if fmt is None:
        return x.astype(np.float64)
    fmt = lowprec.resolve_format(fmt)
    if isinstance(fmt, lowprec.ElementFormat):
        return ref.decode(fmt.name, ref.encode(fmt.name, x)).astype(np.float64)
    n = x.shape[axis]
    if fmt.name == "nvfp4":
        el, sc, ts = ref.quantize_nvfp4(x, fmt.name, axis=axis, pad=True)
        out = ref.dequantize_mx(el, sc, fmt.name, axis=axis, tensor_scale=ts)
    else:  # names carry the block size ("mxfp4_b16")
        el, sc = ref.quantize_mx(x, fmt.name, axis=axis, scale_rule=rule, pad=True)
        out = ref.dequantize_mx(el, sc, fmt.name, axis=axis)
    return np.take(np.asarray(out, np.float64), np.arange(n), axis=axis)


def _ref_scaled(x, fmt, grid="e4m3"):
    """scaling='tensor' by the reference: x / s rounded to ``fmt`` saturating, times s, with
    s the power of two of the MX rceil rule applied to the whole of ``x`` (derived
    independently of lowprec)."""
    x = np.asarray(x, np.float32)
    amax = float(np.max(np.abs(x))) if x.size else 0.0
    s = 2.0 ** min(max(ref.shared_exponent(amax, fmt, "rceil"), -126), 127)
    return ref.decode(fmt, ref.encode(fmt, x / np.float32(s), overflow="saturate")) * s


def _assert_close(got, want, a, b, contract_len):
    """|got - want| <= K 2^-23 sum|a_i b_i| + 2^-24 |want| (a, b: the quantized factors)."""
    got = np.asarray(got, np.float64)
    bound = contract_len * 2.0**-23 * (np.abs(a) @ np.abs(b)) + 2.0**-24 * np.abs(want)
    bad = np.abs(got - want) > bound
    assert not bad.any(), f"{bad.sum()} entries off; max err {np.max(np.abs(got - want))}"


def _assert_same_sums(got, want, a, b, contract_len):
    """``got`` and ``want`` sum the same exact products in two orders: each is within
    L 2^-23 sum|Q(a_i) Q(b_i)| of the exact sum, and |Q(v)| <= 2|v| for round-to-nearest
    into any float grid (a, b: the unquantized factors)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    bound = 2 * contract_len * 2.0**-23 * 4 * (np.abs(a) @ np.abs(b)) + 2.0**-24 * np.abs(want)
    bad = np.abs(got - want) > bound
    assert not bad.any(), f"{bad.sum()} entries off; max err {np.max(np.abs(got - want))}"


def _grads(fn, x, w, g):
    _, vjp = jax.vjp(fn, x, w)
    return vjp(g)


@functools.lru_cache(maxsize=None)
def _run(recipe, grads=True):
    """NumPy (output, grad_lhs, grad_rhs) of ``recipe.ragged_dot`` on the default operands,
    from one jitted program per recipe (output only with ``grads=False``), shared by the
    forward and backward tests of that recipe: each traced program of the NVFP4 recipe costs
    seconds, and a result read back before slicing keeps the per-group slices from compiling
    a program each."""
    x, w, g, gs = _operands()
    if not grads:
        return (np.asarray(jax.jit(lambda a, b: recipe.ragged_dot(a, b, gs))(x, w)),)
    step = jax.jit(lambda a, b, c: _forward_and_grads(
        lambda p, q: recipe.ragged_dot(p, q, gs), a, b, c))
    return tuple(np.asarray(v) for v in step(x, w, g))


# -- forward -------------------------------------------------------------------------------------

FORWARD_CASES = [
    ("mxfp8_e4m3", "mxfp8_e4m3", "rceil"),
    ("mxfp8_e4m3", "mxfp8_e4m3", "floor"),
    ("mxfp4", "mxfp6_e2m3", "even"),
    ("mxfp8_e5m2", None, "ceil"),
    ("e4m3", "e4m3", None),  # element formats, no scaling
    ("nvfp4", "nvfp4", None),  # a tensor scale per group of tokens and per expert
]


@pytest.mark.parametrize("lf,rf,rule", FORWARD_CASES)
@pytest.mark.quick_first(1)
def test_forward_is_each_groups_dot_of_reference_quantized_operands(lf, rf, rule):
    x, w, _, gs = _operands()
    opts = None if rule is None else {"scale_rule": rule}  # E8M0 scales only
    got = _forward_recipe_output(Recipe(forward=(lf, rf), scale_options=opts))
    assert got.shape == (M, N) and got.dtype == jnp.float32
    qx = np.zeros((M, K))
    qw = np.stack([_ref_q(w[i], rf, 0, rule) for i in range(len(SIZES))])
    for i, (a, b) in enumerate(_groups(SIZES)):
        if a == b:
            continue
        qx[a:b] = _ref_q(x[a:b], lf, 1, rule)  # NVFP4: the group's own tensor scale
        _assert_close(got[a:b], qx[a:b] @ qw[i], qx[a:b], qw[i], K)
    assert np.all(np.asarray(got[sum(SIZES):]) == 0)  # rows in no group
    if jax.default_backend() == "cpu":
        # Exact products, float32 sums: XLA's own ragged dot of the reference's values, given in
        # bfloat16 where every one is a bfloat16 (XLA:CPU sums a bfloat16 dot in another order
        # than a float32 one, ~1 ulp apart; both within the bound above).
        dt = jnp.bfloat16 if all(_is_bf16(v) for v in (qx, qw)) else jnp.float32
        want = lax.ragged_dot(jnp.asarray(qx, dt), jnp.asarray(qw, dt), gs,
                              precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def _forward_recipe_output(recipe):
    """The output of ``recipe``'s ragged dot on the default operands; where a backward test's
    recipe has the same forward (formats and scale rule), that recipe's jitted forward and
    gradients, computed once for both tests."""
    for r in QUANTIZED_RECIPES:
        if (r.forward, r.scale_options) == (recipe.forward, recipe.scale_options):
            return _run(r)[0]
    return _run(recipe, grads=False)[0]


def _is_bf16(v) -> bool:
    """Whether every value of ``v`` is a bfloat16 normal number or zero (ml_dtypes' cast
    there and back returns it; subnormals excluded, as XLA:CPU may flush them)."""
    v = np.asarray(v, np.float64)
    back = v.astype(jnp.bfloat16).astype(np.float64)
    tiny = float(jnp.finfo(jnp.bfloat16).tiny)
    return bool(np.all((back == v) & ((np.abs(v) >= tiny) | (v == 0))))


@pytest.mark.slow  # seconds (a backward too); per-tensor scales run in test_recipe's quick tests
def test_tensor_scaling_is_per_group_and_per_expert():
    x, w, _, gs = _operands()
    got = _run(FP8_HYBRID)[0]  # the forward of the tensor-scaled backward test's program
    for i, (a, b) in enumerate(_groups(SIZES)):
        if a == b:
            continue
        qx, qw = _ref_scaled(x[a:b], "e4m3"), _ref_scaled(w[i], "e4m3")
        _assert_close(got[a:b], qx @ qw, qx, qw, K)


def test_group_sizes_past_the_rows_are_clipped_as_in_lax():
    x, w, _, _ = _operands()
    sizes = (30, 0, 70, 5)  # sum 105 > 80: the third group ends at row 80, the last is empty
    got = np.asarray(NVIDIA_MXFP8.ragged_dot(x, w, jnp.asarray(sizes)))
    for i, (a, b) in enumerate(_groups(sizes)):
        if a < b:
            qx, qw = _ref_q(x[a:b], "mxfp8_e4m3", 1, "rceil"), _ref_q(w[i], "mxfp8_e4m3", 0, "rceil")
            _assert_close(got[a:b], qx @ qw, qx, qw, K)


@pytest.mark.slow  # left out of the quick tier (seconds; its paths run in other quick tests)
def test_output_dtype_follows_lax_ragged_dot():
    x, w, _, gs = _operands()

    @jax.jit  # one program for every call below (each alone compiles its own)
    def run(x, w):
        xb, wb = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
        return (NVIDIA_MXFP8.ragged_dot(xb, wb, gs), lax.ragged_dot(xb, wb, gs),
                NVIDIA_MXFP8.ragged_dot(xb, w, gs),
                NVIDIA_MXFP8.ragged_dot(xb, wb, gs, preferred_element_type=jnp.float32),
                _grads(lambda a, b: NVIDIA_MXFP8.ragged_dot(a, b, gs), xb, wb,
                       jnp.ones((M, N), jnp.bfloat16)),
                Recipe().ragged_dot(x, w, gs),
                lax.ragged_dot(x, w, gs, precision=lax.Precision.HIGHEST))

    yb, lax_b, mixed, y, (gl, gr), got, want = run(x, w)
    assert yb.dtype == lax_b.dtype == jnp.bfloat16
    assert mixed.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(yb), np.asarray(y.astype(jnp.bfloat16)))
    assert (gl.dtype, gr.dtype) == (jnp.bfloat16, jnp.bfloat16)
    # Operands left as they are (no format): the ragged dot of the values themselves.
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


# -- backward ------------------------------------------------------------------------------------

QUANTIZED_RECIPES = [
    NVIDIA_MXFP8,  # rceil, E4M3 everywhere
    OCP_MXFP8,  # floor, E5M2 gradients
    Recipe(forward="mxfp4", grad="mxfp8_e4m3", backward_operands="mxfp8",
           scale_options={"scale_rule": "rceil"}),
    Recipe(forward="mxfp8", grad=lowprec.mx_format("mxfp4", block_size=16),
           scale_options={"scale_rule": "even"}),
    Recipe(forward="nvfp4", grad="nvfp4"),  # 16-element blocks, tensor scales per group
]


@pytest.mark.parametrize("recipe", QUANTIZED_RECIPES, ids=lambda r: r.name or r.describe())
@pytest.mark.quick_first(1)
def test_quantized_backward_blocks_each_group_along_its_own_tokens(recipe):
    x, w, g, gs = _operands()
    _, gl, gr = _run(recipe)
    assert gl.shape == x.shape and gr.shape == w.shape
    bl, br = recipe.backward_operands
    rule = recipe.options_of(lowprec.mx_format("mxfp8")).scale_rule.value
    for i, (a, b) in enumerate(_groups(SIZES)):
        if a == b:  # an expert without tokens gets no gradient
            assert np.all(np.asarray(gr[i]) == 0)
            continue
        # grad_lhs: the cotangent rows and the expert's weight blocked along N.
        qg, qw = _ref_q(g[a:b], recipe.grad, 1, rule), _ref_q(w[i], br, 1, rule)
        _assert_close(gl[a:b], qg @ qw.T, qg, qw.T, N)
        # grad_rhs: the group's tokens and cotangent blocked along its own tokens.
        qx, qg = _ref_q(x[a:b], bl, 0, rule), _ref_q(g[a:b], recipe.grad, 0, rule)
        _assert_close(gr[i], qx.T @ qg, qx.T, qg, b - a)
    assert np.all(np.asarray(gl[sum(SIZES):]) == 0)


@pytest.mark.slow  # seconds; the ragged backward runs in the quick quantized case above
def test_ste_backward_is_the_float_gradient_of_the_quantized_forward():
    x, w, g, gs = _operands()
    _, gl, gr = _run(Recipe(forward="mxfp8", scale_options={"scale_rule": "rceil"}))
    g64 = np.asarray(g, np.float64)
    for i, (a, b) in enumerate(_groups(SIZES)):
        qw = _ref_q(w[i], "mxfp8_e4m3", 0, "rceil")  # the forward's: along K
        _assert_close(gl[a:b], g64[a:b] @ qw.T, g64[a:b], qw.T, N)
        qx = _ref_q(x[a:b], "mxfp8_e4m3", 1, "rceil") if a < b else np.zeros((0, K))
        _assert_close(gr[i], qx.T @ g64[a:b], qx.T, g64[a:b], max(b - a, 1))
    assert np.all(np.asarray(gl[sum(SIZES):]) == 0)


@pytest.mark.slow  # left out of the quick tier (seconds; its paths run in other quick tests)
def test_high_precision_wgrad_is_the_float32_weight_gradient():
    x, w, g, gs = _operands()
    _, gl, gr = _run(dataclasses.replace(NVIDIA_MXFP8, high_precision_wgrad=True))
    np.testing.assert_array_equal(gl, _run(NVIDIA_MXFP8)[1])  # grad_lhs unchanged
    x64, g64 = np.asarray(x, np.float64), np.asarray(g, np.float64)
    for i, (a, b) in enumerate(_groups(SIZES)):
        _assert_close(gr[i], x64[a:b].T @ g64[a:b], x64[a:b].T, g64[a:b], max(b - a, 1))


@pytest.mark.slow  # left out of the quick tier (seconds; its paths run in other quick tests)
def test_tensor_scaled_backward_is_per_group():
    x, w, g, gs = _operands()
    _, gl, gr = _run(FP8_HYBRID)
    for i, (a, b) in enumerate(_groups(SIZES)):
        if a == b:
            continue
        qx, qw, qg = _ref_scaled(x[a:b], "e4m3"), _ref_scaled(w[i], "e4m3"), _ref_scaled(g[a:b], "e5m2")
        _assert_close(gl[a:b], qg @ qw.T, qg, qw.T, N)
        _assert_close(gr[i], qx.T @ qg, qx.T, qg, b - a)


@pytest.mark.parametrize("recipe", [NVIDIA_MXFP8, FP8_HYBRID], ids=lambda r: r.name)
@pytest.mark.slow  # left out of the quick tier (seconds; its paths run in other quick tests)
def test_each_group_is_the_recipes_dot_general(recipe):
    # The contract in one line: group g's output and gradients are those of
    # recipe.dot_general on its tokens and weight alone (within float32 summation order).
    # The ragged side is the recipe's shared program (_run); a group's own dot runs on its
    # tokens zero-padded to 64 rows, so that every group shares one compile (zero tokens
    # change no amax, no row's K-blocks, and no 32-token block of the weight gradient: the
    # recipe zero-pads the last one itself).
    x, w, g, gs = _operands()
    dense = jax.jit(lambda a, b, c: _forward_and_grads(
        lambda p, q: recipe.dot_general(p, q, DN), a, b, c))
    y, gl, gr = _run(recipe)
    for i, (a, b) in enumerate(_groups(SIZES)):
        if a == b:
            continue
        yi, gli, gri = (np.asarray(v) for v in dense(
            _padded_rows(x[a:b], 64), w[i], _padded_rows(g[a:b], 64)))
        assert not np.any(yi[b - a:]) and not np.any(gli[b - a:])  # the zero tokens' rows
        xa, wi, ga = (np.asarray(v, np.float64) for v in (x[a:b], w[i], g[a:b]))
        _assert_same_sums(y[a:b], yi[:b - a], xa, wi, K)
        _assert_same_sums(gl[a:b], gli[:b - a], ga, wi.T, N)
        _assert_same_sums(gr[i], gri, xa.T, ga, b - a)


def _forward_and_grads(fn, a, b, c):
    out, vjp = jax.vjp(fn, a, b)
    return (out, *vjp(c))


def _padded_rows(v, rows):
    """``v`` with zero rows appended up to ``rows``."""
    v = np.asarray(v, np.float32)
    return np.pad(v, ((0, rows - v.shape[0]), (0, 0)))


NVFP4_RN = dataclasses.replace(lowprec.NVIDIA_NVFP4, grad_rounding="nearest_even")
NVFP4_SHAPES = dict(sizes=(13, 0, 20), m=40, k=32, n=24)  # 7 rows in no group; N padded to 32


@pytest.fixture(scope="module")
def nvfp4_rn():
    """Operands and NumPy (output, grad_lhs, grad_rhs) of the round-to-nearest NVFP4
    recipe's ragged dot, one jitted program (op by op, each product compiled ~900 small
    programs) shared by the two NVFP4 tests below."""
    x, w, g, gs = _operands(**NVFP4_SHAPES, seed=5)
    step = jax.jit(lambda a, b, c: _forward_and_grads(
        lambda p, q: NVFP4_RN.ragged_dot(p, q, gs), a, b, c))
    return (x, w, g, gs), tuple(np.asarray(v) for v in step(x, w, g))


@pytest.mark.slow  # ~10 s of NVFP4 compiles on 2 shared cores; the quick tier has the MX cases
def test_nvfp4_recipe_each_group_is_the_recipes_dot_general(nvfp4_rn):
    # NVIDIA_NVFP4.ragged_dot (issue 35 item 7): group g's output and gradients are those of
    # NVIDIA_NVFP4.dot_general on its tokens and expert alone — 16 x 16 weight tiles per
    # expert, per-group tensor scales, the Hadamard transform and 16-blocks of the weight
    # gradient's operands along each group's own tokens — within float32 summation order.
    # Round-to-nearest cotangents here (stochastic words are drawn for the whole cotangent,
    # so they differ from a group's own dot; the next test covers them).
    recipe = NVFP4_RN
    sizes, m, k, n = (NVFP4_SHAPES[v] for v in ("sizes", "m", "k", "n"))
    (x, w, g, gs), (y, gl, gr) = nvfp4_rn

    # A group's own dot runs on its tokens zero-padded to 32 rows, so that every group shares
    # one compile: zero tokens leave its tensor scales (amaxes), its rows' K-blocks, and its
    # 16-token blocks (the recipe zero-pads them itself; RHT maps zeros to zeros) as they are.
    @jax.jit
    def dense(a, b, c):
        out, vjp = jax.vjp(lambda p, q: recipe.dot_general(p, q, DN), a, b)
        # The weight gradient multiplies the transformed tokens and cotangent (M x, M g).
        signs = nt.recipe_rht_signs(recipe)
        return (out, *vjp(c), nt.rht(a, signs), nt.rht(c, signs))

    for i, (a, b) in enumerate(_groups(sizes, m)):
        if a == b:
            assert not np.any(np.asarray(gr[i]))  # no tokens: no weight gradient
            continue
        yi, gli, gri, mx, mg = (np.asarray(v, np.float64) for v in dense(
            _padded_rows(x[a:b], 32), w[i], _padded_rows(g[a:b], 32)))
        assert not np.any(yi[b - a:]) and not np.any(gli[b - a:])  # the zero tokens' rows
        xa, wi, ga = (np.asarray(v, np.float64) for v in (x[a:b], w[i], g[a:b]))
        _assert_same_sums(y[a:b], yi[:b - a], xa, wi, k)
        _assert_same_sums(gl[a:b], gli[:b - a], ga, wi.T, n)
        # Summed over the group's tokens padded to whole 16-blocks (the rest are zeros).
        _assert_same_sums(gr[i], gri, mx.T, mg, -((a - b) // 16) * 16)
    rest = slice(sum(sizes), m)
    assert not np.any(np.asarray(y[rest])) and not np.any(np.asarray(gl[rest]))


@pytest.mark.slow  # NVFP4 compiles (seconds)
def test_nvfp4_recipe_stochastic_rounding_is_keyed(nvfp4_rn):
    # Stochastic rounding of the cotangent only: the forward is the round-to-nearest
    # recipe's bit for bit; inside stochastic_rounding_key a key gives the same gradients
    # every time and another key others.
    (x, w, g, gs), (y_rn, gl_rn, gr_rn) = nvfp4_rn

    def grads(key):
        with lowprec.stochastic_rounding_key(key):
            y, vjp = jax.vjp(lambda a, b: lowprec.NVIDIA_NVFP4.ragged_dot(a, b, gs), x, w)
            return (y, *vjp(g))

    step = jax.jit(grads)
    y1, gl1, gr1 = step(jax.random.key(1))
    assert_bits_equal(y1, y_rn)
    assert not np.array_equal(np.asarray(gl1), gl_rn)  # the cotangent was rounded otherwise
    for v, u in zip((gl1, gr1), step(jax.random.key(1))[1:]):
        assert_bits_equal(v, u)
    gl2, gr2 = step(jax.random.key(2))[1:]
    assert not np.array_equal(np.asarray(gl1), np.asarray(gl2))
    assert not np.array_equal(np.asarray(gr1), np.asarray(gr2))


@pytest.mark.slow  # left out of the quick tier (seconds; its paths run in other quick tests)
def test_jit_grad_and_traced_group_sizes_agree_bitwise():
    x, w, g, gs = _operands()

    def loss(a, b, sizes):
        return jnp.sum(NVIDIA_MXFP8.ragged_dot(a, b, sizes) * g)

    eager = jax.grad(loss, argnums=(0, 1))(x, w, gs)
    jitted_grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
    jitted = jitted_grad(x, w, gs)
    for e, j in zip(eager, jitted):
        np.testing.assert_array_equal(np.asarray(e), np.asarray(j))
    # Other sizes through the same trace (one compile: the sizes are an argument).
    other = jnp.asarray((0, 40, 0, 40), jnp.int32)
    got = jitted_grad(x, w, other)
    want = jax.grad(loss, argnums=(0, 1))(x, w, other)
    for e, j in zip(want, got):
        np.testing.assert_array_equal(np.asarray(e), np.asarray(j))
    remat = jax.grad(jax.checkpoint(loss), argnums=(0, 1))(x, w, gs)
    for e, r in zip(eager, remat):
        np.testing.assert_array_equal(np.asarray(e), np.asarray(r))


# -- lowprec.ragged_dot ---------------------------------------------------------------------------


@pytest.mark.slow  # left out of the quick tier (seconds; its paths run in other quick tests)
def test_public_ragged_dot_quantizes_like_dot_general():
    x, w, g, gs = _operands(k=96, n=64)
    y, gl, gr = (np.asarray(v) for v in jax.jit(lambda a, b, c: _forward_and_grads(
        lambda p, q: lowprec.ragged_dot(
            p, q, gs, lhs_format="mxfp8_e4m3", rhs_format="mxfp4", scale_rule="rceil",
            backward="quantized", grad_format="mxfp8_e5m2"), a, b, c))(x, w, g))
    for i, (a, b) in enumerate(_groups(SIZES)):
        if a == b:
            continue
        qx, qw = _ref_q(x[a:b], "mxfp8_e4m3", 1, "rceil"), _ref_q(w[i], "mxfp4", 0, "rceil")
        _assert_close(y[a:b], qx @ qw, qx, qw, 96)
        qg, qw = _ref_q(g[a:b], "mxfp8_e5m2", 1, "rceil"), _ref_q(w[i], "mxfp4", 1, "rceil")
        _assert_close(gl[a:b], qg @ qw.T, qg, qw.T, 64)
        qx, qg = _ref_q(x[a:b], "mxfp8_e4m3", 0, "rceil"), _ref_q(g[a:b], "mxfp8_e5m2", 0, "rceil")
        _assert_close(gr[i], qx.T @ qg, qx.T, qg, b - a)


# -- errors --------------------------------------------------------------------------------------


@pytest.mark.parametrize("call,exc,match", [
    (lambda x, w, gs: NVIDIA_MXFP8.ragged_dot(x, w, gs, group_offset=jnp.array([1])),
     NotImplementedError, "group_offset .* is not supported"),
    (lambda x, w, gs: NVIDIA_MXFP8.ragged_dot(x[None], w, gs), ValueError,
     r"takes lhs \[M, K\] .* rhs \[G, K, N\] .* got shapes \(1, 80, 80\)"),
    (lambda x, w, gs: NVIDIA_MXFP8.ragged_dot(x[:, :64], w, gs), ValueError,
     "lhs has K = 64 features but rhs has K = 80"),
    (lambda x, w, gs: NVIDIA_MXFP8.ragged_dot(x, w, gs[:3]), ValueError,
     r"group_sizes must have shape \(4,\)"),
    (lambda x, w, gs: NVIDIA_MXFP8.ragged_dot(x, w, gs.astype(jnp.float32)), TypeError,
     "group_sizes must be an integer array"),
    (lambda x, w, gs: NVIDIA_MXFP8.ragged_dot(x, w, jnp.array([10, -1, 5, 5])), ValueError,
     r"non-negative, got \[10, -1, 5, 5\]"),
    (lambda x, w, gs: NVIDIA_MXFP8.ragged_dot(x.astype(jnp.int32), w, gs), TypeError,
     "lhs must be a float32, bfloat16 or float16 array, got dtype int32"),
    (lambda x, w, gs: NVIDIA_MXFP8.ragged_dot(lowprec.quantize_mx(x, "mxfp8", pad=True), w, gs),
     TypeError, "lhs is an MXArray"),
    (lambda x, w, gs: NVIDIA_MXFP8.ragged_dot(x, w, gs, preferred_element_type=jnp.int8),
     TypeError, "output dtype must be float32, bfloat16 or float16, got int8"),
    (lambda x, w, gs: dataclasses.replace(lowprec.NVIDIA_NVFP4, four_over_six=True).ragged_dot(
        x, w, gs), ValueError, "ragged_dot does not implement four_over_six"),
    (lambda x, w, gs: dataclasses.replace(NVIDIA_MXFP8, pad=False).ragged_dot(x, w, gs),
     ValueError, "K = 80 is not a multiple of the mxfp8_e4m3 block size 32; pass pad=True"),
    (lambda x, w, gs: lowprec.ragged_dot(x, w, gs, lhs_format="mxfp8"), ValueError,
     "K = 80 is not a multiple"),
    (lambda x, w, gs: lowprec.ragged_dot(x, w, gs, lhs_format="mxfp9"), ValueError,
     "unknown lhs_format 'mxfp9'"),
    (lambda x, w, gs: lowprec.ragged_dot(x, w, gs, grad_format="e5m2"), ValueError,
     "grad_format is only used with backward='quantized'"),
])
def test_bad_calls_raise_clear_errors(call, exc, match):
    x, w, _, gs = _operands()
    with pytest.raises(exc, match=match):
        call(x, w, gs)


@pytest.mark.slow  # left out of the quick tier (seconds; its paths run in other quick tests)
def test_backward_needs_whole_blocks_along_n_without_pad():
    x, w, g, gs = _operands(k=64)  # K fits, N = 40 does not
    fn = lambda a, b: lowprec.ragged_dot(a, b, gs, lhs_format="mxfp8", rhs_format="mxfp8",  # noqa: E731
                                         backward="quantized", grad_format="mxfp8")
    # Both checked as they are traced (eval_shape: nothing compiled).
    assert jax.eval_shape(fn, x, w).shape == (M, N)  # the forward is fine
    with pytest.raises(ValueError, match=r"grad_lhs \(reduces over N\), cotangent: N = 40"):
        jax.eval_shape(lambda a, b: _grads(fn, a, b, g), x, w)


# -- sharding ------------------------------------------------------------------------------------
#
# The sharded ragged dot (tokens, output features and experts split; expert parallel on
# Explicit axes) runs with the other sharding checks on 4 CPU devices, in the one subprocess
# of tests/test_sharding.py: tests/sharded_cases.py,
# test_mxfp8_ragged_dot_layouts_within_the_summation_bound.
