// Fused MX fake quantization on CPU as an XLA FFI target: the float32 values of
// dequantize(quantize_mx(x)) for the E8M0-scaled formats the one-pass quantizer serves
// (_mx_quantize_cpu.cc), blocks along the last axis of float32 input, in one custom call.
//
// XLA:CPU compiles the same values from lowprec's encoder and its exact decoder (every value
// built from bits, subnormal results included) plus, in a quantized dot, the one-multiply
// decode and the check that picks between them: ~1,200 StableHLO lines per MX dot, compiled
// again for each shape. Here each block is quantized by the quantizer's own loop
// (lowprec_native::MxQuantizeBlocks: the same codes and scales) and decoded at once:
// value x 2^(s - 127), exactly as lowprec/_bits.py scale_bits_by_e8m0 defines it (a normal
// result by a float32 multiply of normals, which no flushing mode touches; a result below
// 2^-126 built in integers; +-inf past float32's range; the quiet NaN 0x7FC00000 for a block
// whose scale is the NaN code 0xFF). A second output says, per block, whether the
// one-multiply decode (_mx_decode.fast_decode_exact) is exact there: scale code at least
// `fast_min`, or only zero elements. tests/test_native_mx_fake.py checks both against the
// XLA path bit for bit.

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "_cpu_common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kAttrs = 13;        // _mx_quantize_cpu.attributes, in its order
constexpr size_t kBatch = 64;     // blocks quantized into the stack buffers at a time
constexpr uint32_t kQnan = 0x7FC0'0000u;

struct Fake {
  int64_t attrs[kAttrs];
  int32_t m, emin, code_bits, block, fast_min;
  bool twos;
  uint32_t lut[256];  // float32 bits of each code's value at scale 2^0 (normals or zeros)
};

// float32 bits of a code's value times 2^s (|s| <= 127), exactly (rounded to nearest even
// below 2^-149, which no MX element reaches): sig 2^e is the element's magnitude.
inline uint32_t ValueBits(uint32_t code, int32_t s, const Fake& f) noexcept {
  uint32_t sign, mag;
  if (f.twos) {
    const int32_t v = static_cast<int8_t>(static_cast<uint8_t>(code));
    sign = v < 0 ? 0x8000'0000u : 0u;
    mag = static_cast<uint32_t>(v < 0 ? -v : v);
  } else {
    sign = ((code >> (f.code_bits - 1)) & 1u) << 31;
    mag = code & ((1u << (f.code_bits - 1)) - 1u);
  }
  const uint32_t ef = mag >> f.m;
  const uint32_t fr = mag & ((1u << f.m) - 1u);
  const uint32_t sig = ef == 0 ? fr : fr | (1u << f.m);
  if (sig == 0) return sign;
  const int32_t e = (ef == 0 ? f.emin : f.emin + static_cast<int32_t>(ef) - 1) - f.m + s;
  const int32_t lg = 31 - __builtin_clz(sig);
  const int32_t top = lg + e;  // floor(log2 |value|)
  if (top > 127) return sign | 0x7F80'0000u;
  if (top >= -126) {
    return sign | (static_cast<uint32_t>(top + 127) << 23) | ((sig << (23 - lg)) & 0x7F'FFFFu);
  }
  const int32_t shift = e + 149;  // the value in units of 2^-149
  if (shift >= 0) return sign | (sig << shift);
  const uint32_t r = static_cast<uint32_t>(std::min(-shift, 31));
  const uint32_t k = sig >> r, rem = sig & ((1u << r) - 1u), half = 1u << (r - 1);
  return sign | (k + ((rem > half || (rem == half && (k & 1u))) ? 1u : 0u));
}

// Codes of one block, one per entry, from the quantizer's packed layout.
inline void Unpack(const uint8_t* p, int32_t n, int32_t bits, uint32_t* c) noexcept {
  if (bits == 8) {
    for (int32_t i = 0; i < n; ++i) c[i] = p[i];
  } else if (bits == 4) {  // element 2k in the low nibble
    for (int32_t i = 0; i < n / 2; ++i) {
      c[2 * i] = p[i] & 0xFu;
      c[2 * i + 1] = p[i] >> 4;
    }
  } else {  // FP6: four codes in three bytes, the first in the low bits (PackFp6)
    for (int32_t g = 0; g < n / 4; ++g, p += 3) {
      const uint32_t w =
          p[0] | static_cast<uint32_t>(p[1]) << 8 | static_cast<uint32_t>(p[2]) << 16;
      for (int32_t j = 0; j < 4; ++j) c[4 * g + j] = (w >> (6 * j)) & 0x3Fu;
    }
  }
}

// Blocks [first, first + count): values and fast-decode flags.
void FakeBlocks(const float* x, float* out, uint8_t* ok, size_t first, size_t count,
                const Fake& f) noexcept {
  const size_t block = static_cast<size_t>(f.block);
  const size_t bytes = block * static_cast<size_t>(f.code_bits) / 8;
  uint8_t elements[kBatch * 256];
  uint8_t scales[kBatch];
  uint32_t codes[256];
  for (size_t b0 = first; b0 < first + count; b0 += kBatch) {
    const size_t nb = std::min(kBatch, first + count - b0);
    lowprec_native::MxQuantizeBlocks(x + b0 * block, nb, f.attrs, elements, scales);
    for (size_t j = 0; j < nb; ++j) {
      float* o = out + (b0 + j) * block;
      const uint32_t sc = scales[j];
      Unpack(elements + j * bytes, f.block, f.code_bits, codes);
      uint32_t nonzero = 0;
      for (size_t i = 0; i < block; ++i) nonzero |= f.lut[codes[i]] & 0x7FFF'FFFFu;
      ok[b0 + j] = static_cast<uint8_t>(static_cast<int32_t>(sc) >= f.fast_min || nonzero == 0);
      if (sc == 0xFF) {
        for (size_t i = 0; i < block; ++i) std::memcpy(o + i, &kQnan, sizeof kQnan);
      } else if (static_cast<int32_t>(sc) >= f.fast_min) {
        // Every nonzero value and 2^(s - 127) are float32 normals, and so is their product
        // (or it overflows to +-inf, as the definition says): one exact multiply.
        const uint32_t factor_bits = sc << 23;
        float factor;
        std::memcpy(&factor, &factor_bits, sizeof factor);
        for (size_t i = 0; i < block; ++i) {
          float v;
          std::memcpy(&v, &f.lut[codes[i]], sizeof v);
          o[i] = v * factor;
        }
      } else {
        const int32_t s = static_cast<int32_t>(sc) - 127;
        for (size_t i = 0; i < block; ++i) {
          const uint32_t b = ValueBits(codes[i], s, f);
          std::memcpy(o + i, &b, sizeof b);
        }
      }
    }
  }
}

ffi::Error FakeQuantize(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                        ffi::ResultBuffer<ffi::F32> values, ffi::ResultBuffer<ffi::U8> ok,
                        int64_t mantissa_bits, int64_t emin, int64_t emax_elem, int64_t max_code,
                        int64_t code_bits, bool twos_complement, int64_t rule, int64_t block,
                        int64_t even_drop, int64_t rceil_k, int64_t rceil_mant,
                        int64_t rceil_small, int64_t rceil_thr, int64_t fast_min) {
  Fake f;
  const int64_t attrs[kAttrs] = {mantissa_bits, emin,    emax_elem,   max_code,  code_bits,
                                 twos_complement ? 1 : 0, rule, block, even_drop, rceil_k,
                                 rceil_mant,    rceil_small, rceil_thr};
  std::memcpy(f.attrs, attrs, sizeof attrs);
  // A zero-block probe: MxQuantizeBlocks refuses attributes its loops do not take.
  uint8_t none = 0;
  if (!lowprec_native::MxQuantizeBlocks(nullptr, 0, f.attrs, &none, &none) || fast_min < 1 ||
      fast_min > 255) {
    return ffi::Error::InvalidArgument("lowprec_mx_fake_quantize: unsupported format attributes");
  }
  f.m = static_cast<int32_t>(mantissa_bits);
  f.emin = static_cast<int32_t>(emin);
  f.code_bits = static_cast<int32_t>(code_bits);
  f.block = static_cast<int32_t>(block);
  f.fast_min = static_cast<int32_t>(fast_min);
  f.twos = twos_complement;
  for (uint32_t c = 0; c < 256; ++c) f.lut[c] = ValueBits(c & ((1u << code_bits) - 1u), 0, f);
  const size_t n = x.element_count();
  const size_t blocks = n / static_cast<size_t>(block);
  if (n % static_cast<size_t>(block) != 0 || values->element_count() != n ||
      ok->element_count() != blocks) {
    return ffi::Error::InvalidArgument(
        "lowprec_mx_fake_quantize: buffer sizes do not match the blocks");
  }
  const float* in = x.typed_data();
  float* out = values->typed_data();
  uint8_t* flags = ok->typed_data();
  // Chunks of 2^11 blocks, as the quantizer's; each task holds its own copy of the format.
  lowprec_native::RunChunked(pool, blocks, size_t{1} << 11,
                             [in, out, flags, f](size_t first, size_t count) noexcept {
                               FakeBlocks(in, out, flags, first, count, f);
                             });
  return ffi::Error::Success();
}

}  // namespace

LOWPREC_FFI_HANDLER(LowprecMxFakeQuantize, "lowprec_mx_fake_quantize", FakeQuantize,
                    lowprec_native::BindMxFormat(ffi::Ffi::Bind()
                                                     .Ctx<ffi::ThreadPool>()
                                                     .Arg<ffi::Buffer<ffi::F32>>()
                                                     .Ret<ffi::Buffer<ffi::F32>>()
                                                     .Ret<ffi::Buffer<ffi::U8>>())
                        .Attr<int64_t>("fast_min"));
