"""Loading the native CPU kernels (lowprec/kernels/_cpu_native.py, liblowprec_cpu): a plain
shared library with no CPython API, refused with a clear message and XLA's formulation when
its XLA FFI API version is not the running jaxlib's, and handlers that turn a C++ exception
into an error instead of letting it cross into XLA.

What a version mismatch does without the check was measured with a library built against
headers claiming FFI API 0.4 under jaxlib 0.10.2 (FFI API 0.3): ``register_ffi_target``
accepts it before the CPU backend starts, and the backend then fails to start ("Unable to
initialize backend 'cpu': ... the handler's API version (0.4) is incompatible with the
framework's API version (0.3)"), so every JAX call fails. These tests feed the loader the
running version as a parameter instead of building such a library.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import struct
import subprocess
import sys
import sysconfig
from pathlib import Path

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
import pytest

import lowprec
import lowprec.kernels
from lowprec.kernels import _cpu_native

built = pytest.mark.skipif(not _cpu_native.LIBRARY.is_file(), reason=_cpu_native.status())
needs_native = pytest.mark.skipif(not _cpu_native.available(), reason=_cpu_native.status())


def _elf_dynamic_names(path: Path) -> list[str]:
    """The names in an ELF64 little-endian shared library's dynamic string table (.dynstr:
    every symbol it exports or imports and every library it needs), read from the section
    headers as the ELF specification lays them out."""
    data = path.read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        pytest.skip(f"{path.name} is not a little-endian ELF64 file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)

    def section(i):  # (name offset, type, file offset, size)
        name, kind, _, _, offset, size = struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize)
        return name, kind, offset, size

    _, _, names_at, _ = section(shstrndx)
    for i in range(shnum):
        name, kind, offset, size = section(i)
        if kind == 3 and data[names_at + name:].split(b"\0", 1)[0] == b".dynstr":  # STRTAB
            return [n.decode() for n in data[offset:offset + size].split(b"\0") if n]
    raise AssertionError(f"{path} has no .dynstr section")


@built
def test_library_is_independent_of_cpython():
    """One build serves every CPython: no interpreter tag in the file name, no module init
    function, no reference to the CPython API or to libpython."""
    path = _cpu_native.LIBRARY
    assert sysconfig.get_config_var("EXT_SUFFIX") not in path.name
    names = _elf_dynamic_names(path)
    assert {"LowprecFp6Pack", "LowprecFp6Unpack", "LowprecMxQuantize",
            "lowprec_ffi_api_version"} <= set(names)
    python = [n for n in names if n.startswith(("Py", "_Py")) or "libpython" in n]
    assert not python, f"{path.name} uses the CPython API: {python[:5]}"


@built
def test_library_records_its_ffi_version():
    """The library says which FFI API version (and jaxlib) it was compiled against; in this
    environment it was built here, so both are the running ones."""
    library = ctypes.CDLL(str(_cpu_native.LIBRARY))
    version, jaxlib_version = _cpu_native.built_ffi_api_version(library)
    assert version == _cpu_native.running_ffi_api_version()
    assert jaxlib_version, "the build recorded no jaxlib version"
    if _cpu_native.available():
        assert f"XLA FFI API {version[0]}.{version[1]}" in lowprec.kernels.native_status()


def test_running_ffi_version_is_read_from_jaxlib_headers(monkeypatch, tmp_path):
    api = tmp_path / "xla" / "ffi" / "api"
    api.mkdir(parents=True)
    monkeypatch.setattr(jax.ffi, "include_dir", lambda: str(tmp_path))
    assert _cpu_native.running_ffi_api_version() is None  # no header
    (api / "c_api.h").write_text("#define XLA_FFI_API_MAJOR 2\n")
    assert _cpu_native.running_ffi_api_version() is None  # no minor version
    (api / "c_api.h").write_text("// v\n#define XLA_FFI_API_MAJOR 2\n#  define XLA_FFI_API_MINOR 17\n")
    assert _cpu_native.running_ffi_api_version() == (2, 17)


@built
@pytest.mark.parametrize("change", ["minor+1", "minor-1", "major+1"])
def test_other_ffi_version_is_refused(change):
    """A library built for another FFI API version is refused before anything is registered,
    with both versions and the fix named."""
    library = ctypes.CDLL(str(_cpu_native.LIBRARY))
    (major, minor), _ = _cpu_native.built_ffi_api_version(library)
    running = {"minor+1": (major, minor + 1), "minor-1": (major, minor - 1),
               "major+1": (major + 1, minor)}[change]
    registered = len(_cpu_native._loaded)
    usable, why, avx2 = _cpu_native._probe(_cpu_native.LIBRARY, running=running)
    assert not usable and not avx2
    assert f"built against XLA FFI API {major}.{minor} " in why
    assert f"jaxlib {jaxlib.__version__} has FFI API {running[0]}.{running[1]}" in why
    assert "reinstall lowprec" in why and "XLA's formulations run" in why
    assert len(_cpu_native._loaded) == registered  # nothing was handed to XLA


@built
def test_unknown_running_version_is_refused(monkeypatch):
    monkeypatch.setattr(_cpu_native, "running_ffi_api_version", lambda: None)
    usable, why, _ = _cpu_native._probe(_cpu_native.LIBRARY)
    assert not usable
    assert "does not say its XLA FFI API version" in why and "formulations run" in why


def test_files_that_are_not_the_library_are_refused(tmp_path):
    junk = tmp_path / "liblowprec_cpu.so"
    junk.write_bytes(b"not a shared library")
    usable, why, _ = _cpu_native._probe(junk)
    assert not usable and "did not load" in why and "reinstall lowprec" in why
    libc = ctypes.util.find_library("c")  # a real library without lowprec's symbols
    if libc is None or not Path(libc).is_absolute():
        libc = next((p for p in ("/lib/x86_64-linux-gnu/libc.so.6", "/usr/lib/libc.so.6")
                     if Path(p).is_file()), None)
    if libc is not None:
        usable, why, _ = _cpu_native._probe(Path(libc))
        assert not usable and "lowprec_ffi_api_version" in why and "did not load" in why
    usable, why, _ = _cpu_native._probe(tmp_path / "missing.so")
    assert not usable and "not built" in why


@built
def test_refused_library_leaves_xla(monkeypatch):
    """With the library refused (another FFI version), native_status says why and
    quantize_mx compiles to XLA's formulation, with the same codes."""
    library = ctypes.CDLL(str(_cpu_native.LIBRARY))
    (major, minor), _ = _cpu_native.built_ffi_api_version(library)
    refused = _cpu_native._probe(_cpu_native.LIBRARY, running=(major, minor + 1))
    x = jnp.asarray(np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32))
    want = lowprec.quantize_mx(x, "mxfp8_e4m3")
    previous = lowprec.kernels.set_policy("xla")
    monkeypatch.setattr(_cpu_native, "_load", lambda: refused)
    try:
        lowprec.kernels.set_policy("auto")  # a policy change: JAX's caches are cleared
        assert lowprec.kernels.native_status() == refused[1]
        f = jax.jit(lambda v: lowprec.quantize_mx(v, "mxfp8_e4m3"))
        assert "lowprec_mx_quantize" not in f.lower(x).compile().as_text()
        got = f(x)
    finally:
        lowprec.kernels.set_policy("xla")
        monkeypatch.undo()
        lowprec.kernels.set_policy(previous)
    np.testing.assert_array_equal(np.asarray(got.elements), np.asarray(want.elements))
    np.testing.assert_array_equal(np.asarray(got.scales), np.asarray(want.scales))


@needs_native
def test_exception_in_a_handler_is_an_error():
    """A C++ exception thrown inside a handler comes back as an error naming the target
    (through the guard every handler goes through), and the process goes on."""
    library = ctypes.CDLL(str(_cpu_native.LIBRARY))
    jax.ffi.register_ffi_target("lowprec_guard_check",
                                jax.ffi.pycapsule(library.LowprecGuardCheck), platform="cpu")

    def call(kind):
        out = jax.ShapeDtypeStruct((1,), jnp.uint8)
        return np.asarray(jax.ffi.ffi_call("lowprec_guard_check", out)(kind=np.int64(kind)))

    assert call(0).tolist() == [1]
    with pytest.raises(jax.errors.JaxRuntimeError,
                       match="lowprec_guard_check: C.. exception in the native kernel: "
                             "thrown on request"):
        call(1)
    with pytest.raises(jax.errors.JaxRuntimeError,
                       match="lowprec_guard_check: unknown C.. exception"):
        call(2)
    assert call(0).tolist() == [1]


def _kernel_sources() -> list:
    kernels = _cpu_native.LIBRARY.parent
    return sorted([*kernels.glob("*.cc"), *kernels.glob("*.h")])


@built
def test_library_is_newer_than_its_sources():
    # setup.py builds the library with optional=True, so a C++ error during
    # `pip install -e .` leaves the previous library in place and the install still succeeds:
    # the tests would then check an old kernel against new Python code.
    built_at = _cpu_native.LIBRARY.stat().st_mtime
    sources = _kernel_sources()
    assert sources, "no kernel sources found next to the library"
    stale = [p.name for p in sources if p.stat().st_mtime > built_at]
    assert not stale, (
        f"{_cpu_native.LIBRARY.name} is older than {stale}: rebuild it with "
        "`pip install --no-deps --no-build-isolation -e .` and read the compiler's errors "
        "(a failed optional build keeps the old library)")


@needs_native
def test_a_kernel_module_used_first_still_leaves_every_kernel_usable():
    # Since `import lowprec` became lazy, the checkpoint code can import one kernel module and
    # load the library before _dispatch has imported the others; the kernel declared later
    # must then register on arrival (it raised "declared after the native library was loaded").
    code = """
import jax, numpy as np
from lowprec.kernels import _cpu_native, _mx_quantize_cpu
assert _cpu_native.available()                 # loads with the MX kernel alone declared
import lowprec.kernels._dispatch               # declares FP6 and NVFP4 after the load
from lowprec.kernels import _fp6_cpu
assert _cpu_native.available(), _cpu_native.status()
for serves in ("FP6 packing", "NVFP4 quantization", "MX quantization"):
    assert serves in _cpu_native.status(), _cpu_native.status()
print(np.asarray(jax.jit(_fp6_cpu.pack_last)(np.arange(64, dtype=np.uint8))).tobytes().hex())
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    # Expected bytes: four 6-bit codes per three bytes, the first code in the low bits (the
    # layout of _pack), for the codes 0..63.
    bits = sum(c << (6 * i) for i, c in enumerate(range(64)))
    assert out.stdout.strip() == bits.to_bytes(48, "little").hex()


@needs_native
def test_a_late_kernel_that_fails_its_check_turns_the_kernels_off():
    code = """
from lowprec.kernels import _cpu_native
assert _cpu_native.available()
_cpu_native.register_kernel("toy kernel", {}, lambda: "toy results differ")
assert not _cpu_native.available() and not _cpu_native.vector_quantizer()
print(_cpu_native.status())
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "failed their check: toy kernel: toy results differ" in out.stdout
