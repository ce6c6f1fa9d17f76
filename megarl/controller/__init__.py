"""Single controller on Ray: worker groups of SPMD ranks and the role proxies through which the RL
loop calls ``actor.update(batch)``, never ``.remote()`` (the Batch they exchange: megarl.protocol)."""
