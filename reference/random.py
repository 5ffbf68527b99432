"""The random words of lowprec's stochastic rounding, recomputed in plain NumPy.

lowprec rounds element i of an array away from zero iff its 16-bit word r_i is below
frac_i · 2^16 (the reference encoders take 32-bit words and 2^32: pass r_i · 2^16, which
decides identically). With ``key=``, the words come from Philox2x32-10 — Salmon, Moraes,
Dror, Shaw, "Parallel random numbers: as easy as 1, 2, 3" (SC 2011), as published in the
Random123 library — keyed by k0 at the counter (k1, ⌊i/4⌋): word i is 16-bit chunk i mod 4 of
out0 | out1 << 32, lowest first, where (k0, k1) are two uint32 words drawn once from the
caller's JAX key. Given (k0, k1), :func:`random_bits` here replays the words, so
:func:`lowprec_reference.encode` and :func:`lowprec_reference.quantize_mx` can be handed
exactly what lowprec consumed.

Philox2x32 (Random123, ``philox.h``): a round maps the counter (x0, x1) under key k to
(hi(M·x0) ⊕ x1 ⊕ k, lo(M·x0)) with M = 0xD256D193, hi/lo the upper/lower 32 bits of the
64-bit product; the key grows by W = 0x9E3779B9 between rounds; ten rounds.

Example:
    >>> [hex(int(w)) for w in philox2x32(0, 0, 0)]  # Random123 known-answer test
    ['0xff1dae59', '0x6cd10df2']
"""

from __future__ import annotations

import math

import numpy as np

M2x32 = 0xD256D193
W32 = 0x9E3779B9
ROUNDS = 10
_MASK32 = 0xFFFF_FFFF


def philox2x32(key, x0, x1):
    """Philox2x32-10 of counters ``(x0, x1)`` under ``key`` (ints or uint32 arrays).

    Returns the two output words as uint32 arrays (0-d for scalar input).
    """
    k = np.uint64(int(key) & _MASK32)
    a = np.asarray(x0, np.uint64) & np.uint64(_MASK32)
    b = np.asarray(x1, np.uint64) & np.uint64(_MASK32)
    a, b = np.broadcast_arrays(a, b)
    for r in range(ROUNDS):
        if r:
            k = (k + np.uint64(W32)) & np.uint64(_MASK32)
        prod = a * np.uint64(M2x32)  # < 2^64: exact in uint64
        hi, lo = prod >> np.uint64(32), prod & np.uint64(_MASK32)
        a, b = hi ^ b ^ k, lo
    return a.astype(np.uint32), b.astype(np.uint32)


def random_bits(key_words, shape) -> np.ndarray:
    """The uint16 words lowprec's stochastic rounding uses for an array of ``shape``.

    Args:
      key_words: the two uint32 words (k0, k1) lowprec draws from the caller's key,
        ``jax.random.bits(key, (2,), jnp.uint32)``.
      shape: the array shape (for MX, the padded shape).

    Returns:
      uint16 array of ``shape``: word i (row-major) is bits 16·(i mod 4) up of
      ``out0 | out1 << 32``, ``(out0, out1) = philox2x32(k0, k1, i // 4)``.
    """
    k0, k1 = (int(w) for w in np.asarray(key_words, np.uint32).reshape(2))
    n = math.prod(shape)
    out0, out1 = philox2x32(k0, k1, np.arange(-(-n // 4), dtype=np.uint64))
    both = np.stack([out0, out1], axis=-1).astype("<u4")  # little-endian: lowest chunk first
    return both.view("<u2").reshape(-1)[:n].astype(np.uint16).reshape(shape)
