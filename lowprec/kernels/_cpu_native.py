"""lowprec's native CPU kernels (``_cpu_lib``, built from ``*.cc`` here): loading,
registration with XLA, and a check before first use.

setup.py builds the extension module ``lowprec.kernels._cpu_lib`` where a C++17 compiler
and jaxlib's FFI headers are found; its attributes are the XLA FFI handlers as capsules. The
first call of :func:`available` imports it, registers each handler as a CPU target, and runs
the kernels once on inputs whose results are derived here from the formats' definitions, so
that a jaxlib whose FFI rejects the handlers shows up as "not available", never inside a
user's program. Where the module was not built, does not load, or fails the check, every
call keeps XLA's formulation (the same bits) and :func:`status` says why.
"""

from __future__ import annotations

import functools
import importlib

import numpy as np

import jax

_LIBRARY = "lowprec.kernels._cpu_lib"
#: XLA target name of each handler, by its attribute in the built module.
TARGETS = {"fp6_pack": "lowprec_fp6_pack", "fp6_unpack": "lowprec_fp6_unpack",
           "mx_quantize": "lowprec_mx_quantize"}


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
    usable, _, library = _load()
    return usable and bool(getattr(library, "avx2", False))


@functools.lru_cache(maxsize=None)
def _load() -> tuple[bool, str, object]:
    return _probe(_LIBRARY)


def _probe(library_name: str) -> tuple[bool, str, object]:
    """Imports the built module ``library_name``, registers its handlers with XLA and checks
    them: ``(usable, why, the module or None)``."""
    if getattr(jax, "ffi", None) is None or not hasattr(jax.ffi, "ffi_call"):
        return False, (f"the native CPU kernels cannot run: jax {jax.__version__} has no "
                       "jax.ffi (XLA's formulations run)"), None
    try:
        library = importlib.import_module(library_name)
    except ImportError as error:
        if getattr(error, "name", None) == library_name:
            why = ("the native CPU kernels were not built (no C++17 compiler or no jaxlib "
                   "headers when lowprec was installed; XLA's formulations run)")
            return False, why, None
        return False, f"the native CPU kernels did not load: {error}", None
    where = getattr(library, "__file__", library_name)
    try:
        for attribute, target in TARGETS.items():
            jax.ffi.register_ffi_target(target, getattr(library, attribute), platform="cpu")
    except (AttributeError, RuntimeError, TypeError, ValueError) as error:
        return False, f"the native CPU kernels at {where} did not register: {error}", None
    problem = _self_check()
    if problem:
        return False, f"the native CPU kernels at {where} failed their check: {problem}", None
    return True, f"the native CPU kernels serve FP6 packing and MX quantization ({where})", \
        library


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
