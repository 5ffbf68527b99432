// NVFP4's per-block arithmetic (lowprec's recipe, lowprec/_nvfp4.py), shared by the
// checkpoint pipeline's native pass (_ckpt_cpu.cc) and the quantize_mx FFI kernel
// (_nvfp4_cpu.cc): IEEE float32 steps, which equal _nvfp4.py's exact formulation (integer
// arithmetic on the bits) wherever the CPU keeps subnormals. Callers run these with the
// MXCSR's flush-to-zero and denormals-are-zero off (ExactFloats below), or only for tensor
// scales in [2^-118, 2^116], where _nvfp4.py shows every operand and result normal.
//
// For a block of largest finite magnitude amax under the tensor scale ts:
//   scale code  = RNE_E4M3(clamp((amax / 6) / ts, 2^-6, 448))   (two divisions, in order)
//   "divide":     element = RNE_E2M1(|x| / float32(ts * scale))
//   "reciprocal": element = RNE_E2M1(|x| * float32(float32(1 / ts) / scale))
// saturated at 6, with x's sign bit (-0 keeps it); a block holding a NaN or an infinity gets
// the E4M3 NaN code 0x7F and zero elements.
#ifndef LOWPREC_KERNELS_NVFP4_CPU_H_
#define LOWPREC_KERNELS_NVFP4_CPU_H_

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "_cpu_common.h"

namespace lowprec_native {

constexpr uint32_t kF32Abs = 0x7FFF'FFFFu;
constexpr uint32_t kF32Inf = 0x7F80'0000u;   // magnitudes at or above it are NaN or inf
constexpr uint32_t kE4m3Eps = 0x3C80'0000u;  // 2^-6, the smallest normal E4M3
constexpr uint32_t kE4m3Max = 0x43E0'0000u;  // 448 = 1.75 x 2^8
constexpr uint32_t kE4m3Nan = 0x7Fu;

inline float F32(uint32_t b) noexcept {
  float f;
  std::memcpy(&f, &b, sizeof f);
  return f;
}

inline uint32_t F32Bits(float f) noexcept {
  uint32_t b;
  std::memcpy(&b, &f, sizeof b);
  return b;
}

// Clears the MXCSR's flush-to-zero and denormals-are-zero bits for its lifetime (XLA's
// threads set them), so that float32 operations round subnormals as IEEE 754 does.
class ExactFloats {
 public:
#ifdef LOWPREC_X86_AVX2
  ExactFloats() noexcept : csr_(_mm_getcsr()) { _mm_setcsr(csr_ & ~0x8040u); }
  ~ExactFloats() { _mm_setcsr(csr_); }

 private:
  unsigned csr_;
#endif
};

// E2M1 magnitude code of a float32 magnitude q >= 0 (NaN excluded): RNE onto 0, 0.5, 1, 1.5,
// 2, 3, 4, 6, saturating; ties go to the even code (0.25 -> 0, 0.75 -> 1, 1.25 -> 1,
// 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4).
inline uint32_t E2m1Magnitude(float q) noexcept {
  return (q > 0.25f) + (q >= 0.75f) + (q > 1.25f) + (q >= 1.75f) + (q > 2.5f) + (q >= 3.5f) +
         (q > 5.0f);
}

// The E4M3 scale code of a block of largest magnitude pattern amax (finite) under ts.
inline uint32_t Nvfp4ScaleCode(uint32_t amax, float ts) noexcept {
  const float quotient = (F32(amax) / 6.0f) / ts;
  const uint32_t qb = std::min(std::max(F32Bits(quotient), kE4m3Eps), kE4m3Max);
  // RNE of the float32 mantissa to E4M3's 3 bits; the carry moves into the exponent.
  return ((qb + 0x7'FFFFu + ((qb >> 20) & 1u)) >> 20) - (120u << 3);
}

// The E4M3 value of a scale code from Nvfp4ScaleCode (normal, positive).
inline float E4m3Value(uint32_t code) noexcept { return F32((code + (120u << 3)) << 20); }

// The block's operand: its divisor float32(ts x scale) ("divide"), or its factor
// float32(inverse / scale) with inverse = float32(1 / ts) ("reciprocal").
inline float Nvfp4Operand(uint32_t code, float ts, float inverse, bool reciprocal) noexcept {
  return reciprocal ? inverse / E4m3Value(code) : ts * E4m3Value(code);
}

// The E4M3 scale code of a block of largest magnitude pattern amax (finite) under ts, and
// its divisor float32(ts x scale) (the "divide" step).
inline uint32_t Nvfp4Scale(uint32_t amax, float ts, float* divisor) noexcept {
  const uint32_t code = Nvfp4ScaleCode(amax, ts);
  *divisor = ts * E4m3Value(code);
  return code;
}

#ifdef LOWPREC_X86_AVX2
// E2m1Magnitude's codes, with x's sign bit as bit 3, of 8 float32 patterns b: |x| / operand,
// or |x| x operand where kMultiply (the "reciprocal" step).
template <bool kMultiply = false>
__attribute__((target("avx2"))) inline __m256i E2m1Codes8(__m256i b, __m256 operand) {
  const __m256 mag =
      _mm256_castsi256_ps(_mm256_and_si256(b, _mm256_set1_epi32(static_cast<int>(kF32Abs))));
  const __m256 q = kMultiply ? _mm256_mul_ps(mag, operand) : _mm256_div_ps(mag, operand);
  __m256i m = _mm256_setzero_si256();
  // Each true comparison is all ones (-1): subtracting it adds one.
  m = _mm256_sub_epi32(m, _mm256_castps_si256(_mm256_cmp_ps(q, _mm256_set1_ps(0.25f), _CMP_GT_OQ)));
  m = _mm256_sub_epi32(m, _mm256_castps_si256(_mm256_cmp_ps(q, _mm256_set1_ps(0.75f), _CMP_GE_OQ)));
  m = _mm256_sub_epi32(m, _mm256_castps_si256(_mm256_cmp_ps(q, _mm256_set1_ps(1.25f), _CMP_GT_OQ)));
  m = _mm256_sub_epi32(m, _mm256_castps_si256(_mm256_cmp_ps(q, _mm256_set1_ps(1.75f), _CMP_GE_OQ)));
  m = _mm256_sub_epi32(m, _mm256_castps_si256(_mm256_cmp_ps(q, _mm256_set1_ps(2.5f), _CMP_GT_OQ)));
  m = _mm256_sub_epi32(m, _mm256_castps_si256(_mm256_cmp_ps(q, _mm256_set1_ps(3.5f), _CMP_GE_OQ)));
  m = _mm256_sub_epi32(m, _mm256_castps_si256(_mm256_cmp_ps(q, _mm256_set1_ps(5.0f), _CMP_GT_OQ)));
  return _mm256_or_si256(m, _mm256_slli_epi32(_mm256_srli_epi32(b, 31), 3));
}

// Four vectors of 8 E2M1 codes (32 elements in order, one code per 32-bit lane) packed two
// per byte (element 2k in the low nibble) into 16 bytes at out: the codes narrowed to bytes
// in order, then each byte pair merged.
__attribute__((target("avx2"))) inline void PackE2m1x32Avx2(const __m256i c[4], uint8_t* out) {
  const __m256i bytes = _mm256_permutevar8x32_epi32(
      _mm256_packus_epi16(_mm256_packus_epi32(c[0], c[1]), _mm256_packus_epi32(c[2], c[3])),
      _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  const __m256i pair = _mm256_or_si256(
      _mm256_and_si256(bytes, _mm256_set1_epi16(0x000F)),
      _mm256_and_si256(_mm256_srli_epi16(bytes, 4), _mm256_set1_epi16(0x00F0)));
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi16(pair, pair), 0b1000);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm256_castsi256_si128(packed));
}

// The 32 codes of two consecutive blocks of float32 patterns at xb (16 each) over their
// operands (E2m1Codes8), packed by PackE2m1x32Avx2 into 16 bytes at out.
template <bool kMultiply = false>
__attribute__((target("avx2"))) inline void Nvfp4PairAvx2(const void* xb, float d0, float d1,
                                                          uint8_t* out) {
  // The intrinsics' unaligned loads may alias any type (the float32 or uint32 buffer).
  const __m256i* v = static_cast<const __m256i*>(xb);
  __m256i c[4];
  for (int j = 0; j < 4; ++j) {
    c[j] = E2m1Codes8<kMultiply>(_mm256_loadu_si256(v + j), _mm256_set1_ps(j < 2 ? d0 : d1));
  }
  PackE2m1x32Avx2(c, out);
}
#endif

}  // namespace lowprec_native

#endif  // LOWPREC_KERNELS_NVFP4_CPU_H_
