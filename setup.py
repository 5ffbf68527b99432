"""Builds lowprec's one optional native part: its CPU kernels (``lowprec/kernels/*.cc``:
FP6 packing, one-pass MX quantization, and the checkpoint pipeline's passes over host
memory), XLA FFI handlers and plain C functions compiled against the FFI headers that jaxlib
ships, in one plain shared library. Everything else is in pyproject.toml.

The library uses no CPython API: ``lowprec/kernels/_cpu_native.py`` loads it with ctypes, so
one build serves every CPython version, and a wheel holding it is tagged
``py3-none-<platform>``. It records the XLA FFI API version of the headers it was compiled
against (and that jaxlib's version); the loader refuses it, naming both versions, when the
running jaxlib's differs.

The library is optional: without a C++17 compiler, or without jaxlib's headers in the
build environment, the build goes on without it and lowprec runs XLA's formulations (the
same bits, slower on CPU; ``lowprec.kernels.native_status()`` says which).
"""

import os
import re
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

try:
    from setuptools.command.bdist_wheel import bdist_wheel  # setuptools >= 70.1
except ImportError:  # older setuptools: the wheel package's (a build requirement)
    from wheel.bdist_wheel import bdist_wheel

_NATIVE = "lowprec.kernels._cpu_lib"
# The library's file in lowprec/kernels/; _cpu_native.py loads it by this name. Not a module
# name Python would import.
_NATIVE_FILE = "liblowprec_cpu" + (".dylib" if sys.platform == "darwin" else ".so")


def _jaxlib():
    """(jaxlib's include directory if it holds the XLA FFI headers, else None; its version)."""
    try:
        import jaxlib
    except ImportError:
        return None, None
    include = os.path.join(os.path.dirname(jaxlib.__file__), "include")
    if not os.path.isfile(os.path.join(include, "xla", "ffi", "api", "ffi.h")):
        include = None
    version = str(getattr(jaxlib, "__version__", "unknown"))
    return include, re.sub(r"[^0-9A-Za-z.+-]", "", version) or "unknown"


class BuildNative(build_ext):
    """setuptools' build_ext, building the native kernels as a plain shared library: its
    file name carries no CPython tag, and it exports no module init function."""

    def get_ext_filename(self, fullname):
        name = super().get_ext_filename(fullname)
        # build_ext asks with the full name and with its last part (then joins the package
        # path itself): keep whatever directories the base class put in front.
        if fullname in (_NATIVE, _NATIVE.rpartition(".")[2]):
            return os.path.join(os.path.dirname(name), _NATIVE_FILE)
        return name

    def get_export_symbols(self, ext):
        if ext.name == _NATIVE:
            return []  # its exports are marked in the source (LOWPREC_EXPORT)
        return super().get_export_symbols(ext)


class BdistWheel(bdist_wheel):
    """bdist_wheel tagging a wheel that holds the library ``py3-none-<platform>``: it runs
    on every CPython version of that platform."""

    def get_tag(self):
        python, abi, platform = super().get_tag()
        if not self.root_is_pure:
            return "py3", "none", platform
        return python, abi, platform


_include, _jaxlib_version = _jaxlib()
_ext = []
if _include is not None and os.name == "posix":
    _ext.append(Extension(
        _NATIVE,
        sources=["lowprec/kernels/_cpu_lib.cc", "lowprec/kernels/_fp6_cpu.cc",
                 "lowprec/kernels/_mx_quantize_cpu.cc", "lowprec/kernels/_mx_fake_cpu.cc",
                 "lowprec/kernels/_ckpt_cpu.cc",
                 "lowprec/kernels/_nvfp4_cpu.cc", "lowprec/kernels/_rht_cpu.cc",
                 "lowprec/kernels/_grid_select_cpu.cc"],
        depends=["lowprec/kernels/_cpu_common.h", "lowprec/kernels/_nvfp4_cpu.h"],
        include_dirs=[_include],
        define_macros=[("LOWPREC_JAXLIB_VERSION", f'"{_jaxlib_version}"')],
        language="c++",
        # Hidden by default: only the LOWPREC_EXPORT symbols are visible, so the FFI headers'
        # inline code in the library never binds to another library's copy of it.
        extra_compile_args=["-std=c++17", "-O3", "-fvisibility=hidden",
                            "-fvisibility-inlines-hidden"],
        optional=True,  # a failed compile leaves XLA's formulation, not a failed install
    ))

setup(ext_modules=_ext, cmdclass={"build_ext": BuildNative, "bdist_wheel": BdistWheel})
