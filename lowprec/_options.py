"""Validated quantization options: what every public function checks, checked once.

A public function turns its keyword arguments into one of these frozen, hashable objects
(its ``__post_init__`` validates and canonicalizes every field, with messages that name the
value and the fix) and hands it to a private core as a static argument of ``jax.jit``.
Cores never validate again, and public functions never call each other for their work.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Union

import jax.numpy as jnp

import numpy as np

from ._format import ElementFormat, ElementFormatLike, MXFormat, MXFormatLike, element_format, mx_format
from ._rounding import check_overflow, check_rounding
from ._scale_rules import DEFAULT_SCALE_RULE, ScaleRule, check_scale_rule


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
            f"key is only used by rounding='stochastic', but rounding={str(rounding)!r}; "
            "drop the key or choose rounding='stochastic'"
        )
    if rounding != "stochastic" and random_bits is not None:
        raise ValueError(
            f"random_bits is only used by rounding='stochastic', but rounding={str(rounding)!r}; "
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
        ElementCast(fmt=ElementFormat('e8m0'), rounding=<Rounding.DOWN: 'down'>,
                    overflow=<Overflow.IEEE: 'ieee'>)
    """

    fmt: ElementFormat
    rounding: str = "nearest_even"
    overflow: str = "ieee"

    def __post_init__(self):
        fmt = element_format(self.fmt)
        object.__setattr__(self, "fmt", fmt)
        object.__setattr__(self, "rounding", check_rounding(fmt, self.rounding))
        object.__setattr__(self, "overflow", check_overflow(self.overflow))


# How an NVFP4 element is brought to E2M1's range before rounding (docs/design.md §3b). The
# two differ only where the float32 quotient lands exactly on an E2M1 rounding boundary.
NVFP4_STEPS = {
    # torchao <= 0.16 (nvfp4_tensor.nvfp4_quantize): one division by float32(ts * s).
    "divide": "x / float32(tensor_scale * block_scale)  (torchao <= 0.16)",
    # torchao >= 0.17 (its PR #4031, as NVIDIA's MSLK kernels): a product with a reciprocal.
    "reciprocal": "x * float32(float32(1 / tensor_scale) / block_scale)  (torchao >= 0.17)",
}
DEFAULT_NVFP4_STEP = "divide"


def check_nvfp4_step(fmt: MXFormat, step) -> Optional[str]:
    """The NVFP4 element step for ``fmt`` (None for formats without a tensor scale)."""
    if not fmt.tensor_scale:
        if step is not None:
            raise ValueError(
                f"nvfp4_step applies to NVFP4 (E4M3 block scales under a tensor scale), not to "
                f"{fmt.name}; drop it")
        return None
    if step is None:
        return DEFAULT_NVFP4_STEP
    if step not in NVFP4_STEPS:
        raise ValueError(
            f"unknown nvfp4_step {step!r}; choose one of: "
            + "; ".join(f"{k!r} = {v}" for k, v in NVFP4_STEPS.items()))
    return step


@dataclasses.dataclass(frozen=True)
class MXCast(_Randomness):
    """How an array is block-quantized (the options of ``quantize_mx``/``fake_quantize_mx``).

    Elements always saturate to ± the element maximum (OCP MX v1.0). ``scale_rule`` chooses
    E8M0 block scales (None: the default, ``ScaleRule.FLOOR``); a format with its own scale
    recipe (NVFP4: E4M3 block scales under a float32 tensor scale) records None, whatever
    rule is passed, and its ``nvfp4_step`` (:data:`NVFP4_STEPS`; default ``"divide"``) says how
    elements are divided by their scales, so that one rule can be given for all the operands of a dot — the public
    quantizers refuse an explicit rule for such a format (see :func:`check_no_scale_rule`).

    Example:
        >>> MXCast("mxfp8", scale_rule="rceil")
        MXCast(fmt=MXFormat('mxfp8_e4m3'), scale_rule=<ScaleRule.RCEIL: 'rceil'>,
               rounding=<Rounding.NEAREST_EVEN: 'nearest_even'>, nvfp4_step=None)
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
        object.__setattr__(self, "nvfp4_step", check_nvfp4_step(fmt, self.nvfp4_step))
        rule = None
        if not fmt.tensor_scale:
            rule = DEFAULT_SCALE_RULE if self.scale_rule is None else check_scale_rule(self.scale_rule)
        object.__setattr__(self, "scale_rule", rule)
        object.__setattr__(self, "rounding", check_rounding(fmt.element, self.rounding))


def check_no_scale_rule(fmt: MXFormat, scale_rule, func: str) -> None:
    """A format with its own scale recipe (NVFP4) takes no ``scale_rule``: raise if given."""
    if fmt.tensor_scale and scale_rule is not None:
        raise ValueError(
            f"{func}: {fmt.name} block scales follow the NVFP4 recipe (E4M3 of "
            "amax / 6 / tensor_scale), so scale_rule does not apply; got "
            f"scale_rule={str(scale_rule)!r}. Drop it (scale rules choose E8M0 scales)"
        )


def check_tensor_scale(fmt: MXFormat, tensor_scale, func: str):
    """``tensor_scale`` for a format that has one (None: computed from the input), as a
    float32 scalar; a ValueError for a format without one or an invalid Python number."""
    if not fmt.tensor_scale:
        if tensor_scale is not None:
            raise ValueError(
                f"{func}: {fmt.name} has no tensor scale (only NVFP4 does); drop tensor_scale"
            )
        return None
    if tensor_scale is None:
        return None
    if isinstance(tensor_scale, (int, float)):
        if not (math.isfinite(tensor_scale) and tensor_scale > 0):
            raise ValueError(
                f"{func}: tensor_scale must be a positive finite number, got {tensor_scale!r}"
            )
    ts = jnp.asarray(tensor_scale, jnp.float32)
    if ts.shape != ():
        raise ValueError(f"{func}: tensor_scale must be a scalar, got shape {ts.shape}")
    return ts


ElementCastLike = Union[ElementCast, ElementFormatLike]
MXCastLike = Union[MXCast, MXFormatLike]
