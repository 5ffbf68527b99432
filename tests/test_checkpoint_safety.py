"""The data-safety rule of lowprec.checkpoint and the ``lowprec`` command.

lowprec never writes to a path that is, or aliases, an input; ``--force`` replaces regular
files only; every output (checkpoint and report) is checked before any conversion work and
written atomically; no temp file survives a caught signal, and one left by a killed run is
recognisable and removed by the next run to the same destination.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import lowprec.checkpoint._atomic as atomic
import lowprec.checkpoint._convert as convert_mod
from lowprec.checkpoint import (
    AtomicFile,
    CheckpointError,
    SafetensorsWriter,
    dequantize_checkpoint,
    quantize_checkpoint,
    temp_path,
)
from lowprec.cli import main

TEMP_RE = re.compile(r"^\..+\.lowprec-tmp-(\d+)$")


def digest(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def write_model(path, n=3, shape=(64, 64), seed=0):
    rng = np.random.default_rng(seed)
    entries = [(f"layers.{i}.weight", "F32", shape) for i in range(n)]
    with SafetensorsWriter(path, entries) as w:
        for name, _, _ in entries:
            w.write(name, rng.standard_normal(shape).astype(np.float32))
    return path


@pytest.fixture
def model(tmp_path):
    return write_model(tmp_path / "model.safetensors")


@pytest.fixture
def no_work(monkeypatch):
    """Fails the test if any tensor gets quantized (errors must come before any work)."""

    def boom(*a, **k):
        raise AssertionError("conversion work started before the outputs were checked")

    monkeypatch.setattr(convert_mod, "quantize_chunk", boom)
    monkeypatch.setattr(convert_mod, "dequantize_chunk", boom)


@pytest.fixture(params=["o_tmpfile", "named"])
def temp_mode(request, monkeypatch):
    """Runs a test with anonymous temp files and with the named fallback."""
    if request.param == "named":
        monkeypatch.setattr(atomic, "USE_O_TMPFILE", False)
    elif not atomic.tmpfile_works(os.getcwd()):
        pytest.skip("O_TMPFILE + linkat not available here")
    return request.param


def listing(d) -> list:
    return sorted(os.listdir(d))


# -- never an input, before any work ------------------------------------------------------
def test_report_onto_the_input_is_refused_before_any_work(tmp_path, model, no_work, capsys):
    before = digest(model)
    out = tmp_path / "out.safetensors"
    args = ["quantize", str(model), str(out), "-f", "mxfp4", "--report", str(model)]
    assert main(args) == 1
    assert main(args + ["--force"]) == 1
    err = capsys.readouterr().err
    assert "is the input file" in err and "never writes to an input" in err
    assert digest(model) == before and listing(tmp_path) == ["model.safetensors"]


@pytest.mark.parametrize("link", ["hard", "symbolic"])
@pytest.mark.parametrize("which", ["output", "report"])
def test_links_to_the_input_are_refused_even_with_force(tmp_path, model, no_work, link, which):
    alias = tmp_path / "alias.safetensors"
    (os.link if link == "hard" else os.symlink)(model, alias)
    before = digest(model)
    out, report = tmp_path / "out.safetensors", tmp_path / "r.json"
    if which == "output":
        out = alias
    else:
        report = alias
    with pytest.raises(CheckpointError, match="is a link to the input file"):
        quantize_checkpoint(model, out, "mxfp4", force=True, report=report)
    assert digest(model) == before
    assert listing(tmp_path) == ["alias.safetensors", "model.safetensors"]


def test_report_equal_to_the_output_is_refused(tmp_path, model, no_work):
    out = tmp_path / "out.safetensors"
    with pytest.raises(CheckpointError, match="report would overwrite the checkpoint output"):
        quantize_checkpoint(model, out, "mxfp4", report=tmp_path / "." / "out.safetensors")
    assert listing(tmp_path) == ["model.safetensors"]


def test_existing_report_needs_force_and_is_checked_first(tmp_path, model, no_work):
    report = tmp_path / "r.json"
    report.write_text("keep me")
    with pytest.raises(CheckpointError, match="already exists.*--force"):
        quantize_checkpoint(model, tmp_path / "out.safetensors", "mxfp4", report=report)
    assert report.read_text() == "keep me"
    assert listing(tmp_path) == ["model.safetensors", "r.json"]


def test_bad_report_path_fails_before_any_work(tmp_path, model, no_work, capsys):
    args = ["quantize", str(model), str(tmp_path / "out.safetensors"), "-f", "mxfp4",
            "--report", str(tmp_path / "missing" / "r.json")]
    assert main(args) == 1
    assert "does not exist" in capsys.readouterr().err
    assert listing(tmp_path) == ["model.safetensors"]


def test_report_written_atomically_with_force(tmp_path, model):
    report = tmp_path / "r.json"
    report.write_text("old")
    quantize_checkpoint(model, tmp_path / "out.safetensors", "mxfp4", report=report, force=True)
    assert json.loads(report.read_text())["totals"]["tensors_quantized"] == 3
    assert listing(tmp_path) == ["model.safetensors", "out.safetensors", "r.json"]


# -- --force replaces regular files only ---------------------------------------------------
def _special(tmp_path, kind):
    p = tmp_path / f"{kind}.safetensors"
    if kind == "fifo":
        os.mkfifo(p)
    elif kind == "directory":
        p.mkdir()
    elif kind == "dangling":
        os.symlink(tmp_path / "nowhere", p)
    elif kind == "link_to_directory":
        (tmp_path / "d").mkdir()
        os.symlink(tmp_path / "d", p)
    elif kind == "link_to_device":  # never the device itself: a bug would replace the link
        os.symlink(os.devnull, p)
    return p


@pytest.mark.parametrize("kind", ["fifo", "directory", "dangling", "link_to_directory",
                                  "link_to_device"])
@pytest.mark.parametrize("which", ["output", "report"])
def test_force_refuses_special_files(tmp_path, model, no_work, kind, which):
    target = _special(tmp_path, kind)
    before = {n: os.lstat(tmp_path / n) for n in os.listdir(tmp_path)}
    out, report = tmp_path / "out.safetensors", None
    if which == "output":
        out = target
    else:
        report = target
    with pytest.raises(CheckpointError) as info:
        quantize_checkpoint(model, out, "mxfp4", force=True, report=report)
    assert str(target) in str(info.value)
    assert re.search(r"regular files only|is a directory|is a folder", str(info.value))
    after = {n: os.lstat(tmp_path / n) for n in os.listdir(tmp_path)}
    assert {n: (s.st_ino, s.st_mode) for n, s in after.items()} == {
        n: (s.st_ino, s.st_mode) for n, s in before.items()}


def test_force_replaces_a_symlink_to_a_regular_file_not_its_target(tmp_path, model):
    target = tmp_path / "elsewhere.bin"
    target.write_bytes(b"untouched")
    link = tmp_path / "out.safetensors"
    os.symlink(target, link)
    quantize_checkpoint(model, link, "mxfp4", force=True)
    assert not os.path.islink(link) and target.read_bytes() == b"untouched"


def test_device_destination_is_refused(tmp_path, model, no_work):
    if not os.path.exists(os.devnull):
        pytest.skip("no null device")
    # check_output alone: it must refuse before anything could be opened for writing.
    with pytest.raises(CheckpointError, match="character device.*regular files only"):
        atomic.check_output(os.devnull, force=True)


# -- atomic writes, temp files --------------------------------------------------------------
def test_failure_midway_leaves_nothing(tmp_path, model, monkeypatch, temp_mode):
    calls = []
    real = convert_mod.quantize_chunk

    def fail_second(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            names = listing(tmp_path)
            if temp_mode == "named":  # the temp file is there, recognisable, while writing
                assert [n for n in names if TEMP_RE.match(n)] == [
                    f".out.safetensors.lowprec-tmp-{os.getpid()}"]
            else:  # anonymous: nothing visible at all
                assert names == ["model.safetensors"]
            raise RuntimeError("simulated failure")
        return real(*a, **k)

    monkeypatch.setattr(convert_mod, "quantize_chunk", fail_second)
    with pytest.raises(RuntimeError, match="simulated"):
        quantize_checkpoint(model, tmp_path / "out.safetensors", "mxfp4",
                            report=tmp_path / "r.json")
    assert listing(tmp_path) == ["model.safetensors"]


def test_existing_output_is_untouched_until_the_new_one_is_complete(tmp_path, model, monkeypatch):
    out = tmp_path / "out.safetensors"
    out.write_bytes(b"previous version")
    seen = []
    real = convert_mod.quantize_chunk

    def spy(*a, **k):
        seen.append(out.read_bytes())
        return real(*a, **k)

    monkeypatch.setattr(convert_mod, "quantize_chunk", spy)
    quantize_checkpoint(model, out, "mxfp4", force=True)
    assert set(seen) == {b"previous version"}
    assert out.read_bytes() != b"previous version"


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_stale_temp_files_of_dead_runs_are_removed(tmp_path, model):
    out = tmp_path / "out.safetensors"
    dead = _dead_pid()
    stale = temp_path(str(out), pid=dead)
    live = temp_path(str(out), pid=os.getppid())  # a running process: left alone
    other = temp_path(str(tmp_path / "other.safetensors"), pid=dead)  # another destination
    for p in (stale, live, other):
        open(p, "wb").write(b"x" * 100)
    quantize_checkpoint(model, out, "mxfp4")
    names = listing(tmp_path)
    assert os.path.basename(stale) not in names
    assert os.path.basename(live) in names and os.path.basename(other) in names


def test_atomic_file_abort_and_del_leave_nothing(tmp_path, temp_mode):
    path = tmp_path / "x.bin"
    f = AtomicFile(path)
    f.write(b"abc")
    f.abort()
    g = AtomicFile(path)
    g.write(b"abc")
    del g
    assert listing(tmp_path) == []
    with AtomicFile(path) as h:
        h.write(b"done")
    assert path.read_bytes() == b"done" and listing(tmp_path) == ["x.bin"]


def test_write_behind_hands_each_tensor_to_the_disk_before_its_shard_is_staged(
        tmp_path, model, monkeypatch, temp_mode):
    """Write-behind: each converted tensor's bytes are handed to the disk
    (``sync_file_range``) on the fsync thread, before the shard's fsync; the hint changes no
    byte (the output equals a run without it) and is a no-op after stage or abort."""
    if sys.platform.startswith("linux"):
        assert atomic._sync_file_range_fn() is not None  # the hint really runs here
    events = []
    real_hint, real_stage = atomic._sync_file_range, AtomicFile.stage

    def hint(fd):
        events.append(("hint", threading.current_thread().name, os.fstat(fd).st_size))
        real_hint(fd)

    def stage(self):
        events.append(("stage", os.path.basename(self.path), None))
        real_stage(self)

    monkeypatch.setattr(atomic, "_sync_file_range", hint)
    monkeypatch.setattr(AtomicFile, "stage", stage)
    quantize_checkpoint(model, tmp_path / "q.safetensors", "mxfp4")
    assert [e[0] for e in events] == ["hint"] * 3 + ["stage"]  # 3 tensors, then the fsync
    assert all(e[1].startswith("lowprec-fsync") for e in events[:3])
    monkeypatch.setattr(atomic, "_sync_file_range", lambda fd: None)
    quantize_checkpoint(model, tmp_path / "plain.safetensors", "mxfp4")
    assert digest(tmp_path / "q.safetensors") == digest(tmp_path / "plain.safetensors")

    monkeypatch.setattr(atomic, "_sync_file_range", hint)
    events.clear()
    f = AtomicFile(tmp_path / "x.bin")
    f.write(b"abc")
    f.start_writeback()
    f.commit()
    f.start_writeback()  # staged and published: nothing to hand over
    g = AtomicFile(tmp_path / "y.bin")
    g.abort()
    g.start_writeback()
    assert [e[0] for e in events] == ["hint", "stage"]
    assert (tmp_path / "x.bin").read_bytes() == b"abc" and not (tmp_path / "y.bin").exists()


def test_write_behind_drops_each_finished_tensor_from_the_page_cache(
        tmp_path, model, monkeypatch, temp_mode):
    """Once a tensor is on the disk its output pages leave the page cache (later tensors
    reuse them): each ``start_writeback`` releases, one call late, exactly the prefix of the
    file that was final at the call before (the header and the tensors converted by then,
    read here from the output's own header), never a byte of a tensor still being written;
    the output is byte for byte a run's without it."""
    released = []
    real_release = atomic._release_range

    def release(fd, start, end):
        released.append((start, end))
        real_release(fd, start, end)

    monkeypatch.setattr(atomic, "_release_range", release)
    rep = quantize_checkpoint(model, tmp_path / "q.safetensors", "mxfp4")
    with open(tmp_path / "q.safetensors", "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    end = {k: 8 + n + v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"}
    # the file's final prefix after each tensor: the end of its last stored part
    finals = [max(end[s] for s in (t.stored_as or (t.name,))) for t in rep.tensors]
    assert len(finals) == 3 and finals == sorted(finals) and finals[-1] == max(end.values())
    lagged = [0, 0, *finals[:-1]]
    assert released == [(lagged[k], lagged[k + 1]) for k in range(len(finals))]
    monkeypatch.setattr(atomic, "_release_range", lambda fd, start, end: None)
    quantize_checkpoint(model, tmp_path / "plain.safetensors", "mxfp4")
    assert digest(tmp_path / "q.safetensors") == digest(tmp_path / "plain.safetensors")


def test_not_enough_disk_space_is_refused_up_front(tmp_path, model, monkeypatch, no_work):
    import shutil

    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10, 10, 1))
    with pytest.raises(CheckpointError, match="MiB are free"):
        quantize_checkpoint(model, tmp_path / "out.safetensors", "mxfp4")


# -- signals: a real process killed mid-write -----------------------------------------------
def _writer_fds(pid: int, directory: str) -> list:
    """Targets of the process' open files in ``directory`` (temp files being written)."""
    out = []
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith(directory + "/") and ("lowprec-tmp" in target or "#" in target):
                out.append(target)
    except OSError:
        pass
    return out


def _start_and_kill(tmp_path, sig, named: bool):
    """Starts ``lowprec quantize`` on a ~96 MB checkpoint, sends ``sig`` once it is writing
    its output; returns (the process, its stderr)."""
    src = tmp_path / "in"
    src.mkdir()
    model = write_model(src / "model.safetensors", n=24, shape=(1024, 1024))
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    env = dict(os.environ, JAX_PLATFORMS="cpu", LOWPREC_NO_O_TMPFILE="1" if named else "0")
    cmd = [sys.executable, "-m", "lowprec", "quantize", str(model),
           str(out_dir / "q.safetensors"), "-f", "mxfp8", "--report", str(out_dir / "r.json")]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 240
    while not _writer_fds(proc.pid, str(out_dir)):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            out, err = proc.communicate()
            pytest.fail(f"the conversion never started writing (rc {proc.returncode}): {err[-2000:]}")
        time.sleep(0.005)
    time.sleep(0.05)  # well inside the write of the first tensors
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    return proc, err.decode(), out_dir, model


def _linux_proc():
    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("needs /proc to see when the process is writing")


@pytest.mark.quick_cases(sig=[signal.SIGTERM], named=[True])
@pytest.mark.parametrize("sig,named", [
    (signal.SIGTERM, False), (signal.SIGTERM, True), (signal.SIGINT, True),
    (signal.SIGHUP, False),
])
def test_caught_signal_mid_write_leaves_no_temp_file(tmp_path, sig, named):
    _linux_proc()
    proc, err, out_dir, model = _start_and_kill(tmp_path, sig, named)
    assert proc.returncode == 128 + sig, err
    assert "Traceback" not in err
    assert f"interrupted by {signal.Signals(sig).name}" in err
    assert listing(out_dir) == []  # no output, no report, no temp file
    assert listing(model.parent) == ["model.safetensors"]


@pytest.mark.parametrize("named", [False, True])
@pytest.mark.slow  # left out of the quick tier (seconds; its paths run in other quick tests)
def test_sigkill_mid_write_leaves_at_most_a_recognisable_temp_removed_by_the_next_run(
        tmp_path, named):
    _linux_proc()
    proc, err, out_dir, model = _start_and_kill(tmp_path, signal.SIGKILL, named)
    assert proc.returncode == -signal.SIGKILL
    left = listing(out_dir)
    assert all(TEMP_RE.match(n) and int(TEMP_RE.match(n).group(1)) == proc.pid for n in left)
    if named:
        assert left == [".q.safetensors.lowprec-tmp-%d" % proc.pid]
    else:  # an anonymous temp file dies with the process
        assert left == []
    # The next run to the same destination removes the stale temp file and succeeds.
    quantize_checkpoint(model, out_dir / "q.safetensors", "mxfp8", report=out_dir / "r.json")
    assert listing(out_dir) == ["q.safetensors", "r.json"]


def test_signal_whose_exception_python_drops_still_stops_the_run(tmp_path, model, monkeypatch,
                                                               capsys):
    """A signal handled while Python runs a gc callback: the exception raised by the
    handler is dropped (JAX registers such a callback), so the run must notice the
    recorded signal at its next write and stop cleanly all the same."""
    import gc

    calls = []
    real = convert_mod.quantize_chunk

    def callback(phase, info):
        if phase == "start" and calls == [1, 1] and len(calls) == 2:
            calls.append("signalled")
            signal.raise_signal(signal.SIGTERM)  # its exception cannot leave a gc callback

    def second_piece_triggers_gc(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            gc.callbacks.append(callback)
            try:
                gc.collect()
            finally:
                gc.callbacks.remove(callback)
        return real(*a, **k)

    monkeypatch.setattr(convert_mod, "quantize_chunk", second_piece_triggers_gc)
    out = tmp_path / "out.safetensors"
    status = main(["quantize", str(model), str(out), "-f", "mxfp4", "--report",
                   str(tmp_path / "r.json")])
    err = capsys.readouterr().err
    assert "signalled" in calls
    assert status == 128 + signal.SIGTERM, err
    assert "interrupted by SIGTERM; unfinished output removed" in err and "Traceback" not in err
    assert listing(tmp_path) == ["model.safetensors"]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handlers restored


def test_recorded_signal_stops_every_write_until_cleared(tmp_path):
    """The pending-signal record (what the command line's handler leaves for writes that run
    after its exception was dropped): a write raises Interrupted, and nothing after
    clear_signal does."""
    f = AtomicFile(tmp_path / "out.bin")
    try:
        atomic.record_signal(signal.SIGTERM)
        assert atomic.pending_signal() == signal.SIGTERM
        with pytest.raises(atomic.Interrupted) as e:
            f.pwrite(b"x", 0)
        assert e.value.signum == signal.SIGTERM
    finally:
        atomic.clear_signal()
    assert atomic.pending_signal() is None
    f.pwrite(b"x", 0)
    f.stage()
    f.publish()
    assert open(tmp_path / "out.bin", "rb").read() == b"x"


def test_dequantize_follows_the_same_rules(tmp_path, model):
    q = tmp_path / "q.safetensors"
    quantize_checkpoint(model, q, "mxfp4")
    with pytest.raises(CheckpointError, match="is the input file"):
        dequantize_checkpoint(q, q, force=True)
    with pytest.raises(CheckpointError, match="is the input file"):
        dequantize_checkpoint(q, tmp_path / "d.safetensors", report=q, force=True)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(CheckpointError, match="FIFO"):
        dequantize_checkpoint(q, fifo, force=True)


# -- no file of the input checkpoint is ever an output ---------------------------------------
def _model_folder(root, quantized: bool):
    """A Hugging Face style folder: two shards, their index, config.json, a tokenizer file and
    a file in a subfolder (quantized to MXFP4 in lowprec's layout if ``quantized``)."""
    src = root / "float"
    src.mkdir()
    rng = np.random.default_rng(1)
    weight_map = {}
    for i in (1, 2):
        shard = f"model-0000{i}-of-00002.safetensors"
        name = f"model.layers.{i}.mlp.up_proj.weight"
        with SafetensorsWriter(src / shard, [(name, "F32", (64, 64))]) as w:
            w.write(name, rng.standard_normal((64, 64)).astype(np.float32))
        weight_map[name] = shard
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (src / "config.json").write_text('{"model_type": "llama"}')
    (src / "tokenizer.json").write_text('{"version": "1.0"}')
    (src / "sub").mkdir()
    (src / "sub" / "notes.json").write_text("{}")
    if not quantized:
        return src
    quantize_checkpoint(src, root / "q", "mxfp4", progress=False)
    return root / "q"


def _tree(folder) -> dict:
    return {os.path.relpath(os.path.join(r, f), folder): digest(os.path.join(r, f))
            for r, _, files in os.walk(folder) for f in files}


@pytest.mark.parametrize("op", ["quantize", "dequantize", "convert"])
def test_force_never_replaces_a_file_of_the_input_checkpoint(tmp_path, op, capsys):
    """A single shard's checkpoint is its folder (it holds config.json or an index): none of
    its files — config.json (which may hold quantization_config), the index, the other
    shard, tokenizer files, files in subfolders — is ever an output, not even with --force
    (issue 37.1: `quantize tm/model-00001-of-00002.safetensors tm/config.json --force`
    turned config.json into a safetensors file)."""
    folder = _model_folder(tmp_path, quantized=op != "quantize")
    shard = folder / "model-00001-of-00002.safetensors"
    extra = {"quantize": ["-f", "mxfp4"], "convert": ["--layout", "compressed-tensors"],
             "dequantize": []}[op]
    before = _tree(folder)
    for victim in ("config.json", "model.safetensors.index.json", "tokenizer.json",
                   "model-00002-of-00002.safetensors", "sub/notes.json"):
        for where in ("output", "report"):
            out, report = str(folder / victim), str(tmp_path / "r.json")
            if where == "report":
                out, report = str(tmp_path / "out"), out
            assert main([op, str(shard), out, *extra, "--force", "-q", "--report", report]) == 1
            err = capsys.readouterr().err
            assert f"{folder / victim}: is a file of the input checkpoint {folder}" in err, err
            assert "not even with --force" in err and len(err.strip().splitlines()) == 1
    assert _tree(folder) == before
    # A new file beside the shard is written; once there it is one of the folder's files,
    # which a later run must not replace.
    new = folder / "new.safetensors"
    assert main([op, str(shard), str(new), *extra, "-q"]) == 0
    written = digest(new)
    assert main([op, str(shard), str(new), *extra, "--force", "-q"]) == 1
    assert "is a file of the input checkpoint" in capsys.readouterr().err
    assert digest(new) == written and set(_tree(folder)) == set(before) | {"new.safetensors"}
