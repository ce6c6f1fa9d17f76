"""LoRA post-training of a user's model through the real entry points: an HF Llama with its own
tokenizer (tests/fixtures/hf_models.py; two heads of 32, vLLM's CPU attention's least) and a
PEFT adapter made by peft (rank 8, all seven projections, random A and B), into ``megarl train
model.path=DIR model.lora.path=ADAPTER``; the adapter also trains the final norm whole (PEFT's
``modules_to_save``).

On vLLM (colocated, tp=2 -> t_g=1), 3 GRPO steps with a KL term (the reference is the actor with
its adapters off):
- the first step's old and rollout log-probs equal transformers + peft's (<= 1e-4), and the
  reference's equal transformers' without the adapter;
- every step's rollout log-probs equal the trainer's (<= 1e-4): the merged sync is exact after
  the adapters change, and after the first sync vLLM is handed only the adapted tensors;
- the checkpoint holds the adapters only; ``megarl export-hf`` writes the merged model, bit for
  bit the base plus (alpha/r) B A of the exported adapter, and with ``--adapter`` a PEFT directory
  that peft loads onto the base, giving the merged export's logits (<= 1e-5).
PPO on the native engine with split placement, where every sync after the first sends only the
merged projections: a run killed (SIGKILL) after its step-2 checkpoint resumes to the uninterrupted run's
final adapters and metrics, bit for bit.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.cli import megarl_here
from tests.e2e.test_pretrained import tensors
from tests.fixtures.hf_models import chat_examples, make_hf_model, make_tokenizer
from tests.ray_cluster import joined

ROOT = Path(__file__).resolve().parents[2]
TOL = 1e-4
HEADS_32 = {"num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 32}
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
COMPARED = ("reward/mean", "actor/loss", "actor/grad_norm", "actor/kl", "critic/loss", "response/length_mean")


def env():
    return dict(os.environ, PYTHONPATH=str(ROOT), PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1",
                RAY_AUTH_MODE="disabled")


def train_command(config: Path, *overrides: str):
    args = ("train", str(config), *overrides)
    return [sys.executable, "-m", "megarl.cli", *args, *joined(args)]


@pytest.fixture(scope="module")
def user(tmp_path_factory):
    """The user's HF model, its PEFT adapter and prompts, and the run config (without run_dir)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    work = tmp_path_factory.mktemp("lora")
    tokenizer = make_tokenizer(work / "tokenizer")
    model_dir = make_hf_model("llama", work / "model", tokenizer, overrides=HEADS_32)
    torch.manual_seed(3)
    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir),
                                LoraConfig(r=8, lora_alpha=16, init_lora_weights=False,
                                           target_modules=list(PROJECTIONS), modules_to_save=["model.norm"]))
    with torch.no_grad():  # a small adapter (and a rescaled final norm): the policy stays close to the base
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.mul_(0.05)
            elif "modules_to_save" in name:
                param.mul_(1.1)
    peft_model.save_pretrained(work / "adapter")
    data = work / "prompts.jsonl"
    with data.open("w") as f:
        for chat in chat_examples(16, seed=7):
            f.write(json.dumps({"prompt": chat[:1], "answer": chat[1]["content"]}) + "\n")
    (work / "run.yaml").write_text(f"""
model: {{path: {model_dir}, lora: {{path: {work / 'adapter'}}}}}
parallel: {{actor: {{tp: 2}}, rollout: {{tp: 1}}}}
optimizer: {{lr: 1.0e-3}}
data: {{train_files: [{data}], prompts_per_step: 4}}
algorithm: {{name: grpo, samples_per_prompt: 2, reward_fn: exact_match, max_new_tokens: 8, kl_coef: 0.05}}
trainer: {{nproc_per_node: 2, save_interval: 0}}
logging: {{backends: [console], progress_bar: false}}
""")
    return work, model_dir


@pytest.fixture(scope="module")
def vllm_run(user):
    work, model_dir = user
    run = work / "vllm"
    proc = megarl_here("train", str(work / "run.yaml"), "parallel.rollout.engine=vllm", "trainer.train_steps=3",
                       "trainer.save_interval=3", "logging.rollout_dump_interval=1", f"trainer.run_dir={run}", cwd=work)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    for extra in ([], ["--adapter"]):
        out = work / ("adapter_export" if extra else "merged_export")
        export = megarl_here("export-hf", str(run), str(out), *extra, cwd=work)
        assert export.returncode == 0, export.stdout[-3000:] + export.stderr[-3000:]
    return run


def tensor_bytes(model_dir: Path) -> dict:
    return {name: t.numel() * t.element_size() for name, t in tensors(model_dir).items()}


@pytest.fixture(scope="module")
def adapter_run(user):
    """Fresh rank-8 adapters served by vLLM itself (parallel.rollout.lora_sync=adapter); an entropy
    bonus moves them whatever the rewards."""
    work, _ = user
    run = work / "vllm_adapter"
    proc = megarl_here("train", str(work / "run.yaml"), "parallel.rollout.engine=vllm",
                       "parallel.rollout.lora_sync=adapter", "model.lora.path=null", "model.lora.rank=8",
                       "optimizer.lr=1.0e-2", "algorithm.entropy_coef=0.01", "trainer.train_steps=3",
                       f"trainer.run_dir={run}", cwd=work)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return run


def test_vllm_serves_the_adapters_with_the_trainers_log_probs(adapter_run):
    """lora_sync=adapter: the engine gets the base once (at start-up; no sync moves a base tensor
    again) and each sync the whole adapters (rank 8 on the seven projections of 4 layers), as a
    PEFT directory it serves; its log-probs equal the trainer's at every step, as the adapters change."""
    rows = [json.loads(line) for line in (adapter_run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    hidden, ffn, qkv = 64, 128, 3 * 64  # the fixture's model: two heads of 32
    per_layer = 8 * ((hidden + qkv) + (hidden + hidden) + 2 * (hidden + ffn) + (ffn + hidden)) + 8 * 2 * hidden
    for r in rows:
        assert r["rollout/logp_max_abs_diff"] <= TOL and r["actor/grad_norm"] > 0, r
        assert r["sync/bytes_received"] == 0, r
        assert r["sync/engine_bytes"] == 4 * per_layer * 4, (r["sync/engine_bytes"], 4 * per_layer * 4)


def token_log_probs(model, row) -> torch.Tensor:
    ids = torch.tensor([row["prompt_ids"] + row["response_ids"]])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    start = len(row["prompt_ids"])
    return torch.log_softmax(logits[start - 1:-1], dim=-1).gather(1, ids[0, start:, None]).squeeze(1)


def test_first_step_log_probs_equal_transformers_and_peft(user, vllm_run):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    work, model_dir = user
    rows = [json.loads(line) for line in (vllm_run / "rollouts" / "step_1.jsonl").read_text().splitlines()]
    assert len(rows) == 8 and all(r["response_ids"] for r in rows)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ref = {i: token_log_probs(base, row) for i, row in enumerate(rows)}
    adapted = PeftModel.from_pretrained(base, work / "adapter").eval()
    worst, worst_ref, moved = 0.0, 0.0, 0.0
    for i, row in enumerate(rows):
        logp = token_log_probs(adapted, row)
        for key in ("old_log_probs", "rollout_log_probs"):
            worst = max(worst, (torch.tensor(row[key]) - logp).abs().max().item())
        worst_ref = max(worst_ref, (torch.tensor(row["ref_log_probs"]) - ref[i]).abs().max().item())
        moved = max(moved, (logp - ref[i]).abs().max().item())
    assert moved > 10 * TOL, "the adapter does not change the policy: the test could not tell"
    assert worst <= TOL, f"max |megarl - transformers+peft| log-prob {worst:.2e}"
    assert worst_ref <= TOL, f"the reference (adapters off) is {worst_ref:.2e} from transformers' base"


def test_merged_sync_is_exact_and_sends_only_adapted_tensors(user, vllm_run):
    """Every sync of the run comes after the engine's first load (at start-up). The micro-DP
    all-gather (tp=2 -> 1) moves only the merged projections: each rank receives the other's half
    of them; frozen tensors (embedding, output layer, norms) never move again. vLLM is handed
    whole decoder layers (its layerwise reload takes a fused module whole), never the embedding
    or the output layer."""
    _, model_dir = user
    nbytes = tensor_bytes(model_dir)
    adapted = sum(n for name, n in nbytes.items() if name.split(".")[-2] in PROJECTIONS)
    layers = sum(n for name, n in nbytes.items() if name.startswith("model.layers."))
    rows = [json.loads(line) for line in (vllm_run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["rollout/logp_max_abs_diff"] <= TOL and r["actor/grad_norm"] > 0, r
        assert r["sync/bytes_received"] == adapted // 2, (r["sync/bytes_received"], adapted)
        # and the final norm, trained whole (modules_to_save)
        engine = layers + nbytes["model.norm.weight"]
        assert r["sync/engine_bytes"] == engine < sum(nbytes.values()), (r["sync/engine_bytes"], engine)


def test_checkpoint_holds_adapters_and_exports_merge_exactly(user, vllm_run):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from megarl.checkpoint.dist_ckpt import tensor_keys, verify_dist_checkpoint

    work, model_dir = user
    actor = vllm_run / "checkpoints" / "step_000003" / "actor"
    keys = tensor_keys(verify_dist_checkpoint(actor))
    assert "decoder.final_layernorm.weight" in keys  # trained whole
    assert all(".lora." in k for k in keys if k != "decoder.final_layernorm.weight"), keys
    base, merged = tensors(model_dir), tensors(work / "merged_export")
    adapter = load_file(work / "adapter_export" / "adapter_model.safetensors")
    config = json.loads((work / "adapter_export" / "adapter_config.json").read_text())
    assert config["r"] == 8 and config["lora_alpha"] == 16 and config["base_model_name_or_path"] == str(model_dir)
    original = load_file(work / "adapter" / "adapter_model.safetensors")
    assert sorted(adapter) == sorted(original)
    assert any(not torch.equal(adapter[k], original[k]) for k in adapter), "the adapters did not train"
    assert sorted(merged) == sorted(base)
    assert config["modules_to_save"] == ["model.norm"]
    assert not torch.equal(adapter["base_model.model.model.norm.weight"], original["base_model.model.model.norm.weight"])
    adapted = 0
    for name, weight in base.items():
        module = "base_model.model." + name[:-len(".weight")]
        if f"{module}.lora_A.weight" in adapter:  # by hand: W + (alpha/r) B A
            a, b = adapter[f"{module}.lora_A.weight"], adapter[f"{module}.lora_B.weight"]
            weight = (weight.float() + (b.float() @ a.float()) * (16 / 8)).to(weight.dtype)
            adapted += 1
        elif f"base_model.model.{name}" in adapter:  # trained whole: the run's own tensor
            weight = adapter[f"base_model.model.{name}"]
        assert torch.equal(merged[name], weight), name
    assert adapted == 7 * 4
    ids = torch.tensor([[5, 17, 42, 7, 99, 3, 64, 12]])
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(work / "merged_export").eval()(ids).logits
        peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), work / "adapter_export")
        got = peft.eval()(ids).logits
    assert (got - want).abs().max().item() <= 1e-5


def test_a_killed_lora_run_resumes_to_the_same_adapters(user):
    """PPO (the critic: adapters on its backbone, a full value head; both resumed) with split
    placement (2 training ranks, 1 rollout rank): after the sync at start-up, each sync sends the
    merged projections only (the frozen rest once per rollout process)."""
    work, model_dir = user
    whole, killed = work / "whole", work / "killed"
    steps = ["trainer.train_steps=4", "trainer.save_interval=2", "trainer.placement=split", "parallel.rollout.nproc=1",
             "algorithm.name=ppo"]
    done = megarl_here("train", str(work / "run.yaml"), *steps, f"trainer.run_dir={whole}", cwd=work)
    assert done.returncode == 0, done.stderr[-3000:]
    proc = subprocess.Popen(train_command(work / "run.yaml", *steps, f"trainer.run_dir={killed}"), cwd=work,
                            env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    latest, deadline = killed / "checkpoints" / "latest", time.time() + 600
    try:
        while not (latest.is_file() and latest.read_text() == "step_000002"):
            assert proc.poll() is None and time.time() < deadline, "the run ended before its checkpoint of step 2"
            time.sleep(0.02)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the driver and what it started in its session
        proc.wait()
    assert not (killed / "final.json").exists(), "killed too late: the run had finished"
    resumed = megarl_here("train", str(work / "run.yaml"), *steps, f"trainer.run_dir={killed}", cwd=work)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming after step 2" in resumed.stdout
    a, b = ([json.loads(line) for line in (r / "metrics.jsonl").read_text().splitlines()] for r in (whole, killed))
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    for x, y in zip(a, b):
        assert {k: x[k] for k in COMPARED} == {k: y[k] for k in COMPARED}, x["step"]
    nbytes = tensor_bytes(model_dir)
    adapted = sum(n for name, n in nbytes.items() if name.split(".")[-2] in PROJECTIONS) + nbytes["model.norm.weight"]
    for r in a + b:
        assert r["rollout/logp_max_abs_diff"] <= TOL and r["sync/bytes_over_shard_max"] == 0, r
        assert r["sync/bytes_received"] == adapted, (r["sync/bytes_received"], adapted)
    for r in (whole, killed):
        assert megarl_here("export-hf", str(r), str(r / "adapter"), "--adapter", cwd=work).returncode == 0
    from safetensors.torch import load_file

    final_a, final_b = (load_file(r / "adapter" / "adapter_model.safetensors") for r in (whole, killed))
    assert sorted(final_a) == sorted(final_b)
    for k in final_a:
        assert torch.equal(final_a[k], final_b[k]), k
    # its checkpoint holds adapters, not a model: as a model.path it is refused, saying what to use
    again = megarl_here("train", str(work / "run.yaml"), f"model.path={whole / 'checkpoints' / 'step_000004'}",
                   "model.lora.path=null", "model.lora.rank=8", f"trainer.run_dir={work / 'again'}", cwd=work)
    assert again.returncode == 2 and "is a LoRA run's checkpoint: it holds the adapters" in again.stderr, again.stderr
