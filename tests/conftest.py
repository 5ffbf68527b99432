"""Shared fixtures for the element-codec tests (test_codec.py, test_codec_properties.py).

Three things live here:

* the Hypothesis settings profile of the whole suite (deterministic in CI, see below);
* the parametrization of the codec tests over formats (from ``lowprec_formats.COLLECTIONS``),
  rounding modes, overflow policies and an *implementation* axis, opted into with the
  ``element_cases`` marker::

      @pytest.mark.element_cases(formats="eight_bit", roundings="directed", impls="lowprec")
      def test_something(fmt, rounding, overflow, codec): ...

  fills whichever of ``fmt``, ``rounding``, ``overflow``, ``codec`` the test asks for (rounding
  modes are paired with the formats that accept them: E8M0 adds ``floor``/``ceil``). Tests
  without the marker are left alone, so other test files may use the same argument names;
* helpers handed out as session fixtures (``reference``, ``ml_dtypes_codes``, ``adversarial``,
  ``float_arrays``, ``assert_codes_equal`` ...): expected values come only from the independent
  NumPy reference (``lowprec_reference``), ml_dtypes, or a hand derivation written in a test.

The ``codec`` axis is {reference, eager, jit}: ``reference`` is ``lowprec_reference`` (pure
NumPy, exact rationals), ``eager`` calls ``lowprec.encode`` directly, ``jit`` calls it inside
``jax.jit(lambda x, key: lowprec.encode(...))``. Tests whose expected value comes from the
reference itself run on {eager, jit} only (``impls="lowprec"``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import zlib
from fractions import Fraction
from typing import Callable

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import lowprec
import lowprec_formats

# --------------------------------------------------------------------------------------------
# Hypothesis profiles.
#
# "ci" (the default) is deterministic: derandomize=True seeds every test's example generation
# from a hash of the test itself, and database=None stops examples saved by earlier runs from
# changing what is run. A CI failure therefore reproduces on any machine with the same
# Hypothesis version, and a green run stays green. The price is that CI never explores new
# examples; run `pytest --hypothesis-profile=explore` (random seeds, 20x the examples, saves
# failures to the local database) to search for new counterexamples, and pin any you find with
# @example. deadline=None: the first example of a test pays for JAX tracing and XLA
# compilation (0.1-0.3 s), which would otherwise trip Hypothesis' 200 ms deadline.
# max_examples is kept low because the element tests are parametrized over ~90 (format,
# rounding, overflow) combinations times two implementations; the breadth comes from the
# parametrization and from format-aware input strategies, not from many examples per case.
_COMMON = dict(
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("ci", derandomize=True, database=None, max_examples=10, **_COMMON)
settings.register_profile("explore", derandomize=False, max_examples=200, **_COMMON)
settings.load_profile("ci")  # `--hypothesis-profile=NAME` (the Hypothesis plugin) overrides it

# --------------------------------------------------------------------------------------------
# Names.

FORMATS: tuple = lowprec_formats.COLLECTIONS["all_elements"]
ROUNDING_MODES: tuple = lowprec_formats.ROUNDING_MODES
OVERFLOW_POLICIES: tuple = lowprec_formats.OVERFLOW_POLICIES
E8M0_ONLY_MODES = ("floor", "ceil")  # the MX scale rules, = down / up for an unsigned format
IMPLS = ("reference", "eager", "jit")

_ROUNDING_GROUPS = {
    "all": lambda r: True,
    "deterministic": lambda r: r != "stochastic",
    "directed": lambda r: r in ("toward_zero", "up", "down", "floor", "ceil"),
    "nearest": lambda r: r in ("nearest_even", "nearest_away"),
    "stochastic": lambda r: r == "stochastic",
    "default": lambda r: r == "nearest_even",
}
_IMPL_GROUPS = {
    "all": IMPLS,
    "lowprec": ("eager", "jit"),
    "reference": ("reference",),
    "alternate": ("alternate",),  # see pytest_generate_tests
}


def roundings_for(fmt: str) -> tuple:
    """Every rounding mode ``fmt`` accepts (E8M0 adds floor and ceil)."""
    return ROUNDING_MODES + (E8M0_ONLY_MODES if fmt == "e8m0" else ())


def _reference_missing() -> bool:
    try:
        import lowprec_reference

        return not hasattr(lowprec_reference, "encode")
    except ImportError:
        return True


# While the reference is being written, its parameters skip instead of erroring.
_REFERENCE_MISSING = (
    [pytest.mark.skip(reason="lowprec_reference is not importable")] if _reference_missing() else []
)


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "element_cases(formats='all_elements', roundings='all', overflows=None, impls='all'): "
        "parametrize fmt / rounding / overflow / codec (see tests/conftest.py)",
    )


def _as_tuple(v, groups=None):
    if isinstance(v, str):
        return groups[v] if groups and v in groups else (v,)
    return tuple(v)


def pytest_generate_tests(metafunc):
    marker = metafunc.definition.get_closest_marker("element_cases")
    if marker is None:
        return
    opts = dict(marker.kwargs)
    # Names the test parametrizes itself are left to it.
    explicit = set()
    for m in metafunc.definition.iter_markers("parametrize"):
        argnames = m.args[0]
        explicit |= set(
            n.strip() for n in (argnames.split(",") if isinstance(argnames, str) else argnames)
        )
    names = [n for n in metafunc.fixturenames if n not in explicit]
    collection = opts.get("formats", "all_elements")
    fmts = (
        lowprec_formats.COLLECTIONS[collection]
        if isinstance(collection, str) and collection in lowprec_formats.COLLECTIONS
        else _as_tuple(collection)
    )
    group = opts.get("roundings", "all")
    keep = _ROUNDING_GROUPS[group] if isinstance(group, str) and group in _ROUNDING_GROUPS else (
        lambda r, allowed=_as_tuple(group): r in allowed
    )
    impls = _as_tuple(opts.get("impls", "all"), _IMPL_GROUPS)
    if impls == ("alternate",):
        # Each (format, rounding, overflow) once, on one lowprec implementation, alternating so
        # that every (format, rounding) and every (format, overflow) meets both eager and jit.
        # For input dtypes that need their own ~90 compiled programs per implementation.
        assert {"fmt", "rounding", "overflow", "codec"} <= set(names), names
        overflows = _as_tuple(opts.get("overflows") or OVERFLOW_POLICIES)
        cases = [
            (f, r, o, CODECS[("eager", "jit")[(i + j) % 2]])
            for f in fmts
            for i, r in enumerate(roundings_for(f))
            if keep(r)
            for j, o in enumerate(overflows)
        ]
        metafunc.parametrize(
            "fmt,rounding,overflow,codec", cases, ids=[f"{f}-{r}-{o}-{c}" for f, r, o, c in cases]
        )
        return
    if "fmt" in names and "rounding" in names:
        pairs = [(f, r) for f in fmts for r in roundings_for(f) if keep(r)]
        metafunc.parametrize("fmt,rounding", pairs, ids=[f"{f}-{r}" for f, r in pairs])
    elif "fmt" in names:
        metafunc.parametrize("fmt", fmts)
    elif "rounding" in names:
        metafunc.parametrize("rounding", [r for r in ROUNDING_MODES if keep(r)])
    if "overflow" in names:
        metafunc.parametrize("overflow", _as_tuple(opts.get("overflows") or OVERFLOW_POLICIES))
    if "codec" in names:
        params = [
            pytest.param(CODECS[i], id=i, marks=_REFERENCE_MISSING if i == "reference" else ())
            for i in impls
        ]
        metafunc.parametrize("codec", params)


# --------------------------------------------------------------------------------------------
# The implementation axis.

# Every 1-D input of at most BUCKET elements reaches lowprec zero-padded to BUCKET elements
# (the result is sliced back). Only a test-speed device: lowprec compiles one XLA program per
# (format, rounding, overflow, input shape), about 0.1 s each, and ~90 mode combinations x 2
# implementations x the many array lengths drawn by Hypothesis or built by the tests would
# cost minutes of compilation; with one shape, all float32 tests share one program per mode.
# Stochastic rounding draws its words for the padded shape, so the reference is given the
# same words: ``stochastic_bits(key, shape)``. That lowprec uses exactly
# ``jax.random.bits(key, x.shape, jnp.uint32)`` for unpadded shapes is tested directly.
BUCKET = 4096


def _padded_shape(shape) -> tuple:
    return (BUCKET,) if len(shape) == 1 and shape[0] <= BUCKET else tuple(shape)


def _pad(x: np.ndarray) -> np.ndarray:
    shape = _padded_shape(x.shape)
    if shape == x.shape:
        return x
    out = np.zeros(shape, x.dtype)
    out[: x.shape[0]] = x
    return out


def _unpad(out, x: np.ndarray) -> np.ndarray:
    out = np.asarray(out)
    return out[: x.shape[0]] if out.shape != x.shape else out


def stochastic_bits(key, shape) -> np.ndarray:
    """The uint32 words lowprec's stochastic rounding uses for an input of ``shape`` here."""
    words = np.asarray(jax.random.bits(key, _padded_shape(shape), jnp.uint32))
    return words[: shape[0]] if _padded_shape(shape) != tuple(shape) else words


@functools.lru_cache(maxsize=None)
def _jitted_encode(fmt, rounding, overflow):
    # One jitted callable per mode combination, so jax.jit's own cache is reused across tests.
    return jax.jit(
        lambda x, key: lowprec.encode(fmt, x, rounding=rounding, overflow=overflow, key=key)
    )


@functools.lru_cache(maxsize=None)
def _jitted_decode(fmt):
    return jax.jit(lambda codes: lowprec.decode(fmt, codes))


@functools.lru_cache(maxsize=None)
def _jitted_quantize(fmt, rounding, overflow):
    return jax.jit(
        lambda x, key: lowprec.quantize(
            fmt, x, rounding=rounding, overflow=overflow, key=key, dtype=jnp.float32
        )
    )


@dataclasses.dataclass(frozen=True)
class Codec:
    """One implementation of encode / decode / quantize, with NumPy in and out.

    ``encode`` returns codes as a NumPy array of the implementation's code dtype;
    ``decode`` and ``quantize`` return float64 (exact: every value of every element format
    is a float32, and the reference returns float64).
    """

    name: str

    def __repr__(self) -> str:  # shows up in pytest ids / failure messages
        return self.name

    @property
    def is_reference(self) -> bool:
        return self.name == "reference"

    def encode(self, fmt, x, rounding="nearest_even", overflow="ieee", key=None) -> np.ndarray:
        x = np.asarray(x)
        if self.is_reference:
            import lowprec_reference

            bits = None
            if rounding == "stochastic" and key is not None:
                bits = stochastic_bits(key, x.shape)
            return lowprec_reference.encode(fmt, x, rounding, overflow, random_bits=bits)
        if self.name == "eager":
            out = lowprec.encode(fmt, _pad(x), rounding=rounding, overflow=overflow, key=key)
        else:
            out = _jitted_encode(fmt, rounding, overflow)(_pad(x), key)
        return _unpad(out, x)

    def decode(self, fmt, codes) -> np.ndarray:
        codes = np.asarray(codes)
        if self.is_reference:
            import lowprec_reference

            return np.asarray(lowprec_reference.decode(fmt, codes), np.float64)
        if self.name == "eager":
            out = lowprec.decode(fmt, codes)
        else:
            out = _jitted_decode(fmt)(codes)
        out = np.asarray(out)
        assert out.dtype == np.float32, out.dtype
        return out.astype(np.float64)

    def quantize(self, fmt, x, rounding="nearest_even", overflow="ieee", key=None) -> np.ndarray:
        """Values of ``fmt`` nearest x as the mode says (reference: decode(encode(x)))."""
        if self.is_reference:
            return self.decode(fmt, self.encode(fmt, x, rounding, overflow, key))
        x = np.asarray(x)
        if self.name == "eager":
            out = lowprec.quantize(
                fmt, _pad(x), rounding=rounding, overflow=overflow, key=key, dtype=jnp.float32
            )
        else:
            out = _jitted_quantize(fmt, rounding, overflow)(_pad(x), key)
        out = _unpad(out, x)
        assert out.dtype == np.float32, out.dtype
        return out.astype(np.float64)


CODECS = {name: Codec(name) for name in IMPLS}


@pytest.fixture(scope="session")
def reference() -> Codec:
    """The independent NumPy reference (skips the test if it is not importable yet)."""
    pytest.importorskip("lowprec_reference")
    return CODECS["reference"]


# --------------------------------------------------------------------------------------------
# Bit patterns, ml_dtypes, comparisons.


def f32_bits(values) -> np.ndarray:
    """uint32 bit patterns of values that are exactly float32 (asserted)."""
    v = np.asarray(values)
    v32 = v.astype(np.float32)
    same = (v32.astype(v.dtype) == v) | np.isnan(v)
    assert same.all(), f"not exactly float32: {v[~same][:5]}"
    return v32.view(np.uint32)


def assert_same_values(got, want, x=None, what="") -> None:
    """Bit-for-bit equality of float values (as float32 patterns; NaN compared as 'is NaN')."""
    got = np.asarray(got)
    want = np.asarray(want)
    assert got.shape == want.shape, (got.shape, want.shape)
    gnan, wnan = np.isnan(got), np.isnan(want)
    bad = (gnan != wnan) | (~gnan & ~wnan & (f32_bits(np.where(gnan, 0, got)) != f32_bits(
        np.where(wnan, 0, want))))
    if bad.any():
        idx = np.flatnonzero(bad.ravel())[:8]
        lines = [f"{what}: {bad.sum()} of {bad.size} values differ"]
        for i in idx:
            xi = "" if x is None else f"x={_describe(np.asarray(x).ravel()[i])} "
            lines.append(f"  [{i}] {xi}got={got.ravel()[i]!r} want={want.ravel()[i]!r}")
        raise AssertionError("\n".join(lines))


def _describe(v) -> str:
    v = np.asarray(v)
    nbytes = v.dtype.itemsize
    bits = int(v.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[nbytes]))
    return f"{float(v)!r} ({v.dtype.name} 0x{bits:0{2 * nbytes}x})"


def assert_codes_equal(got, want, x=None, what="") -> None:
    """Exact equality of code arrays, reporting the inputs (value and bits) that differ."""
    got = np.asarray(got)
    want = np.asarray(want)
    assert got.shape == want.shape, (got.shape, want.shape)
    bad = got.astype(np.int64) != want.astype(np.int64)
    if bad.any():
        idx = np.flatnonzero(bad.ravel())[:8]
        lines = [f"{what}: {bad.sum()} of {bad.size} codes differ"]
        for i in idx:
            xi = "" if x is None else f"x={_describe(np.asarray(x).ravel()[i])} "
            lines.append(
                f"  [{i}] {xi}got=0x{int(got.ravel()[i]):x} want=0x{int(want.ravel()[i]):x}"
            )
        raise AssertionError("\n".join(lines))


def ml_dtypes_codes(fmt: str, x: np.ndarray) -> np.ndarray:
    """Codes of ml_dtypes' astype (the default-mode contract) for a float32 array x."""
    dt = lowprec.element_format(fmt).storage_dtype
    with np.errstate(all="ignore"):
        y = np.asarray(x).astype(dt)
    return y.view(np.uint16 if dt.itemsize == 2 else np.uint8)


def ml_dtypes_values(fmt: str, codes: np.ndarray) -> np.ndarray:
    """float32 values of codes, as ml_dtypes reads them."""
    dt = lowprec.element_format(fmt).storage_dtype
    codes = np.asarray(codes).astype(np.uint16 if dt.itemsize == 2 else np.uint8)
    return codes.view(dt).astype(np.float32)


# Each helper is also a session fixture of the same name (pytest discourages importing conftest).


@pytest.fixture(scope="session", name="assert_codes_equal")
def _fixture_assert_codes_equal():
    return assert_codes_equal


@pytest.fixture(scope="session", name="assert_same_values")
def _fixture_assert_same_values():
    return assert_same_values


@pytest.fixture(scope="session", name="ml_dtypes_codes")
def _fixture_ml_dtypes_codes():
    return ml_dtypes_codes


@pytest.fixture(scope="session", name="ml_dtypes_values")
def _fixture_ml_dtypes_values():
    return ml_dtypes_values


@pytest.fixture(scope="session", name="stochastic_bits")
def _fixture_stochastic_bits():
    return stochastic_bits


# --------------------------------------------------------------------------------------------
# Inputs: adversarial float32 sets, format-aware Hypothesis strategies.


def _f32(bits) -> np.ndarray:
    return np.asarray(bits, np.uint64).astype(np.uint32).view(np.float32)


# Float32 special values and edges that every format sees.
F32_SPECIALS = _f32(
    [
        0x0000_0000, 0x8000_0000,  # +-0
        0x7F80_0000, 0xFF80_0000,  # +-inf
        0x7FC0_0000, 0xFFC0_0000, 0x7F80_0001, 0xFFFF_FFFF, 0x7FBF_FFFF,  # NaNs (q, s, payloads)
        0x0000_0001, 0x8000_0001, 0x0000_0002, 0x0000_0003,  # smallest subnormals
        0x0040_0000, 0x007F_FFFF, 0x0020_0001, 0x805F_0F0F,  # larger subnormals
        0x0080_0000, 0x8080_0000, 0x0080_0001,  # smallest normals
        0x7F7F_FFFF, 0xFF7F_FFFF, 0x7F7F_FFFE,  # largest finite
        0x3F80_0000, 0xBF80_0000, 0x3F80_0001, 0x3F7F_FFFF,  # around 1
    ]
)


def _grid_codes(fmt: str) -> np.ndarray:
    """Positive finite codes used to build the adversarial set (all of them for <= 8 bits)."""
    f = lowprec.element_format(fmt)
    m, n_exp = f.mantissa_bits, 1 << f.exponent_bits
    if f.code_bits <= 8:
        codes = np.arange(1 << f.magnitude_bits)
    else:
        mant = sorted({0, 1, (1 << m) // 2, (1 << m) - 2, (1 << m) - 1})
        if f.exponent_bits <= 5:
            exps = range(n_exp)
        else:  # every binade near the bottom, around 1 and near the top
            exps = [*range(0, 6), *range(f.bias - 3, f.bias + 4), *range(n_exp - 6, n_exp)]
        codes = np.array([(e << m) | t for e in exps for t in mant])
    return codes[codes <= f.max_magnitude_code]


@functools.lru_cache(maxsize=None)
def adversarial_float32(fmt: str) -> np.ndarray:
    """A float32 array that stresses ``fmt`` (550-2900 distinct bit patterns, <= BUCKET).

    For each grid value v (every finite value of the 8-bit and 4-bit formats; for the 16/19-bit
    formats, the edge mantissas of every binade near the bottom, around 1 and near the top):
    v and its float32 neighbours, the midpoint to the next grid value (the tie, in every
    binade, including the subnormal ones and between 0 and the smallest subnormal) and its
    float32 neighbours, and 1/4 and 3/4 of the way (stochastic rounding). Past the largest
    finite value M, the grid is extended by one step (the overflow tie M + ulp/2, e.g. 464 for
    e4m3, 61440 for e5m2, 7 for e2m1) and 2M. E8M0 additionally gets the interior of its lowest
    binade (2^-127, 2^-126), where ml_dtypes rounds everything up. All with both signs (a
    sample of negatives for the unsigned E8M0), plus
    float32 specials (+-0, +-inf, NaNs, float32 subnormals, largest finite) and 200 log-uniform
    random values over the format's range. Values come from the format's layout fields.
    """
    f = lowprec.element_format(fmt)
    m = f.mantissa_bits
    codes = _grid_codes(fmt)

    def value(c):  # exact value of a positive magnitude code, from the layout (inputs only)
        e, t = int(c) >> m, int(c) & ((1 << m) - 1)
        if f.subnormals and e == 0:
            return Fraction(t, 1 << m) * Fraction(2) ** f.emin
        return (1 + Fraction(t, 1 << m)) * Fraction(2) ** (e - f.bias)

    near, quarter = [], []  # near: grid values and ties, also with their float32 neighbours
    for c in codes:
        v = value(c)
        w = value(c + 1) if c < f.max_magnitude_code else v + Fraction(2) ** (f.emax - m)
        near += [v, (v + w) / 2]
        quarter += [v + (w - v) / 4, v + 3 * (w - v) / 4]
        if c == f.max_magnitude_code:
            near += [w, 2 * v]
    if f.zero:  # the tie between 0 and the smallest positive value, and either side of it
        s = value(1)
        near += [s / 2]
        quarter += [s / 4, 3 * s / 4]
    else:  # E8M0: below 2^-127, and the interior of the lowest binade (2^-127, 2^-126)
        lo = Fraction(2) ** f.emin
        near += [lo / 2]
        quarter += [lo / 4, lo * 3 / 4] + [lo * (1 + Fraction(k, 16)) for k in range(1, 16)]

    def as_f32(values):
        with np.errstate(over="ignore"):
            return np.array([float(v) for v in values], np.float64).astype(np.float32)

    near32 = as_f32(near)
    neighbours = np.concatenate(
        [
            near32,
            np.nextafter(near32, np.float32(np.inf)),
            np.nextafter(near32, np.float32(0)),
            as_f32(quarter),
        ]
    )
    rng = np.random.default_rng(1234)
    lo_e = f.emin - m - 2
    hi_e = min(f.emax + 1, 127)
    rand = np.exp2(rng.uniform(lo_e, hi_e + 1, 200)).astype(np.float32)
    pos = np.concatenate([neighbours, rand])
    pos = pos[np.isfinite(pos)]
    # An unsigned format maps every negative input to NaN: a sample of negatives is enough.
    neg = -pos if f.signed else -pos[::16]
    x = np.concatenate([pos, neg, F32_SPECIALS])
    x = np.unique(x.view(np.uint32)).view(np.float32)  # dedup on bits: keeps -0 and NaNs
    assert x.size <= BUCKET, (fmt, x.size)
    return x


@pytest.fixture(scope="session", name="adversarial")
def _fixture_adversarial():
    """adversarial(fmt) -> float32 array (see adversarial_float32)."""
    return adversarial_float32


def _near_grid(fmt: str, dtype, salt: str = "") -> st.SearchStrategy:
    """Floats of ``dtype`` placed on, next to, or halfway between values of ``fmt``.

    A value is sign * 1.h t * 2^e with e over the format's exponent range (a few binades
    beyond each end), h the format's mantissa bits and t the remaining bits of the input
    dtype: t = 0 (a grid value), 100..0 (a tie), 011..1 / 100..01 (either side of a tie),
    1 / 11..1 (next to a grid value) or anything. Values the dtype cannot hold exactly
    (below its normal range) are rounded to it by NumPy; they are inputs either way. One
    integer is drawn per value and sliced into those fields (a composite strategy with one
    draw per field is 5x slower, and generation dominates these tests' run time).

    ``salt`` permutes the drawn integers (n -> (A n + crc32(salt)) mod M, a bijection): with
    derandomize=True every parametrization of a test replays the same Hypothesis choices, so
    without it all (rounding, overflow) cases of a format would see the same values.
    """
    f = lowprec.element_format(fmt)
    nmant = int(ml_dtypes.finfo(dtype).nmant)
    g = min(f.mantissa_bits, nmant)
    tail_bits = nmant - g
    e_lo, e_hi = f.emin - f.mantissa_bits - 3, f.emax + 2
    span = e_hi - e_lo + 1
    half = (1 << (tail_bits - 1)) if tail_bits else 0
    tails = [0, half, half - 1, half + 1, 1, (1 << tail_bits) - 1] if tail_bits else [0]
    modulus = span << (g + 4 + tail_bits)
    offset = zlib.crc32(salt.encode()) if salt else 0
    mult = (1 << 61) - 1 if salt else 1  # a prime, so coprime to the modulus

    def build(n: int) -> float:
        n = (mult * n + offset) % modulus
        n, e = divmod(n, span)
        n, head = divmod(n, 1 << g)
        n, kind = divmod(n, 8)
        n, negative = divmod(n, 2)
        tail = tails[kind] if kind < len(tails) else n & ((1 << tail_bits) - 1)
        sig = (((1 << g) | head) << tail_bits) | tail  # nmant + 1 bits
        v = math.ldexp(float(sig), e + e_lo - nmant) if e + e_lo - nmant > -1100 else 0.0
        with np.errstate(all="ignore"):
            return float(np.asarray(-v if negative else v).astype(dtype))

    return st.integers(0, modulus - 1).map(build)


def float_arrays(fmt: str, dtype, max_size: int = 32, salt: str = "") -> st.SearchStrategy:
    """1-D arrays of ``dtype`` (float16, bfloat16, float32, float64) that stress ``fmt``.

    Up to max_size / 2 of Hypothesis' own floats of that width (it favours +-0, +-inf, NaN,
    subnormals and the extremes), then :func:`_near_grid` values; at least one element. Two
    ``hypothesis.extra.numpy.arrays`` draws, concatenated: an array with ``one_of`` elements
    takes twice as long to generate. bfloat16 arrays are drawn as float32 arrays of bfloat16
    values (``hypothesis.extra.numpy`` does not know the ml_dtypes type), converted exactly.
    Pass the test's parameters as ``salt`` to vary the near-grid values between them.
    """
    dtype = np.dtype(dtype)
    is_bf16 = dtype == np.dtype(ml_dtypes.bfloat16)
    if is_bf16:
        generic = st.integers(0, 0xFFFF).map(lambda b: float(np.uint32(b << 16).view(np.float32)))
        array_dtype = np.dtype(np.float32)
    else:
        generic = st.floats(width=8 * dtype.itemsize, allow_subnormal=True)
        array_dtype = dtype
    near = _near_grid(fmt, dtype, salt)
    n_generic = max_size // 2

    @st.composite
    def strategy(draw):
        a = draw(hnp.arrays(array_dtype, st.integers(0, n_generic), elements=generic))
        lo = 0 if a.size else 1
        b = draw(hnp.arrays(array_dtype, st.integers(lo, max_size - n_generic), elements=near))
        return np.concatenate([a, b]).astype(dtype)

    return strategy()


@pytest.fixture(scope="session", name="float_arrays")
def _fixture_float_arrays():
    """float_arrays(fmt, dtype, max_size=32, salt="") -> Hypothesis strategy of 1-D arrays."""
    return float_arrays


# --------------------------------------------------------------------------------------------
# Cached encodings of the adversarial sets (shared by several test_codec.py tests).

SWEEP_KEY_SEED = 20240601


@functools.lru_cache(maxsize=None)
def _sweep(impl: str, fmt: str, rounding: str, overflow: str):
    x = adversarial_float32(fmt)
    key = jax.random.key(SWEEP_KEY_SEED) if rounding == "stochastic" else None
    codes = CODECS[impl].encode(fmt, x, rounding, overflow, key)
    codes.setflags(write=False)
    return codes


@pytest.fixture(scope="session", name="sweep")
def _fixture_sweep() -> Callable[..., np.ndarray]:
    """sweep(impl, fmt, rounding, overflow) -> codes of adversarial(fmt), cached.

    Stochastic rounding uses ``jax.random.key(SWEEP_KEY_SEED)`` for every implementation.
    """
    return _sweep


@functools.lru_cache(maxsize=None)
def _values(fmt: str, codes_bytes: bytes, dtype: str) -> np.ndarray:
    import lowprec_reference

    codes = np.frombuffer(codes_bytes, dtype=np.dtype(dtype))
    values = lowprec_reference.decode(fmt, codes)
    values.setflags(write=False)  # shared by every caller
    return values


@pytest.fixture(scope="session", name="ref_values")
def _fixture_ref_values() -> Callable[[str, np.ndarray], np.ndarray]:
    """ref_values(fmt, codes) -> float64 values by the reference's decode (cached)."""
    pytest.importorskip("lowprec_reference")

    def values(fmt: str, codes: np.ndarray) -> np.ndarray:
        codes = np.ascontiguousarray(codes)
        return _values(fmt, codes.tobytes(), codes.dtype.str).reshape(codes.shape)

    return values

