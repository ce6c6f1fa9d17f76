"""How an RL step scales: measured on this CPU machine, predicted for GPU clusters.

    python benchmarks/scaling.py            # the cost model checked on this CPU machine + the GPU table
    python benchmarks/scaling.py model      # the cost model only (tables + runs/scaling/*.png)
    python benchmarks/scaling.py netns [MBIT]   # world 4 on two nodes in network namespaces (root)
    python benchmarks/scaling.py cluster CONFIG [key=value ...] --ray-address HOST:PORT [--peak-tflops ...]

Checked on this machine: the same model with this machine's constants, measured in the same run
(matmul FLOP/s, gloo latency and bandwidth, the engines' fixed costs on one process, Ray's round
trip; benchmarks/cpu_cost.py), predicts each phase of the GRPO demo's step, printed beside
``megarl train``'s measurement (mean of steps 2-6) at world 2 and 4 on one Ray node and at world 4
on a two-node Ray cluster started on this machine (its "inter-node" traffic is loopback, with
the same constants). For GPU clusters: the cost model of megarl/sizing/cost.py (``megarl plan``
ranks layouts by it), which takes the weight-sync bytes from the real 3D-HybridEngine planner (per
rank, same-node vs other-node) and the compute from FLOPs, for 7B and 70B dense models,
Qwen3-30B-A3B and DeepSeek-V3 (671B) on 8 to 1024 GPUs.
Every assumption is printed with the table.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megarl.sizing import cost  # noqa: E402 (the repository root first)


# (model, GPUs, training t,p,d,e, generation t_g,p_g,e_g): typical layouts
SETUPS = [
    ("llama2-7b", 8, (2, 1, 4, 1), (1, 1, 1)),
    ("llama2-7b", 64, (4, 1, 16, 1), (1, 1, 1)),
    ("llama3-70b", 64, (8, 2, 4, 1), (4, 1, 1)),
    ("llama3-70b", 256, (8, 4, 8, 1), (8, 1, 1)),
    ("llama3-70b", 1024, (8, 4, 32, 1), (8, 1, 1)),
    ("qwen3-30b-a3b", 32, (4, 1, 8, 8), (2, 1, 1)),
    ("qwen3-30b-a3b", 128, (4, 2, 16, 8), (4, 1, 8)),
    ("deepseek-v3", 256, (8, 8, 4, 32), (8, 2, 16)),
    ("deepseek-v3", 1024, (8, 16, 8, 64), (8, 2, 32)),
]


def predict(name: str, gpus: int, train, gen, hw: cost.Hardware, wl: cost.Workload):
    from megarl.hybrid import ModelSpec
    from megarl.models.hf_config import megatron_args_from_hf
    from megarl.parallel import Layout

    args = megatron_args_from_hf(ROOT / "configs/models/reference" / f"{name}.json")
    t, p, d, e = train
    layout = Layout(tp=t, pp=p, dp=d, ep=e, etp=1 if e > 1 else None)
    assert layout.world_size == gpus, (name, gpus)
    topk = args.config_kwargs.get("moe_router_topk", 1)
    return {"model": name, "gpus": gpus, "train": train, "gen": gen,
            **cost.predict(ModelSpec.from_args(args), topk, layout, gen, hw, wl)}


def cost_model(out_dir: Path) -> None:
    hw, wl = cost.Hardware(), cost.Workload()
    print(f"\nCost model, assumptions: {hw}\n  workload per step: {wl}\n  generation = prefill at prefill_mfu + "
          f"response_tokens decode steps, each max(compute, weights/(HBM x efficiency)) per replica (KV-cache reads, "
          f"attention FLOPs and MoE dispatch are not modelled: generation is a lower bound); training = "
          f"(2 + 6) x active params x tokens at train_mfu (old log-probs + update, GRPO, no critic); weight sync "
          f"= the planner's bytes for rank 0, same-node / NVLink + other-node / InfiniBand; phases not overlapped.")
    print(f"{'model':14s} {'GPUs':>5s} {'params B (active)':>18s} {'train t,p,d,e':>14s} {'gen t,p,e':>10s} "
          f"{'generate s':>11s} {'train s':>8s} {'sync s':>7s} {'sync GB':>8s} {'step s':>8s}  decode")
    results = [predict(*setup, hw, wl) for setup in SETUPS]
    for r in results:
        print(f"{r['model']:14s} {r['gpus']:5d} {r['total_b']:8.1f} ({r['active_b']:6.1f}) "
              f"{','.join(map(str, r['train'])):>14s} {','.join(map(str, r['gen'])):>10s} {r['generate_s']:11.1f} "
              f"{r['train_s']:8.1f} {r['sync_s']:7.2f} {r['sync_gb']:8.2f} {r['step_s']:8.1f}  {r['decode_bound']}")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(9, 4))
    labels = [f"{r['model']}\n{r['gpus']} GPUs" for r in results]
    bottom = [0.0] * len(results)
    for key, label in (("generate_s", "generate"), ("train_s", "train"), ("sync_s", "weight sync")):
        values = [r[key] for r in results]
        ax.bar(labels, values, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_ylabel("predicted seconds per RL step")
    ax.set_yscale("log")
    ax.legend()
    ax.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    fig.savefig(out_dir / "cost_model.png", dpi=100)
    print(f"plot: {out_dir / 'cost_model.png'}")


PHASES = ("generate", "old_log_prob", "actor_update", "weight_sync")
TOLERANCE = 0.30  # |predicted / measured - 1| above this is flagged


class LocalCluster:
    """A two-node Ray cluster on this machine, started as launch/slurm/train.sbatch starts one
    (``ray start --head``, then ``ray start --address``), each node with ``cpus`` CPUs. Its
    processes carry a tag of their own and are killed by it (and by ancestry: Ray's agents drop
    the tag) when done; ``ray stop`` would stop every Ray on the machine."""

    TAG = "MEGARL_SCALING_CLUSTER"

    def __init__(self, cpus: int, link=None):
        import socket
        import uuid

        self.tag, self.known = uuid.uuid4().hex, set()
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        # one namespace per node when ``link`` (a benchmarks.netns.TwoNodeLink), each node at its
        # end of the link, gloo bound to it; both on loopback otherwise
        ips = link.ips if link else ["127.0.0.1", "127.0.0.1"]
        self.address = f"{ips[0]}:{port}"
        self.env = dict(os.environ, PYTHONWARNINGS="ignore", RAY_AUTH_MODE="disabled", **{self.TAG: self.tag})
        if link:
            from benchmarks.netns import DEVICE

            self.env["GLOO_SOCKET_IFNAME"] = DEVICE
        self.prefix = link.prefix(0) if link else []  # what runs a driver beside the head
        # a short temp dir of its own: Ray's socket paths must fit AF_UNIX's 107 bytes
        self.tmp = tempfile.mkdtemp(prefix="sc", dir="/tmp")
        ray = Path(sys.executable).with_name("ray")
        try:
            for node, extra in enumerate((["--head", f"--port={port}", "--include-dashboard=false",
                                           f"--temp-dir={self.tmp}"], [f"--address={self.address}"])):
                common = [f"--node-ip-address={ips[node]}", f"--num-cpus={cpus}", "--disable-usage-stats"]
                proc = subprocess.run([*(link.prefix(node) if link else []), str(ray), "start", *extra, *common],
                                      env=self.env, cwd=self.tmp, capture_output=True, text=True, timeout=300)
                self._note()
                if proc.returncode:
                    raise RuntimeError(f"ray start {' '.join(extra)} failed:\n{proc.stdout[-2000:]}"
                                       f"{proc.stderr[-2000:]}")
        except BaseException:
            self.stop()
            raise

    def _note(self) -> None:
        """Remember the cluster's processes now: the agents lose the tag (they rewrite their
        environment with their title) and are known by ancestry only while their raylet lives."""
        from megarl.runtime.processes import descendants, identity, tagged_pids

        for pid in tagged_pids(self.tag, self.TAG):
            self.known |= {identity(p) for p in [pid, *descendants(pid)]} - {None}

    def stop(self) -> None:
        import shutil

        from megarl.runtime.processes import kill_tagged

        self._note()
        kill_tagged(self.tag, self.TAG, also=self.known)
        shutil.rmtree(self.tmp, ignore_errors=True)


def measured_run(world: int, tp: int, nnodes: int = 1, link=None) -> dict:
    """``megarl train`` of the GRPO demo for 6 steps: the mean seconds of each phase over steps
    2-6 (step 1 pays one-time costs), and the mean and longest response lengths (the workload the
    prediction needs). With ``link`` (two nodes in network namespaces), also the bytes each node
    sent over it per step (mean over steps 2-6)."""
    env = dict(os.environ, PYTHONWARNINGS="ignore", RAY_AUTH_MODE="disabled")
    cluster = LocalCluster(world // nnodes, link) if nnodes > 1 else None
    try:
        with tempfile.TemporaryDirectory() as run:
            cmd = [sys.executable, "-m", "megarl.cli", "train", "configs/grpo_demo.yaml", "trainer.train_steps=6",
                   f"trainer.nnodes={nnodes}", f"trainer.nproc_per_node={world // nnodes}",
                   f"parallel.actor.tp={tp}", "logging.progress_bar=false", "logging.backends=[console]",
                   f"trainer.run_dir={run}"]
            if cluster:
                cmd.append(f"trainer.ray_address={cluster.address}")
                env = cluster.env
                cmd = cluster.prefix + cmd
            if link:
                cmd.append(f"trainer.node_ip_address={link.ips[0]}")
            stderr_path = Path(run) / "stderr.txt"
            sent = []  # the link's per-node byte counts whenever a step's metrics line appeared
            with open(stderr_path, "w") as stderr:
                proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=stderr, text=True)
                share = _core_share_while(proc, stderr_path, (lambda: _count_steps(link, Path(run), sent))
                                          if link else None)
            stderr = stderr_path.read_text()
            if proc.returncode:
                sys.exit(f"{' '.join(cmd)} failed:\n{stderr[-4000:]}")
            rows = [json.loads(line) for line in (Path(run) / "metrics.jsonl").read_text().splitlines()][1:]
        # the driver's worker list, "rank: pid N@address (node ID)": how many Ray nodes the ranks ran on
        nodes = len(set(re.findall(r"\d+: pid \d+@[^\s,]+ \(node (\w+)\)", stderr)))
    finally:
        if cluster:
            cluster.stop()
    mean = lambda k: sum(r[k] for r in rows) / len(rows)
    # the bytes between step 1's line and step 6's: steps 2-6
    steps = [(n, counts) for n, counts in sent if n >= 1]
    per_step = ([(b - a) / (steps[-1][0] - steps[0][0]) for a, b in zip(steps[0][1], steps[-1][1])]
                if len(steps) > 1 else None)
    return {**{p: mean(f"time/{p}_s") for p in PHASES + ("reward", "step")},
            "response_mean": mean("response/length_mean"), "response_max": mean("response/length_max"),
            "nodes": nodes, "core_share": share, "link_bytes_per_step": per_step}


def _count_steps(link, run: Path, sent: list) -> None:
    """Append (steps written, [bytes each node sent]) when the metrics file has a new line."""
    metrics = run / "metrics.jsonl"
    done = len(metrics.read_text().splitlines()) if metrics.is_file() else 0
    if not sent or sent[-1][0] != done:
        sent.append((done, link.sent_bytes()))


def _core_share_while(proc: subprocess.Popen, stderr: Path, poll=None) -> float:
    """The share of a core the run's workers got while runnable, from the kernel's scheduler
    statistics of their main threads (/proc/PID/schedstat: time on a CPU, time waiting in a run
    queue) between the driver's worker list and the run's end. Like the response lengths, it is
    what the run was given (here: how loaded the shared machine was), not a timing of its phases;
    time blocked (in a collective, between verbs) counts in neither."""
    first, last = {}, {}
    while proc.poll() is None:
        for pid in map(int, re.findall(r"\d+: pid (\d+)@", stderr.read_text())):
            try:
                on_cpu, waiting = map(int, Path(f"/proc/{pid}/schedstat").read_text().split()[:2])
            except (OSError, ValueError):  # exited
                continue
            first.setdefault(pid, (on_cpu, waiting))
            last[pid] = (on_cpu, waiting)
        if poll:
            poll()
        time.sleep(0.2)
    on_cpu = sum(last[p][0] - first[p][0] for p in last)
    waiting = sum(last[p][1] - first[p][1] for p in last)
    return on_cpu / (on_cpu + waiting) if on_cpu else 1.0


def cpu_breakdown() -> None:
    """This machine's constants, then the GRPO demo measured and predicted per phase at world 2
    and 4 on one Ray node and at world 4 on a two-node Ray cluster (tp=2 within a node)."""
    from benchmarks import cpu_cost
    from megarl.config import load_config
    from megarl.hybrid import ModelSpec, rank_traffic, regroup
    from megarl.parallel import Layout

    c = cpu_cost.measure()
    cfg = load_config([ROOT / "configs/grpo_demo.yaml"])
    shape = cpu_cost.demo_shape(cfg)
    tp = cfg.parallel.actor.tp
    pair = lambda fit: f"{fit['latency_s'] * 1e6:.0f} us + bytes / {fit['bytes_per_s'] / 1e9:.2f} GB/s"
    print(f"Constants measured on this machine ({c['cores']} cores; one thread per process; medians; engine "
          f"costs in CPU seconds): matmul {c['flops_per_s'] / 1e9:.1f} GFLOP per CPU second; native generate "
          f"{c['gen_call_s'] * 1e3:.1f} ms per call + {c['gen_step_s'] * 1e3:.2f} ms per step + "
          f"{c['gen_row_step_s'] * 1e6:.0f} us per row and step; log-prob pass {c['fwd_call_s'] * 1e3:.1f} ms per "
          f"call + {c['fwd_micro_s'] * 1e3:.1f} ms per micro-batch; update {c['upd_call_s'] * 1e3:.1f} ms per "
          f"call + {c['upd_micro_s'] * 1e3:.1f} ms per micro-batch (one process, tp=1, FLOPs/rate subtracted); Ray "
          f"round trip to all "
          f"workers " + ", ".join(f"{s * 1e3:.1f} ms at world {w}" for w, s in c["ray_call_s"].items())
          + " (a DP verb's batch and column; " + ", ".join(f"{s * 1e3:.1f} ms" for s in c["ray_bare_s"].values())
          + " with no data).")
    for world, fits in c["comm"].items():
        print(f"  gloo in pairs, {world} processes running: " + "; ".join(
            f"{name} {pair(fits[name])}" for name in ("p2p", "all_reduce", "all_gather", "reduce_scatter"))
              + f"; over all {world}: all_reduce {fits['world_latency_s']['all_reduce'] * 1e6:.0f} us, all_gather "
              f"{fits['world_latency_s']['all_gather'] * 1e6:.0f} us; each process gets {fits['cpu_share']:.2f} of a "
              f"core busy; weight sync (tp={tp} dp={world // tp}, rollout t_g=1, all ranks at once: resume_memory + "
              f"update_weights) {fits['sync_cpu_s'] * 1e3:.1f} ms CPU per rank outside its gloo calls")
    print("Model: every phase = Ray round trip + (engine's per-call + per-micro-batch or per-decode-step "
          "CPU seconds + FLOPs / rate) / the core share the run got + "
          "the layout's gloo messages, each at latency + bytes / bandwidth (tensor-parallel collectives counted "
          "per micro-batch and per optimizer step, DP gradient all-reduce, the responses' all-gather; weight "
          "sync: the layout's CPU seconds per rank + two world-wide all-reduces + the planner's bytes from the "
          "peer); reward (the verifier, on the driver) is measured, not modelled.")
    print(f"\nGRPO demo ({shape['prompts']} prompts x {shape['samples']} samples, {shape['max_new']} new tokens), "
          f"mean of steps 2-6, seconds: predicted / measured (ratio; * = off by more than "
          f"{TOLERANCE:.0%})")
    print(f"{'setting':>33s} " + " ".join(f"{p:>24s}" for p in PHASES + ("step",)) + f" {'reward':>7s}")
    model = ModelSpec.from_args(shape["args"], cfg.model.make_vocab_size_divisible_by)
    off = []
    for world, nnodes in ((2, 1), (4, 1), (4, 2)):
        measured = measured_run(world, tp, nnodes)
        if measured["nodes"] != nnodes:
            sys.exit(f"world {world}: the ranks ran on {measured['nodes']} Ray node(s), not {nnodes}")
        layout = Layout(tp=tp, dp=world // tp)
        # rank 0's bytes: its micro-DP group is its TP group, within a node at any nnodes here
        traffic = rank_traffic(model, regroup(layout, cfg.parallel.rollout.tp), 0, "micro_dp", world // nnodes)
        sync_bytes = traffic["received"] * 4  # fp32
        predicted = cpu_cost.predict(c, shape, world, tp, measured["response_mean"], measured["response_max"],
                                     sync_bytes, measured["core_share"])
        # the step: the phases, the measured reward and release_memory's Ray call, which carries no
        # data (the batch's assembly and the advantages, on the driver, are not modelled)
        predicted["step"] = sum(predicted[p] for p in PHASES) + measured["reward"] + c["ray_bare_s"][world]
        setting = f"world {world}" + (f" ({nnodes} Ray nodes)" if nnodes > 1 else "") + f" tp={tp} dp={world // tp}"
        cells = []
        for phase in PHASES + ("step",):
            ratio = predicted[phase] / measured[phase]
            flag = "*" if abs(ratio - 1) > TOLERANCE else " "
            if flag == "*":
                off.append((setting, phase, ratio))
            cells.append(f"{predicted[phase]:.3f} / {measured[phase]:.3f} ({ratio:4.2f}){flag}")
        print(f"{setting:>33s} " + " ".join(f"{cell:>24s}" for cell in cells) + f" {measured['reward']:7.3f}")
        d = predicted["detail"]
        print(f"{'':>33s} of which: Ray {d['ray_s'] * 1e3:.1f} ms per call, core share during the run {d['share']:.2f} "
              f"({c['comm'][world]['cpu_share']:.2f} in the microbenchmark), "
              f"{d['micro_batches']} micro-batch(es) per rank, {d['gen_steps']} generation steps, gloo in the "
              f"log-prob pass {d['tp_comm_old_log_prob_s'] * 1e3:.1f} ms and in the update "
              f"{d['comm_update_s'] * 1e3:.1f} ms; sync {sync_bytes / 1e3:.0f} kB per rank")
        fits = c["comm"][world]
        # the model at the check's workload: every row decodes max_new tokens
        full = cpu_cost.predict(c, shape, world, tp, shape["max_new"], shape["max_new"], sync_bytes,
                                measured["core_share"])
        print(f"{'':>33s} without Ray (the layout's roles in a torchrun, every rank at once, every row at "
              f"{shape['max_new']} tokens): generate {fits['generate_wall_s'] * 1e3:.1f} ms vs the model's "
              f"{(full['generate'] - c['ray_generate_s'][world]) * 1e3:.1f} ms (gather "
              f"{full['detail']['gather_s'] * 1e3:.1f} ms; a rank's CPU {fits['generate_cpu_s'] * 1e3:.1f} ms, "
              f"its share of a core while runnable {fits['gen_share']:.2f}); weight sync "
              f"{fits['sync_wall_s'] * 1e3:.1f} ms vs the model's "
              f"{(predicted['weight_sync'] - 2 * c['ray_bare_s'][world]) * 1e3:.1f} ms (collectives "
              f"{d['sync_collectives_s'] * 1e3:.1f} ms)")
    print("all phases within" if not off else "off by more than", f"{TOLERANCE:.0%}" + (
        "" if not off else ": " + "; ".join(f"{s} {p} x{r:.2f}" for s, p, r in off)))


def netns_check(rate_mbit: float) -> None:
    """The GRPO demo at world 4 on two Ray nodes in network namespaces (benchmarks/netns.py: real
    sockets between them over a veth pair limited to ``rate_mbit`` each way), measured beside the
    prediction from this machine's constants plus the link's, measured in the same run; and the
    bytes each node sent over the link per step beside the collectives' bytes the model counts."""
    from benchmarks import cpu_cost, netns
    from megarl.config import load_config
    from megarl.hybrid import ModelSpec, rank_traffic, regroup
    from megarl.parallel import Layout

    why = netns.available()
    if why:
        sys.exit(f"benchmarks/scaling.py netns: {why}")
    world, nnodes = 4, 2
    cfg = load_config([ROOT / "configs/grpo_demo.yaml"])
    shape, tp = cpu_cost.demo_shape(cfg), cfg.parallel.actor.tp
    c = cpu_cost.measure(worlds=(world,))
    link = netns.TwoNodeLink(rate_mbit)
    try:
        fits = cpu_cost.measure_link(link)
        measured = measured_run(world, tp, nnodes, link)
    finally:
        link.close()
    if measured["nodes"] != nnodes:
        sys.exit(f"the ranks ran on {measured['nodes']} Ray node(s), not {nnodes}")
    pair = lambda fit: f"{fit['latency_s'] * 1e6:.0f} us + bytes / {fit['bytes_per_s'] / 1e6:.1f} MB/s"
    print(f"Link: two network namespaces, a veth pair limited to {rate_mbit:g} Mbit/s each way (tc tbf). Gloo "
          f"across it, 4 ranks, a tp=2 pair per node: the two DP pairs' all-reduce at once "
          f"{pair(fits['dp_all_reduce'])}; over all 4: all-reduce {pair(fits['world_all_reduce'])}, all-gather "
          f"{pair(fits['world_all_gather'])}")
    model = ModelSpec.from_args(shape["args"], cfg.model.make_vocab_size_divisible_by)
    layout = Layout(tp=tp, dp=world // tp)
    rg = regroup(layout, cfg.parallel.rollout.tp)
    per_node = world // nnodes
    traffic = [rank_traffic(model, rg, r, "micro_dp", per_node) for r in range(world)]
    sync_cross = sum(t["received_other_nodes"] for t in traffic) * 4  # fp32, both directions
    predicted = cpu_cost.predict(c, shape, world, tp, measured["response_mean"], measured["response_max"],
                                 traffic[0]["received"] * 4, measured["core_share"], link=fits)
    predicted["step"] = sum(predicted[p] for p in PHASES) + measured["reward"] + c["ray_bare_s"][world]
    print(f"\nGRPO demo, world {world} on {nnodes} namespaced Ray nodes, tp={tp} dp={world // tp} (the driver on the "
          f"first node), mean of steps 2-6, seconds: predicted / measured (ratio)")
    for phase in PHASES + ("step",):
        ratio = predicted[phase] / measured[phase]
        print(f"  {phase:>13s} {predicted[phase]:7.3f} / {measured[phase]:7.3f}  ({ratio:4.2f})")
    # the collectives' bytes across the link per step, each direction: the two DP pairs' ring
    # all-reduce of the gradients (each rank sends its whole share once: half in the reduce-scatter,
    # half in the all-gather), and the responses' all-gather over 4 ranks (a ring crosses the link
    # twice, each crossing carries 3 shares: the sizes, then the pickles)
    grads = model.numel() / tp * 4
    share = measured["response_mean"] * 8 * shape["rows"] / world  # ~8 pickled bytes per token
    counted = 2 * grads + 3 * share
    sent = measured["link_bytes_per_step"]
    print(f"  link bytes per step, sent by node 0 / node 1: {sent[0] / 1e3:.0f} kB / {sent[1] / 1e3:.0f} kB; the "
          f"model's collectives {counted / 1e3:.0f} kB each way (DP all-reduce {2 * grads / 1e3:.0f} kB); the "
          f"weight sync's planner bytes across nodes {sync_cross / 1e3:.0f} kB (micro-DP groups within a node); "
          f"the rest is Ray's traffic (the driver on node 0), which the model does not count")
    ray_bytes = max(sent[0] - counted, 0.0)  # node 0's: the driver's calls out (the larger direction)
    with_ray = predicted["step"] + ray_bytes / (rate_mbit * 1e6 / 8)
    print(f"  the step predicted with node 0's uncounted bytes at the link's rate ({ray_bytes / 1e3:.0f} kB, measured): "
          f"{with_ray:.3f} / {measured['step']:.3f} ({with_ray / measured['step']:.2f})")


def cluster_check(argv) -> None:
    """``megarl train`` of the user's config on a real cluster (a Ray address: launch/slurm/train.sbatch's
    head node, or any Ray cluster), each phase's seconds (mean of the steps after the first) beside
    megarl/sizing/cost.py's prediction for the same layout, model and measured response lengths,
    on the hardware the flags describe; and the weight sync's bytes per link from the planner
    (what each rank receives from its own node and from others: the 3D-HybridEngine moves
    exactly these)."""
    import argparse
    import dataclasses

    from megarl.checkpoint.load import resolve_model_config
    from megarl.config import load_config
    from megarl.hybrid import ModelSpec, rank_traffic, regroup
    from megarl.models.hf_config import megatron_args_from_hf
    from megarl.parallel import Layout

    parser = argparse.ArgumentParser(prog="benchmarks/scaling.py cluster", description=cluster_check.__doc__)
    parser.add_argument("config", nargs="+", help="a megarl config file, then key=value overrides")
    parser.add_argument("--ray-address", required=True, help="the cluster's head, host:port")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--timeout-s", type=float, default=3600.0, help="the longest the run may take")
    for field in dataclasses.fields(cost.Hardware):
        parser.add_argument(f"--{field.name.replace('_', '-')}", type=type(field.default), default=field.default)
    flags = parser.parse_args(argv)
    files = [a for a in flags.config if "=" not in a]
    overrides = [a for a in flags.config if "=" in a]
    hw = cost.Hardware(**{f.name: getattr(flags, f.name) for f in dataclasses.fields(cost.Hardware)})
    with tempfile.TemporaryDirectory() as run:
        cmd = [sys.executable, "-m", "megarl.cli", "train", *files, *overrides, f"trainer.train_steps={flags.steps}",
               f"trainer.ray_address={flags.ray_address}", "logging.progress_bar=false", f"trainer.run_dir={run}"]
        try:
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=flags.timeout_s)
        except subprocess.TimeoutExpired:
            sys.exit(f"{' '.join(cmd)} did not finish within --timeout-s={flags.timeout_s:g}; raise it for a longer run")
        if proc.returncode:
            sys.exit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
        rows = [json.loads(line) for line in (Path(run) / "metrics.jsonl").read_text().splitlines()][1:]
        cfg = load_config(files, overrides + [f"trainer.run_dir={run}"])
    if not rows:
        sys.exit("--steps must be at least 2: the first step pays one-time costs and is left out")
    mean = lambda k: sum(r.get(k, 0.0) for r in rows) / len(rows)
    model_cfg = resolve_model_config(cfg.model)
    args = megatron_args_from_hf(model_cfg.hf_config)
    model = ModelSpec.from_args(args, cfg.model.make_vocab_size_divisible_by)
    world = cfg.trainer.nnodes * cfg.trainer.nproc_per_node
    train = Layout.from_config(cfg.parallel.actor, world)
    roll = cfg.parallel.rollout
    gen = (roll.tp, roll.pp, roll.ep)
    wl = cost.Workload(prompts=cfg.data.prompts_per_step, samples=cfg.algorithm.samples_per_prompt,
                       prompt_tokens=max(round(mean("prompt/length_mean")), 1),
                       response_tokens=max(round(mean("response/length_mean")), 1),
                       bytes_per_param=2 if "16" in str(cfg.model.params_dtype) else 4)
    topk = args.config_kwargs.get("moe_router_topk", 1)
    predicted = cost.predict(model, topk, train, gen, hw, wl)
    measured = {"generate_s": mean("time/generate_s"), "sync_s": mean("time/weight_sync_s"),
                "train_s": sum(mean(k) for k in rows[0] if k.startswith("time/") and k.endswith(
                    ("log_prob_s", "update_s", "values_s"))),
                "step_s": mean("time/step_s")}
    print(f"{world} ranks, training {train}, generation t,p,e={gen}, {hw}; workload {wl} (response and prompt "
          f"lengths measured); mean of steps 2-{flags.steps}, seconds: predicted / measured (ratio)")
    for key, label in (("generate_s", "generate"), ("train_s", "log-probs + updates"), ("sync_s", "weight sync"),
                       ("step_s", "step")):
        ratio = predicted[key] / measured[key] if measured[key] else float("nan")
        print(f"  {label:>20s} {predicted[key]:9.3f} / {measured[key]:9.3f}  ({ratio:.2f})")
    rg = regroup(train, *gen, model.num_experts)
    traffic = [rank_traffic(model, rg, r, "micro_dp", hw.gpus_per_node) for r in range(world)]
    same = max(t["received"] - t["received_other_nodes"] for t in traffic) * wl.bytes_per_param
    other = max(t["received_other_nodes"] for t in traffic) * wl.bytes_per_param
    across = sum(t["received_other_nodes"] for t in traffic) * wl.bytes_per_param
    print(f"  weight sync bytes per rank (the planner's, the most any rank receives): {same / 1e6:.1f} MB from its "
          f"node, {other / 1e6:.1f} MB from other nodes; all ranks together {across / 1e6:.1f} MB across nodes")


def main() -> None:
    what = sys.argv[1] if len(sys.argv) > 1 else "all"
    if what == "cluster":
        cluster_check(sys.argv[2:])
        return
    if what == "netns":
        netns_check(float(sys.argv[2]) if len(sys.argv) > 2 else 20.0)
        return
    if what == "all":
        cpu_breakdown()
    cost_model(ROOT / "runs" / "scaling")


if __name__ == "__main__":
    main()
