"""lit-instruct's DPO vs TRL's DPOTrainer on identical LoRA work: tokens/s, peak memory, loss.

Both train SmolLM2-135M-Instruct with DPO (sigmoid, beta 0.1, the reference being the base with the
adapter off), LoRA r=16 on all linear layers, batch 4 pairs (8 rows: the chosen, then the rejected),
max length 512, constant LR 2e-4, AdamW, gradient clipping at 1.0, on the same pairs (~80-token
prompts, two ~100-token answers, cut from the chatterbot corpus) in the same order, for the same
number of optimizer steps. Each run is its own process (peak RSS is the
process's); steady state is after ``--warmup`` steps. Tokens are the non-padding tokens of both rows
of every pair; each step also runs the reference forward, which neither tool counts apart.

The runs (``--runs``; every ratio is against ``trl-bf16``, else ``trl``):
  trl          TRL's fastest fp32 settings: bf16 and gradient checkpointing off
  trl-bf16     trl with ``bf16=True`` (TRL's own default; autocast over the fp32 model)
  trl-gc       TRL's defaults: ``bf16=True`` and gradient checkpointing
  ours-eager   ``configs/dpo.yaml``'s choices in fp32: the chunked lm_head log-probabilities, fused
               LoRA layers
  ours-auto    the shipped config's default: ``precision: auto`` and ``model.dtype: auto`` (bf16
               autocast over bf16 base weights where the CPU does bf16, else ours-eager)
  ours-gc      ours-auto with ``model.gradient_checkpointing``
  ours-cached  ours-auto with DPO's ``precompute_reference``: the reference's
               log-probabilities computed once before the first step (not timed), steps without it
  trl-cached   trl-bf16 with ``precompute_ref_log_probs=True`` (the same, TRL's way)

    pip install 'lit-instruct[bench]'          # trl, datasets
    python benchmarks/preference.py            # trl, trl-bf16, ours-eager, ours-auto: 10 steps
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from vs_trl import (  # the same work as the SFT benchmark's
    BATCH,
    LR,
    MAX_LENGTH,
    RANK,
    SEED,
    in_order,
    instruction_records,
    peak_rss_mb,
    trl_args,
    trl_lora,
    trl_step_clock,
    write_jsonl,
)
from workers import run_worker

BETA = 0.1
OURS = {  # (module options, Trainer precision)
    "ours-eager": ({}, "32-true"),
    "ours-auto": ({"dtype": "auto"}, "auto"),
    "ours-gc": ({"dtype": "auto", "gradient_checkpointing": True}, "auto"),
    "ours-cached": ({"dtype": "auto", "precompute_reference": True}, "auto"),
}
TRL = {
    "trl": {"gradient_checkpointing": False},
    "trl-bf16": {"gradient_checkpointing": False, "bf16": True},
    "trl-gc": {"gradient_checkpointing": True, "bf16": True},
    "trl-cached": {"gradient_checkpointing": False, "bf16": True, "precompute_ref_log_probs": True},
}


def preference_records(count: int, tokenizer) -> list[dict]:
    """Explicit-prompt pairs: a prompt and two answers of about 80 and 100 tokens (cut from the
    chatterbot corpus: what matters here is the work, not what is preferred)."""
    base = instruction_records(2 * count, tokenizer)
    return [
        {"prompt": a["prompt"], "chosen": a["completion"], "rejected": b["completion"]}
        for a, b in zip(base[::2], base[1::2], strict=True)
    ]


def datamodule(data: Path):
    """Our data module on the benchmark's pairs: ``BATCH`` pairs a batch, no validation."""
    from lit_instruct import InstructDataModule

    return InstructDataModule(
        batch_kind="pairs",
        train_files=[str(data)],
        max_seq_len=MAX_LENGTH,
        batch_size=BATCH,
        val_fraction=0.0,
        deduplicate=False,
        seed=SEED,
    )


def run_ours(data: Path, steps: int, options: dict, precision: str) -> dict:
    import lightning as L

    from lit_instruct import InstructLoRAModule, LoRAConfig
    from lit_instruct.batch import num_tokens
    from lit_instruct.objectives import DPO
    from lit_instruct.train.trainer import InstructTrainer

    class StepClock(L.Callback):
        def __init__(self) -> None:
            self.rows: list[tuple[float, int, float]] = []  # (seconds, tokens, loss)

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self.start = time.perf_counter()
            self.tokens = num_tokens(batch)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            loss = float(trainer.callback_metrics["train/loss"])
            self.rows.append((time.perf_counter() - self.start, self.tokens, loss))

    clock = StepClock()
    with tempfile.TemporaryDirectory() as tmp:
        L.seed_everything(SEED)
        options = dict(options)
        precompute = options.pop("precompute_reference", False)
        module = InstructLoRAModule(
            objective=DPO(beta=BETA, precompute_reference=precompute),
            lora=LoRAConfig(r=RANK, alpha=2 * RANK, dropout=0.0, target_modules="all-linear"),
            learning_rate=LR,
            warmup_steps=0,
            min_lr_ratio=1.0,
            adapter_dir=f"{tmp}/adapter",
            **options,
        )
        trainer = InstructTrainer(
            accelerator="cpu",
            strategy="one_device",
            precision=precision,
            max_steps=steps,
            gradient_clip_val=1.0,
            limit_val_batches=0,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=tmp,
            callbacks=[clock],
        )
        trainer.fit(module, datamodule=datamodule(data))
        bf16 = str(trainer.precision).startswith("bf16")
    return {"steps": clock.rows, "peak_rss_mb": peak_rss_mb(), "bf16": bf16}


def run_trl(data: Path, steps: int, order: list[int], options: dict) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    from lit_instruct.model_names import prepare_smollm2

    path = prepare_smollm2()
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    pairs = [
        {
            "prompt": [{"role": "user", "content": rows[i]["prompt"]}],
            "chosen": [{"role": "assistant", "content": rows[i]["chosen"]}],
            "rejected": [{"role": "assistant", "content": rows[i]["rejected"]}],
        }
        for i in order
    ]

    counted: list[int] = []

    def counting(collator):
        def collate(examples):
            batch = collator(examples)
            counted.append(int(batch["attention_mask"].sum()))
            return batch

        return collate

    torch.manual_seed(SEED)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    clock = trl_step_clock()
    with tempfile.TemporaryDirectory() as tmp:
        config = DPOConfig(**trl_args(tmp, steps, options), beta=BETA, loss_type=["sigmoid"])
        trainer = in_order(DPOTrainer)(
            model=model,
            args=config,
            train_dataset=Dataset.from_list(pairs),
            processing_class=tokenizer,
            peft_config=trl_lora(),
            callbacks=[clock],
        )
        trainer.data_collator = counting(trainer.data_collator)
        trainer.train()
    rows = [(t, counted[k], loss) for k, (t, loss) in enumerate(zip(clock.times, clock.losses, strict=False))]
    return {"steps": rows, "peak_rss_mb": peak_rss_mb(), "bf16": bool(options.get("bf16"))}


def summarize(result: dict, warmup: int) -> dict:
    rows = result["steps"][warmup:]
    seconds = sum(r[0] for r in rows)
    return {
        "tokens_per_s": sum(r[1] for r in rows) / seconds,
        "step_s": seconds / len(rows),
        "warmup_s": sum(r[0] for r in result["steps"][:warmup]),
        "peak_rss_mb": result["peak_rss_mb"],
        "losses": [r[2] for r in result["steps"]],
        "bf16": result["bf16"],
    }


def worker(which: str, data: Path, steps: int) -> dict:
    if which in OURS:
        return run_ours(data, steps, *OURS[which])
    order = json.loads(data.with_suffix(".order.json").read_text())
    return run_trl(data, steps, order, TRL[which])


def print_report(best: dict[str, dict]) -> None:
    trl = best.get("trl-bf16", best.get("trl"))
    heads = ("tokens/s", 15), ("s/step", 7), ("peak RSS MB", 17), ("bf16", 5), ("warmup s", 8)
    print(f"{'':>10} " + " ".join(f"{name:>{width}}" for name, width in heads))
    for which, r in best.items():
        speed, memory = (r[k] / (trl or r)[k] for k in ("tokens_per_s", "peak_rss_mb"))
        print(
            f"{which:>10} {r['tokens_per_s']:>7.1f} ({speed:.2f}x) {r['step_s']:>7.2f} "
            f"{r['peak_rss_mb']:>9.0f} ({memory:.2f}x) {('no', 'yes')[r['bf16']]:>5} {r['warmup_s']:>8.1f}"
        )
    print("loss per step (" + " | ".join(best) + "):")  # bf16 runs: within bf16's rounding
    for step, losses in enumerate(zip(*(r["losses"] for r in best.values()), strict=False)):
        print(f"  {step:>3} " + " | ".join(f"{x:.4f}" for x in losses))


def main() -> None:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1)
    default_runs = ["trl", "trl-bf16", "ours-eager", "ours-auto"]
    parser.add_argument("--runs", nargs="+", choices=[*TRL, *OURS], default=default_runs)
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/preference.json"))
    parser.add_argument("--worker", nargs=3, metavar=("WHICH", "DATA", "STEPS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        which, data, steps = args.worker
        print(json.dumps(worker(which, Path(data), int(steps))))
        return

    from transformers import AutoTokenizer

    from lit_instruct.model_names import prepare_smollm2

    path = prepare_smollm2()
    tokenizer = AutoTokenizer.from_pretrained(path)
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "pairs.jsonl"
        write_jsonl(data, preference_records(args.steps * BATCH, tokenizer))
        ours = datamodule(data)
        ours.setup("fit")
        order = list(ours.train_dataloader().sampler)  # the pairs as our first epoch takes them
        data.with_suffix(".order.json").write_text(json.dumps(order))
        runs: dict[str, list[dict]] = {which: [] for which in args.runs}
        for _ in range(args.rounds):
            for which in runs:
                runs[which].append(
                    summarize(run_worker(__file__, which, str(data), str(args.steps)), args.warmup)
                )

    best = {which: max(rs, key=lambda r: r["tokens_per_s"]) for which, rs in runs.items()}
    print_report(best)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"runs": runs}, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
