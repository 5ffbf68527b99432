"""Block layout: the block axis moved last and split into (blocks, block_size), and back.

Also the one validation of an array about to be blocked (dtype, rank, axis, length).
"""

from __future__ import annotations

import operator

import jax.numpy as jnp
import numpy as np

from ._codec import _WIDENED_AS
from ._format import MXFormat

# Block formats read float32 (or narrower: float16, bfloat16, the ml_dtypes floats, all
# widened exactly) input; float64 would need its own block max.
_BLOCK_INPUT_DTYPES = (np.dtype(np.float32), *_WIDENED_AS)


def normalize_axis(axis, ndim: int, what: str = "axis") -> int:
    """``axis`` as a non-negative int; a clear error for a non-integer or out-of-range one."""
    try:
        axis = operator.index(axis)
    except TypeError:
        raise TypeError(f"{what} must be an integer, got {axis!r}") from None
    if not -ndim <= axis < ndim:
        raise ValueError(
            f"{what} {axis} is out of range for an array of rank {ndim} "
            f"(valid: {-ndim}..{ndim - 1})"
        )
    return axis % ndim


def blocked(x, axis: int, block: int):
    """Moves ``axis`` last and splits it into (n / block, block)."""
    x = jnp.moveaxis(x, axis, -1)
    return x.reshape(*x.shape[:-1], x.shape[-1] // block, block)


def unblocked(x, axis: int):
    """Inverse of :func:`blocked`."""
    x = x.reshape(*x.shape[:-2], x.shape[-2] * x.shape[-1])
    return jnp.moveaxis(x, -1, axis)


def split_blocks(x, axis: int, block: int):
    """Splits ``axis`` in place into (n / block, block): a reshape, no data movement.

    The block index stays at ``axis`` and the position within a block is ``axis + 1``, so
    per-block values reduced over ``axis + 1`` already have the MXArray scales layout, and
    no transpose is needed whatever the axis (XLA vectorizes a reduction over a non-minor
    axis along the minor one).
    """
    return x.reshape(*x.shape[:axis], x.shape[axis] // block, block, *x.shape[axis + 1 :])


def merge_blocks(x, axis: int):
    """Inverse of :func:`split_blocks`: merges ``axis`` and ``axis + 1``."""
    return x.reshape(*x.shape[:axis], x.shape[axis] * x.shape[axis + 1], *x.shape[axis + 2 :])


def check_block_input(shape, dtype, fmt: MXFormat, axis, pad: bool, func: str):
    """Validates an array to be split into blocks of ``fmt``; returns ``(axis, n, padded_n)``."""
    dtype = np.dtype(dtype)
    if dtype not in _BLOCK_INPUT_DTYPES:
        raise TypeError(
            f"{func} takes float32, bfloat16, float16 or ml_dtypes float input, got dtype "
            f"{dtype}; convert with x.astype(jnp.float32)"
        )
    if len(shape) == 0:
        raise ValueError(f"{func} needs at least a 1-D array (blocks run along an axis)")
    axis = normalize_axis(axis, len(shape))
    n = shape[axis]
    block = fmt.block_size
    padded = -(-n // block) * block
    if n % block and not pad:
        raise ValueError(
            f"axis {axis} has length {n}, not a multiple of the {fmt.name} block size {block}; "
            f"pass pad=True to zero-pad it to {padded} (dequantize drops the padding), or "
            "choose another axis"
        )
    return axis, n, padded
