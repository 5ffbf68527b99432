"""The implementation axis of the codec tests: {reference, eager, jit} behind one interface.

``reference`` is ``lowprec_reference`` (pure NumPy, exact rationals), ``eager`` calls
``lowprec.encode`` directly, ``jit`` calls it inside ``jax.jit``. Tests opt into the
parametrization with the ``element_cases`` marker (see tests/conftest.py)::

    @pytest.mark.element_cases(formats="eight_bit", roundings="directed", impls="lowprec")
    def test_something(fmt, rounding, overflow, codec): ...

which fills whichever of ``fmt``, ``rounding``, ``overflow``, ``codec`` the test asks for
(rounding modes are paired with the formats that accept them: E8M0 adds floor/ceil).
Tests whose expected value comes from the reference itself run on {eager, jit} only
(``impls="lowprec"``).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lowprec
import lowprec_formats
import lowprec_reference

from .inputs import BUCKET, adversarial_float32

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


def _as_tuple(v, groups=None):
    if isinstance(v, str):
        return groups[v] if groups and v in groups else (v,)
    return tuple(v)


def parametrize_element_cases(metafunc) -> None:
    """Fills fmt / rounding / overflow / codec for tests marked ``element_cases``."""
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
    overflows = _as_tuple(opts.get("overflows") or OVERFLOW_POLICIES)
    if impls == ("alternate",):
        # Each (format, rounding, overflow) once, on one lowprec implementation, alternating so
        # that every (format, rounding) and every (format, overflow) meets both eager and jit.
        # For input dtypes that need their own ~90 compiled programs per implementation.
        assert {"fmt", "rounding", "overflow", "codec"} <= set(names), names
        cases = [
            dict(fmt=f, rounding=r, overflow=o, codec=CODECS[("eager", "jit")[(i + j) % 2]])
            for f in fmts
            for i, r in enumerate(roundings_for(f))
            if keep(r)
            for j, o in enumerate(overflows)
        ]
        ids = [f"{c['fmt']}-{c['rounding']}-{c['overflow']}-{c['codec']}" for c in cases]
        _parametrize(metafunc, ["fmt", "rounding", "overflow", "codec"], cases, ids,
                     overflows, impls=None)
        return
    # One axis per parametrize call the suite has always made (ids: "fmt-rounding-overflow-
    # codec"), multiplied out here so that each case can carry its own tier mark.
    axes = []
    if "fmt" in names and "rounding" in names:
        axes.append([({"fmt": f, "rounding": r}, f"{f}-{r}")
                     for f in fmts for r in roundings_for(f) if keep(r)])
    elif "fmt" in names:
        axes.append([({"fmt": f}, f) for f in fmts])
    elif "rounding" in names:
        axes.append([({"rounding": r}, r) for r in ROUNDING_MODES if keep(r)])
    if "overflow" in names:
        axes.append([({"overflow": o}, o) for o in overflows])
    if "codec" in names:
        axes.append([({"codec": CODECS[i]}, i) for i in impls])
    if not axes:
        return
    argnames = [n for case, _ in (axis[0] for axis in axes) for n in case]
    cases, ids = [], []
    for combo in itertools.product(*axes):
        cases.append({k: v for case, _ in combo for k, v in case.items()})
        ids.append("-".join(i for _, i in combo))
    _parametrize(metafunc, argnames, cases, ids, overflows, impls)


#: The quick tier keeps the (format, rounding) pairs whose index sum is a multiple of this
#: (:func:`in_quick_tier`); at most ``len(ROUNDING_MODES)`` so that every format keeps a mode.
QUICK_PAIR_STRIDE = 6


def in_quick_tier(case: dict, overflows: tuple, impls) -> bool:
    """Whether an ``element_cases`` case runs in the quick tier (``pytest -m "not slow"``).

    The quick tier keeps every format and every rounding mode of a test, but not all their
    pairs, nor their product with the overflow policies and implementations. With
    k = (index of the format in ``FORMATS``) + (index of the rounding mode), it keeps the
    (format, rounding) pairs with k divisible by ``QUICK_PAIR_STRIDE`` = 6 (1 or 2 of the 7
    modes of each format, each mode with 3 of the 18 formats: a stride up to the number of
    modes keeps every format) and E8M0's floor and ceil; the policy and the implementation
    rotate with m = k // 6, so that every policy and every implementation meet the formats
    and modes. Every pair runs in the default run (``pytest``: its covering subset keeps
    each pair of values of any two parameters). The rule is the same in every test, so the
    quick tier's tests of one (format, rounding, overflow, implementation) share its
    compiled program (the sweeps of :func:`sweep`). A test that parametrizes its formats
    and modes itself keeps every case (nothing to rotate with).
    ``impls=None``: the implementation is already one per case (``impls="alternate"``).
    """
    if "fmt" not in case and "rounding" not in case:
        return True
    k = FORMATS.index(case["fmt"]) if "fmt" in case else 0
    m = k
    if "rounding" in case:
        k += (ROUNDING_MODES + E8M0_ONLY_MODES).index(case["rounding"])
        m = k
        if "fmt" in case:
            if case["rounding"] not in E8M0_ONLY_MODES and k % QUICK_PAIR_STRIDE:
                return False
            m = k // QUICK_PAIR_STRIDE
    if "overflow" in case and case["overflow"] != overflows[m % len(overflows)]:
        return False
    if impls is None or "codec" not in case:
        return True
    if len(impls) == 3 and impls[0] == "reference":
        # The reference every third m; otherwise the implementation a test on (eager, jit)
        # picks for the same m, so that tests on both sets share compiled programs.
        pick = "reference" if m % 3 == 0 else impls[1 + m % 2]
        return case["codec"].name == pick
    return case["codec"].name == impls[m % len(impls)]


def _parametrize(metafunc, argnames, cases, ids, overflows, impls) -> None:
    params = [
        pytest.param(*(case[n] for n in argnames), id=case_id,
                     marks=() if in_quick_tier(case, overflows, impls) else pytest.mark.slow)
        for case, case_id in zip(cases, ids)
    ]
    metafunc.parametrize(",".join(argnames), params)


# --------------------------------------------------------------------------------------------
# The harness.

# Every 1-D input of at most BUCKET elements reaches lowprec zero-padded to BUCKET elements
# (the result is sliced back). Only a test-speed device: lowprec compiles one XLA program per
# (format, rounding, overflow, input shape), about 0.1 s each, and ~90 mode combinations x 2
# implementations x the many array lengths drawn by Hypothesis or built by the tests would
# cost minutes of compilation; with one shape, all float32 tests share one program per mode.
# Stochastic rounding draws its words for the padded shape, so the reference is given the
# same words: ``stochastic_bits(key, shape)``. That lowprec uses exactly the documented words
# (``replay_random_bits``, the word hash recomputed by the NumPy reference) for unpadded shapes
# is tested directly.


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


def replay_random_bits(key, shape) -> np.ndarray:
    """The uint16 words ``lowprec.random_bits(key, shape)`` documents, recomputed without
    lowprec: the two key words come from ``jax.random.bits(key, (2,), uint32)`` (the one draw
    the contract makes from the key), the word hash from the NumPy reference."""
    import lowprec_reference

    key_words = np.asarray(jax.random.bits(key, (2,), jnp.uint32))
    return lowprec_reference.random_bits(key_words, tuple(shape))


def reference_words(words) -> np.ndarray:
    """Words for the reference encoders, which compare 32-bit words with frac · 2^32: a
    16-bit word r becomes r · 2^16 (the same decision as r < frac · 2^16)."""
    words = np.asarray(words)
    if words.dtype == np.uint16:
        return words.astype(np.uint32) << np.uint32(16)
    return words.astype(np.uint32)


def stochastic_bits(key, shape) -> np.ndarray:
    """The words (as the reference takes them) lowprec's stochastic rounding uses for an
    input of ``shape`` here."""
    words = reference_words(replay_random_bits(key, _padded_shape(shape)))
    return words[: shape[0]] if _padded_shape(shape) != tuple(shape) else words


@functools.lru_cache(maxsize=None)
def _jitted_encode(fmt, rounding, overflow):
    # One jitted callable per mode combination, so jax.jit's own cache is reused across tests.
    return jax.jit(
        lambda x, key: lowprec.encode(x, fmt, rounding=rounding, overflow=overflow, key=key)
    )


@functools.lru_cache(maxsize=None)
def _jitted_encode_modes(fmt, roundings, overflow):
    # Several deterministic modes of one format in one program: a program each costs more
    # to compile than the modes' share of one (tests/test_codec_properties.py).
    return jax.jit(lambda x: [lowprec.encode(x, fmt, rounding=r, overflow=overflow)
                              for r in roundings])


@functools.lru_cache(maxsize=None)
def _jitted_decode(fmt):
    return jax.jit(lambda codes: lowprec.decode(codes, fmt))


@functools.lru_cache(maxsize=None)
def _jitted_quantize(fmt, rounding, overflow):
    return jax.jit(
        lambda x, key: lowprec.quantize(
            x, fmt, rounding=rounding, overflow=overflow, key=key, dtype=jnp.float32
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
            bits = None
            if rounding == "stochastic" and key is not None:
                bits = stochastic_bits(key, x.shape)
            return lowprec_reference.encode(fmt, x, rounding, overflow, random_bits=bits)
        if self.name == "eager":
            out = lowprec.encode(_pad(x), fmt, rounding=rounding, overflow=overflow, key=key)
        else:
            out = _jitted_encode(fmt, rounding, overflow)(_pad(x), key)
        return _unpad(out, x)

    def encode_modes(self, fmt, x, roundings, overflow="ieee") -> dict:
        """{rounding: codes} of deterministic ``roundings``; under ``jit`` one program."""
        if self.name != "jit":
            return {r: self.encode(fmt, x, r, overflow) for r in roundings}
        x = np.asarray(x)
        out = _jitted_encode_modes(fmt, tuple(roundings), overflow)(_pad(x))
        return {r: _unpad(codes, x) for r, codes in zip(roundings, out)}

    def decode(self, fmt, codes) -> np.ndarray:
        codes = np.asarray(codes)
        if self.is_reference:
            return np.asarray(lowprec_reference.decode(fmt, codes), np.float64)
        if self.name == "eager":
            out = lowprec.decode(codes, fmt)
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
                _pad(x), fmt, rounding=rounding, overflow=overflow, key=key, dtype=jnp.float32
            )
        else:
            out = _jitted_quantize(fmt, rounding, overflow)(_pad(x), key)
        out = _unpad(out, x)
        assert out.dtype == np.float32, out.dtype
        return out.astype(np.float64)


CODECS = {name: Codec(name) for name in IMPLS}


#: The independent reference, as a Codec.
REFERENCE = CODECS["reference"]

# --------------------------------------------------------------------------------------------
# Cached encodings of the adversarial sets (shared by several test_codec.py tests).

SWEEP_KEY_SEED = 20240601


@functools.lru_cache(maxsize=None)
def sweep(impl: str, fmt: str, rounding: str, overflow: str):
    x = adversarial_float32(fmt)
    key = jax.random.key(SWEEP_KEY_SEED) if rounding == "stochastic" else None
    codes = CODECS[impl].encode(fmt, x, rounding, overflow, key)
    codes.setflags(write=False)
    return codes
