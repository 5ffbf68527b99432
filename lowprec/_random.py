"""The random words of stochastic rounding: a keyed counter hash, one 16-bit word per element.

:func:`random_bits` states the contract (docs/design.md §2); the encoders draw the same words
inside their own computation with :func:`key_words` and :func:`word_complements`, and read
caller-supplied words through :func:`as_word32`.
"""

from __future__ import annotations

import functools
import math

from ._lazy import lazy_module

# Imported on first use: the checkpoint command line's native path needs no JAX.
jax = lazy_module("jax")
jnp = lazy_module("jax.numpy")
lax = lazy_module("jax.lax")


# The generator: word i is the top half of a 32-bit hash of the element index i under the two
# key words (k0, k1). It is the SplitMix construction (Steele, Lea & Flood, "Fast splittable
# pseudorandom number generators", OOPSLA 2014: a mixing function applied to the Weyl sequence
# i·γ + seed) in 32 bits: the Weyl step, one xorshift that also takes k1, then the two
# multiply–xorshift rounds of C. Wellons' lowbias32 (hash-prospector, 2018). Its last
# xorshift (x ^= x >> 16) leaves the top 16 bits alone, so it is left out. Each word costs
# three vector multiplies and no state, so the words are drawn inside the encode that uses
# them, per element (XLA fuses per output element: a generator that serves several elements
# per evaluation only pays off where their codes are packed into one output word, and that
# packing costs more than this hash; see benchmarks/README.md).
WEYL = 0x9E3779B9  # γ: 2^32 / golden ratio, rounded to odd (Knuth's multiplicative hash)
MIX1, MIX2 = 0x7FEB352D, 0x846CA68B  # lowbias32's multipliers
SHIFT0, SHIFT1 = 16, 15  # lowbias32's first two xorshifts
WORD_BITS = 16
WORD_MASK = (1 << WORD_BITS) - 1
_MAX_ELEMENTS = 2**32  # element indices are uint32


def word_hash(k, index):
    """The 32-bit hash of the uint32 element ``index`` under the key words ``k = (k0, k1)``;
    its top 16 bits are the element's word.

    Example:
        >>> import jax.numpy as jnp
        >>> z = jnp.uint32(0)
        >>> hex(int(word_hash((z, z), jnp.uint32(1))))
        '0x1fce4ae'
    """
    k0, k1 = k
    x = index * jnp.uint32(WEYL) + k0
    x = x ^ lax.shift_right_logical(x, jnp.uint32(SHIFT0)) ^ k1
    x = x * jnp.uint32(MIX1)
    x = x ^ lax.shift_right_logical(x, jnp.uint32(SHIFT1))
    return x * jnp.uint32(MIX2)


def key_words(key):
    """The two uint32 words drawn from ``key`` that key the generator: (k0, k1)."""
    k = jax.random.bits(key, (2,), jnp.uint32)
    return k[0], k[1]


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


def element_index(shape):
    """The row-major index of every element of ``shape`` (uint32 array of that shape)."""
    return lax.iota(jnp.uint32, math.prod(shape)).reshape(shape)


def element_words(k, index):
    """The 16-bit word (uint32 0..0xFFFF) of each element ``index`` (uint32 array)."""
    return lax.shift_right_logical(word_hash(k, index), jnp.uint32(WORD_BITS))


def word_complements(k, index):
    """0xFFFF minus the word of each element ``index``: the form the encoders add below the
    cut (rounding away from zero iff it carries); uint32 0..0xFFFF."""
    return lax.shift_right_logical(~word_hash(k, index), jnp.uint32(WORD_BITS))


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

    Word i is the top 16 bits of a 32-bit hash of i (docs/design.md §2): with
    ``k0, k1 = jax.random.bits(key, (2,), jnp.uint32)`` (the only draw from ``key``, so any
    key type works: threefry, rbg, raw ``uint32[2]``), and arithmetic modulo 2^32,
    ``x = i·0x9E3779B9 + k0``, ``x ^= (x >> 16) ^ k1``, ``x *= 0x7FEB352D``,
    ``x ^= x >> 15``, ``x *= 0x846CA68B``, and word i is ``x >> 16``: a Weyl sequence through
    the multiply–xorshift rounds of Wellons' lowbias32 (the SplitMix construction of Steele,
    Lea & Flood, 2014, in 32 bits). Its statistical checks are in tests/test_random_words.py.

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
    return _random_bits_program()(key, check_size(shape))


@functools.cache
def _random_bits_program():
    """random_bits as one jitted program per shape and key type: called eagerly, its ~15
    operations were each a program of its own, compiled for every new shape."""

    def words(key, shape):
        return element_words(key_words(key), element_index(shape)).astype(jnp.uint16)

    return jax.jit(words, static_argnums=1)


def as_word32(words):
    """Caller words as uint32 compared with frac · 2^32: a 16-bit word r is r · 2^16 (the
    same decision as r < frac · 2^16)."""
    if words.dtype == jnp.uint16:
        return lax.shift_left(words.astype(jnp.uint32), jnp.uint32(WORD_BITS))
    return words.astype(jnp.uint32)
