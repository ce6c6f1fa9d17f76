"""``megarl sft`` through the command line, on a random Llama of real width with tied embeddings
(hidden 512, 4 layers, the ChatML test tokenizer) and generated conversations (the user gives
digits, the assistant reverses them): ``messages`` rows in jsonl (some multi-turn, with a tool
turn) and prompt/response pairs in parquet, validation on held-out pairs.

One run of 10 steps at tp=2 with packed sequences (checkpoints at 5 and 10), then the same
command with ``trainer.train_steps=14``, which resumes after step 10; then LoRA adapters trained
3 steps at dp=2 from that run's directory (``model.path=RUN_DIR``). The validation loss falls;
``megarl export-hf`` of either run (the LoRA one merged) loads in transformers, whose token-mean
cross entropy of the held-out assistant tokens equals the run's last ``val/loss`` (fp32, 1e-5). Bad rows and settings
exit 2 before Ray starts, named. Then the reward model: ``megarl train-rm`` from the SFT export at
tp=2 on pairs with a learnable rule (held-out accuracy >= 0.9), exported as an HF
``LlamaForSequenceClassification`` whose transformers scores give the run's held-out margin and
accuracy, and PPO scored by it (``reward_model.path``); and ``megarl dpo`` on the same pairs, at tp=2
against a frozen reference and with LoRA against the adapters-off model. (GRPO from an SFT
export: ``make demo``, tests/e2e/test_demo.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megarl.cli import main
from tests.cli import Started, megarl_here
from tests.fixtures.hf_models import PAD_ID, chat_examples, make_hf_model, make_tokenizer

# the shape of the models users start from where it matters here: hidden 512 and tied embeddings
# (the SFT export, the reward model's new head on a tied backbone, DPO's reference copy)
REAL_WIDTH = {"hidden_size": 512, "intermediate_size": 1024, "num_attention_heads": 8, "num_key_value_heads": 2,
              "head_dim": 64, "tie_word_embeddings": True}
TOOL_TURN = [{"role": "system", "content": "Reverse digits."}, {"role": "user", "content": "reverse 123"},
             {"role": "assistant", "content": "look up 123"}, {"role": "tool", "content": "321"},
             {"role": "assistant", "content": "321"}]


@pytest.fixture(scope="module")
def user(tmp_path_factory):
    import pyarrow as pa
    import pyarrow.parquet as pq

    work = tmp_path_factory.mktemp("sft")
    tokenizer = make_tokenizer(work / "tokenizer")
    model = make_hf_model("llama", work / "model", tokenizer, train_steps=0, overrides=REAL_WIDTH)  # random weights
    chats = chat_examples(184, seed=11)
    with (work / "chat.jsonl").open("w") as f:
        for chat in chats[:100]:
            f.write(json.dumps({"messages": chat}) + "\n")
        for _ in range(8):
            f.write(json.dumps({"messages": TOOL_TURN}) + "\n")
    pq.write_table(pa.Table.from_pylist([{"prompt": c[0]["content"], "response": c[1]["content"]}
                                         for c in chats[100:160]]), work / "pairs.parquet")
    with (work / "val.jsonl").open("w") as f:
        for chat in chats[160:]:
            f.write(json.dumps({"prompt": chat[0]["content"], "response": chat[1]["content"]}) + "\n")
    for name, part in (("prefs.jsonl", chats[:120]), ("prefs_val.jsonl", chats[160:])):
        with (work / name).open("w") as f:
            for chat in part:
                f.write(json.dumps(preference(chat)) + "\n")
    return work, model


def preference(chat) -> dict:
    """A preference row with a learnable rule: the answer is preferred to the answer with a stray
    letter somewhere in it."""
    answer = chat[1]["content"]
    at = sum(map(ord, chat[0]["content"])) % (len(answer) + 1)
    return {"prompt": chat[0]["content"], "chosen": answer, "rejected": answer[:at] + "x" + answer[at:]}


SFT = ("data.global_batch_size=16", "data.micro_batch_size=4", "data.pack_sequences=true", "parallel.actor.tp=2",
       "optimizer.lr=3.0e-3", "optimizer.lr_warmup_steps=0", "trainer.save_interval=5", "trainer.val_interval=5",
       "trainer.log_interval=5", "logging.progress_bar=false")


@pytest.fixture(scope="module")
def runs(user):
    work, model = user
    files = (f"model.path={model}", f"data.train_files=[{work / 'chat.jsonl'},{work / 'pairs.parquet'}]",
             f"data.val_files=[{work / 'val.jsonl'}]", f"trainer.run_dir={work / 'run'}")
    first = megarl_here("sft", *files, *SFT, "trainer.train_steps=10", cwd=work)
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = megarl_here("sft", *files, *SFT, "trainer.train_steps=14", cwd=work)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    export = megarl_here("export-hf", str(work / "run"), str(work / "export"), cwd=work)
    assert export.returncode == 0, export.stderr[-3000:]
    dpo = {lora: start_dpo(work, lora) for lora in (False, True)}  # beside what follows; waited for by their tests
    # LoRA adapters on the SFT run's newest checkpoint (model.path=RUN_DIR) at dp=2, exported merged
    lora = megarl_here("sft", f"model.path={work / 'run'}", *files[1:3], f"trainer.run_dir={work / 'lora'}",
                       "model.lora.rank=8", "model.lora.alpha=16", "optimizer.lr=1.0e-2", "trainer.train_steps=3",
                       "trainer.val_interval=3", "trainer.val_before_train=false", "data.global_batch_size=16",
                       "data.micro_batch_size=4", "trainer.save_interval=3", "logging.progress_bar=false", cwd=work)
    assert lora.returncode == 0, lora.stderr[-3000:]
    export = megarl_here("export-hf", str(work / "lora"), str(work / "lora_export"), cwd=work)
    assert export.returncode == 0, export.stderr[-3000:]
    try:
        yield first, resumed, dpo
    finally:
        for started in dpo.values():
            started.stop()


def start_dpo(work: Path, lora: bool) -> Started:
    """``megarl dpo`` from the SFT export on the same pairs, in a new interpreter: without LoRA at
    tp=2 against a frozen copy; with LoRA at dp=2 against the same model with its adapters off."""
    run = work / ("dpo_lora" if lora else "dpo")
    cli = work / f"{run.name}_cli"  # its output
    cli.mkdir()
    layout = ("model.lora.rank=8", "model.lora.alpha=16", "optimizer.lr=1.0e-2") if lora else (
        "parallel.actor.tp=2", "optimizer.lr=1.0e-3")
    return Started("dpo", f"model.path={work / 'export'}", f"data.train_files=[{work / 'prefs.jsonl'}]",
                   f"data.val_files=[{work / 'prefs_val.jsonl'}]", f"trainer.run_dir={run}", *layout,
                   "data.global_batch_size=8", "data.micro_batch_size=2", "optimizer.lr_warmup_steps=0",
                   "trainer.train_steps=12", "trainer.val_interval=12", "trainer.save_interval=0",
                   "logging.backends=[console]", "logging.progress_bar=false", cwd=cli)


@pytest.fixture(scope="module")
def reward_model(user, runs):
    """megarl train-rm from the SFT export (a new value head on its backbone) at tp=2, then its
    export (an HF *ForSequenceClassification directory)."""
    work, _ = user
    rm = megarl_here("train-rm", f"model.path={work / 'export'}", f"data.train_files=[{work / 'prefs.jsonl'}]",
                     f"data.val_files=[{work / 'prefs_val.jsonl'}]", f"trainer.run_dir={work / 'rm'}",
                     "parallel.actor.tp=2", "data.global_batch_size=8", "data.micro_batch_size=2",
                     "optimizer.lr=1.0e-3", "optimizer.lr_warmup_steps=0", "trainer.train_steps=30",
                     "trainer.val_interval=30", "trainer.save_interval=30", "trainer.log_interval=10",
                     "logging.progress_bar=false", cwd=work)
    assert rm.returncode == 0, rm.stderr[-3000:]
    export = megarl_here("export-hf", str(work / "rm"), str(work / "rm_export"), cwd=work)
    assert export.returncode == 0, export.stderr[-3000:]
    return rm


def test_sft_trains_resumes_and_validates(user, runs):
    work, _ = user
    first, resumed, _ = runs
    assert "168 training examples" in first.stderr  # 108 conversations and 60 pairs
    assert "resuming after step 10" in resumed.stdout
    assert sorted(p.name for p in (work / "run" / "checkpoints").glob("step_*")) == ["step_000010", "step_000014"]
    rows = [json.loads(line) for line in (work / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 15))
    assert all(r["train/update_ok"] == 1.0 and r["train/tokens"] > 0 for r in rows)
    vals = {r["step"]: r["val/loss"] for r in map(json.loads, (work / "run" / "validation.jsonl").read_text().splitlines())}
    assert sorted(vals) == [0, 5, 10, 14]
    assert vals[0] > 5.0 and vals[14] < 0.6 * vals[0], vals  # ln(260) = 5.56 at random weights
    assert main(["report", str(work / "run")]) == 0  # the loss and validation curves
    assert {"sft.png", "validation.png", "memory.png"} <= {p.name for p in (work / "run" / "report").iterdir()}
    # the LoRA run: adapters only in its checkpoint, and they moved the loss
    lora = [json.loads(line) for line in (work / "lora" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lora] == [1, 2, 3] and all(r["train/update_ok"] == 1.0 for r in lora)
    (lora_val,) = [json.loads(line)["val/loss"] for line in (work / "lora" / "validation.jsonl").read_text().splitlines()]
    assert lora_val != pytest.approx(vals[14], rel=1e-6)


@pytest.mark.parametrize("run", ["run", "lora"])
def test_export_loads_in_transformers_with_the_runs_validation_loss(user, runs, run):
    """transformers on the exported weights (the LoRA run's merged into its base): the held-out
    rows as megarl sft reads them (its masks: the assistant's tokens and <|im_end|>), the same
    token-mean cross entropy."""
    from transformers import AutoModelForCausalLM

    from megarl.config import load_config
    from megarl.data.sft import collate, load_examples
    from megarl.data.tokenizer import HFTokenizer

    work, _ = user
    export = work / ("export" if run == "run" else "lora_export")
    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    cfg = load_config([sorted((work / run / "checkpoints").glob("step_*"))[-1] / "config.yaml"])
    tok = HFTokenizer(str(export))
    batch = collate(load_examples([str(work / "val.jsonl")], cfg.data, tok, cfg.data.max_length), PAD_ID)
    with torch.no_grad():
        logits = model(input_ids=batch["tokens"], position_ids=batch["position_ids"]).logits
    logp = torch.log_softmax(logits.double(), -1).gather(-1, batch["labels"].unsqueeze(-1)).squeeze(-1)
    mask = batch["loss_mask"].double()
    loss = (-(logp * mask).sum() / mask.sum()).item()
    last = json.loads((work / run / "validation.jsonl").read_text().splitlines()[-1])
    assert last["val/tokens"] == mask.sum().item()
    assert loss == pytest.approx(last["val/loss"], rel=1e-5)


@pytest.mark.parametrize("override, named", [
    ("data.truncation=left", "data.truncation=left"),
    ("data.max_length=8", "data.max_length=8"),
    ("data.global_batch_size=6", "data.global_batch_size=6"),
])
def test_bad_settings_exit_2_before_ray(user, tmp_path, capsys, override, named):
    import ray

    work, model = user
    code = main(["sft", f"model.path={model}", f"data.train_files=[{work / 'chat.jsonl'}]", "parallel.actor.tp=2",
                 "data.micro_batch_size=4", f"trainer.run_dir={tmp_path / 'run'}", override])
    err = capsys.readouterr().err
    assert code == 2 and named in err, err
    assert not ray.is_initialized() and not (tmp_path / "run").exists()


def test_a_bad_row_is_named_by_file_and_row(user, tmp_path, capsys):
    work, model = user
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": TOOL_TURN}) + "\n" + json.dumps({"text": "no fields"}) + "\n")
    code = main(["sft", f"model.path={model}", f"data.train_files=[{bad}]", f"trainer.run_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert code == 2 and f"{bad}:2" in err and "data.messages_key" in err and "data.bad_rows=skip" in err, err


def test_reward_model_learns_the_preference_and_exports_as_a_sequence_classifier(user, reward_model):
    """The held-out pairs: accuracy >= 0.9 after training (0 at the new head, which starts at zero:
    no margin). The export loads in transformers as a *ForSequenceClassification, and its score of
    every held-out row (at its last non-pad token, batched with right padding) equals the run's
    (validation/step_30.jsonl; fp32, 1e-5), and so the run's val/margin and val/accuracy."""
    from transformers import AutoModelForSequenceClassification

    from megarl.config import load_config
    from megarl.data.sft import collate_scored, load_pairs
    from megarl.data.tokenizer import HFTokenizer

    work, _ = user
    vals = [json.loads(line) for line in (work / "rm" / "validation.jsonl").read_text().splitlines()]
    assert [v["step"] for v in vals] == [0, 30] and vals[-1]["val/accuracy"] >= 0.9, vals
    config = json.loads((work / "rm_export" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForSequenceClassification"] and config["num_labels"] == 1
    model = AutoModelForSequenceClassification.from_pretrained(work / "rm_export", dtype=torch.float32).eval()
    cfg = load_config([work / "rm" / "checkpoints" / "step_000030" / "config.yaml"])
    pairs = load_pairs([str(work / "prefs_val.jsonl")], cfg.data, HFTokenizer(str(work / "rm_export")),
                       cfg.data.max_length)
    batch = collate_scored([e for pair in pairs for e in pair], PAD_ID)
    with torch.no_grad():
        scores = model(input_ids=batch["tokens"], attention_mask=batch["tokens"].ne(PAD_ID).long()).logits[:, 0]
    ours = [json.loads(line) for line in (work / "rm" / "validation" / "step_30.jsonl").read_text().splitlines()]
    assert [r["source"] for r in ours] == [chosen.source for chosen, _ in pairs]
    megarl_scores = torch.tensor([[r["chosen_score"], r["rejected_score"]] for r in ours]).flatten()
    assert torch.allclose(scores.double(), megarl_scores.double(), rtol=1e-5, atol=1e-5), (scores, megarl_scores)
    margin = (scores[0::2] - scores[1::2]).double()
    assert margin.mean().item() == pytest.approx(vals[-1]["val/margin"], rel=1e-4, abs=1e-5)
    assert (margin > 0).double().mean().item() == vals[-1]["val/accuracy"]


def test_ppo_with_the_trained_reward_model(user, reward_model):
    """PPO (GAE, a critic) from the SFT export, scored by the exported reward model (reward_model.path)."""
    work, _ = user
    with (work / "prompts.jsonl").open("w") as f:
        for chat in chat_examples(8, seed=5):
            f.write(json.dumps({"prompt": chat[:1], "answer": chat[1]["content"]}) + "\n")
    proc = megarl_here("train", f"model.path={work / 'export'}", f"data.train_files=[{work / 'prompts.jsonl'}]",
                       "algorithm.name=ppo", "algorithm.reward_fn=model", f"reward_model.path={work / 'rm_export'}",
                       "data.prompts_per_step=4", "algorithm.samples_per_prompt=2", "algorithm.max_new_tokens=6",
                       "trainer.train_steps=2", "trainer.save_interval=0", f"trainer.run_dir={work / 'ppo'}",
                       "logging.backends=[console]", "logging.progress_bar=false", cwd=work)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (work / "ppo" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all("critic/loss" in r for r in rows)
    assert len({r["reward/mean"] for r in rows}) == 2  # the model's scores, not a constant


@pytest.mark.parametrize("lora", [False, True])
def test_dpo_prefers_the_chosen_responses(user, runs, lora):
    """megarl dpo from the SFT export on the same pairs: the held-out implicit-reward accuracy
    starts at 0 (the policy is its reference: no margin) and ends >= 0.9, the margin positive and
    the rejected responses' log-probs lowered. Without LoRA at tp=2 against a frozen copy; with
    LoRA at dp=2 against the same model with its adapters off. Both runs start once the export
    exists (``runs``), in new interpreters, beside the LoRA SFT and the reward model's runs."""
    work, _ = user
    run = work / ("dpo_lora" if lora else "dpo")
    proc = runs[2][lora].wait()
    assert proc.returncode == 0, proc.stderr[-3000:]
    first, last = [json.loads(line) for line in (run / "validation.jsonl").read_text().splitlines()]
    assert first["val/accuracy"] == 0 and first["val/margin"] == 0 and first["val/loss"] == pytest.approx(0.6931, abs=1e-4)
    assert last["val/accuracy"] >= 0.9 and last["val/margin"] > 0, last
    assert last["val/rejected_logp"] < first["val/rejected_logp"], (first, last)
