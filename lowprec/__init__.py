"""lowprec: bit-exact low-precision number formats in JAX.

Element formats (FP16, BF16, TF32, every ml_dtypes FP8/FP6/FP4, E8M0, the MX INT8 element and
the parametric IEEE P3109 formats) with every rounding mode and overflow policy named, and the
block formats (OCP MXFP8, MXFP6, MXFP4, MXINT8 at any block size, NVFP4, and the 2026
four-bit formats Four over Six, IF4, MixFP4 and MX+). Every function takes the array first
and the format second.

Example:
    >>> import jax.numpy as jnp
    >>> import lowprec
    >>> lowprec.quantize(jnp.array([0.1, 300.0]), "e4m3").tolist()
    [0.1015625, 288.0]
"""

import lowprec_formats as _formats_data

from ._scheme import ScaleScheme, register as register_scale_scheme
from ._codec import decode, encode, quantize
from ._finfo import FormatInfo, finfo
from ._format import (
    ELEMENT_FORMAT_NAMES,
    MX_FORMAT_NAMES,
    SCALE_SCHEME_NAMES,
    ElementFormat,
    ElementFormatLike,
    FormatLike,
    MXFormat,
    MXFormatLike,
    element_format,
    mx_format,
    resolve_format,
    scale_scheme,
)
from ._p3109 import p3109
from ._gpt_oss import from_gpt_oss, to_gpt_oss
from ._matmul import dot_general, matmul
from ._prepared import PreparedWeight, prepare_weight
from ._weight_only import weight_only_matmul
from ._mx import dequantize, fake_quantize_mx, quantize_mx, shared_exponents
from ._mxfp4_nvfp4 import CastReport, mxfp4_to_nvfp4
from ._mxarray import MXArray
from ._mx_plus import MXPlusArray, dequantize_mx_plus, quantize_mx_plus
from ._ragged import ragged_dot
from ._pack_api import pack_fp4, pack_fp6, unpack_fp4, unpack_fp6
from ._options import OPERAND_FORMAT_NAMES, BackwardMode
from ._recipe import (FP8_DELAYED, FP8_HYBRID, NVIDIA_MXFP8, NVIDIA_NVFP4, OCP_MXFP8, RECIPES,
                      Recipe)
from ._nvfp4_train import TE_NVFP4_OPTIONS
from ._rules import Rule, Rules
from ._delayed import DelayedScaling, DelayedState, delayed_dot_general
from ._random import random_bits
from ._rounding_key import stochastic_rounding_key
from ._rounding import Overflow, Rounding
from ._scale_rules import ScaleRule
from ._scheme_nvfp4 import NVFP4Step

#: Block sizes every block format accepts (``mx_format(fmt, block_size=...)``).
BLOCK_SIZES: tuple[int, ...] = _formats_data.BLOCK_SIZES

__version__ = "0.1.0"

_OPTIONAL_SUBMODULES = ("flax", "optim")  # need the `training` extra (flax, optax)


# Old second spellings of a vocabulary (and a kernel entry now in lowprec.kernels): what to
# use instead, and the value, still returned with a DeprecationWarning.
_DEPRECATED = {
    "ROUNDING_MODES": ("lowprec.Rounding (its members are the mode names)",
                       lambda: _formats_data.ROUNDING_MODES),
    "OVERFLOW_POLICIES": ("lowprec.Overflow", lambda: tuple(p.value for p in Overflow)),
    "SCALE_RULES": ("lowprec.ScaleRule", lambda: tuple(r.value for r in ScaleRule)),
    "DEFAULT_SCALE_RULE": ("lowprec.ScaleRule.FLOOR, the default of every scale_rule=",
                           lambda: ScaleRule.FLOOR),
    "BACKWARD_MODES": ("lowprec.BackwardMode", lambda: tuple(m.value for m in BackwardMode)),
    "mxfp4_gemv": ("lowprec.kernels.mxfp4_gemv", lambda: _kernels_mxfp4_gemv()),
}


def _kernels_mxfp4_gemv():
    from .kernels import mxfp4_gemv

    return mxfp4_gemv


def __getattr__(name):
    # `lowprec.flax` / `lowprec.optim` import on first use, so `import lowprec` needs neither.
    if name in _OPTIONAL_SUBMODULES:
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    from ._deprecated import deprecated_attribute

    return deprecated_attribute(__name__, _DEPRECATED, name)


__all__ = [
    "BLOCK_SIZES",
    "BackwardMode",
    "FP8_DELAYED",
    "FP8_HYBRID",
    "NVIDIA_MXFP8",
    "NVIDIA_NVFP4",
    "TE_NVFP4_OPTIONS",
    "OCP_MXFP8",
    "RECIPES",
    "Recipe",
    "Rounding",
    "Rule",
    "Rules",
    "DelayedScaling",
    "DelayedState",
    "delayed_dot_general",
    "ELEMENT_FORMAT_NAMES",
    "MX_FORMAT_NAMES",
    "OPERAND_FORMAT_NAMES",
    "Overflow",
    "SCALE_SCHEME_NAMES",
    "CastReport",
    "ElementFormat",
    "ElementFormatLike",
    "FormatInfo",
    "FormatLike",
    "MXArray",
    "MXFormat",
    "MXPlusArray",
    "MXFormatLike",
    "NVFP4Step",
    "PreparedWeight",
    "ScaleRule",
    "ScaleScheme",
    "decode",
    "dequantize",
    "dequantize_mx_plus",
    "dot_general",
    "element_format",
    "encode",
    "fake_quantize_mx",
    "finfo",
    "from_gpt_oss",
    "matmul",
    "mx_format",
    "mxfp4_to_nvfp4",
    "p3109",
    "prepare_weight",
    "pack_fp4",
    "pack_fp6",
    "quantize",
    "quantize_mx",
    "quantize_mx_plus",
    "ragged_dot",
    "random_bits",
    "register_scale_scheme",
    "resolve_format",
    "scale_scheme",
    "shared_exponents",
    "stochastic_rounding_key",
    "to_gpt_oss",
    "unpack_fp4",
    "unpack_fp6",
    "weight_only_matmul",
]
