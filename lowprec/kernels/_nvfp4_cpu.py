"""The native CPU kernel for NVFP4 quantization (``_nvfp4_cpu.cc``): which calls it serves,
and ``quantize_mx``'s NVFP4 encode through it.

XLA:CPU compiles lowprec's NVFP4 encode (``_nvfp4.py``: long divisions and products on the
float32 bits, a hardware-float branch beside them, stochastic rounding's integer compare) to
~1,000 HLO instructions per call, and a training step holds dozens of them: compiling them
dominated NVFP4 training on CPU. The kernel is one opaque custom call that takes the same
IEEE float32 steps with subnormals kept (``_nvfp4_cpu.h``), so the same bits for every
positive finite tensor scale and every input, NaN and infinity included
(``tests/test_native_nvfp4.py``). The kernel also computes a tensor scale computed from x
(the largest finite magnitude, one IEEE division, the clamps of ``_scheme_nvfp4``: XLA's
own reduction wrote |x| out first, a copy of x); XLA computes the stochastic-rounding words
(the caller's, or the key's words of ``_random``) and clamps a given tensor scale, exactly as
its own path does. Loading: ``_cpu_native.py``; the check before first use: :func:`_check`
here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .._bits import f32_bits
from .._format import mx_format
from .._mxarray import MXArray
from .._random import WORD_BITS, as_word32, check_size, element_index, element_words, key_words
from .._scheme_nvfp4 import NVFP4Scheme
from . import _cpu_native

TARGET = "lowprec_nvfp4_quantize"
_DTYPES = (np.dtype(np.float32), np.dtype(jnp.bfloat16), np.dtype(np.float16))


def serves(cast) -> bool:
    """Whether ``quantize_mx`` may take the kernel for this cast (static): lowprec's NVFP4
    (E2M1 elements, E4M3 scales of blocks of 16, either step), round to nearest even or
    stochastically, on a CPU with AVX2 (the kernel keeps subnormals through the MXCSR, an x86
    register)."""
    fmt = cast.fmt
    return (type(fmt.scheme) is NVFP4Scheme and fmt.element == mx_format("nvfp4").element
            and fmt.block_size == 16 and cast.rounding in ("nearest_even", "stochastic")
            and _cpu_native.vector_quantizer())


def takes(x) -> bool:
    """Whether the kernel takes this input (static): a float32, bfloat16 or float16 array
    (the narrow ones widened to float32 exactly)."""
    return np.dtype(x.dtype) in _DTYPES


def _words(cast, rng, padded_shape):
    """The uint32 words (compared with frac x 2^32) stochastic rounding uses for the padded
    input, as ``_encode_stochastic.encode_stochastic`` draws or takes them; else an empty
    array."""
    if not cast.stochastic:
        return jnp.zeros((0,), jnp.uint32)
    key, words = rng
    if words is not None:
        return as_word32(words)
    r16 = element_words(key_words(key), element_index(check_size(padded_shape)))
    return lax.shift_left(r16, jnp.uint32(WORD_BITS))


def quantize_mxarray(x, cast, axis: int, padded: int, rng, tensor_scale, xla) -> MXArray:
    """The :class:`MXArray` ``quantize_mx`` gives for NVFP4 of ``x`` (validated; blocks along
    ``axis``, padded with zeros to ``padded``) by the kernel. CPU only, where :func:`serves`
    and :func:`takes` say. A given tensor scale (traced: its value is known only at run
    time) that is not a positive finite float32 takes ``xla(x)``, XLA's formulation, instead
    (one ``lax.cond``): what that gives for such a scale is its own definition."""
    shape = tuple(x.shape)
    # Codes are piecewise constant in x: zero derivative, as XLA's integer path gives.
    xf = lax.stop_gradient(x).astype(jnp.float32)  # bfloat16/float16: exact
    if padded != shape[axis]:
        widths = [(0, 0)] * xf.ndim
        widths[axis] = (0, padded - shape[axis])
        xf = jnp.pad(xf, widths)

    def kernel(xf, ts):
        words = _words(cast, rng, xf.shape)
        last = axis == xf.ndim - 1
        if not last:  # blocks along the last axis; a transpose is cheap next to the encode
            xf = jnp.moveaxis(xf, axis, -1)
            words = jnp.moveaxis(words, axis, -1) if cast.stochastic else words
        n = xf.shape[-1]
        out = (jax.ShapeDtypeStruct((*xf.shape[:-1], n // 2), jnp.uint8),
               jax.ShapeDtypeStruct((*xf.shape[:-1], n // 16), jnp.uint8),
               jax.ShapeDtypeStruct((), jnp.float32))
        call = jax.ffi.ffi_call(TARGET, out, vmap_method="broadcast_all")
        elements, scales, ts = call(
            xf, jnp.zeros((), jnp.float32) if ts is None else ts, words,
            reciprocal=cast.scale_options.nvfp4_step == "reciprocal",
            stochastic=bool(cast.stochastic), compute_ts=ts is None)
        if not last:
            elements, scales = jnp.moveaxis(elements, -1, axis), jnp.moveaxis(scales, -1, axis)
        return MXArray(elements, scales, cast.fmt, axis, shape, cast.scale_rule, ts)

    if tensor_scale is None:  # computed by the kernel (one read of x; XLA's reduction
        # materialized |x| first): a positive finite float32 by construction
        return kernel(xf, None)
    ts_bits = cast.fmt.scheme.tensor_scale_bits(f32_bits(xf), tensor_scale, cast)
    ts = lax.bitcast_convert_type(ts_bits, jnp.float32)
    # Positive finite float32 patterns are (0, 0x7F800000); the clamp made it at least 2^-143.
    return lax.cond(ts_bits < jnp.uint32(0x7F80_0000), lambda v: kernel(xf, ts),
                    lambda v: xla(v), x)


FAKE_TARGET = "lowprec_nvfp4_fake_quantize"


def fake_quantize(x, cast, axis: int, words=None, tile_amax=None, tensor_scale=None):
    """float32 values of ``dequantize(quantize_mx(x, "nvfp4", ...))`` by the kernel's
    fake-quantize handler (one call: the NVFP4 training recipe's quantizations, whose XLA
    decode alone is ~900 HLO instructions): ``x`` float32, ``axis`` a whole number of blocks,
    the tensor scale computed from x by the kernel as ``quantize_mx`` computes it, ``words``
    the stochastic rounding's (uint16 or uint32, x's shape). ``tile_amax``: instead of each
    block's own maximum, these (uint32 patterns in the blocks' layout along the last axis;
    +inf for a block to decode as NaN): the recipe's 16 x 16 weight tiles. CPU only, where
    :func:`serves` says. ``tensor_scale``: instead, one float32 tensor scale per index of
    x's first axis (``axis`` > 0; positive and finite, clamped as the XLA path clamps a given
    one: the ragged dot's per-group scales)."""
    xf = lax.stop_gradient(x).astype(jnp.float32)
    # The kernel computes the tensor scale (of each vmapped group: this operand's size under
    # vmap gives their number), as quantize_mx does: one pass, no XLA division to compile.
    ts = jnp.zeros((), jnp.float32) if tensor_scale is None else tensor_scale
    if tensor_scale is not None:  # groups of blocks: contiguous once axis is moved last
        assert axis > 0 and tensor_scale.shape == xf.shape[:1], (tensor_scale.shape, xf.shape)
    w = _words(cast, (None, words), xf.shape)
    last = axis == xf.ndim - 1
    if not last:
        xf = jnp.moveaxis(xf, axis, -1)
        w = jnp.moveaxis(w, axis, -1) if cast.stochastic else w
    amax = jnp.zeros((0,), jnp.uint32) if tile_amax is None else tile_amax
    call = jax.ffi.ffi_call(FAKE_TARGET, jax.ShapeDtypeStruct(xf.shape, jnp.float32),
                            vmap_method="broadcast_all")
    values = call(xf, ts, w, amax, reciprocal=cast.scale_options.nvfp4_step == "reciprocal",
                  stochastic=bool(cast.stochastic), given_amax=tile_amax is not None,
                  compute_ts=tensor_scale is None)
    return values if last else jnp.moveaxis(values, -1, axis)


def _check() -> str:
    """'' if the registered handler quantizes a known NVFP4 block as derived here: 15 ones
    and a -0 under tensor scale 1. The block scale is E4M3 of (1 / 6) / 1 = 1.333... x 2^-3,
    nearest 1.375 x 2^-3 (code 0b0_0100_011 = 0x23); each 1 / 0.171875 = 5.82 rounds to 6
    (E2M1 code 7) to nearest, and with the word 2^32 - 1 down to 4 (code 6: 5.82 / 2 =
    2.91 keeps 2 quanta and rounds up only for words below 0.91 x 2^32); -0 is code 8. Two
    codes per byte, element 2k in the low nibble. The block is given 9 times: the first 8
    take the kernel's AVX2 loop (eight blocks a step), the ninth its scalar one."""
    cpu = jax.devices("cpu")[0]
    copies = 9
    x = np.ones(16, np.float32)
    x[-1] = -0.0
    x = np.tile(x, copies)
    ts = np.float32(1.0)
    for stochastic, code in ((False, 7), (True, 6)):
        words = np.full(x.size if stochastic else 0, 0xFFFF_FFFF, np.uint32)
        call = jax.ffi.ffi_call(TARGET, (jax.ShapeDtypeStruct((8 * copies,), jnp.uint8),
                                         jax.ShapeDtypeStruct((copies,), jnp.uint8),
                                         jax.ShapeDtypeStruct((), jnp.float32)))
        el, sc, _ = jax.jit(lambda v, t, w, s=stochastic: call(v, t, w, reciprocal=False,
                                                                stochastic=s, compute_ts=False))(
            *(jax.device_put(a, cpu) for a in (x, ts, words)))
        want = ([code * 0x11] * 7 + [code | 0x80]) * copies
        if np.asarray(el).tolist() != want or np.asarray(sc).tolist() != [0x23] * copies:
            return (f"NVFP4 codes of a known block ({'stochastic' if stochastic else 'nearest'}"
                    ") differ from the derived ones")
    # Fake quantization of the same block: 6 x 0.171875 = 1.03125 (exact), -0 stays -0.
    fake = jax.ffi.ffi_call(FAKE_TARGET, jax.ShapeDtypeStruct(x.shape, jnp.float32))
    v = jax.jit(lambda v, t, w, a: fake(v, t, w, a, reciprocal=False, stochastic=False,
                                        given_amax=False, compute_ts=False))(
        *(jax.device_put(a, cpu) for a in (x, ts, np.zeros(0, np.uint32),
                                           np.zeros(0, np.uint32))))
    want = np.full(16, 1.03125, np.float32)
    want[-1] = -0.0
    want = np.tile(want, copies)
    if np.asarray(v).view(np.uint32).tolist() != want.view(np.uint32).tolist():
        return "NVFP4 fake-quantized values of a known block differ from the derived ones"
    return ""


_cpu_native.register_kernel("NVFP4 quantization", {TARGET: "LowprecNvfp4Quantize",
                                                    FAKE_TARGET: "LowprecNvfp4FakeQuantize"},
                            _check)
