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
from ._matmul import BACKWARD_MODES, OPERAND_FORMAT_NAMES, dot_general, matmul, mxfp4_gemv
from ._mx import (
    DEFAULT_SCALE_RULE,
    SCALE_RULES,
    MXArray,
    dequantize,
    fake_quantize_mx,
    from_gpt_oss,
    quantize_mx,
    to_gpt_oss,
)
from ._pack import pack_fp4, unpack_fp4
from ._rounding import OVERFLOW_POLICIES, ROUNDING_MODES

__version__ = "0.1.0"

__all__ = [
    "BACKWARD_MODES",
    "OPERAND_FORMAT_NAMES",
    "DEFAULT_SCALE_RULE",
    "ELEMENT_FORMAT_NAMES",
    "MX_FORMAT_NAMES",
    "OVERFLOW_POLICIES",
    "ROUNDING_MODES",
    "SCALE_RULES",
    "ElementFormat",
    "MXArray",
    "MXFormat",
    "decode",
    "dequantize",
    "dot_general",
    "element_format",
    "encode",
    "fake_quantize_mx",
    "matmul",
    "from_gpt_oss",
    "mx_format",
    "mxfp4_gemv",
    "pack_fp4",
    "quantize",
    "quantize_mx",
    "to_gpt_oss",
    "unpack_fp4",
]
