"""Where a checkpoint command's threads wait, measured so that other processes' load does
not count: for each thread, its lifetime split into **CPU** (on a core), **run-queue**
(runnable, waiting for a core the machine's other work holds: the load's share) and
**blocked** (asleep: waiting for a piece, a barrier, a queue or the disk), read from
``/proc/thread-self/schedstat`` around each phase; the blocked time is what an idle machine
would still lose, and it is split by what the thread was doing (the phases
``checkpoint_phases.py`` times, plus the main thread's wait for pieces and a worker's wait for
work). Also the critical path's CPU seconds: the main thread's CPU while no piece was in
flight (work no worker can overlap).

Usage (one process, in-process call of the library; WORKERS: piece workers, default the
CPUs)::

    python benchmarks/checkpoint_timeline.py quantize MODEL_DIR OUT_DIR nvfp4 [WORKERS]
    python benchmarks/checkpoint_timeline.py dequantize QUANTIZED_DIR OUT_DIR - [WORKERS]

``PYTHONPATH=OLD_TREE`` runs an older version (phases it lacks are left out).
"""
import collections
import importlib
import os
import sys
import threading
import time


def sched():
    """(CPU ns, run-queue ns) of the calling thread."""
    with open("/proc/thread-self/schedstat") as f:
        cpu, wait, _ = f.read().split()
    return int(cpu), int(wait)


# per thread: {label: [cpu, runq, blocked]} (ns) for the time inside each label
ACC = collections.defaultdict(lambda: collections.defaultdict(lambda: [0, 0, 0]))
LIFE = {}  # thread name -> (start wall, cpu, runq)
lock = threading.Lock()
local = threading.local()
inflight = [0]  # pieces submitted and not yet consumed (main thread's view)
running = [0]  # pieces a worker is running now (on a core or not)
samples = []  # running[0] every ms (the watcher's)
starved = {}  # worker -> when it finished a piece and found none queued
# such waits that ended with another piece: count, wall ns; [True]: those that began while
# the main thread drained a run's last pieces (a barrier), [False]: the others
gaps = {True: [0, 0], False: [0, 0]}
barrier = [False]
serial = [0]  # main-thread CPU ns with no piece in flight


def span(label):
    """Context-free wrapper maker: times ``label`` on the calling thread, innermost wins
    (a nested label's time is taken out of the outer one)."""
    def deco(f):
        def g(*a, **k):
            stack = getattr(local, "stack", None)
            if stack is None:
                stack = local.stack = []
            w0, (c0, r0) = time.perf_counter_ns(), sched()
            stack.append([0, 0, 0])
            try:
                return f(*a, **k)
            finally:
                w1, (c1, r1) = time.perf_counter_ns(), sched()
                inner = stack.pop()
                c, r = c1 - c0, r1 - r0
                b = (w1 - w0) - c - r
                rec = ACC[threading.current_thread().name][label]
                rec[0] += c - inner[0]
                rec[1] += r - inner[1]
                rec[2] += b - inner[2]
                if stack:
                    for i, v in enumerate((c, r, b)):
                        stack[-1][i] += v
        return g
    return deco


def wrap(modname, attr, label):
    try:
        mod = importlib.import_module(modname)
    except ImportError:
        return
    owner, name = ((getattr(mod, attr.split(".")[0]), attr.split(".")[1]) if "." in attr
                   else (mod, attr))
    if not hasattr(owner, name):
        return
    f = getattr(owner, name)
    g = span(label)(f)
    setattr(owner, name, g)
    for m in list(sys.modules.values()):
        if m and getattr(m, "__name__", "").startswith("lowprec.checkpoint") and \
                getattr(m, name, None) is f:
            setattr(m, name, g)


def main():
    t_imp = time.process_time()
    import lowprec.cli  # noqa: F401
    t_imp = time.process_time() - t_imp
    from lowprec.checkpoint import dequantize_checkpoint, quantize_checkpoint
    import lowprec.checkpoint._pipeline as pl

    op, src, dst, fmt = sys.argv[1:5]
    if len(sys.argv) > 5:
        pl.WORKERS = int(sys.argv[5])
    wrap("lowprec.checkpoint._safetensors", "SafetensorsReader.read_region", "read (pread)")
    wrap("lowprec.checkpoint._safetensors", "SafetensorsReader.read", "read (pread)")
    wrap("lowprec.checkpoint._safetensors", "SafetensorsWriter.write_region", "write (pwrite)")
    wrap("lowprec.checkpoint._safetensors", "SafetensorsWriter.write", "write (pwrite)")
    wrap("lowprec.checkpoint._atomic", "AtomicFile.stage", "fsync")
    wrap("lowprec.checkpoint._atomic", "AtomicFile.start_writeback", "sync_file_range")
    wrap("lowprec.checkpoint._atomic", "OutputSet.publish", "publish (rename, dir fsync)")
    wrap("lowprec.kernels._ckpt_cpu", "quantize", "native quantize+stats")
    wrap("lowprec.kernels._ckpt_cpu", "quantize_nvfp4", "native quantize+stats")
    wrap("lowprec.kernels._ckpt_cpu", "decode", "native decode")
    wrap("lowprec.kernels._ckpt_cpu", "amax", "native amax")
    wrap("lowprec.checkpoint._validate", "validate", "validate")
    wrap("lowprec.checkpoint._pipeline", "plan_shards", "plan")

    # The runner: a worker's task, and the main thread's waits for results.
    run0 = pl.PieceRunner.run

    def run(self, fn, items, consume, **kw):  # kw: drain= (streaming across tensors)
        inner = span("task (other)")(fn)

        queue = self._pool._work_queue if self._pool is not None else None

        def task(item):
            now = time.perf_counter_ns()
            with lock:
                running[0] += 1
                since = starved.pop(threading.current_thread().name, None)
                if since is not None:  # this worker had found no work queued
                    g = gaps[since[1]]
                    g[0] += 1
                    g[1] += now - since[0]
            try:
                return inner(item)
            finally:
                with lock:
                    running[0] -= 1
                    if queue is not None and queue.qsize() == 0:
                        starved[threading.current_thread().name] = (time.perf_counter_ns(),
                                                                    barrier[0])

        def consume2(item, result):
            inflight[0] -= 1
            return consume(item, result)

        def counted(items):
            barrier[0] = False
            for item in items:
                inflight[0] += 1
                yield item
            # Every item submitted: a draining run now waits for its last pieces.
            barrier[0] = kw.get("drain", True)
        return run0(self, task, counted(items), consume2, **kw)
    pl.PieceRunner.run = run
    import concurrent.futures._base as fb
    result0 = fb.Future.result
    fb.Future.result = span("wait for a piece / fsync (main)")(result0)

    # A worker's idle time: its whole life less its tasks (ThreadPoolExecutor's queue wait).
    import concurrent.futures.thread as cft
    worker0 = cft._worker

    def worker(*a, **k):
        w0, (c0, r0) = time.perf_counter_ns(), sched()
        try:
            return worker0(*a, **k)
        finally:
            w1, (c1, r1) = time.perf_counter_ns(), sched()
            with lock:
                LIFE[threading.current_thread().name] = (w1 - w0, c1 - c0, r1 - r0)
    cft._worker = worker

    # Main thread: CPU while nothing is in flight (serial, nobody overlaps it) is sampled by
    # a watcher thread every ms: cheap enough, and coarse is fine for a share.
    main_tid = threading.get_native_id()
    stop = threading.Event()

    def watch():
        path = f"/proc/self/task/{main_tid}/schedstat"
        last = None
        while not stop.wait(0.001):
            with open(path) as f:
                c = int(f.read().split()[0])
            if last is not None and inflight[0] == 0:
                serial[0] += c - last
            last = c
            samples.append(running[0])
    watcher = threading.Thread(target=watch, daemon=True, name="watcher")

    w0, (c0, r0) = time.perf_counter_ns(), sched()
    ru0 = time.process_time()
    watcher.start()
    if op == "quantize":
        rep = quantize_checkpoint(src, dst, fmt, force=True, progress=False,
                                  report=os.path.join(dst + ".report.json"))
    else:
        rep = dequantize_checkpoint(src, dst, force=True, progress=False)
    stop.set()
    watcher.join()
    w1, (c1, r1) = time.perf_counter_ns(), sched()
    cpu = time.process_time() - ru0
    LIFE["MainThread"] = (w1 - w0, c1 - c0, r1 - r0)
    nbytes = sum(t.bytes_before for t in rep.tensors)
    print(f"{op} {fmt} {os.path.basename(src.rstrip('/'))}: {nbytes / 1e9:.3f} GB in, "
          f"workers {pl.default_workers()}, process CPU {cpu:.2f} s (watcher's included), "
          f"import {t_imp:.2f} CPU s, wall {(w1 - w0) / 1e9:.2f} s, load "
          f"{os.getloadavg()[0]:.1f}")
    print("| thread | phase | CPU s | run-queue s | blocked s |")
    print("|---|---|---:|---:|---:|")
    for th in sorted(LIFE, key=lambda t: (t != "MainThread", t)):
        if th.startswith("watcher"):
            continue
        life_w, life_c, life_r = LIFE[th]
        acc = ACC.get(th, {})
        rc = rr = rb = 0
        for label, (c, r, b) in sorted(acc.items(), key=lambda kv: -sum(kv[1])):
            print(f"| {th} | {label} | {c / 1e9:.3f} | {r / 1e9:.3f} | {b / 1e9:.3f} |")
            rc, rr, rb = rc + c, rr + r, rb + b
        rest = (life_c - rc, life_r - rr, (life_w - life_c - life_r) - rb)
        what = "idle: waiting for work" if th != "MainThread" else "Python, planning, other"
        print(f"| {th} | {what} | {rest[0] / 1e9:.3f} | {rest[1] / 1e9:.3f} | "
              f"{rest[2] / 1e9:.3f} |")
        print(f"| {th} | **life** | **{life_c / 1e9:.3f}** | {life_r / 1e9:.3f} | "
              f"**{(life_w - life_c - life_r) / 1e9:.3f}** |")
    print(f"main thread CPU with no piece in flight (serial): {serial[0] / 1e9:.3f} s")
    # Occupancy: from the first piece to the last, how often fewer pieces ran than there are
    # workers (a tensor's tail, a barrier, the main thread late to refill): a core left
    # without work on an idle machine. Under load a running piece may wait for a core; the
    # structure (barriers) shows all the same.
    print("a worker found no piece queued and waited for the next (a core without work on an "
          f"idle machine): at a barrier (a run draining its last pieces) {gaps[True][0]} times, "
          f"{gaps[True][1] / 1e9:.3f} s of wall; elsewhere (the main thread late to refill) "
          f"{gaps[False][0]} times, {gaps[False][1] / 1e9:.3f} s")
    busy = [i for i, n in enumerate(samples) if n]
    if busy:
        span_ = samples[busy[0]:busy[-1] + 1]
        workers = pl.default_workers()
        hist = collections.Counter(min(n, workers) for n in span_)
        print(f"pieces running, share of {len(span_)} ms samples from the first piece to the "
              f"last: " + ", ".join(f"{k}: {hist[k] / len(span_):.1%}" for k in range(workers + 1))
              + f"; mean {sum(span_) / len(span_):.2f} of {workers}")


if __name__ == "__main__":
    main()
