"""laden.tools.sandbox: model-written Python in a sandboxed subprocess; each barrier checked by code that tries
to cross it, and laden.tools.calculator's safe arithmetic."""

from __future__ import annotations

import asyncio
import socket

import pytest

from laden.tools import sandbox
from laden.tools.calculator import CalculatorError, evaluate_arithmetic, format_number
from laden.tools.sandbox import arun_python, network_namespace_available, run_python

NAMESPACE_MODES = [False, pytest.param(True, marks=pytest.mark.skipif(
    not network_namespace_available(), reason="no unprivileged network namespaces here"))]  # fmt: skip


def test_the_code_runs_and_its_output_comes_back():
    result = run_python("import math\nprint(math.factorial(10))\nprint(sum(range(5)))")
    assert result.ok and result.returncode == 0 and not result.timed_out
    assert result.stdout == "3628800\n10\n" and result.stderr == "" and result.text() == "3628800\n10"


def test_an_exception_is_reported_with_its_traceback_from_the_code_only():
    result = run_python("print('before')\ndef f():\n    return 1 / 0\nf()")
    assert result.returncode == 1 and not result.ok
    assert result.stdout == "before\n"
    assert (
        "ZeroDivisionError: division by zero" in result.stderr
        and 'File "<code>", line 3, in f' in result.stderr
    )
    assert "exec(compile(" not in result.stderr  # the sandbox's own frames are not shown
    assert result.text().startswith("before\nTraceback")
    assert run_python("raise SystemExit(3)").returncode == 3


def test_a_run_past_its_timeout_is_killed():
    result = run_python(
        "import time\nprint('started', flush=True)\nwhile True:\n    time.sleep(0.01)", timeout=1.0
    )
    assert result.timed_out and result.returncode is None and not result.ok
    assert result.stdout == "started\n" and "timed out" in result.text()


@pytest.mark.parametrize("namespace", NAMESPACE_MODES)
def test_the_network_is_refused(namespace):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.setblocking(False)
        port = server.getsockname()[1]
        code = (f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), timeout=5)\n"
                "    print('connected')\nexcept OSError as e:\n    print('refused', type(e).__name__)\n"
                "import urllib.request\ntry:\n    urllib.request.urlopen('http://example.com', timeout=5)\n"
                "except OSError as e:\n    print('refused', type(e).__name__)")  # fmt: skip
        result = run_python(code, network_namespace=namespace)
        with pytest.raises(BlockingIOError):
            server.accept()  # nothing connected
    assert result.ok and result.network_namespace is namespace
    assert result.stdout.splitlines() == ["refused PermissionError", "refused URLError"]


@pytest.mark.skipif(not network_namespace_available(), reason="no unprivileged network namespaces here")
def test_the_network_namespace_has_only_a_loopback_interface():
    result = run_python("print(open('/proc/self/net/dev').read())", network_namespace=True)
    interfaces = [line.split(":")[0].strip() for line in result.stdout.splitlines()[2:] if ":" in line]
    assert result.ok and interfaces == ["lo"]


def test_a_namespace_asked_for_where_there_is_none_is_refused_with_the_reason(monkeypatch):
    monkeypatch.setattr(sandbox, "network_namespace_available", lambda: False)
    with pytest.raises(RuntimeError, match="unshare --user --net. is not available here"):
        run_python("print(1)", network_namespace=True)
    assert run_python("print(1)").network_namespace is False  # auto: the audit hook alone


def test_output_is_cut_at_the_cap_and_a_flood_is_bounded():
    result = run_python(
        "print('x' * 5000)\nimport sys\nprint('y' * 5000, file=sys.stderr)", max_output_chars=100
    )
    assert result.ok and result.truncated
    assert (
        result.stdout == "x" * 100
        and result.stderr == "y" * 100
        and result.text().endswith("[output truncated]")
    )
    flood = run_python(
        "while True:\n    print('x' * 1000)", max_file_bytes=1 << 16, max_output_chars=50, timeout=60
    )
    assert not flood.timed_out and flood.returncode == 1 and flood.truncated  # the write past the limit fails
    exact = run_python("print('x' * 99)", max_output_chars=100)  # 100 characters with the newline: not cut
    assert exact.stdout == "x" * 99 + "\n" and not exact.truncated


def test_files_outside_the_working_directory_are_not_written(tmp_path):
    victim = tmp_path / "keep.txt"
    victim.write_text("original")
    code = f"""
import os, pathlib, shutil
outside = {str(tmp_path)!r}
attempts = {{
    "open": lambda: open(os.path.join(outside, "new.txt"), "w"),
    "append": lambda: open(os.path.join(outside, "keep.txt"), "a"),
    "os.open": lambda: os.open(os.path.join(outside, "new.txt"), os.O_WRONLY | os.O_CREAT),
    "pathlib": lambda: pathlib.Path(outside, "new.txt").write_text("x"),
    "remove": lambda: os.remove(os.path.join(outside, "keep.txt")),
    "rename": lambda: os.rename(os.path.join(outside, "keep.txt"), "stolen.txt"),
    "mkdir": lambda: os.mkdir(os.path.join(outside, "d")),
    "rmtree": lambda: shutil.rmtree(outside),
    "chmod": lambda: os.chmod(os.path.join(outside, "keep.txt"), 0o777),
    "dotdot": lambda: open("../escape.txt", "w"),
    "hardlink": lambda: os.link(os.path.join(outside, "keep.txt"), "alias.txt"),
}}
for name, attempt in attempts.items():
    try:
        attempt()
        print(name, "WROTE")
    except PermissionError:
        print(name, "refused")
os.symlink(outside, "link")  # a link inside the directory that points out of it
try:
    open("link/new.txt", "w")
    print("symlink WROTE")
except PermissionError:
    print("symlink refused")
with open("inside.txt", "w") as f:
    f.write("fine")
os.mkdir("sub")
os.rename("inside.txt", "sub/inside.txt")
print(open("sub/inside.txt").read(), os.getcwd() != outside)
"""
    result = run_python(code)
    assert result.ok, result.text()
    lines = result.stdout.splitlines()
    assert lines[:-1] == [f"{name} refused" for name in ("open", "append", "os.open", "pathlib", "remove", "rename",
                                                         "mkdir", "rmtree", "chmod", "dotdot", "hardlink", "symlink")]  # fmt: skip
    assert lines[-1] == "fine True"  # its own directory is writable
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt"] and victim.read_text() == "original"


def test_processes_native_libraries_and_the_environment_are_out_of_reach():
    code = """
import ctypes, os, subprocess
for name, attempt in {
    "subprocess": lambda: subprocess.run(["true"]),
    "system": lambda: os.system("true"),
    "fork": os.fork,
    "kill": lambda: os.kill(os.getppid(), 0),
    "dlopen": lambda: ctypes.CDLL("libc.so.6"),
    "dlsym": lambda: ctypes.CDLL(None).system,
}.items():
    try:
        attempt()
        print(name, "RAN")
    except PermissionError:
        print(name, "refused")
print(sorted(k for k in os.environ if k != "LC_CTYPE"))
try:
    input()
except EOFError:
    print("no stdin")
"""
    result = run_python(code)
    assert result.ok, result.text()
    assert result.stdout.splitlines() == [
        "subprocess refused", "system refused", "fork refused", "kill refused", "dlopen refused", "dlsym refused",
        "[]", "no stdin",
    ]  # fmt: skip


def test_memory_beyond_the_limit_raises_memory_error():
    result = run_python("x = bytearray(1 << 30)\nprint('allocated')", memory_mb=256)
    assert result.returncode == 1 and "MemoryError" in result.stderr and "allocated" not in result.stdout
    assert run_python("x = bytearray(16 << 20)\nprint('allocated')", memory_mb=256).stdout == "allocated\n"


def test_arun_python_runs_off_the_event_loop_and_bad_limits_are_refused():
    async def both():
        return await asyncio.gather(arun_python("print(1)"), arun_python("print(2)"))

    assert [r.stdout for r in asyncio.run(both())] == ["1\n", "2\n"]
    with pytest.raises(ValueError, match="timeout=0, .* must all be positive"):
        run_python("print(1)", timeout=0)


def test_the_calculator_evaluates_arithmetic_and_nothing_else():
    assert evaluate_arithmetic("3 + 4 * 2") == 11 and evaluate_arithmetic("(1 + 2) ** 3 - 7 // 2") == 24
    assert evaluate_arithmetic("-2^3") == -8 and evaluate_arithmetic("7 / 2") == 3.5
    assert evaluate_arithmetic("10 % 4") == 2 and format_number(evaluate_arithmetic("6 / 3")) == "2"
    assert format_number(1 / 3) == "0.333333333333"
    refusals = {
        "__import__('os').system('true')": "not Call", "x + 1": "not Name", "(1).real": "not Attribute",
        "1 / 0": "division by zero", "9 ** 9 ** 9": "exponent", "10 ** 20": "out of range", "": "non-empty",
        "3 +": "not an arithmetic expression", "'a' * 3": "not Constant", "1 < 2": "not Compare",
        "1" * 300: "longer than 256", "(-8) ** 0.5": "out of range", "2 & 3": "not BitAnd",
    }  # fmt: skip
    for expression, reason in refusals.items():
        with pytest.raises(CalculatorError, match=reason):
            evaluate_arithmetic(expression)
