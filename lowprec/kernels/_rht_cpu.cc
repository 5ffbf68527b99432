// The NVFP4 training recipe's random Hadamard transform along tokens, transposed, as an XLA
// FFI target (lowprec/_nvfp4_train.py rht, lowprec/kernels/_rht_cpu.py): for x [T, C]
// (T a multiple of 16) and signs s [16], out [C, T] with out[c, t] = (M x)[t, c], M the
// 16 x 16 block transform of rht along axis 0: each block of 16 rows multiplied by s, the
// Walsh-Hadamard butterfly ((a, b) -> (a + b, a - b) on rows h = 1, 2, 4, 8 apart), then by
// 1/4. The same float32 operations in the same order as XLA's program of rht, so the same
// bits: with the MXCSR's flush-to-zero and denormals-are-zero on, as XLA:CPU runs its own
// loops (a subnormal operand reads as zero, a subnormal result is flushed).
//
// XLA:CPU runs the butterfly as concatenate fusions (~2.5-5 ns an element), and the weight
// gradient's quantization along tokens needs the result transposed (the quantizer's blocks
// lie along the last axis), another pass. Here one pass does both: eight columns a step, one
// vector per row of the block (the butterfly is adds and subtracts between vectors), then
// each column's 16 values stored as one contiguous run of the output.

#include <algorithm>
#include <cstdint>
#include <string>

#include "_cpu_common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr size_t kBlock = 16;

// XLA:CPU's float mode for its own loops, for this object's lifetime.
class XlaFloats {
 public:
#ifdef LOWPREC_X86_AVX2
  XlaFloats() noexcept : csr_(_mm_getcsr()) { _mm_setcsr(csr_ | 0x8040u); }
  ~XlaFloats() { _mm_setcsr(csr_); }

 private:
  unsigned csr_;
#endif
};

// One block of 16 rows (from row t0) of column c: the transform, stored at out + c * T + t0.
inline void Column(const float* x, const float* s, float* out, size_t rows, size_t cols,
                   size_t t0, size_t c) noexcept {
  float b[kBlock];
  for (size_t i = 0; i < kBlock; ++i) b[i] = x[(t0 + i) * cols + c] * s[i];
  for (size_t h = 1; h < kBlock; h *= 2) {
    for (size_t i = 0; i < kBlock; ++i) {
      if (i & h) continue;
      const float lo = b[i], hi = b[i + h];
      b[i] = lo + hi;
      b[i + h] = lo - hi;
    }
  }
  for (size_t i = 0; i < kBlock; ++i) out[c * rows + t0 + i] = b[i] * 0.25f;
}

#ifdef LOWPREC_X86_AVX2
// Columns [c, c + 8) of the block from row t0 (Column's operations, lane by lane).
__attribute__((target("avx2"))) void Columns8Avx2(const float* x, const float* s, float* out,
                                                  size_t rows, size_t cols, size_t t0,
                                                  size_t c) noexcept {
  __m256 b[kBlock];
  for (size_t i = 0; i < kBlock; ++i) {
    b[i] = _mm256_mul_ps(_mm256_loadu_ps(x + (t0 + i) * cols + c), _mm256_set1_ps(s[i]));
  }
  for (size_t h = 1; h < kBlock; h *= 2) {
    for (size_t i = 0; i < kBlock; ++i) {
      if (i & h) continue;
      const __m256 lo = b[i], hi = b[i + h];
      b[i] = _mm256_add_ps(lo, hi);
      b[i + h] = _mm256_sub_ps(lo, hi);
    }
  }
  alignas(32) float v[kBlock][8];
  for (size_t i = 0; i < kBlock; ++i) _mm256_store_ps(v[i], _mm256_mul_ps(b[i], _mm256_set1_ps(0.25f)));
  for (size_t j = 0; j < 8; ++j) {
    float* o = out + (c + j) * rows + t0;
    for (size_t i = 0; i < kBlock; ++i) o[i] = v[i][j];
  }
}
#endif

// Blocks of rows [first, first + count).
void Blocks(const float* x, const float* s, float* out, size_t rows, size_t cols, size_t first,
            size_t count) noexcept {
  XlaFloats mode;
  for (size_t blk = first; blk < first + count; ++blk) {
    size_t c = 0;
#ifdef LOWPREC_X86_AVX2
    if (lowprec_native::HasAvx2()) {
      for (; c + 8 <= cols; c += 8) Columns8Avx2(x, s, out, rows, cols, blk * kBlock, c);
    }
#endif
    for (; c < cols; ++c) Column(x, s, out, rows, cols, blk * kBlock, c);
  }
}

ffi::Error RhtTransposed(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> signs,
                         ffi::ResultBuffer<ffi::F32> out) {
  const auto dims = x.dimensions();
  const char* problem = "";
  if (dims.size() != 2) {
    problem = "the input is not 2-D";
  } else if (dims[0] % kBlock != 0) {
    problem = "the rows are not a whole number of blocks of 16";
  } else if (signs.element_count() != kBlock) {
    problem = "the signs are not 16";
  } else if (out->element_count() != x.element_count()) {
    problem = "the output is not x's size";
  }
  if (*problem != 0) {
    return ffi::Error::InvalidArgument(std::string("lowprec_rht_transposed: ") + problem);
  }
  const size_t rows = dims[0], cols = dims[1];
  const float* xp = x.typed_data();
  const float* sp = signs.typed_data();
  float* op = out->typed_data();
  // Chunks of 16 blocks of rows (16 x 16 x cols floats); each task copies the pointers.
  lowprec_native::RunChunked(pool, rows / kBlock, 16,
                             [=](size_t first, size_t count) noexcept {
                               Blocks(xp, sp, op, rows, cols, first, count);
                             });
  return ffi::Error::Success();
}

}  // namespace

LOWPREC_FFI_HANDLER(LowprecRhtTransposed, "lowprec_rht_transposed", RhtTransposed,
                    ffi::Ffi::Bind()
                        .Ctx<ffi::ThreadPool>()
                        .Arg<ffi::Buffer<ffi::F32>>()
                        .Arg<ffi::Buffer<ffi::F32>>()
                        .Ret<ffi::Buffer<ffi::F32>>());
