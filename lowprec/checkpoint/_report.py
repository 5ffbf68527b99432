"""Per-tensor reports of a checkpoint conversion: a text table and JSON."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Optional

from ._stats import describe_nonfinite


def _finite_or_none(v):
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return None
    return v


@dataclasses.dataclass
class TensorReport:
    """One tensor of a conversion.

    ``format`` is the stored format, or ``"kept"`` (copied unchanged; ``reason`` says why).
    ``sqnr_db`` = 10·log10(Σx² / Σ(x − q)²), ``max_abs_err`` and ``max_rel_err`` (over
    nonzero x; an element flushed to zero counts 1.0) are over the elements finite before
    and after quantization (``sqnr_db`` inf: no error there). ``exact``: every element
    decodes to itself, non-finite ones included. ``clipped_fraction``: MX: fraction of
    blocks whose max magnitude exceeded max_elem × scale (saturated, as the ``floor`` rule
    does by design); casts: fraction of elements saturated to the format's max.
    ``nonfinite``: elements left out of the statistics; of those, ``nan_in``/``inf_in``
    were NaN/±inf inputs, ``inf_saturated`` ±inf inputs stored as ±max,
    ``finite_to_nonfinite`` finite inputs that decode to NaN (MX blocks holding a NaN or
    an inf: ``nan_blocks`` of them), ``nonfinite_changed`` NaN/±inf inputs not decoded as
    themselves. ``shard``: the file of a sharded checkpoint holding the tensor.
    Dequantize: ``decoded_nonfinite`` NaN/±inf values written (NaN blocks; also counted in
    ``nonfinite``), ``saturated`` finite values clamped to the output dtype's largest finite
    value (only with ``saturate=True``; otherwise such a tensor is refused). Convert with
    ``requantize``: ``changed`` decoded values that differ from the input's (None otherwise).
    """

    name: str
    shape: tuple
    dtype: str
    format: str
    bytes_before: int
    bytes_after: int
    reason: str = ""
    scale_rule: Optional[str] = None
    sqnr_db: Optional[float] = None
    max_abs_err: Optional[float] = None
    max_rel_err: Optional[float] = None
    clipped_fraction: Optional[float] = None
    nonfinite: int = 0
    stored_as: tuple = ()
    exact: Optional[bool] = None
    nan_blocks: int = 0
    inf_saturated: int = 0
    finite_to_nonfinite: int = 0
    nan_in: int = 0
    inf_in: int = 0
    nonfinite_changed: int = 0
    shard: Optional[str] = None
    decoded_nonfinite: int = 0
    saturated: int = 0
    changed: Optional[int] = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def quantized(self) -> bool:
        return self.format != "kept"

    @property
    def bits_per_param(self) -> Optional[float]:
        return 8 * self.bytes_after / self.numel if self.numel else None

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["shape"] = list(self.shape)
        d["stored_as"] = list(self.stored_as)
        d["numel"] = self.numel
        d["bits_per_param"] = self.bits_per_param
        d["sqnr_db"] = _finite_or_none(self.sqnr_db)
        d["exact"] = bool(self.quantized and self.exact)
        return d

    def nonfinite_text(self) -> str:
        """What happened to non-finite values ('' if nothing), for the table."""
        text = describe_nonfinite(
            nan_blocks=self.nan_blocks, inf_saturated=self.inf_saturated,
            finite_to_nonfinite=self.finite_to_nonfinite, nan_in=self.nan_in,
            inf_in=self.inf_in, nonfinite_changed=self.nonfinite_changed,
        )
        extra = []
        if self.decoded_nonfinite:
            extra.append(f"{self.decoded_nonfinite} NaN/inf decoded")
        if self.saturated:
            extra.append(f"{self.saturated} saturated to ±max")
        return ", ".join(filter(None, [text, *extra]))


@dataclasses.dataclass
class ConversionReport:
    """The result of :func:`quantize_checkpoint` / :func:`dequantize_checkpoint`."""

    source: str
    destination: Optional[str]
    operation: str
    options: dict
    tensors: list
    seconds: float = 0.0
    skipped: list = dataclasses.field(default_factory=list)  # (file, reason) not copied

    @property
    def quantized(self) -> list:
        return [t for t in self.tensors if t.quantized]

    def totals(self) -> dict:
        q = self.quantized
        params = sum(t.numel for t in self.tensors)
        qparams = sum(t.numel for t in q)
        before = sum(t.bytes_before for t in self.tensors)
        after = sum(t.bytes_after for t in self.tensors)
        out = {
            "tensors": len(self.tensors),
            "tensors_quantized": len(q),
            "params": params,
            "params_quantized": qparams,
            "bytes_before": before,
            "bytes_after": after,
            "compression": before / after if after else None,
            "bits_per_param": 8 * after / params if params else None,
            "bits_per_param_quantized": (
                8 * sum(t.bytes_after for t in q) / qparams if qparams else None
            ),
            "seconds": round(self.seconds, 3),
        }
        stats = [t for t in q if t.sqnr_db is not None]
        if stats:
            worst = min(stats, key=lambda t: t.sqnr_db)
            out["min_sqnr_db"] = _finite_or_none(worst.sqnr_db)
            out["min_sqnr_tensor"] = worst.name
            # parameter-weighted mean of the per-tensor SQNRs (dB)
            finite = [t for t in stats if math.isfinite(t.sqnr_db)]
            if finite:
                w = sum(t.numel for t in finite)
                out["mean_sqnr_db"] = sum(t.sqnr_db * t.numel for t in finite) / w
            out["min_sqnr_exact"] = bool(worst.exact)
            out["max_abs_err"] = max(t.max_abs_err or 0.0 for t in stats)
            out["clipped_fraction_max"] = max(t.clipped_fraction or 0.0 for t in stats)
            out["tensors_with_nonfinite"] = sum(1 for t in stats if t.nonfinite)
        if self.operation == "dequantize":
            out["tensors_with_nonfinite"] = sum(1 for t in q if t.decoded_nonfinite)
            out["values_saturated"] = sum(t.saturated for t in q)
        return out

    def to_dict(self) -> dict:
        return {
            "operation": self.operation,
            "source": self.source,
            "destination": self.destination,
            "options": self.options,
            "totals": self.totals(),
            "tensors": [t.to_dict() for t in self.tensors],
            "not_copied": [{"file": f, "reason": r} for f, r in self.skipped],
        }

    def to_json(self, indent: int = 1) -> str:
        return json.dumps(self.to_dict(), indent=indent, allow_nan=False)

    def table(self, show_kept: bool = True) -> str:
        """A fixed-width text table, one line per tensor, then totals."""
        if self.operation == "inspect":
            return self._inspect_table()
        rows = [t for t in self.tensors if show_kept or t.quantized]
        header = ["tensor", "shape", "dtype", "format", "MiB in", "MiB out", "bits/p",
                  "SQNR dB", "max abs err", "max rel err", "clipped", "non-finite", "note"]
        lines = []
        for t in rows:
            star = "*" if t.nonfinite else ""
            lines.append([
                t.name,
                "x".join(map(str, t.shape)) or "scalar",
                t.dtype,
                t.format,
                f"{t.bytes_before / 2**20:.3f}",
                f"{t.bytes_after / 2**20:.3f}",
                "" if t.bits_per_param is None else f"{t.bits_per_param:.2f}",
                _num(t.sqnr_db, "{:.2f}", exact="exact" if t.exact else "inf", star=star),
                _num(t.max_abs_err, "{:.3g}", star=star),
                _num(t.max_rel_err, "{:.3g}", star=star),
                _num(t.clipped_fraction, "{:.2%}"),
                t.nonfinite_text(),
                f"kept: {t.reason}" if not t.quantized and t.reason else "",
            ])
        widths = [max(len(h), *(len(r[i]) for r in lines)) if lines else len(h)
                  for i, h in enumerate(header)]

        def fmt(cells):
            out = []
            for i, (c, w) in enumerate(zip(cells, widths)):
                out.append(c.ljust(w) if i < 4 or i >= len(cells) - 2 else c.rjust(w))
            return "  ".join(out).rstrip()

        text = [fmt(header), fmt(["-" * w for w in widths])]
        text += [fmt(r) for r in lines]
        tot = self.totals()
        text.append("")
        text.append(
            f"{tot['tensors_quantized']} of {tot['tensors']} tensors quantized "
            f"({tot['params_quantized']:,} of {tot['params']:,} params); "
            f"{tot['bytes_before'] / 2**20:.2f} MiB -> {tot['bytes_after'] / 2**20:.2f} MiB"
            + (f" ({tot['compression']:.2f}x)" if tot["compression"] else "")
            + (f"; {tot['bits_per_param']:.2f} bits/param overall" if tot["bits_per_param"] else "")
            + (
                f", {tot['bits_per_param_quantized']:.2f} in quantized tensors"
                if tot["bits_per_param_quantized"]
                else ""
            )
        )
        if "min_sqnr_tensor" in tot:
            worst = tot["min_sqnr_db"]
            worst_text = ("exact" if tot["min_sqnr_exact"] else "inf*") if worst is None else f"{worst:.2f} dB"
            text.append(
                "SQNR: "
                + (f"mean {tot['mean_sqnr_db']:.2f} dB (param-weighted), " if "mean_sqnr_db" in tot else "")
                + f"min {worst_text} ({tot['min_sqnr_tensor']}); "
                f"max clipped fraction {tot['clipped_fraction_max']:.2%}"
            )
            if tot["tensors_with_nonfinite"]:
                text.append(
                    f"* {tot['tensors_with_nonfinite']} tensor(s) hold NaN/inf values or gained "
                    "them: their SQNR and errors are over the elements finite before and after; "
                    "the non-finite column says what happened to the others"
                )
        if tot.get("values_saturated"):
            text.append(f"{tot['values_saturated']:,} decoded value(s) beyond the output dtype's "
                        "range saturated to its largest finite value (--saturate)")
        text += self._skipped_lines()
        return "\n".join(text)

    def _skipped_lines(self) -> list:
        return [f"not copied: {f} ({r})" for f, r in self.skipped]


    def _inspect_table(self) -> str:
        header = ["tensor", "shape", "dtype", "format", "MiB", "bits/param", "stored as"]
        lines = [
            [
                t.name,
                "x".join(map(str, t.shape)) or "scalar",
                t.dtype,
                (t.format + (f" {t.scale_rule}" if t.scale_rule else "")) if t.quantized else t.dtype,
                f"{t.bytes_after / 2**20:.3f}",
                "" if t.bits_per_param is None else f"{t.bits_per_param:.2f}",
                ", ".join(t.stored_as),
            ]
            for t in self.tensors
        ]
        widths = [max(len(h), *(len(r[i]) for r in lines)) if lines else len(h)
                  for i, h in enumerate(header)]
        just = [str.ljust, str.ljust, str.ljust, str.ljust, str.rjust, str.rjust, str.ljust]

        def fmt(cells):
            return "  ".join(j(c, w) for j, c, w in zip(just, cells, widths)).rstrip()

        text = [fmt(header), fmt(["-" * w for w in widths])] + [fmt(r) for r in lines]
        tot = self.totals()
        by_format: dict = {}
        for t in self.tensors:
            key = t.format if t.quantized else t.dtype
            n, b = by_format.get(key, (0, 0))
            by_format[key] = (n + t.numel, b + t.bytes_after)
        text.append("")
        text.append(
            f"{tot['tensors']} tensors, {tot['params']:,} params, "
            f"{tot['bytes_after'] / 2**20:.2f} MiB"
            + (f", {tot['bits_per_param']:.2f} bits/param" if tot["bits_per_param"] else "")
            + f" ({tot['bytes_before'] / 2**20:.2f} MiB in the original dtypes)"
        )
        text.append(
            "by format: "
            + "; ".join(
                f"{k}: {n:,} params, {8 * b / n if n else 0:.2f} bits/param"
                for k, (n, b) in by_format.items()
            )
        )
        for lay, presets in self.options.get("layouts", {}).items():
            text.append(f"layout: {lay}" + (f" (preset {', '.join(presets)})" if presets else ""))
        meta = self.options.get("metadata")
        if meta:
            text.append("metadata: " + json.dumps(meta)[:500])
        if self.options.get("shards"):
            text.append(f"{self.options['shards']} shard files")
        text += [f"not decodable by lowprec: {u}" for u in self.options.get("undecodable", ())]
        text += self._skipped_lines()
        return "\n".join(text)


def _num(v, spec, exact="", star=""):
    if v is None:
        return ""
    if isinstance(v, float) and math.isinf(v):
        text = exact if v > 0 else "-inf"
        return text + (star if text != "exact" else "")
    return spec.format(v) + star
