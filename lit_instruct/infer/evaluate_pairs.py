"""``lit-instruct eval`` on preference pairs: an adapter's preference metrics against a reference.

The numbers are :class:`~lit_instruct.train.module.InstructLoRAModule`'s validation with a pair objective on
the files (read, rendered and batched by
:class:`~lit_instruct.data.datamodule.InstructDataModule` of ``batch_kind: pairs``): ``val/loss`` of the pair
loss, ``val/rewards/*``, ``val/logps/*`` and ``val/pairs``. The reference is the adapter's base with
the adapter switched off, or another adapter of the same base and LoRA structure, whose weights are
put in place of the adapter's for the reference pass (as training from an SFT adapter does). The
loss and its coefficients are those the adapter's card records (:func:`recorded_preference`), else
:class:`PreferenceConfig`'s defaults, each replaceable.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

from lit_instruct.adapter_folder import (
    adapter_base,
    adapter_tensors,
    has_tokenizer,
    read_config,
    read_weights,
)
from lit_instruct.errors import ConfigError
from lit_instruct.infer.evaluate import aligned, quiet_trainer
from lit_instruct.loss.preference import PreferenceConfig
from lit_instruct.model_card import recorded_preference
from lit_instruct.models.lora import STRUCTURE, lora_config_of, same_structure
from lit_instruct.vocabulary import adapter_new_tokens


def refuse_for_pairs(with_base: bool, answers: str | None) -> None:
    """Refuse what ``eval`` does on conversations only: ``--base`` and ``--answers``.

    Raises:
        ConfigError: naming the option and why.
    """
    if with_base:
        raise ConfigError(
            "--base",
            "on pairs the base is already the reference (the base against itself has margins 0); "
            "leave --base out, or give --reference ADAPTER to score against another adapter",
        )
    if answers is not None:
        raise ConfigError(
            "--answers",
            "on pairs a win-rate of the adapter's answers against the base's needs a judge, which is "
            "not built yet; leave --answers out (answers are written for conversation files)",
        )


def pair_settings(
    adapter: str | Path, kind: str | None = None, beta: float | None = None
) -> tuple[PreferenceConfig, str]:
    """The preference loss to score with and where it came from: the settings the adapter's card
    records, else the defaults, ``kind`` and ``beta`` replacing theirs; computed with a reference
    pass (no ``precompute_reference``)."""
    recorded = recorded_preference(adapter) or {}
    known = {f.name for f in fields(PreferenceConfig)}
    unknown = sorted(set(recorded) - known)
    if unknown:  # a newer version's setting: scoring without it would be another loss
        raise ConfigError(
            "--adapter",
            f"{str(adapter)!r} records preference settings this version does not know "
            f"({', '.join(unknown)}); score it with the version that trained it",
        )
    config = PreferenceConfig(**recorded)
    if set(recorded) == {"kind"}:  # an earlier card: its objective tag alone
        origin = "the kind from the adapter's card, the rest defaults"
    else:
        origin = "recorded with the adapter" if recorded else "the defaults: the adapter records none"
    overrides: dict[str, Any] = {k: v for k, v in (("kind", kind), ("beta", beta)) if v is not None}
    config = replace(config, precompute_reference=False, **overrides)
    config.loss()  # a value out of range: one line before any weight is read
    return config, origin


def check_reference(adapter: str | Path, reference: str | Path, config: PreferenceConfig) -> None:
    """A reference adapter must share the adapter's base, LoRA structure and vocabulary, and the
    loss must have a reference (read from the folders' configs; no weights).

    Raises:
        ConfigError: naming ``--reference`` and the difference.
    """
    if not config.loss().needs_reference:
        why = "reference_free" if config.reference_free else config.kind
        raise ConfigError("--reference", f"{why} has no reference model (dpo and ipo have one)")
    ours, theirs = read_config(adapter), read_config(reference)
    base, other = ours.get("base_model_name_or_path"), theirs.get("base_model_name_or_path")
    if base != other:
        raise ConfigError(
            "--reference",
            f"{str(reference)!r} is an adapter of {other!r}, {str(adapter)!r} of {base!r}: "
            "a reference adapter shares the adapter's base",
        )
    mine, its = lora_config_of(adapter), lora_config_of(reference)
    for name in STRUCTURE:
        if name == "dropout":  # no structure: off in evaluation
            continue
        a, b = getattr(mine, name), getattr(its, name)
        if not same_structure(name, mine, its):
            raise ConfigError(
                "--reference",
                f"{str(reference)!r} has LoRA {name} {b!r}, the adapter {a!r}: a reference adapter has "
                "the adapter's LoRA structure (its weights are swapped in for the reference pass)",
            )
    grown = has_tokenizer(adapter) or has_tokenizer(reference)
    if grown and adapter_new_tokens(adapter, str(base)) != adapter_new_tokens(reference, str(base)):
        raise ConfigError(
            "--reference", f"{str(reference)!r} added other tokens to the vocabulary than the adapter"
        )


def load_pair_module(
    adapter: str | Path,
    config: PreferenceConfig,
    base: str | None = None,
    reference: str | Path | None = None,
) -> Any:
    """An :class:`InstructLoRAModule` with the pair objective of ``config`` and the adapter as policy,
    in eval mode; its reference is ``reference``'s weights (checked with :func:`check_reference`
    first), else the base."""
    from lit_instruct.objectives.pairs import PairObjective
    from lit_instruct.train.module import InstructLoRAModule

    model = adapter_base(adapter, base)
    tokens = adapter_new_tokens(adapter, model)
    objective = PairObjective.from_preference(config)
    module = InstructLoRAModule(model=model, adapter=str(adapter), added_tokens=tokens, objective=objective)
    module.reference_adapter = None if reference is None else _adapter_weights(module.model, reference)
    return module.eval()


def _adapter_weights(peft_model: Any, folder: str | Path) -> dict[str, Any]:
    """``folder``'s adapter weights under ``peft_model``'s trainable parameters' names (loaded
    through peft, then the model's own put back)."""
    import torch
    from peft import set_peft_model_state_dict

    params = {name: p for name, p in peft_model.named_parameters() if p.requires_grad}
    own = {name: p.detach().clone() for name, p in params.items()}
    saved = read_weights(folder)
    set_peft_model_state_dict(peft_model, saved)
    loaded = adapter_tensors(peft_model)
    if set(saved) != set(loaded) or any(not torch.equal(loaded[k], saved[k].to(loaded[k])) for k in saved):
        raise ConfigError("--reference", f"{folder}: its tensors do not load into the adapter's places")
    weights = {name: p.detach().clone() for name, p in params.items()}
    with torch.no_grad():
        for name, value in own.items():
            params[name].copy_(value)
    return weights


def evaluate_pairs(
    module: Any,
    data: Sequence[str],
    max_seq_len: int = 512,
    batch_size: int = 8,
    chat_template: str | None = None,
) -> dict[str, dict[str, float]]:
    """Validation metrics of ``module`` (:func:`load_pair_module`) on the pairs of ``data`` as
    ``"adapter"``: ``val/loss``, ``val/rewards/*``, ``val/logps/*`` (and ORPO's), ``val/pairs``."""
    from lit_instruct.data.datamodule import InstructDataModule

    datamodule = InstructDataModule(
        batch_kind="pairs",
        tokenizer=module.hparams["model"],
        val_files=list(data),
        max_seq_len=max_seq_len,
        eval_batch_size=batch_size,
        chat_template=chat_template,
    )
    (metrics, *_) = quiet_trainer().validate(module, datamodule=datamodule, verbose=False)
    return {"adapter": {name: float(value) for name, value in metrics.items()}}


def pairs_table(results: Mapping[str, Mapping[str, float]]) -> str:
    """``results`` of :func:`evaluate_pairs` as an aligned table (:func:`aligned`): a row per model,
    a column per metric (``val/loss``, the module's metrics in its order, ``val/pairs``)."""
    names = list(dict.fromkeys(name for metrics in results.values() for name in metrics))
    columns = ["val/loss", *(n for n in names if n not in ("val/loss", "val/pairs")), "val/pairs"]
    rows = [["model", *columns]]
    for label, metrics in results.items():
        rows.append([label, *(_cell(name, metrics.get(name)) for name in columns)])
    return aligned(rows)


def _cell(name: str, value: float | None) -> str:
    """A metric's value as the table shows it: to 4 decimals, the pairs counted whole."""
    if value is None or math.isnan(value):
        return "-"
    return f"{int(value)}" if name == "val/pairs" else f"{value:.4f}"


def settings_line(config: PreferenceConfig, origin: str, reference: str | Path | None) -> str:
    """What the pairs are scored with, in a line: the loss and its non-default coefficients, where
    they came from, and the reference."""
    default = PreferenceConfig(kind=config.kind)
    names = ["label_smoothing", "rpo_alpha", *(["gamma"] if config.kind == "simpo" else [])]
    changed = [f"beta {config.beta:g}"]
    changed += [f"{n} {getattr(config, n):g}" for n in names if getattr(config, n) != getattr(default, n)]
    dpo = ["loss_type", "loss_weights", "ld_alpha", "f_divergence_type", "f_alpha_divergence_coef"]
    dpo += ["discopop_tau", "reference_free"]
    changed += [f"{n} {getattr(config, n)}" for n in dpo if getattr(config, n) != getattr(default, n)]
    if not config.loss().needs_reference:
        against = "no reference model"
    else:
        against = f"reference: {reference}" if reference is not None else "reference: the base, adapter off"
    return f"lit-instruct: pairs scored with {config.kind}, {', '.join(changed)} ({origin}); {against}"
