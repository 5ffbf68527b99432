"""Every float32 bit pattern through lowprec's default encode vs ml_dtypes' astype.

The test suite checks 2^22 random patterns per format plus adversarial sets; this script
runs the exhaustive sweep (2^32 inputs per format, in chunks of 2^24, a few minutes per
format on a laptop CPU) that is too long for CI:

    python scripts/sweep_float32.py                       # every format with an ml_dtypes type
    python scripts/sweep_float32.py e4m3fnuz e2m3 --start 0x7f000000 --count 0x01000000

A code matches when it equals ml_dtypes' bit for bit, or when both decode to NaN (NaN
payloads aside, docs/design.md §2). Exits 1 on the first format with a mismatch, printing the
first few inputs.
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import ml_dtypes  # noqa: F401  (the dtypes named in formats/elements.json)
import numpy as np

import lowprec
import lowprec_formats

CHUNK = 1 << 24


def sweep(fmt_name: str, start: int, count: int) -> int:
    fmt = lowprec.element_format(fmt_name)
    dt = fmt.storage_dtype
    uint = np.uint16 if dt.itemsize == 2 else np.uint8
    encode = jax.jit(lambda x: lowprec.encode(x, fmt))
    decode = jax.jit(lambda c: lowprec.decode(c, fmt))
    bad_total, t0 = 0, time.time()
    for lo in range(start, start + count, CHUNK):
        n = min(CHUNK, start + count - lo)
        x = np.arange(lo, lo + n, dtype=np.uint64).astype(np.uint32).view(np.float32)
        got = np.asarray(encode(jnp.asarray(x)))
        with np.errstate(all="ignore"):
            want = x.astype(dt).view(uint)
            want_nan = np.isnan(want.view(dt).astype(np.float32))
        got_nan = np.isnan(np.asarray(decode(jnp.asarray(got))))
        bad = (got.astype(uint) != want) & ~(got_nan & want_nan)
        if bad.any():
            idx = np.flatnonzero(bad)[:5]
            print(f"{fmt_name}: mismatch at float32 patterns "
                  f"{[hex(int(x.view(np.uint32)[i])) for i in idx]}: lowprec "
                  f"{[hex(int(got[i])) for i in idx]}, ml_dtypes {[hex(int(want[i])) for i in idx]}")
            return int(bad.sum())
        done = lo + n - start
        print(f"\r{fmt_name}: {done / count:6.1%} of {count:#x} patterns, "
              f"{time.time() - t0:6.1f} s", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    print(f"{fmt_name}: {count:#x} float32 patterns from {start:#010x}: identical to ml_dtypes")
    return bad_total


def main(argv=None) -> int:
    with_ml = lowprec_formats.COLLECTIONS["with_ml_dtypes"]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("formats", nargs="*", default=list(with_ml), choices=with_ml)
    p.add_argument("--start", type=lambda s: int(s, 0), default=0)
    p.add_argument("--count", type=lambda s: int(s, 0), default=1 << 32)
    args = p.parse_args(argv)
    for name in args.formats:
        if sweep(name, args.start, min(args.count, (1 << 32) - args.start)):
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
