"""Worker for test_convert.py (run under torchrun). Prints ``RESULT {json}`` lines on rank 0.

``convert``: for each ``name@tp,pp,ep`` spec: HF -> Megatron in that layout, then Megatron -> HF
with the same processes (ranks split the tensors), into WORK/mc/<name>-<layout> and WORK/rt/....
``logits``: load every Megatron checkpoint in WORK/mc at tp = world size (whatever layout it was
converted in), compare its logits with transformers' on the source HF model, and check the
round-trip HF checkpoint: bit-exact tensors, and loadable by AutoModelForCausalLM; then the
Megatron-LM interoperability checks (:func:`interop`) at tp = world size.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from megarl.checkpoint.convert import hf_to_mcore, mcore_to_hf
from megarl.config import ModelConfig, ParallelConfig
from megarl.parallel import Layout, build_groups
from megarl.runtime import init_distributed, set_seed

TOKENS = torch.tensor([[5, 17, 42, 7, 99, 3, 250 - 1, 64, 12, 8, 1, 77],
                       [9, 9, 120, 33, 2, 45, 6, 200, 31, 4, 15, 60]])


def emit(record) -> None:
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(record), flush=True)


def layout_tag(tp: int, pp: int, ep: int) -> str:
    return f"t{tp}p{pp}e{ep}w{dist.get_world_size()}"


def convert(work: Path, specs) -> None:
    for spec in specs:
        name, sizes = spec.split("@")
        tp, pp, ep = (int(x) for x in sizes.split(","))
        tag = f"{name}-{layout_tag(tp, pp, ep)}"
        hf_to_mcore(work / "hf" / name, work / "mc" / tag,
                    ParallelConfig(tp=tp, pp=pp, ep=ep, etp=1 if ep > 1 else None))
        mcore_to_hf(work / "mc" / tag, work / "rt" / tag)
        emit({"check": "converted", "tag": tag})


def megatron_logits(ckpt: Path, groups, hf_config: Path = None) -> torch.Tensor:
    from megarl.checkpoint.dist_ckpt import load_model
    from megarl.models import build_model

    model_cfg = ModelConfig(hf_config=str(hf_config or ckpt / "hf"))
    chunks = build_model(model_cfg, groups, initialize=False)
    load_model(chunks, ckpt)
    return gathered_logits(chunks[0], groups)


def gathered_logits(model, groups) -> torch.Tensor:
    model = model.eval()
    positions = torch.arange(TOKENS.shape[1]).expand_as(TOKENS)
    with torch.no_grad():
        logits = model(TOKENS, positions, None)  # [b, s, vocab/tp]
    parts = [torch.empty_like(logits) for _ in range(groups.layout.tp)]
    dist.all_gather(parts, logits.contiguous(), group=groups.pg.tp)
    return torch.cat(parts, dim=-1)


def hf_logits(path: Path) -> torch.Tensor:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        return model(TOKENS).logits


def bit_exact(source: Path, round_trip: Path) -> dict:
    from safetensors.torch import load_file

    def tensors(path):
        out = {}
        for f in sorted(path.glob("*.safetensors")):
            out.update(load_file(f))
        return out

    a, b = tensors(source), tensors(round_trip)
    differing = sorted(k for k in a.keys() & b.keys() if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k]))
    return {"same_names": sorted(a) == sorted(b), "differing": differing[:5], "count": len(a),
            "index": (round_trip / "model.safetensors.index.json").is_file()}


def plain_megatron_model(hf_dir: Path, groups):
    """A GPTModel built the way Megatron-LM builds one without Transformer Engine: megatron-core's
    own local layer specs (``get_gpt_decoder_block_spec``, its core attention and norms
    included: they run on CPU in megarl's CPU mode), nothing of megarl's but the
    hyperparameters (megarl's TransformerConfig for the HF config). An all-MoE layer pattern is
    the int 1, Megatron-LM's default ``--moe-layer-freq``."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from megarl.models.builder import transformer_config
    from megarl.models.hf_config import megatron_args_from_hf, padded_vocab_size

    model_cfg = ModelConfig(hf_config=str(hf_dir))
    args = megatron_args_from_hf(model_cfg.hf_config)
    config = transformer_config(args, groups, model_cfg, initialize=False)
    if isinstance(config.moe_layer_freq, list) and set(config.moe_layer_freq) == {1}:
        config.moe_layer_freq = 1
    config.sequence_parallel = False  # the local spec's torch norm refuses it (no apex); keys are alike
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    return GPTModel(config=config, transformer_layer_spec=spec,
                    vocab_size=padded_vocab_size(args.vocab_size, model_cfg.make_vocab_size_divisible_by),
                    max_sequence_length=args.max_position_embeddings, pre_process=True, post_process=True,
                    share_embeddings_and_output_weights=args.tie_word_embeddings, position_embedding_type="rope",
                    rotary_base=args.config_kwargs["rotary_base"], rotary_percent=args.rotary_percent,
                    pg_collection=groups.pg)


INTEROP = ["tiny-llama", "tiny-qwen3-moe"]


def interop(work: Path, groups) -> None:
    """Megatron-LM <-> megarl, both directions, with megatron-core's default sharded_state_dict
    (no metadata) on the Megatron-LM side: (a) megarl's hf-to-mcore output (converted at world
    size 1) loads into a plain megatron-core model; (b) that model's own save (in this tp) goes
    through megarl's mcore-to-hf to transformers, and through megarl's load_model."""
    from megatron.core import dist_checkpointing

    from megarl.checkpoint.convert import mcore_to_hf

    world = dist.get_world_size()
    for name in INTEROP:
        hf_dir = work / "hf" / name
        ckpt = work / "mc" / f"{name}-t1p1e1w1"
        model = plain_megatron_model(hf_dir, groups)
        loaded = dist_checkpointing.load(model.sharded_state_dict(), str(ckpt))
        model.load_state_dict(loaded, strict=True)  # every parameter came from the checkpoint
        plain = gathered_logits(model, groups)
        ours = megatron_logits(ckpt, groups)
        saved = work / "megatron-lm" / f"{name}-w{world}"
        if dist.get_rank() == 0:
            saved.mkdir(parents=True)
        dist.barrier()
        dist_checkpointing.save(model.sharded_state_dict(), str(saved))
        dist.barrier()
        exported = work / "megatron-lm-hf" / f"{name}-w{world}"
        mcore_to_hf(saved, exported, hf_config_dir=hf_dir)
        reloaded = megatron_logits(saved, groups, hf_config=hf_dir)
        if dist.get_rank() == 0:
            from megarl.checkpoint.dist_ckpt import checkpoint_layer_keys, verify_dist_checkpoint

            ref = hf_logits(hf_dir)
            vocab = ref.shape[-1]
            emit({"check": "interop", "name": name, "tp": world,
                  "megatron_lm_layout": checkpoint_layer_keys(verify_dist_checkpoint(saved)),
                  "megarl_layout": checkpoint_layer_keys(verify_dist_checkpoint(ckpt)),
                  "plain_vs_transformers": (plain[..., :vocab] - ref).abs().max().item(),
                  "plain_vs_megarl": (plain - ours).abs().max().item(),
                  "export_vs_transformers": (hf_logits(exported) - ref).abs().max().item(),
                  "export_bit_exact": bit_exact(hf_dir, exported),
                  "load_model_vs_plain": (reloaded - plain).abs().max().item()})
        dist.barrier()


def biased_experts(ckpt: Path) -> bool:
    """Experts with biases (GptOss): Megatron splits them only with etp=1, so tp > 1 needs ep > 1."""
    from megarl.models.hf_config import megatron_args_from_hf

    args = megatron_args_from_hf(ckpt / "hf")
    return bool(args.num_experts and args.config_kwargs.get("add_bias_linear"))


def logits(work: Path) -> None:
    world = dist.get_world_size()
    ckpts = sorted((work / "mc").iterdir())
    biased = [c for c in ckpts if biased_experts(c)]
    for layout, group in ((Layout(tp=world, pp=1, dp=1), [c for c in ckpts if c not in biased]),
                          (Layout(tp=world, pp=1, dp=1, ep=world, etp=1), biased)):
        if not group:
            continue
        groups = build_groups(layout)
        set_seed(0, groups)
        for ckpt in group:
            name = ckpt.name.split("-t")[0]
            got = megatron_logits(ckpt, groups)
            record = {"check": "logits", "tag": ckpt.name, "load_tp": world}
            if dist.get_rank() == 0:
                ref = hf_logits(work / "hf" / name)
                vocab = ref.shape[-1]
                record["max_abs_diff"] = (got[..., :vocab] - ref).abs().max().item()
                record["ref_scale"] = ref.abs().max().item()
                if world == 1:
                    rt = work / "rt" / ckpt.name
                    record["round_trip"] = bit_exact(work / "hf" / name, rt)
                    record["round_trip_logits_diff"] = (hf_logits(rt) - ref).abs().max().item()
            emit(record)
        if group is not biased:
            interop(work, groups)
        groups.destroy()


if __name__ == "__main__":
    init_distributed()
    mode, work, rest = sys.argv[1], Path(sys.argv[2]), sys.argv[3:]
    convert(work, rest) if mode == "convert" else logits(work)
