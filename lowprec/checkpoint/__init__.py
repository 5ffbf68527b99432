"""Checkpoint quantization: safetensors files to MXFP4 / MXFP8 / FP8 / BF16 and back.

Streams tensor by tensor, never loads pickles, writes atomically, and reports per-tensor
error (SQNR, max abs/rel error, clipped block maxima). The command line front end is
``lowprec quantize | dequantize | inspect`` (:mod:`lowprec.cli`).

Example:
    >>> import tempfile, numpy as np
    >>> from lowprec.checkpoint import SafetensorsWriter, quantize_checkpoint, load_checkpoint
    >>> d = tempfile.mkdtemp()
    >>> w = np.random.default_rng(0).normal(size=(64, 128)).astype(np.float32)
    >>> b = np.zeros(64, np.float32)
    >>> with SafetensorsWriter(f"{d}/m.safetensors",
    ...                        [("fc.weight", "F32", w.shape), ("fc.bias", "F32", b.shape)]) as f:
    ...     f.write("fc.weight", w); f.write("fc.bias", b)
    >>> rep = quantize_checkpoint(f"{d}/m.safetensors", f"{d}/q.safetensors", "mxfp8_e4m3")
    >>> [(t.name, t.format) for t in rep.tensors]
    [('fc.weight', 'mxfp8_e4m3'), ('fc.bias', 'kept')]
    >>> round(rep.tensors[0].sqnr_db) > 30
    True
    >>> sorted(load_checkpoint(f"{d}/q.safetensors"))
    ['fc.bias', 'fc.weight']
"""

from ._convert import (
    DEFAULT_KEEP_PATTERN,
    METADATA_KEY,
    dequantize_checkpoint,
    inspect_checkpoint,
    load_checkpoint,
    quantize_checkpoint,
    quantized_specs,
    select_tensor,
)
from ._report import ConversionReport, TensorReport
from ._safetensors import CheckpointError, SafetensorsReader, SafetensorsWriter, TensorInfo
from ._tensor import (
    CAST_FORMATS,
    FORMATS,
    LAYOUTS,
    MX_FORMATS,
    TensorSpec,
    canonical_format,
    dequantize_chunk,
    finite_amax,
    make_spec,
    quantize_chunk,
    tensor_scale,
)

__all__ = [
    "CAST_FORMATS",
    "DEFAULT_KEEP_PATTERN",
    "FORMATS",
    "LAYOUTS",
    "METADATA_KEY",
    "MX_FORMATS",
    "CheckpointError",
    "ConversionReport",
    "SafetensorsReader",
    "SafetensorsWriter",
    "TensorInfo",
    "TensorReport",
    "TensorSpec",
    "canonical_format",
    "dequantize_checkpoint",
    "dequantize_chunk",
    "finite_amax",
    "inspect_checkpoint",
    "load_checkpoint",
    "make_spec",
    "quantize_checkpoint",
    "quantize_chunk",
    "quantized_specs",
    "select_tensor",
    "tensor_scale",
]
