"""Worker for test_convert.py (run under torchrun). Prints ``RESULT {json}`` lines on rank 0.

``convert``: for each ``name@tp,pp,ep`` spec: HF -> Megatron in that layout by
checkpoint_tools/hf_to_mcore.py, then Megatron -> HF of them all by checkpoint_tools/mcore_to_hf.py
with a job list, with the same processes (ranks split the tensors), into WORK/mc/<name>-<layout>
and WORK/rt/....
``logits``: load every Megatron checkpoint in WORK/mc at tp = world size (whatever layout it was
converted in) and compare its logits with transformers' on the source HF model
(:func:`megarl.checkpoint.verify.verify`), and check the round-trip HF checkpoint: bit-exact
tensors, and loadable by AutoModelForCausalLM; then the Megatron-LM interoperability checks
(:func:`interop`) at tp = world size; then checkpoint_tools/verify.py on each family's checkpoint
and on a copy with one tensor moved by 1e-3 (:func:`tools`).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from megarl.checkpoint.verify import verify
from megarl.config import ModelConfig
from megarl.parallel import Layout, build_groups
from megarl.runtime import init_distributed, set_seed

ROOT = Path(__file__).resolve().parents[2]

TOKENS = torch.tensor([[5, 17, 42, 7, 99, 3, 250 - 1, 64, 12, 8, 1, 77],
                       [9, 9, 120, 33, 2, 45, 6, 200, 31, 4, 15, 60]])


def emit(record) -> None:
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(record), flush=True)


def layout_tag(tp: int, pp: int, ep: int) -> str:
    return f"t{tp}p{pp}e{ep}w{dist.get_world_size()}"


@functools.cache
def tool(name: str):
    """checkpoint_tools/<name>.py's ``main(argv) -> exit code``, run in this process."""
    spec = importlib.util.spec_from_file_location(f"checkpoint_tools_{name}", ROOT / "checkpoint_tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def convert(work: Path, specs) -> None:
    jobs = []
    for spec in specs:
        name, sizes = spec.split("@")
        tp, pp, ep = (int(x) for x in sizes.split(","))
        tag = f"{name}-{layout_tag(tp, pp, ep)}"
        flags = ["--tp", str(tp), "--pp", str(pp), "--ep", str(ep)] + (["--etp", "1"] if ep > 1 else [])
        assert tool("hf_to_mcore")([str(work / "hf" / name), str(work / "mc" / tag), *flags]) == 0, spec
        jobs.append(f"{work / 'mc' / tag} {work / 'rt' / tag}")
        emit({"check": "converted", "tag": tag})
    listed = work / "lists" / f"mcore-to-hf-w{dist.get_world_size()}-r{dist.get_rank()}.txt"  # each rank its own
    listed.parent.mkdir(exist_ok=True)
    listed.write_text("\n".join(jobs) + "\n")
    assert tool("mcore_to_hf")(["--list", str(listed)]) == 0


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
            checked = verify(ckpt, work / "hf" / name, groups, tokens=list(TOKENS))
            record = {"check": "logits", "tag": ckpt.name, "load_tp": world,
                      "max_abs_diff": checked.max_abs_diff, "ref_scale": checked.ref_scale}
            if dist.get_rank() == 0 and world == 1:
                rt = work / "rt" / ckpt.name
                record["round_trip"] = bit_exact(work / "hf" / name, rt)
                record["round_trip_logits_diff"] = (hf_logits(rt) - hf_logits(work / "hf" / name)).abs().max().item()
            emit(record)
        if group is not biased:
            interop(work, groups)
        groups.destroy()
    tools(work)


FAMILIES = {"dense": "tiny-llama", "MoE": "tiny-qwen3-moe", "MLA": "tiny-deepseek-v3", "delta-net": "tiny-qwen3-next"}
PERTURBED = "output_layer.weight"  # of WORK/perturbed/<name>: moved by PERTURBATION everywhere
PERTURBATION = 1e-3


def perturb(work: Path) -> None:
    """WORK/perturbed/<name>: each family's one-rank conversion with :data:`PERTURBED` moved by
    :data:`PERTURBATION`, saved as megarl saves any model (one world of ranks)."""
    from megarl.checkpoint.dist_ckpt import load_model, save_sharded, sharded_state_dict
    from megarl.models import build_model

    groups = build_groups(Layout(tp=dist.get_world_size()))
    set_seed(0, groups)
    for name in FAMILIES.values():
        source = work / "mc" / f"{name}-t1p1e1w1"
        chunks = build_model(ModelConfig(hf_config=str(source / "hf")), groups, initialize=False)
        load_model(chunks, source)
        with torch.no_grad():
            dict(chunks[0].named_parameters())[PERTURBED].add_(PERTURBATION)
        save_sharded(sharded_state_dict(chunks, layer_keys="default"), work / "perturbed" / name,
                     before_rename=lambda tmp, source=source: shutil.copytree(source / "hf", tmp / "hf"))
    groups.destroy()


def tools(work: Path) -> None:
    """checkpoint_tools/verify.py, as a job runs it, on each family: at world size 1 at tp=1 on the
    conversion two ranks made at tp=2; at 2 in a pipeline of two stages on the first two layers
    (a slice) of the one-rank conversion; each beside the copy with one tensor perturbed (made at
    world size 1), which must fail. Records the exit codes."""
    world = dist.get_world_size()
    if world == 1:
        perturb(work)
    dist.barrier()
    flags = ["--tp", "1"] if world == 1 else ["--pp", "2", "--layers", "2"]
    for family, name in FAMILIES.items():
        good = work / "mc" / f"{name}-{'t2p1e1w2' if world == 1 else 't1p1e1w1'}"
        codes = [tool("verify")([str(work / "hf" / name), str(good), *flags]),
                 tool("verify")([str(work / "perturbed" / name), str(work / "hf" / name), *flags])]  # either order
        emit({"check": "tools", "family": family, "name": name, "world": world, "flags": flags,
              "verify_rc": codes[0], "perturbed_rc": codes[1]})


if __name__ == "__main__":
    init_distributed()
    mode, work, rest = sys.argv[1], Path(sys.argv[2]), sys.argv[3:]
    convert(work, rest) if mode == "convert" else logits(work)
