"""FP4 packing: two 4-bit codes per byte, element 2k in the LOW nibble, 2k+1 in the HIGH one.

This is the OCP MX / gpt-oss / Hugging Face MXFP4 byte layout (docs/design.md §4). Expected
bytes are computed here from that rule with Python integers, never with lowprec.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lowprec
from helpers.mx import unpack_nibbles

ALL_BYTES = np.arange(256, dtype=np.uint8)


def test_hand_example():
    # codes [0x1, 0x2, 0xF, 0x8]: byte 0 = 0x1 | 0x2 << 4 = 0x21, byte 1 = 0xF | 0x8 << 4 = 0x8F.
    packed = lowprec.pack_fp4(jnp.array([0x1, 0x2, 0xF, 0x8], jnp.uint8))
    assert packed.dtype == jnp.uint8
    assert np.asarray(packed).tolist() == [0x21, 0x8F]
    assert np.asarray(lowprec.unpack_fp4(packed)).tolist() == [0x1, 0x2, 0xF, 0x8]


def test_unpack_all_256_bytes():
    codes = np.asarray(lowprec.unpack_fp4(jnp.asarray(ALL_BYTES)))
    assert codes.dtype == np.uint8 and codes.shape == (512,)
    want = [c for b in range(256) for c in (b & 0xF, b >> 4)]  # low nibble first
    assert codes.tolist() == want


def test_round_trip_all_256_bytes_and_all_code_pairs():
    # bytes -> codes -> bytes
    back = lowprec.pack_fp4(lowprec.unpack_fp4(jnp.asarray(ALL_BYTES)))
    assert np.asarray(back).tolist() == ALL_BYTES.tolist()
    # every (even, odd) pair of codes -> one byte -> the same pair
    even, odd = np.meshgrid(np.arange(16), np.arange(16), indexing="ij")
    pairs = np.stack([even.ravel(), odd.ravel()], axis=-1).astype(np.uint8)  # [256, 2]
    packed = np.asarray(lowprec.pack_fp4(jnp.asarray(pairs)))
    assert packed.shape == (256, 1)
    assert packed[:, 0].tolist() == [int(a) | int(b) << 4 for a, b in pairs]
    np.testing.assert_array_equal(np.asarray(lowprec.unpack_fp4(jnp.asarray(packed))), pairs)


@pytest.mark.parametrize("shape, axis", [((6, 4), 0), ((6, 4), 1), ((3, 8, 2), 1), ((2, 3, 4), -1)])
@pytest.mark.quick_first(2)
def test_axis(shape, axis):
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 16, shape, dtype=np.uint8)
    packed = np.asarray(lowprec.pack_fp4(jnp.asarray(codes), axis=axis))
    halved = list(shape)
    halved[axis] //= 2
    assert packed.shape == tuple(halved)
    m = np.moveaxis(codes, axis, -1).astype(np.int64)
    want = np.moveaxis(m[..., 0::2] | (m[..., 1::2] << 4), -1, axis)
    np.testing.assert_array_equal(packed, want)
    np.testing.assert_array_equal(unpack_nibbles(packed, axis), codes)
    np.testing.assert_array_equal(np.asarray(lowprec.unpack_fp4(jnp.asarray(packed), axis=axis)),
                                  codes)


def test_under_jit():
    codes = jnp.asarray(np.tile(np.arange(16, dtype=np.uint8), 4).reshape(4, 16))
    packed = jax.jit(lambda c: lowprec.pack_fp4(c, axis=-1))(codes)
    np.testing.assert_array_equal(np.asarray(packed), np.asarray(lowprec.pack_fp4(codes)))
    back = jax.jit(lambda p: lowprec.unpack_fp4(p, axis=-1))(packed)
    np.testing.assert_array_equal(np.asarray(back), np.asarray(codes))


def test_only_low_four_bits_are_kept():
    # Documented: only the low 4 bits of each entry count. 0x1F -> 0xF, 0x2E -> 0xE: 0xEF.
    packed = lowprec.pack_fp4(jnp.array([0x1F, 0x2E], jnp.uint8))
    assert np.asarray(packed).tolist() == [0xEF]
    # Wider integer dtypes are accepted and give uint8 bytes.
    packed = lowprec.pack_fp4(jnp.array([3, 12], jnp.int32))
    assert packed.dtype == jnp.uint8 and np.asarray(packed).tolist() == [0xC3]


def test_mxfp4_elements_use_this_layout():
    # Quantized MXFP4 elements are packed along the block axis with the same rule: block max 6
    # (scale 127) and elements 1, -0.5, 6, 3 -> codes 0x2, 0x9, 0x7, 0x5 -> bytes 0x92, 0x57.
    x = np.zeros((32, 2), np.float32)
    x[:4, 1] = [1.0, -0.5, 6.0, 3.0]
    mx = lowprec.quantize_mx(jnp.asarray(x), "mxfp4", axis=0)
    assert mx.elements.shape == (16, 2)
    assert np.asarray(mx.elements)[:2, 1].tolist() == [0x92, 0x57]
    np.testing.assert_array_equal(np.asarray(lowprec.unpack_fp4(mx.elements, axis=0)),
                                  unpack_nibbles(mx.elements, 0))


def test_errors():
    with pytest.raises(ValueError, match="even length"):
        lowprec.pack_fp4(jnp.zeros(5, jnp.uint8))
    with pytest.raises(ValueError, match="got 3"):
        lowprec.pack_fp4(jnp.zeros((3, 4), jnp.uint8), axis=0)
    with pytest.raises(TypeError, match="float32"):
        lowprec.pack_fp4(jnp.zeros(4, jnp.float32))
    with pytest.raises(TypeError, match="int32"):
        lowprec.unpack_fp4(jnp.zeros(4, jnp.int32))
    with pytest.raises(ValueError, match="axis 1"):
        lowprec.unpack_fp4(jnp.zeros(4, jnp.uint8), axis=1)


# -- FP6: four 6-bit codes in three bytes, little-endian bit stream (docs/design.md §4) --------


def test_fp6_hand_example():
    # codes [0x3F, 0x00, 0x15, 0x2A]: the 24-bit word 0x3F | 0x00 << 6 | 0x15 << 12 | 0x2A << 18
    # = 0x00003F + 0x015000 + 0xA80000 = 0xA9503F, stored low byte first: 3F 50 A9.
    packed = lowprec.pack_fp6(jnp.array([0x3F, 0x00, 0x15, 0x2A], jnp.uint8))
    assert packed.dtype == jnp.uint8 and np.asarray(packed).tolist() == [0x3F, 0x50, 0xA9]
    assert np.asarray(lowprec.unpack_fp6(packed)).tolist() == [0x3F, 0x00, 0x15, 0x2A]


@pytest.mark.slow  # every 3-byte group: 2^24 of them
def test_fp6_unpack_every_three_byte_group():
    # All 2^24 groups of three bytes: code j is bits 6j..6j+5 of the little-endian word.
    words = np.arange(1 << 24, dtype=np.uint32)
    groups = np.stack([words & 0xFF, (words >> 8) & 0xFF, words >> 16], axis=-1).astype(np.uint8)
    codes = np.asarray(lowprec.unpack_fp6(jnp.asarray(groups.reshape(-1))))
    want = np.stack([(words >> (6 * j)) & 0x3F for j in range(4)], axis=-1).astype(np.uint8)
    np.testing.assert_array_equal(codes.reshape(-1, 4), want)
    back = np.asarray(lowprec.pack_fp6(jnp.asarray(codes)))
    np.testing.assert_array_equal(back, groups.reshape(-1))


@pytest.mark.parametrize("shape, axis", [((8, 3), 0), ((2, 12), 1), ((3, 4, 2), 1)])
@pytest.mark.slow  # left out of the quick tier (seconds; its paths run in other quick tests)
def test_fp6_axis_matches_the_reference_packer(shape, axis):
    import lowprec_reference

    codes = np.random.default_rng(1).integers(0, 64, shape, dtype=np.uint8)
    packed = np.asarray(lowprec.pack_fp6(jnp.asarray(codes), axis=axis))
    np.testing.assert_array_equal(packed, lowprec_reference.pack_codes(codes, 6, axis))
    np.testing.assert_array_equal(np.asarray(lowprec.unpack_fp6(jnp.asarray(packed), axis=axis)),
                                  codes)


def test_fp6_errors():
    with pytest.raises(ValueError, match="multiple of 4"):
        lowprec.pack_fp6(jnp.zeros(6, jnp.uint8))
    with pytest.raises(ValueError, match="multiple of 3 bytes"):
        lowprec.unpack_fp6(jnp.zeros(4, jnp.uint8))
    with pytest.raises(TypeError, match="float32"):
        lowprec.pack_fp6(jnp.zeros(4, jnp.float32))
