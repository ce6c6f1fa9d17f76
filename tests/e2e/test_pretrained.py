"""Post-training a user's model, through the real entry points: a small HF Llama and a small
Qwen3-MoE, a Mistral sliding a window of 8 and a Qwen2-MoE, each with its own tokenizer (ChatML
template, two EOS ids) and briefly trained by plain transformers, go into ``megarl train
model.path=DIR`` at tp=2·pp=2 (Llama, 4 ranks), tp=2 (Mistral, 2 ranks) and tp=2·ep=2 (the MoEs,
2 ranks), the Qwen3-MoE with its rollout on vLLM (its CPU build; 2 ranks at tp=2·ep=2, heads of
32, vLLM's CPU attention's least; a dense model from an HF directory on vLLM, tied and at a real
small model's widths: tests/e2e/test_vllm.py). The first step's old log-probs (the trainer's) and
the rollout's equal transformers' log-probs of the same sequences (<= 1e-4), and the rollout's
equal the trainer's (``rollout/logp_max_abs_diff`` <= 1e-5); with lr=0, ``megarl export-hf`` gives back every
tensor bit-exact (GLM's router expert biases included: model.moe_router_bias_update_rate is 0),
and transformers loads the export with its tokenizer, generates and stops at an EOS id.
A GLM-4.5-style MoE (tp=2·ep=2) and a gpt-oss (tp=2·ep=2·etp=1: sinks, a window of 8 on every
other layer, biases, clamped SwiGLU) run the same way on the native engine, and so do a Qwen3-Next
and a Qwen3.5 vision-language checkpoint (gated delta nets, whose state the native rollout keeps
while it decodes, and gated attention; tp=2·ep=2), the latter's vision tower carried into the
export bit-exact, and a DeepSeek-V3 (tp=2·ep=2: MLA with low-rank q and kv under DeepSeek-V3's YaRN
rope and mscale, sigmoid routing by nonzero expert biases within a group limit, a shared expert,
a first dense layer), its router expert biases exported bit-exact as GLM's.

The Qwen2-MoE case's prompts come as verl's data preprocessing writes them (a parquet of
``data_source``, chat-message ``prompt``, ``reward_model.ground_truth`` and ``extra_info``), scored
by a verl-style ``compute_score`` file given as ``algorithm.reward_fn=verl_reward.py:compute_score``:
each row's reward is what the file computes from its data source, response, ground truth and
extra info.

Each case's run is a new interpreter started from the case's own directory, as a user types the
command, and the next case's run starts beside it (two runs keep 2 cores busier than one). The
Llama case's export also runs as a user types it; the others' run the same CLI ``main`` with
this process as the driver (no interpreter start-up and imports per command)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, Tuple

import pytest
import torch
from safetensors import safe_open

from tests.cli import Started, megarl, megarl_here
from tests.fixtures.hf_models import EOS_IDS, IM_START_ID, chat_examples, make_hf_model, make_tokenizer

ROOT = Path(__file__).resolve().parents[2]
TOL = 1e-4
LAYOUTS = {  # case -> (nproc, actor layout)
    "llama": (4, "{tp: 2, pp: 2}"),
    # an MoE on vLLM: its CPU experts' prepacking redone at every in-place reload (vllm_worker);
    # the trainer's old log-probs (the native model's) checked against transformers' too
    "qwen3_moe+vllm": (2, "{tp: 2, ep: 2, etp: 1}"),
    "mistral": (2, "{tp: 2}"),  # with a sliding window (WINDOW) shorter than its sequences
    "qwen2_moe": (2, "{tp: 2, ep: 2, etp: 1}"),  # shared expert and its gate, q/k/v bias
    "glm4_moe": (2, "{tp: 2, ep: 2, etp: 1}"),  # sigmoid router with expert bias, partial rope, qk norm
    # sinks (split over tp), a window (GPT_OSS_WINDOW) on every other layer, biases everywhere,
    # clamped SwiGLU; biased experts need etp=1
    "gpt_oss": (2, "{tp: 2, ep: 2, etp: 1}"),
    # gated delta nets (their decode state in the native rollout) and gated attention, zero-centred norms
    "qwen3_next": (2, "{tp: 2, ep: 2, etp: 1}"),
    # Qwen3.5's vision-language checkpoint: its text model trained, its vision tower carried into the export
    "qwen3_5_moe": (2, "{tp: 2, ep: 2, etp: 1}"),
    # MLA (low-rank q and kv, interleaved rope) with DeepSeek-V3's YaRN rope and mscale (DSV3_YARN),
    # sigmoid router with nonzero expert biases and a group limit, a shared expert, a first dense layer
    "deepseek_v3": (2, "{tp: 2, ep: 2, etp: 1}"),
}
ROLLOUT = {"qwen3_moe+vllm": ", engine: vllm"}
WINDOW = 8  # the chat prompts alone are longer
GPT_OSS_WINDOW = 8  # tiny-gpt-oss.json's, on its 1st and 3rd layers: the chat prompts alone are longer
# DeepSeek-V3's rope (factor 40 over 4096 positions, mscale = mscale_all_dim = 1: cos/sin unscaled,
# the softmax scaled by (0.1·ln(factor) + 1)²) at this model's length: 4 over 64 of its 256 positions
DSV3_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
             "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
OVERRIDES = {"qwen3_moe+vllm": {"num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 32},
             "mistral": {"sliding_window": WINDOW}, "gpt_oss": {"sliding_window": GPT_OSS_WINDOW},
             "deepseek_v3": {"rope_parameters": DSV3_YARN}}
# the same checkpoint read by transformers without its window: far other log-probs (the window mattered)
NO_WINDOW = {"mistral": (WINDOW, {"sliding_window": None}),
             "gpt_oss": (GPT_OSS_WINDOW, {"layer_types": ["full_attention"] * 4})}
# and without its YaRN rope, or without the softmax's mscale: far other log-probs (both mattered)
OTHER_ROPE = {"deepseek_v3": [{"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
                              {"rope_parameters": {**DSV3_YARN, "mscale_all_dim": 0.0}}]}
GAP_TOL = 1e-5  # the native rollout's log-probs vs the trainer's old log-probs, same tokens
def tensors(directory: Path) -> dict:
    out = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(path, "pt") as f:
            out.update({name: f.get_tensor(name) for name in f.keys()})
    return out


CASES = sorted(LAYOUTS)
SUBPROCESS = {"llama"}  # the cases whose export runs as a user types it (a new interpreter); the others in this one
# the cases whose prompts come as verl prepares them (a parquet of data_source, chat-message prompt,
# reward_model.ground_truth, extra_info), scored by a verl-style compute_score file, unchanged
VERL = {"qwen2_moe"}
VERL_SOURCE = "toy/reverse"
VERL_REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """verl's signature and dict result; every argument shows in the score."""
    assert data_source == "toy/reverse", data_source
    return {"score": float(solution_str.strip() == ground_truth) + extra_info["weight"], "source": data_source}
'''


def verl_weight(content: str) -> float:
    return (len(content) % 4) / 8  # the row's extra_info.weight


def write_verl_parquet(path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"data_source": VERL_SOURCE, "prompt": chat[:1], "ability": "reverse",
             "reward_model": {"style": "rule", "ground_truth": chat[1]["content"]},
             "extra_info": {"index": i, "split": "train", "weight": verl_weight(chat[0]["content"])}}
            for i, chat in enumerate(chat_examples(16, seed=7))]
    pq.write_table(pa.Table.from_pylist(rows), path)


def prepare(case: str, work: Path) -> None:
    """The user's model (an HF directory, briefly trained by transformers), its prompts and run.yaml."""
    kind = case.partition("+")[0]
    tokenizer = make_tokenizer(work / "tokenizer")
    model_dir = make_hf_model(kind, work / "model", tokenizer, overrides=OVERRIDES.get(case))
    data, reward = work / "prompts.jsonl", "exact_match"
    if case in VERL:  # as verl's data preprocessing writes it, and its reward file beside (a relative path)
        data, reward = work / "train.parquet", "verl_reward.py:compute_score"
        write_verl_parquet(data)
        (work / "verl_reward.py").write_text(VERL_REWARD)
    else:
        with data.open("w") as f:
            for chat in chat_examples(16, seed=7):
                f.write(json.dumps({"prompt": chat[:1], "answer": chat[1]["content"]}) + "\n")
    nproc, layout = LAYOUTS[case]
    (work / "run.yaml").write_text(f"""
model: {{path: {model_dir}}}
parallel: {{actor: {layout}, rollout: {{tp: 1{ROLLOUT.get(case, "")}}}}}
optimizer: {{lr: 0.0}}
data: {{train_files: [{data}], prompts_per_step: 4}}
algorithm: {{name: grpo, samples_per_prompt: 2, reward_fn: {reward}, max_new_tokens: 8}}
trainer: {{train_steps: 1, save_interval: 1, nproc_per_node: {nproc}, run_dir: {work / 'run'}}}
logging: {{backends: [console], progress_bar: false, rollout_dump_interval: 1}}
""")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each case's ``megarl train``, started in a new interpreter from the case's own directory
    (nothing relies on the repository's working directory), the next case's beside it: while
    one case's run is waited for, the next one's model is made and its run starts."""
    started: Dict[str, Tuple[Path, Started]] = {}

    def start(case: str) -> None:
        if case not in started:
            work = tmp_path_factory.mktemp(case.replace("+", "_"))
            prepare(case, work)
            started[case] = work, Started("train", str(work / "run.yaml"), cwd=work)

    try:
        yield started, start
    finally:
        for _, run in started.values():
            run.stop()


@pytest.fixture(scope="module", params=CASES)
def post_trained(request, runs, tmp_path_factory):
    case = request.param
    started, start = runs
    start(case)
    if CASES.index(case) + 1 < len(CASES):
        start(CASES[CASES.index(case) + 1])
    work, run = started[case]
    proc = run.wait()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    command = megarl if case in SUBPROCESS else megarl_here
    export = command("export-hf", str(work / "run"), str(work / "export"), cwd=tmp_path_factory.getbasetemp())
    assert export.returncode == 0, export.stdout[-3000:] + export.stderr[-3000:]
    return case, work / "model", work


def test_first_step_log_probs_equal_transformers(post_trained):
    import transformers

    kind, model_dir, work = post_trained
    rows = [json.loads(line) for line in (work / "run" / "rollouts" / "step_1.jsonl").read_text().splitlines()]
    assert len(rows) == 8 and all(r["response_ids"] for r in rows)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    worst = 0.0
    for row in rows:
        ids = torch.tensor([row["prompt_ids"] + row["response_ids"]])
        with torch.no_grad():
            logits = model(ids).logits[0].float()
        start = len(row["prompt_ids"])
        logp = torch.log_softmax(logits[start - 1:-1], dim=-1).gather(1, ids[0, start:, None]).squeeze(1)
        for key in ("old_log_probs", "rollout_log_probs"):
            worst = max(worst, (torch.tensor(row[key]) - logp).abs().max().item())
    assert worst <= TOL, f"{kind}: max |megarl - transformers| log-prob {worst:.2e}"
    # the native engine is the trainer's own model, and vLLM's log-probs in fp32 are the trainer's
    # as closely (the contract's bound): (nearly) the same numbers either way
    metrics = [json.loads(line) for line in (work / "run" / "metrics.jsonl").read_text().splitlines()]
    gap = metrics[0]["rollout/logp_max_abs_diff"]
    assert gap <= GAP_TOL, f"{kind}: first step's rollout vs trainer log-prob {gap:.2e}"
    if kind in NO_WINDOW:  # the window dropped keys of every row: without it, far other log-probs
        assert min(len(r["prompt_ids"]) for r in rows) > NO_WINDOW[kind][0]
    for other in ([NO_WINDOW[kind][1]] if kind in NO_WINDOW else []) + OTHER_ROPE.get(kind, []):
        full = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **other).eval()
        apart = 0.0
        for row in rows:
            ids = torch.tensor([row["prompt_ids"] + row["response_ids"]])
            with torch.no_grad():
                logp = torch.log_softmax(full(ids).logits[0, len(row["prompt_ids"]) - 1:-1], dim=-1)
            logp = logp.gather(1, ids[0, len(row["prompt_ids"]):, None]).squeeze(1)
            apart = max(apart, (torch.tensor(row["old_log_probs"]) - logp).abs().max().item())
        assert apart > 100 * TOL, (other, apart)
    # The chat template rendered the prompt, and a stop on either EOS id ended the response.
    assert rows[0]["prompt_ids"][0] == IM_START_ID and rows[0]["prompt_ids"][-11] == IM_START_ID  # "<|im_start|>assistant\n"
    assert rows[0]["prompt"].startswith("user\nreverse ") and rows[0]["prompt"].endswith("assistant\n")
    for row in rows:
        assert row["response_ids"][-1] in EOS_IDS or len(row["response_ids"]) == 8
    if kind in VERL:  # verl's compute_score scored each row, its data_source and extra_info given
        chats = {c[0]["content"]: c[1]["content"] for c in chat_examples(16, seed=7)}
        for row in rows:
            (content,) = [c for c in chats if f"user\n{c}" in row["prompt"]]
            expected = float(row["response"].strip() == chats[content]) + verl_weight(content)
            assert row["reward"] == pytest.approx(expected), (row["response"], chats[content], row["reward"])
        assert len({r["reward"] for r in rows}) > 1  # the weights differ between rows


def test_export_is_bit_exact_and_generates(post_trained):
    import transformers

    kind, model_dir, work = post_trained
    source, exported = tensors(model_dir), tensors(work / "export")
    assert sorted(exported) == sorted(source)
    for name, value in source.items():
        assert exported[name].dtype == value.dtype, name
        # glm4_moe's and deepseek_v3's router expert biases too: model.moe_router_bias_update_rate
        # is 0 (their aux-loss-free balancing moved them by 1e-3 a step at any lr before)
        assert torch.equal(exported[name], value), name
    if kind in ("glm4_moe", "deepseek_v3"):  # layers 1-3 are MoE
        biases = [v for n, v in source.items() if n.endswith(".mlp.gate.e_score_correction_bias")]
        assert len(biases) == 3
        assert all(b.abs().min() > 0 for b in biases)  # drawn nonzero (make_hf_model), as a real checkpoint's
    config = json.loads((work / "export" / "config.json").read_text())
    assert config["architectures"] and config.get("torch_dtype") == "float32"
    tok = transformers.AutoTokenizer.from_pretrained(work / "export")
    model = transformers.AutoModelForCausalLM.from_pretrained(work / "export").eval()
    assert list(model.generation_config.eos_token_id) == EOS_IDS
    prompt = tok.apply_chat_template([{"role": "user", "content": "reverse 1234"}], add_generation_prompt=True,
                                     return_tensors="pt", return_dict=True)
    out = model.generate(**prompt, max_new_tokens=24, do_sample=False)[0, prompt["input_ids"].shape[1]:]
    assert out[-1].item() in EOS_IDS and len(out) < 24, tok.decode(out)
