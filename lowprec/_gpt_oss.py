"""The gpt-oss / Hugging Face MXFP4 checkpoint layout: ``*_blocks`` and ``*_scales``.

``blocks`` uint8 [..., K/32, 16] hold packed FP4 codes (element 2k in the low nibble of byte
k of a block), ``scales`` uint8 [..., K/32] the E8M0 codes; a value is
FP4_VALUES[nibble] × 2^(scale − 127). That is exactly an MXFP4 :class:`~lowprec.MXArray`
blocked along its last axis, reshaped.
"""

from __future__ import annotations

from typing import Optional, Union

import jax
import jax.numpy as jnp

from ._format import mx_format
from ._mxarray import MXArray
from ._scale_rules import ScaleRule, check_scale_rule


def to_gpt_oss(mx: MXArray) -> tuple[jax.Array, jax.Array]:
    """Exports an MXFP4 array in the gpt-oss / Hugging Face layout.

    Returns ``(blocks, scales)``: ``blocks`` uint8 [..., K/32, 16] (each byte holds element
    2k in its low nibble and 2k+1 in its high nibble) and ``scales`` uint8 [..., K/32]
    (E8M0 codes). The published decoder reads value = FP4_VALUES[nibble] × 2^(scale − 127).

    Raises:
      ValueError: unless ``mx`` is MXFP4, blocked along its last axis, without padding.

    Example:
        >>> import jax.numpy as jnp
        >>> import lowprec
        >>> blocks, scales = to_gpt_oss(lowprec.quantize_mx(jnp.ones((2, 64)), "mxfp4"))
        >>> blocks.shape, scales.shape
        ((2, 2, 16), (2, 2))
    """
    if mx.fmt.name != "mxfp4":
        raise ValueError(f"the gpt-oss layout holds MXFP4 only, got {mx.fmt.name!r}")
    if mx.axis != mx.ndim - 1:
        raise ValueError(
            f"the gpt-oss layout blocks the last axis; this array is blocked along axis "
            f"{mx.axis} of {mx.ndim}: quantize with axis=-1 (transpose first if needed)"
        )
    if mx.padded_length != mx.shape[-1]:
        raise ValueError(
            f"the gpt-oss layout has no padding; last axis {mx.shape[-1]} is not a multiple of 32"
        )
    groups = mx.scales.shape[-1]
    blocks = mx.elements.reshape(*mx.elements.shape[:-1], groups, mx.fmt.block_size // 2)
    return blocks, mx.scales


def from_gpt_oss(blocks, scales, scale_rule: Optional[Union[str, ScaleRule]] = None) -> MXArray:
    """Imports gpt-oss / Hugging Face MXFP4 ``*_blocks`` and ``*_scales`` as an :class:`MXArray`.

    Args:
      blocks: uint8 [..., G, 16] packed FP4 codes.
      scales: uint8 [..., G] E8M0 codes.
      scale_rule: the rule that produced the scales, if known (metadata only).

    Example:
        >>> import jax.numpy as jnp
        >>> import lowprec
        >>> mx = lowprec.quantize_mx(jnp.arange(64.0).reshape(1, 64), "mxfp4")
        >>> back = from_gpt_oss(*to_gpt_oss(mx))
        >>> bool((lowprec.dequantize(back) == lowprec.dequantize(mx)).all())
        True
    """
    blocks = jnp.asarray(blocks)
    scales = jnp.asarray(scales)
    rule = None if scale_rule is None else check_scale_rule(scale_rule)
    if blocks.dtype != jnp.uint8 or scales.dtype != jnp.uint8:
        raise TypeError(f"blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.ndim < 2 or blocks.shape[-1] != 16 or blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"expected blocks [..., G, 16] and scales [..., G], got {blocks.shape} and "
            f"{scales.shape}"
        )
    fmt = mx_format("mxfp4")
    elements = blocks.reshape(*blocks.shape[:-2], blocks.shape[-2] * 16)
    shape = tuple(scales.shape[:-1]) + (scales.shape[-1] * fmt.block_size,)
    return MXArray(elements, scales, fmt, len(shape) - 1, shape, rule)
