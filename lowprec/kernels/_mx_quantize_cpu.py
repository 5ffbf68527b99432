"""The native CPU kernel for one-pass MX quantization (``_mx_quantize_cpu.cc``): which calls
it serves, the format as integers, and its call.

XLA:CPU compiles ``quantize_mx`` to a block-max reduction and an encode that reads x again
(it fuses no reduction into its consumer), and FP6 adds a packing pass: about 2x the bytes
of one pass. The C++ loop reads each block once, computing the block's scale by the same
rule and each element by the same exact rounding as ``_mx_encode.encode_blocks`` (integers
only), and writes packed codes and scales: the same bits, checked against the XLA path by
``tests/test_native_mx_quantize.py``. Loading: ``_cpu_native.py``; the check
before first use: :func:`_check` here.
"""

from __future__ import annotations

import functools

import numpy as np

from .._bits import F32_MANT_BITS
from .._format import MXFormat, mx_format
from .._lazy import lazy_module
from .._mx_hwfloat import hwfloat_element
from .._scale_rules import ScaleRule, even_fraction_bits, rceil_constants
from . import _cpu_native

# Imported on first use: the checkpoint command line's native path needs no JAX.
jax = lazy_module("jax")
jnp = lazy_module("jax.numpy")
lax = lazy_module("jax.lax")

TARGET = "lowprec_mx_quantize"

# The kernel's rule numbers. EVEN_E2M1 is its EVEN with E2M1's one fraction bit
# (``even_drop``). FLOOR_LOG2F stays on XLA's path: ggml's rule goes with ggml's element
# ties (rounding="nearest_toward_zero"), which the kernel (nearest even) does not round.
_RULES = {ScaleRule.FLOOR: 0, ScaleRule.CEIL: 1, ScaleRule.EVEN: 2, ScaleRule.RCEIL: 3,
          ScaleRule.EVEN_E2M1: 2}
_MAX_BLOCK = 256  # the kernel's per-block buffer


def computes(fmt, rounding: str = "nearest_even") -> bool:
    """Whether the kernel computes MX quantization of ``fmt`` (static): E8M0-scaled blocks
    (every OCP MX format; no tensor scale) of 4 to 256 elements, a sign-magnitude or MX INT8
    element that the native encode serves (``_mx_hwfloat.hwfloat_element``: FP8, FP6, FP4,
    INT8), round to nearest even."""
    el = fmt.element
    scheme = fmt.scheme
    # What the kernel computes for a block scale: the E8M0 code of the shared exponent the
    # cast's ScaleRule picks, with no tensor scale; the scheme says whether that is its scale.
    ocp_scales = (scheme.takes("scale_rule") and scheme.exponent_scales and not scheme.tensor_scale
                  and scheme.scale.name == "e8m0")
    return (ocp_scales and rounding == "nearest_even" and hwfloat_element(el)
            and el.code_bits in (4, 6, 8)
            # its two's-complement encode writes 8-bit codes (INT8) only, not INT4's nibbles
            and (el.encoding != "twos_complement" or el.code_bits == 8)
            and el.bias == 1 - el.emin  # the kernel's fast encode derives the bias so
            and fmt.block_size % 4 == 0 and 4 <= fmt.block_size <= _MAX_BLOCK)


def takes_rule(scale_rule) -> bool:
    """Whether the kernel computes block scales by ``scale_rule`` (a :class:`ScaleRule`)."""
    return scale_rule in _RULES


def serves(cast) -> bool:
    """Whether ``quantize_mx`` takes the kernel for this cast (static): one it
    :func:`computes`, with the OCP MX block of 32, on a CPU with AVX2 (elsewhere its
    portable loop is no faster than XLA's program, measured)."""
    return (computes(cast.fmt, cast.rounding) and cast.scale_rule in _RULES
            and cast.fmt.block_size == 32 and _cpu_native.vector_quantizer())


@functools.lru_cache(maxsize=None)
def attributes(fmt, scale_rule) -> tuple[tuple[str, object], ...]:
    """The kernel's FFI attributes for an MX format (or its name) and a scale rule: the
    integers the element encode and the scale rule read, derived from the format."""
    fmt = fmt if isinstance(fmt, MXFormat) else mx_format(fmt)
    el = fmt.element
    rule = ScaleRule(scale_rule)
    k, mant, small, thr = rceil_constants(el.max_finite_exact)
    return (
        ("mantissa_bits", el.mantissa_bits),
        ("emin", el.emin),
        ("emax_elem", fmt.emax_elem),
        ("max_code", el.max_magnitude_code),
        ("code_bits", el.code_bits),
        ("twos_complement", el.encoding == "twos_complement"),
        ("rule", _RULES[rule]),
        ("block", fmt.block_size),
        # EVEN rounds amax to the element's precision in its top binade, EVEN_E2M1 to one
        # fraction bit (_scale_rules.py); the other rules ignore it.
        ("even_drop", F32_MANT_BITS - even_fraction_bits(
            fmt, rule if rule in (ScaleRule.EVEN, ScaleRule.EVEN_E2M1) else ScaleRule.EVEN)),
        ("rceil_k", k),
        ("rceil_mant", mant),
        ("rceil_small", small),
        ("rceil_thr", thr),
    )


def quantize_last(x, attrs):
    """``(elements, scales)``: uint8 codes (packed) and E8M0 scale codes of the float32 array
    ``x`` blocked along the last axis (a whole number of blocks), by the kernel with the
    :func:`attributes` ``attrs``. CPU only, where ``_cpu_native.available``."""
    a = dict(attrs)
    n = x.shape[-1]
    out = (jax.ShapeDtypeStruct((*x.shape[:-1], n * a["code_bits"] // 8), jnp.uint8),
           jax.ShapeDtypeStruct((*x.shape[:-1], n // a["block"]), jnp.uint8))
    # The handler binds int64 attributes and one bool.
    kw = {k: v if isinstance(v, bool) else np.int64(v) for k, v in attrs}
    call = jax.ffi.ffi_call(TARGET, out, vmap_method="broadcast_all")
    # Codes are piecewise constant in x: zero derivative, as XLA's integer path gives (the
    # custom call has no differentiation rule; a stopped gradient needs none).
    return call(lax.stop_gradient(x), **kw)


def _check() -> str:
    """'' if the registered handler quantizes a known MXFP8 block as derived here: E4M3,
    floor rule, 31 ones and a -0. amax 1 = 2^0 gives the shared exponent 0 - 8 (E4M3's
    largest binade), code 127 - 8 = 119; 1 x 2^8 is E4M3's exponent field 8 + 7 = 15, code
    0x78; -0 keeps its sign, 0x80."""
    cpu = jax.devices("cpu")[0]
    x = np.ones(32, np.float32)
    x[-1] = -0.0
    want = np.full(32, 0x78, np.uint8)
    want[-1] = 0x80
    el, sc = jax.jit(lambda v: quantize_last(v, attributes("mxfp8_e4m3", "floor")))(
        jax.device_put(x, cpu))
    if not (np.array_equal(np.asarray(el), want) and np.asarray(sc).tolist() == [119]):
        return "MXFP8 codes of a known block differ from the derived ones"
    return ""


_cpu_native.register_kernel("MX quantization", {TARGET: "LowprecMxQuantize"}, _check)
