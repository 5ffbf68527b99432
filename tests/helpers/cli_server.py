"""A fork server for the ``lowprec`` command, for tests that run it many times from a shell.

Each ``lowprec`` start pays ~0.55 CPU s of imports (``lowprec.cli`` and what it pulls in)
before it does any work; README.md's shell blocks run it 22 times. :func:`start` launches one
Python that imports ``lowprec.cli`` once and then forks a child per command, and writes an
executable ``lowprec`` into a folder to put first on ``PATH``: a stdlib-only client (Python
started with ``-S``, ~0.02 CPU s) that hands the server its argv, working directory,
environment and its stdin/stdout/stderr (the file descriptors themselves, over a Unix
socket), and exits with the command's status. The child does what the installed console
script does (``sys.exit(lowprec.cli.main())``) in that directory and environment, writing to
those descriptors, so a pipe, a redirection or ``$?`` in the shell sees what the real command
gives. JAX is not started in the server (``lowprec.cli`` imports it lazily), so every child
starts its own backend, as a fresh process does.

What it does not exercise is the installed console script itself; the CLI tests run that.
"""

from __future__ import annotations

import json
import os
import pathlib
import socket
import struct
import subprocess
import sys
import tempfile

_CLIENT = """#!{python} -S
import json, os, socket, struct, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect({sock!r})
req = json.dumps({{"argv": sys.argv, "cwd": os.getcwd(), "env": dict(os.environ)}}).encode()
socket.send_fds(s, [struct.pack("!I", len(req)) + req], [0, 1, 2])
status = b""
while len(status) < 4:
    chunk = s.recv(4 - len(status))
    if not chunk:
        sys.exit("lowprec (fork server): the command's process ended without a status")
    status += chunk
sys.exit(struct.unpack("!i", status)[0])
"""


def _exit_status(code) -> int:
    """The process exit status ``sys.exit(code)`` gives."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _run_child(conn: socket.socket, request: dict, fds: list) -> None:
    """In the forked child: become the command (stdio, cwd, environment, argv) and run it."""
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = ["lowprec", *request["argv"][1:]]
    import lowprec.cli

    try:
        status = _exit_status(lowprec.cli.main())
    except SystemExit as e:
        status = _exit_status(e.code)
    except BaseException:  # noqa: BLE001 - as the interpreter would: a traceback, status 1
        import traceback

        traceback.print_exc()
        status = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    conn.sendall(struct.pack("!i", status))
    os._exit(status)


def _recv_request(conn: socket.socket) -> tuple:
    data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
    while len(data) < 4:
        data += conn.recv(1 << 16)
    (size,) = struct.unpack("!I", data[:4])
    data = data[4:]
    while len(data) < size:
        chunk = conn.recv(1 << 16)
        if not chunk:
            raise ConnectionError("the client went away mid-request")
        data += chunk
    return json.loads(data), fds


def serve(sock_path: str) -> None:
    """The server's loop (``python -m helpers.cli_server SOCKET``): forks a child per command."""
    import lowprec.cli  # noqa: F401 - the import each command would otherwise pay

    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(sock_path)
    srv.listen(16)
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    children = set()
    while True:
        conn, _ = srv.accept()
        try:
            request, fds = _recv_request(conn)
        except (ConnectionError, ValueError, OSError):
            conn.close()
            continue
        if request.get("argv") == ["--stop"]:
            conn.close()
            break
        pid = os.fork()
        if pid == 0:
            srv.close()
            _run_child(conn, request, fds)
        children.add(pid)
        conn.close()
        for fd in fds:
            os.close(fd)
        for p in list(children):   # reap the finished ones (their CPU time counts here)
            if os.waitpid(p, os.WNOHANG)[0]:
                children.discard(p)
    for p in children:
        os.waitpid(p, 0)
    srv.close()


class Server:
    """A running fork server: ``bin_dir`` holds its ``lowprec`` client; :meth:`stop` ends it."""

    def __init__(self, env: dict):
        # a short path of its own: a Unix socket's path is limited to ~107 bytes
        self._tmp = tempfile.TemporaryDirectory(prefix="lowprec-cli-")
        directory = pathlib.Path(self._tmp.name)
        self.sock = str(directory / "lowprec.sock")
        self.bin_dir = directory / "bin"
        self.bin_dir.mkdir(exist_ok=True)
        client = self.bin_dir / "lowprec"
        client.write_text(_CLIENT.format(python=sys.executable, sock=self.sock))
        client.chmod(0o755)
        helpers = str(pathlib.Path(__file__).resolve().parents[1])
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "import sys; from helpers.cli_server import serve; serve(sys.argv[1])",
             self.sock],
            env={**env, "PYTHONPATH": os.pathsep.join(filter(None, [helpers, env.get("PYTHONPATH")]))},
            stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
        if self.proc.stdout.readline().strip() != "ready":
            self.proc.kill()
            raise RuntimeError("the lowprec fork server did not start")

    def stop(self) -> None:
        """Ends the server after its running commands (their CPU time then counts in ours)."""
        if self.proc.poll() is None:
            try:
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                    s.connect(self.sock)
                    req = json.dumps({"argv": ["--stop"]}).encode()
                    socket.send_fds(s, [struct.pack("!I", len(req)) + req], [0, 1, 2])
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self.proc.stdout.close()
        self._tmp.cleanup()


def start(env: dict) -> Server:
    """Starts a fork server with ``env`` (that of the shell that will call it); put
    ``server.bin_dir`` first on the shell's PATH."""
    return Server(env)
