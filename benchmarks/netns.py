"""Two "nodes" on this machine whose traffic crosses a real link: a network namespace each, joined
by a veth pair whose both ends send through a token-bucket bandwidth limit (``tc qdisc ... tbf``),
so that what one node sends the other reaches over sockets between namespaces, at the link's
rate, and is counted by the kernel per direction (``/sys/class/net/<dev>/statistics``).
Loopback, which two Ray nodes started in one namespace use, has neither limit nor count.

Needs root (CAP_NET_ADMIN) and iproute2; :func:`available` says why not otherwise. Used by
``benchmarks/scaling.py netns``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from typing import List, Optional, Sequence

DEVICE = "mrl0"  # the same name at both ends (each in its own namespace): one GLOO_SOCKET_IFNAME for all ranks


def _ip(*args: str) -> None:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if proc.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {proc.stderr.strip()}")


def available() -> Optional[str]:
    """None when namespaces, veth and tbf can be set up here; otherwise what is missing."""
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN)"
    return None


class TwoNodeLink:
    """Namespaces ``<prefix>a`` and ``<prefix>b`` with addresses ``10.<subnet>.0.1`` and ``.2``,
    a veth pair between them limited to ``rate_mbit`` in each direction; :meth:`close` removes
    them (a namespace's processes must be gone first)."""

    def __init__(self, rate_mbit: float, subnet: int = 211):
        self.rate_mbit = rate_mbit
        prefix = f"mr{os.getpid()}"
        self.namespaces = [prefix + "a", prefix + "b"]
        self.ips = [f"10.{subnet}.0.1", f"10.{subnet}.0.2"]
        made: List[str] = []
        try:
            for ns in self.namespaces:
                _ip("netns", "add", ns)
                made.append(ns)
            a, b = self.namespaces
            _ip("link", "add", DEVICE, "netns", a, "type", "veth", "peer", "name", DEVICE, "netns", b)
            for ns, ip in zip(self.namespaces, self.ips):
                _ip("-n", ns, "addr", "add", f"{ip}/24", "dev", DEVICE)
                _ip("-n", ns, "link", "set", "lo", "up")
                _ip("-n", ns, "link", "set", DEVICE, "up")
                # a burst of 64 kB: small enough that a collective's bytes are paced by the rate
                self.run(ns, ["tc", "qdisc", "add", "dev", DEVICE, "root", "tbf", "rate", f"{rate_mbit}mbit",
                              "burst", "64kb", "latency", "100ms"], check=True)
        except BaseException:
            self.namespaces = made
            self.close()
            raise

    def prefix(self, node: int) -> List[str]:
        """The command prefix that runs a program inside node ``node``'s namespace."""
        return ["ip", "netns", "exec", self.namespaces[node]]

    def run(self, ns: str, cmd: Sequence[str], check: bool = False) -> subprocess.CompletedProcess:
        proc = subprocess.run(["ip", "netns", "exec", ns, *cmd], capture_output=True, text=True, timeout=60)
        if check and proc.returncode:
            raise RuntimeError(f"{' '.join(cmd)} in {ns}: {proc.stderr.strip()}")
        return proc

    def sent_bytes(self) -> List[int]:
        """Bytes each node has sent over the link so far (the kernel's count on its end)."""
        return [int(self.run(ns, ["cat", f"/sys/class/net/{DEVICE}/statistics/tx_bytes"], check=True).stdout)
                for ns in self.namespaces]

    def close(self) -> None:
        for ns in self.namespaces:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        self.namespaces = []
