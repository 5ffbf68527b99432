"""Which stored tensors of a safetensors file make up which logical tensor.

A quantized tensor is stored as several parts (:mod:`lowprec.checkpoint._layout`), named in
lowprec's metadata (``lowprec.tensors``, versioned by ``lowprec.format_version``) or, in
files without it, recognized by their names, dtypes and shapes: gpt-oss ``*_blocks`` /
``*_scales`` MXFP4 pairs and the compressed-tensors / ModelOpt layouts
(:func:`lowprec.checkpoint._engine_layouts.engine_specs`). Every reader of the package
(dequantize, load, inspect, convert) walks a file through :func:`logical_tensors`, which
checks it (:mod:`lowprec.checkpoint._validate`).
"""

from __future__ import annotations

import json
from typing import Optional

from ._engine_layouts import engine_specs
from ._errors import CheckpointError
from ._layout import GPT_OSS_FORMAT, TensorSpec
from ._qconfig import QuantConfig
from ._safetensors import SafetensorsReader
from ._validate import check_file

METADATA_KEY = "lowprec.tensors"
METADATA_VERSION_KEY = "lowprec.format_version"
METADATA_VERSION = "1"


_GPT_OSS_SUFFIXES = (("_blocks", "_scales"), (".blocks", ".scales"))


def quantized_specs(reader: SafetensorsReader) -> dict:
    """Logical tensors stored in quantized form: ``{name: (TensorSpec, parts)}``, checked
    against the file. Reads lowprec metadata, and also recognizes gpt-oss
    ``*_blocks``/``*_scales`` pairs in files without it (e.g. published gpt-oss
    checkpoints; original dtype taken as BF16, as gpt-oss and Hugging Face decode them)."""
    specs = {}
    raw = reader.metadata.get(METADATA_KEY)
    version = reader.metadata.get(METADATA_VERSION_KEY)
    if raw is not None and version not in (None, METADATA_VERSION):
        # An older file written before the key existed has none; any other value is a layout
        # this lowprec does not know (a newer one), and reading it as version 1 could decode
        # wrong values.
        newer = version.isdigit() and int(version) > int(METADATA_VERSION)
        raise CheckpointError(
            f"{reader.path}: {METADATA_VERSION_KEY} is {version!r}; this lowprec reads version "
            f"{METADATA_VERSION} only" + ("; the file was written by a newer lowprec: upgrade "
                                          "(pip install -U lowprec)" if newer else ""))
    if raw is not None:
        try:
            table = json.loads(raw)
        except RecursionError:
            raise CheckpointError(f"{reader.path}: metadata {METADATA_KEY} is nested too deeply "
                                  "(not lowprec's)") from None
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{reader.path}: metadata {METADATA_KEY} is not JSON ({e})") from None
        if not isinstance(table, dict):
            raise CheckpointError(f"{reader.path}: metadata {METADATA_KEY} is not a JSON object")
        for name, entry in table.items():
            specs[name] = TensorSpec.from_json(name, entry, reader.path)
    else:
        for info in reader.tensors.values():
            for bsuf, ssuf in _GPT_OSS_SUFFIXES:
                if not info.name.endswith(bsuf):
                    continue
                base = info.name[: -len(bsuf)]
                sc = reader.tensors.get(base + ssuf)
                if (
                    sc is not None and info.dtype == "U8" and sc.dtype == "U8"
                    and len(info.shape) >= 2 and info.shape[-1] == 16
                    and info.shape[:-1] == sc.shape and base not in reader.tensors
                    and base not in specs
                ):
                    shape = info.shape[:-2] + (info.shape[-2] * 32,)
                    spec = TensorSpec(GPT_OSS_FORMAT, shape, "BF16", axis=len(shape) - 1,
                                      scale_rule=None, layout="gpt-oss")
                    specs[base] = (spec, {"blocks": info.name, "scales": sc.name})
        for name, spec in engine_specs(reader).items():  # compressed-tensors / ModelOpt
            if name not in specs:
                specs[name] = (spec, {role: stored for role, stored, _, _ in spec.parts(name)})
    out = {}
    owner = {}
    for name, item in specs.items():
        spec, names = item if isinstance(item, tuple) else (item, None)
        parts = spec.parts(name)
        if names is not None:  # gpt-oss pair with '.blocks' naming
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
