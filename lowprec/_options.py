"""Validated quantization options: what every public function checks, checked once.

A public function turns its keyword arguments into one of these frozen, hashable objects
(its ``__post_init__`` validates and canonicalizes every field, with messages that name the
value and the fix) and hands it to a private core as a static argument of ``jax.jit``.
Cores never validate again, and public functions never call each other for their work.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Union

import numpy as np

from ._format import ElementFormat, ElementFormatLike, MXFormat, MXFormatLike, element_format, mx_format
from ._rounding import check_overflow, check_rounding
from ._scale_rules import ScaleRule


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


class _Randomness:
    """What an options object with a ``rounding`` field answers about random words."""

    rounding: str

    @property
    def stochastic(self) -> bool:
        return self.rounding == "stochastic"

    def check_key(self, key, random_bits=None) -> None:
        """Stochastic rounding needs a key or random words (one of them); every other mode
        refuses both."""
        _check_key(self.rounding, key, random_bits)


@dataclasses.dataclass(frozen=True)
class ElementCast(_Randomness):
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


@dataclasses.dataclass(frozen=True)
class MXCast(_Randomness):
    """How an array is block-quantized (the options of ``quantize_mx``/``fake_quantize_mx``).

    Elements always saturate to ± the element maximum (OCP MX v1.0). The format's scale
    scheme canonicalizes the options: ``scale_rule`` chooses E8M0 block scales (None: the
    default, ``ScaleRule.FLOOR``); a scheme with its own recipe (NVFP4: E4M3 block scales
    under a float32 tensor scale) records None, whatever rule is passed, so that one rule can
    be given for all the operands of a dot — the public quantizers refuse an explicit rule
    for such a format (see :func:`check_no_scale_rule`) — and NVFP4's ``nvfp4_step``
    (``_scheme_nvfp4.NVFP4_STEPS``; default ``"divide"``) says how elements are divided by
    their scales.

    Example:
        >>> MXCast("mxfp8", scale_rule="rceil")
        MXCast(fmt=MXFormat('mxfp8_e4m3'), scale_rule=<ScaleRule.RCEIL: 'rceil'>, rounding='nearest_even', nvfp4_step=None)
        >>> c = MXCast("nvfp4")
        >>> c.scale_rule is None, c.nvfp4_step
        (True, 'divide')
    """

    fmt: MXFormat
    scale_rule: Optional[ScaleRule] = None
    rounding: str = "nearest_even"
    nvfp4_step: Optional[str] = None

    def __post_init__(self):
        fmt = mx_format(self.fmt)
        object.__setattr__(self, "fmt", fmt)
        object.__setattr__(self, "nvfp4_step", fmt.scheme.step_option(self.nvfp4_step, fmt.name))
        object.__setattr__(self, "scale_rule", fmt.scheme.scale_rule_option(self.scale_rule))
        object.__setattr__(self, "rounding", check_rounding(fmt.element, self.rounding))


def check_no_scale_rule(fmt: MXFormat, scale_rule, func: str) -> None:
    """A format whose scale scheme takes no rule (NVFP4's own recipe) refuses an explicit
    ``scale_rule``."""
    if not fmt.scheme.takes_scale_rule and scale_rule is not None:
        raise ValueError(
            f"{func}: {fmt.name} block scales follow {fmt.scheme.recipe}, so scale_rule does "
            f"not apply; got scale_rule={str(scale_rule)!r}. Drop it (scale rules choose E8M0 "
            "scales)"
        )


def check_tensor_scale(fmt: MXFormat, tensor_scale, func: str):
    """``tensor_scale`` as the float32 scalar the encoder takes (None: computed from the
    input), as the format's scale scheme accepts it."""
    return fmt.scheme.tensor_scale_option(tensor_scale, fmt.name, func)


ElementCastLike = Union[ElementCast, ElementFormatLike]
MXCastLike = Union[MXCast, MXFormatLike]
