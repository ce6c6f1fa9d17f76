"""The calculator and the sandboxed Python runner (issue 18's sandbox acceptance tests)."""

import os
import time

import psutil
import pytest

from megarl.agent.tools import CALCULATOR, SandboxLimits, ToolError, calculator, python_tool, run_python


@pytest.mark.parametrize("expression, value", [
    ("1776", "1776"), ("12*148", "1776"), ("(17 + 4) * 3", "63"), ("7/2", "3.5"), ("8/2", "4"),
    ("7//2", "3"), ("-7 % 3", "2"), ("2**10", "1024"), ("-(2**3)", "-8"), ("--3", "3"), ("0.1+0.2", "0.3"),
    ("1/3", "0.333333333333"), ("2**-1", "0.5"), ("1e20", "1e+20"), (" 3 ", "3"),
])
def test_calculator_values(expression, value):
    assert calculator(expression) == value


@pytest.mark.parametrize("expression, message", [
    ("1/0", "division by zero"), ("5 % 0", "division by zero"), ("9**9**9", "result out of range"),
    ("10**101", "result out of range"), ("1e308*10", "result out of range"), ("(-8)**0.5", "not a real number"),
    ("2^3", "use **"), ("__import__('os')", "unsupported syntax"), ("x + 1", "unsupported syntax at column 1"),
    ("True + 1", "unsupported syntax"), ("1 +", "invalid expression"), ("", "empty expression"),
    ("1+" * 200 + "1", "expression too long (401 chars; limit 256)"),
])
def test_calculator_errors(expression, message):
    start = time.monotonic()
    with pytest.raises(ToolError, match=message.replace("(", r"\(").replace(")", r"\)").replace("*", r"\*")):
        calculator(expression)
    assert time.monotonic() - start < 1.0  # refused before computing (9**9**9 would take minutes)


def test_calculator_tool_definition_and_arguments():
    assert CALCULATOR.definition["function"]["name"] == "calculator"
    assert CALCULATOR.definition["function"]["parameters"]["required"] == ["expression"]
    with pytest.raises(ToolError, match="missing argument 'expression'"):
        CALCULATOR.check_arguments({})
    with pytest.raises(ToolError, match="unexpected argument 'expr'"):
        CALCULATOR.check_arguments({"expression": "1", "expr": "2"})
    with pytest.raises(ToolError, match="argument 'expression' must be of type string, got int"):
        CALCULATOR.check_arguments({"expression": 3})


FAST = SandboxLimits(timeout_s=20, memory_mb=256)  # a generous time limit: these calls end by themselves


def _assert_gone(pid: int, path: str) -> None:
    """Nothing of the run is left: not its process, nor any process of its group, nor its directory."""
    assert not psutil.pid_exists(pid)
    for proc in psutil.process_iter():
        try:
            assert os.getpgid(proc.pid) != pid, f"process {proc.pid} of the sandbox's group is still running"
        except (ProcessLookupError, psutil.NoSuchProcess):
            pass
    assert not os.path.exists(path)


def test_sandbox_runs_code_in_a_private_directory():
    code = ("import os, numpy\n"
            "open('a.txt', 'w').write('x'); os.mkdir('d'); os.rename('a.txt', 'd/b.txt')\n"
            "print(sorted(os.listdir('d')), int(numpy.arange(5).sum()), os.getcwd())\n"
            "print(os.readlink('/proc/self/ns/net'))")
    result = run_python(code, FAST)
    assert result.error is None and result.exit_code == 0, result.stderr
    listing, netns = result.stdout.splitlines()
    assert listing.startswith("['b.txt'] 10 ")
    assert not os.path.exists(listing.split()[-1])  # the directory is removed afterwards
    if result.netns:  # where user namespaces are allowed, the code is in its own network namespace
        assert netns != os.readlink("/proc/self/ns/net")


@pytest.mark.parametrize("code, message", [
    ("open('/tmp/megarl-sandbox-escape.txt', 'w')",
     "refused by the sandbox: writing '/tmp/megarl-sandbox-escape.txt': outside the sandbox directory"),
    ("import os; os.symlink('/tmp/megarl-sandbox-escape.txt', 'l'); open('l', 'a')",
     "refused by the sandbox: writing 'l': outside the sandbox directory"),
    ("import os; os.remove('/tmp/megarl-sandbox-escape.txt')", "refused by the sandbox: removing"),
    ("import os; os.makedirs('../x')", "refused by the sandbox: creating '../x'"),
    ("open('missing/../../../../../../tmp/megarl-sandbox-escape.txt', 'x')", "refused by the sandbox: writing"),
    # patching what a Python-level check would call changes nothing: the hook calls only C functions
    ("import builtins, os, posixpath\n"
     "posixpath.realpath = os.path.realpath = lambda *a, **k: os.getcwd() + '/x'\n"
     "builtins.isinstance = lambda *a: False; builtins.PermissionError = KeyError; os.getcwd = posixpath.realpath\n"
     "open('/tmp/megarl-sandbox-escape.txt', 'w')",
     "refused by the sandbox: writing '/tmp/megarl-sandbox-escape.txt': outside the sandbox directory"),
    ("import socket; socket.create_connection(('127.0.0.1', 9))", "refused by the sandbox: socket."),
    ("import subprocess; subprocess.run(['true'])", "refused by the sandbox: importing _posixsubprocess"),
    ("import os; os.system('true')", "refused by the sandbox: os.system is not allowed"),
    ("import os; os.fork()", "refused by the sandbox: os.fork is not allowed"),
    ("import os; os.kill(1, 0)", "refused by the sandbox: os.kill is not allowed"),
    ("import ctypes; ctypes.CDLL(None).getpid()", "refused by the sandbox: ctypes.dlsym is not allowed"),
    ("import ctypes; ctypes.CDLL('libc.so.6')", "refused by the sandbox: ctypes.dlopen is not allowed"),
])
def test_sandbox_refuses_writes_outside_sockets_and_processes(code, message):
    result = run_python(code, FAST)
    assert result.exit_code == 1 and result.error.startswith(message), result.error
    assert not os.path.exists("/tmp/megarl-sandbox-escape.txt")


@pytest.mark.parametrize("code, limits, message", [
    ("import os, time; print(os.getpid(), os.getcwd(), flush=True); time.sleep(60)", SandboxLimits(timeout_s=1.5),
     "timed out after 1.5 s (killed)"),
    ("import os; print(os.getpid(), os.getcwd(), flush=True)\nwhile True: pass",
     SandboxLimits(timeout_s=8, cpu_s=1), "CPU time limit of 1 s exceeded (killed)"),
    ("import os; print(os.getpid(), os.getcwd(), flush=True); x = bytearray(1 << 30)", FAST,
     "memory limit of 256 MiB exceeded (MemoryError)"),
])
def test_sandbox_limits_end_the_call_and_leave_nothing_running(code, limits, message):
    start = time.monotonic()
    result = run_python(code, limits)
    assert result.error == message
    pid, cwd = result.stdout.split()
    _assert_gone(int(pid), cwd)
    assert result.seconds <= time.monotonic() - start
    if "timed out" in message:
        assert limits.timeout_s <= result.seconds < limits.timeout_s + 2.0


def test_sandbox_output_and_file_limits():
    result = run_python("print('x' * 100000)", SandboxLimits(max_output_chars=1000))
    assert result.error is None
    assert result.stdout == "x" * 1000 + "\n... (output cut at 1000 characters)"
    result = run_python("open('big', 'wb').write(b'0' * (2 << 20))", SandboxLimits(max_file_mb=1))
    assert result.error == "OSError: [Errno 27] File too large"


def test_sandbox_limits_are_checked():
    with pytest.raises(ValueError, match="sandbox timeout_s=0 must be a positive number"):
        SandboxLimits(timeout_s=0)
    with pytest.raises(ValueError, match="sandbox memory_mb=8 must be an integer >= 32"):
        SandboxLimits(memory_mb=8)
    assert SandboxLimits(timeout_s=2.5).cpu_s == 3


def test_python_tool_answers_and_failures():
    tool = python_tool(FAST)
    assert tool.fn(code="print(6 * 7)") == "42"
    with pytest.raises(ToolError) as err:
        tool.fn(code="print('partial')\n1/0")
    text = str(err.value)
    assert text.startswith("partial\n[stderr]\nTraceback") and 'File "main.py", line 2' in text
    assert text.endswith("[error] ZeroDivisionError: division by zero")
