"""The native CPU kernel of the selecting formats' block choice (``_grid_select_cpu.cc``):
Four over Six, IF4 and MixFP4 (docs/design.md §3c) through one custom call.

XLA:CPU compiles ``_grid_select.py``'s integer emulation of their IEEE float32 steps (both
candidates of every block, their left-to-right error sums) to 9,000-13,500 HLO lines: 2.7-4.4
CPU s per ``quantize_mx`` program. The kernel mirrors each step on the bits, for every input
and tensor scalar pattern (``tests/test_native_grid_select.py`` compares it with the XLA
path), so the scheme's ``choose`` is one call on CPU. Loading: ``_cpu_native.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from . import _cpu_native

TARGET = "lowprec_grid_select"
#: The kernel's ``scheme`` attribute of each scheme's registered name.
SCHEMES = {"nvfp4_4over6": 0, "if4": 1, "mixfp4": 2}


def choose(xb, amax, ts_bits, inner: int, scheme: str, mse: bool, fp16: bool = False,
           e4m3_max: int = 256):
    """``(scale codes int32, element value bits uint32)`` of ``GridSelectScheme.choose`` by
    the kernel: blocks ``xb`` (uint32 patterns, blocks along ``inner``, specials zeroed),
    their largest finite magnitudes ``amax`` (xb's shape without ``inner``) and tensor
    scalar bits ``ts_bits`` (broadcastable to ``amax``). CPU only."""
    xl = jnp.moveaxis(xb, inner, -1)
    ts = jnp.broadcast_to(ts_bits, amax.shape)
    out = (jax.ShapeDtypeStruct(amax.shape, jnp.int32),
           jax.ShapeDtypeStruct(xl.shape, jnp.uint32))
    call = jax.ffi.ffi_call(TARGET, out, vmap_method="broadcast_all")
    codes, values = call(xl, amax, ts, scheme=np.int64(SCHEMES[scheme]), mse=bool(mse),
                         fp16=bool(fp16), e4m3_max=np.int64(e4m3_max))
    return codes, jnp.moveaxis(values, -1, inner)


def _check() -> str:
    """'' if the registered handler chooses as derived here for a block of 16 ones under
    the tensor scalar 1 (IF4: encode 2688 / 1; scale E4M3((1 / 6) x 2688) = 448, code 0x7E;
    q = 1 x 1 / ((1 / 2688) x 448) = 6 in float32; E2M1 gives ((6 x 448) x 1) / 2688 = 1 and
    INT4 round(6 x 7/6) = 7 gives (((7 x 448) x 1) x 6/7) / 2688 = 1: both errors are 0,
    and a tie keeps E2M1: code 0x7E, every value 6)."""
    cpu = jax.devices("cpu")[0]
    x = np.full((1, 16), np.float32(1.0)).view(np.uint32)
    amax = np.asarray([np.float32(1.0).view(np.uint32)])
    codes, values = jax.jit(lambda a, m, t: choose(a, m, t, 1, "if4", True))(
        *(jax.device_put(v, cpu) for v in (x, amax, amax)))
    six = int(np.float32(6.0).view(np.uint32))
    if np.asarray(codes).tolist() != [0x7E] or np.asarray(values).tolist() != [[six] * 16]:
        return "IF4's choice of a known block differs from the derived one"
    return ""


_cpu_native.register_kernel("the selecting formats' block choice", {TARGET: "LowprecGridSelect"},
                            _check)
