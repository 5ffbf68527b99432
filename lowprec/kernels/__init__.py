"""Kernels (Pallas/Triton on CUDA GPUs, one native loop on CPU) and the one place that
decides when they run.

Every lowprec function computes with XLA on every backend. On a CUDA GPU some calls take a
Pallas kernel instead, with the same bits (the dot products: the same exact products, summed
in float32 in another order; docs/design.md §8):

* ``quantize_mx`` / ``fake_quantize_mx``: one-pass quantize (and decode) kernels
  (``_quantize_pallas.py``);
* ``dot_general``'s bfloat16 branch for two MX operands with 8-bit codes: a GEMM that decodes
  in its operand load (``_mxdot_pallas.py``);
* ``dot_general`` / ``matmul`` of up to 16 bfloat16 tokens by a packed MXFP4 weight: a split-K
  product (``_gemv_pallas.py``; also :func:`lowprec.mxfp4_gemv`, which calls it explicitly).

On CPU, FP6 codes are packed into and unpacked from their 3-byte groups along the last axis
by a C++ loop registered with XLA's FFI (``_fp6_cpu.cc``, built at install time where a C++17
compiler is found; :func:`native_status` says whether it is in use): XLA:CPU runs its own
formulation of that layout 5-10x slower than a copy. It moves bits only: the same bytes.

``_dispatch.py`` decides, for each call, whether a kernel serves it. The policy turns them
off: :func:`set_policy` ``("xla")``, or the environment variable ``LOWPREC_KERNELS=xla``;
``"auto"`` (the default) lets them run where they serve. Each public function reads the
policy when it is called (or traced, inside your ``jax.jit``) and hands its jitted core the
decision as a static argument, so a program traced under one policy is never reused under
the other; ``set_policy`` also clears JAX's caches when the policy changes, so that your own
jitted functions are traced again. Set ``LOWPREC_KERNELS`` before the process traces any
lowprec call.

Example:
    >>> import lowprec.kernels
    >>> previous = lowprec.kernels.set_policy("xla")   # XLA only, also on a GPU
    >>> lowprec.kernels.get_policy()
    'xla'
    >>> _ = lowprec.kernels.set_policy(previous)        # back (None: the environment's)
"""

from ._dispatch import ENV_VAR, POLICIES, get_policy, native_status, set_policy

__all__ = ["ENV_VAR", "POLICIES", "get_policy", "native_status", "set_policy"]
