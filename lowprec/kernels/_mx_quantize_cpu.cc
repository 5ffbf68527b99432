// One-pass MX quantization on CPU as an XLA FFI target: E8M0-scaled blocks along the last
// axis of float32 input, round to nearest even, saturating; element codes packed (8, 6 or 4
// bits) and one scale code per block.
//
// XLA:CPU compiles lowprec's quantizer to a block-max reduction and an encode that reads x
// again (it fuses no reduction into its consumer), plus a packing pass for FP6: two or three
// passes over the data. This loop reads each block once. It computes what the XLA path
// computes, from the same definitions (docs/design.md §3, §5; lowprec/_scale_rules.py,
// lowprec/_mx_hwfloat.py): the block's largest magnitude from the float32 bits, its shared
// exponent s by the scale rule in integers, clamped to [-127, 127] (code 0xFF for a block
// holding a NaN or an infinity, whose elements are all code 0), then each element
// RNE(|x| 2^-s) in the element format, saturated at its largest finite magnitude, with x's
// sign bit (-0 keeps it) or two's complement. The element encode is the XLA path's fast one
// (one float multiply, exact where the block's s allows it, and a rebias-and-round on the
// product's bits) or, for the other blocks, an exact integer one; neither depends on how
// the CPU treats subnormals. tests/test_native_mx_quantize.py checks it against the XLA
// path bit for bit.
//
// The format is a set of integers (FFI attributes) computed by _mx_quantize_cpu.py from the
// format's definition.

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "_cpu_common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

enum Rule : int64_t { kFloor = 0, kCeil = 1, kEven = 2, kRceil = 3 };

struct Format {
  int32_t mantissa_bits;   // M: the element's stored mantissa bits
  int32_t emin;            // the element's smallest normal exponent
  int32_t emax_elem;       // floor(log2 of the largest element)
  uint32_t max_code;       // largest finite magnitude code (saturation)
  int32_t code_bits;       // 8, 6 or 4
  bool twos_complement;    // the MX INT8 element; else sign-magnitude
  int64_t rule;
  int32_t block;           // elements per block
  uint32_t even_drop;      // EVEN: float32 mantissa bits dropped when rounding amax
  int32_t rceil_k;         // RCEIL: max_elem = 1.f x 2^k ...
  uint32_t rceil_mant;     // ... with mantissa field f
  uint32_t rceil_small;    // bits of max_elem x 2^-126
  uint32_t rceil_thr;      // bits of the largest float32 <= max_elem x (2^-127 + 2^-150)
};

constexpr uint32_t kAbs = 0x7FFF'FFFFu;
constexpr uint32_t kInf = 0x7F80'0000u;  // float32 +inf: block maxima at or above it are NaN/Inf

inline int32_t FloorLog2Bits(uint32_t a) {  // floor(log2 v) of a float32 pattern v >= 0; 0: -150
  const int32_t efield = static_cast<int32_t>(a >> 23);
  if (efield > 0) return efield - 127;
  const uint32_t m = a & 0x7F'FFFFu;
  return m == 0 ? -150 : (31 - __builtin_clz(m)) - 149;
}

// The block's E8M0 code from its largest magnitude's bits (the rules of _scale_rules.py).
inline uint32_t ScaleCode(uint32_t amax, const Format& f) {
  if (amax >= kInf) return 0xFF;
  int32_t shared;
  switch (f.rule) {
    case kFloor:
      shared = FloorLog2Bits(amax) - f.emax_elem;
      break;
    case kCeil: {
      const uint32_t sig = amax & 0x7F'FFFFu;
      const bool not_pow2 = (amax >> 23) > 0 ? sig != 0 : (sig & (sig - 1)) != 0;
      shared = FloorLog2Bits(amax) + (not_pow2 ? 1 : 0) - f.emax_elem;
      break;
    }
    case kEven: {
      const uint32_t keep = ~((1u << f.even_drop) - 1u);
      shared = FloorLog2Bits((amax + (1u << (f.even_drop - 1))) & keep) - f.emax_elem;
      break;
    }
    default: {  // kRceil: the E8M0 code of float32(amax / max_elem) rounded up
      int32_t code;
      if (amax < f.rceil_small) {
        code = amax > f.rceil_thr ? 1 : 0;
      } else {
        const int32_t efield = static_cast<int32_t>(amax >> 23);
        code = std::min(efield - f.rceil_k + ((amax & 0x7F'FFFFu) > f.rceil_mant ? 1 : 0), 0xFE);
      }
      shared = code - 127;
      break;
    }
  }
  return static_cast<uint32_t>(std::clamp(shared, -127, 127) + 127);
}

// The element loop's format numbers, as locals the compiler can keep in registers.
struct ElementParams {
  int32_t m, emin, top_max;  // mantissa bits, smallest normal exponent, emax_elem + 2
  uint32_t max_code, sign_shift, code_mask;
  // The fast encode (_mx_hwfloat.encode_magnitudes): float32 exponent field moved to the
  // element's bias with half an ulp less one added; results below 2^emin by adding a float
  // whose ulp is the element's subnormal quantum.
  uint32_t shift, rebias, magic_bits, sub_below;
  int32_t s_min;  // smallest shared exponent at which the fast encode is exact
};

template <bool kTwos>
inline uint32_t Signed(uint32_t mag, uint32_t b, const ElementParams& p) {
  if (kTwos) return (b >> 31) ? (0u - mag) & p.code_mask : mag;
  return mag | ((b >> 31) << p.sign_shift);
}

// Code of one element by the fast encode: |x| 2^-s as one float32 multiply (exact whenever
// the product is normal; below 2^-126 it rounds to code 0 either way, which also makes a
// flushing MXCSR harmless), then the element's rounding on the product's bits. Exact for
// the blocks whose shared exponent lies in [s_min, 126] (_scheme_e8m0.py says why).
template <bool kTwos>
inline uint32_t ElementCodeFast(uint32_t b, float factor, const ElementParams& p) {
  float mag_f;
  const uint32_t a = b & kAbs;
  std::memcpy(&mag_f, &a, sizeof mag_f);
  const float qf = mag_f * factor;
  uint32_t q;
  std::memcpy(&q, &qf, sizeof q);
  const uint32_t lsb = (q >> p.shift) & 1u;
  const uint32_t normal = (q + p.rebias + lsb) >> p.shift;
  float magic;
  std::memcpy(&magic, &p.magic_bits, sizeof magic);
  const float sf = qf + magic;
  uint32_t sb;
  std::memcpy(&sb, &sf, sizeof sb);
  const uint32_t sub = sb - p.magic_bits;
  const uint32_t mag = std::min(q < p.sub_below ? sub : normal, p.max_code);
  return Signed<kTwos>(mag, b, p);
}

// Code of one element (float32 pattern b, its block's shared exponent s) in integers only,
// exact for every s (the blocks the fast encode does not serve), with no branch on the
// value, so that the compiler vectorizes the loop over a block (AVX2's variable shifts).
template <bool kTwos>
inline uint32_t ElementCode(uint32_t b, int32_t s, const ElementParams& p) {
  const uint32_t a = b & kAbs;
  const int32_t efield = static_cast<int32_t>(a >> 23);
  const uint32_t mant = a & 0x7F'FFFFu;
  const bool normal = efield > 0;
  const uint32_t sig = normal ? mant | 0x80'0000u : mant;  // |x| = sig 2^e2
  const int32_t e2 = (normal ? efield : 1) - 150;
  // floor(log2 sig): 23 for normals; for subnormals from the exponent field of float(sig),
  // exact (sig < 2^23); sig = 0 gives -127, whose code is 0 below anyway.
  const float fsig = static_cast<float>(static_cast<int32_t>(mant));
  uint32_t fbits;
  std::memcpy(&fbits, &fsig, sizeof fbits);
  const int32_t lg = normal ? 23 : static_cast<int32_t>(fbits >> 23) - 127;
  const int32_t ev = lg + e2 - s;                          // floor(log2 |x| 2^-s)
  const int32_t binade = std::max(ev, p.emin);
  // |x| 2^-s in units of the element's quantum 2^(binade - M), rounded to nearest even.
  // sh <= 0 only when sig has at most M + 1 significant bits, so the left shift is exact.
  const int32_t sh = binade - p.m - (e2 - s);
  const uint32_t right = static_cast<uint32_t>(std::min(std::max(sh, 0), 31));
  const uint32_t left = static_cast<uint32_t>(std::min(std::max(-sh, 0), 31));
  const uint32_t k0 = (sig >> right) << left;
  const uint32_t rem = sig & ((1u << right) - 1u);
  const uint32_t half = (1u << right) >> 1;  // 0 when nothing is dropped (rem = 0 then)
  const uint32_t up = static_cast<uint32_t>(rem > half) |
                      (static_cast<uint32_t>(rem == half) & static_cast<uint32_t>(right != 0) & k0);
  const uint32_t k = k0 + (up & 1u);
  // Code: binades above emin, then the quantum count (its 2^M implicit bit included, so a
  // count that rounds up to 2^(M+1) lands on the next binade's first code); saturated.
  const uint32_t top = static_cast<uint32_t>(std::min(binade, p.top_max) - p.emin);
  const uint32_t mag = std::min((top << p.m) + k, p.max_code);
  return Signed<kTwos>(mag, b, p);
}

// The element loop's numbers for a format.
ElementParams ParamsOf(const Format& f) {
  const uint32_t shift = 23u - static_cast<uint32_t>(f.mantissa_bits);
  const int32_t bias = 1 - f.emin;  // the element's exponent bias
  return ElementParams{f.mantissa_bits,
                       f.emin,
                       f.emax_elem + 2,
                       f.max_code,
                       static_cast<uint32_t>(f.code_bits - 1),
                       (1u << f.code_bits) - 1u,
                       shift,
                       (static_cast<uint32_t>(bias - 127) << 23) + (1u << (shift - 1)) - 1u,
                       static_cast<uint32_t>(f.emin - f.mantissa_bits + 23 + 127) << 23,
                       static_cast<uint32_t>(f.emin + 127) << 23,
                       -126 - (f.emin - f.mantissa_bits - 1)};
}

// A block's codes (one per byte) written in the element layout: 8-bit as they are; FP4 two
// per byte, element 2k in the low nibble (each pair read as one little-endian 16-bit word);
// FP6 in its 3-byte groups.
template <int kBits>
inline void StoreBlock(const uint8_t* codes, int32_t n, uint8_t* out) {
  if (kBits == 8) {
    std::memcpy(out, codes, static_cast<size_t>(n));
  } else if (kBits == 4) {
    for (int32_t i = 0; i < n / 2; ++i) {
      uint16_t pair;
      std::memcpy(&pair, codes + 2 * i, sizeof pair);
      out[i] = static_cast<uint8_t>((pair & 0xF) | ((pair >> 4) & 0xF0));
    }
  } else {
    lowprec_native::PackFp6(codes, out, static_cast<size_t>(n / 4));
  }
}

// Blocks [first, first + count) of kBlock elements (0: f.block, known at run time only).
template <int kBits, bool kTwos, int kBlock>
void Blocks(const float* x, uint8_t* elements, uint8_t* scales, size_t first, size_t count,
            const Format& f, const ElementParams& p) noexcept {
  const int32_t block = kBlock > 0 ? kBlock : f.block;
  const size_t bytes_per_block = static_cast<size_t>(block) * kBits / 8;
  uint8_t codes[256];
  for (size_t blk = first; blk < first + count; ++blk) {
    const float* xb = x + blk * block;
    uint8_t* out = elements + blk * bytes_per_block;
    uint32_t amax = 0;
    for (int32_t i = 0; i < block; ++i) {
      amax = std::max(amax, lowprec_native::Bits(xb + i) & kAbs);
    }
    const uint32_t code = ScaleCode(amax, f);
    scales[blk] = static_cast<uint8_t>(code);
    if (code == 0xFF) {
      std::memset(out, 0, bytes_per_block);
      continue;
    }
    const int32_t s = static_cast<int32_t>(code) - 127;
    if (s >= p.s_min && s <= 126) {
      const uint32_t factor_bits = static_cast<uint32_t>(127 - s) << 23;  // 2^-s, normal
      float factor;
      std::memcpy(&factor, &factor_bits, sizeof factor);
      for (int32_t i = 0; i < block; ++i) {
        codes[i] = static_cast<uint8_t>(
            ElementCodeFast<kTwos>(lowprec_native::Bits(xb + i), factor, p));
      }
    } else {
      for (int32_t i = 0; i < block; ++i) {
        codes[i] = static_cast<uint8_t>(ElementCode<kTwos>(lowprec_native::Bits(xb + i), s, p));
      }
    }
    StoreBlock<kBits>(codes, block, out);
  }
}

// The portable loop (any block size, any CPU), specialized by code width, sign encoding and
// the block sizes 32 (OCP MX) and 16. lowprec sends quantize_mx here only through the AVX2
// loop below (RunBlocks); this one serves other CPUs and block sizes when called directly,
// and the tests, at about XLA's speed.
void QuantizeBlocks(const float* x, uint8_t* elements, uint8_t* scales, size_t first,
                    size_t count, const Format& f) noexcept {
  const ElementParams p = ParamsOf(f);
#define LOWPREC_BLOCKS(BITS, TWOS)                                                  \
  (f.block == 32   ? Blocks<BITS, TWOS, 32>(x, elements, scales, first, count, f, p) \
   : f.block == 16 ? Blocks<BITS, TWOS, 16>(x, elements, scales, first, count, f, p) \
                   : Blocks<BITS, TWOS, 0>(x, elements, scales, first, count, f, p))
  if (f.twos_complement) {  // the MX INT8 element: 8-bit codes
    LOWPREC_BLOCKS(8, true);
  } else if (f.code_bits == 8) {
    LOWPREC_BLOCKS(8, false);
  } else if (f.code_bits == 6) {
    LOWPREC_BLOCKS(6, false);
  } else {
    LOWPREC_BLOCKS(4, false);
  }
#undef LOWPREC_BLOCKS
}

#ifdef LOWPREC_X86_AVX2
// Blocks of 32 with AVX2 intrinsics: the element loop of ElementCodeFast on 4 vectors of 8
// lanes, kept in registers through the packing (compiler-vectorized loops writing codes to
// memory and packing them from there ran 1.5-2.5x slower for FP4/FP6). Blocks the fast
// encode does not serve take ElementCode. 3.4-4.3 ms at 4096 x 4096 float32 on 2 cores,
// against 3.1 ms for XLA's jnp.sum of the same input (a read alone).
struct Avx2Params {
  __m256i abs, rebias, one, magic_bits, sub_below, max_code, code_mask;
  __m128i shift, sign_shift;
  __m256 magic;
};

template <bool kTwos>
__attribute__((target("avx2"))) inline __m256i FastCodes8(__m256i b, __m256 factor,
                                                         const Avx2Params& v) {
  const __m256 qf = _mm256_mul_ps(_mm256_castsi256_ps(_mm256_and_si256(b, v.abs)), factor);
  const __m256i q = _mm256_castps_si256(qf);
  const __m256i lsb = _mm256_and_si256(_mm256_srl_epi32(q, v.shift), v.one);
  const __m256i normal =
      _mm256_srl_epi32(_mm256_add_epi32(_mm256_add_epi32(q, v.rebias), lsb), v.shift);
  const __m256i sub =
      _mm256_sub_epi32(_mm256_castps_si256(_mm256_add_ps(qf, v.magic)), v.magic_bits);
  // q and sub_below are non-negative as int32 (q: a finite magnitude's bits).
  const __m256i is_sub = _mm256_cmpgt_epi32(v.sub_below, q);
  const __m256i mag = _mm256_min_epu32(_mm256_blendv_epi8(normal, sub, is_sub), v.max_code);
  if (kTwos) {
    const __m256i neg = _mm256_srai_epi32(b, 31);  // all ones for a negative x
    return _mm256_and_si256(_mm256_sub_epi32(_mm256_xor_si256(mag, neg), neg), v.code_mask);
  }
  return _mm256_or_si256(mag, _mm256_sll_epi32(_mm256_srli_epi32(b, 31), v.sign_shift));
}

// 32 codes (4 vectors of 8 32-bit lanes, each < 256) to their 32 bytes, in order.
__attribute__((target("avx2"))) inline __m256i Narrow(const __m256i c[4]) {
  const __m256i bytes = _mm256_packus_epi16(_mm256_packus_epi32(c[0], c[1]),
                                            _mm256_packus_epi32(c[2], c[3]));
  return _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

template <int kBits>
__attribute__((target("avx2"))) inline void Store32(__m256i bytes, uint8_t* out) {
  if (kBits == 8) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), bytes);
  } else if (kBits == 4) {  // each 16-bit pair to one byte, element 2k in the low nibble
    const __m256i pair = _mm256_or_si256(
        _mm256_and_si256(bytes, _mm256_set1_epi16(0x000F)),
        _mm256_and_si256(_mm256_srli_epi16(bytes, 4), _mm256_set1_epi16(0x00F0)));
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi16(pair, pair), 0b1000);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm256_castsi256_si128(packed));
  } else {  // FP6: 24 bytes, written without touching byte 24 (the next block's)
    const __m256i g = lowprec_native::Fp6GroupsAvx2(bytes);
    const __m128i hi = _mm256_extracti128_si256(g, 1);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm256_castsi256_si128(g));  // 0..15
    _mm_storel_epi64(reinterpret_cast<__m128i*>(out + 12), hi);                     // 12..19
    const uint32_t last = static_cast<uint32_t>(_mm_extract_epi32(hi, 2));
    std::memcpy(out + 20, &last, sizeof last);                                       // 20..23
  }
}

template <int kBits, bool kTwos>
__attribute__((target("avx2"))) void Blocks32Avx2(const float* x, uint8_t* elements,
                                                  uint8_t* scales, size_t first, size_t count,
                                                  const Format& f, const ElementParams& p) noexcept {
  const Avx2Params v{_mm256_set1_epi32(static_cast<int>(kAbs)),
                     _mm256_set1_epi32(static_cast<int>(p.rebias)),
                     _mm256_set1_epi32(1),
                     _mm256_set1_epi32(static_cast<int>(p.magic_bits)),
                     _mm256_set1_epi32(static_cast<int>(p.sub_below)),
                     _mm256_set1_epi32(static_cast<int>(p.max_code)),
                     _mm256_set1_epi32(static_cast<int>(p.code_mask)),
                     _mm_cvtsi32_si128(static_cast<int>(p.shift)),
                     _mm_cvtsi32_si128(static_cast<int>(p.sign_shift)),
                     _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int>(p.magic_bits)))};
  constexpr size_t kBytes = 32 * kBits / 8;
  for (size_t blk = first; blk < first + count; ++blk) {
    const float* xb = x + blk * 32;
    uint8_t* out = elements + blk * kBytes;
    __m256i b[4];  // the float32 bits, by a float load reinterpreted in registers
    for (int j = 0; j < 4; ++j) b[j] = _mm256_castps_si256(_mm256_loadu_ps(xb + 8 * j));
    // Block maximum of the magnitudes: unsigned max, then across the lanes.
    __m256i m = _mm256_max_epu32(_mm256_max_epu32(_mm256_and_si256(b[0], v.abs), _mm256_and_si256(b[1], v.abs)),
                                 _mm256_max_epu32(_mm256_and_si256(b[2], v.abs), _mm256_and_si256(b[3], v.abs)));
    __m128i m4 = _mm_max_epu32(_mm256_castsi256_si128(m), _mm256_extracti128_si256(m, 1));
    m4 = _mm_max_epu32(m4, _mm_shuffle_epi32(m4, 0b01001110));
    m4 = _mm_max_epu32(m4, _mm_shuffle_epi32(m4, 0b10110001));
    const uint32_t code = ScaleCode(static_cast<uint32_t>(_mm_cvtsi128_si32(m4)), f);
    scales[blk] = static_cast<uint8_t>(code);
    if (code == 0xFF) {
      std::memset(out, 0, kBytes);
      continue;
    }
    const int32_t s = static_cast<int32_t>(code) - 127;
    __m256i c[4];
    if (s >= p.s_min && s <= 126) {
      const __m256 factor = _mm256_castsi256_ps(_mm256_set1_epi32((127 - s) << 23));  // 2^-s
      for (int j = 0; j < 4; ++j) c[j] = FastCodes8<kTwos>(b[j], factor, v);
    } else {
      alignas(32) uint32_t codes[32];
      for (int i = 0; i < 32; ++i) codes[i] = ElementCode<kTwos>(lowprec_native::Bits(xb + i), s, p);
      for (int j = 0; j < 4; ++j) c[j] = _mm256_load_si256(reinterpret_cast<const __m256i*>(codes + 8 * j));
    }
    Store32<kBits>(Narrow(c), out);
  }
}

#endif

// Blocks [first, first + count), by the AVX2 loop where it serves, else the portable one.
void RunBlocks(const float* x, uint8_t* elements, uint8_t* scales, size_t first,
               size_t count, const Format& f) noexcept {
#ifdef LOWPREC_X86_AVX2
  if (f.block == 32 && lowprec_native::HasAvx2()) {
    const ElementParams p = ParamsOf(f);
    if (f.twos_complement) return Blocks32Avx2<8, true>(x, elements, scales, first, count, f, p);
    if (f.code_bits == 8) return Blocks32Avx2<8, false>(x, elements, scales, first, count, f, p);
    if (f.code_bits == 6) return Blocks32Avx2<6, false>(x, elements, scales, first, count, f, p);
    return Blocks32Avx2<4, false>(x, elements, scales, first, count, f, p);
  }
#endif
  QuantizeBlocks(x, elements, scales, first, count, f);
}

// The format from its integer attributes (_mx_quantize_cpu.attributes), or false for
// attributes outside the bounds the loops take: any other caller gets a refusal rather than
// shifts of 32 bits or more and float32 patterns out of their fields. Every OCP MX format
// lies well inside these bounds (codes of at most 8 bits, element quanta that are float32
// normals).
bool MakeFormat(int64_t mantissa_bits, int64_t emin, int64_t emax_elem, int64_t max_code,
                int64_t code_bits, bool twos_complement, int64_t rule, int64_t block,
                int64_t even_drop, int64_t rceil_k, int64_t rceil_mant, int64_t rceil_small,
                int64_t rceil_thr, Format* f) {
  const bool sizes_ok = block > 0 && block <= 256 && block % 4 == 0 &&
                        (code_bits == 8 || code_bits == 6 || code_bits == 4) &&
                        (!twos_complement || code_bits == 8);
  const bool element_ok = sizes_ok && mantissa_bits >= 1 && mantissa_bits < code_bits &&
                          emin - mantissa_bits > -126 && emin < 64 && emax_elem >= 0 &&
                          emax_elem < 64 && max_code >= 1 &&
                          max_code < (int64_t{1} << (code_bits - 1));
  const bool rule_ok = rule >= kFloor && rule <= kRceil && even_drop >= 1 && even_drop <= 23 &&
                       rceil_k >= 0 && rceil_k < 128 && rceil_mant >= 0 &&
                       rceil_mant < (int64_t{1} << 23) && rceil_small >= 0 &&
                       rceil_small < (int64_t{1} << 31) && rceil_thr >= 0 &&
                       rceil_thr < (int64_t{1} << 31);
  if (!(element_ok && rule_ok)) return false;
  *f = Format{static_cast<int32_t>(mantissa_bits), static_cast<int32_t>(emin),
              static_cast<int32_t>(emax_elem),     static_cast<uint32_t>(max_code),
              static_cast<int32_t>(code_bits),     twos_complement,
              rule,                                static_cast<int32_t>(block),
              static_cast<uint32_t>(even_drop),    static_cast<int32_t>(rceil_k),
              static_cast<uint32_t>(rceil_mant),   static_cast<uint32_t>(rceil_small),
              static_cast<uint32_t>(rceil_thr)};
  return true;
}

ffi::Error Quantize(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::U8> elements,
                    ffi::ResultBuffer<ffi::U8> scales, int64_t mantissa_bits, int64_t emin,
                    int64_t emax_elem, int64_t max_code, int64_t code_bits, bool twos_complement,
                    int64_t rule, int64_t block, int64_t even_drop, int64_t rceil_k,
                    int64_t rceil_mant, int64_t rceil_small, int64_t rceil_thr) {
  Format f;
  if (!MakeFormat(mantissa_bits, emin, emax_elem, max_code, code_bits, twos_complement, rule,
                  block, even_drop, rceil_k, rceil_mant, rceil_small, rceil_thr, &f)) {
    return ffi::Error::InvalidArgument("lowprec_mx_quantize: unsupported format attributes");
  }
  const size_t n = x.element_count();
  const size_t blocks = n / static_cast<size_t>(block);
  if (n % static_cast<size_t>(block) != 0 || scales->element_count() != blocks ||
      elements->element_count() != n * static_cast<size_t>(code_bits) / 8) {
    return ffi::Error::InvalidArgument("lowprec_mx_quantize: buffer sizes do not match the blocks");
  }
  const float* in = x.typed_data();
  uint8_t* el = elements->typed_data();
  uint8_t* sc = scales->typed_data();
  // Chunks of 2^11 blocks (256 KiB of float32 input at 32-element blocks); each task holds
  // its own copy of the format.
  lowprec_native::RunChunked(pool, blocks, size_t{1} << 11,
                             [in, el, sc, f](size_t first, size_t count) noexcept {
                               RunBlocks(in, el, sc, first, count, f);
                             });
  return ffi::Error::Success();
}

}  // namespace

// The same loops for a caller on host memory (the checkpoint pipeline's fused pass,
// _ckpt_cpu.cc): blocks [0, blocks) of x quantized on the calling thread, `attrs` the 13
// integers of _mx_quantize_cpu.attributes in their order (twos_complement as 0 or 1).
// Returns false, writing nothing, for attributes the loops do not take.
namespace lowprec_native {
bool MxQuantizeBlocks(const float* x, size_t blocks, const int64_t* attrs, uint8_t* elements,
                      uint8_t* scales) noexcept {
  Format f;
  if (!MakeFormat(attrs[0], attrs[1], attrs[2], attrs[3], attrs[4], attrs[5] != 0, attrs[6],
                  attrs[7], attrs[8], attrs[9], attrs[10], attrs[11], attrs[12], &f)) {
    return false;
  }
  RunBlocks(x, elements, scales, 0, blocks, f);
  return true;
}
}  // namespace lowprec_native

LOWPREC_FFI_HANDLER(LowprecMxQuantize, "lowprec_mx_quantize", Quantize,
                    lowprec_native::BindMxFormat(ffi::Ffi::Bind()
                                                     .Ctx<ffi::ThreadPool>()
                                                     .Arg<ffi::Buffer<ffi::F32>>()
                                                     .Ret<ffi::Buffer<ffi::U8>>()
                                                     .Ret<ffi::Buffer<ffi::U8>>()));
