"""Checkpoint quantization: safetensors files or sharded folders to MXFP4 / MXFP6 / MXFP8 /
MXINT8 / NVFP4 / FP8 / BF16 / FP16 and back.

Formats are named as everywhere in lowprec (``"mxfp4"``, ``"mxfp6_e2m3"``, ``"nvfp4"``,
``"mxfp4_b16"``, ``"e4m3"``, ``"e4m3fnuz"``, ...; :data:`FORMATS`); the stored parts of each
are listed in :mod:`lowprec.checkpoint._layout` (NVFP4: ``<name>_elements``, ``<name>_scales``
and the float32 tensor scale ``<name>_scale``).
Streams every tensor in bounded pieces, never loads pickles, never writes to an input,
checks every quantized tensor it reads (and refuses what it cannot decode, naming it),
writes atomically, and reports per-tensor error (SQNR, max abs/rel error, clipped block
maxima, what happened to NaN/inf values). The command line front end is
``lowprec quantize | dequantize | inspect`` (:mod:`lowprec.cli`).

``quantize_checkpoint(..., layout="compressed-tensors" | "modelopt")`` and
:func:`convert_checkpoint` write the layouts inference engines load (vLLM, SGLang,
transformers; :mod:`lowprec.checkpoint._engine_layouts`), which every reader here also reads.
A layout is a registered :class:`Layout` object (:func:`get_layout`, :func:`layout_names`,
:func:`register`; :mod:`lowprec.checkpoint._layouts` says what one provides), one module
each: ``_layout_lowprec``, ``_layout_gpt_oss``, ``_layout_ct``, ``_layout_modelopt``,
``_layout_gguf``; ``_layout_codes`` is the base of a new layout of block formats.

Modules, one job each: ``_formats`` (which formats, under which names), ``_layout``
(stored parts of a tensor, pieces), ``_chunk`` (encoding/decoding a piece), ``_stats``
(error statistics), ``_safetensors`` (the container), ``_atomic`` (safe outputs),
``_source`` (files, folders, index), ``_logical`` (which stored tensors make up which
logical tensor), ``_qconfig`` (what a checkpoint's ``quantization_config`` says),
``_validate`` (what every reader checks before it decodes), ``_pipeline`` (outputs, readers
and the write phase every conversion shares), ``_convert`` (quantize, dequantize, load, inspect in lowprec's layouts),
``_engine_layouts`` (what compressed-tensors and ModelOpt store, per tensor),
``_engine_convert`` (whole checkpoints in those layouts, and moving between layouts),
``_gguf`` (llama.cpp's GGUF files: ``quantize_gguf``, ``dequantize_gguf``, ``inspect_gguf``,
``convert_gguf``; the ``gguf`` extra), ``_report``.

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

from ._atomic import AtomicFile, remove_stale_temps, temp_path
from ._chunk import dequantize_chunk, finite_amax, quantize_chunk, tensor_scale
from ._convert import (
    DEFAULT_KEEP_PATTERN,
    dequantize_checkpoint,
    inspect_checkpoint,
    load_checkpoint,
    quantize_checkpoint,
    select_tensor,
)
from ._engine_convert import convert_checkpoint, quantize_engine_checkpoint
from ._engine_layouts import DEFAULT_IGNORE, ENGINE_LAYOUTS
from ._errors import CheckpointError
from ._formats import (
    CAST_FORMATS,
    FORMATS,
    LAYOUTS,
    MX_FORMATS,
    canonical_format,
    checkpoint_format,
)
from ._gguf import convert_gguf, dequantize_gguf, inspect_gguf, quantize_gguf
from ._layout import TensorSpec, make_spec, pieces

# The layouts, one module each, registered in the order readers ask them in.
from . import _layout_lowprec, _layout_gpt_oss, _layout_ct, _layout_modelopt  # noqa: E402,F401,I001
from . import _layout_gguf  # noqa: E402,F401
from ._layouts import Layout, get_layout, layout_names, register  # noqa: E402
from ._logical import METADATA_KEY, quantized_specs
from ._report import ConversionReport, TensorReport
from ._safetensors import SafetensorsReader, SafetensorsWriter, TensorInfo
from ._stats import ErrorStats

__all__ = [
    "CAST_FORMATS",
    "DEFAULT_IGNORE",
    "DEFAULT_KEEP_PATTERN",
    "ENGINE_LAYOUTS",
    "FORMATS",
    "LAYOUTS",
    "METADATA_KEY",
    "MX_FORMATS",
    "AtomicFile",
    "CheckpointError",
    "Layout",
    "ConversionReport",
    "ErrorStats",
    "SafetensorsReader",
    "SafetensorsWriter",
    "TensorInfo",
    "TensorReport",
    "TensorSpec",
    "canonical_format",
    "checkpoint_format",
    "convert_checkpoint",
    "convert_gguf",
    "dequantize_checkpoint",
    "dequantize_chunk",
    "dequantize_gguf",
    "finite_amax",
    "get_layout",
    "inspect_checkpoint",
    "inspect_gguf",
    "layout_names",
    "load_checkpoint",
    "make_spec",
    "pieces",
    "quantize_checkpoint",
    "quantize_chunk",
    "quantize_engine_checkpoint",
    "quantize_gguf",
    "quantized_specs",
    "register",
    "remove_stale_temps",
    "select_tensor",
    "temp_path",
    "tensor_scale",
]
