"""Delayed FP8 scaling (Transformer Engine's DelayedScaling) against a NumPy statement.

The statement follows lowprec/_delayed.py's docstring (TE semantics): cast q = fp8(x * scale)
saturating (the independent reference's exact-rational encoder), read q / scale in float32;
after the step record the amax (newest first, window amax_history_len) and take
scale = (fp8_max / amax) / 2^margin from the window's max (or newest) amax, keeping the old
scale where that amax is 0. Cast operands and states must match bit for bit; GEMMs within
2·K·2^-23·Σ|a b| of float64 dots of the statement's operands.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lowprec_reference as ref
from lowprec._delayed import DelayedScaling, delayed_dot_general

from helpers.asserts import assert_bits_equal
from helpers.kernels import gpu_routes_on_cpu  # noqa: F401  (a fixture)

DN = (((1,), (0,)), ((), ()))
FMAX = {"e4m3": np.float32(448.0), "e5m2": np.float32(57344.0)}


def np_cast(x, scale, fmt):
    xs = (np.asarray(x, np.float32) * np.float32(scale)).astype(np.float32)
    q = ref.decode(fmt, ref.encode(fmt, xs, "nearest_even", "saturate")).astype(np.float32)
    return (q / np.float32(scale)).astype(np.float32)


def np_update(hist, scale, amax, fmax, cfg):
    hist = np.concatenate([[np.float32(amax)], hist[:-1]]).astype(np.float32)
    chosen = hist.max() if cfg.amax_compute_algo == "max" else hist[0]
    new = np.float32(np.float32(fmax / chosen) / np.float32(2.0**cfg.margin)) if chosen > 0 else scale
    return hist, np.float32(new)


def _normal(seed, *shapes):
    """float32 standard normals drawn by NumPy (jax.random run op by op compiles its
    programs anew for every shape)."""
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(np.float32) for s in shapes]


def _within(got, a, b):
    a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
    bound = 2 * a64.shape[1] * 2.0**-23 * (np.abs(a64) @ np.abs(b64))
    assert np.all(np.abs(np.asarray(got, np.float64) - a64 @ b64) <= bound)


@pytest.mark.parametrize("cfg", [
    DelayedScaling(amax_history_len=2, margin=1),
    DelayedScaling(amax_history_len=3, amax_compute_algo="most_recent"),
])
@pytest.mark.parametrize("route", ["portable", "gpu"])
@pytest.mark.quick_cases(cfg=(DelayedScaling(amax_history_len=2, margin=1),))
def test_three_steps_match_the_numpy_statement(cfg, route, request):
    """Both formulations of the products: ``"portable"`` (float32 dots of q / scale, every
    backend) and ``"gpu"`` (cuBLASLt's FP8 GEMM of the codes with 1 / scale folded in, its
    math computed here: each operand q · fl(1/scale) rounds once more than q / scale, which
    the 2·K·2^-23 bound covers for K >= 3). The states are the same bits either way."""
    if route == "gpu":
        request.getfixturevalue("gpu_routes_on_cpu")
    state = cfg.init()
    hist, scale = np.zeros((3, cfg.amax_history_len), np.float32), np.ones(3, np.float32)

    @jax.jit
    def step(x, w, c, st):
        loss = lambda a, b, s: jnp.sum(delayed_dot_general(a, b, s, DN, cfg) * c)
        y = delayed_dot_general(x, w, st, DN, cfg)
        return (y,) + jax.grad(loss, argnums=(0, 1, 2))(x, w, st)

    for t, mag in enumerate((1.0, 30.0, 0.01)):  # the amax moves: the scale lags one step
        x, w, c = _normal(t, (16, 32), (32, 8), (16, 8))
        x, c = x * np.float32(mag), c * np.float32(mag)
        y, gx, gw, state = step(x, w, c, state)
        ql, qr = np_cast(x, scale[0], "e4m3"), np_cast(w, scale[1], "e4m3")
        qg = np_cast(c, scale[2], "e5m2")
        _within(y, ql, qr)
        _within(gx, qg, qr.T)
        _within(gw, ql.T, qg)
        amaxes = (np.abs(x).max(), np.abs(w).max(), np.abs(c).max())
        fmts = ("e4m3", "e4m3", "e5m2")
        for i in range(3):
            hist[i], scale[i] = np_update(hist[i], scale[i], amaxes[i], FMAX[fmts[i]], cfg)
        np.testing.assert_array_equal(np.asarray(state.amax_history), hist)
        assert_bits_equal(state.scale, scale)


def test_bad_options():
    with pytest.raises(ValueError, match="unknown amax_compute_algo 'mean'"):
        DelayedScaling(amax_compute_algo="mean")
    with pytest.raises(ValueError, match="amax_history_len must be a positive int"):
        DelayedScaling(amax_history_len=0)
    # 2^-127 is a float32 subnormal and 2^128 overflows: the scale would come out wrong.
    with pytest.raises(ValueError, match=r"margin must lie in \[-126, 126\].*got 127"):
        DelayedScaling(margin=127)
    with pytest.raises(TypeError, match="margin must be an int, got 1.5"):
        DelayedScaling(margin=1.5)


@pytest.mark.slow  # left out of the quick tier (seconds; its paths run in other quick tests)
def test_linen_layer_trains_with_flax_train_state():
    """lowprec.flax.DelayedDotGeneral in nn.Dense, stepped by Flax's own TrainState: the
    overwrite-with-gradient collection follows the NumPy statement over three steps (the scale
    lags the amax by one step), and the layer's products stay within the FP8 GEMM bound of the
    values cast with the previous step's scales."""
    nn = pytest.importorskip("flax.linen")
    optax = pytest.importorskip("optax")
    import functools

    from flax.training import train_state

    import lowprec.flax

    cfg = DelayedScaling(amax_history_len=3)
    layer = nn.Dense(8, use_bias=False,
                     dot_general_cls=functools.partial(lowprec.flax.DelayedDotGeneral, config=cfg))
    x0 = jnp.ones((16, 32))
    variables = jax.jit(layer.init)(jax.random.key(0), x0)  # eagerly: ~100 programs
    state = train_state.TrainState.create(apply_fn=layer.apply, params=variables,
                                          tx=optax.sgd(0.01))
    hist, scale = np.zeros((3, 3), np.float32), np.ones(3, np.float32)

    @jax.jit
    def step(st, x, c):
        loss = lambda v: jnp.sum(st.apply_fn(v, x) * c)
        grads = jax.grad(loss)(st.params)
        return st.apply_gradients(grads=grads), st.apply_fn(st.params, x)

    for t, mag in enumerate((1.0, 30.0, 0.01)):
        x, c = _normal(t + 1, (16, 32), (16, 8))
        x, c = x * np.float32(mag), c * np.float32(mag)
        w = np.asarray(state.params["params"]["kernel"])
        new, y = step(state, x, c)
        _within(y, np_cast(x, scale[0], "e4m3"), np_cast(w, scale[1], "e4m3"))
        amaxes = (np.abs(x).max(), np.abs(w).max(), np.abs(c).max())
        for i, fmt in enumerate(("e4m3", "e4m3", "e5m2")):
            hist[i], scale[i] = np_update(hist[i], scale[i], amaxes[i], FMAX[fmt], cfg)
        owg = new.params["_overwrite_with_gradient"]["DelayedDotGeneral_0"]
        np.testing.assert_array_equal(np.asarray(owg["amax_history"]), hist)
        assert_bits_equal(owg["scale"], scale)
        # The kernel took an ordinary SGD step (the state did not).
        assert not np.array_equal(np.asarray(new.params["params"]["kernel"]), w)
        state = new


def test_linen_layer_refuses_bad_config():
    nn = pytest.importorskip("flax.linen")
    import lowprec.flax

    layer = nn.Dense(2, dot_general_cls=lambda: lowprec.flax.DelayedDotGeneral(config="e4m3"))
    with pytest.raises(TypeError, match="DelayedScaling"):
        layer.init(jax.random.key(0), jnp.ones((1, 4)))


# -- nnx, Recipe, Rules and quantize_model ---------------------------------------------------------


@pytest.mark.slow  # left out of the quick tier (seconds; the linen layer's test covers the product)
def test_nnx_layer_trains_with_update_delayed_state():
    """lowprec.flax.DelayedDotGeneralNnx in nnx.Linear: nnx.grad with respect to the params
    and the DelayedScalingState variables, nnx.Optimizer on the params, update_delayed_state
    for the state; the state follows the NumPy statement over three steps."""
    nnx = pytest.importorskip("flax.nnx")
    optax = pytest.importorskip("optax")
    import lowprec.flax as lf

    cfg = DelayedScaling(amax_history_len=3)
    model = nnx.Linear(32, 8, use_bias=False, rngs=nnx.Rngs(0),
                       dot_general=lf.DelayedDotGeneralNnx(cfg))
    opt = nnx.Optimizer(model, optax.sgd(0.01), wrt=nnx.Param)
    wrt = nnx.Any(nnx.Param, lf.DelayedScalingState)

    @nnx.jit
    def step(model, opt, x, c):
        grads = nnx.grad(lambda m: jnp.sum(m(x) * c), argnums=nnx.DiffState(0, wrt))(model)
        y = model(x)
        opt.update(model, grads)
        lf.update_delayed_state(model, grads)
        return y

    hist, scale = np.zeros((3, 3), np.float32), np.ones(3, np.float32)
    for t, mag in enumerate((1.0, 30.0, 0.01)):
        x, c = _normal(t + 1, (16, 32), (16, 8))
        x, c = x * np.float32(mag), c * np.float32(mag)
        w = np.asarray(model.kernel[...])
        y = step(model, opt, x, c)
        _within(y, np_cast(x, scale[0], "e4m3"), np_cast(w, scale[1], "e4m3"))
        amaxes = (np.abs(x).max(), np.abs(w).max(), np.abs(c).max())
        for i, fmt in enumerate(("e4m3", "e4m3", "e5m2")):
            hist[i], scale[i] = np_update(hist[i], scale[i], amaxes[i], FMAX[fmt], cfg)
        np.testing.assert_array_equal(np.asarray(model.dot_general.amax_history[...]), hist)
        assert_bits_equal(model.dot_general.scale[...], scale)
        assert not np.array_equal(np.asarray(model.kernel[...]), w)  # an SGD step


def test_delayed_recipe_through_rules_and_quantize_model():
    """FP8_DELAYED through Rules and quantize_model: linen layers matched by a delayed rule
    get a DelayedDotGeneral child holding their own state (the others none), Flax's
    TrainState overwrites it with its gradient (one step from scale 1, as the statement);
    nnx layers get a DelayedDotGeneralNnx each, kept when quantized again with the same
    options and removed by quantize_model(model, None)."""
    nn = pytest.importorskip("flax.linen")
    nnx = pytest.importorskip("flax.nnx")
    optax = pytest.importorskip("optax")
    from flax.training import train_state

    import lowprec
    import lowprec.flax as lf

    recipe = lowprec.FP8_DELAYED
    assert recipe.delayed == DelayedScaling() and recipe.backward == "quantized"
    assert lowprec.RECIPES["fp8_delayed"] is recipe

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(8, use_bias=False, name="head")(
                nn.relu(nn.Dense(16, use_bias=False, name="up")(x)))

    qmodel = lf.quantize_model(MLP(), lowprec.Rules([("head", None), (".*", recipe)]))
    # NumPy data, jitted steps: eagerly, init / grad / apply_gradients dispatch op by op
    # (~290 compiled programs); jitted, 3.
    x = (np.random.default_rng(1).standard_normal((16, 32)) * 3).astype(np.float32)
    variables = jax.jit(qmodel.init)(jax.random.key(0), x)
    owg = variables["_overwrite_with_gradient"]
    assert set(owg) == {"up"} and owg["up"]["DelayedDotGeneral_0"]["scale"].shape == (3,)
    state = train_state.TrainState.create(apply_fn=qmodel.apply, params=variables,
                                          tx=optax.sgd(0.01))

    @jax.jit
    def step(state):
        grads = jax.grad(lambda v: jnp.sum(qmodel.apply(v, x)))(state.params)
        return state.apply_gradients(grads=grads)

    new = step(state)
    got = new.params["_overwrite_with_gradient"]["up"]["DelayedDotGeneral_0"]
    w = np.asarray(variables["params"]["up"]["kernel"])
    assert_bits_equal(got["scale"][:2], np.float32(448) / np.array(
        [np.abs(x).max(), np.abs(w).max()], np.float32))
    assert float(got["amax_history"][0, 0]) == np.abs(x).max()

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.up = nnx.Linear(32, 16, rngs=rngs)
            self.head = nnx.Linear(16, 8, rngs=rngs)

        def __call__(self, v):
            return self.head(nnx.relu(self.up(v)))

    net = lf.quantize_model(Net(nnx.Rngs(0)), recipe)
    assert isinstance(net.up.dot_general, lf.DelayedDotGeneralNnx)
    assert net.up.dot_general is not net.head.dot_general
    assert nnx.jit(lambda m, v: m(v))(net, x).shape == (16, 8)
    kept = net.up.dot_general
    assert lf.quantize_model(net, recipe).up.dot_general is kept
    lf.quantize_model(net, None)
    assert net.up.dot_general is jax.lax.dot_general


def test_delayed_recipe_refuses_calls_without_state():
    import lowprec
    import lowprec.flax as lf

    r = lowprec.FP8_DELAYED
    x, w = jnp.ones((4, 32)), jnp.ones((32, 8))
    for call in (lambda: r.dot_general(x, w, DN), lambda: r.einsum("tk,kn->tn", x, w),
                 lambda: r.ragged_dot(x, w[None], jnp.array([4]))):
        with pytest.raises(ValueError, match="delayed scaling: its scales come from the amax "
                                             "history"):
            call()
    with pytest.raises(ValueError, match="DelayedDotGeneralNnx"):
        lf.dot_general(r)
    with pytest.raises(ValueError, match="forward one element format for both operands"):
        lowprec.Recipe(forward="mxfp8", grad="e5m2", scaling="delayed")
    with pytest.raises(ValueError, match=r"delayed's formats \('e4m3', 'e5m2'\) differ"):
        lowprec.Recipe(forward="e4m3", grad="e4m3", scaling="delayed",
                       delayed=DelayedScaling(amax_history_len=8))
    with pytest.raises(ValueError, match="delayed holds the options of scaling='delayed'"):
        lowprec.Recipe(forward="e4m3", delayed=DelayedScaling())
    assert "delayed scaling (history 1024, max, margin 0)" in r.describe()
