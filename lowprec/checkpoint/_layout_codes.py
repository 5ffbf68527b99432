"""The base of a layout that stores an :class:`~lowprec.MXArray`'s codes in parts of its own.

A new layout of block formats subclasses :class:`CodesLayout` and says only what is its
own: which formats it holds, the stored parts of one tensor (``parts``), and their
encoding (``pack``: an ``MXArray`` to ``{role: array}``; ``unpack``: back). Everything
else is the package's: choosing the tensors, quantizing them (the library's own quantizer,
:func:`lowprec.quantize_mx`), the per-tensor error report, recognizing the layout's tensors
in a file (its ``<layout>.tensors`` metadata names each one's format, shape and original
dtype; every stored part is checked for dtype and shape before anything is decoded),
decoding them (:func:`lowprec.dequantize`, narrowed as every reader narrows), converting
another layout's tensors into it (bits moved: no requantization) and the safe outputs of
:mod:`lowprec.checkpoint._pipeline`. tests/test_checkpoint_layouts.py's toy layout is one.

Each tensor is held whole while it is encoded or decoded (the streaming piece pipeline of
lowprec's own layout is :mod:`lowprec.checkpoint._convert`'s); blocks run along the last axis.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import time
from typing import TYPE_CHECKING, Optional

import numpy as np

from ._chunk import count_nonfinite, narrow
from ._convert import check_selection, compile_pattern, select_tensor
from ._engine_layouts import EngineSpec, layout_arrays, scheme_bits
from ._errors import CheckpointError
from ._formats import checkpoint_format, is_block_format
from ._layout import TensorSpec, check_block_scale_rule
from ._layouts import Layout, get_layout
from ._logical import logical_tensors
from ._pipeline import (
    Outputs,
    check_unquantized,
    keep_tensor,
    open_readers,
    plan_shards,
    write_outputs,
)
from ._qconfig import read_quant_config
from ._report import TensorReport
from ._safetensors import FLOAT_DTYPES, SafetensorsReader, nbytes_of
from ._source import open_source
from ._stats import ErrorStats
from .._lazy import lazy_module

if TYPE_CHECKING:  # annotations only: the module imports JAX
    from .._mxarray import MXArray

# Imported on first use: the checkpoint command line's native path needs no JAX.
jnp = lazy_module("jax.numpy")

__all__ = ["CodesLayout", "CodesSpec", "checkpoint_mxarrays", "read_mxarray"]


@dataclasses.dataclass(frozen=True)
class CodesSpec:
    """One tensor stored in a :class:`CodesLayout` (duck-types the readers' specs)."""

    layout: str
    format: object
    shape: tuple
    dtype: str
    scale_rule: Optional[str] = None

    @property
    def lay(self) -> "CodesLayout":
        return get_layout(self.layout)

    @property
    def label(self) -> str:
        return f"{self.format.name} ({self.layout})"

    @property
    def piece_view(self) -> tuple:
        return (1, math.prod(self.shape), 1)

    def parts(self, name: str) -> list:
        return self.lay.parts(name, self.format, tuple(self.shape))

    def nbytes(self) -> int:
        return sum(nbytes_of(dt, shp) for _, _, dt, shp in self.parts("x"))

    def mxarray(self, reader, parts) -> MXArray:
        arrays = {role: reader.read(stored) for role, stored, _, _ in parts}
        try:
            return self.lay.unpack(arrays, self.format, tuple(self.shape))
        except (ValueError, TypeError) as e:
            raise CheckpointError(f"{reader.path}: cannot decode {self.label} data of shape "
                                  f"{list(self.shape)}: {e}") from None

    def decode_pieces(self, reader, parts) -> list:
        """One piece, the whole tensor: ``decode(np_dtype, saturate, name)``."""
        from .._mx import dequantize  # noqa: PLC0415 - JAX, imported where used

        def decode(np_dtype, saturate: bool, name: str):
            values = np.asarray(dequantize(self.mxarray(reader, parts), jnp.float32))
            values, n = narrow(values.reshape(-1), np_dtype, name, saturate)
            return values, n, count_nonfinite(values)
        return [((0, 1, 0, math.prod(self.shape), 0, 1), decode)]


def read_mxarray(reader, name, spec, parts) -> MXArray:
    """The ``MXArray`` of one recognized block-format tensor of any layout: lowprec's,
    gpt-oss's, a codes layout's, or an engine layout's (its bits moved to lowprec's roles as
    ``lowprec convert`` moves them: refused where that is not exact)."""
    from .._mxarray import MXArray  # noqa: PLC0415 - JAX, imported where used

    if isinstance(spec, CodesSpec):
        return spec.mxarray(reader, parts)
    if isinstance(spec, EngineSpec) and spec.w.blocks:
        arrays = {role: reader.read(stored) for role, stored, _, _ in parts}
        w, bits = scheme_bits(name, spec, arrays, "lowprec")
        bits.pop("input_scale", None)
        out, _ = layout_arrays(name, w, bits, "lowprec")
        ts = jnp.float32(out["scale"].reshape(())) if "scale" in out else None
        return MXArray(jnp.asarray(out["elements"].view(np.uint8)),
                       jnp.asarray(np.asarray(out["scales"]).view(np.uint8)), spec.format, 1,
                       tuple(spec.shape), tensor_scale=ts)
    if isinstance(spec, TensorSpec) and spec.is_mx:
        roles = {role: stored for role, stored, _, _ in parts}
        ts = jnp.float32(reader.read(roles["scale"]).reshape(())) if "scale" in roles else None
        if "blocks" in roles:  # gpt-oss: lowprec's packing in 16-byte rows
            elements = reader.read(roles["blocks"]).reshape(*spec.shape[:-1], -1)
            scales = reader.read(roles["scales"]).reshape(*spec.shape[:-1], -1)
        else:
            elements, scales = reader.read(roles["elements"]), reader.read(roles["scales"])
        return MXArray(jnp.asarray(elements), jnp.asarray(scales), spec.format, spec.axis,
                       spec.shape, tensor_scale=ts)
    raise CheckpointError(
        f"{reader.path}: {name} is {getattr(spec, 'label', spec.format.name)}, not a block "
        "format: there are no block codes to move")


def checkpoint_mxarrays(src) -> dict:
    """The quantized tensors of a safetensors checkpoint in any layout lowprec reads, each
    checked by its layout (:func:`~._logical.logical_tensors`): ``{name: (format name, shape,
    load)}``, ``load()`` reading that one tensor as an ``MXArray`` (:func:`read_mxarray`;
    the caller refuses what is not a block format before loading it)."""
    source = open_source(src)
    config = read_quant_config(source.home)
    out = {}
    with contextlib.ExitStack() as stack:
        for rel, reader in open_readers(stack, source).items():
            for name, spec, parts in logical_tensors(reader, config):
                if spec is not None:
                    out[name] = (spec.format.name, tuple(spec.shape),
                                 lambda path=source.path(rel), name=name, spec=spec,
                                 parts=parts: _load(path, name, spec, parts))
    return out


def _load(path, name, spec, parts) -> MXArray:
    with SafetensorsReader(path) as reader:
        return read_mxarray(reader, name, spec, parts)


@dataclasses.dataclass(frozen=True)
class CodesLayout(Layout):
    """A layout storing an ``MXArray``'s codes in parts of its own (see the module doc).

    Subclasses provide :meth:`holds`, :meth:`parts`, :meth:`pack` and :meth:`unpack`."""

    def parts(self, name: str, fmt, shape: tuple) -> list:
        """``[(role, stored name, safetensors dtype, stored shape)]`` of tensor ``name``."""
        raise NotImplementedError

    def pack(self, mx: MXArray) -> dict:
        """``{role: array}``: the stored parts of ``mx`` (blocks along its last axis)."""
        raise NotImplementedError

    def unpack(self, arrays: dict, fmt, shape: tuple) -> MXArray:
        """The ``MXArray`` stored as ``arrays`` (``{role: array}``, dtypes and shapes
        already checked against :meth:`parts`)."""
        raise NotImplementedError

    @property
    def metadata_key(self) -> str:
        return f"{self.name}.tensors"

    # -- the reader side -------------------------------------------------------------
    def recognize(self, reader):
        raw = reader.metadata.get(self.metadata_key)
        if raw is None:
            return None
        where = f"{reader.path}: metadata {self.metadata_key}"
        try:
            table = json.loads(raw)
        except (json.JSONDecodeError, RecursionError):
            raise CheckpointError(f"{where} is not JSON") from None
        if not isinstance(table, dict):
            raise CheckpointError(f"{where} is not a JSON object")
        found = {}
        for name, entry in table.items():
            try:
                fmt = checkpoint_format(entry["format"])
                shape = tuple(entry["shape"])
                if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                           for d in shape) or not shape:
                    raise ValueError(f"shape {list(shape)} is not a list of non-negative ints")
                if entry["dtype"] not in FLOAT_DTYPES:
                    raise ValueError(f"original dtype {entry['dtype']!r} is not one of "
                                     f"{', '.join(FLOAT_DTYPES)}")
                self.check_format(fmt)
                if shape[-1] % fmt.block_size:
                    raise ValueError(f"last axis {shape[-1]} is not a multiple of the block "
                                     f"size {fmt.block_size}")
                rule = entry.get("scale_rule")
                if rule is not None and not isinstance(rule, str):
                    raise ValueError(f"scale_rule {rule!r} is not a name")
            except (KeyError, TypeError, ValueError, CheckpointError) as e:
                raise CheckpointError(f"{where}: tensor {name!r}: {e}") from None
            found[name] = (CodesSpec(self.name, fmt, shape, entry["dtype"], rule), None)
        return found

    def check(self, reader, name, spec, parts, config, data):
        if config is not None:
            raise CheckpointError(
                f"{reader.path}: {name} is stored in the {self.name} layout, which has no "
                f"quantization_config, but {config.where} says quant_method {config.method!r}; "
                "the config and the tensors disagree")

    def spec_for(self, fmt, shape: tuple, dtype: str, scale_rule) -> CodesSpec:
        """The spec of a tensor moved into this layout (:func:`convert_codes`)."""
        return CodesSpec(self.name, fmt, shape, dtype, scale_rule)

    def table(self, specs: dict) -> dict:
        """The safetensors metadata naming ``specs`` (``{name: CodesSpec}``)."""
        return {self.metadata_key: json.dumps(
            {n: {"format": s.format.name, "shape": list(s.shape), "dtype": s.dtype,
                 "scale_rule": s.scale_rule} for n, s in specs.items()},
            separators=(",", ":"))}

    # -- the writer side -------------------------------------------------------------
    def check_format(self, fmt, *, axis=None) -> None:
        super().check_format(fmt)
        if axis not in (None, -1):
            raise CheckpointError(f"the {self.name} layout blocks the last axis; use axis=-1")

    def quantize(self, src, dst, fmt, **options):
        return quantize_codes(self, src, dst, fmt, **options)

    def convert(self, src, dst, **options):
        return convert_codes(self, src, dst, **options)


def _refuse(layout, options: dict) -> None:
    if options:
        raise CheckpointError(f"{', '.join(sorted(options))}: not options of the "
                              f"{layout.name} layout")


def write_parts(writer, name, spec, arrays: dict) -> None:
    """Writes ``arrays`` (``{role: array}``) as the stored parts of ``spec``."""
    for role, stored, dt, shp in spec.parts(name):
        writer.write(stored, np.ascontiguousarray(arrays[role]).reshape(shp))


def quantize_codes(layout: CodesLayout, src, dst, fmt, *, include=None, exclude=None,
                   scale_rule=None, axis=None, block_size=None, force=False, progress=None,
                   report=None, follow_symlinks=False, jobs=1, **other):
    """:func:`~lowprec.checkpoint.quantize_checkpoint` into a codes layout."""
    from .._mx import dequantize, quantize_mx  # noqa: PLC0415 - JAX, imported where used

    _refuse(layout, other)
    start = time.perf_counter()
    if fmt is None:
        raise CheckpointError("give a format (--format)")
    fmt = checkpoint_format(fmt, block_size)
    layout.check_format(fmt, axis=axis)
    if not is_block_format(fmt):
        raise CheckpointError(f"the {layout.name} layout holds block formats, not {fmt.name}")
    scale_rule = check_block_scale_rule(fmt, scale_rule)
    inc, exc = compile_pattern(include, "--include"), compile_pattern(exclude, "--exclude")
    source = open_source(src)
    outputs = Outputs(source, dst, report, force, follow_symlinks, jobs)

    def plan_file(reader):
        for info in reader.tensors.values():
            chosen, reason = select_tensor(info, fmt, inc, exc, -1)
            if not chosen:
                yield (info, None, reason), [(info.name, info.dtype, info.shape)]
                continue
            spec = CodesSpec(layout.name, fmt, tuple(info.shape), info.dtype, scale_rule)
            yield (info, spec, reason), [(s, dt, shp) for _, s, dt, shp in spec.parts(info.name)]

    with contextlib.ExitStack() as stack:
        readers = open_readers(stack, source)
        check_unquantized(source, readers)
        plans = plan_shards(readers, plan_file)
        check_selection(source, plans, include, -1, fmt)

        def convert(reader, writer, it, bar, runner):
            info, spec, reason = it
            if spec is None:
                return keep_tensor(reader, writer, info.name, bar, reason)
            x = np.asarray(reader.read(info.name), np.float32)
            mx = quantize_mx(jnp.asarray(x), fmt, axis=-1, **(
                {"scale_rule": scale_rule} if scale_rule is not None else {}))
            stats = ErrorStats()
            stats.update(x, np.asarray(dequantize(mx, jnp.float32)))
            write_parts(writer, info.name, spec, layout.pack(mx))
            bar.update(info.nbytes)
            return TensorReport(
                info.name, info.shape, info.dtype, fmt.name, info.nbytes, spec.nbytes(),
                reason=reason, scale_rule=scale_rule, sqnr_db=stats.sqnr_db,
                max_abs_err=stats.max_abs, max_rel_err=stats.max_rel,
                clipped_fraction=stats.clipped_fraction, nonfinite=stats.nonfinite,
                stored_as=tuple(p[1] for p in spec.parts(info.name)), exact=stats.exact)

        def metadata(plan):
            return layout.table({i.name: s for i, s, _ in plan if s is not None})

        return write_outputs(source, outputs, readers, plans, "quantize",
                             dict(format=fmt.name, layout=layout.name, include=include,
                                  exclude=exclude, scale_rule=scale_rule),
                             start, force=force, progress=progress, metadata=metadata,
                             convert=convert)


def convert_codes(layout, src, dst, *, force=False, progress=None, report=None,
                  follow_symlinks=False, jobs=1, **other):
    """:func:`~lowprec.checkpoint.convert_checkpoint` into a codes layout (or from one into
    lowprec's: ``layout`` gives ``spec_for``, ``pack`` and ``table``): each block-format
    tensor of the source moved code for code (its ``MXArray`` re-packed), the rest copied."""
    _refuse(layout, other)
    start = time.perf_counter()
    source = open_source(src)
    outputs = Outputs(source, dst, report, force, follow_symlinks, jobs)
    config = read_quant_config(source.home)
    with contextlib.ExitStack() as stack:
        readers = open_readers(stack, source)

        def plan_file(reader):
            for name, spec, parts in logical_tensors(reader, config):
                if spec is None:
                    info = reader.tensors[name]
                    yield (name, None, None, None), [(name, info.dtype, info.shape)]
                    continue
                if spec.layout == layout.name:
                    raise CheckpointError(f"{reader.path}: already in the {layout.name} layout")
                layout.check_format(spec.format)
                if tuple(spec.shape)[-1:] and getattr(spec, "axis", len(spec.shape) - 1) \
                        != len(spec.shape) - 1:
                    raise CheckpointError(f"{reader.path}: {name} is blocked along axis "
                                          f"{spec.axis}; the {layout.name} layout blocks the "
                                          "last axis")
                target = layout.spec_for(spec.format, tuple(spec.shape), spec.dtype,
                                         spec.scale_rule)
                yield (name, spec, parts, target), [(s, dt, shp) for _, s, dt, shp in
                                                    target.parts(name)]

        plans = plan_shards(readers, plan_file)
        if not any(it[1] is not None for plan, _ in plans.values() for it in plan):
            raise CheckpointError(f"{source.given}: holds no quantized tensors to move")

        def convert(reader, writer, it, bar, runner):
            name, spec, parts, target = it
            if spec is None:
                return keep_tensor(reader, writer, name, bar, "not quantized")
            before = sum(reader.tensors[p[1]].nbytes for p in parts)
            write_parts(writer, name, target, layout.pack(read_mxarray(reader, name, spec, parts)))
            bar.update(before)
            return TensorReport(name, spec.shape, spec.dtype, spec.format.name, before,
                                target.nbytes(), reason=f"moved from {spec.layout}",
                                scale_rule=spec.scale_rule,
                                stored_as=tuple(p[1] for p in target.parts(name)), exact=True)

        def metadata(plan):
            return layout.table({n: t for n, s, _, t in plan if s is not None})

        return write_outputs(source, outputs, readers, plans, "convert",
                             {"layout": layout.name}, start, force=force, progress=progress,
                             metadata=metadata, convert=convert)
