"""lowprec's native CPU kernels (the shared library ``liblowprec_cpu``, built from ``*.cc``
here): loading, registration with XLA, and a check before first use.

setup.py builds the library where a C++17 compiler and jaxlib's FFI headers are found. It is a
plain shared library, not a Python extension module (no CPython API: one build serves every
CPython version). The first call of :func:`available`

* loads it with :mod:`ctypes` (which runs none of its code);
* compares the XLA FFI API version of the headers it was compiled against with the running
  jaxlib's, and refuses it, naming both, unless they are equal. XLA accepts handlers from a
  range of versions whose lower end Python cannot see, and one it refuses is worse than
  unused: registered before the CPU backend starts, it makes the backend fail to start
  ("Unable to initialize backend 'cpu'", jaxlib 0.10.2), so every JAX call in the process
  fails. Equality is the one version known to be accepted;
* starts the CPU backend, then hands each handler to XLA as a capsule
  (``jax.ffi.pycapsule``) registered as a CPU target, so that XLA's own refusal, if any, is
  an error of that call and not of the backend;
* runs the kernels once on inputs whose results are derived here from the formats'
  definitions, so that a jaxlib whose FFI misbehaves shows up as "not available", never
  inside a user's program.

Where the library was not built, does not load, was built for another FFI version or fails
the check, every call keeps XLA's formulation (the same bits) and :func:`status` says why.
"""

from __future__ import annotations

import ctypes
import functools
import re
import sys
from pathlib import Path
from typing import Optional

import numpy as np

import jax
import jaxlib

#: The library setup.py builds (its ``_NATIVE_FILE``), beside this module.
LIBRARY = Path(__file__).with_name(
    "liblowprec_cpu" + (".dylib" if sys.platform == "darwin" else ".so"))
#: XLA target name of each handler, by kernel.
TARGETS = {"fp6_pack": "lowprec_fp6_pack", "fp6_unpack": "lowprec_fp6_unpack",
           "mx_quantize": "lowprec_mx_quantize"}
#: The library's exported handler symbol of each target.
SYMBOLS = {"lowprec_fp6_pack": "LowprecFp6Pack", "lowprec_fp6_unpack": "LowprecFp6Unpack",
           "lowprec_mx_quantize": "LowprecMxQuantize"}
_REBUILD = ("reinstall lowprec in this environment to rebuild them against its jaxlib "
            "(from a checkout: pip install --no-build-isolation -e .)")


def available() -> bool:
    """Whether the native kernels are built, registered with XLA and checked (once per
    process, on first use)."""
    return _load()[0]


def status() -> str:
    """Why :func:`available` is what it is, in a sentence."""
    return _load()[1]


def vector_quantizer() -> bool:
    """Whether the MX quantizer's AVX2 loop runs on this CPU (its portable loop is no faster
    than XLA's program, so ``quantize_mx`` takes the kernel only where this holds)."""
    usable, _, avx2 = _load()
    return usable and avx2


def running_ffi_api_version() -> Optional[tuple[int, int]]:
    """The XLA FFI API version ``(major, minor)`` of the running jaxlib, read from the FFI
    headers it ships (``jax.ffi.include_dir()``, the headers of the XLA it was built from),
    or None where they are missing or say none."""
    try:
        header = Path(jax.ffi.include_dir()) / "xla" / "ffi" / "api" / "c_api.h"
        text = header.read_text(encoding="utf-8", errors="replace")
    except (AttributeError, OSError):
        return None
    found = [re.search(rf"^\s*#\s*define\s+XLA_FFI_API_{part}\s+(\d+)\s*$", text, re.M)
             for part in ("MAJOR", "MINOR")]
    if not all(found):
        return None
    return int(found[0].group(1)), int(found[1].group(1))


def built_ffi_api_version(library: ctypes.CDLL) -> tuple[tuple[int, int], str]:
    """The XLA FFI API version ``(major, minor)`` the loaded ``library`` was compiled
    against, and the version of the jaxlib whose headers those were."""
    major, minor = ctypes.c_int32(), ctypes.c_int32()
    version = library.lowprec_ffi_api_version
    version.restype, version.argtypes = None, [ctypes.POINTER(ctypes.c_int32)] * 2
    version(ctypes.byref(major), ctypes.byref(minor))
    jaxlib = library.lowprec_built_with_jaxlib
    jaxlib.restype, jaxlib.argtypes = ctypes.c_char_p, []
    return (major.value, minor.value), (jaxlib() or b"unknown").decode("ascii", "replace")


@functools.lru_cache(maxsize=None)
def _load() -> tuple[bool, str, bool]:
    return _probe(LIBRARY)


# The loaded library, kept for the life of the process: XLA holds its handlers' addresses.
_loaded: list[ctypes.CDLL] = []


def _probe(path: Path, running: Optional[tuple[int, int]] = None) -> tuple[bool, str, bool]:
    """Loads the library at ``path``, checks its FFI API version against ``running`` (the
    running jaxlib's, read when None), registers its handlers with XLA and checks them:
    ``(usable, why, whether its AVX2 quantizer loop runs here)``."""
    ffi = getattr(jax, "ffi", None)
    if ffi is None or not all(hasattr(ffi, f) for f in ("ffi_call", "pycapsule",
                                                        "register_ffi_target")):
        return False, (f"the native CPU kernels cannot run: jax {jax.__version__} has no "
                       "jax.ffi with ffi_call and pycapsule (XLA's formulations run)"), False
    if not path.is_file():
        return False, ("the native CPU kernels were not built (no C++17 compiler or no jaxlib "
                       "headers when lowprec was installed, or a checkout not reinstalled "
                       "since they changed: pip install --no-build-isolation -e .); XLA's "
                       "formulations run"), False
    try:
        library = ctypes.CDLL(str(path))
        built, built_jaxlib = built_ffi_api_version(library)
        avx2 = bool(library.lowprec_cpu_has_avx2())
        handlers = {target: ffi.pycapsule(getattr(library, symbol))
                    for target, symbol in SYMBOLS.items()}
    except (OSError, AttributeError, TypeError, ValueError) as error:
        return False, (f"the native CPU kernels at {path} did not load ({error}); "
                       f"{_REBUILD}; XLA's formulations run"), False
    running = running_ffi_api_version() if running is None else running
    here = f"the running jaxlib {getattr(jaxlib, '__version__', '?')}"
    if running is None:
        return False, (f"the native CPU kernels at {path} were not used: {here} does not say "
                       f"its XLA FFI API version (no FFI headers in jax.ffi.include_dir()), "
                       f"so their build's ({built[0]}.{built[1]}, jaxlib {built_jaxlib}) "
                       "cannot be checked against it; XLA's formulations run"), False
    if running != built:
        return False, (f"the native CPU kernels at {path} were built against XLA FFI API "
                       f"{built[0]}.{built[1]} (jaxlib {built_jaxlib}), but {here} has FFI "
                       f"API {running[0]}.{running[1]}: {_REBUILD}; XLA's formulations "
                       "run"), False
    try:
        jax.devices("cpu")  # the backend first: registering before it starts defers errors
    except RuntimeError as error:
        return False, f"the native CPU kernels cannot run: no CPU backend ({error})", False
    _loaded.append(library)  # before XLA holds any of its addresses
    try:
        for target, capsule in handlers.items():
            ffi.register_ffi_target(target, capsule, platform="cpu")
    except (AttributeError, RuntimeError, TypeError, ValueError) as error:
        return False, (f"the native CPU kernels at {path} did not register ({error}); "
                       f"{_REBUILD}; XLA's formulations run"), False
    problem = _self_check()
    if problem:
        return False, f"the native CPU kernels at {path} failed their check: {problem}", False
    return True, (f"the native CPU kernels serve FP6 packing and MX quantization ({path}; "
                  f"XLA FFI API {built[0]}.{built[1]})"), avx2


def _self_check() -> str:
    """'' if the registered kernels give the results derived here, else the problem."""
    from . import _fp6_cpu, _mx_quantize_cpu  # noqa: PLC0415 - they call back into here

    try:
        cpu = jax.devices("cpu")[0]
    except RuntimeError as error:
        return f"no CPU device ({error})"
    # FP6: 41 groups (the vector loop's steps and the scalar tail), by the layout's rule.
    codes = np.arange(164, dtype=np.uint8) * np.uint8(37)
    low = codes.astype(np.uint32).reshape(-1, 4) & 0x3F
    words = low[:, 0] | low[:, 1] << 6 | low[:, 2] << 12 | low[:, 3] << 18
    want = np.stack([(words >> s) & 0xFF for s in (0, 8, 16)], axis=1).astype(np.uint8).ravel()
    # MXFP8 E4M3, floor rule, one block: 31 ones and a -0. amax 1 = 2^0 gives the shared
    # exponent 0 - 8 (E4M3's largest binade), code 127 - 8 = 119; 1 x 2^8 is E4M3's
    # exponent field 8 + 7 = 15, code 0x78; -0 keeps its sign, 0x80.
    x = np.ones(32, np.float32)
    x[-1] = -0.0
    want_el = np.full(32, 0x78, np.uint8)
    want_el[-1] = 0x80
    try:
        with jax.ensure_compile_time_eval():
            packed = np.asarray(jax.jit(_fp6_cpu.pack_last)(jax.device_put(codes, cpu)))
            back = np.asarray(jax.jit(_fp6_cpu.unpack_last)(jax.device_put(packed, cpu)))
            el, sc = jax.jit(lambda v: _mx_quantize_cpu.quantize_last(
                v, _mx_quantize_cpu.attributes("mxfp8_e4m3", "floor")))(
                    jax.device_put(x, cpu))
            el, sc = np.asarray(el), np.asarray(sc)
    except Exception as error:  # noqa: BLE001 - any failure means: do not use them
        return f"{type(error).__name__}: {error}"
    if not np.array_equal(packed, want):
        return "FP6 packed bytes differ from the layout's"
    if not np.array_equal(back, codes & 0x3F):
        return "FP6 unpacked codes differ from the packed ones"
    if not (np.array_equal(el, want_el) and sc.tolist() == [119]):
        return "MXFP8 codes of a known block differ from the derived ones"
    return ""
