// lowprec's native CPU kernels are one plain shared library, not a Python extension module: it
// uses no CPython API, so one build serves every CPython version, and
// lowprec/kernels/_cpu_native.py loads it with ctypes and hands the handlers to XLA as
// capsules (jax.ffi.pycapsule). Its exported symbols are the XLA FFI handlers (LowprecFp6Pack
// and LowprecFp6Unpack in _fp6_cpu.cc, LowprecMxQuantize in _mx_quantize_cpu.cc) and, here,
// the facts the loader checks before it registers them, and a handler that checks the
// exception guard every handler goes through.

#include <cstdint>
#include <stdexcept>

#include "_cpu_common.h"
#include "xla/ffi/api/c_api.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

// setup.py defines it as the version of the jaxlib whose FFI headers this build compiled.
#ifndef LOWPREC_JAXLIB_VERSION
#define LOWPREC_JAXLIB_VERSION "unknown"
#endif

// The XLA FFI API version of the headers this library was compiled against: the version its
// handlers report to XLA, which registers a handler only if it is XLA's own. The loader
// compares it with the running jaxlib's before registering anything.
LOWPREC_EXPORT void lowprec_ffi_api_version(int32_t* major, int32_t* minor) {
  *major = XLA_FFI_API_MAJOR;
  *minor = XLA_FFI_API_MINOR;
}

// The jaxlib version whose headers this library was compiled against (for messages).
LOWPREC_EXPORT const char* lowprec_built_with_jaxlib() { return LOWPREC_JAXLIB_VERSION; }

// 1 if this CPU runs the quantizer's AVX2 loop (lowprec sends quantize_mx to the kernel only
// then: its portable loop is no faster than XLA's program), else 0.
LOWPREC_EXPORT int32_t lowprec_cpu_has_avx2() {
#ifdef LOWPREC_X86_AVX2
  return lowprec_native::HasAvx2() ? 1 : 0;
#else
  return 0;
#endif
}

namespace {

// Throws what it is asked to (1: a std::exception, 2: something else; otherwise writes 1 to
// its output), so that tests/test_native_loader.py sees an exception inside a handler come
// back to the caller as an error through lowprec_native::Guarded, the process unharmed. The
// loader does not register it.
ffi::Error GuardCheck(ffi::ResultBuffer<ffi::U8> out, int64_t kind) {
  if (kind == 1) throw std::runtime_error("thrown on request");
  if (kind == 2) throw kind;
  if (out->element_count() > 0) out->typed_data()[0] = 1;
  return ffi::Error::Success();
}

}  // namespace

LOWPREC_FFI_HANDLER(LowprecGuardCheck, "lowprec_guard_check", GuardCheck,
                    ffi::Ffi::Bind().Ret<ffi::Buffer<ffi::U8>>().Attr<int64_t>("kind"));
