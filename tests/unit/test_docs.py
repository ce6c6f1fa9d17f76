"""The README and docs/ cannot drift from the code: docs/configuration.md is the generator's output;
every relative link (and its #anchor) exists; every config key written `section.field` in backticks
or as a `key=value` in a shown command exists in the schema; every command shown in a ```bash block
has a runner: run here (cheap `megarl` commands in this process, `megarl train` as its --dry-run),
a `make -n` dry run, or the test named for it (which must exist); repository paths the commands
use exist and are not git-ignored (a fresh clone has them)."""

from __future__ import annotations

import ast
import dataclasses
import enum
import py_compile
import re
import shlex
import subprocess
from pathlib import Path
from typing import List, Optional

from megarl.config import docs as config_docs

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SECTIONS = [f.name for f in dataclasses.fields(config_docs.MegarlConfig)]
KEYS = set(config_docs.keys())


def _text(page: Path) -> str:
    return page.read_text(encoding="utf-8")


# ---------------------------------------------------------------------------------------- config page

def test_configuration_page_is_the_generators_output():
    assert (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8") == config_docs.render(), (
        "docs/configuration.md is stale: run `python -m megarl.config.docs --write`")


def test_every_config_field_has_a_doc():
    assert config_docs.undocumented() == []


def test_enum_fields_render_their_allowed_values():
    class Mode(str, enum.Enum):
        FAST = "fast"
        SAFE = "safe"

    from typing import Optional as Opt

    assert config_docs.type_name(Mode) == "one of `fast`, `safe`"
    assert config_docs.type_name(Opt[Mode]) == "one of `fast`, `safe` or null"
    assert config_docs.type_name(List[str]) == "list of str"
    assert config_docs._render(Mode.SAFE) == "safe"


# ---------------------------------------------------------------------------------------- links

def _slug(heading: str) -> str:  # GitHub's anchor of a heading
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set:
    text = re.sub(r"```.*?```", "", _text(page), flags=re.S)
    return {_slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", text, flags=re.M)}


def test_relative_links_exist():
    bad = []
    for page in PAGES:
        text = re.sub(r"```.*?```", "", _text(page), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                bad.append(f"{page.name}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                bad.append(f"{page.name}: {target} (no such heading)")
    assert not bad, "\n".join(bad)


# ---------------------------------------------------------------------------------------- config keys

_KEY = re.compile(r"(?<![\w/.\-])((?:" + "|".join(SECTIONS) + r")(?:\.(?:\{[\w,]+\}|\*|\w+))+)")


def _expand(key: str) -> List[str]:
    match = re.search(r"\{([\w,]+)\}", key)
    if not match:
        return [key]
    return [k for part in match.group(1).split(",")
            for k in _expand(key[:match.start()] + part + key[match.end():])]


def config_keys(text: str) -> List[str]:
    """Keys named in backticks (prose and code blocks alike) and in shown commands."""
    spans = re.findall(r"`+([^`]+)`+", re.sub(r"```.*?```", "", text, flags=re.S))
    spans += [block for block in re.findall(r"```\w*\n(.*?)```", text, flags=re.S)]
    found = []
    for span in spans:
        for key in _KEY.findall(span):
            found += _expand(key.removesuffix(".*"))
    return found


def test_config_keys_named_in_the_docs_exist():
    unknown = sorted({f"{page.name}: {key}" for page in PAGES for key in config_keys(_text(page)) if key not in KEYS})
    assert not unknown, "\n".join(unknown)


def test_the_key_finder_sees_what_the_docs_write():
    text = "`trainer.hang_timeout_s` and `parallel.rollout.engine=sglang`, `trainer.offload.{params,grads}`, " \
           "`parallel.actor.*`, `rollout/logp_max_abs_diff`, `megarl/trainer/loop.py`\n```bash\n" \
           "megarl train x.yaml data.prompt_key=question\n```\n"
    assert config_keys(text) == ["trainer.hang_timeout_s", "parallel.rollout.engine", "trainer.offload.params",
                                 "trainer.offload.grads", "parallel.actor", "data.prompt_key"]


# ---------------------------------------------------------------------------------------- commands

def shown_commands(text: str) -> List[str]:
    """Every command line of the ```bash blocks: continuations joined, comments dropped."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"(^|\s)#.*$", "", line).strip()
            if line:
                commands.append(" ".join(line.split()))
    return commands


@dataclasses.dataclass
class Runner:
    pattern: str
    kind: str  # cli: run here; dry: `megarl train ... --dry-run` here; make: `make -n`; test: a named test;
    #             bootstrap: the install scripts/bootstrap.sh does; benchmark: a measured script (compiles)
    test: Optional[str] = None  # "tests/...py::name" that runs the command (kind test, make)


RUNNERS = [
    Runner(r"^make (demo|agent-demo|test|test-fast)\b", "make"),
    Runner(r"^megarl (config|layout|plan) ", "cli"),
    Runner(r"^megarl train configs/recipes/", "test", "tests/unit/test_recipes.py::test_the_readmes_example_passes_a_dry_run"),
    Runner(r"^python scripts/data/prepare_(gsm8k|math)\.py ", "test",
           "tests/unit/test_recipes.py::test_the_data_scripts_write_verls_format_with_a_validation_split"),
    Runner(r"^megarl train \S+ .*rollout\.env=", "test", "tests/e2e/test_agent.py::test_multi_turn_log_prob_parity_and_masks"),
    Runner(r"^megarl train \S+ model\.path=", "test", "tests/e2e/test_pretrained.py::test_first_step_log_probs_equal_transformers"),
    Runner(r"^megarl train \S+ data\.train_files=", "test", "tests/e2e/test_pretrained.py::test_first_step_log_probs_equal_transformers"),
    Runner(r"^megarl train \S+ data\.val_files=", "test", "tests/e2e/test_rl.py::test_validation_changes_no_training_metric"),
    Runner(r"^megarl eval ", "test", "tests/e2e/test_rl.py::test_validation_changes_no_training_metric"),
    Runner(r"^(WANDB|SWANLAB)_MODE=offline megarl train \S+ 'logging\.backends=", "test",
           "tests/e2e/test_rl.py::test_validation_changes_no_training_metric"),
    Runner(r"^megarl train configs/\S+ \[key=value \.\.\.\]$", "dry"),
    Runner(r"^megarl train configs/[\w/]+\.yaml( [\w.]+=\S+)*( --dry-run)?$", "dry"),
    Runner(r"^megarl train-lm ", "test", "tests/e2e/test_train_lm.py::test_train_lm_loss_falls"),
    Runner(r"^megarl sft ", "test", "tests/e2e/test_sft.py::test_sft_trains_resumes_and_validates"),
    Runner(r"^megarl dpo ", "test", "tests/e2e/test_sft.py::test_dpo_prefers_the_chosen_responses"),
    Runner(r"^megarl train-rm ", "test",
           "tests/e2e/test_sft.py::test_reward_model_learns_the_preference_and_exports_as_a_sequence_classifier"),
    Runner(r"^megarl export-hf ", "test", "tests/e2e/test_export.py::test_export_hf_from_another_directory_never_copies_source_weights"),
    Runner(r"^megarl report ", "test", "tests/e2e/test_rl.py::test_report_draws_the_run"),
    Runner(r"^megarl convert hf-to-mcore ", "test", "tests/distributed/test_convert.py"),
    Runner(r"^megarl convert mcore-to-hf ", "test", "tests/e2e/test_export.py::test_mcore_to_hf_writes_a_loadable_directory"),
    Runner(r"^torchrun .*-m megarl.checkpoint.cli ", "test", "tests/distributed/test_convert.py"),
    Runner(r"^(python|torchrun .*) checkpoint_tools/\w+\.py ", "test", "tests/distributed/test_convert.py"),
    Runner(r"^sbatch .*launch/slurm/convert\.sbatch", "test",
           "tests/faults/test_multinode.py::test_slurm_convert_runs_its_steps_on_every_rank_with_the_first_nodes_address"),
    Runner(r"^sbatch .*launch/slurm/train\.sbatch", "test", "tests/e2e/test_launch.py::test_slurm_train_dry_run"),
    Runner(r"^ray job submit .* megarl train .*trainer\.ray_address=", "test",
           "tests/faults/test_multinode.py::test_two_node_run_then_a_lost_node_is_named_within_seconds"),
    Runner(r"^launch/torchrun\.sh ", "test", "tests/e2e/test_launch.py::test_torchrun_dry_run"),
    Runner(r"^mlflow ui --backend-store-uri ", "test", "tests/e2e/test_demo.py::test_mlflow_ui_serves_the_demo_run"),
    Runner(r"^pip install ", "bootstrap"),
    Runner(r"^(python )?benchmarks/[\w/]+\.(py|sh)( \w+)?$", "benchmark"),
]
MAKE_TESTS = {"demo": "tests/e2e/test_demo.py::test_demo_workflow", "agent-demo": None, "test": None, "test-fast": None}


def _runner(command: str) -> Optional[Runner]:
    return next((r for r in RUNNERS if re.search(r.pattern, command)), None)


def _all_commands():
    return [(page.relative_to(ROOT).as_posix(), c) for page in PAGES for c in shown_commands(_text(page))]


def test_every_shown_command_has_a_runner():
    missing = [f"{page}: {command}" for page, command in _all_commands() if _runner(command) is None]
    assert not missing, "no runner for:\n" + "\n".join(missing)


def _test_exists(nodeid: str) -> bool:
    path, _, name = nodeid.partition("::")
    file = ROOT / path
    if not file.is_file():
        return False
    return not name or name in {n.name for n in ast.walk(ast.parse(file.read_text())) if isinstance(n, ast.FunctionDef)}


def test_mapped_tests_exist():
    nodeids = [r.test for r in RUNNERS if r.test] + [t for t in MAKE_TESTS.values() if t]
    assert [n for n in nodeids if not _test_exists(n)] == []


def test_repository_paths_in_commands_are_in_a_fresh_clone():
    paths = sorted({tok for _, c in _all_commands() for tok in shlex.split(c)
                    if re.match(r"(configs|launch|benchmarks|scripts|requirements|checkpoint_tools)/", tok)})
    assert paths and [p for p in paths if not (ROOT / p).exists()] == []
    ignored = subprocess.run(["git", "check-ignore", *paths], cwd=ROOT, capture_output=True, text=True).stdout.split()
    assert ignored == []


def _argv(command: str) -> List[str]:
    return [a for a in shlex.split(command.replace("[key=value ...]", ""))][1:]


def test_cheap_commands_run(capsys):
    """`megarl config`, `megarl layout`, `megarl plan` and every `megarl train configs/...` (as its --dry-run) in
    this process; `make -n` of each make target; the mapped long commands' configs and overrides load."""
    from megarl.cli import main
    from megarl.config import load_config

    failures, ran = [], 0
    for page, command in _all_commands():
        runner = _runner(command)
        if runner.kind in ("cli", "dry"):
            argv = _argv(command)
            if runner.kind == "dry" and "--dry-run" not in argv:
                argv.append("--dry-run")
            rc = main(argv)
            out, err = capsys.readouterr()
            ran += 1
            if rc != 0:
                failures.append(f"{page}: {command}: exit {rc}: {err[-500:]}")
        elif runner.kind == "make":
            target = command.split()[1]
            proc = subprocess.run(["make", "-n", target], cwd=ROOT, capture_output=True, text=True)
            if proc.returncode != 0:
                failures.append(f"{page}: {command}: make -n: {proc.stderr[-300:]}")
        elif runner.kind == "test" and command.startswith("megarl train"):
            argv = _argv(command)
            files = [a for a in argv[1:] if a.endswith(".yaml") and (ROOT / a).is_file()]
            overrides = [a for a in argv[1:] if "=" in a and not a.startswith("-")]
            load_config(files, overrides)  # the keys and values it shows are valid
    assert not failures, "\n".join(failures)
    assert ran >= 5


def test_install_commands_are_the_bootstraps():
    bootstrap = (ROOT / "scripts" / "bootstrap.sh").read_text()
    installs = [set(shlex.split(line.split("install", 1)[1])) for line in bootstrap.splitlines()
                if '"${pip[@]}" install' in line]
    for _, command in _all_commands():
        if _runner(command).kind == "bootstrap":
            assert any(set(shlex.split(command)[2:]) <= tokens for tokens in installs), command


def test_benchmark_scripts_shown_compile():
    for _, command in _all_commands():
        if _runner(command).kind == "benchmark":
            script = ROOT / next(t for t in command.split() if t.startswith("benchmarks/"))
            if script.suffix == ".py":
                py_compile.compile(str(script), doraise=True)
            else:
                assert subprocess.run(["bash", "-n", str(script)]).returncode == 0, command
            arg = command.split()[-1]
            if not arg.endswith((".py", ".sh")):  # a subcommand: the script knows it
                assert f'"{arg}"' in script.read_text(), command


def test_readme_is_a_landing_page_linking_every_doc():
    text = _text(ROOT / "README.md")
    assert len(text.splitlines()) < 200
    assert "make demo" in text and "make test" in text
    for doc in (ROOT / "docs").glob("*.md"):
        assert f"(docs/{doc.name})" in text, doc.name
