"""Every float32 input (all 2^32 bit patterns) through lowprec's encoders, checked twice:

1. default mode (nearest_even, "ieee") against ml_dtypes' ``astype`` (``lax.reduce_precision``
   for tf32), bit for bit; a NaN output only needs to be a NaN with the input's sign (lowprec
   gives the format's canonical NaN; docs/design.md §9);
2. the float32 fast paths (default mode, and stochastic rounding with fixed pseudo-random
   32-bit words and with 16-bit words, whose encoders differ) against lowprec's general
   encoder run on the same values as float64 patterns, which no fast path takes, bit for bit.

Run: ``python scripts/exhaustive_f32.py`` (every element format; about 10 minutes per format
on a 2-core CPU), ``--formats fp16 e8m0``, ``--step 64`` (every 64th chunk of 2^22 patterns,
for a quick look). Prints progress and a summary; the exit status is 1 if anything differs.
Too slow for the test suite (which checks random and adversarial samples of the same
properties); run it after changing an encoder.
"""

from __future__ import annotations

import argparse
import sys
import time

import jax

jax.config.update("jax_enable_x64", True)  # the general encoder's float64 input

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402

import lowprec  # noqa: E402
from lowprec import _dtypes, _encode, _encode_fast  # noqa: E402

CHUNK = 1 << 22


def _words(start):
    # Fixed pseudo-random 32-bit words (a multiplicative hash of the pattern itself).
    i = start + jnp.arange(CHUNK, dtype=jnp.uint32)
    return (i * jnp.uint32(2654435761)) ^ lax.shift_right_logical(i, jnp.uint32(7)) * jnp.uint32(40503)


def check_format(name: str, step: int) -> int:
    f = lowprec.element_format(name)
    dt = f.storage_dtype
    fast_modes = []
    if _encode_fast.rebias_encodable(f):
        fast_modes += ["nearest_even", "stochastic"]
    if _encode_fast.is_e8m0(f):
        fast_modes += ["nearest_even", "nearest_away"]

    default = jax.jit(lambda s: lowprec.encode(
        lax.bitcast_convert_type(s + jnp.arange(CHUNK, dtype=jnp.uint32), jnp.float32), f))

    def fast(mode):
        return jax.jit(lambda s: _encode.encode_bits(
            f, s + jnp.arange(CHUNK, dtype=jnp.uint32), mode, "ieee",
            _words(s) if mode == "stochastic" else None))

    def general(mode):
        def run(s):
            u = _dtypes.f32_bits_to_f64(s + jnp.arange(CHUNK, dtype=jnp.uint32))
            return _encode.encode_bits(f, lax.bitcast_convert_type(u, jnp.uint64), mode, "ieee",
                                      _words(s) if mode == "stochastic" else None)
        return jax.jit(run)

    pairs = [(m, fast(m), general(m)) for m in fast_modes]
    enc16 = _encode_fast.stochastic16_encoder(f)
    if enc16 is not None:  # 16-bit words: the top half of the same pseudo-random words
        def words16(s):
            return lax.shift_right_logical(_words(s), jnp.uint32(16))

        def fast16(s):
            u = s + jnp.arange(CHUNK, dtype=jnp.uint32)
            return enc16(f, u, words16(s) ^ jnp.uint32(0xFFFF))

        def general16(s):
            u = _dtypes.f32_bits_to_f64(s + jnp.arange(CHUNK, dtype=jnp.uint32))
            return _encode.encode_bits(f, lax.bitcast_convert_type(u, jnp.uint64), "stochastic",
                                      "ieee", lax.shift_left(words16(s), jnp.uint32(16)))
        pairs.append(("stochastic16", jax.jit(fast16), jax.jit(general16)))
        fast_modes.append("stochastic16")
    bad = {"default vs " + ("ml_dtypes" if dt is not None else "reduce_precision"): 0}
    bad.update({f"{m} fast vs general": 0 for m in fast_modes})
    t0 = time.perf_counter()
    starts = range(0, 1 << 32, CHUNK * step)
    for done, start in enumerate(starts, 1):
        s = jnp.uint32(start)
        x = (np.arange(CHUNK, dtype=np.uint64) + start).astype(np.uint32).view(np.float32)
        got = np.asarray(default(s))
        if dt is not None:
            with np.errstate(invalid="ignore", over="ignore"):
                ref = x.astype(dt)
            want = ref.view({1: np.uint8, 2: np.uint16}[dt.itemsize])
            nan_ref = np.isnan(ref.astype(np.float32))
            nan_got = np.isnan(np.asarray(lowprec.decode(got, f)))
            # A NaN output must be a NaN; its sign must be the input's where the format has one.
            # (fnuz formats have one NaN, 0x80, whatever the sign: ml_dtypes gives it too.)
            sign_ok = (not f.signed) | (f.nan == "negative_zero") | (
                ((got >> f.magnitude_bits) & 1) == np.signbit(x))
            diff = np.where(nan_ref, ~nan_got | ~sign_ok, got != want.astype(got.dtype))
        else:  # tf32: the top 19 bits of reduce_precision(x, 8, 10)
            ref = np.asarray(lax.reduce_precision(jnp.asarray(x), 8, 10)).view(np.uint32) >> 13
            nan_ref = np.isnan(x)
            diff = np.where(nan_ref, ~np.isnan((got.astype(np.uint32) << 13).view(np.float32)),
                            got != ref)
        bad[next(iter(bad))] += int(diff.sum())
        for mode, fa, ge in pairs:
            bad[f"{mode} fast vs general"] += int((np.asarray(fa(s)) != np.asarray(ge(s))).sum())
        if done % 64 == 0 or done == len(starts):
            print(f"  {name}: {done}/{len(starts)} chunks, {time.perf_counter() - t0:.0f} s, "
                  f"mismatches so far {sum(bad.values())}", flush=True)
    for what, count in bad.items():
        print(f"{name}: {what}: {count} mismatches")
    return sum(bad.values())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # Formats with a peer to compare with: an ml_dtypes type, or TF32's reduce_precision (the
    # MX INT8 element has neither; the reference checks it in the test suite).
    with_peer = [n for n in lowprec.ELEMENT_FORMAT_NAMES
                 if n == "tf32" or lowprec.element_format(n).storage_dtype is not None]
    p.add_argument("--formats", nargs="+", default=with_peer, choices=with_peer)
    p.add_argument("--step", type=int, default=1, help="check every STEP-th chunk of 2^22")
    args = p.parse_args(argv)
    total = sum(check_format(name, args.step) for name in args.formats)
    print("all identical" if total == 0 else f"{total} mismatches in all")
    return 1 if total else 0


if __name__ == "__main__":
    sys.exit(main())
