"""Expected values from outside lowprec: ml_dtypes' ``astype`` and the reference's decode.

Nothing here calls lowprec: the ml_dtypes dtype of a format comes from the data table
(``formats/elements.json``), so these oracles also serve the reference's own tests.
"""

from __future__ import annotations

import functools

import ml_dtypes
import numpy as np

import lowprec_formats
import lowprec_reference

from .asserts import bit_pattern


def ml_dtype(fmt: str) -> np.dtype:
    """The ml_dtypes / NumPy dtype with ``fmt``'s layout (from the data table)."""
    name = lowprec_formats.ELEMENT_FORMATS[fmt]["ml_dtypes"]
    if name is None:
        raise ValueError(f"{fmt} has no ml_dtypes dtype")
    return np.dtype(getattr(ml_dtypes, name, None) or name)


def ml_dtypes_codes(fmt: str, x: np.ndarray) -> np.ndarray:
    """Codes of ml_dtypes' astype (the default-mode contract) for a float array x."""
    dt = ml_dtype(fmt)
    with np.errstate(all="ignore"):
        y = np.asarray(x).astype(dt)
    return bit_pattern(y)


def ml_dtypes_values(fmt: str, codes: np.ndarray) -> np.ndarray:
    """float32 values of codes, as ml_dtypes reads them."""
    dt = ml_dtype(fmt)
    codes = np.asarray(codes).astype(np.uint16 if dt.itemsize == 2 else np.uint8)
    return codes.view(dt).astype(np.float32)


@functools.lru_cache(maxsize=None)
def _ref_values(fmt: str, codes_bytes: bytes, dtype: str) -> np.ndarray:
    codes = np.frombuffer(codes_bytes, dtype=np.dtype(dtype))
    values = lowprec_reference.decode(fmt, codes)
    values.setflags(write=False)  # shared by every caller
    return values


def ref_values(fmt: str, codes: np.ndarray) -> np.ndarray:
    """float64 values of codes by the reference's decode (cached per distinct array)."""
    codes = np.ascontiguousarray(codes)
    return _ref_values(fmt, codes.tobytes(), codes.dtype.str).reshape(codes.shape)
