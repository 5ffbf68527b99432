"""Kernels (Pallas/Triton on CUDA GPUs, one native loop on CPU) and the one place that
decides when they run.

Every lowprec function computes with XLA on every backend. On a CUDA GPU some calls take a
Pallas kernel instead, with the same bits (the dot products: the same exact products, summed
in float32 in another order; docs/design.md §8):

* ``quantize_mx`` / ``fake_quantize_mx``: one-pass quantize (and decode) kernels
  (``_quantize_pallas.py``; NVFP4 quantize too, a first pass for the largest magnitude where
  the tensor scale is computed);
* ``dot_general``'s bfloat16 branch for two MX operands with 8-bit codes: a GEMM that decodes
  in its operand load (``_mxdot_pallas.py``);
* ``dot_general`` / ``matmul`` of up to 16 bfloat16 tokens by a packed MXFP4 weight: a split-K
  product (``_gemv_pallas.py``; also :func:`lowprec.kernels.mxfp4_gemv`, which calls it explicitly);
* :func:`lowprec.weight_only_matmul` of up to 16 bfloat16 tokens by a weight prepared with
  :func:`lowprec.prepare_weight` (MXFP4 or NVFP4), on Hopper GPUs: a Pallas Mosaic GPU
  kernel with the weight tile as ``wgmma``'s left operand (``_weight_only_mgpu.py``).

On CPU two C++ kernels registered with XLA's FFI (built at install time where a C++17
compiler is found; :func:`native_status` says whether they are in use) give the same bits
as XLA's formulation, faster: ``quantize_mx`` of float32 blocked along the last axis in one
pass (``_mx_quantize_cpu.cc``: E8M0 scales, blocks of 32, round to nearest even; XLA reads
x twice), and FP6 packing and unpacking along the last axis (``_fp6_cpu.cc``; XLA:CPU runs
its formulation of the 3-byte groups 5-10x slower than a copy).

``_dispatch.py`` decides, for each call, whether a kernel serves it, and whether the
quantized products build their operands for the GPU's FP8/bfloat16 GEMMs on CUDA
(``lowprec/_gpu_gemm.py``: XLA programs, not kernels, but summed differently from the
portable products). One frozen value, a :class:`Policy`, says what may run: its
``kernels`` field turns them all off (``"xla"``; also the environment variable
``LOWPREC_KERNELS=xla``; ``"auto"``, the default, lets them run where they serve), its
``gpu_route`` picks the decode-time MXFP4 route on CUDA and its ``fused_mxdot`` turns on the
fused MX dot kernel (off by default: slower than cuBLAS on an H200). Set it for the process
with :func:`set_policy`, or for a block with the context manager :func:`policy`;
:func:`current_policy` says what is in force. Each public function reads the
policy when it is called (or traced, inside your ``jax.jit``) and hands its jitted core the
decision as a static argument, so a program traced under one policy is never reused under
the other; ``set_policy`` also clears JAX's caches when the policy changes, so that your own
jitted functions are traced again. Set ``LOWPREC_KERNELS`` before the process traces any
lowprec call.

Example:
    >>> import lowprec.kernels
    >>> with lowprec.kernels.policy("xla"):             # XLA only, also on a GPU
    ...     lowprec.kernels.get_policy()
    'xla'
    >>> previous = lowprec.kernels.set_policy(gpu_route="xla", fused_mxdot=True)
    >>> lowprec.kernels.current_policy().fused_mxdot
    True
    >>> _ = lowprec.kernels.set_policy(previous)        # the settings before, restored
"""

from .._lazy import resolve_public

# Imported on first use (PEP 562): the checkpoint command line imports this package for
# the JAX-free passes of _ckpt_cpu, and _dispatch imports JAX.
_PUBLIC = {
    "ENV_VAR": "_dispatch",
    "POLICIES": "_dispatch",
    "Policy": "_dispatch",
    "current_policy": "_dispatch",
    "get_policy": "_dispatch",
    "native_status": "_dispatch",
    "policy": "_dispatch",
    "set_policy": "_dispatch",
    "mxfp4_gemv": "_gemv_pallas",
}


def __getattr__(name):
    return resolve_public(__name__, _PUBLIC, globals(), name)


def __dir__():
    return sorted(set(globals()) | set(__all__))


__all__ = ["ENV_VAR", "POLICIES", "Policy", "current_policy", "get_policy", "mxfp4_gemv",
           "native_status", "policy", "set_policy"]
