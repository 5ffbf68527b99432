"""Every code block of README.md runs exactly as written.

Blocks run in order, in one test and one fresh temporary directory (so a later block may use the files an
earlier one made): ``python`` blocks are executed in a fresh namespace each, ``bash`` blocks
with ``bash -euo pipefail`` and the ``lowprec`` command of this interpreter's environment on
PATH (``lowprec.cli.main`` of this environment, run by a fork server that imported it once:
tests/helpers/cli_server.py). A block that cannot run here says so in an HTML comment on the line before it,
``<!-- readme-test: skip: <why> -->``; only the set-up block does (it creates a virtual
environment and installs packages), and its shape is checked instead.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

from helpers import cli_server

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
SKIP = re.compile(r"<!--\s*readme-test:\s*skip:\s*(?P<why>.+?)\s*-->")


def blocks() -> list:
    """``(line, language, code, skip reason or None)`` for every fenced block."""
    lines = README.read_text(encoding="utf-8").splitlines()
    out, i = [], 0
    while i < len(lines):
        m = re.match(r"^```(\w*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        start, lang = i, m.group(1)
        j = i + 1
        while not lines[j].startswith("```"):
            j += 1
        skip = SKIP.search(lines[start - 1]) if start else None
        out.append((start + 1, lang, "\n".join(lines[start + 1:j]) + "\n",
                    skip.group("why") if skip else None))
        i = j + 1
    return out


BLOCKS = blocks()


def test_blocks_are_found_and_labelled():
    assert len(BLOCKS) >= 5
    assert all(lang in ("python", "bash") for _, lang, _, _ in BLOCKS), "label every block"
    skipped = [(line, why) for line, _, _, why in BLOCKS if why]
    assert len(skipped) == 1 and "install" in skipped[0][1], skipped


def test_setup_is_two_commands_naming_python_venv_and_extras():
    line, lang, code, why = BLOCKS[0]
    commands = [c for c in code.splitlines() if c.strip()]
    assert lang == "bash" and why and len(commands) == 2
    install, test = commands
    assert re.search(r"python3\.1\d+ -m venv", install) and "activate" in install
    assert "pip install -e '.[test]'" in install and "examples/quickstart.py" in install
    assert test == "pytest"
    text = README.read_text(encoding="utf-8")
    assert "Python 3.10 or newer" in text and "`[cli]`" in text


@pytest.mark.slow  # runs every README code block (about a minute)
def test_every_block_runs_in_order(tmp_path, monkeypatch):
    # One test for all blocks, not one per block: a later block uses the files an earlier one
    # made, and pytest-xdist may run separate tests on separate workers in any order.
    monkeypatch.chdir(tmp_path)
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    # The shell blocks run `lowprec` 22 times: through a fork server that imported lowprec.cli
    # once (tests/helpers/cli_server.py; ~0.55 CPU s of imports saved per command).
    server = cli_server.start(env)
    env["PATH"] = str(server.bin_dir) + os.pathsep + env["PATH"]
    ran = 0
    try:
        for line, lang, code, why in BLOCKS:
            if why:
                continue  # illustrative only; its shape is checked above
            if lang == "python":
                exec(compile(code, f"README.md:{line}", "exec"), {"__name__": f"readme_line{line}"})
            else:
                proc = subprocess.run(["bash", "-euo", "pipefail", "-c", code], cwd=tmp_path,
                                      env=env, capture_output=True, text=True, timeout=600)
                assert proc.returncode == 0, (
                    f"README.md line {line}:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
            ran += 1
    finally:
        server.stop()
    assert ran == len(BLOCKS) - 1  # every block but the set-up one
