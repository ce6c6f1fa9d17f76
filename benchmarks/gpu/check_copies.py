"""Host copies of one large tensor, the bandwidth an offload, a reload and a host-side weight sync
get: device to host and host to device, into pageable memory and into pinned memory (GB/s, the
median of REPEATS timed copies after one warm-up). Checks that every copy arrives intact
(the round trip equals the source) and that pinned memory is pinned where a GPU is present.

    python3 benchmarks/gpu/check_copies.py [--mib 2048]

Prints ``COPY`` lines and exits 1 when a check fails. Under the test suite it runs through the
GPU-shaped harness (MEGARL_GPU_SHAPED=1, started by init_distributed)."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from megarl.runtime import init_distributed

REPEATS = 3


def timed_gbps(dst: torch.Tensor, src: torch.Tensor) -> float:
    times = []
    for i in range(REPEATS + 1):
        torch.cuda.synchronize()
        start = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        if i:  # the first copy is the warm-up
            times.append(time.perf_counter() - start)
    return src.numel() * src.element_size() / statistics.median(times) / 1e9


def main(argv) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=2048)
    opts = parser.parse_args(argv)
    init_distributed()  # the device (and, under the test suite, the harness)
    n = opts.mib << 20
    device = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda",
                           generator=torch.Generator(device="cuda").manual_seed(0))
    want = device.sum(dtype=torch.int64).item()
    ok = True
    for kind in ("pageable", "pinned"):
        start = time.perf_counter()
        host = torch.empty(n, dtype=torch.uint8, pin_memory=kind == "pinned")
        alloc_s = time.perf_counter() - start
        d2h = timed_gbps(host, device)
        host_sum = host.sum(dtype=torch.int64).item()
        device.zero_()
        h2d = timed_gbps(device, host)
        arrived = host_sum == want and device.sum(dtype=torch.int64).item() == want
        pinned = host.is_pinned() if torch.version.cuda else None  # page-locking needs a CUDA build
        row_ok = arrived and (kind == "pageable" or pinned is not False)
        ok &= row_ok
        print("COPY " + json.dumps({"memory": kind, "mib": opts.mib, "d2h_gbps": round(d2h, 2),
                                    "h2d_gbps": round(h2d, 2), "alloc_s": round(alloc_s, 3), "intact": arrived,
                                    "is_pinned": pinned, "ok": row_ok}), flush=True)
        del host
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
