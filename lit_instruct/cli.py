"""``lit-instruct``: ``fit``/``validate`` through LightningCLI, plus ``prepare``."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities import rank_zero_info

from lit_instruct.data.datamodule import InstructDataModule
from lit_instruct.module import InstructLoRAModule


def _val_metrics(results: list[dict[str, float]]) -> dict[str, float]:
    return {k: float(v) for k, v in (results[0] if results else {}).items()}


class InstructCLI(LightningCLI):
    """LightningCLI for instruction tuning: the datamodule's tokenizer follows ``model.model``.

    ``fit`` measures ``val/loss`` before training (``--validate_before_fit``, on by default) and
    after it, and prints both with where the adapter went.
    """

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("seed_everything_default", 42)
        super().__init__(InstructLoRAModule, InstructDataModule, **kwargs)

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        return {
            "fit": {"model", "train_dataloaders", "val_dataloaders", "datamodule"},
            "validate": {"model", "dataloaders", "datamodule"},
        }

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.link_arguments("model.model", "data.tokenizer")
        parser.add_argument(
            "--validate_before_fit", type=bool, default=True, help="Measure val/loss before training starts."
        )

    def _val(self) -> dict[str, float]:
        return _val_metrics(self.trainer.validate(self.model, datamodule=self.datamodule, verbose=False))

    def before_fit(self) -> None:
        self.before: dict[str, float] = {}
        if self.config["fit"].get("validate_before_fit") and self.trainer.limit_val_batches != 0:
            self.before = self._val()

    def after_fit(self) -> None:
        if self.trainer.interrupted or not self.before:
            return
        if self.model.last_val_step != self.trainer.global_step:
            self._val()
        after = {k: float(v) for k, v in self.trainer.callback_metrics.items() if k.startswith("val/")}
        if "val/loss" in after:
            rank_zero_info(
                f"lit-instruct: val/loss {self.before['val/loss']:.4f} -> {after['val/loss']:.4f}, "
                f"val/ppl {self.before['val/ppl']:.2f} -> {after['val/ppl']:.2f} "
                f"over {int(after['val/tokens'])} held-out response tokens, "
                f"after {self.trainer.global_step} steps"
            )


def prepare_main(argv: list[str]) -> None:
    """``lit-instruct prepare``: convert the bundled model(s) into the cache folder."""
    from lit_instruct.models import BUNDLED_MODELS, SMOLLM2_NAME

    parser = argparse.ArgumentParser(prog="lit-instruct prepare", description=prepare_main.__doc__)
    parser.add_argument("--model", choices=sorted(BUNDLED_MODELS), default=SMOLLM2_NAME)
    parser.add_argument("--force", action="store_true", help="convert again even if already prepared")
    args = parser.parse_args(argv)
    path = BUNDLED_MODELS[args.model](force=args.force)
    sys.stdout.write(f"{args.model}: {path}\n")


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``lit-instruct`` command."""
    command = sys.argv[1:] if argv is None else argv
    if command[:1] == ["prepare"]:
        prepare_main(command[1:])
        return
    InstructCLI(args=argv)
