"""The training recipe's fused NVFP4 quantize-dequantize on CPU (``_mx_encode.nvfp4_values``):
the same bits as ``dequantize(quantize_mx(x, "nvfp4", ...))`` and the NumPy reference's values,
for both element steps, nearest-even and stochastic rounding, blocks along either axis, in
both of the encoder's branches (tensor scales inside the hardware-float range, and tiny or
huge tensors that take the exact integer steps), with NaN/inf blocks, subnormal inputs and
all-zero tensors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lowprec
import lowprec_reference as ref
from lowprec._mx_encode import nvfp4_values

from helpers.asserts import assert_bits_equal
from helpers.codecs import reference_words

SHAPE = (32, 64)


def _inputs():
    """[name, x] cases of one shape: each branch of the encoder, specials, ties."""
    rng = np.random.default_rng(35)
    normal = (rng.standard_normal(SHAPE) * np.exp2(rng.integers(-8, 8, SHAPE))).astype(np.float32)
    specials = normal.copy()
    specials[0, 3], specials[5, 40], specials[17, 0] = np.nan, np.inf, -np.inf
    # E2M1 rounding boundaries of a block whose amax is 6 (its scale is then exactly 1 / ts's
    # E4M3 value): midpoints 0.25 ... 5 and the values themselves, both signs.
    ties = np.resize(np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -0.75, -2.5,
                               -5.0, 0.5, 1.5, 3.0, -6.0], np.float32), SHAPE)
    tiny = (normal * np.float32(2.0**-118)).astype(np.float32)  # amax < 2^-106: exact branch
    tiny[::3] = (rng.integers(-(1 << 22), 1 << 22, (len(tiny[::3]), SHAPE[1])).astype(np.int32)
                 .view(np.float32))  # float32 subnormals (and zeros)
    huge = (np.clip(normal, -1, 1) * np.float32(2.0**127)).astype(np.float32)  # amax >= 2^127
    return {"normal": normal, "specials": specials, "ties": ties, "tiny": tiny, "huge": huge,
            "zeros": np.zeros(SHAPE, np.float32)}


INPUTS = _inputs()
WORDS = np.asarray(jax.random.bits(jax.random.key(9), SHAPE, jnp.uint32))


def _pair(x, axis, words, step):
    kw = {} if words is None else {"rounding": "stochastic", "random_bits": words}
    return lowprec.dequantize(lowprec.quantize_mx(x, "nvfp4", axis=axis, nvfp4_step=step, **kw))


@pytest.mark.parametrize("axis, step, stochastic", [
    (1, "divide", False), (1, "divide", True),
    # the same code along axis 0 and with the other step (~20 CPU s each under load)
    pytest.param(0, "divide", False, marks=pytest.mark.slow),
    pytest.param(1, "reciprocal", False, marks=pytest.mark.slow),
    pytest.param(0, "reciprocal", True, marks=pytest.mark.slow)])
def test_fused_values_are_the_pair_and_the_reference(axis, step, stochastic):
    words = jnp.asarray(WORDS) if stochastic else None
    fused = jax.jit(lambda v, w: nvfp4_values(v, w, axis, step))
    pair = jax.jit(lambda v, w: _pair(v, axis, w, step))
    for name, x in INPUTS.items():
        got = np.asarray(fused(jnp.asarray(x), words))
        assert_bits_equal(got, np.asarray(pair(jnp.asarray(x), words)), f"{name} vs the pair")
        if step == "divide":  # the reference states the torchao <= 0.16 ("divide") recipe
            rounding = "stochastic" if stochastic else "nearest_even"
            e, s, ts = ref.quantize_nvfp4(
                x, axis=axis, rounding=rounding,
                random_bits=None if words is None else reference_words(WORDS))
            want = ref.dequantize_mx(e, s, "nvfp4", axis=axis, tensor_scale=ts)
            np.testing.assert_array_equal(got, want.astype(np.float32), err_msg=name)
            assert np.array_equal(np.signbit(got), np.signbit(want)), name
