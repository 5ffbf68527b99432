"""lowprec.optim: parameters kept in bf16 (or another format), updates rounded stochastically.

Expected values: neighbouring bf16 values come from ml_dtypes (np.nextafter in bfloat16), the
per-leaf keys from the documented contract, and the statistics from bounds derived in each
test. The float32 baseline is plain optax on float32 parameters.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

optax = pytest.importorskip("optax")
import lowprec  # noqa: E402
from lowprec.optim import cast_params, low_precision_params, storage_dtype  # noqa: E402
from helpers.codecs import replay_random_bits  # noqa: E402

BF16 = ml_dtypes.bfloat16


def _neighbours_bf16(v):
    """The bf16 values at or just below / at or just above each float32 v (ml_dtypes)."""
    v = np.asarray(v, np.float32)
    near = v.astype(BF16)
    nf = near.astype(np.float32)
    below = np.where(nf <= v, near, np.nextafter(near, BF16(-np.inf)))
    above = np.where(nf >= v, near, np.nextafter(near, BF16(np.inf)))
    return below.astype(np.float32), above.astype(np.float32)


def _run(opt, params, grad_fn, steps, state=None):
    state = opt.init(params) if state is None else state

    @jax.jit
    def step(p, s):
        u, s = opt.update(grad_fn(p), s, p)
        return optax.apply_updates(p, u), s

    for _ in range(steps):
        params, state = step(params, state)
    return params, state


def test_one_step_follows_the_key_contract():
    key = jax.random.key(42)
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    params = cast_params({"a": jax.random.normal(k1, (64, 32)), "b": jax.random.normal(k2, (7,))})
    grads = jax.tree.map(lambda p: jax.random.normal(k3, p.shape, jnp.bfloat16), params)
    lr = 1e-3
    opt = low_precision_params(optax.sgd(lr), "bf16", key=key)
    state = opt.init(params)

    @jax.jit  # one program (op by op, the update compiles ~30)
    def step(grads, state, params):
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    for t in range(2):  # steps 0 and 1
        new, state = step(grads, state, params)
        for i, name in enumerate(sorted(params)):  # jax.tree.leaves order of a dict: sorted keys
            p32, g32 = (np.asarray(params[name], np.float32), np.asarray(grads[name], np.float32))
            target = np.float32(p32 - np.float32(lr) * g32)  # the float32 sum, then rounded
            got = np.asarray(new[name]).astype(np.float32)
            assert new[name].dtype == jnp.bfloat16
            below, above = _neighbours_bf16(target)
            assert np.all((got == below) | (got == above))
            # The magnitude rounds away from zero iff bits < frac * 2^16, frac = the fraction of
            # the way from the smaller-magnitude neighbour to the larger one, with the
            # documented key for (step t, leaf i) and lowprec's 16-bit words for that key
            # (replayed by the NumPy reference: docs/design.md §2).
            k = jax.random.fold_in(jax.random.fold_in(key, t), i)
            bits = replay_random_bits(k, target.shape).astype(np.float64)
            small = np.where(target >= 0, below, above).astype(np.float64)
            large = np.where(target >= 0, above, below).astype(np.float64)
            gap = np.abs(large - small)
            frac = np.abs(target - small) / np.where(gap > 0, gap, 1)
            want_away = (bits < frac * 2.0**16) & (gap > 0)
            np.testing.assert_array_equal(got, np.where(want_away, large, small))
        params = new
    assert int(state.count) == 2


def test_apply_updates_stores_the_rounded_value_exactly():
    # Updates across binades, sign changes and exact cancellation: q - w is exact in float32
    # (exponents at most 15 apart), so optax.apply_updates stores q itself.
    rng = np.random.default_rng(0)
    w = rng.normal(size=4096).astype(np.float32) * 2.0 ** rng.integers(-10, 10, 4096)
    scale = 2.0 ** rng.integers(-14, 3, 4096)  # |u| from 2^-14 |w| up to 4 |w|
    u = (rng.normal(size=4096) * np.abs(w) * scale).astype(np.float32)
    u[:16] = -w[:16]  # exact cancellation to zero
    params = cast_params({"w": jnp.asarray(w)})
    opt = low_precision_params(optax.identity(), "bf16", rounding="nearest_even")
    updates, _ = opt.update({"w": jnp.asarray(u)}, opt.init(params), params)
    got = np.asarray(optax.apply_updates(params, updates)["w"]).astype(np.float32)
    w16 = np.asarray(params["w"]).astype(np.float32)
    np.testing.assert_array_equal(got, (w16 + u).astype(BF16).astype(np.float32))


def test_stochastic_rounding_accumulates_updates_that_round_to_nearest_loses():
    # w = 1 (bf16 ulp 2^-7 in [1, 2), 2^-8 just below 1), n = 1000 steps of +1e-4 (40x below
    # half an ulp). Round-to-nearest never moves; float32 reaches 1.1. Stochastic rounding is
    # unbiased: each step adds a zero-mean error of variance <= ulp^2/4, so the mean over P
    # weights has standard deviation <= ulp * sqrt(n / (4 P)) = 2^-7 * sqrt(1000/16384) = 0.0019.
    n, size = 1000, 4096
    params = cast_params({"w": jnp.ones(size)})
    grads = lambda p: {"w": jnp.full(size, -1.0, jnp.bfloat16)}
    sgd = optax.sgd(1e-4)
    sr, _ = _run(low_precision_params(sgd, "bf16", key=jax.random.key(1)), params, grads, n)
    rn, _ = _run(low_precision_params(sgd, "bf16", rounding="nearest_even"), params, grads, n)
    f32, _ = _run(sgd, {"w": jnp.ones(size)}, lambda p: {"w": -jnp.ones(size)}, n)
    assert np.all(np.asarray(rn["w"]) == 1.0)  # stalled: every update rounded away
    mean32 = float(f32["w"].mean())
    assert abs(mean32 - 1.1) < 1e-3
    sigma = 2.0**-7 * math.sqrt(n / (4 * size))
    assert abs(float(sr["w"].astype(jnp.float32).mean()) - mean32) < 6 * sigma
    assert sr["w"].dtype == jnp.bfloat16


def _regression(seed=0, n=1024, d=256):
    """Least squares whose solution sits a small step away from a bf16 start: weights in
    [0.5, 2) (bf16 ulp >= 2^-8), targets w* = w0 + 0.05 N(0, 1)."""
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    w0 = jax.random.uniform(k1, (d,), minval=0.5, maxval=2.0)
    w0 = jnp.asarray(cast_params(w0)).astype(jnp.float32)
    w_star = w0 + 0.05 * jax.random.normal(k2, (d,))
    x = jax.random.normal(k3, (n, d)) / math.sqrt(d)
    y = x @ w_star

    def loss(w):
        return jnp.mean((x @ w.astype(jnp.float32) - y) ** 2)

    return w0, w_star, loss


@pytest.mark.slow  # left out of the quick tier (seconds; its paths run in other quick tests)
def test_adam_in_bf16_with_stochastic_rounding_matches_float32():
    # Adam's steps are ~lr = 5e-4, below half an ulp (>= 2^-9) of every weight: bf16 with
    # round-to-nearest cannot move at all; with stochastic rounding it follows float32.
    w0, w_star, loss = _regression()
    opt = optax.adam(5e-4)
    grad = lambda p: {"w": jax.grad(loss)(p["w"])}
    every, steps = 25, 400
    rec = {}
    for name, opt_, p in (
        ("fp32", opt, {"w": w0}),
        ("bf16_sr", low_precision_params(opt, "bf16", key=jax.random.key(3)), cast_params({"w": w0})),
        ("bf16_rn", low_precision_params(opt, "bf16", rounding="nearest_even"), cast_params({"w": w0})),
    ):
        state = opt_.init(p)

        @jax.jit
        def chunk(p, s, opt_=opt_):
            def body(_, ps):
                u, s2 = opt_.update(grad(ps[0]), ps[1], ps[0])
                return optax.apply_updates(ps[0], u), s2

            p, s = jax.lax.fori_loop(0, every, body, (p, s))
            return p, s, loss(p["w"])

        rec[name] = []
        for _ in range(steps // every):
            p, state, l = chunk(p, state)
            rec[name].append(float(l))
        if name == "bf16_rn":  # not one weight moved
            np.testing.assert_array_equal(np.asarray(p["w"]), np.asarray(cast_params({"w": w0})["w"]))
        if name != "fp32":
            assert p["w"].dtype == jnp.bfloat16
            assert state.inner_state[0].mu["w"].dtype == jnp.float32  # Adam state: float32
            assert state.inner_state[0].nu["w"].dtype == jnp.float32
    l0 = float(loss(w0))
    fp32, sr, rn = (np.array(rec[k]) for k in ("fp32", "bf16_sr", "bf16_rn"))
    assert np.all(rn == np.float32(l0))  # round to nearest: stalled at the start

    def steps_to(curve, target):
        hit = np.nonzero(curve <= target)[0]
        return (hit[0] + 1) * every if hit.size else math.inf

    # Stochastic rounding makes the same progress: each 10x and 20x loss reduction within
    # 1.5x float32's step count (plus one recording interval). Its weights carry zero-mean
    # rounding noise of about an ulp, which adds a little loss near the end: measured
    # 1.2x-1.7x float32's loss at steps 100-200 for keys 3..6.
    for target in (l0 / 10, l0 / 20):
        assert steps_to(sr, target) <= 1.5 * steps_to(fp32, target) + every, (fp32, sr)
    assert sr[-1] < l0 / 40


def test_other_formats_and_storage():
    assert storage_dtype("bf16") == jnp.bfloat16 and storage_dtype("fp16") == jnp.float16
    assert storage_dtype("e4m3") == jnp.float32
    params = cast_params({"w": jnp.linspace(-3.0, 3.0, 64)}, "e4m3")
    opt = low_precision_params(optax.sgd(1e-2), "e4m3", key=jax.random.key(0))
    p, _ = _run(opt, params, lambda p: {"w": jnp.ones(64)}, 3)
    w = np.asarray(p["w"])
    assert w.dtype == np.float32
    # Every stored value is an E4M3 value (ml_dtypes round trip is the identity).
    np.testing.assert_array_equal(w.astype(ml_dtypes.float8_e4m3fn).astype(np.float32), w)
    p16, _ = _run(low_precision_params(optax.sgd(1e-2), "fp16", key=jax.random.key(0)),
                  cast_params({"w": jnp.ones(8)}, "fp16"), lambda p: {"w": jnp.ones(8)}, 2)
    assert p16["w"].dtype == jnp.float16


def test_errors():
    params = cast_params({"w": jnp.ones(4)})
    with pytest.raises(ValueError, match="needs key=jax.random.key"):
        low_precision_params(optax.sgd(1.0), "bf16")
    with pytest.raises(ValueError, match="key is only used with rounding='stochastic'"):
        low_precision_params(optax.sgd(1.0), "bf16", rounding="nearest_even", key=jax.random.key(0))
    with pytest.raises(ValueError, match="unknown parameter rounding 'up'"):
        low_precision_params(optax.sgd(1.0), "bf16", rounding="up")
    with pytest.raises(ValueError, match="e8m0 is a scale format"):
        low_precision_params(optax.sgd(1.0), "e8m0", key=jax.random.key(0))
    with pytest.raises(TypeError, match="must be a PRNG key"):
        low_precision_params(optax.sgd(1.0), "bf16", key=3)
    opt = low_precision_params(optax.sgd(1.0), "fp16", key=jax.random.key(0))
    with pytest.raises(TypeError, match=r"dtype bfloat16 cannot hold 'fp16' values exactly.*cast_params"):
        opt.init(params)
    opt = low_precision_params(optax.sgd(1.0), "bf16", key=jax.random.key(0))
    with pytest.raises(ValueError, match="needs the parameters"):
        opt.update(params, opt.init(params))
    # A raw uint32 key (jax.random.PRNGKey) is accepted too.
    low_precision_params(optax.sgd(1.0), "bf16", key=jax.random.PRNGKey(0)).init(params)


def test_refuses_parameters_wider_than_the_storage_dtype():
    # float32 holds bf16 values exactly, but saves no memory: refused, with the fix.
    opt = low_precision_params(optax.sgd(1.0), "bf16", key=jax.random.key(0))
    with pytest.raises(TypeError, match=r"dtype float32 stores 'bf16' values in 4 bytes.*cast_params"):
        opt.init({"w": jnp.ones(4, jnp.float32)})
    opt.init(cast_params({"w": jnp.ones(4)}))  # bfloat16: fine


def test_state_is_serializable_and_restores_the_same_steps():
    flax_serialization = pytest.importorskip("flax.serialization")
    params = cast_params({"w": jnp.linspace(-1.0, 1.0, 256), "b": jnp.ones(3)})
    opt = low_precision_params(optax.adam(1e-3), "bf16", key=jax.random.key(7))
    grads = lambda p: jax.tree.map(lambda x: jnp.ones_like(x) * 1e-2, p)
    p, state = _run(opt, params, grads, 2)
    # No typed PRNG key in the state (orbax and flax refuse those): plain arrays only.
    assert not any(jnp.issubdtype(x.dtype, jax.dtypes.prng_key) for x in jax.tree.leaves(state))
    blob = flax_serialization.to_bytes(state)
    restored = flax_serialization.from_bytes(opt.init(params), blob)
    jax.tree.map(np.testing.assert_array_equal, restored, state)
    # Continuing from the restored state takes the very same stochastic steps.
    a, _ = _run(opt, p, grads, 3, state)
    b, _ = _run(opt, p, grads, 3, restored)
    jax.tree.map(np.testing.assert_array_equal, a, b)


def test_state_round_trips_through_orbax(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    params = {"w": jnp.linspace(-1, 1, 64, dtype=jnp.bfloat16).reshape(8, 8)}
    opt = low_precision_params(optax.adam(1e-3), "bf16", key=jax.random.key(9))
    grads = lambda p: jax.tree.map(lambda x: jnp.ones_like(x) * 1e-2, p)
    p, state = _run(opt, params, grads, 2)
    path = tmp_path / "ckpt"
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path, {"params": p, "opt_state": state})
    with ocp.StandardCheckpointer() as ckptr:
        restored = ckptr.restore(path, {"params": p, "opt_state": opt.init(params)})
    jax.tree.map(np.testing.assert_array_equal, restored["opt_state"], state)
    # Continuing from the restored state takes the very same stochastic steps.
    a, _ = _run(opt, restored["params"], grads, 3, restored["opt_state"])
    b, _ = _run(opt, p, grads, 3, state)
    jax.tree.map(np.testing.assert_array_equal, a, b)
