"""The kernel policy is part of jax.jit's cache key (lowprec/kernels/_dispatch.py): a
program traced under one policy is never reused under another, and a policy's programs are
found again when it comes back (the policy is read while tracing)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lowprec
from lowprec.kernels import current_policy, policy

pytestmark = pytest.mark.skipif(not hasattr(jax, "make_user_context"),
                                reason="JAX before user contexts: caches are cleared instead")


def test_a_users_jitted_function_follows_the_policy_and_keeps_each_policys_program():
    traces = []

    @jax.jit
    def route(x):
        traces.append(current_policy())  # what lowprec's functions read while tracing
        return x + (1.0 if current_policy().kernels == "xla" else 2.0)

    x = jnp.zeros(4)
    start = current_policy()
    assert float(route(x)[0]) == (1.0 if start.kernels == "xla" else 2.0)
    other = "auto" if start.kernels == "xla" else "xla"
    with policy(other):
        assert float(route(x)[0]) == (1.0 if other == "xla" else 2.0)  # not the stale program
    assert len(traces) == 2
    assert float(route(x)[0]) == (1.0 if start.kernels == "xla" else 2.0)
    with policy(other, gpu_route="xla"):  # another field: another policy, another program
        route(x)
    with policy(other):
        route(x)
    assert len(traces) == 3, traces  # the first two policies' programs were found again


def test_lowprec_calls_under_both_policies_give_the_same_bits_and_are_not_retraced():
    x = jnp.asarray(np.random.default_rng(3).standard_normal((4, 64)), jnp.float32)
    fake = jax.jit(lambda v: lowprec.fake_quantize_mx(v, "mxfp4"))
    first = fake(x)
    with policy("xla"):
        xla = fake(x)
    again = fake(x)
    np.testing.assert_array_equal(np.asarray(first), np.asarray(xla))
    np.testing.assert_array_equal(np.asarray(first), np.asarray(again))
    assert fake._cache_size() == 2  # one program per policy, the first one reused
