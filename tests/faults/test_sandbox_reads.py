"""The Python tool's code sees only itself (issue 25, item 7): confined, it cannot read the host
(/etc, /root, the project, a run directory, other processes' /proc entries) while numpy and its
own directory still work; on a kernel without user namespaces, ``rollout.env=python`` refuses to
start unless ``rollout.sandbox=unconfined``."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from megarl.agent import envs, tools
from megarl.agent.tools import SandboxLimits, ToolResult, confinement_error, run_python
from megarl.config import ConfigError, MegarlConfig, load_config
from megarl.config.schema import RolloutConfig
from megarl.agent.validate import check_agent
from megarl.entrypoints.train_rl import prepare

REPO = Path(__file__).resolve().parents[2]
LIMITS = SandboxLimits(timeout_s=20, memory_mb=256)
NO_NAMESPACES = "unshare: Operation not permitted"


@pytest.fixture(scope="module")
def confined():
    why = confinement_error()
    # never skipped: a machine that cannot confine is one where rollout.env=python refuses to start
    assert why is None, f"this machine cannot confine code ({why}): the sandbox's read cases cannot run here"


def test_the_code_cannot_read_the_host(confined, tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "checkpoints" / "manifest.json").write_text("{}")
    files = [p for p in ("/etc/hostname", "/etc/passwd", "/etc/shadow") if os.path.exists(p)]
    files += [str(REPO / "setup.py"), str(Path(__file__).resolve()), str(run_dir / "checkpoints" / "manifest.json"),
              "/proc/1/environ", f"/proc/{os.getpid()}/cmdline", f"/proc/{os.getppid()}/environ"]
    listings = ["/", "/root", "/etc", "/proc", str(REPO), str(run_dir), str(tmp_path)]
    for path in files + listings:  # what the code is denied exists for the trainer
        assert os.path.exists(path), path
    code = (f"import json, os\nresult = {{}}\n"
            f"for path in {files!r}:\n"
            f"    try:\n        open(path, 'rb').read(1); result[path] = 'read'\n"
            f"    except OSError as err:\n        result[path] = type(err).__name__\n"
            f"for path in {listings!r}:\n"
            f"    try:\n        os.listdir(path); result[path] = 'listed'\n"
            f"    except OSError as err:\n        result[path] = type(err).__name__\n"
            f"try:\n    import megarl; result['import megarl'] = 'imported'\n"
            f"except ImportError as err:\n    result['import megarl'] = type(err).__name__\n"
            f"print(json.dumps(result))")
    result = run_python(code, LIMITS)
    assert result.error is None and result.confined and result.netns, result.stderr
    outcomes = json.loads(result.stdout)
    leaked = {path: how for path, how in outcomes.items() if how in ("read", "listed", "imported")}
    assert not leaked, f"the sandboxed code reached the host: {leaked}"
    assert set(outcomes) == {*files, *listings, "import megarl"}


def test_numpy_and_its_own_directory_still_work(confined):
    code = ("import os, shutil, numpy\n"
            "a = numpy.array([[2.0, 1.0], [1.0, 3.0]]); x = numpy.linalg.solve(a, [3.0, 5.0])\n"
            "os.makedirs('d/e'); open('d/e/f.txt', 'w').write('kept')\n"
            "print(open('d/e/f.txt').read(), sorted(os.listdir('.')), numpy.round(x, 6).tolist())\n"
            "shutil.rmtree('d')  # its fd-relative removals are resolved through /proc/self/fd\n"
            "print(os.listdir('.'), open('/dev/urandom', 'rb').read(4) != b'', open('/dev/null', 'w').write('x'))")
    result = run_python(code, LIMITS)
    assert result.error is None and result.confined, result.stderr
    assert result.stdout.splitlines() == ["kept ['d'] [0.8, 1.4]", "[] True 1"]


def test_a_library_the_code_writes_cannot_be_loaded(confined):
    # its directory is noexec: native code of its own would escape the audit hook
    code = ("import importlib.machinery, importlib.util, shutil, _json\n"
            "copy = 'mod' + importlib.machinery.EXTENSION_SUFFIXES[0]\n"
            "shutil.copy(_json.__file__, copy)\n"
            "importlib.util.module_from_spec(importlib.util.spec_from_file_location('_json', copy))")
    result = run_python(code, LIMITS)
    assert result.error.startswith("ImportError") and "failed to map segment" in result.error, result.error


def test_past_the_audit_hook_the_root_stays_read_only_and_mounts_are_refused(confined, tmp_path):
    """What native code would find if it escaped the hook: the confined root built as for a call,
    no hook, then ctypes: no capability to mount, unmount or remount, even from a nested user
    namespace, and a read-only runtime."""
    runtime, _ = tools._runtime()
    work, new_root = tmp_path / "work", tmp_path / "root"
    work.mkdir(), new_root.mkdir()
    cfg = {"confined": True, "plan_error": None, "mounts": sorted((*runtime.mounts, ("rw", str(work))),
                                                                  key=lambda m: m[1]),
           "listable": runtime.listable, "new_root": str(new_root), "work": str(work), "uid": os.getuid(),
           "gid": os.getgid()}
    stdlib = next(path for kind, path in runtime.mounts if kind == "ro" and path == os.path.dirname(os.__file__))
    probe = tools._BOOTSTRAP.rsplit("def _sandbox():", 1)[0] + f"""
import ctypes, json, os, sys
print(_isolate(json.loads(sys.argv[1])))
libc = ctypes.CDLL(None, use_errno=True)
def errno(result):
    return os.strerror(ctypes.get_errno()) if result != 0 else "succeeded"
print(errno(libc.mount(b"none", b"/", b"tmpfs", 0, None)))
print(errno(libc.umount2({stdlib!r}.encode(), 2)))
try:
    open({stdlib!r} + "/x.py", "w")
except OSError as err:
    print(err.strerror)
print(errno(libc.unshare(0x10000000 | 0x00020000)))  # a nested user and mount namespace: its own capabilities
print(errno(libc.mount(None, {stdlib!r}.encode(), None, 32 | 4096, None)))  # MS_REMOUNT | MS_BIND, not read-only
print(errno(libc.mount(b"proc", b"/proc", b"proc", 0, None)))
"""
    out = subprocess.run([sys.executable, "-I", "-c", probe, json.dumps(cfg)], cwd=work, capture_output=True,
                         text=True, timeout=60, env={"PATH": "/usr/bin:/bin"})
    assert out.stdout.splitlines() == ["(True, None)", "Operation not permitted", "Operation not permitted",
                                       "Read-only file system", "succeeded", "Operation not permitted",
                                       "Operation not permitted"], out.stderr


def test_without_user_namespaces_confined_fails_and_unconfined_runs(tmp_path):
    """A kernel that allows no user namespace, for real: a user namespace whose
    user.max_user_namespaces is 0 (so any further unshare(CLONE_NEWUSER) fails)."""
    assert shutil.which("unshare") is not None and subprocess.run(["unshare", "--user", "true"]).returncode == 0, \
        "no unshare(1) or no user namespaces to run the check in"
    script = ("import json, sys\n"
              "open('/proc/sys/user/max_user_namespaces', 'w').write('0')\n"
              "from megarl.agent.tools import SandboxLimits, confinement_error, run_python\n"
              "confined = run_python('print(1)', SandboxLimits(timeout_s=20))\n"
              "unconfined = run_python(f'import numpy; print(open({sys.argv[1]!r}).read())', "
              "SandboxLimits(timeout_s=20, confined=False))\n"
              "print(json.dumps([confinement_error(), confined.error, confined.stdout, unconfined.error, "
              "unconfined.stdout, unconfined.confined, unconfined.netns]))")
    secret = tmp_path / "secret.txt"
    secret.write_text("host file")
    out = subprocess.run(["unshare", "--user", "--map-root-user", sys.executable, "-c", script, str(secret)],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    why, error, stdout, unconfined_error, unconfined_stdout, unconfined_confined, netns = json.loads(out.stdout)
    assert why.startswith("refused by the sandbox: cannot confine the code (unshare: No space left on device")
    assert error == why and stdout == ""  # the user's code never ran
    assert unconfined_error is None and unconfined_stdout == "host file\n"  # what unconfined allows
    assert not unconfined_confined and not netns


def _cfg(**rollout) -> MegarlConfig:
    return MegarlConfig(rollout=RolloutConfig(env="python", **rollout))


ARGS = SimpleNamespace(max_position_embeddings=1 << 16)


def test_config_check_refuses_python_without_namespaces_unless_unconfined(monkeypatch, caplog):
    monkeypatch.setattr(envs, "confinement_error", lambda: NO_NAMESPACES)
    with pytest.raises(ConfigError) as err:
        check_agent(_cfg(), ARGS)
    assert str(err.value).startswith(f"rollout.env=python: this machine cannot confine the tool's code "
                                     f"({NO_NAMESPACES})")
    assert "rollout.sandbox=unconfined runs it anyway" in str(err.value)
    assert "can then read every file the trainer can" in str(err.value)
    with caplog.at_level(logging.WARNING, logger="megarl.agent.envs"):
        assert check_agent(_cfg(sandbox="unconfined"), ARGS)
    assert "rollout.sandbox=unconfined on a machine that cannot confine" in caplog.text
    with pytest.raises(ConfigError, match=r"rollout.sandbox='open' must be one of confined, unconfined"):
        check_agent(_cfg(sandbox="open"), ARGS)


def test_config_check_passes_where_the_code_is_confined(monkeypatch):
    monkeypatch.setattr(envs, "confinement_error", lambda: None)
    assert check_agent(_cfg(), ARGS)
    calls = []
    monkeypatch.setattr(envs, "confinement_error", lambda: calls.append(1))
    assert check_agent(MegarlConfig(rollout=RolloutConfig(env="calculator")), ARGS) and not calls  # no probe


def test_env_factory_passes_the_mode_to_the_tool(monkeypatch):
    seen = []
    monkeypatch.setattr(tools, "run_python", lambda code, limits: seen.append(limits.confined) or
                        ToolResult("", "", 0, None, 0.0))
    for sandbox in ("confined", "unconfined"):
        envs.env_factory("python", sandbox=sandbox)()._tools["python"].fn(code="pass")
    assert seen == [True, False]
    with pytest.raises(ValueError, match="rollout.sandbox='x' must be one of confined, unconfined"):
        envs.env_factory("python", sandbox="x")


def test_a_run_refuses_before_workers_start(monkeypatch):
    monkeypatch.setattr(envs, "confinement_error", lambda: NO_NAMESPACES)
    with pytest.raises(ConfigError, match=r"rollout\.sandbox=unconfined runs it anyway"):
        prepare(load_config(["configs/grpo_demo.yaml"], ["rollout.env=python"]))
    with pytest.raises(ConfigError, match=r"rollout\.sandbox='open' must be one of \('confined', 'unconfined'\)"):
        prepare(load_config(["configs/grpo_demo.yaml"], ["rollout.env=python", "rollout.sandbox=open"]))
