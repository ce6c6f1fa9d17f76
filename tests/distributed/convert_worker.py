"""Worker for test_convert.py (run under torchrun). Prints ``RESULT {json}`` lines on rank 0.

``convert``: for each ``name@tp,pp,ep`` spec: HF -> Megatron in that layout, then Megatron -> HF
with the same processes (ranks split the tensors), into WORK/mc/<name>-<layout> and WORK/rt/....
``logits``: load every Megatron checkpoint in WORK/mc at tp = world size (whatever layout it was
converted in), compare its logits with transformers' on the source HF model, and check the
round-trip HF checkpoint: bit-exact tensors, and loadable by AutoModelForCausalLM.
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


def megatron_logits(ckpt: Path, groups) -> torch.Tensor:
    from megarl.models import build_model
    from megarl.training.dist_ckpt import load_model

    model_cfg = ModelConfig(hf_config=str(ckpt / "hf"))
    chunks = build_model(model_cfg, groups, initialize=False)
    load_model(chunks, ckpt)
    model = chunks[0].eval()
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


def logits(work: Path) -> None:
    world = dist.get_world_size()
    groups = build_groups(Layout(tp=world, pp=1, dp=1))
    set_seed(0, groups)
    for ckpt in sorted((work / "mc").iterdir()):
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
    groups.destroy()


if __name__ == "__main__":
    init_distributed()
    mode, work, rest = sys.argv[1], Path(sys.argv[2]), sys.argv[3:]
    convert(work, rest) if mode == "convert" else logits(work)
