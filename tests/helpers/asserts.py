"""Bit-exact assertions with readable reports, and the one ``bit_pattern`` of the suite.

``bit_pattern`` is how a test reads the bits of an array; ``assert_codes_equal`` compares
integer codes, ``assert_bits_equal`` compares any two arrays bit for bit (NaN payloads and
the sign of zero included), ``assert_same_values`` compares float values with any NaN equal
to any NaN.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

BLOCK = 32

_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def bit_pattern(a) -> np.ndarray:
    """The bits of each element of ``a`` as the unsigned integer of the same width.

    ``a``: a NumPy or JAX array (or anything ``np.asarray`` takes) of a 1, 2, 4 or 8-byte
    dtype: float32 -> uint32, float16 / bfloat16 -> uint16, the float8 / float6 / float4
    types of ml_dtypes (one byte each) and integer codes -> uint8 ... A view for NumPy input.
    """
    a = np.asarray(a)
    if a.dtype.itemsize not in _UNSIGNED:
        raise TypeError(f"bit_pattern: no unsigned integer of {a.dtype}'s width")
    return a.view(_UNSIGNED[a.dtype.itemsize])


def _exactly_float32(values) -> np.ndarray:
    """``values`` as float32, asserting that the conversion is exact (NaN aside)."""
    v = np.asarray(values)
    v32 = v.astype(np.float32)
    same = (v32.astype(v.dtype) == v) | np.isnan(v)
    assert same.all(), f"not exactly float32: {v[~same][:5]}"
    return v32


def describe(v) -> str:
    """A float with its bit pattern, e.g. ``0.1 (float32 0x3dcccccd)``."""
    v = np.asarray(v)
    return f"{float(v)!r} ({v.dtype.name} 0x{int(bit_pattern(v)):0{2 * v.dtype.itemsize}x})"


def _describe_block(x, axis: int, index, block: int) -> str:
    """The input block holding ``index`` (values and bits)."""
    xm = np.moveaxis(np.asarray(x), axis, -1)
    idx = list(index)
    moved = idx[:axis] + idx[axis + 1 :] + [idx[axis]]
    start = moved[-1] // block * block
    row = xm[tuple(moved[:-1])][start : start + block]
    return ", ".join(describe(v) for v in row)


def assert_codes_equal(
    got, want, x=None, what: str = "", *, axis: Optional[int] = None, per_block: bool = False,
    nan: Optional[tuple] = None, block: int = BLOCK,
) -> None:
    """Exact equality of two code arrays, reporting the inputs behind the first differences.

    Args:
      got, want: integer code arrays of one shape.
      x: the inputs, to show beside each difference: element-wise, or (with ``axis``) the
        whole MX block along ``axis`` that holds the difference.
      what: a label for the report.
      axis: the MX block axis of ``x`` (element codes share x's shape along it).
      per_block: ``got``/``want`` hold one code per block along ``axis`` (scales).
      nan: ``(got_is_nan, want_is_nan)`` boolean arrays: where ``want`` is NaN, ``got``
        only needs to be NaN too (NaN payloads aside), elsewhere the codes must be equal.
      block: the block size along ``axis``.
    """
    got = np.asarray(got)
    want = np.asarray(want)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != expected {want.shape}"
    bad = got.astype(np.int64) != want.astype(np.int64)
    if nan is not None:
        got_nan, want_nan = (np.asarray(v, bool) for v in nan)
        bad = (got_nan != want_nan) | (~want_nan & bad)
    if not bad.any():
        return
    lines = [f"{what}: {int(bad.sum())} of {bad.size} codes differ"]
    for flat in np.flatnonzero(bad.ravel())[:8]:
        i = np.unravel_index(flat, bad.shape)
        ctx = ""
        if x is not None and axis is not None:
            xi = list(i)
            if per_block:
                xi[axis] *= block
            ctx = f" input block: [{_describe_block(x, axis, xi, block)}]"
        elif x is not None:
            ctx = f" x={describe(np.asarray(x)[i])}"
        lines.append(
            f"  [{', '.join(map(str, i))}] got=0x{int(got[i]):x} want=0x{int(want[i]):x}{ctx}"
        )
    raise AssertionError("\n".join(lines))


def assert_bits_equal(got, want, what: str = "") -> None:
    """Bit-for-bit equality of two arrays of one shape and element width (float or integer):
    NaN payloads and the sign of zero count. Reported as :func:`assert_codes_equal` does."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype.itemsize == want.dtype.itemsize, (
        f"{what}: {got.dtype} is not as wide as the expected {want.dtype}"
    )
    assert_codes_equal(bit_pattern(got), bit_pattern(want), what=what)


def assert_same_values(got, want, x=None, what: str = "") -> None:
    """Bit-for-bit equality of float values (as float32 patterns; NaN compared as 'is NaN')."""
    got = np.asarray(got)
    want = np.asarray(want)
    assert got.shape == want.shape, (got.shape, want.shape)
    gnan, wnan = np.isnan(got), np.isnan(want)
    bad = (gnan != wnan) | (
        ~gnan & ~wnan & (bit_pattern(_exactly_float32(np.where(gnan, 0, got)))
                         != bit_pattern(_exactly_float32(np.where(wnan, 0, want))))
    )
    if bad.any():
        idx = np.flatnonzero(bad.ravel())[:8]
        lines = [f"{what}: {bad.sum()} of {bad.size} values differ"]
        for i in idx:
            xi = "" if x is None else f"x={describe(np.asarray(x).ravel()[i])} "
            lines.append(f"  [{i}] {xi}got={got.ravel()[i]!r} want={want.ravel()[i]!r}")
        raise AssertionError("\n".join(lines))


def assert_same_floats(got, want, what: str = "") -> None:
    """Equal as float32 bit patterns, except that any NaN equals any NaN."""
    assert_same_values(np.asarray(got, np.float32), np.asarray(want, np.float32), what=what)
