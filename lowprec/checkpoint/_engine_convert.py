"""Whole checkpoints in the layouts inference engines load: quantizing a Hugging Face
folder into compressed-tensors or ModelOpt (:func:`quantize_engine_checkpoint`), and moving a
quantized checkpoint between lowprec's, compressed-tensors' and ModelOpt's layouts without
requantizing (:func:`convert_checkpoint`). What each layout stores, and what its loaders
compute, is :mod:`lowprec.checkpoint._engine_layouts`; the write phase is the one every
conversion shares (:mod:`lowprec.checkpoint._pipeline`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
import time
from typing import Optional, Sequence

import numpy as np

from ._chunk import finite_amax
from ._engine_layouts import (
    DEFAULT_IGNORE,
    ENGINE_LAYOUTS,
    MODELOPT_SCHEMES,
    ORIGIN_KEY,
    SCHEMES,
    EngineSpec,
    ct_quantization_config,
    add_stats,
    exact_reciprocal,
    layout_arrays,
    modelopt_quant_config,
    quantize_arrays,
    scheme_bits,
    scheme_name,
)
from ._errors import CheckpointError
from ._formats import DEFAULT_SCALE_RULE, check_scale_rule
from ._layout import make_spec
from ._logical import METADATA_KEY, METADATA_VERSION, METADATA_VERSION_KEY, logical_tensors
from ._pipeline import (
    Outputs,
    check_collisions,
    check_unquantized,
    copy_tensor,
    open_readers,
    write_outputs,
)
from ._qconfig import config_keeping, read_quant_config
from ._report import TensorReport
from ._safetensors import FLOAT_DTYPES
from ._source import open_source
from ._stats import ErrorStats


def _parse_schemes(schemes) -> list:
    """``[(compiled pattern, scheme)]`` from ``{pattern: format}`` or ``["PATTERN=FORMAT"]``."""
    items = schemes.items() if isinstance(schemes, dict) else []
    if not isinstance(schemes, dict):
        for s in schemes or ():
            if "=" not in s:
                raise CheckpointError(
                    f"--scheme {s!r}: write PATTERN=FORMAT, e.g. 're:.*mlp.*=nvfp4'")
            pat, _, fmt = s.rpartition("=")
            items = [*items, (pat, fmt)]
    return [(_pattern(p, "--scheme"), scheme_name(f)) for p, f in items]


def _pattern(p: str, what: str):
    """A module pattern as compressed-tensors writes them: ``re:REGEX`` (``re.match``) or an
    exact module name."""
    if not isinstance(p, str) or not p:
        raise CheckpointError(f"{what} pattern {p!r} must be a non-empty string")
    if p.startswith("re:"):
        try:
            return re.compile(p[3:])
        except re.error as e:
            raise CheckpointError(f"{what} {p!r} is not a valid regular expression: {e}") from None
    return re.compile(re.escape(p) + r"\Z")


def _matches(pattern, module: str) -> bool:
    return pattern.match(module) is not None


def plan_modules(names_infos, default: Optional[str], schemes, ignore) -> tuple:
    """Which Linear weights get which scheme: ``({weight name: scheme}, kept modules)``."""
    chosen, kept = {}, []
    for name, info in names_infos:
        if not name.endswith(".weight") or len(info.shape) != 2 or info.dtype not in FLOAT_DTYPES:
            continue
        module = name[: -len(".weight")]
        scheme = next((s for p, s in schemes if _matches(p, module)), None)
        if info.numel == 0 or any(_matches(p, module) for p in ignore) or (
                scheme is None and (default is None or re.search(DEFAULT_IGNORE, module, re.I))):
            kept.append(module)  # an empty weight has nothing to quantize: kept, and listed
            continue
        scheme = scheme or default
        group = {"nvfp4": 16, "mxfp4": 32, "mxfp8": 32}.get(scheme, 1)
        if info.shape[1] % group:
            raise CheckpointError(
                f"{name}: {info.shape[1]} input features are not a multiple of the {scheme} "
                f"group size {group}; --ignore 're:{re.escape(module)}' keeps it"
            )
        chosen[name] = scheme
    return chosen, kept


def quantize_engine_checkpoint(
    src, dst, format: Optional[str] = None, *, layout: str = "compressed-tensors",
    schemes=None, ignore: Sequence[str] = (), scale_rule: Optional[str] = None,
    force: bool = False, progress: Optional[bool] = None, report=None,
    follow_symlinks: bool = False, jobs: int = 1,
):
    """Quantizes the Linear weights of a Hugging Face safetensors checkpoint into a layout
    vLLM / SGLang / transformers load (see the module docstring for the stored tensors).

    Args:
      src, dst: as :func:`~lowprec.checkpoint.quantize_checkpoint` (a folder gives a folder
        whose ``config.json`` gets ``quantization_config``; ModelOpt also gets
        ``hf_quant_config.json``).
      format: the scheme of every Linear weight not matched otherwise: ``"nvfp4"``,
        ``"mxfp4"``, ``"mxfp8"``, ``"fp8"`` (per tensor) or ``"fp8_channel"`` (lowprec names
        ``"e4m3"``, ``"mxfp8_e4m3"`` too). ModelOpt: ``"nvfp4"`` or ``"fp8"``.
      layout: ``"compressed-tensors"`` or ``"modelopt"``.
      schemes: per-module schemes, ``{pattern: format}`` or ``["PATTERN=FORMAT", ...]``; a
        pattern is an exact module name or ``re:REGEX`` (matched from the start, as
        compressed-tensors does); the first match wins. Such modules are quantized even if
        the default rule would keep them.
      ignore: module patterns kept in their original precision (besides the default:
        ``lm_head``, embeddings, norms — :data:`DEFAULT_IGNORE`).
      scale_rule: MX schemes: the E8M0 scale rule (default ``"floor"``).

    Returns:
      The :class:`~lowprec.checkpoint.ConversionReport`; its ``options`` hold the written
      ``quantization_config``.

    Example:
        >>> import tempfile, numpy as np
        >>> from lowprec.checkpoint import SafetensorsWriter, load_checkpoint
        >>> d = tempfile.mkdtemp()
        >>> w = np.linspace(-1, 1, 64 * 32, dtype=np.float32).reshape(64, 32)
        >>> with SafetensorsWriter(f"{d}/m.safetensors", [("fc.weight", "F32", w.shape)]) as f:
        ...     f.write("fc.weight", w)
        >>> rep = quantize_engine_checkpoint(f"{d}/m.safetensors", f"{d}/q.safetensors", "nvfp4")
        >>> rep.tensors[0].stored_as
        ('fc.weight_packed', 'fc.weight_scale', 'fc.weight_global_scale')
        >>> float(np.abs(load_checkpoint(f"{d}/q.safetensors")["fc.weight"] - w).max()) < 0.1
        True
    """
    start = time.perf_counter()
    if layout not in ENGINE_LAYOUTS:
        raise CheckpointError(
            f"unknown engine layout {layout!r}; choose one of: {', '.join(ENGINE_LAYOUTS)}")
    default = None if format is None else scheme_name(format)
    parsed = _parse_schemes(schemes)
    ignore_p = [_pattern(p, "--ignore") for p in ignore]
    used = {default} | {s for _, s in parsed}
    used.discard(None)
    if not used:
        raise CheckpointError(
            "give a format (--format) or per-module schemes (--scheme PATTERN=FORMAT)")
    if layout == "modelopt":
        bad = used - set(MODELOPT_SCHEMES)
        if bad or len(used) > 1:
            raise CheckpointError(
                f"the ModelOpt layout holds one scheme of {', '.join(MODELOPT_SCHEMES)} per "
                f"checkpoint, not {', '.join(sorted(used))}; use --layout compressed-tensors"
            )
    if scale_rule is not None and not used & {"mxfp4", "mxfp8"}:
        raise CheckpointError(
            f"--scale-rule / scale_rule applies to the MX schemes (mxfp4, mxfp8), not "
            f"{', '.join(sorted(used))}: NVFP4 has its own scale recipe and FP8's scale is amax "
            "/ 448; drop it")
    scale_rule = check_scale_rule(DEFAULT_SCALE_RULE if scale_rule is None else scale_rule)
    source = open_source(src)
    outputs = Outputs(source, dst, report, force, follow_symlinks, jobs)
    with contextlib.ExitStack() as stack:
        readers = open_readers(stack, source)
        plans, groups, kept_all = {}, {}, []
        check_unquantized(source, readers)
        for rel, reader in readers.items():
            chosen, kept = plan_modules(reader.tensors.items(), default, parsed, ignore_p)
            kept_all += kept
            plan, entries = [], []
            for info in reader.tensors.values():
                scheme = chosen.get(info.name)
                spec = None
                if scheme is not None:
                    spec = EngineSpec(scheme, layout, tuple(info.shape), info.dtype, scale_rule)
                    entries += [(st, dt, shp) for _, st, dt, shp in spec.parts(info.name)]
                    groups.setdefault(scheme, []).append(info.name[: -len(".weight")])
                else:
                    entries.append((info.name, info.dtype, info.shape))
                plan.append((info, spec))
            check_collisions(entries, reader.path, "--ignore the module of one of them")
            plans[rel] = (plan, entries)
        if not groups:
            raise CheckpointError(f"{source.given}: no Linear weight ([out, in] '*.weight') to "
                                  "quantize with these options")
        groups = {s: sorted(m) for s, m in groups.items()}
        if layout == "compressed-tensors":
            qconfig = ct_quantization_config(groups, kept_all)
            extra = {}
        else:
            (scheme,) = groups
            hf = modelopt_quant_config(scheme, kept_all)
            qconfig = {"quant_method": "modelopt", **hf["quantization"]}
            extra = {"hf_quant_config.json": json.dumps(hf, indent=2) + "\n"}
        texts = _config_texts(source, outputs, qconfig, extra)

        def convert(reader, writer, item, bar, runner):
            info, spec = item
            bar.set_postfix_str(info.name[-40:], refresh=False)
            if spec is None:
                copy_tensor(reader, writer, info.name, bar)
                return TensorReport(info.name, info.shape, info.dtype, "kept",
                                    info.nbytes, info.nbytes, reason="kept")
            parts = spec.parts(info.name)
            blocks = list(spec.row_blocks())
            amax = None
            if spec.scheme in ("nvfp4", "fp8"):  # one scale for the whole tensor: a first pass
                maxima = []
                runner.run(lambda b: np.float32(finite_amax(reader.read_rows(info.name, *b))),
                           blocks, lambda b, m: maxima.append(m))
                amax = max(maxima, default=np.float32(0))

            def piece(block):  # on a worker: each part's rows written at their place
                r0, r1 = block
                x = reader.read_rows(info.name, r0, r1)
                arrays = quantize_arrays(x, spec.scheme, layout, scale_rule=scale_rule, amax=amax)
                for role, stored, _, _ in parts:
                    if not spec.is_whole(role):
                        writer.write_rows(stored, r0, arrays[role])
                    elif r0 == 0:
                        writer.write(stored, arrays[role])
                piece_stats = ErrorStats()
                add_stats(piece_stats, x, arrays, dataclasses.replace(spec, shape=x.shape))
                return piece_stats, x.nbytes

            stats = ErrorStats()

            def done(block, result):
                stats.merge(result[0])
                bar.update(result[1])

            runner.run(piece, blocks, done)
            return TensorReport(
                info.name, info.shape, info.dtype, spec.label, info.nbytes, spec.nbytes(),
                reason=f"{layout} " + (SCHEMES[spec.scheme][1] if layout != "modelopt"
                                       else MODELOPT_SCHEMES[spec.scheme]),
                scale_rule=scale_rule if spec.scheme in ("mxfp4", "mxfp8") else None,
                sqnr_db=stats.sqnr_db, max_abs_err=stats.max_abs, max_rel_err=stats.max_rel,
                nonfinite=stats.nonfinite, stored_as=tuple(p[1] for p in parts), exact=stats.exact)

        options = {"layout": layout, "format": default, "schemes": list(schemes or ()),
                   "ignore": list(ignore), "quantization_config": qconfig}
        def metadata(plan):
            return {ORIGIN_KEY: json.dumps({i.name: {"dtype": i.dtype, "scale_rule": scale_rule
                                                     if s.scheme in ("mxfp4", "mxfp8") else None}
                                            for i, s in plan if s is not None},
                                           separators=(",", ":"))}

        return write_outputs(source, outputs, readers, plans, "quantize", options, start,
                             force=force, progress=progress, metadata=metadata,
                             convert=convert, texts=texts)


def _config_texts(source, outputs, qconfig: Optional[dict], extra: dict) -> dict:
    """``{relative path: text}`` replacing or adding the folder's config files (a single-file
    output has none: the config is in the report)."""
    if not source.is_folder:
        return {}
    texts = dict(extra)
    config = {}
    if qconfig is None and "config.json" not in source.others:
        return texts
    if "config.json" in source.others:
        try:
            with open(source.path("config.json"), encoding="utf-8") as f:
                config = json.load(f)
        except (OSError, ValueError) as e:
            raise CheckpointError(
                f"{source.path('config.json')}: cannot read it as JSON ({e})") from None
        except RecursionError:
            raise CheckpointError(
                f"{source.path('config.json')}: cannot read it as JSON (nested too deeply)") from None
        if not isinstance(config, dict):
            raise CheckpointError(f"{source.path('config.json')}: is not a JSON object")
    if qconfig is None:
        if "quantization_config" not in config:
            return texts  # nothing to take out: config.json is copied as it is
        config.pop("quantization_config")
    else:
        config["quantization_config"] = qconfig
    texts["config.json"] = json.dumps(config, indent=2) + "\n"
    for rel in texts:
        outputs.add_file(rel)
    return texts


def plain_config_texts(source, outputs, config=None, kept=(), decoded=()) -> dict:
    """For a dequantized folder: ``config.json`` without ``quantization_config`` (else the
    engines would look for quantized tensors) and no ``hf_quant_config.json`` — unless
    modules ``kept`` stay quantized (``keep_undecodable``): then the config keeps their part,
    and the ``decoded`` modules are listed as kept in high precision
    (:func:`~lowprec.checkpoint._qconfig.config_keeping`)."""
    q, hf = config_keeping(config, kept, decoded) if kept and config is not None else (None, None)
    extra = {}
    if source.is_folder and ("hf_quant_config.json" in source.others or hf is not None):
        extra["hf_quant_config.json"] = None if hf is None else json.dumps(hf, indent=2) + "\n"
    if q is None:
        texts = _config_texts(source, outputs, None, {})
        texts.update(extra)
        return texts
    return _config_texts(source, outputs, q, extra)


def convert_checkpoint(src, dst, layout: str, *, force: bool = False,
                       progress: Optional[bool] = None, report=None,
                       follow_symlinks: bool = False, jobs: int = 1):
    """Rewrites a quantized checkpoint (lowprec, compressed-tensors or ModelOpt layout) in
    another of these layouts, moving the stored bits: no requantization, every decoded value
    unchanged. Refused, naming the tensor, where the target cannot hold the bits exactly
    (lowprec has no per-channel FP8, ModelOpt holds NVFP4 and FP8 only, an NVFP4 tensor scale
    without an exact reciprocal; see the module docstring). Tensors that are not quantized
    and the folder's other files are copied; ``config.json``'s ``quantization_config`` (and
    ModelOpt's ``hf_quant_config.json``) are rewritten for the target. The original dtype and
    scale rule of each tensor travel in the safetensors metadata (``lowprec.origin``), so
    lowprec → compressed-tensors → lowprec gives back the same tensor files byte for byte.

    Example:
        >>> import tempfile, numpy as np
        >>> from lowprec.checkpoint import SafetensorsWriter, quantize_checkpoint, load_checkpoint
        >>> d = tempfile.mkdtemp()
        >>> w = np.linspace(-1, 1, 64 * 32, dtype=np.float32).reshape(64, 32)
        >>> with SafetensorsWriter(f"{d}/m.safetensors", [("fc.weight", "F32", w.shape)]) as f:
        ...     f.write("fc.weight", w)
        >>> _ = quantize_checkpoint(f"{d}/m.safetensors", f"{d}/q.safetensors", "mxfp4")
        >>> rep = convert_checkpoint(f"{d}/q.safetensors", f"{d}/ct.safetensors",
        ...                          "compressed-tensors")
        >>> rep.tensors[0].stored_as
        ('fc.weight_packed', 'fc.weight_scale')
        >>> a, b = load_checkpoint(f"{d}/q.safetensors"), load_checkpoint(f"{d}/ct.safetensors")
        >>> bool(np.array_equal(a["fc.weight"], b["fc.weight"]))
        True
    """
    start = time.perf_counter()
    if layout not in ENGINE_LAYOUTS + ("lowprec",):
        raise CheckpointError(f"unknown layout {layout!r}; choose one of: lowprec, "
                              f"{', '.join(ENGINE_LAYOUTS)}")
    source = open_source(src)
    outputs = Outputs(source, dst, report, force, follow_symlinks, jobs)
    config = read_quant_config(source.home)
    with contextlib.ExitStack() as stack:
        readers = open_readers(stack, source)
        plans, groups, kept, layouts = {}, {}, [], set()
        for rel, reader in readers.items():
            origin = {}
            with contextlib.suppress(ValueError, TypeError, RecursionError):
                origin = dict(json.loads(reader.metadata.get(ORIGIN_KEY, "{}")))
            plan, entries = [], []
            found = logical_tensors(reader, config)
            layouts |= {spec.layout for spec, _ in found.specs.values()}
            if layouts == {"lowprec"} == {layout}:  # (an engine layout's own is rewritten:
                # FP8 scales become float32)
                raise CheckpointError(f"{reader.path}: already in the lowprec layout; nothing "
                                      "to convert")
            for name, spec, parts in found:
                if spec is None:
                    info = reader.tensors[name]
                    entries.append((name, info.dtype, info.shape))
                    plan.append((name, None, None, None, None))
                    if name.endswith(".weight") and len(info.shape) == 2:
                        kept.append(name[: -len(".weight")])
                    continue
                # the tensor-wide parts and the scales: enough to check exactness up front
                arrays = {role: reader.read(stored) for role, stored, _, _ in parts
                          if role in ("scale", "scales", "global_scale")}
                scheme, bits = scheme_bits(name, spec, arrays, layout)
                o = origin.get(name, {}) if isinstance(origin.get(name), dict) else {}
                dtype = o.get("dtype", spec.dtype)
                rule = o.get("scale_rule", spec.scale_rule)
                if layout == "lowprec":
                    if scheme == "fp8_channel":
                        raise CheckpointError(f"{name}: per-channel FP8 has no lowprec layout; "
                                              "keep it in compressed-tensors or dequantize it")
                    target = make_spec(SCHEMES[scheme][0], spec.shape, dtype,
                                       axis=-1 if scheme != "fp8" else None,
                                       scale_rule=rule if scheme in ("mxfp4", "mxfp8") else None)
                    tparts = target.parts(name)
                else:
                    if layout == "modelopt" and scheme not in MODELOPT_SCHEMES:
                        raise CheckpointError(f"{name}: {scheme} has no ModelOpt layout (NVFP4 "
                                              "and FP8 per tensor have); use compressed-tensors")
                    target = EngineSpec(scheme, layout, tuple(spec.shape), dtype, rule)
                    tparts = target.parts(name)
                    if scheme == "nvfp4" and layout == "compressed-tensors" and "ts" in bits:
                        exact_reciprocal(name, bits["ts"], bits["scales"], layout)
                    groups.setdefault(scheme, []).append(name[: -len(".weight")])
                entries += [(st, dt, shp) for _, st, dt, shp in tparts]
                plan.append((name, spec, parts, target, scheme))
                del arrays, bits
                origin[name] = {"dtype": dtype, "scale_rule": rule}
            check_collisions(entries, reader.path, "rename one of them in the input")
            plans[rel] = (plan, entries)
        if not layouts:
            raise CheckpointError(
                f"{source.given}: holds no quantized tensors; nothing to convert (lowprec "
                f"quantize --layout {layout} quantizes a high-precision checkpoint)")
        texts = {}
        if layout == "lowprec":
            texts = plain_config_texts(source, outputs)
        elif groups:
            groups = {s: sorted(m) for s, m in groups.items()}
            if layout == "compressed-tensors":
                qconfig = ct_quantization_config(groups, kept)
                texts = _config_texts(source, outputs, qconfig, {})
                if source.is_folder and "hf_quant_config.json" in source.others:
                    texts["hf_quant_config.json"] = None  # ModelOpt's, no longer true
            else:
                if len(groups) > 1:
                    raise CheckpointError("the ModelOpt layout holds one scheme per checkpoint, "
                                          f"not {', '.join(sorted(groups))}")
                (scheme,) = groups
                hf = modelopt_quant_config(scheme, kept)
                qconfig = {"quant_method": "modelopt", **hf["quantization"]}
                extra = {"hf_quant_config.json": json.dumps(hf, indent=2) + "\n"}
                texts = _config_texts(source, outputs, qconfig, extra)

        def metadata(plan):
            specs = {n: t for n, s, _, t, _ in plan if t is not None}
            if layout == "lowprec":  # lowprec's own metadata holds dtype and scale rule
                return {METADATA_VERSION_KEY: METADATA_VERSION,
                        METADATA_KEY: json.dumps({n: t.to_json(n) for n, t in specs.items()},
                                                    separators=(",", ":"))}
            return {ORIGIN_KEY: json.dumps({n: {"dtype": t.dtype, "scale_rule": t.scale_rule}
                                            for n, t in specs.items()}, separators=(",", ":"))}

        def convert(reader, writer, item, bar, runner):
            name, spec, parts, target, scheme = item
            if spec is None:
                info = reader.tensors[name]
                copy_tensor(reader, writer, name, bar)
                return TensorReport(name, info.shape, info.dtype, "kept", info.nbytes,
                                    info.nbytes, reason="not quantized")
            tparts = target.parts(name)
            rows = EngineSpec(scheme, layout if layout != "lowprec" else "compressed-tensors",
                              tuple(spec.shape))
            def piece(block):  # move the bits a block of rows at a time, on a worker
                r0, r1 = block
                if isinstance(spec, EngineSpec):
                    got = spec.read_rows(reader, parts, r0, r1)
                else:
                    got = {role: reader.read(stored) if role == "scale"
                           else reader.read_rows(stored, r0, r1) for role, stored, _, _ in parts}
                out = layout_arrays(name, scheme, scheme_bits(name, spec, got, layout)[1], layout)
                for role, stored, _, _ in tparts:
                    if not rows.is_whole(role):
                        writer.write_rows(stored, r0, out[role])
                    elif r0 == 0:
                        writer.write(stored, out[role])

            runner.run(piece, list(rows.row_blocks()), lambda block, result: None)
            before = sum(reader.tensors[p[1]].nbytes for p in parts)
            bar.update(before)
            label = getattr(target, "label", target.format.name)
            return TensorReport(name, spec.shape, target.dtype, label,
                                before, target.nbytes(), reason=f"moved from {spec.layout}",
                                scale_rule=target.scale_rule, stored_as=tuple(p[1] for p in tparts))

        return write_outputs(source, outputs, readers, plans, "convert", {"layout": layout},
                             start, force=force, progress=progress, metadata=metadata,
                             convert=convert, texts=texts)
