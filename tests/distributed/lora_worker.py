"""Worker for test_lora.py (ranks started by tests/distributed/launch.py). Prints ``RESULT {json}``
lines on rank 0.

``peft`` (one process): for a tiny Llama (LoRA on all seven HF projections) and a tiny Qwen3-MoE
(attention only), transformers makes the HF directory and peft a random rank-8 adapter (B
nonzero); megarl loads both through ``model.path`` + ``model.lora.path``. Reported: the logits
against transformers + peft, the base logits with the adapters off against transformers alone,
and every adapter gradient against peft's (a summed cross-entropy).
``layouts``: for each layout, the actor (PPO loss) takes 3 optimizer steps from the PEFT adapter
and saves its train state (adapters and their optimizer state only) as the run checkpoints do.
``compare``: every layout's saved adapters read back whole; its update (after - before) against
the single process's, per tensor (relative).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist

from megarl.config import ModelConfig, OptimizerConfig
from megarl.config.schema import LoRAConfig
from megarl.parallel import Layout, build_groups
from megarl.runtime import init_distributed, set_seed
from tests.distributed.parity_worker import grads_as_weights

MODELS = {"llama": ("configs/models/tiny-llama.json", ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                        "up_proj", "down_proj"]),
          "qwen3_moe": ("configs/models/tiny-qwen3-moe.json", ["q_proj", "k_proj", "v_proj", "o_proj"])}
TOKENS = torch.tensor([[5, 17, 42, 7, 99, 3, 249, 64, 12, 8, 1, 77],
                       [9, 9, 120, 33, 2, 45, 6, 200, 31, 4, 15, 60]])
SEED, STEPS = 1234, 3


def emit(record) -> None:
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(record), flush=True)


def make_hf(work: Path, name: str) -> None:
    """The HF model and a random PEFT adapter of ``name`` under ``work`` (once)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    config_file, targets = MODELS[name]
    if (work / "adapter" / name).exists():
        return
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_file))
    model.save_pretrained(work / "hf" / name)
    peft_model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=targets, lora_dropout=0.0,
                                                  init_lora_weights=False))
    peft_model.save_pretrained(work / "adapter" / name)


def model_config(work: Path, name: str, **lora) -> ModelConfig:
    hf = str(work / "hf" / name)
    return ModelConfig(hf_config=hf, path=hf, lora=LoRAConfig(path=str(work / "adapter" / name), **lora))


def peft(args) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from megarl.engines.train_state import build_train_state
    from megarl.models import lora

    init_distributed()
    work = Path(args.workdir)
    labels = TOKENS.roll(-1, dims=1)
    for name in MODELS:
        make_hf(work, name)
        base = AutoModelForCausalLM.from_pretrained(work / "hf" / name, dtype=torch.float32)
        with torch.no_grad():
            base_logits = base(TOKENS).logits
        hf_model = PeftModel.from_pretrained(base, work / "adapter" / name, is_trainable=True)
        hf_logits = hf_model(TOKENS).logits
        torch.nn.functional.cross_entropy(hf_logits.flatten(0, 1), labels.flatten(), reduction="sum").backward()
        hf_grads = {n: p.grad for n, p in hf_model.named_parameters() if "lora_" in n}

        groups = build_groups(Layout())
        set_seed(SEED, groups)
        state = build_train_state(model_config(work, name), OptimizerConfig(), groups, 1,
                                  init_checkpoint=str(work / "hf" / name))
        model = state.model[0]
        for chunk in state.model:
            chunk.zero_grad_buffer()
        vocab = hf_logits.shape[-1]
        position_ids = torch.arange(TOKENS.shape[1]).expand_as(TOKENS)
        logits = model(TOKENS, position_ids, None)[..., :vocab]
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum").backward()
        with torch.no_grad(), lora.adapters_off(state.model):
            off_logits = model(TOKENS, position_ids, None)[..., :vocab]
        grad_diff, compared = 0.0, 0
        trainable = [n for n, p in model.module.named_parameters() if p.requires_grad]
        args_ = lora_args(work, name)
        for adapter in lora.adapters(state.model):
            modules = lora.hf_modules(args_, adapter.layer, adapter.key)
            for part in adapter.parts:
                for x, ours in (("A", adapter.A[part]), ("B", adapter.B[part])):
                    theirs = hf_grads[f"base_model.model.{modules[part]}.lora_{x}.default.weight"]
                    grad_diff = max(grad_diff, ((ours.main_grad - theirs).abs().max() / theirs.abs().max()).item())
                    compared += 1
        emit({"check": "peft", "model": name,
              "logits": (logits - hf_logits).abs().max().item(),
              "logits_scale": hf_logits.abs().max().item(),
              "adapter_effect": (hf_logits - base_logits).abs().max().item(),
              "base_logits": (off_logits - base_logits).abs().max().item(),
              "grads_rel": grad_diff, "grads_compared": compared, "hf_lora_tensors": len(hf_grads),
              "trainable_non_adapter": [n for n in trainable if not lora.is_adapter_name(n)],
              "frozen_in_optimizer": sum(1 for g in state.optimizer.param_groups for p in g["params"]
                                         if not p.requires_grad)})
        groups.destroy()


def lora_args(work: Path, name: str):
    from megarl.models import megatron_args_from_hf

    return megatron_args_from_hf(str(work / "hf" / name))


def engine_batch(vocab: int, rows: int = 8, seq: int = 16):
    gen = torch.Generator().manual_seed(SEED + 100)
    tokens = torch.randint(3, vocab, (rows, seq + 1), generator=gen)
    lengths = torch.tensor([16, 9, 12, 5, 16, 7, 11, 14])[:rows]
    real = torch.arange(seq).unsqueeze(0) < lengths.unsqueeze(1)
    loss_mask = (real & (torch.arange(seq) >= 4)).float()
    return {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(), "loss_mask": loss_mask,
            "position_ids": torch.arange(seq).expand(rows, -1).contiguous(),
            "old_log_probs": -5.5 + 0.3 * torch.randn(rows, seq, generator=gen),
            "advantages": torch.randn(rows, 1, generator=gen).expand(-1, seq).contiguous()}, lengths


def layout_name(layout: Layout) -> str:
    return (f"t{layout.tp}p{layout.pp}d{layout.dp}e{layout.ep}" + (f"v{layout.vpp}" if layout.vpp else "")
            + (f"c{layout.cp}" if layout.cp > 1 else "")
            + ("nosp" if layout.tp > 1 and not layout.sequence_parallel else ""))


def layouts(args) -> None:
    from megarl.checkpoint.dist_ckpt import save_sharded, sharded_state_dict
    from megarl.checkpoint.train_state import save_train_state, trainable_only
    from megarl.engines.megatron_engine import MegatronEngine, MicroBatching
    from megarl.engines.train_state import build_train_state
    from megarl.roles.actor import Actor, ActorLossConfig

    init_distributed()
    work = Path(args.workdir)
    for spec in args.layouts:
        name, sizes = spec.split("@")
        sizes, _, flag = sizes.partition(":")  # ":nosp": tensor parallelism without sequence parallelism
        given = [int(x) for x in sizes.split(",")]
        tp, pp, dp, ep, vpp, cp = given + [0, 1][len(given) - 4:]
        layout = Layout(tp=tp, pp=pp, dp=dp, ep=ep, vpp=vpp or None, cp=cp, sequence_parallel=flag != "nosp")
        groups = build_groups(layout)
        set_seed(SEED, groups)
        vocab = lora_args(work, name).vocab_size
        batch, lengths = engine_batch(vocab)
        per = batch["tokens"].shape[0] // layout.dp
        rows = slice(groups.dp_rank * per, (groups.dp_rank + 1) * per)
        batch, lengths = {k: v[rows] for k, v in batch.items()}, lengths[rows]
        out = work / "ckpt" / name / layout_name(layout)
        loss_cfg = ActorLossConfig(agg_mode="seq-mean-token-mean")
        optim = OptimizerConfig(lr=1e-2, clip_grad=1.0)
        # the reduced gradients of one pass, whole on every DP rank (no distributed optimizer)
        state = build_train_state(model_config(work, name), optim, groups, STEPS, use_distributed_optimizer=False,
                                  init_checkpoint=str(work / "hf" / name))
        actor = Actor(MegatronEngine(state, vocab), loss_cfg)
        actor.engine.forward_backward(batch, lengths, actor._loss, MicroBatching(2))
        with grads_as_weights(state.model):
            save_sharded(trainable_only(state.model, sharded_state_dict(state.model, "default")), out / "grads")
        state = build_train_state(model_config(work, name), optim, groups, STEPS,
                                  use_distributed_optimizer=True, init_checkpoint=str(work / "hf" / name))
        actor = Actor(MegatronEngine(state, vocab), loss_cfg)
        losses = [actor.update(batch, lengths, MicroBatching(2))["loss"] for _ in range(STEPS)]
        save_train_state(state, out / "state")
        if dist.get_rank() == 0:
            (out / "losses.json").write_text(json.dumps(losses))
        if layout.tp == layout.pp == 1:
            check_merged_sync(state.model, lora_args(work, name), layout)
        groups.destroy()


def check_merged_sync(chunks, args, layout: Layout) -> None:
    """The colocated sync of a LoRA actor (t_g = 1: each rank's generation shard is its training
    model) sends W + (alpha/r) B A, computed one tensor at a time: the peak extra memory stays
    within the bucket plus the largest merged tensor, and no merged tensor stays allocated."""
    import torch

    from megarl.hybrid import ModelSpec, Resharder, regroup
    from megarl.models import lora

    model = ModelSpec.from_args(args)
    bucket = 64 << 10
    for delta in (False, True):
        resharder = Resharder.create(model, regroup(layout, 1, 1, 1, model.num_experts), chunks, bucket, delta=delta)
        for _ in range(2):
            out = resharder.sync()
        merged = lora.merged_weights(chunks[0])
        largest = max(m.numel() * m.element_size() for m in merged.tensors().values())
        peak = resharder.last.peak_extra_bytes
        assert peak <= (2 if delta else 1) * bucket + largest, (peak, bucket, largest)
        assert all(m.untyped_storage().size() == 0 for m in merged.tensors().values())
        for name, (linear, _) in merged.entries.items():
            want = linear.weight + linear.lora.delta_weight().to(linear.weight.dtype)
            assert torch.equal(out[name], want.detach()), name


def peft_as_megatron(work: Path, name: str):
    """The PEFT adapter's tensors under the checkpoint's keys (layers stacked): a column-parallel
    B and a row-parallel A are split along HF's own dims, so the global tensors are PEFT's."""
    from safetensors.torch import load_file

    from megarl.models import lora

    tensors = load_file(work / "adapter" / name / lora.ADAPTER_WEIGHTS)
    args = lora_args(work, name)
    out = {}
    for key, (_, parts) in lora.TARGETS.items():
        for part in parts:
            for x in "AB":
                try:
                    names = [lora.hf_modules(args, layer, key)[part] for layer in range(args.config_kwargs["num_layers"])]
                except lora.LoRAError:
                    continue
                per_layer = [tensors.get(f"base_model.model.{n}.lora_{x}.weight") for n in names]
                if all(t is not None for t in per_layer):
                    out[f"decoder.layers.{key}.lora.{x}.{part}"] = torch.stack(per_layer)
    return out


def compare(args) -> None:
    from megarl.checkpoint.dist_ckpt import read_tensor, tensor_keys, verify_dist_checkpoint
    from megarl.checkpoint.integrity import safe_reader

    work = Path(args.workdir)

    def adapters(path: Path):
        meta = verify_dist_checkpoint(path)
        reader = safe_reader(path)
        return {k: read_tensor(reader, k, meta.state_dict_metadata[k]) for k in tensor_keys(meta)}

    for name in MODELS:
        root = work / "ckpt" / name
        if not root.exists():
            continue
        init = peft_as_megatron(work, name)
        ref = {kind: adapters(root / "t1p1d1e1" / kind) for kind in ("grads", "state")}
        ref_losses = json.loads((root / "t1p1d1e1" / "losses.json").read_text())
        for run in sorted(p for p in root.iterdir() if p.name != "t1p1d1e1"):
            got = {kind: adapters(run / kind) for kind in ("grads", "state")}
            losses = json.loads((run / "losses.json").read_text())

            def rel(kind, base=None):
                want = ref[kind]
                return max(((got[kind][k] - want[k]).norm() / (want[k] - (0 if base is None else base[k])).norm()).item()
                           for k in want)

            print("RESULT " + json.dumps({
                "check": "layout", "model": name, "layout": run.name,
                "keys": sorted(got["state"]) == sorted(ref["state"]) == sorted(init),
                "grads_rel": rel("grads"), "adapters_rel": rel("state"), "update_rel": rel("state", init),
                "losses_rel": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))}), flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["peft", "layouts", "compare"])
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--layouts", nargs="*", default=[])
    args = parser.parse_args()
    {"peft": peft, "layouts": layouts, "compare": compare}[args.mode](args)
