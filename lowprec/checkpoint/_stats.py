"""Error statistics of a quantized tensor, accumulated piece by piece.

SQNR and the max abs/rel errors are over the elements that are finite both before and
after quantization (float64 throughout). Every other element is counted by what happened
to it, so a report never calls a tensor exact when it is not: a ±inf weight cast with
saturation to ±max, a finite weight that decodes to NaN because its MX block held a NaN
or an inf, a NaN that came out as a number.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np

E8M0_NAN = 0xFF  # the E8M0 scale code of a block that held a NaN or an infinity


class ErrorStats:
    """Accumulates error statistics of one tensor over its pieces.

    Example:
        >>> s = ErrorStats()
        >>> s.update(np.array([1.0, np.inf]), np.array([1.0, 448.0]))
        >>> s.sqnr_db, s.inf_saturated, s.exact, s.describe_nonfinite()
        (inf, 1, False, '1 inf->max')
    """

    def __init__(self):
        self.sum_x2 = 0.0
        self.sum_e2 = 0.0
        self.max_abs = 0.0
        self.max_rel = 0.0
        self.count = 0  # elements in the statistics (finite before and after)
        self.nonfinite = 0  # elements left out: non-finite input or output
        self.nan_in = 0  # NaN inputs
        self.inf_in = 0  # ±inf inputs
        self.inf_saturated = 0  # ±inf inputs stored as a finite value
        self.finite_to_nonfinite = 0  # finite inputs that decode to NaN/±inf
        self.nonfinite_changed = 0  # NaN/±inf inputs not decoded as themselves
        self.nan_blocks = 0  # MX blocks with the NaN scale (0xFF)
        self.clipped = 0
        self.clip_total = 0

    def update(self, x, q) -> None:
        """Adds a piece: ``x`` the original values, ``q`` the decoded quantized ones."""
        x = np.array(x, np.float64).reshape(-1)  # own copies, modified in place below
        q = np.array(q, np.float64).reshape(-1)
        fx, fq = np.isfinite(x), np.isfinite(q)
        ok = fx & fq
        if not ok.all():
            bad = ~ok
            xb, qb, fxb, fqb = x[bad], q[bad], fx[bad], fq[bad]
            inf_x = np.isinf(xb)
            self.nonfinite += int(xb.size)
            self.nan_in += int(np.count_nonzero(np.isnan(xb)))
            self.inf_in += int(np.count_nonzero(inf_x))
            self.inf_saturated += int(np.count_nonzero(inf_x & fqb))
            self.finite_to_nonfinite += int(np.count_nonzero(fxb & ~fqb))
            same = (np.isnan(xb) & np.isnan(qb)) | (xb == qb)
            self.nonfinite_changed += int(np.count_nonzero(~fxb & ~same))
            x, q = x[ok], q[ok]
        del ok, fx, fq
        err = np.subtract(x, q, out=q)
        np.abs(err, out=err)
        self.count += x.size
        self.sum_x2 += float(np.dot(x, x))
        self.sum_e2 += float(np.dot(err, err))
        if err.size:
            self.max_abs = max(self.max_abs, float(err.max()))
            np.abs(x, out=x)
            rel = np.divide(err, x, out=np.zeros_like(err), where=x != 0)
            self.max_rel = max(self.max_rel, float(rel.max()))

    def add_clipped(self, clipped: int, total: int) -> None:
        self.clipped += int(clipped)
        self.clip_total += int(total)

    def add_nan_blocks(self, scales) -> None:
        self.nan_blocks += int(np.count_nonzero(np.asarray(scales) == E8M0_NAN))

    @property
    def sqnr_db(self) -> float:
        """10·log10(Σx² / Σ(x − q)²) over the finite elements (inf: no error there)."""
        if self.sum_e2 == 0:
            return math.inf
        if self.sum_x2 == 0:
            return -math.inf
        return 10 * math.log10(self.sum_x2 / self.sum_e2)

    @property
    def exact(self) -> bool:
        """Every element decodes to itself (NaN to a NaN, ±inf to the same inf)."""
        return self.sum_e2 == 0 and self.finite_to_nonfinite == 0 and self.nonfinite_changed == 0

    @property
    def clipped_fraction(self) -> Optional[float]:
        return self.clipped / self.clip_total if self.clip_total else 0.0

    def describe_nonfinite(self) -> str:
        """What happened to the elements left out of the statistics, in a few words."""
        return describe_nonfinite(
            nan_blocks=self.nan_blocks, inf_saturated=self.inf_saturated,
            finite_to_nonfinite=self.finite_to_nonfinite, nan_in=self.nan_in,
            inf_in=self.inf_in, nonfinite_changed=self.nonfinite_changed,
        )


def describe_nonfinite(*, nan_blocks=0, inf_saturated=0, finite_to_nonfinite=0, nan_in=0,
                       inf_in=0, nonfinite_changed=0) -> str:
    """A short text for the report's "non-finite" column ('' when there is nothing).

    Example:
        >>> describe_nonfinite(nan_blocks=1, finite_to_nonfinite=31, nan_in=1)
        '1 NaN block, 31 finite->NaN, 1 NaN in'
    """
    out = []
    if nan_blocks:
        out.append(f"{nan_blocks} NaN block{'s' if nan_blocks > 1 else ''}")
    if inf_saturated:
        out.append(f"{inf_saturated} inf->max")
    if finite_to_nonfinite:
        out.append(f"{finite_to_nonfinite} finite->NaN")
    if nan_in:
        out.append(f"{nan_in} NaN in")
    other = inf_in - inf_saturated
    if other > 0:
        out.append(f"{other} inf in")
    changed = nonfinite_changed - inf_saturated
    if changed > 0 and not nan_blocks:
        out.append(f"{changed} non-finite changed")
    return ", ".join(out)
