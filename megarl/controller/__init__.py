"""Single controller on Ray: worker groups of SPMD ranks, the typed batch they exchange, and
local proxies so that the RL loop calls ``actor.update(batch)``, never ``.remote()``."""

from megarl.controller.protocol import Batch

__all__ = ["Batch"]
