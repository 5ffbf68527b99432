"""Streaming conversion of safetensors checkpoints, files or sharded folders: quantize,
dequantize, inspect, load.

Every tensor is processed in pieces of about :data:`CHUNK_ELEMENTS` elements (whatever
its shape and block axis, see :func:`lowprec.checkpoint._layout.pieces`), read with
``pread`` and written with ``pwrite`` at their place in the output, so peak memory is one
piece plus the import, not a tensor. Outputs follow the rules of
:mod:`lowprec.checkpoint._atomic`: checked before any work, written atomically, never an input.
"""

from __future__ import annotations

import contextlib
import difflib
import os
import re
import time
from collections import Counter
from typing import Optional, Union

import numpy as np

from ._chunk import decode_piece, dequantize_chunk, finite_amax, quantize_chunk, tensor_scale
from ._engine_convert import plain_config_texts, source_scheme
from ._errors import CheckpointError
from ._formats import (
    cast_dtype,
    cast_takes_scale,
    check_fp8_scale,
    checkpoint_format,
    is_block_format,
)
from ._layout import (
    TensorSpec,
    check_block_scale_rule,
    check_options_for_cast,
    make_spec,
    pieces,
)
from ._layouts import get_layout, is_default
from ._logical import METADATA_KEY, logical_tensors
from ._pipeline import (
    Outputs,
    check_unquantized,
    keep_tensor,
    open_readers,
    plan_shards,
    write_outputs,
)
from ._qconfig import read_quant_config
from ._report import ConversionReport, TensorReport
from ._safetensors import FLOAT_DTYPES, dtype_name, nbytes_of, numpy_dtype
from ._source import Source, open_source
from ._stats import ErrorStats

#: Names matching this (case-insensitive search) are kept in their original precision by
#: default: embeddings and the output head, norms, biases. ``include=`` overrides it.
DEFAULT_KEEP_PATTERN = r"embed|lm_head|norm|bias|(^|[._])(wte|wpe|ln_\w*)([._]|$)"

#: Elements per piece (about 4 MiB of float32): bounds the working memory of a conversion.
CHUNK_ELEMENTS = 1 << 20

PathLike = Union[str, "os.PathLike[str]"]


def compile_pattern(pattern, what):
    if pattern is None or isinstance(pattern, re.Pattern):
        return pattern
    try:
        return re.compile(pattern)
    except (re.error, TypeError) as e:
        raise CheckpointError(f"{what} {pattern!r} is not a valid regular expression: {e}") from None


def select_tensor(info, fmt, include, exclude, axis: Optional[int]) -> tuple:
    """Whether to quantize tensor ``info`` (a header entry) to ``fmt`` (a checkpoint format
    object or name) and why (or why not); ``include``/``exclude``: compiled patterns or None."""
    fmt = checkpoint_format(fmt)
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
    if is_block_format(fmt):
        if not info.shape:
            return False, "scalar"
        axis = -1 if axis is None else axis
        if not -len(info.shape) <= axis < len(info.shape):
            return False, f"no axis {axis}"
        if info.shape[axis] % fmt.block_size:
            return False, f"axis len {info.shape[axis]} % {fmt.block_size} != 0"
    elif not cast_takes_scale(fmt) and info.dtype == cast_dtype(fmt):
        return False, f"already {info.dtype}"
    return True, chosen


# -- quantize --------------------------------------------------------------------------
def quantize_checkpoint(
    src: PathLike,
    dst: PathLike,
    format: str,
    *,
    include: Optional[str] = None,
    exclude: Optional[str] = None,
    scale_rule: Optional[str] = None,
    layout: str = "lowprec",
    axis: Optional[int] = None,
    fp8_scale: str = "tensor",
    block_size: Optional[int] = None,
    force: bool = False,
    progress: Optional[bool] = None,
    report: Optional[PathLike] = None,
    ignore=(),
    schemes=None,
    follow_symlinks: bool = False,
    jobs: int = 1,
    calibration=None,
    activation_amax=None,
    max_seq_length: int = 2048,
) -> ConversionReport:
    """Quantizes the weights of a safetensors checkpoint (a file or a sharded folder).

    Streams every tensor in pieces (any shape, any block axis), so peak memory stays
    near one piece plus the import. Outputs are checked before any work and written
    atomically; the input is only read (see :mod:`lowprec.checkpoint._atomic`).

    Args:
      src: a ``.safetensors`` file (pickle checkpoints are refused), a folder of shards,
        or a folder's ``*.safetensors.index.json``.
      dst: output file for a file; output folder for a folder (created if missing):
        quantized shards under the same names, a rewritten index, and every other file
        (config, tokenizer, ...) copied. Must not exist unless ``force``; never an input.
      format: a library format name: block formats ``"mxfp4"``, ``"mxfp8_e4m3"``,
        ``"mxfp8_e5m2"``, ``"mxfp6_e2m3"``, ``"mxfp6_e3m2"``, ``"mxint8"``, ``"nvfp4"`` (also
        with a block size in the name, ``"mxfp4_b16"``); casts ``"e4m3"``, ``"e5m2"``,
        ``"e4m3fnuz"``, ``"e5m2fnuz"``, ``"bf16"``, ``"fp16"``; or any alias of one
        (``"mxfp8"``, ``"fp8_e4m3"``, ``"float8_e4m3fnuz"``, ...). See
        :mod:`lowprec.checkpoint._layout` for the storage.
      include: regex (``re.search`` on the tensor name); when given, exactly the matching
        float tensors are quantized (as far as the format allows), replacing the default
        rule. Default rule: float tensors with ≥ 2 dims whose name does not match
        :data:`DEFAULT_KEEP_PATTERN` (embeddings, lm_head, norms, biases) and, for block
        formats, whose block axis is a multiple of the block size.
      exclude: regex of names never quantized (applied after ``include``).
      scale_rule: MX scale rule (``"floor"`` default, ``"ceil"``, ``"even"``, ``"rceil"``);
        NVFP4 has its own recipe (torchao's: E4M3 block scales under the float32 tensor scale
        amax / 2688, computed over the whole tensor) and takes none.
      layout: ``"lowprec"`` (``<name>_elements`` + ``<name>_scales``) or ``"gpt-oss"``
        (MXFP4 only: ``<name>_blocks`` [..., K/32, 16] + ``<name>_scales`` [..., K/32]).
        ``"compressed-tensors"`` / ``"modelopt"``: the layouts inference engines load
        (:func:`lowprec.checkpoint.quantize_engine_checkpoint`: ``format`` is then a scheme,
        an llm-compressor preset such as ``"NVFP4A16"`` or ``"FP8_DYNAMIC"``, and it takes
        ``ignore``, ``schemes``, ``calibration``, ``activation_amax``, ``max_seq_length``;
        ``include``/``exclude``/``axis``/``fp8_scale``/``block_size`` do not apply there).
      axis: MX block axis (default -1: the input-feature axis of a [out, in] weight).
      fp8_scale: FP8 casts: ``"tensor"`` (default; ``<name>_scale`` = amax / max_fp8, the
        vLLM/compressed-tensors convention) or ``"none"`` (saturating cast).
      block_size: block formats: another block size (a power of two from 2 to 1024; None:
        the format's own, 32 for MX, 16 for NVFP4); same as naming it (``"mxfp4_b16"``), and
        recorded so in the file's metadata.
      force: replace existing output files (regular files only).
      progress: tqdm progress bar on stderr; default: when stderr is a terminal.
      report: also write the report as JSON to this path (checked up front like ``dst``).
      follow_symlinks: read (and copy) files of a folder input whose symbolic links lead out
        of the folder; by default they are refused, except a Hugging Face cache snapshot's
        links into its ``blobs/`` (see :mod:`lowprec.checkpoint._source`).
      jobs: shards of a folder converted at once, in threads (each holds one piece at a
        time, so peak memory grows with ``jobs``); the output is the same for any value.

    Returns:
      A :class:`ConversionReport` (per-tensor shapes, formats, bytes, SQNR, errors).

    Raises:
      CheckpointError: bad input or options, an unsafe output, or nothing to quantize
        (an ``include`` matching no tensor, an ``axis`` no tensor has, ...).

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
    options = {k: v for k, v in dict(
        include=include, exclude=exclude, scale_rule=scale_rule, axis=axis,
        fp8_scale=fp8_scale, block_size=block_size, force=force, progress=progress,
        report=report, ignore=ignore, schemes=schemes, follow_symlinks=follow_symlinks,
        jobs=jobs, calibration=calibration, activation_amax=activation_amax,
        max_seq_length=max_seq_length).items() if not is_default(v, _QUANTIZE_DEFAULTS[k])}
    return get_layout(layout).quantize(src, dst, format, **options)


#: The defaults of :func:`quantize_checkpoint`'s options: a layout is handed only the
#: options the caller set (and refuses those it does not take).
_QUANTIZE_DEFAULTS = dict(
    include=None, exclude=None, scale_rule=None, axis=None, fp8_scale="tensor",
    block_size=None, force=False, progress=None, report=None, ignore=(), schemes=None,
    follow_symlinks=False, jobs=1, calibration=None, activation_amax=None,
    max_seq_length=2048)


def quantize_lowprec(
    src, dst, format, *, layout: str = "lowprec", include=None, exclude=None,
    scale_rule=None, axis=None, fp8_scale="tensor", block_size=None, force=False,
    progress=None, report=None, ignore=(), schemes=None, follow_symlinks=False, jobs=1,
    calibration=None, activation_amax=None, max_seq_length=2048,
) -> ConversionReport:
    """:func:`quantize_checkpoint` into lowprec's layout or gpt-oss's (the ``quantize`` of
    :mod:`lowprec.checkpoint._layout_lowprec` and ``_layout_gpt_oss``)."""
    if ignore or schemes:
        raise CheckpointError("--ignore / --scheme apply to --layout compressed-tensors or "
                              "modelopt; the lowprec layout takes --include / --exclude")
    if calibration is not None or activation_amax is not None:
        raise CheckpointError("--calibration / --activation-amax apply to the static activation "
                              "schemes of --layout compressed-tensors or modelopt; lowprec's "
                              "layout holds weights only")
    if format is None:
        raise CheckpointError("give a format (--format)")
    start = time.perf_counter()
    fmt = checkpoint_format(format, block_size)
    mx = is_block_format(fmt)
    include_re = compile_pattern(include, "--include")
    exclude_re = compile_pattern(exclude, "--exclude")
    if mx:
        scale_rule = check_block_scale_rule(fmt, scale_rule)
        if axis is not None and (not isinstance(axis, int) or isinstance(axis, bool)):
            raise CheckpointError(f"axis must be an int, got {axis!r}")
    else:
        check_options_for_cast(fmt, axis=axis, scale_rule=scale_rule)
        check_fp8_scale(fp8_scale)
    get_layout(layout).check_format(fmt, axis=axis)
    if mx:
        axis = -1 if axis is None else axis
    source = open_source(src)
    outputs = Outputs(source, dst, report, force, follow_symlinks, jobs)
    options = dict(format=fmt.name, include=include, exclude=exclude, layout=layout)
    if mx:
        options.update(axis=axis, scale_rule=scale_rule)
    else:
        options["fp8_scale"] = fp8_scale
    with contextlib.ExitStack() as stack:
        readers = open_readers(stack, source)
        check_unquantized(source, readers)

        def plan_file(reader):
            for info in reader.tensors.values():
                chosen, reason = select_tensor(info, fmt, include_re, exclude_re, axis)
                if not chosen:
                    yield (info, None, reason), [(info.name, info.dtype, info.shape)]
                    continue
                spec = make_spec(fmt, info.shape, info.dtype, axis=axis if mx else None,
                                 scale_rule=scale_rule, layout=layout, fp8_scale=fp8_scale)
                yield (info, spec, reason), [(s, dt, shp) for _, s, dt, shp in
                                             spec.parts(info.name)]

        plans = plan_shards(readers, plan_file)
        check_selection(source, plans, include, axis if mx else None, fmt)

        def metadata(plan) -> dict:
            return get_layout(layout).table({i.name: s for i, s, _ in plan if s is not None})

        def convert(reader, writer, item, bar, runner) -> TensorReport:
            info, spec, reason = item
            bar.set_postfix_str(info.name[-40:], refresh=False)
            if spec is None:
                return keep_tensor(reader, writer, info.name, bar, reason)
            return _quantize_one(reader, writer, info, spec, reason, bar, runner)

        return write_outputs(source, outputs, readers, plans, "quantize", options, start,
                             force=force, progress=progress, metadata=metadata,
                             convert=convert)


def check_selection(source: Source, plans: dict, include, axis, fmt) -> None:
    """Refuses a run that would quantize nothing, saying why."""
    infos = [info for plan, _ in plans.values() for info, _, _ in plan]
    if any(spec is not None for plan, _ in plans.values() for _, spec, _ in plan):
        return
    where = source.given
    if not infos:
        raise CheckpointError(f"{where}: holds no tensors; nothing to quantize")
    if include is not None and not any(re.search(include, i.name) for i in infos):
        sample = ", ".join(repr(i.name) for i in infos[:3])
        raise CheckpointError(
            f"--include {include!r} matches none of the {len(infos)} tensor names "
            f"(e.g. {sample}); nothing to quantize"
        )
    if axis is not None:
        ranks = [len(i.shape) for i in infos if i.dtype in FLOAT_DTYPES and i.shape]
        if ranks and not any(-r <= axis < r for r in ranks):
            raise CheckpointError(
                f"axis {axis} is out of range for every float tensor (ranks {min(ranks)} to "
                f"{max(ranks)}); nothing to quantize"
            )
    reasons = Counter(reason for plan, _ in plans.values() for _, _, reason in plan)
    summary = "; ".join(f"{n} x {reason}" for reason, n in reasons.most_common(6))
    raise CheckpointError(
        f"{where}: no tensor can be quantized to {fmt.name} with these options (kept: {summary}); "
        "choose tensors with --include"
    )


def _quantize_one(reader, writer, info, spec: TensorSpec, reason, bar, runner):
    """Quantizes one tensor piece by piece on the runner's workers: read a region, encode
    it, write each part's region of the output (a per-tensor scale, FP8 or NVFP4, needs a
    first pass for the amax: the whole tensor's, so that every piece is encoded as the whole
    tensor is). Each piece's statistics are merged in the tensor's order. Returns what makes
    the tensor's report once its last pieces, left in flight so that the next tensor's
    pieces (or amax pass) keep the workers busy meanwhile, are consumed."""
    view = spec.piece_view
    regions = list(pieces(view, spec.align, CHUNK_ELEMENTS))
    parts = spec.parts(info.name)
    itemsize = np.dtype(numpy_dtype(info.dtype)).itemsize
    scale = None
    if spec.has_tensor_scale:
        maxima = []
        runner.run(lambda rect: finite_amax(reader.read_region(info.name, view, rect)), regions,
                   lambda rect, amax: maxima.append(amax))
        scale = tensor_scale(max(maxima, default=0.0), spec)

    def piece(rect):
        x = reader.read_region(info.name, view, rect)
        piece_stats = ErrorStats()
        out = quantize_chunk(x, spec, scale, piece_stats)
        del x
        for role, stored, _, _ in parts:
            if role in out:
                part_view, part_rect = spec.part_region(role, rect, view)
                writer.write_region(stored, part_view, part_rect, out[role])
        return piece_stats

    stats = ErrorStats()

    def done(rect, piece_stats):
        stats.merge(piece_stats)
        p0, p1, a0, a1, s0, s1 = rect
        bar.update((p1 - p0) * (a1 - a0) * (s1 - s0) * itemsize)

    runner.run(piece, regions, done, drain=False)
    for role, stored, _, _ in parts:
        if role == "scale":
            writer.write(stored, np.asarray(scale, np.float32))
    return lambda: TensorReport(
        info.name, info.shape, info.dtype, spec.format.name, info.nbytes, spec.nbytes(),
        reason=reason, scale_rule=spec.scale_rule, sqnr_db=stats.sqnr_db,
        max_abs_err=stats.max_abs, max_rel_err=stats.max_rel,
        clipped_fraction=stats.clipped_fraction, nonfinite=stats.nonfinite,
        stored_as=tuple(p[1] for p in parts), exact=stats.exact,
        nan_blocks=stats.nan_blocks, inf_saturated=stats.inf_saturated,
        finite_to_nonfinite=stats.finite_to_nonfinite, nan_in=stats.nan_in,
        inf_in=stats.inf_in, nonfinite_changed=stats.nonfinite_changed,
    )


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


def _decode_pieces(reader, spec: TensorSpec, parts) -> list:
    """``[(rect, decode)]``: the tensor's pieces in its ``piece_view``, each with
    ``decode(np_dtype, saturate, name) -> (values, saturated, non-finite values)``, which
    reads the piece's stored parts and decodes them (:func:`~._chunk.decode_piece`)."""
    if hasattr(spec, "decode_pieces"):  # an engine layout (_engine_layouts): blocks of rows
        return spec.decode_pieces(reader, parts)
    view = spec.piece_view
    fixed = {role: reader.read(stored) for role, stored, _, _ in parts if role == "scale"}

    def task(rect):
        def decode(np_dtype, saturate: bool, name: str):
            arrays = dict(fixed)
            for role, stored, _, _ in parts:
                if role != "scale":
                    part_view, part_rect = spec.part_region(role, rect, view)
                    arrays[role] = reader.read_region(stored, part_view, part_rect)
            p0, p1, a0, a1, s0, s1 = rect
            return decode_piece(arrays, spec, (p1 - p0, a1 - a0, s1 - s0), np_dtype,
                                saturate=saturate, name=name, where=f"{reader.path}: ")
        return rect, decode

    return [task(rect) for rect in pieces(view, spec.align, CHUNK_ELEMENTS)]


def dequantize_checkpoint(
    src: PathLike,
    dst: PathLike,
    *,
    dtype: Optional[str] = None,
    force: bool = False,
    progress: Optional[bool] = None,
    report: Optional[PathLike] = None,
    saturate: bool = False,
    follow_symlinks: bool = False,
    jobs: int = 1,
    keep_undecodable: bool = False,
) -> ConversionReport:
    """Writes plain safetensors with the quantized tensors of ``src`` decoded.

    Decoding is exactly :func:`lowprec.dequantize` for block (MX, NVFP4) tensors (bit for
    bit the in-memory round trip; NVFP4 with its stored tensor scale), FP8 value × scale in
    float32 for FP8, and the value for BF16/FP16. Tensors that were kept are copied unchanged; the input's own metadata is
    kept. Streams piece by piece; outputs are safe as in :func:`quantize_checkpoint`.

    Args:
      src: a file written by :func:`quantize_checkpoint` (or any safetensors file with
        gpt-oss ``<name>_blocks``/``<name>_scales`` MXFP4 pairs, or compressed-tensors /
        ModelOpt tensors, decoded as their loaders do; a folder's ``quantization_config`` is
        then dropped from its config.json), or a folder of them.
      dst: output file (folder for a folder input); refused if it exists, unless ``force``.
      dtype: output dtype of decoded tensors: ``None`` (default) = each tensor's original
        dtype (BF16 for gpt-oss pairs without lowprec metadata), or ``"float32"``,
        ``"bfloat16"``, ``"float16"``, ``"float64"``.
      report: also write the report as JSON to this path.
      follow_symlinks, jobs: as in :func:`quantize_checkpoint`.
      saturate: decoded finite values beyond the output dtype's range (e.g. > 65504 for
        float16) are clamped to its largest finite value and counted in the report
        (``saturated``); without it such a tensor is refused, never written as inf.
      keep_undecodable: modules quantized in a way lowprec does not decode (an int4 group of
        llm-compressor, GPTQ weights, ...) are copied as stored, and a folder's config.json
        keeps their part of ``quantization_config`` (the decoded modules join its
        ``ignore``); without it such a checkpoint is refused, naming the module, rather than
        half decoded. Every tensor is checked first (:mod:`lowprec.checkpoint._validate`).

    Raises:
      CheckpointError: a finite decoded value overflows the output dtype (without
        ``saturate``), a quantized tensor is damaged or disagrees with the checkpoint's
        config, or the input is not a quantized checkpoint.
    """
    start = time.perf_counter()
    if not isinstance(saturate, bool):
        raise TypeError(f"saturate must be True or False, got {saturate!r}")
    if not isinstance(keep_undecodable, bool):
        raise TypeError(f"keep_undecodable must be True or False, got {keep_undecodable!r}")
    out_dtype = None if dtype in (None, "original") else _dtype_arg(dtype)
    source = open_source(src)
    outputs = Outputs(source, dst, report, force, follow_symlinks, jobs)
    config = read_quant_config(source.home)
    with contextlib.ExitStack() as stack:
        readers = open_readers(stack, source)
        decoded, undecodable = [], {}

        def plan_file(reader):
            found = logical_tensors(reader, config, keep_undecodable=keep_undecodable)
            undecodable.update(found.undecodable)
            for name, spec, parts in found:
                if spec is None:
                    info = reader.tensors[name]
                    why = ("quantized, not decodable: copied as stored" if name in found.kept
                           else "not quantized")
                    yield (name, None, parts, info.dtype, why), [(name, info.dtype, info.shape)]
                    continue
                decoded.append(name)
                dt = out_dtype or spec.dtype
                yield (name, spec, parts, dt, None), [(name, dt, spec.shape)]

        plans = plan_shards(readers, plan_file, "rename one of them in the input")
        if not decoded:
            raise CheckpointError(
                f"{source.given}: holds no quantized tensors lowprec decodes (no {METADATA_KEY} "
                "metadata, no gpt-oss *_blocks/*_scales pairs, no compressed-tensors or ModelOpt "
                "weights); nothing to decode"
            )
        def convert(reader, writer, item, bar, runner):
            name, spec, parts, st, why = item
            bar.set_postfix_str(name[-40:], refresh=False)
            if spec is None:
                return keep_tensor(reader, writer, name, bar, why)
            before = sum(reader.tensors[p[1]].nbytes for p in parts)
            target = np.dtype(numpy_dtype(st))
            counts = [0, 0]  # saturated, non-finite

            def piece(task):
                rect, decode = task
                values, n, bad = decode(target, saturate, name)
                writer.write_region(name, spec.piece_view, rect, values)
                return n, bad

            tasks = _decode_pieces(reader, spec, parts)
            final = tasks[-1] if tasks else None

            def done(task, result):
                counts[0] += result[0]
                counts[1] += result[1]
                if task is final:
                    bar.update(before)

            if final is None:
                bar.update(before)
            # The last pieces stay in flight while the next tensor starts (see _quantize_one).
            runner.run(piece, tasks, done, drain=False)

            def report():
                saturated, nonfinite = counts
                return TensorReport(
                    name, spec.shape, st, spec.format.name, before, nbytes_of(st, spec.shape),
                    reason=f"decoded from {', '.join(p[1] for p in parts)}",
                    scale_rule=spec.scale_rule, stored_as=tuple(p[1] for p in parts),
                    nonfinite=nonfinite, decoded_nonfinite=nonfinite, saturated=saturated)
            return report

        modules = [n[: -len(".weight")] if n.endswith(".weight") else n for n in decoded]
        texts = plain_config_texts(source, outputs, config, sorted(undecodable), modules)
        options = {"dtype": dtype or "original", "saturate": saturate}
        if undecodable:
            options["kept_undecodable"] = [u.describe() for u in undecodable.values()]
        return write_outputs(source, outputs, readers, plans, "dequantize", options, start,
                             force=force,
                             progress=progress, metadata=lambda plan: {}, convert=convert,
                             texts=texts)


def load_checkpoint(path: PathLike, *, dtype: Optional[str] = None, names=None,
                    saturate: bool = False, keep_undecodable: bool = False) -> dict:
    """Reads a (possibly quantized) safetensors file or folder into ``{name: np.ndarray}``,
    decoding quantized tensors as :func:`dequantize_checkpoint` does (in memory; for small
    models, tests and analysis).

    Args:
      dtype: as in :func:`dequantize_checkpoint`.
      names: only these logical tensor names (default: all); a name the checkpoint does
        not hold raises KeyError (with the closest names it does hold).
      saturate: as in :func:`dequantize_checkpoint` (else a value overflowing ``dtype``
        raises CheckpointError).
      keep_undecodable: as in :func:`dequantize_checkpoint`: the stored tensors of modules
        lowprec does not decode come back as stored, under their own names (else such a
        checkpoint is refused).
    """
    if not isinstance(keep_undecodable, bool):
        raise TypeError(f"keep_undecodable must be True or False, got {keep_undecodable!r}")
    out_dtype = None if dtype in (None, "original") else _dtype_arg(dtype)
    if isinstance(names, str):
        names = [names]
    source = open_source(path)
    config = read_quant_config(source.home)
    result, held = {}, set()
    with contextlib.ExitStack() as stack:
        for reader in open_readers(stack, source).values():
            for name, spec, parts in logical_tensors(reader, config,
                                                     keep_undecodable=keep_undecodable):
                held.add(name)
                if names is not None and name not in names:
                    continue
                if spec is None:
                    result[name] = reader.read(name)
                    continue
                np_dtype = np.dtype(numpy_dtype(out_dtype or spec.dtype))
                out = np.empty(spec.piece_view, np_dtype)
                for (p0, p1, a0, a1, s0, s1), decode in _decode_pieces(reader, spec, parts):
                    values = decode(np_dtype, saturate, name)[0]
                    out[p0:p1, a0:a1, s0:s1] = values.reshape(p1 - p0, a1 - a0, s1 - s0)
                result[name] = out.reshape(spec.shape)
    missing = [n for n in names if n not in result] if names is not None else []
    if missing:
        hints = {n: difflib.get_close_matches(n, sorted(held), n=3) for n in missing}
        detail = "; ".join(f"{n!r}" + (f" (did you mean {', '.join(map(repr, h))}?)" if h else "")
                           for n, h in hints.items())
        raise KeyError(f"{source.given}: no tensor named {detail}; it holds {len(held)} "
                       "tensors (lowprec inspect lists them)")
    return result


def _preset(name, spec, config) -> Optional[str]:
    """The engine scheme (llm-compressor preset) tensor ``name`` was written with, where its
    layout has them and the checkpoint says (None otherwise)."""
    if not hasattr(spec, "scheme"):
        return None
    try:
        return source_scheme(name, spec, config).name
    except CheckpointError:  # inspect lists what it cannot name too
        return None


def inspect_checkpoint(path: PathLike) -> ConversionReport:
    """Lists the logical tensors of a safetensors file or folder: shape, dtype, format,
    bytes, bits/param; ``options["layouts"]``: the layouts they are stored in, each with the
    presets (engine schemes) they were written with where known.

    Quantized tensors (lowprec metadata, or gpt-oss ``*_blocks``/``*_scales`` pairs) are
    shown once under their original name, with the bytes of all their stored parts;
    ``bytes_before`` is the size in the original dtype.
    """
    source = open_source(path)
    config = read_quant_config(source.home)
    reports = []
    options: dict = {}
    undecodable = []
    written: dict = {}  # layout -> the presets (engine schemes) its tensors were written with
    with contextlib.ExitStack() as stack:
        readers = open_readers(stack, source)
        for rel, reader in readers.items():
            found = logical_tensors(reader, config, strict=False)
            undecodable += [u.describe() for u in found.undecodable.values()]
            for name, spec, parts in found:
                if spec is None:
                    info = reader.tensors[name]
                    rep = TensorReport(name, info.shape, info.dtype, "kept", info.nbytes,
                                       info.nbytes)
                else:
                    stored = sum(reader.tensors[p[1]].nbytes for p in parts)
                    label = getattr(spec, "label", None) or get_layout(spec.layout).label(spec)
                    rep = TensorReport(name, spec.shape, spec.dtype, label,
                                       nbytes_of(spec.dtype, spec.shape), stored,
                                       scale_rule=spec.scale_rule,
                                       stored_as=tuple(p[1] for p in parts))
                    written.setdefault(spec.layout, set()).add(_preset(name, spec, config))
                if source.is_folder:
                    rep.shard = rel
                reports.append(rep)
        first = next(iter(readers.values()))
        options["metadata"] = {k: v for k, v in first.metadata.items() if k != METADATA_KEY}
        if written:
            options["layouts"] = {lay: sorted(p for p in presets if p)
                                  for lay, presets in written.items()}
        if undecodable:
            options["undecodable"] = undecodable
        if source.is_folder:
            options["shards"] = len(readers)
    return ConversionReport(source.given, None, "inspect", options, reports,
                            skipped=source.skipped)
