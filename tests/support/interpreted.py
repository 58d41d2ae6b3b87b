"""Code run under Triton's interpreter from a test. `TRITON_INTERPRET` is read when Triton is
imported, so the code runs in a Python process of its own, with this checkout first on the import
path, then the helpers of tests/support and the test directories this session imported tests from
(the code may import its own test module by name)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from repo_paths import ROOT, SUPPORT, TESTS


def interpret(code: str, *, timeout: float = 300) -> subprocess.CompletedProcess:
    """`code` run by this Python with `TRITON_INTERPRET=1`; its output captured as text."""
    test_dirs = [p for p in sys.path if p and Path(p).resolve().is_relative_to(TESTS)]
    paths = [str(ROOT), str(SUPPORT), *test_dirs, os.environ.get("PYTHONPATH", "")]
    env = {
        **os.environ,
        "TRITON_INTERPRET": "1",
        "PYTHONPATH": os.pathsep.join(dict.fromkeys(p for p in paths if p)),
    }
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )


def interpret_ok(code: str, *, timeout: float = 300) -> None:
    """Run `code`, which prints "ok" when every check in it passed, under the interpreter; fail
    with its error output unless it exited 0 having printed only that."""
    done = interpret(code, timeout=timeout)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def interpret_check(cases: str, *args) -> None:
    """Run the `check(*args)` that the source `cases` defines under the interpreter (`args` written
    by their repr: dtypes, device names, tolerances), failing with its error output."""
    interpret_ok(f"{cases}\ncheck({', '.join(map(repr, args))})\nprint('ok')\n")


def run_check(cases: str, *args) -> None:
    """Run the `check(*args)` that the source `cases` defines, in this process: the GPU tests run
    the same cases as the interpreter's."""
    scope: dict = {}
    exec(cases, scope)  # noqa: S102 - test source of this directory
    scope["check"](*args)
