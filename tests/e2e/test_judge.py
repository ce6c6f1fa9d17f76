"""A generative reward model (``reward_model.generative``, an LLM judge) through ``megarl train``.

The judge is a tiny HF Llama of its own (heads of 32, vLLM's CPU attention's least) trained by
plain transformers to reverse digits, and the parser reads the first digit of what it writes: a
judgement without one is garbage (counted in ``reward/judge_unparseable``, scored 0, the run goes on). The policy is another tiny Llama (less trained) with the same tokenizer (the judge tokenizes with its own
directory's).

- Native engine, tp=2 on 2 ranks, the judge's weights resharded into the generation layout
  (t_g=1): each row's reward is 0.5 x exact_match (the rule) + the judge's score
  (``reward_model.rule_weight``); the template asks the judge to ``reverse`` the response; the
  judge's part equals what transformers' greedy ``generate`` of the same judge writes for the same
  filled template.
- vLLM engine for the judge (the policy's rollout native), 1 rank, the judge alone
  (``algorithm.reward_fn=model``), given the bare response, to which it answers digits for some
  and words for others: the same equality with transformers, and the garbage counted. This run
  starts first, as a new interpreter, and runs beside the native one.

Every row's judgement of both steps is compared (after step 1 the judge sleeps, and is woken and
refilled for step 2: on vLLM's CPU build a reload with its oneDNN prepacking), and the
unparseable count equals the rows where transformers' judgement has no digit. ``--dry-run`` names the judge in the plan.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from tests.cli import Started, megarl_here
from tests.fixtures.hf_models import chat_examples, make_hf_model, make_tokenizer

REVERSE = "reverse {response}"  # the judge reverses the response: mostly digits
BARE = "{response}"  # the bare response: the judge writes digits for some, words (garbage) for others
PARSER = r"(\d)"
JUDGE_HEADS = {"num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 32}
JUDGE_TOKENS = 8
STEPS = 2  # the judge sleeps after step 1 and is woken and refilled for step 2: both checked


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    work = tmp_path_factory.mktemp("judge")
    tokenizer = make_tokenizer(work / "tokenizer")
    policy = make_hf_model("llama", work / "policy", tokenizer, train_steps=20)
    judge = make_hf_model("llama", work / "judge", tokenizer, seed=1, overrides=JUDGE_HEADS)
    data = work / "prompts.jsonl"
    with data.open("w") as f:
        for chat in chat_examples(16, seed=7):
            f.write(json.dumps({"prompt": chat[:1], "answer": chat[1]["content"]}) + "\n")
    return work, policy, judge, data


def write_config(models, name: str, layout: str, algorithm: str, judge: str, template: str, nproc: int = 2):
    work, policy, judge_dir, data = models
    run_dir = work / name
    (work / f"{name}.yaml").write_text(f"""
model: {{path: {policy}}}
parallel: {{actor: {layout}, rollout: {{tp: 1}}}}
data: {{train_files: [{data}], prompts_per_step: 4}}
algorithm: {{name: grpo, samples_per_prompt: 2, max_new_tokens: 8, {algorithm}}}
reward_model: {{path: {judge_dir}, generative: true, template: '{template}', parser: '{PARSER}',
               max_new_tokens: {JUDGE_TOKENS}, batch_size: 3, {judge}}}
trainer: {{train_steps: {STEPS}, nproc_per_node: {nproc}, run_dir: {run_dir}}}
logging: {{backends: [console], progress_bar: false, rollout_dump_interval: 1}}
""")
    return work / f"{name}.yaml"


def collect(models, name: str, done):
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    run_dir = models[0] / name
    rows = [json.loads(line) for step in range(1, STEPS + 1)
            for line in (run_dir / "rollouts" / f"step_{step}.jsonl").read_text().splitlines()]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == STEPS
    return rows, {k: sum(m[k] for m in metrics) for k in ("reward/judge_unparseable", "reward/judge_timeouts",
                                                         "reward/judge_too_long")} | {"steps": metrics}


def run(models, name: str, nproc: int, layout: str, algorithm: str, judge: str, template: str):
    config = write_config(models, name, layout, algorithm, judge, template, nproc)
    return collect(models, name, megarl_here("train", str(config), cwd=models[0]))


@pytest.fixture(scope="module")
def vllm_judge_started(models):
    """The vLLM judge's run (1 rank), started first, as a new interpreter, beside the native run
    (2 ranks); its test waits for it."""
    config = write_config(models, "vllm", "{tp: 1}", "reward_fn: model", "engine: vllm", BARE, nproc=1)
    (models[0] / "vllm-cli").mkdir()
    started = Started("train", str(config), cwd=models[0] / "vllm-cli")
    try:
        yield started
    finally:
        started.stop()


def transformers_judgements(judge_dir: Path, template: str, responses):
    """What the judge writes for each response under transformers' greedy generate, as the
    trainer's tokenizer sees it: the filled template as one user message of the chat template."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(judge_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(judge_dir, dtype=torch.float32).eval()
    out = []
    for response in responses:
        ids = tok.apply_chat_template([{"role": "user", "content": template.format(response=response)}],
                                      add_generation_prompt=True, return_tensors="pt", return_dict=True)
        with torch.no_grad():
            new = model.generate(**ids, max_new_tokens=JUDGE_TOKENS, do_sample=False)[0, ids["input_ids"].shape[1]:]
        out.append(tok.decode(new, skip_special_tokens=True))
    return out


def judge_scores(texts):
    found = [re.search(PARSER, t) for t in texts]
    return [float(m.group(1)) if m else 0.0 for m in found], sum(m is None for m in found)


def answers_of(rows):
    chats = {c[0]["content"]: c[1]["content"] for c in chat_examples(16, seed=7)}
    return [next(a for q, a in chats.items() if f"user\n{q}" in row["prompt"]) for row in rows]


def test_native_judge_plus_rule_equals_transformers(models, vllm_judge_started):
    rows, metrics = run(models, "native", 2, "{tp: 2}", "reward_fn: exact_match",
                        "rule_weight: 0.5, judge_weight: 1.0", REVERSE)
    texts = transformers_judgements(models[2], REVERSE, [r["response"] for r in rows])
    scores, garbage = judge_scores(texts)
    rules = [float(r["response"].strip() == a) for r, a in zip(rows, answers_of(rows))]
    for row, score, rule, text in zip(rows, scores, rules, texts):
        assert row["reward"] == pytest.approx(0.5 * rule + score, abs=1e-6), (row["response"], text, row["reward"])
    print(f"native judge: scores {scores}, rules {rules}, unparseable {garbage}")
    assert metrics["reward/judge_unparseable"] == garbage
    assert metrics["reward/judge_timeouts"] == 0 and metrics["reward/judge_too_long"] == 0
    assert len(set(scores)) > 1, texts  # the judge tells the responses apart
    half = len(rows) // STEPS  # each step's parsed scores' mean
    for step, m in enumerate(metrics["steps"]):
        parsed = [s for s, t in zip(scores[step * half:(step + 1) * half], texts[step * half:(step + 1) * half])
                  if re.search(PARSER, t)]
        assert m["reward/judge_score_mean"] == pytest.approx(sum(parsed) / len(parsed))


def test_vllm_judge_alone_equals_transformers(models, vllm_judge_started):
    rows, metrics = collect(models, "vllm", vllm_judge_started.wait())
    texts = transformers_judgements(models[2], BARE, [r["response"] for r in rows])
    scores, garbage = judge_scores(texts)
    assert [r["reward"] for r in rows] == pytest.approx(scores, abs=1e-6), list(zip([r["response"] for r in rows], texts))
    assert metrics["reward/judge_unparseable"] == garbage
    print(f"vllm judge: scores {scores}, unparseable {garbage}")
    assert 0 < garbage < len(rows), texts  # garbage was met, counted, and the run went on


def test_the_plan_names_the_judge(models, capsys):
    """``--dry-run``: the judge's model, layout and engine in the plan, nothing started."""
    from megarl.cli import main

    work, policy, judge_dir, data = models
    config = write_config(models, "plan", "{tp: 2}", "reward_fn: model", "judge_weight: 1.0", REVERSE)
    assert main(["train", str(config), "trainer.nproc_per_node=2", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"judge {judge_dir} (llama) on every rank, layout (tp=1, pp=1, dp=2) (native), asleep between calls" in out
