"""lowprec: bit-exact low-precision number formats in JAX.

Element formats (FP16, BF16, TF32, FP8 E4M3/E5M2, FP4 E2M1, E8M0) with every rounding mode
and overflow policy named, and the OCP MX block formats (MXFP8, MXFP4).

Example:
    >>> import jax.numpy as jnp
    >>> import lowprec
    >>> lowprec.quantize("e4m3", jnp.array([0.1, 300.0])).tolist()
    [0.1015625, 288.0]
"""

from ._codec import decode, encode, quantize
from ._format import (
    ELEMENT_FORMAT_NAMES,
    MX_FORMAT_NAMES,
    ElementFormat,
    MXFormat,
    element_format,
    mx_format,
)
from ._rounding import OVERFLOW_POLICIES, ROUNDING_MODES

__version__ = "0.1.0"

__all__ = [
    "ELEMENT_FORMAT_NAMES",
    "MX_FORMAT_NAMES",
    "OVERFLOW_POLICIES",
    "ROUNDING_MODES",
    "ElementFormat",
    "MXFormat",
    "decode",
    "element_format",
    "encode",
    "mx_format",
    "quantize",
]
