"""Error statistics of a quantized tensor, accumulated piece by piece.

SQNR and the max abs/rel errors are over the elements that are finite both before and
after quantization (float64 throughout). Every other element is counted by what happened
to it, so a report never calls a tensor exact when it is not: a ±inf weight cast with
saturation to ±max, a finite weight that decodes to NaN because its MX block held a NaN
or an inf, a NaN that came out as a number.

Precision: each square x² and (x − q)² of float32 values is exact or rounded once in
float64 (the native pass adds it by a fused multiply-add: x² is exact, so its sum is the
same; (x − q)² is rounded with the addition), and the maxima are exact. The sums are
accumulated in a fixed order (so a report is the same on every run, for any number of
worker threads): within a piece by NumPy's pairwise sum (:meth:`ErrorStats.update`) or by
the native pass's eight float64 lanes (:mod:`lowprec.kernels._ckpt_cpu`), then piece after
piece. The two differ by rounding only: each lane's running sum of m positive terms is
within (m − 1) 2^-53 relative of the exact one (recursive summation's bound), so for a
piece of 2^20 elements in eight lanes Σx² and Σ(x − q)² are within 2e-11 relative of
NumPy's at worst and about 1e-13 in practice (errors of random sign), the SQNR in dB within
2e-10 (10 log10 e x 4e-11; far below the two decimals the report prints).
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
        self.nan_blocks = 0  # blocks with the NaN scale (E8M0 0xFF; NVFP4: E4M3 NaN)
        self.clipped = 0
        self.clip_total = 0
        self._buf = None

    def _scratch(self, n: int) -> tuple:
        """Two float64 work arrays of ``n`` elements, reused across pieces (a fresh 8 MB
        array costs page faults on every touch)."""
        if self._buf is None or self._buf[0].size < n:
            self._buf = (np.empty(n, np.float64), np.empty(n, np.float64), np.empty(n, np.float64))
        return tuple(b[:n] for b in self._buf)

    def update(self, x, q) -> None:
        """Adds a piece: ``x`` the original values, ``q`` the decoded quantized ones."""
        x, q = np.asarray(x).reshape(-1), np.asarray(q).reshape(-1)
        xd, ed, tmp = self._scratch(x.size)
        with np.errstate(invalid="ignore"):  # signaling NaNs raise "invalid" when converted
            np.copyto(xd, x if x.dtype in (np.float32, np.float64) else x.astype(np.float32))
            np.copyto(ed, q)
        np.subtract(xd, ed, out=ed)  # x − q, exact in float64 for float32 x and q
        # Squares and pairwise sums (NumPy's reduce), not BLAS dot: as exact, and no
        # thread pool to wake on a busy machine.
        sum_x2 = float(np.add.reduce(np.square(xd, out=tmp)))
        sum_e2 = float(np.add.reduce(np.square(ed, out=tmp)))
        if not (math.isfinite(sum_x2) and math.isfinite(sum_e2)):  # some element is not
            qd = np.asarray(q, np.float64)
            fx, fq = np.isfinite(xd), np.isfinite(qd)
            bad = ~(fx & fq)
            xb, qb, fxb, fqb = xd[bad], qd[bad], fx[bad], fq[bad]
            inf_x = np.isinf(xb)
            self.nonfinite += int(xb.size)
            self.nan_in += int(np.count_nonzero(np.isnan(xb)))
            self.inf_in += int(np.count_nonzero(inf_x))
            self.inf_saturated += int(np.count_nonzero(inf_x & fqb))
            self.finite_to_nonfinite += int(np.count_nonzero(fxb & ~fqb))
            same = (np.isnan(xb) & np.isnan(qb)) | (xb == qb)
            self.nonfinite_changed += int(np.count_nonzero(~fxb & ~same))
            xd, ed = xd[~bad], ed[~bad]
            tmp = tmp[: xd.size]
            sum_x2 = float(np.add.reduce(np.square(xd, out=tmp)))
            sum_e2 = float(np.add.reduce(np.square(ed, out=tmp)))
        self.count += xd.size
        self.sum_x2 += sum_x2
        self.sum_e2 += sum_e2
        if ed.size and sum_e2 > 0:
            np.abs(ed, out=ed)
            self.max_abs = max(self.max_abs, float(ed.max()))
            np.abs(xd, out=xd)
            # |x| = 0 only where q = 0 too (e = 0): dividing by the smallest double keeps 0.
            np.maximum(xd, 5e-324, out=xd)
            np.divide(ed, xd, out=ed)
            self.max_rel = max(self.max_rel, float(ed.max()))

    def add_vector(self, v) -> None:
        """Adds a piece's statistics as the native pass computes them (the slots of
        :data:`lowprec.kernels._ckpt_cpu.STATS`: counts, sums, maxima, clipped blocks);
        :meth:`update` and :meth:`add_clipped` in one step."""
        v = [float(t) for t in v]
        (count, sum_x2, sum_e2, max_abs, max_rel, nonfinite, nan_in, inf_in, inf_saturated,
         finite_to_nonfinite, nonfinite_changed, clipped, clip_total) = v
        self.count += int(count)
        self.sum_x2 += sum_x2
        self.sum_e2 += sum_e2
        self.max_abs = max(self.max_abs, max_abs)
        self.max_rel = max(self.max_rel, max_rel)
        self.nonfinite += int(nonfinite)
        self.nan_in += int(nan_in)
        self.inf_in += int(inf_in)
        self.inf_saturated += int(inf_saturated)
        self.finite_to_nonfinite += int(finite_to_nonfinite)
        self.nonfinite_changed += int(nonfinite_changed)
        self.add_clipped(int(clipped), int(clip_total))

    def merge(self, other: "ErrorStats") -> None:
        """Adds the statistics of another piece of the same tensor (pieces measured apart,
        e.g. on worker threads, and merged in the tensor's order).

        Example:
            >>> a, b = ErrorStats(), ErrorStats()
            >>> a.update(np.array([1.0, 2.0]), np.array([1.0, 2.5]))
            >>> b.update(np.array([4.0]), np.array([3.0]))
            >>> a.merge(b)
            >>> a.count, a.sum_x2, a.sum_e2, a.max_abs
            (3, 21.0, 1.25, 1.0)
        """
        for name in ("count", "sum_x2", "sum_e2", "nonfinite", "nan_in", "inf_in",
                     "inf_saturated", "finite_to_nonfinite", "nonfinite_changed", "nan_blocks",
                     "clipped", "clip_total"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.max_abs = max(self.max_abs, other.max_abs)
        self.max_rel = max(self.max_rel, other.max_rel)

    def add_clipped(self, clipped: int, total: int) -> None:
        self.clipped += int(clipped)
        self.clip_total += int(total)

    def add_nan_blocks(self, scales, nan_table=None) -> None:
        """Counts the blocks whose scale code is NaN: E8M0 0xFF, or where ``nan_table`` (a
        boolean per uint8 code, for other scale formats such as NVFP4's E4M3) says so."""
        scales = np.asarray(scales)
        if nan_table is None:
            self.nan_blocks += int(np.count_nonzero(scales == E8M0_NAN))
        else:
            self.nan_blocks += int(np.count_nonzero(np.asarray(nan_table)[scales]))

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
