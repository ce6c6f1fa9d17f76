"""``megarl eval CONFIG.yaml model.path=DIR data.val_files=[...]``: the held-out evaluation of
``megarl train`` (megarl/trainer/validation.py) on a model without training it.

``model.path`` is an HF directory, a Megatron dist checkpoint, a run checkpoint
(``RUN_DIR/checkpoints/step_N``) or a run directory (its newest checkpoint). The model loads into the
actor's layout and reaches the configured rollout backend by the run's own weight sync, so the
responses are those validation draws in a run with the same weights and ``trainer.seed``. Writes
``<trainer.run_dir>/eval.json`` (the metrics, the model and the settings) and
``<trainer.run_dir>/eval_responses.jsonl`` (one line per response); both through a temporary file
and a rename.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Dict, List

from megarl.config import ConfigError, load_config

__all__ = ["main", "evaluate"]


def evaluate(cfg) -> Dict[str, float]:
    """Evaluate ``cfg``'s model on ``cfg.data.val_files``; returns the metrics (and writes the files)."""
    from megarl.checkpoint.disk import replace_text
    from megarl.controller.cluster import RaySession
    from megarl.controller.prepare import prepare, world_size
    from megarl.controller.roles import build_roles, rollout_ranks, start_groups
    from megarl.trainer.validation import Validator, validation_seed

    if not cfg.data.val_files:
        raise ConfigError("megarl eval needs data.val_files (the prompts to evaluate on)")
    if not cfg.model.path:
        raise ConfigError("megarl eval needs model.path (an HF directory, a Megatron checkpoint, a run checkpoint "
                          "or a run directory)")
    cfg = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, resume=False, save_interval=0))
    prepared = prepare(cfg)  # model.path: a run directory's newest checkpoint (resolve_paths)
    cfg, scorer, tok = prepared.cfg, prepared.scorer, prepared.tokenizer
    out = Path(cfg.trainer.run_dir)
    out.mkdir(parents=True, exist_ok=True)
    session = RaySession(cfg.trainer, num_cpus=world_size(cfg) + rollout_ranks(cfg))
    groups: List = []
    try:
        groups = start_groups(cfg, session)
        roles = build_roles(*groups)
        scorer.attach(roles)
        roles.rollout.update_weights(0)
        validator = Validator(prepared.val_stream, scorer, cfg.algorithm, tok.eos_token_ids, cfg.trainer.seed,
                              tok.decode)
        metrics, rows = validator.run(roles.rollout)
    finally:
        scorer.close()
        for g in groups:
            g.shutdown()
        session.close()
    algo = cfg.algorithm
    summary = {"model": cfg.model.path, "val_files": list(cfg.data.val_files), "engine": str(cfg.parallel.rollout.engine),
               "samples_per_prompt": algo.val_samples_per_prompt, "temperature": algo.val_temperature,
               "max_new_tokens": algo.val_max_new_tokens or algo.max_new_tokens,
               "seed": validation_seed(cfg.trainer.seed), "metrics": metrics}
    replace_text(out / "eval_responses.jsonl", "".join(json.dumps(r) + "\n" for r in rows), "the evaluation's responses")
    replace_text(out / "eval.json", json.dumps(summary, indent=2) + "\n", "the evaluation's summary")
    return metrics


def main(argv=None) -> int:
    from megarl.trainer.validation import HEADLINE

    argv = list(sys.argv[1:] if argv is None else argv)
    files = [a for a in argv if a.endswith((".yaml", ".yml"))]
    cfg = load_config(files, [a for a in argv if a not in files])
    metrics = evaluate(cfg)
    print(json.dumps({k: round(v, 6) for k, v in metrics.items() if HEADLINE.match(k)}), flush=True)
    print(f"{cfg.trainer.run_dir}: eval.json, eval_responses.jsonl", flush=True)
    return 0
