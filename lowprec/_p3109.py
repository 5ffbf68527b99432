"""IEEE P3109 ``binaryKpP`` formats: parametric element formats built from the family's rules.

The rules (width K, precision P, signedness, domain → layout and specials) are data, in
``lowprec_formats.p3109_spec``; this module only names and validates the parameters. The
result is an ordinary :class:`~lowprec.ElementFormat`, usable everywhere a format is.
"""

from __future__ import annotations

import lowprec_formats as _data

from ._format import ElementFormat, element_format

SIGNEDNESS = ("signed", "unsigned")
DOMAINS = ("extended", "finite")


def p3109(k: int, p: int, signedness: str = "signed", domain: str = "extended") -> ElementFormat:
    """The IEEE P3109 format with K bits and precision P (significand bits, implicit bit
    included), as gfloat's ``format_info_p3109`` defines it.

    Signed formats have a sign bit, K − P exponent bits, bias 2^(K−P−1) (0 when P = K), no
    −0, and one NaN at 0b1000…0; unsigned ones K − P + 1 exponent bits, bias 2^(K−P), NaN
    at the all-ones code. The ``"extended"`` domain has ±infinity at the largest remaining
    magnitude codes (signed: 0b0111…1); ``"finite"`` gives that code a finite value. Every
    format has subnormals; ties to even compare codes. Unsigned formats encode negative
    numbers as NaN (−0 as +0).

    Args:
      k: width in bits, 2..16 (every value must also be a float32, which rules out a few
        wide formats with small P).
      p: precision, 1..k.
      signedness: ``"signed"`` (default) or ``"unsigned"``.
      domain: ``"extended"`` (default, with infinities) or ``"finite"``.

    Returns:
      An :class:`ElementFormat` named as gfloat names it, e.g. ``"p3109_k8p3se"``; the name
      works wherever a format name does.

    Raises:
      ValueError: parameters out of range; the message names the valid ones.

    Example:
        >>> f = p3109(8, 3)
        >>> f.name, f.max_finite, f.min_subnormal, f.nan_code, f.inf_code
        ('p3109_k8p3se', 49152.0, 7.62939453125e-06, 128, 127)
        >>> import jax.numpy as jnp, lowprec
        >>> lowprec.encode(jnp.array([1.0, -0.0, 1e6, jnp.nan]), f).tolist()
        [64, 0, 127, 128]
    """
    if signedness not in SIGNEDNESS:
        raise ValueError(f"unknown signedness {signedness!r}; valid: {SIGNEDNESS}")
    if domain not in DOMAINS:
        raise ValueError(f"unknown domain {domain!r}; valid: {DOMAINS}")
    try:
        k, p = int(k), int(p)
    except (TypeError, ValueError):
        raise TypeError(f"k and p must be integers, got k={k!r}, p={p!r}") from None
    _data.p3109_spec(k, p)  # validates k and p with the family's own message
    return element_format(_data.p3109_name(k, p, signedness == "signed", domain == "extended"))
