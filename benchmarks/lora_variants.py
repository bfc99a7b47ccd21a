"""LoRA variants on the bundled model and corpus, one run each in its own process: validation loss
after N optimizer steps, trainable parameters, mean step time.

SmolLM2-135M-Instruct, fp32, LoRA r=16 alpha=32 on all linear layers, the chatterbot corpus (all
categories, 10% held out, max length 256), batch 8, LR 1e-3 with 5 warmup steps then cosine, seed 0:
plain LoRA, rsLoRA, DoRA, LoRA+ (B at 16x), gaussian init, PiSSA, OLoRA and EVA; the same samples in
the same order.

    python benchmarks/lora_variants.py --steps 30     # about 10 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

from workers import run_worker

VARIANTS = {
    "lora": {},
    "rslora": {"use_rslora": True},
    "dora": {"use_dora": True},
    "lora+": {"loraplus_lr_ratio": 16.0},
    "gaussian init": {"init": "gaussian"},
    "pissa": {"init": "pissa"},
    "olora": {"init": "olora"},
    "eva": {"init": "eva"},
}


def worker(variant: str, steps: int) -> dict:
    import lightning as L

    from lit_instruct import InstructDataModule, InstructLoRAModule, LoRAConfig

    class StepTimes(L.Callback):
        def __init__(self) -> None:
            self.times: list[float] = []

        def on_train_batch_start(self, *args) -> None:
            self.start = time.perf_counter()

        def on_train_batch_end(self, *args) -> None:
            self.times.append(time.perf_counter() - self.start)

    L.seed_everything(0)
    lora = LoRAConfig(r=16, alpha=32, **VARIANTS[variant])
    module = InstructLoRAModule(lora=lora, learning_rate=1e-3, warmup_steps=5, packing=True)
    data = InstructDataModule(
        chatterbot_categories=["all"], val_fraction=0.1, max_seq_len=256, batch_size=8, packing=True
    )
    times = StepTimes()
    with tempfile.TemporaryDirectory() as root:
        trainer = L.Trainer(
            accelerator="cpu", max_steps=steps, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
            limit_val_batches=1.0, val_check_interval=steps, callbacks=[times], default_root_dir=root,
        )  # fmt: skip
        trainer.fit(module, datamodule=data)
    trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
    steady = times.times[3:] or times.times
    return {
        "val_loss": float(trainer.callback_metrics["val/loss"]),
        "trainable": trainable,
        "step_s": sum(steady) / len(steady),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--worker", nargs=2, metavar=("VARIANT", "STEPS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker[0], int(args.worker[1]))))
        return
    print(f"| variant | val loss after {args.steps} steps | trainable parameters | s / step |")
    print("| --- | --- | --- | --- |")
    for variant in VARIANTS:
        r = run_worker(__file__, variant, str(args.steps))
        print(f"| {variant} | {r['val_loss']:.4f} | {r['trainable']:,} | {r['step_s']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
