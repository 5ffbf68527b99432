"""The random words of stochastic rounding: Philox2x32-10, keyed from a JAX PRNG key.

:func:`random_bits` states the contract (docs/design.md §2: one 16-bit word per element); the
encoders draw the same words inside their own computation with :func:`key_words`,
:func:`hash_words` and :func:`element_words`, and read caller-supplied words through
:func:`as_word32`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

# Philox2x32-10 (Salmon, Moraes, Dror, Shaw: "Parallel random numbers: as easy as 1, 2, 3",
# SC 2011; the Random123 library): a counter-based generator, so word i is a pure function of
# (key, i) and one evaluation per element fuses into the encode that consumes it. On CPU this
# costs about a tenth of what jax.random.bits' default threefry does there (threefry runs as
# a rolled XLA loop on CPU). One round maps the counter (x0, x1) and key k to
# (hi(M·x0) ^ x1 ^ k, lo(M·x0)), and the key grows by W between rounds; constants from
# Random123's philox.h.
PHILOX_M2x32 = 0xD256D193  # the round multiplier
PHILOX_W32 = 0x9E3779B9  # the key increment, 2^32 / golden ratio rounded to odd
PHILOX_ROUNDS = 10


def mulhi(a, m: int):
    """High 32 bits of the 64-bit product of uint32 ``a`` and the constant ``m``.

    ``lax.mulhi`` where it works: on CPU it is one vector multiply-high, and the whole
    stochastic encode runs 1.8x faster with it than with the 16-bit schoolbook product
    (e4m3: 1,170 vs 640 Melem/s). JAX versions without it, and processes with several
    devices (its lowering fails on partitioned arrays in JAX 0.10), take
    :func:`mulhi_halves`; both give the same bits (tests/test_fast_paths.py).
    """
    if _lax_mulhi_lowers(a):
        return lax.mulhi(a, lax.full_like(a, m))
    return mulhi_halves(a, m)


def _lax_mulhi_lowers(a) -> bool:
    """Whether ``lax.mulhi`` exists and ``a`` cannot be partitioned: one device in the
    process and no Explicit/Manual mesh axes (static)."""
    if not hasattr(lax, "mulhi"):
        return False
    # XLA's partitioner cannot lower chlo.mulhi in JAX 0.10 (MHLO→StableHLO fails on the
    # sharded op), and a traced array on Auto axes shows no mesh at trace time: with more
    # than one device in the process the array may be partitioned, so take the halves.
    if jax.device_count() > 1:
        return False
    try:
        types = tuple(jax.typeof(a).sharding.mesh.axis_types)
    except AttributeError:  # a JAX without typed shardings: no explicit axes either
        return True
    return all(t == jax.sharding.AxisType.Auto for t in types)


def mulhi_halves(a, m: int):
    """:func:`mulhi` as the schoolbook product of 16-bit halves, every partial sum within
    32 bits."""
    mask = jnp.uint32(0xFFFF)
    a_lo, a_hi = a & mask, lax.shift_right_logical(a, jnp.uint32(16))
    m_lo, m_hi = jnp.uint32(m & 0xFFFF), jnp.uint32(m >> 16)
    mid = a_hi * m_lo + lax.shift_right_logical(a_lo * m_lo, jnp.uint32(16))
    mid2 = a_lo * m_hi + (mid & mask)
    return (
        a_hi * m_hi + lax.shift_right_logical(mid, jnp.uint32(16))
        + lax.shift_right_logical(mid2, jnp.uint32(16))
    )


def philox2x32(key, x0, x1):
    """Philox2x32-10 of the counters ``(x0, x1)`` under the 32-bit ``key`` (uint32 arrays,
    broadcast together); returns the two output words.

    Example:
        >>> import jax.numpy as jnp
        >>> z = jnp.uint32(0)
        >>> [hex(int(w)) for w in philox2x32(z, z, z)]  # Random123's known-answer test
        ['0xff1dae59', '0x6cd10df2']
    """
    key, x0, x1 = (jnp.asarray(v, jnp.uint32) for v in (key, x0, x1))
    x0, x1 = jnp.broadcast_arrays(x0, x1)
    for r in range(PHILOX_ROUNDS):
        if r:
            key = key + jnp.uint32(PHILOX_W32)
        lo = x0 * jnp.uint32(PHILOX_M2x32)
        x0, x1 = mulhi(x0, PHILOX_M2x32) ^ x1 ^ key, lo
    return x0, x1


# The contract (docs/design.md §2): with key=, element i (row-major) gets the 16-bit word
#     r_i = bits 16·(i mod 4) .. 16·(i mod 4) + 15 of  out0 | out1 << 32,
#     (out0, out1) = philox2x32(k0, k1, ⌊i / 4⌋),   (k0, k1) = jax.random.bits(key, (2,), uint32),
# and rounds away from zero iff r_i < frac_i · 2^16. One Philox evaluation serves four
# elements; encoders that write codes of at most 16 bits compute it once per four (or two)
# elements by packing the codes of neighbouring elements into one uint32 (see
# ``_encode_stochastic.encode_stochastic``), which is what makes key= fast. Caller-supplied 32-bit
# words use the same rule with 2^32.
WORD_BITS = 16
WORDS_PER_HASH = 4  # 64 output bits of Philox2x32 / 16
_MAX_ELEMENTS = 2**32  # element indices are uint32


def key_words(key):
    """The two uint32 words drawn from ``key`` that key the generator: (k0, k1)."""
    k = jax.random.bits(key, (2,), jnp.uint32)
    return k[0], k[1]


def hash_words(k, group):
    """Philox2x32 output (out0, out1) for the uint32 group indices ``group``: the words of
    elements 4·group .. 4·group + 3 (16 bits each, lowest first)."""
    k0, k1 = k
    return philox2x32(k0, k1, group)


def check_size(shape) -> tuple:
    """``shape`` as a tuple of ints if its elements can be numbered by uint32 counters (at
    most 2^32 of them); a ValueError that says how to split the array otherwise."""
    shape = tuple(int(d) for d in shape)
    n = math.prod(shape)
    if n > _MAX_ELEMENTS:
        raise ValueError(
            f"stochastic rounding draws at most 2**32 random words per call, but the array "
            f"has {n} elements (shape {shape}); round it in slices, with a key for each"
        )
    return shape


def element_words(k, index):
    """The 16-bit word (as uint32 0..0xFFFF) of each element flat ``index`` (uint32 array)."""
    out0, out1 = hash_words(k, lax.shift_right_logical(index, jnp.uint32(2)))
    word = jnp.where((index & 2) != 0, out1, out0)
    return jnp.where((index & 1) != 0, lax.shift_right_logical(word, jnp.uint32(16)),
                     word & jnp.uint32(0xFFFF))


def random_bits(key, shape) -> jax.Array:
    """The uint16 words that stochastic rounding with ``key`` uses for an array of ``shape``.

    ``encode``/``quantize``/``quantize_mx``/``fake_quantize_mx`` with
    ``rounding="stochastic", key=key`` round element i (row-major; the padded shape for MX
    with ``pad=True``) away from zero iff ``random_bits(key, shape)[i] < frac_i * 2**16``,
    frac_i being its distance from the value toward zero in units of the gap: it rounds up
    with probability ⌈frac_i·2^16⌉/2^16, which is frac_i exactly when frac_i is a multiple
    of 2^-16 (every float32 input to bf16 and fp16 outside their subnormal range) and
    exceeds it by less than 2^-16 otherwise, so E[q(x)] − x lies in [0, 2^-16·gap) away
    from zero. Passing ``random_bits=random_bits(key, shape)`` instead of ``key`` gives the
    same result; your own 32-bit words (``random_bits=`` a uint32 array) use 2^32 instead.

    Word i is 16 bits of Philox2x32-10 (Salmon et al., SC 2011; Random123): with
    ``k0, k1 = jax.random.bits(key, (2,), jnp.uint32)`` (the only draw from ``key``, so any
    key type works: threefry, rbg, raw ``uint32[2]``), ``(out0, out1) = philox2x32(k0, k1,
    i // 4)`` and word i is 16-bit chunk ``i % 4`` of ``out0 | out1 << 32``, lowest first.

    Args:
      key: a JAX PRNG key (typed or raw).
      shape: the array shape.

    Returns:
      uint16 array of ``shape``.

    Example:
        >>> import jax
        >>> w = random_bits(jax.random.key(0), (2, 3))
        >>> w.shape, w.dtype.name
        ((2, 3), 'uint16')
    """
    shape = check_size(shape)
    n = math.prod(shape)
    words = element_words(key_words(key), lax.iota(jnp.uint32, n))
    return words.astype(jnp.uint16).reshape(shape)


def as_word32(words):
    """Caller words as uint32 compared with frac · 2^32: a 16-bit word r is r · 2^16 (the
    same decision as r < frac · 2^16)."""
    if words.dtype == jnp.uint16:
        return lax.shift_left(words.astype(jnp.uint32), jnp.uint32(16))
    return words.astype(jnp.uint32)
