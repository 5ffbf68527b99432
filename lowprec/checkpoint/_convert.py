"""Streaming conversion of safetensors checkpoints: quantize, dequantize, inspect."""

from __future__ import annotations

import json
import math
import os
import re
import sys
import time
from typing import Optional, Union

import numpy as np

from .._scale_rules import DEFAULT_SCALE_RULE
from ._report import ConversionReport, TensorReport
from ._safetensors import (
    FLOAT_DTYPES,
    CheckpointError,
    SafetensorsReader,
    SafetensorsWriter,
    dtype_name,
    nbytes_of,
    numpy_dtype,
)
from ._tensor import (
    MX_FORMATS,
    ErrorStats,
    TensorSpec,
    canonical_format,
    dequantize_chunk,
    make_spec,
    quantize_chunk,
    finite_amax,
    tensor_scale,
)

METADATA_KEY = "lowprec.tensors"
METADATA_VERSION_KEY = "lowprec.format_version"
METADATA_VERSION = "1"

#: Names matching this (case-insensitive search) are kept in their original precision by
#: default: embeddings and the output head, norms, biases. ``include=`` overrides it.
DEFAULT_KEEP_PATTERN = r"embed|lm_head|norm|bias|(^|[._])(wte|wpe|ln_\w*)([._]|$)"

# Elements per piece when a tensor is processed in pieces along axis 0.
CHUNK_ELEMENTS = 1 << 20

PathLike = Union[str, "os.PathLike[str]"]


def _progress(total: int, desc: str, enabled: Optional[bool]):
    if enabled is None:
        enabled = sys.stderr.isatty()
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm is optional
        enabled = False
    if not enabled:
        return _NoProgress()
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                file=sys.stderr, leave=False, dynamic_ncols=True)


class _NoProgress:
    def update(self, n=1):
        pass

    def set_postfix_str(self, s="", refresh=True):
        pass

    def close(self):
        pass


def _compile(pattern, what):
    if pattern is None or isinstance(pattern, re.Pattern):
        return pattern
    try:
        return re.compile(pattern)
    except re.error as e:
        raise CheckpointError(f"{what} {pattern!r} is not a valid regular expression: {e}") from None


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _row_chunks(shape, axis: Optional[int]):
    """Row ranges along axis 0 (which must not be the block axis) of ≈CHUNK_ELEMENTS each."""
    if len(shape) < 2 or axis == 0 or shape[0] == 0:
        return [None]  # whole tensor
    row = max(1, math.prod(shape[1:]))
    step = max(1, CHUNK_ELEMENTS // row)
    return [(r, min(r + step, shape[0])) for r in range(0, shape[0], step)]


def select_tensor(info, fmt: str, include, exclude, axis: int) -> tuple[bool, str]:
    """Whether to quantize tensor ``info`` (a header entry) and why (or why not)."""
    name = info.name
    if exclude is not None and exclude.search(name):
        return False, "--exclude"
    if include is not None:
        if not include.search(name):
            return False, "not in --include"
        chosen = "--include"
    else:
        if info.dtype not in FLOAT_DTYPES:
            return False, f"{info.dtype}, not float"
        if len(info.shape) < 2:
            return False, "1-D" if info.shape else "scalar"
        if re.search(DEFAULT_KEEP_PATTERN, name, re.IGNORECASE):
            return False, "embedding/norm/bias/head"
        chosen = "default"
    if info.dtype not in FLOAT_DTYPES:
        return False, f"{info.dtype}, not float"
    if info.numel == 0:
        return False, "empty"
    if fmt in MX_FORMATS:
        if not info.shape:
            return False, "scalar"
        ax = axis if -len(info.shape) <= axis < len(info.shape) else None
        if ax is None:
            return False, f"no axis {axis}"
        if info.shape[ax] % 32:
            return False, f"axis len {info.shape[ax]} % 32 != 0"
    elif info.dtype == {"bf16": "BF16", "fp16": "F16"}.get(fmt):
        return False, f"already {info.dtype}"
    return True, chosen


def quantize_checkpoint(
    src: PathLike,
    dst: PathLike,
    format: str,
    *,
    include: Optional[str] = None,
    exclude: Optional[str] = None,
    scale_rule: Optional[str] = None,
    layout: str = "lowprec",
    axis: int = -1,
    fp8_scale: str = "tensor",
    force: bool = False,
    progress: Optional[bool] = None,
) -> ConversionReport:
    """Quantizes the weights of a safetensors checkpoint into a new safetensors file.

    Streams tensor by tensor (large ones in pieces along axis 0), so peak memory stays near
    the largest tensor. Writes to a temp file beside ``dst`` and renames it atomically;
    ``src`` is only read.

    Args:
      src: input ``.safetensors`` file (pickle checkpoints are refused).
      dst: output file; must not exist unless ``force``; must not be ``src``.
      format: ``"mxfp4"``, ``"mxfp8_e4m3"``, ``"mxfp8_e5m2"``, ``"fp8_e4m3"``, ``"fp8_e5m2"``,
        ``"bf16"`` or ``"fp16"`` (see :mod:`lowprec.checkpoint._tensor` for the storage).
      include: regex (``re.search`` on the tensor name); when given, exactly the matching
        float tensors are quantized (as far as the format allows), replacing the default
        rule. Default rule: float tensors with ≥ 2 dims whose name does not match
        :data:`DEFAULT_KEEP_PATTERN` (embeddings, lm_head, norms, biases) and, for MX
        formats, whose block axis is a multiple of 32.
      exclude: regex of names never quantized (applied after ``include``).
      scale_rule: MX scale rule (``"floor"`` default, ``"ceil"``, ``"even"``, ``"rceil"``).
      layout: ``"lowprec"`` (``<name>_elements`` + ``<name>_scales``) or ``"gpt-oss"``
        (MXFP4 only: ``<name>_blocks`` [..., K/32, 16] + ``<name>_scales`` [..., K/32]).
      axis: MX block axis (default last: the input-feature axis of a [out, in] weight).
      fp8_scale: FP8 formats: ``"tensor"`` (default; ``<name>_scale`` = amax / max_fp8,
        the vLLM/compressed-tensors convention) or ``"none"`` (plain saturating cast).
      force: overwrite ``dst``.
      progress: tqdm progress bar on stderr; default: when stderr is a terminal.

    Returns:
      A :class:`ConversionReport` (per-tensor shapes, formats, bytes, SQNR, errors).

    Example:
        >>> import os, tempfile, numpy as np
        >>> from lowprec.checkpoint import SafetensorsWriter
        >>> d = tempfile.mkdtemp()
        >>> w = np.linspace(-1, 1, 64 * 64, dtype=np.float32).reshape(64, 64)
        >>> with SafetensorsWriter(f"{d}/in.safetensors", [("fc.weight", "F32", w.shape)]) as f:
        ...     f.write("fc.weight", w)
        >>> report = quantize_checkpoint(f"{d}/in.safetensors", f"{d}/out.safetensors", "mxfp4")
        >>> t = report.tensors[0]
        >>> t.format, t.bytes_before, t.bytes_after, t.bits_per_param
        ('mxfp4', 16384, 2176, 4.25)
    """
    start = time.perf_counter()
    src, dst = os.fspath(src), os.fspath(dst)
    fmt = canonical_format(format)
    include_re = _compile(include, "--include")
    exclude_re = _compile(exclude, "--exclude")
    # Check the options once, on a dummy shape, so errors come before any work.
    rank = max(2, axis + 1 if axis >= 0 else -axis)
    make_spec(fmt, (32,) * rank, "F32", axis=axis, scale_rule=scale_rule, layout=layout,
              fp8_scale=fp8_scale)
    if fmt in MX_FORMATS and scale_rule is None:
        scale_rule = DEFAULT_SCALE_RULE
    if _same_file(src, dst):
        raise CheckpointError(f"{dst}: is the input file; the input is never modified, choose another output")
    with SafetensorsReader(src) as reader:
        if METADATA_KEY in reader.metadata:
            raise CheckpointError(
                f"{src}: already quantized by lowprec; dequantize it first (lowprec dequantize)"
            )
        plan = []  # (info, spec or None, reason)
        entries = []
        for info in reader.tensors.values():
            chosen, reason = select_tensor(info, fmt, include_re, exclude_re, axis)
            spec = None
            if chosen:
                spec = make_spec(fmt, info.shape, info.dtype, axis=axis, scale_rule=scale_rule,
                                 layout=layout, fp8_scale=fp8_scale)
                entries += [(stored, dt, shp) for _, stored, dt, shp in spec.parts(info.name)]
            else:
                entries.append((info.name, info.dtype, info.shape))
            plan.append((info, spec, reason))
        _check_collisions(entries, src)
        metadata = {k: v for k, v in reader.metadata.items() if not k.startswith("lowprec.")}
        metadata[METADATA_VERSION_KEY] = METADATA_VERSION
        metadata[METADATA_KEY] = json.dumps(
            {info.name: spec.to_json(info.name) for info, spec, _ in plan if spec is not None},
            separators=(",", ":"),
        )
        reports = []
        bar = _progress(sum(i.nbytes for i in reader.tensors.values()), "quantize", progress)
        try:
            with SafetensorsWriter(dst, entries, metadata, force=force) as writer:
                for info, spec, reason in plan:
                    bar.set_postfix_str(info.name[-40:], refresh=False)
                    if spec is None:
                        for piece in reader.iter_raw(info.name):
                            writer.write(info.name, piece)
                        reports.append(TensorReport(info.name, info.shape, info.dtype, "kept",
                                                    info.nbytes, info.nbytes, reason=reason))
                    else:
                        reports.append(_quantize_one(reader, writer, info, spec, reason))
                    bar.update(info.nbytes)
        finally:
            bar.close()
    options = dict(format=fmt, include=include, exclude=exclude, layout=layout, axis=axis)
    if fmt in MX_FORMATS:
        options["scale_rule"] = scale_rule
    else:
        options["fp8_scale"] = fp8_scale
    return ConversionReport(src, dst, "quantize", options, reports, time.perf_counter() - start)


def _check_collisions(entries, src):
    seen = {}
    for name, _, _ in entries:
        if name in seen:
            raise CheckpointError(
                f"{src}: the stored name {name!r} would be used twice (an input tensor already "
                "has a name lowprec uses for a quantized part); --exclude one of them"
            )
        seen[name] = True


def _quantize_one(reader, writer, info, spec: TensorSpec, reason) -> TensorReport:
    """Quantizes one tensor, reading and writing it in pieces of about CHUNK_ELEMENTS."""
    parts = spec.parts(info.name)
    chunks = _row_chunks(info.shape, spec.axis)

    def pieces():
        if chunks == [None]:
            yield reader.read(info.name)
        else:
            for r0, r1 in chunks:
                yield reader.read_rows(info.name, r0, r1)

    scale = None
    if spec.fp8_scale == "tensor":  # a first pass for the tensor's amax
        scale = tensor_scale(max((finite_amax(p) for p in pieces()), default=0.0), spec)
    stats = ErrorStats()
    held = {}  # the other parts wait until the first part is fully written
    first_role, first_name = parts[0][0], parts[0][1]
    for piece in pieces():
        out = quantize_chunk(piece, spec, scale, stats)
        del piece
        writer.write(first_name, out.pop(first_role))
        for role, arr in out.items():
            held.setdefault(role, []).append(arr)
    for role, stored, _, _ in parts[1:]:
        if role == "scale":
            writer.write(stored, np.asarray(scale, np.float32))
        else:
            for arr in held.pop(role):  # C order: pieces along axis 0 concatenate
                writer.write(stored, arr)
    return TensorReport(
        info.name, info.shape, info.dtype, spec.format, info.nbytes, spec.nbytes(),
        reason=reason, scale_rule=spec.scale_rule, sqnr_db=stats.sqnr_db,
        max_abs_err=stats.max_abs, max_rel_err=stats.max_rel,
        clipped_fraction=stats.clipped_fraction, nonfinite=stats.nonfinite,
        stored_as=tuple(p[1] for p in parts),
    )


# -- reading quantized files --------------------------------------------------------
_GPT_OSS_SUFFIXES = (("_blocks", "_scales"), (".blocks", ".scales"))


def quantized_specs(reader: SafetensorsReader) -> dict:
    """Logical tensors stored in quantized form: ``{name: TensorSpec}``, checked against
    the file. Reads lowprec metadata, and also recognizes gpt-oss ``*_blocks``/``*_scales``
    pairs in files without it (e.g. published gpt-oss checkpoints; original dtype taken
    as BF16, as gpt-oss and Hugging Face decode them)."""
    specs = {}
    raw = reader.metadata.get(METADATA_KEY)
    if raw is not None:
        try:
            table = json.loads(raw)
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
                ):
                    shape = info.shape[:-2] + (info.shape[-2] * 32,)
                    spec = TensorSpec("mxfp4", shape, "BF16", axis=len(shape) - 1,
                                      scale_rule=None, layout="gpt-oss")
                    specs[base] = (spec, {"blocks": info.name, "scales": sc.name})
    out = {}
    for name, item in specs.items():
        spec, names = item if isinstance(item, tuple) else (item, None)
        parts = spec.parts(name)
        if names is not None:  # gpt-oss pair with '.blocks' naming
            parts = [(role, names[role], dt, shp) for role, _, dt, shp in parts]
        for role, stored, dt, shp in parts:
            info = reader.tensors.get(stored)
            if info is None:
                raise CheckpointError(
                    f"{reader.path}: tensor {name!r} ({spec.format}) needs stored tensor {stored!r}, "
                    "which is missing"
                )
            if info.dtype != dt or tuple(info.shape) != tuple(shp):
                raise CheckpointError(
                    f"{reader.path}: stored tensor {stored!r} is {info.dtype} {list(info.shape)}; "
                    f"{spec.format} of shape {list(spec.shape)} needs {dt} {list(shp)}"
                )
        out[name] = (spec, parts)
    return out


def dequantize_checkpoint(
    src: PathLike,
    dst: PathLike,
    *,
    dtype: Optional[str] = None,
    force: bool = False,
    progress: Optional[bool] = None,
) -> ConversionReport:
    """Writes a plain safetensors file with the quantized tensors of ``src`` decoded.

    Decoding is exactly :func:`lowprec.dequantize` for MX tensors (bit for bit the in-memory
    round trip), FP8 value × scale in float32 for FP8, and the value for BF16/FP16.
    Tensors that were kept are copied unchanged; the input's own metadata is kept.

    Args:
      src: a file written by :func:`quantize_checkpoint`, or any safetensors file with
        gpt-oss ``<name>_blocks``/``<name>_scales`` MXFP4 pairs.
      dst: output file (refused if it exists, unless ``force``).
      dtype: output dtype of decoded tensors: ``None`` (default) = each tensor's original
        dtype (BF16 for gpt-oss pairs without lowprec metadata), or ``"float32"``,
        ``"bfloat16"``, ``"float16"``, ``"float64"``.
    """
    start = time.perf_counter()
    src, dst = os.fspath(src), os.fspath(dst)
    out_dtype = None if dtype in (None, "original") else _dtype_arg(dtype)
    if _same_file(src, dst):
        raise CheckpointError(f"{dst}: is the input file; the input is never modified, choose another output")
    with SafetensorsReader(src) as reader:
        specs = quantized_specs(reader)
        owner = {stored: name for name, (_, parts) in specs.items() for _, stored, _, _ in parts}
        plan, entries, done = [], [], set()
        for info in reader.tensors.values():
            name = owner.get(info.name)
            if name is None:
                plan.append((info.name, None, None))
                entries.append((info.name, info.dtype, info.shape))
            elif name not in done:
                done.add(name)
                spec, parts = specs[name]
                st = out_dtype or spec.dtype
                plan.append((name, spec, parts))
                entries.append((name, st, spec.shape))
        _check_collisions(entries, src)
        metadata = {k: v for k, v in reader.metadata.items() if not k.startswith("lowprec.")}
        reports = []
        bar = _progress(sum(i.nbytes for i in reader.tensors.values()), "dequantize", progress)
        try:
            with SafetensorsWriter(dst, entries, metadata, force=force) as writer:
                for (name, spec, parts), (_, st, _) in zip(plan, entries):
                    bar.set_postfix_str(name[-40:], refresh=False)
                    if spec is None:
                        info = reader.tensors[name]
                        for piece in reader.iter_raw(name):
                            writer.write(name, piece)
                        reports.append(TensorReport(name, info.shape, info.dtype, "kept",
                                                    info.nbytes, info.nbytes, reason="not quantized"))
                        bar.update(info.nbytes)
                        continue
                    before = sum(reader.tensors[p[1]].nbytes for p in parts)
                    for rows, values in _dequantize_pieces(reader, spec, parts, numpy_dtype(st)):
                        writer.write(name, values)
                    reports.append(TensorReport(
                        name, spec.shape, st, spec.format, before, nbytes_of(st, spec.shape),
                        reason=f"decoded from {', '.join(p[1] for p in parts)}",
                        scale_rule=spec.scale_rule, stored_as=tuple(p[1] for p in parts)))
                    bar.update(before)
        finally:
            bar.close()
    options = {"dtype": dtype or "original"}
    return ConversionReport(src, dst, "dequantize", options, reports, time.perf_counter() - start)


def _dtype_arg(dtype) -> str:
    names = {"float32": "F32", "f32": "F32", "fp32": "F32", "bfloat16": "BF16", "bf16": "BF16",
             "float16": "F16", "f16": "F16", "fp16": "F16", "float64": "F64", "f64": "F64"}
    if isinstance(dtype, str) and (dtype.lower() in names or dtype.upper() in FLOAT_DTYPES):
        return names.get(dtype.lower(), dtype.upper())
    try:
        name = dtype_name(dtype)
    except (TypeError, CheckpointError):
        name = None
    if name in FLOAT_DTYPES:
        return name
    raise CheckpointError(
        f"dtype {dtype!r} is not a supported output dtype; choose float32, bfloat16, float16, "
        "float64 or original"
    )


def _dequantize_pieces(reader, spec: TensorSpec, parts, dtype):
    """Yields (rows, values) pieces of the decoded tensor in C order."""
    for rows in _row_chunks(spec.shape, spec.axis):
        if rows is None:
            arrays = {role: reader.read(stored) for role, stored, _, _ in parts}
            shape = spec.shape
        else:
            arrays = {}
            for role, stored, _, shp in parts:
                arrays[role] = reader.read(stored) if not shp else reader.read_rows(stored, *rows)
            shape = (rows[1] - rows[0],) + tuple(spec.shape[1:])
        yield rows, dequantize_chunk(arrays, spec, shape, dtype)


def load_checkpoint(path: PathLike, *, dtype: Optional[str] = None, names=None) -> dict:
    """Reads a (possibly quantized) safetensors file into ``{name: np.ndarray}``, decoding
    quantized tensors as :func:`dequantize_checkpoint` does (in memory; for small models,
    tests and analysis).

    Args:
      names: only these logical tensor names (default: all).
    """
    out_dtype = None if dtype in (None, "original") else _dtype_arg(dtype)
    with SafetensorsReader(path) as reader:
        specs = quantized_specs(reader)
        stored = {s for _, parts in specs.values() for _, s, _, _ in parts}
        result = {}
        for name, (spec, parts) in specs.items():
            if names is None or name in names:
                arrays = {role: reader.read(s) for role, s, _, _ in parts}
                st = out_dtype or spec.dtype
                result[name] = dequantize_chunk(arrays, spec, spec.shape, numpy_dtype(st))
        for info in reader.tensors.values():
            if info.name not in stored and (names is None or info.name in names):
                result[info.name] = reader.read(info.name)
        return result


def inspect_checkpoint(path: PathLike) -> ConversionReport:
    """Lists the logical tensors of a safetensors file: shape, dtype, format, bytes, bits/param.

    Quantized tensors (lowprec metadata, or gpt-oss ``*_blocks``/``*_scales`` pairs) are shown
    once under their original name, with the bytes of all their stored parts; ``bytes_before``
    is the size in the original dtype.
    """
    path = os.fspath(path)
    with SafetensorsReader(path) as reader:
        specs = quantized_specs(reader)
        owner = {stored: name for name, (_, parts) in specs.items() for _, stored, _, _ in parts}
        reports, done = [], set()
        for info in reader.tensors.values():
            name = owner.get(info.name)
            if name is None:
                reports.append(TensorReport(info.name, info.shape, info.dtype, "kept",
                                            info.nbytes, info.nbytes))
            elif name not in done:
                done.add(name)
                spec, parts = specs[name]
                stored = sum(reader.tensors[p[1]].nbytes for p in parts)
                reports.append(TensorReport(
                    name, spec.shape, spec.dtype,
                    spec.format + (" (gpt-oss)" if spec.layout == "gpt-oss" and spec.is_mx else ""),
                    nbytes_of(spec.dtype, spec.shape), stored, scale_rule=spec.scale_rule,
                    stored_as=tuple(p[1] for p in parts)))
        options = {"metadata": {k: v for k, v in reader.metadata.items() if k != METADATA_KEY}}
    return ConversionReport(path, None, "inspect", options, reports)
