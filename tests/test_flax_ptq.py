"""Post-training quantization inside Flax: MXArray kernels stored in the model state.

Expected values: the served product equals the product of the reference-quantized input and
kernel (``lowprec_reference``, blocks along the contraction) within the float32 accumulation
bound, and the recipe's own forward on the float kernel bit for bit (the same quantization,
done once instead of at every call); stored bytes from the formats' definitions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

flax = pytest.importorskip("flax")
import flax.linen as nn  # noqa: E402
from flax import nnx, serialization  # noqa: E402

import lowprec  # noqa: E402
import lowprec.flax as lf  # noqa: E402
import lowprec_reference as ref  # noqa: E402
from lowprec import Recipe  # noqa: E402

from helpers.asserts import assert_bits_equal  # noqa: E402

PLANS = {
    "mxfp8": Recipe(forward="mxfp8", scale_options={"scale_rule": "rceil"}),
    "mxfp8xmxfp4": Recipe(forward=("mxfp8", "mxfp4"), scale_options={"scale_rule": "floor"}),
}
REF_NAMES = {"mxfp8": ("mxfp8_e4m3", "mxfp8_e4m3"), "mxfp8xmxfp4": ("mxfp8_e4m3", "mxfp4")}


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(64, name="up")(x))
        h = nn.DenseGeneral((2, 32), name="gen")(h)
        h = nn.DenseGeneral(40, axis=(-2, -1), name="merge")(h)
        return nn.Dense(8, name="head")(h)



def _rules(recipe):
    return lowprec.Rules([("head", None), (".*", recipe)])


def _x(shape=(2, 5, 48), seed=0):
    # Drawn by NumPy: jax.random run op by op compiles its programs anew for every shape.
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape).astype(np.float32))


def _ref_q(x, fmt, axis, rule):
    x = np.asarray(x, np.float32)
    el, sc = ref.quantize_mx(x, fmt, axis=axis, scale_rule=rule, pad=True)
    out = ref.dequantize_mx(el, sc, fmt, axis=axis).astype(np.float64)
    return np.take(out, np.arange(x.shape[axis]), axis=axis)


@pytest.mark.parametrize("name", PLANS)
@pytest.mark.parametrize("mode", ["eager", "jit"])
@pytest.mark.quick_cases(mode=["jit"])
def test_linen_ptq_layer_is_the_reference_quantized_product(name, mode):
    recipe = PLANS[name]
    layer = nn.Dense(24)
    x = _x((2, 5, 40))  # [batch, seq, d]; 40 is padded to 64 along the contraction
    params = jax.jit(layer.init)(jax.random.key(1), x)  # op by op: a program per op
    served = lf.ptq(layer, recipe)
    qparams = served.quantize_params(params, x)
    kernel = qparams["params"]["kernel"]
    assert isinstance(kernel, lowprec.MXArray) and kernel.axis == 0 and kernel.shape == (40, 24)
    apply = jax.jit(served.apply) if mode == "jit" else served.apply
    got = np.asarray(apply(qparams, x), np.float64)
    lname, rname = REF_NAMES[name]
    rule = recipe.options_of(lowprec.mx_format("mxfp8")).scale_rule.value
    qx = _ref_q(x, lname, 2, rule)
    qw = _ref_q(params["params"]["kernel"], rname, 0, rule)
    want = qx @ qw + np.asarray(params["params"]["bias"], np.float64)
    bound = 40 * 2.0**-23 * (np.abs(qx) @ np.abs(qw)) + 2.0**-23 * np.abs(want)
    assert (np.abs(got - want) <= bound).all()


@pytest.mark.parametrize("name", [
    pytest.param("mxfp8", marks=pytest.mark.slow),  # the MXFP8 kernel path: the layer test
    "mxfp8xmxfp4",
])
def test_linen_ptq_model_equals_the_recipe_forward_and_stores_fewer_bytes(name):
    recipe = PLANS[name]
    x = _x()
    params = _mlp_params(x)
    served = lf.ptq(MLP(), _rules(recipe))
    qparams = served.quantize_params(params, x)
    kinds = {k: type(v["kernel"]).__name__ for k, v in qparams["params"].items()}
    assert kinds == {"up": "MXArray", "gen": "MXArray", "merge": "MXArray", "head": "ArrayImpl"}

    @jax.jit
    def run(qparams, params, x):
        return served.apply(qparams, x), lf.quantize_model(MLP(), _rules(recipe)).apply(params, x)

    got, want = run(qparams, params, x)
    assert_bits_equal(got, want)
    # Bytes: an MX kernel [K, N] (K padded to 32) stores K*N elements of the format's width
    # and one E8M0 byte per 32; biases and the float head stay float32.
    bits = 4 if recipe.forward[1].name == "mxfp4" else 8
    kernels = [(48, 64), (64, 64), (64, 40)]
    padded = [(-(-k // 32) * 32, n) for k, n in kernels]
    mx = sum(k * n * bits // 8 + (k // 32) * n for k, n in padded)
    floats = 4 * (64 + 64 + 40 + 8 + 40 * 8)  # biases + head kernel [40, 8]
    assert lf.params_nbytes(qparams) == mx + floats
    f32 = lf.params_nbytes(params)
    assert f32 == 4 * sum(k * n for k, n in kernels) + floats
    print(f"{name}: {lf.params_nbytes(qparams)} bytes vs f32 {f32}, bf16 {f32 // 2}")


@pytest.mark.slow  # seconds; the quick nnx PTQ test serializes MXArray weights too
def test_ptq_params_round_trip_through_flax_serialization():
    recipe = PLANS["mxfp8xmxfp4"]
    x = _x()
    params = _mlp_params(x)
    served = lf.ptq(MLP(), _rules(recipe))
    qparams = served.quantize_params(params, x)
    data = serialization.to_bytes(qparams)
    template = jax.eval_shape(lambda: served.quantize_params(params, x))  # no values needed
    back = serialization.from_bytes(template, data)
    jax.tree.map(assert_bits_equal, back, qparams)
    assert_bits_equal(served.apply(back, x), served.apply(qparams, x))


# One jitted init shared by the tests (op by op, init compiles a program per op).
_mlp_params = jax.jit(lambda x: MLP().init(jax.random.key(1), x))


class Net(nnx.Module):
    def __init__(self, rngs):
        self.up = nnx.Linear(48, 64, rngs=rngs)
        self.gen = nnx.LinearGeneral(64, (2, 32), rngs=rngs)
        self.head = nnx.Linear(64, 8, rngs=rngs)

    def __call__(self, x):
        return self.head(self.gen(nnx.relu(self.up(x))).reshape(*x.shape[:-1], 64))


def test_nnx_ptq_in_place_serves_the_recipe_forward_and_serializes():
    recipe = PLANS["mxfp8xmxfp4"]
    x = _x()
    net = Net(nnx.Rngs(0))
    want = lf.quantize_model(nnx.clone(net), _rules(recipe))(x)
    assert lf.ptq(net, _rules(recipe)) is net
    assert isinstance(net.up, lf.PtqLinear) and isinstance(net.head, nnx.Linear)
    assert_bits_equal(net(x), want)
    assert_bits_equal(nnx.jit(lambda m, x: m(x))(net, x), want)
    # The stored weights are QuantizedWeight variables, not Params (optimizers skip them).
    assert set(nnx.to_pure_dict(nnx.state(net, lf.QuantizedWeight))) == {"up", "gen"}
    assert "kernel" not in nnx.to_pure_dict(nnx.state(net, nnx.Param))["up"]
    # Round trip: pure dict -> bytes -> a fresh PTQ model of the same structure.
    data = serialization.to_bytes(nnx.to_pure_dict(nnx.state(net)))
    other = lf.ptq(Net(nnx.Rngs(7)), _rules(recipe))
    state = nnx.state(other)
    nnx.replace_by_pure_dict(state, serialization.from_bytes(nnx.to_pure_dict(state), data))
    nnx.update(other, state)
    assert_bits_equal(other(x), want)


@pytest.mark.parametrize("recipe,match", [
    (lowprec.FP8_HYBRID, r"at (up|gen) has recipe 'fp8_hybrid' with scaling='tensor'"),
    (lowprec.NVIDIA_NVFP4, r"at (up|gen) has recipe 'nvidia_nvfp4' with the NVFP4 training recipe"),
    (Recipe(forward="e4m3", name="e4m3"), r"weight format 'e4m3' that is not an MX block format"),
])
def test_ptq_refuses_what_one_mxarray_cannot_store(recipe, match):
    with pytest.raises(ValueError, match=match):
        lf.ptq(Net(nnx.Rngs(0)), recipe)
    x = _x()
    params = _mlp_params(x)
    with pytest.raises(ValueError, match=match):
        lf.ptq(MLP(), recipe).quantize_params(params, x)


def test_ptq_refuses_a_bare_layer_and_a_mismatched_plan():
    with pytest.raises(ValueError, match=r"itself an nnx.Linear: wrap it in a module"):
        lf.ptq(nnx.Linear(64, 8, rngs=nnx.Rngs(0)), PLANS["mxfp8"])
    x = _x()
    params = _mlp_params(x)
    qparams = lf.ptq(MLP(), _rules(PLANS["mxfp8xmxfp4"])).quantize_params(params, x)
    with pytest.raises(ValueError, match=r"kernel at up is stored in mxfp4 but the plan's "
                                         r"recipe has weights in mxfp8_e4m3"):
        lf.ptq(MLP(), _rules(PLANS["mxfp8"])).apply(qparams, x)
