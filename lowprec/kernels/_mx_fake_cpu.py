"""The native CPU kernel for fused MX fake quantization (``_mx_fake_cpu.cc``): the float32
values of ``dequantize(quantize_mx(x, fmt))`` for the E8M0 formats the one-pass quantizer
serves, in one custom call.

XLA:CPU compiles those values from lowprec's encoder and exact decoder (474 StableHLO lines
for MXFP8's ``fake_quantize_mx``), and a quantized dot adds the one-multiply decode and the
run-time check that picks a bfloat16 or a float32 product (~1,200 lines per MX dot, ~2,400
with its backward): on CPU the suite and training steps spent their time compiling these.
The kernel quantizes each block with the quantizer's own loop and decodes it as
``_bits.scale_bits_by_e8m0`` defines the values, and also gives, per block, whether the
one-multiply decode is exact there (``_mx_decode.fast_decode_exact``'s condition), which
the dot's choice of product reads: the same bits and the same choice
(``tests/test_native_mx_fake.py``). Loading: ``_cpu_native.py``; the check before first
use: :func:`_check` here.
"""

from __future__ import annotations

import numpy as np

from .._lazy import lazy_module
from . import _cpu_native, _mx_quantize_cpu

jax = lazy_module("jax")
jnp = lazy_module("jax.numpy")
lax = lazy_module("jax.lax")

TARGET = "lowprec_mx_fake_quantize"


def serves(cast) -> bool:
    """Whether the kernel computes the fake quantization of this cast (static): as the
    one-pass quantizer serves it (``_mx_quantize_cpu.serves``: E8M0 blocks of 32, round to
    nearest even, a rule it takes, an AVX2 CPU)."""
    return _mx_quantize_cpu.serves(cast)


def fast_min(fmt) -> int:
    """The smallest scale code at which the one-multiply decode of ``fmt`` is exact for any
    block (``_mx_decode.fast_scale_min``: E8M0's ``scale_min``)."""
    return fmt.scheme.fast_decoder().scale_min(fmt.element)


def fake_quantize_last(x, cast):
    """``(values, fast_ok)``: the float32 values of ``cast``'s quantization of the float32
    array ``x``, blocked along its last axis (a whole number of blocks), and uint8 flags,
    one per block (``x.shape[:-1] + (blocks,)``): 1 where the one-multiply decode is exact.
    CPU only, where :func:`serves` says and ``_cpu_native.available``."""
    fmt = cast.fmt
    attrs = _mx_quantize_cpu.attributes(fmt, cast.scale_rule)
    kw = {k: v if isinstance(v, bool) else np.int64(v) for k, v in attrs}
    n = x.shape[-1]
    out = (jax.ShapeDtypeStruct(x.shape, jnp.float32),
           jax.ShapeDtypeStruct((*x.shape[:-1], n // fmt.block_size), jnp.uint8))
    call = jax.ffi.ffi_call(TARGET, out, vmap_method="broadcast_all")
    # No differentiation rule of its own: callers give a straight-through or no gradient.
    return call(lax.stop_gradient(x), fast_min=np.int64(fast_min(fmt)), **kw)


def fake_quantize(x, cast, axis: int):
    """``fake_quantize_last`` of ``x`` (float32, bfloat16 or float16: widened exactly)
    blocked along ``axis``, moved last and back: the values in x's layout and shape, the
    flags in the blocks' layout along the last axis. A partial last block is zero-padded
    (+0.0 changes no block's maximum) and the padding cut from the values."""
    from .._bits import bits_to_f32
    from .._dtypes import input_bits

    # Widened with integer operations, never a float convert (docs/design.md §8: no compiled
    # lowprec program converts half-precision floats).
    xf = lax.stop_gradient(x)
    xf = xf if xf.dtype == jnp.float32 else bits_to_f32(input_bits(xf))
    n, block = xf.shape[axis], cast.fmt.block_size
    if n % block:
        widths = [(0, 0)] * xf.ndim
        widths[axis] = (0, -n % block)
        xf = jnp.pad(xf, widths)
    last = axis == xf.ndim - 1
    if not last:
        xf = jnp.moveaxis(xf, axis, -1)
    values, ok = fake_quantize_last(xf, cast)
    values = values if last else jnp.moveaxis(values, -1, axis)
    return lax.slice_in_dim(values, 0, n, axis=axis), ok


def _check() -> str:
    """'' if the registered handler fake-quantizes a known MXFP8 block as derived here: E4M3,
    floor rule, 31 values 3 and a -0. amax 3 = 1.5 x 2^1 gives the shared exponent 1 - 8,
    scale code 120 (at least E4M3's fast minimum 10: flag 1); 3 x 2^7 = 384 is an E4M3
    value, so the values come back as 3 and -0 (sign bit only)."""
    from .._format import mx_format
    from .._options import MXCast

    cpu = jax.devices("cpu")[0]
    x = np.full(32, 3.0, np.float32)
    x[-1] = -0.0
    cast = MXCast(mx_format("mxfp8_e4m3"), "floor")
    values, ok = jax.jit(lambda v: fake_quantize_last(v, cast))(jax.device_put(x, cpu))
    if not (np.array_equal(np.asarray(values).view(np.uint32), x.view(np.uint32))
            and np.asarray(ok).tolist() == [1]):
        return "MXFP8 fake-quantized values of a known block differ from the derived ones"
    return ""


_cpu_native.register_kernel("fused MX fake quantization", {TARGET: "LowprecMxFakeQuantize"},
                            _check)
