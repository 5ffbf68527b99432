"""Which stored tensors of a safetensors file make up which logical tensor.

A quantized tensor is stored as several parts (:mod:`lowprec.checkpoint._layout`), named in
lowprec's metadata (``lowprec.tensors``, versioned by ``lowprec.format_version``) or, in
files without it, recognized by their names, dtypes and shapes: gpt-oss ``*_blocks`` /
``*_scales`` MXFP4 pairs and the compressed-tensors / ModelOpt layouts
(:func:`lowprec.checkpoint._engine_layouts.engine_specs`). Every reader of the package
(dequantize, load, inspect, convert) walks a file through :func:`logical_tensors`.
"""

from __future__ import annotations

import json

from ._engine_layouts import engine_specs
from ._errors import CheckpointError
from ._layout import GPT_OSS_FORMAT, TensorSpec
from ._safetensors import SafetensorsReader

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


def check_decodable(reader: SafetensorsReader, claimed=None) -> None:
    """Refuses FP8 codes stored with scales that no layout here claims (block- or group-scaled
    FP8, e.g. ``M.weight`` with ``M.weight_scale_inv`` [out/128, in/128]): passed on as they
    are, the codes would stand for weights — decoded without their scales, or listed as kept
    in high precision in an engine's config. ``claimed``: the stored names of the file's
    quantized tensors (default: those :func:`quantized_specs` finds)."""
    if claimed is None:
        claimed = {stored for _, parts in quantized_specs(reader).values()
                   for _, stored, _, _ in parts}
    for info in reader.tensors.values():
        if not info.dtype.startswith("F8_") or info.name in claimed:
            continue
        scale = next((n for n in reader.tensors
                      if n.startswith(info.name + "_scale") and n not in claimed), None)
        if scale is not None:
            s = reader.tensors[scale]
            raise CheckpointError(
                f"{reader.path}: {info.name} ({info.dtype} {list(info.shape)}) comes with "
                f"{scale} ({s.dtype} {list(s.shape)}): quantized weights in a layout lowprec does "
                "not read (it reads its own, gpt-oss MXFP4, compressed-tensors NVFP4, MXFP4, "
                "MXFP8 and FP8 per tensor or channel, ModelOpt NVFP4 and FP8; not block- or "
                "group-scaled FP8); their codes would pass for weights. Start from the "
                "unquantized checkpoint")


def logical_tensors(reader: SafetensorsReader, *, strict: bool = True):
    """Yields ``(name, spec or None, parts or None)`` per logical tensor, in file order.
    ``strict``: first refuse quantized tensors of an unknown layout (:func:`check_decodable`;
    ``inspect`` lists them as stored instead)."""
    specs = quantized_specs(reader)
    owner = {stored: name for name, (_, parts) in specs.items() for _, stored, _, _ in parts}
    if strict:
        check_decodable(reader, owner)
    done = set()
    for info in reader.tensors.values():
        name = owner.get(info.name)
        if name is None:
            yield info.name, None, None
        elif name not in done:
            done.add(name)
            yield name, specs[name][0], specs[name][1]

