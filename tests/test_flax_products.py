"""Attention score/value products, convolutions and nested interception under a recipe.

Expected values are independent statements: operands quantized by the NumPy reference
(``lowprec_reference``) along the product's contraction, then the float64 product (within the
float32 accumulation bound); patches built here in NumPy (im2col, window positions then input
features) for convolutions. Plumbing (which layer gets which recipe) is checked bit for bit
against layers given the recipe's product by hand.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

flax = pytest.importorskip("flax")
import flax.linen as nn  # noqa: E402
from flax import nnx  # noqa: E402

import lowprec  # noqa: E402
import lowprec.flax as lf  # noqa: E402
import lowprec_reference as ref  # noqa: E402
from lowprec import NVIDIA_MXFP8, Recipe  # noqa: E402

from helpers.asserts import assert_bits_equal  # noqa: E402
from helpers.programs import assert_same_program, traced  # noqa: E402

# STE: forward statement
MX8 = Recipe(forward="mxfp8", scale_options={"scale_rule": "rceil"}, name="mx8_ste")
MX4 = Recipe(forward="mxfp4", backward_operands="mxfp8", grad="mxfp8",
             scale_options={"scale_rule": "rceil"})


def _x(shape, seed=0):
    # Drawn by NumPy: jax.random run op by op compiles its programs anew for every shape.
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape).astype(np.float32))


def _ref_q(x, fmt, axis, rule="rceil"):
    """Reference MX fake quantization (float64) along ``axis``, zero-padded to the block."""
    x = np.asarray(x, np.float32)
    el, sc = ref.quantize_mx(x, fmt, axis=axis, scale_rule=rule, pad=True)
    out = ref.dequantize_mx(el, sc, fmt, axis=axis).astype(np.float64)
    return np.take(out, np.arange(x.shape[axis]), axis=axis)


def _assert_close(got, want, bound):
    got = np.asarray(got, np.float64)
    bad = np.abs(got - want) > bound + 2.0**-24 * np.abs(want)
    assert not bad.any(), f"{bad.sum()} entries off; max err {np.max(np.abs(got - want))}"


# -- attention ----------------------------------------------------------------------------------


def _qkv(b=2, s=6, h=2, d=32):
    return _x((b, s, h, d), 1), _x((b, s, h, d), 2), _x((b, s, h, d), 3)


@pytest.mark.parametrize("mode", ["eager", "jit"])
@pytest.mark.quick_cases(mode=["jit"])
def test_attention_products_are_the_reference_quantized_products(mode):
    """Scores q·kᵀ: q and k quantized along the head depth; values p·v: p and v along the
    keys. Batch dims [b, h] as attention has them (4-D operands)."""
    q, k, v = _qkv()
    ein = lf.einsum(MX8)
    scores_fn = lambda a, b: ein("...qhd,...khd->...hqk", a, b)  # noqa: E731
    values_fn = lambda a, b: ein("...hqk,...khd->...qhd", a, b)  # noqa: E731
    if mode == "jit":
        scores_fn, values_fn = jax.jit(scores_fn), jax.jit(values_fn)
    s = scores_fn(q, k)
    qq, qk = _ref_q(q, "mxfp8_e4m3", 3), _ref_q(k, "mxfp8_e4m3", 3)
    want = np.einsum("bqhd,bkhd->bhqk", qq, qk)
    _assert_close(s, want, 32 * 2.0**-23 * np.einsum("bqhd,bkhd->bhqk", np.abs(qq), np.abs(qk)))
    p = jax.nn.softmax(s)
    o = values_fn(p, v)
    qp, qv = _ref_q(p, "mxfp8_e4m3", 3), _ref_q(v, "mxfp8_e4m3", 1)
    want = np.einsum("bhqk,bkhd->bqhd", qp, qv)
    _assert_close(o, want, 6 * 2.0**-23 * np.einsum("bhqk,bkhd->bqhd", np.abs(qp), np.abs(qv)))


def _attention_by_hand(recipe, q, k, v):
    """Flax's attention with the two products written as the recipe's einsums."""
    s = recipe.einsum("...qhd,...khd->...hqk", q / jnp.sqrt(q.shape[-1]).astype(q.dtype), k)
    return recipe.einsum("...hqk,...khd->...qhd", jax.nn.softmax(s), v)


@pytest.mark.slow  # seconds; lowprec.flax.attention runs in the quick nnx quantize_model test
def test_nnx_attention_fn_and_linen_hooks_run_the_recipe_products():
    """lowprec.flax.attention and Flax's attention given the recipe's einsums as hooks are the
    attention written with the recipe's products by hand, forward and gradients: compared as
    traced programs (one program is the same bits for every input; compiling the gradients
    takes seconds). The causal mask, numerically (one compiled forward)."""
    q, k, v = _qkv()
    ein = lf.einsum(MX4)
    assert_same_program(lambda *a: lf.attention(MX4)(*a, deterministic=True),
                        lambda *a: _attention_by_hand(MX4, *a), q, k, v, what="attention_fn")
    assert_same_program(
        lambda *a: nn.dot_product_attention(*a, qk_attn_weights_einsum=ein,
                                            attn_weights_value_einsum=ein),
        lambda *a: _attention_by_hand(MX4, *a), q, k, v, what="linen hooks")
    # Gradients flow through both products (the recipe's quantized backward).
    assert_same_program(jax.grad(lambda *a: lf.attention(MX4)(*a, deterministic=True).sum(), (0, 1, 2)),
                        jax.grad(lambda *a: _attention_by_hand(MX4, *a).sum(), (0, 1, 2)),
                        q, k, v, what="gradients")
    causal = jnp.tril(jnp.ones((6, 6), bool))
    got, want = jax.jit(lambda q, k, v: (
        lf.attention(MX4)(q, k, v, is_causal=True, deterministic=True),
        nn.dot_product_attention(q, k, v, mask=causal, qk_attn_weights_einsum=ein,
                                 attn_weights_value_einsum=ein)))(q, k, v)
    assert_bits_equal(got, want)


class Block(nn.Module):
    """Attention as users call it: [batch, seq, d] activations, a residual."""

    @nn.compact
    def __call__(self, x):
        return x + nn.MultiHeadDotProductAttention(2, name="attn")(x)


class BlockByHand(nn.Module):
    recipe: Recipe
    attention_recipe: Recipe | None

    @nn.compact
    def __call__(self, x):
        dg = lf.dot_general(self.recipe)
        ein = None if self.attention_recipe is None else (lambda: lf.einsum(self.attention_recipe))
        return x + nn.MultiHeadDotProductAttention(
            2, name="attn", qkv_dot_general=dg, out_dot_general=dg,
            qk_attn_weights_einsum_cls=ein, attn_weights_value_einsum_cls=ein)(x)


@pytest.mark.slow  # seconds; linen interception runs in the quick nesting tests below
def test_linen_block_intercepted_forward_and_gradients_and_opted_out_by_rule():
    """A linen attention block under quantize_model: its output and parameter gradients are
    those of the block given the recipe's products by hand (projections and both attention
    products); a rule for the "attention" kind keeps those products in their own precision.
    Compared as traced programs: the same program is the same output and gradients for every
    input and parameters (the four models compiled take ~15 CPU s; traced, ~3)."""
    x = _x((2, 8, 32))
    params = jax.eval_shape(Block().init, jax.random.key(0), x)  # traced on shapes alone
    rules = lowprec.Rules([lowprec.Rule(".*", None, ops=("attention",)), (".*", NVIDIA_MXFP8)])

    def output_and_grads(model):
        def run(p, x):
            y, pull = jax.vjp(lambda q: model.apply(q, x), p)
            return y, pull(jnp.ones_like(y))[0]  # the gradients of sum(y)
        return run

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_same_program(output_and_grads(lf.quantize_model(Block(), NVIDIA_MXFP8)),
                            output_and_grads(BlockByHand(NVIDIA_MXFP8, NVIDIA_MXFP8)),
                            params, x, what="quantize_model")
        opted_out = assert_same_program(lf.quantize_model(Block(), rules).apply,
                                        BlockByHand(NVIDIA_MXFP8, None).apply, params, x,
                                        what="rules")
    # The rule did opt out: not the program with quantized attention products.
    assert opted_out != str(traced(BlockByHand(NVIDIA_MXFP8, NVIDIA_MXFP8).apply, params, x))


def test_nnx_attention_quantized_by_quantize_model_and_restored():
    mha = nnx.MultiHeadAttention(2, 32, decode=False, rngs=nnx.Rngs(0))
    x = _x((2, 8, 32))
    # One jitted function for every call (op by op: ~40 programs); a module whose graph
    # (its static fields: the products it runs) is new traces and compiles anew.
    jitted = nnx.jit(lambda m, x: m(x))
    call = lambda m: jitted(m, x)  # noqa: E731
    float_out = call(mha)
    lf.quantize_model(mha, NVIDIA_MXFP8)
    assert mha.attention_fn == lf.attention(NVIDIA_MXFP8)
    assert mha.query.dot_general == lf.dot_general(NVIDIA_MXFP8)
    by_hand = nnx.MultiHeadAttention(2, 32, decode=False, rngs=nnx.Rngs(0),
                                     attention_fn=lf.attention(NVIDIA_MXFP8))
    for name in ("query", "key", "value", "out"):
        getattr(by_hand, name).dot_general = lf.dot_general(NVIDIA_MXFP8)
    assert_bits_equal(call(mha), call(by_hand))
    lf.quantize_model(mha, None)
    assert mha.attention_fn is nnx.dot_product_attention
    assert_bits_equal(call(mha), float_out)


# -- convolutions -------------------------------------------------------------------------------


def _patches(x, window, strides, padding):
    """im2col in NumPy: x [N, *spatial, C] -> [N, *out, prod(window) * C] (window positions
    row-major, input features innermost); ``padding`` a (lo, hi) pair per spatial dim."""
    x = np.pad(np.asarray(x, np.float32), [(0, 0), *padding, (0, 0)])
    out = [(x.shape[1 + i] - window[i]) // strides[i] + 1 for i in range(len(window))]
    cols = []
    for offs in np.ndindex(*window):
        sl = tuple(slice(o, o + strides[i] * (out[i] - 1) + 1, strides[i]) for i, o in enumerate(offs))
        cols.append(x[(slice(None), *sl, slice(None))])
    return np.concatenate(cols, axis=-1)


CONV_CASES = [  # (input shape [N, *spatial, C], window, strides, padding)
    ((2, 9, 32), (3,), (1,), ((1, 1),)),               # 1-D over [batch, seq, d]
    ((2, 7, 6, 32), (3, 2), (2, 1), ((1, 1), (0, 1))),  # 2-D NHWC, strided
    ((1, 5, 5, 24), (2, 2), (1, 1), ((0, 0), (0, 0))),  # 24 features: blocks span windows
]


@pytest.mark.parametrize("shape,window,strides,padding,mode", [
    (*CONV_CASES[0], "eager"), *((*c, "jit") for c in CONV_CASES)])
@pytest.mark.quick_first(1)
def test_conv_is_the_reference_quantized_patch_product(shape, window, strides, padding, mode):
    x = _x(shape)
    kernel = _x((*window, shape[-1], 8), 5) * 0.2
    sp = "HWD"[: len(window)]
    dn = (f"N{sp}C", f"{sp}IO", f"N{sp}C")
    conv = lambda a, b: lf.conv_general_dilated(MX8)(a, b, strides, padding, dimension_numbers=dn)  # noqa: E731
    got = (jax.jit(conv) if mode == "jit" else conv)(x, kernel)
    patches = _patches(x, window, strides, padding)
    w = np.asarray(kernel).reshape(-1, 8)
    # Bit for bit the recipe's dot on the NumPy patches ...
    assert_bits_equal(got, MX8.dot_general(jnp.asarray(patches), jnp.asarray(w),
                                           (((patches.ndim - 1,), (0,)), ((), ()))))
    # ... which is the product of the reference-quantized patches and kernel.
    qp, qw = _ref_q(patches, "mxfp8_e4m3", patches.ndim - 1), _ref_q(w, "mxfp8_e4m3", 0)
    _assert_close(got, qp @ qw, w.shape[0] * 2.0**-23 * (np.abs(qp) @ np.abs(qw)))


@pytest.mark.slow  # seconds; the recipe's backward runs in quick tests of test_recipe.py
def test_conv_gradients_are_the_recipe_backward_products():
    x, kernel = _x((2, 9, 32)), _x((3, 32, 8), 5) * 0.2
    pad, dn = ((1, 1),), ("NHC", "HIO", "NHC")
    conv = lf.conv_general_dilated(MX4)
    g = _x((2, 9, 8), 7)
    gx, gk = jax.jit(jax.grad(lambda a, b: (conv(a, b, (1,), pad, dimension_numbers=dn) * g).sum(),
                              (0, 1)))(x, kernel)
    patches = jnp.asarray(_patches(x, (3,), (1,), pad))
    dn2 = (((2,), (0,)), ((), ()))
    gp, gw = jax.jit(jax.grad(lambda p, w: (MX4.dot_general(p, w, dn2) * g).sum(), (0, 1)))(
        patches, kernel.reshape(96, 8))
    assert_bits_equal(gk, gw.reshape(3, 32, 8))  # weight gradient: the recipe's, bit for bit
    # Input gradient: the patches' gradient folded back (each window position adds its slice).
    gp = np.asarray(gp, np.float64).reshape(2, 9, 3, 32)
    fold = np.zeros((2, 11, 32))
    for j in range(3):
        fold[:, j:j + 9] += gp[:, :, j]
    np.testing.assert_allclose(np.asarray(gx), fold[:, 1:10], rtol=2e-7, atol=1e-30)


@pytest.mark.slow  # seconds; lowprec.flax's conv product runs in the quick patch test above
def test_conv_layers_linen_and_nnx_and_grouped_refusal():
    x = _x((2, 6, 6, 32))
    layer = nn.Conv(8, (3, 3))
    params = jax.jit(layer.init)(jax.random.key(0), x)
    by_hand = nn.Conv(8, (3, 3), conv_general_dilated=lf.conv_general_dilated(NVIDIA_MXFP8))
    conv = nnx.Conv(32, 8, (3, 3), rngs=nnx.Rngs(0))
    lf.quantize_model(conv, NVIDIA_MXFP8)
    nnx_params = {"params": {"kernel": conv.kernel[...], "bias": conv.bias[...]}}

    @jax.jit
    def run(params, nnx_params, x):
        return (lf.quantize_model(layer, NVIDIA_MXFP8).apply(params, x), by_hand.apply(params, x),
                by_hand.apply(nnx_params, x))

    got, want, want_nnx = run(params, nnx_params, x)
    assert_bits_equal(got, want)
    assert_bits_equal(nnx.jit(lambda m, x: m(x))(conv, x), want_nnx)
    grouped = nnx.Conv(32, 32, (3,), feature_group_count=32, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"grouped convolution at <root> \(feature_group_count=32\)"):
        lf.quantize_model(grouped, NVIDIA_MXFP8)
    lf.quantize_model(grouped, lowprec.Rules([lowprec.Rule(".*", None, ops="conv")]))  # opted out
    with pytest.raises(ValueError, match="grouped convolution at Conv_0"):
        class Net(nn.Module):
            @nn.compact
            def __call__(self, x):
                return nn.Conv(32, (3,), feature_group_count=4)(x)
        lf.quantize_model(Net(), NVIDIA_MXFP8).init(jax.random.key(0), _x((2, 5, 32)))


def test_nnx_embed_attend_runs_in_the_recipe_and_is_restored():
    class LM(nnx.Module):
        def __init__(self, rngs):
            self.embed = nnx.Embed(96, 64, rngs=rngs)

        def __call__(self, t):
            return self.embed.attend(self.embed(t) * 0.5)

    lm, t = LM(nnx.Rngs(0)), jnp.arange(16).reshape(2, 8) % 96
    float_out = lm(t)
    lf.quantize_model(lm, MX4)
    table = lm.embed.embedding[...]
    want = MX4.dot_general(table[t] * 0.5, table, (((2,), (1,)), ((), ())))
    assert_bits_equal(nnx.jit(lambda m, t: m(t))(lm, t), want)
    lf.quantize_model(lm, lowprec.Rules([lowprec.Rule(".*", None, ops="attend"), (".*", MX4)]))
    assert type(lm.embed) is nnx.Embed  # opted out: Flax's own class and attend again
    assert_bits_equal(lm(t), float_out)


# -- nesting and submodules ----------------------------------------------------------------------


class Two(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(32, name="b")(nn.Dense(32, name="a")(x))


def test_nested_intercepting_the_innermost_rule_decides():
    """Compared as traced programs (the contexts are active while tracing, as under jit)."""
    x = _x((4, 32))
    params = jax.eval_shape(Two().init, jax.random.key(0), x)

    def nested(*recipes):
        def run(p, x):
            with lf.intercepting(recipes[0]), lf.intercepting(recipes[1]):
                return Two().apply(p, x)
        return run

    def modelled(rules):
        return lf.quantize_model(Two(), rules).apply

    only_a = lowprec.Rules([("a", MX4)])
    # a: the inner rule; b: no inner rule, so the outer recipe.
    assert_same_program(nested(NVIDIA_MXFP8, only_a),
                        modelled(lowprec.Rules([("a", MX4), ("b", NVIDIA_MXFP8)])), params, x,
                        what="inner rule for a, outer recipe for b")
    # The inner recipe decides every layer.
    assert_same_program(nested(only_a, NVIDIA_MXFP8), modelled(NVIDIA_MXFP8), params, x,
                        what="inner recipe")
    # An inner None rule keeps a layer in its own precision against the outer recipe.
    assert_same_program(nested(NVIDIA_MXFP8, [("a", None)]),
                        modelled(lowprec.Rules([("b", NVIDIA_MXFP8)])), params, x,
                        what="inner None rule")


class Parent(nn.Module):
    inner: nn.Module

    @nn.compact
    def __call__(self, x):
        return nn.Dense(32, name="head")(self.inner(x))


def test_quantized_linen_is_a_submodule_with_the_float_parameters():
    x = _x((4, 32))
    float_params = jax.jit(Parent(Two()).init)(jax.random.key(0), x)
    model = Parent(lf.quantize_model(Two(), MX4))
    assert jax.tree.structure(jax.eval_shape(model.init, jax.random.key(0), x)) == jax.tree.structure(
        float_params)
    got = model.apply(float_params, x)
    # The child runs in MX4, the parent's head in its own precision.
    want = lf.quantize_model(Parent(Two()), lowprec.Rules([("inner/.*", MX4)])).apply(float_params, x)
    assert_bits_equal(got, want)
    # Under an outer recipe, the wrapped child's recipe decides its layers.
    got = lf.quantize_model(model, NVIDIA_MXFP8).apply(float_params, x)
    want = lf.quantize_model(Parent(Two()), lowprec.Rules(
        [("inner/.*", MX4), (".*", NVIDIA_MXFP8)])).apply(float_params, x)
    assert_bits_equal(got, want)
