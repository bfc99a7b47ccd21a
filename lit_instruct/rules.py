"""What each setting may be, and which settings cannot go together: checked on the parsed config before
anything is read (the command line), and again when a model is built from Python.

Settings are a flat mapping of dotted names (``model.lora.r``, ``data.streaming``,
``trainer.strategy``) to values; a rule whose settings are not all in the mapping does not apply
(building a model from Python knows no ``data.*`` or ``trainer.*``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from lit_instruct.errors import ConfigError

RESIDUAL_INIT = re.compile(r"pissa|pissa_niter_\d+|olora")
INITS = ("default", "gaussian", "pissa", "pissa_niter_N", "olora", "eva", "loftq")
REFUSED_INITS = {
    "corda": "needs its own covariance pass with peft's preprocessing, which lit-instruct does not do yet",
}
FSDP_STRATEGIES = (
    "fsdp_lora",
    "fused_ce_fsdp",
    "lit_instruct.train.strategy.LoRAFSDPStrategy",
    "lit_instruct.train.strategy.FusedCEFSDPStrategy",
)
"""``fsdp_lora`` by its name, former name and class paths."""


def is_residual_init(init: str) -> bool:
    """``init`` rewrites the base weights into a residual (PiSSA, OLoRA)."""
    return RESIDUAL_INIT.fullmatch(init) is not None


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _positive_int(value: Any) -> bool:
    return _int(value) and value > 0


def _names(value: Any) -> bool:
    return isinstance(value, list | tuple) and all(isinstance(v, str) and v.strip() for v in value)


def _or_none(valid: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda value: value is None or valid(value)


def _init(value: Any) -> bool:
    return isinstance(value, str) and (value in INITS or is_residual_init(value))


VALUES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "model.lora.r": (_positive_int, "must be a positive integer"),
    "model.lora.alpha": (lambda v: _number(v) and v > 0, "must be a positive number"),
    "model.lora.dropout": (lambda v: _number(v) and 0 <= v < 1, "must be in [0, 1)"),
    "model.lora.target_modules": (
        lambda v: (_names(v) and len(v) > 0) or v == "all-linear",
        "must be a non-empty list of module names, or [all-linear]",
    ),
    "model.lora.init": (_init, f"must be one of {', '.join(INITS)} (N: iterations, e.g. pissa_niter_4)"),
    "model.lora.layers_to_transform": (
        lambda v: v is None or (isinstance(v, list) and len(v) > 0 and all(_int(i) and i >= 0 for i in v)),
        "must be a non-empty list of decoder layer indices (0, 1, ...) or null",
    ),
    "model.lora.rank_pattern": (
        lambda v: isinstance(v, dict) and all(_positive_int(r) for r in v.values()),
        "must map module-name patterns to positive ranks",
    ),
    "model.lora.alpha_pattern": (
        lambda v: isinstance(v, dict) and all(_number(a) and a > 0 for a in v.values()),
        "must map module-name patterns to positive alphas",
    ),
    "model.lora.loraplus_lr_ratio": (
        lambda v: v is None or (_number(v) and v > 0),
        "must be a positive number (the B matrices' learning rate over the A matrices'), or null",
    ),
    "model.lora.modules_to_save": (_names, "must be a list of module names"),
    "model.learning_rate": (lambda v: _number(v) and v > 0, "must be a positive number"),
    "model.weight_decay": (lambda v: _number(v) and v >= 0, "must be a number >= 0"),
    "model.betas": (
        lambda v: isinstance(v, list | tuple) and len(v) == 2 and all(_number(b) and 0 <= b < 1 for b in v),
        "must be two numbers in [0, 1)",
    ),
    "model.warmup_steps": (lambda v: _int(v) and v >= 0, "must be an integer >= 0"),
    "model.min_lr_ratio": (lambda v: _number(v) and 0 <= v <= 1, "must be in [0, 1]"),
    "model.neftune_noise_alpha": (
        lambda v: v is None or (_number(v) and v > 0),
        "must be a positive number (NEFTune's noise scale, 5 in its paper) or null",
    ),
    "model.checkpoint_layers": (
        lambda v: v is None or (_int(v) and v >= 0),
        "must be an integer >= 0 or null",
    ),
    "data.max_seq_len": (_positive_int, "must be a positive integer"),
    "data.batch_size": (_positive_int, "must be a positive integer"),
    "data.eval_batch_size": (_or_none(_positive_int), "must be a positive integer or null"),
    "data.val_fraction": (lambda v: _number(v) and 0 <= v < 1, "must be in [0, 1)"),
    "data.pad_to_multiple_of": (
        lambda v: v is None or _positive_int(v),
        "must be a positive integer or null",
    ),
    "data.num_workers": (lambda v: _int(v) and v >= 0, "must be an integer >= 0"),
    "data.num_proc": (_positive_int, "must be a positive integer"),
    "data.shuffle_buffer": (_positive_int, "must be a positive integer"),
    "trainer.accumulate_grad_batches": (_positive_int, "must be a positive integer"),
    "trainer.max_steps": (lambda v: _int(v) and v >= -1, "must be an integer >= 0, or -1 for no limit"),
}
"""Each setting's rule and what is allowed, for the message."""


def shown(value: Any) -> str:
    """A setting's value as the config writes it: ``true``, ``null``, ``'eva'``, ``[1, 2]``."""
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    return repr(value)


def check_values(settings: Mapping[str, Any]) -> None:
    """Raise :class:`ConfigError` for the first setting whose value breaks its rule."""
    for name, (valid, allowed) in VALUES.items():
        if name not in settings:
            continue
        value = settings[name]
        if name == "model.lora.init" and isinstance(value, str) and value in REFUSED_INITS:
            raise ConfigError(name, f"{shown(value)} {REFUSED_INITS[value]}")
        if not valid(value):
            raise ConfigError(name, f"{allowed}, got {shown(value)}")


def _strategy(value: Any) -> str:
    """A strategy setting's name: the registry name or the ``class_path``."""
    if isinstance(value, Mapping):
        return str(value.get("class_path", ""))
    return value if isinstance(value, str) else type(value).__qualname__


BATCH_KIND = "data.batch_kind"
"""What the data's batches hold: the objective's batch kind (the CLI links it to ``model.objective``)."""


@dataclass(frozen=True)
class Conflict:
    """Two settings that cannot go together when ``clash`` holds on their values."""

    first: str
    second: str
    clash: Callable[[Any, Any], bool]
    reason: str
    example: tuple[Any, Any]
    """Two values that clash (the tests walk the table with them; docs/config.md lists them)."""


def _decomposing(init: Any) -> bool:
    return isinstance(init, str) and (is_residual_init(init) or init == "eva")


def _hybrid(strategy: Any) -> bool:
    """A ``fsdp_lora`` strategy asked for hybrid sharding (``init_args: {hybrid: true}``)."""
    return isinstance(strategy, Mapping) and bool((strategy.get("init_args") or {}).get("hybrid"))


CONFLICTS: tuple[Conflict, ...] = (
    Conflict(
        "model.lora.init",
        "model.quantization.method",
        lambda init, method: _decomposing(init) and method != "none",
        "PiSSA, OLoRA and EVA decompose full-precision weights or layer inputs; the init for a 4-bit "
        "base is loftq",
        ("pissa", "nf4"),
    ),
    Conflict(
        "model.lora.init",
        "model.quantization.method",
        lambda init, method: init == "loftq" and method != "nf4",
        "LoftQ fits the NF4 quantization error: set model.quantization.method: nf4",
        ("loftq", "fp4"),
    ),
    Conflict(
        "model.lora.init",
        "model.lora.use_dora",
        lambda init, dora: _decomposing(init) and bool(dora),
        "EVA sets plain LoRA layers only, and a residual init's adapter could not be saved as plain "
        "LoRA on the original base (peft cannot convert DoRA either)",
        ("olora", True),
    ),
    Conflict(
        "model.lora.init",
        "model.adapter",
        lambda init, adapter: init != "default" and adapter is not None,
        "an init sets new adapters; model.adapter continues a trained one (leave model.lora.init unset)",
        ("gaussian", "runs/x/adapter"),
    ),
    Conflict(
        "model.lora.init",
        "model.low_memory_load",
        lambda init, low: (init in ("eva", "loftq") or is_residual_init(str(init))) and bool(low),
        "the init reads the base's weights on every rank; with low_memory_load only rank 0 has them",
        ("pissa", True),
    ),
    Conflict(
        "model.low_memory_load",
        "trainer.strategy",
        lambda low, strategy: bool(low) and _strategy(strategy) not in FSDP_STRATEGIES,
        "only rank 0 reads the weights and the other ranks receive their shards from it, which "
        "trainer.strategy: fsdp_lora does",
        (True, "ddp_lora"),
    ),
    Conflict(
        "model.checkpoint_layers",
        "model.gradient_checkpointing",
        lambda layers, checkpointing: layers is not None and not checkpointing,
        "checkpoint_layers chooses which layers gradient checkpointing recomputes: set "
        "model.gradient_checkpointing: true",
        (4, False),
    ),
    Conflict(
        "data.new_tokens",
        "model.low_memory_load",
        lambda tokens, low: isinstance(tokens, list) and len(tokens) > 0 and bool(low),
        "growing the embedding for new tokens is not supported on ranks built without weights yet",
        (["<|im_start|>"], True),
    ),
    Conflict(
        "data.packing",
        "model.attn_implementation",
        lambda packing, attention: bool(packing) and attention not in ("auto", "sdpa", "eager"),
        "packed rows run attention sample by sample through sdpa or eager",
        (True, "flash_attention_2"),
    ),
    Conflict(
        "trainer.strategy",
        "trainer.num_nodes",
        lambda strategy, nodes: _hybrid(strategy) and (nodes or 1) < 2,
        "hybrid sharding shards within a node and replicates across nodes: it needs 2 nodes or more "
        "(on one node, plain fsdp_lora shards over all its devices)",
        ({"class_path": "lit_instruct.train.strategy.LoRAFSDPStrategy", "init_args": {"hybrid": True}}, 1),
    ),
    Conflict(
        "model.neftune_noise_alpha",
        "data.packing",
        lambda alpha, packing: alpha is not None and bool(packing),
        "NEFTune's noise scale is alpha / sqrt(row length x hidden): on a packed row it would take the "
        "whole row's length, not each sample's, and every sample would get less noise than unpacked",
        (5.0, True),
    ),
    Conflict(
        "data.packing",
        "data.batch_kind",
        lambda packing, kind: bool(packing) and kind != "conversations",
        "pairs, labelled answers and rollouts are padded rows (the chosen beside the rejected; KTO's "
        "answers beside their KL rows; each prompt's completions side by side)",
        (True, "pairs"),
    ),
    Conflict(
        "data.streaming",
        "data.batch_kind",
        lambda streaming, kind: bool(streaming) and kind != "conversations",
        "pairs, labelled answers and prompts are read and split by prompt before training",
        (True, "pairs"),
    ),
    Conflict(
        "data.chatterbot_categories",
        "data.batch_kind",
        lambda categories, kind: bool(categories) and kind != "conversations",
        "the chatterbot corpus holds conversations, no preference pairs, labelled answers or prompts",
        (["greetings"], "pairs"),
    ),
    Conflict(
        "data.train_on",
        "data.batch_kind",
        lambda train_on, kind: train_on not in (None, "answers") and kind != "conversations",
        "pairs, labelled answers and rollouts train their answers only",
        ("all", "pairs"),
    ),
    Conflict(
        "data.multi_turn",
        "data.batch_kind",
        lambda multi_turn, kind: multi_turn not in (None, "auto", "last") and kind != "conversations",
        "only each record's last answer is trained (multi_turn: auto or last)",
        ("per_turn", "pairs"),
    ),
    Conflict(
        "data.batch_size",
        "data.batch_kind",
        lambda size, kind: kind == "unpaired" and isinstance(size, int) and size < 2,
        "KTO's KL estimate pairs each prompt with another answer of its batch: 2 answers or more",
        (1, "unpaired"),
    ),
    Conflict(
        "data.eval_batch_size",
        "data.batch_kind",
        lambda size, kind: kind == "unpaired" and isinstance(size, int) and size < 2,
        "KTO's KL estimate pairs each prompt with another answer of its batch, held-out ones too",
        (1, "unpaired"),
    ),
    Conflict(
        "data.num_proc",
        "data.batch_kind",
        lambda procs, kind: kind != "conversations" and isinstance(procs, int) and procs > 1,
        "pairs, labelled answers and prompts render in the main process (uncached: in well under a "
        "step's time)",
        (2, "pairs"),
    ),
    Conflict(
        "data.format",
        "data.batch_kind",
        lambda record_format, kind: record_format not in (None, "auto") and kind != "conversations",
        "the layouts of pairs, labelled answers and prompts are told apart per record (format: auto)",
        ("alpaca", "pairs"),
    ),
    Conflict(
        "data.streaming",
        "trainer.max_steps",
        lambda streaming, steps: bool(streaming) and steps in (None, -1),
        "a stream has no end, so the fit needs a step count: set trainer.max_steps",
        (True, -1),
    ),
)
"""Every pair of settings refused together, with the reason (docs/config.md lists them)."""


def refuse_conflicts(settings: Mapping[str, Any]) -> None:
    """Raise :class:`ConfigError` naming both settings of the first conflict in ``settings``."""
    for conflict in CONFLICTS:
        if conflict.first not in settings or conflict.second not in settings:
            continue
        first, second = settings[conflict.first], settings[conflict.second]
        if conflict.clash(first, second):
            other = f"{conflict.second}: {shown(second)}"
            if conflict.second == BATCH_KIND:  # set by the objective, not by the user
                other = f"model.objective (its batch kind: {second})"
            raise ConfigError(
                conflict.first, f"{shown(first)} cannot be combined with {other}: {conflict.reason}"
            )


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"model": {"lora": {"r": 8}}}`` as ``{"model": {...}, "model.lora": {...}, "model.lora.r": 8}``."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        flat[name] = value
        if isinstance(value, Mapping) and "class_path" not in value:
            flat.update(flatten(value, f"{name}."))
    return flat
