"""Scale schemes: a block format holds one, refuses any other combination, and the block
encoder, decoder, option objects and MXArray ask it (never a flag).

A toy scheme registered here — a block's scale is 2^floor(log2 amax), the block maximum's
own binade, stored as an E8M0 code — must be served by quantize_mx, dequantize,
fake_quantize_mx, shared_exponents' refusal, MXArray and dot_general without any other file
knowing of it. Its expected values are derived in the test: x / 2^e rounded to E4M3 with
saturation by ``lowprec.quantize`` (the element codec, tested on its own against ml_dtypes),
times 2^e, in float64.
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
from lowprec._bits import E8M0_BIAS, E8M0_NAN, F32_INF, floor_log2_bits, scale_bits_by_e8m0

E4M3 = lowprec.element_format("e4m3")
E8M0 = lowprec.element_format("e8m0")


@_scheme.register("toy_binade")
class ToyBinadeScheme(_scheme.ScaleScheme):
    """E8M0 codes of 2^floor(log2 amax): elements land in [1, 2) of their grid at the block
    maximum (a deliberately poor scale for E4M3, which then uses only its two lowest binades
    above 1; what matters here is that it is not what any real scheme computes)."""

    recipe = "the toy rule (the block maximum's binade)"

    def check_scale(self):
        if self.scale != E8M0:
            raise ValueError("the toy scheme stores E8M0 codes")

    def encode_blocks(self, xb, amax, ts_bits, cast, inner):
        special = amax >= F32_INF
        e = jnp.clip(floor_log2_bits(amax), -127, 127)
        codes = jnp.where(special, E8M0_NAN, e + E8M0_BIAS)
        return codes, special, xb, jnp.expand_dims(codes - E8M0_BIAS, inner)

    def decode_values(self, value_bits, scale_codes, tensor_scale):
        return scale_bits_by_e8m0(value_bits, scale_codes)


TOY = lowprec.MXFormat("toy_fp8", E4M3, 32, ToyBinadeScheme(E8M0))


def _toy_values(x: np.ndarray) -> np.ndarray:
    """float64 values of TOY-quantized rows of 32 (the derivation in the module docstring)."""
    x = np.asarray(x, np.float32).reshape(-1, 32)
    out = np.empty(x.shape, np.float64)
    for i, row in enumerate(x):
        if not np.all(np.isfinite(row)):
            out[i] = np.nan
            continue
        amax = float(np.max(np.abs(row)))
        e = int(np.clip(np.frexp(amax)[1] - 1, -127, 127)) if amax > 0 else -127
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
    with pytest.raises(ValueError, match="nvfp4_step applies to NVFP4"):
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


@pytest.mark.parametrize("name", _scheme.registered_names())
@pytest.mark.quick_first(1)
def test_every_registered_scheme_serves_the_block_functions(name):
    """quantize_mx / dequantize / fake_quantize_mx agree, and MXArray validates the codes,
    for every registered scheme (data formats, and the toy one)."""
    fmt = next((lowprec.mx_format(n) for n in lowprec_formats.MX_FORMATS
                if lowprec_formats.MX_FORMATS[n]["scheme"] == name), TOY)
    assert fmt.scheme.name == name
    x = jnp.asarray(_rows(2)).reshape(-1)[:192].reshape(2, 96)
    mx = lowprec.quantize_mx(x, fmt, pad=True)
    again = lowprec.MXArray(mx.elements, mx.scales, fmt, mx.axis, mx.shape, mx.scale_rule,
                            mx.tensor_scale)
    deq = np.asarray(lowprec.dequantize(again))
    fake = np.asarray(lowprec.fake_quantize_mx(x, fmt, pad=True))
    np.testing.assert_array_equal(deq.view(np.uint32), fake.view(np.uint32))
    assert (mx.tensor_scale is not None) == fmt.scheme.tensor_scale
