"""The native CPU kernel for FP6 packing (``_fp6_cpu.cc``): loading, registration, calls.

FP6 packs four 6-bit codes into three bytes. XLA:CPU compiles every formulation of that
layout we tried (``_pack.py``'s, and a dozen others: stacks, pads, reductions, transposes,
words) to element loops whose innermost dimension is a group's 3 bytes or 4 codes, which
run 5-10x slower than a copy of the same bytes. The C++ loops run at copy speed (a byte
shuffle per 8 groups). They only move bits, so their results equal ``_pack.py``'s bit for
bit; ``tests/test_native_fp6.py`` checks every byte pattern, and the library checks itself
once before first use.

setup.py builds the library as an optional extension. Where it was not built (no C++17
compiler at install time), did not load, or failed its check, :func:`available` is False and
every call keeps XLA's formulation; :func:`status` says why.
"""

from __future__ import annotations

import functools
import importlib

import numpy as np

import jax
import jax.numpy as jnp

_LIBRARY = "lowprec.kernels._fp6_cpu_lib"
#: XLA target name of each handler, by its attribute in the built module.
_TARGETS = {"pack": "lowprec_fp6_pack", "unpack": "lowprec_fp6_unpack"}


def pack_last(codes):
    """uint8 FP6 codes packed along the last axis (a multiple of 4 long) by the native
    kernel: ``_pack.pack_last(codes, 6)``'s bytes. CPU only; call where :func:`available`."""
    shape = (*codes.shape[:-1], codes.shape[-1] // 4 * 3)
    return _call("pack", codes, shape)


def unpack_last(packed):
    """Inverse of :func:`pack_last`: ``_pack.unpack_last(packed, 6)``'s codes."""
    shape = (*packed.shape[:-1], packed.shape[-1] // 3 * 4)
    return _call("unpack", packed, shape)


def _call(kind: str, x, shape):
    # The kernel reads the buffer as one run of groups, so any leading dims (a vmapped one
    # included) are the same loop.
    out = jax.ShapeDtypeStruct(shape, jnp.uint8)
    return jax.ffi.ffi_call(_TARGETS[kind], out, vmap_method="broadcast_all")(x)


def available() -> bool:
    """Whether the native kernel is built, registered with XLA and checked (once per
    process, on first use)."""
    return _load()[0]


def status() -> str:
    """Why :func:`available` is what it is, in a sentence."""
    return _load()[1]


@functools.lru_cache(maxsize=None)
def _load() -> tuple[bool, str]:
    return _probe(_LIBRARY)


def _probe(library_name: str) -> tuple[bool, str]:
    """Loads the built library ``library_name`` (a module path), registers its targets with
    XLA and checks them: ``(usable, why)``."""
    if getattr(jax, "ffi", None) is None or not hasattr(jax.ffi, "ffi_call"):
        return False, (f"the native FP6 kernel cannot run: jax {jax.__version__} has no "
                       "jax.ffi (XLA's FP6 packing runs)")
    try:
        library = importlib.import_module(library_name)
    except ImportError as error:
        if getattr(error, "name", None) == library_name:
            return False, ("the native FP6 kernel was not built (no C++17 compiler or no jaxlib "
                           "headers when lowprec was installed; XLA's FP6 packing runs)")
        return False, f"the native FP6 kernel did not load: {error}"
    where = getattr(library, "__file__", library_name)
    try:
        for attribute, target in _TARGETS.items():
            jax.ffi.register_ffi_target(target, getattr(library, attribute), platform="cpu")
    except (AttributeError, RuntimeError, TypeError, ValueError) as error:
        return False, f"the native FP6 kernel at {where} did not register: {error}"
    problem = _self_check()
    if problem:
        return False, f"the native FP6 kernel at {where} failed its check: {problem}"
    return True, f"the native FP6 kernel serves FP6 packing on CPU ({where})"


def _self_check() -> str:
    """'' if the registered kernel packs and unpacks a few groups as the layout says (an FFI
    version this jaxlib rejects shows up here, not in a user's program), else the problem."""
    try:
        cpu = jax.devices("cpu")[0]
    except RuntimeError as error:
        return f"no CPU device ({error})"
    # 41 groups: the vector loop's steps and the scalar tail both run.
    codes = np.arange(164, dtype=np.uint8) * np.uint8(37)
    low = codes.astype(np.uint32).reshape(-1, 4) & 0x3F
    words = low[:, 0] | low[:, 1] << 6 | low[:, 2] << 12 | low[:, 3] << 18
    want = np.stack([(words >> s) & 0xFF for s in (0, 8, 16)], axis=1).astype(np.uint8).ravel()
    try:
        with jax.ensure_compile_time_eval():
            x = jax.device_put(codes, cpu)
            packed = np.asarray(jax.jit(pack_last)(x))
            back = np.asarray(jax.jit(unpack_last)(jax.device_put(packed, cpu)))
    except Exception as error:  # noqa: BLE001 - any failure means: do not use it
        return f"{type(error).__name__}: {error}"
    if not np.array_equal(packed, want):
        return "packed bytes differ from the layout's"
    if not np.array_equal(back, codes & 0x3F):
        return "unpacked codes differ from the packed ones"
    return ""
