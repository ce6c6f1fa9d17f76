"""Worker for the layout-parity tests; run under torchrun (see test_layout_parity.py).

``run``: for each layout given, load the shared initial weights, record the loss and save the
gradients (DDP-reduced, as a dist checkpoint, so any layout can read them back whole), then
take 3 steps with the distributed optimizer and save the weights. Then, through the RL engine
(MegatronEngine with the actor's PPO loss at ``seq-mean-token-mean`` and an entropy bonus, which
need whole sequences), save the log-probs and entropies of a right-padded batch, padded and
packed, and the weights after one update of each. With ``--reference`` (one process, layout
(1,1,1,1)) it first writes the initial weights. A layout spec is ``t,p,d,e[,vpp[,cp]]`` with an
optional ``:selective`` or ``:full`` activation recompute.
``compare``: in one process, read every saved checkpoint back as full tensors and report the
relative differences against the reference layout as JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
from pathlib import Path

import torch

from megarl.checkpoint.dist_ckpt import load_model, save_model
from megarl.config import ModelConfig, OptimizerConfig
from megarl.engines import supervised
from megarl.engines.megatron_engine import MegatronEngine, MicroBatching
from megarl.engines.train_state import build_train_state
from megarl.models import build_model, megatron_args_from_hf
from megarl.parallel import Layout, build_groups
from megarl.runtime import init_distributed, set_seed

MODELS = {"dense": "configs/models/tiny-llama.json", "moe": "configs/models/tiny-qwen3-moe.json",
          "moe_aux": "configs/models/tiny-qwen3-moe.json", "qwen2_moe": "configs/models/tiny-qwen2-moe.json",
          "mistral_swa": "configs/models/tiny-mistral.json", "glm4_moe": "configs/models/tiny-glm4-moe.json",
          "gpt_oss": "configs/models/tiny-gpt-oss.json", "qwen3_next": "configs/models/tiny-qwen3-next.json",
          "qwen3_5_moe": "configs/models/tiny-qwen3-5-moe.json"}
# qwen3_next: gated delta nets (layers 1 and 3) and gated full attention (2 and 4), zero-centred
# norms, a shared expert with its gate, a dense layer (mlp_only_layers [1]); qwen3_5_moe: Qwen3.5's
# text model (every layer MoE, the delta net's projections apart in HF, the same Megatron modules)
# gpt_oss: tiny-gpt-oss.json as it is: a window of 8 on its 1st and 3rd layers over the SEQ-token
# rows, attention sinks, biases everywhere, clamped SwiGLU (swiglu_limit 0.1)
# mistral_swa: Mistral sliding a window of SWA over the SEQ-token rows (every layer); its config is
# tiny-mistral.json with that window, written to the work directory (see hf_config)
SWA = 6
# moe_aux: the MoE model with Megatron's load-balancing loss on (its gradient only; the reported
# loss excludes it), which every layout must reduce over the same tokens as the single process
AUX_LOSS_COEFF = {"moe_aux": 0.1}
# moe_aux runs the layouts that split a micro-batch's tokens (sp, cp) or change its padding
# (vpp pads micro-batches to one width, cp and packing pad sequences), and dp·ep
AUX_LAYOUTS = {"t1p1d1e1", "t2p1d1e1", "t1p1d2e2", "t1p2d1e1v2", "t1p1d1e1c2", "t2p1d1e1c2"}
# models run at a few layouts only (all others: every layout given, ep > 1 for MoE models only):
# the newer families at tp (and ep for the MoE, cp for the window, which crosses the CP chunks)
ONLY_LAYOUTS = {"moe_aux": AUX_LAYOUTS, "qwen2_moe": {"t1p1d1e1", "t2p1d1e1", "t1p1d2e2"},
                "mistral_swa": {"t1p1d1e1", "t2p1d1e1", "t1p1d1e1c2"},
                "glm4_moe": {"t1p1d1e1", "t2p1d1e1", "t1p1d2e2"},
                "gpt_oss": {"t1p1d1e1", "t2p1d1e2", "t1p1d2e2", "t1p2d1e1"},
                "qwen3_next": {"t1p1d1e1", "t2p1d1e1", "t1p1d2e2", "t1p2d1e1"},
                "qwen3_5_moe": {"t1p1d1e1", "t2p1d1e1", "t1p1d2e2"}}
# biased experts need expert tensor parallelism off: these models run every layout at etp=1, and
# they alone run the layouts that need it (t2p1d1e2: tp=2·ep=2 on two ranks, each tp rank holding
# other experts)
ETP1_MODELS = {"gpt_oss"}
ETP1_LAYOUTS = {"t2p1d1e2"}
DENSE_MODELS = {"dense", "mistral_swa"}


def hf_config(name: str, workdir: Path) -> str:
    if name != "mistral_swa":
        return MODELS[name]
    path = workdir / "tiny-mistral-swa.json"
    if not path.exists():  # every rank writes the same text; the rename is atomic
        config = {**json.loads(Path(MODELS[name]).read_text()), "sliding_window": SWA}
        path.parent.mkdir(parents=True, exist_ok=True)
        part = path.with_name(f"{path.name}.{os.getpid()}")
        part.write_text(json.dumps(config))
        os.replace(part, path)
    return str(path)


def model_config(name: str, workdir: Path, **kwargs) -> ModelConfig:
    return ModelConfig(hf_config=hf_config(name, workdir), moe_aux_loss_coeff=AUX_LOSS_COEFF.get(name), **kwargs)
GLOBAL_BATCH, SEQ, MICRO, STEPS, SEED = 8, 16, 2, 3, 1234


def make_batch(step: int, vocab: int):
    gen = torch.Generator().manual_seed(SEED + step)
    tokens = torch.randint(3, vocab, (GLOBAL_BATCH, SEQ + 1), generator=gen)
    loss_mask = torch.ones(GLOBAL_BATCH, SEQ)
    loss_mask[::3, :5] = 0  # a few masked prompt positions, as in RL batches
    return {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": loss_mask,
            "position_ids": torch.arange(SEQ).expand(GLOBAL_BATCH, -1).contiguous()}


@contextlib.contextmanager
def grads_as_weights(chunks):
    """Temporarily expose each trainable parameter's reduced gradient (DDP main_grad) as its data."""
    saved = []
    for chunk in chunks:
        for param in chunk.parameters():
            if not param.requires_grad:  # frozen (LoRA's base): no gradient
                continue
            saved.append((param, param.data))
            param.data = param.main_grad.detach().clone().to(param.dtype)
    try:
        yield
    finally:
        for param, data in saved:
            param.data = data


def nonzero_biases(chunks) -> None:
    """Megatron starts biases (qwen2_moe's q/k/v, gpt_oss's linear and expert ones) at zero, as no
    pretrained model has them: a tensor that is one optimizer step from zero would make the
    relative weight difference a ratio of rounding to that step (measured 8.9e-5 on
    linear_qkv.bias, 8.7e-8 absolute). The router's expert bias (glm4_moe; a buffer) gets random
    values too, so that it takes part in the routing; so do zero-centred norms (qwen3_next's, which
    start at 0)."""
    gen = torch.Generator().manual_seed(SEED + 7)
    with torch.no_grad():
        for chunk in chunks:
            for name, tensor in [*chunk.named_parameters(), *chunk.named_buffers()]:
                if name.endswith((".bias", ".expert_bias", "norm.weight")) and not tensor.any():
                    tensor.copy_(0.02 * torch.randn(tensor.shape, generator=gen))


def layout_name(layout: Layout, recompute: str = "") -> str:
    return (f"t{layout.tp}p{layout.pp}d{layout.dp}e{layout.ep}" + (f"v{layout.vpp}" if layout.vpp else "")
            + (f"c{layout.cp}" if layout.cp > 1 else "") + (f"r{recompute}" if recompute else ""))


ENGINE_LENGTHS = torch.tensor([16, 9, 12, 5, 16, 7, 11, 14])  # real tokens per row, right padding after
ENGINE_MODES = {"padded": MicroBatching(micro_batch_size=2), "packed": MicroBatching(micro_batch_size=2, packed=True)}


def engine_batch(vocab: int):
    """Rows for the RL engine: prompt tokens (the first 4) are not trained on; old log-probs
    near the policy's (ratios near 1, some clipped) and one advantage per row."""
    gen = torch.Generator().manual_seed(SEED + 100)
    tokens = torch.randint(3, vocab, (GLOBAL_BATCH, SEQ + 1), generator=gen)
    real = torch.arange(SEQ).unsqueeze(0) < ENGINE_LENGTHS.unsqueeze(1)
    loss_mask = (real & (torch.arange(SEQ) >= 4)).float()
    return {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(), "loss_mask": loss_mask,
            "position_ids": torch.arange(SEQ).expand(GLOBAL_BATCH, -1).contiguous(),
            "old_log_probs": -5.5 + 0.3 * torch.randn(GLOBAL_BATCH, SEQ, generator=gen),
            "advantages": torch.randn(GLOBAL_BATCH, 1, generator=gen).expand(-1, SEQ).contiguous()}


def engine_phase(model_cfg, optim_cfg, groups, init, run_dir, model_name) -> dict:
    """Log-probs/entropies (whole batch, saved by rank 0) and one actor update per mode."""
    from megarl.roles.actor import Actor, ActorLossConfig

    vocab = megatron_args_from_hf(model_cfg.hf_config).vocab_size
    dp, per = groups.layout.dp, GLOBAL_BATCH // groups.layout.dp
    rows = slice(groups.dp_rank * per, (groups.dp_rank + 1) * per)
    batch = {k: v[rows] for k, v in engine_batch(vocab).items()}
    results = {}
    for mode, how in ENGINE_MODES.items():
        state = build_train_state(model_cfg, optim_cfg, groups, 1, use_distributed_optimizer=False,
                                  init_checkpoint=str(init))
        engine = MegatronEngine(state, vocab)
        out = engine.forward_log_probs(batch, ENGINE_LENGTHS[rows], how)
        gathered = {}
        for key, value in out.items():
            parts = [torch.empty_like(value) for _ in range(dp)]
            torch.distributed.all_gather(parts, value, group=groups.pg.dp)
            gathered[key] = torch.cat(parts)
        actor = Actor(engine, ActorLossConfig(agg_mode="seq-mean-token-mean", entropy_coef=0.01))
        metrics = actor.update(batch, ENGINE_LENGTHS[rows], how)
        save_model(state.model, run_dir / f"engine_weights_{mode}")
        if torch.distributed.get_rank() == 0:
            torch.save(gathered, run_dir / f"engine_outputs_{mode}.pt")
        results[mode] = {"loss": metrics["loss"], "grad_norm": metrics["grad_norm"]}
    return results


# megarl sft's path (megarl.roles.sft: the real vocabulary's softmax, chat-shaped masks), padded
# and packed, at every layout of these models, and against transformers at one process
SFT_MODELS = {"dense", "moe"}


def sft_batch(vocab: int):
    """Conversation-shaped SFT rows of ENGINE_LENGTHS real tokens (random tokens after them, as
    right padding): two assistant spans trained, positions 3-5 and 8 to the row's end; the prompt
    and the turn between carry no loss."""
    gen = torch.Generator().manual_seed(SEED + 200)
    tokens = torch.randint(3, vocab, (GLOBAL_BATCH, SEQ + 1), generator=gen)
    position = torch.arange(SEQ)
    real = position.unsqueeze(0) < ENGINE_LENGTHS.unsqueeze(1)
    spans = ((position >= 3) & (position < 6)) | (position >= 8)
    return {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
            "loss_mask": (real & spans).float(), "position_ids": position.expand(GLOBAL_BATCH, -1).contiguous()}


def sft_phase(model_cfg, optim_cfg, groups, init, run_dir) -> dict:
    """The SFT loss's gradients (DDP-reduced, saved whole) and loss, padded and packed."""
    vocab = megatron_args_from_hf(model_cfg.hf_config).vocab_size
    batch = supervised.dp_shard(sft_batch(vocab), groups)
    state = build_train_state(model_cfg, optim_cfg, groups, 1, use_distributed_optimizer=False,
                              init_checkpoint=str(init))
    engine = MegatronEngine(state, vocab)  # megarl sft's learner: the real vocabulary
    losses, kept = {}, {}
    params = [(n, p) for chunk in state.model for n, p in chunk.named_parameters() if p.requires_grad]
    for mode, how in ENGINE_MODES.items():
        for chunk in state.model:
            chunk.zero_grad_buffer()
        losses[mode] = supervised.forward_backward(engine, batch, how)
        kept[mode] = [p.main_grad.clone() for _, p in params]
        with grads_as_weights(state.model):
            save_model(state.model, run_dir / f"sft_grads_{mode}")
    # the untrained positions' targets (prompt, tool output, padding) changed: nothing may move
    labels, untrained = batch["labels"].clone(), batch["loss_mask"] == 0
    labels[untrained] = 3 + (labels[untrained] + 7) % (vocab - 3)
    for chunk in state.model:
        chunk.zero_grad_buffer()
    loss = supervised.forward_backward(engine, batch | {"labels": labels}, ENGINE_MODES["padded"])
    losses["changed_targets_loss_diff"] = abs(loss - losses["padded"])
    losses["changed_targets_grad_diff"] = max((p.main_grad - g).abs().max().item()
                                              for (_, p), g in zip(params, kept["padded"]))
    losses["changed_targets"] = int(untrained.sum())
    return losses


DPO_BETA = 0.5  # the one-process DPO check (dense model): sft_batch's rows as 4 (chosen, rejected) pairs


def dpo_phase(model_cfg, optim_cfg, groups, init, run_dir) -> float:
    """megarl dpo's loss (megarl.roles.dpo) of the initial weights against a reference that is
    this run's weights after its 3 steps: its gradients saved whole, and the loss."""
    from megarl.engines.train_state import build_frozen_state
    from megarl.roles.dpo import DPOLearner

    vocab = megatron_args_from_hf(model_cfg.hf_config).vocab_size
    state = build_train_state(model_cfg, optim_cfg, groups, 1, use_distributed_optimizer=False,
                              init_checkpoint=str(init))
    reference = MegatronEngine(build_frozen_state(model_cfg, groups, str(run_dir / "weights")), vocab)
    learner = DPOLearner(MegatronEngine(state, vocab), reference, groups, MicroBatching(MICRO), DPO_BETA)
    for chunk in state.model:
        chunk.zero_grad_buffer()
    loss = learner.forward_backward(sft_batch(vocab))["loss"]
    with grads_as_weights(state.model):
        save_model(state.model, run_dir / "dpo_grads")
    return loss


def run(args) -> None:
    init_distributed()
    out = Path(args.workdir)
    for model_name in args.models:
        optim_cfg = OptimizerConfig(lr=1e-4, clip_grad=1.0, weight_decay=0.01)
        init = out / model_name / "init"
        for spec in args.layouts:
            sizes, recompute = spec.split(":") if ":" in spec else (spec, "")
            given = [int(x) for x in sizes.split(",")]
            tp, pp, dp, ep, vpp, cp = given + [0, 1][len(given) - 4:]  # vpp 0 = none, cp 1
            layout = Layout(tp=tp, pp=pp, dp=dp, ep=ep, vpp=vpp or None, cp=cp,
                            etp=1 if model_name in ETP1_MODELS else None)
            name = layout_name(layout, recompute)
            if (model_name in DENSE_MODELS and ep > 1) or name not in ONLY_LAYOUTS.get(model_name, (name,)) \
                    or (name in ETP1_LAYOUTS and model_name not in ETP1_MODELS):
                continue
            model_cfg = model_config(model_name, out, moe_token_dispatcher=args.dispatcher,
                                     recompute_granularity=recompute or None)
            groups = build_groups(layout)
            set_seed(SEED, groups)
            if args.reference and not init.exists():
                chunks = build_model(model_cfg, groups)
                nonzero_biases(chunks)
                save_model(chunks, init)
            vocab = 256
            run_dir = out / model_name / layout_name(layout, recompute)
            state = build_train_state(model_cfg, optim_cfg, groups, STEPS,
                                      use_distributed_optimizer=False, init_checkpoint=str(init))
            for chunk in state.model:
                chunk.zero_grad_buffer()
            # Core-attention calls of the forward-backward: recompute runs them again in the backward.
            calls = [0]
            hooks = [m.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
                     for chunk in state.model for m in chunk.modules() if type(m).__name__ == "SDPACoreAttention"]
            batch = supervised.dp_shard(make_batch(0, vocab), groups)
            loss = supervised.forward_backward(supervised.engine(state), batch, MicroBatching(MICRO))
            for hook in hooks:
                hook.remove()
            with grads_as_weights(state.model):
                save_model(state.model, run_dir / "grads")
            state = build_train_state(model_cfg, optim_cfg, groups, STEPS,
                                      use_distributed_optimizer=True, init_checkpoint=str(init))
            engine = supervised.engine(state)
            steps = [supervised.train_step(engine, supervised.dp_shard(make_batch(s, vocab), groups),
                                           MicroBatching(MICRO))
                     for s in range(STEPS)]
            save_model(state.model, run_dir / "weights")
            engine = engine_phase(model_cfg, optim_cfg, groups, init, run_dir, model_name)
            sft = sft_phase(model_cfg, optim_cfg, groups, init, run_dir) if model_name in SFT_MODELS else {}
            if model_name == "dense" and name == "t1p1d1e1":
                sft["dpo"] = dpo_phase(model_cfg, optim_cfg, groups, init, run_dir)
            if torch.distributed.get_rank() == 0:
                (run_dir / "losses.json").write_text(json.dumps({
                    "loss": loss, "attention_calls": calls[0], "step_losses": [m["loss"] for m in steps],
                    "grad_norms": [m["grad_norm"] for m in steps], "engine": engine, "sft": sft}))
            groups.destroy()


# one model per config to read checkpoints into (building one costs more than a load); cleared
# with the groups it was built under
_readers: dict = {}


def _full_tensors(model_cfg, groups, path, value_head: bool = False):
    key = (repr(model_cfg), value_head)
    if key not in _readers:
        chunks = build_model(model_cfg, groups)
        if value_head:
            from megarl.models.value_head import attach_value_head

            attach_value_head(chunks)
        _readers[key] = chunks
    chunks = _readers[key]
    with torch.no_grad():  # a tensor the load missed reads as NaN, not as the previous checkpoint's
        for param in chunks[0].parameters():
            param.fill_(float("nan"))
    load_model(chunks, path)
    return {k: v.detach().clone() for k, v in chunks[0].state_dict().items() if torch.is_tensor(v)}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    denom = b.double().norm().item()
    diff = (a.double() - b.double()).norm().item()
    return diff / denom if denom > 0 else diff


def transformers_sft(model_dir: Path, model_cfg, ref_losses) -> dict:
    """The single process's SFT loss and gradients against transformers on the same weights and
    batch: the initial weights and the reduced gradients go through megarl's Megatron -> HF
    converter (grads under HF names, read back as a model), transformers computes the token-mean cross entropy of the
    masked labels and its gradients in fp32. Relative differences: the loss, and the worst tensor."""
    import shutil

    import transformers
    from megarl.checkpoint.convert import mcore_to_hf

    config_dir = model_dir / "hf_config"
    config_dir.mkdir(exist_ok=True)
    shutil.copy2(model_cfg.hf_config, config_dir / "config.json")
    for source, dest in (("init", "hf_init"), ("t1p1d1e1/sft_grads_padded", "hf_sft_grads")):
        mcore_to_hf(model_dir / source, model_dir / dest, hf_config_dir=config_dir, hashes=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir / "hf_init", dtype=torch.float32).eval()
    batch = sft_batch(model.config.vocab_size)
    logits = model(input_ids=batch["tokens"], position_ids=batch["position_ids"]).logits.float()
    logp = torch.log_softmax(logits, -1).gather(-1, batch["labels"].unsqueeze(-1)).squeeze(-1)
    loss = -(logp * batch["loss_mask"]).sum() / batch["loss_mask"].sum()
    loss.backward()
    # the gradients read as a model, so transformers maps the names (fused experts) as for weights
    grads = transformers.AutoModelForCausalLM.from_pretrained(model_dir / "hf_sft_grads", dtype=torch.float32)
    ours = dict(grads.named_parameters())
    theirs = {name: p.grad for name, p in model.named_parameters()}
    worst = max(theirs, key=lambda k: _rel(ours[k], theirs[k]))
    return {"loss": abs(ref_losses["sft"]["padded"] - loss.item()) / loss.item(),
            "grads": _rel(ours[worst], theirs[worst]), "grads_worst_tensor": worst,
            "tensors": len(theirs), "tensors_compared": len(set(ours) & set(theirs))}


def float64_dpo(model_dir: Path, ref_losses) -> dict:
    """The one-process DPO loss and gradients against a direct float64 computation of DPO's
    formula with transformers on the same weights (the policy's initial ones, the reference's after
    the 3 steps, through megarl's converter) and batch: -mean log σ(β ((log π_c - log π_ref,c) -
    (log π_r - log π_ref,r))), each log π the sum over the row's masked tokens."""
    import transformers

    from megarl.checkpoint.convert import mcore_to_hf

    for source, dest in (("t1p1d1e1/weights", "hf_reference"), ("t1p1d1e1/dpo_grads", "hf_dpo_grads")):
        mcore_to_hf(model_dir / source, model_dir / dest, hf_config_dir=model_dir / "hf_config", hashes=False)
    load = transformers.AutoModelForCausalLM.from_pretrained
    policy = load(model_dir / "hf_init", dtype=torch.float64).eval()
    reference = load(model_dir / "hf_reference", dtype=torch.float64).eval()
    batch = sft_batch(policy.config.vocab_size)

    def sequence_log_probs(model) -> torch.Tensor:
        logits = model(input_ids=batch["tokens"], position_ids=batch["position_ids"]).logits
        token = torch.log_softmax(logits, -1).gather(-1, batch["labels"].unsqueeze(-1)).squeeze(-1)
        return (token * batch["loss_mask"].double()).sum(-1)

    with torch.no_grad():
        ref = sequence_log_probs(reference)
    pol = sequence_log_probs(policy)
    h = (pol[0::2] - ref[0::2]) - (pol[1::2] - ref[1::2])
    loss = -torch.nn.functional.logsigmoid(DPO_BETA * h).mean()
    loss.backward()
    grads = load(model_dir / "hf_dpo_grads", dtype=torch.float64)
    ours = dict(grads.named_parameters())
    theirs = {name: p.grad for name, p in policy.named_parameters()}
    worst = max(theirs, key=lambda k: _rel(ours[k], theirs[k]))
    return {"loss": abs(ref_losses["sft"]["dpo"] - loss.item()) / loss.item(), "grads": _rel(ours[worst], theirs[worst]),
            "grads_worst_tensor": worst, "tensors": len(theirs), "tensors_compared": len(set(ours) & set(theirs)),
            "h_abs_mean": h.abs().mean().item()}


def compare(args) -> None:
    init_distributed()
    out = Path(args.workdir)
    report = {}
    for model_name in args.models:
        model_cfg = model_config(model_name, out)
        groups = build_groups(Layout())
        ref_dir = out / model_name / "t1p1d1e1"
        ref = {kind: _full_tensors(model_cfg, groups, ref_dir / kind)
               for kind in ["grads", "weights"] + [f"engine_weights_{mode}" for mode in ENGINE_MODES]}
        if model_name in SFT_MODELS:
            ref["sft_grads"] = _full_tensors(model_cfg, groups, ref_dir / "sft_grads_padded")
        ref_losses = json.loads((ref_dir / "losses.json").read_text())
        for run_dir in sorted(p for p in (out / model_name).iterdir() if p.name.startswith("t")):
            losses = json.loads((run_dir / "losses.json").read_text())
            entry = {
                "attention_calls_vs_reference": losses["attention_calls"] / ref_losses["attention_calls"],
                "loss": abs(losses["loss"] - ref_losses["loss"]) / abs(ref_losses["loss"]),
                "step_losses": max(abs(a - b) / abs(b) for a, b in zip(losses["step_losses"], ref_losses["step_losses"])),
                "grad_norms": max(abs(a - b) / abs(b) for a, b in zip(losses["grad_norms"], ref_losses["grad_norms"])),
            }
            real = (torch.arange(SEQ).unsqueeze(0) < ENGINE_LENGTHS.unsqueeze(1)).double()
            for mode in ENGINE_MODES:
                ref_out = torch.load(ref_dir / f"engine_outputs_{mode}.pt")
                got_out = torch.load(run_dir / f"engine_outputs_{mode}.pt")
                for key in ("log_probs", "entropy"):  # max abs diff on real tokens, plus anything past them
                    entry[f"engine_{key}_{mode}"] = ((got_out[key].double() - ref_out[key].double()).abs() * real).max().item() \
                        + (got_out[key] * (1 - real)).abs().max().item()
                for key in ("loss", "grad_norm"):
                    want = ref_losses["engine"][mode][key]
                    entry[f"engine_{key}_{mode}"] = abs(losses["engine"][mode][key] - want) / abs(want)
            # the same layout's packed run against its padded one (the loss sees rows either way)
            padded, packed = (torch.load(run_dir / f"engine_outputs_{mode}.pt") for mode in ("padded", "packed"))
            entry["packed_vs_padded_log_probs"] = max(
                ((packed[key].double() - padded[key].double()).abs() * real).max().item() for key in ("log_probs", "entropy"))
            entry["packed_vs_padded_loss"] = max(
                abs(losses["engine"]["packed"][key] - losses["engine"]["padded"][key]) / abs(losses["engine"]["padded"][key])
                for key in ("loss", "grad_norm"))
            weights = {mode: _full_tensors(model_cfg, groups, run_dir / f"engine_weights_{mode}") for mode in ENGINE_MODES}
            entry["packed_vs_padded_weights"] = max(_rel(weights["packed"][k], weights["padded"][k]) for k in weights["padded"])
            for kind in ["grads", "weights"] + [f"engine_weights_{mode}" for mode in ENGINE_MODES]:
                got = _full_tensors(model_cfg, groups, run_dir / kind)
                assert got.keys() == ref[kind].keys(), f"{run_dir}/{kind}: tensor names differ"
                worst = max(ref[kind], key=lambda k: _rel(got[k], ref[kind][k]))
                entry[kind] = _rel(got[worst], ref[kind][worst])
                entry[kind + "_worst_tensor"] = worst
                entry[kind + "_nonzero"] = sum(int(v.abs().sum() > 0) for v in got.values())
            if model_name in SFT_MODELS:  # each mode against the single process's padded run
                for key in ("changed_targets_loss_diff", "changed_targets_grad_diff", "changed_targets"):
                    entry[f"sft_{key}"] = losses["sft"][key]
                want = ref_losses["sft"]["padded"]
                for mode in ENGINE_MODES:
                    entry[f"sft_loss_{mode}"] = abs(losses["sft"][mode] - want) / abs(want)
                    got = _full_tensors(model_cfg, groups, run_dir / f"sft_grads_{mode}")
                    entry[f"sft_grads_{mode}"] = max(_rel(got[k], ref["sft_grads"][k]) for k in ref["sft_grads"])
            report[f"{model_name}/{run_dir.name}"] = entry
        if model_name in SFT_MODELS:
            report[f"sft_transformers/{model_name}"] = transformers_sft(out / model_name, model_cfg, ref_losses)
        if model_name == "dense":
            report["dpo_float64/dense"] = float64_dpo(out / model_name, ref_losses)
        groups.destroy()
        _readers.clear()
    Path(args.report).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["run", "compare"])
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--layouts", nargs="*", default=["1,1,1,1"])
    parser.add_argument("--reference", action="store_true")
    parser.add_argument("--dispatcher", default="alltoall")
    parser.add_argument("--report", default="")
    args = parser.parse_args()
    run(args) if args.mode == "run" else compare(args)
