"""Independent reference implementation of lowprec's formats (pure NumPy + exact rationals).

``lowprec_reference`` recomputes, slowly and exactly, everything lowprec promises bit for bit:
element encode/decode for every format in :data:`lowprec_formats.ELEMENT_FORMATS` (IEEE 754
binary16, bfloat16, TF32, OCP FP8 E4M3/E5M2, the other ml_dtypes FP8s and FP6s, MX FP4 E2M1,
the MX INT8 element, E8M0 and UE5M3 scales, the tapered HiFloat8) and the IEEE P3109 family,
OCP MX v1.0 block quantization (MXFP8/6/4, MXINT8, any block size), NVFP4 by torchao's recipe,
the 2026 four-bit formats (Four over Six, IF4, MixFP4, MX+) as their authors compute them,
plus the published gpt-oss MXFP4 decoder and ggml's NVFP4 quantizer (``ggml.py``). It uses no JAX, no ml_dtypes arithmetic and no
lowprec code: every format is derived from the raw fields of the format table and every value
is rounded as a :class:`fractions.Fraction` (or, where a recipe is a sequence of float32
operations, with NumPy float32 scalars).

Example:
    >>> import numpy as np
    >>> from lowprec_reference import encode, decode
    >>> codes = encode("e5m2", np.array([1.0, 61440.0, -1e-9], np.float32))
    >>> codes.tolist(), decode("e5m2", codes).tolist()
    ([60, 124, 128], [1.0, inf, -0.0])
"""

from .element import (
    all_codes,
    code_dtype,
    decode,
    encode,
    encode_value,
    format_names,
    is_negative_code,
    max_finite,
    rounding_modes,
    value_of_code,
)
from .ggml import (
    ggml_nvfp4_blocks,
    ggml_nvfp4_decode,
    ggml_ue4m3,
    ggml_ue4m3_value,
    quantize_nvfp4_ggml,
)
from .mx import (
    FP4_VALUES,
    decode_gpt_oss,
    dequantize_mx,
    mx_block_size,
    mx_element_format,
    nvfp4_tensor_scale,
    pack_codes,
    quantize_mx,
    quantize_nvfp4,
    shared_exponent,
    unpack_codes,
)
from .four_bit import (
    dequantize_4over6,
    dequantize_if4,
    dequantize_mixfp4,
    dequantize_mx_plus,
    mixfp4_global_scale,
    quantize_4over6,
    quantize_if4,
    quantize_mixfp4,
    quantize_mx_plus,
)
from .random import random_bits, word_hash

__all__ = [
    "FP4_VALUES",
    "all_codes",
    "code_dtype",
    "decode",
    "decode_gpt_oss",
    "dequantize_4over6",
    "dequantize_if4",
    "dequantize_mixfp4",
    "dequantize_mx",
    "dequantize_mx_plus",
    "encode",
    "encode_value",
    "format_names",
    "ggml_nvfp4_blocks",
    "ggml_nvfp4_decode",
    "ggml_ue4m3",
    "ggml_ue4m3_value",
    "is_negative_code",
    "max_finite",
    "mixfp4_global_scale",
    "mx_block_size",
    "mx_element_format",
    "nvfp4_tensor_scale",
    "pack_codes",
    "quantize_4over6",
    "quantize_if4",
    "quantize_mixfp4",
    "quantize_mx",
    "quantize_mx_plus",
    "quantize_nvfp4",
    "quantize_nvfp4_ggml",
    "random_bits",
    "rounding_modes",
    "shared_exponent",
    "unpack_codes",
    "value_of_code",
    "word_hash",
]
