"""Which stored tensors of a safetensors file make up which logical tensor.

A quantized tensor is stored as several parts (:mod:`lowprec.checkpoint._layout`), named in
lowprec's metadata (``lowprec.tensors``, versioned by ``lowprec.format_version``) or, in
files without it, recognized by their names, dtypes and shapes by the registered layouts
(:class:`~lowprec.checkpoint.Layout`'s ``recognize``: gpt-oss ``*_blocks`` / ``*_scales``
MXFP4 pairs, compressed-tensors, ModelOpt). Every reader of the package
(dequantize, load, inspect, convert) walks a file through :func:`logical_tensors`, which
checks it (:mod:`lowprec.checkpoint._validate`).
"""

from __future__ import annotations

from typing import Optional

from ._errors import CheckpointError
from ._layout import METADATA_KEY, METADATA_VERSION, METADATA_VERSION_KEY
from ._layouts import layouts
from ._qconfig import QuantConfig
from ._safetensors import SafetensorsReader
from ._validate import check_file

__all__ = ["METADATA_KEY", "METADATA_VERSION", "METADATA_VERSION_KEY", "FileTensors",
           "logical_tensors", "quantized_specs"]


def quantized_specs(reader: SafetensorsReader) -> dict:
    """Logical tensors stored in quantized form: ``{name: (spec, parts)}``, checked
    against the file. Each registered layout (:mod:`lowprec.checkpoint._layouts`) recognizes
    its own tensors, in registration order: lowprec's metadata names every quantized tensor
    of its files (then no other layout is asked); files without it are recognized by their
    stored names, dtypes and shapes (gpt-oss ``*_blocks``/``*_scales`` pairs, published
    gpt-oss checkpoints; compressed-tensors; ModelOpt), a name claimed once."""
    specs = {}
    for layout in layouts():
        found = layout.recognize(reader)
        if found is None:
            continue
        for name, item in found.items():
            specs.setdefault(name, item)
        if layout.exclusive:
            break
    out = {}
    owner = {}
    for name, (spec, names) in specs.items():
        parts = spec.parts(name)
        if names is not None:  # stored names of the layout's own (gpt-oss's '.blocks')
            parts = [(role, names[role], dt, shp) for role, _, dt, shp in parts]
        for role, stored, dt, shp in parts:
            info = reader.tensors.get(stored)
            if info is None:
                raise CheckpointError(
                    f"{reader.path}: tensor {name!r} ({spec.format.name}) needs stored tensor {stored!r}, "
                    "which is missing"
                )
            if info.dtype != dt or tuple(info.shape) != tuple(shp):
                raise CheckpointError(
                    f"{reader.path}: stored tensor {stored!r} is {info.dtype} {list(info.shape)}; "
                    f"{spec.format.name} of shape {list(spec.shape)} needs {dt} {list(shp)}"
                )
            if stored in owner:
                raise CheckpointError(
                    f"{reader.path}: stored tensor {stored!r} is claimed by both "
                    f"{owner[stored]!r} and {name!r}"
                )
            owner[stored] = name
        out[name] = (spec, parts)
    for name in out:
        if name in reader.tensors and owner.get(name) != name:
            raise CheckpointError(
                f"{reader.path}: {name!r} is both a stored tensor and a quantized tensor's name"
            )
    return out


class FileTensors:
    """The logical tensors of one file, checked (:func:`logical_tensors`): iterating gives
    ``(name, spec or None, parts or None)`` in file order; ``specs`` are the quantized ones,
    ``undecodable`` the modules lowprec does not decode (kept as stored where allowed)."""

    def __init__(self, reader: SafetensorsReader, specs: dict, undecodable: dict):
        self.reader, self.specs, self.undecodable = reader, specs, undecodable
        self.kept = {n for u in undecodable.values() for n, _, _ in u.stored}

    @property
    def quantized(self) -> bool:
        """Whether the file holds quantized tensors (decodable or not)."""
        return bool(self.specs or self.undecodable)

    def __iter__(self):
        owner = {stored: name for name, (_, parts) in self.specs.items()
                 for _, stored, _, _ in parts}
        done = set()
        for info in self.reader.tensors.values():
            name = owner.get(info.name)
            if name is None:
                yield info.name, None, None
            elif name not in done:
                done.add(name)
                yield name, self.specs[name][0], self.specs[name][1]


def logical_tensors(reader: SafetensorsReader, config: Optional[QuantConfig] = None, *,
                    strict: bool = True, keep_undecodable: bool = False) -> FileTensors:
    """The logical tensors of ``reader``, checked against its layout and the checkpoint's
    quantization ``config`` (:mod:`lowprec.checkpoint._validate`, the one place every reader
    goes through). ``strict``: the caller decodes: stored scales are checked too, and modules
    lowprec cannot decode are refused unless ``keep_undecodable`` (``inspect`` lists them)."""
    specs = quantized_specs(reader)
    undecodable = check_file(reader, specs, config, decode=strict,
                             keep_undecodable=keep_undecodable)
    return FileTensors(reader, specs, undecodable)
