"""``lit-instruct fit --help`` (and ``validate --help``): one screen of what is used most, pointing at
``docs/config.md`` for every setting; ``--help-all`` still prints LightningCLI's full list."""

from __future__ import annotations

HELP_ALL = "--help-all"
"""Asks for LightningCLI's own help: every setting of every class the config may name."""

TRAINING_ONLY = (
    "--trainer.max_steps",
    "--trainer.accumulate_grad_batches",
    "--model.learning_rate",
    "--model.adapter_dir",
)
"""Settings of the steps, which ``validate`` takes none of."""

SETTINGS = (
    ("--trainer.max_steps N", "optimizer steps to take (or --trainer.max_epochs N)"),
    ("--trainer.default_root_dir DIR", "where the run writes: logs, checkpoints, the adapter"),
    ("--trainer.precision P", "auto (bf16-mixed where the hardware does bf16), 32-true, ..."),
    ("--trainer.devices N", "processes (DDP or FSDP with --trainer.strategy)"),
    ("--trainer.accumulate_grad_batches N", "batches per optimizer step"),
    ("--model.model NAME|DIR", "the base: a bundled name, a folder or a hub id"),
    ("--model.lora.r N", "LoRA rank (--model.lora.alpha, .dropout, .target_modules)"),
    ("--model.learning_rate LR", "peak learning rate (--model.warmup_steps N)"),
    ("--model.quantization.method nf4", "QLoRA: the base in 4-bit NF4 (configs/qlora.yaml)"),
    ("--model.adapter DIR", "continue from a PEFT adapter"),
    ("--model.adapter_dir DIR", "where the adapter goes (default: the run's folder/adapter)"),
    ("--model.objective NAME", "{kinds}"),
    ("--data.train_files [A,B]", "training files, any format (docs/data.md)"),
    ("--data.max_seq_len N", "tokens per sample; longer ones are truncated (counted)"),
    ("--data.batch_size N", "samples (pairs) per batch"),
    ("--data.val_fraction F", "held out for validation (or --data.val_files)"),
)
"""The settings shown, with what each does: the ones a first fit changes."""


def short_help(command: str, kinds: tuple[str, ...]) -> str:
    """The help text of ``lit-instruct fit`` or ``validate``; ``kinds``: the objectives' short names."""
    shown = [
        (flag, what.format(kinds=", ".join(kinds)))
        for flag, what in SETTINGS
        if command == "fit" or not flag.startswith(TRAINING_ONLY)
    ]
    width = max(len(flag) for flag, _ in shown) + 2
    rows = "".join(f"  {flag.ljust(width)}{what}\n" for flag, what in shown)
    resume = (
        "resume a run (last: the newest checkpoint of the run's folder)"
        if command == "fit"
        else "the checkpoint to validate (last: the newest of the run's folder)"
    )
    return (
        f"usage: lit-instruct {command} --config X.yaml [--config Y.yaml ...] "
        "[--SECTION.SETTING VALUE ...]\n\n"
        "The config's trainer, model and data; a setting given later (a file or the command line) wins.\n\n"
        "  --config X.yaml          configs/quickstart.yaml, lora, qlora, dpo, kto, ddp, fsdp, "
        "mixture, ...\n"
        "  --print_config           print the whole config as it would run (every setting, resolved)\n"
        f"  --ckpt_path last|FILE    {resume}\n"
        "  --seed_everything N      the seed of sampling, dropout and the data order\n"
        "  --debug                  a mistake's traceback too, beside its one line\n\n"
        f"Most used settings:\n{rows}\n"
        "Every setting, with its default and meaning: docs/config.md in the repository;\n"
        f"LightningCLI's own list of them all: lit-instruct {command} {HELP_ALL}\n"
    )
