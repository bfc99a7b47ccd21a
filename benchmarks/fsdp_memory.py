"""Base-model memory per rank: 1 process, 2-process DDP and 2-process FSDP (``fsdp_lora``), with
and without an NF4 base, on a random-weight Llama-architecture model of ~0.5B parameters (fp32).

    python benchmarks/fsdp_memory.py [--dir /tmp/lit-instruct-fsdp-bench] [--steps 3]

Each configuration runs in fresh processes (gloo on this CPU machine); every rank reports the bytes
of the frozen base it holds (its shards under FSDP), its resident memory after the fit and its peak,
and the logged loss of each step. The table compares the per-rank base bytes with DDP's, and the
losses of FSDP with DDP's (same global batches: they must agree to 1e-5 in fp32).
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from workers import run_worker

CONFIG = dict(  # ~0.5B parameters: 12 layers of width 1536, untied 49,152-token embeddings
    hidden_size=1536,
    intermediate_size=4096,
    num_hidden_layers=12,
    num_attention_heads=12,
    num_key_value_heads=4,
    vocab_size=49152,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
)


def build_model(folder: Path) -> Path:
    """A random-weight Llama (seeded) with SmolLM2's tokenizer, saved once."""
    if (folder / "config.json").exists():
        return folder
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from lit_instruct.model_names import resolve_model_path

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG))
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(resolve_model_path("smollm2-135m-instruct")).save_pretrained(folder)
    return folder


def write_data(path: Path) -> Path:
    rows = [
        {
            "prompt": f"Describe item {i} in a sentence.",
            "completion": f"Item {i} is " + "a very fine thing, " * 6,
        }
        for i in range(16)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def worker(args: dict) -> None:
    """One configuration; Lightning's launcher runs this again for rank 1."""
    import lightning as L

    from lit_instruct.data.datamodule import InstructDataModule
    from lit_instruct.distributed import local_tensor
    from lit_instruct.models.lora import LoRAConfig
    from lit_instruct.train.module import InstructLoRAModule

    class Losses(L.Callback):
        def __init__(self) -> None:
            self.values: list[float] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.values.append(float(trainer.callback_metrics["train/loss"]))

    L.seed_everything(0)
    quantization = {"method": "nf4", "compute_dtype": "float32"} if args["nf4"] else None
    module = InstructLoRAModule(
        model=args["model"],
        lora=LoRAConfig(r=16, alpha=32),
        quantization=quantization,
        warmup_steps=0,
        low_memory_load=args.get("low_memory_load", False),
    )
    data = InstructDataModule(tokenizer=args["model"], train_files=[args["data"]], batch_size=1, cache=False)
    losses = Losses()
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
        callbacks=[losses],
    )
    trainer.fit(module, datamodule=data)
    frozen = {id(p): p for p in module.parameters() if not p.requires_grad}.values()
    result = {
        "base_mib": sum(local_tensor(p).nbytes for p in frozen) / 2**20,
        "rss_mib": rss_mib(),
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "losses": losses.values,
    }
    Path(args["out"], f"rank{trainer.global_rank}.json").write_text(json.dumps(result))
    if trainer.global_rank == 0:
        print(json.dumps({"out": args["out"]}))


def measure(
    out: Path, devices: int, strategy: str, nf4: bool, low_memory: bool = False, **paths: Any
) -> list[dict]:
    """Run one configuration (``paths``: model, data, steps) and return every rank's report."""
    args = {
        "model": str(paths["model"]),
        "data": str(paths["data"]),
        "steps": paths["steps"],
        "out": str(out),
    }
    args.update(devices=devices, strategy=strategy, nf4=nf4, low_memory_load=low_memory)
    out.mkdir(parents=True, exist_ok=True)
    run_worker(__file__, json.dumps(args))
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(devices)]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dir", type=Path, default=Path("/tmp/lit-instruct-fsdp-bench"))
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    model = build_model(args.dir / "model")
    data = write_data(args.dir / "data.jsonl")
    rows = []
    common = {"model": model, "data": data, "steps": args.steps}
    for nf4 in (False, True):
        runs = {
            "1 process": measure(args.dir / f"one-{nf4}", 1, "auto", nf4, **common),
            "2-process DDP": measure(args.dir / f"ddp-{nf4}", 2, "ddp", nf4, **common),
            "2-process FSDP": measure(args.dir / f"fsdp-{nf4}", 2, "fsdp_lora", nf4, **common),
        }
        if not nf4:  # a 4-bit base is quantized from its weights on every rank
            low = measure(args.dir / "fsdp-low", 2, "fsdp_lora", nf4, low_memory=True, **common)
            runs["2-process FSDP, low_memory_load"] = low
        ddp_base = runs["2-process DDP"][0]["base_mib"]
        ddp_losses = runs["2-process DDP"][0]["losses"]
        for label, ranks in runs.items():
            r = ranks[0]
            diff = (
                max(abs(a - b) for a, b in zip(r["losses"], ddp_losses, strict=True))
                if len(ranks) > 1
                else None
            )
            peaks = " / ".join(f"{rank['peak_rss_mib']:.0f}" for rank in ranks)
            rows.append((("NF4 " if nf4 else "fp32 ") + label, r, r["base_mib"] / ddp_base, diff, peaks))
    columns = [
        "base, setup",
        "base MiB per rank",
        "x DDP",
        "RSS after fit MiB",
        "peak RSS MiB (rank 0 / 1)",
        "losses",
    ]
    print("| " + " | ".join([*columns, "max diff vs DDP"]) + " |")
    print("|---|---:|---:|---:|---:|---|---:|")
    for label, r, ratio, diff, peaks in rows:
        losses = ", ".join(f"{x:.5f}" for x in r["losses"])
        shown = "" if diff is None else f"{diff:.1e}"
        print(
            f"| {label} | {r['base_mib']:.0f} | {ratio:.2f} | {r['rss_mib']:.0f} | {peaks} | "
            f"{losses} | {shown} |"
        )


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:  # also rank 1, which Lightning's launcher starts the same way
        worker(json.loads(sys.argv[2]))
    else:
        main()
