"""Validated quantization options: what every public function checks, checked once.

A public function turns its keyword arguments into one of these frozen, hashable objects
(its ``__post_init__`` validates and canonicalizes every field, with messages that name the
value and the fix) and hands it to a private core as a static argument of ``jax.jit``.
Cores never validate again, and public functions never call each other for their work.
"""

from __future__ import annotations

import dataclasses
from typing import Union

import numpy as np

from ._format import ElementFormat, ElementFormatLike, MXFormat, MXFormatLike, element_format, mx_format
from ._rounding import check_overflow, check_rounding
from ._scale_rules import ScaleRule, check_scale_rule


def _check_key(rounding: str, key, random_bits=None) -> None:
    if rounding == "stochastic" and key is None and random_bits is None:
        raise ValueError(
            "rounding='stochastic' needs a PRNG key: pass key=jax.random.key(seed) "
            "(or a split of your training key), or your own words as random_bits="
        )
    if rounding == "stochastic" and key is not None and random_bits is not None:
        raise ValueError(
            "rounding='stochastic' takes a key or random_bits, not both: random_bits= "
            "replaces the words lowprec.random_bits(key, shape) would draw"
        )
    if rounding != "stochastic" and key is not None:
        raise ValueError(
            f"key is only used by rounding='stochastic', but rounding={rounding!r}; "
            "drop the key or choose rounding='stochastic'"
        )
    if rounding != "stochastic" and random_bits is not None:
        raise ValueError(
            f"random_bits is only used by rounding='stochastic', but rounding={rounding!r}; "
            "drop random_bits or choose rounding='stochastic'"
        )


def check_random_bits(random_bits, shape: tuple, what: str = "x's shape") -> None:
    """Caller-supplied stochastic-rounding words: a uint16 or uint32 array of ``shape``
    (one word per element), or a clear error."""
    if random_bits is None:
        return
    dtype = getattr(random_bits, "dtype", None)
    if dtype is None or np.dtype(dtype) not in (np.dtype(np.uint16), np.dtype(np.uint32)):
        got = f"dtype {np.dtype(dtype)}" if dtype is not None else type(random_bits).__name__
        raise TypeError(
            f"random_bits must be a uint16 or uint32 array (one word per element), got {got}; "
            "draw them with lowprec.random_bits(key, shape) or jax.random.bits(key, shape, "
            "jnp.uint32)"
        )
    if tuple(random_bits.shape) != tuple(shape):
        raise ValueError(
            f"random_bits has shape {tuple(random_bits.shape)} but needs {what} {tuple(shape)}: "
            "one word per element"
        )


@dataclasses.dataclass(frozen=True)
class ElementCast:
    """How values are rounded to an element format (the options of ``encode``/``quantize``).

    Example:
        >>> ElementCast("e8m0", rounding="floor")
        ElementCast(fmt=ElementFormat('e8m0'), rounding='down', overflow='ieee')
    """

    fmt: ElementFormat
    rounding: str = "nearest_even"
    overflow: str = "ieee"

    def __post_init__(self):
        fmt = element_format(self.fmt)
        object.__setattr__(self, "fmt", fmt)
        object.__setattr__(self, "rounding", check_rounding(fmt, self.rounding))
        object.__setattr__(self, "overflow", check_overflow(self.overflow))

    @property
    def stochastic(self) -> bool:
        return self.rounding == "stochastic"

    def check_key(self, key, random_bits=None) -> None:
        """Stochastic rounding needs a key or random words (one of them); every other mode
        refuses both."""
        _check_key(self.rounding, key, random_bits)


@dataclasses.dataclass(frozen=True)
class MXCast:
    """How an array is block-quantized (the options of ``quantize_mx``/``fake_quantize_mx``).

    Elements always saturate to ± the element maximum (OCP MX v1.0).

    Example:
        >>> MXCast("mxfp8", scale_rule="rceil")
        MXCast(fmt=MXFormat('mxfp8_e4m3'), scale_rule=<ScaleRule.RCEIL: 'rceil'>, rounding='nearest_even')
    """

    fmt: MXFormat
    scale_rule: ScaleRule = ScaleRule.FLOOR
    rounding: str = "nearest_even"

    def __post_init__(self):
        fmt = mx_format(self.fmt)
        object.__setattr__(self, "fmt", fmt)
        object.__setattr__(self, "scale_rule", check_scale_rule(self.scale_rule))
        object.__setattr__(self, "rounding", check_rounding(fmt.element, self.rounding))

    @property
    def stochastic(self) -> bool:
        return self.rounding == "stochastic"

    def check_key(self, key, random_bits=None) -> None:
        """Stochastic rounding needs a key or random words (one of them); every other mode
        refuses both."""
        _check_key(self.rounding, key, random_bits)


ElementCastLike = Union[ElementCast, ElementFormatLike]
MXCastLike = Union[MXCast, MXFormatLike]
