// The Python extension module lowprec.kernels._cpu_lib: lowprec's native CPU kernels (XLA FFI
// handlers defined in _fp6_cpu.cc and _mx_quantize_cpu.cc) as capsules, which
// lowprec/kernels/_cpu_native.py registers with jax.ffi.register_ffi_target.

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "xla/ffi/api/api.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(LowprecFp6Pack);
XLA_FFI_DECLARE_HANDLER_SYMBOL(LowprecFp6Unpack);
XLA_FFI_DECLARE_HANDLER_SYMBOL(LowprecMxQuantize);

static PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_cpu_lib",
                              "lowprec's native CPU kernels (XLA FFI handlers).", -1, nullptr,
                              nullptr, nullptr, nullptr, nullptr};

PyMODINIT_FUNC PyInit__cpu_lib() {
  PyObject* module = PyModule_Create(&kModule);
  if (module == nullptr) return nullptr;
  const struct {
    const char* name;
    void* handler;
  } handlers[] = {{"fp6_pack", reinterpret_cast<void*>(LowprecFp6Pack)},
                  {"fp6_unpack", reinterpret_cast<void*>(LowprecFp6Unpack)},
                  {"mx_quantize", reinterpret_cast<void*>(LowprecMxQuantize)}};
  for (const auto& h : handlers) {
    PyObject* capsule = PyCapsule_New(h.handler, nullptr, nullptr);
    if (capsule == nullptr || PyModule_AddObject(module, h.name, capsule) < 0) {
      Py_XDECREF(capsule);
      Py_DECREF(module);
      return nullptr;
    }
  }
  // Whether this CPU runs the quantizer's AVX2 loop (lowprec sends quantize_mx to the kernel
  // only then: its portable loop is no faster than XLA's program).
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  const bool avx2 = __builtin_cpu_supports("avx2");
#else
  const bool avx2 = false;
#endif
  if (PyModule_AddObject(module, "avx2", PyBool_FromLong(avx2)) < 0) {
    Py_DECREF(module);
    return nullptr;
  }
  return module;
}
