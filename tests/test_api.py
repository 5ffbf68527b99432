"""The public surface: argument order, ScaleRule, finfo, resolve_format, shared_exponents,
MXArray validation, dtype checks, and integer-only widening of half-precision input.

Expected values come from ml_dtypes (finfo, half-precision bit patterns), the independent
reference (shared exponents), or a derivation written beside the assertion.
"""

from __future__ import annotations

import math
import re
import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import lowprec
import lowprec.kernels
import lowprec_formats
import lowprec_reference as R
from helpers.asserts import bit_pattern
from helpers.kernels import cuda_branches, lower_for_cuda  # noqa: F401  (cuda_branches: a fixture)

MX_NAMES = lowprec_formats.COLLECTIONS["e8m0_scaled_mx"]  # NVFP4 has no shared exponents
RULES = tuple(lowprec.ScaleRule)


# -- argument order ---------------------------------------------------------------------------


@pytest.mark.parametrize("func", ["encode", "quantize"])
def test_old_argument_order_still_works_with_a_deprecation_warning(func):
    x = jnp.array([0.1, 300.0, 500.0])
    f = getattr(lowprec, func)
    with pytest.warns(DeprecationWarning, match=rf"lowprec.{func}\(x, fmt\)"):
        old = f("e4m3", x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        new = f(x, "e4m3")
    np.testing.assert_array_equal(np.asarray(old), np.asarray(new))


def test_old_argument_order_of_decode_and_quantize_mx():
    codes = jnp.arange(16, dtype=jnp.uint8)
    with pytest.warns(DeprecationWarning):
        old = lowprec.decode("e2m1", codes)
    np.testing.assert_array_equal(np.asarray(old), np.asarray(lowprec.decode(codes, "e2m1")))
    x = jnp.linspace(-1, 1, 64)
    with pytest.warns(DeprecationWarning):
        mx = lowprec.quantize_mx("mxfp4", x)
    np.testing.assert_array_equal(np.asarray(mx.scales), np.asarray(lowprec.quantize_mx(x, "mxfp4").scales))


# -- ScaleRule ----------------------------------------------------------------------------------


def test_scale_rule_members_are_the_data_table_rules_and_documented():
    assert tuple(r.value for r in lowprec.ScaleRule) == lowprec_formats.SCALE_RULES
    for rule in lowprec.ScaleRule:
        assert rule == rule.value and str(rule) == rule.value and f"{rule}" == rule.value
        assert lowprec.ScaleRule(rule.value) is rule
        assert rule.__doc__ and rule.__doc__ != lowprec.ScaleRule.__doc__


@pytest.mark.parametrize("rule", RULES)
def test_enum_and_string_scale_rules_give_the_same_bits(rule):
    x = jax.random.normal(jax.random.key(1), (4, 64)) * 30
    a = lowprec.quantize_mx(x, "mxfp8_e4m3", scale_rule=rule)
    b = lowprec.quantize_mx(x, "mxfp8_e4m3", scale_rule=rule.value)
    np.testing.assert_array_equal(np.asarray(a.scales), np.asarray(b.scales))
    np.testing.assert_array_equal(np.asarray(a.elements), np.asarray(b.elements))
    assert a.scale_rule is rule


@pytest.mark.parametrize(
    "call",
    [
        lambda x: lowprec.quantize_mx(x, "mxfp4", scale_rule="nearest"),
        lambda x: lowprec.fake_quantize_mx(x, "mxfp4", scale_rule="nearest"),
        lambda x: lowprec.shared_exponents(x, "mxfp4", scale_rule="nearest"),
        lambda x: lowprec.dot_general(
            x[None], x[:, None], (((1,), (0,)), ((), ())), lhs_format="mxfp4", scale_rule="nearest"
        ),
    ],
)
def test_every_entry_point_rejects_an_unknown_scale_rule_with_one_message(call):
    with pytest.raises(ValueError, match=r"unknown scale_rule 'nearest'; valid rules: 'floor', 'ceil', 'even', 'rceil'"):
        call(jnp.ones(32))


# -- finfo -----------------------------------------------------------------------------------

_FINFO_FIELDS = (
    "bits", "eps", "epsneg", "machep", "negep", "max", "min", "maxexp", "minexp", "nexp",
    "nmant", "iexp", "tiny", "smallest_normal", "smallest_subnormal",
)


@pytest.mark.parametrize("name", lowprec_formats.COLLECTIONS["with_ml_dtypes"])
def test_finfo_equals_ml_dtypes_finfo(name):
    info = lowprec.finfo(name)
    dtype = lowprec.element_format(name).storage_dtype
    peer = ml_dtypes.finfo(dtype)
    for field in _FINFO_FIELDS:
        assert getattr(info, field) == float(getattr(peer, field)), field
    assert info.dtype == dtype


def test_finfo_of_tf32_from_its_layout():
    info = lowprec.finfo("tf32")
    # 1/8/10, bias 127: float32's exponent range with a 10-bit mantissa.
    assert (info.bits, info.nexp, info.nmant) == (19, 8, 10)
    assert info.eps == 2.0**-10 and info.epsneg == 2.0**-11
    assert info.max == (2 - 2.0**-10) * 2.0**127
    assert info.smallest_normal == 2.0**-126 and info.smallest_subnormal == 2.0**-136
    assert (info.maxexp, info.minexp, info.precision) == (128, -126, 3)
    assert info.dtype is None


def test_finfo_precision_follows_numpy_definition():
    for name in lowprec.ELEMENT_FORMAT_NAMES:
        info = lowprec.finfo(name)
        assert info.precision == int(-math.log10(info.eps))
        assert info.resolution == 10.0**-info.precision
    assert lowprec.finfo("fp16").precision == np.finfo(np.float16).precision


def test_finfo_refuses_block_formats_with_the_fix():
    with pytest.raises(TypeError, match=r"finfo\('e2m1'\)"):
        lowprec.finfo(lowprec.mx_format("mxfp4"))
    with pytest.raises(ValueError, match="block"):
        lowprec.finfo("mxfp4")


# -- resolve_format ----------------------------------------------------------------------------


def test_resolve_format_accepts_every_alias_of_the_data_table():
    for alias, canonical in lowprec_formats.ALIASES.items():
        fmt = lowprec.resolve_format(alias)
        assert fmt.name == canonical
        assert lowprec.resolve_format(alias.upper()) is fmt
        assert lowprec.resolve_format(fmt) is fmt


def test_resolve_format_error_lists_the_names():
    with pytest.raises(ValueError, match=r"unknown format 'fp7'.*e4m3.*mxfp4"):
        lowprec.resolve_format("fp7")
    with pytest.raises(TypeError):
        lowprec.resolve_format(8)


# -- shared_exponents ------------------------------------------------------------------------


def _reference_shared(x: np.ndarray, fmt: str, rule: str) -> np.ndarray:
    """Per-block shared exponents from the reference, 128 for NaN/Inf blocks."""
    elem = R.mx_element_format(fmt)
    blocks = x.reshape(-1, 32)
    out = []
    for b in blocks:
        if not np.isfinite(b).all():
            out.append(128)
        else:
            out.append(R.shared_exponent(float(np.abs(b).max()), elem, rule))
    return np.array(out)


@pytest.mark.parametrize("fmt", MX_NAMES)
@pytest.mark.parametrize("rule", RULES, ids=str)
@given(
    x=hnp.arrays(
        np.float32, (4 * 32,),
        elements=st.floats(width=32, allow_nan=True, allow_infinity=True, allow_subnormal=True),
    )
)
@pytest.mark.quick_first(8)
def test_shared_exponents_equal_the_reference(fmt, rule, x):
    got = np.asarray(lowprec.shared_exponents(jnp.asarray(x), fmt, scale_rule=rule))
    np.testing.assert_array_equal(got, _reference_shared(x, fmt, rule.value))


def test_shared_exponents_along_an_axis_with_padding():
    x = jnp.ones((40, 3)).at[33, 1].set(1000.0)
    got = lowprec.shared_exponents(x, "mxfp4", axis=0, pad=True)
    assert got.shape == (2, 3)
    # floor(log2 1) - 2 = -2 everywhere, floor(log2 1000) - 2 = 7 in the padded second block.
    assert got.tolist() == [[-2, -2, -2], [-2, 7, -2]]
    with pytest.raises(ValueError, match="pad=True"):
        lowprec.shared_exponents(x, "mxfp4", axis=0)


# -- MXArray validation -------------------------------------------------------------------------


def _good():
    return lowprec.quantize_mx(jnp.ones((2, 64)), "mxfp4")


def test_mxarray_accepts_a_format_name_and_a_negative_axis():
    mx = _good()
    built = lowprec.MXArray(mx.elements, mx.scales, "mxfp4", -1, (2, 64), "floor")
    assert built.fmt is lowprec.mx_format("mxfp4") and built.axis == 1
    assert built.scale_rule is lowprec.ScaleRule.FLOOR
    np.testing.assert_array_equal(np.asarray(lowprec.dequantize(built)), np.ones((2, 64)))


@pytest.mark.parametrize(
    "change, error, match",
    [
        (dict(scales=jnp.zeros((2, 3), jnp.uint8)), ValueError, r"scales have shape \(2, 3\)"),
        (dict(shape=(2, 96)), ValueError, "needs"),
        (dict(fmt="mxfp8_e4m3"), ValueError, r"elements have shape \(2, 32\).*needs \(2, 64\)"),
        (dict(scales=jnp.full((2, 2), 300, jnp.int32)), TypeError, "uint8"),
        (dict(elements=jnp.zeros((2, 32), jnp.float32)), TypeError, "uint8"),
        (dict(axis=2), ValueError, "axis 2 is out of range"),
        (dict(axis=1.0), TypeError, "axis must be an integer"),
        (dict(fmt="e4m3"), ValueError, "unknown MX format"),
        (dict(fmt=3), TypeError, "MXFormat"),
        (dict(scale_rule="round"), ValueError, "unknown scale_rule"),
        (dict(shape=(2, "64")), TypeError, "tuple of ints"),
    ],
)
def test_mxarray_rejects_inconsistent_parts(change, error, match):
    mx = _good()
    fields = dict(elements=mx.elements, scales=mx.scales, fmt=mx.fmt, axis=1, shape=(2, 64),
                  scale_rule=None)
    fields.update(change)
    with pytest.raises(error, match=match):
        lowprec.MXArray(**fields)


def test_mxarray_checks_shapes_under_jit_and_allows_vmap_batches():
    mx = _good()

    @jax.jit
    def bad(el, sc):
        return lowprec.MXArray(el, sc[:, :1], mx.fmt, 1, (2, 64))

    with pytest.raises(ValueError, match="scales have shape"):
        bad(mx.elements, mx.scales)
    x = jnp.ones((5, 2, 64))
    batched = jax.vmap(lambda r: lowprec.quantize_mx(r, "mxfp4"))(x)
    assert batched.elements.shape == (5, 2, 32) and batched.shape == (2, 64)
    back = jax.vmap(lowprec.dequantize)(batched)
    np.testing.assert_array_equal(np.asarray(back), np.ones((5, 2, 64)))


# -- dtype checks ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.uint8, jnp.bool_])
def test_quantize_and_decode_refuse_non_float_result_dtypes(dtype):
    x = jnp.array([1.5, jnp.nan])
    with pytest.raises(TypeError, match="float32, float64, bfloat16 or float16"):
        lowprec.quantize(x, "e4m3", dtype=dtype)
    with pytest.raises(TypeError, match="float32, float64, bfloat16 or float16"):
        lowprec.decode(jnp.array([1, 2], jnp.uint8), "e4m3", dtype=dtype)
    with pytest.raises(TypeError, match="float32, float64, bfloat16 or float16"):
        lowprec.dequantize(_good(), dtype)


# -- half-precision input is widened with integer operations --------------------------------------


def _all_half(dtype) -> np.ndarray:
    return np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(dtype)


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16], ids=["f16", "bf16"])
def test_widening_every_half_precision_value_matches_numpy(dtype):
    from lowprec._dtypes import input_bits

    h = _all_half(dtype)
    got = np.asarray(jax.jit(input_bits)(jnp.asarray(h)))
    want = bit_pattern(h.astype(np.float32))
    nan = np.isnan(h.astype(np.float32))
    np.testing.assert_array_equal(got[~nan], want[~nan])
    # NaN: a float32 NaN with the input's sign (payloads are not kept).
    assert (got[nan] & 0x7FFF_FFFF > 0x7F80_0000).all()
    np.testing.assert_array_equal(got[nan] >> 31, want[nan] >> 31)


_DN = (((1,), (1,)), ((), ()))


def _w4():
    return lowprec.quantize_mx(jnp.ones((8, 64)), "mxfp4")


def _pw4():
    with jax.ensure_compile_time_eval():  # prepared where the weight is loaded: concrete
        return lowprec.prepare_weight(_w4())


def _vjp(f):
    """x, ct -> f's vjp at x applied to ct (the cotangent is an input: no constant seed)."""
    return lambda x, ct: jax.vjp(f, x)[1](ct)[0]


# Every public function that reads or writes float arrays, called on a half-precision x[64]
# ("function-variant" -> call; vjp calls also take a cotangent, shapes below). Dot products
# go through each operand path, the decode-time MXFP4 route included.
HALF_CALLS = {
    "encode": lambda x: lowprec.encode(x, "e4m3"),
    "decode": lambda x: lowprec.decode(lowprec.encode(x, "e5m2"), "e5m2", dtype=x.dtype),
    # (e5m2: a format both half dtypes hold exactly, so dtype=x.dtype is no second rounding)
    "quantize": lambda x: lowprec.quantize(x, "e5m2", dtype=x.dtype),
    "quantize-stochastic": lambda x: lowprec.quantize(
        x, "e4m3", rounding="stochastic", key=jax.random.key(0), dtype=x.dtype),
    "quantize_mx": lambda x: lowprec.quantize_mx(x, "mxfp8_e4m3").scales,
    "shared_exponents": lambda x: lowprec.shared_exponents(x, "mxfp4"),
    "dequantize": lambda x: lowprec.dequantize(lowprec.quantize_mx(x, "mxfp8_e5m2"), x.dtype),
    "fake_quantize_mx": lambda x: lowprec.fake_quantize_mx(x, "mxfp4"),
    "quantize_mx_plus": lambda x: lowprec.quantize_mx_plus(x, "mxfp4").bm_index,
    "dequantize_mx_plus": lambda x: lowprec.dequantize_mx_plus(
        lowprec.quantize_mx_plus(x, "mxfp4"), x.dtype),
    "dot_general-as-is": lambda x: lowprec.dot_general(
        x.reshape(2, 32), x.reshape(2, 32), _DN, preferred_element_type=x.dtype),
    "dot_general-mx": lambda x: lowprec.dot_general(
        x.reshape(2, 32), x.reshape(2, 32), _DN, lhs_format="mxfp8", rhs_format="mxfp4",
        preferred_element_type=x.dtype),
    "dot_general-element": lambda x: lowprec.dot_general(
        x.reshape(2, 32), x.reshape(2, 32), _DN, lhs_format="e4m3", rhs_format="bf16"),
    "dot_general-mxfp4-weight": lambda x: lowprec.dot_general(
        x.reshape(1, 64), _w4(), _DN, preferred_element_type=x.dtype),
    "matmul-mxfp4-weight": lambda x: lowprec.matmul(
        x.reshape(1, 64), lowprec.quantize_mx(jnp.ones((64, 8)), "mxfp4", axis=0),
        preferred_element_type=x.dtype),
    "dot_general-vjp-ste": _vjp(lambda a: lowprec.dot_general(
        a.reshape(2, 32), a.reshape(2, 32), _DN, lhs_format="mxfp8", preferred_element_type=a.dtype)),
    "dot_general-vjp-quantized": _vjp(lambda a: lowprec.dot_general(
        a.reshape(2, 32), a.reshape(2, 32), _DN, lhs_format="mxfp8", rhs_format="mxfp8",
        backward="quantized", pad=True, preferred_element_type=a.dtype)),
    "fake_quantize_mx-vjp": _vjp(lambda a: lowprec.fake_quantize_mx(a, "mxfp8")),
    "ragged_dot-mx": lambda x: lowprec.ragged_dot(
        x.reshape(2, 32), x.reshape(1, 32, 2), jnp.array([2]), lhs_format="mxfp8",
        rhs_format="mxfp4", preferred_element_type=x.dtype),
    "ragged_dot-vjp-quantized": _vjp(lambda a: lowprec.ragged_dot(
        a.reshape(2, 32), a.reshape(1, 32, 2), jnp.array([2]), lhs_format="mxfp8",
        rhs_format="mxfp8", backward="quantized", pad=True, preferred_element_type=a.dtype)),
    "delayed_dot_general-vjp": lambda x: jax.vjp(lambda a: lowprec.delayed_dot_general(
        a.reshape(2, 32), a.reshape(2, 32), lowprec.DelayedScaling(amax_history_len=2).init(),
        _DN, lowprec.DelayedScaling(amax_history_len=2)), x)[1](jnp.ones((2, 2)))[0],
    "mxfp4_gemv": lambda x: lowprec.kernels.mxfp4_gemv(_w4(), x),
    "weight_only_matmul": lambda x: lowprec.weight_only_matmul(x, _pw4()),
}
_COTANGENT_SHAPES = {
    "dot_general-vjp-ste": (2, 2), "dot_general-vjp-quantized": (2, 2),
    "ragged_dot-vjp-quantized": (2, 2),
    "fake_quantize_mx-vjp": (64,),
}
# Public names that never see a float array (formats, codes, layouts).
_NO_FLOAT_IO = {
    "finfo", "resolve_format", "element_format", "mx_format", "pack_fp4", "unpack_fp4",
    "pack_fp6", "unpack_fp6", "p3109",
    "to_gpt_oss", "from_gpt_oss", "mxfp4_to_nvfp4", "MXArray", "ScaleRule", "random_bits", "scale_scheme",
    "ScaleScheme", "register_scale_scheme", "prepare_weight", "stochastic_rounding_key",
}


def test_half_precision_convert_test_covers_every_public_function():
    public = {n for n in lowprec.__all__ if callable(getattr(lowprec, n)) and not n[0].isupper()}
    public -= _NO_FLOAT_IO
    covered = {name.split("-")[0] for name in HALF_CALLS}
    assert public <= covered, f"add {sorted(public - covered)} to HALF_CALLS"


def _half_converts(hlo: str, dtype) -> list:
    half = "f16" if dtype == jnp.float16 else "bf16"
    return [
        line.strip() for line in hlo.splitlines()
        if re.search(r"\bstablehlo\.convert\b", line) and re.search(rf"\b{half}\b|x{half}>", line)
    ]


@pytest.mark.quick_cases(dtype=[jnp.bfloat16])
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16], ids=["f16", "bf16"])
@pytest.mark.parametrize("name", list(HALF_CALLS))
@pytest.mark.quick_first(5)
def test_half_precision_paths_hold_no_float_convert(dtype, name):
    """XLA on GPU turns any half NaN into 0x7fffffff when it converts (sign lost), so no
    compiled lowprec program converts half-precision floats at all: widening and narrowing
    are bitcasts and integer arithmetic (docs/design.md §8), forward and backward."""
    if name in ("mxfp4_gemv", "weight_only_matmul") and dtype == jnp.float16:
        pytest.skip(f"{name} takes bfloat16 activations only")
    args = [jax.ShapeDtypeStruct((64,), dtype)]
    if name in _COTANGENT_SHAPES:
        args.append(jax.ShapeDtypeStruct(_COTANGENT_SHAPES[name], dtype))
    hlo = jax.jit(HALF_CALLS[name]).lower(*args).as_text()
    converts = _half_converts(hlo, dtype)
    assert not converts, "\n".join(converts)


# Quick tier: one entry point per Pallas kernel (dot_general and matmul lower to the same one).
@pytest.mark.quick_cases(name=["dot_general-mxfp4-weight", "mxfp4_gemv"])
@pytest.mark.parametrize("name", ["dot_general-mxfp4-weight", "matmul-mxfp4-weight", "mxfp4_gemv"])
def test_half_precision_paths_lowered_for_cuda_hold_no_float_convert(name, cuda_branches):
    """The same for the program XLA gets on a CUDA GPU, where the decode-time MXFP4 product
    is a Pallas kernel (its body is Triton code, in which bfloat16 is widened by shifts)."""
    pytest.importorskip("jax._src.pallas.triton.pallas_call_registration")
    fn = HALF_CALLS[name]
    if name == "mxfp4_gemv":
        fn = lambda x: lowprec.kernels.mxfp4_gemv(_w4(), x, interpret=False)  # noqa: E731
    arg = jax.ShapeDtypeStruct((64,), jnp.bfloat16)
    hlo = lower_for_cuda(fn, arg)
    assert "__gpu$xla.gpu.triton" in hlo
    converts = _half_converts(hlo, jnp.bfloat16)
    assert not converts, "\n".join(converts)


def test_negative_half_nan_keeps_its_sign_through_encode():
    h = np.array([0xFC01, 0x7C01, 0xFE00], np.uint16).view(np.float16)
    # ml_dtypes: every NaN of either sign maps to e4m3's NaN code with that sign.
    with np.errstate(invalid="ignore"):
        want = bit_pattern(h.astype(np.float32).astype(ml_dtypes.float8_e4m3fn))
    got = np.asarray(lowprec.encode(jnp.asarray(h), "e4m3"))
    np.testing.assert_array_equal(got, want)
    assert got.tolist() == [0xFF, 0x7F, 0xFF]


# Result dtypes of quantize, crossed with every element format of at most 8 bits.
_RESULT_DTYPES = [jnp.float16, jnp.bfloat16, jnp.float8_e4m3fn, jnp.float8_e5m2,
                  jnp.float8_e4m3fnuz, jnp.float8_e5m2fnuz, jnp.float4_e2m1fn]
_SMALL_FORMATS = [f for f in R.format_names() if lowprec.element_format(f).code_bits <= 8]


def _holds_every_value(fmt: str, dtype) -> bool:
    """Whether ``dtype`` holds every value of ``fmt`` (the reference's decode of every code,
    infinities and NaN included) exactly: ml_dtypes' cast there and back returns it."""
    v = R.decode(fmt, R.all_codes(fmt))
    with np.errstate(invalid="ignore", over="ignore"):
        back = v.astype(np.dtype(dtype)).astype(np.float64)
    return bool(np.all((back == v) | (np.isnan(back) & np.isnan(v))))


@pytest.mark.parametrize("dtype", _RESULT_DTYPES, ids=lambda d: np.dtype(d).name)
def test_quantize_refuses_a_result_dtype_that_cannot_hold_every_value(dtype):
    """quantize rounds to the values of the format; a dtype= missing one of them would round
    the result a second time (issue 37.4: e4m3 as float8_e5m2 turned 0.1 into 0.09375, not
    e4m3's 0.1015625), so it is refused — decided for every format against the reference's
    values (traced only: the check comes before any compilation)."""
    x = jax.ShapeDtypeStruct((2,), jnp.float32)
    for fmt in _SMALL_FORMATS:
        call = lambda v: lowprec.quantize(v, fmt, dtype=dtype)  # noqa: E731
        if _holds_every_value(fmt, dtype):
            assert jax.eval_shape(call, x).dtype == np.dtype(dtype), fmt
            continue
        with pytest.raises(ValueError, match=rf"dtype={np.dtype(dtype).name} cannot hold every "
                                             rf"value of '{fmt}' exactly \(.*\).*dtype="):
            jax.eval_shape(call, x)


def test_quantize_result_dtype_double_rounding_repro():
    x = jnp.array([0.1, 448.0])
    with pytest.raises(ValueError, match=r"dtype=float8_e5m2 cannot hold every value of 'e4m3' "
                                         r"exactly \(1.125 is not a float8_e5m2 value\)"):
        lowprec.quantize(x, "e4m3", dtype=jnp.float8_e5m2)
    # Exact dtypes give e4m3's values themselves (0.1 -> 13 * 2^-7).
    for dtype in (jnp.float32, jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn):
        got = np.asarray(lowprec.quantize(x, "e4m3", dtype=dtype)).astype(np.float64)
        assert got.tolist() == [13 * 2.0**-7, 448.0]


@pytest.mark.parametrize("name,suggestion", [
    ("e4m4", "'e4m3'"), ("nvfp5", "'nvfp4'"), ("mxfp8_e4m2", "'mxfp8_e5m2'"),
    ("bfloat15", "'bfloat16'"),
])
def test_near_miss_format_names_suggest_the_right_one(name, suggestion):
    with pytest.raises(ValueError, match=rf"unknown format '{name}'; did you mean .*{suggestion}"):
        lowprec.resolve_format(name)


@pytest.mark.parametrize("obj,phrase", [
    (jnp.float8_e4m3fn, "got the dtype float8_e4m3fn .*pass its name, 'float8_e4m3fn'"),
    (np.float64, "got the dtype float64 .*lowprec has no format of that name"),
    (None, "got NoneType None"),
])
def test_finfo_of_a_dtype_says_what_it_got(obj, phrase):
    with pytest.raises(TypeError, match=phrase):
        lowprec.finfo(obj)
    assert lowprec.finfo("float8_e4m3fn").max == 448.0  # the suggested call works


# -- one validation per entry point -------------------------------------------------------------

_ENTRY_CALLS = {
    # entry point: (call, the option object whose check_call validates it)
    "encode": (lambda: lowprec.encode(jnp.ones(4), "e4m3"), "ElementCast"),
    "quantize": (lambda: lowprec.quantize(jnp.ones(4), "e4m3"), "ElementCast"),
    "quantize_mx": (lambda: lowprec.quantize_mx(jnp.ones(64), "mxfp8"), "MXCast"),
    "fake_quantize_mx": (lambda: lowprec.fake_quantize_mx(jnp.ones(64), "nvfp4"), "MXCast"),
    "shared_exponents": (lambda: lowprec.shared_exponents(jnp.ones(64), "mxfp4"), "MXCast"),
    "dot_general": (lambda: lowprec.dot_general(jnp.ones((2, 64)), jnp.ones((3, 64)), _DN,
                                                lhs_format="mxfp8"), "DotSpec"),
    "matmul": (lambda: lowprec.matmul(jnp.ones((2, 64)), jnp.ones((64, 3)), rhs_format="mxfp4"),
               "DotSpec"),
}


@pytest.mark.parametrize("name", list(_ENTRY_CALLS))
@pytest.mark.quick_first(3)
def test_each_entry_point_runs_its_checks_once(name, monkeypatch):
    """Every public entry point validates a call through exactly one check_call of its
    option object (and none of another's): the checks cannot drift apart between them."""
    from lowprec import _options

    calls = []
    for cls in ("ElementCast", "MXCast", "DotSpec"):
        real = getattr(_options, cls).check_call

        def counted(self, *a, _real=real, _cls=cls, **kw):
            calls.append(_cls)
            return _real(self, *a, **kw)

        monkeypatch.setattr(getattr(_options, cls), "check_call", counted)
    call, cls = _ENTRY_CALLS[name]
    call()
    assert calls == [cls]
