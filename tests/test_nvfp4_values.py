"""The training recipe's fused NVFP4 quantize-dequantize on CPU (``_mx_encode.nvfp4_values``):
the same bits as ``dequantize(quantize_mx(x, "nvfp4", ...))`` and the NumPy reference's values,
for both element steps, nearest-even and stochastic rounding, blocks along either axis, in
both of the encoder's branches (tensor scales inside the hardware-float range, and tiny or
huge tensors that take the exact integer steps), with NaN/inf blocks, subnormal inputs and
all-zero tensors; and per-group tensor scales under ``vmap`` (ragged_dot's path), computed or
given, against the reference group by group."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
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
            "zeros": np.zeros(SHAPE, np.float32), "underflow": _underflow(rng),
            "subnormal_elements": _subnormal_elements(rng)}


def _subnormal_elements(rng):
    """A tensor in the hardware-float range (amax ~2^-95: block factors down to ~2^-124)
    whose blocks hold float32 subnormals, so that their quotients span (0, 1/4]."""
    x = (rng.standard_normal(SHAPE) * np.float32(2.0**-95)).astype(np.float32)
    sub = rng.integers(1, 1 << 23, SHAPE).astype(np.int32).view(np.float32)
    x[:, 1::3] = sub[:, 1::3] * np.where(rng.random((SHAPE[0], len(range(1, SHAPE[1], 3)))) < 0.5,
                                          -1, 1).astype(np.float32)
    return x


def _underflow(rng):
    """A tensor in the hardware-float range whose blocks hold, beside their largest value,
    elements whose quotient x / float32(ts * s) lies at float32's underflow boundaries: 2^-150
    (a tie that rounds to 0), just above it, 2^-149, just below and at 2^-126, 2^-33, 2^-2;
    and float32 subnormal elements (flushed by XLA:CPU's arithmetic)."""
    x = (rng.standard_normal(SHAPE) * np.float32(2.0**90)).astype(np.float32)
    blocks = x.reshape(SHAPE[0], -1, 16)
    blocks[:, :, 0] = np.abs(blocks[:, :, 0]) * 1e6  # each block's largest magnitude
    e, s, ts = ref.quantize_nvfp4(x)
    total = (np.float32(ts) * ref.decode("e4m3", s).astype(np.float32)).astype(np.float64)
    factors = np.array([2.0**-150, 2.0**-150 * (1 + 2.0**-20), 2.0**-149, 2.0**-126 * (1 - 2.0**-20),
                        2.0**-126, 2.0**-33, 2.0**-2, 1.5 * 2.0**-149])
    for j, f in enumerate(factors):  # positions 1.. of every block (position 0 keeps its value)
        v = (total * f).astype(np.float32)
        blocks[:, :, 1 + j] = np.where(blocks[:, :, 0] != 0, v, 0) * np.where(j % 2, -1, 1)
    out = blocks.reshape(SHAPE)
    out[1::4, 9::16] = np.float32(1e-40)  # subnormal elements
    return out


INPUTS = _inputs()
WORDS = np.array(jax.random.bits(jax.random.key(9), SHAPE, jnp.uint32))
WORDS[:, ::3] = 0  # a zero word rounds every nonzero quotient up, however small
WORDS[:, 1::5] >>= 28  # small words: quotients just above a grid point round up


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


# -- per-group tensor scales (vmap: a tensor scale per group, as ragged_dot computes them) --------

GROUPS = np.stack(list(INPUTS.values()))  # [G, 32, 64]: each group its own tensor


def _reference_groups(groups, axis, tensor_scale=None, words=None):
    """Per group: the reference's (values, scale codes, tensor scale), each group quantized as
    a tensor of its own (its own tensor scale unless ``tensor_scale`` is given)."""
    out = []
    for i, x in enumerate(groups):
        kw = {} if words is None else {"rounding": "stochastic",
                                       "random_bits": reference_words(words[i])}
        e, s, ts = ref.quantize_nvfp4(x, axis=axis, tensor_scale=tensor_scale, **kw)
        out.append((ref.dequantize_mx(e, s, "nvfp4", axis=axis, tensor_scale=ts).astype(np.float32),
                    s, np.float32(ts)))
    return out


def _assert_groups(got_values, want, what):
    for i, (name, (values, _, _)) in enumerate(zip(INPUTS, want)):
        np.testing.assert_array_equal(got_values[i], values, err_msg=f"{what}: group {name}")
        assert np.array_equal(np.signbit(got_values[i]), np.signbit(values)), (what, name)


@pytest.mark.parametrize("stochastic", [False, True])
def test_per_group_tensor_scales_under_vmap_are_the_references(stochastic):
    """Each group's tensor scale amax_g / 2688 is one element of a batched [G] array under
    vmap, and the constant divisors 2688 and 6 are not batched: XLA:CPU must still divide
    (not multiply by a rounded reciprocal) in the tensor scale, the block scales and the
    element quotients. This is the path of ragged_dot's per-group tensor scales."""
    words = None
    if stochastic:
        words = np.array(jax.random.bits(jax.random.key(3), GROUPS.shape, jnp.uint32))
        words[:, :, ::3] = 0
    want = _reference_groups(GROUPS, 1, words=words)
    w = None if words is None else jnp.asarray(words)
    fused = jax.jit(jax.vmap(lambda v, wd: nvfp4_values(v, wd, 1, "divide"),
                             in_axes=(0, None if w is None else 0)))
    _assert_groups(np.asarray(fused(jnp.asarray(GROUPS), w)), want, "nvfp4_values")

    kw = {} if w is None else {"rounding": "stochastic"}

    def codes(v, wd):
        mx = lowprec.quantize_mx(v, "nvfp4", axis=1, random_bits=wd, **kw)
        return mx.scales, mx.tensor_scale, lowprec.dequantize(mx)

    scales, ts, values = jax.vmap(codes, in_axes=(0, None if w is None else 0))(
        jnp.asarray(GROUPS), w)
    np.testing.assert_array_equal(np.asarray(ts), np.array([t for _, _, t in want]),
                                  err_msg="tensor scales")
    for i, name in enumerate(INPUTS):
        np.testing.assert_array_equal(np.asarray(scales[i]).reshape(want[i][1].shape), want[i][1],
                                      err_msg=f"scale codes: group {name}")
    _assert_groups(np.asarray(values), want, "quantize_mx")


def _scale_ties(t):
    """[32, 64] blocks along axis 0 whose block amax a makes (a / 6) / t round to another E4M3
    code than a * float32(1/6) / t or a * float32(1/6) * float32(1/t) would (NumPy's IEEE
    float32 and ml_dtypes' E4M3 rounding, searched among the patterns within 64 ulps of
    6 t m, m the E4M3 midpoints): the block scales a reciprocal in place of a division
    gets wrong."""
    e4m3 = ml_dtypes.float8_e4m3fn
    grid = np.arange(1, 127, dtype=np.uint8).view(e4m3).astype(np.float64)
    mids = (grid[:-1] + grid[1:]) / 2
    near = (6 * float(t) * mids[mids >= 2.0**-6]).astype(np.float32).view(np.uint32)
    a = (near[:, None] + np.arange(-64, 65, dtype=np.int32).astype(np.uint32)).ravel().view(
        np.float32)
    inv6, inv_t = np.float32(1) / np.float32(6), np.float32(1) / t

    def code(q):
        return q.astype(e4m3).view(np.uint8)

    exact = code((a / np.float32(6)) / t)
    found = a[(exact != code((a * inv6) / t)) | (exact != code((a * inv6) * inv_t))]
    assert len(found) >= 16, len(found)
    x = np.resize(np.float32(0.25) * t, (32, 64)).astype(np.float32)
    x[0], x[16] = np.resize(found, (2, 64))  # each block's largest magnitude
    return x


def test_a_shared_given_tensor_scale_under_vmap_is_the_references():
    """A given tensor scale that is not batched (one for every group) beside batched
    elements: its block-scale and element divisions are broadcast along the groups."""
    t = np.float32(float.fromhex("0x1.3p-7"))  # 0.0093: hardware-float range
    groups = np.concatenate([GROUPS, _scale_ties(t)[None]])
    want = _reference_groups(groups, 0, tensor_scale=t)
    f = jax.vmap(lambda v: lowprec.dequantize(
        lowprec.quantize_mx(v, "nvfp4", axis=0, tensor_scale=jnp.float32(t))))
    got = np.asarray(f(jnp.asarray(groups)))
    for i, name in enumerate([*INPUTS, "scale_ties"]):
        np.testing.assert_array_equal(got[i], want[i][0], err_msg=f"given tensor scale: {name}")
