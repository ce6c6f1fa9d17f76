"""Probes for ``benchmarks/rollout.py``: per-thread CPU time of processes from ``/proc`` (what the
vLLM engine's processes really use while they generate, and while the others do), and where the
native engine's decode spends its time (module hooks and torch.profiler, one run each).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import defaultdict
from typing import Dict, Iterable, List, Tuple

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


# ----------------------------------------------------------------------------- /proc


def _stat_fields(path: str) -> List[str]:
    """The fields of a ``/proc/.../stat`` file after ``(comm)``: state, ppid, ... (utime at 11, stime at 12)."""
    with open(path) as f:
        return f.read().rsplit(")", 1)[1].split()


def process_tree(root: int) -> List[int]:
    """``root`` and all its descendants (pids), parents first."""
    children: Dict[int, List[int]] = defaultdict(list)
    for name in os.listdir("/proc"):
        if name.isdigit():
            with contextlib.suppress(OSError, IndexError):
                children[int(_stat_fields(f"/proc/{name}/stat")[1])].append(int(name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop(0)
        out.append(pid)
        todo += sorted(children.get(pid, []))
    return out


def comm(pid) -> str:
    """The name of process ``pid`` (or of thread ``'pid/task/tid'``)."""
    with contextlib.suppress(OSError):
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    return "?"


def status(pid: int, key: str) -> str:
    """A field of ``/proc/<pid>/status`` (``Threads``, ``Cpus_allowed_list``), '?' if unreadable.
    (``/proc/<pid>/environ`` is no use for vLLM's processes: setproctitle overwrites it.)"""
    with contextlib.suppress(OSError):
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return line.split(":", 1)[1].strip()
    return "?"


def thread_cpu(pids: Iterable[int]) -> Dict[Tuple[int, int], float]:
    """CPU seconds (user + system) of every thread of ``pids``, by (pid, tid)."""
    out = {}
    for pid in pids:
        with contextlib.suppress(OSError):
            for tid in os.listdir(f"/proc/{pid}/task"):
                with contextlib.suppress(OSError, IndexError):
                    f = _stat_fields(f"/proc/{pid}/task/{tid}/stat")
                    out[(pid, int(tid))] = (int(f[11]) + int(f[12])) * TICK_S
    return out


class CpuWatch:
    """CPU use of ``pids``' threads over a ``with`` block: per process, CPU seconds and the
    threads that ran for at least ``busy`` of the block's wall time."""

    def __init__(self, pids: Iterable[int], busy: float = 0.1):
        self.pids, self.busy = list(pids), busy
        self.wall = 0.0
        self.cpu: Dict[int, float] = {}
        self.busy_threads: Dict[int, int] = {}
        self.busy_names: Dict[int, List[str]] = {}

    def __enter__(self):
        self.before = thread_cpu(self.pids)
        self.begin = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.wall = time.perf_counter() - self.begin
        after = thread_cpu(self.pids)
        self.cpu = {pid: 0.0 for pid in self.pids}
        self.busy_threads = {pid: 0 for pid in self.pids}
        self.busy_names = {pid: [] for pid in self.pids}
        for (pid, tid), seconds in after.items():
            used = seconds - self.before.get((pid, tid), 0.0)
            self.cpu[pid] += used
            if used >= self.busy * self.wall:
                self.busy_threads[pid] += 1
                self.busy_names[pid].append(f"{comm(f'{pid}/task/{tid}')} {used / self.wall:.0%}")
        return False

    def total(self) -> float:
        """CPU seconds of all the processes over the block."""
        return sum(self.cpu.values())


# ----------------------------------------------------------------------------- the native decode


def _category(name: str) -> str:
    """The breakdown category of the generation model's module ``name`` ('' if not timed)."""
    last = name.rsplit(".", 1)[-1]
    parts = name.split(".")
    if name == "":
        return "model"
    if name == "embedding":
        return "embedding"
    if name == "output_layer":
        return "output_layer"
    if name == "decoder.final_layernorm":
        return "final_norm"
    if last in ("input_layernorm", "pre_mlp_layernorm"):
        return "norms"
    if len(parts) == 3 and parts[:2] == ["decoder", "layers"]:
        return "layer"
    if last in ("self_attention", "core_attention", "linear_qkv", "linear_proj", "mlp", "linear_fc1", "linear_fc2"):
        return last
    return ""


def profile_native(rollout, prompts, sampling, top: int = 8) -> List[str]:
    """Where one native ``generate`` of ``prompts`` spends its time: a run with timing hooks on
    the model's modules, the sampler, the KV-cache update and the model call, then a run under
    torch.profiler (ATen ops by self time). One thread, so wall-clock intervals nest exactly."""
    import torch

    import megarl.rollout.native as native

    spent: Dict[str, float] = defaultdict(float)
    calls: Dict[str, int] = defaultdict(int)
    starts: Dict[int, float] = {}
    handles, restore = [], []

    def timed(key, fn):
        def wrapper(*args, **kwargs):
            begin = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[key] += time.perf_counter() - begin
                calls[key] += 1
        return wrapper

    for name, module in rollout.model.named_modules():
        key = _category(name)
        if not key:
            continue
        handles.append(module.register_forward_pre_hook(lambda m, a: starts.__setitem__(id(m), time.perf_counter())))

        def post(m, a, out, key=key):
            spent[key] += time.perf_counter() - starts.pop(id(m))
        handles.append(module.register_forward_hook(post))
        if key == "self_attention" and "_adjust_key_value_for_inference" in vars(module):
            original = module._adjust_key_value_for_inference
            module._adjust_key_value_for_inference = timed("rope_kv_cache", original)
            restore.append((module, "_adjust_key_value_for_inference", original))
    forward = timed("forward", rollout._logits)

    def logits(*args, **kwargs):  # the first model call of a generate is the prefill
        begin, first = time.perf_counter(), calls["forward"] == 0
        try:
            return forward(*args, **kwargs)
        finally:
            if first:
                spent["prefill"] += time.perf_counter() - begin
    rollout._logits = logits
    restore.append((rollout, "_logits", None))
    original_sample = native.sample
    native.sample = timed("sampling", original_sample)
    try:
        rollout.generate(prompts, sampling)
        hooked = rollout.last.seconds
    finally:
        for h in handles:
            h.remove()
        native.sample = original_sample
        for obj, attr, value in restore:
            if value is None:
                delattr(obj, attr)  # the instance attribute goes; the method shows through again
            else:
                setattr(obj, attr, value)

    rollout.generate(prompts, sampling)
    plain = rollout.last.seconds
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        rollout.generate(prompts, sampling)
    profiled = rollout.last.seconds
    events = prof.key_averages()
    ops = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)
    op_total = sum(e.self_cpu_time_total for e in events) / 1e6

    s = spent
    linears = s["linear_qkv"] + s["linear_proj"] + s["linear_fc1"] + s["linear_fc2"]
    rows = [
        ("matmuls of the layers (qkv, proj, fc1, fc2; plain matmul + bias)", linears),
        (f"output layer (logits matmul, vocab {rollout.vocab})", s["output_layer"]),
        ("core attention (SDPA over the cached keys, GQA)", s["core_attention"]),
        ("RoPE of the new token + KV-cache append", s["rope_kv_cache"]),
        ("rest of self-attention (head split, reshapes, Megatron glue)",
         s["self_attention"] - s["linear_qkv"] - s["linear_proj"] - s["core_attention"] - s["rope_kv_cache"]),
        ("rest of the MLP (SwiGLU activation)", s["mlp"] - s["linear_fc1"] - s["linear_fc2"]),
        ("RMSNorms", s["norms"] + s["final_norm"]),
        ("rest of TransformerLayer (residual adds, bias-dropout-add)",
         s["layer"] - s["self_attention"] - s["mlp"] - s["norms"]),
        ("embedding", s["embedding"]),
        ("rest of GPTModel (rotary table, decoder block glue)",
         s["model"] - s["layer"] - s["embedding"] - s["output_layer"] - s["final_norm"]),
        ("model call outside GPTModel (positions, logits slice; no gathers at t_g=1)", s["forward"] - s["model"]),
        ("sampling (log-softmax over the vocabulary, argmax, gather)", s["sampling"]),
        ("decode loop outside model and sampler (token concat, masks, .tolist)",
         hooked - s["forward"] - s["sampling"]),
    ]
    steps = calls["forward"]
    out = [f"native generate, batch {len(prompts)}, {sampling.max_new_tokens} new tokens, one thread: "
           f"{plain:.2f} s plain, {hooked:.2f} s with timing hooks, {profiled:.2f} s under torch.profiler",
           f"  hooked run: prefill forward {s['prefill']:.3f} s, {steps - 1} decode steps "
           f"{1e3 * (hooked - s['prefill']) / max(steps - 1, 1):.1f} ms each (model call "
           f"{1e3 * (s['forward'] - s['prefill']) / max(steps - 1, 1):.1f} ms, sampling "
           f"{1e3 * s['sampling'] / max(steps, 1):.2f} ms)",
           "  where the hooked run's time goes:"]
    for label, seconds in rows:
        out.append(f"    {label:<78s} {seconds:6.3f} s {100 * seconds / hooked:5.1f}%")
    out.append(f"  ATen ops' self CPU time under torch.profiler: {op_total:.2f} s of {profiled:.2f} s wall "
               f"({100 * op_total / profiled:.0f}%; the rest is Python: Megatron's modules, the decode loop, the profiler)")
    for e in ops[:top]:
        out.append(f"    {e.key:<40s} {e.self_cpu_time_total / 1e6:6.3f} s {100 * e.self_cpu_time_total / 1e6 / profiled:5.1f}% "
                   f"{e.count:7d} calls {e.self_cpu_time_total / max(e.count, 1):7.1f} us/call")
    return out



# ----------------------------------------------------------------------------- the sampler alone


def sampler_step_times(vocabs=(4096, 151936), batches=(1, 16, 64), repeats: int = 20) -> List[str]:
    """Time per decode step of token selection alone, in one run, best of ``repeats``: the
    sampler before issue 42 (one ``torch.multinomial`` per row, a generator per row), the batched
    one (:func:`megarl.rollout.sampling.sample`: inversion with one counter-based uniform per
    row), and Gumbel-max over the same counter-based hash (one uniform per vocabulary entry, the
    alternative it was chosen over). Each includes the step's read of the tokens to the host, as
    the decode loop does. Temperature 0.8, top-p 0.9, fp32 logits from ``torch.randn``."""
    import torch

    from megarl.rollout import SamplingParams
    from megarl.rollout.sampling import _mix32, filter_logits, row_key, row_keys, sample

    params = SamplingParams(temperature=0.8, top_p=0.9)

    def per_row(logits, generators):
        probs = torch.softmax(filter_logits(logits.float() / 0.8, 0, 0.9), dim=-1)
        return torch.stack([torch.multinomial(probs[i], 1, generator=g)[0] for i, g in enumerate(generators)])

    def gumbel(logits, keys, step):
        index = torch.arange(logits.shape[-1], dtype=torch.int64)
        bits = _mix32((_mix32(keys ^ step)[:, None] ^ index) & 0xFFFF_FFFF)
        exponential = -((((bits >> 8).float() + 0.5) * 2.0 ** -24).log())
        probs = torch.softmax(filter_logits(logits.float() / 0.8, 0, 0.9), dim=-1)
        return (probs / exponential).argmax(-1)

    def best(fn):
        fn()
        times = []
        for _ in range(repeats):
            begin = time.perf_counter()
            fn()
            times.append(time.perf_counter() - begin)
        return 1e3 * min(times)

    out = [f"token selection per decode step (ms, best of {repeats}, {torch.get_num_threads()} thread(s), "
           f"T=0.8, top-p 0.9; each with the step's host read)",
           f"{'vocab':>7s} {'batch':>5s} {'per-row multinomial':>20s} {'batched (inversion)':>20s} "
           f"{'speed-up':>9s} {'Gumbel-max (hashed)':>20s}"]
    for vocab in vocabs:
        for batch in batches:
            logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(batch))
            generators = [torch.Generator().manual_seed(row_key(1, i, 0)) for i in range(batch)]
            keys = row_keys(row_key(1, i, 0) for i in range(batch))
            old = best(lambda: per_row(logits, generators).tolist())
            new = best(lambda: sample(logits, params, keys, 7)[0].tolist())
            hashed = best(lambda: gumbel(logits, keys, 7).tolist())
            out.append(f"{vocab:7d} {batch:5d} {old:20.3f} {new:20.3f} {old / new:8.1f}x {hashed:20.3f}")
    return out
