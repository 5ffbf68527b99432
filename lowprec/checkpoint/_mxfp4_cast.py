"""One MXFP4 tensor of a checkpoint cast to NVFP4 (:func:`lowprec.mxfp4_to_nvfp4`), or
refused with its name and the fix: shared by the safetensors cast (``_cast``) and GGUF's
(``_gguf``)."""

from __future__ import annotations

import numpy as np

from ._errors import CheckpointError

_E8M0_NAN = 0xFF  # the E8M0 scale code of a NaN block


def cast_mxfp4(mx, name: str):
    """:func:`lowprec.mxfp4_to_nvfp4` of the tensor ``name``, refusing (naming it, its NaN
    blocks and the fix) one that holds a NaN block: the cast keeps each E2M1 code under a new
    scale, and a block whose E8M0 scale is the NaN code has none that NVFP4 could keep."""
    from .._mxfp4_nvfp4 import mxfp4_to_nvfp4  # noqa: PLC0415 - JAX, imported where used

    nan = int(np.count_nonzero(np.asarray(mx.scales) == _E8M0_NAN))
    if nan:
        blocks = int(np.asarray(mx.scales).size)
        raise CheckpointError(
            f"{name!r}: {nan} of its {blocks} MXFP4 blocks are NaN (E8M0 scale 0xFF: a NaN in "
            "the quantized input); the exact cast to NVFP4 keeps each code under a new scale "
            "and has none for a NaN block. Dequantize the file (lowprec dequantize IN DENSE) "
            "and quantize that (lowprec quantize DENSE OUT -f nvfp4): NaN blocks stay NaN")
    return mxfp4_to_nvfp4(mx)
