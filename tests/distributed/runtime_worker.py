"""Worker for test_runtime.py (run under torchrun). Prints one JSON line per check on rank 0.

``groups``: for several layouts, every rank's Megatron groups agree with Layout.coords, and an
impossible layout is refused before any process group is created.
``archs``: every supported architecture builds from its HF config and trains at the given
layouts (loss finite and falling over a few steps), virtual pipeline stages included.
``groups`` also reports the collector after start-up (its import-time objects frozen) and at
exit (everything frozen before Python's last collection).
``groups``, ``archs`` and ``single`` report how many gloo transport threads a rank runs beside its
groups (``groups`` runs with ``TORCH_GLOO_LAZY_INIT``, ``archs`` with ``GLOO_SOCKET_IFNAME``).
``single``: a packed batch (thd, cu_seqlens) gives the same per-token loss as each sequence
alone; the rotary frequencies (default and llama3-scaled) equal transformers'.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

from megarl.config import ModelConfig, OptimizerConfig
from megarl.engines import supervised
from megarl.engines.megatron_engine import MicroBatching
from megarl.engines.train_state import build_train_state
from megarl.parallel import Layout, LayoutError, build_groups
from megarl.runtime import init_distributed, set_seed
from megarl.tasks.reverse_digits import reverse_digits_batch


def emit(record) -> None:
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(record), flush=True)


def check_groups() -> None:
    from megatron.core import parallel_state
    from torch.distributed import distributed_c10d

    world = dist.get_world_size()
    for layout in (Layout(tp=2, pp=2, dp=world // 4), Layout(tp=1, pp=1, dp=world, ep=2, etp=1),
                   Layout(tp=2, pp=1, dp=world // 2, ep=2, etp=1), Layout(tp=1, pp=2, dp=world // 2)):
        groups = build_groups(layout)
        me = dist.get_rank()
        coords = layout.coords(me)
        seen = {"tp": groups.tp_rank, "pp": groups.pp_rank, "dp": groups.dp_rank, "ep": groups.ep_rank,
                "etp": groups.pg.expt_tp.rank(), "edp": groups.pg.expt_dp.rank(), "cp": groups.pg.cp.rank()}
        members = {}
        for axis, group in (("tp", groups.pg.tp), ("pp", groups.pg.pp), ("dp", groups.pg.dp),
                            ("ep", groups.pg.ep), ("edp", groups.pg.expt_dp)):
            expect = [r for r in range(world)
                      if all(layout.coords(r)[k] == coords[k] for k in _fixed(axis))]
            members[axis] = dist.get_process_group_ranks(group) == expect
        ok = torch.tensor([float(seen == {k: coords[k] for k in seen} and all(members.values()))])
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        emit({"check": "groups", "layout": str(layout), "ok": bool(ok.item())})
        report_gloo_loops(f"groups {layout}")
        groups.destroy()

    before = distributed_c10d._world.group_count
    try:
        build_groups(Layout(tp=3, pp=1, dp=1))
        refused = ""
    except LayoutError as exc:
        refused = str(exc)
    emit({"check": "refuse", "message": refused,
          "no_groups": distributed_c10d._world.group_count == before
          and not parallel_state.model_parallel_is_initialized()})


def report_gloo_loops(where: str) -> None:
    """How many gloo TCP loop threads this rank runs, beside how many groups exist."""
    from torch.distributed import distributed_c10d

    names = [open(f"/proc/self/task/{tid}/comm").read().strip() for tid in os.listdir("/proc/self/task")]
    emit({"check": "gloo_loops", "where": where, "loops": names.count("gloo_tcp_loop"),
          "groups": len(distributed_c10d._world.pg_map), "ifname": os.environ.get("GLOO_SOCKET_IFNAME", ""),
          "lazy": os.environ.get("TORCH_GLOO_LAZY_INIT", "")})


def _fixed(axis):
    """Coordinates shared by the members of one group along ``axis``."""
    dense = {"tp": ("cp", "dp", "pp"), "pp": ("tp", "cp", "dp"), "dp": ("tp", "cp", "pp")}
    expert = {"ep": ("etp", "edp", "pp"), "edp": ("etp", "ep", "pp")}
    return {**dense, **expert}[axis]


def check_archs(specs) -> None:
    for spec in specs:
        name, sizes = spec.split("@")
        tp, pp, dp, ep, vpp = (int(x) for x in sizes.split(","))
        layout = Layout(tp=tp, pp=pp, dp=dp, ep=ep, etp=tp if ep == 1 else 1, vpp=vpp or None)
        groups = build_groups(layout)
        set_seed(7, groups)
        state = build_train_state(ModelConfig(hf_config=f"configs/models/{name}.json"),
                                  OptimizerConfig(lr=3e-3), groups, total_steps=4)
        losses, engine = [], supervised.engine(state)
        for step in range(4):
            batch = reverse_digits_batch(0, 8, 4, seed=3)  # the same batch: loss must fall
            losses.append(supervised.train_step(engine, supervised.dp_shard(batch, groups), MicroBatching(2))["loss"])
        emit({"check": "arch", "model": name, "layout": str(layout), "losses": losses})
        report_gloo_loops(f"archs {name} {layout}")
        groups.destroy()


def check_packed() -> None:
    from megatron.core.packed_seq_params import PackedSeqParams

    from megarl.models import build_model

    groups = build_groups(Layout())
    report_gloo_loops("single")
    for name in ("tiny-qwen3", "tiny-deepseek-v3"):
        set_seed(11, groups)
        model = build_model(ModelConfig(hf_config=f"configs/models/{name}.json"), groups)[0].eval()
        gen = torch.Generator().manual_seed(0)
        lengths = [5, 8, 3]
        seqs = [torch.randint(4, 200, (n + 1,), generator=gen) for n in lengths]
        alone = []
        for s in seqs:
            n = len(s) - 1
            alone.append(model(s[:-1][None], torch.arange(n)[None], None, labels=s[1:][None])[0])
        cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                 max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))
        tokens = torch.cat([s[:-1] for s in seqs])[None]
        labels = torch.cat([s[1:] for s in seqs])[None]
        positions = torch.cat([torch.arange(n) for n in lengths])[None]
        packed = model(tokens, positions, None, labels=labels, packed_seq_params=params)[0]
        diff = (packed - torch.cat(alone)).abs().max().item()
        emit({"check": "packed", "model": name, "max_abs_diff": diff})
    check_rope(groups)
    groups.destroy()


def check_rope(groups) -> None:
    import transformers

    from megarl.models import build_model, megatron_args_from_hf

    scaled = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    for name, rope in (("default", None), ("llama3", scaled)):
        hf = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=256, **({"rope_parameters": rope} if rope else {}))
        model = build_model(ModelConfig(), groups, megatron_args_from_hf(hf.to_dict()))[0]
        reference = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(hf).inv_freq
        diff = (model.rotary_pos_emb.inv_freq.double() - reference.double()).abs().max().item()
        emit({"check": "rope", "rope": name, "max_abs_diff": diff})


def collector_at_exit() -> None:
    """Registered before init_distributed, so it runs after the freeze that registers (LIFO)."""
    import gc

    if int(os.environ["RANK"]) == 0:
        print("RESULT " + json.dumps({"check": "collector_at_exit", "tracked": len(gc.get_objects()),
                                      "frozen": gc.get_freeze_count()}), flush=True)


if __name__ == "__main__":
    import atexit
    import gc

    mode, rest = sys.argv[1], sys.argv[2:]
    if mode == "groups":
        atexit.register(collector_at_exit)
    init_distributed()
    if mode == "groups":
        emit({"check": "collector", "frozen": gc.get_freeze_count()})
    {"groups": lambda: check_groups(), "archs": lambda: check_archs(rest), "single": check_packed}[mode]()
