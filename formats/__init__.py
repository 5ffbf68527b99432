"""Format definitions as data: the single source of truth for lowprec and the reference.

The table lives in ``elements.json`` beside this file; this module only loads it, plus the
one parametric family, IEEE P3109 ``binaryKpP``, whose entries follow from (K, P,
signedness, domain) by the rules in :func:`p3109_spec` and are returned in the same schema.
Nothing here computes derived quantities — lowprec and the reference each derive what they
need from these raw fields, independently.

Example:
    >>> from lowprec_formats import ELEMENT_FORMATS, element_spec
    >>> ELEMENT_FORMATS["e4m3"]["exponent_bits"], ELEMENT_FORMATS["e4m3"]["bias"]
    (4, 7)
    >>> name, spec = element_spec("p3109_k8p3se")
    >>> spec["exponent_bits"], spec["bias"], spec["inf_code"], spec["nan_code"]
    (5, 16, '0x7f', '0x80')
"""

from __future__ import annotations

import json
import re
import types
from importlib import resources
from typing import Optional

_DATA = json.loads(resources.files(__name__).joinpath("elements.json").read_text())


def _freeze(table: dict) -> types.MappingProxyType:
    return types.MappingProxyType({k: types.MappingProxyType(v) for k, v in table.items()})


ELEMENT_FORMATS = _freeze(_DATA["element_formats"])
MX_FORMATS = _freeze(_DATA["mx_formats"])
#: How block formats encode their scales (each ``MX_FORMATS`` entry names one as ``"scheme"``).
SCALE_SCHEMES = _freeze(_DATA["scale_schemes"])
BLOCK_SIZES: tuple[int, ...] = tuple(_DATA["block_sizes"])
ROUNDING_MODES: tuple[str, ...] = tuple(_DATA["rounding_modes"])
OVERFLOW_POLICIES: tuple[str, ...] = tuple(_DATA["overflow_policies"])
SCALE_RULES: tuple[str, ...] = tuple(_DATA["scale_rules"])
COLLECTIONS = types.MappingProxyType({k: tuple(v) for k, v in _DATA["collections"].items()})

# Every alias (and canonical name) -> canonical name.
ALIASES = types.MappingProxyType(
    {
        alias: name
        for table in (_DATA["element_formats"], _DATA["mx_formats"])
        for name, spec in table.items()
        for alias in (name, *spec["aliases"])
    }
)

# -- IEEE P3109 binaryKpP -------------------------------------------------------------------
#: Widths K accepted for P3109 formats (P3109 itself defines K >= 2; lowprec stops at 16).
P3109_WIDTHS = range(2, 17)
_P3109_NAME = re.compile(r"^p3109_k(\d+)p(\d+)([su])([ef])$")


def p3109_name(k: int, p: int, signed: bool = True, extended: bool = True) -> str:
    """The canonical name of a P3109 format, as gfloat spells it: ``p3109_k8p3se``."""
    return f"p3109_k{k}p{p}{'s' if signed else 'u'}{'e' if extended else 'f'}"


def p3109_spec(k: int, p: int, signed: bool = True, extended: bool = True) -> dict:
    """Raw fields (the ``elements.json`` schema) of the P3109 format with K bits, precision P.

    The rules of IEEE P3109 (interim report; the same facts as gfloat 0.5's
    ``format_info_p3109``): P - 1 trailing significand bits; a sign bit for signed formats;
    exponent bits K - P (signed) or K - P + 1 (unsigned); bias 2^(K-P-1) rounded down
    (signed) or 2^(K-P) (unsigned); subnormals; no negative zero. Signed formats have one NaN,
    the code 2^(K-1) (where -0 would be), unsigned ones the all-ones code 2^K - 1. The extended
    domain has infinities at the largest remaining magnitude code (signed: 2^(K-1) - 1 and its
    negative; unsigned: 2^K - 2); the finite domain uses that code for a finite value. Ties to
    even compare the codes' last bit (it matters only for P = 1, without mantissa bits).

    Raises:
      ValueError: K outside 2..16 or P outside 1..K.
    """
    if k not in P3109_WIDTHS:
        raise ValueError(
            f"P3109 width K={k} is outside the supported range {P3109_WIDTHS.start}..."
            f"{P3109_WIDTHS.stop - 1}"
        )
    if not 1 <= p <= k:
        raise ValueError(f"P3109 precision P={p} must satisfy 1 <= P <= K={k}")
    mantissa = p - 1
    exponent = k - p if signed else k - p + 1
    bias = (1 << (k - p - 1)) if (signed and k - p >= 1) else (0 if signed else 1 << (k - p))
    nan_code = (1 << (k - 1)) if signed else (1 << k) - 1
    inf_code = ((1 << (k - 1)) - 1 if signed else (1 << k) - 2) if extended else None
    return {
        "aliases": [],
        "sign_bits": 1 if signed else 0,
        "exponent_bits": exponent,
        "mantissa_bits": mantissa,
        "bias": bias,
        "inf": extended,
        "inf_code": None if inf_code is None else hex(inf_code),
        "nan": "negative_zero" if signed else "all_ones",
        "zero": True,
        "subnormals": True,
        "nan_code": hex(nan_code),
        "ties": "code",
        "ml_dtypes": None,
        "doc": f"IEEE P3109 binary{k}p{p}, {'signed' if signed else 'unsigned'}, "
        f"{'extended' if extended else 'finite'} domain.",
    }


def parse_p3109(name: str) -> Optional[tuple]:
    """``(k, p, signed, extended)`` of a P3109 name such as ``"p3109_k8p3se"``, else None."""
    m = _P3109_NAME.match(name)
    if m is None:
        return None
    return int(m.group(1)), int(m.group(2)), m.group(3) == "s", m.group(4) == "e"


def element_spec(name: str) -> tuple:
    """``(canonical name, raw fields)`` of an element format name, alias or P3109 name.

    Raises:
      KeyError: the name is not an element format (it may be a block format).
      ValueError: a P3109 name with parameters out of range.
    """
    canonical = ALIASES.get(name)
    if canonical in ELEMENT_FORMATS:
        return canonical, ELEMENT_FORMATS[canonical]
    parsed = parse_p3109(name)
    if parsed is not None:
        try:
            return p3109_name(*parsed), types.MappingProxyType(p3109_spec(*parsed))
        except ValueError as e:
            raise ValueError(f"{name!r}: {e}") from None
    raise KeyError(name)


__all__ = [
    "ALIASES",
    "BLOCK_SIZES",
    "COLLECTIONS",
    "ELEMENT_FORMATS",
    "MX_FORMATS",
    "OVERFLOW_POLICIES",
    "P3109_WIDTHS",
    "ROUNDING_MODES",
    "SCALE_RULES",
    "SCALE_SCHEMES",
    "element_spec",
    "p3109_name",
    "p3109_spec",
    "parse_p3109",
]
