"""The plumbing every whole-checkpoint conversion shares (quantize, dequantize, convert, in
lowprec's and the engines' layouts): where the outputs go (checked before any work), the
readers of the input's shards, the progress bar, and the write phase that feeds one atomic
writer per shard and publishes every output together (see :mod:`lowprec.checkpoint._atomic`).

A driver plans each shard as ``(plan, entries)`` — its own items, and the ``(stored name,
dtype, shape)`` of everything the output shard holds — then hands :func:`write_outputs` a
``convert(reader, writer, item, bar, runner) -> TensorReport`` for its items (or a callable
making it, once the pieces it left in flight, ``runner.run(..., drain=False)``, are done).

Pieces run on worker threads (:class:`PieceRunner`): reading with ``pread``, the compiled
programs, the native passes and ``pwrite`` all release the GIL, so a piece is read while
another is quantized and a third written, on every core. At most two pieces per worker are
in flight (memory stays a few pieces, whatever the checkpoint), each is written at its own
place in the output, and results come back in order, so reports do not depend on the
number of threads. Each converted tensor's bytes start for the disk at once (write-behind,
:meth:`~._atomic.AtomicFile.start_writeback`) and a finished shard is made durable (fsync)
in the background while the next one converts, so the last fsync waits for little; once
on the disk, a tensor's output pages leave the page cache, so that later tensors reuse them
(an output's page cache stays a few tensors, and fresh pages are what writing cost most).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import json
import os
import shutil
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Callable, Iterable, Optional

from ._atomic import AtomicFile, OutputSet, check_output
from ._errors import CheckpointError
from ._layouts import layouts
from ._logical import METADATA_KEY, logical_tensors
from ._qconfig import read_quant_config
from ._report import ConversionReport, TensorReport
from ._safetensors import SafetensorsReader, SafetensorsWriter, nbytes_of
from ._source import Source, check_symlinks

_COPY_BYTES = 16 * 1024 * 1024


#: Worker threads converting pieces (None: one per CPU this process may run on, at most 8).
WORKERS: Optional[int] = None


def default_workers() -> int:
    """The number of piece workers: :data:`WORKERS`, else the CPUs this process may use
    (at most 8: two cores already reach the disk's speed for most formats, and each worker
    holds up to two pieces)."""
    if WORKERS is not None:
        return max(1, int(WORKERS))
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cpus = os.cpu_count() or 1
    return max(1, min(cpus, 8))


class PieceRunner:
    """Runs the pieces of a conversion on worker threads (see the module docstring).

    :meth:`run` calls ``fn(item)`` for each item on the workers, at most two per worker at
    once, and ``consume(item, result)`` in this thread in the items' order. With
    ``drain=False`` it returns once every item is submitted, leaving the last few in flight:
    the next :meth:`run` from this thread (the next tensor's pieces, its amax pass) keeps
    the workers busy while they finish and consumes them first, in order, so a tensor's
    tail no longer leaves a core idle. :meth:`after` queues a call for when every piece
    submitted so far is consumed (a tensor's report, its write-behind); :meth:`drain`
    consumes everything. Each thread that calls it (one per shard converted at once) has
    its own queue. An exception in ``fn``, ``consume`` or a queued call (or a signal's,
    raised here: the command line's SIGTERM) cancels the pieces not started and waits for
    those running before it propagates, as :meth:`cancel` does for an exception raised
    between two calls: no worker touches an output after its file is aborted.

    Example:
        >>> got = []
        >>> with PieceRunner(2) as runner:
        ...     runner.run(lambda i: i * i, range(5), lambda i, r: got.append(r), drain=False)
        ...     runner.after(lambda: got.append("squares done"))
        ...     runner.run(lambda i: -i, range(2), lambda i, r: got.append(r))
        >>> got
        [0, 1, 4, 9, 16, 'squares done', 0, -1]
    """

    def __init__(self, workers: int):
        self.workers = max(1, int(workers))
        self._pool = (ThreadPoolExecutor(self.workers, thread_name_prefix="lowprec-piece")
                      if self.workers > 1 else None)
        self._local = threading.local()

    def _queue(self) -> collections.deque:
        """This thread's ``(item, future, consume)`` in submission order (future None: a
        call queued by :meth:`after`); ``self._local.inflight`` counts the pieces."""
        pending = getattr(self._local, "pending", None)
        if pending is None:
            pending = self._local.pending = collections.deque()
            self._local.inflight = 0
        return pending

    def _consume_next(self, pending: collections.deque) -> None:
        """Consumes the oldest piece, and the calls queued before it."""
        while pending:
            item, future, then = pending.popleft()
            if future is None:
                then()
                continue
            self._local.inflight -= 1
            then(item, future.result())
            return

    def run(self, fn: Callable, items: Iterable, consume: Callable, *, drain: bool = True) -> None:
        if self._pool is None:
            for item in items:
                consume(item, fn(item))
            return
        pending = self._queue()
        try:
            for item in items:
                pending.append((item, self._pool.submit(fn, item), consume))
                self._local.inflight += 1
                if self._local.inflight >= 2 * self.workers:
                    self._consume_next(pending)
            if drain:
                while pending:
                    self._consume_next(pending)
        except BaseException:
            self.cancel()
            raise

    def after(self, call: Callable) -> None:
        """Calls ``call()`` in this thread once every piece submitted so far is consumed
        (now, if none is in flight)."""
        pending = self._queue()
        if pending:
            pending.append((None, None, call))
        else:
            call()

    def drain(self) -> None:
        """Consumes, in order, every piece this thread has in flight (and runs the calls
        queued between them)."""
        self.run(None, (), None)

    def cancel(self) -> None:
        """Cancels this thread's pieces not started and waits for those running (their
        results and the queued calls are dropped)."""
        pending = self._queue()
        futures = [future for _, future, _ in pending if future is not None]
        pending.clear()
        self._local.inflight = 0
        for future in futures:
            future.cancel()
        wait(futures)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def progress_bar(total: int, desc: str, enabled: Optional[bool]):
    if enabled is None:
        enabled = sys.stderr.isatty()
    if not enabled:  # before the import: tqdm's (its version lookup) costs ~0.2 CPU s
        return _NoProgress()
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm is optional
        return _NoProgress()
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                file=sys.stderr, leave=False, dynamic_ncols=True)


class _NoProgress:
    def update(self, n=1):
        pass

    def set_postfix_str(self, s="", refresh=True):
        pass

    def close(self):
        pass


# -- outputs -------------------------------------------------------------------------
def _norm(path: str) -> str:
    """``path`` with its directory resolved (the file itself need not exist)."""
    path = os.path.abspath(path)
    return os.path.join(os.path.realpath(os.path.dirname(path)), os.path.basename(path))


class Outputs:
    """Where a conversion writes, checked up front (before any work)."""

    def __init__(self, source: Source, dst, report, force: bool, follow_symlinks: bool = False,
                 jobs: int = 1):
        if not isinstance(follow_symlinks, bool):
            raise TypeError(f"follow_symlinks must be True or False, got {follow_symlinks!r}")
        if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
            raise CheckpointError(f"jobs must be a positive int (shards converted at once), "
                                  f"got {jobs!r}")
        self.jobs = jobs
        if not follow_symlinks:
            check_symlinks(source)
        self.source = source
        self.force = force
        self.dst = os.fspath(dst)
        self.report = None if report is None else os.fspath(report)
        self.create_folder = False
        inputs = source.inputs
        if source.is_folder:
            self._check_folder()
            self.files = {rel: os.path.join(self.dst, rel)
                          for rel in [*source.shards,
                                      *([source.index_name] if source.index_name else []),
                                      *source.others]}
            if not self.create_folder:
                for rel, path in self.files.items():
                    if not os.path.isdir(os.path.dirname(path)):
                        continue  # a subfolder created later; nothing there to clash with
                    check_output(path, force=force, inputs=inputs)
        else:
            if os.path.isdir(self.dst):
                raise CheckpointError(
                    f"{self.dst}: is a folder; a single-file input gives a single-file output "
                    "(give a file name)"
                )
            self.files = {source.shards[0]: self.dst}
            check_output(self.dst, force=force, inputs=inputs)
        if self.report is not None:
            check_output(self.report, force=force, inputs=inputs, what="report")
            clash = [p for p in self.files.values() if _norm(p) == _norm(self.report)]
            if clash:
                raise CheckpointError(
                    f"{self.report}: the report would overwrite the checkpoint output {clash[0]}; "
                    "choose another report path"
                )

    def _check_folder(self):
        dst, src = self.dst, self.source.folder
        if os.path.lexists(dst):
            if not os.path.isdir(dst):
                raise CheckpointError(
                    f"{dst}: exists and is not a folder; a sharded input gives an output folder"
                )
            if os.path.samefile(dst, src):
                raise CheckpointError(
                    f"{dst}: is the input folder; lowprec never writes into its input, choose "
                    "another output folder"
                )
        real_dst, real_src = os.path.realpath(dst), os.path.realpath(src)
        if real_dst.startswith(real_src.rstrip(os.sep) + os.sep):
            raise CheckpointError(
                f"{dst}: is inside the input folder {src}; choose an output folder outside it"
            )
        if not os.path.lexists(dst):
            parent = os.path.dirname(os.path.abspath(dst))
            if not os.path.isdir(parent):
                raise CheckpointError(f"{dst}: directory {parent} does not exist")
            if not os.access(parent, os.W_OK | os.X_OK):
                raise CheckpointError(f"{dst}: directory {parent} is not writable")
            self.create_folder = True

    def check_space(self, nbytes: int) -> None:
        where = self.dst if os.path.isdir(self.dst) else os.path.dirname(os.path.abspath(self.dst))
        try:
            free = shutil.disk_usage(where).free
        except OSError:
            return
        if nbytes > free:
            raise CheckpointError(
                f"{self.dst}: the output needs {nbytes / 2**20:,.1f} MiB but only "
                f"{free / 2**20:,.1f} MiB are free there"
            )

    @contextlib.contextmanager
    def folder(self):
        """Creates the output folder (and subfolders) if needed; removes what it created
        if the conversion fails."""
        made = []
        try:
            if self.source.is_folder:
                for path in [self.dst, *sorted({os.path.dirname(p) for p in self.files.values()})]:
                    if not os.path.isdir(path):
                        os.makedirs(path)
                        made.append(path)
            yield
        except BaseException:
            for path in reversed(made):
                with contextlib.suppress(OSError):
                    os.rmdir(path)  # only if empty: never removes anything else
            raise

    def path(self, rel: str) -> str:
        return self.files[rel]

    def add_file(self, rel: str) -> None:
        """Adds ``rel`` (relative to the output folder) to the outputs, checked as the others
        were: a file the input folder lacks (a config an engine layout needs)."""
        if rel in self.files:
            return
        path = os.path.join(self.dst, rel)
        if not self.create_folder:
            check_output(path, force=self.force, inputs=self.source.inputs)
        self.files[rel] = path


def _copy_file(src: str, dst: str, outs: OutputSet, o: Outputs, bar) -> None:
    f = outs.add(AtomicFile(dst, force=o.force, inputs=o.source.inputs))
    with open(src, "rb") as inp:
        pos = 0
        while True:
            data = inp.read(_COPY_BYTES)
            if not data:
                break
            f.pwrite(data, pos)
            pos += len(data)
            bar.update(len(data))
    f.stage()


def _write_text(path: str, text: str, outs: OutputSet, o: Outputs, what="output") -> None:
    data = text.encode("utf-8")
    f = outs.add(AtomicFile(path, force=o.force, inputs=o.source.inputs, what=what))
    f.pwrite(data, 0)
    f.stage()


def _index_text(source: Source, weight_map: dict, total_size: int) -> str:
    index = dict(source.index or {})
    meta = dict(index.get("metadata") or {})
    meta["total_size"] = total_size
    index["metadata"] = meta
    index["weight_map"] = dict(sorted(weight_map.items()))
    return json.dumps(index, indent=2) + "\n"


def open_readers(stack, source: Source) -> dict:
    readers = {}
    for rel in source.shards:
        readers[rel] = stack.enter_context(SafetensorsReader(source.path(rel)))
    if source.index is not None:  # the index must agree with the shards
        for name, shard in source.index["weight_map"].items():
            if name not in readers[shard].tensors:
                raise CheckpointError(
                    f"{source.path(source.index_name)}: says tensor {name!r} is in {shard}, "
                    "which has no such tensor"
                )
    seen = {}
    for rel, reader in readers.items():
        for name in reader.tensors:
            if name in seen:
                raise CheckpointError(
                    f"{source.given}: tensor {name!r} is in both {seen[name]} and {rel}"
                )
            seen[name] = rel
    return readers


def check_unquantized(source: Source, readers: dict) -> None:
    """Refuses to quantize a checkpoint that is, or whose config says it is, quantized:
    quantizing starts from high precision (requantized codes, or quantized parts copied
    beside new ones, are never what was meant)."""
    config = read_quant_config(source.home)
    if config is not None:
        raise CheckpointError(
            f"{config.where}: already quantized, says its quantization_config (quant_method "
            f"{config.method!r}); start from the unquantized checkpoint (lowprec dequantize "
            "decodes the layouts it reads, lowprec convert changes the layout), or delete "
            "quantization_config from config.json if it is stale")
    for reader in readers.values():
        if METADATA_KEY in reader.metadata:
            raise CheckpointError(f"{reader.path}: already quantized by lowprec; dequantize "
                                  "it first (lowprec dequantize)")
        found = logical_tensors(reader, strict=False)
        if found.undecodable:
            first = next(iter(found.undecodable.values()))
            raise CheckpointError(f"{reader.path}: already quantized: {first.describe()}; start "
                                  "from the unquantized checkpoint")
        if found.specs:
            raise CheckpointError(
                f"{reader.path}: already quantized (compressed-tensors, ModelOpt or gpt-oss "
                "tensors); lowprec convert changes its layout, lowprec dequantize decodes it")


def check_collisions(entries, src, fix: str = "--exclude one of them"):
    """Refuses two output tensors of one name; ``fix``: what the caller's user can do (the
    option keeping a tensor out of quantization in that layout)."""
    seen = set()
    for name, _, _ in entries:
        if name in seen:
            raise CheckpointError(
                f"{src}: the stored name {name!r} would be used twice (an input tensor already "
                f"has a name lowprec uses for a quantized part); {fix}"
            )
        seen.add(name)


def copy_tensor(reader, writer, name: str, bar) -> None:
    for piece in reader.iter_raw(name):
        writer.write(name, piece)
        bar.update(len(piece))


def keep_tensor(reader, writer, name: str, bar, reason: str):
    """Copies tensor ``name`` unchanged; its report line (format ``kept``)."""
    info = reader.tensors[name]
    copy_tensor(reader, writer, name, bar)
    return TensorReport(name, info.shape, info.dtype, "kept", info.nbytes, info.nbytes,
                        reason=reason)


def plan_shards(readers: dict, plan_file, fix: str = "--exclude one of them") -> dict:
    """``{rel: (plan, entries)}`` of every shard: ``plan_file(reader)`` gives its items, each
    with the ``(stored name, dtype, shape)`` entries it writes; two entries of one name are
    refused (:func:`check_collisions`, ``fix`` saying how)."""
    plans = {}
    for rel, reader in readers.items():
        plan, entries = [], _Entries()
        for item, stored in plan_file(reader):
            plan.append(item)
            entries += stored
            entries.ends.append(len(entries))
        check_collisions(entries, reader.path, fix)
        plans[rel] = (plan, entries)
    return plans


class _Entries(list):
    """A shard's ``(stored name, dtype, shape)`` entries, in file order, and where each
    planned item's end: item k stores ``entries[ends[k - 1]:ends[k]]``."""

    def __init__(self):
        super().__init__()
        self.ends: list = []

    def last_name(self, k: int) -> Optional[str]:
        """The last entry stored by items 0..k (None: none stores any)."""
        n = self.ends[k]
        return self[n - 1][0] if n else None



def _finish(source, outputs, outs, weight_map, total_size, bar, texts=None) -> None:
    """Copies the other files of a folder (or writes ``texts[rel]`` in place of one, e.g. a
    config.json with quantization_config) and writes its rewritten index (published last)."""
    if not source.is_folder:
        return
    texts = texts or {}
    for rel in source.others:
        if rel not in texts:
            _copy_file(source.path(rel), outputs.path(rel), outs, outputs, bar)
    for rel, text in texts.items():
        if text is not None:  # None: not written (a config the target layout does not use)
            _write_text(outputs.path(rel), text, outs, outputs)
    if source.index_name is not None:
        text = _index_text(source, weight_map, total_size)
        _write_text(outputs.path(source.index_name), text, outs, outputs)


def write_outputs(source, outputs, readers, plans, op, options, start, *, force, progress,
                   metadata, convert, texts=None) -> ConversionReport:
    """The write phase shared by quantize and dequantize: checks free space, then, per shard,
    one atomic safetensors writer (the input's metadata minus lowprec's, plus
    ``metadata(plan)``) fed by ``convert(reader, writer, item, bar) -> TensorReport`` for
    each planned tensor; then the folder's other files and index, and the report. Every
    output is published together at the end, or none is."""
    out_bytes = sum(nbytes_of(dt, shp) for _, entries in plans.values()
                    for _, dt, shp in entries) + source.other_bytes()
    outputs.check_space(out_bytes)
    in_bytes = sum(i.nbytes for r in readers.values() for i in r.tensors.values())
    bar = progress_bar(in_bytes + source.other_bytes(), op, progress)
    reports, weight_map = [], {}
    staged = []  # shards being made durable in the background
    runner = PieceRunner(default_workers())
    try:
        with outputs.folder(), OutputSet() as outs, contextlib.ExitStack() as stack:
            # Left first: every background fsync has ended before any output is aborted
            # (an aborted file's descriptor must not be used again).
            stack.callback(wait, staged)
            stager = stack.enter_context(ThreadPoolExecutor(1, thread_name_prefix="lowprec-fsync"))
            writers = {}
            # Another layout's table of its tensors describes the input, not the output.
            layout_keys = {getattr(lay, "metadata_key", None) for lay in layouts()}
            for rel, reader in readers.items():
                plan, entries = plans[rel]
                meta = {k: v for k, v in reader.metadata.items()
                        if not k.startswith("lowprec.") and k not in layout_keys}
                meta.update(metadata(plan))
                writers[rel] = SafetensorsWriter(outputs.path(rel), entries, meta, force=force,
                                                 inputs=source.inputs)
                outs.add(writers[rel].atomic_file)
                for name, _, _ in entries:
                    weight_map[name] = rel

            def shard(rel):
                shard_reports = []
                plan, entries = plans[rel]
                writer = writers[rel]

                def finished(k, rep):
                    # Once the tensor's last piece is consumed: its report, and the
                    # write-behind (its bytes go to disk while the next converts, and those
                    # final one call earlier leave the page cache). The prefix stops at its
                    # end: a later tensor already complete (a kept one, copied meanwhile)
                    # waits for its own call, so the calls are those of converting one tensor
                    # after the other.
                    rep = rep() if callable(rep) else rep
                    if source.is_folder:
                        rep.shard = rel
                    shard_reports.append(rep)
                    through = entries.last_name(k) if isinstance(entries, _Entries) else None
                    staged.append(stager.submit(writer.atomic_file.start_writeback,
                                                writer.written_prefix(through)))

                try:
                    for k, item in enumerate(plan):
                        # A report, or (pieces left in flight) what makes it once consumed.
                        rep = convert(readers[rel], writer, item, bar, runner)
                        runner.after(functools.partial(finished, k, rep))
                    runner.drain()
                except Exception:
                    # The earlier tensors' pieces still in flight (a few) are finished first:
                    # their error, if one fails, is the one converting the tensors one after
                    # the other would raise.
                    try:
                        runner.drain()
                    except Exception as earlier:
                        raise earlier from None
                    raise
                except BaseException:  # a signal: stop at once
                    runner.cancel()
                    raise
                staged.append(stager.submit(writer.stage))
                return shard_reports

            if outputs.jobs > 1 and len(readers) > 1:
                # Shards are independent files: threads (NumPy, JAX and file I/O release the
                # GIL). map keeps the shards' order, so the report is the same for any jobs.
                with ThreadPoolExecutor(min(outputs.jobs, len(readers))) as pool:
                    done = list(pool.map(shard, readers))
            else:
                done = [shard(rel) for rel in readers]
            reports = [rep for shard_reports in done for rep in shard_reports]
            for future in list(staged):
                future.result()
            _finish(source, outputs, outs, weight_map, out_bytes - source.other_bytes(), bar,
                    texts)
            result = ConversionReport(source.given, outputs.dst, op, options, reports,
                                      time.perf_counter() - start, skipped=source.skipped)
            if outputs.report is not None:
                _write_text(outputs.report, result.to_json() + "\n", outs, outputs, "report")
    finally:
        runner.close()
        bar.close()
    return result

