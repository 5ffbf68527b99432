"""The random words of lowprec's stochastic rounding, recomputed in plain Python integers.

lowprec rounds element i of an array away from zero iff its 16-bit word r_i is below
frac_i · 2^16 (the reference encoders take 32-bit words and 2^32: pass r_i · 2^16, which
decides identically). With ``key=``, word i is the top 16 bits of a 32-bit hash of the
element index i, keyed by two uint32 words (k0, k1) drawn once from the caller's JAX key.
Given (k0, k1), :func:`random_bits` here replays the words, so :func:`lowprec_reference.encode`
and :func:`lowprec_reference.quantize_mx` can be handed exactly what lowprec consumed.

The hash, arithmetic modulo 2^32 (docs/design.md §2)::

    x = i · 0x9E3779B9 + k0        the Weyl sequence of SplitMix (Steele, Lea & Flood, 2014)
    x = x ⊕ (x >> 16) ⊕ k1
    x = x · 0x7FEB352D             the multiply–xorshift rounds of C. Wellons' lowbias32
    x = x ⊕ (x >> 15)
    x = x · 0x846CA68B
    r_i = x >> 16

Example:
    >>> hex(word_hash(0, 0, 1))
    '0x1fce4ae'
"""

from __future__ import annotations

import math

import numpy as np

WEYL = 0x9E3779B9
MIX1 = 0x7FEB352D
MIX2 = 0x846CA68B
_MASK32 = 0xFFFF_FFFF


def word_hash(k0, k1, i):
    """The 32-bit hash of element index ``i`` under key words ``(k0, k1)``.

    ``i`` is an int or an integer array (uint64 arithmetic, reduced modulo 2^32 after every
    step); returns an int or a uint64 array.
    """
    m = np.uint64(_MASK32)
    scalar = np.isscalar(i)
    x = np.asarray(i, np.uint64) & m
    x = (x * np.uint64(WEYL) + np.uint64(int(k0) & _MASK32)) & m
    x = x ^ (x >> np.uint64(16)) ^ np.uint64(int(k1) & _MASK32)
    x = (x * np.uint64(MIX1)) & m  # < 2^64: the product of two 32-bit numbers is exact
    x = x ^ (x >> np.uint64(15))
    x = (x * np.uint64(MIX2)) & m
    return int(x) if scalar else x


def random_bits(key_words, shape) -> np.ndarray:
    """The uint16 words lowprec's stochastic rounding uses for an array of ``shape``.

    Args:
      key_words: the two uint32 words (k0, k1) lowprec draws from the caller's key,
        ``jax.random.bits(key, (2,), jnp.uint32)``.
      shape: the array shape (for MX, the padded shape).

    Returns:
      uint16 array of ``shape``: word i (row-major) is ``word_hash(k0, k1, i) >> 16``.
    """
    k0, k1 = (int(w) for w in np.asarray(key_words, np.uint32).reshape(2))
    n = math.prod(shape)
    h = word_hash(k0, k1, np.arange(n, dtype=np.uint64))
    return (h >> np.uint64(16)).astype(np.uint16).reshape(shape)
