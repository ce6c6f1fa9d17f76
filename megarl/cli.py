"""The ``megarl`` command: ``megarl <subcommand> [CONFIG.yaml ...] [key=value ...]``.

Subcommands:
  train      RL post-training (GRPO, PPO, DAPO, RLOO, REINFORCE++, ReMax) on Ray, colocated
  sft        supervised fine-tuning of a model on chat data (messages or prompt/response rows) on Ray;
             its run directory is what export-hf and train's model.path take
  train-rm   reward-model training (Bradley-Terry) on prompt/chosen/rejected rows; export-hf writes an HF
             *ForSequenceClassification directory that reward_model.path takes
  dpo        DPO (or IPO) of a model on prompt/chosen/rejected rows against its frozen starting weights
  eval       the held-out evaluation of a model (HF, Megatron, a run) on data.val_files, without training
  export-hf  the actor of a run's newest checkpoint as an HF checkpoint: RUN_DIR OUT [--dtype D]; a LoRA
             run's merged, or with --adapter its PEFT adapter directory
  report     draw a run's curves (RUN_DIR/metrics.jsonl) to RUN_DIR/report/*.png
  train-lm   tiny Megatron training on the built-in reverse-digits task (launches torchrun)
  config     print the composed, validated configuration as YAML
  convert    hf-to-mcore | mcore-to-hf checkpoint conversion, one or a job list; verify (logits against
             transformers), inspect (tensors and metadata, or a diff of two) (see megarl convert --help)
  layout     print every rank's coordinates in the actor layout (dry run; --world-size=N,
             default trainer.nproc_per_node)
  plan       the training and generation layouts that fit N GPUs of M GB, ranked by predicted step time,
             with each one's memory per rank and phase (--gpus=N --gpu-memory-gb=M)

Exit codes: 0 done; 1 the run diverged (a role's non-finite outputs or updates, named) or failed; 2 bad input (the field or file named); 3 a rank died or made no progress
(trainer.hang_timeout_s); 4 out of disk space; 130 Ctrl-C; 143 SIGTERM (after the step's checkpoint).
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from typing import List, Tuple

from megarl.checkpoint.disk import DiskFull
from megarl.config import ConfigError, load_config, to_yaml
from megarl.errors import NonFiniteOutput, NonFiniteUpdateError
from megarl.parallel.layout import Layout, LayoutError
from megarl.runtime.distributed import torn_down
from megarl.runtime.processes import WorkerDied
from megarl.runtime.signals import EXIT_CODE as EXIT_PREEMPTED, Preempted


def _split(args: List[str]) -> Tuple[List[str], List[str]]:
    files = [a for a in args if a.endswith((".yaml", ".yml"))]
    return files, [a for a in args if a not in files]


def _train_lm(args: List[str]) -> int:
    files, overrides = _split(args)
    cfg = load_config(files, overrides)  # fail here, before any process starts
    Layout.from_config(cfg.parallel.actor, cfg.trainer.nproc_per_node)
    from megarl.entrypoints.train_lm import check_config, main

    check_config(cfg)
    if "RANK" in os.environ:  # already under torchrun/srun
        return main(args)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", str(cfg.trainer.nproc_per_node), "-m", "megarl.entrypoints.train_lm", *args]
    from megarl.runtime.memory import allocator_env

    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("PYTHONWARNINGS", "ignore")
    env.update(allocator_env(env))  # expandable_segments, as for the RL trainer's Ray workers
    return subprocess.call(cmd, env=env)


def _train(args: List[str]) -> int:
    from megarl.entrypoints.train_rl import main

    return main(args)


def _sft(args: List[str]) -> int:
    from megarl.entrypoints.sft import main

    return main(args)


def _train_rm(args: List[str]) -> int:
    from megarl.entrypoints.sft import main

    return main(args, stage="train-rm")


def _dpo(args: List[str]) -> int:
    from megarl.entrypoints.sft import main

    return main(args, stage="dpo")


def _eval(args: List[str]) -> int:
    from megarl.entrypoints.eval import main

    return main(args)


def _report(args: List[str]) -> int:
    from megarl.trainer.report import report

    if len(args) != 1:
        raise ValueError("usage: megarl report RUN_DIR")
    for path in report(args[0]):
        print(path)
    return 0


def _export_hf(args: List[str]) -> int:
    from megarl.trainer.export import export_hf

    usage = "usage: megarl export-hf RUN_DIR OUT [--dtype=auto|float32|bfloat16] [--adapter]"
    dtype = next((a.split("=", 1)[1] for a in args if a.startswith("--dtype=")), "auto")
    flags = [a for a in args if a.startswith("--") and not a.startswith("--dtype=")]
    paths = [a for a in args if not a.startswith("--")]
    if len(paths) != 2 or any(f != "--adapter" for f in flags):
        raise ValueError(usage)
    adapter = "--adapter" in flags
    source = export_hf(paths[0], paths[1], dtype, adapter=adapter)
    what = "PEFT adapter" if adapter else "HF checkpoint"
    print(f"{paths[1]}: {what} of the actor in {source}")
    return 0


def _config(args: List[str]) -> int:
    files, overrides = _split(args)
    print(to_yaml(load_config(files, overrides)), end="")
    return 0


def _layout(args: List[str]) -> int:
    sizes = [a for a in args if a.startswith("--world-size=")]
    world = int(sizes[-1].split("=", 1)[1]) if sizes else None
    files, overrides = _split([a for a in args if a not in sizes])
    cfg = load_config(files, overrides)
    world = world or cfg.trainer.nproc_per_node
    from megarl.controller.plan import layout_lines

    print("\n".join(layout_lines(Layout.from_config(cfg.parallel.actor, world))))
    return 0


def _plan(args: List[str]) -> int:
    import argparse
    from pathlib import Path

    from megarl.checkpoint.load import resolve_model_config
    from megarl.models.hf_config import megatron_args_from_hf
    from megarl.sizing.proposals import Cluster, plan_layouts, plan_lines

    parser = argparse.ArgumentParser(prog="megarl plan", add_help=False, allow_abbrev=False)
    parser.add_argument("--gpus", type=int, required=True)
    parser.add_argument("--gpu-memory-gb", type=float, required=True)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--seq-len", type=int)
    parser.add_argument("--top", type=int, default=5)
    try:
        flags, rest = parser.parse_known_args(args)
    except SystemExit as done:  # argparse named the flag on stderr
        return done.code if isinstance(done.code, int) else 2
    unknown = [a for a in rest if a.startswith("-")]
    if unknown:
        raise ValueError(f"unknown flag(s) {unknown}; {HELP['plan'].splitlines()[0]}")
    files, overrides = _split(rest)
    cfg = load_config(files, overrides)
    model_cfg = resolve_model_config(cfg.model)
    source = Path(model_cfg.hf_config)  # the model's name in the report: its directory's or its file's
    name = source.parent.name if source.name == "config.json" else source.name if source.is_dir() else source.stem
    cluster = Cluster(flags.gpus, flags.gpu_memory_gb, flags.gpus_per_node, flags.seq_len, flags.top)
    plan = plan_layouts(cfg, megatron_args_from_hf(model_cfg.hf_config), cluster, name)
    print("\n".join(plan_lines(plan)))
    return 0


def _convert(args: List[str]) -> int:
    from megarl.checkpoint.cli import main as convert_main

    try:
        return convert_main(args)
    except SystemExit as done:  # argparse's --help (0) and usage errors (2): the command's exit code
        return done.code if isinstance(done.code, int) else 2


COMMANDS = {"train": _train, "sft": _sft, "train-rm": _train_rm, "dpo": _dpo, "eval": _eval, "report": _report, "export-hf": _export_hf, "train-lm": _train_lm, "config": _config, "layout": _layout, "plan": _plan, "convert": _convert}


def _message(exc: BaseException) -> str:
    """A named error's message; raised on a Ray worker, the worker's own (Ray's wrapper is an
    instance of the error's class, with the worker's traceback in its text)."""
    cause = getattr(exc, "cause", None)
    if type(exc).__name__.startswith("RayTaskError") and isinstance(cause, BaseException):
        return str(cause)
    return str(exc)


HELP = {
    "train": """usage: megarl train CONFIG.yaml [CONFIG.yaml ...] [key=value ...] [--dry-run]

RL post-training (GRPO, PPO, DAPO, GSPO, RLOO, REINFORCE++, ReMax) on Ray. The YAML files merge in
order, then the key=value overrides (docs/configuration.md lists every key). --dry-run checks the
configuration, the model and every data row, prints the layout of every role and starts nothing.
A run resumes from its run directory's newest checkpoint (trainer.run_dir).""",
    "sft": """usage: megarl sft CONFIG.yaml [key=value ...] model.path=DIR data.train_files=[FILE, ...]

Supervised fine-tuning on the user's chat data: rows with a 'messages' conversation (data.messages_key)
or a prompt/response pair (data.prompt_key, data.response_key), in jsonl, parquet, globs or HF datasets
directories. The loss is on the assistant's tokens as the chat template renders them. data.val_files
gives val/loss every trainer.val_interval steps. Checkpoints, resume and the trackers are megarl
train's; megarl export-hf RUN_DIR OUT and megarl train model.path=RUN_DIR take the run directory.""",
    "train-rm": """usage: megarl train-rm CONFIG.yaml [key=value ...] model.path=DIR data.train_files=[FILE, ...]

Reward-model training: a scalar head on model.path's backbone, scored at each sequence's last token,
trained with the Bradley-Terry loss on rows with a prompt (data.prompt_key) and a preferred and a
dispreferred response (data.chosen_key, data.rejected_key; strings, or whole conversations). The
batch sizes count pairs. data.val_files gives val/accuracy and val/margin. megarl export-hf RUN_DIR OUT
writes a *ForSequenceClassification directory that transformers loads and reward_model.path takes.""",
    "dpo": """usage: megarl dpo CONFIG.yaml [key=value ...] model.path=DIR data.train_files=[FILE, ...]

Direct preference optimisation on the rows megarl train-rm reads (a prompt, a chosen and a rejected
response): algorithm.dpo_loss (sigmoid: DPO; ipo), algorithm.dpo_beta, algorithm.dpo_label_smoothing.
The reference is the starting weights, frozen (with model.lora.rank, the model with its adapters off).
The batch sizes count pairs. Metrics: the implicit rewards' accuracy and margin, chosen and rejected
log-probs. The run directory is megarl sft's: export-hf, model.path=RUN_DIR.""",
    "eval": """usage: megarl eval CONFIG.yaml [key=value ...] model.path=DIR data.val_files=[FILE, ...]

The held-out evaluation of megarl train's validation (data.val_files; algorithm.val_samples_per_prompt,
val_temperature, val_max_new_tokens; trainer.seed) on model.path without training it: an HF directory, a
Megatron checkpoint, a run checkpoint or a run directory (its newest checkpoint), generated through the
configured rollout backend. Writes trainer.run_dir/eval.json and eval_responses.jsonl.""",
    "export-hf": """usage: megarl export-hf RUN_DIR OUT [--dtype=auto|float32|bfloat16] [--adapter]

The actor of RUN_DIR's newest checkpoint as an HF checkpoint in OUT (config, safetensors, the
tokenizer and generation config). A LoRA run's adapters merged into the base; with --adapter its PEFT
adapter directory instead.""",
    "report": """usage: megarl report RUN_DIR

Draw a run's curves (RUN_DIR/metrics.jsonl) to RUN_DIR/report/*.png.""",
    "train-lm": """usage: megarl train-lm CONFIG.yaml [key=value ...]

Supervised Megatron training on the built-in tasks (launches torchrun with trainer.nproc_per_node ranks).""",
    "config": """usage: megarl config CONFIG.yaml [CONFIG.yaml ...] [key=value ...]

Print the composed, validated configuration as YAML.""",
    "layout": """usage: megarl layout CONFIG.yaml [key=value ...] [--world-size=N]

Print every rank's coordinates (tp, pp, dp, ep, cp) in the actor's layout (default world size:
trainer.nproc_per_node).""",
    "plan": """usage: megarl plan CONFIG.yaml [key=value ...] --gpus=N --gpu-memory-gb=M [--gpus-per-node=8]
                   [--seq-len=TOKENS] [--top=5]

Size a run before starting it: every training layout (tp, pp, dp, cp, ep) of N GPUs that a run would
accept, with its generation layout (parallel.rollout.tp, pp, ep), is costed per rank and phase
(parameters, gradients, optimizer state, activations with and without full recompute; the rollout
engine's weights and KV cache), and those that fit M GiB per GPU are ranked by the cost model's
predicted step time; the fastest are printed with their memory and the overrides that select them.
The model is model.hf_config or model.path's config.json; sequence lengths and micro-batches come from
data.max_prompt_length, algorithm.max_new_tokens and data.micro_batch_tokens (--seq-len overrides).
Exits 2 naming what to change when nothing fits. Formulas and what is not verified: docs/scaling.md.""",
}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print(__doc__.strip())
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    if argv[0] in HELP and any(a in ("-h", "--help") for a in argv[1:]):  # convert prints its own
        print(HELP[argv[0]])
        return 0
    try:
        with torn_down():  # the exit code is the command's, whatever groups it started
            return COMMANDS[argv[0]](argv[1:])
    except (ConfigError, LayoutError, ValueError, FileNotFoundError, FileExistsError) as exc:
        print(f"megarl {argv[0]}: error: {_message(exc)}", file=sys.stderr)
        return 2
    except WorkerDied as exc:  # names the rank and node; the run resumes from its newest checkpoint
        print(f"megarl {argv[0]}: error: {exc}", file=sys.stderr)
        return 3
    except DiskFull as exc:  # names the path, the bytes needed and free; what was there is intact
        print(f"megarl {argv[0]}: error: {exc}", file=sys.stderr)
        return 4
    except (NonFiniteOutput, NonFiniteUpdateError) as exc:  # diverged: the step and the role named
        print(f"megarl {argv[0]}: error: {_message(exc)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C: the run's processes are already stopped on the way out
        print(f"megarl {argv[0]}: interrupted", file=sys.stderr)
        return 130
    except Preempted as exc:  # SIGTERM: the step finished and was saved, or the grace ran out
        print(f"megarl {argv[0]}: preempted: {exc}", file=sys.stderr)
        return EXIT_PREEMPTED
    finally:
        # The interpreter's last garbage collection walks every object torch, Megatron and
        # transformers made (4-10 s on a loaded node, after the run has ended): nothing of a finished
        # command needs it, so its objects are moved out of the collector's reach.
        gc.freeze()


if __name__ == "__main__":
    sys.exit(main())
