"""Block layout: the block axis split in place into (blocks, block_size) and merged back; the
normalization of an axis argument."""

from __future__ import annotations

import operator


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
