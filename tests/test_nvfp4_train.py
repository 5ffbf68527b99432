"""The NVFP4 training recipe (lowprec.NVIDIA_NVFP4) against a NumPy statement of its steps.

The statement below is written from the recipe's description (lowprec/_nvfp4_train.py's
docstring: NVIDIA arXiv 2509.25149 / Transformer Engine NVFP4BlockScaling) with the
independent reference's NVFP4 quantizer (``lowprec_reference.quantize_nvfp4``: exact
rational rounding) for 16-element blocks, and NumPy float32 arithmetic for the 16 x 16 weight
tiles and the Hadamard butterfly. Every quantized operand must equal it bit for bit; each
GEMM (a float32 dot in lowprec, a float64 one here) within 2·K·2^-23·Σ|a b| (float32
accumulation plus one product rounding per term). The random words are the recipe's
documented contract (lowprec.random_bits of keys folded from the seed and the cotangent, or
inside lowprec.stochastic_rounding_key from that key and the dot's index).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import lowprec
import lowprec.kernels
import lowprec_reference as ref
from lowprec_reference import four_bit as R4
from lowprec import _nvfp4_train as nt

from helpers.asserts import assert_bits_equal, bit_pattern
from helpers.codecs import reference_words

DN = (((1,), (0,)), ((), ()))
E4M3_EPS, E4M3_MAX = np.float32(2.0**-6), np.float32(448.0)


def np_q1(v, axis, words=None):
    """NVFP4 values of v blocked along axis (reference quantizer), float32."""
    rounding = "nearest_even" if words is None else "stochastic"
    words = None if words is None else reference_words(words)  # the reference's 32-bit form
    e, s, ts = ref.quantize_nvfp4(np.asarray(v, np.float32), axis=axis, rounding=rounding,
                                  random_bits=words)
    return ref.dequantize_mx(e, s, "nvfp4", axis=axis, tensor_scale=ts).astype(np.float32)


def np_q2(w):
    """NVFP4 values of w [R, C] with one E4M3 scale per 16 x 16 tile (from the tile amax)."""
    w = np.asarray(w, np.float32)
    ts = ref.nvfp4_tensor_scale(w)
    out = np.empty_like(w)
    with np.errstate(all="ignore"):
        for i in range(0, w.shape[0], 16):
            for j in range(0, w.shape[1], 16):
                tile = w[i:i + 16, j:j + 16]
                amax = np.float32(np.abs(tile).max())
                s = np.float32(np.float32(amax / np.float32(6)) / ts)
                s = min(max(s, E4M3_EPS), E4M3_MAX)
                total = np.float32(ts * np.float32(ref.decode("e4m3", ref.encode("e4m3", np.array([s])))[0]))
                q = (tile / total).astype(np.float32)
                codes = ref.encode("e2m1", q, "nearest_even", "saturate")
                out[i:i + 16, j:j + 16] = (ref.decode("e2m1", codes).astype(np.float32) * total)
    return out


def np_q_tiles(w, tile, step="divide"):
    """NVFP4 values of w [R, C] with one E4M3 scale per ``tile`` (rows, cols) from its amax:
    (1, 16) blocks along C, (16, 1) along R, (16, 16) the weight tiles. ``step``: the element
    step, x / float32(ts * s) ("divide") or x * float32(float32(1 / ts) / s) ("reciprocal",
    Transformer Engine's and torchao >= 0.17's), every step a NumPy float32 operation."""
    w = np.asarray(w, np.float32)
    ts = ref.nvfp4_tensor_scale(w)
    out = np.empty_like(w)
    tr, tc = tile
    with np.errstate(all="ignore"):
        for i in range(0, w.shape[0], tr):
            for j in range(0, w.shape[1], tc):
                blk = w[i:i + tr, j:j + tc]
                amax = np.float32(np.abs(blk).max())
                s = np.float32(np.float32(amax / np.float32(6)) / ts)
                s = min(max(s, E4M3_EPS), E4M3_MAX)
                s = np.float32(ref.decode("e4m3", ref.encode("e4m3", np.array([s])))[0])
                total = np.float32(ts * s)
                if step == "reciprocal":
                    q = (blk * np.float32(np.float32(np.float32(1) / ts) / s)).astype(np.float32)
                else:
                    q = (blk / total).astype(np.float32)
                codes = ref.encode("e2m1", q, "nearest_even", "saturate")
                out[i:i + tr, j:j + tc] = ref.decode("e2m1", codes).astype(np.float32) * total
    return out


def np_rht(v, signs):
    """M v along axis 0 in 16-blocks: signs, the Walsh-Hadamard butterfly, then 1/4."""
    v = np.asarray(v, np.float32)
    t, c = v.shape
    b = (v.reshape(t // 16, 16, c) * signs[None, :, None]).astype(np.float32)
    h = 1
    while h < 16:
        b = b.reshape(t // 16, 16 // (2 * h), 2, h, c)
        lo, hi = b[:, :, 0], b[:, :, 1]
        b = np.stack([lo + hi, lo - hi], axis=2).astype(np.float32)
        h *= 2
    return (b.reshape(t, c) * np.float32(0.25)).astype(np.float32)


def np_words(g, seed):
    """The contract's words: h = wrapping uint32 sum of g's bits, k = fold_in(key(seed), h)."""
    h = int(bit_pattern(np.asarray(g, np.float32)).astype(np.uint64).sum() % 2**32)
    k = jax.random.fold_in(jax.random.key(seed), np.uint32(h))
    return [np.asarray(lowprec.random_bits(jax.random.fold_in(k, i), g.shape)) for i in (0, 1)]


def np_keyed_words(key, index, shape):
    """The contract's words inside stochastic_rounding_key(key), for its index-th dot."""
    k = jax.random.fold_in(key, index)
    return [np.asarray(lowprec.random_bits(jax.random.fold_in(k, i), shape)) for i in (0, 1)]


def _within(got, a, b):
    a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
    exact = a64 @ b64
    bound = 2 * a64.shape[1] * 2.0**-23 * (np.abs(a64) @ np.abs(b64)) + 1e-30
    assert np.all(np.abs(np.asarray(got, np.float64) - exact) <= bound)


def _data(t=32, k=32, n=16, seed=0):
    # NumPy: jax.random run op by op compiles its programs anew for every shape.
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((t, k)) * np.exp2(rng.integers(-3, 4, (t, k)))
    w = rng.standard_normal((k, n)) / 4
    c = rng.standard_normal((t, n))
    return x.astype(np.float32), w.astype(np.float32), c.astype(np.float32)


@pytest.mark.slow  # ~10 s on 2 shared cores (the exact-rational reference)
def test_building_blocks_bit_exact():
    x, w, _ = _data()
    q2 = jax.jit(nt.quantize_2d)
    assert_bits_equal(q2(jnp.asarray(w.T)), np_q2(w.T))
    signs = np.asarray(nt.rht_signs(5))
    assert set(signs.tolist()) <= {-1.0, 1.0} and len(signs) == 16
    got = np.asarray(jax.jit(nt.rht)(jnp.asarray(x), jnp.asarray(signs)))
    assert_bits_equal(got, np_rht(x, signs))
    # M is orthogonal: (M x)^T (M x) = x^T x up to rounding.
    np.testing.assert_allclose(got.T.astype(np.float64) @ got, x.T.astype(np.float64) @ x,
                               rtol=1e-5, atol=1e-4)
    # A 2-D-scaled weight reads the same along either axis (one weight for fwd and dgrad).
    np.testing.assert_array_equal(np.asarray(q2(jnp.asarray(w))).T, np.asarray(q2(jnp.asarray(w.T))))


@pytest.mark.slow
@pytest.mark.parametrize("recipe_kw,keyed", [
    ({}, False),  # NVIDIA_NVFP4 itself, words hashed from the cotangent
    ({}, True),  # ... inside stochastic_rounding_key: words from the key
    (dict(wgrad_rht=False, weight_block_2d=False, grad_rounding="nearest_even"), False),  # plain
])
def test_recipe_matches_the_numpy_statement(recipe_kw, keyed):
    base = lowprec.NVIDIA_NVFP4
    recipe = lowprec.Recipe(forward="nvfp4", grad="nvfp4", seed=base.seed, **{
        "weight_block_2d": True, "wgrad_rht": True, "grad_rounding": "stochastic", **recipe_kw})
    x, w, c = _data()  # T = 32, K = 32, N = 16: multiples of 16, no padding
    loss = lambda a, b: jnp.sum(recipe.dot_general(a, b, DN) * c)
    key = jax.random.key(77)

    def grads(a, b, k):
        if not keyed:
            return jax.grad(loss, argnums=(0, 1))(a, b)
        with lowprec.stochastic_rounding_key(k):
            return jax.grad(loss, argnums=(0, 1))(a, b)

    # One program for the output and both gradients.
    step = jax.jit(lambda a, b, k: (recipe.dot_general(a, b, DN), *grads(a, b, k)))
    y, gx, gw = (np.asarray(v) for v in step(x, w, key))
    # The statement.
    xq = np_q1(x, 1)
    wq = np_q2(w.T).T if recipe.weight_block_2d else np_q1(w, 0)
    _within(y, xq, wq)
    wd, ww = (None, None)
    if recipe.grad_rounding == "stochastic":
        wd, ww = np_keyed_words(key, 0, c.shape) if keyed else np_words(c, recipe.seed)
    # Without 2-D scales the weight is re-quantized along N for grad_x (lowprec's quantized
    # backward); with them, the forward's quantized weight is the backward's.
    wq_d = wq if recipe.weight_block_2d else np_q1(w, 1)
    _within(gx, np_q1(c, 1, wd), wq_d.T)
    xr, gr = x, c
    if recipe.wgrad_rht:
        signs = 1.0 - 2.0 * (np.asarray(lowprec.random_bits(jax.random.key(recipe.seed), (16,))) & 1)
        xr, gr = np_rht(x, signs.astype(np.float32)), np_rht(c, signs.astype(np.float32))
    _within(gw, np_q1(xr, 0).T, np_q1(gr, 0, ww))


@pytest.mark.slow
def test_padding_and_weight_layouts():
    # T, K, N not multiples of 16 (zero padding), the weight as [N, K], and leading dims.
    x, w, c = _data(t=20, k=24, n=8, seed=3)
    r = lowprec.NVIDIA_NVFP4
    x3 = x.reshape(4, 5, 24)
    y = jax.jit(lambda a, b: r.dot_general(a, b, (((2,), (0,)), ((), ()))))(x3, w)
    y_t = jax.jit(lambda a, b: r.dot_general(a, b, (((2,), (1,)), ((), ()))))(x3, w.T)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(y_t))
    xp = np.pad(x, ((0, 12), (0, 8)))
    wp = np.pad(w, ((0, 8), (0, 8)))
    _within(np.asarray(y).reshape(20, 8), np_q1(xp, 1)[:20], np_q2(wp.T).T[:, :8])
    g = jax.jit(jax.grad(lambda a, b: jnp.sum(r.dot_general(a, b, (((2,), (1,)), ((), ()))) ** 2),
                         argnums=(0, 1)))(jnp.asarray(x3), jnp.asarray(w.T))
    assert g[0].shape == x3.shape and g[1].shape == w.T.shape
    assert all(bool(jnp.all(jnp.isfinite(v))) for v in g)


@pytest.mark.parametrize("form", ["qkv", "qkv_nk", "out"])
@pytest.mark.quick_first(1)
def test_dense_general_weights_are_their_2d_matrix(form):
    # The documented layer view: a DenseGeneral weight is the 2-D matrix of its contracting
    # axes (K) by its other axes (N), each flattened in order, and x's contracting axes are
    # flattened alike. So the dot, and both gradients, equal the 2-D recipe's on those
    # reshapes bit for bit (same quantized operands, same tiles, same words, same GEMMs).
    r = lowprec.NVIDIA_NVFP4
    rng = np.random.default_rng(31)
    normal = lambda shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    b, s, d, heads, hd = 2, 16, 32, 2, 16
    if form == "out":  # attention's output projection: [B, S, H, hd] . [H, hd, D]
        x = normal((b, s, heads, hd))
        w = normal((heads, hd, d)) / 4
        dn = (((2, 3), (0, 1)), ((), ()))
        x2, w2, dn2 = x.reshape(b, s, heads * hd), w.reshape(heads * hd, d), (((2,), (0,)), ((), ()))
        out_shape = (b, s, d)
    else:  # q/k/v: [B, S, D] . [D, H, hd], or the weight stored [H, hd, D]
        x = normal((b, s, d))
        w = normal((d, heads, hd)) / 4
        x2, w2, dn2 = x, w.reshape(d, heads * hd), (((2,), (0,)), ((), ()))
        dn = (((2,), (0,)), ((), ()))
        if form == "qkv_nk":
            w, dn = np.transpose(w, (1, 2, 0)), (((2,), (2,)), ((), ()))
            w2, dn2 = w.reshape(heads * hd, d), (((2,), (1,)), ((), ()))
        out_shape = (b, s, heads, hd)
    c = normal(out_shape)
    grad = lambda f: jax.jit(jax.value_and_grad(f, argnums=(0, 1)))
    _, (gx, gw) = grad(lambda a, v: jnp.sum(r.dot_general(a, v, dn) * c))(x, w)
    _, (gx2, gw2) = grad(lambda a, v: jnp.sum(r.dot_general(a, v, dn2) * c.reshape(
        *out_shape[:2], -1)))(x2, w2)
    fwd = jax.jit(lambda a, v, dn_: r.dot_general(a, v, dn_), static_argnums=2)
    np.testing.assert_array_equal(np.asarray(fwd(x, w, dn)).reshape(b, s, -1),
                                  np.asarray(fwd(x2, w2, dn2)))
    np.testing.assert_array_equal(np.asarray(gx).reshape(x2.shape), np.asarray(gx2))
    np.testing.assert_array_equal(np.asarray(gw).reshape(w2.shape), np.asarray(gw2))
    assert gx.shape == x.shape and gw.shape == w.shape


@pytest.mark.slow  # left out of the quick tier (seconds; its paths run in other quick tests)
def test_stochastic_rounding_words_hashed_or_keyed():
    # One cotangent element moved by one ulp, as another summation order moves it (a
    # data-parallel run on another number of devices). Hashed words (no key) all change:
    # every element's rounding is redrawn, so the gradients differ throughout. Keyed words
    # (stochastic_rounding_key) stay: only what that element touches can change, its row of
    # grad_x (g blocked along N) and its column of grad_w (g blocked along tokens).
    x, w, c = _data()  # T = 32, N = 16
    t0, n0 = 5, 3
    assert abs(c[t0, n0]) < np.abs(c).max()  # not the amax: the tensor scale stays
    c2 = c.copy()
    c2[t0, n0] = np.nextafter(c[t0, n0], np.float32(np.inf))
    r = lowprec.NVIDIA_NVFP4
    loss = lambda a, b, cc: jnp.sum(r.dot_general(a, b, DN) * cc)

    def grads(cc, key, keyed):
        if not keyed:
            return jax.grad(loss, argnums=(0, 1))(x, w, cc)
        with lowprec.stochastic_rounding_key(key):
            return jax.grad(loss, argnums=(0, 1))(x, w, cc)

    key = jax.random.key(9)
    for keyed in (False, True):
        f = jax.jit(functools.partial(grads, keyed=keyed))
        (gx, gw), (gx2, gw2) = f(c, key), f(c2, key)
        np.testing.assert_array_equal(np.asarray(f(c, key)[0]), np.asarray(gx))  # reproducible
        rows_same = np.all(np.asarray(gx) == np.asarray(gx2), axis=1)
        cols_same = np.all(np.asarray(gw) == np.asarray(gw2), axis=0)
        if keyed:
            assert rows_same[np.arange(32) != t0].all() and cols_same[np.arange(16) != n0].all()
        else:
            assert rows_same.mean() < 0.5 and cols_same.mean() < 0.5
    # Other keys (steps), other words.
    assert not np.array_equal(np.asarray(f(c, jax.random.key(10))[0]), np.asarray(gx))


# Transformer Engine's source, as data: its fixed sign vector of the NVFP4 weight-gradient
# RHT (transformer_engine/jax/quantize/hadamard.py, get_wgrad_sign_vector; the same in its
# PyTorch module), and its RHT matrix diag(s) @ H16 / sqrt(16), applied to each 16 consecutive
# values v as the row vector v @ matrix.
TE_WGRAD_SIGNS = [1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1]


def test_te_rht_signs_are_transformer_engines():
    signs = np.asarray(nt.recipe_rht_signs(
        dataclasses.replace(lowprec.NVIDIA_NVFP4, rht_signs="transformer_engine")))
    np.testing.assert_array_equal(signs, np.asarray(TE_WGRAD_SIGNS, np.float32))
    # The transform is TE's matrix: v @ (diag(s) H / 4) for each block of 16 tokens (exact
    # here: small integers times 1/4 and their sums are float32 numbers).
    h = np.array([[1.0]])
    while h.shape[0] < 16:
        h = np.block([[h, h], [h, -h]])  # Sylvester's construction (scipy.linalg.hadamard)
    te_matrix = np.diag(TE_WGRAD_SIGNS) @ h / 4
    v = np.arange(-48, 48, dtype=np.float32).reshape(32, 3)  # [tokens, features]
    got = np.asarray(nt.rht(jnp.asarray(v), jnp.asarray(signs)))
    want = np.concatenate([(v[i:i + 16].T @ te_matrix).T for i in (0, 16)])
    np.testing.assert_array_equal(got, want.astype(np.float32))
    # Own signs: 16 ints ±1, kept as given.
    own = tuple(int(s) for s in -signs)
    r = dataclasses.replace(lowprec.NVIDIA_NVFP4, rht_signs=own)
    np.testing.assert_array_equal(np.asarray(nt.recipe_rht_signs(r)), -signs)


@pytest.fixture(scope="module")
def te_grads():
    """The NVFP4 recipe with Transformer Engine's options (gradients rounded to nearest, so
    that the statement needs no random words), on [batch, seq, d] activations."""
    recipe = dataclasses.replace(lowprec.NVIDIA_NVFP4, grad_rounding="nearest_even",
                                 **nt.TE_NVFP4_OPTIONS)
    x, w, c = _data()
    dn = (((2,), (0,)), ((), ()))
    x3, c3 = x.reshape(2, 16, 32), c.reshape(2, 16, 16)
    y = jax.jit(lambda a, b: recipe.dot_general(a, b, dn))(x3, w)
    loss = lambda a, b: jnp.sum(recipe.dot_general(a, b, dn) * c3)
    gx, gw = jax.jit(jax.grad(loss, argnums=(0, 1)))(x3, w)
    return recipe, (x, w, c), [np.asarray(v).reshape(-1, v.shape[-1]) for v in (y, gx, gw)]


@pytest.mark.slow  # NVFP4 compiles (seconds); the recipe's module runs in the quick tests above
def test_te_options_match_the_numpy_statement(te_grads):
    # nvfp4_step="reciprocal" in every quantization (1-D blocks and 16 x 16 tiles), TE's
    # signs, and the transform in bfloat16: operands and result rounded to nearest even
    # (ml_dtypes), as TE's bfloat16 GEMM with its bfloat16 matrix gives.
    recipe, (x, w, c), (y, gx, gw) = te_grads
    assert "reciprocal NVFP4 step" in recipe.describe() and "bfloat16 RHT" in recipe.describe()
    wq = np_q_tiles(w.T, (16, 16), "reciprocal").T
    _within(y, np_q_tiles(x, (1, 16), "reciprocal"), wq)
    _within(gx, np_q_tiles(c, (1, 16), "reciprocal"), wq.T)
    bf16 = lambda v: np.asarray(v, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)
    signs = np.asarray(TE_WGRAD_SIGNS, np.float32)
    xr, cr = bf16(np_rht(bf16(x), signs)), bf16(np_rht(bf16(c), signs))
    _within(gw, np_q_tiles(xr, (16, 1), "reciprocal").T, np_q_tiles(cr, (16, 1), "reciprocal"))


@pytest.mark.parametrize("override", ["high_precision", "dequantized"])
def test_backward_override_of_the_nvfp4_recipe(override):
    # TE's backward_override with its NVFP4 recipe: the backward products are float32 dots of
    # the unquantized cotangent and of the operands unquantized ("high_precision") or as the
    # forward read them ("dequantized": Q(x) along K, the 16 x 16-tiled weight).
    recipe = dataclasses.replace(lowprec.NVIDIA_NVFP4, backward_override=override)
    assert f"{override} backward" in recipe.describe()
    x, w, c = _data()
    loss = lambda a, b: jnp.sum(recipe.dot_general(a, b, DN) * c)
    gx, gw = (np.asarray(v) for v in jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w))
    xs, ws = (x, w) if override == "high_precision" else (np_q_tiles(x, (1, 16)), np_q2(w.T).T)
    _within(gx, c, ws.T)
    _within(gw, xs.T, c)


def np_q_4over6(v):
    """Four over Six values of v [R, C] blocked along C: the independent reference's
    quantizer (TransformerEngine's nvfp4_4over6 recipe, NumPy float32 steps), float32."""
    codes, scales, amax = R4.quantize_4over6(np.asarray(v, np.float32))
    return np.asarray(R4.dequantize_4over6(codes, scales, amax), np.float32)


@pytest.mark.parametrize("weight_block_2d", [False, True])
@pytest.mark.slow  # ~10 s of NVFP4 compiles each; the recipe's module runs in quick tests
def test_four_over_six_forward_is_the_formats_quantizer(weight_block_2d):
    # Recipe(four_over_six=True): the forward product's 16-element blocks (activations along
    # K; the weight along K unless it has 16 x 16 tiles) chosen 4-or-6 exactly as the
    # nvfp4_4over6 format's own quantizer, here the NumPy reference's; the 3-D activations
    # [B, S, D] of a transformer layer.
    recipe = dataclasses.replace(lowprec.NVIDIA_NVFP4, four_over_six=True,
                                 weight_block_2d=weight_block_2d)
    assert "4over6 forward" in recipe.describe()
    x, w, c = _data(t=16, k=32, n=16, seed=4)
    dn3 = (((2,), (0,)), ((), ()))
    # With a "dequantized" backward the input gradient reads the forward's quantized weight.
    dq = dataclasses.replace(recipe, backward_override="dequantized")
    run = jax.jit(lambda a, b: (  # one program for the three results
        recipe.dot_general(a.reshape(2, 8, 32), b, dn3), nt.quantize_1d(a, 1, four_over_six=True),
        jax.grad(lambda u, v: jnp.sum(dq.dot_general(u, v, DN) * c))(a, b)))
    y, x_q, gx = (np.asarray(v) for v in run(x, w))
    y = y.reshape(16, 16)
    # The operand as the recipe builds it equals the reference bit for bit.
    assert_bits_equal(x_q, np_q_4over6(x))
    xq = np_q_4over6(x)
    wq = np_q2(w.T).T if weight_block_2d else np_q_4over6(w.T).T
    _within(y, xq, wq)
    # ... and it is not the map-to-6 forward (some block of these values prefers 4).
    assert not np.array_equal(xq, np_q1(x, 1))
    # The backward products are the recipe's own (4/6 is a forward option): the
    # "dequantized" backward's input gradient reads the forward's quantized weight.
    _within(gx, c, wq.T)


def test_recipe_validation():
    with pytest.raises(ValueError, match="parts of the NVFP4 training recipe"):
        lowprec.Recipe(forward="mxfp8", grad="mxfp8", wgrad_rht=True)
    with pytest.raises(ValueError, match="four_over_six are parts of the NVFP4 training"):
        lowprec.Recipe(forward="mxfp8", grad="mxfp8", four_over_six=True)
    with pytest.raises(TypeError, match="four_over_six must be a bool"):
        dataclasses.replace(lowprec.NVIDIA_NVFP4, four_over_six="yes")
    with pytest.raises(ValueError, match="unknown grad_rounding 'up'"):
        lowprec.Recipe(forward="nvfp4", grad="nvfp4", grad_rounding="up")
    with pytest.raises(ValueError, match="applies to linear layers"):
        lowprec.NVIDIA_NVFP4.dot_general(jnp.ones((2, 16, 16)), jnp.ones((2, 16, 16)),
                                         (((2,), (1,)), ((0,), (0,))))
    assert lowprec.RECIPES["nvidia_nvfp4"] is lowprec.NVIDIA_NVFP4
    assert "wgrad RHT" in lowprec.NVIDIA_NVFP4.describe()


def test_rounding_key_numbers_the_dots_of_its_block():
    # The i-th dot inside a block takes fold_in(key, i); blocks nest, each counting from 0;
    # outside any block there is no key (the words hash the cotangent).
    from lowprec._rounding_key import next_key

    data = lambda k: np.asarray(jax.random.key_data(k))
    k1, k2 = jax.random.key(1), jax.random.key(2)
    assert next_key() is None
    with lowprec.stochastic_rounding_key(k1):
        first = next_key()
        with lowprec.stochastic_rounding_key(k2):
            inner = next_key()
        second = next_key()
    assert next_key() is None
    np.testing.assert_array_equal(data(first), data(jax.random.fold_in(k1, 0)))
    np.testing.assert_array_equal(data(second), data(jax.random.fold_in(k1, 1)))
    np.testing.assert_array_equal(data(inner), data(jax.random.fold_in(k2, 0)))
    raw = jax.random.key_data(k1)  # raw uint32 words are keys too
    with lowprec.stochastic_rounding_key(raw):
        np.testing.assert_array_equal(np.asarray(next_key()), np.asarray(jax.random.fold_in(raw, 0)))


def test_rounding_key_refuses_what_would_be_wrong():
    x, w, _ = _data()
    dot = lambda a: lowprec.NVIDIA_NVFP4.dot_general(a, w, DN)
    with pytest.raises(TypeError, match="takes one PRNG key"):
        with lowprec.stochastic_rounding_key(7):
            pass
    with pytest.raises(TypeError, match="takes one PRNG key"):
        with lowprec.stochastic_rounding_key(jax.random.split(jax.random.key(0), 2)):
            pass
    # A concrete key met while jit traces the dot would be compiled in as a constant: every
    # later call would reuse its words. Refused at trace time (nothing is compiled).
    with lowprec.stochastic_rounding_key(jax.random.key(0)):
        with pytest.raises(ValueError, match="concrete value.*Pass the key as an argument"):
            jax.jit(dot).lower(x)


@pytest.mark.parametrize("key_kind", ["hash", "typed", "raw"])
def test_grad_words_follow_the_stated_contract(key_kind):
    """w_d, w_w = random_bits(fold_in(k, 0), shape), random_bits(fold_in(k, 1), shape), with k
    the given key or fold_in(key(seed), wrapping uint32 sum of the cotangent's bits) (module
    docstring), whichever way grad_words derives them (it vmaps the two threefry calls)."""
    g = jnp.asarray(np.random.default_rng(5).standard_normal((48, 32)), jnp.float32)
    seed = 7
    if key_kind == "hash":
        given = None
        h = jnp.sum(jax.lax.bitcast_convert_type(g, jnp.uint32), dtype=jnp.uint32)
        k = jax.random.fold_in(jax.random.key(seed), h)
    else:
        k = given = (jax.random.key(11) if key_kind == "typed"
                     else jnp.asarray([3, 0xDEADBEEF], jnp.uint32))
    want = [lowprec.random_bits(jax.random.fold_in(k, i), g.shape) for i in (0, 1)]
    for got in (nt.grad_words(g, seed, given), jax.jit(nt.grad_words, static_argnums=1)(
            g, seed, given)):
        assert len(got) == 2
        for a, b in zip(got, want):
            assert a.dtype == jnp.uint16 and a.shape == g.shape
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # transposed=True (the weight gradient's [N, T] layout): w_w.T, w_d unchanged.
    wd, wwt = jax.jit(nt.grad_words, static_argnums=(1, 3))(g, seed, given, True)
    np.testing.assert_array_equal(np.asarray(wd), np.asarray(want[0]))
    assert wwt.shape == g.shape[::-1]
    np.testing.assert_array_equal(np.asarray(wwt), np.asarray(want[1]).T)


def _flush(a):
    """XLA:CPU's float mode on float32 values: subnormals read and written as zero of their
    sign (flush-to-zero and denormals-are-zero)."""
    a = np.asarray(a, np.float32)
    return np.where(np.abs(a) < np.float32(2.0**-126), np.copysign(np.float32(0), a), a)


def np_rht_flushed(v, signs):
    """np_rht's steps with every operand and result flushed as XLA:CPU flushes them."""
    v = _flush(v)
    t, c = v.shape
    b = _flush(v.reshape(t // 16, 16, c) * signs[None, :, None])
    h = 1
    with np.errstate(invalid="ignore", over="ignore"):
        while h < 16:
            b = b.reshape(t // 16, 16 // (2 * h), 2, h, c)
            lo, hi = b[:, :, 0], b[:, :, 1]
            b = _flush(np.stack([lo + hi, lo - hi], axis=2))
            h *= 2
    return _flush(b.reshape(t, c) * np.float32(0.25))


def _rht_inputs(t, c, seed=0):
    """float32 [t, c] over many binades with ±0, subnormals, ±inf, NaN, pairs that cancel
    (a - a: the sign of the zero) and sums that overflow."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((t, c)) * np.exp2(rng.integers(-30, 30, (t, c)))).astype(np.float32)
    x[0, :8] = [0.0, -0.0, 1e-40, -3e-39, np.inf, -np.inf, np.nan, 3e38]
    x[1, :8] = [-0.0, -0.0, 1e-40, 1.5e-38, 5.0, np.inf, 1.0, 3e38]
    x[16:32, 1] = 2.5  # one block of equal values: 15 rows cancel
    x[16:32, 2] = -1.25e-38  # normal inputs, subnormal transforms (flushed)
    return x


@pytest.mark.parametrize("cols", [13, 40])  # the kernel's scalar loop alone; vector + scalar
@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_rht_kernel_transposed_bit_exact(cols, mode):
    """The native Hadamard kernel (rht along tokens, written transposed) against the NumPy
    statement with XLA:CPU's flushing, and against XLA's own formulation (kernels off), bit
    for bit (NaN as NaN: the quantizer makes a block holding one all NaN)."""
    from lowprec.kernels import _rht_cpu

    x = _rht_inputs(48, cols)
    signs = np.asarray(nt.rht_signs(5))
    # The kernel serves these inputs, and XLA lowers for CPU (on a GPU machine it lowers for
    # CUDA, which takes XLA's formulation: the kernel is a CPU custom call).
    if not (_rht_cpu.serves(jnp.asarray(x), jnp.asarray(signs))
            and jax.default_backend() == "cpu"):
        pytest.skip("no native CPU kernel here (not built, no AVX2, or the default device "
                    "is not a CPU)")
    recipe = lowprec.NVIDIA_NVFP4
    f = functools.partial(nt._tokens_last, recipe=dataclasses.replace(recipe, rht_signs=tuple(
        int(s) for s in signs)))
    f = f if mode == "eager" else jax.jit(f)
    got = np.asarray(f(jnp.asarray(x)))
    hlo = jax.jit(f).lower(jnp.asarray(x)).as_text()
    assert "lowprec_rht_transposed" in hlo
    with lowprec.kernels.policy("xla"):
        xla = np.asarray(jax.jit(lambda v: nt.rht(v, jnp.asarray(signs), 0).T)(jnp.asarray(x)))
    want = np_rht_flushed(x, signs).T
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan) and np.array_equal(np.isnan(xla), nan)
    assert_bits_equal(np.where(nan, 0, got), np.where(nan, 0, want))
    assert_bits_equal(np.where(nan, 0, xla), np.where(nan, 0, want))
    assert np.any(want == 0) and np.any(np.signbit(want) & (want == 0))  # both zeros met
    with np.errstate(invalid="ignore", over="ignore"):  # the data meets the flushing
        unflushed = np_rht(x, signs).T
    assert np.any((unflushed != 0) & (want == 0))


@pytest.mark.parametrize("rht_dtype", ["float32", "bfloat16"])
def test_wgrad_operands_the_same_with_kernels_off(rht_dtype):
    """The weight gradient's transposed, transformed operands (_tokens_last): the native
    kernel's and XLA's formulation (kernels off) give the same bits, float32 and bfloat16
    transforms (TE's signs)."""
    recipe = dataclasses.replace(lowprec.NVIDIA_NVFP4, rht_dtype=rht_dtype,
                                 rht_signs="transformer_engine")
    x = jnp.asarray(np.nan_to_num(_rht_inputs(64, 24, seed=2), nan=1.0))
    f = jax.jit(functools.partial(nt._tokens_last, recipe=recipe))
    native = np.asarray(f(x))
    with lowprec.kernels.policy("xla"):
        xla = np.asarray(jax.jit(functools.partial(nt._tokens_last, recipe=recipe))(x))
    assert_bits_equal(native, xla)
