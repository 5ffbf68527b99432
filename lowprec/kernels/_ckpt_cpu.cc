// The checkpoint pipeline's per-piece passes over host memory (lowprec/checkpoint/_chunk.py):
// the error statistics of a quantized piece against its input, stored codes decoded to the
// output dtype, and the largest finite magnitude. Plain C functions called through ctypes
// (which releases the GIL, so the pipeline's worker threads run them at once), not XLA
// handlers: they read and write NumPy buffers between the XLA programs.
//
// Each computes what NumPy code in lowprec/checkpoint computes, element for element, and
// tests/test_checkpoint_native.py compares them (the NumPy code stays as the fallback where
// this library is not built):
//
// * a decoded value is elut[code] x factor[block], one float32 multiply rounded to nearest
//   even with subnormals kept (the table is the element format's decode, the factor what
//   the block's scale code multiplies its elements by): the exact decode of every E8M0
//   format (the product is exact) and of NVFP4 (element x float32(ts x s), lowprec's
//   rounded product), and NumPy's `values * scale` for FP8 casts;
// * statistics as ErrorStats.update: float64 squares and differences of the elements finite
//   on both sides, the others counted by what happened to them; sums are accumulated in a
//   fixed order (8 lanes, then the lanes in order), each term by one fused multiply-add
//   (x^2 of a float32 x is exact in float64, so its sum is the same as with a rounded
//   product; e^2 is rounded once, with the sum), so they can differ from NumPy's pairwise
//   sums of rounded squares by rounding only (at most n 2^-52 relative for n terms, far
//   below the report's digits);
// * narrowing as ml_dtypes (bfloat16: RNE, NaN to sign | 0x7FC0) and NumPy (float16: RNE,
//   NaN keeping its top payload bits) do, with finite values that overflow counted.
//
// Subnormals matter (a block scale of 2^-127, an element of 2^-149): every function runs with
// the CPU's flush-to-zero and denormals-are-zero modes off (XLA's threads set them), and
// restores the caller's modes on return.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "_cpu_common.h"
#include "_nvfp4_cpu.h"

namespace {

enum Kind : int32_t { kF32 = 0, kBF16 = 1, kF16 = 2, kF64 = 3 };

constexpr uint32_t kAbs = 0x7FFF'FFFFu;
constexpr uint32_t kExp = 0x7F80'0000u;
constexpr uint32_t kQNaN = 0x7FC0'0000u;  // lowprec's canonical NaN (F32_QNAN)
constexpr int64_t kChunk = 2048;          // elements widened/decoded at a time (on the stack)

// The statistics' slots (lowprec/kernels/_ckpt_cpu.py STATS names them in this order).
enum Stat {
  kCount, kSumX2, kSumE2, kMaxAbs, kMaxRel, kNonfinite, kNanIn, kInfIn, kInfSaturated,
  kFiniteToNonfinite, kNonfiniteChanged, kClipped, kClipTotal, kNumStats
};

#ifdef LOWPREC_X86_AVX2
// Whether the CPU has AVX2 and FMA (every AVX2 CPU made so far has both; checked anyway).
inline bool HasAvx2Fma() {
  static const bool fma = lowprec_native::HasAvx2() && __builtin_cpu_supports("fma");
  return fma;
}
#endif

// Clears flush-to-zero and denormals-are-zero for its lifetime.
class ExactFloats {
 public:
#ifdef LOWPREC_X86_AVX2
  ExactFloats() : csr_(_mm_getcsr()) { _mm_setcsr(csr_ & ~0x8040u); }
  ~ExactFloats() { _mm_setcsr(csr_); }

 private:
  unsigned csr_;
#endif
};

inline float FromBits(uint32_t b) {
  float f;
  std::memcpy(&f, &b, sizeof f);
  return f;
}

inline uint32_t ToBits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof b);
  return b;
}

// float16 bits to float32 bits, exactly (NumPy's astype: NaN payloads kept).
inline uint32_t HalfToFloatBits(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1Fu;
  const uint32_t m = h & 0x3FFu;
  if (e == 0x1F) return sign | kExp | (m << 13);
  if (e != 0) return sign | ((e + 112) << 23) | (m << 13);
  if (m == 0) return sign;
  // A subnormal m x 2^-24: normalize (m < 2^10, so its leading bit is at 9 or below).
  const int lead = 31 - __builtin_clz(m);  // floor(log2 m)
  const uint32_t mant = (m << (23 - lead)) & 0x7F'FFFFu;
  return sign | (static_cast<uint32_t>(lead - 24 + 127) << 23) | mant;
}

// float32 bits to float16 bits as NumPy's astype does: round to nearest even, overflow to
// inf, NaN to a NaN keeping the top 10 payload bits (made non-zero).
inline uint16_t FloatBitsToHalf(uint32_t f) {
  const uint16_t sign = static_cast<uint16_t>((f >> 16) & 0x8000u);
  const uint32_t a = f & kAbs;
  if (a >= kExp) {
    if (a == kExp) return sign | 0x7C00u;
    uint16_t r = static_cast<uint16_t>(0x7C00u | ((a & 0x7F'FFFFu) >> 13));
    if (r == 0x7C00u) ++r;
    return sign | r;
  }
  if (a >= 0x477F'F000u) return sign | 0x7C00u;  // >= 65520 = 65504 + half an ulp: inf
  if (a >= 0x3880'0000u) {                         // a float16 normal (>= 2^-14)
    const uint32_t r = a - (112u << 23);           // exponent bias 127 -> 15
    return sign | static_cast<uint16_t>((r + 0xFFFu + ((r >> 13) & 1u)) >> 13);
  }
  if (a <= 0x3300'0000u) return sign;  // <= 2^-25 (a tie at 2^-25 goes to even: 0)
  // A float16 subnormal: |x| / 2^-24 = sig x 2^(e - 126), rounded to nearest even.
  const uint32_t sig = (a & 0x7F'FFFFu) | 0x80'0000u;
  const uint32_t shift = 126u - (a >> 23);  // 14..24 here
  const uint32_t k = sig >> shift;
  const uint32_t rem = sig & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1);
  return sign | static_cast<uint16_t>(k + ((rem > half || (rem == half && (k & 1u))) ? 1u : 0u));
}

// float32 bits to bfloat16 bits as ml_dtypes does: round to nearest even (overflow to inf),
// NaN to sign | 0x7FC0.
inline uint16_t FloatBitsToBf16(uint32_t f) {
  if ((f & kAbs) > kExp) return static_cast<uint16_t>(((f >> 16) & 0x8000u) | 0x7FC0u);
  return static_cast<uint16_t>((f + 0x7FFFu + ((f >> 16) & 1u)) >> 16);
}

// Element i of an array of `kind` (f32, bf16, f16) as float32 bits.
inline uint32_t InputBits(const void* x, int32_t kind, int64_t i) {
  if (kind == kF32) return lowprec_native::Bits(static_cast<const float*>(x) + i);
  uint16_t h;
  std::memcpy(&h, static_cast<const uint8_t*>(x) + 2 * i, sizeof h);
  return kind == kBF16 ? static_cast<uint32_t>(h) << 16 : HalfToFloatBits(h);
}

#ifdef LOWPREC_X86_AVX2
// bfloat16 patterns to float32 patterns, 8 at a time; returns how many were done.
__attribute__((target("avx2"))) int64_t WidenBf16Avx2(const uint8_t* p, int64_t len,
                                                      uint32_t* out) {
  int64_t i = 0;
  for (; i + 8 <= len; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2 * i));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i),
                        _mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  return i;
}

// Largest magnitude pattern of 8k float32 patterns (k >= 1).
__attribute__((target("avx2"))) uint32_t AmaxAvx2(const uint32_t* v, int64_t len) {
  const __m256i abs = _mm256_set1_epi32(static_cast<int>(kAbs));
  __m256i m = _mm256_setzero_si256();
  for (int64_t i = 0; i < len; i += 8) {
    m = _mm256_max_epu32(m, _mm256_and_si256(
                                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + i)), abs));
  }
  __m128i m4 = _mm_max_epu32(_mm256_castsi256_si128(m), _mm256_extracti128_si256(m, 1));
  m4 = _mm_max_epu32(m4, _mm_shuffle_epi32(m4, 0b01001110));
  m4 = _mm_max_epu32(m4, _mm_shuffle_epi32(m4, 0b10110001));
  return static_cast<uint32_t>(_mm_cvtsi128_si32(m4));
}

// Largest finite magnitude pattern of float32 patterns v[0..len) (0 if none), 8 at a time.
__attribute__((target("avx2"))) uint32_t FiniteAmaxAvx2(const uint32_t* v, int64_t len) {
  const __m256i abs = _mm256_set1_epi32(static_cast<int>(kAbs));
  const __m256i e = _mm256_set1_epi32(static_cast<int>(kExp));
  __m256i m = _mm256_setzero_si256();
  int64_t i = 0;
  for (; i + 8 <= len; i += 8) {
    const __m256i a = _mm256_and_si256(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + i)), abs);
    m = _mm256_max_epu32(m, _mm256_and_si256(a, _mm256_cmpgt_epi32(e, a)));  // a < inf
  }
  __m128i m4 = _mm_max_epu32(_mm256_castsi256_si128(m), _mm256_extracti128_si256(m, 1));
  m4 = _mm_max_epu32(m4, _mm_shuffle_epi32(m4, 0b01001110));
  m4 = _mm_max_epu32(m4, _mm_shuffle_epi32(m4, 0b10110001));
  uint32_t top = static_cast<uint32_t>(_mm_cvtsi128_si32(m4));
  for (; i < len; ++i) {
    const uint32_t a = v[i] & kAbs;
    top = std::max(top, a < kExp ? a : 0u);
  }
  return top;
}

// FiniteAmaxAvx2 of bfloat16 patterns p[0..len), read as they are (16 at a time, no
// widening): the largest finite magnitude pattern, 0 if none. Widening is a shift, which
// keeps the order and finiteness, so this is FiniteAmax of the widened patterns >> 16.
__attribute__((target("avx2"))) uint16_t FiniteAmaxBf16Avx2(const uint16_t* p, int64_t len) {
  const __m256i abs = _mm256_set1_epi16(0x7FFF);
  const __m256i inf = _mm256_set1_epi16(0x7F80);
  __m256i m = _mm256_setzero_si256();
  int64_t i = 0;
  for (; i + 16 <= len; i += 16) {
    const __m256i a = _mm256_and_si256(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i)), abs);
    m = _mm256_max_epu16(m, _mm256_and_si256(a, _mm256_cmpgt_epi16(inf, a)));  // a < inf
  }
  __m128i m8 = _mm_max_epu16(_mm256_castsi256_si128(m), _mm256_extracti128_si256(m, 1));
  m8 = _mm_max_epu16(m8, _mm_shuffle_epi32(m8, 0b01001110));
  m8 = _mm_max_epu16(m8, _mm_shuffle_epi32(m8, 0b10110001));
  m8 = _mm_max_epu16(m8, _mm_shufflelo_epi16(_mm_shufflehi_epi16(m8, 0b10110001), 0b10110001));
  uint16_t top = static_cast<uint16_t>(_mm_extract_epi16(m8, 0));
  for (; i < len; ++i) {
    const uint16_t a = p[i] & 0x7FFFu;
    top = std::max(top, a < 0x7F80u ? a : uint16_t{0});
  }
  return top;
}

// DecodeChunk's values for 4- or 8-bit codes, 8 at a time, where the factor is constant
// over each group of 8 (blocks of a multiple of 8, or one factor); returns how many were done.
__attribute__((target("avx2"))) int64_t DecodeAvx2(const uint8_t* codes, int32_t bits,
                                                   const float* elut, const float* factors,
                                                   int64_t block, int64_t i0, int64_t len,
                                                   uint32_t* out) {
  const __m256i spread = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3);
  const __m256i nibble = _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4);
  const __m256i low4 = _mm256_set1_epi32(0xF);
  const __m256 lo = _mm256_loadu_ps(elut);
  const __m256 hi = bits == 4 ? _mm256_loadu_ps(elut + 8) : lo;
  // The current block and its factor, moved on as the groups of 8 cross into the next (a
  // division per group cost as much as the rest of the loop).
  int64_t b = factors != nullptr ? i0 / block : 0;
  int64_t next = (b + 1) * block;
  __m256 f = _mm256_set1_ps(factors != nullptr ? factors[b] : 1.0f);
  int64_t i = 0;
  for (; i + 8 <= len; i += 8) {
    const int64_t g = i0 + i;
    if (factors != nullptr && g >= next) {  // block % 8 == 0 here: g is the next block's start
      ++b;
      next += block;
      f = _mm256_set1_ps(factors[b]);
    }
    __m256i idx;
    if (bits == 8) {
      idx = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + g)));
    } else {
      int32_t four;
      std::memcpy(&four, codes + (g >> 1), sizeof four);
      const __m256i b = _mm256_permutevar8x32_epi32(
          _mm256_cvtepu8_epi32(_mm_cvtsi32_si128(four)), spread);
      idx = _mm256_and_si256(_mm256_srlv_epi32(b, nibble), low4);
    }
    // 16 values: two 8-value tables picked by the code's bit 3 (moved to the sign bit);
    // 256: a gather.
    __m256 v = bits == 4 ? _mm256_blendv_ps(_mm256_permutevar8x32_ps(lo, idx),
                                            _mm256_permutevar8x32_ps(hi, idx),
                                            _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)))
                         : _mm256_i32gather_ps(elut, idx, 4);
    if (factors != nullptr) v = _mm256_mul_ps(v, f);
    _mm256_storeu_ps(reinterpret_cast<float*>(out + i), v);
  }
  return i;
}

// Non-finite float32 patterns among v[0..len), 8 at a time; *done receives how many were
// looked at (a multiple of 8).
__attribute__((target("avx2"))) int64_t NonfiniteAvx2(const uint32_t* v, int64_t len,
                                                      int64_t* done) {
  const __m256i e = _mm256_set1_epi32(static_cast<int>(kExp));
  __m256i count = _mm256_setzero_si256();
  int64_t i = 0;
  for (; i + 8 <= len; i += 8) {
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + i));
    count = _mm256_sub_epi32(count, _mm256_cmpeq_epi32(_mm256_and_si256(b, e), e));
  }
  alignas(32) int32_t c[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(c), count);
  *done = i;
  return static_cast<int64_t>(c[0]) + c[1] + c[2] + c[3] + c[4] + c[5] + c[6] + c[7];
}

// FloatBitsToBf16 of v[0..len) into o, 8 at a time, counting the non-finite results; stops
// before the first group of 8 holding a finite value that overflows (the scalar loop counts
// and, if asked, saturates those). Returns how many were done; *nonfinite is increased.
__attribute__((target("avx2"))) int64_t NarrowBf16Avx2(const uint32_t* v, int64_t len,
                                                       uint16_t* o, int64_t* nonfinite) {
  const __m256i abs = _mm256_set1_epi32(static_cast<int>(kAbs));
  const __m256i e = _mm256_set1_epi32(static_cast<int>(kExp));
  const __m256i one = _mm256_set1_epi32(1);
  const __m256i round = _mm256_set1_epi32(0x7FFF);
  const __m256i qnan = _mm256_set1_epi32(0x7FC0);
  const __m256i sign16 = _mm256_set1_epi32(0x8000);
  const __m256i inf16 = _mm256_set1_epi32(0x7F80);
  const __m256i abs16 = _mm256_set1_epi32(0x7FFF);
  const __m256i low16 = _mm256_set1_epi32(0xFFFF);
  __m256i count = _mm256_setzero_si256();
  // Finite values that bfloat16 holds exactly (their low 16 bits zero) need no rounding and
  // cannot overflow: their top halves are the result (an FP4 or FP8 code times a power of
  // two: the MX decode's values). Taken until a group of 8 is not that (NVFP4's rounded
  // products), then the rounding loop, so other values pay one test per call.
  int64_t i = 0;
  for (; i + 8 <= len; i += 8) {
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + i));
    const __m256i odd = _mm256_or_si256(_mm256_and_si256(b, low16),
                                        _mm256_cmpeq_epi32(_mm256_and_si256(b, e), e));
    if (!_mm256_testz_si256(odd, odd)) break;
    const __m256i top = _mm256_srli_epi32(b, 16);
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(top, top), 0b1000);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(o + i), _mm256_castsi256_si128(packed));
  }
  for (; i + 8 <= len; i += 8) {
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + i));
    const __m256i is_nan = _mm256_cmpgt_epi32(_mm256_and_si256(b, abs), e);  // |b| > inf
    // Round to nearest even on the top 16 bits (a NaN's sum may wrap: replaced below).
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), one);
    const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(b, round), lsb), 16);
    const __m256i nan = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(b, 16), sign16), qnan);
    const __m256i h = _mm256_blendv_epi8(rounded, nan, is_nan);
    const __m256i finite_in = _mm256_xor_si256(_mm256_cmpeq_epi32(_mm256_and_si256(b, e), e),
                                               _mm256_set1_epi32(-1));
    const __m256i over = _mm256_and_si256(
        _mm256_cmpeq_epi32(_mm256_and_si256(h, abs16), inf16), finite_in);
    if (!_mm256_testz_si256(over, over)) break;  // the scalar loop takes it from here
    count = _mm256_sub_epi32(count, _mm256_cmpeq_epi32(_mm256_and_si256(h, inf16), inf16));
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(h, h), 0b1000);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(o + i), _mm256_castsi256_si128(packed));
  }
  alignas(32) int32_t c[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(c), count);
  *nonfinite += static_cast<int64_t>(c[0]) + c[1] + c[2] + c[3] + c[4] + c[5] + c[6] + c[7];
  return i;
}
#endif

// Largest finite magnitude pattern of float32 patterns v[0..len) (0 if none).
uint32_t FiniteAmax(const uint32_t* v, int64_t len) {
#ifdef LOWPREC_X86_AVX2
  if (lowprec_native::HasAvx2()) return FiniteAmaxAvx2(v, len);
#endif
  uint32_t top = 0;
  for (int64_t i = 0; i < len; ++i) {
    const uint32_t a = v[i] & kAbs;
    top = std::max(top, a < kExp ? a : 0u);
  }
  return top;
}

// Elements [i0, i0 + len) of x as float32 bits into out.
void WidenChunk(const void* x, int32_t kind, int64_t i0, int64_t len, uint32_t* out) {
  if (kind == kF32) {
    std::memcpy(out, static_cast<const float*>(x) + i0, static_cast<size_t>(len) * 4);
    return;
  }
  const uint8_t* p = static_cast<const uint8_t*>(x) + 2 * i0;
  int64_t i = 0;
#ifdef LOWPREC_X86_AVX2
  if (kind == kBF16 && lowprec_native::HasAvx2()) i = WidenBf16Avx2(p, len, out);
#endif
  for (; i < len; ++i) {
    uint16_t h;
    std::memcpy(&h, p + 2 * i, sizeof h);
    out[i] = kind == kBF16 ? static_cast<uint32_t>(h) << 16 : HalfToFloatBits(h);
  }
}

// The code of element i of a packed stream (4 bits: two per byte, element 2k in the low
// nibble; 6 bits: four per three bytes, code j of a group in bits 6j..6j+5 of its
// little-endian 24-bit word; 8 bits: one per byte).
inline uint32_t CodeAt(const uint8_t* codes, int32_t bits, int64_t i) {
  if (bits == 8) return codes[i];
  if (bits == 4) return (codes[i >> 1] >> ((i & 1) * 4)) & 0xFu;
  const uint8_t* g = codes + (i >> 2) * 3;
  const uint32_t w = g[0] | (static_cast<uint32_t>(g[1]) << 8) | (static_cast<uint32_t>(g[2]) << 16);
  return (w >> ((i & 3) * 6)) & 0x3Fu;
}

// Decoded values of elements [i0, i0 + len) as float32 bits: elut[code] x factors[i / block]
// (no factors: the table value as it is); NaN results made lowprec's canonical NaN if asked.
void DecodeChunk(const uint8_t* codes, int32_t bits, const float* elut, const float* factors,
                 int64_t block, bool canonical_nan, int64_t i0, int64_t len, uint32_t* out) {
  int64_t i = 0;
#ifdef LOWPREC_X86_AVX2
  // The vector loop needs groups of 8 that start a byte (i0 is a multiple of 8) and see one
  // factor each.
  if ((bits == 4 || bits == 8) && i0 % 8 == 0 && lowprec_native::HasAvx2() &&
      (factors == nullptr || block % 8 == 0 || i0 + len <= block)) {
    i = DecodeAvx2(codes, bits, elut, factors, block, i0, len, out);
  }
#endif
  if (factors == nullptr) {
    for (; i < len; ++i) out[i] = ToBits(elut[CodeAt(codes, bits, i0 + i)]);
  }
  while (i < len) {  // one block (or the part of it in this chunk) at a time
    const int64_t b = (i0 + i) / block;
    const int64_t end = std::min(len, (b + 1) * block - i0);
    const float f = factors[b];
    if (bits == 4 && ((i0 + i) & 1) == 0) {
      for (; i + 1 < end; i += 2) {  // a byte at a time
        const uint8_t byte = codes[(i0 + i) >> 1];
        out[i] = ToBits(elut[byte & 0xFu] * f);
        out[i + 1] = ToBits(elut[byte >> 4] * f);
      }
    }
    for (; i < end; ++i) out[i] = ToBits(elut[CodeAt(codes, bits, i0 + i)] * f);
  }
  if (canonical_nan) {
    for (int64_t k = 0; k < len; ++k) {
      if ((out[k] & kAbs) > kExp) out[k] = kQNaN;
    }
  }
}

struct Acc {  // one piece's statistics while they accumulate
  double v[kNumStats] = {};
};

// Elements whose input or decoded value is not finite: counted as ErrorStats.update does;
// the finite pairs among them join the sums (each term fused, as in the lanes).
void ScalarStats(const uint32_t* xb, const uint32_t* qb, int64_t len, Acc& a) {
  for (int64_t i = 0; i < len; ++i) {
    const double xd = FromBits(xb[i]);
    const double qd = FromBits(qb[i]);
    const bool fx = std::isfinite(xd), fq = std::isfinite(qd);
    if (fx && fq) {
      const double e = xd - qd;
      a.v[kCount] += 1;
      a.v[kSumX2] += xd * xd;  // exact product: the same as a fused multiply-add
      a.v[kSumE2] = std::fma(e, e, a.v[kSumE2]);
      const double ae = std::fabs(e);
      a.v[kMaxAbs] = std::max(a.v[kMaxAbs], ae);
      a.v[kMaxRel] = std::max(a.v[kMaxRel], ae / std::max(std::fabs(xd), 5e-324));
      continue;
    }
    const bool nan_x = std::isnan(xd), inf_x = std::isinf(xd);
    a.v[kNonfinite] += 1;
    a.v[kNanIn] += nan_x;
    a.v[kInfIn] += inf_x;
    a.v[kInfSaturated] += inf_x && fq;
    a.v[kFiniteToNonfinite] += fx && !fq;
    const bool same = (nan_x && std::isnan(qd)) || xd == qd;
    a.v[kNonfiniteChanged] += !fx && !same;
  }
}

// The finite pairs' sums and maxima in 8 lanes (lane = i mod 8). `mrc` is what the skip
// test of the relative error compares with (see FiniteStatsAvx2): the lane's maximum m
// itself where m is a power of two (0 and 1 included; m |x| is then exact), else m (1 -
// 2^-50).
struct Lanes {
  double x2[8] = {}, e2[8] = {}, ma[8] = {}, mr[8] = {}, mrc[8] = {};
};

constexpr double kSkipMargin = 1.0 - 0x1p-50;

inline double SkipBound(double m) {
  uint64_t b;
  std::memcpy(&b, &m, sizeof b);
  return (b & 0x000F'FFFF'FFFF'FFFFull) == 0 ? m : m * kSkipMargin;
}

// Lane k's relative error of one pair: |e| / max(|x|, 5e-324) (NumPy's formula), computed
// only where it may raise the lane's maximum: where |e| > mrc |x|. A skipped pair has
// |e| <= m |x| (the product rounded up by at most 2^-53 twice, or exact for a power-of-two
// m), so its ratio rounds to at most m; x = 0 is never skipped for a non-zero error (its
// ratio, up to 2^1074 |e|, may exceed any earlier one; mrc = inf gives NaN, no candidate,
// and nothing exceeds inf). The product is never subnormal (slow on CPUs): a non-zero mrc
// is at least 2^-149 / 2^128 (a float32 error over a float32 input) and |x| >= 2^-149.
inline void RelError(double ae, double xd, int k, Lanes& l) {
  const double ax = std::fabs(xd);
  if (ae > l.mrc[k] * ax) {
    const double r = ae / std::max(ax, 5e-324);
    if (r > l.mr[k]) {
      l.mr[k] = r;
      l.mrc[k] = SkipBound(r);
    }
  }
}

void FiniteStatsPortable(const uint32_t* xb, const uint32_t* qb, int64_t len, Lanes& l) {
  for (int64_t i = 0; i < len; ++i) {
    const int k = static_cast<int>(i & 7);
    const double xd = FromBits(xb[i]);
    const double e = xd - static_cast<double>(FromBits(qb[i]));
    l.x2[k] += xd * xd;  // exact product: the same as a fused multiply-add
    l.e2[k] = std::fma(e, e, l.e2[k]);
    const double ae = std::fabs(e);
    l.ma[k] = std::max(l.ma[k], ae);
    RelError(ae, xd, k, l);
  }
}

#ifdef LOWPREC_X86_AVX2
// FiniteStatsPortable on two vectors of 4 doubles per step (lanes 0-3 and 4-7), the same
// results bit for bit; the relative error's division (the slowest step) only where the skip
// test fails, rarely once a lane's maximum is reached (usually 1: an element that became 0).
// The loop is bound by the floating-point ports (9 of its operations per 4 pairs use them):
// a fused multiply-add per square and no floor in the skip test keep that count low.
__attribute__((target("avx2,fma"))) void FiniteStatsAvx2(const uint32_t* xb, const uint32_t* qb,
                                                     int64_t len, Lanes& l) {
  const __m256d sign = _mm256_set1_pd(-0.0);
  __m256d x2[2], e2[2], ma[2], mrc[2];
  for (int h = 0; h < 2; ++h) {
    x2[h] = _mm256_loadu_pd(l.x2 + 4 * h);
    e2[h] = _mm256_loadu_pd(l.e2 + 4 * h);
    ma[h] = _mm256_loadu_pd(l.ma + 4 * h);
    mrc[h] = _mm256_loadu_pd(l.mrc + 4 * h);
  }
  int64_t i = 0;
  for (; i + 8 <= len; i += 8) {
    __m256d may = _mm256_setzero_pd();
    for (int h = 0; h < 2; ++h) {  // 4 floats loaded and widened in one step each
      const __m256d xd = _mm256_cvtps_pd(_mm_loadu_ps(reinterpret_cast<const float*>(xb + i + 4 * h)));
      const __m256d qd = _mm256_cvtps_pd(_mm_loadu_ps(reinterpret_cast<const float*>(qb + i + 4 * h)));
      const __m256d e = _mm256_sub_pd(xd, qd);
      x2[h] = _mm256_fmadd_pd(xd, xd, x2[h]);
      e2[h] = _mm256_fmadd_pd(e, e, e2[h]);
      const __m256d ae = _mm256_andnot_pd(sign, e);
      ma[h] = _mm256_max_pd(ma[h], ae);
      const __m256d bound = _mm256_mul_pd(mrc[h], _mm256_andnot_pd(sign, xd));
      may = _mm256_or_pd(may, _mm256_cmp_pd(ae, bound, _CMP_GT_OQ));
    }
    if (_mm256_movemask_pd(may)) {  // rare: the 8 pairs one by one, as the portable loop
      for (int h = 0; h < 2; ++h) _mm256_storeu_pd(l.mrc + 4 * h, mrc[h]);
      for (int k = 0; k < 8; ++k) {
        const double xd = FromBits(xb[i + k]);
        RelError(std::fabs(xd - static_cast<double>(FromBits(qb[i + k]))), xd, k, l);
      }
      for (int h = 0; h < 2; ++h) mrc[h] = _mm256_loadu_pd(l.mrc + 4 * h);
    }
  }
  for (int h = 0; h < 2; ++h) {
    _mm256_storeu_pd(l.x2 + 4 * h, x2[h]);
    _mm256_storeu_pd(l.e2 + 4 * h, e2[h]);
    _mm256_storeu_pd(l.ma + 4 * h, ma[h]);
  }
  FiniteStatsPortable(xb + i, qb + i, len - i, l);  // the tail, lanes from 0 again
}

#endif

// A chunk's pairs, all finite or not: its sums and maxima go to `chunk` (sums from 0,
// maxima from the running ones in `l`); true, and merged into `l`, iff the sums are
// finite, which they are exactly when every pair is (a finite float32 squared is at most
// 2^256 in float64). Otherwise the caller counts the chunk element by element.
bool FiniteStats(const uint32_t* xb, const uint32_t* qb, int64_t len, Lanes& l) {
  Lanes c = l;
  std::fill(c.x2, c.x2 + 8, 0.0);
  std::fill(c.e2, c.e2 + 8, 0.0);
#ifdef LOWPREC_X86_AVX2
  if (HasAvx2Fma()) {
    FiniteStatsAvx2(xb, qb, len, c);
  } else
#endif
  {
    FiniteStatsPortable(xb, qb, len, c);
  }
  double sx = 0, se = 0;
  for (int k = 0; k < 8; ++k) {
    sx += c.x2[k];
    se += c.e2[k];
  }
  if (!std::isfinite(sx) || !std::isfinite(se)) return false;
  for (int k = 0; k < 8; ++k) {
    l.x2[k] += c.x2[k];
    l.e2[k] += c.e2[k];
    l.ma[k] = c.ma[k];
    l.mr[k] = c.mr[k];
    l.mrc[k] = c.mrc[k];
  }
  return true;
}

// Clipped blocks of a (P, A, S) piece, blocks of `block` elements along A (strided by S):
// those whose largest |x| (float32, compared in float64) exceeds factor x max_finite, the
// factors in the (P, A / block, S) layout; a block whose factor is NaN (its scale code the
// scale format's NaN) is never clipped.
void ClippedBlocks(const void* x, int32_t kind, const float* factors, int64_t block, int64_t P,
                   int64_t A, int64_t S, double max_finite, Acc& a) {
  const int64_t per = A / block;
  double count = 0;
  for (int64_t p = 0; p < P; ++p) {
    for (int64_t ab = 0; ab < per; ++ab) {
      for (int64_t s = 0; s < S; ++s) {
        uint32_t amax = 0;
        const int64_t first = (p * A + ab * block) * S + s;
        for (int64_t k = 0; k < block; ++k) {
          amax = std::max(amax, InputBits(x, kind, first + k * S) & kAbs);
        }
        const double limit = static_cast<double>(factors[(p * per + ab) * S + s]) * max_finite;
        count += static_cast<double>(FromBits(amax)) > limit;  // NaN amax or limit: false
      }
    }
  }
  a.v[kClipped] += count;
  a.v[kClipTotal] += static_cast<double>(P * per * S);
}

#ifdef LOWPREC_X86_AVX2
// The largest magnitude patterns of 8 consecutive blocks of `block` (a multiple of 8) float32
// patterns from v: lane k is block k's. Each block's columns of 8 are reduced first, then
// the 8 blocks' lanes together (a transpose of max steps: 14 for 8 blocks instead of 7
// shuffles and maxima per block, AmaxAvx2's).
__attribute__((target("avx2"))) inline __m256i BlockAmax8Avx2(const uint32_t* v, int64_t block) {
  const __m256i abs = _mm256_set1_epi32(static_cast<int>(kAbs));
  __m256i m[8];
  for (int k = 0; k < 8; ++k) {
    const uint32_t* b = v + k * block;
    __m256i a = _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)), abs);
    for (int64_t j = 8; j < block; j += 8) {
      a = _mm256_max_epu32(a, _mm256_and_si256(
                                  _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + j)), abs));
    }
    m[k] = a;
  }
  // Pairs of blocks interleaved and reduced, then pairs of pairs, then the two halves.
  __m256i p[4], q[2];
  for (int k = 0; k < 4; ++k) {
    p[k] = _mm256_max_epu32(_mm256_unpacklo_epi32(m[2 * k], m[2 * k + 1]),
                            _mm256_unpackhi_epi32(m[2 * k], m[2 * k + 1]));
  }  // p[k] lanes: (2k, 2k+1, 2k, 2k+1 | the same in the upper half)
  for (int k = 0; k < 2; ++k) {
    q[k] = _mm256_max_epu32(_mm256_unpacklo_epi64(p[2 * k], p[2 * k + 1]),
                            _mm256_unpackhi_epi64(p[2 * k], p[2 * k + 1]));
  }  // q[k] lanes: (4k, 4k+1, 4k+2, 4k+3) in each half
  return _mm256_max_epu32(_mm256_permute2x128_si256(q[0], q[1], 0x20),
                          _mm256_permute2x128_si256(q[0], q[1], 0x31));
}

// Clipped blocks among 8 blocks (their largest magnitude patterns `amax`, their factors f):
// float64(amax) > float64(factor) x max_finite, 4 at a time, as the scalar test computes it
// (one rounded product; NaN on either side compares false).
__attribute__((target("avx2"))) inline int Clipped8Avx2(__m256i amax, const float* f,
                                                        double max_finite) {
  const __m256d top = _mm256_set1_pd(max_finite);
  const __m256 a = _mm256_castsi256_ps(amax);
  const __m256 fs = _mm256_loadu_ps(f);
  const __m256d lo = _mm256_cmp_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(a)),
                                   _mm256_mul_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(fs)), top),
                                   _CMP_GT_OQ);
  const __m256d hi = _mm256_cmp_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(a, 1)),
                                   _mm256_mul_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(fs, 1)), top),
                                   _CMP_GT_OQ);
  return __builtin_popcount(static_cast<unsigned>(_mm256_movemask_pd(lo)) |
                            (static_cast<unsigned>(_mm256_movemask_pd(hi)) << 4));
}

// ClippedInChunk for blocks of a multiple of 8 elements, 8 blocks at a time: the count among
// the first 8 * (len / (8 * block)) blocks; *done receives the elements looked at.
__attribute__((target("avx2"))) double ClippedBlocks8Avx2(const uint32_t* xv, int64_t len,
                                                          const float* factors, int64_t block,
                                                          double max_finite, int64_t* done) {
  int64_t count = 0;
  int64_t i = 0;
  for (int64_t b = 0; i + 8 * block <= len; i += 8 * block, b += 8) {
    count += Clipped8Avx2(BlockAmax8Avx2(xv + i, block), factors + b, max_finite);
  }
  *done = i;
  return static_cast<double>(count);
}
#endif

// Clipped blocks among the `len / block` whole blocks of float32 patterns xv (S = 1): those
// whose largest |x| exceeds factors[b] x max_finite. A NaN amax (a block holding a NaN) or a
// NaN factor (the scale's NaN code) compares false: never clipped.
double ClippedInChunk(const uint32_t* xv, int64_t len, const float* factors, int64_t block,
                      double max_finite) {
  double clipped = 0;
  int64_t first = 0;
#ifdef LOWPREC_X86_AVX2
  if (block % 8 == 0 && lowprec_native::HasAvx2()) {
    clipped = ClippedBlocks8Avx2(xv, len, factors, block, max_finite, &first);
  }
#endif
  for (int64_t b0 = first; b0 < len; b0 += block) {
    uint32_t amax = 0;
#ifdef LOWPREC_X86_AVX2
    if (block % 8 == 0 && lowprec_native::HasAvx2()) {
      amax = AmaxAvx2(xv + b0, block);
    } else
#endif
    {
      for (int64_t k = 0; k < block; ++k) amax = std::max(amax, xv[b0 + k] & kAbs);
    }
    clipped += static_cast<double>(FromBits(amax)) >
               static_cast<double>(factors[b0 / block]) * max_finite;
  }
  return clipped;
}

// One chunk's pairs (input patterns xv, decoded patterns qv) into the lanes and counts:
// the order every caller keeps (chunks of kChunk from the piece's start), so a piece's
// statistics do not depend on which pass computed them.
void ChunkStats(const uint32_t* xv, const uint32_t* qv, int64_t len, Lanes& lanes, Acc& a) {
  if (FiniteStats(xv, qv, len, lanes)) {
    a.v[kCount] += static_cast<double>(len);
  } else {
    ScalarStats(xv, qv, len, a);
  }
}

void AddLanes(const Lanes& lanes, Acc& a) {  // the lanes in order, after the scalar sums
  for (int k = 0; k < 8; ++k) {
    a.v[kSumX2] += lanes.x2[k];
    a.v[kSumE2] += lanes.e2[k];
    a.v[kMaxAbs] = std::max(a.v[kMaxAbs], lanes.ma[k]);
    a.v[kMaxRel] = std::max(a.v[kMaxRel], lanes.mr[k]);
  }
}

}  // namespace

// Error statistics of one piece: its input x (n elements of `kind`: 0 float32, 1 bfloat16,
// 2 float16) against its decoded values, given as q (n values of `q_kind`) or, when q is
// null, decoded from the packed `codes` (code_bits 4, 6 or 8) as elut[code] x
// factors[i / block] (factors null: elut[code]). out[13] receives (count, sum x^2, sum e^2,
// max |e|, max |e|/|x|, non-finite, NaN in, inf in, inf saturated, finite to non-finite,
// non-finite changed, clipped, clip total); see Clipped for `clip` (0: none), with the piece
// seen as (P, A, S) and the factors in the (P, A / block, S) layout. Returns 0, or 1 for
// arguments it does not take (nothing is written then).
LOWPREC_EXPORT int32_t lowprec_ckpt_stats(const void* x, int32_t kind, int64_t n, const void* q,
                                          int32_t q_kind, const uint8_t* codes, int32_t code_bits,
                                          const float* elut, const float* factors, int64_t block,
                                          int32_t clip, double max_finite, float cast_scale,
                                          int64_t P, int64_t A, int64_t S, double* out) {
  if (kind < kF32 || kind > kF16 || n < 0 || out == nullptr) return 1;
  if (q == nullptr && (codes == nullptr || elut == nullptr ||
                       (code_bits != 4 && code_bits != 6 && code_bits != 8)))
    return 1;
  if (q != nullptr && (q_kind < kF32 || q_kind > kF16)) return 1;
  if ((factors != nullptr || clip == 1) && block <= 0) return 1;
  if (clip == 1 && (factors == nullptr || P < 0 || S <= 0 || A % block != 0 || P * A * S != n))
    return 1;
  if (clip < 0 || clip > 2) return 1;
  ExactFloats exact;
  Acc a;
  Lanes lanes;
  uint32_t xb[kChunk], qb[kChunk];
  // Blocks along a contiguous axis (S = 1) that divide the chunk are counted in its loop,
  // while the chunk's values are at hand; others in a pass of their own (Clipped).
  const bool fused = clip == 2 || (clip == 1 && S == 1 && kChunk % block == 0);
  const float cast_top = static_cast<float>(max_finite);
  double clipped = 0;
  for (int64_t i0 = 0; i0 < n; i0 += kChunk) {
    const int64_t len = std::min(kChunk, n - i0);
    const uint32_t* xv = xb;  // float32 input is read where it is
    if (kind == kF32) {
      xv = static_cast<const uint32_t*>(x) + i0;
    } else {
      WidenChunk(x, kind, i0, len, xb);
    }
    if (fused && clip == 1) {
      clipped += ClippedInChunk(xv, len, factors + i0 / block, block, max_finite);
    } else if (clip == 2) {
      for (int64_t k = 0; k < len; ++k) clipped += std::fabs(FromBits(xv[k]) / cast_scale) > cast_top;
    }
    const uint32_t* qv = qb;
    if (q != nullptr && q_kind == kF32) {
      qv = static_cast<const uint32_t*>(q) + i0;
    } else if (q != nullptr) {
      WidenChunk(q, q_kind, i0, len, qb);
    } else {
      DecodeChunk(codes, code_bits, elut, factors, block, false, i0, len, qb);
    }
    ChunkStats(xv, qv, len, lanes, a);
  }
  AddLanes(lanes, a);
  if (fused) {
    a.v[kClipped] = clipped;
    a.v[kClipTotal] = static_cast<double>(clip == 2 ? n : n / block);
  } else if (clip == 1) {
    ClippedBlocks(x, kind, factors, block, P, A, S, max_finite, a);
  }
  std::memcpy(out, a.v, sizeof a.v);
  return 0;
}

namespace {

// NVFP4 (lowprec's recipe, the "divide" step) of `blocks` blocks of 16 float32 patterns
// under the tensor scale ts, by IEEE float32 arithmetic (subnormals kept): for a block of
// largest magnitude amax, its E4M3 scale code is RNE(clamp((amax / 6) / ts, 2^-6, 448)) (two
// correctly rounded divisions, in that order), its divisor float32(ts x that scale), each
// element's E2M1 code RNE(|x| / divisor) saturated at 6 with x's sign bit (-0 keeps it),
// two per byte, element 2k in the low nibble; a block holding a NaN or an infinity gets the
// E4M3 NaN code 0x7F and zero elements. That is _nvfp4.py's exact formulation step by step:
// its software divisions and product round as IEEE float32 does, which the caller relies on
// only for ts in [2^-118, 2^116] (where _nvfp4.py shows every product normal).
//
// The block arithmetic (scale code, divisor, E2M1 codes) is _nvfp4_cpu.h's, shared with the
// quantize_mx kernel.
using lowprec_native::E2m1Magnitude;
using lowprec_native::kE4m3Nan;
using lowprec_native::Nvfp4Scale;
#ifdef LOWPREC_X86_AVX2
using lowprec_native::Nvfp4PairAvx2;
#endif

// One block (the scalar steps): its largest magnitude pattern is returned.
uint32_t Nvfp4Block(const uint32_t* xb, float ts, uint8_t* out, uint8_t* scale) {
  uint32_t amax = 0;
  for (int k = 0; k < 16; ++k) amax = std::max(amax, xb[k] & kAbs);
  if (amax >= kExp) {
    *scale = kE4m3Nan;
    std::memset(out, 0, 8);
    return amax;
  }
  float divisor;
  *scale = static_cast<uint8_t>(Nvfp4Scale(amax, ts, &divisor));
  for (int j = 0; j < 8; ++j) {
    const uint32_t lo = E2m1Magnitude(FromBits(xb[2 * j] & kAbs) / divisor) | ((xb[2 * j] >> 31) << 3);
    const uint32_t hi =
        E2m1Magnitude(FromBits(xb[2 * j + 1] & kAbs) / divisor) | ((xb[2 * j + 1] >> 31) << 3);
    out[j] = static_cast<uint8_t>(lo | (hi << 4));
  }
  return amax;
}

#ifdef LOWPREC_X86_AVX2
// Nvfp4Blocks 8 blocks at a time (their maxima together, then pairs), for the first
// 8 * (blocks / 8); returns how many blocks were done.
__attribute__((target("avx2"))) int64_t Nvfp4Blocks8Avx2(const uint32_t* xv, int64_t blocks,
                                                         float ts, uint8_t* elements,
                                                         uint8_t* scales, uint32_t* amax) {
  int64_t blk = 0;
  for (; blk + 8 <= blocks; blk += 8) {
    const __m256i m = BlockAmax8Avx2(xv + 16 * blk, 16);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(amax + blk), m);
    // A NaN or an infinity among them (a pattern >= inf's; patterns are < 2^31 here, so the
    // signed comparison is the unsigned one): these 8 blocks by the scalar steps.
    const __m256i bad = _mm256_cmpgt_epi32(m, _mm256_set1_epi32(static_cast<int>(kExp - 1)));
    if (!_mm256_testz_si256(bad, bad)) {
      for (int64_t k = blk; k < blk + 8; ++k) Nvfp4Block(xv + 16 * k, ts, elements + 8 * k, scales + k);
      continue;
    }
    for (int64_t k = blk; k < blk + 8; k += 2) {
      float d0, d1;
      scales[k] = static_cast<uint8_t>(Nvfp4Scale(amax[k], ts, &d0));
      scales[k + 1] = static_cast<uint8_t>(Nvfp4Scale(amax[k + 1], ts, &d1));
      Nvfp4PairAvx2(xv + 16 * k, d0, d1, elements + 8 * k);
    }
  }
  return blk;
}
#endif

// `blocks` blocks of xv; amax[b] receives block b's largest magnitude pattern (what the
// statistics' clipped-block count needs: not computed again).
void Nvfp4Blocks(const uint32_t* xv, int64_t blocks, float ts, uint8_t* elements,
                 uint8_t* scales, uint32_t* amax) {
  int64_t blk = 0;
#ifdef LOWPREC_X86_AVX2
  if (lowprec_native::HasAvx2()) blk = Nvfp4Blocks8Avx2(xv, blocks, ts, elements, scales, amax);
#endif
  for (; blk < blocks; ++blk) {
    amax[blk] = Nvfp4Block(xv + 16 * blk, ts, elements + 8 * blk, scales + blk);
  }
}

#ifdef LOWPREC_X86_AVX2
__attribute__((target("avx2"))) double ClippedFromAmax8Avx2(const uint32_t* amax,
                                                            const float* factors, int64_t blocks,
                                                            double max_finite, int64_t* done) {
  int64_t count = 0, b = 0;
  for (; b + 8 <= blocks; b += 8) {
    count += Clipped8Avx2(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(amax + b)),
                          factors + b, max_finite);
  }
  *done = b;
  return static_cast<double>(count);
}
#endif

// Clipped blocks among `blocks` blocks of largest magnitude patterns amax (as ClippedInChunk
// counts them from the elements).
double ClippedFromAmax(const uint32_t* amax, const float* factors, int64_t blocks,
                       double max_finite) {
  double clipped = 0;
  int64_t b = 0;
#ifdef LOWPREC_X86_AVX2
  if (lowprec_native::HasAvx2()) clipped = ClippedFromAmax8Avx2(amax, factors, blocks, max_finite, &b);
#endif
  for (; b < blocks; ++b) {
    clipped += static_cast<double>(FromBits(amax[b])) > static_cast<double>(factors[b]) * max_finite;
  }
  return clipped;
}

// The fused pass of lowprec_ckpt_quantize and lowprec_ckpt_quantize_nvfp4: `encode(xv,
// blocks, el, sc, amax)` writes a chunk's codes and returns 0 (refused), 1 (done), or 2 (done,
// and each block's largest magnitude pattern written to amax, which the clipped-block count
// then takes instead of finding them again); the statistics follow as described there.
template <typename Encode>
int32_t QuantizeFused(const void* x, int32_t kind, int64_t n, int64_t code_bits, int64_t block,
                      uint8_t* elements, uint8_t* scales, const float* elut, const float* ftable,
                      double max_finite, double* out, const Encode& encode) {
  ExactFloats exact;
  Acc a;
  Lanes lanes;
  alignas(32) uint32_t xb[kChunk];
  uint32_t qb[kChunk];
  float factors[kChunk];
  uint32_t amax[kChunk];
  double clipped = 0;
  for (int64_t i0 = 0; i0 < n; i0 += kChunk) {
    const int64_t len = std::min(kChunk, n - i0);
    const uint32_t* xv = xb;
    if (kind == kF32) {
      xv = static_cast<const uint32_t*>(x) + i0;
    } else {
      WidenChunk(x, kind, i0, len, xb);
    }
    uint8_t* el = elements + i0 * code_bits / 8;
    uint8_t* sc = scales + i0 / block;
    const int32_t encoded = encode(xv, len / block, el, sc, amax);
    if (encoded == 0) return 1;
    if (out == nullptr) continue;
    for (int64_t b = 0; b < len / block; ++b) factors[b] = ftable[sc[b]];
    clipped += encoded == 2 ? ClippedFromAmax(amax, factors, len / block, max_finite)
                            : ClippedInChunk(xv, len, factors, block, max_finite);
    DecodeChunk(el, static_cast<int32_t>(code_bits), elut, factors, block, false, 0, len, qb);
    ChunkStats(xv, qb, len, lanes, a);
  }
  if (out != nullptr) {
    AddLanes(lanes, a);
    a.v[kClipped] = clipped;
    a.v[kClipTotal] = static_cast<double>(n / block);
    std::memcpy(out, a.v, sizeof a.v);
  }
  return 0;
}

}  // namespace

// MX quantization of a piece fused with its error statistics: x (n elements of `kind`: 0
// float32, 1 bfloat16, 2 float16) blocked along its last axis in blocks of `block` (dividing
// kChunk), quantized by _mx_quantize_cpu.cc's loops (`attrs`: the 13 integers of
// _mx_quantize_cpu.attributes) into the packed `elements` (code_bits per element) and the
// E8M0 `scales`, a chunk at a time; with `out` not null, each chunk's codes are decoded
// while at hand (elut[code] x ftable[scale code]) and its statistics and clipped blocks
// computed as lowprec_ckpt_stats computes them for the stored codes (clip = 1): the same
// chunks, lanes and order, so the same float64 results bit for bit. One read of x instead
// of a quantize pass and a statistics pass. Returns 0, or 1 for arguments it does not take.
LOWPREC_EXPORT int32_t lowprec_ckpt_quantize(const void* x, int32_t kind, int64_t n,
                                             const int64_t* attrs, uint8_t* elements,
                                             uint8_t* scales, const float* elut,
                                             const float* ftable, double max_finite,
                                             double* out) {
  if (kind < kF32 || kind > kF16 || n < 0 || attrs == nullptr || elements == nullptr ||
      scales == nullptr)
    return 1;
  const int64_t code_bits = attrs[4], block = attrs[7];
  if (block <= 0 || kChunk % block != 0 || n % block != 0) return 1;
  if (out != nullptr && (elut == nullptr || ftable == nullptr)) return 1;
  return QuantizeFused(x, kind, n, code_bits, block, elements, scales, elut, ftable, max_finite,
                       out, [attrs](const uint32_t* xv, int64_t blocks, uint8_t* el, uint8_t* sc,
                                    uint32_t*) {
                         return lowprec_native::MxQuantizeBlocks(
                                    reinterpret_cast<const float*>(xv), static_cast<size_t>(blocks),
                                    attrs, el, sc)
                                    ? 1
                                    : 0;
                       });
}

// lowprec_ckpt_quantize for NVFP4 (Nvfp4Blocks: blocks of 16 under the tensor scale ts,
// packed E2M1 elements and E4M3 scale codes; `ftable` then holds float32(ts x scale) per
// scale code). Returns 0, or 1 for arguments it does not take (ts outside [2^-118, 2^116]).
LOWPREC_EXPORT int32_t lowprec_ckpt_quantize_nvfp4(const void* x, int32_t kind, int64_t n,
                                                   float ts, uint8_t* elements, uint8_t* scales,
                                                   const float* elut, const float* ftable,
                                                   double max_finite, double* out) {
  if (kind < kF32 || kind > kF16 || n < 0 || n % 16 != 0 || elements == nullptr ||
      scales == nullptr)
    return 1;
  if (!(ts >= 0x1p-118f && ts <= 0x1p116f)) return 1;
  if (out != nullptr && (elut == nullptr || ftable == nullptr)) return 1;
  return QuantizeFused(x, kind, n, 4, 16, elements, scales, elut, ftable, max_finite, out,
                       [ts](const uint32_t* xv, int64_t blocks, uint8_t* el, uint8_t* sc,
                            uint32_t* amax) {
                         Nvfp4Blocks(xv, blocks, ts, el, sc, amax);
                         return 2;
                       });
}

namespace {

// The body of lowprec_ckpt_decode and lowprec_ckpt_decode_scaled: with `scale_codes`, block
// b's factor is factors[scale_codes[b]] (factors: a table of 256), looked up a chunk at a
// time; `nan_possible` (scaled form only) then says per chunk whether the canonical-NaN pass
// runs (see lowprec_ckpt_decode_scaled).
int32_t Decode(const float* q, const uint8_t* codes, int32_t code_bits, const float* elut,
               const float* factors, const uint8_t* scale_codes, int64_t block,
               int32_t canonical_nan, int64_t n, int32_t out_kind, void* out, int32_t saturate,
               double* counts) {
  ExactFloats exact;
  double nonfinite = 0, overflow = 0, top = 0;
  uint32_t vb[kChunk];
  float chunk_factors[kChunk + 2];  // a chunk's blocks' factors (scaled form)
  // What makes a NaN possible in the scaled form: a NaN element value, or an infinite one
  // times a zero factor, or a NaN factor (checked per chunk below).
  bool elut_nan = false, elut_inf = false;
  if (scale_codes != nullptr && canonical_nan) {
    for (int32_t c = 0; c < (1 << code_bits); ++c) {
      elut_nan |= std::isnan(elut[c]);
      elut_inf |= std::isinf(elut[c]);
    }
  }
  for (int64_t i0 = 0; i0 < n; i0 += kChunk) {
    const int64_t len = std::min(kChunk, n - i0);
    if (q != nullptr) {
      std::memcpy(vb, q + i0, static_cast<size_t>(len) * 4);
      if (canonical_nan) {
        for (int64_t k = 0; k < len; ++k) {
          if ((vb[k] & kAbs) > kExp) vb[k] = kQNaN;
        }
      }
    } else if (scale_codes != nullptr) {
      // The chunk's blocks b0 .. b1 - 1, decoded from the byte of its first block's first
      // element (block x code_bits is a whole number of bytes: checked by the caller).
      const int64_t b0 = i0 / block, b1 = (i0 + len - 1) / block + 1;
      bool nan_factor = false, zero_factor = false;
      for (int64_t b = b0; b < b1; ++b) {
        const float f = factors[scale_codes[b]];
        chunk_factors[b - b0] = f;
        nan_factor |= std::isnan(f);
        zero_factor |= f == 0.0f;
      }
      const bool nan_possible = elut_nan || nan_factor || (elut_inf && zero_factor);
      DecodeChunk(codes + b0 * block * code_bits / 8, code_bits, elut, chunk_factors, block,
                  canonical_nan != 0 && nan_possible, i0 - b0 * block, len, vb);
    } else {
      DecodeChunk(codes, code_bits, elut, factors, block, canonical_nan != 0, i0, len, vb);
    }
    if (out_kind == kF32) {
      std::memcpy(static_cast<float*>(out) + i0, vb, static_cast<size_t>(len) * 4);
      int64_t k = 0;
#ifdef LOWPREC_X86_AVX2
      if (lowprec_native::HasAvx2()) nonfinite += static_cast<double>(NonfiniteAvx2(vb, len, &k));
#endif
      for (; k < len; ++k) nonfinite += (vb[k] & kExp) == kExp;
    } else if (out_kind == kF64) {
      double* o = static_cast<double*>(out) + i0;
      for (int64_t k = 0; k < len; ++k) {
        o[k] = FromBits(vb[k]);
        nonfinite += (vb[k] & kExp) == kExp;
      }
    } else {
      uint16_t* o = static_cast<uint16_t*>(out) + i0;
      const bool bf16 = out_kind == kBF16;
      const uint16_t inf = bf16 ? 0x7F80u : 0x7C00u;
      const uint16_t largest = bf16 ? 0x7F7Fu : 0x7BFFu;
      int64_t k = 0;
#ifdef LOWPREC_X86_AVX2
      if (bf16 && lowprec_native::HasAvx2()) {
        int64_t bad = 0;
        k = NarrowBf16Avx2(vb, len, o, &bad);
        nonfinite += static_cast<double>(bad);
      }
#endif
      for (; k < len; ++k) {
        uint16_t h = bf16 ? FloatBitsToBf16(vb[k]) : FloatBitsToHalf(vb[k]);
        if ((h & 0x7FFFu) == inf && (vb[k] & kExp) != kExp) {  // a finite value overflowed
          overflow += 1;
          top = std::max(top, static_cast<double>(std::fabs(FromBits(vb[k]))));
          if (saturate) h = static_cast<uint16_t>((h & 0x8000u) | largest);
        }
        nonfinite += (h & inf) == inf;
        o[k] = h;
      }
    }
  }
  counts[0] = nonfinite;
  counts[1] = overflow;
  counts[2] = top;
  counts[3] = 0;
  return (overflow > 0 && !saturate) ? 2 : 0;
}

}  // namespace

// Decodes n values into out (out_kind: 0 float32, 1 bfloat16, 2 float16, 3 float64): from q
// (float32 values, when not null) or from the packed codes as lowprec_ckpt_stats does, NaN
// results made lowprec's canonical NaN if canonical_nan. Narrowed as ml_dtypes / NumPy do;
// a finite value that becomes inf is an overflow: with `saturate` it is written as the
// dtype's largest finite value of its sign. counts[4] receives (non-finite values written,
// overflows, the largest |value| that overflowed, 0). Returns 0, or 1 for arguments it does
// not take (nothing written), or 2 when values overflowed without `saturate` (out is then
// partly written: the caller refuses the tensor).
LOWPREC_EXPORT int32_t lowprec_ckpt_decode(const float* q, const uint8_t* codes, int32_t code_bits,
                                           const float* elut, const float* factors,
                                           int64_t block, int32_t canonical_nan, int64_t n,
                                           int32_t out_kind, void* out, int32_t saturate,
                                           double* counts) {
  if (n < 0 || out == nullptr || counts == nullptr || out_kind < kF32 || out_kind > kF64) return 1;
  if (q == nullptr && (codes == nullptr || elut == nullptr ||
                       (code_bits != 4 && code_bits != 6 && code_bits != 8)))
    return 1;
  if (factors != nullptr && block <= 0) return 1;
  return Decode(q, codes, code_bits, elut, factors, nullptr, block, canonical_nan, n, out_kind,
                out, saturate, counts);
}

// lowprec_ckpt_decode of packed codes whose block b's factor is ftable[scale_codes[b]]
// (ftable: float32[256], a value per scale code; scale_codes: n / block of them, n a whole
// number of blocks, block x code_bits a whole number of bytes): the factors are looked up a
// chunk at a time here instead of by the caller for the whole piece. With canonical_nan, the
// canonical-NaN pass runs on the chunks where a NaN can come out (a NaN element value or
// factor, or an infinite element value and a zero factor), which changes nothing elsewhere.
LOWPREC_EXPORT int32_t lowprec_ckpt_decode_scaled(const uint8_t* codes, int32_t code_bits,
                                                  const float* elut, const float* ftable,
                                                  const uint8_t* scale_codes, int64_t block,
                                                  int32_t canonical_nan, int64_t n,
                                                  int32_t out_kind, void* out, int32_t saturate,
                                                  double* counts) {
  if (n < 0 || out == nullptr || counts == nullptr || out_kind < kF32 || out_kind > kF64) return 1;
  if (codes == nullptr || elut == nullptr || ftable == nullptr || scale_codes == nullptr ||
      (code_bits != 4 && code_bits != 6 && code_bits != 8))
    return 1;
  if (block <= 0 || n % block != 0 || (block * code_bits) % 8 != 0) return 1;
  return Decode(nullptr, codes, code_bits, elut, ftable, scale_codes, block, canonical_nan, n,
                out_kind, out, saturate, counts);
}

// The largest finite |x| of each of `rows` equal rows of x (n elements of `kind`: 0
// float32, 1 bfloat16, 2 float16, 3 float64 rounded to float32 first, as NumPy's astype),
// as float32 into out[rows]; 0 for a row with no finite element. Returns 0, or 1 for
// arguments it does not take.
LOWPREC_EXPORT int32_t lowprec_ckpt_amax(const void* x, int32_t kind, int64_t n, int64_t rows,
                                         float* out) {
  if (kind < kF32 || kind > kF64 || n < 0 || rows <= 0 || n % rows != 0 || out == nullptr) return 1;
  ExactFloats exact;
  const int64_t cols = n / rows;
  uint32_t b[kChunk];
  for (int64_t r = 0; r < rows; ++r) {
    uint32_t m = 0;
#ifdef LOWPREC_X86_AVX2
    if (kind == kBF16 && lowprec_native::HasAvx2()) {  // the patterns as stored, unwidened
      const uint16_t top = FiniteAmaxBf16Avx2(static_cast<const uint16_t*>(x) + r * cols, cols);
      out[r] = FromBits(static_cast<uint32_t>(top) << 16);
      continue;
    }
#endif
    for (int64_t c0 = 0; c0 < cols; c0 += kChunk) {
      const int64_t len = std::min(kChunk, cols - c0);
      const int64_t first = r * cols + c0;
      if (kind == kF64) {  // rounded to float32 first (overflow to inf), as astype does
        const double* d = static_cast<const double*>(x) + first;
        for (int64_t i = 0; i < len; ++i) b[i] = ToBits(static_cast<float>(d[i]));
      } else {
        WidenChunk(x, kind, first, len, b);
      }
      m = std::max(m, FiniteAmax(b, len));
    }
    out[r] = FromBits(m);
  }
  return 0;
}
