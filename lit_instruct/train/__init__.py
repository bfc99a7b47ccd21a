"""Training: the LightningModule, the strategies (devices and sharding), the token-weighted window,
and the callbacks the module installs itself (throughput, RNG states, the fit report).

Importing it registers the strategy names (``one_device``, ``ddp_lora``, ``fsdp_lora``) in
Lightning's registry, here and nowhere else, so that ``Trainer(strategy="one_device")`` and YAML find
them once any training class is imported.
"""

from lit_instruct.train.strategy import register_strategies

register_strategies()
