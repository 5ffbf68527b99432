// NVFP4 quantization on CPU as an XLA FFI target: float32 input blocked by 16 along the last
// axis, under a tensor scale given as an operand (one float32 per group of consecutive
// blocks: one for the whole array, or one per vmapped batch element), E4M3 block scales and
// packed E2M1 codes, round to nearest even or stochastically with the caller's uint32 words,
// by either NVFP4 step ("divide", "reciprocal").
//
// XLA compiles lowprec's NVFP4 encode (lowprec/_nvfp4.py, _scheme_nvfp4.py) to ~1,000 HLO
// instructions: integer long divisions and products on the bits, a hardware-float branch
// beside them, the stochastic rounding's integer compare. This is one custom call. It takes
// the same IEEE float32 steps (_nvfp4_cpu.h) with the MXCSR's flush-to-zero and
// denormals-are-zero off, so every quotient, product and divisor rounds as IEEE 754 says,
// subnormals included: what _nvfp4.py's exact formulation computes on the bits, for every
// positive finite tensor scale. tests/test_native_nvfp4.py and test_native_fuzz.py compare
// it with the XLA path bit for bit.
//
// Stochastic rounding (lowprec/_rounding.py round_shift): the E2M1 quotient q = |x| / divisor
// (or |x| x factor) as a float32, its binade t = max(floor(log2 q), 0), quantum 2^(t - 1);
// with `rem` the bits of q's significand below the quantum and `shift` their count, q rounds
// away from zero iff the element's word r < rem / 2^shift x 2^32, compared exactly as
// integers (r < ceil of it); then saturated at 6.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "_cpu_common.h"
#include "_nvfp4_cpu.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using lowprec_native::Bits;
using lowprec_native::E2m1Magnitude;
using lowprec_native::F32;
using lowprec_native::F32Bits;
using lowprec_native::kE4m3Nan;
using lowprec_native::kF32Abs;
using lowprec_native::kF32Inf;

// The E2M1 magnitude code of a float32 magnitude pattern q (finite or +inf) rounded
// stochastically with the word r, saturated at 6 (code 7).
inline uint32_t E2m1Stochastic(uint32_t q, uint32_t r) noexcept {
  if (q >= kF32Inf) return 7;
  const int32_t efield = static_cast<int32_t>(q >> 23);
  const uint64_t sig = efield > 0 ? (q & 0x7F'FFFFu) | 0x80'0000u : q & 0x7F'FFFFu;
  if (sig == 0) return 0;
  const int32_t t = std::max(efield - 127, 0);             // E2M1's binade (emin 0)
  const int32_t lsb = std::max(efield, 1) - 150;           // q = sig x 2^lsb
  const int32_t shift = (t - 1) - lsb;                     // >= 1: bits below the quantum
  // shift >= 64: kept 0, and 0 < rem / 2^shift x 2^32 <= 1 rounds up iff r = 0.
  uint64_t kept = 0, thr = 1;
  if (shift < 64) {
    kept = sig >> shift;
    const uint64_t rem = sig & ((uint64_t{1} << shift) - 1u);
    if (shift <= 32) {
      thr = rem << (32 - shift);
    } else {
      const int32_t k = shift - 32;
      thr = (rem + (uint64_t{1} << k) - 1u) >> k;  // rem < 2^24: no overflow
    }
  }
  const uint64_t code = (static_cast<uint64_t>(t) << 1) + kept + (r < thr ? 1u : 0u);
  return static_cast<uint32_t>(std::min<uint64_t>(code, 7));
}

struct Call {
  const float* x;
  const float* ts;        // one per group
  const uint32_t* words;  // stochastic rounding's, one per element; null: nearest even
  const uint32_t* amax;   // each block's largest magnitude pattern (inf: a NaN block); null:
                          // from x
  uint8_t* elements;      // packed codes and scale codes (quantize), or
  uint8_t* scales;
  float* values;          // the dequantized values (fake quantize)
  size_t group_blocks;    // blocks per tensor scale
  bool reciprocal;
};

// E2M1's magnitudes by code (0, 0.5, 1, 1.5, 2, 3, 4, 6).
constexpr float kE2m1[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
constexpr uint32_t kQNaN = 0x7FC0'0000u;  // lowprec's canonical NaN (a NaN block's values)

// The scale code and operand (divisor or factor) of block blk, and its dequantization
// factor float32(ts x scale); or false for a block holding a NaN or an infinity (its
// outputs are written here).
inline bool BlockScale(const Call& c, size_t blk, float* operand, float* total) noexcept {
  uint32_t amax = 0;
  if (c.amax != nullptr) {
    amax = c.amax[blk];
  } else {
    const float* xb = c.x + 16 * blk;
    for (int i = 0; i < 16; ++i) amax = std::max(amax, Bits(xb + i) & kF32Abs);
  }
  if (amax >= kF32Inf) {
    if (c.values != nullptr) {
      const float nan = F32(kQNaN);
      std::fill(c.values + 16 * blk, c.values + 16 * blk + 16, nan);
    } else {
      c.scales[blk] = static_cast<uint8_t>(kE4m3Nan);
      std::memset(c.elements + 8 * blk, 0, 8);
    }
    return false;
  }
  const float ts = c.ts[blk / c.group_blocks];
  const uint32_t code = lowprec_native::Nvfp4ScaleCode(amax, ts);
  if (c.scales != nullptr) c.scales[blk] = static_cast<uint8_t>(code);
  *total = ts * lowprec_native::E4m3Value(code);
  *operand = c.reciprocal ? (1.0f / ts) / lowprec_native::E4m3Value(code) : *total;
  return true;
}

// Element codes of one finite block, one at a time, then packed or dequantized
// (element x total, rounded once; -0 stays -0).
inline void BlockCodes(const Call& c, size_t blk, float operand, float total) noexcept {
  const float* xb = c.x + 16 * blk;
  const uint32_t* wb = c.words == nullptr ? nullptr : c.words + 16 * blk;
  uint8_t codes[16];
  for (int i = 0; i < 16; ++i) {
    const uint32_t b = Bits(xb + i);
    const float mag = F32(b & kF32Abs);
    const float q = c.reciprocal ? mag * operand : mag / operand;
    const uint32_t m = wb == nullptr ? E2m1Magnitude(q) : E2m1Stochastic(F32Bits(q), wb[i]);
    codes[i] = static_cast<uint8_t>(m | ((b >> 31) << 3));
  }
  if (c.values != nullptr) {
    float* out = c.values + 16 * blk;
    for (int i = 0; i < 16; ++i) {
      const float v = kE2m1[codes[i] & 7u] * total;
      out[i] = F32(F32Bits(v) | (static_cast<uint32_t>(codes[i] >> 3) << 31));
    }
    return;
  }
  uint8_t* out = c.elements + 8 * blk;
  for (int j = 0; j < 8; ++j) out[j] = static_cast<uint8_t>(codes[2 * j] | (codes[2 * j + 1] << 4));
}

#ifdef LOWPREC_X86_AVX2
// The AVX2 loop: eight blocks (128 elements) a step. Their maxima, scale codes and operands
// are computed as one vector each (the steps of BlockScale, lane by lane: the same IEEE
// operations in the same order, so the same bits); then each pair of blocks' 32 codes are
// formed in registers and packed (PackE2m1x32Avx2) or dequantized. A step whose
// blocks straddle two tensor scales, or hold a NaN or an infinity, takes the scalar loop.

// The 8 block maxima of the magnitudes m[k] (two vectors per block, already |x|): one
// max-transpose instead of eight horizontal reductions.
__attribute__((target("avx2"))) inline __m256i BlockMax8(const __m256i m[8]) {
  const __m256i a = _mm256_max_epu32(_mm256_unpacklo_epi32(m[0], m[1]), _mm256_unpackhi_epi32(m[0], m[1]));
  const __m256i b = _mm256_max_epu32(_mm256_unpacklo_epi32(m[2], m[3]), _mm256_unpackhi_epi32(m[2], m[3]));
  const __m256i c = _mm256_max_epu32(_mm256_unpacklo_epi32(m[4], m[5]), _mm256_unpackhi_epi32(m[4], m[5]));
  const __m256i d = _mm256_max_epu32(_mm256_unpacklo_epi32(m[6], m[7]), _mm256_unpackhi_epi32(m[6], m[7]));
  // Blocks 0-3 in each 128-bit half of u, 4-7 in v; the halves are then merged.
  const __m256i u = _mm256_max_epu32(_mm256_unpacklo_epi64(a, b), _mm256_unpackhi_epi64(a, b));
  const __m256i v = _mm256_max_epu32(_mm256_unpacklo_epi64(c, d), _mm256_unpackhi_epi64(c, d));
  return _mm256_max_epu32(_mm256_permute2x128_si256(u, v, 0x20), _mm256_permute2x128_si256(u, v, 0x31));
}

// E2M1 magnitude codes of 8 quotients q (float32 magnitudes, finite or +inf) rounded
// stochastically with the words r: E2m1Stochastic's rule in float32 steps, all exact. The
// quantum is 2^(t-1) with t = 0, 1, 2 below 2, 4, 8 (q >= 8 saturates: code 7), so
// y = q / quantum has integer part `kept` (code 2t + kept) and fraction f; E2m1Stochastic's
// threshold rem / 2^shift x 2^32 is F = f x 2^32 (a power-of-two product of an exact
// difference), and for an integer word r < ceil(F) iff r < F. ceil(F) <= 2^32 - 2^8 is
// converted to uint32 in two halves (AVX2 converts to int32 only) and compared unsigned.
__attribute__((target("avx2"))) inline __m256i E2m1Stochastic8(__m256 q, __m256i r) {
  const __m256 ge2 = _mm256_cmp_ps(q, _mm256_set1_ps(2.0f), _CMP_GE_OQ);
  const __m256 ge4 = _mm256_cmp_ps(q, _mm256_set1_ps(4.0f), _CMP_GE_OQ);
  const __m256 ge8 = _mm256_cmp_ps(q, _mm256_set1_ps(8.0f), _CMP_GE_OQ);
  const __m256 inv_quantum = _mm256_blendv_ps(
      _mm256_blendv_ps(_mm256_set1_ps(2.0f), _mm256_set1_ps(1.0f), ge2), _mm256_set1_ps(0.5f), ge4);
  const __m256 y = _mm256_mul_ps(q, inv_quantum);
  const __m256 kept = _mm256_floor_ps(y);
  const __m256 ceil_f = _mm256_ceil_ps(
      _mm256_mul_ps(_mm256_sub_ps(y, kept), _mm256_set1_ps(0x1p32f)));
  const __m256 big = _mm256_cmp_ps(ceil_f, _mm256_set1_ps(0x1p31f), _CMP_GE_OQ);
  const __m256i sign = _mm256_set1_epi32(static_cast<int>(0x8000'0000u));
  // thr - 2^31 as int32 (the unsigned compare's bias): big lanes convert ceil_f - 2^31
  // (exact: ceil_f in [2^31, 2^32)), the others ceil_f with the sign bit flipped.
  const __m256i thr = _mm256_xor_si256(
      _mm256_cvttps_epi32(_mm256_sub_ps(ceil_f, _mm256_and_ps(big, _mm256_set1_ps(0x1p31f)))),
      _mm256_andnot_si256(_mm256_castps_si256(big), sign));
  const __m256i up = _mm256_cmpgt_epi32(thr, _mm256_xor_si256(r, sign));  // -1: round away
  const __m256i base = _mm256_slli_epi32(
      _mm256_sub_epi32(_mm256_setzero_si256(),
                       _mm256_add_epi32(_mm256_castps_si256(ge2), _mm256_castps_si256(ge4))), 1);
  const __m256i code = _mm256_min_epi32(
      _mm256_sub_epi32(_mm256_add_epi32(base, _mm256_cvttps_epi32(kept)), up), _mm256_set1_epi32(7));
  return _mm256_blendv_epi8(code, _mm256_set1_epi32(7), _mm256_castps_si256(ge8));
}

// Signed E2M1 codes (x's sign bit as bit 3) of 8 float32 patterns b over the block's
// operand: to nearest even (E2m1Codes8) or stochastically with the words at w.
template <bool kMultiply, bool kStochastic>
__attribute__((target("avx2"))) inline __m256i Codes8(__m256i b, __m256 operand, const uint32_t* w) {
  if (!kStochastic) return lowprec_native::E2m1Codes8<kMultiply>(b, operand);
  const __m256 mag =
      _mm256_castsi256_ps(_mm256_and_si256(b, _mm256_set1_epi32(static_cast<int>(kF32Abs))));
  const __m256 q = kMultiply ? _mm256_mul_ps(mag, operand) : _mm256_div_ps(mag, operand);
  const __m256i m = E2m1Stochastic8(q, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)));
  return _mm256_or_si256(m, _mm256_slli_epi32(_mm256_srli_epi32(b, 31), 3));
}

// Eight blocks from blk, all of one tensor scale ts (inverse = float32(1 / ts)); false,
// writing nothing, where one holds a NaN or an infinity (the scalar loop takes them).
template <bool kMultiply, bool kStochastic, bool kValues>
__attribute__((target("avx2"))) inline bool Blocks8Avx2(const Call& c, size_t blk, float ts,
                                                       float inverse) noexcept {
  const float* xb = c.x + 16 * blk;
  const __m256i abs = _mm256_set1_epi32(static_cast<int>(kF32Abs));
  __m256i amax;
  if (c.amax != nullptr) {
    amax = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c.amax + blk));
  } else {
    __m256i m[8];
    for (int k = 0; k < 8; ++k) {
      m[k] = _mm256_max_epu32(
          _mm256_and_si256(_mm256_castps_si256(_mm256_loadu_ps(xb + 16 * k)), abs),
          _mm256_and_si256(_mm256_castps_si256(_mm256_loadu_ps(xb + 16 * k + 8)), abs));
    }
    amax = BlockMax8(m);
  }
  // A NaN or infinity (patterns >= 0x7F800000; the given maxima are at most +inf).
  const __m256i special = _mm256_cmpgt_epi32(amax, _mm256_set1_epi32(0x7F7F'FFFF));
  if (!_mm256_testz_si256(special, special)) return false;
  // Nvfp4ScaleCode, E4m3Value and the operand, lane by lane.
  const __m256 quotient =
      _mm256_div_ps(_mm256_div_ps(_mm256_castsi256_ps(amax), _mm256_set1_ps(6.0f)), _mm256_set1_ps(ts));
  const __m256i qb = _mm256_min_epu32(
      _mm256_max_epu32(_mm256_castps_si256(quotient), _mm256_set1_epi32(lowprec_native::kE4m3Eps)),
      _mm256_set1_epi32(lowprec_native::kE4m3Max));
  const __m256i rounded = _mm256_srli_epi32(
      _mm256_add_epi32(_mm256_add_epi32(qb, _mm256_set1_epi32(0x7'FFFF)),
                       _mm256_and_si256(_mm256_srli_epi32(qb, 20), _mm256_set1_epi32(1))), 20);
  const __m256i code = _mm256_sub_epi32(rounded, _mm256_set1_epi32(120 << 3));
  const __m256 scale = _mm256_castsi256_ps(_mm256_slli_epi32(rounded, 20));  // E4m3Value
  const __m256 total = _mm256_mul_ps(_mm256_set1_ps(ts), scale);
  alignas(32) float operand[8], totals[8];
  _mm256_store_ps(operand, kMultiply ? _mm256_div_ps(_mm256_set1_ps(inverse), scale) : total);
  _mm256_store_ps(totals, total);
  if (!kValues) {
    alignas(32) uint32_t codes[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(codes), code);
    for (int k = 0; k < 8; ++k) c.scales[blk + k] = static_cast<uint8_t>(codes[k]);
  }
  const __m256 table = _mm256_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f);
  for (int k = 0; k < 8; k += 2) {  // a pair of blocks: 4 vectors of 8 codes
    __m256i cv[4];
    for (int j = 0; j < 4; ++j) {
      const size_t e = 16 * k + 8 * j;
      cv[j] = Codes8<kMultiply, kStochastic>(_mm256_castps_si256(_mm256_loadu_ps(xb + e)),
                                             _mm256_set1_ps(operand[k + j / 2]),
                                             kStochastic ? c.words + 16 * blk + e : nullptr);
    }
    if (kValues) {  // element x total, rounded once, with the code's sign bit
      for (int j = 0; j < 4; ++j) {
        const __m256 v = _mm256_mul_ps(
            _mm256_permutevar8x32_ps(table, cv[j]), _mm256_set1_ps(totals[k + j / 2]));
        const __m256i s = _mm256_slli_epi32(_mm256_srli_epi32(cv[j], 3), 31);
        _mm256_storeu_ps(c.values + 16 * blk + 16 * k + 8 * j,
                         _mm256_or_ps(v, _mm256_castsi256_ps(s)));
      }
    } else {
      lowprec_native::PackE2m1x32Avx2(cv, c.elements + 8 * (blk + k));
    }
  }
  return true;
}

// Blocks [first, end) eight at a time where Blocks8Avx2 takes them; returns the first block
// left to the scalar loop (a NaN block's step is done by the scalar loop at once).
template <bool kMultiply, bool kStochastic, bool kValues>
__attribute__((target("avx2"))) size_t BlocksAvx2(const Call& c, size_t first, size_t end) noexcept;
#endif
void Blocks(const Call& c, size_t first, size_t count) noexcept {
  lowprec_native::ExactFloats exact;  // on this thread, for this chunk
  size_t blk = first;
  const size_t end = first + count;
#ifdef LOWPREC_X86_AVX2
  if (lowprec_native::HasAvx2()) {
    const bool sr = c.words != nullptr, values = c.values != nullptr;
#define LOWPREC_NVFP4_AVX2(MUL)                                                         \
  (sr ? (values ? BlocksAvx2<MUL, true, true>(c, blk, end) : BlocksAvx2<MUL, true, false>(c, blk, end)) \
      : (values ? BlocksAvx2<MUL, false, true>(c, blk, end) : BlocksAvx2<MUL, false, false>(c, blk, end)))
    blk = c.reciprocal ? LOWPREC_NVFP4_AVX2(true) : LOWPREC_NVFP4_AVX2(false);
#undef LOWPREC_NVFP4_AVX2
  }
#endif
  for (; blk < end; ++blk) {
    float operand, total;
    if (BlockScale(c, blk, &operand, &total)) BlockCodes(c, blk, operand, total);
  }
}

#ifdef LOWPREC_X86_AVX2
template <bool kMultiply, bool kStochastic, bool kValues>
__attribute__((target("avx2"))) size_t BlocksAvx2(const Call& c, size_t first, size_t end) noexcept {
  size_t blk = first;
  while (blk + 8 <= end) {
    const size_t group = blk / c.group_blocks;
    if ((blk + 7) / c.group_blocks != group) {  // two tensor scales: this block alone
      float operand, total;
      if (BlockScale(c, blk, &operand, &total)) BlockCodes(c, blk, operand, total);
      ++blk;
      continue;
    }
    const float ts = c.ts[group];
    if (!Blocks8Avx2<kMultiply, kStochastic, kValues>(c, blk, ts, 1.0f / ts)) {
      for (size_t k = blk; k < blk + 8; ++k) {  // a NaN or infinity among them
        float operand, total;
        if (BlockScale(c, k, &operand, &total)) BlockCodes(c, k, operand, total);
      }
    }
    blk += 8;
  }
  return blk;
}
#endif

// The checks both handlers make: sizes, groups, words, tensor scales. Empty: fine.
const char* CheckCall(size_t n, size_t groups, const float* tsv, bool stochastic, size_t words,
                      size_t amax, bool given_amax) noexcept {
  if (n % 16 != 0) return "the input is not a whole number of blocks of 16";
  if (groups == 0 || (n / 16) % groups != 0) {
    return "the tensor scales do not split the blocks into equal groups";
  }
  if (stochastic && words != n) return "stochastic rounding needs one word per element";
  if (given_amax && amax != n / 16) return "the block maxima are not one per block";
  for (size_t g = 0; g < groups; ++g) {
    const uint32_t b = Bits(tsv + g);
    if (b == 0 || b >= kF32Inf) return "a tensor scale is not a positive finite float32";
  }
  return "";
}

void Run(ffi::ThreadPool& pool, const Call& call, size_t blocks) {
  // Chunks of 2^12 blocks (256 KiB of float32 input); each task holds a copy of `call`.
  lowprec_native::RunChunked(pool, blocks, size_t{1} << 12,
                             [call](size_t first, size_t count) noexcept {
                               Blocks(call, first, count);
                             });
}

#ifdef LOWPREC_X86_AVX2
// FiniteAmax's loop, 32 elements a step: magnitudes at or above +inf's pattern masked to 0
// (a signed compare: magnitudes are below 2^31). Returns where it stopped, the maximum so
// far in *amax.
__attribute__((target("avx2"))) size_t FiniteAmaxAvx2(const float* x, size_t n,
                                                      uint32_t* amax) noexcept {
  const __m256i abs = _mm256_set1_epi32(static_cast<int>(kF32Abs));
  const __m256i inf = _mm256_set1_epi32(static_cast<int>(kF32Inf));
  __m256i m[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(),
                  _mm256_setzero_si256()};
  size_t i = 0;
  for (; i + 32 <= n; i += 32) {
    for (int j = 0; j < 4; ++j) {
      const __m256i a = _mm256_and_si256(_mm256_castps_si256(_mm256_loadu_ps(x + i + 8 * j)), abs);
      m[j] = _mm256_max_epu32(m[j], _mm256_and_si256(a, _mm256_cmpgt_epi32(inf, a)));
    }
  }
  __m256i v = _mm256_max_epu32(_mm256_max_epu32(m[0], m[1]), _mm256_max_epu32(m[2], m[3]));
  __m128i h = _mm_max_epu32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  h = _mm_max_epu32(h, _mm_shuffle_epi32(h, 0b01001110));
  h = _mm_max_epu32(h, _mm_shuffle_epi32(h, 0b10110001));
  *amax = static_cast<uint32_t>(_mm_cvtsi128_si32(h));
  return i;
}
#endif

// The largest finite magnitude pattern of x[0, n) (0 if none).
uint32_t FiniteAmax(const float* x, size_t n) noexcept {
  uint32_t amax = 0;
  size_t i = 0;
#ifdef LOWPREC_X86_AVX2
  if (lowprec_native::HasAvx2()) i = FiniteAmaxAvx2(x, n, &amax);
#endif
  for (; i < n; ++i) {
    const uint32_t a = Bits(x + i) & kF32Abs;
    if (a < kF32Inf) amax = std::max(amax, a);
  }
  return amax;
}

// The tensor scale of a group of largest finite magnitude pattern amax as _scheme_nvfp4
// computes it: float32(amax / 2688) (1 for amax = 0), raised to 2^-143 (2^-121 for the
// "reciprocal" step). IEEE division with subnormals kept: _nvfp4.f32_div's bits.
float GroupTensorScale(uint32_t amax, bool reciprocal) noexcept {
  lowprec_native::ExactFloats exact;
  uint32_t ts = amax == 0 ? 0x3F80'0000u : F32Bits(F32(amax) / 2688.0f);
  ts = std::max(ts, reciprocal ? uint32_t{(127 - 121) << 23} : uint32_t{1} << 6);
  return F32(ts);
}

constexpr size_t kAmaxChunk = size_t{1} << 16;  // elements per task (256 KiB of float32)

// Each group's tensor scale computed from its values (GroupTensorScale) into out[groups]:
// one group (the unbatched call) read in chunks on XLA's threads, maxima merged here;
// several (vmap) one after another. `partial` holds a slot per chunk of the one group.
void TensorScales(ffi::ThreadPool& pool, const float* x, size_t n, size_t groups,
                  bool reciprocal, uint32_t* partial, float* out) {
  if (groups == 1) {
    const size_t chunks = (n + kAmaxChunk - 1) / kAmaxChunk;
    lowprec_native::RunChunked(pool, chunks, 1, [x, n, partial](size_t first, size_t count) noexcept {
      for (size_t k = first; k < first + count; ++k) {
        partial[k] = FiniteAmax(x + k * kAmaxChunk, std::min(kAmaxChunk, n - k * kAmaxChunk));
      }
    });
    uint32_t amax = 0;
    for (size_t k = 0; k < chunks; ++k) amax = std::max(amax, partial[k]);
    out[0] = GroupTensorScale(amax, reciprocal);
    return;
  }
  for (size_t g = 0; g < groups; ++g) {
    out[g] = GroupTensorScale(FiniteAmax(x + g * (n / groups), n / groups), reciprocal);
  }
}

// Returns in `used` the tensor scale of each group: `ts`'s, or with compute_ts the one computed
// here from the group's values (GroupTensorScale; `ts` then only gives the number of groups).
ffi::Error Quantize(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> ts,
                    ffi::Buffer<ffi::U32> words, ffi::ResultBuffer<ffi::U8> elements,
                    ffi::ResultBuffer<ffi::U8> scales, ffi::ResultBuffer<ffi::F32> used,
                    bool reciprocal, bool stochastic, bool compute_ts) {
  const size_t n = x.element_count();
  const size_t groups = ts.element_count();
  if (used->element_count() != groups) {
    return ffi::Error::InvalidArgument(
        "lowprec_nvfp4_quantize: the tensor scale output is not one per group");
  }
  float* tsv = used->typed_data();
  if (compute_ts && groups > 0 && n % groups == 0) {
    std::vector<uint32_t> partial(groups == 1 ? n / kAmaxChunk + 1 : 0);
    TensorScales(pool, x.typed_data(), n, groups, reciprocal, partial.data(), tsv);
  } else {
    std::copy(ts.typed_data(), ts.typed_data() + groups, tsv);
  }
  const char* problem = CheckCall(n, groups, tsv, stochastic, words.element_count(), 0, false);
  if (*problem == 0 && (scales->element_count() != n / 16 || elements->element_count() != n / 2)) {
    problem = "the outputs do not match the blocks";
  }
  if (*problem != 0) {
    return ffi::Error::InvalidArgument(std::string("lowprec_nvfp4_quantize: ") + problem);
  }
  const size_t blocks = n / 16;
  const Call call{x.typed_data(), tsv, stochastic ? words.typed_data() : nullptr, nullptr,
                  elements->typed_data(), scales->typed_data(), nullptr, blocks / groups,
                  reciprocal};
  Run(pool, call, blocks);
  return ffi::Error::Success();
}

// Fake quantization: dequantize(quantize_mx(x, "nvfp4")) in one call, the values
// element x float32(ts x scale) as _nvfp4.dequantize_bits rounds them (a NaN block: the
// canonical quiet NaN). With compute_ts, each group's tensor scale is computed here from
// its values (GroupTensorScale; `ts` then only gives the number of groups). With
// given_amax, each block's largest magnitude comes from `amax` (the training recipe's
// 16 x 16 weight tiles: the tile's finite maximum for each of its rows' blocks, or +inf for
// a tile holding a NaN or an infinity).
ffi::Error FakeQuantize(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> ts,
                        ffi::Buffer<ffi::U32> words, ffi::Buffer<ffi::U32> amax,
                        ffi::ResultBuffer<ffi::F32> values, bool reciprocal, bool stochastic,
                        bool given_amax, bool compute_ts) {
  const size_t n = x.element_count();
  const size_t groups = ts.element_count();
  std::vector<float> computed;
  const float* tsv = ts.typed_data();
  if (compute_ts && groups > 0 && n % groups == 0) {
    computed.resize(groups);
    std::vector<uint32_t> partial(groups == 1 ? n / kAmaxChunk + 1 : 0);
    TensorScales(pool, x.typed_data(), n, groups, reciprocal, partial.data(), computed.data());
    tsv = computed.data();
  }
  const char* problem = CheckCall(n, groups, tsv, stochastic, words.element_count(),
                                  amax.element_count(), given_amax);
  if (*problem == 0 && values->element_count() != n) problem = "the output is not x's size";
  if (*problem != 0) {
    return ffi::Error::InvalidArgument(std::string("lowprec_nvfp4_fake_quantize: ") + problem);
  }
  const size_t blocks = n / 16;
  const Call call{x.typed_data(), tsv, stochastic ? words.typed_data() : nullptr,
                  given_amax ? amax.typed_data() : nullptr, nullptr, nullptr,
                  values->typed_data(), blocks / groups, reciprocal};
  Run(pool, call, blocks);  // returns when every chunk is done: `computed` outlives them
  return ffi::Error::Success();
}

}  // namespace

LOWPREC_FFI_HANDLER(LowprecNvfp4Quantize, "lowprec_nvfp4_quantize", Quantize,
                    ffi::Ffi::Bind()
                        .Ctx<ffi::ThreadPool>()
                        .Arg<ffi::Buffer<ffi::F32>>()
                        .Arg<ffi::Buffer<ffi::F32>>()
                        .Arg<ffi::Buffer<ffi::U32>>()
                        .Ret<ffi::Buffer<ffi::U8>>()
                        .Ret<ffi::Buffer<ffi::U8>>()
                        .Ret<ffi::Buffer<ffi::F32>>()
                        .Attr<bool>("reciprocal")
                        .Attr<bool>("stochastic")
                        .Attr<bool>("compute_ts"));

LOWPREC_FFI_HANDLER(LowprecNvfp4FakeQuantize, "lowprec_nvfp4_fake_quantize", FakeQuantize,
                    ffi::Ffi::Bind()
                        .Ctx<ffi::ThreadPool>()
                        .Arg<ffi::Buffer<ffi::F32>>()
                        .Arg<ffi::Buffer<ffi::F32>>()
                        .Arg<ffi::Buffer<ffi::U32>>()
                        .Arg<ffi::Buffer<ffi::U32>>()
                        .Ret<ffi::Buffer<ffi::F32>>()
                        .Attr<bool>("reciprocal")
                        .Attr<bool>("stochastic")
                        .Attr<bool>("given_amax")
                        .Attr<bool>("compute_ts"));
