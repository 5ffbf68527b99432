"""The native one-pass CPU MX quantizer (lowprec/kernels/_mx_quantize_cpu.cc, an XLA FFI
target) against XLA's formulation of ``quantize_mx``, bit for bit.

The expected codes come from lowprec's XLA path (policy ``"xla"``), which the rest of the
suite checks against the independent reference, ml_dtypes, torchao and microxcaling; here
the kernel must reproduce it exactly, on inputs built to reach every branch of the block
rules and of the element rounding: every float32 class (subnormals, NaN, infinities, -0),
blocks whose scale sends them to the exact integer path (tiny and huge maxima), exact ties
on the element grid, and blocks of one value.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import lowprec
import lowprec.kernels
from lowprec._format import mx_format
from lowprec.kernels import _cpu_native, _mx_quantize_cpu

needs_native = pytest.mark.skipif(not _cpu_native.available(), reason=_cpu_native.status())
needs_vector = pytest.mark.skipif(not _cpu_native.vector_quantizer(),
                                  reason="quantize_mx takes the kernel only on AVX2 CPUs")

FORMATS = ("mxfp8_e4m3", "mxfp8_e5m2", "mxfp6_e2m3", "mxfp6_e3m2", "mxfp4", "mxint8")
RULES = ("floor", "ceil", "even", "rceil", "even_e2m1")  # the kernel's (not floor_log2f)


def inputs(rows: int, cols: int, seed: int) -> dict[str, np.ndarray]:
    """float32 test arrays [rows, cols] (cols a multiple of 32), by kind."""
    rng = np.random.default_rng(seed)
    blocks = cols // 32

    def bits(sign, exp, mant):
        return ((sign << 31) | (exp << 23) | mant).astype(np.uint32).view(np.float32)

    shape = (rows, cols)
    sign = rng.integers(0, 2, shape)
    mant = rng.integers(0, 2**23, shape)
    out = {
        "normal": rng.standard_normal(shape).astype(np.float32),
        # Every pattern: NaNs and infinities make 0xFF blocks, subnormals and huge values.
        "any_bits": rng.integers(0, 2**32, shape, dtype=np.uint64).astype(np.uint32).view(np.float32),
        # Blocks spanning up to 40 binades below a random top: elements round to 0,
        # subnormal codes and every binade of the element.
        "spread": bits(sign, np.clip(rng.integers(1, 255, (rows, blocks, 1))
                                     - rng.integers(0, 41, (rows, blocks, 32)), 0, 254)
                       .reshape(shape), mant),
        # Maxima below 2^-108 or near 2^127: the shared exponent leaves the fast encode's
        # range, so these blocks take the exact integer path.
        "tiny": bits(sign, rng.integers(0, 4, shape), mant),
        "huge": bits(sign, rng.integers(245, 255, shape), mant),
    }
    # Exact ties: multiples of 2^-9 of a per-block power of two, with random signs.
    grid = rng.integers(0, 2**12, shape) * np.exp2(
        rng.integers(-20, 10, (rows, blocks)).repeat(32, axis=1)) / 2**9
    out["ties"] = np.where(sign == 1, -grid, grid).astype(np.float32)
    special = out["normal"] * np.float32(2.0) ** rng.integers(-140, 120, (rows, 1)).astype(np.float32)
    flat = special.reshape(-1)
    at = rng.choice(flat.size, 64, replace=False)
    flat[at[:16]], flat[at[16:32]], flat[at[32:48]], flat[at[48:]] = np.nan, -np.inf, -0.0, 0.0
    special[0, :32] = 0.0  # an all-zero block: scale code 0
    special[1, :32] = -0.0
    special[2, :32] = 3.0  # one value
    out["special"] = special
    return out


def _quantize(x, name, rule, **kw):
    if rule is not None:
        kw["scale_rule"] = rule
    return jax.jit(lambda v: lowprec.quantize_mx(v, name, **kw))(x)


def _both(x, name, rule, **kw):
    """quantize_mx's (elements, scales) with the kernel allowed and with XLA only."""
    out = {}
    previous = lowprec.kernels.set_policy("xla")
    try:
        m = _quantize(x, name, rule, **kw)
        out["xla"] = (np.asarray(m.elements), np.asarray(m.scales))
        lowprec.kernels.set_policy("auto")
        m = _quantize(x, name, rule, **kw)
        out["auto"] = (np.asarray(m.elements), np.asarray(m.scales))
    finally:
        lowprec.kernels.set_policy(previous)
    return out


def _takes_kernel(x, name, rule=None, **kw) -> bool:
    """Whether the program of quantize_mx(x, name, ...) calls the kernel (read from the
    lowered program: the choice is made while tracing, so no compile is needed)."""
    if rule is not None:
        kw["scale_rule"] = rule
    text = jax.jit(lambda v: lowprec.quantize_mx(v, name, **kw)).lower(x).as_text()
    return "stablehlo.custom_call @lowprec_mx_quantize(" in text


def _programs(xs, name, rules, **kw):
    """quantize_mx(x, name, scale_rule=r, **kw) for each (x, r) of ``xs`` and ``rules`` as the
    outputs of one program, compiled with the kernel allowed ("auto") and with XLA only
    ("xla"): per policy, the (elements, scales) of each rule as NumPy, and the count of the
    kernel's custom calls in the compiled program."""
    out = {}
    for policy in ("xla", "auto"):
        with lowprec.kernels.policy(policy):
            compiled = jax.jit(lambda vs: [
                (m.elements, m.scales) for m in
                (lowprec.quantize_mx(v, name, scale_rule=r, **kw) for v, r in zip(vs, rules))]
            ).lower(xs).compile()
            calls = compiled.as_text().count('custom_call_target="lowprec_mx_quantize"')
            out[policy] = ([tuple(np.asarray(a) for a in pair) for pair in compiled(xs)], calls)
    return out


@needs_vector
@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.quick_first(1)
def test_same_bits_as_xla(name):
    """Every kind of input under every rule the kernel serves: its codes are XLA's, and
    "auto" takes the kernel for each rule (one program per policy for all the rules, each
    rule on inputs of its own)."""
    kinds = [inputs(24, 256, seed=FORMATS.index(name) * 4 + i) for i in range(len(RULES))]
    xs = [jnp.asarray(np.concatenate(list(k.values()))) for k in kinds]
    got = _programs(xs, name, RULES)
    assert got["auto"][1] == len(RULES) and got["xla"][1] == 0, (got["auto"][1], got["xla"][1])
    for rule, have, want in zip(RULES, got["auto"][0], got["xla"][0]):
        for part, a, b in zip(("elements", "scales"), have, want):
            for i, kind in enumerate(kinds[0]):  # report the kind of input that differs
                rows = slice(24 * i, 24 * (i + 1))
                np.testing.assert_array_equal(a[rows], b[rows],
                                              err_msg=f"{name} {rule} {kind}: {part}")


@needs_vector
@pytest.mark.slow  # left out of the quick tier: test_same_bits_as_xla's quick cases run its code
@given(data=st.data())
def test_any_bits_property(data):
    """Random float32 bit patterns, format and rule: the kernel's codes are XLA's."""
    name = data.draw(st.sampled_from(FORMATS))
    rule = data.draw(st.sampled_from(RULES))
    words = data.draw(st.lists(st.integers(0, 2**32 - 1), min_size=64, max_size=64))
    x = np.array(words, np.uint32).view(np.float32).reshape(2, 32)
    got = _both(jnp.asarray(x), name, rule)
    np.testing.assert_array_equal(got["auto"][0], got["xla"][0])
    np.testing.assert_array_equal(got["auto"][1], got["xla"][1])


@needs_vector
@pytest.mark.parametrize("shape", [(100,), (3, 5, 70), (2, 1, 33)])
@pytest.mark.quick_first(1)
def test_padding_and_leading_dims(shape):
    x = jnp.asarray(np.random.default_rng(4).standard_normal(shape).astype(np.float32))
    got = _both(x, "mxfp6_e2m3", "floor", pad=True)
    np.testing.assert_array_equal(got["auto"][0], got["xla"][0])
    np.testing.assert_array_equal(got["auto"][1], got["xla"][1])
    assert _takes_kernel(x, "mxfp6_e2m3", pad=True)
    # dequantize drops the padding from the kernel's codes as from XLA's
    back = lowprec.dequantize(lowprec.quantize_mx(x, "mxfp6_e2m3", pad=True))
    assert back.shape == x.shape


@needs_vector
def test_calls_it_does_not_serve_keep_xla():
    x = jnp.asarray(np.random.default_rng(5).standard_normal((8, 64)).astype(np.float32))
    assert _takes_kernel(x, "mxfp8_e4m3")
    assert not _takes_kernel(x.astype(jnp.bfloat16), "mxfp8_e4m3")  # not float32
    assert not _takes_kernel(x, "mxfp8_e4m3", rounding="stochastic",
                             key=jax.random.key(0))  # random rounding
    assert not _takes_kernel(x, "mxfp4_b16")  # not the OCP block of 32
    assert not _takes_kernel(x.T, "mxfp8_e4m3", axis=0)  # not the last axis
    assert not _takes_kernel(x, "nvfp4")  # a tensor scale
    assert not _takes_kernel(x, "mxfp4", "floor_log2f")  # ggml's rule: XLA's path
    assert not _takes_kernel(x, "mxfp4", rounding="nearest_toward_zero")  # not nearest even
    previous = lowprec.kernels.set_policy("xla")
    try:
        assert not _takes_kernel(x, "mxfp8_e4m3")
    finally:
        lowprec.kernels.set_policy(previous)


@needs_native
@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("block", [16, 64])
@pytest.mark.quick_first(1)
def test_portable_loop_same_bits_as_xla(name, block):
    """Block sizes other than 32 run the kernel's portable loop (no AVX2); quantize_mx does
    not send them to the kernel, but the loop must still give XLA's codes, under every rule
    (the rules' kernel calls in one program, XLA's in another)."""
    fmt = mx_format(name, block)
    x = jnp.asarray(np.concatenate(list(inputs(8, 256, seed=block).values())))
    calls = [_mx_quantize_cpu.attributes(fmt, rule) for rule in RULES]
    got = jax.jit(lambda v: [_mx_quantize_cpu.quantize_last(v, attrs) for attrs in calls])(x)
    with lowprec.kernels.policy("xla"):
        want = jax.jit(lambda v: [(m.elements, m.scales) for m in
                                  (lowprec.quantize_mx(v, fmt, scale_rule=r) for r in RULES)])(x)
    for rule, have, expected in zip(RULES, got, want):
        for part, a, b in zip(("elements", "scales"), have, expected):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b),
                                          err_msg=f"{name} b{block} {rule}: {part}")


@needs_native
def test_kernel_refuses_mismatched_buffers():
    """The handler checks its buffers against the format (a wrong call is an error, never
    a write past an output)."""
    attrs = _mx_quantize_cpu.attributes(mx_format("mxfp8_e4m3"), "floor")
    x = jnp.zeros((4, 48), jnp.float32)  # 48: not a whole number of 32-element blocks
    with pytest.raises(Exception, match="buffer sizes do not match"):
        jax.block_until_ready(jax.jit(lambda v: _mx_quantize_cpu.quantize_last(v, attrs))(x))


@needs_native
@pytest.mark.parametrize("attribute, value", [
    ("mantissa_bits", 23),  # would shift by 32 and more
    ("mantissa_bits", 0),
    ("emin", -200),  # the subnormal quantum below float32's normals
    ("max_code", 255),  # past the sign bit of an 8-bit code
    ("rceil_k", -1),
    ("block", 2**40),
])
def test_kernel_refuses_attributes_no_format_has(attribute, value):
    """The target is callable by anyone with any attributes: values outside every MX
    format's are an error, not shifts and float patterns out of their ranges."""
    attrs = dict(_mx_quantize_cpu.attributes(mx_format("mxfp8_e4m3"), "floor"))
    attrs[attribute] = value
    x = jnp.zeros((4, 64), jnp.float32)
    with pytest.raises(Exception, match="unsupported format attributes"):
        call = jax.ffi.ffi_call(_mx_quantize_cpu.TARGET,
                                (jax.ShapeDtypeStruct((4, 64), jnp.uint8),
                                 jax.ShapeDtypeStruct((4, 2), jnp.uint8)))
        kw = {k: v if isinstance(v, bool) else np.int64(v) for k, v in attrs.items()}
        jax.block_until_ready(jax.jit(lambda v: call(v, **kw))(x))
