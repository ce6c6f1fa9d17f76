"""The prompt conventions of ``data.*`` through ``megarl train --dry-run`` (which prepares the whole
run, data included, and starts no worker) and the tokenizer itself: data.system_prompt,
data.chat_template_kwargs, data.chat_template_path, data.max_prompt_length with each
data.truncation, and the warning for chat prompts with a tokenizer that has no template."""

from __future__ import annotations

import json
import logging

import pytest

from megarl.data.tokenizer import HFTokenizer, load_tokenizer
from tests.cli import megarl_here
from tests.fixtures.hf_models import make_hf_model, make_tokenizer

# the ChatML template with an argument of its own: Qwen3's non-thinking mode writes an empty think block
THINKING = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n"
            "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}")


@pytest.fixture(scope="module")
def user(tmp_path_factory):
    work = tmp_path_factory.mktemp("data")
    tokenizer = make_tokenizer(work / "tokenizer")
    model = make_hf_model("llama", work / "model", tokenizer, train_steps=1)
    return work, tokenizer, model


def text(tok: HFTokenizer, prompt) -> str:
    return tok.tok.decode(tok.prompt_ids(prompt))


def test_system_prompt_template_arguments_and_file(user, tmp_path):
    work, tokenizer, _ = user
    tok = load_tokenizer(str(tokenizer), system_prompt="Be brief.")
    assert text(tok, "reverse 12") == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nreverse 12<|im_end|>\n"
                                       "<|im_start|>assistant\n")
    own = [{"role": "system", "content": "Mine."}, {"role": "user", "content": "hi"}]
    assert "Be brief." not in text(tok, own) and "Mine." in text(tok, own)  # a prompt's own system message stays
    (tmp_path / "thinking.jinja").write_text(THINKING)
    for kwargs, think in (({}, False), ({"enable_thinking": True}, False), ({"enable_thinking": False}, True)):
        tok = load_tokenizer(str(tokenizer), template_kwargs=kwargs, template_path=str(tmp_path / "thinking.jinja"))
        assert text(tok, "hi").endswith("<think>\n\n</think>\n\n") is think, kwargs
    with pytest.raises(FileNotFoundError, match="data.chat_template_path=nowhere.jinja"):
        load_tokenizer(str(tokenizer), template_path="nowhere.jinja")
    with pytest.raises(ValueError, match="data.system_prompt: the built-in digit tokenizer"):
        load_tokenizer(None, system_prompt="Be brief.")


def test_chat_prompts_without_a_template_are_named_once(user, tmp_path, caplog):
    from transformers import AutoTokenizer

    _, tokenizer, _ = user
    plain = AutoTokenizer.from_pretrained(tokenizer)
    plain.chat_template = None
    plain.save_pretrained(tmp_path / "plain")
    (tmp_path / "plain" / "chat_template.jinja").unlink(missing_ok=True)
    (tmp_path / "plain" / "generation_config.json").write_text((tokenizer / "generation_config.json").read_text())
    tok = load_tokenizer(str(tmp_path / "plain"), system_prompt="Be brief.")
    chat = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    with caplog.at_level(logging.WARNING):
        assert text(tok, chat) == "Be brief.\na\nb" and text(tok, chat) == "Be brief.\na\nb"
    warnings = [r.getMessage() for r in caplog.records if "no chat template" in r.getMessage()]
    assert len(warnings) == 1 and str(tmp_path / "plain") in warnings[0] and "data.chat_template_path" in warnings[0]


@pytest.mark.parametrize("truncation", ["error", "left", "right", "skip"])
def test_over_long_prompts_by_truncation(user, truncation):
    """Rows 2 and 4 render over data.max_prompt_length=40; error stops before any worker, naming
    file:row and the length (exit 2); left and right cut them to 40 (a dry run passes); skip drops
    them (logged)."""
    work, tokenizer, model = user
    data = work / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "answer": "1"}) + "\n"
                            for p in ["short", "x" * 60, "short too", "y" * 80]))
    proc = megarl_here("train", "--dry-run", f"model.path={model}", f"data.tokenizer={tokenizer}",
                       f"data.train_files=[{data}]", "data.max_prompt_length=40", f"data.truncation={truncation}",
                       "algorithm.reward_fn=exact_match", "data.prompts_per_step=2", "algorithm.samples_per_prompt=2",
                       "trainer.nproc_per_node=1", "algorithm.max_new_tokens=16", f"trainer.run_dir={work / 'run'}", cwd=work)
    if truncation == "error":
        assert proc.returncode == 2, proc.stderr
        assert f"{data}:2: prompt of 79 tokens exceeds data.max_prompt_length=40 (data.truncation=error" in proc.stderr, proc.stderr
    else:
        assert proc.returncode == 0, proc.stderr


def test_truncation_cuts_the_named_end(user):
    from megarl.controller.prepare import prompt_stream
    from megarl.config import load_config
    from megarl.data.datasets import PromptRecord
    from megarl.trainer.steps import check_prompt_tokens

    _, tokenizer, _ = user
    tok = load_tokenizer(str(tokenizer))
    records = [PromptRecord("z" * 60, "1", "f.jsonl:1", {}), PromptRecord("ok", "1", "f.jsonl:2", {})]
    full = tok.prompt_ids(records[0].prompt)
    for truncation, expect in (("left", full[-40:]), ("right", full[:40])):
        cfg = load_config([], ["data.max_prompt_length=40", f"data.truncation={truncation}"])
        stream = prompt_stream(records, tok, cfg, room=100)
        check_prompt_tokens(stream, 1 << 20)
        assert stream.token_ids(records[0]) == expect and len(stream.records) == 2
    stream = prompt_stream(records, tok, load_config([], ["data.max_prompt_length=40", "data.truncation=skip"]), 100)
    check_prompt_tokens(stream, 1 << 20)
    assert [r.source for r in stream.records] == ["f.jsonl:2"]
    with pytest.raises(Exception, match=r"data.max_prompt_length=500 must be in \[1, 100\]"):
        prompt_stream(records, tok, load_config([], ["data.max_prompt_length=500"]), 100)


def test_a_checkpoint_with_one_nan_is_refused_before_ray_starts(user, tmp_path):
    """One NaN in one tensor of the user's HF checkpoint: megarl train exits 2 naming the tensor and
    its file, before Ray starts (no run directory is written). (Before: a sampling error deep in a
    worker, RayTaskError(RuntimeError): probability tensor contains either inf, nan or element < 0.)"""
    import shutil

    from safetensors.torch import load_file, save_file

    work, tokenizer, model = user
    broken = tmp_path / "model"
    shutil.copytree(model, broken)
    weights = load_file(broken / "model.safetensors")
    name = "model.layers.2.mlp.down_proj.weight"
    weights[name][3, 5] = float("nan")
    save_file(weights, str(broken / "model.safetensors"), metadata={"format": "pt"})
    data = work / "ok.jsonl"
    data.write_text(json.dumps({"prompt": "reverse 12", "answer": "21"}) + "\n")
    proc = megarl_here("train", f"model.path={broken}", f"data.train_files=[{data}]", "algorithm.reward_fn=exact_match",
                       "trainer.nproc_per_node=1", "algorithm.max_new_tokens=16", "data.prompts_per_step=2", f"trainer.run_dir={tmp_path / 'run'}",
                       cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"tensor '{name}' (in model.safetensors) holds 1 non-finite value(s)" in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and not (tmp_path / "run").exists()
    ok = megarl_here("train", "--dry-run", f"model.path={broken}", "model.check_finite=false",
                     f"data.train_files=[{data}]", "algorithm.reward_fn=exact_match", "trainer.nproc_per_node=1", "algorithm.max_new_tokens=16",
                     "data.prompts_per_step=2", f"trainer.run_dir={tmp_path / 'run'}", cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr[-3000:]  # the check can be turned off


def test_globs_hf_datasets_directories_epochs_and_order(user, tmp_path):
    """data.train_files takes globs (sorted matches) and HF ``datasets`` directories beside files;
    a DatasetDict's directory, a pattern without matches and a missing path are named; with
    trainer.total_epochs the run's steps follow from the prompts kept; data.shuffle=false draws
    in file order, true a seeded new order each epoch."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    from megarl.data.datasets import DataError, load_records
    from megarl.trainer.steps import PromptStream

    work, tokenizer, model = user
    rows = [{"prompt": f"reverse {i}{i + 1}", "answer": f"{i + 1}{i}"} for i in range(9)]
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train-0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:3]))
    pq.write_table(pa.Table.from_pylist(rows[3:5]), tmp_path / "data" / "train-1.parquet")
    datasets.Dataset.from_list(rows[5:]).save_to_disk(str(tmp_path / "hf" / "train"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[5:]),
                          "test": datasets.Dataset.from_list(rows[:1])}).save_to_disk(str(tmp_path / "dd"))
    files = [str(tmp_path / "data" / "train-*"), str(tmp_path / "hf" / "train")]
    records = load_records(files)
    assert [r.prompt for r in records] == [r["prompt"] for r in rows]
    assert [r.source.rsplit("/", 1)[-1] for r in records] == [
        "train-0.jsonl:1", "train-0.jsonl:2", "train-0.jsonl:3", "train-1.parquet:1", "train-1.parquet:2",
        "train:1", "train:2", "train:3", "train:4"]
    with pytest.raises(DataError, match=r"is a DatasetDict with splits \['train', 'test'\]: name one, e\.g\. .*dd/train"):
        load_records([str(tmp_path / "dd")])
    with pytest.raises(DataError, match=r"data.val_files: the pattern .*nothing-\*\.jsonl matches no file"):
        load_records([str(tmp_path / "nothing-*.jsonl")], key="data.val_files")
    with pytest.raises(DataError, match=r"dataset .*missing\.jsonl does not exist \(data.train_files\)"):
        load_records([str(tmp_path / "missing.jsonl")])

    proc = megarl_here("train", "--dry-run", f"model.path={model}", f"data.tokenizer={tokenizer}",
                       f"data.train_files=[{','.join(files)}]", "trainer.total_epochs=3", "data.prompts_per_step=2",
                       "algorithm.samples_per_prompt=2", "algorithm.reward_fn=exact_match", "trainer.nproc_per_node=1", "algorithm.max_new_tokens=16",
                       f"trainer.run_dir={tmp_path / 'run'}", cwd=work)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "trainer.total_epochs=3 over 9 prompts, 2 a step: trainer.train_steps=14" in proc.stdout  # ceil(27 / 2)
    # PRIME's accuracy filter draws oversample_factor x the prompts a step: ceil(2 x 1.5) = 3
    proc = megarl_here("train", "--dry-run", f"model.path={model}", f"data.tokenizer={tokenizer}",
                       f"data.train_files=[{','.join(files)}]", "trainer.total_epochs=3", "data.prompts_per_step=2",
                       "algorithm.samples_per_prompt=2", "algorithm.reward_fn=exact_match", "trainer.nproc_per_node=1",
                       "algorithm.max_new_tokens=16", "algorithm.filter_accuracy=true", "algorithm.oversample_factor=1.5",
                       f"trainer.run_dir={tmp_path / 'run'}", cwd=work)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "trainer.total_epochs=3 over 9 prompts, 3 a step: trainer.train_steps=9" in proc.stdout  # ceil(27 / 3)

    tok = load_tokenizer(str(tokenizer))
    in_order = PromptStream(records, tok, seed=7, max_prompt_tokens=100, shuffle=False)
    assert in_order.next(12) == records + records[:3]
    shuffled = PromptStream(records, tok, seed=7, max_prompt_tokens=100)
    epochs = [shuffled.next(9), shuffled.next(9)]
    assert all(sorted(r.source for r in e) == sorted(r.source for r in records) for e in epochs)  # each prompt once an epoch
    assert epochs[0] != records and epochs[0] != epochs[1]
    again = PromptStream(records, tok, seed=7, max_prompt_tokens=100)
    assert again.next(18) == epochs[0] + epochs[1]  # the seed decides the order
