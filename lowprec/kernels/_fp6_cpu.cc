// FP6 packing on CPU as XLA FFI targets: four 6-bit codes <-> three bytes along the last axis.
//
// XLA:CPU compiles the Python formulation of this layout (lowprec/_pack.py) to element loops
// whose innermost dimension is a group's 3 bytes or 4 codes; they run scalar, 5-10x slower
// than a copy of the same bytes. These loops run at copy speed. The layout is the one of
// _pack.py: code j of a group in bits 6j..6j+5 of the little-endian 24-bit word its three
// bytes form. Packing keeps only the low 6 bits of each code, as _pack.pack_fp6 does. Both
// directions are byte permutations plus masks: no arithmetic on values, so the same bits as
// the Python formulation (tests/test_native_fp6.py checks every byte pattern).
//
// Built by setup.py into the optional shared library of the native kernels (_cpu_lib.cc; no
// compiler: XLA's formulation runs); lowprec/kernels/_cpu_native.py loads it, registers the
// targets and checks them once.

#include <cstddef>
#include <cstdint>

#include "_cpu_common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Portable loops, one group per step (also the tails of the AVX2 loops).
void PackScalar(const uint8_t* c, uint8_t* p, size_t groups) noexcept {
  lowprec_native::PackFp6(c, p, groups);
}

void UnpackScalar(const uint8_t* p, uint8_t* c, size_t groups) noexcept {
  for (size_t g = 0; g < groups; ++g, p += 3, c += 4) {
    const uint32_t w = p[0] | static_cast<uint32_t>(p[1]) << 8 | static_cast<uint32_t>(p[2]) << 16;
    c[0] = w & 0x3Fu;
    c[1] = (w >> 6) & 0x3Fu;
    c[2] = (w >> 12) & 0x3Fu;
    c[3] = (w >> 18) & 0x3Fu;
  }
}

#ifdef LOWPREC_X86_AVX2
// 8 groups (32 codes, 24 bytes) per step (lowprec_native::Fp6GroupsAvx2); each 128-bit half
// is stored as 16 bytes of which 12 count: the second store overwrites the first's 4 spare
// bytes. A step writes bytes 0..27 from p, so it runs while at least 10 groups (30 bytes)
// remain; the scalar loop does the rest.
__attribute__((target("avx2"))) void PackAvx2(const uint8_t* c, uint8_t* p, size_t groups) noexcept {
  const __m256i low6 = _mm256_set1_epi8(0x3F);
  size_t g = 0;
  for (; g + 10 <= groups; g += 8, c += 32, p += 24) {
    const __m256i v = _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(c)), low6);
    const __m256i b = lowprec_native::Fp6GroupsAvx2(v);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(b));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p + 12), _mm256_extracti128_si256(b, 1));
  }
  PackScalar(c, p, groups - g);
}

// 8 groups per step: each 128-bit half loads 16 bytes of which 12 are its 4 groups (a step
// reads bytes 0..27 from p, so it runs while at least 10 groups remain), a byte shuffle
// spreads each group into a 32-bit lane, and shifts and masks move code j to byte j.
__attribute__((target("avx2"))) void UnpackAvx2(const uint8_t* p, uint8_t* c, size_t groups) noexcept {
  const __m256i spread = _mm256_setr_epi8(0, 1, 2, -1, 3, 4, 5, -1, 6, 7, 8, -1, 9, 10, 11, -1,
                                          0, 1, 2, -1, 3, 4, 5, -1, 6, 7, 8, -1, 9, 10, 11, -1);
  const __m256i m0 = _mm256_set1_epi32(0x3F), m1 = _mm256_set1_epi32(0x3F00),
                m2 = _mm256_set1_epi32(0x3F0000), m3 = _mm256_set1_epi32(0x3F000000);
  size_t g = 0;
  for (; g + 10 <= groups; g += 8, p += 24, c += 32) {
    const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 12));
    const __m256i w = _mm256_shuffle_epi8(
        _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1), spread);
    const __m256i r = _mm256_or_si256(
        _mm256_or_si256(_mm256_and_si256(w, m0), _mm256_and_si256(_mm256_slli_epi32(w, 2), m1)),
        _mm256_or_si256(_mm256_and_si256(_mm256_slli_epi32(w, 4), m2),
                        _mm256_and_si256(_mm256_slli_epi32(w, 6), m3)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(c), r);
  }
  UnpackScalar(p, c, groups - g);
}
#endif

using Loop = void (*)(const uint8_t*, uint8_t*, size_t) noexcept;

// Groups per chunk of work: 192-256 KiB each way, within an L2.
constexpr size_t kChunk = size_t{1} << 16;

Loop Choose(bool pack) {
#ifdef LOWPREC_X86_AVX2
  if (lowprec_native::HasAvx2()) return pack ? PackAvx2 : UnpackAvx2;
#endif
  return pack ? PackScalar : UnpackScalar;
}

// Runs `loop` over `groups` groups in chunks on XLA's threads.
void RunLoop(ffi::ThreadPool& pool, Loop loop, const uint8_t* in, uint8_t* out, size_t groups,
             size_t in_per_group, size_t out_per_group) {
  lowprec_native::RunChunked(pool, groups, kChunk, [=](size_t first, size_t count) noexcept {
    loop(in + first * in_per_group, out + first * out_per_group, count);
  });
}

ffi::Error Pack(ffi::ThreadPool pool, ffi::Buffer<ffi::U8> codes, ffi::ResultBuffer<ffi::U8> out) {
  const size_t n = codes.element_count();
  if (n % 4 != 0 || out->element_count() != n / 4 * 3) {
    return ffi::Error::InvalidArgument(
        "lowprec_fp6_pack: needs a multiple of 4 codes and 3 output bytes per 4 codes");
  }
  RunLoop(pool, Choose(true), codes.typed_data(), out->typed_data(), n / 4, 4, 3);
  return ffi::Error::Success();
}

ffi::Error Unpack(ffi::ThreadPool pool, ffi::Buffer<ffi::U8> packed, ffi::ResultBuffer<ffi::U8> out) {
  const size_t n = packed.element_count();
  if (n % 3 != 0 || out->element_count() != n / 3 * 4) {
    return ffi::Error::InvalidArgument(
        "lowprec_fp6_unpack: needs a multiple of 3 bytes and 4 output codes per 3 bytes");
  }
  RunLoop(pool, Choose(false), packed.typed_data(), out->typed_data(), n / 3, 3, 4);
  return ffi::Error::Success();
}

}  // namespace

LOWPREC_FFI_HANDLER(LowprecFp6Pack, "lowprec_fp6_pack", Pack,
                    ffi::Ffi::Bind()
                        .Ctx<ffi::ThreadPool>()
                        .Arg<ffi::Buffer<ffi::U8>>()
                        .Ret<ffi::Buffer<ffi::U8>>());

LOWPREC_FFI_HANDLER(LowprecFp6Unpack, "lowprec_fp6_unpack", Unpack,
                    ffi::Ffi::Bind()
                        .Ctx<ffi::ThreadPool>()
                        .Arg<ffi::Buffer<ffi::U8>>()
                        .Ret<ffi::Buffer<ffi::U8>>());
