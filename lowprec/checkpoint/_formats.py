"""Which of lowprec's formats a checkpoint can store, under the library's own names.

One vocabulary: a checkpoint format is named exactly as the library names the format
(``"mxfp4"``, ``"mxfp8_e4m3"``, ``"mxfp8_e5m2"``, ``"mxfp6_e2m3"``, ``"mxfp6_e3m2"``,
``"mxint8"``, ``"nvfp4"``, ``"e4m3"``, ``"e5m2"``, ``"e4m3fnuz"``, ``"e5m2fnuz"``,
``"bf16"``, ``"fp16"``), and every alias the library accepts is accepted here too
(``"mxfp8"``, ``"mxfp6"``, ``"fp8_e4m3"`` — the name earlier lowprec checkpoints stored —,
``"float8_e4m3fnuz"``, ``"bfloat16"``, ...). A block format may carry another block size in
its name, as the library writes it (``"mxfp4_b16"`` = ``mx_format("mxfp4", block_size=16)``),
which is how a file records it. Names are resolved by the library's one alias table; scale
rules are checked by the library's one validator. This module only adds what is specific to
files: the safetensors dtype a cast format is stored as, and the checkpoint-only options.

Cast formats are the element formats safetensors has a dtype for (its dtype list: F8_E4M3,
F8_E5M2, F8_E4M3FNUZ, F8_E5M2FNUZ, BF16, F16; safetensors 0.8). The library's other element
formats (``e4m3ieee``, ``e3m4``, ``e4m3b11fnuz``, P3109, ...) have none, and are refused with
the list of storable ones. safetensors' sub-byte and scale dtypes (F4, F6_*, F8_E8M0) are not
offered as casts: an unscaled FP4/FP6/E8M0 weight is not a useful checkpoint, and the block
formats above store those codes with their scales.
"""

from __future__ import annotations

import difflib
from typing import Union

import lowprec_formats

from .._deprecated import deprecated_attribute
from .._format import ElementFormat, MXFormat, element_format, mx_format, resolve_format
from .._scale_rules import ScaleRule
from .._scale_rules import check_scale_rule as _check_scale_rule
from ._errors import CheckpointError

#: Block formats a checkpoint can hold (uint8 element codes, packed below 8 bits, + uint8
#: scale codes: E8M0 for MX, E4M3 and a float32 tensor scale for NVFP4), each also with any
#: block size the library accepts (``"mxfp4_b16"``).
MX_FORMATS = ("mxfp4", "mxfp8_e4m3", "mxfp8_e5m2", "mxfp6_e2m3", "mxfp6_e3m2", "mxint8", "nvfp4")
#: Element formats a tensor can be cast to: name → (element format, safetensors dtype,
#: takes a per-tensor scale).
CAST_FORMATS = {
    "e4m3": ("e4m3", "F8_E4M3", True),
    "e5m2": ("e5m2", "F8_E5M2", True),
    "e4m3fnuz": ("e4m3fnuz", "F8_E4M3FNUZ", True),
    "e5m2fnuz": ("e5m2fnuz", "F8_E5M2FNUZ", True),
    "bf16": ("bf16", "BF16", False),
    "fp16": ("fp16", "F16", False),
}
FORMATS = MX_FORMATS + tuple(CAST_FORMATS)
LAYOUTS = ("lowprec", "gpt-oss")
FP8_SCALINGS = ("tensor", "none")

#: A format a checkpoint stores: a block format or a cast (element) format.
CheckpointFormat = Union[MXFormat, ElementFormat]

# The same tables keyed by the format objects (what the package passes around).
_BLOCK_BASES = frozenset(MX_FORMATS)
_STORABLE_NAMES = frozenset(FORMATS)
_CASTS = {element_format(elem): (dtype, scaled) for elem, dtype, scaled in CAST_FORMATS.values()}

__all__ = [
    "CAST_FORMATS",
    "FORMATS",
    "FP8_SCALINGS",
    "LAYOUTS",
    "MX_FORMATS",
    "CheckpointFormat",
    "canonical_format",
    "cast_dtype",
    "cast_takes_scale",
    "check_fp8_scale",
    "check_layout",
    "check_scale_rule",
    "checkpoint_format",
    "is_block_format",
]

_STORABLE = (f"{', '.join(FORMATS)} (block formats also with another block size: "
             "mxfp4_b16, ...)")


def _close_names(name) -> str:
    """``"did you mean ...? "`` for a near miss among the storable names and their aliases."""
    if not isinstance(name, str):
        return ""
    aliases = [a for a, canon in lowprec_formats.ALIASES.items() if canon in _STORABLE_NAMES]
    close = difflib.get_close_matches(name.lower(), list(dict.fromkeys([*FORMATS, *aliases])),
                                      n=3, cutoff=0.6)
    return f"did you mean {' or '.join(map(repr, close))}? " if close else ""


def is_block_format(fmt: CheckpointFormat) -> bool:
    """Whether the checkpoint format ``fmt`` (from :func:`checkpoint_format`) is a block
    format (MX or NVFP4, any block size)."""
    return isinstance(fmt, MXFormat)


def checkpoint_format(name, block_size=None) -> CheckpointFormat:
    """The format object a checkpoint stores for ``name``: the one place a checkpoint format
    name is resolved (command-line arguments, file metadata, the public functions'
    arguments); the package passes the object from then on.

    Accepts every name and alias the library accepts, and format objects (checked as names
    are).

    Args:
      name: a format name, alias or object.
      block_size: block formats only: another block size (a power of two from 2 to 1024;
        None keeps the format's own); the format returned carries it (``"mxfp4_b16"``).

    Raises:
      CheckpointError: for an unknown name (with the closest storable names), a format a
        checkpoint cannot store, or a block size the format cannot take.

    Example:
        >>> checkpoint_format("MXFP8"), checkpoint_format("bfloat16")
        (MXFormat('mxfp8_e4m3'), ElementFormat('bf16'))
        >>> checkpoint_format("mxfp4", block_size=16)
        MXFormat('mxfp4_b16')
    """
    try:
        fmt = resolve_format(name)
    except (ValueError, TypeError):
        raise CheckpointError(
            f"unknown checkpoint format {name!r}; {_close_names(name)}choose one of: {_STORABLE}"
        ) from None
    if isinstance(fmt, MXFormat):
        if fmt.base_name not in _BLOCK_BASES:  # a block format added to the library but not here
            raise CheckpointError(f"format {name!r} is not a checkpoint storage format; "
                                  f"choose one of: {_STORABLE}")
        if block_size is not None:
            try:
                fmt = mx_format(fmt, block_size=block_size)
            except (ValueError, TypeError) as e:
                raise CheckpointError(f"block size {block_size!r} for {fmt.name}: {e}") from None
        return fmt
    if fmt not in _CASTS:
        alias = f" ({fmt.name})" if name != fmt.name else ""
        raise CheckpointError(
            f"format {name!r}{alias} is not a checkpoint storage format (casts are the "
            "element formats that have a safetensors dtype; FP4/FP6/E8M0 codes are stored by "
            f"the block formats); choose one of: {_STORABLE}"
        )
    if block_size is not None:
        raise CheckpointError(f"a block size applies to block formats only, not {fmt.name}")
    return fmt


def canonical_format(name, block_size=None) -> str:
    """The name of the checkpoint format for ``name``: the library's canonical format name
    (:func:`checkpoint_format`'s, as files record it).

    Example:
        >>> canonical_format("MXFP8"), canonical_format("fp8_e4m3"), canonical_format("bfloat16")
        ('mxfp8_e4m3', 'e4m3', 'bf16')
        >>> canonical_format("mxfp6"), canonical_format("mxfp4", block_size=16)
        ('mxfp6_e2m3', 'mxfp4_b16')
    """
    return checkpoint_format(name, block_size).name


def cast_dtype(fmt: ElementFormat) -> str:
    """The safetensors dtype a cast format is stored as (``"F8_E4M3"`` for E4M3).

    Example:
        >>> cast_dtype(checkpoint_format("bf16"))
        'BF16'
    """
    return _CASTS[fmt][0]


def cast_takes_scale(fmt: ElementFormat) -> bool:
    """Whether a cast format takes a per-tensor scale (the FP8 formats do, BF16/FP16 not)."""
    return _CASTS[fmt][1]


def check_scale_rule(rule) -> str:
    """The name of scale rule ``rule`` (a :class:`lowprec.ScaleRule` or its name), checked
    by the library's validator.

    Example:
        >>> check_scale_rule("rceil")
        'rceil'
    """
    try:
        return _check_scale_rule(rule).value
    except (ValueError, TypeError) as e:
        raise CheckpointError(str(e)) from None


def check_layout(layout) -> str:
    """``layout`` if it is one of :data:`LAYOUTS`."""
    if layout not in LAYOUTS:
        raise CheckpointError(f"unknown layout {layout!r}; choose one of: {', '.join(LAYOUTS)}")
    return layout


def check_fp8_scale(fp8_scale) -> str:
    """``fp8_scale`` if it is one of :data:`FP8_SCALINGS`."""
    if fp8_scale not in FP8_SCALINGS:
        raise CheckpointError(
            f"unknown fp8_scale {fp8_scale!r}; choose one of: {', '.join(FP8_SCALINGS)}"
        )
    return fp8_scale


# The scale rule's old second spellings (lowprec.ScaleRule is the one): what to use instead,
# and the value, still returned with a DeprecationWarning.
_DEPRECATED = {
    "SCALE_RULES": ("lowprec.ScaleRule", lambda: tuple(r.value for r in ScaleRule)),
    "DEFAULT_SCALE_RULE": ("lowprec.ScaleRule.FLOOR, the default of every scale_rule=",
                           lambda: ScaleRule.FLOOR),
}


def __getattr__(name):
    return deprecated_attribute(__name__, _DEPRECATED, name)
