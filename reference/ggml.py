"""ggml's (llama.cpp's) NVFP4 quantizer, stated from its definition: the reference the
GGUF tests and the SQNR study compare with.

ggml's ``NVFP4`` (GGML type 40) stores 64 values in 36 bytes: four UE4M3 sub-block scales
(one per 16 values), then 32 bytes of E2M1 codes, sub-block s's element j (j < 8) in the low
nibble of byte 4 + 8s + j and element j + 8 in its high nibble. Its reference quantizer
(llama.cpp ``quantize_row_nvfp4_ref``; ``quantize_nvfp4`` calls it, ignoring an importance
matrix) takes no per-tensor scale:

* scale code = ``ggml_fp32_to_ue4m3(float32(amax / 6))``: zero for a non-positive value;
  values clamped to 448; below 2^-6 the subnormal code ``min(trunc(float32(float32(512 x) +
  0.5)), 7)`` (so [7.5, 8) x 2^-9 stays at code 7, never the normal 2^-6); from 2^-6 the
  significand rounded to 3 fraction bits half away from zero; an exponent of 8 or more
  (values from 248, after rounding, up to 448) gives code 0x7E, i.e. 448. Codes 0x78-0x7D
  (256 ... 416) are never written.
* scale value (``ggml_ue4m3_to_fp32`` without its factor 1/2, which ggml's doubled E2M1
  table undoes): 0 for codes 0x00 and 0x7F; otherwise from bits 6-3 (exponent, bias 7) and
  2-0 (mantissa), subnormal at exponent 0, bit 7 ignored.
* element code: the E2M1 value nearest x / scale (``best_index_mxfp4``: the first table
  entry of least |k d - x|, smaller magnitudes first), ties toward zero, saturating at ±6;
  every zero is code 0 (+0). A zero scale gives zero codes.

gguf-py 0.19 (``gguf.quants.NVFP4``) decodes these blocks and carries the scale encoder
(``fp32_to_ue4m3``) but no quantizer; tests/test_engine_rules.py checks this statement
against both. ggml's MXFP4 needs no statement of its own: it is
``quantize_mx(x, "mxfp4", scale_rule="floor_log2f", rounding="nearest_toward_zero")`` with
every zero written as code 0.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np

from .element import encode_value

__all__ = [
    "ggml_nvfp4_blocks",
    "ggml_nvfp4_decode",
    "ggml_ue4m3",
    "ggml_ue4m3_value",
    "quantize_nvfp4_ggml",
]

SUB_BLOCK = 16  # QK_NVFP4_SUB
SUPER_BLOCK = 64  # QK_NVFP4
_UE4M3_448 = 0x7E  # exponent field 15, mantissa 6: 1.75 x 2^8


def ggml_ue4m3(x) -> np.ndarray:
    """ggml's UE4M3 code (uint8) of each float32 value of ``x``.

    Example:
        >>> ggml_ue4m3(np.array([1.0, 1.0625, 300.0, 0.5 / 512, 0.0], np.float32)).tolist()
        [56, 57, 126, 1, 0]
    """
    x = np.asarray(x, np.float32)
    with np.errstate(invalid="ignore"):
        positive = x > 0  # NaN: False
        v = np.where(positive, np.minimum(x, np.float32(448.0)), np.float32(1.0))
    bits = v.view(np.uint32).astype(np.int64)
    exponent = (bits >> 23) - 127  # float32 subnormals read -127: below 2^-6 anyway
    # Below 2^-6: two float32 roundings (the product is exact, the sum is not), truncated.
    y = v * np.float32(512.0) + np.float32(0.5)
    sub = np.minimum(np.floor(y).astype(np.int64), 7)
    sub = np.where(sub >= 1, sub, 0)
    # From 2^-6: 3 fraction bits, half away from zero (add half a unit of the last kept bit).
    rounded = ((bits & 0x7F_FFFF) + (1 << 19)) >> 20  # 0 ... 8
    field = exponent + 7 + (rounded >> 3)
    normal = np.where(field >= 15, _UE4M3_448, (field << 3) | (rounded & 7))
    code = np.where(exponent + 7 <= 0, sub, np.where(exponent + 7 >= 15, _UE4M3_448, normal))
    return np.where(positive, code, 0).astype(np.uint8)


def ggml_ue4m3_value(code: int) -> Fraction:
    """The exact value of a ggml UE4M3 scale code (0 for 0x00 and 0x7F; bit 7 ignored).

    Example:
        >>> [str(ggml_ue4m3_value(c)) for c in (0x7E, 0x01, 0x7F, 0xFE)]
        ['448', '1/512', '0', '448']
    """
    code = int(code)
    if code in (0x00, 0x7F):
        return Fraction(0)
    e, m = (code >> 3) & 0xF, code & 0x7
    if e == 0:
        return Fraction(m, 512)
    return Fraction(8 + m, 8) * Fraction(2) ** (e - 7)


def quantize_nvfp4_ggml(x) -> tuple[np.ndarray, np.ndarray]:
    """ggml's NVFP4 quantization of the finite float32 array ``x`` along its last axis (a
    multiple of 16): ``(element codes, scale codes)``, uint8, codes unpacked in x's order.

    Example:
        >>> x = np.zeros(16, np.float32); x[:3] = [0.06, -0.01, 0.005]
        >>> e, s = quantize_nvfp4_ggml(x)
        >>> s.tolist(), e[:3].tolist()   # scale 5/512 (the subnormal code 5): 6, -1, 0.5
        ([5], [7, 10, 1])
    """
    x = np.asarray(x, np.float32)
    if not np.isfinite(x).all():
        raise ValueError("quantize_nvfp4_ggml states ggml's rule for finite input only")
    if x.shape[-1] % SUB_BLOCK:
        raise ValueError(f"the last axis ({x.shape[-1]}) must be a multiple of {SUB_BLOCK}")
    blocks = x.reshape(-1, SUB_BLOCK)
    with np.errstate(over="ignore"):
        quotients = np.abs(blocks).max(axis=1) / np.float32(6.0)  # one float32 division
    scales = ggml_ue4m3(quotients)
    codes = np.zeros(blocks.shape, np.uint8)
    for b, (row, code) in enumerate(zip(blocks, scales)):
        d = ggml_ue4m3_value(code)
        if d == 0:
            continue
        for i, t in enumerate(row.tolist()):
            c = encode_value("e2m1", Fraction(t) / d, "nearest_toward_zero", "saturate")
            codes[b, i] = 0 if c == 0x8 else c  # ggml has no -0
    return codes.reshape(x.shape), scales.reshape(*x.shape[:-1], -1)


def ggml_nvfp4_decode(codes, scales) -> np.ndarray:
    """float32 values of ggml NVFP4 element codes (unpacked, ``[..., n]``) under their
    sub-block scale codes (``[..., n / 16]``): E2M1 value x scale value, code 0x8 as +0."""
    codes = np.asarray(codes)
    scales = np.asarray(scales)
    e2m1 = [Fraction(v) for v in (0, 0.5, 1, 1.5, 2, 3, 4, 6)]
    table = np.array([[float((-1 if c & 8 and c & 7 else 1) * e2m1[c & 7] * ggml_ue4m3_value(s))
                       for c in range(16)] for s in range(256)])
    rows = np.repeat(scales.astype(np.int64), SUB_BLOCK, axis=-1)
    return table[rows, codes.astype(np.int64)].astype(np.float32)


def ggml_nvfp4_blocks(codes, scales) -> np.ndarray:
    """ggml's ``block_nvfp4`` bytes ``[..., n / 64, 36]`` of unpacked E2M1 codes ``[..., n]``
    and their scale codes ``[..., n / 16]`` (n a multiple of 64)."""
    codes = np.asarray(codes, np.uint8)
    lead, n = codes.shape[:-1], codes.shape[-1]
    c = codes.reshape(*lead, n // SUPER_BLOCK, 4, 2, 8)  # sub-block, half, j
    qs = (c[..., 0, :] | (c[..., 1, :] << 4)).reshape(*lead, n // SUPER_BLOCK, 32)
    d = np.asarray(scales, np.uint8).reshape(*lead, n // SUPER_BLOCK, 4)
    return np.concatenate([d, qs], axis=-1)
