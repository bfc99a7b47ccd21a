"""Scaling over processes: 1 process, 2-process DDP and 2-process FSDP (gloo, CPU) on the bundled
SmolLM2-135M, LoRA r16 on all linear layers, chatterbot conversations, the same global batch.

    python benchmarks/scaling.py [--steps 8] [--global-batch 8] [--max-seq-len 256]

Each configuration runs in fresh processes. Every rank reports its steady tokens/s (all ranks'
tokens per second of wall time, the first two steps left out), its peak resident memory, and the
share of its step time spent in collectives (the ``c10d`` / gloo operations of a profiled step).
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from workers import run_worker

COLLECTIVES = ("allreduce", "all_reduce", "allgather", "all_gather", "reduce_scatter", "broadcast", "gloo")


def worker(args: dict) -> None:
    """One configuration; Lightning's launcher runs this again for rank 1."""
    import lightning as L
    import torch

    from lit_instruct.data.datamodule import InstructDataModule
    from lit_instruct.models.lora import LoRAConfig
    from lit_instruct.train.module import InstructLoRAModule

    class Clock(L.Callback):
        """Wall time and global tokens of every step; the collectives' share of one profiled step."""

        def __init__(self) -> None:
            self.times: list[float] = []
            self.tokens: list[float] = []
            self.profile: torch.profiler.profile | None = None
            self.collective_share = float("nan")

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if trainer.global_step == 3:
                self.profile = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
                self.profile.__enter__()
            self.start = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.times.append(time.perf_counter() - self.start)
            self.tokens.append(float(trainer.callback_metrics["train/tokens"]))
            if self.profile is not None:
                self.profile.__exit__(None, None, None)
                events = self.profile.key_averages()
                total = sum(e.self_cpu_time_total for e in events)
                spent = sum(
                    e.self_cpu_time_total for e in events if any(c in e.key.lower() for c in COLLECTIVES)
                )
                self.collective_share = spent / total if total else float("nan")
                self.profile = None

    L.seed_everything(0)
    module = InstructLoRAModule(
        model="smollm2-135m-instruct", lora=LoRAConfig(r=16, alpha=32), warmup_steps=0
    )
    data = InstructDataModule(
        chatterbot_categories=["all"],
        batch_size=args["global_batch"] // args["devices"],
        max_seq_len=args["max_seq_len"],
        val_fraction=0.0,
    )
    clock = Clock()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args["devices"],
        strategy=args["strategy"],
        max_steps=args["steps"],
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=args["out"],
        callbacks=[clock],
    )
    trainer.fit(module, datamodule=data)
    steady = slice(2, None)
    tokens = clock.tokens[-1] - clock.tokens[1]  # train/tokens is cumulative over all ranks
    result = {
        "tokens_per_s": tokens / sum(clock.times[steady]),
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "collective_share": clock.collective_share,
        "threads": torch.get_num_threads(),
    }
    Path(args["out"], f"rank{trainer.global_rank}.json").write_text(json.dumps(result))
    if trainer.global_rank == 0:
        print(json.dumps({"out": args["out"]}))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dir", type=Path, default=Path("/tmp/lit-instruct-scaling-bench"))
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--max-seq-len", type=int, default=256)
    args = parser.parse_args()
    print("| setup | tokens/s (all ranks) | x 1 process | peak RSS MiB per rank | collectives' share |")
    print("|---|---:|---:|---:|---:|")
    base = None
    for label, devices, strategy in (
        ("1 process", 1, "one_device"),
        ("2-process DDP", 2, "ddp_lora"),
        ("2-process FSDP", 2, "fsdp_lora"),
    ):
        out = args.dir / label.replace(" ", "-")
        out.mkdir(parents=True, exist_ok=True)
        config = {"devices": devices, "strategy": strategy, "steps": args.steps, "out": str(out)}
        config |= {"global_batch": args.global_batch, "max_seq_len": args.max_seq_len}
        run_worker(__file__, json.dumps(config))
        ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(devices)]
        speed = ranks[0]["tokens_per_s"]
        base = base or speed
        peaks = " / ".join(f"{r['peak_rss_mib']:.0f}" for r in ranks)
        shares = " / ".join(f"{r['collective_share']:.0%}" for r in ranks)
        if (
            strategy == "ddp_lora"
        ):  # its all-reduce runs inside DDP's reducer, which the profiler does not see
            shares = "not profiled (DDP's reducer)"
        elif devices == 1:
            shares = "none"
        label = f"{label} ({ranks[0]['threads']} threads each)"
        print(f"| {label} | {speed:.1f} | {speed / base:.2f} | {peaks} | {shares} |")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:  # also rank 1, which Lightning's launcher starts the same way
        worker(json.loads(sys.argv[2]))
    else:
        main()
