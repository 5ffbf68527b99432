"""Every non-negative finite float32 through the NVFP4 encoder's CPU arithmetic, against NumPy.

NumPy's float32 division is IEEE 754 with subnormals kept; XLA:CPU's flushes them, which is
what the CPU formulations in ``lowprec/_nvfp4.py`` work around. Checked, bit for bit, for all
2^31 - 2^23 patterns a (+0 up to the largest finite float32):

1. ``div_by_integer(a, d)`` = float32(a / d) for the NVFP4 constants d = 6, 7 (block maxima
   over the element's largest value), 2688 and 3136 (tensor scales: 448 * 6, 448 * 7), called
   on the whole array and under ``vmap`` over its elements (a scalar per example, as
   ragged_dot's per-group tensor scales are: the divisor is not batched there);
2. ``hwfloat_sr_quotients(a, t)`` for a few block factors t across the hardware-float range
   [2^-124, 2^125]: float32(a / t) wherever that is at least 2^-126, else 2^-100 where it is
   nonzero and 0 where it is zero (the stochastic encode treats every quotient in (0, 2^-33)
   alike).

Run: ``python scripts/exhaustive_nvfp4_cpu.py`` (about a minute per divisor on an idle 2-core
CPU), ``--step 16`` (every 16th chunk of 2^24 patterns, for a quick look), ``--chunks 0 1 6 7``
(where the quotients turn subnormal). Prints progress
and a summary; the exit status is 1 if anything differs. Run on CPU (``JAX_PLATFORMS=cpu``):
elsewhere both functions take the integer long division, which this does not check.
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from lowprec import _nvfp4

CHUNK = 1 << 24
LAST = 0x7F80_0000  # +inf: patterns below it are the non-negative finite float32
DIVISORS = (6, 7, 2688, 3136)
FACTORS = (2.0**-124, 1.625 * 2.0**-124, 1e-30, 0.75, 1.0, 3.0 * 2.0**100, 1.75 * 2.0**124)


def _expected_sr(a, t):
    with np.errstate(all="ignore"):
        q = (a.view(np.float32) / np.float32(t)).astype(np.float32).view(np.uint32)
    small = np.where(q != 0, np.float32(2.0**-100).view(np.uint32), np.uint32(0))
    return np.where(q >= np.uint32(0x0080_0000), q, small)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--step", type=int, default=1, help="check every step-th chunk of 2^24")
    p.add_argument("--chunks", type=int, nargs="+", default=None,
                   help="check these chunks of 2^24 only (e.g. 0 1 6 7: the subnormals and "
                   "the patterns around d * 2^-126, where the quotients become subnormal)")
    args = p.parse_args(argv)
    div = {d: jax.jit(lambda a, d=d: _nvfp4.div_by_integer(a, d)) for d in DIVISORS}
    div_vmap = {d: jax.jit(jax.vmap(lambda a, d=d: _nvfp4.div_by_integer(a, d)))
                for d in DIVISORS}
    sr = jax.jit(lambda a, t: _nvfp4.hwfloat_sr_quotients(a, t))
    bad = 0
    t0 = time.time()
    starts = (range(0, LAST, CHUNK * args.step) if args.chunks is None
              else [c * CHUNK for c in args.chunks if c * CHUNK < LAST])
    for i, start in enumerate(starts):
        a = np.arange(start, min(start + CHUNK, LAST), dtype=np.uint32)
        for d in DIVISORS:
            with np.errstate(all="ignore"):
                want = (a.view(np.float32) / np.float32(d)).astype(np.float32).view(np.uint32)
            for form, f in (("", div[d]), (" under vmap", div_vmap[d])):
                got = np.asarray(f(a))
                n = int((got != want).sum())
                if n:
                    j = int(np.flatnonzero(got != want)[0])
                    print(f"div_by_integer(., {d}){form}: {n} differ, e.g. {a[j]:#010x}: "
                          f"{got[j]:#010x} != {want[j]:#010x}")
                bad += n
        for t in FACTORS:
            got = np.asarray(sr(a, jnp.full(a.shape, t, jnp.float32)))
            want = _expected_sr(a, t)
            n = int((got != want).sum())
            if n:
                j = int(np.flatnonzero(got != want)[0])
                print(f"hwfloat_sr_quotients(., {t!r}): {n} differ, e.g. {a[j]:#010x}: "
                      f"{got[j]:#010x} != {want[j]:#010x}")
            bad += n
        if i % 8 == 7 or i == len(starts) - 1:
            print(f"{i + 1}/{len(starts)} chunks, {time.time() - t0:.0f} s, {bad} differences",
                  flush=True)
    print("all identical" if not bad else f"{bad} differences")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
