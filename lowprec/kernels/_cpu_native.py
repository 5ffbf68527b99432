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
* runs each kernel's own check (declared by its module with :func:`register_kernel`,
  on inputs whose results that module derives from the formats' definitions), so that a
  jaxlib whose FFI misbehaves shows up as "not available", never inside a user's program.

Where the library was not built, does not load, was built for another FFI version or fails
the check, every call keeps XLA's formulation (the same bits) and :func:`status` says why.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import re
import sys
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from .._lazy import lazy_module

# Imported when the library is first probed: the checkpoint passes (_ckpt_cpu) read only
# LIBRARY, and the checkpoint command line imports no JAX.
jax = lazy_module("jax")
jaxlib = lazy_module("jaxlib")

#: The library setup.py builds (its ``_NATIVE_FILE``), beside this module.
LIBRARY = Path(__file__).with_name(
    "liblowprec_cpu" + (".dylib" if sys.platform == "darwin" else ".so"))


@dataclasses.dataclass(frozen=True)
class Kernel:
    """A kernel of the library, as its module declares it (:func:`register_kernel`): this
    module knows none of them."""

    #: What it serves, in words (for :func:`status`).
    serves: str
    #: XLA target name -> the library's exported handler symbol.
    handlers: tuple
    #: '' if its registered handlers give the results the kernel's module derives, else the
    #: problem (run once, after registration, before any use).
    check: Callable[[], str]


_KERNELS: list = []


def register_kernel(serves: str, handlers: dict, check: Callable[[], str]) -> None:
    """Declares a kernel of the library (at its module's import): its handlers are registered
    with XLA and its ``check`` run when the library loads or, where the library is already
    loaded (``import lowprec`` is lazy, so a module using one kernel can load it before the
    others are imported), at once."""
    kernel = Kernel(serves, tuple(handlers.items()), check)
    _KERNELS.append(kernel)
    if _load.cache_info().currsize and _load()[0]:
        problem = _register(_loaded[-1], (kernel,))
        if problem:
            _late_problems.append(f"{serves}: {problem}")


#: Problems of kernels declared after the library loaded (each turns every kernel off, as a
#: failed check at load time does).
_late_problems: list[str] = []


_REBUILD = ("reinstall lowprec in this environment to rebuild them against its jaxlib "
            "(from a checkout: pip install --no-build-isolation -e .)")


def available() -> bool:
    """Whether the native kernels are built, registered with XLA and checked (once per
    process, on first use)."""
    return _load()[0] and not _late_problems


def status() -> str:
    """Why :func:`available` is what it is, in a sentence."""
    usable, why, _ = _load()
    if usable and _late_problems:
        return f"the native CPU kernels at {LIBRARY} failed their check: {_late_problems[0]}"
    if usable:  # every kernel declared so far, those declared after the load included
        serves = " and ".join(k.serves for k in _KERNELS) or "nothing (no kernel declared)"
        return f"the native CPU kernels serve {serves} {why}"
    return why


def vector_quantizer() -> bool:
    """Whether the MX quantizer's AVX2 loop runs on this CPU (its portable loop is no faster
    than XLA's program, so ``quantize_mx`` takes the kernel only where this holds)."""
    usable, _, avx2 = _load()
    return usable and avx2 and not _late_problems


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
        for kernel in _KERNELS:  # every declared handler is exported
            for _, symbol in kernel.handlers:
                getattr(library, symbol)
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
    problem = _register(library, tuple(_KERNELS))
    if problem:
        return False, f"the native CPU kernels at {path} {problem}", False
    return True, f"({path}; XLA FFI API {built[0]}.{built[1]})", avx2


def _register(library: ctypes.CDLL, kernels: tuple) -> str:
    """Registers ``kernels``' handlers of the loaded ``library`` with XLA and runs their
    checks: '' or what went wrong (a phrase following "the native CPU kernels at PATH")."""
    try:
        for kernel in kernels:
            for target, symbol in kernel.handlers:
                jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, symbol)),
                                            platform="cpu")
    except (AttributeError, RuntimeError, TypeError, ValueError) as error:
        return f"did not register ({error}); {_REBUILD}; XLA's formulations run"
    problem = _self_check(kernels)
    return f"failed their check: {problem}" if problem else ""


def _self_check(kernels: tuple) -> str:
    """'' if each of ``kernels`` passes its own check, else the first problem."""
    try:
        jax.devices("cpu")
    except RuntimeError as error:
        return f"no CPU device ({error})"
    for kernel in kernels:
        try:
            with jax.ensure_compile_time_eval():
                problem = kernel.check()
        except Exception as error:  # noqa: BLE001 - any failure means: do not use them
            problem = f"{type(error).__name__}: {error}"
        if problem:
            return f"{kernel.serves}: {problem}"
    return ""
