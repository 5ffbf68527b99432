"""The native CPU block choice of the selecting formats (lowprec/kernels/_grid_select_cpu.cc:
Four over Six, IF4, MixFP4) against XLA's formulation (``_grid_select.py``'s integer
emulation of the authors' IEEE float32 steps), bit for bit.

XLA's path (policy ``"xla"``) is the one tests/test_four_bit_2026.py also checks against the
authors' code and the reference; under the default policy that file runs the kernel. Here
both run on inputs built for the kernel's edges: blocks whose two candidates' errors tie
(small grid values, both grids exact) or differ by an ulp (those values moved one ulp),
float32 subnormals (inputs, block maxima, tensor scalars: the CPU flushes them unless the
kernel turns that off), ±0, NaN and infinities, blocks at the E4M3 scale's ends, and tensor
scalars given as traced values from 0 and 2^-149 to FLT_MAX and past the domain the schemes
compute (inf, NaN, negative, -0), where the emulation reads an infinite or NaN operand as
(1.m) x 2^128 and the kernel must do the same.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lowprec
import lowprec.kernels
from lowprec.kernels import _cpu_native, _grid_select_cpu

from helpers.inputs import bit_kinds

pytestmark = pytest.mark.skipif(not _cpu_native.vector_quantizer(),
                                reason="the block choice takes the kernel only on AVX2 CPUs "
                                       f"({_cpu_native.status()})")

TARGET = f'custom_call_target="{_grid_select_cpu.TARGET}"'
_E2M1 = lowprec.element_format("e2m1")


def variant(name: str, **options) -> lowprec.MXFormat:
    base = lowprec.mx_format(name)
    if not options:
        return base
    tag = "_".join(f"{v}" for v in options.values())
    return lowprec.MXFormat(f"{name}_{tag}", _E2M1, 16, dataclasses.replace(base.scheme, **options))


FORMATS = {"nvfp4_4over6": {}, "if4": {}, "mixfp4": {}}
VARIANTS = {"nvfp4_4over6": ({"error": "mse"}, {"error_domain": "fp16"}, {"e4m3_max": 448}),
            "if4": ({"error": "mae"},)}
CASES = [(n, {}) for n in FORMATS] + [(n, o) for n, opts in VARIANTS.items() for o in opts]


def kinds(seed: int) -> dict[str, np.ndarray]:
    """float32 arrays [4, 64] (4 blocks of 16 per row), by kind."""
    rng = np.random.default_rng(seed)
    shape = (4, 64)
    sign = rng.integers(0, 2, shape)
    mant = rng.integers(0, 2**23, shape)
    binade = np.exp2(rng.integers(-130, 120, (4, 4, 1)))
    # Multiples of 1/2 up to 7 in a block's binade: on both E2M1 and INT4 grids (or on the
    # 6- and the 4-scaled one) often exactly, so the two errors tie (often both 0).
    grid = (rng.integers(-14, 15, (4, 4, 16)) / 2 * binade).reshape(shape)
    ties = grid.astype(np.float32)
    ulp = np.where(rng.random(shape) < 0.5, np.nextafter(ties, np.float32(np.inf)),
                   np.nextafter(ties, np.float32(-np.inf)))
    near = np.where(rng.random(shape) < 0.25, ulp, ties)
    special = rng.standard_normal(shape) * np.exp2(rng.integers(-140, 120, (4, 1)))
    flat = special.reshape(-1)
    at = rng.choice(flat.size, 12, replace=False)
    flat[at[:3]], flat[at[3:6]], flat[at[6:9]], flat[at[9:]] = np.nan, -np.inf, np.inf, -0.0
    out = {
        **bit_kinds(rng, sign, mant, shape),
        "ties": ties,
        "one_ulp": near,
        "zeros": np.where(sign == 1, -0.0, 0.0),
        "special": special,
    }
    with np.errstate(over="ignore"):
        return {k: np.asarray(v).astype(np.float32) for k, v in out.items()}


@functools.lru_cache(maxsize=None)
def _compiled(policy: str, name: str, options: tuple, shape: tuple):
    """quantize_mx(x, fmt) and dequantize of it, compiled under ``policy`` with the tensor
    scalar a traced operand (one program per policy serves every value), and whether the
    program holds the kernel's custom call."""
    fmt = variant(name, **dict(options))
    with lowprec.kernels.policy(policy):
        def run(v, ts):
            m = lowprec.quantize_mx(v, fmt, tensor_scale=ts)
            return m.elements, m.scales, lowprec.dequantize(m)

        compiled = jax.jit(run).lower(jax.ShapeDtypeStruct(shape, jnp.float32),
                                      jax.ShapeDtypeStruct((), jnp.float32)).compile()
    return compiled, TARGET in compiled.as_text()


def computed_scalar(name: str, x: np.ndarray) -> np.float32:
    """The tensor scalar the scheme computes (tests/test_four_bit_2026.py checks it against
    the authors'): the finite amax, or for MixFP4 2688 / max(amax, 2^-126) (1 if that is
    inf), rounded once in float32."""
    mag = np.abs(x[np.isfinite(x)])
    amax = np.float32(mag.max() if mag.size else 0.0)
    if name != "mixfp4":
        return amax
    with np.errstate(over="ignore"):
        gs = np.float32(2688.0) / max(amax, np.float32(2.0**-126))
    return np.float32(1.0) if np.isinf(gs) else gs


TENSOR_SCALARS = (0.0, 2.0**-149, 2.0**-130, 1e-30, 1.0, 1e30, float(np.finfo(np.float32).max),
                  np.inf, np.nan, -1.0, -0.0)


def assert_same(name, options, kinds_, scalars):
    x = np.concatenate(list(kinds_.values()))
    auto, took = _compiled("auto", name, tuple(options.items()), x.shape)
    xla, xla_took = _compiled("xla", name, tuple(options.items()), x.shape)
    assert took and not xla_took, "the kernel runs under 'auto' only"
    for ts in scalars:
        ts = computed_scalar(name, x) if ts is None else np.float32(ts)
        got, want = auto(x, ts), xla(x, ts)
        for part, a, b in zip(("elements", "scales", "values"), got, want):
            a, b = np.asarray(a), np.asarray(b)
            if part == "values":
                a, b = a.view(np.uint32), b.view(np.uint32)
            for i, kind in enumerate(kinds_):  # report the kind of input that differs
                rows = slice(4 * i, 4 * (i + 1))
                np.testing.assert_array_equal(
                    a[rows], b[rows], err_msg=f"{name} {options} ts={ts!r} {kind}: {part}")


@pytest.mark.quick_cases(name=["if4"])
@pytest.mark.parametrize("name", list(FORMATS))
def test_same_bits_as_xla(name):
    """Every kind of input under the scheme's own tensor scalar and the adversarial ones."""
    assert_same(name, {}, kinds(seed=list(FORMATS).index(name)), (None,) + TENSOR_SCALARS)


@pytest.mark.extended  # each variant is a program of its own (a ~3 s XLA compile): the
# default run has their code paths in the base formats' (the same C++ with a flag)
@pytest.mark.parametrize("name, options", [c for c in CASES if c[1]], ids=str)
def test_variants_same_bits_as_xla(name, options):
    assert_same(name, options, kinds(seed=7), (None, 0.0, 2.0**-149, 1.0, np.inf, -1.0))


def test_batched_tensor_scalars_and_middle_axis():
    """Under vmap (one tensor scalar per example: the kernel takes one per block) and blocks
    along a middle axis, the kernel gives what the per-example calls give."""
    k = kinds(seed=3)
    x = np.stack([k["normal"], k["subnormal"], k["one_ulp"]])  # [3, 4, 64]
    fmt = lowprec.mx_format("if4")
    batched = jax.jit(jax.vmap(lambda v: lowprec.quantize_mx(v, fmt).scales))(x)
    for i in range(3):
        np.testing.assert_array_equal(np.asarray(batched[i]),
                                      np.asarray(lowprec.quantize_mx(jnp.asarray(x[i]), fmt).scales),
                                      err_msg=f"example {i}")
    xt = np.ascontiguousarray(np.swapaxes(x, 1, 2))  # [3, 64, 4]: blocks along axis 1
    mid = lowprec.quantize_mx(jnp.asarray(xt), fmt, axis=1)
    last = lowprec.quantize_mx(jnp.asarray(x), fmt, axis=-1)
    np.testing.assert_array_equal(np.swapaxes(np.asarray(mid.scales), 1, 2),
                                  np.asarray(last.scales))


def test_mixfp4_tensor_scalar_is_the_ieee_quotient():
    """MixFP4's global scale 2688 / max(amax, 2^-126) (1 where that overflows), which XLA:CPU
    divides in hardware float32, is NumPy's IEEE quotient at the edges: amax subnormal, at
    and just above 2^-126 (quotients past FLT_MAX), where the quotient crosses FLT_MAX, at
    FLT_MAX (the smallest quotient) and over random patterns."""
    rng = np.random.default_rng(5)
    f32 = np.float32
    edges = [0.0, 2.0**-149, 2.0**-127, 2.0**-126, float(np.nextafter(f32(2.0**-126), f32(1))),
             float(f32(2688) / np.finfo(np.float32).max), 1e-35, 1.0, 3.0,
             float(np.finfo(np.float32).max)]
    amax = np.concatenate([np.float32(edges),
                           rng.integers(0, 0x7F80_0000, 64, dtype=np.uint32).view(np.float32)])
    run = jax.jit(jax.vmap(lambda a: lowprec.quantize_mx(jnp.full((16,), a), "mixfp4").tensor_scale))
    got = np.asarray(run(jnp.asarray(amax))).view(np.uint32)
    with np.errstate(over="ignore"):
        want = f32(2688) / np.maximum(amax, f32(2.0**-126))
    want = np.where(np.isinf(want), f32(1), want).astype(np.float32).view(np.uint32)
    np.testing.assert_array_equal(got, want, err_msg=str(amax))
