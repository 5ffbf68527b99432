"""The ``lowprec`` command: quantize, dequantize and inspect safetensors checkpoints.

Usage::

    lowprec quantize IN OUT --format FORMAT [--include REGEX] [--exclude REGEX]
        [--scale-rule floor|ceil|even|rceil] [--layout lowprec|gpt-oss] [--axis N]
        [--block-size N] [--fp8-scale tensor|none] [--report REPORT.json] [--json]
        [--force] [--quiet]
    lowprec quantize IN OUT --layout compressed-tensors|modelopt --scheme SCHEME
        [--ignore PATTERN ...] [--scheme PATTERN=SCHEME ...] [--scale-rule RULE]
        [--calibration TOKENS.json|TEXT] [--activation-amax AMAX.json] ...
    lowprec convert IN OUT --layout lowprec|compressed-tensors|modelopt [--requantize] ...
    lowprec dequantize IN OUT [--dtype original|float32|bfloat16|float16|float64] [--saturate]
        [--keep-undecodable] [--report REPORT.json] [--json] [--force] [--quiet]
    lowprec inspect IN [--json]
    lowprec quantize MODEL.gguf OUT.gguf -f mxfp4|nvfp4 [--scale-rule R] [--rounding M]
    lowprec convert IN.safetensors OUT.gguf --template MODEL.gguf [--to nvfp4]
    lowprec convert IN.gguf OUT.gguf --to nvfp4 | OUT.safetensors --layout LAYOUT

GGUF (llama.cpp; the ``gguf`` extra) in or out: :mod:`lowprec.checkpoint._gguf`.

IN is a ``.safetensors`` file, a folder of shards, or its ``*.safetensors.index.json``;
OUT is then a file, or a folder. FORMAT is a lowprec format name: block formats mxfp4,
mxfp8_e4m3, mxfp8_e5m2, mxfp6_e2m3, mxfp6_e3m2, mxint8, nvfp4 (another block size with
``--block-size`` or in the name, mxfp4_b16); casts e4m3, e5m2, e4m3fnuz, e5m2fnuz, bf16, fp16
(or an alias such as mxfp8, mxfp6, fp8_e4m3, float8_e4m3fnuz, bfloat16). SCHEME (the engine
layouts) is an llm-compressor preset, any case: NVFP4A16, MXFP4A16, MXFP6A16, MXFP8A16
(weight-only), MXFP4, MXFP8, FP8_DYNAMIC (dynamic activations), NVFP4, FP8 (static
activations: give --calibration or --activation-amax); or FP8A16 / FP8A16_CHANNEL
(weight-only FP8).

Outputs (the checkpoint and the report) are never an input or a link to one, are checked
before any work, and are written atomically; ``--force`` replaces regular files only.

Exit status: 0 on success, 1 for a checkpoint problem (message on stderr), 2 for bad
usage, 128 + N when stopped by signal N (SIGINT 130, SIGTERM 143, SIGHUP 129: unfinished
output is removed first), 141 when stdout is closed early (``lowprec inspect f | head``).

Example:
    >>> main(["quantize", "--help"])  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    SystemExit: 0
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
from typing import Optional, Sequence

from . import __version__
from ._scale_rules import ScaleRule
from .checkpoint import (
    DEFAULT_KEEP_PATTERN,
    FORMATS,
    CheckpointError,
    convert_checkpoint,
    dequantize_checkpoint,
    get_layout,
    inspect_checkpoint,
    layout_names,
    quantize_checkpoint,
)
from .checkpoint._atomic import Interrupted, interruptible, pending_signal
from .kernels import _ckpt_cpu
from .checkpoint._cast import cast_checkpoint
from .checkpoint._layouts import layout_of_path
from .checkpoint._engine_layouts import scheme_name
from .checkpoint._engine_schemes import SCHEMES as ENGINE_SCHEMES
from .checkpoint._formats import (
    FP8_SCALINGS,
    check_fp8_scale,
    check_scale_rule,
    checkpoint_format,
)

_EXIT_BROKEN_PIPE = 128 + 13  # as a process killed by SIGPIPE


def _checked(fn):
    """An argparse ``type=`` that reports the library's own validation message."""

    def convert(value):
        try:
            return fn(value)
        except CheckpointError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    convert.__name__ = fn.__name__
    return convert


def _format_arg(name: str):
    """The checkpoint format object for ``name`` (resolved here, once), or the name of an
    engine scheme (``NVFP4A16``, ``FP8_DYNAMIC``: the engine layouts take those)."""
    try:
        return checkpoint_format(name)
    except CheckpointError as e:
        try:
            return scheme_name(name)
        except CheckpointError:
            raise CheckpointError(f"{e} (the engine layouts take a scheme: "
                                  f"{', '.join(ENGINE_SCHEMES)})") from None


def _layout_arg(name: str) -> str:
    """A registered layout's name (:func:`lowprec.checkpoint.get_layout`)."""
    return get_layout(name).name


def _convert_layout_arg(name: str) -> str:
    """A registered layout that ``convert`` writes."""
    return get_layout(name, writes="convert").name


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lowprec",
        description="Bit-exact low-precision formats: checkpoint quantization tools.",
    )
    p.add_argument("--version", action="version", version=f"lowprec {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    q = sub.add_parser(
        "quantize",
        help="quantize a safetensors checkpoint (file or sharded folder)",
        description=(
            "Quantize the weight matrices of a safetensors checkpoint and report the error. "
            "By default: float tensors with >= 2 dims whose name does not match "
            f"/{DEFAULT_KEEP_PATTERN}/ (embeddings, lm_head, norms, biases) and, for block "
            "formats, whose block axis is a multiple of the block size. The input is never "
            "modified; "
            "outputs are checked before any work and written atomically."
        ),
    )
    q.add_argument("input", help="a .safetensors file (pickle .bin/.pt files are refused), a "
                                 "folder of shards, or its *.safetensors.index.json")
    q.add_argument("output", help="output .safetensors file (a folder for a folder input)")
    q.add_argument("--format", "-f", metavar="FORMAT", type=_checked(_format_arg),
                   help=f"one of: {', '.join(FORMATS)} (library names; aliases accepted); "
                        "with --layout compressed-tensors or modelopt, a SCHEME (see --scheme)")
    q.add_argument("--include", metavar="REGEX",
                   help="quantize exactly the float tensors whose name matches (re.search); "
                        "replaces the default selection")
    q.add_argument("--exclude", metavar="REGEX", help="never quantize names matching this")
    q.add_argument("--scale-rule", type=_checked(check_scale_rule), default=None,
                   metavar="RULE",
                   help=f"MX scale rule: {', '.join(r.value for r in ScaleRule)} (default "
                        f"{ScaleRule.FLOOR.value}, "
                        "the OCP MX v1.0 rule; rceil is NVIDIA's, even_e2m1 llm-compressor's "
                        "for mxfp4/mxfp8, floor_log2f ggml's); nvfp4 has its own recipe and "
                        "takes none")
    q.add_argument("--rounding", default=None, metavar="MODE",
                   help="GGUF output: element rounding (default nearest_toward_zero with "
                        "--scale-rule floor_log2f: ggml's own MXFP4 rule, what llama-quantize "
                        "writes; nearest_even is lowprec's)")
    q.add_argument("--layout", type=_checked(_layout_arg), default="lowprec", metavar="LAYOUT",
                   help=f"{', '.join(layout_names())}; lowprec: <name>_elements + "
                        "<name>_scales; gpt-oss (mxfp4 only): <name>_blocks [...,K/32,16] + "
                        "<name>_scales [...,K/32]; compressed-tensors (formats nvfp4, mxfp4, "
                        "mxfp8, fp8, fp8_channel) and modelopt (nvfp4, fp8): what vLLM, SGLang "
                        "and transformers load, config.json's quantization_config included")
    q.add_argument("--ignore", action="append", default=[], metavar="PATTERN",
                   help="engine layouts: keep these modules in high precision (an exact module "
                        "name or re:REGEX, e.g. 're:.*lm_head'); lm_head, embeddings and norms "
                        "are kept anyway unless a --scheme names them")
    q.add_argument("--scheme", action="append", default=[], metavar="[PATTERN=]SCHEME",
                   help="engine layouts: the scheme of every Linear (an llm-compressor preset, "
                        f"any case: {', '.join(ENGINE_SCHEMES)}; A16 = weight-only, NVFP4 and "
                        "FP8 have static activation scales), or, as PATTERN=SCHEME, of the "
                        "modules matching PATTERN (first match wins), e.g. "
                        "'re:.*self_attn.*=FP8_DYNAMIC'; q/k/v and gate/up must share one")
    q.add_argument("--calibration", metavar="FILE",
                   help="engine layouts, static schemes (FP8, NVFP4): token ids (.json: a list "
                        "of sequences) or text (one sample a line, the folder's tokenizer) to "
                        "run through the model with transformers ([interop] extra), measuring "
                        "each Linear's input amax")
    q.add_argument("--activation-amax", metavar="FILE.json",
                   help="engine layouts, static schemes: each Linear's input amax, "
                        '{"<module>": amax, ...} (or an earlier report: its options)')
    q.add_argument("--max-seq-length", type=int, default=2048, metavar="N",
                   help="--calibration: tokens per sample at most (default 2048)")
    q.add_argument("--axis", type=int, default=None,
                   help="MX block axis (default -1: the input features of a [out, in] weight)")
    q.add_argument("--block-size", type=int, default=None, metavar="N",
                   help="block formats: elements per block, a power of two from 2 to 1024 "
                        "(default: the format's own, 32 for MX, 16 for nvfp4); the file records "
                        "it in the format name (mxfp4_b16)")
    q.add_argument("--fp8-scale", type=_checked(check_fp8_scale), default="tensor",
                   metavar="MODE",
                   help=f"{' or '.join(FP8_SCALINGS)}; FP8 casts (e4m3, e5m2, e4m3fnuz, e5m2fnuz): "
                        "per-tensor scale amax/max_fp8 stored as <name>_scale (default), or "
                        "none (plain saturating cast)")
    _common(q)

    d = sub.add_parser(
        "dequantize",
        help="decode a quantized checkpoint back to floats",
        description="Decode the quantized tensors of a lowprec (or gpt-oss MXFP4) safetensors "
                    "file or folder into plain safetensors; other tensors and files are copied.",
    )
    d.add_argument("input", help="a quantized .safetensors file, folder or index")
    d.add_argument("output", help="output .safetensors file (a folder for a folder input)")
    d.add_argument("--dtype", default="original",
                   help="original (default: each tensor's dtype before quantization), "
                        "float32, bfloat16, float16 or float64")
    d.add_argument("--saturate", action="store_true",
                   help="clamp decoded values beyond the output dtype's range (e.g. > 65504 "
                        "in float16) to its largest finite value, counted in the report; "
                        "without it such a tensor is refused rather than written as inf")
    d.add_argument("--keep-undecodable", action="store_true",
                   help="copy modules quantized in a way lowprec does not decode (e.g. an int4 "
                        "group of llm-compressor) as they are stored, keeping their part of "
                        "config.json's quantization_config; without it such a checkpoint is "
                        "refused, naming the module, rather than half decoded")
    _common(d)

    c = sub.add_parser(
        "convert", help="rewrite a quantized checkpoint in another layout, without requantizing",
        description="Rewrite the quantized tensors of a lowprec, compressed-tensors or ModelOpt "
                    "checkpoint in another of these layouts, moving the stored bits (no "
                    "requantization); refused, naming the tensor, where the target layout "
                    "cannot hold them exactly.")
    c.add_argument("input")
    c.add_argument("output")
    c.add_argument("--layout", default=None, type=_checked(_convert_layout_arg), metavar="LAYOUT",
                   help="lowprec, compressed-tensors or modelopt (required unless OUT is .gguf)")
    c.add_argument("--template", metavar="MODEL.gguf",
                   help="safetensors -> GGUF: a GGUF of the same model from llama.cpp's "
                        "convert_hf_to_gguf.py, whose metadata and other tensors are kept")
    c.add_argument("--to", default=None, metavar="nvfp4",
                   help="cast MXFP4 tensors to NVFP4 keeping every E2M1 code (exact where the "
                        "block scale fits E4M3 under one power-of-two tensor scale; the other "
                        "blocks requantized and counted)")
    c.add_argument("--requantize", action="store_true",
                   help="an NVFP4 tensor whose global scale has no exact reciprocal in the "
                        "target layout, or an FP8 tensor whose float32 scale is no value of "
                        "the model dtype compressed-tensors stores it in, is re-encoded from "
                        "its decoded values against the nearest scale (the report counts the "
                        "values that changed), instead of refused")
    _common(c)

    i = sub.add_parser("inspect", help="list tensors, formats, sizes and bits/param",
                       description="List the tensors of a safetensors file or folder "
                                   "(quantized ones under their original name), sizes and "
                                   "bits/param.")
    i.add_argument("input")
    i.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return p


def _common(p):
    p.add_argument("--report", metavar="FILE.json",
                   help="also write the report as JSON here (checked before any work)")
    p.add_argument("--force", action="store_true",
                   help="replace existing output files (regular files only; never an input)")
    p.add_argument("--jobs", "-j", type=int, default=1, metavar="N",
                   help="convert N shards of a folder at once (threads; peak memory grows "
                        "with N; the output is the same for any N)")
    p.add_argument("--follow-symlinks", action="store_true",
                   help="read and copy files of the input folder whose symbolic links lead "
                        "outside it (refused by default; a Hugging Face cache snapshot's links "
                        "into its blobs/ are always followed)")
    p.add_argument("--quiet", "-q", action="store_true",
                   help="no progress bar and no table (errors still go to stderr)")
    p.add_argument("--json", action="store_true", help="print the report as JSON, not a table")


def _print(text: str, command: str = "") -> int:
    """Prints to stdout; 0, the broken-pipe status if the reader went away, or 1 (with one
    line on stderr) if stdout cannot take it (a full device). The output files are complete
    by then: only the table or JSON on stdout is lost."""
    try:
        print(text, flush=True)
    except OSError as e:
        with contextlib.suppress(OSError, ValueError, AttributeError):
            # Stop the interpreter's own flush at exit from failing again.
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        if isinstance(e, BrokenPipeError):
            return _EXIT_BROKEN_PIPE
        with contextlib.suppress(OSError, ValueError):
            print(f"lowprec {command}: error: cannot write the report to stdout "
                  f"({e.strerror or e}); the output itself is complete (--report FILE.json "
                  "keeps the report)", file=sys.stderr, flush=True)
        return 1
    return 0


def _quantize_scheme(args) -> tuple:
    """``(format, per-pattern schemes)``: a ``--scheme`` without ``=`` names the scheme of
    every module (llm-compressor's ``scheme=``), as ``--format`` does."""
    whole = [s for s in args.scheme if "=" not in s]
    fmt = args.format
    if len(whole) + (fmt is not None) > 1:
        given = [*(["--format"] if fmt is not None else []), *(f"--scheme {s}" for s in whole)]
        raise CheckpointError(f"{' and '.join(given)}: give the scheme of every module once")
    if whole:
        fmt = scheme_name(whole[0])
    if fmt is None:
        raise CheckpointError("give a format (--format FORMAT) or, with --layout "
                              "compressed-tensors or modelopt, a scheme (--scheme SCHEME)")
    return fmt, [s for s in args.scheme if "=" in s]


def _container_call(args, progress):
    """A layout with its own container (GGUF): runs the command if IN or OUT is one of its
    files (None otherwise)."""
    out = getattr(args, "output", "")
    own = layout_of_path(args.input, out or None)  # GGUF: IN's magic, or OUT named .gguf
    if own is None:
        if getattr(args, "template", None):
            raise CheckpointError("--template is for a GGUF output (OUT.gguf)")
        if getattr(args, "to", None):
            if args.to != "nvfp4":
                raise CheckpointError(f"convert casts to nvfp4 only (--to nvfp4), not {args.to!r}")
            return cast_checkpoint(args.input, args.output, args.layout, force=args.force,
                                   progress=progress, report=args.report)
        if getattr(args, "rounding", None):
            raise CheckpointError("--rounding is for GGUF output only")
        return None
    unused = [opt for opt, used in (
        ("--layout", getattr(args, "layout", None) not in (None, "lowprec")
         and args.command == "quantize"),
        ("--axis", getattr(args, "axis", None) is not None),
        ("--block-size", getattr(args, "block_size", None) is not None),
        ("--ignore", bool(getattr(args, "ignore", None))),
        ("--scheme", bool(getattr(args, "scheme", None))),
        ("--saturate", bool(getattr(args, "saturate", False))),
        ("--keep-undecodable", bool(getattr(args, "keep_undecodable", False))),
        ("--jobs", getattr(args, "jobs", 1) != 1),
        ("--requantize", bool(getattr(args, "requantize", False))),
        ("--calibration", getattr(args, "calibration", None) is not None),
        ("--activation-amax", getattr(args, "activation_amax", None) is not None)) if used]
    if unused:
        raise CheckpointError(f"{', '.join(unused)}: not for {own.name.upper()} files "
                              f"({own.why_not})")
    common = dict(force=args.force, progress=progress, report=args.report) if out else {}
    if args.command == "quantize":
        if args.format is None:
            raise CheckpointError("give the GGUF output's format: --format mxfp4 or nvfp4")
        return own.quantize(args.input, args.output, args.format, include=args.include,
                            exclude=args.exclude, scale_rule=args.scale_rule,
                            rounding=args.rounding, **common)
    if args.command == "dequantize":
        return own.dequantize(args.input, args.output, dtype=args.dtype, **common)
    if args.command == "convert":
        return own.convert(args.input, args.output, template=args.template, to=args.to,
                           layout=args.layout, **common)
    return own.inspect(args.input)


def _quantize(args, progress):
    fmt, schemes = _quantize_scheme(args)
    return quantize_checkpoint(
        args.input, args.output, fmt, include=args.include, exclude=args.exclude,
        scale_rule=args.scale_rule, layout=args.layout, axis=args.axis,
        fp8_scale=args.fp8_scale, block_size=args.block_size, force=args.force,
        progress=progress, report=args.report, ignore=args.ignore, schemes=schemes,
        follow_symlinks=args.follow_symlinks, jobs=args.jobs, calibration=args.calibration,
        activation_amax=args.activation_amax, max_seq_length=args.max_seq_length)


def _convert(args, progress):
    return convert_checkpoint(args.input, args.output, args.layout, requantize=args.requantize,
                              force=args.force, progress=progress, report=args.report,
                              follow_symlinks=args.follow_symlinks, jobs=args.jobs)


def _dequantize(args, progress):
    return dequantize_checkpoint(
        args.input, args.output, dtype=args.dtype, force=args.force, progress=progress,
        report=args.report, saturate=args.saturate, follow_symlinks=args.follow_symlinks,
        jobs=args.jobs, keep_undecodable=args.keep_undecodable)


def _inspect(args, progress):
    return inspect_checkpoint(args.input)


#: The verbs on safetensors checkpoints (a container layout's files go to the layout).
_VERBS = {"quantize": _quantize, "convert": _convert, "dequantize": _dequantize,
          "inspect": _inspect}


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Runs the ``lowprec`` command line; returns the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "convert" and args.layout is None:
        if layout_of_path(args.input, args.output) is None:
            parser.error("convert: the following argument is required: --layout "
                         "(unless IN or OUT is a GGUF file)")
    progress = False if getattr(args, "quiet", False) else None
    if args.command in ("quantize", "dequantize") and not _ckpt_cpu.available():
        # Start JAX's backends before any output is opened: plugin discovery (the CUDA
        # plugin loads its libraries for seconds) swallows and logs an exception raised in
        # it, so a signal landing there would print a traceback mid-write. Not where the
        # native checkpoint passes serve: that path imports no JAX (1.1-1.5 CPU s saved).
        import jax

        jax.devices()
    try:
        with interruptible():
            report = _container_call(args, progress)
            if report is None:
                report = _VERBS[args.command](args, progress)
            late = pending_signal()  # caught, but its exception was dropped
        if late is not None:
            print(f"lowprec {args.command}: interrupted by {signal.Signals(late).name} after "
                  "the output was complete", file=sys.stderr)
            return 128 + late
    except Interrupted as e:
        name = signal.Signals(e.signum).name
        print(f"lowprec {args.command}: interrupted by {name}; unfinished output removed",
              file=sys.stderr)
        return 128 + e.signum
    except CheckpointError as e:
        print(f"lowprec {args.command}: error: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        where = f"{e.filename}: " if getattr(e, "filename", None) else ""
        print(f"lowprec {args.command}: error: {where}{e.strerror or e}", file=sys.stderr)
        return 1
    except MemoryError:
        print(f"lowprec {args.command}: error: out of memory", file=sys.stderr)
        return 1
    if args.json:
        return _print(report.to_json(), args.command)
    if not getattr(args, "quiet", False):
        return _print(report.table(), args.command)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
