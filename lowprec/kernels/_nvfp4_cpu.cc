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

void Blocks(const Call& c, size_t first, size_t count) noexcept {
  lowprec_native::ExactFloats exact;  // on this thread, for this chunk
  size_t blk = first;
  const size_t end = first + count;
#ifdef LOWPREC_X86_AVX2
  if (c.words == nullptr && c.values == nullptr && lowprec_native::HasAvx2()) {
    for (; blk + 2 <= end; blk += 2) {  // two blocks at a time
      float d0 = 0, d1 = 0, t0 = 0, t1 = 0;
      const bool f0 = BlockScale(c, blk, &d0, &t0), f1 = BlockScale(c, blk + 1, &d1, &t1);
      if (f0 && f1) {
        if (c.reciprocal) {
          lowprec_native::Nvfp4PairAvx2<true>(c.x + 16 * blk, d0, d1, c.elements + 8 * blk);
        } else {
          lowprec_native::Nvfp4PairAvx2<false>(c.x + 16 * blk, d0, d1, c.elements + 8 * blk);
        }
      } else {  // a NaN/inf block's codes are written; the other one's here
        if (f0) BlockCodes(c, blk, d0, t0);
        if (f1) BlockCodes(c, blk + 1, d1, t1);
      }
    }
  }
#endif
  for (; blk < end; ++blk) {
    float operand, total;
    if (BlockScale(c, blk, &operand, &total)) BlockCodes(c, blk, operand, total);
  }
}

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

// The tensor scale of a group of float32 values as _scheme_nvfp4 computes it: its largest
// finite magnitude amax, float32(amax / 2688) (1 for amax = 0), raised to 2^-143 (2^-121
// for the "reciprocal" step). IEEE division with subnormals kept: _nvfp4.f32_div's bits.
float GroupTensorScale(const float* x, size_t n, bool reciprocal) noexcept {
  uint32_t amax = 0;
  for (size_t i = 0; i < n; ++i) {
    const uint32_t a = Bits(x + i) & kF32Abs;
    if (a < kF32Inf) amax = std::max(amax, a);
  }
  lowprec_native::ExactFloats exact;
  uint32_t ts = amax == 0 ? 0x3F80'0000u : F32Bits(F32(amax) / 2688.0f);
  ts = std::max(ts, reciprocal ? uint32_t{(127 - 121) << 23} : uint32_t{1} << 6);
  return F32(ts);
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
  for (size_t g = 0; g < groups; ++g) {
    tsv[g] = compute_ts && n % groups == 0
                 ? GroupTensorScale(x.typed_data() + g * (n / groups), n / groups, reciprocal)
                 : ts.typed_data()[g];
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
    for (size_t g = 0; g < groups; ++g) {
      computed[g] = GroupTensorScale(x.typed_data() + g * (n / groups), n / groups, reciprocal);
    }
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
