"""CPU seconds per phase of one ``quantize_checkpoint`` / ``dequantize_checkpoint`` run, in
this process: each phase's calls are wrapped and timed by their thread's CPU clock (every
worker thread counts), the rest (Python per tensor and piece, scheduling, compilations) is
the process's CPU time less those. Works on older versions too (phases they lack are left
out), so ``PYTHONPATH=OLD_TREE python benchmarks/checkpoint_phases.py ...`` profiles one.

Usage::

    python benchmarks/checkpoint_phases.py quantize MODEL_DIR OUT_DIR mxfp4 [WORKERS]
    python benchmarks/checkpoint_phases.py dequantize QUANTIZED_DIR OUT_DIR - [WORKERS]
"""
import importlib
import os
import resource
import sys
import threading
import time

t_imp = time.process_time()
import lowprec.cli  # noqa
t_imp = time.process_time() - t_imp
from lowprec.checkpoint import quantize_checkpoint, dequantize_checkpoint
import lowprec.checkpoint._pipeline as pl
op, src, dst, fmt = sys.argv[1:5]
if len(sys.argv) > 5:
    pl.WORKERS = int(sys.argv[5])
T, N = {}, {}
lock = threading.Lock()
def wrap(modname, attr, label):
    try:
        mod = importlib.import_module(modname)
    except ImportError:
        return
    owner, name = (getattr(mod, attr.split(".")[0]), attr.split(".")[1]) if "." in attr else (mod, attr)
    if not hasattr(owner, name):
        return
    f = getattr(owner, name)
    def g(*a, **k):
        t = time.thread_time()
        try:
            return f(*a, **k)
        finally:
            with lock:
                T[label] = T.get(label, 0) + time.thread_time() - t
                N[label] = N.get(label, 0) + 1
    setattr(owner, name, g)
    # rebind where imported by name
    for m in list(sys.modules.values()):
        if m and getattr(m, "__name__", "").startswith("lowprec.checkpoint") and getattr(m, name, None) is f:
            setattr(m, name, g)
wrap("lowprec.checkpoint._safetensors", "SafetensorsReader.read_region", "read (pread)")
wrap("lowprec.checkpoint._safetensors", "SafetensorsWriter.write_region", "write (pwrite)")
wrap("lowprec.checkpoint._atomic", "AtomicFile.stage", "fsync")
wrap("lowprec.checkpoint._atomic", "AtomicFile.start_writeback", "write-behind (sync_file_range)")
wrap("lowprec.checkpoint._chunk", "encode_blocks", "encode (XLA program + copies)")
wrap("lowprec.kernels._ckpt_cpu", "quantize", "encode+stats (fused native)")
wrap("lowprec.kernels._ckpt_cpu", "quantize_nvfp4", "encode+stats (fused native)")
wrap("lowprec.kernels._ckpt_cpu", "stats", "stats (native pass)")
wrap("lowprec.kernels._ckpt_cpu", "decode", "decode (native)")
wrap("lowprec.kernels._ckpt_cpu", "amax", "amax")
wrap("lowprec.checkpoint._chunk", "element_table", "tables (element/factor)")
wrap("lowprec.checkpoint._chunk", "_factor_table", "tables (element/factor)")
def threads():
    out = {}
    tick = os.sysconf("SC_CLK_TCK")
    for tid in os.listdir("/proc/self/task"):
        try:
            comm = open(f"/proc/self/task/{tid}/comm").read().strip()
            st = open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        key = comm.rstrip("0123456789_-")
        out[key] = out.get(key, 0) + (int(st[11]) + int(st[12])) / tick
    return out
th0 = threads()
def ru():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime, r.ru_stime, r.ru_minflt
u0, s0, f0 = ru(); w0 = time.perf_counter()
if op == "quantize":
    rep = quantize_checkpoint(src, dst, fmt, force=True, progress=False)
else:
    rep = dequantize_checkpoint(src, dst, force=True, progress=False)
u1, s1, f1 = ru(); wall = time.perf_counter() - w0
nbytes = sum(t.bytes_before for t in rep.tensors)
cpu = (u1 - u0) + (s1 - s0)
print(f"{op} {fmt} {os.path.basename(src)}: {nbytes/1e9:.3f} GB, wall {wall:.2f} s, CPU {cpu:.2f} s "
      f"(user {u1-u0:.2f}, sys {s1-s0:.2f}), minor faults {f1-f0}, import lowprec.cli {t_imp:.2f} CPU s, "
      f"load {os.getloadavg()[0]:.1f}, tensors {len(rep.tensors)}")
print(f"2-core estimate (run only): {nbytes/(cpu/2)/1e9:.2f} GB/s; with import: {nbytes/((cpu+t_imp)/2)/1e9:.2f} GB/s")
th1 = threads()
print("per thread kind (CPU s, live threads only):", {k: round(v - th0.get(k, 0), 2) for k, v in th1.items() if v - th0.get(k, 0) > 0.005})
rest = cpu
print("| phase | CPU s | calls | share |\n|---|---:|---:|---:|")
for k in sorted(T, key=lambda k: -T[k]):
    print(f"| {k} | {T[k]:.2f} | {N[k]} | {100*T[k]/cpu:.0f}% |"); rest -= T[k]
print(f"| rest (Python per tensor/piece, scheduling, compiles, tables) | {rest:.2f} | | {100*rest/cpu:.0f}% |")
