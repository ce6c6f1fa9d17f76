"""The recipes (configs/recipes/) and the data scripts that feed them (scripts/data/), as a user
runs them: the public GSM8K and MATH parquet layouts (made here: nothing is downloaded) become
train and validation splits in verl's format with the reference answers extracted; each recipe,
from the directory the scripts wrote to, and the README's example as written pass
``megarl train --dry-run`` with the real model's shapes (configs/models/reference/), the user's
model directory and tokenizer standing in as its HF config and a test tokenizer."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.cli import megarl_here
from tests.fixtures.hf_models import make_tokenizer

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "configs" / "models" / "reference"
RECIPES = {  # recipe: (its model's shapes, the plan lines it must show)
    "gsm8k_grpo_qwen3_8b": ("qwen3-8b.json", ["nodes 1 x 8 ranks = world 8",
                                              "actor layout (tp=2, pp=1, dp=4); rollout layout (tp=2, pp=1, dp=4) "
                                              "(vllm); micro-DP size 1", "algorithm grpo; 128 prompts x 8 samples"]),
    "math_dapo_qwen3_8b": ("qwen3-8b.json", ["actor layout (tp=4, pp=1, dp=2); rollout layout (tp=2, pp=1, dp=4) "
                                             "(vllm); micro-DP size 2", "algorithm dapo; 64 prompts x 16 samples"]),
    "gsm8k_grpo_qwen3_30b_a3b_2nodes": ("qwen3-30b-a3b.json", [
        "nodes 2 x 8 ranks = world 16; ray auto", "actor layout (tp=4, pp=1, dp=4, ep=8, etp=1)"]),
}


def script(name: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "data" / f"prepare_{name}.py"), *args], cwd=cwd,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def user(tmp_path_factory):
    """The public files' layouts (openai/gsm8k's question/answer with ``#### n``; MATH's problem,
    solution with its answer boxed, level, type), converted by the scripts into ``data/``."""
    work = tmp_path_factory.mktemp("recipes")
    gsm8k = [{"question": f"Tom has {i} apples and buys {i + 2} more. How many does he have?",
              "answer": f"He has {i} + {i + 2} = <<{i}+{i + 2}={2 * i + 2}>>{2 * i + 2}.\n#### {2 * i + 2}"}
             for i in range(40)]
    pq.write_table(pa.Table.from_pylist(gsm8k[:30]), work / "gsm8k_train.parquet")
    pq.write_table(pa.Table.from_pylist(gsm8k[30:]), work / "gsm8k_test.parquet")
    math = [{"problem": f"What is ${i}/2$ in lowest terms?",
             "solution": f"Halving, $\\frac{{{i}}}{{2}} = \\boxed{{\\frac{{{i}}}{{2}}}}$.", "level": "Level 1",
             "type": "Prealgebra"} for i in range(1, 41, 2)]
    pq.write_table(pa.Table.from_pylist(math), work / "math_train.parquet")
    made = [script("gsm8k", "--train", "gsm8k_train.parquet", "--test", "gsm8k_test.parquet", "--out", "data/gsm8k",
                   cwd=work),
            script("math", "--train", "math_train.parquet", "--val-size", "5", "--seed", "3", "--out", "data/math",
                   cwd=work)]
    for proc in made:
        assert proc.returncode == 0, proc.stderr
    return work, make_tokenizer(work / "tokenizer")


def test_the_data_scripts_write_verls_format_with_a_validation_split(user, tmp_path):
    work, _ = user
    train, val = (pq.read_table(work / "data" / "gsm8k" / f"{s}.parquet").to_pylist() for s in ("train", "val"))
    assert (len(train), len(val)) == (30, 10)
    row = train[3]
    assert row["data_source"] == "openai/gsm8k" and row["reward_model"] == {"style": "rule", "ground_truth": "8"}
    assert row["prompt"] == [{"role": "user", "content": "Tom has 3 apples and buys 5 more. How many does he have? "
                                                         "Let's think step by step and output the final answer "
                                                         "after \"####\"."}]
    assert row["extra_info"]["split"] == "train" and val[0]["extra_info"]["split"] == "test"
    from megarl.rewards.verifiers import gsm8k_reward, math_reward

    assert gsm8k_reward(row["extra_info"]["solution"], row["reward_model"]["ground_truth"]) == 1.0
    train, val = (pq.read_table(work / "data" / "math" / f"{s}.parquet").to_pylist() for s in ("train", "val"))
    assert (len(train), len(val)) == (15, 5)  # 5 held out of the 20 training rows, by seed
    assert not {r["extra_info"]["index"] for r in train} & {r["extra_info"]["index"] for r in val}
    assert all(r["reward_model"]["ground_truth"] == f"\\frac{{{2 * r['extra_info']['index'] + 1}}}{{2}}" for r in val)
    assert all(r["extra_info"]["level"] == "Level 1" for r in train)
    assert all(math_reward(r["extra_info"]["solution"], r["reward_model"]["ground_truth"]) == 1.0 for r in val)
    # a file that is not the dataset's: the column named, nothing written
    bad = script("math", "--train", str(work / "gsm8k_train.parquet"), "--out", str(tmp_path / "out"), cwd=work)
    assert bad.returncode == 2 and "no column ['problem', 'solution', 'level', 'type']" in bad.stderr, bad.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_each_recipe_passes_a_dry_run(user, recipe):
    work, tokenizer = user
    shapes, lines = RECIPES[recipe]
    proc = megarl_here("train", str(ROOT / "configs" / "recipes" / f"{recipe}.yaml"), "--dry-run", "model.path=null",
                       f"model.hf_config={REFERENCE / shapes}", f"data.tokenizer={tokenizer}", cwd=work)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for line in lines:
        assert line in proc.stdout, (line, proc.stdout[:2000])


def test_the_readmes_example_passes_a_dry_run(user):
    """The README's `megarl train configs/recipes/...` command, every key and value as written,
    the user's model directory standing in as its shapes and a test tokenizer, from the directory
    its `python scripts/data/prepare_gsm8k.py` line writes to."""
    from tests.unit.test_docs import shown_commands

    work, tokenizer = user
    commands = [c for c in shown_commands((ROOT / "README.md").read_text()) if c.startswith("megarl train configs/recipes/")]
    assert len(commands) == 1, commands
    argv = shlex.split(commands[0])[1:]
    assert "model.path=/models/Qwen3-8B" in argv and "trainer.ray_address=auto" in argv
    argv = [a for a in argv if a != "model.path=/models/Qwen3-8B"]
    (work / "configs").mkdir(exist_ok=True)  # the checkout's configs/, beside the data the scripts wrote
    if not (work / "configs" / "recipes").exists():
        (work / "configs" / "recipes").symlink_to(ROOT / "configs" / "recipes")
    proc = megarl_here(*argv, "--dry-run", "model.path=null", f"model.hf_config={REFERENCE / 'qwen3-8b.json'}",
                       f"data.tokenizer={tokenizer}", cwd=work)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "nodes 2 x 8 ranks = world 16; ray auto" in proc.stdout
    assert re.search(r"actor layout \(tp=4, pp=2, dp=2\); rollout layout \(tp=2, pp=1, dp=8\)", proc.stdout), proc.stdout[:800]


def test_dual_clip_is_a_key_of_megarl_train(user):
    """algorithm.clip_ratio_c (verl's name, 3 by default as verl's) is a key of megarl train; null
    turns it off, a bound of 1 or less is refused by name before anything starts, and GSPO's
    sequence-level loss, which has no dual clip, runs with the default (ignored, as verl does)."""
    work, tokenizer = user
    base = [str(ROOT / "configs" / "recipes" / "gsm8k_grpo_qwen3_8b.yaml"), "--dry-run", "model.path=null",
            f"model.hf_config={REFERENCE / 'qwen3-8b.json'}", f"data.tokenizer={tokenizer}"]
    assert megarl_here("train", *base, "algorithm.clip_ratio_c=null", cwd=work).returncode == 0
    assert megarl_here("train", *base, "algorithm.name=gspo", cwd=work).returncode == 0
    proc = megarl_here("train", *base, "algorithm.clip_ratio_c=1.0", cwd=work)
    assert proc.returncode == 2 and "algorithm.clip_ratio_c" in proc.stderr, proc.stderr
