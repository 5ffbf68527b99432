"""Writing and reading test checkpoints, shared by the checkpoint test files."""

from __future__ import annotations

import lowprec.checkpoint._safetensors as _st
from lowprec.checkpoint import SafetensorsReader, SafetensorsWriter

try:
    import safetensors.numpy as st_numpy
except ImportError:  # the independent writer is optional
    st_numpy = None


def save(path, tensors: dict, metadata=None):
    """Writes a checkpoint with the safetensors package when present (an independent
    writer), else with lowprec's own."""
    if st_numpy is not None:
        st_numpy.save_file(tensors, str(path), metadata=metadata)
        return
    entries = [(k, _st.dtype_name(v.dtype), v.shape) for k, v in tensors.items()]
    with SafetensorsWriter(path, entries, metadata) as w:
        for k, v in tensors.items():
            w.write(k, v)


def raw_tensors(path) -> dict:
    """Every tensor of a safetensors file, as stored (codes, scales, metadata-free)."""
    with SafetensorsReader(path) as r:
        return {name: r.read(name) for name in r.tensors}
