"""The native CPU kernel for the NVFP4 training recipe's Hadamard transform along tokens
(``_rht_cpu.cc``): which calls it serves, and the call.

The weight gradient quantizes M x and M g along tokens (``_nvfp4_train``), and the native
NVFP4 quantizer blocks along the last axis: XLA:CPU ran the transform's butterfly as
concatenate fusions along axis 0 (or, for the cotangent, along axis 1 after a transpose)
and then transposed for the quantizer, two passes at 2.5-5 ns an element. The kernel is one
pass that writes the transform already transposed, with the same float32 operations in the
same order (XLA:CPU's flush-to-zero and denormals-are-zero included): the same bits
(``tests/test_nvfp4_train.py``). Loading: ``_cpu_native.py``; the check before first use:
:func:`_check` here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from . import _cpu_native

TARGET = "lowprec_rht_transposed"


def serves(v, signs) -> bool:
    """Whether the kernel takes ``rht(v, signs, 0).T`` (static): ``v`` float32 [T, C] with T
    a multiple of 16 and 16 signs, on a CPU with AVX2 (the kernel sets the x86 MXCSR's
    flush-to-zero to match XLA's loops). The caller also checks that the call may take a
    native kernel at all (``_dispatch``: policy, one unsharded CPU device)."""
    return (v.ndim == 2 and v.dtype == jnp.float32 and v.shape[0] % 16 == 0 and v.size > 0
            and signs.shape == (16,) and _cpu_native.vector_quantizer())


def rht_transposed(v, signs):
    """``rht(v, signs, 0).T`` ([C, T]) by the kernel: float32 ``v`` [T, C], T a multiple of
    16; ``signs`` float32 ±1 [16]. CPU only, where :func:`serves` says."""
    t, c = v.shape
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((c, t), jnp.float32),
                            vmap_method="sequential")
    return call(jax.lax.stop_gradient(v), jnp.asarray(signs, jnp.float32))


def _check() -> str:
    """'' if the registered handler transforms known blocks as derived here. With signs s,
    row i of a block e_i (1 at row i, 0 elsewhere) becomes s_i x column i of H16 / 4: 0.25
    with the sign s_i (-1)^popcount(i & j) at row j; 3 in every row of a block becomes 3 s,
    and s = (1, -1, 1, ...) is column 1 of H16, so H16 (3 s) / 4 = 12 at row 1 and +0
    elsewhere (every partial sum is 0, 3 + -3, or +-6, +-12, ...); 2^-128 (subnormal) in every
    row reads as 0, as XLA:CPU reads it (kept, the same sums would give 2^-126 at row 1). Five
    columns (the kernel's scalar loop) and eight (its vector loop) both."""
    cpu = jax.devices("cpu")[0]
    signs = np.array([1, -1] * 8, np.float32)
    for cols in (5, 8):
        x = np.zeros((48, cols), np.float32)
        want = np.zeros((cols, 48), np.float32)
        for c in range(cols):
            i = (3 * c + 1) % 16
            x[i, c] = 1.0
            want[c, :16] = [0.25 * signs[i] * (-1) ** bin(i & j).count("1") for j in range(16)]
        x[16:32] = 3.0
        want[:, 17] = 12.0
        x[32:48] = np.float32(2.0**-128)
        call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((cols, 48), jnp.float32))
        got = np.asarray(jax.jit(call)(jax.device_put(x, cpu), jax.device_put(signs, cpu)))
        if got.view(np.uint32).tolist() != want.view(np.uint32).tolist():
            return "the transform of known blocks differs from the derived one"
    return ""


_cpu_native.register_kernel("the NVFP4 recipe's Hadamard transform", {TARGET: "LowprecRhtTransposed"},
                            _check)
