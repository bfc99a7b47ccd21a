"""lit-instruct inside an ordinary Lightning script: no CLI, no YAML.

python examples/plain_trainer.py --max-steps 20
"""

from __future__ import annotations

import argparse

import lightning as L

from lit_instruct import InstructDataModule, InstructLoRAModule, LoRAConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--model", default="smollm2-135m-instruct", help="bundled name, local folder or hub id"
    )
    parser.add_argument("--max-steps", type=int, default=20)
    parser.add_argument("--root", default="runs/plain_trainer", help="logs, checkpoints and the adapter")
    args = parser.parse_args()

    L.seed_everything(42)
    module = InstructLoRAModule(model=args.model, lora=LoRAConfig(r=8, alpha=16), learning_rate=1e-3)
    data = InstructDataModule(
        tokenizer=args.model, chatterbot_categories=["greetings", "humor"], max_seq_len=256, batch_size=4
    )
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=args.max_steps,
        default_root_dir=args.root,
        log_every_n_steps=1,
        num_sanity_val_steps=0,
        enable_progress_bar=False,
    )
    (before,) = trainer.validate(module, datamodule=data, verbose=False)
    trainer.fit(module, datamodule=data)
    (after,) = trainer.validate(module, datamodule=data, verbose=False)
    print(f"val/loss before: {before['val/loss']:.4f} after: {after['val/loss']:.4f}")
    print(f"adapter: {module.adapter_path()}")


if __name__ == "__main__":
    main()
