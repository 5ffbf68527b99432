"""Format definitions as data: the single source of truth for lowprec and the reference.

The table lives in ``elements.json`` beside this file; this module only loads it.
Nothing here computes derived quantities — lowprec and the reference each derive
what they need from these raw fields, independently.

Example:
    >>> from lowprec_formats import ELEMENT_FORMATS
    >>> ELEMENT_FORMATS["e4m3"]["exponent_bits"], ELEMENT_FORMATS["e4m3"]["bias"]
    (4, 7)
"""

from __future__ import annotations

import json
import types
from importlib import resources

_DATA = json.loads(resources.files(__name__).joinpath("elements.json").read_text())


def _freeze(table: dict) -> types.MappingProxyType:
    return types.MappingProxyType({k: types.MappingProxyType(v) for k, v in table.items()})


ELEMENT_FORMATS = _freeze(_DATA["element_formats"])
MX_FORMATS = _freeze(_DATA["mx_formats"])
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

__all__ = [
    "ALIASES",
    "COLLECTIONS",
    "ELEMENT_FORMATS",
    "MX_FORMATS",
    "OVERFLOW_POLICIES",
    "ROUNDING_MODES",
    "SCALE_RULES",
]
