// The block choice of the selecting formats (Four over Six, IF4, MixFP4; lowprec/_scheme_*.py,
// docs/design.md §3c) on CPU as an XLA FFI target: blocks of float32 patterns (specials
// already zeroed), each block's largest magnitude and tensor scalar in, each block's E4M3
// scale code (the grid flag included) and the signed E2M1 value bits of its elements out.
//
// XLA compiles lowprec/_grid_select.py's integer emulation of these steps (IEEE float32 add,
// multiply and divide on the bits, both candidates and their left-to-right error sums) to
// 9,000-13,500 HLO lines, 2.7-4.4 CPU s per program. This is one custom call that mirrors
// each of those steps on the bits, for every input pattern: the IEEE operations by the CPU's
// own float32 arithmetic with the MXCSR's flush-to-zero and denormals-are-zero off (so
// subnormals round as IEEE 754 says) and NaN results replaced by lowprec's quiet NaN
// 0x7FC00000 (as _grid_select's operations give it); _nvfp4.f32_mul's reading of an infinite
// or NaN operand as (1.m) x 2^128, by an exact double product rounded once to float32; grid
// roundings, clamps and comparisons on the patterns as unsigned integers, as the Python does.
// tests/test_native_grid_select.py compares it with the XLA path bit for bit.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>

#include "_cpu_common.h"
#include "_nvfp4_cpu.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using lowprec_native::F32;
using lowprec_native::F32Bits;

constexpr uint32_t kAbs = 0x7FFF'FFFFu;
constexpr uint32_t kSign = 0x8000'0000u;
constexpr uint32_t kInf = 0x7F80'0000u;
constexpr uint32_t kQNaN = 0x7FC0'0000u;
constexpr uint32_t kOne = 0x3F80'0000u;
constexpr uint32_t kFltMax = 0x7F7F'FFFFu;
constexpr uint32_t kTiny = 0x0080'0000u;  // 2^-126
constexpr uint32_t kE4m3Max = 0x43E0'0000u;  // 448
constexpr uint32_t kThreeHalves = 0x3FC0'0000u;
constexpr uint32_t kSevenF = 0x40E0'0000u;  // 7.0
// E2M1 magnitudes by index (0, 0.5, 1, 1.5, 2, 3, 4, 6) and the midpoints between them.
constexpr uint32_t kE2m1[8] = {0x0000'0000u, 0x3F00'0000u, 0x3F80'0000u, 0x3FC0'0000u,
                               0x4000'0000u, 0x4040'0000u, 0x4080'0000u, 0x40C0'0000u};
constexpr uint32_t kMid[7] = {0x3E80'0000u, 0x3F40'0000u, 0x3FA0'0000u, 0x3FE0'0000u,
                              0x4020'0000u, 0x4060'0000u, 0x40A0'0000u};

inline uint32_t Canon(float r) noexcept { return std::isnan(r) ? kQNaN : F32Bits(r); }

// IEEE float32 a + b, a * b, a / b (_grid_select.f32_add, f32_mul, f32_div,
// f32_div_by_integer).
inline uint32_t Add(uint32_t a, uint32_t b) noexcept { return Canon(F32(a) + F32(b)); }
inline uint32_t Sub(uint32_t a, uint32_t b) noexcept { return Add(a, b ^ kSign); }
inline uint32_t Mul(uint32_t a, uint32_t b) noexcept { return Canon(F32(a) * F32(b)); }
inline uint32_t Div(uint32_t a, uint32_t b) noexcept { return Canon(F32(a) / F32(b)); }

// The value _nvfp4._split reads from a pattern's magnitude: sig x 2^(max(e, 1) - 150), the
// exponent field 255 (inf, NaN) included.
inline double SplitValue(uint32_t bits) noexcept {
  const uint32_t mag = bits & kAbs;
  if (mag < kInf) return static_cast<double>(F32(mag));  // exact, subnormals included
  return std::ldexp(static_cast<double>((mag & 0x7F'FFFFu) | 0x80'0000u), 105);  // 255 - 150
}

// _nvfp4.f32_mul (f32_mul_finite, f32_mul_short): a signed zero if either is zero, else the
// product of SplitValue's (exact in a double: 48 significant bits, 2^-298 to 2^256) rounded
// once to float32 (nearest even, subnormal or overflowing to inf as IEEE 754).
inline uint32_t MulFinite(uint32_t a, uint32_t b) noexcept {
  const uint32_t sign = (a ^ b) & kSign;
  if ((a & kAbs) == 0 || (b & kAbs) == 0) return sign;
  const double p = SplitValue(a) * SplitValue(b);
  const float r = p >= 0x1.ffffffp127 ? INFINITY : static_cast<float>(p);
  return F32Bits(r) | sign;
}

// _grid_select.f32_mul_positive: a finite or inf, b positive finite.
inline uint32_t MulPositive(uint32_t a, uint32_t b) noexcept {
  if ((a & kAbs) == kInf) return a;
  if ((a & kAbs) > kInf) return b & kSign;  // a NaN is replaced by +0 first
  return MulFinite(a, b);
}

// _grid_select.e2m1_nearest (with plus_zero): ties to even, or toward zero (strict
// comparisons), on the magnitude's pattern (a NaN reads as above 6).
inline uint32_t E2m1Index(uint32_t q, bool even) noexcept {
  const uint32_t mag = q & kAbs;
  uint32_t index = 0;
  for (int j = 0; j < 7; ++j) index += (even && j % 2 == 1) ? mag >= kMid[j] : mag > kMid[j];
  return index;
}
inline uint32_t E2m1Value(uint32_t q, bool even) noexcept {
  if (q == kSign) return 0;  // plus_zero: an exact -0 gives +0
  return kE2m1[E2m1Index(q, even)] | (q & kSign);
}

// _grid_select.int_nearest(q, 7): the magnitude clamped to 7 on the patterns, rounded to
// nearest even (exact in float32 for magnitudes up to 7), negated for a negative q.
inline int32_t IntNearest7(uint32_t q) noexcept {
  const uint32_t mag = std::min(q & kAbs, kSevenF);
  const int32_t k = static_cast<int32_t>(std::nearbyint(F32(mag)));
  return (q & kSign) != 0 ? -k : k;
}
// float32 pattern of E2M1 code c (sign-magnitude: code 8 is -0; _grid_select.e2m1_table_bits).
inline uint32_t E2m1CodeValue(uint32_t c) noexcept { return kE2m1[c & 7u] | ((c & 8u) << 28); }

inline uint32_t IntBits(int32_t k) noexcept { return F32Bits(static_cast<float>(k)); }

// E4M3 code of min(bits, 448) on the patterns (any pattern: a negative or NaN one clamps to
// 448), rounded to nearest even, subnormal E4M3 included (_grid_select.e4m3_codes).
inline uint32_t E4m3Code(uint32_t bits) noexcept {
  const uint32_t v = std::min(bits, kE4m3Max);
  if (v >= 0x3C80'0000u) {  // 2^-6: normal E4M3, RNE of the mantissa to 3 bits
    return ((v + 0x7'FFFFu + ((v >> 20) & 1u)) >> 20) - (120u << 3);
  }
  return static_cast<uint32_t>(std::nearbyint(F32(v) * 512.0f));  // multiples of 2^-9
}

// float32 pattern of an E4M3 code (sign bit included).
inline uint32_t E4m3Value(uint32_t code) noexcept {
  const uint32_t e = (code >> 3) & 0xFu, m = code & 7u;
  const float mag = e == 0 ? std::ldexp(static_cast<float>(m), -9)
                           : std::ldexp(static_cast<float>(8u + m), static_cast<int>(e) - 10);
  return F32Bits(mag) | ((code & 0x80u) << 24);
}

// Σ |approx_i - target_i| or Σ (approx_i - target_i)², each step one IEEE float32 operation,
// left to right from +0 (_grid_select.block_error).
template <typename Approx, typename Target>
inline uint32_t BlockError(size_t n, bool mse, const Approx& approx, const Target& target) noexcept {
  uint32_t acc = 0;
  for (size_t i = 0; i < n; ++i) {
    const uint32_t diff = Sub(approx(i), target(i));
    acc = Add(acc, mse ? Mul(diff, diff) : diff & kAbs);
  }
  return acc;
}

constexpr size_t kMaxBlock = 1024;  // formats/elements.json's largest block size

enum Scheme : int64_t { kFourOverSix = 0, kIf4 = 1, kMixFp4 = 2 };

struct Call {
  const uint32_t* x;
  const uint32_t* amax;
  const uint32_t* ts;
  int32_t* codes;
  uint32_t* values;
  size_t block;
  int64_t scheme;
  bool mse;
  bool fp16;
  int64_t e4m3_max;
};

// _scheme_nvfp4_4over6.FourOverSixScheme.choose for one block.
void FourOverSix(const Call& c, size_t blk) noexcept {
  const uint32_t* x = c.x + blk * c.block;
  uint32_t* out = c.values + blk * c.block;
  const uint32_t ts = c.ts[blk];
  const uint32_t denominator = F32Bits(6.0f * static_cast<float>(c.e4m3_max));
  uint32_t encode = std::min(Div(denominator, ts), kFltMax);
  if (encode == 0) encode = kOne;
  const uint32_t decode = Div(kOne, encode);
  const uint32_t base = Mul(Div(c.amax[blk], F32Bits(6.0f)), encode);
  uint32_t codes[2] = {E4m3Code(base), E4m3Code(Mul(base, kThreeHalves))};
  uint32_t errors[2];
  uint32_t values[2][kMaxBlock];
  for (int k = 0; k < 2; ++k) {
    const uint32_t s = E4m3Value(codes[k]);
    const uint32_t factor = std::min(Div(kOne, MulFinite(s, decode)), kFltMax);
    uint32_t* v = values[k];
    for (size_t i = 0; i < c.block; ++i) v[i] = E2m1Value(MulFinite(x[i], factor), true);
    if (c.fp16) {
      errors[k] = BlockError(c.block, c.mse, [&](size_t i) { return MulFinite(s, v[i]); },
                             [&](size_t i) { return MulFinite(x[i], encode); });
    } else {
      errors[k] = BlockError(
          c.block, c.mse,
          [&](size_t i) { return Div(MulFinite(MulFinite(s, v[i]), ts), denominator); },
          [&](size_t i) { return x[i]; });
    }
  }
  const int pick = errors[1] < errors[0] ? 1 : 0;
  c.codes[blk] = static_cast<int32_t>(codes[pick]);
  std::memcpy(out, values[pick], c.block * sizeof(uint32_t));
}

// _scheme_if4.IF4Scheme.choose for one block.
void If4(const Call& c, size_t blk) noexcept {
  static const uint32_t kSevenSixths = F32Bits(static_cast<float>(7.0 / 6.0));
  static const uint32_t kSixSevenths = F32Bits(static_cast<float>(6.0 / 7.0));
  const uint32_t* x = c.x + blk * c.block;
  uint32_t* out = c.values + blk * c.block;
  const uint32_t ts = c.ts[blk];
  const uint32_t divisor = F32Bits(2688.0f);
  const uint32_t encode = std::min(Div(divisor, ts), kFltMax);
  uint32_t code = E4m3Code(Mul(Div(c.amax[blk], F32Bits(6.0f)), encode));
  if (ts == 0) code = 0;
  const uint32_t s = E4m3Value(code);
  const uint32_t factor = Div(kOne, MulFinite(Div(kOne, encode), s));
  uint32_t fp[kMaxBlock];
  int32_t k[kMaxBlock];
  for (size_t i = 0; i < c.block; ++i) {
    const uint32_t q = s == 0 ? 0u : MulFinite(x[i], factor);
    fp[i] = E2m1Value(q, true);
    k[i] = IntNearest7(MulFinite(q, kSevenSixths));
  }
  const uint32_t e_fp = BlockError(
      c.block, c.mse,
      [&](size_t i) { return Div(MulPositive(MulFinite(MulFinite(s, fp[i]), ts), kOne), divisor); },
      [&](size_t i) { return x[i]; });
  const uint32_t e_int = BlockError(
      c.block, c.mse,
      [&](size_t i) {
        return Div(MulPositive(MulFinite(MulFinite(s, IntBits(k[i])), ts), kSixSevenths),
                   divisor);
      },
      [&](size_t i) { return x[i]; });
  const bool pick_int = e_int < e_fp;
  c.codes[blk] = static_cast<int32_t>(pick_int ? code | 0x80u : code);
  for (size_t i = 0; i < c.block; ++i) {
    out[i] = pick_int ? E2m1CodeValue(static_cast<uint32_t>(k[i]) & 0xFu) : fp[i];
  }
}

// _scheme_mixfp4.MixFP4Scheme.choose for one block.
void MixFp4(const Call& c, size_t blk) noexcept {
  const uint32_t* x = c.x + blk * c.block;
  uint32_t* out = c.values + blk * c.block;
  const uint32_t ts = c.ts[blk];
  const uint32_t scaled_amax = Mul(ts, c.amax[blk]);
  const uint32_t codes[2] = {E4m3Code(Div(scaled_amax, F32Bits(6.0f))),
                             E4m3Code(Div(scaled_amax, F32Bits(7.0f)))};
  uint32_t errors[2];
  for (int g = 0; g < 2; ++g) {  // the observer's choice: effective scales at least 2^-126
    const uint32_t eff = std::max(Div(E4m3Value(codes[g]), ts), kTiny);
    errors[g] = BlockError(
        c.block, true,
        [&](size_t i) {
          const uint32_t q = Div(x[i], eff);
          return MulFinite(eff, g == 0 ? E2m1Value(q, false) : IntBits(IntNearest7(q)));
        },
        [&](size_t i) { return x[i]; });
  }
  const bool pick_int = errors[1] < errors[0];
  const uint32_t code = codes[pick_int ? 1 : 0];
  // The packer's values: effective scale s / gs unclamped, 0 where it is 0.
  const uint32_t eff = Div(E4m3Value(code), ts);
  for (size_t i = 0; i < c.block; ++i) {
    const uint32_t q = Div(x[i], eff == 0 ? kOne : eff);
    uint32_t v;
    if (eff == 0) {
      v = 0;
    } else if (pick_int) {
      const int32_t k = IntNearest7(q);
      v = E2m1CodeValue(static_cast<uint32_t>(k < 0 ? 8 - k : k));
    } else {
      v = E2m1Value(q, false);
    }
    out[i] = v;
  }
  c.codes[blk] = static_cast<int32_t>(pick_int && (code & 0x7Fu) != 0 ? code | 0x80u : code);
}

void Blocks(const Call& c, size_t first, size_t count) noexcept {
  lowprec_native::ExactFloats exact;
  for (size_t blk = first; blk < first + count; ++blk) {
    if (c.scheme == kFourOverSix) {
      FourOverSix(c, blk);
    } else if (c.scheme == kIf4) {
      If4(c, blk);
    } else {
      MixFp4(c, blk);
    }
  }
}

ffi::Error Choose(ffi::ThreadPool pool, ffi::Buffer<ffi::U32> x, ffi::Buffer<ffi::U32> amax,
                  ffi::Buffer<ffi::U32> ts, ffi::ResultBuffer<ffi::S32> codes,
                  ffi::ResultBuffer<ffi::U32> values, int64_t scheme, bool mse, bool fp16,
                  int64_t e4m3_max) {
  const size_t n = x.element_count(), blocks = amax.element_count();
  const char* problem = "";
  if (blocks == 0 || n % blocks != 0) {
    problem = "the input is not a whole number of blocks";
  } else if (ts.element_count() != blocks || codes->element_count() != blocks ||
             values->element_count() != n) {
    problem = "the tensor scalars and outputs are not one per block and element";
  } else if (n / blocks > kMaxBlock) {
    problem = "blocks of more than 1024 elements";
  } else if (scheme < kFourOverSix || scheme > kMixFp4 || (e4m3_max != 256 && e4m3_max != 448)) {
    problem = "unknown scheme attributes";
  }
  if (*problem != 0) {
    return ffi::Error::InvalidArgument(std::string("lowprec_grid_select: ") + problem);
  }
  const Call call{x.typed_data(), amax.typed_data(), ts.typed_data(), codes->typed_data(),
                  values->typed_data(), n / blocks, scheme, mse, fp16, e4m3_max};
  // Chunks of 2^10 blocks; each task holds a copy of `call`.
  lowprec_native::RunChunked(pool, blocks, size_t{1} << 10,
                             [call](size_t first, size_t count) noexcept {
                               Blocks(call, first, count);
                             });
  return ffi::Error::Success();
}

}  // namespace

LOWPREC_FFI_HANDLER(LowprecGridSelect, "lowprec_grid_select", Choose,
                    ffi::Ffi::Bind()
                        .Ctx<ffi::ThreadPool>()
                        .Arg<ffi::Buffer<ffi::U32>>()
                        .Arg<ffi::Buffer<ffi::U32>>()
                        .Arg<ffi::Buffer<ffi::U32>>()
                        .Ret<ffi::Buffer<ffi::S32>>()
                        .Ret<ffi::Buffer<ffi::U32>>()
                        .Attr<int64_t>("scheme")
                        .Attr<bool>("mse")
                        .Attr<bool>("fp16")
                        .Attr<int64_t>("e4m3_max"));
