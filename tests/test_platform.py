"""lowprec._platform.platform_dependent: where JAX compiles for CPU alone, the CPU formulation
is traced without ``lax.platform_dependent`` (whose every branch was traced: half an NVFP4
training step's trace time), with the same bits as the program holding every platform's
branch (``Policy(platform_branches="all")``, what a machine with a GPU plugin traces), in
eager and jitted calls, under ``vmap`` and through gradients; and such a program refuses to
be lowered for another platform, naming the fix."""

from __future__ import annotations

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

import lowprec
import lowprec.kernels
from lowprec import _nvfp4, _nvfp4_train, _platform

cpu_only_here = pytest.mark.skipif(
    _platform.other_platforms_possible(),
    reason="JAX here can compile for another platform: every branch is traced anyway")


def _inputs(shape, seed=0):
    """float32 values over many binades, with a few ±0, subnormals, ±inf and a NaN."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(shape) * np.exp2(rng.integers(-20, 20, shape))).astype(np.float32)
    flat = x.reshape(-1)
    flat[:6] = [0.0, -0.0, 1e-40, -3e-39, np.inf, -np.inf]
    flat[7] = np.nan
    return x


def _words(shape, seed=1):
    return np.random.default_rng(seed).integers(0, 2**32, shape, dtype=np.uint64).astype(
        np.uint32)


x3 = _inputs((2, 8, 64))  # [batch, seq, d]


# Each case: a function of float32 [2, 8, 64] activations, the calls through every kind of
# platform split lowprec makes on CPU (native kernels, XLA:CPU float arithmetic, both).
CASES = {
    "nvfp4_kernel": lambda x: lowprec.quantize_mx(x, "nvfp4"),
    "nvfp4_kernel_sr": lambda x: lowprec.quantize_mx(
        x, "nvfp4", rounding="stochastic", random_bits=jnp.asarray(_words(x.shape))),
    "nvfp4_xla": lambda x: _with_kernels_off(lambda: lowprec.quantize_mx(
        x, "nvfp4", nvfp4_step="reciprocal")),
    "nvfp4_xla_sr": lambda x: _with_kernels_off(lambda: lowprec.dequantize(lowprec.quantize_mx(
        x, "nvfp4", rounding="stochastic", random_bits=jnp.asarray(_words(x.shape))))),
    "mxfp8_kernel": lambda x: lowprec.quantize_mx(x, "mxfp8"),
    "mxfp6_packed": lambda x: lowprec.dequantize(lowprec.quantize_mx(x, "mxfp6_e2m3")),
    "recipe_fake_quantize_1d": lambda x: _nvfp4_train.quantize_1d(
        x.reshape(16, 64), 0, words=jnp.asarray(_words((16, 64)))),
    "recipe_fake_quantize_2d": lambda x: _nvfp4_train.quantize_2d(x.reshape(16, 64)),
    "div_by_integer": lambda x: _nvfp4.div_by_integer(
        jax.lax.bitcast_convert_type(jnp.abs(jnp.nan_to_num(x)), jnp.uint32), 2688),
}


def _with_kernels_off(f):
    # The policy is read while tracing; the jitted cores take it as a static argument.
    with lowprec.kernels.policy("xla"):
        return f()


def _bits(tree):
    return [np.atleast_1d(np.asarray(a)).view(np.uint8).tobytes() for a in jax.tree.leaves(tree)]


def _run(f, mode, branches):
    with lowprec.kernels.policy(platform_branches=branches):
        if mode == "eager":
            return _bits(f(x3))
        if mode == "jit":
            return _bits(jax.jit(f)(x3))
        return _bits(jax.jit(jax.vmap(f))(np.stack([x3, -x3[:, ::-1]])))  # "vmap"


# Every case jitted; eager calls and vmap (the CPU-only mark's batching rule, the kernels'
# vmap_method) on the cases that hold each kind of split (kept few: the suite's budget).
RUNS = ([(case, "jit") for case in CASES]
        + [(case, mode) for case in ("nvfp4_kernel_sr", "nvfp4_xla", "mxfp6_packed",
                                     "recipe_fake_quantize_1d") for mode in ("eager", "vmap")]
        + [("recipe_fake_quantize_2d", "eager")])


# Quick tier: the first three (the NVFP4 kernel, rounding to nearest and stochastic, and
# XLA:CPU's NVFP4 formulation, jitted); every case runs in the default run.
@pytest.mark.quick_first(3)
@pytest.mark.parametrize(("case", "mode"), RUNS)
def test_cpu_branch_alone_gives_the_bits_of_every_branch(case, mode):
    f = CASES[case]
    assert _run(f, mode, "auto") == _run(f, mode, "all")


def _nvfp4_loss(x, w):
    y = lowprec.NVIDIA_NVFP4.dot_general(x, w, (((2,), (0,)), ((), ())))
    return jnp.sum(jnp.sin(y))


# Eager: the extended sweep only (~350 programs op by op, 11 CPU s); the default run has the
# eager calls of each of its platform splits (recipe_fake_quantize_1d and _2d above) and
# the jitted gradients. Left out of the quick tier (4 CPU s): the quick tier runs the
# recipe's gradients in tests/test_nvfp4_train.py and its platform splits above.
@pytest.mark.slow
@pytest.mark.parametrize("mode", [pytest.param("eager", marks=pytest.mark.extended), "jit"])
def test_nvfp4_recipe_gradients_the_same_bits(mode):
    """The NVFP4 recipe's forward and both quantized gradients (the kernel's fake quantization,
    stochastic rounding, the Hadamard transform) of [batch, seq, d] activations."""
    w = _inputs((64, 32), seed=3)
    x = np.nan_to_num(x3, nan=1.0, posinf=2.0, neginf=-2.0)
    f = jax.value_and_grad(_nvfp4_loss, argnums=(0, 1))
    f = f if mode == "eager" else jax.jit(f)
    out = {}
    for branches in ("auto", "all"):
        with lowprec.kernels.policy(platform_branches=branches):
            out[branches] = _bits(f(x, w))
    assert out["auto"] == out["all"]


def _primitives(jaxpr) -> set:
    names = set()
    for eqn in jaxpr.eqns:
        names.add(eqn.primitive.name)
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            names |= _primitives(sub)
    return names


@cpu_only_here
@pytest.mark.parametrize("case", ["nvfp4_kernel", "nvfp4_xla", "recipe_fake_quantize_2d"])
def test_only_the_cpu_branch_is_traced(case):
    """The CPU-only program holds no platform_index (lax.platform_dependent's switch) and is
    marked; the all-platform one holds the switch."""
    f = CASES[case]
    with lowprec.kernels.policy(platform_branches="auto"):
        auto = _primitives(jax.make_jaxpr(f)(x3).jaxpr)
    with lowprec.kernels.policy(platform_branches="all"):
        every = _primitives(jax.make_jaxpr(f)(x3).jaxpr)
    assert "platform_index" not in auto and "lowprec_cpu_only" in auto
    assert "platform_index" in every and "lowprec_cpu_only" not in every


@cpu_only_here
def test_lowering_a_cpu_only_program_for_another_platform_is_refused():
    f = CASES["nvfp4_kernel"]
    traced = jax.jit(f).trace(x3)
    assert traced.lower(lowering_platforms=("cpu",)) is not None
    for platforms in (("cuda",), ("cpu", "cuda"), ("tpu",)):
        with pytest.raises(ValueError, match=r"platform_branches=\"all\".*") as e:
            traced.lower(lowering_platforms=platforms)
        assert repr(platforms[-1]) in str(e.value)
    f = CASES["nvfp4_xla"]  # XLA:CPU's float arithmetic (no custom call, which export refuses)
    with pytest.raises(ValueError, match="traced by lowprec for CPU alone"):
        jax.export.export(jax.jit(f), platforms=["cpu", "cuda"])(x3)
    with lowprec.kernels.policy(platform_branches="all"):  # the fix the error names
        exported = jax.export.export(jax.jit(f), platforms=["cpu", "cuda"])(x3)
    assert exported.platforms == ("cpu", "cuda")


def test_platform_branches_is_a_policy_field_checked_by_name():
    assert lowprec.kernels.current_policy().platform_branches == "auto"
    with pytest.raises(ValueError, match="'some'.*'auto'.*'all'"):
        lowprec.kernels.Policy(platform_branches="some")
    with lowprec.kernels.policy(platform_branches="all") as p:
        assert p.platform_branches == "all" and _platform.other_platforms_possible()
    assert lowprec.kernels.current_policy().platform_branches == "auto"
    with pytest.raises(TypeError, match="unknown platform branch.*'gpu'"):
        _platform.platform_dependent(x3, gpu=lambda v: v, default=lambda v: v)
