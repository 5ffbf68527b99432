"""Safe outputs: never an input, never a special file, written atomically, no temp file left.

The rule every lowprec output follows (checkpoint files, index files, copied files, reports):

* It is never a path that is, or aliases (same device and inode: a hard link or a symbolic
  link), one of the run's inputs — not even with ``force``. The inputs are every file of the
  input checkpoint: an existing file anywhere under its folder (the folder given, or the model
  folder holding a single shard, :func:`lowprec.checkpoint._source.open_source`) is one.
* An existing path is replaced only with ``force``, and only if it is a regular file (or a
  symbolic link to one, which is replaced by the new file): directories, FIFOs, devices,
  sockets and dangling links are refused.
* Every output is checked before any conversion work (:func:`check_output`), then written
  to a temporary file in the destination directory, fsynced and renamed onto the
  destination with ``os.replace`` (atomic), and the directory is fsynced.
* The temporary file is anonymous where the file system allows it (``O_TMPFILE``: it has
  no name until it is complete, so even ``SIGKILL`` leaves nothing behind); otherwise, and
  for the instant between naming and renaming it, it is ``.<name>.lowprec-tmp-<pid>``. Any
  error or caught signal removes it; one left by a killed process (its pid no longer runs)
  is removed by the next run writing to the same destination.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import signal
import stat
import sys
import threading
import weakref
from typing import Iterable, Optional

from ._errors import CheckpointError

TEMP_TAG = ".lowprec-tmp-"

# Off switch for anonymous temp files (tests exercise the named fallback with it).
USE_O_TMPFILE = os.environ.get("LOWPREC_NO_O_TMPFILE", "") in ("", "0")

_LIVE: "weakref.WeakSet[AtomicFile]" = weakref.WeakSet()
_TMPFILE_OK: dict = {}  # st_dev of a directory -> whether O_TMPFILE + linkat work there


class Interrupted(BaseException):
    """A caught SIGINT/SIGTERM/SIGHUP (:func:`interruptible`): unfinished outputs are
    aborted on the way out."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


# Recorded by the command line's signal handler (record_signal). The handler also raises
# Interrupted, but Python drops exceptions raised where it cannot propagate them (a gc
# callback, a __del__), so every write, stage and publish checks the record as well.
_pending_signal: Optional[int] = None


def record_signal(signum: int) -> None:
    """Records that signal ``signum`` was caught: every later write, stage and publish of an
    output raises :class:`Interrupted` until :func:`clear_signal`."""
    global _pending_signal
    _pending_signal = signum


def clear_signal() -> None:
    """Forgets a recorded signal (the command line does so when its handlers are removed)."""
    global _pending_signal
    _pending_signal = None


def pending_signal() -> Optional[int]:
    """The signal recorded by :func:`record_signal`, or None."""
    return _pending_signal


def raise_if_interrupted() -> None:
    """Raises :class:`Interrupted` if a signal was recorded."""
    if _pending_signal is not None:
        raise Interrupted(_pending_signal)


def temp_path(path: str, pid: Optional[int] = None) -> str:
    """The recognisable temp-file name lowprec uses while writing ``path``.

    Example:
        >>> temp_path("/data/model.safetensors", pid=42)
        '/data/.model.safetensors.lowprec-tmp-42'
    """
    directory, base = os.path.split(os.path.abspath(path))
    return os.path.join(directory, f".{base}{TEMP_TAG}{os.getpid() if pid is None else pid}")


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return pid != 0  # exists but belongs to someone else (or cannot be asked): keep
    return True


def remove_stale_temps(path: str) -> list:
    """Removes temp files of ``path`` left by lowprec processes that no longer run.

    Only regular files named exactly ``.<name>.lowprec-tmp-<pid>`` whose ``pid`` is not a
    running process are removed. Returns the removed paths.
    """
    directory, base = os.path.split(os.path.abspath(path))
    prefix = f".{base}{TEMP_TAG}"
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        if not name.startswith(prefix) or not name[len(prefix):].isdigit():
            continue
        pid = int(name[len(prefix):])
        if pid == os.getpid() or _pid_alive(pid):
            continue
        full = os.path.join(directory, name)
        try:
            if stat.S_ISREG(os.lstat(full).st_mode):
                os.unlink(full)
                removed.append(full)
        except OSError:
            pass
    return removed


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


class Inputs:
    """The files of a run's input checkpoint, to refuse outputs that are or alias one: the
    identities (device, inode) of its files, and its folder (every existing file under it)."""

    def __init__(self, paths: Iterable[str] = ()):
        self._ids: dict = {}  # the files given or listed as inputs
        self._folder_ids: dict = {}  # the top-level files of the folder
        self.folder: Optional[str] = None  # as given (messages name it so)
        self._root: Optional[str] = None  # resolved
        for p in paths:
            self.add(p)

    def add(self, path, _into=None) -> None:
        path = os.fspath(path)
        try:
            st = os.stat(path)
        except OSError:
            return
        (self._ids if _into is None else _into).setdefault((st.st_dev, st.st_ino), path)

    def add_folder(self, folder) -> None:
        """Makes every existing file under ``folder`` an input (and registers the identities
        of its top-level files, for links to them from elsewhere)."""
        self.folder = os.fspath(folder)
        self._root = os.path.realpath(self.folder)
        try:
            names = os.listdir(self._root)
        except OSError:
            return
        for name in names:
            self.add(os.path.join(self.folder, name), self._folder_ids)

    def in_folder(self, path) -> bool:
        """Whether ``path`` exists (or is a link, even dangling) under the input folder, or
        leads there."""
        path = os.fspath(path)
        if self._root is None or not os.path.lexists(path):
            return False
        root = self._root.rstrip(os.sep) + os.sep
        # The path as named (its directory resolved: replacing a link inside the folder
        # replaces a file of the folder), and where it leads.
        named = os.path.join(os.path.realpath(os.path.dirname(os.path.abspath(path))),
                             os.path.basename(path))
        return named.startswith(root) or os.path.realpath(path).startswith(root)

    def given(self, path) -> bool:
        """Whether ``path`` is one of the files given (or listed) as the run's inputs."""
        return any(os.path.abspath(p) == os.path.abspath(path) for p in self._ids.values())

    def which(self, path) -> Optional[str]:
        """The input file that ``path`` is or aliases (same device and inode), or None."""
        try:
            st = os.stat(path)
        except OSError:
            return None
        key = (st.st_dev, st.st_ino)
        return self._ids.get(key, self._folder_ids.get(key))


def check_output(path, *, force: bool, inputs: Optional[Inputs] = None, what: str = "output"):
    """Raises :class:`CheckpointError` unless lowprec may write ``path`` (see the module doc).

    Also removes stale temp files of ``path`` (left by killed lowprec runs).
    """
    path = os.fspath(path)
    if not path:
        raise CheckpointError(f"the {what} path is empty")
    source = inputs.which(path) if inputs is not None else None
    same = source is not None and os.path.abspath(source) == os.path.abspath(path)
    if inputs is not None and inputs.in_folder(path) and not (same and inputs.given(path)):
        raise CheckpointError(
            f"{path}: is a file of the input checkpoint {inputs.folder}; lowprec never writes "
            f"over a file of its input checkpoint (not even with --force): choose a new "
            f"{what} path"
        )
    if source is not None:
        raise CheckpointError(
            f"{path}: is {'the' if same else 'a link to the'} input file"
            f"{'' if same else ' ' + source}; lowprec never writes to an input (not even "
            f"with --force): choose another {what} path"
        )
    if os.path.lexists(path):
        try:
            st = os.stat(path)
        except OSError:
            st = None
        if st is not None and stat.S_ISDIR(st.st_mode) and what != "output folder":
            raise CheckpointError(f"{path}: is a directory; give the {what} a file name")
        if not force:
            raise CheckpointError(
                f"{path}: already exists; refusing to overwrite it (pass --force / "
                "force=True to replace it)"
            )
        if st is None:
            raise CheckpointError(
                f"{path}: is a dangling symbolic link; --force replaces regular files only"
            )
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(
                f"{path}: is {_kind(st.st_mode)}; --force replaces regular files only, "
                "choose another path"
            )
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise CheckpointError(f"{path}: directory {directory} does not exist")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise CheckpointError(f"{path}: directory {directory} is not writable")
    remove_stale_temps(path)


@functools.lru_cache(maxsize=None)
def _sync_file_range_fn():
    """libc's ``sync_file_range`` (Linux; Python's ``os`` lacks it), or None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):  # pragma: no cover - a libc without it
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


# <linux/fs.h>: wait for the range's pages already under writeback; start writeback of its
# dirty pages; wait for that writeback.
_SYNC_FILE_RANGE_WAIT_BEFORE, _SYNC_FILE_RANGE_WRITE, _SYNC_FILE_RANGE_WAIT_AFTER = 1, 2, 4


def _sync_file_range(fd: int) -> None:
    fn = _sync_file_range_fn()
    if fn is not None:  # offset 0, nbytes 0: the whole file; its result is only a hint
        fn(fd, 0, 0, _SYNC_FILE_RANGE_WRITE)


def _release_range(fd: int, start: int, end: int) -> None:
    """Waits until bytes [start, end) of ``fd`` are written to the disk, then drops their
    (now clean) pages from the page cache. Both are hints: an I/O error is still reported by
    the fsync, and a page written again meanwhile (dirty) is kept."""
    fn = _sync_file_range_fn()
    if fn is None or end <= start or not hasattr(os, "posix_fadvise"):
        return
    fn(fd, start, end - start, _SYNC_FILE_RANGE_WAIT_BEFORE | _SYNC_FILE_RANGE_WRITE
       | _SYNC_FILE_RANGE_WAIT_AFTER)
    with contextlib.suppress(OSError):
        os.posix_fadvise(fd, start, end - start, os.POSIX_FADV_DONTNEED)


def _fsync_dir(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _link_fd(fd: int, target: str) -> None:
    """Gives the anonymous (O_TMPFILE) file ``fd`` the name ``target`` (linkat)."""
    directory, base = os.path.split(target)
    dfd = os.open(directory, os.O_RDONLY)
    try:  # dst_dir_fd makes os.link call linkat(..., AT_SYMLINK_FOLLOW), which /proc needs
        os.link(f"/proc/self/fd/{fd}", base, dst_dir_fd=dfd, follow_symlinks=True)
    finally:
        os.close(dfd)


def tmpfile_works(directory: str) -> bool:
    """Whether O_TMPFILE and naming it later work in ``directory`` (probed once per device)."""
    if not USE_O_TMPFILE or not hasattr(os, "O_TMPFILE") or not os.path.isdir("/proc/self/fd"):
        return False
    try:
        dev = os.stat(directory).st_dev
    except OSError:
        return False
    if dev not in _TMPFILE_OK:
        ok = False
        probe = os.path.join(directory, f".lowprec-probe{TEMP_TAG}{os.getpid()}")
        try:
            fd = os.open(directory, os.O_TMPFILE | os.O_WRONLY, 0o600)
        except OSError:
            fd = None
        if fd is not None:
            try:
                _link_fd(fd, probe)
                ok = True
                os.unlink(probe)
            except OSError:
                pass
            finally:
                os.close(fd)
        _TMPFILE_OK[dev] = ok
    return _TMPFILE_OK[dev]


class Transaction:
    """Context-manager protocol of an output that is finished or undone as a whole: leaving
    the ``with`` block normally calls :meth:`finish` (and :meth:`abort` if that fails), an
    exception calls :meth:`abort`."""

    def finish(self) -> None:  # pragma: no cover - every subclass defines it
        raise NotImplementedError

    def abort(self) -> None:  # pragma: no cover
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            try:
                self.finish()
            except BaseException:
                self.abort()
                raise
        else:
            self.abort()


class AtomicFile(Transaction):
    """A new file at ``path``, invisible until :meth:`commit` renames it into place.

    ``commit()`` = ``stage()`` (fsync, give the temp file its recognisable name) then
    ``publish()`` (``os.replace`` onto ``path``, fsync the directory); a caller writing
    several files stages each and publishes them all at the end. ``abort()`` (or an
    exception in the ``with`` block) removes the temp file.

    Example:
        >>> import os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "out.txt")
        >>> with AtomicFile(path) as f:
        ...     _ = f.write(b"hello")
        ...     os.path.exists(path)
        False
        >>> open(path).read(), sorted(os.listdir(os.path.dirname(path)))
        ('hello', ['out.txt'])
    """

    def __init__(self, path, *, force: bool = False, inputs: Optional[Inputs] = None,
                 what: str = "output"):
        self.path = os.path.abspath(os.fspath(path))
        self._force = force
        self._inputs = inputs
        self._what = what
        check_output(self.path, force=force, inputs=inputs, what=what)
        self._dir = os.path.dirname(self.path)
        self._temp = temp_path(self.path)
        self._named = False  # whether self._temp exists (is ours)
        self._fd: Optional[int] = None
        self._pos = 0
        self._final = self._released = 0  # see start_writeback
        self.state = "open"
        if tmpfile_works(self._dir):
            self._fd = os.open(self._dir, os.O_TMPFILE | os.O_RDWR | getattr(os, "O_CLOEXEC", 0), 0o666)
        else:
            if os.path.lexists(self._temp):  # ours from an earlier writer of this process
                os.unlink(self._temp)
            self._named = True
            self._fd = os.open(
                self._temp, os.O_CREAT | os.O_EXCL | os.O_RDWR | getattr(os, "O_CLOEXEC", 0), 0o666
            )
        _LIVE.add(self)

    @property
    def anonymous(self) -> bool:
        """Whether the data so far lives in an unnamed (O_TMPFILE) file."""
        return self._fd is not None and not self._named

    def fileno(self) -> int:
        return self._fd

    def pwrite(self, data, offset: int) -> None:
        """Writes all of ``data`` (bytes-like) at byte ``offset``."""
        raise_if_interrupted()
        view = memoryview(data).cast("B")
        done = 0
        while done < len(view):
            if hasattr(os, "pwrite"):
                done += os.pwrite(self._fd, view[done:], offset + done)
            else:  # pragma: no cover - Windows
                os.lseek(self._fd, offset + done, os.SEEK_SET)
                done += os.write(self._fd, view[done:])

    def write(self, data) -> int:
        """Appends ``data`` after the last :meth:`write` (independent of :meth:`pwrite`)."""
        n = len(memoryview(data).cast("B"))
        self.pwrite(data, self._pos)
        self._pos += n
        return n

    def tell(self) -> int:
        """Where the next :meth:`write` appends: the bytes it has written so far."""
        return self._pos

    def start_writeback(self, done: Optional[int] = None) -> None:
        """Starts writing the data so far to disk without waiting for it (Linux
        ``sync_file_range(SYNC_FILE_RANGE_WRITE)``; nothing elsewhere), so that the fsync of
        :meth:`stage` finds little left: a conversion calls it as it goes, on the thread that
        stages, and its last fsync no longer waits for a whole shard to reach the disk (0.48 s
        of wall time for a 0.81 GB output). A hint only: an I/O error is still reported by
        that fsync, which alone says the data is durable.

        ``done``: the file's first ``done`` bytes are final (written, never written again).
        Then the bytes the previous call called final are waited for and dropped from the
        page cache (one call's lag: the disk has had that long), so the output's page cache
        stays a few tensors however large the file: its pages are reused instead of new ones
        taken from free memory, which cost ~3 ns per byte written on this project's
        virtual machines (a page the host has reclaimed faults on first touch) against
        ~0.2-0.7 reused, and a large output no longer pushes the input out of the cache."""
        if self._fd is None or self.state != "open":
            return
        _sync_file_range(self._fd)
        if done is not None:
            _release_range(self._fd, self._released, self._final)
            self._released = max(self._released, self._final)
            self._final = max(self._final, int(done))

    def stage(self) -> None:
        """Makes the data durable under the temp name (closes the file)."""
        raise_if_interrupted()
        if self.state != "open":
            raise CheckpointError(f"{self.path}: stage() after {self.state}")
        os.fsync(self._fd)
        if not self._named:
            if os.path.lexists(self._temp):
                os.unlink(self._temp)
            self._named = True  # before linking: a signal in between still cleans up
            _link_fd(self._fd, self._temp)
        os.close(self._fd)
        self._fd = None
        self.state = "staged"

    def publish(self) -> None:
        """Renames the staged temp file onto the destination."""
        raise_if_interrupted()
        if self.state != "staged":
            raise CheckpointError(f"{self.path}: publish() before stage()")
        # Check again: the destination may have been created or swapped meanwhile.
        check_output(self.path, force=self._force, inputs=self._inputs, what=self._what)
        os.replace(self._temp, self.path)
        self._named = False
        self.state = "done"
        _fsync_dir(self._dir)

    def commit(self) -> None:
        self.stage()
        self.publish()

    finish = commit  # what leaving a ``with`` block does

    def abort(self) -> None:
        """Discards the data; the destination is left as it was."""
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = None
        if self._named:
            try:
                os.unlink(self._temp)
            except FileNotFoundError:
                pass
            self._named = False
        if self.state != "done":
            self.state = "aborted"


    def __del__(self):  # a writer dropped without commit leaves nothing behind
        try:
            if self.state in ("open", "staged"):
                self.abort()
        except Exception:  # pragma: no cover - interpreter shutdown
            pass


def abort_all() -> None:
    """Aborts every unfinished output of this process (used on fatal signals)."""
    for f in list(_LIVE):
        if f.state in ("open", "staged"):
            f.abort()


_SIGNALS = tuple(getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, n))


@contextlib.contextmanager
def interruptible():
    """While active, SIGINT/SIGTERM/SIGHUP raise :class:`Interrupted` in the main thread
    (once: further ones are ignored so that cleanup finishes), and every unfinished output is
    aborted before it propagates. The signal is also recorded, and every output write checks
    it: an exception raised while Python runs a gc callback is dropped, not propagated (then
    :func:`pending_signal` says so after the block). Elsewhere than the main thread it only
    aborts the outputs on :class:`Interrupted`."""
    if threading.current_thread() is not threading.main_thread():
        try:
            yield
        except Interrupted:
            abort_all()
            raise
        return

    def handler(signum, frame):
        for s in _SIGNALS:
            signal.signal(s, signal.SIG_IGN)
        record_signal(signum)  # in case the exception below gets swallowed
        raise Interrupted(signum)

    hook = sys.unraisablehook

    def quiet_hook(unraisable):  # the dropped Interrupted is handled via the flag: no noise
        if not isinstance(unraisable.exc_value, Interrupted):
            hook(unraisable)

    previous = {s: signal.getsignal(s) for s in _SIGNALS}
    try:
        sys.unraisablehook = quiet_hook
        for s in _SIGNALS:
            signal.signal(s, handler)
        try:
            yield
        except Interrupted:
            abort_all()
            raise
    finally:
        clear_signal()
        for s, h in previous.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)
        sys.unraisablehook = hook


class OutputSet(Transaction):
    """Several outputs published together: each is staged when complete, all are renamed
    into place at the end (index files last), and all are removed if anything fails."""

    def __init__(self):
        self.files: list = []

    def add(self, f):
        self.files.append(f)
        return f

    def publish(self) -> None:
        for f in self.files:
            if f.state == "open":
                f.stage()
        for f in self.files:
            f.publish()

    finish = publish

    def abort(self) -> None:
        for f in self.files:
            f.abort()

