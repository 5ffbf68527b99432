"""Fuzzing the native CPU kernels against XLA's formulation: random shapes, non-contiguous
inputs, padding and special values, for every OCP MX format and scale rule (quantize_mx and
the fused fake quantization), NVFP4 (both
steps, both roundings, computed and given tensor scales) and the selecting formats' block
choice (Four over Six, IF4, MixFP4).

Each case is a seeded random *structure* -- a base array of random rank and dims, a chain of
view operations inside ``jax.jit`` (axis permutations, reversals, strided slices, a
broadcast) that XLA must lay out densely before the custom call, and ``pad=True`` where the
last dim is not a whole number of blocks -- run on several random *fillings* of the base
array. A filling gives each stretch of 32 elements its own kind: Gaussian values over a random
binade, every float32 bit pattern, values spread over 40 binades below a random top (subnormal
and zero codes), exact ties of the element grid, all zeros (either sign), one repeated value,
blocks whose maximum sits on a power of two, the largest finite float32 or the subnormal range
(the exact integer path), with NaN, infinities, -0 and float32 subnormals sprinkled in.

The expected codes are lowprec's XLA path (policy ``"xla"``, the same jitted function), which
the rest of the suite checks against the independent reference; the FP6 packer's expected
bytes come from the layout's rule written with NumPy integers. Every case also checks that
the compiled program holds the custom call, so that the comparison is never XLA against XLA.

Cost: the compilations dominate (one per policy and structure, ~0.2 s with the kernel and
~0.5 s without on a 2-core machine), so the breadth is in the fillings: 24 structures x 6
fillings of up to 3,000 blocks; the FP6 packing cases compile no XLA formulation.
"""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lowprec
import lowprec.kernels
from lowprec.kernels import _cpu_native

FORMATS = ("mxfp8_e4m3", "mxfp8_e5m2", "mxfp6_e2m3", "mxfp6_e3m2", "mxfp4", "mxint8")
RULES = ("floor", "ceil", "even", "rceil", "even_e2m1")  # the kernel's (not floor_log2f)
FILLINGS = 6

needs_vector = pytest.mark.skipif(not _cpu_native.vector_quantizer(),
                                  reason="quantize_mx takes the kernel only on AVX2 CPUs "
                                         f"({_cpu_native.status()})")
needs_native = pytest.mark.skipif(not _cpu_native.available(), reason=_cpu_native.status())


def _seed(*parts) -> int:
    return zlib.crc32(" ".join(map(str, parts)).encode())


def _f32(sign, exp, mant) -> np.ndarray:
    bits = (np.asarray(sign, np.uint32) << 31) | (np.asarray(exp, np.uint32) << 23) | np.asarray(
        mant, np.uint32)
    return bits.astype(np.uint32).view(np.float32)


def filling(rng: np.random.Generator, shape) -> np.ndarray:
    """float32 values of ``shape``: each run of 32 elements (in memory order) of one kind,
    specials sprinkled over the whole (see the module docstring)."""
    n = int(np.prod(shape))
    runs = -(-n // 32)
    sign = rng.integers(0, 2, (runs, 32))
    mant = rng.integers(0, 2**23, (runs, 32))

    def per_run(values):  # one draw per run, broadcast over its 32 elements
        return np.asarray(values)[:, None]

    gaussian = rng.standard_normal((runs, 32))
    top = per_run(rng.integers(1, 255, runs))
    grid = rng.integers(0, 2**12, (runs, 32)) * np.exp2(per_run(rng.integers(-20, 10, runs)) - 9)
    pow2 = np.exp2(per_run(rng.integers(-60, 60, runs)))
    on_pow2 = rng.uniform(-1, 1, (runs, 32)) * pow2
    on_pow2[np.arange(runs), rng.integers(0, 32, runs)] = (pow2 * (1 - 2 * sign[:, :1]))[:, 0]
    kinds = [
        gaussian * np.exp2(per_run(rng.integers(-130, 120, runs))),  # one random binade
        rng.integers(0, 2**32, (runs, 32), dtype=np.uint64).astype(np.uint32)
        .view(np.float32),  # any bit pattern: NaN payloads, infinities, subnormals
        _f32(sign, np.clip(top - rng.integers(0, 41, (runs, 32)), 0, 254), mant),  # 40 binades
        np.where(sign == 1, -grid, grid),  # exact ties: multiples of 2^-9 of a power of two
        np.where(sign == 1, -0.0, 0.0),  # all zeros, either sign: scale code 0
        per_run(rng.standard_normal(runs) * np.exp2(rng.integers(-20, 20, runs)))
        + np.zeros((runs, 32)),  # one value repeated
        on_pow2,  # the block maximum on a power of two: the scale rules' boundaries
        _f32(sign, rng.integers(245, 255, (runs, 32)), mant),  # up to the float32 maximum
        _f32(sign, rng.integers(0, 4, (runs, 32)), mant),  # float32 subnormals, tiny normals
        gaussian * np.exp2(rng.integers(-30, 10, (runs, 32))),  # a mix of binades in a block
    ]
    # Each kind made float32 on its own (a float32 NaN taken through float64 would lose its
    # signaling bit); values past float32's range round to infinities, as intended.
    with np.errstate(over="ignore"):
        stacked = np.stack([k.astype(np.float32) for k in kinds])
    out = stacked[rng.integers(0, len(kinds), runs), np.arange(runs)]
    flat = out.ravel()[:n]
    for value, count in ((np.nan, 3), (np.inf, 2), (-np.inf, 2), (-0.0, 4),
                         (np.float32(2.0**-140), 3)):
        flat[rng.integers(0, n, count)] = value
    return flat.reshape(shape)


def structure(rng: np.random.Generator):
    """A random base shape and a view of it (a function of a traced array) whose last dim
    is the blocked one."""
    big = rng.random() < 0.3  # over 2^11 blocks: the kernel's work splits over threads
    dims = [int(rng.integers(1, 9)) for _ in range(int(rng.integers(1, 5)))]
    dims[-1] = int(rng.integers(1, 400))
    if big:  # 2,250-2,625 blocks of 32 (no strided slice below)
        dims = [4, 3, int(rng.integers(6000, 7000))]
    rank = len(dims)
    ops = []
    if rank > 1 and rng.random() < 0.6:
        ops.append(("permute", tuple(int(a) for a in rng.permutation(rank))))
    if rng.random() < 0.5:
        ops.append(("reverse", int(rng.integers(0, rank))))
    if rng.random() < 0.5 and not big:
        ops.append(("stride", int(rng.integers(0, rank)), int(rng.integers(2, 4))))
    if rng.random() < 0.3:
        ops.append(("broadcast", 2))

    def view(x):
        for op in ops:
            if op[0] == "permute":
                x = jnp.transpose(x, op[1])
            elif op[0] == "reverse":
                x = jnp.flip(x, op[1])
            elif op[0] == "stride":  # from element 1 where there is one: never empty
                index = [slice(None)] * x.ndim
                index[op[1]] = slice(min(1, x.shape[op[1]] - 1), None, op[2])
                x = x[tuple(index)]
            else:
                x = jnp.broadcast_to(x, (op[1], *x.shape))
        return x

    return tuple(dims), ops, view


@needs_vector
@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.quick_first(1)  # the FP6 kernels run quick in test_native_fp6 and _mx_quantize
def test_quantize_mx_fuzz(name, rule):
    """quantize_mx (and, for FP6, dequantize, whose unpacking is the other kernel) of a
    random view of random fillings: the hardware-float path's bits are the XLA path's."""
    rng = np.random.default_rng(_seed("quantize", name, rule))
    shape, ops, view = structure(rng)
    # dequantize of FP6 along the last axis unpacks with the other kernel (the scale rule
    # does not matter to it: one rule per format is enough)
    fp6 = name.startswith("mxfp6") and rule == "floor"

    def run(x):
        m = lowprec.quantize_mx(view(x), name, scale_rule=rule, pad=True)
        if not fp6:
            return m.elements, m.scales
        return m.elements, m.scales, jax.lax.bitcast_convert_type(lowprec.dequantize(m),
                                                                  jnp.uint32)

    fillings = [jnp.asarray(filling(rng, shape)) for _ in range(FILLINGS)]
    got = {}
    for policy in ("xla", "auto"):
        with lowprec.kernels.policy(policy):
            compiled = jax.jit(run).lower(fillings[0]).compile()  # once per policy
            text = compiled.as_text()
            calls = text.count('custom_call_target="lowprec_mx_quantize"')
            assert calls == (policy == "auto"), f"{policy}: {calls} quantizer calls ({ops})"
            if fp6:
                assert ('custom_call_target="lowprec_fp6_unpack"' in text) == (policy == "auto")
            got[policy] = [[np.asarray(a) for a in compiled(x)] for x in fillings]
    for i, (want, have) in enumerate(zip(got["xla"], got["auto"])):
        for part, a, b in zip(("elements", "scales", "dequantized"), have, want):
            np.testing.assert_array_equal(
                a, b, err_msg=f"{name} {rule} base {shape} view {ops} filling {i}: {part}")


@needs_vector
@pytest.mark.parametrize("case", range(6))
@pytest.mark.quick_first(1)
def test_nvfp4_quantize_fuzz(case):
    """quantize_mx(..., "nvfp4") of a random view of random fillings, with a random step,
    rounding (nearest even, or stochastic with the key's words) and tensor scale (computed,
    or a power of two from 2^-149 to 2^126): the NVFP4 kernel's codes, block scales and
    tensor scale are the XLA path's."""
    rng = np.random.default_rng(_seed("nvfp4", case))
    shape, ops, view = structure(rng)
    step = ("divide", "reciprocal")[int(rng.integers(0, 2))]
    stochastic = bool(rng.integers(0, 2))
    ts = None if rng.random() < 0.5 else float(2.0 ** int(rng.integers(-149, 127)))
    kw = {"nvfp4_step": step, "tensor_scale": ts, "pad": True}
    if stochastic:
        kw.update(rounding="stochastic", key=jax.random.key(case))

    def run(x):
        m = lowprec.quantize_mx(view(x), "nvfp4", **kw)
        return m.elements, m.scales, jax.lax.bitcast_convert_type(m.tensor_scale, jnp.uint32)

    fillings = [jnp.asarray(filling(rng, shape)) for _ in range(FILLINGS)]
    assert_kernel_is_xla(run, fillings, "lowprec_nvfp4_quantize",
                         ("elements", "scales", "tensor scale"), f"{kw} base {shape} view {ops}")


@needs_vector
@pytest.mark.parametrize("case", range(6))
@pytest.mark.quick_first(1)
def test_mx_fake_quantize_fuzz(case):
    """fake_quantize_mx of a random view of random fillings, with a random OCP MX format,
    scale rule, block axis and input dtype (float32, or bfloat16 rounded from the filling):
    the fused kernel's values are the XLA path's (its encoder and exact decoder)."""
    rng = np.random.default_rng(_seed("mx_fake", case))
    shape, ops, view = structure(rng)
    name = FORMATS[int(rng.integers(0, len(FORMATS)))]
    rule = RULES[int(rng.integers(0, len(RULES)))]
    narrow = rng.random() < 0.3
    last_axis = rng.random() < 0.7

    def run(x):
        v = view(x.astype(jnp.bfloat16) if narrow else x)
        axis = -1 if last_axis else 0
        out = lowprec.fake_quantize_mx(v, name, scale_rule=rule, axis=axis, pad=True)
        return (jax.lax.bitcast_convert_type(out.astype(jnp.float32), jnp.uint32),)

    fillings = [jnp.asarray(filling(rng, shape)) for _ in range(FILLINGS)]
    assert_kernel_is_xla(run, fillings, "lowprec_mx_fake_quantize", ("values",),
                         f"{name} {rule} narrow {narrow} last {last_axis} base {shape} "
                         f"view {ops}")


def assert_kernel_is_xla(run, fillings, target: str, parts: tuple, what: str):
    """``run`` compiled once per policy ("xla": no call of the kernel ``target``; "auto":
    one) gives the same arrays on every filling."""
    got = {}
    for policy in ("xla", "auto"):
        with lowprec.kernels.policy(policy):
            compiled = jax.jit(run).lower(fillings[0]).compile()  # once per policy
            calls = compiled.as_text().count(f'custom_call_target="{target}"')
            assert calls == (policy == "auto"), f"{policy}: {calls} calls of {target} ({what})"
            got[policy] = [[np.asarray(a) for a in compiled(x)] for x in fillings]
    for i, (want, have) in enumerate(zip(got["xla"], got["auto"])):
        for part, a, b in zip(parts, have, want):
            np.testing.assert_array_equal(a, b, err_msg=f"{what} filling {i}: {part}")


@needs_vector
@pytest.mark.parametrize("name", ("nvfp4_4over6", "if4", "mixfp4"))
@pytest.mark.slow  # the quick tier checks the kernel against XLA in test_native_grid_select
def test_grid_select_fuzz(name):
    """quantize_mx of the selecting formats (Four over Six, IF4, MixFP4) of a random view of
    random fillings, with the tensor scalar computed or given (a random float32 pattern,
    finite and non-negative): the block-choice kernel's codes and scales are the XLA path's
    (its integer emulation of the authors' float32 steps)."""
    rng = np.random.default_rng(_seed("grid_select", name))
    shape, ops, view = structure(rng)
    ts = None if rng.random() < 0.5 else float(
        np.uint32(rng.integers(0, 0x7F80_0000)).view(np.float32))
    kw = {"tensor_scale": ts, "pad": True}

    def run(x):
        m = lowprec.quantize_mx(view(x), name, **kw)
        return m.elements, m.scales

    fillings = [jnp.asarray(filling(rng, shape)) for _ in range(FILLINGS)]
    assert_kernel_is_xla(run, fillings, "lowprec_grid_select", ("elements", "scales"),
                         f"{name} {kw} base {shape} view {ops}")


def _want_packed(codes: np.ndarray) -> np.ndarray:
    """FP6 bytes of uint8 codes along the last axis by the layout's rule (low 6 bits count):
    code j of a group in bits 6j..6j+5 of the little-endian 24-bit word of its 3 bytes."""
    c = codes.astype(np.uint32).reshape(*codes.shape[:-1], -1, 4) & 0x3F
    word = c[..., 0] | c[..., 1] << 6 | c[..., 2] << 12 | c[..., 3] << 18
    out = np.stack([(word >> s) & 0xFF for s in (0, 8, 16)], axis=-1).astype(np.uint8)
    return out.reshape(*codes.shape[:-1], -1)


def _want_unpacked(packed: np.ndarray) -> np.ndarray:
    b = packed.astype(np.uint32).reshape(*packed.shape[:-1], -1, 3)
    word = b[..., 0] | b[..., 1] << 8 | b[..., 2] << 16
    out = np.stack([(word >> (6 * j)) & 0x3F for j in range(4)], axis=-1).astype(np.uint8)
    return out.reshape(*packed.shape[:-1], -1)


@needs_native
@pytest.mark.parametrize("case", range(8))
@pytest.mark.quick_first(2)
def test_fp6_packing_fuzz(case):
    """pack_fp6 / unpack_fp6 of random views of random bytes (every value: packing drops the
    top two bits): the layout's bytes and codes, by the kernel."""
    rng = np.random.default_rng(_seed("fp6", case))
    while True:  # a view whose last dim holds a whole 12 bytes (4 groups of codes or bytes)
        shape, ops, view = structure(rng)
        if jax.eval_shape(view, jax.ShapeDtypeStruct(shape, jnp.uint8)).shape[-1] >= 12:
            break

    def trimmed(x):  # the view, its last dim cut to whole groups both ways
        v = view(x)
        return v[..., : v.shape[-1] // 12 * 12]

    spec = jax.ShapeDtypeStruct(shape, jnp.uint8)
    materialize = jax.jit(trimmed).lower(spec).compile()
    pack = jax.jit(lambda x: lowprec.pack_fp6(trimmed(x))).lower(spec).compile()
    unpack = jax.jit(lambda x: lowprec.unpack_fp6(trimmed(x))).lower(spec).compile()
    assert 'custom_call_target="lowprec_fp6_pack"' in pack.as_text()
    assert 'custom_call_target="lowprec_fp6_unpack"' in unpack.as_text()
    for _ in range(FILLINGS):
        x = rng.integers(0, 256, shape, dtype=np.uint8)
        v = np.asarray(materialize(x))
        np.testing.assert_array_equal(np.asarray(pack(x)), _want_packed(v), err_msg=str(ops))
        np.testing.assert_array_equal(np.asarray(unpack(x)), _want_unpacked(v), err_msg=str(ops))
