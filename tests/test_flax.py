"""Flax integration: the dot_general/einsum factories and quantize_model, linen and nnx.

The expected value of a Flax layer running a recipe is the recipe's own dot on the layer's
inputs and parameters (tests/test_recipe.py holds those dots to the reference), so these
tests check the plumbing bit for bit: which layers get the recipe, with which arguments,
under jit, grad, vmap and remat.
"""

from __future__ import annotations

import dataclasses
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
from lowprec import NVIDIA_MXFP8, Recipe  # noqa: E402

from helpers.asserts import assert_bits_equal, bit_pattern  # noqa: E402
from helpers.programs import assert_same_program  # noqa: E402

R4 = Recipe(forward="mxfp4", backward_operands="mxfp8", grad="mxfp8",
            scale_options={"scale_rule": "rceil"})
DN = (((1,), (0,)), ((), ()))


def _x(shape=(8, 64), seed=0):
    # Drawn by NumPy: jax.random run op by op compiles its programs anew for every shape.
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape).astype(np.float32))


# -- factories ------------------------------------------------------------------------------------


@pytest.mark.slow  # left out of the quick tier (seconds; its paths run in other quick tests)
def test_linen_dense_factory_is_the_recipe_dot():
    layer = nn.Dense(48, dot_general=lf.dot_general(R4))
    x = _x()
    p = jax.jit(layer.init)(jax.random.key(1), x)["params"]
    assert_bits_equal(layer.apply({"params": p}, x), R4.dot_general(x, p["kernel"], DN) + p["bias"])


@pytest.mark.slow
def test_linen_dense_general_several_contracting_axes():
    layer = nn.DenseGeneral(16, axis=(-2, -1), dot_general=lf.dot_general(NVIDIA_MXFP8))
    x = _x((4, 2, 32))
    p = jax.jit(layer.init)(jax.random.key(1), x)["params"]
    want = NVIDIA_MXFP8.dot_general(x, p["kernel"], (((1, 2), (0, 1)), ((), ()))) + p["bias"]
    assert_bits_equal(layer.apply({"params": p}, x), want)
    # Flattened contraction (2 x 32): the same as quantizing the reshaped operands.
    assert_bits_equal(want, NVIDIA_MXFP8.dot_general(x.reshape(4, 64), p["kernel"].reshape(64, 16), DN) + p["bias"])


def test_bf16_layers_keep_lax_dtype_semantics():
    layer = nn.Dense(32, dtype=jnp.bfloat16, dot_general=lf.dot_general(NVIDIA_MXFP8))
    x = _x()
    p = jax.jit(layer.init)(jax.random.key(1), x)
    assert layer.apply(p, x).dtype == jnp.bfloat16  # as with lax.dot_general


@pytest.mark.slow  # left out of the quick tier (seconds; its paths run in other quick tests)
def test_nnx_linear_and_einsum_factories():
    rngs = nnx.Rngs(0)
    lin = nnx.Linear(64, 32, dot_general=lf.dot_general(R4), rngs=rngs)
    ein = nnx.Einsum("btd,dnh->btnh", (64, 4, 8), (4, 8), einsum_op=lf.einsum(R4), rngs=rngs)
    # nnx passes preferred_element_type (and out_sharding) through: honoured.
    lin16 = nnx.Linear(64, 32, dot_general=lf.dot_general(R4), use_bias=False,
                       preferred_element_type=jnp.bfloat16, rngs=rngs)
    x, x3 = _x(), _x((2, 5, 64))

    @nnx.jit  # one program (op by op: ~20)
    def run(lin, ein, lin16, x, x3):
        return (lin(x), R4.dot_general(x, lin.kernel[...], DN) + lin.bias[...], ein(x3),
                R4.einsum("btd,dnh->btnh", x3, ein.kernel[...]) + ein.bias[...], lin16(x))

    got, want, got_ein, want_ein, y16 = run(lin, ein, lin16, x, x3)
    assert_bits_equal(got, want)
    assert_bits_equal(got_ein, want_ein)
    assert y16.dtype == jnp.bfloat16


def test_factories_reject_non_recipes():
    with pytest.raises(TypeError, match="expected a lowprec.Recipe"):
        lf.dot_general("mxfp8")
    with pytest.raises(TypeError, match="flax.linen or flax.nnx Module"):
        lf.quantize_model(lambda x: x, NVIDIA_MXFP8)


# -- quantize_model: linen ------------------------------------------------------------------------


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(64, name="up")(x))
        h = nn.DenseGeneral((2, 32), name="gen")(h).reshape(*h.shape[:-1], 64)
        h = nn.Dense(64, name="mine", dot_general=jax.lax.dot_general)(h)  # user's own choice
        return nn.Dense(8, name="head")(h)


class ExplicitMLP(nn.Module):
    """MLP written with the recipe by hand, except for `head` (kept high precision)."""

    recipe: Recipe

    @nn.compact
    def __call__(self, x):
        dg = lf.dot_general(self.recipe)
        h = nn.relu(nn.Dense(64, name="up", dot_general=dg)(x))
        h = nn.DenseGeneral((2, 32), name="gen", dot_general=dg)(h).reshape(*h.shape[:-1], 64)
        h = nn.Dense(64, name="mine")(h)
        return nn.Dense(8, name="head")(h)


@pytest.mark.slow  # left out of the quick tier (seconds; its paths run in other quick tests)
def test_quantize_model_linen_equals_the_hand_written_model():
    recipe = dataclasses.replace(NVIDIA_MXFP8, high_precision=("head",))
    x = _x()
    params = jax.jit(MLP().init)(jax.random.key(1), x)
    float_out = MLP().apply(params, x)
    q = lf.quantize_model(MLP(), recipe)
    shapes = jax.eval_shape(q.init, jax.random.key(1), x)  # the structure, without compiling
    assert jax.tree.structure(shapes) == jax.tree.structure(params)
    want = ExplicitMLP(recipe).apply(params, x)
    assert_bits_equal(q.apply(params, x), want)  # eager
    assert not np.array_equal(bit_pattern(float_out), bit_pattern(want))  # it did change
    # Interception is scoped to the wrapper's calls: the model itself stays float.
    assert_bits_equal(MLP().apply(params, x), float_out)
    # Under jit and grad (traced inside the wrapper's interception): the same program as the
    # hand-written model's, so the same loss and gradients (compiled, ~1 s each; traced, less).
    assert_same_program(jax.value_and_grad(lambda p, x: jnp.sum(q.apply(p, x) ** 2)),
                        jax.value_and_grad(lambda p, x: jnp.sum(ExplicitMLP(recipe).apply(p, x) ** 2)),
                        params, x)


def test_linen_uncovered_layers_warn_once_unless_excluded():
    class WithEinsum(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Einsum((64, 8), "bd,df->bf", name="ein")(nn.Dense(64, name="d")(x))

    x = _x()
    params = jax.jit(WithEinsum().init)(jax.random.key(0), x)
    q = lf.quantize_model(WithEinsum(), Recipe(forward="mxfp8", name="warn_test"))
    with pytest.warns(UserWarning, match=r"Einsum.__call__ at ein has no dot_general hook.*'warn_test'"):
        q.apply(params, x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        q.apply(params, x)  # once per (layer, recipe)
        lf.quantize_model(WithEinsum(), Recipe(forward="mxfp8", high_precision="ein")).apply(params, x)


@pytest.mark.slow
def test_linen_remat_module():
    # nn.remat (a lifted transform) re-runs the layer in the backward pass: still intercepted.
    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.remat(nn.Dense)(16, name="d")(x)

    x = _x()
    params = jax.jit(Net().init)(jax.random.key(0), x)
    q = lf.quantize_model(Net(), NVIDIA_MXFP8)
    p = params["params"]["d"]
    g, want = jax.jit(lambda pp, k: (  # one program for both (each alone compiles ~1 s)
        jax.grad(lambda pp: jnp.sum(q.apply(pp, x) ** 2))(pp),
        jax.grad(lambda k: jnp.sum((NVIDIA_MXFP8.dot_general(x, k, DN) + p["bias"]) ** 2))(k)))(
            params, p["kernel"])
    assert_bits_equal(g["params"]["d"]["kernel"], want)


# -- quantize_model: nnx --------------------------------------------------------------------------


class Net(nnx.Module):
    def __init__(self, rngs):
        self.a = nnx.Linear(64, 64, rngs=rngs)
        self.b = nnx.LinearGeneral(64, (2, 32), rngs=rngs)
        self.c = nnx.Einsum("bd,df->bf", (64, 16), (16,), rngs=rngs)
        self.mine = nnx.Linear(16, 16, dot_general=jax.lax.dot_general, rngs=rngs)
        self.mine.dot_general = lambda *a, **k: jax.lax.dot_general(*a, **k)  # user's own
        self.head = nnx.Linear(16, 8, rngs=rngs)

    def __call__(self, x):
        h = self.b(jax.nn.relu(self.a(x))).reshape(x.shape[0], 64)
        return self.head(self.mine(self.c(h)))


@pytest.mark.slow
def test_quantize_model_nnx_in_place_and_restore():
    x = _x()
    net = Net(nnx.Rngs(0))
    float_out = net(x)
    recipe = Recipe(forward="mxfp4", grad="mxfp8", high_precision="head")
    assert lf.quantize_model(net, recipe) is net
    assert net.a.dot_general == lf.dot_general(recipe) and net.b.dot_general == lf.dot_general(recipe)
    assert net.c.einsum_op == lf.einsum(recipe)
    assert net.head.dot_general is jax.lax.dot_general  # excluded by pattern
    assert not isinstance(net.mine.dot_general, lf.RecipeDotGeneral)  # user's choice kept
    h = recipe.dot_general(x, net.a.kernel[...], DN) + net.a.bias[...]
    h = recipe.dot_general(jax.nn.relu(h), net.b.kernel[...], DN) + net.b.bias[...]
    h = recipe.einsum("bd,df->bf", h.reshape(8, 64), net.c.kernel[...]) + net.c.bias[...]
    assert_bits_equal(net(x), net.head(net.mine(h)))

    @nnx.jit
    def f(m, v):
        return m(v)

    quant_out = f(net, x)
    assert_bits_equal(quant_out, net(x))
    lf.quantize_model(net, None)
    assert net.a.dot_general is jax.lax.dot_general and net.b.dot_general is None
    assert_bits_equal(f(net, x), float_out)  # nnx.jit retraced: the recipe is part of the graph's static data
    lf.quantize_model(net, recipe)
    assert_bits_equal(f(net, x), quant_out)


@pytest.mark.slow
def test_nnx_grad_and_remat():
    # (vmap and jax.checkpoint of recipe dots: tests/test_recipe.py.)
    # One layer: remat re-runs its forward in the backward pass, still in the recipe.
    x = _x()
    net = lf.quantize_model(nnx.Linear(64, 32, rngs=nnx.Rngs(0)), NVIDIA_MXFP8)

    def loss(m, v):
        return jnp.sum(m(v) ** 2)

    # One program for both gradients (each alone compiles ~2 s).
    g1, g2 = nnx.jit(lambda m, v: (nnx.grad(loss)(m, v), nnx.grad(nnx.remat(loss))(m, v)))(net, x)
    jax.tree.map(assert_bits_equal, nnx.state(g1), nnx.state(g2))


# -- every matmul-like layer: quantized or reported -----------------------------------------------


class TiedLM(nn.Module):
    """Embedding lookup, one attention layer, logits through the tied embedding (attend)."""

    def setup(self):
        self.embed = nn.Embed(96, 64)
        self.attn = nn.MultiHeadDotProductAttention(2)

    def hidden(self, tokens):
        h = self.embed(tokens)
        return h + self.attn(h)

    def __call__(self, tokens):
        return self.embed.attend(self.hidden(tokens))


@pytest.mark.slow
def test_linen_embed_attend_runs_in_the_recipe():
    """Compared as traced programs (op by op, ~30 programs compile)."""
    tokens = jnp.arange(16).reshape(2, 8) % 96
    params = jax.eval_shape(TiedLM().init, jax.random.key(0), tokens)
    recipe = Recipe(forward="mxfp8", name="attend_test")
    q = lf.quantize_model(TiedLM(), recipe)

    def by_hand(p, t):
        # The recipe's dot of the (quantized model's) hidden states and the table.
        table = p["params"]["embed"]["embedding"]
        return recipe.dot_general(q.apply(p, t, method="hidden"), table, (((2,), (1,)), ((), ())))

    def float_attend(p, t):  # Flax's own attend: jnp.dot with the table
        return jnp.dot(TiedLM().apply(p, t, method="hidden"), p["params"]["embed"]["embedding"].T)

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # attention's products run in the recipe too: no warning
        assert_same_program(q.apply, by_hand, params, tokens, what="attend in the recipe")
        # Excluded by path: attend stays Flax's jnp.dot, and nothing warns.
        hp = lf.quantize_model(TiedLM(), Recipe(forward="mxfp8", high_precision=("embed", "attn*")))
        assert_same_program(hp.apply, float_attend, params, tokens, what="excluded")


def test_nnx_uncovered_layers_warn_in_quantize_model():
    class Mixed(nnx.Module):
        def __init__(self, rngs):
            self.conv = nnx.ConvTranspose(64, 64, (3,), rngs=rngs)
            self.embed = nnx.Embed(96, 64, rngs=rngs)
            self.lin = nnx.Linear(64, 64, rngs=rngs)

    recipe = Recipe(forward="mxfp8", name="nnx_warn_test")
    with pytest.warns(UserWarning) as record:
        lf.quantize_model(Mixed(nnx.Rngs(0)), recipe)
    text = " ".join(str(w.message) for w in record)
    assert "ConvTranspose at conv" in text and "at embed" not in text  # attend: in the recipe
    assert "at lin" not in text
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lf.quantize_model(Mixed(nnx.Rngs(0)), recipe)  # once per (path, recipe)
        lf.quantize_model(Mixed(nnx.Rngs(0)), Recipe(forward="mxfp8", high_precision=("conv", "embed")))


# -- per-layer rules --------------------------------------------------------------------------------


class RulesMLP(nn.Module):
    """MLP written with per-layer dot_generals by hand: what the rules below must give."""

    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(64, name="up", dot_general=lf.dot_general(R4))(x))
        h = nn.DenseGeneral((2, 32), name="gen", dot_general=lf.dot_general(NVIDIA_MXFP8))(h)
        h = nn.Dense(64, name="mine", dot_general=jax.lax.dot_general)(h.reshape(*h.shape[:-2], 64))
        return nn.Dense(8, name="head")(h)


def test_rules_first_match_wins_linen_and_nnx():
    rules = lowprec.Rules([("head", None), ("up", R4), ("u.*", NVIDIA_MXFP8), (".*", NVIDIA_MXFP8)])
    x = _x()
    params = jax.jit(MLP().init)(jax.random.key(1), x)
    assert_bits_equal(lf.quantize_model(MLP(), rules).apply(params, x), RulesMLP().apply(params, x))
    # A list of pairs is accepted as Rules; no match keeps the layer's own precision.
    q = lf.quantize_model(MLP(), [("gen", NVIDIA_MXFP8)])
    only_gen = dataclasses.replace(NVIDIA_MXFP8, high_precision=("up", "head"))
    assert_bits_equal(q.apply(params, x), lf.quantize_model(MLP(), only_gen).apply(params, x))
    # nnx: each layer gets its rule's recipe.
    net = lf.quantize_model(Net(nnx.Rngs(0)), lowprec.Rules([("a", R4), ("b|c", NVIDIA_MXFP8)]))
    assert net.a.dot_general == lf.dot_general(R4)
    assert net.b.dot_general == lf.dot_general(NVIDIA_MXFP8)
    assert net.c.einsum_op == lf.einsum(NVIDIA_MXFP8)
    assert net.head.dot_general is jax.lax.dot_general  # no rule matched
    with pytest.raises(ValueError, match="not a valid regular expression"):
        lowprec.Rule("(", None)
    with pytest.raises(TypeError, match="lowprec.Recipe or None"):
        lowprec.Rule(".*", "mxfp8")
