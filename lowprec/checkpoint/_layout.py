"""How one tensor is laid out in a quantized checkpoint, and how it is cut into pieces.

A :class:`TensorSpec` says how a logical tensor is stored (format, scale rule, axis,
layout, original shape and dtype) and names the stored parts:

=================  =======================  ========================================
format / layout    stored parts             values
=================  =======================  ========================================
block, lowprec     ``<name>_elements`` U8   element codes, MXArray.elements: packed
                                            along ``axis`` as a little-endian bit
                                            stream (FP4 two per byte, low nibble
                                            first; FP6 four per three bytes, code j of
                                            a group in bits 6j..6j+5 of the 24-bit
                                            word, :func:`lowprec.pack_fp6`); 8-bit
                                            codes (FP8, MXINT8 two's complement) as is
                   ``<name>_scales`` U8     scale codes, MXArray.scales: E8M0 (MX);
                                            E4M3 (NVFP4)
nvfp4 (+ _bN)      ``<name>_scale`` F32 []  also: the float32 tensor scale
                                            (MXArray.tensor_scale), as for FP8 casts
mxfp4, gpt-oss     ``<name>_blocks`` U8     [..., K/32, 16] packed FP4 codes
                   ``<name>_scales`` U8     [..., K/32] E8M0 codes (:func:`lowprec.to_gpt_oss`)
e4m3 / e5m2 /      ``<name>`` F8_E4M3 /     FP8(x / s), saturating
e4m3fnuz /         F8_E5M2 / F8_E4M3FNUZ /
e5m2fnuz           F8_E5M2FNUZ
                   ``<name>_scale`` F32 []  s = amax / max_fp8 (``fp8_scale="tensor"``)
bf16 / fp16        ``<name>`` BF16 / F16    x rounded to nearest even
=================  =======================  ========================================

A block format's name carries its block size when it is not the format's own (``"mxfp4_b16"``,
as :func:`lowprec.mx_format` names it), so the metadata's ``format`` says all a reader needs.
``<name>_scale`` is always the one float32 number that multiplies the whole tensor's decoded
values (FP8 casts) or block scales (NVFP4); ``<name>_scales`` the per-block codes.

Pieces. A tensor is seen as a 3-D array (P, A, S): P = the product of the dims before the
block axis, A = the block axis, S = the product of the dims after it (casts: (1, numel, 1)).
Blocks run along A, so any region ``[p0:p1, a0:a1, s0:s1]`` with a0, a1 multiples of the
block size holds whole blocks, and each stored part sees the same region with A scaled by
its own factor (elements: code bits / 8, e.g. 1/2 for FP4, 3/4 for FP6; scales: 1 / block
size; a block is a whole number of bytes). :func:`pieces` cuts a tensor into
such regions of a bounded number of elements: whole rows of P when they fit, else
block-aligned ranges of A, else (a huge S) slabs of S one block high — for every axis and
for 1-D tensors, reading only the bytes of the piece. Where blocks run along the last axis
(S = 1) conversions cut the tensor as (1, P·A, 1) instead (:attr:`TensorSpec.piece_view`):
a run of whole blocks, in pieces of exactly the budget. Per-tensor scales are computed over
the whole tensor first (a pass over the pieces for its amax), so every piece is encoded
exactly as the whole tensor would be.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from typing import Iterator, Optional

from .._format import ElementFormat, MXFormat, mx_format
from .._scale_rules import ScaleRule
from ._errors import CheckpointError
from ._formats import (
    CheckpointFormat,
    cast_takes_scale,
    check_fp8_scale,
    check_layout,
    check_scale_rule,
    checkpoint_format,
    is_block_format,
)
from ._layouts import get_layout
from ._safetensors import FLOAT_DTYPES, nbytes_of

#: The one format of the gpt-oss layout.
GPT_OSS_FORMAT = mx_format("mxfp4")


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """How one logical tensor is stored: ``format`` is the format object
    (:func:`~lowprec.checkpoint._formats.checkpoint_format`; :func:`make_spec` takes names),
    ``shape``/``dtype`` are the original ones."""

    format: CheckpointFormat
    shape: tuple
    dtype: str
    axis: Optional[int] = None
    scale_rule: Optional[str] = None
    layout: str = "lowprec"
    fp8_scale: Optional[str] = None

    def __post_init__(self):
        if not isinstance(self.format, (MXFormat, ElementFormat)):
            raise TypeError(f"TensorSpec takes a format object, got {self.format!r}; "
                            "make_spec(name, ...) resolves a name")

    @property
    def code_role(self) -> str:
        """The role of a block format's stored codes in its layout (``"elements"``; gpt-oss:
        ``"blocks"``, the same bytes in rows of 16)."""
        return getattr(get_layout(self.layout), "code_role", "elements")

    @property
    def is_mx(self) -> bool:
        """Whether the format is a block format (MX or NVFP4, any block size)."""
        return is_block_format(self.format)

    @property
    def block_size(self) -> int:
        return self.format.block_size if self.is_mx else 1

    @property
    def has_tensor_scale(self) -> bool:
        """Whether a float32 ``<name>_scale`` is stored (NVFP4; FP8 with ``fp8_scale="tensor"``)."""
        return self.format.tensor_scale if self.is_mx else self.fp8_scale == "tensor"

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def view(self) -> tuple:
        """The tensor as (P, A, S): dims before the block axis, the axis, dims after."""
        if not self.is_mx:
            return (1, self.numel, 1)
        shape = tuple(self.shape)
        return (math.prod(shape[: self.axis]), shape[self.axis], math.prod(shape[self.axis + 1:]))

    @property
    def piece_view(self) -> tuple:
        """The view a conversion cuts pieces from: (1, P·A, 1) when blocks run along the
        last axis (S = 1: the tensor is then a run of whole blocks, so a piece may be any
        block-aligned range, and every piece but the last holds exactly the budget, the size
        the compiled programs are built for), else :attr:`view`."""
        P, A, S = self.view
        return (1, P * A, 1) if S == 1 else (P, A, S)

    @property
    def align(self) -> int:
        """Piece boundaries along A are multiples of this (the block size for MX)."""
        return self.block_size

    def parts(self, name: str) -> list:
        """``[(role, stored name, safetensors dtype, stored shape), ...]`` in file order: what
        its layout stores (:mod:`~lowprec.checkpoint._layout_lowprec`, ``_layout_gpt_oss``)."""
        return get_layout(self.layout).parts(self, name)

    def part_length(self, role: str, a: int) -> int:
        """Entries of part ``role`` along A that hold ``a`` elements of the tensor (``a`` a
        multiple of the block size): ``a`` times the code bits / 8 for element codes, ``a``
        / block size for scales, ``a`` for cast values. The per-tensor ``scale`` is not
        cut into pieces."""
        if role == "scale":
            raise ValueError("the per-tensor scale is not cut into pieces")
        if role == "scales":
            return a // self.block_size
        if role in ("elements", "blocks"):
            return a * self.format.element.code_bits // 8
        return a

    def part_region(self, role: str, rect, view=None) -> tuple:
        """``(view, rect)`` of part ``role`` holding the region ``rect`` of the tensor seen
        as ``view`` (default :attr:`view`; or :attr:`piece_view`)."""
        P, A, S = self.view if view is None else view
        p0, p1, a0, a1, s0, s1 = rect
        n = functools.partial(self.part_length, role)
        return (P, n(A), S), (p0, p1, n(a0), n(a1), s0, s1)

    def nbytes(self) -> int:
        """Stored bytes (all parts)."""
        return sum(nbytes_of(dt, shp) for _, _, dt, shp in self.parts("x"))

    def to_json(self, name: str) -> dict:
        out = {"format": self.format.name, "shape": list(self.shape), "dtype": self.dtype}
        if self.is_mx:
            out.update(axis=self.axis, scale_rule=self.scale_rule, layout=self.layout)
        elif self.fp8_scale is not None:
            out.update(fp8_scale=self.fp8_scale)
        out["parts"] = {role: stored for role, stored, _, _ in self.parts(name)}
        return out

    @classmethod
    def from_json(cls, name: str, entry, where: str) -> "TensorSpec":
        """Parses and checks one entry of the ``lowprec.tensors`` metadata."""
        try:
            if not isinstance(entry, dict):
                raise ValueError(f"entry is a {type(entry).__name__}, not an object")
            fmt = checkpoint_format(entry["format"])
            shape = entry["shape"]
            if not isinstance(shape, list) or not all(
                isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
            ):
                raise ValueError(f"shape {shape!r} is not a list of non-negative ints")
            shape = tuple(shape)
            dtype = entry["dtype"]
            if dtype not in FLOAT_DTYPES:
                raise ValueError(
                    f"claims original dtype {dtype!r}; a quantized tensor was one of "
                    f"{', '.join(FLOAT_DTYPES)}"
                )
            if is_block_format(fmt):
                axis = entry["axis"]
                if not isinstance(axis, int) or isinstance(axis, bool):
                    raise ValueError(f"axis {axis!r} is not an int")
                rule = entry.get("scale_rule")
                if rule is not None and not fmt.scheme.takes_scale_rule:
                    raise ValueError(f"{fmt.name} takes no scale rule, got {rule!r}")
                spec = cls(
                    fmt,
                    shape,
                    dtype,
                    axis=axis,
                    scale_rule=None if rule is None else check_scale_rule(rule),
                    layout=check_layout(entry.get("layout", "lowprec")),
                )
                if not 0 <= axis < len(shape) or shape[axis] % spec.block_size:
                    raise ValueError(f"axis {axis} does not fit shape {list(shape)}")
                # the layout recorded (gpt-oss: MXFP4 along the last axis only)
                get_layout(spec.layout).check_format(fmt, axis=axis - len(shape))
            else:
                fp8_scale = entry.get("fp8_scale")
                if fp8_scale is not None:
                    check_fp8_scale(fp8_scale)
                    if not cast_takes_scale(fmt):
                        raise ValueError(f"fp8_scale does not apply to {fmt.name}")
                spec = cls(fmt, shape, dtype, fp8_scale=fp8_scale)
            if spec.to_json(name)["parts"] != entry.get("parts"):
                raise ValueError(f"parts {entry.get('parts')} do not match the format")
            return spec
        except CheckpointError as e:
            raise CheckpointError(f"{where}: tensor {name!r}: {e}") from None
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(
                f"{where}: malformed lowprec metadata for tensor {name!r} ({type(e).__name__}: {e})"
            ) from None


def make_spec(
    fmt,
    shape,
    dtype: str,
    *,
    axis: Optional[int] = None,
    scale_rule: Optional[str] = None,
    layout: str = "lowprec",
    fp8_scale: str = "tensor",
) -> TensorSpec:
    """A :class:`TensorSpec` for quantizing a tensor of ``shape`` to ``fmt`` (a format
    object or name, checked).

    Example:
        >>> make_spec("mxfp4", (8, 64), "F32").parts("w")
        [('elements', 'w_elements', 'U8', (8, 32)), ('scales', 'w_scales', 'U8', (8, 2))]
    """
    fmt = checkpoint_format(fmt)
    shape = tuple(int(d) for d in shape)
    check_layout(layout)
    if is_block_format(fmt):
        scale_rule = check_block_scale_rule(fmt, scale_rule)
        axis = -1 if axis is None else axis
        if not shape:
            raise CheckpointError("a scalar cannot be MX-quantized (blocks run along an axis)")
        if not -len(shape) <= axis < len(shape):
            raise CheckpointError(f"axis {axis} is out of range for shape {list(shape)}")
        axis %= len(shape)
        if shape[axis] % fmt.block_size:
            raise CheckpointError(
                f"axis {axis} has length {shape[axis]}, not a multiple of the {fmt.name} block "
                f"size {fmt.block_size}"
            )
        _check_in_layout(layout, fmt, axis - len(shape))
        return TensorSpec(fmt, shape, dtype, axis=axis, scale_rule=scale_rule, layout=layout)
    check_options_for_cast(fmt, axis=axis, scale_rule=scale_rule)
    _check_in_layout(layout, fmt, None)
    check_fp8_scale(fp8_scale)
    return TensorSpec(fmt, shape, dtype, fp8_scale=fp8_scale if cast_takes_scale(fmt) else None)


def check_block_scale_rule(fmt: MXFormat, scale_rule) -> Optional[str]:
    """The scale rule of block format ``fmt``: ``scale_rule`` checked (None: the default),
    or None for NVFP4, which has its own scale recipe and refuses one."""
    if not fmt.scheme.takes_scale_rule:
        if scale_rule is not None:
            raise CheckpointError(
                f"{fmt.name} has its own scale recipe ({fmt.scheme.recipe}) and takes no scale "
                "rule; drop --scale-rule / scale_rule"
            )
        return None
    return check_scale_rule(ScaleRule.FLOOR if scale_rule is None else scale_rule)


def check_options_for_cast(fmt: ElementFormat, *, axis, scale_rule) -> None:
    """Refuses MX-only options given with an element (cast) format."""
    if scale_rule is not None:
        raise CheckpointError(f"scale rules apply to MX formats only, not {fmt.name}")
    if axis is not None:
        raise CheckpointError(f"a block axis applies to MX formats only, not {fmt.name}")


def _check_in_layout(layout: str, fmt, axis) -> None:
    """Refuses what the layout (lowprec's metadata records lowprec or gpt-oss) cannot hold."""
    get_layout(check_layout(layout)).check_format(fmt, axis=axis)


def pieces(view, align: int, budget: int) -> Iterator[tuple]:
    """Regions ``(p0, p1, a0, a1, s0, s1)`` covering a (P, A, S) tensor in C order, each
    of at most ``max(budget, align)`` elements, with a0 and a1 multiples of ``align``
    (A must be a multiple of ``align``).

    Example:
        >>> list(pieces((4, 64, 1), 32, 128))   # whole rows, two at a time
        [(0, 2, 0, 64, 0, 1), (2, 4, 0, 64, 0, 1)]
        >>> list(pieces((1, 96, 1), 32, 64))    # a 1-D tensor, in whole blocks
        [(0, 1, 0, 64, 0, 1), (0, 1, 64, 96, 0, 1)]
        >>> list(pieces((1, 64, 8), 32, 128))   # axis 0 of a 64 x 8 matrix: column slabs
        [(0, 1, 0, 32, 0, 4), (0, 1, 0, 32, 4, 8), (0, 1, 32, 64, 0, 4), (0, 1, 32, 64, 4, 8)]
    """
    P, A, S = view
    if P * A * S == 0:
        return
    if A % align:
        raise ValueError(f"axis length {A} is not a multiple of {align}")
    budget = max(int(budget), 1)
    if A * S <= budget:  # whole (A, S) planes, several at a time
        step = budget // (A * S)
        for p in range(0, P, step):
            yield (p, min(p + step, P), 0, A, 0, S)
    elif align * S <= budget:  # block-aligned ranges of A, full S (contiguous)
        step = budget // S // align * align
        for p in range(P):
            for a in range(0, A, step):
                yield (p, p + 1, a, min(a + step, A), 0, S)
    else:  # one block high, slabs of S (strided reads, one run per row of the block)
        width = max(1, budget // align)
        for p in range(P):
            for a in range(0, A, align):
                for s in range(0, S, width):
                    yield (p, p + 1, a, a + align, s, min(s + width, S))


# -- lowprec's metadata: the table of a file's quantized tensors ------------------------
METADATA_KEY = "lowprec.tensors"
METADATA_VERSION_KEY = "lowprec.format_version"
METADATA_VERSION = "1"


def metadata_table(reader):
    """The ``lowprec.tensors`` table of ``reader`` as ``{name: TensorSpec}`` (None without
    one), checked: version, JSON, each entry (:meth:`TensorSpec.from_json`)."""
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
    if raw is None:
        return None
    try:
        table = json.loads(raw)
    except RecursionError:
        raise CheckpointError(f"{reader.path}: metadata {METADATA_KEY} is nested too deeply "
                              "(not lowprec's)") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{reader.path}: metadata {METADATA_KEY} is not JSON ({e})") from None
    if not isinstance(table, dict):
        raise CheckpointError(f"{reader.path}: metadata {METADATA_KEY} is not a JSON object")
    return {name: TensorSpec.from_json(name, entry, reader.path) for name, entry in table.items()}
