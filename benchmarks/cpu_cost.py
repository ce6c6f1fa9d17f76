"""The cost model of benchmarks/scaling.py instantiated for this CPU machine: its constants
measured here, and the GRPO demo's step predicted per phase from them.

    python benchmarks/cpu_cost.py          # measure the constants and print them (JSON)

Constants (each from seconds of microbenchmark in a subprocess, one thread per process; each a
median of repeats, as the phases it predicts are means of ordinary steps):
- ``flops_per_s``: fp32 matmul rate of one process at the demo model's weight shapes, per CPU second;
- ``comm[world]``: gloo between pairs of processes, with ``world`` processes exchanging at once
  (pairs, as the demo's tp=2 groups): point-to-point, all-reduce, all-gather, reduce-scatter, each
  fitted as latency + bytes / bandwidth over 4 B .. 1 MiB; ``world_latency_s``, all-reduce and
  all-gather over all ``world`` ranks at 4 B .. 4 KiB; ``cpu_share``, the fraction of a core
  each of ``world`` busy processes gets (CPU time / wall time, with whatever else runs on the
  machine); and in the demo's layout at that world, with its real roles (``_layout_costs``):
  the weight sync's CPU seconds per rank outside its gloo calls (``sync_cpu_s``);
- the fixed costs of the real engines on one process (world 1, tp=1), in CPU seconds: native
  generate per call, per step and per row and step (each row samples from its own generator;
  a non-negative line through three row counts); the log-prob pass and the update per call and
  per micro-batch (from two token budgets); FLOPs / rate subtracted. On a model this small a
  pass is mostly Python and dispatch, which FLOP counts cannot give;
- ``ray_call_s[world]``, ``ray_bare_s[world]``, ``ray_generate_s[world]``: a Ray round trip from a
  driver to ``world`` actors, as a DP verb (a batch share in, a column out), as a call that
  carries no data (the weight sync's two) and as generate (prompts in, every rank's copy of the
  step's responses out);
- ``cores``: os.sched_getaffinity.

:func:`predict` adds what the layout changes: FLOPs split over tp and dp, the tensor-parallel
collectives of each micro-batch and the optimizer step's (counted in a tp=2 pass: 12 per
micro-batch forward, 15 more in its backward, 3 + 4 per step at dp > 1), each at its gloo cost,
the DP gradient all-reduce, the responses' all-gather, the weight sync's two world-wide
all-reduces and the planner's bytes; the engines' CPU seconds become wall seconds at the core
share (``cpu_share``, or the one the run got).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
DEMO = ROOT / "configs" / "grpo_demo.yaml"


def _typical(fn, repeats: int, clock=time.perf_counter) -> float:
    """Median time of ``fn()`` on ``clock`` over ``repeats`` runs after one warm-up. The median,
    not the best: the phases it is compared with are means over ordinary steps on a shared
    machine, and a best case (the least disturbed run) made every constant, and so every
    prediction, too low."""
    fn()
    samples = []
    for _ in range(repeats):
        begin = clock()
        fn()
        samples.append(clock() - begin)
    return statistics.median(samples)


def nonnegative_line(xs, ys) -> tuple:
    """(intercept, slope) of the least-squares line through (xs, ys) with both >= 0: a cost per
    call and per unit cannot be negative, and noise must not make one so. Where the free fit
    has a negative term, the best fit with that term at 0."""
    mx, my = statistics.mean(xs), statistics.mean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    intercept = my - slope * mx
    if slope < 0:
        return max(my, 0.0), 0.0
    if intercept < 0:
        return 0.0, max(sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs), 0.0)
    return intercept, slope


def _cpu_share(seconds: float = 1.0) -> float:
    """The fraction of a core this process gets while busy: CPU time over wall time of a loop of
    small torch ops (what a demo pass is made of). With ``world`` such processes at once and
    whatever else runs on the machine (other jobs, Ray's daemons), it is what each rank of a
    phase gets; cores / world is only its upper bound."""
    import torch

    x, y = torch.randn(1024, 64), torch.empty(1024, 64)
    wall, cpu = time.perf_counter(), time.process_time()
    while time.perf_counter() - wall < seconds:
        for _ in range(64):
            torch.mul(x, 1.0001, out=y)
    return (time.process_time() - cpu) / (time.perf_counter() - wall)


def demo_shape(cfg) -> dict:
    """The demo step's batch shape: prompt tokens (BOS + digits + '='), rows, new tokens, model FLOPs."""
    from megarl.data.tokenizer import DigitTokenizer
    from megarl.hybrid import ModelSpec
    from megarl.models.flops import forward_flops
    from megarl.models.hf_config import megatron_args_from_hf
    from megarl.tasks.reverse_digits import reverse_digits_records

    record = reverse_digits_records(1, cfg.data.num_digits, 0)[0]
    prompt = len(DigitTokenizer().prompt_ids(record.prompt))
    args = megatron_args_from_hf(ROOT / cfg.model.hf_config)
    return {"prompt": prompt, "rows": cfg.data.prompts_per_step * cfg.algorithm.samples_per_prompt,
            "prompts": cfg.data.prompts_per_step, "samples": cfg.algorithm.samples_per_prompt,
            "max_new": cfg.algorithm.max_new_tokens, "args": args, "flops": forward_flops(args),
            "micro_batch_tokens": cfg.data.micro_batch_tokens,
            "spec": ModelSpec.from_args(args, cfg.model.make_vocab_size_divisible_by)}


# ------------------------------------------------------------------------- microbenchmarks
def _compute_worker(out: Path, repeats: int) -> None:
    """One process, one thread: the matmul rate and the engines' fixed costs on the demo model."""
    import torch

    from megarl.algorithms.presets import resolve
    from megarl.config import load_config
    from megarl.engines.megatron_engine import MegatronEngine, MicroBatching
    from megarl.engines.train_state import build_train_state
    from megarl.hybrid import regroup
    from megarl.parallel import Layout, build_groups
    from megarl.roles.actor import Actor, ActorLossConfig
    from megarl.rollout import SamplingParams
    from megarl.rollout.native import NativeRollout
    from megarl.runtime import init_distributed, set_seed

    init_distributed()
    torch.set_num_threads(1)
    cfg = load_config([DEMO])
    algo = resolve(cfg.algorithm)
    shape = demo_shape(cfg)
    args, flops = shape["args"], shape["flops"]
    h = args.config_kwargs["hidden_size"]
    ffn = args.config_kwargs["ffn_hidden_size"]
    tokens = shape["rows"] * (shape["prompt"] + shape["max_new"])
    rates = []
    # the demo's weight matmuls on a micro-batch of its tokens: QKV, attention out, fc1 (gate+up), fc2
    for k, n in ((h, 3 * h), (h, h), (h, 2 * ffn), (ffn, h)):
        a, b = torch.randn(tokens // 2, k), torch.randn(k, n)
        seconds = _typical(lambda: [a @ b for _ in range(20)], repeats, time.process_time) / 20
        rates.append(2 * a.shape[0] * k * n / seconds)
    flops_per_s = statistics.median(rates)

    groups = build_groups(Layout(tp=1, dp=1))
    set_seed(0, groups)
    state = build_train_state(cfg.model, cfg.optimizer, groups, total_steps=1000)
    engine = MegatronEngine(state, args.vocab_size)
    # the demo's actor and its PPO loss, as megarl.controller.rl_worker builds them (GRPO: no KL term)
    assert algo.kl_coef == 0, "the demo trains without a reference policy"
    actor = Actor(engine, ActorLossConfig(
        policy_loss=algo.policy_loss, agg_mode=algo.agg_mode, clip_low=algo.clip_low, clip_high=algo.clip_high,
        kl_coef=0.0, entropy_coef=algo.entropy_coef, max_len=algo.max_new_tokens, temperature=algo.temperature,
        rollout_correction=algo.rollout_correction, rollout_correction_threshold=algo.rollout_correction_threshold))
    rollout = NativeRollout.colocated(cfg.model, args, regroup(groups.layout, 1), state.model)
    rollout.update_weights(0)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, args.vocab_size, (shape["prompt"],), generator=gen).tolist()
               for _ in range(shape["prompts"])]

    def generate(prompt_count: int, new: int) -> float:
        # no stop tokens: every row decodes ``new`` tokens (the prompt's step + new - 1 decode steps)
        sampling = SamplingParams(temperature=1.0, n=shape["samples"], max_new_tokens=new, seed=0)
        return _typical(lambda: rollout.generate(prompts[:prompt_count], sampling), repeats, time.process_time)

    # A generate call = per call + per step (a forward) + per row and step (sampling draws from
    # each row's own generator) + FLOPs: timed at 1 and 9 new tokens, on all rows, a half and a
    # quarter; the per-step cost against rows is a non-negative line through the three (two
    # differences of medians can fit a negative per-step cost on a loaded machine)
    prompt, long_new = shape["prompt"], 9
    slopes, intercepts = {}, {}
    for count in (shape["prompts"], shape["prompts"] // 2, shape["prompts"] // 4):
        rows = count * shape["samples"]
        first = rows * (prompt * (flops.per_token + flops.lm_head) + prompt ** 2 * flops.attention)
        later = sum(rows * (flops.per_token + flops.lm_head + (prompt + s) * flops.attention)
                    for s in range(1, long_new))
        short, long = generate(count, 1), generate(count, long_new)
        slopes[rows] = (long - short - later / flops_per_s) / (long_new - 1)  # per step at this many rows
        intercepts[rows] = short - first / flops_per_s - slopes[rows]
    gen_step, gen_row = nonnegative_line(list(slopes), list(slopes.values()))
    gen_call = max(statistics.median(intercepts.values()), 0.0)

    # training passes over a demo-shaped batch: one token budget and a small one, for the
    # per-micro-batch cost (slope) and the per-call cost (intercept)
    rows = shape["rows"]
    length = prompt + shape["max_new"] - 1
    width = -(-length // 8) * 8
    batch = {"tokens": torch.randint(3, args.vocab_size, (rows, width), generator=gen),
             "position_ids": torch.arange(width).expand(rows, -1).contiguous(),
             "loss_mask": torch.zeros(rows, width)}
    batch["labels"] = torch.roll(batch["tokens"], -1, 1)
    batch["loss_mask"][:, prompt - 1:length] = 1
    batch["advantages"] = torch.randn(rows, width, generator=gen) * batch["loss_mask"]
    lengths = torch.full((rows,), length)
    batch["old_log_probs"] = batch["rollout_log_probs"] = actor.compute_log_prob(
        batch, lengths, MicroBatching(max_tokens=shape["micro_batch_tokens"]))

    budgets = (shape["micro_batch_tokens"], length * 8)
    cpu = time.process_time  # the work, in CPU seconds: predict() divides by the share of a core each rank gets
    micro = [len(engine.micro_batches(batch, lengths, MicroBatching(max_tokens=b))) for b in budgets]
    fwd = [_typical(lambda: actor.compute_log_prob(batch, lengths, MicroBatching(max_tokens=b)), repeats, cpu)
           for b in budgets]
    upd = [_typical(lambda: actor.update(batch, lengths, MicroBatching(max_tokens=b)), repeats, cpu)
           for b in budgets]
    fwd_flops = flops.forward([width] * rows)  # padded rows: the engine computes the padding too
    fwd_micro = (fwd[1] - fwd[0]) / (micro[1] - micro[0])
    upd_micro = (upd[1] - upd[0]) / (micro[1] - micro[0])
    result = {"flops_per_s": flops_per_s,
              "gen_call_s": gen_call, "gen_step_s": gen_step, "gen_row_step_s": gen_row,
              "fwd_call_s": fwd[0] - micro[0] * fwd_micro - fwd_flops / flops_per_s, "fwd_micro_s": fwd_micro,
              "upd_call_s": upd[0] - micro[0] * upd_micro - 3 * fwd_flops / flops_per_s, "upd_micro_s": upd_micro,
              "raw": {"generate_step_s": slopes, "micro_batches": micro,
                                           "forward_s": fwd, "update_s": upd}}
    out.write_text(json.dumps(result))
    groups.destroy()


def _fit(sizes, times) -> dict:
    """latency + bytes / bandwidth: the latency is the median time of the small messages
    (<= 4 KiB; robust to a stray slow sample on a shared machine), the bandwidth the inverse
    least-squares slope of time against bytes over the large ones (>= 64 KiB)."""
    latency = statistics.median(t for s, t in zip(sizes, times) if s <= 4096)
    large = [(s, t) for s, t in zip(sizes, times) if s >= 65536]
    mean_s = statistics.mean(s for s, _ in large)
    mean_t = statistics.mean(t for _, t in large)
    slope = (sum((s - mean_s) * (t - mean_t) for s, t in large) / sum((s - mean_s) ** 2 for s, _ in large))
    return {"latency_s": latency, "bytes_per_s": 1 / max(slope, 1e-12), "raw_s": times}


def _comm_worker(out: Path, repeats: int) -> None:
    """Gloo between pairs of processes (ranks 2k, 2k+1 at once, as the demo's tp=2 groups run):
    one-way point-to-point (half a ping-pong) and the collectives Megatron's tensor parallelism
    uses, all-reduce, all-gather and reduce-scatter, at 4 B .. 1 MiB (a whole tensor's bytes)."""
    import torch
    import torch.distributed as dist

    from megarl.runtime import init_distributed

    init_distributed()
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    pairs = [dist.new_group([r, r + 1]) for r in range(0, world, 2)]
    dist.barrier()
    share = _cpu_share()  # every rank busy at once, as in a phase; again at the end (the load drifts)
    group, peer = pairs[rank // 2], rank ^ 1
    sizes = [2 ** k for k in range(2, 21, 2)]
    times = {"p2p": [], "all_reduce": [], "all_gather": [], "reduce_scatter": []}
    for size in sizes:
        whole = torch.zeros(max(size // 4, 2))
        half = torch.zeros(whole.numel() // 2)

        def p2p():
            if rank % 2 == 0:
                dist.send(whole, peer)
                dist.recv(whole, peer)
            else:
                dist.recv(whole, peer)
                dist.send(whole, peer)

        ops = {"p2p": p2p, "all_reduce": lambda: dist.all_reduce(whole, group=group),
               "all_gather": lambda: dist.all_gather_into_tensor(whole, half, group=group),
               "reduce_scatter": lambda: dist.reduce_scatter_tensor(half, whole, group=group)}
        for name, op in ops.items():
            dist.barrier()
            seconds = _typical(lambda: [op() for _ in range(20)], repeats) / 20
            times[name].append(seconds / 2 if name == "p2p" else seconds)
    # over the whole world, small messages only (what the phases send world-wide: the sync's flags
    # and peaks, the responses' sizes and pickles): latency, the median over 4 B .. 4 KiB
    world_latency = {}
    for name in ("all_reduce", "all_gather"):
        samples = []
        for size in [s for s in sizes if s <= 4096]:
            mine = torch.zeros(max(size // 4 // world, 1))
            every = torch.zeros(mine.numel() * world)
            op = ((lambda: dist.all_reduce(every)) if name == "all_reduce"
                  else (lambda: dist.all_gather_into_tensor(every, mine)))
            dist.barrier()
            samples.append(_typical(lambda: [op() for _ in range(20)], repeats) / 20)
        world_latency[name] = statistics.median(samples)
    dist.barrier()
    share = torch.tensor([share + _cpu_share()]) / 2
    dist.all_reduce(share)
    layout = _layout_costs(repeats)
    if rank == 0:
        out.write_text(json.dumps({"world": world, **{name: _fit(sizes, t) for name, t in times.items()},
                                   "bytes": sizes, "cpu_share": share.item() / world,
                                   "world_latency_s": world_latency, **layout}))
    dist.barrier()


def _link_worker(out: Path, repeats: int) -> None:
    """Gloo across the link of two nodes (benchmarks/netns.py), 4 ranks, 0-1 on the first node and
    2-3 on the second, as the demo's world 4 at tp=2 runs there: the data-parallel pairs (0, 2)
    and (1, 3) all-reduce at once, sharing the link, at 4 B .. 1 MiB; over all 4 ranks, all-reduce
    and all-gather (latency: the median over 4 B .. 4 KiB; the all-gather's bandwidth too, the
    responses' gather)."""
    import torch
    import torch.distributed as dist

    from megarl.runtime import init_distributed

    init_distributed()
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 4, "the link is measured as the demo's world 4 runs on two nodes"
    pairs = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    group = pairs[rank % 2]
    sizes = [2 ** k for k in range(2, 21, 2)]
    times = {"dp_all_reduce": [], "world_all_reduce": [], "world_all_gather": []}
    for size in sizes:
        whole = torch.zeros(max(size // 4, world))
        mine = torch.zeros(whole.numel() // world)
        ops = {"dp_all_reduce": lambda: dist.all_reduce(whole, group=group),
               "world_all_reduce": lambda: dist.all_reduce(whole),
               "world_all_gather": lambda: dist.all_gather_into_tensor(whole, mine)}
        calls = 20 if size <= 65536 else 2  # a MiB at a few MB/s is a second a call
        for name, op in ops.items():
            dist.barrier()
            times[name].append(_typical(lambda: [op() for _ in range(calls)], repeats) / calls)
    if rank == 0:
        fits = {name: _fit(sizes, t) for name, t in times.items()}
        fits["world_latency_s"] = {"all_reduce": fits["world_all_reduce"]["latency_s"],
                                   "all_gather": fits["world_all_gather"]["latency_s"]}
        out.write_text(json.dumps(fits))
    dist.barrier()


LINK_TIMEOUT_S = 900


def measure_link(link, repeats: int = 3) -> dict:
    """The link's constants (:func:`_link_worker`): 4 ranks started in the two namespaces of
    ``link`` (a benchmarks.netns.TwoNodeLink), the rendezvous on the first node's address."""
    import socket

    from benchmarks.netns import DEVICE

    with socket.socket() as sock:  # a port free on the first node (a fresh namespace: any is)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as work:
        out = Path(work) / "link.json"
        procs = []
        for rank in range(4):
            env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1",
                       RANK=str(rank), LOCAL_RANK=str(rank % 2), WORLD_SIZE="4", LOCAL_WORLD_SIZE="2",
                       MASTER_ADDR=link.ips[0], MASTER_PORT=str(port), GLOO_SOCKET_IFNAME=DEVICE)
            cmd = [*link.prefix(rank // 2), sys.executable, __file__, "link", "--out", str(out),
                   "--repeats", str(repeats)]
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                          text=True))
        try:
            errors = [p.communicate(timeout=LINK_TIMEOUT_S)[1] for p in procs]
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            sys.exit(f"the link's microbenchmark (4 ranks in {link.namespaces}) did not finish within "
                     f"{LINK_TIMEOUT_S} s")
        if any(p.returncode for p in procs) or not out.is_file():
            sys.exit("the link's microbenchmark failed:\n" + "\n".join(e[-2000:] for e in errors))
        return json.loads(out.read_text())


def _schedstat() -> tuple:
    """(ns on a CPU, ns runnable but waiting for one) of the calling thread, from the kernel."""
    on_cpu, waiting = map(int, Path("/proc/thread-self/schedstat").read_text().split()[:2])
    return on_cpu, waiting


def _layout_costs(repeats: int) -> dict:
    """The demo's layout at this world (actor tp=2, dp=world/2; rollout t_g=1), built as the
    workers build it, with the real rollout role, every rank at once:

    - ``sync_cpu_s``: the weight sync's two verbs, resume_memory then update_weights (the
      Resharder's changed-flags all-reduce, packing, the exchange with the micro-DP peer and the
      copies into the generation model; the phase bookkeeping's peaks all-reduce), in CPU seconds,
      the largest rank's median, less the CPU seconds inside its gloo calls: the part the model
      divides by the core share (the collectives are modelled from the gloo fits);
    - checks, printed beside the model's parts to show where a phase's error lies, not used by
      the model: ``gen_share``, the share of a core the ranks' main threads got while generating
      the demo's batch (every rank decoding its rows at once), from the scheduler's statistics
      (time on a CPU over time on a CPU or waiting in a run queue); ``generate_cpu_s``, a rank's
      CPU seconds in that generate; ``sync_wall_s``, ``generate_wall_s``, the calls' wall seconds
      without Ray (medians, largest rank)."""
    import torch
    import torch.distributed as dist

    from megarl.config import load_config
    from megarl.engines.offload import PhaseOffload
    from megarl.engines.train_state import build_train_state
    from megarl.hybrid import regroup
    from megarl.parallel import Layout, build_groups
    from megarl.roles.rollout import Rollout
    from megarl.rollout import SamplingParams
    from megarl.rollout.native import NativeRollout
    from megarl.runtime import set_seed

    cfg = load_config([DEMO])
    shape, world, tp = demo_shape(cfg), dist.get_world_size(), cfg.parallel.actor.tp
    args = shape["args"]
    groups = build_groups(Layout(tp=tp, dp=world // tp))
    set_seed(0, groups)
    state = build_train_state(cfg.model, cfg.optimizer, groups, total_steps=1000)
    engine = NativeRollout.colocated(cfg.model, args, regroup(groups.layout, cfg.parallel.rollout.tp), state.model)
    role = Rollout(engine, PhaseOffload([state], False, False, False))
    role.update_weights(0)
    # a gloo call costs CPU too (about 0.5 ms for a few bytes here), which the gloo fits already
    # count: the CPU seconds inside the sync's collectives (its all-reduces, the exchange's start
    # and wait) are measured around each call and taken out
    in_comm = [0.0]

    def counted(fn):
        def call(*a, **kw):
            begin = time.process_time()
            try:
                return fn(*a, **kw)
            finally:
                in_comm[0] += time.process_time() - begin
        return call

    transport, all_reduce = engine.resharder.transport, dist.all_reduce
    transport.start, transport.wait, dist.all_reduce = counted(transport.start), counted(transport.wait), \
        counted(all_reduce)
    sync_cpu, sync_wall = [], []
    try:
        for version in range(1, repeats + 2):  # the first one warms up
            role.release_memory()  # as the loop does before training
            dist.barrier()
            cpu, wall, in_comm[0] = time.process_time(), time.perf_counter(), 0.0
            role.resume_memory()
            role.update_weights(version)
            sync_cpu.append(time.process_time() - cpu - in_comm[0])
            sync_wall.append(time.perf_counter() - wall)
    finally:
        dist.all_reduce = all_reduce
        del transport.start, transport.wait
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, args.vocab_size, (shape["prompt"],), generator=gen).tolist()
               for _ in range(shape["prompts"])]
    sampling = SamplingParams(temperature=1.0, n=shape["samples"], max_new_tokens=shape["max_new"], seed=0)
    on_cpu = waiting = 0
    gen_wall, gen_cpu = [], []
    for i in range(repeats + 1):
        dist.barrier()
        before, wall, cpu = _schedstat(), time.perf_counter(), time.process_time()
        role.generate(prompts, sampling)
        after = _schedstat()
        gen_wall.append(time.perf_counter() - wall)
        gen_cpu.append(time.process_time() - cpu)
        if i:
            on_cpu, waiting = on_cpu + after[0] - before[0], waiting + after[1] - before[1]
    mine = torch.tensor([statistics.median(x[1:]) for x in (sync_cpu, sync_wall, gen_wall, gen_cpu)],
                        dtype=torch.float64)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    counts = torch.tensor([on_cpu, waiting], dtype=torch.float64)
    dist.all_reduce(counts)
    groups.destroy()
    return {"sync_cpu_s": mine[0].item(), "sync_wall_s": mine[1].item(), "generate_wall_s": mine[2].item(),
            "generate_cpu_s": mine[3].item(), "gen_share": (counts[0] / counts.sum()).item()}


def _ray_worker(out: Path, worlds, repeats: int) -> None:
    """A local Ray with max(worlds) actors: the driver's round trip of one call to each of
    ``world`` of them, as the loop's verbs travel: a DP verb (that rank's share of a demo-sized
    batch in, a [rows, seq] column out) and generate (the prompts in, every rank's copy of all the
    step's responses out). Medians of many: Ray's latency varies call to call."""
    import ray
    import torch

    from megarl.protocol import Batch, Columns
    from megarl.rollout.types import Response

    ray.init(num_cpus=max(worlds), include_dashboard=False, log_to_driver=False)
    try:
        @ray.remote(num_cpus=1)
        class Echo:
            def call(self, batch: Batch):
                # as the log-prob verb answers: a [rows, seq] column of the chunk
                return Columns({"old_log_probs": torch.zeros_like(batch.loss_mask)})

            def bare(self):
                # as resume_memory and update_weights travel: no data either way
                return None

            def generate(self, prompts, samples: int, new: int):
                return [Response(p, s, list(range(new)), [-0.5] * new, "length", 0)
                        for p in range(len(prompts)) for s in range(samples)]

        actors = [Echo.remote() for _ in range(max(worlds))]

        def median(call) -> float:
            call()
            samples = []
            for _ in range(10 * repeats):
                begin = time.perf_counter()
                call()
                samples.append(time.perf_counter() - begin)
            return statistics.median(samples)

        result = {"ray_call_s": {}, "ray_bare_s": {}, "ray_generate_s": {}}
        prompts = [[1, 5, 6, 7, 8, 9]] * 16
        for world in worlds:
            rows, width = 128 // (world // 2), 16  # a DP rank's chunk at tp=2: 128 rows over dp = world/2
            columns = ("tokens", "labels", "position_ids", "loss_mask", "rollout_log_probs", "old_log_probs",
                       "advantages", "returns")
            per_row = ("lengths", "response_lengths", "scores", "raw_scores", "index", "policy_versions")
            batch = Batch(**{k: torch.zeros(rows, width) for k in columns}, **{k: torch.zeros(rows) for k in per_row},
                          prompt_ids=[[0] * 6] * rows, response_ids=[[0] * (width - 5)] * rows)
            result["ray_call_s"][world] = median(lambda: ray.get([a.call.remote(batch) for a in actors[:world]]))
            result["ray_bare_s"][world] = median(lambda: ray.get([a.bare.remote() for a in actors[:world]]))
            result["ray_generate_s"][world] = median(
                lambda: ray.get([a.generate.remote(prompts, 8, 5) for a in actors[:world]]))
        out.write_text(json.dumps(result))
    finally:
        ray.shutdown()


def measure(worlds=(2, 4), repeats: int = 5) -> dict:
    """All constants, each group from its own subprocess (torchrun for the distributed ones)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1",
               RAY_AUTH_MODE="disabled")
    constants = {"cores": len(os.sched_getaffinity(0)), "comm": {}}
    with tempfile.TemporaryDirectory() as work:
        jobs = [("compute", 1), *[("comm", w) for w in worlds], ("ray", 0)]
        for what, nproc in jobs:
            out = Path(work) / f"{what}{nproc}.json"
            script = [__file__, what, "--out", str(out), "--repeats", str(repeats),
                      "--worlds", ",".join(map(str, worlds))]
            cmd = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
                   if nproc else [sys.executable]) + script
            proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
            if proc.returncode or not out.is_file():
                sys.exit(f"{' '.join(cmd)} failed:\n{proc.stderr[-4000:]}")
            result = json.loads(out.read_text())
            if what == "comm":
                constants["comm"][nproc] = result
            elif what == "ray":
                constants.update({k: {int(w): s for w, s in v.items()} for k, v in result.items()})
            else:
                constants.update(result)
    return constants


# ------------------------------------------------------------------------------ prediction
def _cost(fit: dict, nbytes: float) -> float:
    return fit["latency_s"] + nbytes / fit["bytes_per_s"]


def predict(c: dict, shape: dict, world: int, tp: int, response_mean: float, response_max: float,
            sync_bytes: float, core_share: float | None = None, link: dict | None = None) -> dict:
    """Seconds of each phase of one demo step at ``world`` ranks (actor tp=2, dp = world/2,
    sequence parallel; rollout t_g = 1), from the constants ``c``. ``response_mean`` /
    ``response_max``: the run's response lengths (the workload, not a timing); ``sync_bytes``:
    what the planner makes a rank receive; ``core_share``: the share of a core the run's ranks got
    (on a shared machine the load drifts between the microbenchmark and the run), by default the
    microbenchmark's. Every phase ends in a collective (or Ray's wait for every rank), so it takes
    as long as the last rank: all ranks' CPU seconds over their cores, the share each gets while
    all are runnable; a rank that finishes early and blocks does not speed the others up.
    ``link``: the constants of a link between two nodes (:func:`measure_link`) that the
    data-parallel groups and the world-wide collectives cross (world 4, a tp=2 group per node);
    the tensor-parallel collectives and the weight sync's exchange stay within a node."""
    import torch

    from megarl.engines import batching
    from megarl.rollout.types import Response

    assert tp == 2, "the collectives are measured in pairs: tp=2"
    flops, args = shape["flops"], shape["args"]
    layers, h = args.config_kwargs["num_layers"], args.config_kwargs["hidden_size"]
    rate, dp, comm = c["flops_per_s"], world // tp, c["comm"][world]
    # every rank is busy at once in every phase: each gets the share of a core measured with
    # `world` busy processes (at most cores/world); the engines' costs are CPU seconds
    share = comm["cpu_share"] if core_share is None else core_share
    ray = c["ray_call_s"][world]
    rows, prompt = shape["rows"], shape["prompt"]
    assert link is None or world == 4, "the link is measured at world 4 (a tp=2 group per node)"
    # what crosses the nodes' link when there is one: world-wide collectives, the DP groups
    world_latency = (link or comm)["world_latency_s"]
    gather_rate = (link["world_all_gather"] if link else comm["all_gather"])["bytes_per_s"]
    dp_reduce = link["dp_all_reduce"] if link else comm["all_reduce"]

    # generate: each of the `world` replicas decodes rows/world rows, for as many steps as its
    # longest row (every step after the prompt's is one decode step)
    gen_rows = rows / world
    steps = round(response_max)
    gen_flops = gen_rows * (prompt * (flops.per_token + flops.lm_head) + prompt ** 2 * flops.attention)
    gen_flops += sum(gen_rows * (flops.per_token + flops.lm_head + (prompt + s) * flops.attention)
                     for s in range(1, steps))
    # then every replica's responses to every rank (all_gather_object over the world: the sizes,
    # then the pickled lists, each one world-wide all-gather; the payload's bytes at the pairs'
    # all-gather bandwidth, (world - 1) shares arriving at each rank)
    share_bytes = len(pickle.dumps([Response(i, 0, list(range(steps)), [-0.5] * steps, "length", 0)
                                    for i in range(rows // world)]))
    gathered = 2 * world_latency["all_gather"] + (world - 1) * 2 * share_bytes / gather_rate
    row_steps = gen_rows * response_mean  # finished rows leave the batch
    generate = (c["ray_generate_s"][world] + gathered
                + (c["gen_call_s"] + steps * c["gen_step_s"] + row_steps * c["gen_row_step_s"] + gen_flops / rate)
                / share)

    # training passes: this DP rank's rows in token-budget micro-batches, padded to the batch width
    length = round(prompt + response_mean - 1)
    width = -(-(prompt + steps - 1) // 8) * 8
    local_rows = rows // dp
    micro = len(batching.token_budget_micro_batches(torch.full((local_rows,), length),
                                                    shape["micro_batch_tokens"]))
    act = local_rows * width / micro * h * 4  # bytes of one micro-batch's fp32 activations
    # Tensor-parallel collectives per micro-batch with sequence parallelism. Forward: in each layer
    # an all-gather before QKV and before fc1, a reduce-scatter after the attention projection and
    # after fc2; the embedding's reduce-scatter and the all-gather before the output layer; two
    # all-reduces of the vocabulary-parallel log-prob (max, then the sums). Backward: each
    # column-parallel layer (QKV, fc1, output) gathers its input again for the weight gradient and
    # reduce-scatters the input gradient; each reduce-scatter of the forward becomes an all-gather.
    column, row = 2 * layers + 1, 2 * layers + 1  # row-parallel layers and the embedding
    fwd_comm = (column * _cost(comm["all_gather"], act) + row * _cost(comm["reduce_scatter"], act)
                + 2 * _cost(comm["all_reduce"], act / h * 3))
    bwd_comm = (column + row) * _cost(comm["all_gather"], act) + column * _cost(comm["reduce_scatter"], act)
    local_flops = flops.forward([width] * local_rows) / tp
    old_log_prob = ray + (c["fwd_call_s"] + micro * c["fwd_micro_s"] + local_flops / rate) / share + micro * fwd_comm
    # after the backward (counted in a tp=2 update): the TP all-reduce of the replicated norm
    # weights' gradients, the finite check and the grad norm over the model-parallel group; over
    # the data-parallel group, which has one rank at dp=1, the DP all-reduce of this rank's
    # gradients (one bucket), the token count, the finite check and the two loss reports
    grads = shape["spec"].numel() / tp * 4
    step_comm = 3 * _cost(comm["all_reduce"], 64) + ((_cost(dp_reduce, grads) + 4 * _cost(dp_reduce, 64))
                                                      if dp > 1 else 0.0)
    update = (ray + (c["upd_call_s"] + micro * c["upd_micro_s"] + 3 * local_flops / rate) / share
              + micro * (fwd_comm + bwd_comm) + step_comm)
    # weight sync: two Ray calls that carry no data (resume_memory, update_weights); the two verbs'
    # CPU seconds on a rank of this layout (the Resharder's packing and copies, its Python);
    # two world-wide all-reduces of a few bytes (the Resharder's changed flags, the phase
    # bookkeeping's memory peaks) and one exchange with the micro-DP peer (the planner's bytes)
    sync = (2 * c["ray_bare_s"][world] + comm["sync_cpu_s"] / share
            + 2 * world_latency["all_reduce"] + _cost(comm["p2p"], sync_bytes))
    return {"generate": generate, "old_log_prob": old_log_prob, "actor_update": update, "weight_sync": sync,
            "detail": {"micro_batches": micro, "share": share, "gen_steps": steps,
                       "ray_s": ray, "gather_s": gathered,
                       "sync_collectives_s": 2 * world_latency["all_reduce"] + _cost(comm["p2p"], sync_bytes),
                       "tp_comm_old_log_prob_s": micro * fwd_comm,
                       "comm_update_s": micro * (fwd_comm + bwd_comm) + step_comm}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("what", nargs="?", default="all", choices=["all", "compute", "comm", "ray", "link"])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--worlds", default="2,4")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    worlds = [int(w) for w in args.worlds.split(",")]
    if args.what == "compute":
        _compute_worker(args.out, args.repeats)
    elif args.what == "comm":
        _comm_worker(args.out, args.repeats)
    elif args.what == "link":
        _link_worker(args.out, args.repeats)
    elif args.what == "ray":
        _ray_worker(args.out, worlds, args.repeats)
    else:
        print(json.dumps(measure(worlds, args.repeats), indent=1))


if __name__ == "__main__":
    main()
