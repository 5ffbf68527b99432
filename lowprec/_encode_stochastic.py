"""Stochastic rounding's encoder: the random words drawn inside the encode that uses them.

:func:`encode_stochastic` generates the words of the contract (``_random.py``; docs/design.md
§2) from a key, or takes the caller's, and rounds with the general encoder;
:func:`encode_any` is the encoder for every mode, given ``rng = (key, words)``.
"""

from __future__ import annotations

import math
from typing import Union

import jax.numpy as jnp
from jax import lax

from ._encode import encode_bits
from ._format import ElementFormat
from ._random import (
    WORD_BITS,
    WORDS_PER_HASH,
    as_word32,
    check_size,
    element_words,
    hash_words,
    key_words,
)
from ._rounding import Overflow, Rounding


def encode_stochastic(fmt: ElementFormat, u, overflow: Union[str, Overflow], rng, scale_exp=None,
                      assume_finite: bool = False):
    """Stochastic :func:`encode_bits` of float patterns ``u`` with ``rng = (key, words)``.

    Caller words (uint16 or uint32, ``u``'s shape) are used as given. With a key, the words
    of the contract (``_random.random_bits``) are generated here, inside the encode. One
    Philox evaluation serves four neighbouring elements, but XLA fuses work per *output*
    element and would evaluate it once for each of them; so the codes of the elements that
    share an evaluation are OR-ed into one uint32 by a reduction over a minor axis of 4 (8-bit
    codes) or 2 (16-bit codes, an evaluation then serving two reductions), whose unrolled
    iterations share the evaluation, and the uint32s are reinterpreted as codes. Wider codes,
    or a last axis that does not split into such groups, take one evaluation per element.
    ``scale_exp`` (broadcastable to ``u``) and ``assume_finite`` as for :func:`encode_bits`.
    Returns int32 codes of ``u``'s shape.
    """
    key, words = rng

    def enc(bits, r32, se):
        return encode_bits(fmt, bits, Rounding.STOCHASTIC, overflow, r32, scale_exp=se,
                           assume_finite=assume_finite)

    if words is not None:
        return enc(u, as_word32(words), scale_exp)
    k = key_words(key)
    shape = check_size(u.shape)
    lanes = 4 if fmt.code_bits <= 8 else 2 if fmt.code_bits <= 16 else 1
    if lanes == 1 or not shape or shape[-1] % WORDS_PER_HASH:
        r16 = element_words(k, lax.iota(jnp.uint32, math.prod(shape)).reshape(shape))
        return enc(u, lax.shift_left(r16, jnp.uint32(WORD_BITS)), scale_exp)
    grouped = shape[:-1] + (shape[-1] // lanes, lanes)
    slot = lax.iota(jnp.uint32, math.prod(grouped[:-1])).reshape(grouped[:-1] + (1,))
    lane = lax.broadcasted_iota(jnp.uint32, grouped, len(grouped) - 1)
    if lanes == 4:  # slot = group: lanes 0, 1 in out0, lanes 2, 3 in out1
        out0, out1 = hash_words(k, slot)
        word = jnp.where(lane >= 2, out1, out0)
    else:  # two slots per group: the even one takes out0, the odd one out1
        out0, out1 = hash_words(k, lax.shift_right_logical(slot, jnp.uint32(1)))
        word = jnp.where((slot & 1) != 0, out1, out0)
    # The lane's 16-bit word moved to the top of a uint32 (r · 2^16: the same decision).
    high_word = ((1 << WORD_BITS) - 1) << WORD_BITS
    r32 = jnp.where((lane & 1) != 0, word & jnp.uint32(high_word),
                    lax.shift_left(word, jnp.uint32(WORD_BITS)))
    se = None if scale_exp is None else jnp.broadcast_to(scale_exp, shape).reshape(grouped)
    width = 32 // lanes
    code = enc(u.reshape(grouped), r32, se).astype(jnp.uint32) & jnp.uint32((1 << width) - 1)
    shifted = lax.shift_left(code, lane * jnp.uint32(width))
    packed = lax.reduce(shifted, jnp.uint32(0), lax.bitwise_or, (len(grouped) - 1,))
    codes = lax.bitcast_convert_type(packed, jnp.uint8 if lanes == 4 else jnp.uint16)
    return codes.reshape(shape).astype(jnp.int32)


def encode_any(fmt: ElementFormat, u, rounding: Union[str, Rounding],
               overflow: Union[str, Overflow], rng, scale_exp=None, assume_finite: bool = False):
    """:func:`encode_bits` for every mode; stochastic rounding draws its words from
    ``rng = (key, words)`` (see :func:`encode_stochastic`), the other modes ignore it."""
    if Rounding(rounding) is Rounding.STOCHASTIC:
        return encode_stochastic(fmt, u, overflow, rng, scale_exp, assume_finite)
    return encode_bits(fmt, u, rounding, overflow, None, scale_exp=scale_exp,
                       assume_finite=assume_finite)
