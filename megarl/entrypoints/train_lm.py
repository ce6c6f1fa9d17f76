"""Tiny multi-process Megatron training on a built-in task, reverse-digits or calculator (every rank runs this).

Shows the whole stack working on any machine: the layout's process groups, a GPTModel built
from an HF config, Megatron DDP with the distributed optimizer, the pipeline schedule, and the
loss falling. With ``trainer.save_dir`` the trained weights are saved as a Megatron dist
checkpoint with an ``hf/`` folder, the supervised warm start of ``make demo``. Start it with
``megarl train-lm`` (which launches torchrun).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path

import torch

from megarl.checkpoint.dist_ckpt import save_sharded, sharded_state_dict
from megarl.checkpoint.load import HF_SUBDIR, resolve_model_config
from megarl.config import MegarlConfig, load_config
from megarl.data.digit_hf import save_digit_tokenizer
from megarl.data.tokenizer import DigitTokenizer
from megarl.engines import supervised
from megarl.engines.megatron_engine import MicroBatching
from megarl.engines.train_state import build_train_state
from megarl.models.hf_config import read_hf_config
from megarl.parallel import Layout, build_groups
from megarl.runtime import init_distributed, set_seed, torn_down
from megarl.tasks.calculator import calculator_batch, calculator_sequence_length
from megarl.tasks.reverse_digits import reverse_digits_batch

log = logging.getLogger(__name__)
TASKS = ("reverse_digits", "calculator")


def make_batch(data, step: int, seed: int) -> dict:
    """Step ``step``'s global batch of the built-in task ``data.task`` (DataConfig)."""
    if data.task == "calculator":
        return calculator_batch(step, data.global_batch_size, data.num_digits, seed, data.tool_call_rate)
    return reverse_digits_batch(step, data.global_batch_size, data.num_digits, seed, data.label_noise)


def check_config(cfg: MegarlConfig) -> None:
    """Checks that need no process: the model reads the built-in tokenizer's ids; the output is new."""
    if cfg.model.path:
        raise ValueError(f"model.path={cfg.model.path}: megarl train-lm trains a randomly initialised model on the "
                         f"built-in task (model.hf_config); start from pretrained weights with megarl train")
    hf_config = resolve_model_config(cfg.model).hf_config
    vocab = read_hf_config(hf_config).get("vocab_size", 0)
    if vocab < DigitTokenizer().vocab_size:
        raise ValueError(f"model.hf_config {hf_config}: vocab_size {vocab} is smaller than the built-in "
                         f"digit tokenizer's {DigitTokenizer().vocab_size} tokens the built-in tasks use")
    if not 0.0 <= cfg.data.label_noise <= 1.0:
        raise ValueError(f"data.label_noise={cfg.data.label_noise} must be a probability in [0, 1]")
    if cfg.data.task not in TASKS:
        raise ValueError(f"data.task='{cfg.data.task}': megarl train-lm trains on one of {sorted(TASKS)}")
    if cfg.data.task == "calculator":
        if cfg.data.label_noise:
            log.warning("data.label_noise=%s is ignored with data.task=calculator (its demonstrations answer "
                        "directly at data.tool_call_rate's complement instead)", cfg.data.label_noise)
        seq = calculator_sequence_length(cfg.data.num_digits)
        positions = read_hf_config(hf_config).get("max_position_embeddings", seq)
        if seq > positions:
            raise ValueError(f"data.num_digits={cfg.data.num_digits}: calculator demonstrations are {seq} tokens, "
                             f"more than model.hf_config {hf_config}'s max_position_embeddings {positions}")
    if cfg.trainer.save_dir and Path(cfg.trainer.save_dir).exists():
        raise FileExistsError(f"trainer.save_dir {cfg.trainer.save_dir} already exists; remove it or choose "
                              f"another path")


def write_hf_files(cfg: MegarlConfig, dtype: torch.dtype, dest: Path) -> None:
    """What ``mcore-to-hf`` needs besides the weights, as ``hf-to-mcore`` keeps it: the model's
    config.json (with its architecture, dtype and the tokenizer's special ids), a generation
    config that stops at EOS, and the built-in digit tokenizer the task was trained with."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    dest.mkdir(parents=True)
    digits = DigitTokenizer()
    ids = {"bos_token_id": digits.bos_token_id, "eos_token_id": digits.eos_token_id,
           "pad_token_id": digits.pad_token_id}
    config = read_hf_config(resolve_model_config(cfg.model).hf_config)
    config.setdefault("architectures", [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config["model_type"]]])
    config.update(ids, torch_dtype=str(dtype).removeprefix("torch."))
    (dest / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (dest / "generation_config.json").write_text(json.dumps(ids, indent=2) + "\n")
    save_digit_tokenizer(dest)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    files = [a for a in argv if a.endswith((".yaml", ".yml"))]
    cfg: MegarlConfig = load_config(files, [a for a in argv if a not in files])
    check_config(cfg)
    with torn_down():  # the exit code is this rank's, whatever groups are alive at an error
        return _train(cfg)


def _train(cfg: MegarlConfig) -> int:
    init_distributed()
    layout = Layout.from_config(cfg.parallel.actor, torch.distributed.get_world_size())
    groups = build_groups(layout)
    set_seed(cfg.trainer.seed, groups)
    state = build_train_state(cfg.model, cfg.optimizer, groups, cfg.trainer.train_steps)
    engine = supervised.engine(state, cfg.trainer.max_bad_steps)
    how = MicroBatching(micro_batch_size=cfg.data.micro_batch_size, packed=cfg.data.pack_sequences)
    rank0 = torch.distributed.get_rank() == 0
    if rank0:
        backend = "nccl/GPU" if torch.cuda.is_available() else "gloo/CPU"
        print(f"megarl train-lm: {resolve_model_config(cfg.model).hf_config} layout {layout} on "
              f"{torch.distributed.get_world_size()} processes ({backend})", flush=True)
    first = last = None
    start = time.perf_counter()
    for step in range(cfg.trainer.train_steps):
        batch = make_batch(cfg.data, step, cfg.trainer.seed)
        metrics = supervised.train_step(engine, supervised.dp_shard(batch, groups), how)
        first = metrics["loss"] if first is None else first
        last = metrics["loss"]
        if rank0 and (step % cfg.trainer.log_interval == 0 or step == cfg.trainer.train_steps - 1):
            print(f"step {step:4d}  loss {metrics['loss']:.4f}  grad_norm {metrics['grad_norm']:.3f}  "
                  f"lr {metrics['lr']:.2e}  {time.perf_counter() - start:6.1f}s", flush=True)
    if rank0:
        print(f"loss fell from {first:.4f} to {last:.4f} in {cfg.trainer.train_steps} steps", flush=True)
    if cfg.trainer.save_dir:
        dtype = next(state.model[0].parameters()).dtype
        save_sharded(sharded_state_dict(state.model), cfg.trainer.save_dir,
                     before_rename=lambda tmp: write_hf_files(cfg, dtype, tmp / HF_SUBDIR))
        if rank0:
            print(f"saved the model to {cfg.trainer.save_dir} (Megatron dist checkpoint; "
                  f"megarl convert mcore-to-hf makes it an HF directory)", flush=True)
    return 0 if last < first else 1


if __name__ == "__main__":
    sys.exit(main())
