"""``finfo``: the machine limits of an element format, in the vocabulary of ``numpy.finfo``.

The same attribute names as ``numpy.finfo`` / ``ml_dtypes.finfo`` (``eps``, ``max``,
``smallest_subnormal``, ``nmant``, ...), with Python numbers as values, for every element
format — TF32 included, which has no NumPy dtype.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional

import numpy as np

from ._format import ElementFormat, ElementFormatLike, MXFormat, element_format


@dataclasses.dataclass(frozen=True)
class FormatInfo:
    """Machine limits of an element format (see :func:`finfo`).

    Attributes:
      name: the format's canonical name.
      bits: bits of a code.
      nexp, iexp: exponent bits. nmant: explicit mantissa bits.
      machep, eps: eps = 2^machep is the gap from 1.0 to the next value.
      negep, epsneg: epsneg = 2^negep is the gap from 1.0 down to the previous value.
      maxexp: the smallest power of two that overflows (emax + 1).
      minexp: exponent of the smallest normal number (emin).
      max: the largest finite value. min: −max for signed formats (MX INT8: −127/64, the
        symmetric range encoders produce; its code 0x80 decodes to −2), 0 for unsigned ones
        with a zero (P3109 unsigned), the smallest value for E8M0.
      smallest_normal (alias tiny): 2^minexp.
      smallest_subnormal: the smallest positive value (= smallest_normal without subnormals).
      precision: decimal digits, ``int(-log10(eps))`` as NumPy defines it.
      resolution: 10^-precision.
      dtype: the NumPy/ml_dtypes dtype with this layout, or None (TF32).
    """

    name: str
    bits: int
    nexp: int
    iexp: int
    nmant: int
    machep: int
    eps: float
    negep: int
    epsneg: float
    maxexp: int
    minexp: int
    max: float
    min: float
    smallest_normal: float
    smallest_subnormal: float
    precision: int
    resolution: float
    dtype: Optional[np.dtype]

    @property
    def tiny(self) -> float:
        """Alias of ``smallest_normal`` (NumPy's name)."""
        return self.smallest_normal


@functools.lru_cache(maxsize=None)
def _finfo(fmt: ElementFormat) -> FormatInfo:
    m = fmt.mantissa_bits
    precision = int(-math.log10(fmt.eps))
    machep = round(math.log2(fmt.eps))
    # The value below 1.0 lies in binade -1 (spacing 2^(-1-m)), or among the subnormals
    # (spacing 2^(emin-m)) when 1.0 is the smallest normal (E2M1: emin = 0, 1 - 0.5).
    negep = max(-1, fmt.emin) - m
    return FormatInfo(
        name=fmt.name,
        bits=fmt.code_bits,
        nexp=fmt.exponent_bits,
        iexp=fmt.exponent_bits,
        nmant=m,
        machep=machep,
        eps=fmt.eps,
        negep=negep,
        epsneg=math.ldexp(1.0, negep),
        maxexp=fmt.emax + 1,
        minexp=fmt.emin,
        max=fmt.max_finite,
        min=-fmt.max_finite if fmt.signed else 0.0 if fmt.zero else fmt.min_subnormal,
        smallest_normal=fmt.min_normal,
        smallest_subnormal=fmt.min_subnormal,
        precision=precision,
        resolution=10.0**-precision,
        dtype=fmt.storage_dtype,
    )


def finfo(fmt: ElementFormatLike) -> FormatInfo:
    """Machine limits of an element format, like ``numpy.finfo`` / ``ml_dtypes.finfo``.

    Every field except ``precision``/``resolution`` equals ml_dtypes' ``finfo`` of the
    matching dtype (ml_dtypes hard-codes ``precision = 1`` for its 8-bit types; lowprec
    applies NumPy's definition ``int(-log10(eps))`` to every format).

    Args:
      fmt: an element format or its name. For a block format pass its element format
        (``finfo(mx_format("mxfp4").element)``).

    Example:
        >>> info = finfo("e4m3")
        >>> info.max, info.eps, info.smallest_normal, info.smallest_subnormal, info.nmant
        (448.0, 0.125, 0.015625, 0.001953125, 3)
    """
    if isinstance(fmt, MXFormat):
        raise TypeError(
            f"finfo describes element formats; {fmt.name!r} is a block format: pass its "
            f"element format, finfo({fmt.element.name!r})"
        )
    return _finfo(element_format(fmt))
