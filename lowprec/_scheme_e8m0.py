"""The OCP MX scale scheme: one E8M0 scale per block, the block's shared exponent.

OCP MX v1.0 §5.2: the value of element i is X × P_i with X = 2^(scale_code − 127) (§5.4.1:
E8M0, no sign, no mantissa, code 0xFF = NaN). A :class:`~lowprec.ScaleRule` picks the shared
exponent from the block's largest magnitude, read from exact float32 bits
(``_scale_rules.py``); elements are encoded from V_i × 2^-shared_exp by moving exponents in
integer arithmetic (never a float division), saturating. Decoding builds every value from its
bits, or, where it is exact, multiplies the element value by the float32 2^(s − 127) once
(docs/design.md §3, §5).
"""

from __future__ import annotations

import dataclasses


from ._bits import (
    BF16_MANT_BITS,
    E8M0_BIAS,
    E8M0_NAN,
    F32_BIAS,
    F32_EMAX,
    F32_EMIN,
    F32_EXP_MAX,
    F32_MANT_BITS,
    bits_to_f32,
    scale_bits_by_e8m0,
)
from ._format import ElementFormat
from ._lazy import lazy_module
from ._mx_hwfloat import half_quantum_exponent
from ._scale_rules import DEFAULT_SCALE_RULE, ScaleRule, check_scale_rule, scale_codes_of_amax
from ._scheme import FastDecoder, FastEncoder, ScaleScheme, register

# Imported on first use: the checkpoint command line's native path needs no JAX.
jnp = lazy_module("jax.numpy")
lax = lazy_module("jax.lax")


@dataclasses.dataclass(frozen=True)
class E8M0Options:
    """The options of an E8M0 cast: the :class:`~lowprec.ScaleRule` that picks each block's
    shared exponent (``scale_rule=``; default ``"floor"``, OCP MX v1.0 §6.3).

    Example:
        >>> E8M0Options("rceil")
        E8M0Options(scale_rule=<ScaleRule.RCEIL: 'rceil'>)
    """

    scale_rule: ScaleRule = DEFAULT_SCALE_RULE

    def __post_init__(self):
        object.__setattr__(self, "scale_rule", check_scale_rule(self.scale_rule))


@register("e8m0")
class E8M0Scheme(ScaleScheme):
    """E8M0 block scales, 2^(code − 127), chosen by a scale rule (default ``"floor"``).

    Example:
        >>> import lowprec
        >>> s = lowprec.scale_scheme("e8m0")
        >>> s.option_names(), s.tensor_scale, s.Options()
        (('scale_rule',), False, E8M0Options(scale_rule=<ScaleRule.FLOOR: 'floor'>))
    """

    Options = E8M0Options
    exponent_scales = True
    recipe = "a scale rule (the shared exponent of the block maximum)"

    def check_scale(self) -> None:
        sc = self.scale
        e8m0 = (sc.sign_bits == 0 and not sc.zero and sc.exponent_bits == 8
                and sc.mantissa_bits == 0 and sc.bias == E8M0_BIAS and sc.nan_code == E8M0_NAN)
        if not e8m0:
            raise ValueError(
                f"scale scheme {self.name!r} stores E8M0 scale codes (2^(code - 127), 0xFF = "
                f"NaN), got the scale format {getattr(sc, 'name', sc)!r}; a scale of another "
                "format needs its own scheme (E4M3 block scales: 'nvfp4', under a tensor scale)"
            )

    def check_element(self, element: ElementFormat, fmt_name: str) -> None:
        if not (element.signed and element.zero):
            raise ValueError(
                f"{fmt_name}: E8M0-scaled blocks hold signed elements with a zero (OCP MX "
                f"v1.0 §5.3: FP8, FP6, FP4, INT8), got {element.name}")

    # -- encode ----------------------------------------------------------------------------

    def encode_blocks(self, xb, amax, ts_bits, cast, inner: int):
        codes, special = scale_codes_of_amax(amax, cast.fmt, cast.scale_options.scale_rule)
        return codes, special, xb, jnp.expand_dims(codes - E8M0_BIAS, inner)

    def exponents_of_amax(self, amax, cast):
        codes, _ = scale_codes_of_amax(amax, cast.fmt, cast.scale_options.scale_rule)
        return codes - E8M0_BIAS

    def fast_encoder(self):
        return _HWFLOAT_ENCODER

    # -- decode ----------------------------------------------------------------------------

    def decode_values(self, value_bits, scale_codes, tensor_scale):
        return scale_bits_by_e8m0(value_bits, scale_codes)

    def fast_decoder(self):
        return _FAST_DECODER

    # -- analysis --------------------------------------------------------------------------

    def element_scale(self, scale_codes, tensor_scale):
        return scale_codes.astype(jnp.int32) - E8M0_BIAS


class _E8M0HwFloat(FastEncoder):
    """E8M0's hardware-float encode (:class:`~lowprec._scheme.FastEncoder`)."""

    # The hardware-float path: |x| times the float32 2^-s of the block's shared exponent s, one
    # multiply. The product of a float32 with a power of two is exact whenever it is normal;
    # it is below 2^-126 only for elements that round to 0 anyway. What a backend that flushes
    # subnormal operands gets wrong is a subnormal x in a block whose scale lifts it to an
    # element's range: x < 2^-126 stays at most half the element's smallest subnormal
    # 2^(emin - M) when 2^(-126 - s) <= 2^(emin - M - 1), i.e. s >= -125 - emin + M (-116 for
    # E4M3). Blocks with a smaller s (block maxima below ~2^-108) and s = 127 (2^-127 is
    # subnormal; INT8 blocks near float32's top) send the array to the exact path; all-zero
    # blocks (s = -127) have no subnormal to lift.

    def scales(self, amax, ts_bits, cast):
        codes, _ = scale_codes_of_amax(amax, cast.fmt, cast.scale_options.scale_rule)
        # Materialized once as bytes (the output), then read by the check below and by the
        # element loop: XLA would otherwise recompute the scale rule in each.
        codes = lax.optimization_barrier(codes.astype(jnp.uint8))
        s = codes.astype(jnp.int32) - E8M0_BIAS
        s_min = F32_EMIN - half_quantum_exponent(cast.fmt.element)
        outside = (codes != E8M0_NAN) & (amax != 0) & ((s < s_min) | (s > F32_EMAX - 1))
        # A max over bytes: XLA:CPU's fastest reduction to a scalar here.
        return codes, jnp.max(outside.astype(jnp.uint8)) == 0

    def operands(self, scale_codes, ts_bits, cast):
        # 2^-s from the code's bits (exponent field 127 - s = 254 - code), a few integer
        # operations that XLA computes in the element loop.
        field = jnp.clip(2 * E8M0_BIAS - scale_codes.astype(jnp.int32), 1, F32_EXP_MAX - 1)
        factor = bits_to_f32(lax.shift_left(field.astype(jnp.uint32), jnp.uint32(F32_MANT_BITS)))
        return scale_codes == E8M0_NAN, factor

    def quotients(self, magnitudes, operand, x_bits, cast):
        return magnitudes * operand


_HWFLOAT_ENCODER = _E8M0HwFloat()


class _E8M0FastDecoder(FastDecoder):
    """E8M0's faster decodes (:class:`~lowprec._scheme.FastDecoder`): bfloat16/float32 output
    bits moved by the scale directly, and the one-multiply decode."""

    def narrow(self, value_bits, scale_codes, element: ElementFormat, out_bits: int):
        # bfloat16 holds every normal result of elements of at most 8 significant bits.
        if out_bits == 16 and element.mantissa_bits > BF16_MANT_BITS:
            return None
        return scale_bits_by_e8m0(value_bits, scale_codes, out_bits)

    # The fast decode: element value (float32, exact) times the block's scale 2^(s - 127), a
    # float32 built from the code's bits, in one float multiply. The product of a value with
    # at most 24 significant bits and a power of two is exact whenever it is a float32 normal,
    # and overflows to inf exactly as the bit-built path does. What it cannot do on every
    # backend is a subnormal result (XLA on CPU flushes them, docs/design.md §8), so it is
    # used only where no block can produce one (see scale_min).

    def one_multiply(self, element: ElementFormat) -> bool:
        """Elements of at most 8 bits whose every nonzero value is a float32 normal (so no
        operand of the multiply can be flushed)."""
        lowest = element.emin - (element.mantissa_bits if element.subnormals else 0)
        return element.code_bits <= 8 and element.mantissa_bits < F32_MANT_BITS and lowest >= -126

    def scale_min(self, element: ElementFormat) -> int:
        """The smallest scale code at which even the element's smallest nonzero magnitude,
        2^(emin - M) (2^emin without subnormals), times 2^(s - 127) is at least 2^-126, a
        float32 (and bfloat16) normal: s >= 1 - (emin - M). 10 for E4M3, 17 for E5M2, 2 for
        E2M1."""
        lowest = element.emin - (element.mantissa_bits if element.subnormals else 0)
        return max(1, 1 - lowest)

    def scale_factors(self, scale_codes):
        """float32 2^(s - 127) of E8M0 codes, from the bits: the exponent field is ``s``; code
        0 gives the subnormal 2^-127 (0 where the backend flushes subnormals: only all-zero
        blocks use it on the fast path) and 0xFF a quiet NaN."""
        s = scale_codes.astype(jnp.uint32)
        low = jnp.where((s == 0) | (s == E8M0_NAN), jnp.uint32(1 << 22), jnp.uint32(0))
        return bits_to_f32(lax.shift_left(s, jnp.uint32(F32_MANT_BITS)) | low)


_FAST_DECODER = _E8M0FastDecoder()
