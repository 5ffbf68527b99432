"""Builds lowprec's one optional native part: its CPU kernels (``lowprec/kernels/*.cc``:
FP6 packing, one-pass MX quantization), XLA FFI targets compiled against the FFI headers
that jaxlib ships, in one extension module. Everything else is in pyproject.toml.

The extension is optional: without a C++17 compiler, or without jaxlib's headers in the
build environment, the build goes on without it and lowprec runs XLA's formulations (the
same bits, slower on CPU; ``lowprec.kernels.native_status()`` says which).
"""

import os

from setuptools import Extension, setup


def _ffi_include():
    """jaxlib's include directory if it holds the XLA FFI headers, else None."""
    try:
        import jaxlib
    except ImportError:
        return None
    include = os.path.join(os.path.dirname(jaxlib.__file__), "include")
    return include if os.path.isfile(os.path.join(include, "xla", "ffi", "api", "ffi.h")) else None


_include = _ffi_include()
_ext = []
if _include is not None and os.name == "posix":
    _ext.append(Extension(
        "lowprec.kernels._cpu_lib",
        sources=["lowprec/kernels/_cpu_lib.cc", "lowprec/kernels/_fp6_cpu.cc",
                 "lowprec/kernels/_mx_quantize_cpu.cc"],
        depends=["lowprec/kernels/_cpu_common.h"],
        include_dirs=[_include],
        language="c++",
        extra_compile_args=["-std=c++17", "-O3"],
        optional=True,  # a failed compile leaves XLA's formulation, not a failed install
    ))

setup(ext_modules=_ext)
