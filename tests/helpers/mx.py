"""Shared helpers for the MX tests: names, input strategies, independent unpacking, diffs.

Nothing here calls lowprec's packing or codec code: FP4 nibbles are split with NumPy from
the published layout (element 2k in the low nibble, 2k+1 in the high nibble), so a packing
bug cannot hide a quantization bug or the other way round.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from hypothesis import strategies as st

import lowprec

from .asserts import bit_pattern
from .codecs import reference_words, replay_random_bits

MX_FORMATS = ("mxfp8_e4m3", "mxfp8_e5m2", "mxfp4")
#: The other E8M0-scaled block formats: MXFP6 (E2M3, E3M2) and MXINT8 (tests/test_mx_formats.py).
NEW_MX_FORMATS = ("mxfp6_e2m3", "mxfp6_e3m2", "mxint8")
SCALE_RULES = ("floor", "ceil", "even", "rceil", "even_e2m1", "floor_log2f")
ROUNDINGS = ("nearest_even", "nearest_away", "nearest_toward_zero", "toward_zero", "up", "down",
             "stochastic")
MODES = ("eager", "jit")
BLOCK = 32
ELEMENT = {"mxfp8_e4m3": "e4m3", "mxfp8_e5m2": "e5m2", "mxfp4": "e2m1"}

F32_MAX_BITS = 0x7F7F_FFFF
POS_INF_BITS = 0x7F80_0000
NAN_BITS = 0x7FC0_0000


def f32(bits) -> np.ndarray:
    """float32 array from uint32 bit patterns."""
    return np.asarray(bits, np.uint32).view(np.float32)


# -- independent FP4 unpacking --------------------------------------------------------------


def unpack_nibbles(packed, axis: int) -> np.ndarray:
    """uint8 bytes -> codes 0..15 along ``axis``: low nibble first (the OCP / gpt-oss layout)."""
    p = np.moveaxis(np.asarray(packed, np.uint8), axis, -1)
    codes = np.stack([p & 0x0F, p >> 4], axis=-1).reshape(*p.shape[:-1], 2 * p.shape[-1])
    return np.moveaxis(codes, -1, axis)


def element_codes(mx) -> np.ndarray:
    """Element codes of an MXArray, one uint8 per element (FP4 unpacked with NumPy, FP6 with
    the reference's bit-stream unpacker)."""
    e = np.asarray(mx.elements)
    bits = mx.fmt.element.code_bits
    if bits == 4:
        e = unpack_nibbles(e, mx.axis)
    elif bits == 6:
        import lowprec_reference

        e = lowprec_reference.unpack_codes(e, 6, mx.axis)
    return e


# -- running lowprec eagerly or under jit ----------------------------------------------------


@functools.lru_cache(maxsize=None)
def jitted_quantize(fmt, axis, scale_rule, rounding, pad=False):
    """One cached jax.jit(quantize_mx) per static configuration (compiles once per shape)."""

    def f(x, key):
        return lowprec.quantize_mx(
            x, fmt, axis=axis, scale_rule=scale_rule, rounding=rounding, pad=pad, key=key
        )

    return jax.jit(f)


def run_quantize(mode, x, fmt, *, axis=-1, scale_rule="floor", rounding="nearest_even",
                 pad=False, key=None):
    if mode == "eager":
        return lowprec.quantize_mx(
            x, fmt, axis=axis, scale_rule=scale_rule, rounding=rounding, pad=pad, key=key
        )
    return jitted_quantize(fmt, axis, scale_rule, rounding, pad)(x, key)


def random_bits(key, padded_shape) -> np.ndarray:
    """The words lowprec's stochastic rounding consumes (documented contract), replayed by the
    NumPy reference from the two words lowprec draws from ``key``, in the reference's 32-bit
    form (a 16-bit word r as r · 2^16: the same decision)."""
    return reference_words(replay_random_bits(key, tuple(padded_shape)))


# -- input strategies ------------------------------------------------------------------------

# Values that must show up: zeros of both signs, float32 subnormals (2^-130, the smallest),
# infinities, NaN, the largest floats, exact powers of two and values just below them.
SPECIALS = (
    0x0000_0000,  # +0
    0x8000_0000,  # -0
    0x0008_0000,  # 2^-130 = 2^19 * 2^-149 (subnormal)
    0x8008_0000,  # -2^-130
    0x0020_0000,  # 2^-128
    0x0000_0001,  # 2^-149
    0x007F_FFFF,  # largest subnormal
    0x0080_0000,  # 2^-126
    POS_INF_BITS,  # +inf
    0xFF80_0000,  # -inf
    NAN_BITS,  # NaN
    0xFFC0_0001,  # -NaN with payload
    F32_MAX_BITS,  # float32 max
    0xFF7F_FFFF,  # -float32 max
    0x7F00_0000,  # 2^127
    0x3F80_0000,  # 1.0
    0x3F7F_FFFF,  # 1 - 2^-24 (a few ulp below a power of two)
)
INTERESTING_EXPONENTS = (-149, -140, -135, -133, -130, -128, -127, -126, -125, -120, -117,
                         -110, -1, 0, 1, 2, 8, 15, 16, 100, 118, 119, 120, 125, 126, 127)


def _element_bits(rng, n, top_exp, spread, mant_bits, zero_frac):
    """uint32 float32 patterns: magnitude 2^(top_exp - offset) * (1 + m), random signs."""
    offsets = rng.integers(0, spread + 1, n) if spread else np.zeros(n, np.int64)
    e = top_exp - offsets
    if mant_bits >= 23:
        mant = rng.integers(0, 1 << 23, n, dtype=np.int64)
    elif mant_bits == 0:
        mant = np.zeros(n, np.int64)
    else:
        mant = rng.integers(0, 1 << mant_bits, n, dtype=np.int64) << (23 - mant_bits)
    sig = mant | (1 << 23)
    e = np.minimum(e, 127)
    field = e + 127
    normal = (field << 23) | mant
    # Below 2^-126: shift the significand into the subnormal field (truncating; any float32
    # is a valid input, the point is to land in the subnormal range).
    shift = np.clip(1 - field, 0, 40)
    sub = np.where(shift < 24, sig >> np.minimum(shift, 23), 0)
    mag = np.where(field >= 1, normal, sub)
    sign = rng.integers(0, 2, n, dtype=np.int64) << 31
    out = (mag | sign).astype(np.uint32)
    if zero_frac:
        out[rng.random(n) < zero_frac] = 0
    return out


@st.composite
def block_bits(draw, nblocks, min_exp=-149, max_exp=127, specials=True, max_spread=40):
    """uint32 float32 bit patterns [nblocks, 32], one random magnitude scale per block.

    Each block has its own top exponent (often one of INTERESTING_EXPONENTS), a spread of
    element exponents below it (0 = all in one binade, so maxima near element overflow and
    ties are common), and either full 23-bit mantissas or only a few leading mantissa bits
    (which puts many elements exactly on, or half-way between, element grid points).
    """
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    rows = []
    exps = [e for e in INTERESTING_EXPONENTS if min_exp <= e <= max_exp]
    for _ in range(nblocks):
        top = draw(st.one_of(st.sampled_from(exps), st.integers(min_exp, max_exp)))
        spread = draw(st.sampled_from([s for s in (0, 1, 2, 4, 8, 24, 40) if s <= max_spread]))
        mant_bits = draw(st.sampled_from([0, 1, 2, 3, 4, 5, 6, 23, 23]))
        zero_frac = draw(st.sampled_from([0.0, 0.0, 0.25]))
        rows.append(_element_bits(rng, BLOCK, top, spread, mant_bits, zero_frac))
    out = np.stack(rows)
    if specials:
        picks = draw(
            st.lists(
                st.tuples(st.integers(0, out.size - 1), st.sampled_from(SPECIALS)), max_size=3
            )
        )
        flat = out.reshape(-1)
        for i, b in picks:
            flat[i] = b
    return out


@st.composite
def mx_inputs(draw, shape, axis, dtype=np.float32, **kw):
    """An array of ``shape`` (blocks of 32 along ``axis``) built from :func:`block_bits`."""
    axis = axis % len(shape)
    moved = tuple(s for i, s in enumerate(shape) if i != axis) + (shape[axis],)
    nblocks = int(np.prod(moved)) // BLOCK
    bits = draw(block_bits(nblocks, **kw)).reshape(moved)
    x = np.moveaxis(f32(bits), -1, axis)
    if np.dtype(dtype) == np.dtype(ml_dtypes.bfloat16):
        # Truncate to the top 16 bits: every bfloat16 pattern reachable, no new infinities.
        b16 = (bit_pattern(np.ascontiguousarray(x)) >> 16).astype(np.uint16)
        x = b16.view(ml_dtypes.bfloat16)
    return np.ascontiguousarray(x)


def as_float32(x) -> np.ndarray:
    """float32 copy of a float32 / bfloat16 array (exact)."""
    x = np.asarray(x)
    if x.dtype == np.float32:
        return x
    assert x.dtype == np.dtype(ml_dtypes.bfloat16), x.dtype
    return (bit_pattern(x).astype(np.uint32) << 16).view(np.float32)


def f64_to_f32_exact(v) -> np.ndarray:
    """float64 -> float32, asserting the conversion is exact (NaN and ±inf pass through)."""
    v = np.asarray(v, np.float64)
    with np.errstate(over="ignore"):
        out = v.astype(np.float32)
    finite = np.isfinite(v) & np.isfinite(out)
    assert np.array_equal(out[finite].astype(np.float64), v[finite]), "value not a float32"
    return out
