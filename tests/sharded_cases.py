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

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import lowprec
from lowprec import _delayed, _nvfp4_train, _qdot, _ragged
from lowprec.kernels import _dispatch

from helpers.asserts import assert_bits_equal
from helpers.kernels import gpu_routes_on_cpu  # noqa: F401  (a fixture)

if jax.device_count() < 4:  # pragma: no cover - guards a direct run without XLA_FLAGS
    pytest.skip("needs 4 devices: XLA_FLAGS=--xla_force_host_platform_device_count=4",
                allow_module_level=True)

AXIS_TYPES = {"explicit": AxisType.Explicit, "auto": AxisType.Auto}


def extended(*values):
    """A case that only the extended sweep (LOWPREC_FULL_SUITE=1) runs (tests/helpers/tiers.py).

    The default run keeps a sample of the costly training cases: every test function, recipe,
    kind of mesh axes, layout (data, tensor, data x tensor, FSDP, expert) and the linen
    transformer block on Explicit axes (tests/test_sharding.py checks this of each run; the
    nnx block: the extended sweep); a case marked here
    repeats one of those in another combination (the NVFP4 compiles cost 20-50 s of CPU each).
    """
    return pytest.param(*values, marks=pytest.mark.extended)


def _mesh(kind, shape=(4,), names=("x",)):
    return jax.make_mesh(shape, names, axis_types=(AXIS_TYPES[kind],) * len(shape))


def _assert_mx_equal(got, want):
    assert_bits_equal(got.elements, want.elements)
    assert_bits_equal(got.scales, want.scales)
    assert (got.fmt, got.axis, got.shape) == (want.fmt, want.axis, want.shape)


# The expected values of a training case (the same computation on one device) depend on the
# case's function and recipe, not on its mesh layout: computed once per (function, recipe) and
# shared by the layouts (one compile of the one-device program instead of one per case). Keyed
# by the products' formulation too: the gpu_routes_on_cpu fixture swaps it.
_ONE_DEVICE = {}
_ROUTED = (_qdot, _delayed, _nvfp4_train, _ragged)
_PORTABLE = tuple(m.on_cuda for m in _ROUTED)  # as imported: the fixture not in force


def _one_device(what, recipe, run):
    gpu_routes = tuple(m.on_cuda for m in _ROUTED) != _PORTABLE
    key = (what, repr(recipe), gpu_routes, _dispatch.cuda_kernels_possible())
    if key not in _ONE_DEVICE:
        _ONE_DEVICE[key] = run()
    return _ONE_DEVICE[key]


# Test data comes from NumPy: an eager jax.random call (or .at[].set) is a program of its own
# to compile for the 4-device backend, one per new shape (up to ~20 of a case's compiles).
def _normal(seed, *shapes):
    """Standard normal float32 NumPy arrays of ``shapes`` (one generator per seed)."""
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s, dtype=np.float32) for s in shapes]


def _ints(seed, shape, low, high):
    """Integers in [low, high) as a float32 NumPy array: products with exact sums in any
    order."""
    return np.random.default_rng(seed).integers(low, high, shape).astype(np.float32)


def _data(shape, seed=0, nan_block=True):
    # Wide dynamic range (so blocks get different scales), plus a zero block and a NaN block.
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape, dtype=np.float32)
    x *= np.exp2(rng.integers(-20, 20, shape)).astype(np.float32)
    x[0, :32] = 0.0
    x[1, 32:64] = np.nan if nan_block else 1.0
    return jnp.asarray(x)


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
    x, w = _normal(5, (64, 128), (128, 96))
    want = lowprec.dot_general(x, w, DN, **MATMUL)
    mesh = _mesh(kind)
    xs, ws = (jax.device_put(a, NamedSharding(mesh, s)) for a, s in ((x, lspec), (w, rspec)))
    f = lambda a, b: lowprec.dot_general(a, b, DN, **MATMUL)
    with jax.set_mesh(mesh):
        got = jax.jit(f)(xs, ws) if mode == "jit" else f(xs, ws)
    assert_bits_equal(got, want)


@pytest.mark.parametrize("kind", ["auto"])  # Explicit axes: see the note below
def test_matmul_contraction_sharded(kind):
    # K split into 4 shards of 32: every block is on one device; each device multiplies its
    # blocks and the partial sums are added across devices, so only the float32 summation
    # order can differ. (1) Integer-valued operands have exact sums in any order: bits equal.
    # (2) Random operands: within the accumulation bound K * 2^-23 * sum|a_i b_i|.
    mesh = _mesh(kind)
    # One program per device count, for both operand pairs (same shapes): jitted, not eager.
    f = jax.jit(lambda a, b: lowprec.dot_general(a, b, DN, **MATMUL))
    ints = _ints(61, (16, 128), -8, 8), _ints(62, (128, 32), -3, 4)
    rand = _normal(6, (16, 128), (128, 32))
    for exact, (x, w) in ((True, ints), (False, rand)):
        want = f(x, w)
        xs = jax.device_put(x, NamedSharding(mesh, P(None, "x")))
        ws = jax.device_put(w, NamedSharding(mesh, P("x", None)))
        with jax.set_mesh(mesh):
            got = f(xs, ws)
        if exact:
            assert_bits_equal(got, want)
        else:
            qx, qw = jax.jit(lambda a, b: (
                lowprec.dequantize(lowprec.quantize_mx(a, "mxfp8_e4m3", scale_rule="rceil")),
                lowprec.dequantize(lowprec.quantize_mx(b, "mxfp4", scale_rule="rceil", axis=0))))(x, w)
            bound = 2 * 128 * 2.0**-23 * (np.abs(np.asarray(qx, np.float64)) @ np.abs(np.asarray(qw, np.float64)))
            off = np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64)) - bound
            assert np.all(off <= 0), (f"K split on {kind} axes: {int((off > 0).sum())} of "
                                      f"{off.size} outputs beyond the accumulation bound")


def test_matmul_contraction_sharded_explicit_needs_and_honours_out_sharding():
    # Explicit axes, K split on both operands: as for lax.dot_general, the output sharding must
    # be named; it is given to the inner dot, whose partial sums are reduced into it.
    x = _ints(61, (16, 128), -8, 8)  # exact sums in any order
    w = _ints(62, (128, 32), -3, 4)
    want = lowprec.dot_general(x, w, DN, **MATMUL)
    mesh = _mesh("explicit")
    with jax.set_mesh(mesh):
        xs, ws = jax.device_put(x, P(None, "x")), jax.device_put(w, P("x", None))
        with pytest.raises(Exception, match="out_sharding"):
            jax.jit(lambda a, b: jax.lax.dot_general(a, b, DN))(xs, ws)  # plain JAX alike
        with pytest.raises(Exception, match="out_sharding"):
            jax.jit(lambda a, b: lowprec.dot_general(a, b, DN, **MATMUL))(xs, ws)
        specs = (P(None, None), P("x", None), P(None, "x"))
        # The three output layouts in one program (which quantizes the operands once).
        outs = jax.jit(lambda a, b: [lowprec.dot_general(a, b, DN, out_sharding=spec, **MATMUL)
                                     for spec in specs])(xs, ws)
        for spec, got in zip(specs, outs):
            assert _spec_of(got) == tuple(spec), (spec, got.sharding)
            assert_bits_equal(got, want, f"out_sharding={spec}")


def _spec_of(a):
    spec = tuple(a.sharding.spec)
    return spec + (None,) * (a.ndim - len(spec))


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


# Every block function runs the same entry checks (MXCast.check_call): fake_quantize_mx and
# shared_exponents once failed here with JAX's raw ShardingTypeError (or split blocks silently)
# where quantize_mx gave lowprec's error.
BLOCK_FUNCTIONS = {
    "quantize_mx": lambda v: lowprec.quantize_mx(v, "mxfp8"),
    "fake_quantize_mx": lambda v: lowprec.fake_quantize_mx(v, "mxfp8"),
    "shared_exponents": lambda v: lowprec.shared_exponents(v, "mxfp8"),
}


@pytest.mark.parametrize("name", list(BLOCK_FUNCTIONS))
@pytest.mark.parametrize("kind,mode", [("explicit", "eager"), ("explicit", "jit"), ("auto", "eager")])
def test_every_block_function_refuses_split_blocks_with_the_same_error(name, kind, mode):
    mesh = _mesh(kind)
    x = jax.device_put(jnp.ones((4, 64)), NamedSharding(mesh, P(None, "x")))  # 16 per shard
    f = BLOCK_FUNCTIONS[name]
    with jax.set_mesh(mesh):
        with pytest.raises(ValueError, match=rf"^{name}: axis 1 \(length 64\) is split into 4 "
                                             r"shards of 16.*would straddle shard boundaries"):
            (jax.jit(f) if mode == "jit" else f)(x)
        # Whole blocks per shard (64 per device): every function serves the sharded layout,
        # with the one-device bits.
        y = _data((4, 256))
        ys = jax.device_put(y, NamedSharding(mesh, P(None, "x")))
        got, want = (jax.jit(f) if mode == "jit" else f)(ys), f(y)
        if name == "quantize_mx":
            _assert_mx_equal(got, want)
        else:
            assert_bits_equal(got, want)


def test_split_block_under_jit_auto_is_unchecked_but_exact():
    # Auto axes: the layout is chosen after tracing, so nothing can be checked; GSPMD keeps the
    # meaning, so the bits still equal the one-device result (documented in lowprec._sharding).
    mesh = _mesh("auto")
    x = _data((4, 64))
    xs = jax.device_put(x, NamedSharding(mesh, P(None, "x")))
    got = jax.jit(lambda v: lowprec.quantize_mx(v, "mxfp8"))(xs)
    _assert_mx_equal(got, lowprec.quantize_mx(x, "mxfp8"))


# With Explicit axes the weight-gradient dot contracts over the sharded token axis; its
# output is sharded as the weight (JAX's transpose rule), so the partial sums are reduced.
@pytest.mark.parametrize("kind", [extended("auto"), "explicit"])
def test_flax_recipe_data_parallel(kind):
    # 128 tokens on 4 devices: 32 per device, so the weight gradient's blocks (along tokens)
    # stay on one device each.
    flax_nn = pytest.importorskip("flax.linen")
    import lowprec.flax

    model = flax_nn.Dense(64, dot_general=lowprec.flax.dot_general(lowprec.NVIDIA_MXFP8))
    x, = _normal(0, (128, 128))
    # The float layer's parameters are the quantized one's: a float forward to compile.
    params = jax.jit(flax_nn.Dense(64).init)(jax.random.key(1), x)

    def loss(p, v):
        out = model.apply(p, v)
        return jnp.sum(out ** 2), out

    # The layer's output comes back as the loss's aux: one program per device count.
    grad = jax.value_and_grad(loss, has_aux=True)
    (want_y, want_out), want_g = jax.jit(grad)(params, x)
    mesh = _mesh(kind)
    xs = jax.device_put(x, NamedSharding(mesh, P("x", None)))
    ps = jax.device_put(params, NamedSharding(mesh, P()))
    with jax.set_mesh(mesh):
        (got_y, got_out), got_g = jax.jit(grad)(ps, xs)
    # The layer's output is per token: same bits. The loss and the weight gradient sum over
    # tokens across devices (the order may differ): float32 accuracy.
    assert_bits_equal(got_out, want_out)
    np.testing.assert_allclose(np.asarray(got_y), np.asarray(want_y), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(got_g), jax.tree.leaves(want_g)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=1e-5)


def test_flax_recipe_too_few_tokens_per_device_is_a_clear_error():
    # 32 tokens on 4 devices: the weight gradient's 32-token blocks would span 4 devices.
    flax_nn = pytest.importorskip("flax.linen")
    import lowprec.flax

    model = flax_nn.Dense(64, dot_general=lowprec.flax.dot_general(lowprec.NVIDIA_MXFP8))
    x, = _normal(0, (32, 128))
    # The float layer's parameters are the quantized one's: a float forward to compile.
    params = jax.jit(flax_nn.Dense(64).init)(jax.random.key(1), x)
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
    x, (w,) = _data((64, 128), 2, nan_block=False), _normal(8, (128, 32))
    want = lowprec.NVIDIA_MXFP8.dot_general(x, w, DN)
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, P("x", None))
        got = jax.jit(lambda a, b: lowprec.NVIDIA_MXFP8.dot_general(
            a, b, DN, out_sharding=P(None, "x")))(xs, w)
    assert got.sharding.spec == P(None, "x")
    assert_bits_equal(got, want)


# -- training: data, tensor (column + row) and FSDP parallelism, Auto and Explicit axes ------------
#
# A two-layer MLP y = relu(x w1) w2 on activations x [batch, seq, d] (the transformer
# layout), with the loss sum(y * c) for a fixed c, so the cotangent of y is c itself: the
# quantized gradients do not depend on how y's sums were ordered, and every layout must give
# the one-device gradients up to float32 summation order. On the layouts whose two layers
# are laid out alike (ONE_LAYER: the same specs for w1 and w2, no out_sharding), one layer
# y = x w1 with the gradient of x too runs the same three products (forward, grad_lhs: the
# second layer's input gradient, grad_rhs) on the same partitioning, in a program half the
# size.

BATCH, SEQ, D, H = 8, 16, 128, 128  # 32 tokens per device on 4 devices: whole 32-token blocks
DN3 = (((2,), (0,)), ((), ()))
LAYOUTS = {
    # name: (mesh shape, names, x spec, w1 spec, w2 spec, h out_sharding, y out_sharding)
    "data": ((4,), ("x",), P("x", None, None), P(), P(), None, None),
    # Megatron: w1 column-parallel (output features split), w2 row-parallel (its
    # contraction split on both operands: out_sharding needed on Explicit axes).
    "tensor": ((4,), ("x",), P(), P(None, "x"), P("x", None), None, P(None, None)),
    "data_tensor": ((2, 2), ("d", "m"), P("d", None, None), P(None, "m"), P("m", None), None,
                    P("d", None)),
    # FSDP: weights stored split along their first axis, gathered for the matmul (reshard;
    # its transpose reduce-scatters the gradient back to the stored layout).
    "fsdp": ((4,), ("x",), P("x", None, None), P("x", None), P("x", None), None, None),
}


# Straight-through MXFP8: the float gradient of the quantized forward (lowprec.dot_general's
# "ste" backward).
STE_MXFP8 = lowprec.Recipe(forward="mxfp8_e4m3", scale_options={"scale_rule": "rceil"},
                           name="ste_mxfp8")


def _recipe(name):
    return STE_MXFP8 if name == "ste_mxfp8" else lowprec.RECIPES[name]


ONE_LAYER = ("data", "fsdp")


def _mlp_loss(recipe, layout, gather=False, sharded=True):
    *_, hs, ys = LAYOUTS[layout] if sharded else (None, None)
    if layout in ONE_LAYER:
        def one_layer(params, x, c):
            w1, = params
            if gather:
                w1 = jax.sharding.reshard(w1, P())
            y = recipe.dot_general(x, w1, DN3, out_sharding=hs)
            return jnp.sum(y * c), y

        return one_layer

    def loss(params, x, c):
        w1, w2 = params
        if gather:
            w1, w2 = jax.sharding.reshard(w1, P()), jax.sharding.reshard(w2, P())
        h = jax.nn.relu(recipe.dot_general(x, w1, DN3, out_sharding=hs))
        y = recipe.dot_general(h, w2, DN3, out_sharding=ys)
        return jnp.sum(y * c), y

    return loss


@pytest.mark.parametrize("kind,layout,recipe", [
    # The default run keeps FSDP on Auto axes (GSPMD gathers the weights; tensor parallel on
    # Explicit axes: the GPU-route case below, the delayed-scaling MLP and the transformer
    # block, row-parallel with out_sharding; data parallel and data x tensor: the other
    # recipes below, the transformer block).
    *((k, lay, "nvidia_mxfp8") if (k, lay) == ("auto", "fsdp")
      else extended(k, lay, "nvidia_mxfp8")
      for k in ("explicit", "auto") for lay in sorted(LAYOUTS)),
    # Kept small: the other backward paths (OCP's E5M2 gradients; per-tensor scaling, which
    # has its own VJP; STE) on layouts whose backward dots reduce across devices (per-tensor
    # scaling: FSDP's reduce-scatter here, tensor parallel in the GPU-route case below; data
    # x tensor on Explicit axes: the delayed-scaling MLP and the nnx transformer block).
    ("explicit", "data", "ocp_mxfp8"), extended("explicit", "data_tensor", "fp8_hybrid"),
    ("explicit", "data", "ste_mxfp8"), ("explicit", "fsdp", "fp8_hybrid"),
    # The NVFP4 training recipe (its own VJP; 16 x 16 weight tiles, RHT along tokens), its
    # words keyed (stochastic_rounding_key): column- and row-parallel (issue 35 item 2),
    # and data x tensor parallel on Auto axes (data parallel: the transformer block below).
    # (With words hashed from the cotangent, the tensor-parallel case is 21% off: w1's
    # cotangent comes from the row-parallel layer's input gradient, whose per-device dot
    # sums in another order than one device's, so its bits differ, and with them every
    # word.)
    # (The default run keeps the second, 20 s of CPU; the first costs 43 s.)
    extended("explicit", "tensor", "nvidia_nvfp4"), ("auto", "data_tensor", "nvidia_nvfp4"),
])
def test_training_matches_one_device(kind, layout, recipe):
    recipe = _recipe(recipe)
    x, w1, w2, c = _normal(11, (BATCH, SEQ, D), (D, H), (H, D), (BATCH, SEQ, D))
    w1, w2 = w1 / 8, w2 / 8
    shape, names, xs_, w1s, w2s, _, _ = LAYOUTS[layout]
    fsdp = layout == "fsdp"
    key = jax.random.key(3)
    one_layer = layout in ONE_LAYER
    params = (w1,) if one_layer else (w1, w2)
    # The gradients as a list: one layer's of x too (grad_lhs of its dot).
    flat = lambda g: [*g[0], g[1]] if one_layer else list(g)  # noqa: E731

    def grad_of(loss):
        grad = jax.value_and_grad(loss, argnums=(0, 1) if one_layer else 0, has_aux=True)
        if not recipe._nvfp4_training():
            return lambda p, x, c, k: grad(p, x, c)

        def keyed(p, x, c, k):
            with lowprec.stochastic_rounding_key(k):
                return grad(p, x, c)

        return keyed

    (want_l, want_y), want_g = _one_device(f"mlp{len(params)}", recipe, lambda: jax.jit(
        grad_of(_mlp_loss(recipe, layout, sharded=False)))(params, x, c, key))
    mesh = _mesh(kind, shape, names)
    with jax.set_mesh(mesh):
        put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))
        args = (tuple(put(w, s) for w, s in zip(params, (w1s, w2s))), put(x, xs_),
                put(c, P(*xs_[:1], None)))
        f = grad_of(_mlp_loss(recipe, layout, fsdp and kind == "explicit"))
        (got_l, got_y), got_g = jax.jit(f)(*args, key)
    # Explicit axes: gradients come back in their inputs' own layouts (as plain JAX's).
    for g, p in zip(flat(got_g), [*args[0], args[1]]):  # (two layers: zip stops at w2)
        assert kind == "auto" or _spec_of(g) == _spec_of(p), (g.sharding, p.sharding)
    np.testing.assert_allclose(np.asarray(got_y), np.asarray(want_y), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(float(got_l), float(want_l), rtol=1e-5)
    for a, b in zip(flat(got_g), flat(want_g)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("kind", ["explicit"])
def test_nnx_recipe_tensor_parallel_with_out_sharding(kind):
    # nnx layers pass their out_sharding to dot_general: a row-parallel nnx.Linear (kernel
    # split along its inputs) needs it on Explicit axes, as plain Flax does.
    nnx = pytest.importorskip("flax.nnx")
    import lowprec.flax

    mesh = _mesh(kind)
    x, c = _normal(12, (64, 128), (64, 32))

    def loss(m, v, out=None):
        return jnp.sum(m(v, out_sharding=out) * c)

    # One model (its eager init compiled once, not again under the mesh): the gradient does
    # not change it, and the sharded run only relays its kernel out.
    lin = nnx.Linear(128, 32, use_bias=False, rngs=nnx.Rngs(0))
    model = lowprec.flax.quantize_model(lin, lowprec.NVIDIA_MXFP8)
    want = nnx.jit(nnx.grad(loss))(model, x).kernel[...]  # one program, not one per op
    with jax.set_mesh(mesh):
        model.kernel = nnx.Param(jax.device_put(model.kernel[...], P("x", None)))
        xs = jax.device_put(x, P(None, "x"))
        got = nnx.jit(nnx.grad(lambda m, v: loss(m, v, P(None, None))))(model, xs).kernel[...]
    assert _spec_of(got) == ("x", None)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-4)


def test_recipe_einsum_out_sharding_in_output_order():
    # The einsum's out_sharding names its own output order ("nt"); the inner dot gets it in
    # dot_general's order ("tn"). K split on both operands: it must be given.
    x = _ints(131, (16, 128), -8, 8)  # exact sums in any order
    w = _ints(132, (128, 32), -3, 4)
    want = lowprec.NVIDIA_MXFP8.dot_general(x, w, DN).T
    mesh = _mesh("explicit")
    with jax.set_mesh(mesh):
        xs, ws = jax.device_put(x, P(None, "x")), jax.device_put(w, P("x", None))
        got = jax.jit(lambda a, b: lowprec.NVIDIA_MXFP8.einsum(
            "tk,kn->nt", a, b, out_sharding=P("x", None)))(xs, ws)
    assert _spec_of(got) == ("x", None)
    assert_bits_equal(got, want)


# The forward dot of 3-D activations [B, S, D] (issue 35 item 1: every MX/FP8 recipe once
# failed here on Explicit axes, in the reshape to the dot's canonical 3-D layout). Each
# output is per token: the same bits as on one device, laid out as lax.dot_general lays out
# the same operands. The weights: a Dense kernel [D, N] (replicated, or column-parallel on a
# second mesh axis) and a DenseGeneral kernel [D, heads, head_dim] with the heads split.
FORWARD_3D = {  # (x spec, w spec, the weight as [D, N] or [D, heads, head_dim]) on a 2 x 2 mesh
    "batch": (P("d", None, None), P(), (128, 128)),  # batch split: nothing moves
    "sequence": (P(None, "d", None), P(), (128, 128)),  # merged tokens relaid out
    "column": (P("d", None, None), P(None, "m"), (128, 128)),  # data x column-parallel
    "heads": (P("d", None, None), P(None, "m", None), (128, 4, 32)),  # DenseGeneral, heads split
}


@pytest.mark.parametrize("recipe,layouts", [
    # (The default run leaves out the layouts whose activations' layout another of its cases
    # of the recipe has: "batch", where "column" and "heads" split the batch too; each of
    # these is one more compile, 2-5 s of CPU.)
    ("nvidia_mxfp8", ("sequence", "column", "heads")), extended("nvidia_mxfp8", ("batch",)),
    ("fp8_hybrid", ("batch", "sequence")),
    # (STE_MXFP8's forward is NVIDIA_MXFP8's: the same jaxpr and HLO, the recipes differing
    # in their backward only.)
    extended("ste_mxfp8", ("batch", "sequence")),
    # Its own dot: 16 x 16 tiles of [D, heads x head_dim].
    ("nvidia_nvfp4", ("heads",)), extended("nvidia_nvfp4", ("batch",)),
])
def test_recipe_forward_3d_activations_same_bits(recipe, layouts):
    r = _recipe(recipe)
    x, w = _normal(15, (8, 16, 128), (128, 4, 32))
    w = w / 8
    mesh = _mesh("explicit", (2, 2), ("d", "m"))
    dn = (((2,), (0,)), ((), ()))
    dot = jax.jit(lambda a, b: r.dot_general(a, b, dn))
    want = {}
    for name in layouts:
        xspec, wspec, wshape = FORWARD_3D[name]
        wv = w.reshape(wshape)
        if wshape not in want:
            want[wshape] = dot(x, wv)
        with jax.set_mesh(mesh):
            xs, ws = jax.device_put(x, xspec), jax.device_put(wv, wspec)
            got = dot(xs, ws)
            lax_spec = jax.eval_shape(lambda a, b: jax.lax.dot_general(a, b, dn), xs, ws).sharding.spec
        assert got.sharding.spec == lax_spec, (name, got.sharding.spec, lax_spec)
        assert_bits_equal(got, want[wshape], f"{recipe}, {name} layout")


def test_sharded_inputs_keep_the_partitionable_formulation():
    """The one-pass Pallas kernels are single-device calls, so quantize_mx and
    fake_quantize_mx take them (on CUDA) only for inputs not laid out over several devices:
    a sharded concrete array, or a traced one over Explicit axes, keeps XLA's formulation."""
    from lowprec.kernels._dispatch import unsharded

    x = _data((16, 256))
    assert unsharded(x)
    seen = []
    jax.jit(lambda v: seen.append(unsharded(v)) or v)(x)
    for kind in ("explicit", "auto"):
        mesh = _mesh(kind)
        xs = jax.device_put(x, NamedSharding(mesh, P("x", None)))
        assert not unsharded(xs)
        with jax.set_mesh(mesh):
            jax.jit(lambda v: seen.append(unsharded(v)) or v)(xs)
    assert seen == [True, False, True]  # unsharded; Explicit axes; Auto axes (no layout)


@pytest.mark.parametrize("kind", ["explicit", "auto"])
def test_stochastic_rounding_compiles_sharded(kind):
    """Stochastic rounding under jit on a sharded array (the words are computed from each
    element's global index inside the encode): the same bits as on one device, because the
    words depend only on the key and the element index."""
    x = _data((128, 64), nan_block=False)
    k = jax.random.key(3)
    enc = lambda v: lowprec.quantize(v, "e4m3", rounding="stochastic", key=k)
    mx = lambda v: lowprec.quantize_mx(v, "mxfp4", rounding="stochastic", key=k)
    want_e, want_m = enc(x), mx(x)
    mesh = _mesh(kind)
    xs = jax.device_put(x, NamedSharding(mesh, P("x", None)))
    with jax.set_mesh(mesh):
        got_e, got_m = jax.jit(enc)(xs), jax.jit(mx)(xs)
    assert_bits_equal(got_e, want_e)
    _assert_mx_equal(got_m, want_m)


# -- the GPU GEMM routes (lowprec/_gpu_gemm.py), computed here on CPU devices -------------------
#
# The gpu_routes_on_cpu fixture makes the products take their CUDA formulation (FP8 codes read
# as float8, block values as bfloat16, NVFP4 tensor scales on the output): the same layouts
# must train as on one device with that formulation.


@pytest.mark.parametrize("kind,layout,recipe", [
    extended("explicit", "data", "fp8_hybrid"), ("explicit", "tensor", "fp8_hybrid"),
    extended("explicit", "tensor", "nvidia_mxfp8"), ("auto", "data_tensor", "nvidia_mxfp8"),
    extended("explicit", "data", "nvidia_nvfp4"),  # 20 s of CPU
])
def test_gpu_routes_training_matches_one_device(kind, layout, recipe, gpu_routes_on_cpu):
    test_training_matches_one_device(kind, layout, recipe)


# Delayed scaling (lowprec.delayed_dot_general): the MLP above with [batch, seq, d] activations,
# each layer with its own state; on every layout the outputs, gradients and next states must
# be those of one device (the amaxes are maxima over every token: the same bits).
BATCH, SEQ = 4, 32


def _tokens_3d(spec):
    """A [tokens, features] spec for [batch, seq, features]: tokens' axes on the batch."""
    if spec is None:
        return None
    tokens, features = (tuple(spec) + (None, None))[:2]
    return P(tokens, None, features)


def _delayed_loss(layout, sharded=True):
    *_, hs, ys = LAYOUTS[layout] if sharded else (None, None)
    cfg = lowprec.DelayedScaling(amax_history_len=4)
    dn = (((2,), (0,)), ((), ()))
    hs3, ys3 = _tokens_3d(hs), _tokens_3d(ys)

    def loss(params, states, x, c):
        (w1, w2), (s1, s2) = params, states
        h = jax.nn.relu(lowprec.delayed_dot_general(x, w1, s1, dn, cfg, out_sharding=hs3))
        y = lowprec.delayed_dot_general(h, w2, s2, dn, cfg, out_sharding=ys3)
        return jnp.sum(y * c), y

    return loss, cfg


# The default run: each layout and kind of axes once, the GPU route on the tensor-parallel
# ones and the portable route on the others (all eight cases: LOWPREC_FULL_SUITE=1).
@pytest.mark.parametrize("kind,layout,route", [
    (kind, layout, route) if (layout == "tensor") == (route == "gpu")
    else extended(kind, layout, route)
    for kind, layout in (("explicit", "data"), ("explicit", "tensor"),
                         ("explicit", "data_tensor"), ("auto", "tensor"))
    for route in ("portable", "gpu")])
def test_delayed_training_matches_one_device(kind, layout, route, request):
    if route == "gpu":
        request.getfixturevalue("gpu_routes_on_cpu")
    x, w1, w2, c = _normal(13, (BATCH, SEQ, D), (D, H), (H, D), (BATCH, SEQ, D))
    w1, w2 = w1 / 8, w2 / 8
    loss, cfg = _delayed_loss(layout, sharded=False)
    # Second step's state: scales from a first step's amaxes (not the initial 1.0).
    states = (cfg.init(), cfg.init())
    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))

    def one_device(states):
        _, (_, states) = grad((w1, w2), states, x, c)
        return states, grad((w1, w2), states, x, c)

    states, ((want_l, want_y), (want_g, want_s)) = _one_device(
        "delayed", cfg, lambda: one_device(states))
    shape, names, xs_, w1s, w2s, _, _ = LAYOUTS[layout]
    x3 = _tokens_3d(xs_)
    mesh = _mesh(kind, shape, names)
    with jax.set_mesh(mesh):
        put = lambda a, sp: jax.device_put(a, NamedSharding(mesh, sp))  # noqa: E731
        args = ((put(w1, w1s), put(w2, w2s)), jax.tree.map(lambda a: put(a, P()), states),
                put(x, x3), put(c, x3))
        f = jax.value_and_grad(_delayed_loss(layout)[0], argnums=(0, 1), has_aux=True)
        (got_l, got_y), (got_g, got_s) = jax.jit(f)(*args)
    for g, p in zip(got_g, args[0]):
        assert kind == "auto" or _spec_of(g) == _spec_of(p), (g.sharding, p.sharding)
    # Histories and scales come from maxima, which no layout reorders: the rows of tensors
    # that are inputs (x, w1, w2: layer 1's rows 0 and 1, layer 2's row 1) are the same bits.
    # The others are maxima of products (h, and the cotangents) whose float32 sums a layout may
    # order differently: within an ulp or two.
    exact = ((0, 1), (1,))
    for layer, (a_state, b_state) in enumerate(zip(got_s, want_s)):
        for part, a, b in zip(("history", "scale"), a_state, b_state):
            a, b = np.asarray(a), np.asarray(b)  # rows of host copies: no program per row
            for row in range(3):
                what = f"layer {layer + 1} {part}, {('lhs', 'rhs', 'cotangent')[row]} row"
                if row in exact[layer]:
                    assert_bits_equal(a[row], b[row], what)
                else:
                    np.testing.assert_allclose(a[row], b[row], rtol=1e-6, err_msg=what)
    np.testing.assert_allclose(np.asarray(got_y), np.asarray(want_y), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(float(got_l), float(want_l), rtol=1e-5)
    for a, b in zip(got_g, want_g):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-4)


# -- a transformer block: 3-D [B, S, D] activations, MHA + MLP, linen and nnx, every layout ------
#
# Pre-LN self-attention (4 heads of 32 over d = 64; no biases: a key bias has no gradient but
# summation noise, which Adam would turn into steps of either sign) and a 64 -> 128 -> 64
# GELU MLP, the whole block quantized by quantize_model (linen: interception; nnx: in place).
# 8 x 16 = 128 tokens: 32 per device on 4 devices (whole 32-token blocks for the weight
# gradients); tensor parallelism splits the heads (one head of 32 features per device on 4,
# whole blocks along the output projection's contraction) and the MLP's hidden features.
#
# Expected: the same training on one device, three Adam steps (lr 1e-3) from the same
# parameters on the same batch (for both Flax APIs the linen block's, which computes the
# nnx block's bits: _block_one_device). What may differ, and the tolerance for each:
# * float32 summation order: of sums that cross devices (weight gradients, the loss), and of
#   the unquantized float work (softmax, LayerNorm), which XLA compiles
#   differently for another per-device shape (plain float32 Flax gives other bits here).
#   A relative ~1e-6 change of a gradient, which Adam (dividing each gradient by its own
#   magnitude) passes on as ~lr * 1e-6: parameters within TOL = 2e-5 (1/50 of one step's
#   size lr);
# * an isolated rounding flip: a value that such a change moves across a rounding boundary
#   of its quantizer changes by one quantization step (at most 1/8 of it for E4M3), and
#   with it what it multiplies: one token's outputs, for an activation (seen: data parallel,
#   nnx, LayerNorm's outputs differing in their last bits in 112 of 128 tokens, one MXFP8
#   code of the attention input flipped, one token's outputs off by up to 0.02, the other
#   8128 the same bits); one column of one weight gradient, for a cotangent element. The
#   losses, means over 8192 outputs that a flip moves by ~1e-5 relative (seen up to 2e-4
#   after three steps), are within a relative LOSS_TOL = 1e-3. Through attention's
#   backward, that one token's cotangent reaches the keys and values of its whole sequence,
#   so every attention gradient moves by a few percent of its size (seen up to 6%), and
#   Adam, dividing each element by its own magnitude, turns that into steps of the other
#   sign where a gradient is near zero: many elements beyond TOL (seen up to 37%). So the
#   bound per parameter tensor is on its drift, the norm of its distance from the one-device
#   run over the norm of the one-device run's own update: DRIFT = 0.2 (seen up to 0.05
#   with MXFP8; where no flip happened, ~1e-4).
# A layout error (a block or tile split across devices, a wrong scale, a missing
# reduction, other random words) changes gradients by their own size, a drift of order 1.

B_, S_, D_, HEADS, QKV, F_ = 8, 16, 64, 4, 128, 128
LR, STEPS, TOL, FLIPS, DRIFT, LOSS_TOL = 1e-3, 3, 2e-5, 0.01, 0.2, 1e-3

# Megatron tensor parallelism by parameter name: column-parallel q/k/v and up (heads,
# hidden features split), row-parallel out and down (their contractions split).
TP_SPECS = {
    ("query", "kernel"): P(None, "m", None), ("key", "kernel"): P(None, "m", None),
    ("value", "kernel"): P(None, "m", None), ("out", "kernel"): P("m", None, None),
    ("up", "kernel"): P(None, "m"), ("up", "bias"): P("m"), ("down", "kernel"): P("m", None),
}
MESHES = {  # layout: (mesh shape, axis names, activation spec)
    "data": ((4,), ("d",), P("d", None, None)),
    "tensor": ((4,), ("m",), P()),
    "data_tensor": ((2, 2), ("d", "m"), P("d", None, None)),
    "fsdp": ((4,), ("d",), P("d", None, None)),
}


def _param_spec(path, layout, ndim):
    names = tuple(str(k.key) for k in path if hasattr(k, "key"))  # dict keys (nnx: + .value)
    if layout in ("tensor", "data_tensor"):
        return TP_SPECS.get(names[-2:], P())
    if layout == "fsdp":  # stored split along the first axis (64 or 128 rows: 16+ each)
        return P("d") if ndim >= 2 else P()
    return P()


def _linen_block():
    nn = pytest.importorskip("flax.linen")

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.LayerNorm()(x)
            x = x + nn.MultiHeadDotProductAttention(HEADS, qkv_features=QKV, use_bias=False,
                                                    name="attn")(h)
            h = nn.LayerNorm()(x)
            return x + nn.Dense(D_, name="down")(nn.gelu(nn.Dense(F_, name="up")(h)))

    return Block()


def _nnx_block(out_sharding=None):
    nnx = pytest.importorskip("flax.nnx")

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.ln1, self.ln2 = nnx.LayerNorm(D_, rngs=rngs), nnx.LayerNorm(D_, rngs=rngs)
            self.attn = nnx.MultiHeadAttention(HEADS, D_, QKV, D_, use_bias=False, decode=False,
                                               rngs=rngs)
            self.up = nnx.Linear(D_, F_, rngs=rngs)
            self.down = nnx.Linear(F_, D_, rngs=rngs)

        def __call__(self, x):
            # Row-parallel layers (out, down) need out_sharding on Explicit axes, as in
            # plain Flax: the activations' own layout.
            x = x + self.attn(self.ln1(x), out_sharding=out_sharding)
            return x + self.down(nnx.gelu(self.up(self.ln2(x))), out_sharding=out_sharding)

    return Block(nnx.Rngs(0))


def _batch():
    return _normal(21, (B_, S_, D_), (B_, S_, D_))


def _adam_run(loss, params, x, t, keyed):
    """STEPS Adam steps of ``loss(params, x, t)``; ``keyed``: each step's gradient inside
    stochastic_rounding_key(fold_in(key, step)), the key an argument of the jitted step.
    Returns (losses, params, the starting params)."""
    optax = pytest.importorskip("optax")
    opt = optax.adam(LR)
    # One program, not an eager one per parameter shape and layout (~25 compiles a block).
    state, start = jax.jit(opt.init)(params), params

    @jax.jit
    def step(params, state, x, t, key):
        if keyed:
            with lowprec.stochastic_rounding_key(key):
                value, grads = jax.value_and_grad(loss)(params, x, t)
        else:
            value, grads = jax.value_and_grad(loss)(params, x, t)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value

    losses = []
    for i in range(STEPS):
        params, state, value = step(params, state, x, t, jax.random.fold_in(jax.random.key(5), i))
        losses.append(float(value))
    return losses, params, start


def _assert_tracks(got, want, drift=False):
    """The tolerance of the comment above: losses within a relative LOSS_TOL; per parameter
    tensor, with ``drift`` (a block with attention) a drift of at most DRIFT, else (no
    attention to spread a flip) at most FLIPS of its elements beyond TOL."""
    (got_l, got_p, _), (want_l, want_p, start) = got, want
    np.testing.assert_allclose(got_l, want_l, rtol=LOSS_TOL)
    for (path, a), b, p0 in zip(jax.tree_util.tree_leaves_with_path(got_p),
                                jax.tree.leaves(want_p), jax.tree.leaves(start)):
        a, b, p0 = (np.asarray(v, np.float64) for v in (a, b, p0))
        off = np.abs(a - b) > TOL
        moved = np.linalg.norm(a - b) / np.linalg.norm(b - p0)
        ok = moved <= DRIFT if drift else off.mean() <= FLIPS
        assert ok, (jax.tree_util.keystr(path), int(off.sum()), off.size, f"drift {moved:.3g}")


NVFP4_OUT = lowprec.Rules([("attn/out", lowprec.NVIDIA_NVFP4), (".*", lowprec.NVIDIA_MXFP8)])
# The default run's block: the attention's score and value products (batch dims [B@d, H] of
# Recipe.einsum) and its output projection (a DenseGeneral weight [heads, head_dim, D]
# contracted over two axes) in the recipe; the query/key/value projections and the MLP in
# float32. The products left out are the MLP cases' above (Dense layers on the same
# activations, in and out of the recipe's dots) and the forward cases' DenseGeneral with its
# heads split; each quantized product is ~1/8 of the block's two programs to compile.
MXFP8_ATTN = lowprec.Rules([("attn(/out)?", lowprec.NVIDIA_MXFP8)], name="mxfp8_attn")
PLANS = {"nvfp4_out": NVFP4_OUT, "mxfp8_attn": MXFP8_ATTN}


def _keyed(plan):
    """Whether a recipe (or Rules) rounds some gradient stochastically: then the steps are
    keyed (stochastic_rounding_key)."""
    recipes = [rule.recipe for rule in plan.rules] if isinstance(plan, lowprec.Rules) else [plan]
    return any(r is not None and r.grad_rounding == "stochastic" for r in recipes)


def _put_params(params, mesh, layout):
    return jax.tree_util.tree_map_with_path(
        lambda path, v: jax.device_put(v, NamedSharding(mesh, _param_spec(path, layout, v.ndim))),
        params)


@functools.cache
def _block_start():
    """The batch and the float linen block's parameters, where every block case starts
    (QuantizedLinen's parameters are the model's own: a float forward to trace and compile
    instead of a quantized one). Computed once: a new ``jax.jit`` of a new bound ``init``
    traces and compiles again."""
    x, t = _batch()
    return x, t, jax.jit(_linen_block().init)(jax.random.key(0), x)


def _linen_loss(recipe, gather=False):
    import lowprec.flax

    model = lowprec.flax.quantize_model(_linen_block(), recipe)

    def loss(p, x, t):
        if gather:  # FSDP on Explicit axes: weights gathered where used (JAX's reshard)
            p = jax.tree.map(lambda v: jax.sharding.reshard(v, P()), p)
        return jnp.mean((model.apply(p, x) - t) ** 2)

    return loss


def _block_one_device(recipe, x, t, params):
    """The expected run of both Flax APIs' blocks: the linen block's, on one device. Given
    the same parameters the nnx block computes the same bits (seen with NVIDIA_MXFP8 on one
    device: every parameter after three steps equal to the bit), so one compile of the
    one-device program serves the linen and the nnx cases of a recipe."""
    return _one_device("block", recipe,
                       lambda: _adam_run(_linen_loss(recipe), params, x, t, _keyed(recipe)))


def _linen_case(kind, layout, recipe):
    x, t, params = _block_start()
    want = _block_one_device(recipe, x, t, params)
    shape, names, xspec = MESHES[layout]
    mesh = _mesh(kind, shape, names)
    with jax.set_mesh(mesh):
        put = lambda v: jax.device_put(v, NamedSharding(mesh, xspec))
        got = _adam_run(_linen_loss(recipe, layout == "fsdp" and kind == "explicit"),
                        _put_params(params, mesh, layout), put(x), put(t), _keyed(recipe))
    _assert_tracks(got, want, drift=True)


def _nnx_case(kind, layout, recipe):
    nnx = pytest.importorskip("flax.nnx")
    import lowprec.flax

    x, t, params = _block_start()
    want = _block_one_device(recipe, x, t, params)
    shape, names, xspec = MESHES[layout]
    row_parallel = layout in ("tensor", "data_tensor") and kind == "explicit"
    # Built abstractly (eval_shape): its own initial values, replaced below, would cost an
    # eager program per initializer (16 compiles).
    model = nnx.eval_shape(lambda: lowprec.flax.quantize_model(
        _nnx_block(xspec if row_parallel else None), recipe))
    graph, state = nnx.split(model)
    # The linen block's parameters under the nnx block's names (same shapes and meanings).
    linen = params["params"]
    nnx.replace_by_pure_dict(state, {"ln1": linen["LayerNorm_0"], "ln2": linen["LayerNorm_1"],
                                **{k: linen[k] for k in ("attn", "up", "down")}})

    def loss(p, x, t):
        return jnp.mean((nnx.merge(graph, p)(x) - t) ** 2)

    mesh = _mesh(kind, shape, names)
    with jax.set_mesh(mesh):
        put = lambda v: jax.device_put(v, NamedSharding(mesh, xspec))
        got = _adam_run(loss, _put_params(state, mesh, layout), put(x), put(t), _keyed(recipe))
    # In the linen block's structure, as the expected run's parameters.
    got_l, got_p, start = got
    as_linen = lambda s: {"params": {  # noqa: E731
        "LayerNorm_0": s["ln1"], "LayerNorm_1": s["ln2"],
        **{k: s[k] for k in ("attn", "up", "down")}}}
    got = got_l, as_linen(nnx.to_pure_dict(got_p)), as_linen(nnx.to_pure_dict(start))
    _assert_tracks(got, want, drift=True)


# quantize_model runs attention's score and value products in the recipe too (issue 35
# item 5; [B@d, H, S, S] batch dims of Recipe.einsum on these meshes): both linen (einsum
# hooks) and nnx (attention_fn) forms are covered below.
@pytest.mark.parametrize("flavour,kind,layout,recipe", [
    # Data parallel on Explicit axes, the layout whose forward dot of [B@d, S, D]
    # activations once failed for every MX/FP8 recipe (issue 35 item 1). (The other recipes
    # on 3-D activations: the MLP cases above, and the forward bits.)
    # (The default run: the attention in the recipe, the MLP in float32 (MXFP8_ATTN); the
    # extended sweep: the whole block.)
    ("linen", "explicit", "data", "mxfp8_attn"), extended("linen", "explicit", "data", "nvidia_mxfp8"),
    # Data x tensor parallel on a 2 x 2 mesh: nnx passes out_sharding, which the row-parallel
    # layers need on Explicit axes (linen's layers do not pass it). (The extended sweep: the
    # same recipe on the same kind of axes as the case above, ~27 s of CPU for its one
    # compile; the default run has nnx's out_sharding on a row-parallel layer in
    # test_nnx_recipe_tensor_parallel_with_out_sharding, data x tensor parallel on Explicit
    # axes in the delayed-scaling MLP, and nnx attention's recipe products in
    # tests/test_flax_products.py.)
    extended("nnx", "explicit", "data_tensor", "nvidia_mxfp8"),
    # FSDP on Auto axes (GSPMD gathers the weights).
    extended("linen", "auto", "fsdp", "nvidia_mxfp8"),
    # NVFP4 (its words keyed per step: stochastic_rounding_key) for the attention's output
    # projection, by Rules (a DenseGeneral weight [heads, head_dim, D] contracted over two
    # axes; its compiles cost ~15 s of CPU per layer, so the other layers, and the MLP's
    # 2-D weights in the MLP cases above, are enough), NVIDIA_MXFP8 for the rest: tensor
    # parallel (issue 35 item 2: row-parallel, heads split), and
    # data parallel (item 4: with words hashed from the cotangent, as without the key, this
    # case fails, the attention's key kernel at a drift of 0.30, the cotangents' bits
    # differing with the device count; in linen form, 67% of the parameters beyond TOL and
    # the losses 7e-3 apart after three steps; keyed, the linen form had 0 beyond TOL and
    # its losses 7e-7 apart).
    # (The default run keeps the first: two block compiles, the one-device run and the
    # sharded one, ~40 s of CPU; the NVFP4 cases cost 80 s, and NVFP4 training runs sharded
    # in the MLP case above.)
    extended("nnx", "explicit", "tensor", "nvfp4_out"),
    extended("nnx", "explicit", "data", "nvfp4_out"),
])
def test_transformer_block_training_matches_one_device(flavour, kind, layout, recipe):
    plan = PLANS[recipe] if recipe in PLANS else _recipe(recipe)
    (_linen_case if flavour == "linen" else _nnx_case)(kind, layout, plan)


# -- a mixture-of-experts layer, expert parallel (Recipe.ragged_dot) ------------------------------
#
# Tokens [M, K] on every device, the experts' weights [G, K, N] split over 4 devices (one
# expert each), group sizes uneven (one expert gets no token). Three Adam steps against one
# device: nothing but float32 summation order may differ, and with no attention to spread an
# isolated rounding flip, at most FLIPS of each tensor beyond TOL (the block test's reasoning). FP8_HYBRID's per-expert power-of-two scales once failed here on Explicit axes
# (issue 35 item 3).


@pytest.mark.parametrize("kind,recipe", [
    ("explicit", "fp8_hybrid"), extended("explicit", "nvidia_mxfp8"), ("auto", "fp8_hybrid"),
])
def test_ragged_training_expert_parallel_matches_one_device(kind, recipe):
    r = lowprec.RECIPES[recipe]
    x, w, t = _normal(17, (128, 64), (4, 64, 64), (128, 64))
    w = w / 8
    sizes = np.array([40, 0, 56, 32], np.int32)
    explicit = kind == "explicit"

    def loss_with(out_sharding):
        def loss(w, x, t):
            return jnp.mean((r.ragged_dot(x, w, sizes, out_sharding=out_sharding) - t) ** 2)

        return loss

    want = _one_device("ragged", r, lambda: _adam_run(loss_with(None), w, x, t, keyed=False))
    mesh = _mesh(kind)
    with jax.set_mesh(mesh):
        # On Explicit axes the output's layout (the tokens') is named, as lax.ragged_dot needs.
        got = _adam_run(loss_with(P() if explicit else None),
                        jax.device_put(w, NamedSharding(mesh, P("x"))),
                        *(jax.device_put(v, NamedSharding(mesh, P())) for v in (x, t)), keyed=False)
        if explicit:
            assert _spec_of(got[1]) == ("x", None, None)  # weights stay split by expert
    _assert_tracks(got, want)


def test_nvfp4_ragged_dot_expert_parallel_matches_one_device():
    """NVIDIA_NVFP4's ragged_dot (per-group tensor scales, 16 x 16 weight tiles, stochastic
    gradients keyed by stochastic_rounding_key) with the experts split over 4 devices on
    Explicit axes: the forward and both gradients of one step against one device, by the
    MoE test's measure above (the partitioned ragged dot may sum in another float32 order:
    here up to 1.4e-6 apart in the output, 6e-9 in the gradients, none beyond TOL). One
    value_and_grad, not Adam steps: its compiles cost ~20 s of CPU per mesh."""
    r = lowprec.NVIDIA_NVFP4
    x, w, t = _normal(23, (96, 64), (4, 64, 48), (96, 48))
    w = w / 8
    sizes = jnp.array([40, 0, 37, 19], jnp.int32)  # an empty expert, none a multiple of 16

    def run(w, x, t, out_sharding=None):
        @jax.jit
        def f(w, x, t, key):
            def loss(w, x):
                y = r.ragged_dot(x, w, sizes, out_sharding=out_sharding)
                return jnp.mean((y - t) ** 2), y

            with lowprec.stochastic_rounding_key(key):
                return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(w, x)

        return f(w, x, t, jax.random.key(5))

    want = run(w, x, t)
    mesh = _mesh("explicit")
    with jax.set_mesh(mesh):
        got = run(jax.device_put(w, NamedSharding(mesh, P("x"))),
                  *(jax.device_put(v, NamedSharding(mesh, P())) for v in (x, t)),
                  out_sharding=P())
        assert _spec_of(got[1][0]) == ("x", None, None)  # grad_rhs stays split by expert
    (loss, out), grads = got
    np.testing.assert_allclose(float(loss), float(want[0][0]), rtol=LOSS_TOL)
    for name, a, b in zip(("output", "grad_rhs", "grad_lhs"), (out, *grads),
                          (want[0][1], *want[1])):
        off = np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)) > TOL
        assert off.mean() <= FLIPS, (name, int(off.sum()), off.size)


# -- the MXFP8 ragged dot under every layout of its operands ------------------------------------
#
# (Moved here from tests/test_ragged.py, which ran it in a subprocess of its own: one JAX
# start-up less.) NVIDIA_MXFP8's ragged dot and both gradients with the tokens split, the
# output features N split and the experts split (Auto axes), and expert parallel on Explicit
# axes (out_sharding as lax.ragged_dot needs it), against one device: the same exact products
# summed in another order, so each sum is within L 2^-23 of sum|Q(a) Q(b)| <= 4 sum|a b|
# (round to nearest at most doubles a magnitude).


def test_mxfp8_ragged_dot_layouts_within_the_summation_bound():
    x, w, g = _normal(0, (128, 64), (4, 64, 64), (128, 64))
    gs = jnp.array([20, 0, 70, 30], jnp.int32)

    def step(x, w, g, out_sharding=None):
        y, vjp = jax.vjp(lambda a, b: lowprec.NVIDIA_MXFP8.ragged_dot(
            a, b, gs, out_sharding=out_sharding), x, w)
        return (y,) + vjp(g)

    ax, aw, ag = (np.abs(np.asarray(v, np.float64)) for v in (x, w, g))
    bounds = (8 * 64 * 2.0**-23 * np.einsum("mk,gkn->gmn", ax, aw).max(0),
              8 * 64 * 2.0**-23 * np.einsum("mn,gkn->gmk", ag, aw).max(0),
              8 * 128 * 2.0**-23 * (ax.T @ ag)[None])

    def check(got, want, what):
        for part, a, b, bound in zip(("output", "grad_lhs", "grad_rhs"), got, want, bounds):
            err = np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))
            assert np.all(err <= bound), (what, part, float(err.max()))

    one = jax.jit(step)
    want = one(x, w, g)
    auto = _mesh("auto")
    put = lambda a, s: jax.device_put(a, NamedSharding(auto, s))  # noqa: E731
    layouts = (("tokens", P("x", None), P()), ("N", P(), P(None, None, "x")),
               ("experts", P(), P("x")))
    # The three layouts as three calls in one program (one partitioning and compile, not
    # three; the step traced once), each call's operands placed as that layout shards them.
    args = [put(v, s) for _, xs, ws in layouts for v, s in ((x, xs), (w, ws), (g, xs))]
    outs = jax.jit(lambda *a: [one(*a[i:i + 3]) for i in range(0, len(a), 3)])(*args)
    for (name, xs, ws), got, arg in zip(layouts, outs, args[::3]):
        assert arg.sharding.spec == xs, (name, arg.sharding.spec)
        check(got, want, "auto " + name)
    explicit = _mesh("explicit")
    with jax.set_mesh(explicit):  # expert parallel: out_sharding as lax.ragged_dot needs it
        got = jax.jit(step, static_argnums=3)(
            jax.device_put(x, P()), jax.device_put(w, P("x")), jax.device_put(g, P()), P())
        assert got[2].sharding.spec == P("x", None, None), got[2].sharding.spec
    check(got, want, "explicit experts")
