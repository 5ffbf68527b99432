"""The checkpoint command line's native path imports no JAX (issue 34: the import was 1.1-1.5
CPU s, 15-20% of a bfloat16 checkpoint command), and what it computes in NumPy instead is
the library's, bit for bit.

Where the native passes serve, ``lowprec quantize`` / ``dequantize`` / ``inspect`` /
``convert`` of MX formats read their code and scale tables from ml_dtypes, NVFP4's tensor
scale and block factors from IEEE float32 NumPy arithmetic, and a format's scale options
from its scheme; each is compared here with the library's JAX code (``lowprec.decode``, the
scheme's ``element_scale`` and ``tensor_scale_bits``, ``MXCast``), which the rest of the
suite checks against the independent reference. The subprocess tests run the real command
and list the JAX modules it imported; their outputs are compared with the library's JAX
programs' (the kernel policy ``"xla"``). Cost: a few seconds on an idle machine (short
subprocesses, most without JAX, and the XLA path's compilations for the comparison).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

import lowprec
from lowprec._options import MXCast
from lowprec.checkpoint import _chunk, dequantize_checkpoint, quantize_checkpoint
from lowprec.checkpoint._formats import MX_FORMATS
from lowprec.checkpoint._layout import make_spec
from lowprec.kernels import _ckpt_cpu

_BITS = {4: np.uint32, 8: np.uint64}


def _same_bits(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(
        a.view(_BITS[a.dtype.itemsize]), b.view(_BITS[b.dtype.itemsize]))


_SMALL_ELEMENTS = sorted({lowprec.mx_format(f).element.name for f in MX_FORMATS}
                         | {lowprec.mx_format(f).scale.name for f in MX_FORMATS}
                         | {"e4m3", "e5m2", "e4m3fnuz", "e5m2fnuz", "e3m2", "e2m3", "e8m0"})


@pytest.mark.parametrize("name", _SMALL_ELEMENTS)
def test_host_code_tables_are_the_library_decode(name):
    elem = lowprec.element_format(name)
    host = _chunk._host_values(elem)
    if elem.storage_dtype is None or elem.storage_dtype.kind != "V":
        assert host is None  # MX INT8's element: the library's decode serves it
        return
    codes = np.arange(1 << elem.code_bits, dtype=np.uint8)
    want = np.asarray(lowprec.decode(codes, elem), np.float32)
    assert _same_bits(host, want), name  # NaN codes and their signs included
    assert _same_bits(_chunk.element_table(elem), want)


@pytest.mark.parametrize("fmt_name", MX_FORMATS)
def test_host_factor_tables_are_the_library_scales(fmt_name):
    fmt = lowprec.mx_format(fmt_name)
    lo, hi = _ckpt_cpu.NVFP4_TENSOR_SCALES
    # The ends of the range NumPy serves, powers of two, and ragged float32 values
    tss = [None] if not fmt.tensor_scale else [
        np.float32(lo), np.float32(hi), np.float32(1), np.float32(2.0**-50),
        np.nextafter(np.float32(lo), np.float32(1)), np.nextafter(np.float32(hi), np.float32(0)),
        *np.exp2(np.random.default_rng(0).uniform(-40, 40, 6)).astype(np.float32),
        np.float32(1 / 2688), np.float32(0.0016719187)]
    for ts in tss:
        host = _chunk._host_element_scales(fmt, ts)
        assert host is not None, (fmt_name, ts)
        want = np.asarray(_chunk._element_scales(fmt, ts))
        if fmt.tensor_scale:
            assert _same_bits(host, want.astype(np.float32)), (fmt_name, ts)
        else:
            assert host.dtype == np.int32 and np.array_equal(host, want), fmt_name
    if fmt.tensor_scale:  # outside the range: the library's program
        assert _chunk._host_element_scales(fmt, np.float32(lo / 2)) is None
        assert _chunk._host_element_scales(fmt, np.float32(hi * 2)) is None


def test_host_nvfp4_tensor_scale_is_the_library_one():
    spec = make_spec("nvfp4", (16,), "F32")
    rng = np.random.default_rng(1)
    # Every binade of float32 (subnormals, where the quotient and the 2^-143 floor matter,
    # and the top, where it is largest), a random mantissa in each, their ends, and zero.
    exps = np.arange(-149, 128)
    amax = np.concatenate([np.ldexp(rng.uniform(1, 2, exps.size), exps),
                           np.ldexp(1.0, exps), [0.0, float(np.finfo(np.float32).max),
                                                 2688 * 2.0**-143, 2688 * 2.0**-144]])
    amax = amax.astype(np.float32)
    amax = amax[np.isfinite(amax)]
    cast = MXCast(spec.format)
    for a in amax:
        host = _chunk._host_tensor_scale(a, spec)
        bits = _chunk._tensor_scale_bits(np.array([a.view(np.uint32)], np.uint32), cast)
        want = np.uint32(np.asarray(bits).reshape(())).view(np.float32)
        assert host.dtype == np.float32 and host.view(np.uint32) == want.view(np.uint32), a
    assert _chunk._host_tensor_scale(1.0, make_spec("mxfp4", (32,), "F32")) is None


@pytest.mark.parametrize("rule", [None, *lowprec.ScaleRule])
@pytest.mark.parametrize("fmt_name", MX_FORMATS)
def test_scale_options_are_mxcast_ones(fmt_name, rule):
    fmt = lowprec.mx_format(fmt_name)
    try:
        want = MXCast(fmt, scale_rule=rule).scale_options
    except (ValueError, TypeError) as error:  # a rule the format refuses: refused here too
        with pytest.raises(type(error)):
            _chunk.scale_options(fmt, rule)
        return
    assert _chunk.scale_options(fmt, rule) == want


# -- the command line, in a subprocess ----------------------------------------------------
# One Python start-up per test (each costs ~1 CPU s): the commands run one after the other in
# the same process, and the JAX modules listed are those imported by all of them (modules are
# only ever added, so an empty list means no command imported JAX).
_RUN = ("import json, sys\n"
        "from lowprec.cli import main\n"
        "for cmd in json.loads(sys.argv[1]):\n"
        "    rc = main(cmd)\n"
        "    if rc:\n"
        "        sys.exit(f'{cmd[0]}: exit status {rc}')\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib')))\n")


def _lowprec(*commands, policy=None):
    """The JAX modules imported by running ``commands`` (argument lists) in one process."""
    env = {k: v for k, v in os.environ.items() if k != "LOWPREC_KERNELS"}
    if policy is not None:
        env["LOWPREC_KERNELS"] = policy
    arg = json.dumps([[str(a) for a in cmd] for cmd in commands])
    r = subprocess.run([sys.executable, "-c", _RUN, arg], capture_output=True,
                       text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1].replace("'", '"'))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A checkpoint as users have: bfloat16 and float32 matrices and a kept norm."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(2)
    path = tmp_path_factory.mktemp("nojax") / "model.safetensors"
    x = rng.standard_normal((64, 256)).astype(np.float32)
    x[3, :32] *= 2.0**60  # a saturating block
    save_file({"layers.0.q_proj.weight": x.astype(ml_dtypes.bfloat16),
               "layers.0.o_proj.weight": rng.standard_normal((128, 64)).astype(np.float32),
               "layers.0.norm.weight": np.ones(64, np.float32)}, str(path))
    return path


@pytest.mark.skipif(not _ckpt_cpu.available(), reason=_ckpt_cpu.status())
# MXFP8 takes the fused MX pass as MXFP4 does: slow tier only; NVFP4's native pass runs in
# the quick tier in test_checkpoint_native.py, its JAX-free import here in the default run
@pytest.mark.parametrize("fmt", ["mxfp4", pytest.param("nvfp4", marks=pytest.mark.slow),
                                 pytest.param("mxfp8_e4m3", marks=pytest.mark.slow)])
def test_the_native_commands_import_no_jax(model, fmt, tmp_path):
    q, d = tmp_path / "q.safetensors", tmp_path / "d.safetensors"
    assert _lowprec(["quantize", model, q, "-f", fmt, "-q", "--report", tmp_path / "r.json"],
                    ["dequantize", q, d, "-q"], ["inspect", q]) == []
    # The same files as the library's JAX programs write (the native passes off)
    with lowprec.kernels.policy("xla"):
        quantize_checkpoint(model, tmp_path / "q-xla.safetensors", fmt, progress=False,
                            report=tmp_path / "r-xla.json")
        dequantize_checkpoint(tmp_path / "q-xla.safetensors", tmp_path / "d-xla.safetensors",
                              progress=False)
    assert q.read_bytes() == (tmp_path / "q-xla.safetensors").read_bytes()
    assert d.read_bytes() == (tmp_path / "d-xla.safetensors").read_bytes()
    # The error report, computed on the native path, is the library's (its float64 sums in
    # another order: the last bits of an SQNR may differ)
    report = json.loads((tmp_path / "r.json").read_text())["tensors"]
    want = json.loads((tmp_path / "r-xla.json").read_text())["tensors"]
    assert len(report) == 3
    for got, ref in zip(report, want):
        assert got == {k: pytest.approx(v, rel=1e-12) if isinstance(v, float) else v
                       for k, v in ref.items()}


def test_the_environment_policy_is_read_without_jax(model, tmp_path):
    # The passes read LOWPREC_KERNELS themselves until _dispatch (JAX) is imported: "xla"
    # turns them off there too, and the command then runs the library's programs.
    assert _ckpt_cpu._ENV_VAR == lowprec.kernels.ENV_VAR
    q = tmp_path / "q.safetensors"
    assert "jax" in _lowprec(["quantize", model, q, "-f", "mxfp4", "-q"], policy="xla")


@pytest.mark.skipif(not _ckpt_cpu.available(), reason=_ckpt_cpu.status())
def test_convert_imports_no_jax(model, tmp_path):
    q, ct = tmp_path / "q.safetensors", tmp_path / "ct.safetensors"
    quantize_checkpoint(model, q, "mxfp4", progress=False)  # the input; its imports are not checked
    assert _lowprec(["convert", q, ct, "--layout", "compressed-tensors", "-q"], ["inspect", ct]) == []


def test_import_lowprec_imports_no_jax():
    # One process (a start-up each costs ~1 CPU s): the plain import pulls in no JAX, and a
    # public name's first use does. Then, as before the lazy init (when `import lowprec`
    # imported lowprec.kernels along the way), `lowprec.kernels` works without its own import.
    code = ("import sys, lowprec\n"
            "assert not [m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib')]\n"
            "assert set(lowprec.__all__) <= set(dir(lowprec))\n"
            "lowprec.quantize\n"
            "assert 'jax' in sys.modules\n"
            "assert 'lowprec.kernels' not in sys.modules  # not imported by the lines above\n"
            "assert lowprec.kernels.current_policy().kernels in lowprec.kernels.POLICIES\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


def test_every_public_name_is_lazy_or_defined():
    # the lazy table and __all__ name the same objects (plus the constants defined eagerly)
    assert set(lowprec._PUBLIC) | {"BLOCK_SIZES"} == set(lowprec.__all__)
    for name in lowprec.__all__:
        assert getattr(lowprec, name) is not None, name
