"""The GPU check's summary (run.sh): one ``SUMMARY {json}`` line per part from its log in RUNS_DIR
(its exit code and seconds, and its headline numbers), then ``CHECK_OK`` or ``CHECK_FAILED``.
Exits 1 when a part failed or its log lacks what the part prints when it passes.

    python3 benchmarks/gpu/summarize.py RUNS_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from statistics import median

def records(log: Path, tag: str) -> list:
    """The JSON of every ``TAG {...}`` line of ``log``."""
    if not log.is_file():
        return []
    return [json.loads(line[len(tag) + 1:]) for line in log.read_text().splitlines() if line.startswith(tag + " {")]


def copies(runs: Path) -> dict:
    rows = records(runs / "copies.log", "COPY")
    out = {r["memory"]: {"d2h_gbps": r["d2h_gbps"], "h2d_gbps": r["h2d_gbps"]} for r in rows}
    return out | {"passed": len(rows) == 2 and all(r["ok"] for r in rows)}


def parity(runs: Path) -> dict:
    rows = records(runs / "parity.log", "PARITY")
    out = {r["case"]: {"max_abs": r["max_abs"], "mean_abs": r["mean_abs"], "max_abs_bound": r["tolerance"]["max_abs"]}
           for r in rows}
    generated = records(runs / "parity.log", "GENERATE")
    if generated:
        out["bf16_tokens_per_s"] = generated[0]["tokens_per_s"]
    return out | {"passed": len(rows) >= 3 and all(r["ok"] for r in rows) and bool(generated)}


def loop(runs: Path) -> dict:
    steps = records(runs / "loop.log", "LOOP")
    phases = {r["phase"]: r for r in records(runs / "loop.log", "PHASE")}
    later = steps[1:] or steps  # the first step includes start-up

    def med(key):
        values = [r[key] for r in later if key in r]
        return round(median(values), 3) if values else None

    out = {"steps": len(steps), "step_s": med("time/step_s"), "generate_s": med("time/generate_s"),
           "actor_update_s": med("time/actor_update_s"), "offload_s": med("time/offload_s"),
           "reload_s": med("time/reload_s"),
           "first_logp_max_abs_diff": steps[0].get("rollout/logp_max_abs_diff") if steps else None,
           "reserved_gb": {p: r["reserved_gb"] for p, r in phases.items()},
           "max_reserved_gb": max((r["max_reserved_gb"] for r in phases.values()), default=None),
           "device_used_gb": {p: r["device_used_gb"] for p, r in phases.items()},
           "checkpoint_s": {k: phases[f"checkpoint.{k}"]["seconds_total"] for k in ("save", "load")
                            if f"checkpoint.{k}" in phases}}
    text = (runs / "loop.log").read_text() if (runs / "loop.log").is_file() else ""
    return out | {"passed": "\nLOOP_OK" in "\n" + text}


def main(runs_dir: str) -> int:
    runs = Path(runs_dir)
    ran = {}
    if (runs / "parts.log").is_file():
        for line in (runs / "parts.log").read_text().splitlines():
            _, name, code, seconds = line.split()
            ran[name] = (int(code), int(seconds))
    ok = True
    for name, summary in (("copies", copies), ("parity", parity), ("loop", loop)):
        code, seconds = ran.get(name, (None, None))
        row = {"part": name, "exit": code, "seconds": seconds, **summary(runs)}
        passed = row.pop("passed")
        row["ok"] = code == 0 and passed
        ok &= row["ok"]
        print("SUMMARY " + json.dumps(row), flush=True)
    print(f"CHECK_OK in {sum(s for _, s in ran.values())}s" if ok else "CHECK_FAILED", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1]))
