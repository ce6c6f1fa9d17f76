"""Run specs of the distributed workers: ``name@t,p,d,e[,vpp][:micro-batching]``."""

from typing import Tuple

from megarl.engines.megatron_engine import MicroBatching
from megarl.parallel import Layout

HOW = {"fixed": MicroBatching(micro_batch_size=2), "dynamic": MicroBatching(max_tokens=24),
       "packed": MicroBatching(micro_batch_size=2, packed=True),
       "dynamic-packed": MicroBatching(max_tokens=24, packed=True)}


def parse(spec: str) -> Tuple[str, Layout, str]:
    """(model name, layout (etp=1 when ep>1), micro-batching mode)."""
    name, rest = spec.split("@")
    sizes, mode = rest.split(":") if ":" in rest else (rest, "fixed")
    tp, pp, dp, ep, vpp = (int(x) for x in (sizes + ",0").split(",")[:5])
    return name, Layout(tp=tp, pp=pp, dp=dp, ep=ep, etp=1 if ep > 1 else None, vpp=vpp or None), mode
