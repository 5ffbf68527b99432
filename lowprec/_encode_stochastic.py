"""Stochastic rounding's encoder: the random words drawn inside the encode that uses them.

:func:`encode_stochastic` generates the words of the contract (``_random.py``; docs/design.md
§2) from a key, or takes the caller's, and rounds with a fast encoder where one applies
(``_encode_fast.stochastic16_encoder``) or the general encoder; :func:`encode_any` is the
encoder for every mode, given ``rng = (key, words)``.
"""

from __future__ import annotations

from typing import Union

import jax.numpy as jnp
import numpy as np
from jax import lax

from ._encode import encode_bits
from ._encode_fast import stochastic16_encoder
from ._format import ElementFormat
from ._random import (
    WORD_BITS,
    WORD_MASK,
    as_word32,
    check_size,
    element_index,
    element_words,
    key_words,
    word_complements,
)
from ._rounding import Overflow, Rounding


def encode_stochastic(fmt: ElementFormat, u, overflow: Union[str, Overflow], rng, scale_exp=None,
                      assume_finite: bool = False):
    """Stochastic :func:`encode_bits` of float patterns ``u`` with ``rng = (key, words)``.

    Caller words (uint16 or uint32, ``u``'s shape) are used as given. With a key, the words
    of the contract (``_random.random_bits``) are generated here, one per element inside the
    encode, from each element's row-major index in ``u`` (a reshape, such as MX's split into
    blocks, keeps it). 16-bit words of float32 input under "ieee" overflow and without
    ``scale_exp`` take the format's fast encoder where it has one (those handle NaN and inf
    whatever ``assume_finite`` says); everything else takes :func:`encode_bits`, with
    ``scale_exp`` (broadcastable to ``u``) and ``assume_finite`` as it defines them.
    Returns int32 codes of ``u``'s shape.
    """
    key, words = rng
    if words is not None and words.dtype != jnp.uint16:
        return encode_bits(fmt, u, Rounding.STOCHASTIC, overflow, as_word32(words),
                           scale_exp=scale_exp, assume_finite=assume_finite)
    fast = None
    if scale_exp is None and np.dtype(u.dtype) == np.uint32 and Overflow(overflow) is Overflow.IEEE:
        fast = stochastic16_encoder(fmt)
    if words is None:
        k, index = key_words(key), element_index(check_size(u.shape))
        if fast is not None:
            return fast(fmt, u, word_complements(k, index))
        r16 = element_words(k, index)
    else:
        r16 = words.astype(jnp.uint32)
    if fast is not None:
        return fast(fmt, u, r16 ^ jnp.uint32(WORD_MASK))
    return encode_bits(fmt, u, Rounding.STOCHASTIC, overflow,
                       lax.shift_left(r16, jnp.uint32(WORD_BITS)),
                       scale_exp=scale_exp, assume_finite=assume_finite)


def encode_any(fmt: ElementFormat, u, rounding: Union[str, Rounding],
               overflow: Union[str, Overflow], rng, scale_exp=None, assume_finite: bool = False):
    """:func:`encode_bits` for every mode; stochastic rounding draws its words from
    ``rng = (key, words)`` (see :func:`encode_stochastic`), the other modes ignore it."""
    if Rounding(rounding) is Rounding.STOCHASTIC:
        return encode_stochastic(fmt, u, overflow, rng, scale_exp, assume_finite)
    return encode_bits(fmt, u, rounding, overflow, None, scale_exp=scale_exp,
                       assume_finite=assume_finite)
