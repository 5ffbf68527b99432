"""The native CPU kernel for FP6 packing (lowprec/kernels/_fp6_cpu.cc, an XLA FFI target).

Expected bytes and codes come from the layout's rule, written here with NumPy integers (code
j of a group in bits 6j..6j+5 of the little-endian 24-bit word its three bytes form;
docs/design.md §4), and from XLA's formulation of the same packing (``lowprec.kernels``
policy ``"xla"``), which the rest of the suite checks against the reference.
"""

from __future__ import annotations

import os
import platform
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lowprec
import lowprec.kernels
from lowprec.kernels import _cpu_native, _fp6_cpu

needs_native = pytest.mark.skipif(not _cpu_native.available(), reason=_cpu_native.status())

FP6 = ("mxfp6_e2m3", "mxfp6_e3m2")


def want_packed(codes: np.ndarray) -> np.ndarray:
    """Bytes of uint8 ``codes`` (any values: only the low 6 bits count) by the layout's rule."""
    c = codes.astype(np.uint32).reshape(*codes.shape[:-1], -1, 4) & 0x3F
    word = c[..., 0] | c[..., 1] << 6 | c[..., 2] << 12 | c[..., 3] << 18
    out = np.stack([(word >> s) & 0xFF for s in (0, 8, 16)], axis=-1).astype(np.uint8)
    return out.reshape(*codes.shape[:-1], -1)


def want_unpacked(packed: np.ndarray) -> np.ndarray:
    b = packed.astype(np.uint32).reshape(*packed.shape[:-1], -1, 3)
    word = b[..., 0] | b[..., 1] << 8 | b[..., 2] << 16
    out = np.stack([(word >> (6 * j)) & 0x3F for j in range(4)], axis=-1).astype(np.uint8)
    return out.reshape(*packed.shape[:-1], -1)


@pytest.fixture
def policy():
    """Sets the kernel policy for one test and restores the previous one after it."""
    previous = lowprec.kernels.current_policy()
    with lowprec.kernels.policy():
        yield lowprec.kernels.set_policy
    assert lowprec.kernels.current_policy() == previous


def _compiled_text(f, *args) -> str:
    return jax.jit(f).lower(*args).compile().as_text()


def test_built_where_a_compiler_is():
    """setup.py builds the kernel as an optional extension: on Linux with a C++ compiler
    (CI's machines) it must have been built, loaded and checked, or the suite would pass on
    XLA's formulation without anyone noticing."""
    compiler = shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")
    if platform.system() != "Linux" or compiler is None:
        pytest.skip("the kernel is optional here (not Linux, or no C++ compiler on PATH)")
    assert _cpu_native.available(), (
        f"{_cpu_native.status()}; a compiler is at {compiler}: reinstall (pip install -e .) and "
        "read the build's warnings")
    status = lowprec.kernels.native_status()
    assert "kernels serve " in status and "FP6 packing" in status, status


@needs_native
@pytest.mark.parametrize("groups", [0, 1, 2, 7, 8, 9, 10, 11, 17, 18, 19, 41,
                                    (1 << 16) - 1, 1 << 16, 3 * (1 << 16) + 13])
@pytest.mark.parametrize("mode", ["eager", "jit"])
@pytest.mark.quick_first(10)
def test_any_length(groups, mode):
    # The AVX2 loops take 8 groups per step while 10 remain and leave the rest to the scalar
    # loop; above 2^16 groups the work is split in chunks over XLA's threads. Every byte value
    # in the input: packing must drop the codes' top two bits.
    rng = np.random.default_rng(groups)
    codes = rng.integers(0, 256, 4 * groups, dtype=np.uint8)
    packed_in = rng.integers(0, 256, 3 * groups, dtype=np.uint8)
    pack, unpack = _fp6_cpu.pack_last, _fp6_cpu.unpack_last
    if mode == "jit":
        pack, unpack = jax.jit(pack), jax.jit(unpack)
    np.testing.assert_array_equal(np.asarray(pack(jnp.asarray(codes))), want_packed(codes))
    np.testing.assert_array_equal(np.asarray(unpack(jnp.asarray(packed_in))),
                                  want_unpacked(packed_in))


@needs_native
def test_every_byte_value_in_every_position():
    # Group i holds byte value i % 256 at position i // 256 (codes) or i // 256 (bytes), the
    # other positions random.
    rng = np.random.default_rng(7)
    codes = rng.integers(0, 256, (1024, 4), dtype=np.uint8)
    codes[np.arange(1024), np.arange(1024) // 256] = np.arange(1024) % 256
    np.testing.assert_array_equal(np.asarray(_fp6_cpu.pack_last(jnp.asarray(codes.ravel()))),
                                  want_packed(codes.ravel()))
    packed = rng.integers(0, 256, (768, 3), dtype=np.uint8)
    packed[np.arange(768), np.arange(768) // 256] = np.arange(768) % 256
    np.testing.assert_array_equal(np.asarray(_fp6_cpu.unpack_last(jnp.asarray(packed.ravel()))),
                                  want_unpacked(packed.ravel()))


@needs_native
@pytest.mark.parametrize("shape", [(4, 12), (3, 2, 64), (1, 4096)])
def test_public_packers_take_the_kernel_under_vmap_and_jit(shape, policy):
    codes = np.random.default_rng(3).integers(0, 64, shape, dtype=np.uint8)
    x = jnp.asarray(codes)
    assert 'custom_call_target="lowprec_fp6_pack"' in _compiled_text(lowprec.pack_fp6, x)
    packed = jax.vmap(lowprec.pack_fp6)(x)  # leading dims and a batched dim: one run of groups
    np.testing.assert_array_equal(np.asarray(packed), want_packed(codes))
    text = _compiled_text(lowprec.unpack_fp6, packed)
    assert 'custom_call_target="lowprec_fp6_unpack"' in text
    np.testing.assert_array_equal(np.asarray(jax.vmap(lowprec.unpack_fp6)(packed)), codes)
    policy("xla")
    assert "lowprec_fp6" not in _compiled_text(lowprec.pack_fp6, x)
    np.testing.assert_array_equal(np.asarray(jax.jit(lowprec.pack_fp6)(x)), want_packed(codes))


def _bits(a):
    """The bit patterns of a float array, as unsigned integers of its width (traceable)."""
    a = jnp.asarray(a)
    return jax.lax.bitcast_convert_type(a, jnp.dtype(f"uint{8 * a.dtype.itemsize}"))


@needs_native
@pytest.mark.parametrize("name", FP6)
@pytest.mark.parametrize("scale_rule", ["floor", "rceil"])
@pytest.mark.parametrize("shape, axis", [((16, 96), -1), ((3, 5, 70), -1), ((64, 8), 0)])
@pytest.mark.quick_first(1)
def test_mx_calls_give_xla_bits(name, scale_rule, shape, axis, policy):
    """quantize_mx (float32 and bfloat16 input) / dequantize (to float32, bfloat16) of FP6
    formats: the same bits with the kernels (policy "auto") and without them ("xla"), under
    jit and eagerly; the kernels are in the compiled program exactly where blocks run along
    the last axis: float32 input takes the one-pass quantizer (packing inside it), bfloat16
    input XLA's encode and the packing kernel, dequantize the unpacking kernel. Inputs span
    2^-140..2^20 with zeros, NaN and infinities, so blocks take the exact paths as well as
    the fast ones. All four calls share one program per policy (its custom calls counted)."""
    rng = np.random.default_rng(11)
    x = (rng.standard_normal(shape) * np.exp2(rng.integers(-140, 20, shape))).astype(np.float32)
    x.ravel()[:: 37] = 0.0
    x.ravel()[5] = np.nan
    x.ravel()[-3] = -np.inf
    x = jnp.asarray(x)

    def quantize(v):
        return lowprec.quantize_mx(v, name, axis=axis, scale_rule=scale_rule, pad=True)

    def calls(v):
        m, mb = quantize(v), quantize(v.astype(jnp.bfloat16))
        return (m.elements, m.scales, _bits(lowprec.dequantize(m)),
                _bits(lowprec.dequantize(m, dtype=jnp.bfloat16)), mb.elements, mb.scales)

    parts = ("f32 elements", "f32 scales", "dequantize f32", "dequantize bf16",
             "bf16 elements", "bf16 scales", "eager dequantize(quantize)")
    results = {}
    for chosen in ("auto", "xla"):
        policy(chosen)
        compiled = jax.jit(calls).lower(x).compile()
        text = compiled.as_text()
        kernel = chosen == "auto" and axis == -1
        counts = {t: text.count(f'custom_call_target="{t}"')
                  for t in ("lowprec_mx_quantize", "lowprec_fp6_pack", "lowprec_fp6_unpack")}
        # one quantizer (the float32 call's: bfloat16 input is not its), the packer (the
        # bfloat16 call's, in each of its branches), the unpacker (the dequantizes')
        assert (counts["lowprec_mx_quantize"], counts["lowprec_fp6_pack"] > 0,
                counts["lowprec_fp6_unpack"] > 0) == ((1, True, True) if kernel else (0, False, False)), (
            chosen, axis, counts)
        results[chosen] = [np.asarray(a) for a in compiled(x)]
        results[chosen].append(np.asarray(_bits(lowprec.dequantize(quantize(x)))))  # eagerly
    for part, got, want in zip(parts, results["auto"], results["xla"]):
        np.testing.assert_array_equal(got, want, err_msg=f"{name} {scale_rule} {shape} axis "
                                                         f"{axis}: {part}")


def test_missing_library_keeps_xla(monkeypatch, policy):
    """Without the built library the probe says so, and calls keep XLA's formulation."""
    usable, why, _ = _cpu_native._probe(_cpu_native.LIBRARY.with_name("no_such_library.so"))
    assert not usable and "not built" in why
    monkeypatch.setattr(_cpu_native, "available", lambda: False)
    policy("xla")
    policy("auto")  # a policy change clears JAX's caches: traced again without the kernel
    codes = np.random.default_rng(5).integers(0, 64, (8, 32), dtype=np.uint8)
    assert "lowprec_fp6" not in _compiled_text(lowprec.pack_fp6, jnp.asarray(codes))
    np.testing.assert_array_equal(np.asarray(lowprec.pack_fp6(jnp.asarray(codes))),
                                  want_packed(codes))


@needs_native
def test_explicit_mesh_keeps_xla():
    """Under a mesh with Explicit axes the kernel (a single-device custom call) steps aside."""
    mesh = jax.make_mesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,))
    codes = jnp.asarray(np.random.default_rng(2).integers(0, 64, (4, 64), dtype=np.uint8))
    with jax.set_mesh(mesh):
        text = _compiled_text(lowprec.pack_fp6, codes)
        packed = jax.jit(lowprec.pack_fp6)(codes)
    assert "lowprec_fp6" not in text
    np.testing.assert_array_equal(np.asarray(packed), want_packed(np.asarray(codes)))
