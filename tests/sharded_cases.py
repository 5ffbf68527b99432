"""Sharding checks, run by tests/test_sharding.py in a subprocess on 4 CPU devices.

Not collected by the main test run (the file name does not start with ``test_``): XLA_FLAGS
must hold ``--xla_force_host_platform_device_count=4`` before JAX initializes, which the main
process must not do to itself. Run directly with::

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python -m pytest tests/sharded_cases.py

Expected values are the same computation on one device (unsharded): sharding must change
nothing but the layout. Both kinds of mesh axes are covered: ``Explicit`` (the default of
``jax.make_mesh``; the sharding is part of each traced value's type) and ``Auto`` (GSPMD
chooses the layout after tracing).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import lowprec

if jax.device_count() < 4:  # pragma: no cover - guards a direct run without XLA_FLAGS
    pytest.skip("needs 4 devices: XLA_FLAGS=--xla_force_host_platform_device_count=4",
                allow_module_level=True)

AXIS_TYPES = {"explicit": AxisType.Explicit, "auto": AxisType.Auto}


def _mesh(kind, shape=(4,), names=("x",)):
    return jax.make_mesh(shape, names, axis_types=(AXIS_TYPES[kind],) * len(shape))


def _bits(a):
    a = np.asarray(jax.device_get(a))
    return a.view(np.uint32) if a.dtype == np.float32 else a


def _assert_mx_equal(got, want):
    np.testing.assert_array_equal(_bits(got.elements), _bits(want.elements))
    np.testing.assert_array_equal(_bits(got.scales), _bits(want.scales))
    assert (got.fmt, got.axis, got.shape) == (want.fmt, want.axis, want.shape)


def _data(shape, seed=0):
    # Wide dynamic range (so blocks get different scales), plus a zero block and a NaN block.
    k1, k2 = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(k1, shape) * jnp.exp2(jax.random.randint(k2, shape, -20, 20))
    x = x.at[0, :32].set(0.0)
    return x.at[1, 32:64].set(jnp.nan)


@pytest.mark.parametrize("kind,mode", [("explicit", "eager"), ("explicit", "jit"), ("auto", "jit")])
@pytest.mark.parametrize("spec,fmt,rule", [
    (P("x", None), "mxfp8_e4m3", "rceil"),  # rows split: blocks untouched
    (P(None, "x"), "mxfp4", "floor"),  # block axis split into 4 shards of 64 (2 blocks each)
    (P("x", "y"), "mxfp8_e5m2", "even"),  # both, on a 2 x 2 mesh
])
def test_quantize_mx_bits_same_sharded(kind, mode, spec, fmt, rule):
    x = _data((16, 256))
    want = lowprec.quantize_mx(x, fmt, scale_rule=rule)  # one device
    mesh = _mesh(kind, (2, 2), ("x", "y")) if "y" in spec else _mesh(kind)
    xs = jax.device_put(x, NamedSharding(mesh, spec))
    f = lambda v: lowprec.quantize_mx(v, fmt, scale_rule=rule)
    with jax.set_mesh(mesh):
        got = jax.jit(f)(xs) if mode == "jit" else f(xs)
    _assert_mx_equal(got, want)
    assert got.scales.sharding.spec == spec  # the blocks stayed on their devices


@pytest.mark.parametrize("kind", ["explicit"])
def test_stochastic_quantize_mx_same_sharded(kind):
    x, key = _data((8, 128), 1), jax.random.key(3)
    want = lowprec.quantize_mx(x, "mxfp4", rounding="stochastic", key=key)
    mesh = _mesh(kind)
    xs = jax.device_put(x, NamedSharding(mesh, P("x", None)))
    with jax.set_mesh(mesh):
        got = jax.jit(lambda v: lowprec.quantize_mx(v, "mxfp4", rounding="stochastic", key=key))(xs)
    _assert_mx_equal(got, want)


MATMUL = dict(lhs_format="mxfp8_e4m3", rhs_format="mxfp4", scale_rule="rceil")
DN = (((1,), (0,)), ((), ()))


@pytest.mark.parametrize("kind,mode", [("explicit", "eager"), ("auto", "jit")])
@pytest.mark.parametrize("lspec,rspec", [
    (P("x", None), P(None, None)),  # data parallel: tokens split
    (P(None, None), P(None, "x")),  # tensor parallel: output features split
])
def test_matmul_bits_same_sharded_free_axes(kind, mode, lspec, rspec):
    k1, k2 = jax.random.split(jax.random.key(5))
    x, w = jax.random.normal(k1, (64, 128)), jax.random.normal(k2, (128, 96))
    want = lowprec.dot_general(x, w, DN, **MATMUL)
    mesh = _mesh(kind)
    xs, ws = (jax.device_put(a, NamedSharding(mesh, s)) for a, s in ((x, lspec), (w, rspec)))
    f = lambda a, b: lowprec.dot_general(a, b, DN, **MATMUL)
    with jax.set_mesh(mesh):
        got = jax.jit(f)(xs, ws) if mode == "jit" else f(xs, ws)
    np.testing.assert_array_equal(_bits(got), _bits(want))


@pytest.mark.parametrize("kind", ["auto"])  # Explicit axes: see the note below
def test_matmul_contraction_sharded(kind):
    # K split into 4 shards of 32: every block is on one device; each device multiplies its
    # blocks and the partial sums are added across devices, so only the float32 summation
    # order can differ. (1) Integer-valued operands have exact sums in any order: bits equal.
    # (2) Random operands: within the accumulation bound K * 2^-23 * sum|a_i b_i|.
    k1, k2 = jax.random.split(jax.random.key(6))
    mesh = _mesh(kind)
    f = lambda a, b: lowprec.dot_general(a, b, DN, **MATMUL)
    ints = (jax.random.randint(k1, (16, 128), -8, 8).astype(jnp.float32),
            jax.random.randint(k2, (128, 32), -3, 4).astype(jnp.float32))
    rand = jax.random.normal(k1, (16, 128)), jax.random.normal(k2, (128, 32))
    for exact, (x, w) in ((True, ints), (False, rand)):
        want = f(x, w)
        xs = jax.device_put(x, NamedSharding(mesh, P(None, "x")))
        ws = jax.device_put(w, NamedSharding(mesh, P("x", None)))
        with jax.set_mesh(mesh):
            got = jax.jit(f)(xs, ws)
        if exact:
            np.testing.assert_array_equal(_bits(got), _bits(want))
        else:
            qx = lowprec.dequantize(lowprec.quantize_mx(x, "mxfp8_e4m3", scale_rule="rceil"))
            qw = lowprec.dequantize(lowprec.quantize_mx(w, "mxfp4", scale_rule="rceil", axis=0))
            bound = 2 * 128 * 2.0**-23 * (np.abs(np.asarray(qx, np.float64)) @ np.abs(np.asarray(qw, np.float64)))
            assert np.all(np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64)) <= bound)


# With Explicit mesh axes and the contraction sharded, JAX requires the output sharding of
# the inner lax.dot_general to be given (as for jnp.dot); lowprec.dot_general has no
# out_sharding argument yet, so that layout raises JAX's ShardingTypeError. Not tested here.


@pytest.mark.parametrize("kind", ["explicit", "auto"])
def test_split_block_is_a_clear_error_eager(kind):
    mesh = _mesh(kind)
    x = jax.device_put(jnp.ones((4, 64)), NamedSharding(mesh, P(None, "x")))  # 16 per shard
    with jax.set_mesh(mesh):
        with pytest.raises(ValueError, match=r"axis 1 \(length 64\) is split into 4 shards of 16"):
            lowprec.quantize_mx(x, "mxfp8")
        with pytest.raises(ValueError, match="straddle shard boundaries"):
            lowprec.dot_general(x, jnp.ones((64, 8)), DN, lhs_format="mxfp8")
        lowprec.quantize_mx(x, "mxfp8", axis=0, pad=True)  # another axis: fine


def test_split_block_is_a_clear_error_under_jit_explicit():
    mesh = _mesh("explicit")
    x = jax.device_put(jnp.ones((4, 64)), NamedSharding(mesh, P(None, "x")))
    with jax.set_mesh(mesh):
        with pytest.raises(ValueError, match="would straddle shard boundaries"):
            jax.jit(lambda v: lowprec.quantize_mx(v, "mxfp8"))(x)


def test_split_block_under_jit_auto_is_unchecked_but_exact():
    # Auto axes: the layout is chosen after tracing, so nothing can be checked; GSPMD keeps the
    # meaning, so the bits still equal the one-device result (documented in lowprec._sharding).
    mesh = _mesh("auto")
    x = _data((4, 64))
    xs = jax.device_put(x, NamedSharding(mesh, P(None, "x")))
    got = jax.jit(lambda v: lowprec.quantize_mx(v, "mxfp8"))(xs)
    _assert_mx_equal(got, lowprec.quantize_mx(x, "mxfp8"))


# Auto axes only. With Explicit axes the weight-gradient dot contracts over the sharded token
# axis, and JAX then needs the output sharding of the inner lax.dot_general, which the custom
# VJP of lowprec.dot_general does not pass yet (it raises JAX's ShardingTypeError).
@pytest.mark.parametrize("kind", ["auto"])
def test_flax_recipe_data_parallel(kind):
    # 128 tokens on 4 devices: 32 per device, so the weight gradient's blocks (along tokens)
    # stay on one device each.
    flax_nn = pytest.importorskip("flax.linen")
    import lowprec.flax

    model = flax_nn.Dense(64, dot_general=lowprec.flax.dot_general(lowprec.NVIDIA_MXFP8))
    x = jax.random.normal(jax.random.key(0), (128, 128))
    params = model.init(jax.random.key(1), x)
    loss = lambda p, v: jnp.sum(model.apply(p, v) ** 2)
    want_y, want_g = jax.jit(jax.value_and_grad(loss))(params, x)
    want_out = model.apply(params, x)
    mesh = _mesh(kind)
    xs = jax.device_put(x, NamedSharding(mesh, P("x", None)))
    ps = jax.device_put(params, NamedSharding(mesh, P()))
    with jax.set_mesh(mesh):
        got_out = jax.jit(model.apply)(ps, xs)
        got_y, got_g = jax.jit(jax.value_and_grad(loss))(ps, xs)
    # The layer's output is per token: same bits. The loss and the weight gradient sum over
    # tokens across devices (the order may differ): float32 accuracy.
    np.testing.assert_array_equal(_bits(got_out), _bits(want_out))
    np.testing.assert_allclose(np.asarray(got_y), np.asarray(want_y), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(got_g), jax.tree.leaves(want_g)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=1e-5)


def test_flax_recipe_too_few_tokens_per_device_is_a_clear_error():
    # 32 tokens on 4 devices: the weight gradient's 32-token blocks would span 4 devices.
    flax_nn = pytest.importorskip("flax.linen")
    import lowprec.flax

    model = flax_nn.Dense(64, dot_general=lowprec.flax.dot_general(lowprec.NVIDIA_MXFP8))
    x = jax.random.normal(jax.random.key(0), (32, 128))
    params = model.init(jax.random.key(1), x)
    mesh = _mesh("explicit")
    xs = jax.device_put(x, NamedSharding(mesh, P("x", None)))
    ps = jax.device_put(params, NamedSharding(mesh, P()))
    loss = lambda p, v: jnp.sum(model.apply(p, v) ** 2)
    with jax.set_mesh(mesh):
        with pytest.raises(ValueError, match=r"backward dot for grad_rhs.*free dims \(0,\)"):
            jax.jit(jax.grad(loss))(ps, xs)


def test_recipe_dot_general_out_sharding():
    # nnx layers pass out_sharding through to dot_general; the recipe reshards its output.
    # 16 tokens per device: fine for this forward-only call; only a gradient would need the
    # token axis in whole blocks (test_flax_recipe_too_few_tokens_per_device_...).
    mesh = _mesh("explicit")
    x, w = _data((64, 128), 2), jax.random.normal(jax.random.key(8), (128, 32))
    x = jnp.nan_to_num(x)
    want = lowprec.NVIDIA_MXFP8.dot_general(x, w, DN)
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, P("x", None))
        got = jax.jit(lambda a, b: lowprec.NVIDIA_MXFP8.dot_general(
            a, b, DN, out_sharding=P(None, "x")))(xs, w)
    assert got.sharding.spec == P(None, "x")
    np.testing.assert_array_equal(_bits(got), _bits(want))


def test_sharded_inputs_keep_the_partitionable_formulation():
    """The one-pass Pallas kernels are single-device calls, so quantize_mx and
    fake_quantize_mx take them (on CUDA) only for inputs not laid out over several devices:
    a sharded concrete array, or a traced one over Explicit axes, keeps XLA's formulation."""
    from lowprec import _mx

    x = _data((16, 256))
    assert _mx._unsharded(x)
    seen = []
    jax.jit(lambda v: seen.append(_mx._unsharded(v)) or v)(x)
    for kind in ("explicit", "auto"):
        mesh = _mesh(kind)
        xs = jax.device_put(x, NamedSharding(mesh, P("x", None)))
        assert not _mx._unsharded(xs)
        with jax.set_mesh(mesh):
            jax.jit(lambda v: seen.append(_mx._unsharded(v)) or v)(xs)
    assert seen == [True, False, True]  # unsharded; Explicit axes; Auto axes (no layout)
