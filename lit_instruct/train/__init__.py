"""Training: the LightningModule, the strategies (devices and sharding), the token-weighted window,
and the callbacks the module installs itself (throughput, RNG states, the fit report).

Importing it registers the strategy names (``fused_ce``, ``fused_ce_ddp``, ``fused_ce_fsdp``) in
Lightning's registry, here and nowhere else, so that ``Trainer(strategy="fused_ce")`` and YAML find
them once any training class is imported.
"""

from lit_instruct.train.strategy import register_strategies

register_strategies()
