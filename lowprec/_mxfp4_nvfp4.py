"""MXFP4 → NVFP4 without requantizing: the exact cast (as NVIDIA ModelOpt offers it).

An MXFP4 block is 32 E2M1 codes under one E8M0 scale 2^k; an NVFP4 block is 16 E2M1 codes
under an E4M3 scale times one float32 tensor scale. Keeping every E2M1 code, an MX block
becomes two NVFP4 blocks whose E4M3 scale is 2^(k − t) under the tensor scale 2^t, which is
exact where E4M3 holds 2^(k − t): the powers of two of E4M3 are 2^-9, 2^-8, 2^-7 (the
subnormals 1, 2 and 4 × 2^-9, codes 0x01, 0x02, 0x04) and 2^-6 ... 2^8 (the normals with a
zero mantissa, code (j + 7) << 3), eighteen consecutive exponents. So t is chosen to put as
many blocks as possible in the window [t − 9, t + 8] (ties: the largest t, so that the
blocks left out are the smallest ones, never the largest), blocks of zeros are exact under
any scale, and only the blocks outside the window are requantized (NVFP4, round to nearest
even, under the same tensor scale), counted in the :class:`CastReport`.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from ._format import mx_format
from ._mx import quantize_mx
from ._mxarray import MXArray

__all__ = ["CastReport", "mxfp4_to_nvfp4"]

_WINDOW = (-9, 8)  # the powers of two E4M3 holds: 2^-9 (subnormal 0x01) ... 2^8 (0x78)
_E8M0_NAN = 0xFF


@dataclasses.dataclass(frozen=True)
class CastReport:
    """What :func:`mxfp4_to_nvfp4` did: ``blocks`` MX blocks of 32, ``exact`` of them kept
    code for code (zero blocks included), ``requantized`` = blocks − exact, ``tensor_scale``
    = 2^``tensor_exponent``."""

    blocks: int
    exact: int
    requantized: int
    tensor_exponent: int

    @property
    def tensor_scale(self) -> float:
        return 2.0 ** self.tensor_exponent


def _e4m3_power_of_two(j: np.ndarray) -> np.ndarray:
    """E4M3 code of 2^j for j in [-9, 8] (others: garbage, masked by the caller)."""
    normal = (j + 7) << 3  # exponent field j + 7, mantissa 0
    subnormal = 1 << np.clip(j + 9, 0, 2)  # m × 2^-9, m = 1, 2, 4
    return np.where(j >= -6, normal, subnormal).astype(np.uint8)


def _best_exponent(k: np.ndarray) -> int:
    """The t in [-126, 127] putting the most exponents ``k`` in [t − 9, t + 8]; ties → the
    largest t. (2^t must be a normal float32.)"""
    if k.size == 0:
        return 0
    counts = np.bincount(k + 127, minlength=255)  # k in [-127, 127]
    cum = np.concatenate([[0], np.cumsum(counts)])
    best_t, best = 0, -1
    for t in range(127, -127, -1):  # from the top: the first maximum is the largest t
        lo, hi = max(t + _WINDOW[0], -127), min(t + _WINDOW[1], 127)
        n = cum[hi + 128] - cum[lo + 127]
        if n > best:
            best_t, best = t, n
    return best_t


def _unpack(p: np.ndarray) -> np.ndarray:
    return np.stack([p & 0xF, p >> 4], axis=-1).reshape(*p.shape[:-1], -1)


def _pack(c: np.ndarray) -> np.ndarray:
    return (c[..., 0::2] | (c[..., 1::2] << 4)).astype(np.uint8)


def mxfp4_to_nvfp4(mx: MXArray) -> tuple:
    """Casts an MXFP4 array (blocks of 32) to NVFP4 (blocks of 16) keeping every E2M1 code:
    ``(nvfp4 MXArray, CastReport)``.

    Blocks whose scale 2^k is 2^(t−9) ... 2^(t+8) under the chosen tensor scale 2^t (and
    blocks of zeros) decode to exactly the same values; the others are requantized from
    their decoded values under the same tensor scale, and counted.

    Args:
      mx: an ``MXArray`` of format ``mxfp4`` (E8M0 scales, blocks of 32), any block axis
        whose length is a multiple of 32.

    Returns:
      ``(MXArray of format nvfp4, CastReport)``.

    Raises:
      ValueError: another format, a padded array, or a NaN block (E8M0 0xFF), which NVFP4
        holds only as a NaN block: it is refused, not guessed.

    Example:
        >>> import lowprec, jax.numpy as jnp
        >>> x = jnp.asarray([[1.0, -0.5] * 16, [2.0**10, 3.0] * 16, [2.0**-30, 0.0] * 16])
        >>> mx = lowprec.quantize_mx(x, "mxfp4")
        >>> nv, rep = mxfp4_to_nvfp4(mx)   # scales 2^-2, 2^8, 2^-32: the last one is out
        >>> rep.blocks, rep.exact, rep.requantized, rep.tensor_scale
        (3, 2, 1, 128.0)
        >>> bool((lowprec.dequantize(nv)[:2] == lowprec.dequantize(mx)[:2]).all())
        True
    """
    fmt = mx.fmt
    if fmt != mx_format("mxfp4"):
        raise ValueError(f"mxfp4_to_nvfp4 takes an mxfp4 MXArray (blocks of 32), got {fmt.name}")
    axis = mx.axis
    n = mx.shape[axis]
    if n % 32 or tuple(mx.elements.shape)[axis] * 2 != n:
        raise ValueError(f"mxfp4_to_nvfp4: the block axis ({n}) must be a multiple of 32, unpadded")
    codes = _unpack(np.moveaxis(np.asarray(mx.elements), axis, -1))  # [..., n]
    scales = np.moveaxis(np.asarray(mx.scales), axis, -1)  # [..., n/32]
    lead = codes.shape[:-1]
    blocks = codes.reshape(-1, 32)
    e = scales.reshape(-1).astype(np.int64)
    if (e == _E8M0_NAN).any():
        where = int(np.flatnonzero(e == _E8M0_NAN)[0])
        raise ValueError(f"mxfp4_to_nvfp4: block {where} has the E8M0 NaN scale 0xFF; NVFP4 "
                         "has no exact counterpart, decode and requantize instead")
    k = e - 127
    zero = ((blocks & 0x7) == 0).all(axis=1)
    t = _best_exponent(k[~zero])
    j = k - t
    exact = zero | ((j >= _WINDOW[0]) & (j <= _WINDOW[1]))
    out_scales = np.where(zero, 0, _e4m3_power_of_two(np.clip(j, *_WINDOW))).astype(np.uint8)
    out_scales = np.repeat(out_scales, 2)  # two NVFP4 blocks of 16 per MX block of 32
    out_codes = blocks.copy()
    nv = mx_format("nvfp4")
    ts = np.float32(2.0 ** t)
    bad = np.flatnonzero(~exact)
    if bad.size:
        e2m1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float64)
        mag = e2m1[blocks[bad] & 0x7] * np.exp2(k[bad].astype(np.float64))[:, None]
        # Exact in float32 except 3·2^127 and up (k = 127), beyond float32: held at its max.
        mag = np.minimum(mag, float(np.finfo(np.float32).max))
        values = np.where(blocks[bad] & 0x8, -mag, mag).astype(np.float32)
        re = quantize_mx(jnp.asarray(values), nv, axis=-1, tensor_scale=jnp.float32(ts))
        out_codes[bad] = _unpack(np.asarray(re.elements))
        sc = out_scales.reshape(-1, 2)
        sc[bad] = np.asarray(re.scales)
        out_scales = sc.reshape(-1)
    new_codes = np.moveaxis(_pack(out_codes.reshape(*lead, n)), -1, axis)
    new_scales = np.moveaxis(out_scales.reshape(*lead, n // 16), -1, axis)
    out = MXArray(elements=jnp.asarray(new_codes), scales=jnp.asarray(new_scales), fmt=nv,
                  axis=axis, shape=mx.shape, tensor_scale=jnp.float32(ts))
    report = CastReport(blocks=int(e.size), exact=int(exact.sum()),
                        requantized=int(bad.size), tensor_exponent=int(t))
    return out, report
