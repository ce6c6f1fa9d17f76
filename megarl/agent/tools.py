"""The built-in tools of agentic rollouts: a calculator (``ast``-evaluated arithmetic, no
``eval``) and a sandboxed Python runner (a limited subprocess in a throw-away directory, which
sees only that directory and a read-only Python runtime).

A tool is a :class:`Tool`: a JSON-schema definition (what the chat template shows the model) and
a callable; it answers with text, or raises :class:`ToolError` whose message goes to the model.
"""

from __future__ import annotations

import ast
import functools
import json
import math
import operator
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Dict, Optional, Tuple, Union


class ToolError(Exception):
    """A failed tool call; the message is shown to the model as the tool's answer."""


@dataclass
class Tool:
    """A tool the model may call: ``fn(**arguments)`` returns the answer text (sync functions run
    in a worker thread, coroutine functions on the event loop) or raises :class:`ToolError`."""

    name: str
    description: str
    parameters: Dict[str, Any]
    """JSON schema of the arguments (``{"type": "object", "properties": ..., "required": [...]}``)."""
    fn: Callable[..., Union[str, Awaitable[str]]]

    @property
    def definition(self) -> Dict[str, Any]:
        """The OpenAI/HF function definition that chat templates render into the prompt."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}

    def check_arguments(self, arguments: Dict[str, Any]) -> None:
        """Refuse missing, unexpected or wrongly typed arguments with a message for the model (the
        simple JSON types only: a tool checks richer constraints itself)."""
        properties = self.parameters.get("properties", {})
        missing = [k for k in self.parameters.get("required", []) if k not in arguments]
        if missing:
            raise ToolError(f"missing argument {missing[0]!r}; {self.name} takes: {', '.join(properties)}")
        for key, value in arguments.items():
            if key not in properties:
                raise ToolError(f"unexpected argument {key!r}; {self.name} takes: {', '.join(properties)}")
            expected = properties[key].get("type")
            if expected in _JSON_TYPES and not _JSON_TYPES[expected](value):
                raise ToolError(f"argument {key!r} must be of type {expected}, got {type(value).__name__}")


_JSON_TYPES: Dict[str, Callable[[Any], bool]] = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
}

# ----------------------------------------------------------------------------------------------
# Calculator

MAX_EXPRESSION_CHARS = 256
MAX_MAGNITUDE = 1e100
"""No value (operand, intermediate or result) may exceed this: it bounds the size of the ints
Python computes with, so ``9**9**9`` is refused before it takes minutes."""

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}


def _bounded(value: Union[int, float]) -> Union[int, float]:
    if isinstance(value, float) and not math.isfinite(value):
        raise ToolError("result out of range")
    if abs(value) > MAX_MAGNITUDE:
        raise ToolError(f"result out of range (limit {MAX_MAGNITUDE:g})")
    return value


def _evaluate(node: ast.AST) -> Union[int, float]:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(left) > 1 and right * math.log10(abs(left)) > math.log10(MAX_MAGNITUDE):
            raise ToolError(f"result out of range (limit {MAX_MAGNITUDE:g})")
        try:
            result = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise ToolError("division by zero") from None
        except OverflowError:
            raise ToolError("result out of range") from None
        if isinstance(result, complex):  # a negative number to a fractional power
            raise ToolError("the result is not a real number")
        return _bounded(result)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitXor):
        raise ToolError("'^' is not a power here: use **")
    raise ToolError(f"unsupported syntax at column {getattr(node, 'col_offset', 0) + 1}: numbers, "
                    f"+ - * / // % ** and parentheses only")


def format_number(value: Union[int, float]) -> str:
    """An integral value as an integer ("1776", not "1776.0"); others to 12 significant digits."""
    if isinstance(value, int):
        return str(value)
    if value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return format(value, ".12g")


def calculator(expression: str) -> str:
    """The value of an arithmetic expression: ints and floats, + - * / // % **, unary minus and
    parentheses. Errors (syntax, division by zero, out-of-range values) raise :class:`ToolError`."""
    if not isinstance(expression, str) or not expression.strip():
        raise ToolError("empty expression")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ToolError(f"expression too long ({len(expression)} chars; limit {MAX_EXPRESSION_CHARS})")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as err:
        raise ToolError(f"invalid expression at column {err.offset or 0}: {err.msg}") from None
    return format_number(_evaluate(tree.body))


CALCULATOR = Tool(
    name="calculator",
    description="Evaluate an arithmetic expression (+ - * / // % **, parentheses) and return its value.",
    parameters={"type": "object",
                "properties": {"expression": {"type": "string", "description": "e.g. (17 + 4) * 3"}},
                "required": ["expression"]},
    fn=calculator,
)

# ----------------------------------------------------------------------------------------------
# Sandboxed Python


@dataclass
class SandboxLimits:
    """Limits of one :func:`run_python` call."""

    timeout_s: float = 10.0
    """Wall-clock limit of the code's run, from its start (the interpreter's start-up and the
    confinement before it are not counted); past it the whole process group is killed (SIGKILL)."""
    cpu_s: Optional[int] = None
    """CPU-time limit (RLIMIT_CPU); None: ``ceil(timeout_s)``."""
    memory_mb: int = 512
    """Address-space limit (RLIMIT_AS) in MiB; an allocation past it raises MemoryError."""
    max_file_mb: int = 16
    """Largest file the code may write (RLIMIT_FSIZE), stdout and stderr included; a write past
    it fails with OSError (EFBIG: Python ignores SIGXFSZ)."""
    max_open_files: int = 64
    """RLIMIT_NOFILE."""
    max_output_chars: int = 8192
    """stdout and stderr are each cut to this many characters in the result."""
    confined: bool = True
    """The code must run confined (its own user, network and mount namespaces, seeing only its
    directory and a read-only Python runtime): where the kernel refuses, the call fails. False
    (``rollout.sandbox=unconfined``): confined where possible, else with only the network
    namespace (where allowed), the audit hook and the limits: it can then read what the trainer can."""

    def __post_init__(self) -> None:
        if not (isinstance(self.timeout_s, (int, float)) and self.timeout_s > 0):
            raise ValueError(f"sandbox timeout_s={self.timeout_s!r} must be a positive number of seconds")
        if self.cpu_s is None:
            self.cpu_s = math.ceil(self.timeout_s)
        for name, low in (("cpu_s", 1), ("memory_mb", 32), ("max_file_mb", 1), ("max_open_files", 16),
                          ("max_output_chars", 1)):
            value = getattr(self, name)
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= low):
                raise ValueError(f"sandbox {name}={value!r} must be an integer >= {low}")


@dataclass
class ToolResult:
    """What a :func:`run_python` call did. ``error`` is None for a clean exit, else why it failed."""

    stdout: str
    stderr: str
    exit_code: Optional[int]
    """The process's exit status; negative: killed by that signal; None: never started."""
    error: Optional[str]
    seconds: float
    netns: bool = False
    """The code ran in its own (empty) network namespace (where user namespaces are allowed)."""
    confined: bool = False
    """The code ran in its own mount namespace, seeing only its directory and the runtime."""

    def format(self) -> str:
        """The text the model reads: stdout, then stderr and the error, each marked."""
        parts = [self.stdout] if self.stdout else []
        if self.stderr:
            parts.append(f"[stderr]\n{self.stderr}")
        if self.error:
            parts.append(f"[error] {self.error}")
        return "\n".join(p.rstrip("\n") for p in parts) if parts else "(no output)"


SANDBOX_PACKAGES = ("numpy",)
# The interpreter's start-up and the confinement (namespaces, mounts) before the user's code runs:
# milliseconds on a quiet node, seconds on one loaded far past its cores. ``timeout_s`` counts from
# the code's start, so a loaded node does not fail correct code; this bounds the start-up itself.
SANDBOX_START_S = 60.0
"""The third-party packages the sandboxed code may import (those installed): of the interpreter's
site directories, only their directories are mounted in its root, beside the standard library."""

_SITE_DIRS = ("site-packages", "dist-packages")

# Run once per process, with the sandbox's interpreter and flags: what the confined root must hold.
# It loads (dlopen, without initialising) every extension module of the standard library and of
# the packages, so that the shared libraries they need show up in /proc/self/maps.
_RUNTIME_PROBE = r'''
import ctypes, importlib.machinery, importlib.util, json, os, sys

def shared_objects():
    with open("/proc/self/maps") as f:
        fields = [line.rstrip("\n").split(None, 5) for line in f]
    return {f[5] for f in fields if len(f) == 6 and f[5].startswith("/") and ".so" in os.path.basename(f[5])}

before = shared_objects()
stdlib = os.path.dirname(os.__file__)
packages = {}
for name in json.loads(sys.argv[1]):
    spec = importlib.util.find_spec(name)
    if spec is not None and spec.submodule_search_locations:
        packages[name] = list(spec.submodule_search_locations)
extension_dirs = [p for p in sys.path if p.startswith(stdlib + "/") and os.path.basename(p) not in ("site-packages",
                  "dist-packages")] + [d for dirs in packages.values() for d in dirs]
for top in extension_dirs:
    for where, _, files in os.walk(top):
        for name in files:
            if name.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES)):
                try:
                    ctypes.CDLL(os.path.join(where, name))
                except OSError:  # its libraries are not installed (e.g. _tkinter): no import can load it
                    pass
print(json.dumps({"stdlib": stdlib, "sys_path": sys.path, "packages": packages,
                  "libraries": sorted(shared_objects() - before)}))
'''


def _under(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent.rstrip("/") + "/")


@dataclass(frozen=True)
class _Runtime:
    """What the confined root holds besides the working directory (see :func:`run_python`)."""

    mounts: Tuple[Tuple[str, str], ...]
    """(kind, path), parents first: ``ro`` a read-only bind of the host's directory at the same
    path, ``empty`` an empty read-only tmpfs over a site directory a ``ro`` mount shows, ``dev`` a
    device node, ``proc`` this process's own /proc/self/fd or /proc/self/ns."""
    listable: Tuple[str, ...]
    """The directories on sys.path that are the tmpfs's own (the others may be crossed, not listed)."""
    packages: Tuple[str, ...]
    """Those of :data:`SANDBOX_PACKAGES` that are installed."""


def _runtime_plan(probe: Dict[str, Any]) -> _Runtime:
    """The mounts of the confined root from what :data:`_RUNTIME_PROBE` found: the standard library
    (with lib-dynload), the packages' directories, and the directories of the shared libraries they
    load that the interpreter had not (so not libpython, already mapped), each once."""
    stdlib, sys_path = probe["stdlib"], [p for p in probe["sys_path"] if p.startswith("/")]

    def as_imported(path: str) -> str:  # a real path (from the maps) as sys.path names it
        for entry in sys_path:
            real = os.path.realpath(entry)
            if real != entry and _under(path, real):
                return entry + path[len(real):]
        return path

    binds = {stdlib} | {d for dirs in probe["packages"].values() for d in dirs}
    binds |= {as_imported(os.path.dirname(lib)) for lib in probe["libraries"]}
    assert "/" not in binds, "the sandbox would mount the host's whole root"
    # a site directory that a bind shows (e.g. the base interpreter's, inside its stdlib) is hidden
    empty = {d for d in (*sys_path, os.path.join(stdlib, "site-packages"))
             if os.path.basename(d) in _SITE_DIRS and os.path.isdir(d) and any(_under(d, b) and d != b for b in binds)}

    def shown(path: str) -> bool:  # through another bind, and not hidden by an empty mount
        return any(_under(path, b) and path != b and not any(_under(path, e) and _under(e, b) for e in empty)
                   for b in binds)

    mounts = [("ro", d) for d in binds if not shown(d)] + [("empty", d) for d in empty]
    mounts += [("dev", "/dev/null"), ("dev", "/dev/zero"), ("dev", "/dev/urandom"),
               ("proc", "/proc/self/fd"), ("proc", "/proc/self/ns")]
    listable = [d for d in sys_path if os.path.isdir(d) and not any(_under(d, p) for k, p in mounts if k == "ro")]
    return _Runtime(tuple(sorted(mounts, key=lambda m: m[1])), tuple(listable), tuple(probe["packages"]))


@functools.lru_cache(maxsize=None)
def _runtime() -> Tuple[Optional[_Runtime], Optional[str]]:
    """The confined root's runtime (probed once per process), or why it could not be found."""
    try:
        out = subprocess.run([sys.executable, "-I", "-c", _RUNTIME_PROBE, json.dumps(SANDBOX_PACKAGES)],
                             capture_output=True, text=True, timeout=120, env={"PATH": "/usr/bin:/bin"}, check=True)
        return _runtime_plan(json.loads(out.stdout)), None
    except (OSError, subprocess.SubprocessError, ValueError, KeyError) as err:
        stderr = getattr(err, "stderr", None) or ""
        return None, f"cannot find the Python runtime to mount: {type(err).__name__}: {err} {stderr[-300:]}".strip()


# Runs in the child before the user's code, with ``-I`` (isolated mode: no PYTHON* variables,
# no user site, the script's directory not on sys.path). Order matters: the code is read while the
# host is visible, then the limits, then the namespaces and the confined root (ctypes, and the
# capabilities the new user namespace grants, dropped once the root is built), then the audit hook,
# which from then on refuses ctypes calls.
_BOOTSTRAP = r'''
def _make_hook(root):
    # The hook's state lives in this finished frame's cells, reachable only through the hook, which
    # Python cannot list; it calls only C functions bound here, so patching a module (posixpath,
    # os, builtins) from the user's code cannot change what it checks.
    import posix, stat
    lstat, readlink, getcwd, fspath, is_link = posix.lstat, posix.readlink, posix.getcwd, posix.fspath, stat.S_ISLNK
    refuse, is_a, str_, bytes_, int_ = PermissionError, isinstance, str, bytes, int
    write_flags = posix.O_WRONLY | posix.O_RDWR | posix.O_CREAT | posix.O_TRUNC | posix.O_APPEND
    refused_prefixes = ("socket.", "ctypes.", "subprocess.", "os.exec", "os.spawn", "os.posix_spawn",
                        "os.fork", "os.system", "os.kill", "os.startfile", "pty.", "signal.pthread_kill",
                        "gc.get_", "sys._current_frames", "os.unshare", "os.setns")  # the last two: 3.12+

    def resolve(path, dir_fd):
        # os.path.realpath, on C functions only: the symbolic links are followed, a missing
        # component is taken as it is
        if is_a(path, int_):
            return readlink(f"/proc/self/fd/{path}")
        path = fspath(path)
        if is_a(path, bytes_):
            path = path.decode("utf-8", "surrogateescape")
        # the audit events pass -1 (or AT_FDCWD) for "no dir_fd"
        base = readlink(f"/proc/self/fd/{dir_fd}") if dir_fd is not None and dir_fd >= 0 else getcwd()
        pending = (path if path.startswith("/") else base + "/" + path).split("/")[::-1]
        parts, links = [], 0
        while pending:
            part = pending.pop()
            if part in ("", "."):
                continue
            if part == "..":
                if parts:
                    parts.pop()
                continue
            here = "/" + "/".join(parts + [part])
            try:
                mode = lstat(here).st_mode
            except OSError:
                mode = 0
            if is_link(mode):
                links += 1
                if links > 40:
                    raise OSError("too many levels of symbolic links")
                target = readlink(here)
                if target.startswith("/"):
                    parts = []
                pending.extend(target.split("/")[::-1])
            else:
                parts.append(part)
        return "/" + "/".join(parts)

    def inside(event, path, dir_fd=None):
        try:
            real = resolve(path, dir_fd)
        except (OSError, TypeError, ValueError):
            raise refuse(f"sandbox: {event} {path!r}: cannot resolve the path") from None
        if real != root and not real.startswith(root + "/") and real != "/dev/null":
            raise refuse(f"sandbox: {event} {path!r}: outside the sandbox directory")

    def hook(event, args):
        # ``import ctypes`` opens the main program (numpy needs that); any other library, foreign
        # call or raw memory access is refused.
        if event.startswith(refused_prefixes) and not (event == "ctypes.dlopen" and args[0] is None):
            raise refuse(f"sandbox: {event} is not allowed")
        if event == "import" and args[0] == "_posixsubprocess":  # its fork_exec raises no audit event
            raise refuse(f"sandbox: importing {args[0]} is not allowed")
        if event == "open":
            path, mode, flags = args
            writing = (is_a(mode, str_) and ("w" in mode or "a" in mode or "x" in mode or "+" in mode)) \
                or (flags or 0) & write_flags
            if writing and path is not None and not is_a(path, int_):  # an open fd was checked as it was opened
                inside("writing", path)
        elif event in ("os.remove", "os.rmdir"):
            inside("removing", args[0], args[1])
        elif event == "os.mkdir":
            inside("creating", args[0], args[2])
        elif event in ("os.chmod", "os.utime"):
            inside("changing", args[0], args[-1])
        elif event == "os.chown":
            inside("changing", args[0], args[3])
        elif event in ("os.truncate", "os.setxattr", "os.removexattr"):
            inside("changing", args[0])
        elif event in ("os.rename", "os.link"):
            inside("moving" if event == "os.rename" else "linking", args[0], args[2])
            inside("moving" if event == "os.rename" else "linking", args[1], args[3])
        elif event == "os.symlink":
            inside("linking", args[1], args[2])

    return hook


def _build_root(libc, check, cfg):
    # In the new user and mount namespaces: map this uid and gid to themselves, build the root on
    # a tmpfs (cfg["mounts"], parents first), pivot into it and detach the host's root, so that no
    # path leads back to it. The tmpfs's own directories (the parents of the mount points) may be
    # crossed but not listed, except those on sys.path (the import system lists them).
    import os
    MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC = 1, 2, 4, 8, 32, 4096, 16384
    MS_NOATIME, MS_NODIRATIME, MS_PRIVATE, MS_RELATIME, MS_STRICTATIME = 1024, 2048, 1 << 18, 1 << 21, 1 << 24
    MNT_DETACH = 2

    def locked(path):
        # the flags of the mount holding path that a user namespace may not change (the kernel
        # locks them): a remount must repeat them (statvfs's ST_* bits are MS_*'s, but relatime)
        st = os.statvfs(path).f_flag
        atime = MS_RELATIME if st & os.ST_RELATIME else 0 if st & os.ST_NOATIME else MS_STRICTATIME
        return st & (MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_NOATIME | MS_NODIRATIME) | atime

    pivot_root = {"x86_64": 155, "aarch64": 41}.get(os.uname().machine)
    if pivot_root is None:
        raise OSError(f"pivot_root: no system call number for {os.uname().machine}")

    def mount(source, target, fstype, flags, data=None):
        enc = lambda text: None if text is None else text.encode()
        check(libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)), f"mount {source or ''} {target}")

    for name, line in (("setgroups", "deny"), ("uid_map", f"{cfg['uid']} {cfg['uid']} 1"),
                       ("gid_map", f"{cfg['gid']} {cfg['gid']} 1")):
        fd = os.open(f"/proc/self/{name}", os.O_WRONLY)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)
    mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing done here propagates to the host
    new, listable = cfg["new_root"], set(cfg["listable"])
    mount("tmpfs", new, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "mode=0111,size=64k,nr_inodes=1024")
    read_only = [new]

    def make_dirs(path):
        here = new
        for part in path.strip("/").split("/"):
            here += "/" + part
            if not os.path.lexists(here):
                os.mkdir(here, 0o555 if here[len(new):] in listable else 0o111)
        return here

    for kind, path in cfg["mounts"]:
        if kind == "empty":  # hides the other packages of a site directory that a runtime mount shows
            mount("tmpfs", new + path, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "mode=0555,size=4k,nr_inodes=64")
            read_only.append(new + path)
        elif kind == "dev":  # the host's device node (a user namespace's own mounts ignore devices)
            make_dirs(os.path.dirname(path))
            os.close(os.open(new + path, os.O_WRONLY | os.O_CREAT, 0o444))
            mount(path, new + path, None, MS_BIND)
        elif kind == "proc":  # this process's own entry only: no other process is visible
            mount(f"/proc/{os.getpid()}/{os.path.basename(path)}", make_dirs(path), None, MS_BIND)
        else:  # "ro" (the runtime) or "rw" (the working directory, where nothing may be executed)
            target = make_dirs(path)
            mount(path, target, None, MS_BIND | MS_REC)
            flags = MS_RDONLY | MS_NOSUID | MS_NODEV if kind == "ro" else MS_NOSUID | MS_NODEV | MS_NOEXEC
            mount(None, target, None, MS_REMOUNT | MS_BIND | flags | locked(path))
    for target in reversed(read_only):
        mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC)
    os.chdir(new)
    check(libc.syscall(pivot_root, b".", b"."), "pivot_root")
    check(libc.umount2(b".", MNT_DETACH), "umount the host's root")
    os.chdir(cfg["work"])


def _isolate(cfg):
    # Returns (netns, why): the code is in its own network namespace; why it is not confined
    # (None: it is). Whatever happened, the capabilities of a new user namespace are dropped and
    # no_new_privs is set: the code cannot mount, unmount or remount anything.
    import ctypes, os
    CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWNET = 0x00020000, 0x10000000, 0x40000000
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = (ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p)

    def check(result, what):
        if result != 0:
            errno = ctypes.get_errno()
            raise OSError(f"{what}: {os.strerror(errno)}")

    netns, why = False, cfg["plan_error"]
    try:
        if why is None:
            try:
                check(libc.unshare(CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWNS), "unshare")
                netns = True
                _build_root(libc, check, cfg)
            except OSError as err:
                why = str(err)
        if not netns and not cfg["confined"]:
            netns = libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) == 0
        header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this thread
        check(libc.capset(header, (ctypes.c_uint32 * 6)()), "capset")  # no effective, permitted, inheritable
        check(libc.prctl(38, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
    except OSError as err:
        why = why or str(err)
    return netns, why


def _sandbox():
    import importlib, json, os, resource, sys, traceback, linecache
    cfg = json.loads(sys.argv[1])
    with open(cfg["code_path"], encoding="utf-8") as f:  # outside the working directory: hidden below
        source = f.read()
    resource.setrlimit(resource.RLIMIT_CPU, (cfg["cpu_s"], cfg["cpu_s"] + 1))
    resource.setrlimit(resource.RLIMIT_AS, (cfg["memory"], cfg["memory"]))
    resource.setrlimit(resource.RLIMIT_FSIZE, (cfg["fsize"], cfg["fsize"]))
    resource.setrlimit(resource.RLIMIT_NOFILE, (cfg["nofile"], cfg["nofile"]))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    # No new processes (nor threads) from native code, for an unprivileged user: the kernel
    # exempts root; the audit hook refuses fork/exec from Python in any case.
    resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))
    netns, why = _isolate(cfg)
    os.write(cfg["status_fd"], json.dumps({"netns": netns, "confined": why is None}).encode())
    os.close(cfg["status_fd"])
    if why is not None and cfg["confined"]:
        print(f"sandbox: cannot confine the code ({why})", file=sys.stderr)
        sys.exit(1)
    importlib.invalidate_caches()  # the import system's listings of the host's directories

    code = compile(source, "main.py", "exec")
    linecache.cache["main.py"] = (len(source), None, source.splitlines(True), "main.py")
    sys.argv = ["main.py"]
    sys.addaudithook(_make_hook(os.path.realpath(os.getcwd())))
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    del cfg, f, source
    try:
        exec(code, namespace)
    except SystemExit:
        raise
    except BaseException as err:  # the user's error, printed without this bootstrap's frame
        traceback.print_exception(type(err), err, err.__traceback__.tb_next)
        sys.exit(1)
_sandbox()
'''


def _read_head(path: str, limit: int) -> str:
    with open(path, "rb") as f:
        data = f.read(4 * limit + 4)
    text = data.decode("utf-8", errors="replace")
    if len(text) > limit or os.path.getsize(path) > len(data):
        return text[:limit] + f"\n... (output cut at {limit} characters)"
    return text


def _read_status(fd: int, deadline: float) -> Optional[bytes]:
    """The child's status (its bootstrap writes it, then closes the pipe, just before the user's
    code runs; nothing if it died first), or None if ``deadline`` passes before the pipe closes."""
    data = b""
    while True:
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            return None
        chunk = os.read(fd, 4096)
        if not chunk:
            return data
        data += chunk


def _wait_unreaped(pid: int, deadline: float) -> bool:
    """Wait until ``pid`` exits, leaving it a zombie (so that its process-group id stays taken
    until the group is killed); False if ``deadline`` passes first."""
    pause = 0.001
    while True:
        status = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        if status is not None:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(min(pause, max(deadline - time.monotonic(), 0.0)))
        pause = min(pause * 2, 0.02)


def run_python(code: str, limits: Optional[SandboxLimits] = None) -> ToolResult:
    """Run ``code`` in a sandboxed Python subprocess and report what it printed and how it ended.

    What it does: a fresh temporary directory is the cwd (and HOME, TMPDIR), removed afterwards;
    the child is ``sys.executable -I`` with a minimal environment, in its own session and process
    group, with RLIMIT_CPU/AS/FSIZE/NOFILE/NPROC set; ``timeout_s`` after the code starts (start-up
    and confinement are not counted, up to :data:`SANDBOX_START_S`) the process group is
    SIGKILLed and reaped, and it is killed in any case once the leader exits, so nothing is left
    running. It installs an audit hook (which Python cannot remove) refusing sockets, ctypes,
    subprocesses, fork/exec, signals to other processes, and writes, renames, removals or links
    whose path resolves outside its directory.

    Confinement (``limits.confined``; where the kernel allows unprivileged user namespaces): before
    the user's code, the child enters new user, network (no interface but a down loopback) and
    mount namespaces and pivots into a root built on an empty tmpfs, holding, at the host's paths:

    - read-only: the standard library (with lib-dynload), the directories of the installed
      :data:`SANDBOX_PACKAGES` (e.g. ``numpy`` and ``numpy.libs``) and those of the shared
      libraries they and lib-dynload load (found in /proc/self/maps of a probe that loads them all
      once per process, not guessed): what ``import`` needs, not the venv's other packages, the
      project or its run directories; a site directory those mounts show (the base interpreter's
      site-packages inside its stdlib) is covered by an empty tmpfs;
    - /dev/null, /dev/zero, /dev/urandom (the host's device nodes);
    - /proc/self/fd and /proc/self/ns of this process only (the audit hook resolves fds there);
      no procfs is mounted, so no other process is visible (that would take a PID namespace);
    - the working directory, read-write, nosuid, nodev and noexec (a library the code writes
      there cannot be loaded).

    The tmpfs's own directories (the parents of those mount points) may be crossed but not
    listed, except those on sys.path; the tmpfs is then read-only and the host's root is
    detached, so no path leads back to it (/etc, /root, the project, checkpoints). The
    capabilities the user namespace grants are dropped and no_new_privs set before the hook
    locks ctypes: the code can neither mount nor unmount anything, and Python offers no mount
    call of its own. Where the kernel refuses the namespaces, a confined call fails ("cannot
    confine the code"); an unconfined one runs with the network namespace where allowed, and can
    read whatever the trainer can. :func:`confinement_error` says up front which of the two a
    machine gets.

    What it does not: it is a guard against misbehaving model code on a training node, not a
    hardened boundary: a native exploit (a crafted code object, a C extension's bug) escapes the
    audit hook, and then runs with the trainer's uid without capabilities, in the confined root;
    without a PID namespace it may signal the trainer's processes; without user namespaces an
    escaped process keeps the network and, for root, ignores RLIMIT_NPROC.

    Every outcome of the user's code (exception, refused operation, timeout, memory or CPU limit)
    is a :class:`ToolResult` with ``error`` set; only bad ``limits`` raise.
    """
    limits = limits or SandboxLimits()
    root = tempfile.mkdtemp(prefix="megarl-sandbox-")
    work = os.path.join(root, "work")
    os.mkdir(work)
    code_path, out_path, err_path = (os.path.join(root, n) for n in ("main.py", "stdout", "stderr"))
    with open(code_path, "w", encoding="utf-8") as f:
        f.write(code)
    new_root = os.path.join(root, "root")
    os.mkdir(new_root)
    runtime, plan_error = _runtime()
    mounts = sorted((*runtime.mounts, ("rw", work)), key=lambda m: m[1]) if runtime else []
    status_read, status_write = os.pipe()
    cfg = {"cpu_s": limits.cpu_s, "memory": limits.memory_mb << 20, "fsize": limits.max_file_mb << 20,
           "nofile": limits.max_open_files, "code_path": code_path, "status_fd": status_write,
           "confined": limits.confined, "plan_error": plan_error, "mounts": mounts,
           "listable": runtime.listable if runtime else [], "new_root": new_root, "work": work,
           "uid": os.getuid(), "gid": os.getgid()}
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": work, "TMPDIR": work,
           # numerical libraries would start a thread pool, which RLIMIT_NPROC forbids
           "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    start = time.monotonic()
    proc = None
    try:
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            proc = subprocess.Popen([sys.executable, "-I", "-c", _BOOTSTRAP, json.dumps(cfg)], cwd=work, env=env,
                                    stdin=subprocess.DEVNULL, stdout=out, stderr=err, start_new_session=True,
                                    pass_fds=(status_write,))
        os.close(status_write)
        status_write = -1
        status_bytes = _read_status(status_read, start + SANDBOX_START_S)  # written just before the code runs
        exited = status_bytes is not None and _wait_unreaped(proc.pid, time.monotonic() + limits.timeout_s)
        try:  # the whole group: a process that escaped the hook dies with it
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
        seconds = time.monotonic() - start
        os.close(status_read)
        status_read = -1
        status = json.loads(status_bytes or b"{}")  # empty: the child died before it wrote it
        stdout = _read_head(out_path, limits.max_output_chars)
        stderr = _read_head(err_path, limits.max_output_chars)
    finally:
        if proc is not None and proc.returncode is None:  # interrupted (e.g. KeyboardInterrupt): still kill it
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for fd in (status_read, status_write):
            if fd >= 0:
                os.close(fd)
        shutil.rmtree(root, ignore_errors=True)
    return ToolResult(stdout, stderr, proc.returncode, _diagnose(exited, proc.returncode, stderr, limits, status_bytes is not None), seconds,
                      status.get("netns", False), status.get("confined", False))


def confinement_error() -> Optional[str]:
    """Why :func:`run_python` cannot confine code on this machine (the kernel refuses user or
    mount namespaces, or the confined root lacks what the packages import), or None when it can:
    one confined call that imports the installed :data:`SANDBOX_PACKAGES` (about 0.3 s)."""
    runtime, error = _runtime()
    if runtime is None:
        return error
    result = run_python("".join(f"import {name}\n" for name in runtime.packages), SandboxLimits(timeout_s=60))
    if result.error is None and result.confined:
        return None
    return result.error or "the code ran unconfined"


def _diagnose(exited: bool, returncode: int, stderr: str, limits: SandboxLimits, started: bool) -> Optional[str]:
    if not started:
        return f"the sandbox did not start within {SANDBOX_START_S:g} s (killed)"
    if not exited:
        return f"timed out after {limits.timeout_s:g} s (killed)"
    if returncode == 0:
        return None
    if returncode == -signal.SIGXCPU:
        return f"CPU time limit of {limits.cpu_s} s exceeded (killed)"
    if returncode < 0:
        return f"killed by signal {signal.Signals(-returncode).name}"
    last = next((line for line in reversed(stderr.splitlines()) if line.strip()), "")
    if last.startswith("MemoryError"):
        return f"memory limit of {limits.memory_mb} MiB exceeded (MemoryError)"
    if "sandbox: " in last:
        return "refused by the sandbox: " + last.split("sandbox: ", 1)[1]
    return last or f"exit code {returncode}"


def python_tool(limits: Optional[SandboxLimits] = None) -> Tool:
    """The sandboxed runner as a tool: the answer is the output; a failure raises
    :class:`ToolError` with the output and the reason."""
    limits = limits or SandboxLimits()

    def python(code: str) -> str:
        result = run_python(code, limits)
        if result.error is not None:
            raise ToolError(result.format())
        return result.format()

    return Tool(
        name="python",
        description=(f"Run a Python 3 program and return what it prints (stdout, stderr). No network; files only "
                     f"in its working directory; limits: {limits.timeout_s:g} s, {limits.memory_mb} MiB."),
        parameters={"type": "object",
                    "properties": {"code": {"type": "string", "description": "the program; print the results"}},
                    "required": ["code"]},
        fn=python,
    )
