"""FP4 weights stored once in the layout of a tensor-core product's left operand.

A decode step multiplies a few tokens by each weight, so its product is a stream over the
weight: 4.25 (MXFP4) or 4.5 (NVFP4) bits per element that must become bfloat16 tensor-core
operands with as few instructions as possible. :func:`prepare_weight` rearranges an MXFP4 or
NVFP4 weight [N, K] once — at quantization or load time — so that the kernel of
``kernels/_weight_only_mgpu.py`` reads, with one 16-byte load per thread, exactly the 32
elements its registers hold as the left operand A of Hopper's ``wgmma`` (the weight rows are
the product's M side, the tokens its N side), and turns each 32-bit word of them into four
bfloat16 pairs with nine bit operations. Nothing is lost: :meth:`PreparedWeight.to_mxarray`
gives back the MXArray bit for bit.

The layout (docs/design.md §15). The weight is cut into tiles of 64 rows × 64 columns (rows
padded to a multiple of 128 — two tiles, the rows of one kernel program — and columns to a
multiple of 64, with zero codes). In a tile, thread ``tid = 32·w + 4·g + t`` of a warpgroup
holds, for each of the four 16-column slices q of the tile, the ``wgmma`` A fragment of PTX's
m64nNk16 bfloat16 shape: registers a_j (j = 0..3) with rows ``16·w + g + 8·(j mod 2)`` and
columns ``16·q + 8·(j div 2) + 2·t + e`` (e = 0 in the low half of the register, 1 in the
high half). ``words[tile_n, tile_k, tid, q]`` holds those eight elements, E2M1 code bits
(s, e1, e0, m) scattered so that :data:`DECODE_PROGRAM` yields each a_j: bfloat16 pairs with
the sign at bits 15/31 and (e1, e0, m) at bits 8..6 / 24..22, which is the bfloat16 pattern
of value × 2^-126 (E2M1 and bfloat16 both read a zero exponent field as subnormal, so the
code's bits are the value's bits, 126 binades down). ``scales[tile_n, tile_k]`` holds, per
group of four threads sharing rows (``quad = tid // 4``), the scale codes of rows g and g + 8
over the tile's blocks, as 32-bit words of two blocks b = 2·p, 2·p + 1 for both rows: byte
``2·h + (b mod 2)`` of word p (h = 0 for row g, 1 for g + 8) — one word per quad for MXFP4
(two E8M0 blocks of 32), two for NVFP4 (four E4M3 blocks of 16).

How the kernel applies the scale exactly (tested on CPU by running its PTX text through a
NumPy model of the instructions, ``tests/test_prepared_weight.py``):

* two multiplies (any codes): the decoded pair × 2^126 (the value itself), then × the block
  scale as a bfloat16: E8M0 code s gives max(s << 7, 0x0040), so code 0 stays 2^-127 (a
  bfloat16 subnormal; PTX's ``mul.bf16x2`` keeps subnormals); an E4M3 code c gives
  ((c & 0x7F) << 4) × 2^120, its value. Every product is exact (E2M1 × E8M0 has at most two
  significant bits, ≥ 2^-128; E2M1 × E4M3 at most six, in [2^-10, 2688]);
* one multiply (:attr:`PreparedWeight.one_multiply`, decided here from the codes): by
  2^(s−1) = 2^126 · 2^(s−127) for MXFP4 when every block's code is at most 128 (block
  values below 16, which is every practical weight), by E4M3 value × 2^118 for NVFP4 when
  every block scale is a positive normal E4M3 (as lowprec's quantizer and torchao's recipe
  write them), the output then multiplied by the tensor scale × 2^8. Blocks whose codes are
  all ±0 and NaN blocks are exempt (their products do not depend on the factor).

A scale code 0xFF (E8M0) or 0x7F/0xFF (E4M3) makes a block NaN: :attr:`PreparedWeight.nan_rows`
marks the rows holding one, and the product's output row is NaN (as the dequantized values'
dot product gives), set after the kernel rather than by a per-block fix-up in it.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ._format import MXFormat, mx_format
from ._gpt_oss import from_gpt_oss
from ._mxarray import MXArray
from ._scale_rules import ScaleRule

#: Rows and columns of a tile: one warpgroup's ``wgmma`` M (64) by four k16 slices.
TILE_ROWS = 64
TILE_COLS = 64
#: Threads of a warpgroup, each holding 32 elements of a tile in four 32-bit words.
THREADS = 128
WORDS_PER_THREAD = 4
#: Rows are padded to a multiple of this (a kernel program covers two tiles of rows).
ROW_MULTIPLE = 2 * TILE_ROWS
#: The weight formats the layout holds (E2M1 elements; E8M0 blocks of 32, E4M3 of 16).
FORMATS = ("mxfp4", "nvfp4")
#: Scale bytes per thread quad per tile, by format: 2 rows × (64 / block size) blocks.
SCALE_BYTES_PER_QUAD = {"mxfp4": 4, "nvfp4": 8}

# -- the decode program -------------------------------------------------------------------------
#
# Output register j of a word w is ``rotr(w, ROTATE[j]) & OUT_MASK``, except that the bits
# KEEP[j] are taken from w unrotated: a_j = (w & KEEP[j]) | (rotr(w, ROTATE[j]) & (OUT_MASK &
# ~KEEP[j])). OUT_MASK selects, in each 16-bit half, the sign (bit 15) and the three bits an
# E2M1 magnitude occupies below bfloat16's exponent field's second bit (bits 8, 7, 6).
# No four rotations of OUT_MASK tile 32 bits (an exhaustive search; its pattern has a run of
# three bits and a lone bit seven above), so one register takes two sources: nine
# instructions per word (three rotate-and-mask pairs, then a mask, a rotate and a lop3).
OUT_MASK = 0x81C0_81C0
ROTATE = (10, 4, 14, 8)
KEEP = (0, 0, 0, 0x0100_0100)
#: Bit of a bfloat16 half holding each E2M1 code bit: code bit 3 (sign) → 15, bit 2 (e1)
#: → 8, bit 1 (e0) → 7, bit 0 (m) → 6; the high half (odd column) adds 16.
CODE_BIT_POSITIONS = (6, 7, 8, 15)
DECODE_PROGRAM = tuple(zip(ROTATE, KEEP))


def source_bit(j: int, out_bit: int) -> int:
    """The bit of a prepared word that becomes bit ``out_bit`` of output register ``j``."""
    if (KEEP[j] >> out_bit) & 1:
        return out_bit
    return (out_bit + ROTATE[j]) % 32


def _bit_positions() -> np.ndarray:
    """[j, e, b] → the word bit holding code bit b of the element of register j, half e."""
    pos = np.zeros((4, 2, 4), np.uint32)
    for j in range(4):
        for e in range(2):
            for b, p in enumerate(CODE_BIT_POSITIONS):
                pos[j, e, b] = source_bit(j, p + 16 * e)
    assert len(set(pos.ravel().tolist())) == 32  # the program reads every bit exactly once
    return pos


BIT_POSITIONS = _bit_positions()


# -- the prepared weight ------------------------------------------------------------------------


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["words", "scales", "nan_rows", "tensor_scale"],
    meta_fields=["fmt", "shape", "axis", "one_multiply", "scale_rule"],
)
@dataclasses.dataclass(frozen=True)
class PreparedWeight:
    """An MXFP4 or NVFP4 weight in the layout of the decode kernel (a JAX pytree).

    Build it with :func:`prepare_weight`; multiply with :func:`weight_only_matmul`; get the
    MXArray back with :meth:`to_mxarray`. The layout is described in ``lowprec/_prepared.py``
    and docs/design.md §15.

    Attributes:
      words: uint32 [Tn, Tk, 128, 4]: the element codes, per 64×64 tile and thread.
      scales: uint8 [Tn, Tk, 128] (MXFP4) or [Tn, Tk, 256] (NVFP4): the block scale codes,
        per tile and thread quad.
      nan_rows: bool [N]: rows holding a NaN block (their products are NaN).
      tensor_scale: NVFP4's float32 tensor scale (None for MXFP4).
      fmt: the :class:`MXFormat` (``mxfp4`` or ``nvfp4``).
      shape: the logical weight shape (N, K) — the product is x [..., K] → [..., N].
      axis: the block axis of the MXArray it came from (1: a [N, K] weight; 0: [K, N]).
      one_multiply: whether the kernel applies each block's scale with one multiply
        (decided from the codes by :func:`prepare_weight`).
      scale_rule: the MXArray's scale rule (metadata, kept for :meth:`to_mxarray`).
    """

    words: jax.Array
    scales: jax.Array
    nan_rows: jax.Array
    fmt: MXFormat
    shape: tuple
    axis: int = 1
    one_multiply: bool = False
    scale_rule: Optional[ScaleRule] = None
    tensor_scale: Optional[jax.Array] = None

    def __post_init__(self):
        fmt = mx_format(self.fmt) if isinstance(self.fmt, str) else self.fmt
        if not isinstance(fmt, MXFormat) or fmt.name not in FORMATS:
            raise ValueError(f"PreparedWeight holds {' or '.join(FORMATS)}, got {self.fmt!r}")
        object.__setattr__(self, "fmt", fmt)
        shape = tuple(int(d) for d in self.shape)
        if len(shape) != 2 or min(shape) < 1:
            raise ValueError(f"PreparedWeight shape must be (N, K) with N, K >= 1, got {shape}")
        object.__setattr__(self, "shape", shape)
        if self.axis not in (0, 1):
            raise ValueError(f"PreparedWeight axis must be 0 or 1, got {self.axis!r}")
        leaves = (self.words, self.scales, self.nan_rows)
        if not all(hasattr(v, "shape") and hasattr(v, "dtype") for v in leaves):
            return  # placeholders when JAX rebuilds the pytree
        tn, tk = tile_counts(shape)
        want = {
            "words": ((tn, tk, THREADS, WORDS_PER_THREAD), np.uint32),
            "scales": ((tn, tk, SCALE_BYTES_PER_QUAD[fmt.name] * THREADS // 4), np.uint8),
            "nan_rows": ((shape[0],), np.bool_),
        }
        for name, (wshape, wdtype) in want.items():
            v = getattr(self, name)
            if tuple(v.shape) != wshape or np.dtype(v.dtype) != wdtype:
                raise ValueError(
                    f"PreparedWeight {name}: expected {np.dtype(wdtype).name}{list(wshape)} for "
                    f"a {fmt.name} weight of shape {shape}, got {np.dtype(v.dtype).name}"
                    f"{list(v.shape)}")
        has_ts = self.tensor_scale is not None
        if has_ts != (fmt.name == "nvfp4"):
            raise ValueError(f"PreparedWeight: {fmt.name} {'needs' if not has_ts else 'takes no'} "
                             "tensor_scale")
        if has_ts and (tuple(getattr(self.tensor_scale, "shape", ())) != ()
                       or np.dtype(self.tensor_scale.dtype) != np.float32):
            raise ValueError("PreparedWeight tensor_scale must be a float32 scalar")

    @property
    def nbytes(self) -> int:
        """Bytes of storage of the codes and scales (padding included)."""
        return int(np.prod(self.words.shape)) * 4 + int(np.prod(self.scales.shape))

    def to_mxarray(self) -> MXArray:
        """The MXArray this weight was prepared from, bit for bit (jit-compatible).

        Example:
            >>> import jax.numpy as jnp
            >>> import lowprec
            >>> w = lowprec.quantize_mx(jnp.arange(128.0).reshape(2, 64), "mxfp4")
            >>> back = lowprec.prepare_weight(w).to_mxarray()
            >>> bool((back.elements == w.elements).all() and (back.scales == w.scales).all())
            True
        """
        return _unprepare(self)


def tile_counts(shape) -> tuple[int, int]:
    """(row tiles, column tiles) of a weight of logical shape (N, K)."""
    n, k = shape
    return -(-n // ROW_MULTIPLE) * (ROW_MULTIPLE // TILE_ROWS), -(-k // TILE_COLS)


# -- preparation and its inverse (bit moves in integer dtypes; jit-compatible cores) --------------


def _scale_blocks(fmt_name: str) -> int:
    return TILE_COLS // mx_format(fmt_name).block_size  # blocks per tile row: 2 or 4


def _to_words(codes, tn: int, tk: int):
    """uint8 codes [Tn·64, Tk·64] (one per element) → uint32 words [Tn, Tk, 128, 4]."""
    # row = 64·tn + 16·w + 8·h + g, column = 64·tk + 16·q + 8·c + 2·t + e; register j = 2c + h.
    c = codes.astype(jnp.uint32).reshape(tn, 4, 2, 8, tk, 4, 2, 4, 2)  # tn w h g tk q c t e
    c = c.transpose(0, 4, 1, 3, 7, 5, 6, 2, 8)  # tn tk w g t q c h e
    c = c.reshape(tn, tk, THREADS, WORDS_PER_THREAD, 4, 2, 1)  # ..., j = 2c + h, e, (b)
    bits = (c >> jnp.arange(4, dtype=jnp.uint32)) & jnp.uint32(1)  # ..., j, e, b
    # Every code bit has its own word bit: the sum of the shifted bits is their OR.
    return jnp.sum(bits << jnp.asarray(BIT_POSITIONS), axis=(4, 5, 6), dtype=jnp.uint32)


def _from_words(words, tn: int, tk: int):
    """The inverse of :func:`_to_words`."""
    bits = (words[..., None, None, None] >> jnp.asarray(BIT_POSITIONS)) & jnp.uint32(1)
    c = jnp.sum(bits << jnp.arange(4, dtype=jnp.uint32), axis=-1, dtype=jnp.uint32)  # ..., j, e
    c = c.reshape(tn, tk, 4, 8, 4, 4, 2, 2, 2)  # tn tk w g t q c h e
    c = c.transpose(0, 2, 7, 3, 1, 5, 6, 4, 8)  # tn w h g tk q c t e
    return c.reshape(tn * TILE_ROWS, tk * TILE_COLS).astype(jnp.uint8)


def _to_scale_layout(scales, tn: int, tk: int, blocks: int):
    """uint8 block scales [Tn·64, Tk·blocks] → [Tn, Tk, 32·2·blocks]: per quad, words p of
    bytes (h, b mod 2) for blocks b = 2p, 2p + 1."""
    s = scales.reshape(tn, 4, 2, 8, tk, blocks // 2, 2)  # tn w h g tk p b2
    s = s.transpose(0, 4, 1, 3, 5, 2, 6)  # tn tk w g p h b2
    return s.reshape(tn, tk, THREADS // 4 * 2 * blocks)


def _from_scale_layout(s, tn: int, tk: int, blocks: int):
    s = s.reshape(tn, tk, 4, 8, blocks // 2, 2, 2).transpose(0, 2, 5, 3, 1, 4, 6)  # tn w h g tk p b2
    return s.reshape(tn * TILE_ROWS, tk * blocks)


def _unpack_fp4(packed):
    """uint8 [R, C/2] two E2M1 codes per byte (low nibble first) → uint8 [R, C]."""
    lo = packed & jnp.uint8(0xF)
    hi = packed >> jnp.uint8(4)
    return jnp.stack([lo, hi], axis=-1).reshape(packed.shape[0], -1)


def _pack_fp4(codes):
    pairs = codes.reshape(codes.shape[0], -1, 2)
    return pairs[..., 0] | (pairs[..., 1] << jnp.uint8(4))


@functools.partial(jax.jit, static_argnames=("fmt_name", "shape"))
def _prepare_core(elements, scales, *, fmt_name: str, shape: tuple):
    """Row-major [N, Kp/2] packed codes and [N, Kp/block] scales → (words, scales, nan_rows)."""
    n, k = shape
    tn, tk = tile_counts(shape)
    blocks = _scale_blocks(fmt_name)
    codes = _unpack_fp4(elements)
    codes = jnp.pad(codes, ((0, tn * TILE_ROWS - n), (0, tk * TILE_COLS - codes.shape[1])))
    # Padding blocks get scale code 0x7F (E8M0 1.0; E4M3 NaN, but its rows are sliced off
    # and its codes are zero): any code gives zero products, and 0x7F keeps the one-multiply
    # kernel's factor finite for MXFP4.
    sc = jnp.pad(scales, ((0, tn * TILE_ROWS - n), (0, tk * blocks - scales.shape[1])),
                 constant_values=np.uint8(0x7F))
    nan_code = 0xFF if fmt_name == "mxfp4" else 0x7F
    nan_blocks = (scales == nan_code) if fmt_name == "mxfp4" else ((scales & 0x7F) == nan_code)
    return (_to_words(codes, tn, tk), _to_scale_layout(sc, tn, tk, blocks),
            jnp.any(nan_blocks, axis=1))


@functools.partial(jax.jit, static_argnames=("fmt_name", "shape", "kp"))
def _unprepare_core(words, scales, *, fmt_name: str, shape: tuple, kp: int):
    n, _ = shape
    tn, tk = tile_counts(shape)
    blocks = _scale_blocks(fmt_name)
    codes = _from_words(words, tn, tk)[:n, :kp]
    sc = _from_scale_layout(scales, tn, tk, blocks)[:n, : kp // mx_format(fmt_name).block_size]
    return _pack_fp4(codes), sc


def row_mxarray(pw: PreparedWeight) -> MXArray:
    """The weight as an MXArray [N, K] blocked along axis 1, whatever its original axis
    (the operand of the generic product x @ W.T)."""
    n, k = pw.shape
    block = pw.fmt.block_size
    kp = -(-k // block) * block
    el, sc = _unprepare_core(pw.words, pw.scales, fmt_name=pw.fmt.name, shape=pw.shape, kp=kp)
    return MXArray(el, sc, pw.fmt, 1, (n, k), pw.scale_rule, pw.tensor_scale)


def _unprepare(pw: PreparedWeight) -> MXArray:
    rows = row_mxarray(pw)
    if pw.axis == 1:
        return rows
    n, k = pw.shape
    kp = rows.elements.shape[1] * 2
    return MXArray(_transpose_packed(rows.elements, n, kp), rows.scales.T, pw.fmt, 0, (k, n),
                   pw.scale_rule, pw.tensor_scale)


def _transpose_packed(el, n: int, kp: int):
    """Codes [N, Kp/2] packed along K → the [K, N] weight's codes [Kp/2, N], packed along 0."""
    codes = _unpack_fp4(el)  # [N, Kp]
    t = codes.T.reshape(kp // 2, 2, n)  # pairs along K, now axis 0
    return t[:, 0, :] | (t[:, 1, :] << jnp.uint8(4))


def _as_rows(w: MXArray):
    """An MXArray [N, K] blocked along 1, or [K, N] blocked along 0 → row-major packed codes
    [N, Kp/2] and scales [N, Kp/block] of the [N, K] weight."""
    if w.axis == 1:
        return w.elements, w.scales
    kp2, n = w.elements.shape
    lo = w.elements & jnp.uint8(0xF)
    hi = w.elements >> jnp.uint8(4)
    codes = jnp.stack([lo, hi], axis=1).reshape(2 * kp2, n)  # [Kp, N]
    return _pack_fp4(codes.T), w.scales.T


def _is_concrete(*arrays) -> bool:
    return not any(isinstance(a, jax.core.Tracer) for a in arrays)


def _one_multiply(fmt_name: str, codes_nonzero_blocks: np.ndarray, scales: np.ndarray) -> bool:
    """Whether every block's factor fits one bfloat16 multiply (see the module docstring)."""
    if fmt_name == "mxfp4":
        ok = (scales <= 128) | (scales == 0xFF)
    else:
        ok = ((scales >= 0x08) & (scales <= 0x7E)) | ((scales & 0x7F) == 0x7F)
    return bool(np.all(ok | ~codes_nonzero_blocks))


def prepare_weight(w, *, scale_rule: Optional[Union[str, ScaleRule]] = None) -> PreparedWeight:
    """Rearranges an MXFP4 or NVFP4 weight once for the decode-time product.

    The weight's codes and scales are moved, not changed, into the layout whose 16-byte
    loads are the left operand of the decode kernel's tensor-core product
    (``lowprec/_prepared.py``, docs/design.md §15); :meth:`PreparedWeight.to_mxarray` moves
    them back. Call it where the weight is quantized or loaded, outside ``jax.jit``: it reads
    the scale codes to choose how the kernel applies them, and checks them.

    Args:
      w: an MXFP4 or NVFP4 :class:`~lowprec.MXArray` of shape [N, K] blocked along axis 1
        (the product is x @ w.T) or [K, N] blocked along axis 0 (x @ w); or the gpt-oss /
        Hugging Face pair ``(blocks, scales)`` of an MXFP4 weight [N, K]
        (:func:`~lowprec.from_gpt_oss`).
      scale_rule: for ``(blocks, scales)``: the rule that chose the scales (metadata).

    Returns:
      A :class:`PreparedWeight`.

    Raises:
      TypeError: under ``jax.jit`` (the codes must be concrete), or for another input type.
      ValueError: for another format, rank or block axis, or NVFP4 block scales with the
        sign bit set over non-zero elements (no quantizer writes them; the kernel reads E4M3
        scales as magnitudes).

    Example:
        >>> import jax.numpy as jnp
        >>> import lowprec
        >>> w = lowprec.quantize_mx(jnp.ones((256, 64)), "mxfp4")
        >>> pw = lowprec.prepare_weight(w)
        >>> pw.words.shape, pw.scales.shape, pw.one_multiply
        ((4, 1, 128, 4), (4, 1, 128), True)
    """
    if isinstance(w, tuple) and len(w) == 2:
        w = from_gpt_oss(*w, scale_rule=scale_rule)
        if w.ndim != 2:
            raise ValueError(f"prepare_weight takes one weight: blocks [N, K/32, 16], got a "
                             f"weight of shape {w.shape} (index the expert or layer first)")
    if not isinstance(w, MXArray):
        raise TypeError(f"prepare_weight takes an MXArray or a (blocks, scales) pair, got "
                        f"{type(w).__name__}")
    if w.fmt.name not in FORMATS:
        raise ValueError(f"prepare_weight holds {' or '.join(FORMATS)} weights (E2M1 elements), "
                         f"got {w.fmt.name}; use dot_general for other formats")
    if w.ndim != 2 or w.elements.ndim != 2:
        raise ValueError(f"prepare_weight takes a 2-D weight, got shape {w.shape} "
                         f"(elements {tuple(w.elements.shape)}); index the expert or layer first")
    leaves = [w.elements, w.scales] + ([w.tensor_scale] if w.tensor_scale is not None else [])
    if not _is_concrete(*leaves):
        raise TypeError(
            "prepare_weight needs concrete arrays (it reads the scale codes to choose the "
            "kernel's arithmetic and checks them): call it outside jax.jit, where the weight is "
            "quantized or loaded")
    shape = (w.shape[0], w.shape[1]) if w.axis == 1 else (w.shape[1], w.shape[0])
    elements, scales = _as_rows(w)
    name = w.fmt.name
    words, sc, nan_rows = _prepare_core(elements, scales, fmt_name=name, shape=shape)
    # The choice of arithmetic and the sign check read the codes on the host.
    s_np = np.asarray(scales)
    nonzero = _nonzero_blocks(np.asarray(elements), w.fmt.block_size)
    if name == "nvfp4":
        negative = ((s_np & 0x80) != 0) & (s_np != 0xFF) & nonzero
        if negative.any():
            r, b = np.argwhere(negative)[0]
            raise ValueError(
                f"prepare_weight: {int(negative.sum())} NVFP4 block scale code(s) have the sign "
                f"bit set over non-zero elements (first: row {r}, block {b}, code "
                f"{int(s_np[r, b]):#04x}); the decode kernel reads E4M3 block scales as "
                "magnitudes. Use dot_general with this MXArray instead")
    one = _one_multiply(name, nonzero, s_np)
    return PreparedWeight(words, sc, nan_rows, w.fmt, shape, w.axis, one, w.scale_rule,
                          w.tensor_scale)


def _nonzero_blocks(packed: np.ndarray, block: int) -> np.ndarray:
    """[N, blocks]: whether a block holds a code other than ±0 (0 or 8)."""
    mags = (packed & 0x77) != 0  # both nibbles' magnitude bits
    return mags.reshape(packed.shape[0], -1, block // 2).any(axis=2)
