"""Which of lowprec's formats a checkpoint can store, under the library's own names.

One vocabulary: a checkpoint format is named exactly as the library names the format
(``"mxfp4"``, ``"mxfp8_e4m3"``, ``"mxfp8_e5m2"``, ``"e4m3"``, ``"e5m2"``, ``"bf16"``,
``"fp16"``), and every alias the library accepts is accepted here too (``"mxfp8"``,
``"fp8_e4m3"`` — the name earlier lowprec checkpoints stored —, ``"bfloat16"``, ...).
Names are resolved by the library's one alias table; scale rules are checked by the
library's one validator. This module only adds what is specific to files: the
safetensors dtype a cast format is stored as, and the checkpoint-only options.
"""

from __future__ import annotations

from .._format import resolve_format
from .._scale_rules import DEFAULT_SCALE_RULE, SCALE_RULES
from .._scale_rules import check_scale_rule as _check_scale_rule
from ._errors import CheckpointError

#: Block formats a checkpoint can hold (stored as uint8 element codes + E8M0 scales).
MX_FORMATS = ("mxfp4", "mxfp8_e4m3", "mxfp8_e5m2")
#: Element formats a tensor can be cast to: name → (element format, safetensors dtype,
#: takes a per-tensor scale).
CAST_FORMATS = {
    "e4m3": ("e4m3", "F8_E4M3", True),
    "e5m2": ("e5m2", "F8_E5M2", True),
    "bf16": ("bf16", "BF16", False),
    "fp16": ("fp16", "F16", False),
}
FORMATS = MX_FORMATS + tuple(CAST_FORMATS)
LAYOUTS = ("lowprec", "gpt-oss")
FP8_SCALINGS = ("tensor", "none")

__all__ = [
    "CAST_FORMATS",
    "DEFAULT_SCALE_RULE",
    "FORMATS",
    "FP8_SCALINGS",
    "LAYOUTS",
    "MX_FORMATS",
    "SCALE_RULES",
    "canonical_format",
    "check_fp8_scale",
    "check_layout",
    "check_scale_rule",
]


def canonical_format(name) -> str:
    """The checkpoint format for ``name``: the library's canonical format name.

    Accepts every name and alias the library accepts (and format objects).

    Raises:
      CheckpointError: for an unknown name, or a format a checkpoint cannot store.

    Example:
        >>> canonical_format("MXFP8"), canonical_format("fp8_e4m3"), canonical_format("bfloat16")
        ('mxfp8_e4m3', 'e4m3', 'bf16')
    """
    try:
        fmt = resolve_format(name)
    except (ValueError, TypeError):
        raise CheckpointError(
            f"unknown checkpoint format {name!r}; choose one of: {', '.join(FORMATS)}"
        ) from None
    if fmt.name not in FORMATS:
        alias = f" ({fmt.name})" if name != fmt.name else ""
        raise CheckpointError(
            f"format {name!r}{alias} is not a checkpoint storage format; choose one "
            f"of: {', '.join(FORMATS)}"
        )
    return fmt.name


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
