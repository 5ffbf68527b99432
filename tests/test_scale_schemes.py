"""Scale schemes: a block format holds one, refuses any other combination, and the block
encoder, decoder, option objects and MXArray ask it (never a flag).

A toy scheme registered here — a block's scale is 2^(floor(log2 amax) + headroom), the block
maximum's own binade raised by its one option, stored as an E8M0 code — must be served by
quantize_mx, dequantize, fake_quantize_mx, shared_exponents' refusal, MXArray and
dot_general without any other file knowing of it: its class is the semantic methods of a
scheme and its options value, nothing else (adding its knob touched this definition only).
Its expected values are derived in the test: x / 2^e rounded to E4M3 with saturation by
``lowprec.quantize`` (the element codec, tested on its own against ml_dtypes), times 2^e, in
float64.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lowprec
import lowprec_formats
from lowprec import _scheme
from lowprec._options import MXCast
from lowprec._bits import E8M0_BIAS, E8M0_NAN, F32_INF, floor_log2_bits, scale_bits_by_e8m0

E4M3 = lowprec.element_format("e4m3")
E8M0 = lowprec.element_format("e8m0")


@dataclasses.dataclass(frozen=True)
class ToyOptions:
    """The toy scheme's one option: ``headroom`` binades added to every block's scale."""

    headroom: int = 0

    def __post_init__(self):
        if not (isinstance(self.headroom, int) and 0 <= self.headroom <= 8):
            raise ValueError(f"headroom must be an int from 0 to 8, got {self.headroom!r}")


@_scheme.register("toy_binade")
class ToyBinadeScheme(_scheme.ScaleScheme):
    """E8M0 codes of 2^(floor(log2 amax) + headroom): with no headroom elements land in
    [1, 2) of their grid at the block maximum (a deliberately poor scale for E4M3, which then
    uses only its two lowest binades above 1; what matters here is that it is not what any
    real scheme computes)."""

    Options = ToyOptions
    recipe = "the toy rule (the block maximum's binade)"

    def check_scale(self):
        if self.scale != E8M0:
            raise ValueError("the toy scheme stores E8M0 codes")

    def encode_blocks(self, xb, amax, ts_bits, cast, inner):
        special = amax >= F32_INF
        e = jnp.clip(floor_log2_bits(amax) + cast.scale_options.headroom, -127, 127)
        codes = jnp.where(special, E8M0_NAN, e + E8M0_BIAS)
        return codes, special, xb, jnp.expand_dims(codes - E8M0_BIAS, inner)

    def decode_values(self, value_bits, scale_codes, tensor_scale):
        return scale_bits_by_e8m0(value_bits, scale_codes)

    def element_scale(self, scale_codes, tensor_scale):
        e = scale_codes.astype(jnp.int32) - E8M0_BIAS
        return jnp.where(scale_codes == E8M0_NAN, jnp.nan, jnp.exp2(e.astype(jnp.float32)))


TOY = lowprec.MXFormat("toy_fp8", E4M3, 32, ToyBinadeScheme(E8M0))


def _toy_values(x: np.ndarray, headroom: int = 0) -> np.ndarray:
    """float64 values of TOY-quantized rows of 32 (the derivation in the module docstring)."""
    x = np.asarray(x, np.float32).reshape(-1, 32)
    out = np.empty(x.shape, np.float64)
    for i, row in enumerate(x):
        if not np.all(np.isfinite(row)):
            out[i] = np.nan
            continue
        amax = float(np.max(np.abs(row)))
        e = int(np.clip(np.frexp(amax)[1] - 1 + headroom, -127, 127)) if amax > 0 else -127
        scaled = (row.astype(np.float64) * 2.0 ** -e).astype(np.float32)  # exact: a power of 2
        q = lowprec.quantize(jnp.asarray(scaled), "e4m3", overflow="saturate")
        out[i] = np.asarray(q, np.float64) * 2.0 ** e
    return out


def _rows(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((6, 32)) * 2.0 ** rng.integers(-20, 20, (6, 1))).astype(np.float32)
    x[1, 4] = np.nan
    x[2] = 0.0
    x[3, 7] = -np.inf
    x[4, :3] = [2.0**-140, -(2.0**-135), 3.0]
    return x


# -- what a block format refuses -------------------------------------------------------------


@pytest.mark.parametrize("scale", ["e4m3", "e5m2"])
def test_fp8_scales_without_a_tensor_scale_are_refused(scale):
    """The bug of the old MXFormat: E4M3/E5M2 scales with no tensor scale were quantized
    with E8M0 codes and labelled E4M3/E5M2. Every way to ask for it is now an error."""
    sc = lowprec.element_format(scale)
    with pytest.raises(TypeError, match="scheme must be a scale scheme.*bare scale format"):
        lowprec.MXFormat("bad", E4M3, 32, sc)  # a scale format passed directly
    e8m0_cls = type(lowprec.scale_scheme("e8m0"))
    with pytest.raises(ValueError, match=f"stores E8M0 scale codes.*{scale!r}"):
        e8m0_cls(sc)  # the E8M0 arithmetic on FP8 codes
    from lowprec._format import scheme_from_spec

    with pytest.raises(ValueError, match="stores E8M0 scale codes"):
        scheme_from_spec("e8m0", {"scale": scale, "tensor_scale": False})  # data saying so
    with pytest.raises(ValueError, match="data say tensor_scale=False.*has a float32 tensor"):
        scheme_from_spec("nvfp4", {"scale": "e4m3", "tensor_scale": False})
    if scale == "e5m2":
        with pytest.raises(ValueError, match="stores E4M3 block scales"):
            type(lowprec.scale_scheme("nvfp4"))(sc)


def test_block_format_refuses_unknown_schemes_and_elements_they_cannot_serve():
    with pytest.raises(ValueError, match="unknown scale scheme 'ue5m0'; valid schemes: 'e8m0', 'nvfp4'"):
        lowprec.scale_scheme("ue5m0")
    from lowprec._format import scheme_from_spec

    with pytest.raises(ValueError, match="'ue5m0' has no registered arithmetic"):
        scheme_from_spec("ue5m0", {"scale": "e8m0", "tensor_scale": False})

    class Unregistered(ToyBinadeScheme):
        pass

    with pytest.raises(TypeError, match="must be a registered scale scheme"):
        lowprec.MXFormat("x", E4M3, 32, Unregistered(E8M0))
    with pytest.raises(TypeError, match=r"arguments are \(name, element, block_size, scheme\)"):
        lowprec.MXFormat("x", E4M3, E8M0, 32)  # the old (name, element, scale, block) order
    nvfp4 = lowprec.scale_scheme("nvfp4")
    with pytest.raises(ValueError, match="NVFP4 scales serve signed 4-bit elements.*got e4m3"):
        lowprec.MXFormat("x", E4M3, 16, nvfp4)
    with pytest.raises(ValueError, match="E8M0-scaled blocks hold signed elements with a zero"):
        lowprec.MXFormat("x", lowprec.element_format("p3109_k8p3ue"), 32,
                         lowprec.scale_scheme("e8m0"))
    with pytest.raises(ValueError, match="4-, 6- or 8-bit element codes.*bf16"):
        lowprec.MXFormat("x", lowprec.element_format("bf16"), 32, lowprec.scale_scheme("e8m0"))
    with pytest.raises(ValueError, match="block_size 24 is not supported"):
        lowprec.MXFormat("x", E4M3, 24, lowprec.scale_scheme("e8m0"))
    with pytest.raises(ValueError, match="already registered"):
        _scheme.register("e8m0")(ToyBinadeScheme)


def test_formats_hold_their_schemes_and_derive_scale_and_tensor_scale():
    for name in lowprec_formats.MX_FORMATS:
        fmt = lowprec.mx_format(name)
        entry = lowprec_formats.SCALE_SCHEMES[lowprec_formats.MX_FORMATS[name]["scheme"]]
        scheme = lowprec.scale_scheme(lowprec_formats.MX_FORMATS[name]["scheme"])
        params = lowprec_formats.MX_FORMATS[name].get("scheme_params")
        if params:  # a variant: the same arithmetic with other parameters
            assert type(fmt.scheme) is type(scheme) and fmt.scheme != scheme
            assert all(getattr(fmt.scheme, k) == v for k, v in params.items())
        else:
            assert fmt.scheme is scheme
        assert fmt.scale == lowprec.element_format(entry["scale"])
        assert fmt.tensor_scale is entry["tensor_scale"]
        with pytest.raises(dataclasses.FrozenInstanceError):
            fmt.scheme = None
    assert lowprec.SCALE_SCHEME_NAMES == ("e8m0", "nvfp4", "nvfp4_4over6", "if4", "mixfp4")


# -- a scheme registered here is served everywhere -------------------------------------------


def test_toy_scheme_quantize_dequantize_fake_quantize():
    x = _rows(0)
    want = _toy_values(x).reshape(x.shape)
    mx = lowprec.quantize_mx(jnp.asarray(x), TOY)
    assert mx.fmt is TOY and mx.scale_rule is None and mx.tensor_scale is None
    # Scale codes: the binade of each block maximum (+127); 0xFF for the NaN/inf blocks, 0
    # (2^-127) for the all-zero block.
    amax = np.max(np.abs(np.where(np.isfinite(x), x, 0.0)), axis=1)
    binade = np.where(amax > 0, np.frexp(np.where(amax > 0, amax, 1.0))[1] - 1, -127) + 127
    expect_scales = np.where(np.all(np.isfinite(x), axis=1), binade, 0xFF)
    np.testing.assert_array_equal(np.asarray(mx.scales)[:, 0], expect_scales)
    got = np.asarray(lowprec.dequantize(mx), np.float64)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(np.nan_to_num(got), np.nan_to_num(want))
    for fq in (lowprec.fake_quantize_mx(jnp.asarray(x), TOY),
               jax.jit(lambda v: lowprec.fake_quantize_mx(v, TOY))(jnp.asarray(x))):
        np.testing.assert_array_equal(np.asarray(fq, np.float64), got)
    g = jax.grad(lambda v: lowprec.fake_quantize_mx(v, TOY).sum())(jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(g), np.ones_like(x))  # straight-through
    # Along axis 0, and at another block size (the same parts, named with the size).
    np.testing.assert_array_equal(
        np.asarray(lowprec.dequantize(lowprec.quantize_mx(jnp.asarray(x.T), TOY, axis=0))), got.T)
    small = lowprec.mx_format(TOY, block_size=16)
    assert small.name == "toy_fp8_b16" and small.scheme == TOY.scheme
    np.testing.assert_array_equal(
        np.asarray(lowprec.dequantize(lowprec.quantize_mx(jnp.asarray(x[:1]), small)), np.float64),
        np.concatenate([_toy_values(np.concatenate([h, h]))[:1, :16] for h in (x[0, :16], x[0, 16:])],
                       axis=1))


def test_toy_scheme_options_array_checks_and_matmul():
    x = jnp.asarray(_rows(1)[4:5])
    with pytest.raises(ValueError, match=r"toy_fp8 block scales follow the toy rule.*'rceil'"):
        lowprec.quantize_mx(x, TOY, scale_rule="rceil")
    with pytest.raises(ValueError, match="toy_fp8 has no tensor scale"):
        lowprec.fake_quantize_mx(x, TOY, tensor_scale=1.0)
    with pytest.raises(ValueError, match="nvfp4_step applies to NVFP4 scales, not to toy_fp8"):
        lowprec.quantize_mx(x, TOY, nvfp4_step="divide")
    with pytest.raises(ValueError, match="toy_fp8 block scales are E8M0 values, not shared exponents"):
        lowprec.shared_exponents(x, TOY)
    mx = lowprec.quantize_mx(x, TOY)
    with pytest.raises(ValueError, match="toy_fp8 has no tensor scale"):
        lowprec.MXArray(mx.elements, mx.scales, TOY, 1, (1, 32), tensor_scale=jnp.float32(1))
    with pytest.raises(ValueError, match=r"one E8M0 code per 32"):
        lowprec.MXArray(mx.elements, mx.scales[:, :0], TOY, 1, (1, 32))
    # dot_general quantizes an operand to it, and takes a pre-quantized one; small integers
    # keep every product and sum exact, so the float64 dot of the toy values is the answer.
    rng = np.random.default_rng(3)
    a = rng.integers(-8, 9, (3, 64)).astype(np.float32)
    w = rng.integers(-8, 9, (64, 2)).astype(np.float32)
    want = _toy_values(a).reshape(a.shape) @ w.astype(np.float64)
    got = lowprec.matmul(jnp.asarray(a), jnp.asarray(w), lhs_format=TOY)
    np.testing.assert_array_equal(np.asarray(got, np.float64), want)
    pre = lowprec.quantize_mx(jnp.asarray(a), TOY)
    np.testing.assert_array_equal(np.asarray(lowprec.matmul(pre, jnp.asarray(w)), np.float64), want)


# Every scheme the data define, and the toy one. Not ``_scheme.registered_names()`` at
# collection: data schemes register lazily, on first use, so that list depended on which test
# modules were imported before this one (alone, this file collected only nvfp4 and the toy).
SCHEMES = lowprec.SCALE_SCHEME_NAMES + ("toy_binade",)


@pytest.mark.parametrize("name", SCHEMES)
@pytest.mark.quick_first(1)
def test_every_registered_scheme_serves_the_block_functions(name):
    """quantize_mx / dequantize / fake_quantize_mx agree, and MXArray validates the codes,
    for every registered scheme (data formats, and the toy one)."""
    fmt = next((lowprec.mx_format(n) for n in lowprec_formats.MX_FORMATS
                if lowprec_formats.MX_FORMATS[n]["scheme"] == name), TOY)
    assert fmt.scheme.name == name and name in _scheme.registered_names()
    # No scheme is registered that these cases leave out.
    assert set(_scheme.registered_names()) <= set(SCHEMES), _scheme.registered_names()
    x = jnp.asarray(_rows(2)).reshape(-1)[:192].reshape(2, 96)
    mx = lowprec.quantize_mx(x, fmt, pad=True)
    again = lowprec.MXArray(mx.elements, mx.scales, fmt, mx.axis, mx.shape, mx.scale_rule,
                            mx.tensor_scale)
    deq = np.asarray(lowprec.dequantize(again))
    fake = np.asarray(lowprec.fake_quantize_mx(x, fmt, pad=True))
    np.testing.assert_array_equal(deq.view(np.uint32), fake.view(np.uint32))
    assert (mx.tensor_scale is not None) == fmt.scheme.tensor_scale


# -- what a scheme is made of ----------------------------------------------------------------


def test_a_scheme_is_its_meaning_and_one_options_value():
    """The base class requires the three semantic methods and knows no scheme's knob or
    acceleration hook by name; the toy is those methods, element_scale and its Options."""
    assert _scheme.ScaleScheme.__abstractmethods__ == {"check_scale", "encode_blocks",
                                                       "decode_values"}
    base = {n for n in vars(_scheme.ScaleScheme) if not n.startswith("__")}
    for word in ("nvfp4", "step", "hwfloat", "native", "route", "narrow", "factor"):
        assert not [n for n in base if word in n], (word, sorted(base))
    toy = {n for n, v in vars(ToyBinadeScheme).items() if callable(v) and not n.startswith("_")}
    assert toy == {"check_scale", "encode_blocks", "decode_values", "element_scale", "Options"}
    assert TOY.scheme.fast_encoder() is None and TOY.scheme.fast_decoder() is None
    # Each scheme's keywords are its options' fields (the public spellings); hashable values.
    assert TOY.scheme.option_names() == ("headroom",)
    assert lowprec.scale_scheme("e8m0").option_names() == ("scale_rule",)
    assert lowprec.scale_scheme("nvfp4").option_names() == ("nvfp4_step",)
    assert lowprec.mx_format("if4").scheme.option_names() == ()
    casts = {MXCast(TOY), MXCast(TOY, scale_options=ToyOptions(0)),
             MXCast(TOY, scale_options={"headroom": 2})}
    assert len(casts) == 2
    assert MXCast("mxfp8", "rceil") == MXCast("mxfp8", scale_options={"scale_rule": "rceil"})
    assert MXCast("mxfp8", "rceil").scale_options.scale_rule is lowprec.ScaleRule.RCEIL
    assert MXCast("nvfp4", nvfp4_step="reciprocal").nvfp4_step is lowprec.NVFP4Step.RECIPROCAL


@pytest.mark.parametrize("headroom", [0, 2])
@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_toy_option_runs_through_every_entry_point(headroom, mode):
    x = _rows(4)
    want = _toy_values(x, headroom).reshape(x.shape)
    opts = ToyOptions(headroom)
    q = (lambda v, o: lowprec.quantize_mx(v, TOY, scale_options=o))
    fq = (lambda v, o: lowprec.fake_quantize_mx(v, TOY, scale_options=o))
    if mode == "jit":
        q, fq = jax.jit(q, static_argnums=1), jax.jit(fq, static_argnums=1)
    mx = q(jnp.asarray(x), opts)
    assert mx.fmt is TOY and mx.scale_rule is None
    amax = np.max(np.abs(np.where(np.isfinite(x), x, 0.0)), axis=1)
    binade = np.where(amax > 0, np.frexp(np.where(amax > 0, amax, 1.0))[1] - 1 + headroom, -127)
    np.testing.assert_array_equal(np.asarray(mx.scales)[:, 0],
                                  np.where(np.all(np.isfinite(x), axis=1), binade + 127, 0xFF))
    got = np.asarray(lowprec.dequantize(mx), np.float64)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(np.nan_to_num(got), np.nan_to_num(want))
    np.testing.assert_array_equal(np.asarray(fq(jnp.asarray(x), opts), np.float64), got)
    # The dict spelling, through MXArray's checks, and a pre-quantized dot operand (small
    # integers: every product and sum exact, so the float64 dot of the toy values is exact).
    again = lowprec.quantize_mx(jnp.asarray(x), TOY, scale_options={"headroom": headroom})
    np.testing.assert_array_equal(np.asarray(again.scales), np.asarray(mx.scales))
    lowprec.MXArray(mx.elements, mx.scales, TOY, mx.axis, mx.shape)
    a = np.random.default_rng(5).integers(-8, 9, (3, 64)).astype(np.float32)
    w = np.random.default_rng(6).integers(-8, 9, (64, 2)).astype(np.float32)
    pre = lowprec.quantize_mx(jnp.asarray(a), TOY, scale_options=opts)
    dot_want = _toy_values(a, headroom).reshape(a.shape) @ w.astype(np.float64)
    np.testing.assert_array_equal(
        np.asarray(lowprec.matmul(pre, jnp.asarray(w)), np.float64), dot_want)
    # ... and quantized in the dot, the knob given to dot_general as to quantize_mx.
    np.testing.assert_array_equal(np.asarray(lowprec.matmul(
        jnp.asarray(a), jnp.asarray(w), lhs_format=TOY, scale_options=opts), np.float64), dot_want)


def test_scale_options_are_checked_where_they_are_given():
    x = jnp.asarray(_rows(1)[4:5])
    with pytest.raises(ValueError, match="headroom must be an int from 0 to 8, got 9"):
        lowprec.quantize_mx(x, TOY, scale_options={"headroom": 9})
    with pytest.raises(ValueError, match="bogus is no option of any scale scheme.*'toy_binade' "
                                         "options: headroom"):
        lowprec.fake_quantize_mx(x, TOY, scale_options={"bogus": 1})
    with pytest.raises(ValueError, match="headroom applies to TOY_BINADE scales, not to "
                                         "mxfp8_e4m3.*'e8m0' options: scale_rule"):
        lowprec.quantize_mx(x, "mxfp8", scale_options={"headroom": 1})
    with pytest.raises(ValueError, match="headroom applies to TOY_BINADE.*'if4' scales take no"):
        lowprec.quantize_mx(x[:, :16], "if4", scale_options={"headroom": 1})
    with pytest.raises(TypeError, match="scale_options must be a NVFP4Options.*ToyOptions"):
        lowprec.quantize_mx(x, "nvfp4", scale_options=ToyOptions(1))
    with pytest.raises(ValueError, match="unknown scale_rule 'nope'"):
        lowprec.quantize_mx(x, "mxfp8", scale_options={"scale_rule": "nope"})
    # The keyword spelling and the options value set the same field; the keyword wins.
    assert MXCast("mxfp4", "rceil", scale_options={"scale_rule": "floor"}).scale_rule == "rceil"


def test_the_dispatch_asks_the_scheme_for_its_fast_formulations():
    """kernels/_dispatch offers HWFLOAT only where the scheme returns a fast encoder or
    decoder: the toy (none) is computed exactly everywhere; E8M0 and NVFP4 have both."""
    from lowprec.kernels import _dispatch

    F = _dispatch.Formulation
    x = jnp.zeros((2, 64), jnp.float32)
    assert _dispatch.quantize_formulations(x, MXCast(TOY), 1) == {F.EXACT}
    assert _dispatch.decode_formulations(TOY) == {F.EXACT}
    assert _dispatch.hwfloat_encoder(MXCast(TOY)) is None
    for name in ("mxfp8", "mxfp4", "nvfp4"):
        fmt = lowprec.mx_format(name)
        assert F.HWFLOAT in _dispatch.quantize_formulations(x, MXCast(fmt), 1), name
        assert F.HWFLOAT in _dispatch.decode_formulations(fmt), name
    # Stochastic rounding has no hardware-float encode; a scheme that rounds its own elements
    # (IF4) has no fast path at all.
    assert F.HWFLOAT not in _dispatch.quantize_formulations(
        x, MXCast("mxfp8", rounding="stochastic"), 1)
    assert _dispatch.decode_formulations(lowprec.mx_format("if4")) == {F.EXACT}
