"""The ``lowprec`` command: quantize, dequantize and inspect safetensors checkpoints.

Usage::

    lowprec quantize IN.safetensors OUT.safetensors --format mxfp4 \\
        [--include REGEX] [--exclude REGEX] [--scale-rule floor|ceil|even|rceil] \\
        [--layout lowprec|gpt-oss] [--axis -1] [--fp8-scale tensor|none] \\
        [--report REPORT.json] [--json] [--force] [--quiet]
    lowprec dequantize IN.safetensors OUT.safetensors [--dtype original|float32|bfloat16|float16]
    lowprec inspect FILE.safetensors [--json]

Exit status: 0 on success, 1 for a checkpoint problem (message on stderr), 2 for bad usage.

Example:
    >>> main(["quantize", "--help"])  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    SystemExit: 0
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from .checkpoint import (
    DEFAULT_KEEP_PATTERN,
    FORMATS,
    LAYOUTS,
    CheckpointError,
    dequantize_checkpoint,
    inspect_checkpoint,
    quantize_checkpoint,
)


def _parser() -> argparse.ArgumentParser:
    from . import __version__
    from ._scale_rules import DEFAULT_SCALE_RULE, SCALE_RULES

    p = argparse.ArgumentParser(
        prog="lowprec",
        description="Bit-exact low-precision formats: checkpoint quantization tools.",
    )
    p.add_argument("--version", action="version", version=f"lowprec {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    q = sub.add_parser(
        "quantize",
        help="quantize a safetensors checkpoint",
        description=(
            "Quantize the weight matrices of a safetensors checkpoint and report the error. "
            "By default: float tensors with >= 2 dims whose name does not match "
            f"/{DEFAULT_KEEP_PATTERN}/ (embeddings, lm_head, norms, biases) and, for MX "
            "formats, whose block axis is a multiple of 32. The input is never modified; "
            "the output is written to a temp file and renamed."
        ),
    )
    q.add_argument("input", help="input .safetensors file (pickle .bin/.pt files are refused)")
    q.add_argument("output", help="output .safetensors file")
    q.add_argument("--format", "-f", required=True, metavar="FORMAT",
                   help=f"one of: {', '.join(FORMATS)}")
    q.add_argument("--include", metavar="REGEX",
                   help="quantize exactly the float tensors whose name matches (re.search); "
                        "replaces the default selection")
    q.add_argument("--exclude", metavar="REGEX", help="never quantize names matching this")
    q.add_argument("--scale-rule", choices=SCALE_RULES, default=None,
                   help=f"MX scale rule (default {DEFAULT_SCALE_RULE}, the OCP MX v1.0 rule; "
                        "rceil is NVIDIA's)")
    q.add_argument("--layout", choices=LAYOUTS, default="lowprec",
                   help="lowprec: <name>_elements + <name>_scales; gpt-oss (mxfp4 only): "
                        "<name>_blocks [...,K/32,16] + <name>_scales [...,K/32]")
    q.add_argument("--axis", type=int, default=-1,
                   help="MX block axis (default -1: the input features of a [out, in] weight)")
    q.add_argument("--fp8-scale", choices=("tensor", "none"), default="tensor",
                   help="fp8 formats: per-tensor scale amax/max_fp8 stored as <name>_scale "
                        "(default), or none (plain saturating cast)")
    q.add_argument("--report", metavar="FILE.json", help="also write the report as JSON here")
    _common(q, table=True)

    d = sub.add_parser(
        "dequantize",
        help="decode a quantized checkpoint back to floats",
        description="Decode the quantized tensors of a lowprec (or gpt-oss MXFP4) safetensors "
                    "file into a plain safetensors file; other tensors are copied.",
    )
    d.add_argument("input")
    d.add_argument("output")
    d.add_argument("--dtype", default="original",
                   help="original (default: each tensor's dtype before quantization), "
                        "float32, bfloat16, float16 or float64")
    _common(d, table=True)

    i = sub.add_parser("inspect", help="list tensors, formats, sizes and bits/param",
                       description="List the tensors of a safetensors file (quantized ones "
                                   "under their original name), sizes and bits/param.")
    i.add_argument("input")
    i.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return p


def _common(p, table: bool):
    p.add_argument("--force", action="store_true", help="overwrite the output if it exists")
    p.add_argument("--quiet", "-q", action="store_true",
                   help="no progress bar and no table (errors still go to stderr)")
    p.add_argument("--json", action="store_true", help="print the report as JSON, not a table")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Runs the ``lowprec`` command line; returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        if args.command == "quantize":
            report = quantize_checkpoint(
                args.input, args.output, args.format,
                include=args.include, exclude=args.exclude, scale_rule=args.scale_rule,
                layout=args.layout, axis=args.axis, fp8_scale=args.fp8_scale,
                force=args.force, progress=False if args.quiet else None,
            )
            if args.report:
                with open(args.report, "w", encoding="utf-8") as f:
                    f.write(report.to_json() + "\n")
        elif args.command == "dequantize":
            report = dequantize_checkpoint(
                args.input, args.output, dtype=args.dtype, force=args.force,
                progress=False if args.quiet else None,
            )
        else:
            report = inspect_checkpoint(args.input)
    except CheckpointError as e:
        print(f"lowprec {args.command}: error: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"lowprec {args.command}: error: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(report.to_json())
    elif not getattr(args, "quiet", False):
        print(report.table())
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
