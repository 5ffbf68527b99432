"""Statistical checks of stochastic rounding's random words (docs/design.md §2).

The words come from a 32-bit counter hash (a Weyl sequence through lowbias32's multiply–
xorshift rounds), not from a generator with published test-battery results, so the
properties stochastic rounding relies on are tested here, on 2^22 words per check: every
16-bit value equally likely; neighbouring words (lag 1, 2, 4, an MX block of 32, a matrix
row) independent, as pairs of bytes and bit by bit; the words of different keys (fold_in,
split) independent; and rounding unbiased at several fractions. Each statistic is compared
with its distribution under independent uniform words at a 6-sigma bound (the inputs are
fixed, so a pass is deterministic; 6 sigma leaves the ~50 statistics here a false-alarm rate
near 1e-7 each). A negative control shows that the same checks reject words with a known
defect.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lowprec

N = 1 << 22
Z_BOUND = 6.0


def _words(key, n: int = N) -> np.ndarray:
    return np.asarray(lowprec.random_bits(key, (n,))).astype(np.int64)


def _chi2_z(counts: np.ndarray) -> float:
    """(χ² − df) / sqrt(2 df) of equally likely cells: about N(0, 1) for independent
    uniform data when every cell expects many counts (here at least 64)."""
    expected = counts.sum() / counts.size
    chi2 = float(((counts - expected) ** 2).sum() / expected)
    df = counts.size - 1
    return (chi2 - df) / math.sqrt(2 * df)


def _pair_z(a: np.ndarray, b: np.ndarray, byte: str) -> float:
    """χ² z-score of the 65536 (byte of a, byte of b) pairs: "hi" or "lo" byte."""
    if byte == "hi":
        a, b = a >> 8, b >> 8
    else:
        a, b = a & 0xFF, b & 0xFF
    return _chi2_z(np.bincount((a << 8) | b, minlength=1 << 16))


def _bit_correlation_z(a: np.ndarray, b: np.ndarray) -> float:
    """The largest |z| of the 256 correlations between bit j of a and bit k of b (each
    ±1-valued product sum over n pairs is about N(0, n) if independent)."""
    sa = (((a[:, None] >> np.arange(16)) & 1) * 2 - 1).astype(np.float32)
    sb = (((b[:, None] >> np.arange(16)) & 1) * 2 - 1).astype(np.float32)
    return float(np.abs(sa.T @ sb).max() / math.sqrt(a.size))


def _serial_failures(w: np.ndarray, lags=(1, 2, 4, 32, 4096)) -> dict:
    """Every statistic of the serial checks above Z_BOUND, by name (empty if none)."""
    stats = {"hist16": _chi2_z(np.bincount(w, minlength=1 << 16)),
             "hi_byte": _chi2_z(np.bincount(w >> 8, minlength=256)),
             "lo_byte": _chi2_z(np.bincount(w & 0xFF, minlength=256))}
    for lag in lags:
        a, b = w[:-lag], w[lag:]
        stats[f"pairs_hi_lag{lag}"] = _pair_z(a, b, "hi")
        stats[f"pairs_lo_lag{lag}"] = _pair_z(a, b, "lo")
        m = 1 << 18  # bit correlations on a prefix: 256 sums of 2^18 products
        stats[f"bits_lag{lag}"] = _bit_correlation_z(a[:m], b[:m])
    return {k: round(v, 1) for k, v in stats.items() if abs(v) > Z_BOUND}


@pytest.mark.quick_cases(seed=[0])  # the second key in the default run
@pytest.mark.parametrize("seed", [0, 1])
def test_words_are_uniform_and_serially_independent(seed):
    assert _serial_failures(_words(jax.random.key(seed))) == {}


def test_words_along_a_strided_axis_are_independent():
    # Column 5 of a row-major [65536, 64] array: the words of indices 64 i + 5, in order.
    w = np.asarray(lowprec.random_bits(jax.random.key(3), (1 << 16, 64)))[:, 5].astype(np.int64)
    assert abs(_chi2_z(np.bincount(w >> 8, minlength=256))) < Z_BOUND
    nibbles = ((w[:-1] >> 12) << 4) | (w[1:] >> 12)  # pairs of top nibbles: 256 cells
    assert abs(_chi2_z(np.bincount(nibbles, minlength=256))) < Z_BOUND
    assert _bit_correlation_z(w[:-1], w[1:]) < Z_BOUND


def test_words_of_different_keys_are_independent():
    key = jax.random.key(5)
    base = _words(key)
    others = {"fold_in 1": jax.random.fold_in(key, 1), "fold_in 2": jax.random.fold_in(key, 2),
              "split": jax.random.split(key)[0], "next seed": jax.random.key(6)}
    for name, other in others.items():
        w = _words(other)
        for byte in ("hi", "lo"):
            assert abs(_pair_z(base, w, byte)) < Z_BOUND, (name, byte)
        assert _bit_correlation_z(base[: 1 << 18], w[: 1 << 18]) < Z_BOUND, name
        assert (base == w).mean() < 2.0**-16 + Z_BOUND * 2.0**-8 / math.sqrt(N), name


def test_the_checks_reject_defective_words():
    # Negative control: a Weyl sequence without the multiply-xorshift rounds, and the hash
    # with only one of its two rounds, both fail the serial checks.
    i = np.arange(N, dtype=np.uint64)
    weyl = ((i * 0x9E3779B9 + 12345) % 2**32) >> 16
    assert _serial_failures(weyl.astype(np.int64))
    x = (i * 0x9E3779B9 + 12345) % 2**32
    x = ((x ^ (x >> 16)) * 0x7FEB352D) % 2**32
    assert _serial_failures((x >> 16).astype(np.int64))


# (format, x, frac): x lies between neighbours lo < |x| < hi of the format at about frac of
# the gap (the test computes the exact frac of float32(x)); rounding away from zero has
# probability ⌈frac · 2^16⌉ / 2^16 by the contract.
UNBIASED_CASES = [
    ("e4m3", 1.0 + 0.125 / 3, 1 / 3),  # gap 2^-3 above 1
    ("e4m3", 1.0 + 0.125 * 0.9, 0.9),
    ("e4m3", 2.0**-9 * 5.3, 0.3),  # subnormal results: quantum 2^-9
    ("e5m2", -(1.0 + 0.25 * 0.1), 0.1),  # gap 2^-2 above 1, negative
    ("bf16", 1.0 + 2.0**-7 * 0.25, 0.25),
    ("fp16", 2.0**-24 * 28.75, 0.75),  # subnormal results: quantum 2^-24
    ("e8m0", 1.7, 0.7),  # between 2^0 and 2^1
]


@pytest.mark.parametrize("fmt,x,frac", UNBIASED_CASES, ids=[c[0] for c in UNBIASED_CASES])
@pytest.mark.quick_first(2)  # e4m3 normal and near-1 fractions; the rest in the default run
def test_stochastic_rounding_is_unbiased(fmt, x, frac):
    f = lowprec.element_format(fmt)
    xf = np.float32(x)
    away = "up" if xf > 0 else "down"
    lo, hi = (int(lowprec.encode(jnp.asarray([xf]), fmt, rounding=m)[0]) for m in ("toward_zero", away))
    v_lo, v_hi = (float(lowprec.decode(jnp.asarray([c], f.code_dtype), fmt)[0]) for c in (lo, hi))
    exact = (float(xf) - v_lo) / (v_hi - v_lo)  # float64: exact for these float32 values
    assert lo != hi and abs(exact - frac) < 1e-6
    p = math.ceil(exact * 2**16) / 2**16
    codes = np.asarray(lowprec.encode(jnp.full((N,), xf), fmt, rounding="stochastic",
                                      key=jax.random.key(7)))
    assert set(np.unique(codes).tolist()) <= {lo, hi}
    ups = float((codes == hi).mean())
    assert abs(ups - p) < Z_BOUND * math.sqrt(p * (1 - p) / N), (ups, p)
