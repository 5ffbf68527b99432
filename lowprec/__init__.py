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

from ._lazy import resolve_public

# The public names and the module defining each (or the module and the name there), imported
# on first use by __getattr__ below (PEP 562): `import lowprec` imports no JAX (0.06 CPU s,
# not 1.3), so the checkpoint command line, whose native path needs none, starts without it.
_PUBLIC = {
    "ScaleScheme": "_scheme",
    "register_scale_scheme": ("_scheme", "register"),
    "decode": "_codec",
    "encode": "_codec",
    "quantize": "_codec",
    "FormatInfo": "_finfo",
    "finfo": "_finfo",
    "ELEMENT_FORMAT_NAMES": "_format",
    "MX_FORMAT_NAMES": "_format",
    "SCALE_SCHEME_NAMES": "_format",
    "ElementFormat": "_format",
    "ElementFormatLike": "_format",
    "FormatLike": "_format",
    "MXFormat": "_format",
    "MXFormatLike": "_format",
    "element_format": "_format",
    "mx_format": "_format",
    "resolve_format": "_format",
    "scale_scheme": "_format",
    "p3109": "_p3109",
    "from_gpt_oss": "_gpt_oss",
    "to_gpt_oss": "_gpt_oss",
    "dot_general": "_matmul",
    "matmul": "_matmul",
    "PreparedWeight": "_prepared",
    "prepare_weight": "_prepared",
    "weight_only_matmul": "_weight_only",
    "dequantize": "_mx",
    "fake_quantize_mx": "_mx",
    "quantize_mx": "_mx",
    "shared_exponents": "_mx",
    "CastReport": "_mxfp4_nvfp4",
    "mxfp4_to_nvfp4": "_mxfp4_nvfp4",
    "MXArray": "_mxarray",
    "MXPlusArray": "_mx_plus",
    "dequantize_mx_plus": "_mx_plus",
    "quantize_mx_plus": "_mx_plus",
    "ragged_dot": "_ragged",
    "pack_fp4": "_pack_api",
    "pack_fp6": "_pack_api",
    "unpack_fp4": "_pack_api",
    "unpack_fp6": "_pack_api",
    "OPERAND_FORMAT_NAMES": "_options",
    "BackwardMode": "_options",
    "FP8_DELAYED": "_recipe",
    "FP8_HYBRID": "_recipe",
    "NVIDIA_MXFP8": "_recipe",
    "NVIDIA_NVFP4": "_recipe",
    "OCP_MXFP8": "_recipe",
    "RECIPES": "_recipe",
    "Recipe": "_recipe",
    "TE_NVFP4_OPTIONS": "_nvfp4_train",
    "Rule": "_rules",
    "Rules": "_rules",
    "DelayedScaling": "_delayed",
    "DelayedState": "_delayed",
    "delayed_dot_general": "_delayed",
    "random_bits": "_random",
    "stochastic_rounding_key": "_rounding_key",
    "Overflow": "_rounding",
    "Rounding": "_rounding",
    "ScaleRule": "_scale_rules",
    "NVFP4Step": "_scheme_nvfp4",
}

#: Block sizes every block format accepts (``mx_format(fmt, block_size=...)``).
BLOCK_SIZES: tuple[int, ...] = _formats_data.BLOCK_SIZES

__version__ = "0.1.0"

# Subpackages imported at their first read: `lowprec.flax` / `lowprec.optim` need the
# `training` extra (flax, optax); `lowprec.kernels` imports JAX.
_SUBMODULES_ON_FIRST_READ = ("flax", "optim", "kernels")


# Old second spellings of a vocabulary (and a kernel entry now in lowprec.kernels): what to
# use instead, and the value, still returned with a DeprecationWarning.
_DEPRECATED = {
    "ROUNDING_MODES": ("lowprec.Rounding (its members are the mode names)",
                       lambda: _formats_data.ROUNDING_MODES),
    "OVERFLOW_POLICIES": ("lowprec.Overflow",
                          lambda: tuple(p.value for p in _public("Overflow"))),
    "SCALE_RULES": ("lowprec.ScaleRule", lambda: tuple(r.value for r in _public("ScaleRule"))),
    "DEFAULT_SCALE_RULE": ("lowprec.ScaleRule.FLOOR, the default of every scale_rule=",
                           lambda: _public("ScaleRule").FLOOR),
    "BACKWARD_MODES": ("lowprec.BackwardMode",
                       lambda: tuple(m.value for m in _public("BackwardMode"))),
    "mxfp4_gemv": ("lowprec.kernels.mxfp4_gemv", lambda: _kernels_mxfp4_gemv()),
}


def _public(name):
    return resolve_public(__name__, _PUBLIC, globals(), name)


def _kernels_mxfp4_gemv():
    from .kernels import mxfp4_gemv

    return mxfp4_gemv


def __getattr__(name):
    if name in _PUBLIC:
        return _public(name)
    if name in _SUBMODULES_ON_FIRST_READ:
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    from ._deprecated import deprecated_attribute

    return deprecated_attribute(__name__, _DEPRECATED, name)


def __dir__():
    return sorted(set(globals()) | set(__all__))


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
