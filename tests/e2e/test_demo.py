"""`make demo`'s workflow, shortened to a few steps per stage: the warm start's conversations →
supervised fine-tuning on them (megarl sft) → HF directory (export-hf) → GRPO from it
(model.path) → export-hf; every stage's output is there, transformers loads the final export with
its tokenizer and generates until EOS; the warm start's conversations, through the digit
tokenizer's chat template, are the RL prompts + responses token for token (and so are train-lm's
sequences); `mlflow ui` on the GRPO stage's store serves the run back over its REST API and the
web UI's page."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from megarl.data.digit_hf import build_digit_tokenizer
from megarl.data.tokenizer import DigitTokenizer
from megarl.tasks.reverse_digits import reverse_digits_batch, reverse_digits_conversations, reverse_digits_records

ROOT = Path(__file__).resolve().parents[2]


def test_warm_start_sequences_are_rl_prompts_plus_responses():
    hf, builtin = build_digit_tokenizer(), DigitTokenizer()
    assert len(hf) == builtin.vocab_size
    assert (hf.pad_token_id, hf.bos_token_id, hf.eos_token_id) == (0, 1, 2)
    assert hf.encode(builtin.CHARS) == builtin.prompt_ids(builtin.CHARS)  # every character, BOS first
    batch = reverse_digits_batch(step=0, batch_size=8, num_digits=4, seed=1)
    for tokens, labels, mask in zip(batch["tokens"], batch["labels"], batch["loss_mask"]):
        sequence = tokens.tolist() + labels[-1:].tolist()
        prompt = hf.decode(sequence[1:6])  # "d1d2d3d4="
        answer = prompt[:4][::-1]
        assert sequence == hf.encode(prompt) + hf.encode(answer, add_special_tokens=False) + [hf.eos_token_id]
        assert labels[mask.bool()].tolist() == hf.encode(answer, add_special_tokens=False) + [hf.eos_token_id]
    record = reverse_digits_records(1, 4, seed=1)[0]  # an RL prompt of the built-in task
    assert record.prompt.endswith("=") and hf.encode(record.prompt) == builtin.prompt_ids(record.prompt)


def test_warm_start_conversations_render_as_rl_prompts_plus_responses(tmp_path):
    """megarl sft's rows of the demo (scripts/demo_data.py) through the digit tokenizer's chat
    template: BOS, the prompt, the answer and EOS, the loss on the answer and EOS; the same
    tokenizer makes the GRPO stage's prompts (its chat template applied) the built-in ones."""
    from megarl.data.sft import chat_example
    from megarl.data.tokenizer import HFTokenizer
    from megarl.data.digit_hf import save_digit_tokenizer

    builtin = DigitTokenizer()
    save_digit_tokenizer(tmp_path, chat_template=True)
    tok = HFTokenizer(str(tmp_path))
    rows = reverse_digits_conversations(64, num_digits=4, seed=1, label_noise=0.3)
    noisy = 0
    for row in rows:
        prompt, answer = (m["content"] for m in row["messages"])
        example = chat_example(tok.tok, row["messages"], tok.eos_token_ids)
        assert example.ids == builtin.prompt_ids(prompt) + builtin.encode(answer) + [builtin.eos_token_id]
        assert example.mask == [0] * 6 + [1] * 5
        assert tok.prompt_ids(prompt) == builtin.prompt_ids(prompt)  # GRPO's prompt, through the template
        noisy += answer != prompt[:4][::-1]
    assert 0.4 < noisy / len(rows) < 0.95  # about 1 - 0.7^4 of the answers have a wrong digit


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """One shortened `make demo` for the module's tests: (its output directory, the process)."""
    out = tmp_path_factory.mktemp("demo") / "demo"
    env = dict(os.environ, DEMO_DIR=str(out), SFT_ARGS="trainer.train_steps=3", PYTHON=sys.executable,
               MEGARL=str(Path(sys.executable).parent / "megarl"))
    proc = subprocess.run(["bash", "scripts/demo.sh", "trainer.train_steps=2", "logging.progress_bar=false"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, proc


def test_demo_workflow(demo):
    out, proc = demo
    for number in range(1, 7):
        assert f"=== stage {number}/6" in proc.stdout
    assert len((out / "conversations.jsonl").read_text().splitlines()) == 8000
    sft = [json.loads(line) for line in (out / "sft" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in sft] == [1, 2, 3] and (out / "sft" / "checkpoints" / "step_000003").is_dir()
    assert "GRPO mean reward: " in proc.stdout
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in (out / "sft_hf").iterdir()} and list((out / "sft_hf").glob("*.safetensors"))
    assert len((out / "grpo" / "metrics.jsonl").read_text().splitlines()) == 2
    final = out / "final_hf"
    assert f"The post-trained model (Hugging Face: weights, config, generation config, tokenizer): {out}/final_hf" \
        in proc.stdout
    assert json.loads((final / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]

    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(final)
    model = AutoModelForCausalLM.from_pretrained(final)
    ids = tokenizer("1234=", return_tensors="pt").input_ids
    assert ids.tolist() == [DigitTokenizer().prompt_ids("1234=")]
    # sampled with a seed, so that an untrained model reaches EOS within the budget too
    torch.manual_seed(0)
    generated = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=True,
                               num_return_sequences=16)
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id == 2
    stopped = 0
    for row in generated[:, ids.shape[1]:].tolist():
        if tokenizer.eos_token_id in row:  # generation stopped there: only padding follows
            stopped += 1
            assert set(row[row.index(tokenizer.eos_token_id) + 1:]) <= {tokenizer.pad_token_id}, row
    assert stopped > 0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())


def test_mlflow_ui_serves_the_demo_run(demo):
    """The README's `mlflow ui --backend-store-uri sqlite:///runs/demo/grpo/mlflow.db`, on the
    demo's store: the server comes up within the deadline, its REST API lists the GRPO run with
    its metrics, and its root is the web UI's page (the full mlflow package: extra `ui`)."""
    out, _ = demo
    store = out / "grpo" / "mlflow.db"
    assert store.is_file()
    port = _free_port()
    env = dict(os.environ, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false")  # no job-runner process
    server = subprocess.Popen(
        [str(Path(sys.executable).parent / "mlflow"), "ui", "--backend-store-uri", f"sqlite:///{store}",
         "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
        cwd=out, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    api = f"http://127.0.0.1:{port}/api/2.0/mlflow"
    try:
        deadline, experiments = time.monotonic() + 180, None
        while experiments is None:
            assert server.poll() is None, server.stdout.read().decode()[-3000:]
            assert time.monotonic() < deadline, "mlflow ui did not answer within 180 s"
            try:
                experiments = _post(f"{api}/experiments/search", {"max_results": 100})["experiments"]
            except (urllib.error.URLError, ConnectionError, OSError):
                time.sleep(0.5)
        ids = [e["experiment_id"] for e in experiments if e["name"] == "megarl"]
        assert len(ids) == 1, experiments
        runs = _post(f"{api}/runs/search", {"experiment_ids": ids})["runs"]
        assert [r["info"]["run_name"] for r in runs] == ["grpo"] and runs[0]["info"]["status"] == "FINISHED"
        metrics = {m["key"]: m for m in runs[0]["data"]["metrics"]}
        assert "reward/mean" in metrics and metrics["reward/mean"]["step"] == 2, sorted(metrics)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=10) as response:
            assert b"<title>MLflow</title>" in response.read()  # the web UI's built page, not the landing-page error
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
