"""The native CPU NVFP4 quantizer (lowprec/kernels/_nvfp4_cpu.cc, an XLA FFI target) against
XLA's formulation of ``quantize_mx(x, "nvfp4")`` and the independent NumPy reference, bit
for bit.

XLA's path (policy ``"xla"``) is the one the rest of the suite checks against torchao, the
reference and Transformer Engine's statements; the kernel must reproduce its element codes,
block scales and tensor scale exactly, for both NVFP4 steps and both roundings, on inputs
built to reach every branch: each E2M1 rounding tie, block maxima on and around the E4M3
scale grid's ends (2^-6, 448) and its ties, the 448 x 6 = 2688 edge of the computed tensor
scale, ±0, float32 subnormals, NaN and infinities, and tensor scales from the 2^-143 floor to
2^126 (outside the [2^-118, 2^116] where XLA's own hardware-float path is exact, so the
kernel's subnormal handling is what is checked). Words of stochastic rounding include 0 and
2^32 - 1 (always and never rounding away).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lowprec
import lowprec.kernels
from lowprec import _nvfp4_train
from lowprec.kernels import _cpu_native, _nvfp4_cpu
from lowprec_reference import mx as ref

from helpers.inputs import bit_kinds, float32_from_fields

needs_kernel = pytest.mark.skipif(not _cpu_native.vector_quantizer(),
                                  reason="quantize_mx takes the NVFP4 kernel only on AVX2 CPUs "
                                         f"({_cpu_native.status()})")
pytestmark = needs_kernel

TARGET = f'custom_call_target="{_nvfp4_cpu.TARGET}"'
STEPS = ("divide", "reciprocal")
# E2M1's rounding ties (midpoints of 0, 0.5, 1, 1.5, 2, 3, 4, 6) and its grid, as multiples
# of a block's divisor.
TIES = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def kinds(seed: int, ts: float = 1.0) -> dict[str, np.ndarray]:
    """float32 arrays [8, 64] (4 blocks per row), by kind; ``ts``: the tensor scale the
    ``ties`` and ``scale_edges`` rows are built for (a power of two keeps them exact)."""
    rng = np.random.default_rng(seed)
    shape = (8, 64)
    sign = rng.integers(0, 2, shape)
    mant = rng.integers(0, 2**23, shape)
    signs = np.where(sign == 1, -1.0, 1.0)
    out = bit_kinds(rng, sign, mant, shape)
    out["huge"] = float32_from_fields(sign, rng.integers(245, 255, shape), mant)
    # Every tie and grid point of E2M1 times an E4M3 block scale s, in blocks whose maximum
    # is 6 s (so the block's scale is s exactly under tensor scale ts): each quotient is the
    # tie itself, for both steps (1 / ts and 1 / s are powers of two for these s, ts).
    s = np.exp2(rng.integers(-6, 9, (8, 4, 1))) * ts
    points = np.array(TIES + GRID[1:], np.float64)  # 14 points, then the maximum 6 twice
    block = np.concatenate([points, [6.0, 6.0]])
    out["ties"] = (signs * (s * block).reshape(8, 64)).astype(np.float64)
    # Block maxima putting (amax / 6) / ts on the E4M3 grid's ends and its rounding ties:
    # 2^-6 and below it, 448 and above it, and midpoints m = (1 + (2k + 1) / 16) 2^e.
    ends = np.array([2.0**-6, 2.0**-7, 2.0**-6 * (1 - 2**-20), 448.0, 464.0, 480.0, 2.0**10,
                     (1 + 1 / 16) * 2.0**-3, (1 + 3 / 16) * 2.0**0, (1 + 15 / 16) * 2.0**8,
                     (1 + 5 / 16) * 2.0**-6, 0.0])
    amax = ends[rng.integers(0, len(ends), (8, 4, 1))] * 6 * ts
    frac = rng.uniform(-1, 1, (8, 4, 16))
    frac[..., 0] = 1.0
    out["scale_edges"] = (amax * frac).reshape(shape)
    # The tensor's maximum 2688 ts (448 x 6) and its neighbours: the computed tensor scale's
    # edge, where the largest block's scale is 448 and its maximum element 6.
    with np.errstate(over="ignore"):  # 2688 x 2^126 is +inf: an infinite block then
        edge = np.float32(2688.0) * np.float32(ts)
    near = np.array([edge, np.nextafter(edge, np.float32(0)),
                     np.nextafter(edge, np.float32(np.inf))])
    e = rng.standard_normal(shape) * float(edge) / 8
    e[:, ::16] = near[rng.integers(0, 3, (8, 4))] * signs[:, ::16]
    out["edge_2688"] = e
    zeros = np.where(sign == 1, -0.0, 0.0)
    zeros[::2, :16] = 0.0  # an all +0 block and an all -0 block
    zeros[1::2, :16] = -0.0
    out["zeros"] = zeros
    special = rng.standard_normal(shape) * np.exp2(rng.integers(-140, 120, (8, 1)))
    flat = special.reshape(-1)
    at = rng.choice(flat.size, 48, replace=False)
    flat[at[:12]], flat[at[12:24]], flat[at[24:36]], flat[at[36:]] = np.nan, -np.inf, np.inf, -0.0
    out["special"] = special
    with np.errstate(over="ignore"):
        return {k: v.astype(np.float32) for k, v in out.items()}


_OPERAND_DTYPES = {"tensor_scale": jnp.float32, "random_bits": jnp.uint32,
                   "key": jax.random.key(0).dtype}


@functools.lru_cache(maxsize=None)
def _compiled(policy: str, shape: tuple, dtype, operands: tuple, **kw):
    """quantize_mx(x, "nvfp4", **kw) compiled under ``policy`` for x of ``shape``, with the
    named ``operands`` ("tensor_scale", "random_bits") as traced arguments, so that one
    program serves every value of them (XLA's NVFP4 encode takes seconds to compile); and
    whether the program holds the kernel's custom call."""
    with lowprec.kernels.policy(policy):
        def run(v, *args):
            m = lowprec.quantize_mx(v, "nvfp4", **kw, **dict(zip(operands, args)))
            return m.elements, m.scales, m.tensor_scale

        specs = [jax.ShapeDtypeStruct(shape, dtype)]
        specs += [jax.ShapeDtypeStruct((), _OPERAND_DTYPES[o]) if o != "random_bits"
                  else jax.ShapeDtypeStruct(shape, jnp.uint32) for o in operands]
        compiled = jax.jit(run).lower(*specs).compile()
    return compiled, TARGET in compiled.as_text()


def quantize(x, policy, **kw):
    """quantize_mx(x, "nvfp4") as numpy (elements, scales, tensor scale bits) under
    ``policy``, and whether its program holds the kernel's custom call."""
    operands = tuple(k for k in _OPERAND_DTYPES if kw.get(k) is not None)
    args = [kw.pop(k) for k in operands]
    args = [a if k == "key" else jnp.asarray(a, _OPERAND_DTYPES[k]) for k, a in zip(operands, args)]
    kw = {k: v for k, v in kw.items() if v is not None}
    compiled, took = _compiled(policy, tuple(x.shape), x.dtype, operands, **kw)
    el, sc, ts = compiled(x, *args)
    return np.asarray(el), np.asarray(sc), np.asarray(ts).view(np.uint32), took


def assert_same(x, names=None, **kw):
    auto, xla = quantize(x, "auto", **dict(kw)), quantize(x, "xla", **dict(kw))
    assert auto[3] and not xla[3], "the kernel runs under 'auto' only"
    for part, a, b in zip(("elements", "scales", "tensor scale"), auto[:3], xla[:3]):
        if names is None or a.ndim == 0:
            np.testing.assert_array_equal(a, b, err_msg=f"{kw}: {part}")
            continue
        for i, name in enumerate(names):  # report the kind of input that differs
            rows = slice(8 * i, 8 * (i + 1))
            np.testing.assert_array_equal(a[rows], b[rows], err_msg=f"{kw} {name}: {part}")
    return auto


@functools.lru_cache(maxsize=None)
def _words(seed: int, shape: tuple, kind: str = "lowprec") -> np.ndarray:
    """``lowprec.random_bits(key, shape)`` ("lowprec") or ``jax.random.bits(key, shape,
    uint32)`` ("jax") of ``jax.random.key(seed)``, as NumPy, computed in one jitted program
    once per process: called eagerly, each of their ~15 primitives is a compile (again after
    anything empties JAX's caches)."""
    def run():
        key = jax.random.key(seed)
        if kind == "lowprec":
            return lowprec.random_bits(key, shape)
        return jax.random.bits(key, shape, jnp.uint32)

    return np.asarray(jax.jit(run)())


TENSOR_SCALES = (None, 1.0, 2.0**-10, 2.0**-149, 2.0**-125, 2.0**-119, 2.0**117, 2.0**126)


@pytest.mark.parametrize("step", STEPS)
@pytest.mark.quick_first(1)
def test_nearest_same_bits_as_xla(step):
    """Every kind of input under every tensor scale (computed, and given from the 2^-143
    floor to 2^126; the given ones share one program per policy)."""
    for i, ts in enumerate(TENSOR_SCALES):
        k = kinds(seed=i + 10 * STEPS.index(step), ts=1.0 if ts is None else ts)
        x = jnp.asarray(np.concatenate(list(k.values())))
        assert_same(x, list(k), nvfp4_step=step, tensor_scale=ts)


@pytest.mark.parametrize("step", STEPS)
@pytest.mark.slow  # seconds; the quick test_layouts[odd_pad] runs the kernel's stochastic rounding
def test_stochastic_same_bits_as_xla(step):
    """Words from a key, and given: uint16, uint32, all 0 (always away from zero where
    anything is dropped) and all 2^32 - 1 (never)."""
    k = kinds(seed=7 + STEPS.index(step))
    x = jnp.asarray(np.concatenate(list(k.values())))
    key = jax.random.key(3)
    assert_same(x, list(k), nvfp4_step=step, rounding="stochastic", key=key)
    for w in (_words(3, x.shape).astype(np.uint32) << 16, _words(3, x.shape, "jax"),
              np.zeros(x.shape, np.uint32), np.full(x.shape, 2**32 - 1, np.uint32)):
        assert_same(x, list(k), nvfp4_step=step, rounding="stochastic", random_bits=w)
    if step == "reciprocal":
        return
    # uint16 words as given (compared with frac x 2^16): the words above shifted
    w16 = _words(4, x.shape)
    auto = jax.jit(lambda v, w: lowprec.quantize_mx(v, "nvfp4", rounding="stochastic",
                                                    random_bits=w, nvfp4_step=step).elements)
    want = quantize(x, "auto", nvfp4_step=step, rounding="stochastic",
                    random_bits=w16.astype(np.uint32) << 16)[0]
    np.testing.assert_array_equal(np.asarray(auto(x, w16)), want)


@pytest.mark.parametrize("rounding", ("nearest_even", "stochastic"))
def test_reference(rounding):
    """Against reference/mx.py's NumPy float32 statement of the recipe ("divide" step; the
    reference takes no other), every kind of input, the kernel's codes unpacked."""
    k = kinds(seed=21)
    x = np.concatenate([k[n] for n in ("normal", "ties", "scale_edges", "subnormal", "special")])
    kw = {}
    if rounding == "stochastic":
        kw["random_bits"] = _words(5, x.shape, "jax")
    el, sc, ts, took = quantize(jnp.asarray(x), "auto", rounding=rounding, **kw)
    assert took
    want_el, want_sc, want_ts = ref.quantize_nvfp4(x, rounding=rounding, **kw)
    np.testing.assert_array_equal(ref.unpack_codes(el, 4), want_el)
    np.testing.assert_array_equal(sc, want_sc)
    assert ts.view(np.uint32) == np.float32(want_ts).view(np.uint32)


@pytest.mark.parametrize("case", ("odd_pad", "3d_last", "3d_axis0", "3d_axis1_pad",
                                  "noncontiguous", "bfloat16", "float16"))
@pytest.mark.quick_first(1)
def test_layouts(case):
    """3-D activations blocked along each axis, padding, views XLA must lay out, and the
    narrow input dtypes (widened exactly): the kernel's bits are XLA's."""
    rng = np.random.default_rng(len(case))
    x = jnp.asarray(rng.standard_normal((2, 48, 64)).astype(np.float32) * 3)
    if case == "3d_last":
        assert_same(x)
    elif case == "3d_axis0":
        assert_same(jnp.asarray(rng.standard_normal((32, 3, 5)).astype(np.float32)), axis=0,
                    rounding="stochastic", key=jax.random.key(0))
    elif case == "3d_axis1_pad":
        assert_same(x[:, :41], axis=1, pad=True, nvfp4_step="reciprocal")
    elif case == "odd_pad":
        assert_same(x[..., :37], pad=True, rounding="stochastic", key=jax.random.key(1))
    elif case == "noncontiguous":
        assert_same(jnp.asarray(np.asarray(x).transpose(2, 0, 1)[::2, :, ::-1]), axis=2)
    else:
        assert_same(x.astype(getattr(jnp, case)))


@pytest.mark.slow  # seconds; quick tests run the kernel under jit (test_layouts, test_nearest_...)
def test_jit_vmap_grad():
    """Under vmap (one tensor scale per batch element: the kernel's grouped scales), jit,
    and grad through dequantize: the same values as XLA's path."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((3, 4, 32)).astype(np.float32)
                    * np.array([1e-3, 1.0, 1e3], np.float32)[:, None, None])
    words = _words(2, x.shape, "jax")

    def per_example(v, w):
        m = lowprec.quantize_mx(v, "nvfp4", rounding="stochastic", random_bits=w)
        return m.elements, m.scales, m.tensor_scale

    def loss(v):
        return jnp.sum(lowprec.dequantize(lowprec.quantize_mx(v, "nvfp4")) * v)

    got = {}
    for policy in ("auto", "xla"):
        with lowprec.kernels.policy(policy):
            batched = jax.jit(jax.vmap(per_example))
            assert (TARGET in batched.lower(x, words).compile().as_text()) == (policy == "auto")
            got[policy] = [np.asarray(a) for a in batched(x, words)]
            got[policy].append(np.asarray(jax.jit(jax.grad(loss))(x)))
    assert got["auto"][2].shape == (3,)  # a tensor scale per example
    for a, b in zip(got["auto"], got["xla"]):
        np.testing.assert_array_equal(a, b)
    # each example quantized alone gives its batch row
    el, sc, ts = per_example(x[2], words[2])
    np.testing.assert_array_equal(np.asarray(el), got["auto"][0][2])
    np.testing.assert_array_equal(np.asarray(ts), got["auto"][2][2])


def test_traced_tensor_scale():
    """A tensor scale given as a traced value (known only at run time) takes the kernel when
    it is a positive finite float32 and XLA's formulation otherwise, by one lax.cond: the
    same bits as XLA's path either way (0 is raised to 2^-143 first)."""
    # [80, 64] and the step written out: the programs of test_nearest_same_bits_as_xla
    # (cached by _compiled), so this test compiles nothing of its own.
    x = jnp.asarray(np.random.default_rng(1).standard_normal((80, 64)).astype(np.float32))
    for ts in (0.5, 0.0, 2.0**-149, -1.0, -0.0, np.inf, np.nan):
        assert_same(x, tensor_scale=np.float32(ts), nvfp4_step="divide")


def _lowered_takes_kernel(f, *args) -> bool:
    return f"@{_nvfp4_cpu.TARGET}" in jax.jit(f).lower(*args).as_text()


def test_xla_keeps_what_the_kernel_does_not_take():
    """The 4-over-6 scheme, a float8 input (widened on its bits by XLA's path) and the
    policy "xla" stay on XLA's formulation (read from the lowered program: no compile)."""
    x = jnp.ones((2, 32), jnp.float32)
    nvfp4 = lambda v: lowprec.quantize_mx(v, "nvfp4").elements  # noqa: E731
    assert _lowered_takes_kernel(nvfp4, x)
    assert not _lowered_takes_kernel(lambda v: lowprec.quantize_mx(v, "nvfp4_4over6").elements, x)
    assert not _lowered_takes_kernel(nvfp4, x.astype(jnp.float8_e4m3fn))
    with lowprec.kernels.policy("xla"):
        assert not _lowered_takes_kernel(nvfp4, x)


@pytest.mark.parametrize("bad", ("zero_scale", "nan_scale", "words", "groups"))
def test_handler_refuses_bad_calls(bad):
    """The handler validates its buffers and tensor scales: a bad call is an error of that
    call, never a crash or a silent result."""
    x = np.ones((2, 32), np.float32)
    ts = {"zero_scale": np.float32(0), "nan_scale": np.float32(np.nan)}.get(
        bad, np.ones(3, np.float32) if bad == "groups" else np.float32(1))
    words = np.zeros(5 if bad == "words" else 0, np.uint32)
    call = jax.ffi.ffi_call(_nvfp4_cpu.TARGET, (jax.ShapeDtypeStruct((2, 16), jnp.uint8),
                                                jax.ShapeDtypeStruct((2, 2), jnp.uint8),
                                                jax.ShapeDtypeStruct(np.shape(ts), jnp.float32)))
    with pytest.raises(Exception, match="lowprec_nvfp4_quantize"):
        jax.block_until_ready(call(x, ts, words, reciprocal=False, stochastic=bad == "words",
                                   compute_ts=False))


FAKE = 'custom_call_target="lowprec_nvfp4_fake_quantize"'


@pytest.mark.parametrize("step", STEPS)
@pytest.mark.slow  # ~7 s a case (XLA's four fake quantizations); quick: the fused call lowered below
def test_training_fake_quantize_same_bits_as_xla(step):
    """The NVFP4 recipe's fake quantizations (lowprec/_nvfp4_train.py: Q along either axis,
    to nearest or with stochastic words, and Q2's 16 x 16 weight tiles) by the kernel's fused
    call: XLA's values bit for bit, NaN/Inf tiles and blocks, subnormals and ties included."""
    t = _nvfp4_train

    k = kinds(seed=31 + STEPS.index(step))
    x = np.concatenate(list(k.values()))  # [80, 64]: whole 16 x 16 tiles
    x = jnp.asarray(x)
    words = _words(9, x.shape)

    def run(v, w):
        return (t.quantize_1d(v, 1, step=step), t.quantize_1d(v, 0, w, step=step),
                t.quantize_1d(v, 1, w, step=step), t.quantize_2d(v, step=step))

    got = {}
    for policy in ("auto", "xla"):
        with lowprec.kernels.policy(policy):
            compiled = jax.jit(run).lower(x, words).compile()
            assert compiled.as_text().count(FAKE) == (4 if policy == "auto" else 0)
            got[policy] = [np.asarray(a).view(np.uint32) for a in compiled(x, words)]
    for name, a, b in zip(("Q along K", "Q along T, SR", "Q along K, SR", "Q2 tiles"),
                          got["auto"], got["xla"]):
        np.testing.assert_array_equal(a, b, err_msg=f"{step}: {name}")


@pytest.mark.slow  # ~5 s (XLA's stochastic encode); quick: the dense dot's fused call below
def test_ragged_per_group_tensor_scales_same_bits_as_xla():
    """The ragged dot's NVFP4 operands (lowprec/_ragged.py: token rows under their group's
    tensor scale, to nearest and with stochastic words; 16-token blocks of the per-group
    padded layout; experts under their own) by the kernel's fused call with one given tensor
    scale per group: XLA's values bit for bit, NaN/Inf blocks, subnormals, ties and huge
    rows included. (Both steps: test_dense_dot_nvfp4_operands_take_the_fused_call.)"""
    from lowprec import _ragged
    from lowprec._options import MXCast

    step = "reciprocal"
    k = kinds(seed=41)
    x = np.concatenate([k[n] for n in ("normal", "ties", "subnormal", "spread", "any_bits")]
                       + [k["normal"] * 1e30])  # [48, 64]
    bits = jnp.asarray(x).view(jnp.uint32)
    words = _words(9, x.shape)
    gid = jnp.asarray([0] * 13 + [2] * 28 + [3] * 7)  # groups 0..2 (1 empty), 3: no group
    unit_group = jnp.asarray([0, 2, 3])  # 16-token blocks of the padded layout
    rn, sr = (MXCast(lowprec.mx_format("nvfp4"), None, r, step)
              for r in ("nearest_even", "stochastic"))

    def run(b, w):
        return (_ragged._row_values(b, sr, gid, 3, w),
                _ragged._token_block_values(b, sr, unit_group, 3, 16, w),
                _ragged._expert_values(b.reshape(3, 16, 64), rn, 1))

    got = {}
    for policy in ("auto", "xla"):
        with lowprec.kernels.policy(policy):
            compiled = jax.jit(run).lower(bits, words).compile()
            assert compiled.as_text().count(FAKE) == (3 if policy == "auto" else 0)
            got[policy] = [np.asarray(a) for a in compiled(bits, words)]
    for name, a, b in zip(("rows, SR", "token blocks, SR", "experts"),
                          got["auto"], got["xla"]):
        np.testing.assert_array_equal(a, b, err_msg=f"{step}: {name}")


@pytest.mark.parametrize("step", STEPS)
@pytest.mark.quick_first(1)
def test_dense_dot_nvfp4_operands_take_the_fused_call(step):
    """lowprec.dot_general of NVFP4 operands (round to nearest): on CPU each operand's
    values come from the kernel's fused call (lowprec/_qdot.py), XLA's bit for bit."""
    k = kinds(seed=51 + STEPS.index(step))
    x = jnp.asarray(np.concatenate([k["normal"], k["ties"], k["subnormal"], k["spread"]]))
    x = x.at[5, 9].set(jnp.nan)
    w = jnp.asarray(kinds(seed=52)["normal"].T.repeat(2, 1))  # [64, 16]
    dims = (((1,), (0,)), ((), ()))

    def run(a, b):
        return lowprec.dot_general(a, b, dims, lhs_format="nvfp4", rhs_format="nvfp4",
                                   scale_options={"nvfp4_step": step})

    got = {}
    for policy in ("auto", "xla"):
        with lowprec.kernels.policy(policy):
            compiled = jax.jit(run).lower(x, w).compile()
            assert compiled.as_text().count(FAKE) == (2 if policy == "auto" else 0)
            got[policy] = np.asarray(compiled(x, w)).view(np.uint32)
    np.testing.assert_array_equal(got["auto"], got["xla"], err_msg=step)


@needs_kernel
@pytest.mark.parametrize("shape", [(16,), (1025, 1024), (2, 4096, 4096)])
@pytest.mark.quick_first(1)
def test_inputs_of_any_size_take_the_kernel(shape):
    # The vectorized kernel is no slower than XLA's compiled program from 2^16 to 4096^2
    # elements (benchmarks/README.md), so no size sends NVFP4 to XLA's program: one block,
    # one past the 2^20 limit the scalar kernel had, and 2^25 (lowered, never run).
    x = jax.ShapeDtypeStruct(shape, jnp.float32)
    text = jax.jit(lambda a: lowprec.quantize_mx(a, "nvfp4")).lower(x).as_text()
    assert _nvfp4_cpu.TARGET in text, shape
    fake = jax.jit(lambda a: _nvfp4_train.quantize_1d(a, a.ndim - 1)).lower(x).as_text()
    assert _nvfp4_cpu.FAKE_TARGET in fake, shape
