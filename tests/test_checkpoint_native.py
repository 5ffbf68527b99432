"""The checkpoint pipeline's native passes (``lowprec/kernels/_ckpt_cpu.cc``) against the
NumPy code they replace, bit for bit, on adversarial pieces.

The expected values never come from the native passes: decoded values are the library's
``dequantize`` of ``quantize_mx``'s codes (which the rest of the suite checks against the
independent reference), narrowed by NumPy's casts (``lowprec.checkpoint._chunk.narrow`` with
the native passes turned off); statistics are :meth:`ErrorStats.update` on those values and the
clipped-block count of ``_mx_clipped``; largest magnitudes are NumPy's. Inputs hold NaN, ±inf,
−0, float32 and half-precision subnormals, values past float16's and bfloat16's range (the
overflow on narrowing), blocks of zeros, and odd numbers of blocks and elements. Every
format the pipeline stores is covered (MXFP4/6/8, MXINT8, NVFP4 with its tensor scale, the
FP8 casts), from float32, bfloat16 and float16 inputs, decoded to float32, bfloat16, float16
and float64. Cost: about a second (a few small compiled programs per format).
"""

from __future__ import annotations

import dataclasses
import zlib

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import lowprec
from lowprec.checkpoint import _chunk
from lowprec.checkpoint._errors import CheckpointError
from lowprec.checkpoint._layout import make_spec
from lowprec.checkpoint._stats import ErrorStats
from lowprec.kernels import _ckpt_cpu

pytestmark = pytest.mark.skipif(not _ckpt_cpu.available(), reason=_ckpt_cpu.status())

MX_FORMATS = ("mxfp4", "mxfp6_e2m3", "mxfp6_e3m2", "mxfp8_e4m3", "mxfp8_e5m2", "mxint8",
              "nvfp4")
INPUTS = (np.float32, ml_dtypes.bfloat16, np.float16)
OUTPUTS = (np.float32, ml_dtypes.bfloat16, np.float16, np.float64)
_INT_OF = {2: np.uint16, 4: np.uint32, 8: np.uint64}


@pytest.fixture
def numpy_only(monkeypatch):
    """The NumPy code of the pipeline (what runs where the library is not built)."""
    monkeypatch.setattr(_chunk, "native", lambda: False)


def adversarial(rows: int, cols: int, dtype, seed: str) -> np.ndarray:
    """``rows`` x ``cols`` values of ``dtype``: Gaussian rows over binades from 2^-30 to
    2^20 (past float16's and into bfloat16's subnormal range), one row of zeros of both
    signs, one row of float32 subnormals, one of huge values (past float16 and near float32's
    max), with NaN, ±inf, −0 and tiny values sprinkled in."""
    rng = np.random.default_rng(zlib.crc32(seed.encode()))
    x = rng.standard_normal((rows, cols)) * np.exp2(rng.integers(-30, 21, (rows, 1)))
    x[0] = np.where(rng.integers(0, 2, cols) == 1, -0.0, 0.0)
    x[1] = rng.standard_normal(cols) * 2.0 ** -140  # float32 subnormals (0 in half types)
    x[2] = rng.standard_normal(cols) * 3e38 * rng.random(cols)  # past half ranges
    flat = x.reshape(-1)
    picks = rng.choice(flat.size, size=min(flat.size, max(8, flat.size // 40)),
                       replace=False)
    specials = np.array([np.nan, np.inf, -np.inf, -0.0, 2.0 ** -24, -(2.0 ** -133), 65520.0,
                         -1e6])
    flat[picks] = specials[rng.integers(0, specials.size, picks.size)]
    with np.errstate(over="ignore"):
        return flat.reshape(rows, cols).astype(np.float32).astype(dtype)


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(_INT_OF[a.dtype.itemsize])


def quantized(fmt_name: str, x: np.ndarray):
    """(the library's codes as a CodedPiece, its decoded float32 values, its clipped-block
    count by the NumPy code) of ``x`` quantized along its last axis."""
    fmt = lowprec.mx_format(fmt_name)
    mx = lowprec.quantize_mx(jnp.asarray(x.astype(np.float32)), fmt, axis=-1)
    ts = None if mx.tensor_scale is None else np.float32(mx.tensor_scale)
    elements, scales = np.asarray(mx.elements), np.asarray(mx.scales)
    coded = _chunk.mx_coded(elements, scales, fmt, ts)
    assert coded is not None
    clipped = _chunk._mx_clipped(x.astype(np.float32), scales, fmt, ts)
    return coded, np.asarray(lowprec.dequantize(mx), np.float32), clipped


def expected_narrowing(values: np.ndarray, dtype, saturate: bool):
    """(narrowed values, saturated count) by the NumPy code, or the CheckpointError it raises."""
    wide = values.astype(_chunk.wide_dtype(dtype))
    saved = _chunk.native
    _chunk.native = lambda: False
    try:
        return _chunk.narrow(wide, dtype, "t", saturate)
    except CheckpointError as e:
        return e
    finally:
        _chunk.native = saved


def assert_stats_equal(got: ErrorStats, want: ErrorStats) -> None:
    for field in ("count", "max_abs", "max_rel", "nonfinite", "nan_in", "inf_in",
                  "inf_saturated", "finite_to_nonfinite", "nonfinite_changed", "clipped",
                  "clip_total"):
        assert getattr(got, field) == getattr(want, field), field
    # Sums: the same float64 terms in another order (eight lanes vs NumPy's pairwise sum);
    # each of at most 2^12 terms carries a relative rounding of 2^-53, so 1e-12 bounds them.
    for field in ("sum_x2", "sum_e2"):
        assert getattr(got, field) == pytest.approx(getattr(want, field), rel=1e-12, abs=0)


@pytest.mark.parametrize("in_dtype", INPUTS, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("fmt_name", MX_FORMATS)
def test_mx_stats_and_decode_match_numpy(fmt_name, in_dtype):
    block = lowprec.mx_format(fmt_name).block_size
    x = adversarial(7, 3 * 32, in_dtype, f"{fmt_name} {in_dtype}")  # 21 or 42 blocks: odd
    coded, values, clipped = quantized(fmt_name, x)
    assert values.size == x.size and x.size % block == 0

    got = ErrorStats()
    got.add_vector(_ckpt_cpu.stats(x, **coded.args(), clip=1,
                                   max_finite=lowprec.mx_format(fmt_name).element.max_finite,
                                   view=(*x.shape, 1)))
    want = ErrorStats()
    want.update(x, values)
    want.add_clipped(*clipped)
    assert_stats_equal(got, want)
    assert want.nonfinite > 0 and want.count > 0  # the specials reached the statistics

    for out_dtype in OUTPUTS:
        for saturate in (False, True):
            expected = expected_narrowing(values, out_dtype, saturate)
            if isinstance(expected, CheckpointError):
                with pytest.raises(CheckpointError) as raised:
                    _chunk.decode_coded(coded, x.shape, out_dtype, saturate=saturate, name="t")
                assert str(raised.value) == str(expected)
                continue
            out, n, nonfinite = _chunk.decode_coded(coded, x.shape, out_dtype,
                                                    saturate=saturate, name="t")
            assert out.dtype == np.dtype(out_dtype)
            np.testing.assert_array_equal(bits(out), bits(expected[0]))
            assert n == expected[1]
            assert nonfinite == _chunk.count_nonfinite(expected[0])


def test_overflow_on_narrowing_is_reached():
    """The adversarial MXFP8 piece overflows float16 (so the test above checks the refusal
    and the clamping) and not float32."""
    _, values, _ = quantized("mxfp8_e4m3", adversarial(7, 96, np.float32, "overflow"))
    assert isinstance(expected_narrowing(values, np.float16, False), CheckpointError)
    saturated = expected_narrowing(values, np.float16, True)
    assert saturated[1] > 0 and np.abs(saturated[0][np.isfinite(saturated[0])]).max() == 65504
    assert expected_narrowing(values, np.float32, False)[1] == 0


_NOT_EXACT = {  # values bfloat16 does not hold as they are
    "overflow": 3.4e38,  # finite, rounds to inf: refused, or clamped with saturate
    "nan": np.uint32(0x7FC0_1234).view(np.float32),  # a NaN with payload bits below 16
    "inf": -np.inf,
    "rounds": 1 + 2.0 ** -9,  # a tie, rounded to even (1.0)
    "subnormal": 2.0 ** -140,  # float32 subnormal, under bfloat16's smallest
}


@pytest.mark.parametrize("saturate", [False, True])
@pytest.mark.parametrize("where", [0, 7, 8, 13, 2040, 2048 + 5, None])
@pytest.mark.parametrize("special", sorted(_NOT_EXACT))
def test_bf16_narrowing_after_a_run_of_exact_values(special, where, saturate):
    """Narrowing to bfloat16 takes the top halves of finite values bfloat16 holds exactly (an
    MX decode's) until a group of 8 holds another value, then rounds: wherever the first such
    value falls (the first group, mid-group, past the 2048-value chunk, nowhere) and whatever
    follows it (exact values, a second special), the result is NumPy's cast (ml_dtypes): the
    same bits, count and refusal."""
    rng = np.random.default_rng(7 if where is None else where)
    values = (rng.standard_normal(4100) * np.exp2(rng.integers(-20, 20, 4100))).astype(
        np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)
    if where is not None:
        values[where] = values[where + 1000] = np.float32(_NOT_EXACT[special])
    expected = expected_narrowing(values, ml_dtypes.bfloat16, saturate)
    if isinstance(expected, CheckpointError):
        with pytest.raises(CheckpointError) as raised:
            _chunk.narrow(values, ml_dtypes.bfloat16, "t", saturate)
        assert str(raised.value) == str(expected)
        return
    out, n = _chunk.narrow(values, ml_dtypes.bfloat16, "t", saturate)
    np.testing.assert_array_equal(bits(out), bits(expected[0]))
    assert n == expected[1]
    nonfinite, _, _ = _ckpt_cpu.decode(np.empty(values.size, ml_dtypes.bfloat16), values,
                                       saturate=True)
    assert nonfinite == _chunk.count_nonfinite(expected[0])


@pytest.mark.parametrize("elem_name", ["e4m3", "e5m2"])
@pytest.mark.parametrize("in_dtype", INPUTS, ids=lambda d: np.dtype(d).name)
def test_cast_stats_and_decode_match_numpy(elem_name, in_dtype, numpy_only):
    """FP8 casts with a per-tensor scale (an odd number of elements): the native statistics
    (clip 2: |x / scale| > max) and decoding against the NumPy code of ``_chunk``."""
    elem = lowprec.element_format(elem_name)
    x = adversarial(5, 41, in_dtype, f"cast {elem_name} {in_dtype}")
    scale = np.float32(2.0 ** -3)
    with np.errstate(over="ignore", invalid="ignore"):
        y = x.astype(np.float32) / scale
    codes = _chunk.encode_cast(y, elem)
    values = (np.asarray(lowprec.decode(jnp.asarray(codes.view(elem.code_dtype)), elem))
              .astype(np.float32))
    with np.errstate(over="ignore"):
        values = values * scale
    coded = _chunk.CodedPiece(codes.view(np.uint8).reshape(-1), 8, _chunk.element_table(elem),
                              np.float32([scale]), codes.size, False)
    got = ErrorStats()
    got.add_vector(_ckpt_cpu.stats(x, **coded.args(), clip=2, max_finite=elem.max_finite,
                                   cast_scale=scale))
    want = ErrorStats()
    want.update(x, values)
    with np.errstate(invalid="ignore"):
        want.add_clipped(np.count_nonzero(np.abs(y) > elem.max_finite), y.size)
    assert_stats_equal(got, want)

    for out_dtype in OUTPUTS:
        expected = _chunk.narrow(values.astype(_chunk.wide_dtype(out_dtype)), out_dtype, "t",
                                 True)
        out = np.empty(x.shape, out_dtype)
        _, n, _ = _ckpt_cpu.decode(out, **coded.args(), saturate=True)
        np.testing.assert_array_equal(bits(out), bits(expected[0]))
        assert n == expected[1]


@pytest.mark.parametrize("q_dtype", INPUTS, ids=lambda d: np.dtype(d).name)
def test_stats_of_given_values_match_numpy(q_dtype):
    """Statistics of x against decoded values given as an array (1,001 elements: no lane
    multiple), every pairing of finite and non-finite on both sides."""
    x = adversarial(7, 143, np.float32, "given x").reshape(-1)
    rng = np.random.default_rng(1)
    q = (x * (1 + rng.standard_normal(x.size) * 2.0 ** -8)).astype(np.float32)
    q[rng.choice(x.size, 60, replace=False)] = np.nan
    q[rng.choice(x.size, 60, replace=False)] = np.inf
    q[np.isinf(x)] = 448.0  # inf inputs stored as a number (saturated)
    with np.errstate(over="ignore"):
        q = q.astype(q_dtype)
    got = ErrorStats()
    got.add_vector(_ckpt_cpu.stats(x, q))
    want = ErrorStats()
    want.update(x, q.astype(np.float32))
    assert_stats_equal(got, want)
    assert want.finite_to_nonfinite > 0 and want.inf_saturated > 0


@pytest.mark.parametrize("n", [24, 20], ids=["vector", "scalar tail"])
def test_relative_error_of_zero_inputs_is_the_largest(n):
    """The relative error's maximum, |e| / max(|x|, 5e-324), where x = 0 gives the largest
    ratios (|e| x 2^1074): each pair raises the lane's maximum, and a pair skipped by the
    pass's shortcut (which must skip only pairs that cannot raise it) would leave it low.
    Lane 0 (pairs 0, 8, 16) sees x = 0 with errors 2^-149 then 2^-100, then 2^-120: the
    maxima 2^925, then 2^974 (2^-100 x 2^1074), kept. ``n`` = 20 puts the last pair in the
    scalar tail, whose lanes restart at 0."""
    x = np.ones(n, np.float32)
    q = x.copy()
    x[[0, 8, 16]] = 0.0
    q[[0, 8, 16]] = [2.0 ** -149, 2.0 ** -100, 2.0 ** -120]
    got = ErrorStats()
    got.add_vector(_ckpt_cpu.stats(x, q))
    assert got.max_rel == 2.0 ** 974 and got.max_abs == 2.0 ** -100
    want = ErrorStats()
    want.update(x, q)
    assert_stats_equal(got, want)


@pytest.mark.parametrize("in_dtype", INPUTS + (np.float64,), ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (5, 1001), (4, 0)])
def test_amax_matches_numpy(in_dtype, shape, numpy_only):
    x = adversarial(max(shape[0], 3), max(shape[1], 1), np.float64, f"amax {shape}")
    x = x[: shape[0], : shape[1]]
    if in_dtype == np.float64 and x.size > 2:
        x.reshape(-1)[:2] = [1e300, float.fromhex("0x1.fffffefp127")]  # inf / max in float32
    with np.errstate(over="ignore"):
        x = np.ascontiguousarray(x.astype(in_dtype))
    want = _chunk.finite_amax_rows(x)  # NumPy (the fixture)
    got = _ckpt_cpu.amax(x, rows=shape[0])
    np.testing.assert_array_equal(bits(got), bits(want.astype(np.float32)))
    whole = _ckpt_cpu.amax(x)[0]
    assert whole == (want.max() if want.size else 0)
    if x.size:
        assert whole == _chunk.finite_amax(x)


def test_bad_arguments_refused():
    x = np.ones(64, np.float32)
    codes = np.zeros(32, np.uint8)
    e2m1 = _chunk.element_table(lowprec.element_format("e2m1"))
    with pytest.raises(ValueError, match="q holds 3 values for 64"):
        _ckpt_cpu.stats(x, np.ones(3, np.float32))
    with pytest.raises(TypeError, match="int32 is not one"):
        _ckpt_cpu.stats(x.astype(np.int32))
    with pytest.raises(ValueError, match="refused"):  # x and q: no float64 (decode's only)
        _ckpt_cpu.stats(x, np.ones(64))
    with pytest.raises(ValueError, match="refused"):
        _ckpt_cpu.stats(np.ones(64), x)
    with pytest.raises(ValueError, match="table holds 8 values, not 16"):
        _ckpt_cpu.stats(x, codes=codes, code_bits=4, elut=e2m1[:8])
    with pytest.raises(ValueError, match="clipped blocks needs"):
        _ckpt_cpu.stats(x, codes=codes, code_bits=4, elut=e2m1, clip=1)
    with pytest.raises(ValueError, match="refused"):  # factors without a block length
        _ckpt_cpu.stats(x, codes=codes, code_bits=4, elut=e2m1, factors=np.ones(2, np.float32))
    with pytest.raises(ValueError, match="refused"):  # a code width the passes do not read
        _ckpt_cpu.stats(x, codes=codes, code_bits=5, elut=np.zeros(32, np.float32))
    with pytest.raises(ValueError, match="refused"):
        _ckpt_cpu.stats(x, codes=codes, code_bits=4, elut=e2m1, clip=3)
    with pytest.raises(ValueError, match="C-contiguous"):
        _ckpt_cpu.decode(np.empty((8, 16), np.float32)[:, ::2], codes=codes, code_bits=4,
                         elut=e2m1)
    with pytest.raises(ValueError, match="q holds 64 values for 32"):
        _ckpt_cpu.decode(np.empty(32, np.float32), x)
    with pytest.raises(TypeError, match="int16 is not one"):
        _ckpt_cpu.decode(np.empty(64, np.int16), codes=codes, code_bits=4, elut=e2m1)
    with pytest.raises(ValueError, match="refused"):
        _ckpt_cpu.decode(np.empty(64, np.float32), codes=codes, code_bits=4, elut=e2m1,
                         factors=np.ones(2, np.float32), block=0)
    with pytest.raises(ValueError, match="refused"):  # 64 values in 3 equal rows
        _ckpt_cpu.amax(x, rows=3)
    with pytest.raises(ValueError, match="refused"):
        _ckpt_cpu.amax(x, rows=0)
    with pytest.raises(TypeError, match="uint8 is not one"):
        _ckpt_cpu.amax(codes)


def test_fallback_when_policy_is_xla():
    """Kernel policy "xla" hands the pipeline to the NumPy code (the same numbers)."""
    previous = lowprec.kernels.set_policy("xla")
    try:
        assert not _chunk.native()
    finally:
        lowprec.kernels.set_policy(previous)
    assert _chunk.native()


@pytest.mark.parametrize("in_dtype", INPUTS, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("fmt_name,rule", [(f, "floor") for f in MX_FORMATS]
                         + [("mxfp4", "rceil"), ("mxfp8_e4m3", "even")])
def test_fused_quantize_matches_library_and_stats_pass(fmt_name, rule, in_dtype, monkeypatch):
    """The fused pass (quantize and statistics in one, ``lowprec_ckpt_quantize`` and its
    NVFP4 twin) through ``quantize_chunk``: the codes are ``quantize_mx``'s, and the
    statistics are the separate statistics pass's on those codes, bit for bit (the same
    chunks, lanes and order; that pass is tied to NumPy above). Five rows of 1024: blocks
    across two 2048-element chunk boundaries and a partial last chunk. NVFP4 runs natively
    for tensor scales in [2^-118, 2^116] only: the adversarial rows' ~3e38 (a tensor scale
    ~1e35) take the XLA path, with the same results; scaled by 2^-20 they take the native
    one."""
    fmt = lowprec.mx_format(fmt_name)
    rule = None if fmt.tensor_scale else rule
    x = adversarial(5, 1024, in_dtype, f"fused {fmt_name} {rule} {in_dtype}")
    calls = []
    for name in ("quantize", "quantize_nvfp4"):
        real = getattr(_ckpt_cpu, name)
        monkeypatch.setattr(_ckpt_cpu, name,
                            lambda *a, _real=real, **k: calls.append(1) or _real(*a, **k))
    spec = make_spec(fmt_name, x.shape, {np.float32: "F32", ml_dtypes.bfloat16: "BF16",
                                         np.float16: "F16"}[in_dtype], scale_rule=rule)
    huge = fmt.tensor_scale and in_dtype != np.float16  # float16 holds inf instead
    for scale in ((1.0, 2.0 ** -20) if huge else (1.0,)):
        x = (x.astype(np.float32) * np.float32(scale)).astype(in_dtype)
        mx = lowprec.quantize_mx(jnp.asarray(x.astype(np.float32)), fmt, axis=-1,
                                 scale_rule=rule)
        ts = None if mx.tensor_scale is None else np.float32(mx.tensor_scale)
        calls.clear()
        got = ErrorStats()
        parts = _chunk.quantize_chunk(x, spec, ts, got)
        assert calls == ([] if huge and scale == 1.0 else [1]), "the expected pass did not run"
        elements, scales = np.asarray(mx.elements), np.asarray(mx.scales)
        np.testing.assert_array_equal(parts["elements"], elements)
        np.testing.assert_array_equal(parts["scales"], scales)

        want = _separate_pass_stats(x, elements, scales, fmt, ts, got)
        assert want.nonfinite > 0 and want.count > 0 and want.nan_blocks > 0


@pytest.mark.parametrize("in_dtype", INPUTS, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("fmt_name,rule", [("mxfp4", "floor"), ("mxfp8_e4m3", "floor"),
                                           ("mxfp6_e2m3", "floor"), ("mxfp4", "rceil")])
def test_encode_rows_is_the_library_quantizer(fmt_name, rule, in_dtype, monkeypatch):
    """The engine layouts' MX encoder (``encode_rows``: the MX kernel's loops on the calling
    thread, no XLA program) gives ``quantize_mx``'s codes and scales on adversarial rows
    (NaN, inf, subnormal, huge values; three 2048-element chunks and a partial one)."""
    fmt = lowprec.mx_format(fmt_name)
    x = adversarial(7, 1024, in_dtype, f"rows {fmt_name} {rule} {in_dtype}")
    calls = []
    real = _ckpt_cpu.quantize
    monkeypatch.setattr(_ckpt_cpu, "quantize", lambda *a, **k: calls.append(1) or real(*a, **k))
    elements, scales = _chunk.encode_rows(x, fmt, rule)
    assert calls == ([1] if _ckpt_cpu.has_avx2() else []), "the expected encoder did not run"
    mx = lowprec.quantize_mx(jnp.asarray(x.astype(np.float32)), fmt, axis=-1, scale_rule=rule)
    np.testing.assert_array_equal(elements, np.asarray(mx.elements))
    np.testing.assert_array_equal(scales, np.asarray(mx.scales))


@pytest.mark.parametrize("with_nan_block", [False, True])
@pytest.mark.parametrize("fmt_name", MX_FORMATS)
def test_canonical_nan_pass_skipped_only_where_no_nan_can_come_out(fmt_name, with_nan_block):
    # mx_coded turns the decode's NaN-canonicalizing pass off where no code x factor can be
    # NaN; the values are then those of the decode with the pass on, bit for bit (every
    # element code, scale codes with and without the scale format's NaN).
    fmt = lowprec.mx_format(fmt_name)
    rng = np.random.default_rng(zlib.crc32(fmt_name.encode()))
    n = fmt.block_size * 64
    bits = fmt.element.code_bits
    codes = rng.integers(0, 1 << bits, n).astype(np.uint8)
    codes[: 1 << bits] = np.arange(1 << bits)  # every element code, NaN and inf included
    packed = (codes[0::2] | (codes[1::2] << 4)).astype(np.uint8) if bits == 4 else codes
    if bits == 6:
        packed = np.asarray(lowprec.pack_fp6(codes))
    scale_nan = np.flatnonzero(np.isnan(_chunk.factor_table(fmt, np.float32(1) if
                                                            fmt.tensor_scale else None)))
    scales = rng.integers(100, 140, n // fmt.block_size).astype(np.uint8)
    if with_nan_block:
        scales[-1] = scale_nan[0]
    ts = np.float32(0.5) if fmt.tensor_scale else None
    coded = _chunk.mx_coded(packed, scales, fmt, ts)
    forced = dataclasses.replace(coded, canonical_nan=True)
    got = _chunk._decode_unchecked(coded, (n,), np.float32)
    want = _chunk._decode_unchecked(forced, (n,), np.float32)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    assert coded.canonical_nan == bool(np.isnan(want).any())


def _separate_pass_stats(x, elements, scales, fmt, ts, got):
    """The statistics of the separate statistics pass over (elements, scales) of x: every
    field of ``got`` (the fused pass's) must equal it; returned for further checks."""
    coded = _chunk.mx_coded(elements, scales, fmt, ts)
    want = ErrorStats()
    want.add_vector(_ckpt_cpu.stats(x, **coded.args(), clip=1,
                                    max_finite=fmt.element.max_finite, view=(*x.shape, 1)))
    want.nan_blocks = int(np.count_nonzero(np.isnan(coded.block_factors())))
    for field in vars(want):
        if field != "_buf":
            assert getattr(got, field) == getattr(want, field), field
    return want


@pytest.mark.parametrize("in_dtype", INPUTS, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("fmt_name", ["nvfp4", "mxfp4", "mxfp8_e4m3"])
def test_fused_pass_groups_of_8_blocks(fmt_name, in_dtype):
    """The fused pass takes blocks 8 at a time (their largest magnitudes found together; for
    NVFP4 also its encode, and the clipped-block count from those maxima), a group holding a
    NaN or an infinity by the scalar steps. Gaussian rows (every group on the vector path
    unless a special is put there) with a special at the first and last block of a group, in
    a group of its own, and in the blocks after the last whole group of a chunk (rows of
    2048 + 3 blocks' elements: a partial last chunk), and heavy-tailed blocks (clipped ones):
    the codes are ``quantize_mx``'s, the statistics the separate statistics pass's, and the
    clipped-block count NumPy's."""
    fmt = lowprec.mx_format(fmt_name)
    block = fmt.block_size
    rng = np.random.default_rng(zlib.crc32(f"groups {fmt_name} {in_dtype}".encode()))
    cols = 2048 + 3 * block
    x = rng.standard_normal((3, cols)) * 0.02
    x[:, 5 * block::11 * block] *= 40.0  # heavy-tailed blocks: clipped under the floor rule
    flat = x.reshape(-1)
    for b, special in [(0, np.nan), (7, np.inf), (8 * 3 + 4, -np.inf), (2048 // block + 1, np.nan),
                       (cols // block + 16, -np.inf), (2 * cols // block - 1, np.nan)]:
        flat[b * block + rng.integers(0, block)] = special
    x = x.astype(np.float32).astype(in_dtype)
    rule = None if fmt.tensor_scale else "floor"
    mx = lowprec.quantize_mx(jnp.asarray(x.astype(np.float32)), fmt, axis=-1, scale_rule=rule)
    ts = None if mx.tensor_scale is None else np.float32(mx.tensor_scale)
    spec = make_spec(fmt_name, x.shape, {np.float32: "F32", ml_dtypes.bfloat16: "BF16",
                                         np.float16: "F16"}[in_dtype], scale_rule=rule)
    got = ErrorStats()
    parts = _chunk.quantize_chunk(x, spec, ts, got)
    np.testing.assert_array_equal(parts["elements"], np.asarray(mx.elements))
    np.testing.assert_array_equal(parts["scales"], np.asarray(mx.scales))
    want = _separate_pass_stats(x, np.asarray(mx.elements), np.asarray(mx.scales), fmt, ts, got)
    assert (got.clipped, got.clip_total) == _chunk._mx_clipped(  # NumPy's count
        x.reshape(3, -1, 1), np.asarray(mx.scales).view(np.uint8), fmt, ts)
    assert want.clipped > 0 and want.nan_in + want.inf_in == 6 and want.count > 0


@pytest.mark.parametrize("out_dtype", OUTPUTS, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("fmt_name", MX_FORMATS)
def test_decode_by_scale_codes_is_decode_by_factors(fmt_name, out_dtype):
    """The decode that looks each block's factor up from its scale code a chunk at a time
    (``mx_coded``'s, running the canonical-NaN pass only on chunks where a NaN can come out)
    writes the bits and counts of the decode given every block's factor with the pass on
    everywhere: every element code; a NaN block's scale code and a zero factor's (NVFP4's
    E4M3 0) in one chunk only of a piece of 2.5 chunks (2048 elements each); saturated and
    not."""
    fmt = lowprec.mx_format(fmt_name)
    rng = np.random.default_rng(zlib.crc32(f"scaled {fmt_name}".encode()))
    n = 5 * 1024
    code_bits = fmt.element.code_bits
    codes = rng.integers(0, 1 << code_bits, n).astype(np.uint8)
    codes[: 1 << code_bits] = np.arange(1 << code_bits)  # every element code, in chunk 0
    packed = codes
    if code_bits == 4:
        packed = (codes[0::2] | (codes[1::2] << 4)).astype(np.uint8)
    elif code_bits == 6:
        packed = np.asarray(lowprec.pack_fp6(codes))
    ts = np.float32(0.5) if fmt.tensor_scale else None
    ftable = _chunk.factor_table(fmt, ts)
    scales = rng.integers(120, 134, n // fmt.block_size).astype(np.uint8)
    special = np.flatnonzero(np.isnan(ftable) | (ftable == 0))
    scales[2048 // fmt.block_size + 3] = special[0]  # chunk 1 only
    scales[-1] = special[-1]  # chunk 2 (partial)
    coded = _chunk.mx_coded(packed, scales, fmt, ts)
    assert coded.scale_codes is not None and coded.factors is None
    by_factors = dataclasses.replace(coded, factors=np.take(ftable, scales), scale_codes=None,
                                     ftable=None, canonical_nan=True)
    for saturate in (False, True):
        got, want = np.zeros(n, out_dtype), np.zeros(n, out_dtype)
        got_counts = _ckpt_cpu.decode(got, **coded.decode_args(), saturate=saturate,
                                      canonical_nan=coded.canonical_nan)
        want_counts = _ckpt_cpu.decode(want, **by_factors.args(), saturate=saturate,
                                       canonical_nan=True)
        assert got_counts == want_counts
        np.testing.assert_array_equal(bits(got), bits(want))
