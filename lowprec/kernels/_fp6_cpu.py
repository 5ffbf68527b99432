"""The native CPU kernel for FP6 packing (``_fp6_cpu.cc``): its calls.

FP6 packs four 6-bit codes into three bytes. XLA:CPU compiles every formulation of that
layout we tried (``_pack.py``'s, and a dozen others: stacks, pads, reductions, transposes,
words) to element loops whose innermost dimension is a group's 3 bytes or 4 codes, which
run 5-10x slower than a copy of the same bytes. The C++ loops run at copy speed (a byte
shuffle per 8 groups). They only move bits, so their results equal ``_pack.py``'s bit for
bit (``tests/test_native_fp6.py`` checks every byte pattern). Loading: ``_cpu_native.py``;
the check before first use: :func:`_check` here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from . import _cpu_native

TARGETS = {"fp6_pack": "lowprec_fp6_pack", "fp6_unpack": "lowprec_fp6_unpack"}


def pack_last(codes):
    """uint8 FP6 codes packed along the last axis (a multiple of 4 long) by the native
    kernel: ``_pack.pack_last(codes, 6)``'s bytes. CPU only, where ``_cpu_native.available``."""
    shape = (*codes.shape[:-1], codes.shape[-1] // 4 * 3)
    return _call("fp6_pack", codes, shape)


def unpack_last(packed):
    """Inverse of :func:`pack_last`: ``_pack.unpack_last(packed, 6)``'s codes."""
    shape = (*packed.shape[:-1], packed.shape[-1] // 3 * 4)
    return _call("fp6_unpack", packed, shape)


def _call(kind: str, x, shape):
    # The kernel reads the buffer as one run of groups, so any leading dims (a vmapped one
    # included) are the same loop.
    out = jax.ShapeDtypeStruct(shape, jnp.uint8)
    return jax.ffi.ffi_call(TARGETS[kind], out, vmap_method="broadcast_all")(x)


def _check() -> str:
    """'' if the registered handlers pack and unpack 41 groups (the vector loop's steps and
    the scalar tail) as the layout's rule says, derived here."""
    cpu = jax.devices("cpu")[0]
    codes = np.arange(164, dtype=np.uint8) * np.uint8(37)
    low = codes.astype(np.uint32).reshape(-1, 4) & 0x3F
    words = low[:, 0] | low[:, 1] << 6 | low[:, 2] << 12 | low[:, 3] << 18
    want = np.stack([(words >> s) & 0xFF for s in (0, 8, 16)], axis=1).astype(np.uint8).ravel()
    packed = np.asarray(jax.jit(pack_last)(jax.device_put(codes, cpu)))
    back = np.asarray(jax.jit(unpack_last)(jax.device_put(packed, cpu)))
    if not np.array_equal(packed, want):
        return "FP6 packed bytes differ from the layout's"
    if not np.array_equal(back, codes & 0x3F):
        return "FP6 unpacked codes differ from the packed ones"
    return ""


_cpu_native.register_kernel(
    "FP6 packing", {TARGETS[k]: s for k, s in (("fp6_pack", "LowprecFp6Pack"),
                                               ("fp6_unpack", "LowprecFp6Unpack"))}, _check)
