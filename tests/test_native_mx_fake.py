"""The native fused MX fake quantization on CPU (lowprec/kernels/_mx_fake_cpu.cc, an XLA FFI
target) against XLA's formulation, bit for bit: the values of ``fake_quantize_mx`` and of
the quantized dot's operands, and the per-block flags the dot's choice between a bfloat16
and a float32 product reads.

The expected values come from lowprec's XLA path (policy ``"xla"``: its encoder and exact
decoder, which the rest of the suite checks against the independent reference, ml_dtypes
and peer libraries); the expected flags from their definition, written here: a block's
one-multiply decode is exact when its scale code is at least 1 - log2 of the element's
smallest subnormal (every value times 2^(s - 127) then a float32 normal) or it holds only
zeros. Inputs reach every branch (``test_native_mx_quantize.inputs``): NaN and infinity
blocks (scale 0xFF), subnormals, -0, ties, saturation, tiny and huge block maxima (values
below 2^-126 built in integers, products past float32's range).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lowprec
import lowprec.kernels
from lowprec._format import mx_format
from lowprec._options import MXCast
from lowprec.kernels import _cpu_native, _mx_fake_cpu
from test_native_mx_quantize import FORMATS, RULES, inputs

needs_vector = pytest.mark.skipif(not _cpu_native.vector_quantizer(),
                                  reason="the fused kernel serves AVX2 CPUs only")

# 1 - log2(smallest positive element magnitude): E4M3 2^-9, E5M2 2^-16, E2M3 2^-3,
# E3M2 2^-4, E2M1 2^-1, MX INT8 2^-6 (OCP MX spec v1.0, tables 1-3).
FAST_MIN = {"mxfp8_e4m3": 10, "mxfp8_e5m2": 17, "mxfp6_e2m3": 4, "mxfp6_e3m2": 5,
            "mxfp4": 2, "mxint8": 7}


def _bits(a) -> np.ndarray:
    return np.asarray(a, np.float32).view(np.uint32)


def _want_flags(values: np.ndarray, scales: np.ndarray, name: str) -> np.ndarray:
    """The flags by their definition, from XLA's values and scales (blocks along the last
    axis): scale code at least FAST_MIN, or every value of the block ±0."""
    zero = (values.reshape(*values.shape[:-1], -1, 32) == 0).all(axis=-1)
    return (scales >= FAST_MIN[name]) | zero


@needs_vector
@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.quick_first(1)
def test_same_bits_and_flags_as_xla(name):
    """Every kind of input under every rule: the kernel's values are XLA's
    ``dequantize(quantize_mx(x))`` and its flags the definition's (one program per policy
    for all the rules)."""
    kinds = [inputs(16, 128, seed=FORMATS.index(name) * 5 + i) for i in range(len(RULES))]
    xs = [jnp.asarray(np.concatenate(list(k.values()))) for k in kinds]
    fmt = mx_format(name)
    casts = [MXCast(fmt, r) for r in RULES]
    got = jax.jit(lambda vs: [_mx_fake_cpu.fake_quantize_last(v, c)
                              for v, c in zip(vs, casts)])(xs)
    with lowprec.kernels.policy("xla"):
        want = jax.jit(lambda vs: [
            (lowprec.dequantize(m), m.scales) for m in
            (lowprec.quantize_mx(v, name, scale_rule=r) for v, r in zip(vs, RULES))])(xs)
    for rule, (values, flags), (wv, ws) in zip(RULES, got, want):
        wv, ws = np.asarray(wv), np.asarray(ws)
        for i, kind in enumerate(kinds[0]):  # report the kind of input that differs
            rows = slice(16 * i, 16 * (i + 1))
            np.testing.assert_array_equal(_bits(values)[rows], _bits(wv)[rows],
                                          err_msg=f"{name} {rule} {kind}: values")
            np.testing.assert_array_equal(np.asarray(flags)[rows] != 0,
                                          _want_flags(wv, ws, name)[rows],
                                          err_msg=f"{name} {rule} {kind}: flags")


def _fake_both(fn, *args):
    """``fn(*args)`` jitted with the kernels allowed and with XLA only; and whether the first
    program calls the fused kernel."""
    text = jax.jit(fn).lower(*args).as_text()
    auto = jax.jit(fn)(*args)
    with lowprec.kernels.policy("xla"):
        xla = jax.jit(fn)(*args)
    return auto, xla, "@lowprec_mx_fake_quantize(" in text


@needs_vector
@pytest.mark.parametrize("shape, axis, dtype", [
    ((3, 5, 70), -1, np.float32),  # padded: 70 = 2 x 32 + 6
    ((33, 4), 0, np.float32),  # along axis 0 (moved last), padded
    ((2, 64), -1, jnp.bfloat16),  # widened exactly, rounded back to bfloat16
])
def test_fake_quantize_mx_takes_it(shape, axis, dtype):
    """``fake_quantize_mx`` takes the kernel on CPU for odd, padded and transposed shapes and
    narrow inputs, with XLA's bits; specials included."""
    x = inputs(8, 256, seed=7)["special"].reshape(-1)[:np.prod(shape)].reshape(shape)
    x = jnp.asarray(x).astype(dtype)
    def fn(v):
        return [lowprec.fake_quantize_mx(v, f, axis=axis, pad=True, scale_rule="rceil")
                for f in ("mxfp8_e4m3", "mxfp6_e3m2", "mxfp4")]

    auto, xla, called = _fake_both(fn, x)
    assert called
    for f, a, b in zip(("mxfp8_e4m3", "mxfp6_e3m2", "mxfp4"), auto, xla):
        assert a.dtype == b.dtype == x.dtype
        np.testing.assert_array_equal(np.asarray(a, np.float32).view(np.uint32),
                                      np.asarray(b, np.float32).view(np.uint32), err_msg=f)


@needs_vector
def test_vmap_and_gradient():
    """Under vmap (batched rows) and grad (straight-through) the kernel gives XLA's values
    and gradient."""
    x = jnp.asarray(inputs(4, 64, seed=8)["spread"].reshape(2, 2, 64))
    fn = jax.vmap(lambda v: lowprec.fake_quantize_mx(v, "mxint8"))
    auto, xla, called = _fake_both(fn, x)
    assert called
    np.testing.assert_array_equal(_bits(auto), _bits(xla))
    g = jax.grad(lambda v: jnp.sum(lowprec.fake_quantize_mx(v, "mxfp4") * 3.0))(x)
    np.testing.assert_array_equal(np.asarray(g), np.full(x.shape, 3.0, np.float32))


@needs_vector
@pytest.mark.parametrize("scale", [1.0, 2.0**-120])
def test_dot_takes_it_same_bits(scale):
    """A recipe's MX dot and its gradients take the kernel for every operand on CPU, with
    XLA's bits: ordinary operands (the bfloat16 product) and tiny ones (blocks whose
    one-multiply decode is not exact: the float32 product), NaN and infinity included."""
    rng = np.random.default_rng(9)
    x = rng.standard_normal((8, 64)).astype(np.float32) * np.float32(scale)
    x[0, 3], x[1, 40] = np.nan, np.inf
    w = rng.standard_normal((64, 48)).astype(np.float32)
    dn = (((1,), (0,)), ((), ()))
    r = lowprec.NVIDIA_MXFP8

    def fn(a, b):
        out, pull = jax.vjp(lambda a, b: r.dot_general(a, b, dn), a, b)
        return (out, *pull(jnp.ones_like(out)))

    auto, xla, called = _fake_both(fn, jnp.asarray(x), jnp.asarray(w))
    assert called
    for part, a, b in zip(("out", "grad x", "grad w"), auto, xla):
        np.testing.assert_array_equal(_bits(a), _bits(b), err_msg=part)


@needs_vector
def test_calls_it_does_not_serve_keep_xla():
    x = jnp.zeros((8, 64), jnp.float32)

    def called(fmt, **kw):
        text = jax.jit(lambda v: lowprec.fake_quantize_mx(v, fmt, **kw)).lower(x).as_text()
        return "@lowprec_mx_fake_quantize(" in text

    assert called("mxfp8_e5m2")
    assert not called("mxfp4_b16")  # not the OCP block of 32
    assert not called("nvfp4")  # a tensor scale (its own kernel)
    assert not called("mxfp4", scale_rule="floor_log2f")  # ggml's rule
    assert not called("mxfp4", rounding="stochastic", key=jax.random.key(0))
    with lowprec.kernels.policy("xla"):
        assert not called("mxfp8_e5m2")


@pytest.mark.skipif(not _cpu_native.available(), reason=_cpu_native.status())
def test_kernel_refuses_bad_calls():
    """Buffers that do not match the blocks, and attributes no format has, are errors."""
    cast = MXCast(mx_format("mxfp8_e4m3"), "floor")
    with pytest.raises(Exception, match="buffer sizes do not match"):
        jax.block_until_ready(jax.jit(lambda v: _mx_fake_cpu.fake_quantize_last(v, cast))(
            jnp.zeros((4, 48), jnp.float32)))
    call = jax.ffi.ffi_call(_mx_fake_cpu.TARGET, (jax.ShapeDtypeStruct((64,), jnp.float32),
                                                  jax.ShapeDtypeStruct((2,), jnp.uint8)))
    from lowprec.kernels import _mx_quantize_cpu

    kw = {k: v if isinstance(v, bool) else np.int64(v)
          for k, v in _mx_quantize_cpu.attributes(cast.fmt, "floor")}
    for bad in ({"mantissa_bits": np.int64(23)}, {"fast_min": np.int64(0)}):
        with pytest.raises(Exception, match="unsupported format attributes"):
            jax.block_until_ready(jax.jit(lambda v, bad=bad: call(
                v, **{**kw, "fast_min": np.int64(10), **bad}))(jnp.zeros(64, jnp.float32)))
