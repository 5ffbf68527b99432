"""Which formulation computes a call (:class:`Formulation`: XLA's exact or hardware-float
one, a C++ kernel, a Pallas kernel) and whether a kernel serves it: the one place lowprec
decides it, under one :class:`Policy`.

A kernel serves a call when

* the policy allows kernels (:func:`set_policy`, else the environment variable
  ``LOWPREC_KERNELS``, else ``"auto"``; ``"xla"`` turns every kernel off),
* JAX here can compile for CUDA (:func:`cuda_kernels_possible`) and Pallas' Triton backend
  imports (elsewhere the CUDA branches are left out, so CPU-only installs never trace kernels
  they cannot run), and no mesh with Explicit axes is in context (JAX 0.11's Triton lowering
  fails there), and
* the kernel serves the call's layout and formats (each kernel module's ``*_applies``;
  the Pallas quantize kernels' are here);

then the call picks the kernel or XLA's formulation where XLA lowers the program
(:func:`on_cuda`: ``lax.platform_dependent``, or where JAX here compiles for CPU alone the
CPU branch alone, ``_platform.platform_dependent``), so one program runs on every backend. The
public functions read the policy when they are called and hand the decision (or the policy,
for the dot's inner choices) to their jitted cores as a static argument.

The GPU GEMM routes of the quantized products (:func:`gpu_gemm_routes`: FP8 per-tensor
products on cuBLASLt's FP8 GEMM, block formats as bfloat16 GEMM operands; ``_gpu_gemm.py``)
follow the policy too: they are XLA programs, not kernels, but they change how a product
is summed on the GPU, and ``"xla"`` keeps the portable one.

The native CPU kernels (``_cpu_native``) follow the same policy: :func:`fp6_packer` /
:func:`fp6_unpacker` give the FP6 kernel to ``_pack.py`` (which chooses nothing), and :func:`cpu_quantize_kernel` for
``quantize_mx``, decided when it is called; each picks with :func:`on_cpu`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import importlib.util
import os
from typing import Iterator, Optional

import jax
import jax.numpy as jnp

from .._deprecated import deprecated_attribute, settable_deprecated_attributes
from .._format import mx_format
from .._mx_hwfloat import hwfloat_element
from .._mxarray import MXArray
from .._pack import pack6_xla, unpack6_xla
from .._platform import platform_dependent, set_policy_reader
from .._scheme_e8m0 import E8M0Scheme
from .._scheme_nvfp4 import NVFP4Scheme
from . import _cpu_native, _fp6_cpu, _grid_select_cpu, _mx_fake_cpu, _nvfp4_cpu
from ._mx_quantize_cpu import serves as native_quantize_serves
from ._mxdot_pallas import pallas_mxdot_applies
from ._weight_only_mgpu import MAX_TOKENS as WEIGHT_ONLY_MAX_TOKENS
from ._weight_only_mgpu import mosaic_gpu_available

#: ``Policy.kernels``: ``"auto"``, Pallas kernels where they serve a call and the GPU GEMM
#: routes of the quantized products (CUDA GPUs); ``"xla"``: neither.
POLICIES: tuple[str, ...] = ("auto", "xla")
#: The environment variable read when no kernel policy was set in the process.
ENV_VAR = "LOWPREC_KERNELS"
#: Most tokens (product of the activation's free dims) sent to the decode-time route.
MAX_TOKENS = 16


class Formulation(enum.Enum):
    """How a block format's encode or decode is computed: lowprec's four formulations, named
    once. Every one gives the same bits; :func:`quantize_formulations` and
    :func:`decode_formulations` say which a call may take (XLA then lowers, per platform,
    the one for its backend)."""

    #: XLA, integer arithmetic on the bits: every backend, every call.
    EXACT = "exact"
    #: XLA, float32 hardware arithmetic where the scale scheme proves it exact (its
    #: ``fast_encoder()`` / ``fast_decoder()``; ``_mx_hwfloat``; picked per array on CPU by
    #: one ``lax.cond`` beside EXACT).
    HWFLOAT = "hwfloat"
    #: A C++ kernel registered with XLA's FFI (``_mx_quantize_cpu.cc``, ``_nvfp4_cpu.cc``; CPU).
    CPU_KERNEL = "cpu_kernel"
    #: A Pallas kernel (``_quantize_pallas.py``; CUDA).
    PALLAS = "pallas"


def _check_policy(policy, where: str) -> str:
    if policy not in POLICIES:
        raise ValueError(f"unknown kernel policy {policy!r} ({where}); valid policies: "
                         + ", ".join(map(repr, POLICIES)))
    return policy


@dataclasses.dataclass(frozen=True)
class Policy:
    """Everything that decides which kernels and routes run, as one frozen value: what
    :func:`current_policy` returns, :func:`set_policy` and :func:`policy` set, and the
    public functions read while tracing.

    Attributes:
      kernels: ``"auto"`` (kernels where they serve a call, and the quantized products on the
        GPU's FP8/bfloat16 GEMMs, on CUDA GPUs) or ``"xla"`` (the portable formulation
        everywhere: the same bits, or for the products the same exact products summed in
        float32, at another speed); None: the environment variable ``LOWPREC_KERNELS``'s,
        else ``"auto"`` (:func:`current_policy` resolves it).
      gpu_route: the route ``dot_general`` takes on a CUDA GPU for decode-time MXFP4
        products: ``"pallas"`` (the kernel of ``_gemv_pallas.py``) or ``"xla"``
        (``_gemv.mxfp4_matmul_xla``, no kernel). Measured on an H200
        (benchmarks/bench_gpu.py weight_only, 4096² and 16384×8192 at 1 and 16 tokens) the
        kernel took 35-155 µs per product and the XLA route 73-462 µs.
      fused_mxdot: whether the bfloat16 branch of a quantized dot of two 8-bit MX operands
        takes the fused kernel of ``_mxdot_pallas.py`` on a CUDA GPU (the same bits). Off:
        measured on an H200 (benchmarks/bench_gpu.py, pre-quantized MXFP8, n = 4096 and
        8192) the kernel ran at 0.15-0.22x a bfloat16 dot, decoding to bfloat16 for cuBLAS
        at 0.82-0.95x.
      platform_branches: which platforms' formulations a traced program holds where lowprec
        picks one per platform (``lowprec._platform.platform_dependent``): ``"auto"``, those
        of the platforms JAX here can compile for (where it compiles for CPU alone, no GPU or
        TPU plugin installed, the CPU formulation alone, without ``lax.platform_dependent``,
        whose other branches cost half of an NVFP4 training step's trace; such a program
        refuses to be lowered for another platform, naming this field); ``"all"``, every
        platform's (``lax.platform_dependent``): for ``jax.export(..., platforms=...)`` or
        ``lower(lowering_platforms=...)`` of a program traced on a CPU-only install.

    Example:
        >>> Policy(gpu_route="xla")
        Policy(kernels=None, gpu_route='xla', fused_mxdot=False, platform_branches='auto')
    """

    kernels: Optional[str] = None
    gpu_route: str = "pallas"
    fused_mxdot: bool = False
    platform_branches: str = "auto"

    def __post_init__(self):
        if self.kernels is not None:
            _check_policy(self.kernels, "Policy.kernels")
        if self.gpu_route not in ("pallas", "xla"):
            raise ValueError(f"unknown gpu_route {self.gpu_route!r}; valid routes: 'pallas' "
                             "(the decode-time MXFP4 kernel), 'xla' (no kernel)")
        if not isinstance(self.fused_mxdot, bool):
            raise TypeError(f"fused_mxdot must be True or False, got {self.fused_mxdot!r}")
        if self.platform_branches not in ("auto", "all"):
            raise ValueError(f"unknown platform_branches {self.platform_branches!r}; valid: "
                             "'auto' (the platforms JAX here compiles for), 'all' (every "
                             "platform's, for programs lowered for other platforms)")


_settings = Policy()  # what set_policy set in this process


class _Unchanged:
    def __repr__(self) -> str:
        return "<unchanged>"


_UNCHANGED = _Unchanged()


def current_policy() -> Policy:
    """The :class:`Policy` in force, its ``kernels`` resolved (read while tracing).

    Example:
        >>> current_policy().gpu_route in ("pallas", "xla")
        True
    """
    return dataclasses.replace(_settings, kernels=get_policy())


def set_policy(policy=_UNCHANGED, /, *, gpu_route: Optional[str] = None,
               fused_mxdot: Optional[bool] = None,
               platform_branches: Optional[str] = None) -> Policy:
    """Sets which kernels and routes lowprec's functions may run, for this process (for a
    block of code: :func:`policy`).

    Args:
      policy: a :class:`Policy` (every field), a kernel policy (``"auto"`` or ``"xla"``,
        :attr:`Policy.kernels`), or None (the kernel policy back to the environment
        variable ``LOWPREC_KERNELS``, else ``"auto"``); left out: the kernel policy as it is.
      gpu_route: :attr:`Policy.gpu_route` (``"pallas"`` or ``"xla"``); None: as it is.
      fused_mxdot: :attr:`Policy.fused_mxdot`; None: as it is.
      platform_branches: :attr:`Policy.platform_branches`; None: as it is.

    Returns:
      The settings before (a :class:`Policy`), to restore them: ``set_policy(previous)``.

    The policy in force is part of ``jax.jit``'s cache key: a function of yours traced under
    one policy is traced again under another (the policy is read while tracing; lowprec's
    own jitted cores also take it as a static argument), and its programs of an earlier
    policy are found again when that policy is back.

    Example:
        >>> previous = set_policy("xla", gpu_route="xla")
        >>> current_policy()
        Policy(kernels='xla', gpu_route='xla', fused_mxdot=False, platform_branches='auto')
        >>> _ = set_policy(previous)
    """
    global _settings
    if isinstance(policy, Policy):
        settings = policy
    elif policy is _UNCHANGED:
        settings = _settings
    else:
        if policy is not None:
            _check_policy(policy, "set_policy")
        settings = dataclasses.replace(_settings, kernels=policy)
    fields = {"gpu_route": gpu_route, "fused_mxdot": fused_mxdot,
              "platform_branches": platform_branches}
    settings = dataclasses.replace(settings, **{k: v for k, v in fields.items() if v is not None})
    in_force = current_policy()
    previous, _settings = _settings, settings
    if current_policy() != in_force:
        if _POLICY_KEY is None:
            jax.clear_caches()
        else:
            _POLICY_KEY.set_global(current_policy())
    return previous


@contextlib.contextmanager
def policy(policy=_UNCHANGED, /, *, gpu_route: Optional[str] = None,
           fused_mxdot: Optional[bool] = None,
           platform_branches: Optional[str] = None) -> Iterator[Policy]:
    """:func:`set_policy` for a ``with`` block: the settings before are restored when it
    ends, however it ends. Yields the :class:`Policy` in force inside. (The settings are the
    process's, not a thread's.)

    Example:
        >>> with policy(gpu_route="xla") as p:
        ...     p.gpu_route
        'xla'
        >>> current_policy().gpu_route
        'pallas'
    """
    previous = set_policy(policy, gpu_route=gpu_route, fused_mxdot=fused_mxdot,
                          platform_branches=platform_branches)
    try:
        yield current_policy()
    finally:
        set_policy(previous)


def get_policy() -> str:
    """The kernel policy in force (:attr:`Policy.kernels`): :func:`set_policy`'s, else
    ``LOWPREC_KERNELS``'s, else ``"auto"``. Read by each public function when it is called.

    Example:
        >>> get_policy() in POLICIES
        True
    """
    if _settings.kernels is not None:
        return _settings.kernels
    env = os.environ.get(ENV_VAR)
    if env is None or env == "":
        return "auto"
    return _check_policy(env, f"environment variable {ENV_VAR}")


# The policy in force is part of every jit cache key (a JAX user context, which JAX's tracing,
# lowering and compilation caches all include): a program traced under one policy is never
# reused under another, and going back to a policy finds its programs again, where emptying
# JAX's caches on every change made each one recompile everything. JAX without user
# contexts (before 0.6) still has its caches emptied.
_POLICY_KEY = (jax.make_user_context(current_policy())
               if hasattr(jax, "make_user_context") else None)


# The module globals that were the knobs before Policy (one release, with a warning).
_OLD_KNOBS = {"GPU_ROUTE": "gpu_route", "FUSED_MXDOT": "fused_mxdot"}


def _old_knob_use(name: str) -> str:
    return f"lowprec.kernels.set_policy({_OLD_KNOBS[name]}=...) or lowprec.kernels.policy"


def __getattr__(name: str):
    table = {n: (_old_knob_use(n), lambda f=f: getattr(current_policy(), f))
             for n, f in _OLD_KNOBS.items()}
    return deprecated_attribute(__name__, table, name)


settable_deprecated_attributes(
    __name__, {n: (_old_knob_use(n), lambda v, f=f: set_policy(**{f: v}))
               for n, f in _OLD_KNOBS.items()})


def kernels_enabled() -> bool:
    """Whether the policy in force lets Pallas kernels serve calls."""
    return get_policy() == "auto"


@functools.lru_cache(maxsize=None)
def cuda_kernels_possible() -> bool:
    """Whether JAX here can compile for CUDA: a GPU backend, or the CUDA plugin installed
    (which also compiles for a GPU without one, benchmarks/gpu_hlo_report.py). Elsewhere
    the CUDA branches of ``lax.platform_dependent`` holding Pallas kernels are left out,
    so CPU-only installs do not trace kernels they can never run."""
    for version in (12, 13):
        try:
            if importlib.util.find_spec(f"jax_plugins.xla_cuda{version}") is not None:
                return True
        except ImportError:
            pass
    try:
        return jax.default_backend() == "gpu"
    except RuntimeError:
        return False


def triton_available() -> bool:
    """Whether this JAX has Pallas with its Triton backend (lowering happens on GPU only)."""
    try:
        from jax.experimental import pallas  # noqa: F401
        from jax.experimental.pallas import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _no_explicit_mesh() -> bool:
    """Whether no mesh with Explicit axes is in context (read while tracing). JAX 0.11's
    Pallas Triton lowering fails on a kernel's reductions traced under one ("Length of
    sharding.spec (4) must be equal to aval's ndim (3)"), so there the kernels step aside for
    XLA's formulation, which gives the same bits."""
    return not getattr(jax.sharding.get_abstract_mesh(), "explicit_axes", ())


def _kernels_can_run() -> bool:
    return cuda_kernels_possible() and triton_available() and _no_explicit_mesh()


def unsharded(x) -> bool:
    """False for an array laid out over several devices (a concrete array's sharding, or a
    traced one's Explicit mesh axes): the Pallas kernels are single-device custom calls,
    which XLA's partitioner would run on gathered inputs, so sharded inputs keep XLA's
    formulation (partitioned like any elementwise program). Traced inputs over Auto axes
    carry no layout at trace time: they take the kernel."""
    sharding = getattr(x, "sharding", None)
    if sharding is not None and not isinstance(x, jax.core.Tracer):
        return len(sharding.device_set) <= 1
    try:
        spec = jax.typeof(x).sharding.spec
    except Exception:  # noqa: BLE001 - no sharding in the type
        return True
    return all(s is None for s in spec)


# What the Pallas quantize kernels (_quantize_pallas.py, which checks its calls against these)
# serve; kept here so that this module does not import the kernels, which use the encoder.

def pallas_quantize_applies(cast: MXCast, axis0: bool = False) -> bool:
    """Whether the kernel serves this cast (static): E8M0-scaled formats with blocks of 32
    (the tiles are multiples of it) (FP6's three-byte
    groups along the last axis only; ``axis0``: blocks along axis 0 of a 2-D array),
    and NVFP4 with blocks of 16 or 32 along the last axis (its tensor scale, a whole-array
    reduction when it is computed, comes in as an operand); deterministic rounding."""
    fmt = cast.fmt
    if cast.stochastic:
        return False
    if isinstance(fmt.scheme, NVFP4Scheme):
        return not axis0 and fmt.block_size in (16, 32)
    bits_ok = fmt.element.code_bits in ((4, 8) if axis0 else (4, 6, 8))
    return isinstance(fmt.scheme, E8M0Scheme) and fmt.block_size == 32 and bits_ok


def pallas_fake_quantize_applies(cast: MXCast) -> bool:
    """Whether the fake-quantization kernel serves this cast (static): E8M0-scaled formats
    with blocks of 32 (codes stay unpacked in registers, so FP6 too), deterministic
    rounding."""
    return (isinstance(cast.fmt.scheme, E8M0Scheme) and cast.fmt.block_size == 32
            and not cast.stochastic)


def quantize_kernel(x, cast, axis: int, fake: bool = False) -> bool:
    """Whether ``quantize_mx`` (``fake``: ``fake_quantize_mx``) of the validated input ``x``
    takes its one-pass kernel on CUDA (static): the policy, an unsharded input, blocks along
    the last axis or axis 0 of a 2-D array (zero padding included; done in the kernel),
    float32/bfloat16/float16 input, a cast the kernel serves, and JAX able to lower it."""
    if not (kernels_enabled() and unsharded(x)):
        return False
    if x.ndim == 0 or x.size == 0 or not (axis == x.ndim - 1 or (axis == 0 and x.ndim == 2)):
        return False
    if x.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
        return False
    if not _kernels_can_run():
        return False
    if fake:
        return pallas_fake_quantize_applies(cast)
    return pallas_quantize_applies(cast, axis0=axis != x.ndim - 1)


def mxdot_kernel(layout, lop, rop, kernels: bool, out_sharding=None) -> bool:
    """Whether the bfloat16 branch of a quantized dot takes the fused MX kernel on CUDA
    (static): the policy's ``fused_mxdot`` and ``kernels``, no requested output sharding (the
    kernel is a single-device call), two MX operands with 8-bit codes in the (1, M, K) x
    (1, N, K) layout, and JAX able to lower it."""
    if not (current_policy().fused_mxdot and kernels) or out_sharding is not None:
        return False
    if layout != (2, 2) or not (isinstance(lop, MXArray) and isinstance(rop, MXArray)):
        return False
    if lop.elements.ndim != 3 or rop.elements.ndim != 3 or lop.shape[0] != 1:
        return False
    if 0 in lop.elements.shape or 0 in rop.elements.shape:
        return False
    if not _kernels_can_run():
        return False
    return pallas_mxdot_applies(lop.fmt, rop.fmt)


def gpu_gemm_routes(kernels: bool) -> bool:
    """Whether the quantized products build their operands for a GPU's low-precision GEMMs
    where XLA lowers for CUDA (``_gpu_gemm.py``: FP8 per-tensor products on cuBLASLt's FP8
    GEMM, block formats as bfloat16; static): the policy (``kernels``: ``"xla"`` keeps the
    portable formulation, exact products summed in float32, on every backend) and JAX able
    to compile for CUDA. No Pallas kernel is involved, so Explicit meshes and sharded
    operands are served too (XLA partitions these GEMMs like any other)."""
    return kernels and cuda_kernels_possible()


def _is_weight(op) -> bool:
    # The decode kernels serve exactly OCP MXFP4 (E2M1 codes, E8M0 scales, blocks of 32).
    return (isinstance(op, MXArray) and op.fmt == mx_format("mxfp4") and op.shape[0] == 1
            and min(op.shape) > 0)


def _is_activation(op, cast) -> bool:
    return (
        not isinstance(op, MXArray) and cast is None and op.dtype == jnp.bfloat16
        and op.shape[0] == 1 and 1 <= op.shape[1] <= MAX_TOKENS
    )


def gemv_route(lhs, rhs, lcast, rcast, kernels: bool) -> Optional[tuple[str, str]]:
    """For canonical operands (B, M, K) x (B, N, K) of a quantized dot: ``(side, route)``
    where the call is a decode-time MXFP4 product that takes a GPU route on CUDA, else None
    (static). ``side`` (``"lhs"``/``"rhs"``) is the weight; ``route`` the policy's
    ``gpu_route`` (``"pallas"``: the kernel of ``_gemv_pallas.py``; ``"xla"``: no kernel).

    The case: no batch (B = 1), one side a packed MXFP4 MXArray (blocked along K, as every
    canonical MXArray is), the other a bfloat16 array used as it is (no format) with at
    most :data:`MAX_TOKENS` rows; for the ``"pallas"`` route also the policy (``kernels``)
    and JAX able to lower it.
    """
    route = current_policy().gpu_route
    if route == "pallas" and not (kernels and _kernels_can_run()):
        return None
    if _is_activation(lhs, lcast) and _is_weight(rhs):
        return "rhs", route
    if _is_weight(lhs) and _is_activation(rhs, rcast):
        return "lhs", route
    return None


@functools.lru_cache(maxsize=None)
def _only_hopper_gpus() -> bool:
    """Whether every GPU JAX sees is a Hopper (sm_90: ``wgmma``), or JAX sees none (the
    CUDA plugin compiling for a compile-only device, which the tests make an H100)."""
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        return True
    return all(str(getattr(d, "compute_capability", "")).split(".")[0] == "9" for d in gpus)


def weight_only_kernel(x, w, kernels: bool) -> bool:
    """Whether ``weight_only_matmul`` of the tokens ``x`` (bfloat16 [M, K]) by the prepared
    weight ``w`` takes the Mosaic GPU kernel of ``_weight_only_mgpu.py`` on CUDA (static):
    the policy (``kernels``), at most 16 tokens, unsharded operands (a single-device call),
    JAX able to lower Mosaic GPU kernels, and GPUs that have ``wgmma`` (Hopper; on other
    GPUs the product takes the generic route)."""
    if not kernels or not 1 <= x.shape[0] <= WEIGHT_ONLY_MAX_TOKENS:
        return False
    if not (unsharded(x) and unsharded(w.words) and unsharded(w.scales)):
        return False
    return (cuda_kernels_possible() and mosaic_gpu_available() and _no_explicit_mesh()
            and _only_hopper_gpus())


@functools.lru_cache(maxsize=None)
def _one_cpu_device() -> bool:
    """Whether the CPU backend has a single device. With several (a host platform device
    count), a program traced inside ``jax.jit`` over Auto mesh axes carries no layout at
    trace time, and the native kernels, single-device custom calls, would have XLA's
    partitioner gather their inputs: they step aside there."""
    try:
        return len(jax.devices("cpu")) == 1
    except RuntimeError:
        return False


def _native_cpu_can_run(x) -> bool:
    return (kernels_enabled() and unsharded(x) and _no_explicit_mesh() and _one_cpu_device()
            and _cpu_native.available())


def cpu_fp6_kernel(x) -> bool:
    """Whether FP6 packing or unpacking of ``x`` along its last axis takes the native CPU
    kernel where XLA lowers for CPU (static, read while tracing): the policy, the kernel
    built and checked (``_cpu_native.available``), and an unsharded input on a one-device
    CPU backend (it is a single-device custom call, which XLA's partitioner would run on
    gathered inputs)."""
    return _native_cpu_can_run(x)


def hwfloat_encoder(cast):
    """The scheme's :class:`~lowprec._scheme.FastEncoder` where XLA's block encode of
    ``cast`` may take the hardware-float formulation (static; the encoder then decides per
    array, at run time, on CPU), else None: nearest-even rounding, an element the short
    encode serves and a scheme with a fast encoder."""
    if cast.rounding != "nearest_even" or not hwfloat_element(cast.fmt.element):
        return None
    return cast.fmt.scheme.fast_encoder()


def hwfloat_values_encoder(cast, words: bool):
    """The scheme's :class:`~lowprec._scheme.FastEncoder` where the fused fake quantization
    of ``cast`` (``_mx_encode.encode_values``, NVFP4-style schemes on CPU) may take the
    hardware-float formulation (static), else None: as :func:`hwfloat_encoder`, and also for
    stochastic rounding by given random words (``words``) with the divide step (its quotients
    by ``_nvfp4.hwfloat_sr_quotients``)."""
    if not (cast.stochastic and words and cast.nvfp4_step != "reciprocal"):
        return hwfloat_encoder(cast)
    return cast.fmt.scheme.fast_encoder() if hwfloat_element(cast.fmt.element) else None


def one_multiply_decoder(fmt):
    """The scheme's :class:`~lowprec._scheme.FastDecoder` where the block decode of ``fmt``
    may take the one-multiply formulation (HWFLOAT: element value times a float32 factor per
    block, picked per array at run time where it is exact; E8M0 scales), else None (static)."""
    fast = fmt.scheme.fast_decoder()
    return fast if fast is not None and fast.one_multiply(fmt.element) else None


def routed_decoder(fmt):
    """The scheme's :class:`~lowprec._scheme.FastDecoder` where the block decode of ``fmt``
    with its tensor scale chooses between two formulations by the scales alone (HWFLOAT: a
    float32 product where every block's factor allows it; NVFP4), else None (static)."""
    if not fmt.scheme.tensor_scale or one_multiply_decoder(fmt) is not None:
        return None
    fast = fmt.scheme.fast_decoder()
    return fast if fast is not None and fast.routes else None


def decode_formulations(fmt) -> frozenset:
    """The :class:`Formulation` s the block decode of ``fmt`` (``dequantize``, fake
    quantization, the dots' decodes) may take (static): EXACT always (every value built from
    bits; on CUDA laid out in one pass, ``_mx_decode.mx_values_blockwise``), HWFLOAT where
    :func:`one_multiply_decoder` or :func:`routed_decoder` gives a fast decoder (on CPU one
    ``lax.cond`` beside EXACT picks it per array, where it is exact), CPU_KERNEL for FP6
    codes (unpacked by the C++ kernel along the last axis where :func:`fp6_kernel` says)."""
    forms = {Formulation.EXACT}
    if one_multiply_decoder(fmt) is not None or routed_decoder(fmt) is not None:
        forms.add(Formulation.HWFLOAT)
    if fmt.element.code_bits == 6 and kernels_enabled() and _cpu_native.available():
        forms.add(Formulation.CPU_KERNEL)
    return frozenset(forms)


def quantize_formulations(x, cast, axis: int, rng=None, tensor_scale=None,
                          fake: bool = False) -> frozenset:
    """The :class:`Formulation` s a ``quantize_mx`` (``fake``: ``fake_quantize_mx``) call of
    the validated input ``x`` may take (static): EXACT always, HWFLOAT where
    :func:`hwfloat_encoder` gives one, PALLAS where :func:`quantize_kernel`, CPU_KERNEL where
    :func:`cpu_quantize_kernel` (quantize), or :func:`cpu_mx_fused_values` (fake)."""
    forms = {Formulation.EXACT}
    if hwfloat_encoder(cast) is not None:
        forms.add(Formulation.HWFLOAT)
    if quantize_kernel(x, cast, axis, fake=fake):
        forms.add(Formulation.PALLAS)
    if not fake and cpu_quantize_kernel(x, cast, axis, rng, tensor_scale):
        forms.add(Formulation.CPU_KERNEL)
    stochastic = rng is not None and any(r is not None for r in rng)  # (key, random words)
    if fake and tensor_scale is None and cpu_mx_fused_values(x, cast, stochastic):
        forms.add(Formulation.CPU_KERNEL)
    return frozenset(forms)


def fp6_kernel(x, axis: int) -> bool:
    """Whether FP6 packing or unpacking of ``x`` along ``axis`` takes the native CPU kernel
    where XLA lowers for CPU (static): along the last axis, as :func:`cpu_fp6_kernel` says."""
    return axis == x.ndim - 1 and cpu_fp6_kernel(x)


def fp6_packer(x, axis: int):
    """The FP6 packer ``_pack.pack_along`` is given for codes ``x`` packed along ``axis``:
    the native CPU kernel (XLA's formulation on other backends) where :func:`fp6_kernel`
    says, else None (``_pack``'s XLA formulation)."""
    if not fp6_kernel(x, axis):
        return None
    return lambda c: on_cpu(_fp6_cpu.pack_last, lambda c: pack6_xla(c, c.ndim - 1), c)


def fp6_unpacker(p, axis: int):
    """The inverse of :func:`fp6_packer` for bytes ``p`` unpacked along ``axis``."""
    if not fp6_kernel(p, axis):
        return None
    return lambda b: on_cpu(_fp6_cpu.unpack_last, lambda b: unpack6_xla(b, b.ndim - 1), b)


def cpu_quantize_kernel(x, cast, axis: int, rng, tensor_scale) -> bool:
    """Whether ``quantize_mx`` of the validated input ``x`` takes a native one-pass CPU
    kernel where XLA lowers for CPU (static): the policy, the kernels built and checked, an
    unsharded input on a one-device CPU backend, and

    * NVFP4 (``_nvfp4_cpu.serves``/``takes``): float32, bfloat16 or float16 input of any
      size blocked along any axis, round to nearest even or stochastically, either step (one
      custom call instead of the ~1,000-instruction encode XLA would compile, and no slower
      than XLA's compiled program at 2^16 to 4096^2 elements; a given tensor scale that is
      not a positive finite float32 takes XLA's formulation by a ``lax.cond``);
    * the E8M0 formats: float32 input blocked along its last axis (other dtypes would be
      widened into a copy first, which XLA's two reads of the narrow input beat),
      deterministic rounding and a cast the kernel serves (``_mx_quantize_cpu.serves``)."""
    if x.ndim == 0 or x.size == 0:
        return False
    if cast.fmt.scheme.tensor_scale:
        return _nvfp4_cpu.serves(cast) and _nvfp4_cpu.takes(x) and _native_cpu_can_run(x)
    if x.dtype != jnp.float32 or axis != x.ndim - 1:
        return False
    stochastic = rng is not None and any(r is not None for r in rng)  # (key, random words)
    if stochastic or tensor_scale is not None or not native_quantize_serves(cast):
        return False
    return _native_cpu_can_run(x)


def cpu_grid_select_kernel(x) -> bool:
    """Whether the selecting formats' block choice (``_grid_select.GridSelectScheme``) of
    blocks ``x`` takes the native CPU kernel where XLA lowers for CPU (static): the policy,
    the kernels built and checked, an unsharded input on a one-device CPU backend, and an
    x86 CPU with AVX2 (the kernel keeps subnormals through the MXCSR, an x86 register)."""
    return _native_cpu_can_run(x) and _cpu_native.vector_quantizer()


def cpu_nvfp4_fake_quantize(x, step, stochastic: bool) -> bool:
    """Whether the NVFP4 training recipe's fake quantization of ``x`` (its
    ``dequantize(quantize_mx(x, "nvfp4", ...))`` and its 16 x 16 weight tiles, computed
    from x's own tensor scale) takes the native kernel's fused call where XLA lowers for CPU
    (static): as :func:`cpu_quantize_kernel` decides for NVFP4 with ``step`` and the
    rounding."""
    from .._options import MXCast  # the options module sits above this one

    cast = MXCast(mx_format("nvfp4"), None, "stochastic" if stochastic else "nearest_even",
                  step)
    return (x.ndim > 0 and x.size > 0 and x.dtype == jnp.float32
            and _nvfp4_cpu.serves(cast)
            and _native_cpu_can_run(x))


def cpu_nvfp4_fused_values(x, cast, words: bool = False) -> bool:
    """Whether the float32 values of ``cast``'s quantization of ``x`` (its
    ``dequantize(quantize_mx(x, ...))``; a quantized dot's operand) take the native kernel's
    fused call where XLA lowers for CPU (static): lowprec's NVFP4 rounded to nearest even, or
    stochastically with given ``words``, as :func:`cpu_nvfp4_fake_quantize` decides."""
    rounding = "stochastic" if words else "nearest_even"
    return (cast.fmt == mx_format("nvfp4") and cast.rounding == rounding
            and cpu_nvfp4_fake_quantize(x, cast.scale_options.nvfp4_step, words))


def cpu_mx_fused_values(x, cast, stochastic: bool = False) -> bool:
    """Whether the float32 values of an E8M0 MX ``cast``'s quantization of ``x`` (its
    ``dequantize(quantize_mx(x, ...))``: ``fake_quantize_mx``, a quantized dot's operand)
    take the native fused kernel (``_mx_fake_cpu.py``) where XLA lowers for CPU (static):
    deterministic rounding (``stochastic``: the call draws or takes random bits), a cast
    the one-pass quantizer serves (E8M0 blocks of 32, round to nearest even, an AVX2 CPU),
    a float32, bfloat16 or float16 input (widened exactly), the policy, the kernels built
    and checked, and an unsharded input on a one-device CPU backend. One custom call in
    place of XLA's encoder and exact decoder (474 StableHLO lines for MXFP8)."""
    from .._options import MXCast  # the options module sits above this one

    return (isinstance(cast, MXCast) and not stochastic and not cast.fmt.scheme.tensor_scale
            and x.ndim > 0 and x.size > 0 and _nvfp4_cpu.takes(x)
            and _mx_fake_cpu.serves(cast) and _native_cpu_can_run(x))


def native_status() -> str:
    """Whether lowprec's native CPU kernels (FP6 packing, one-pass MX and NVFP4 quantization) are
    built and in use here, and if not, why: a sentence. The policy (:func:`set_policy`)
    decides whether they run.

    Example:
        >>> "native CPU kernels" in native_status()
        True
    """
    return _cpu_native.status()


set_policy_reader(lambda: (current_policy().platform_branches == "all"
                           or cuda_kernels_possible()))  # a module global: tests patch it


def by_platform(*args, default, cpu=None, cuda=None):
    """The formulation of the platform XLA lowers for: ``cpu(*args)`` on CPU, ``cuda(*args)``
    on a CUDA GPU (each where given), ``default(*args)`` elsewhere. Every per-platform choice
    of a formulation above this module is made here (:func:`on_cpu`, :func:`on_cuda`); only
    the platforms JAX here can compile for are traced (``_platform.platform_dependent``)."""
    branches = {name: fn for name, fn in (("cpu", cpu), ("cuda", cuda)) if fn is not None}
    return platform_dependent(*args, default=default, **branches)


def on_cpu(fast, generic, *args):
    """``fast(*args)`` where XLA lowers for CPU, ``generic(*args)`` everywhere else (where JAX
    here compiles for CPU alone, ``fast`` alone is traced: :func:`by_platform`)."""
    return by_platform(*args, cpu=fast, default=generic)


def on_cuda(fast, generic, *args):
    """``fast(*args)`` where XLA lowers for a CUDA GPU, ``generic(*args)`` everywhere else
    (where JAX here compiles for CPU alone, ``generic`` alone: :func:`by_platform`)."""
    return by_platform(*args, cuda=fast, default=generic)
