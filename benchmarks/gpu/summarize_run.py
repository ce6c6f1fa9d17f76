"""Print one ``RUN {json}`` line for a finished ``megarl train`` run from its metrics.jsonl:
generated tokens/s, weight-sync seconds, peak memory per phase, offload and reload seconds.
Exits non-zero when the run has fewer steps than expected or lacks a metric.

    python benchmarks/gpu/summarize_run.py NAME RUN_DIR STEPS
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from statistics import median

# the first step includes start-up (CUDA graphs, the first sync): medians skip it
REQUIRED = ["time/generate_s", "response/length_mean", "batch/rows", "sync/seconds", "time/step_s"]
OPTIONAL = ["memory/gpu_peak_gb/generate", "memory/gpu_peak_gb/train", "memory/host_peak_gb/generate",
            "memory/host_peak_gb/train", "time/offload_s", "time/reload_s", "memory/worker_peak_gpu_gb",
            "throughput/tokens_per_s"]


def main(name: str, run_dir: str, steps: int) -> int:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        print(f"RUN {json.dumps({'name': name, 'ok': False, 'error': f'{path} is missing'})}")
        return 1
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    records = [r for r in records if "step" in r]
    missing = sorted({k for r in records for k in REQUIRED if k not in r})
    if len(records) < steps or missing:
        error = f"{len(records)} of {steps} steps logged" if len(records) < steps else f"missing {missing}"
        print(f"RUN {json.dumps({'name': name, 'ok': False, 'error': error})}")
        return 1
    later = records[1:] or records
    out = {"name": name, "ok": True, "steps": len(records),
           # generated tokens over the generate phase (sampling + scoring excluded), median of steps 2..N
           "gen_tokens_per_s": round(median(r["response/length_mean"] * r["batch/rows"] / r["time/generate_s"]
                                            for r in later), 1),
           "sync_s": round(median(r["sync/seconds"] for r in later), 4),
           "step_s": round(median(r["time/step_s"] for r in later), 3),
           "reward_first_last": [round(records[0]["reward/mean"], 4), round(records[-1]["reward/mean"], 4)]}
    for key in OPTIONAL:
        values = [r[key] for r in records if key in r]
        if values:
            out[key] = round(max(values), 4)  # peaks: the run's max; seconds: the slowest step
    print("RUN " + json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
