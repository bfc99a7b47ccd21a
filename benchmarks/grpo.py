"""lit-instruct's GRPO vs TRL's GRPOTrainer on the same work: steps/s, generation and training
tokens/s, peak memory.

Both train SmolLM2-135M-Instruct with GRPO (``dapo``, beta 0, group-scaled advantages), LoRA r=16 on
all linear layers, on the same prompts (two-digit arithmetic, ``examples/data/arithmetic.jsonl``; each
tool in its own order): 4 prompts a step, 8 completions each (32 sampled completions), up
to 32 new tokens at temperature 0.7, rewarded by the same functions (``exact_answer`` and a
``\\boxed{}`` format reward), constant LR 2e-4, AdamW, clipping at 1.0. Each run is its own process
(peak RSS is the process's); steady state is after ``--warmup`` steps. The completions differ (each
tool samples its own), so speeds are per token: generation tokens/s is the sampled completion tokens
over the time sampling took; training tokens/s the prompt and completion tokens the loss saw over the
rest of the step.

The runs (``--runs``; every ratio is against ``trl-bf16``, else ``trl``):
  trl        TRL's fp32 (bf16 off), gradient checkpointing off
  trl-bf16   trl with ``bf16=True`` (TRL's default precision; autocast over the fp32 model)
  ours-auto  ``configs/grpo.yaml``'s choices: ``precision: auto``, ``model.dtype: auto`` (bf16 where
             the CPU does bf16, else fp32)
  ours-gc    ours-auto with ``model.gradient_checkpointing: true``
  ours-gcN   ours-gc recomputing only the first N of the 30 layers (``model.checkpoint_layers: N``),
             e.g. ours-gc15
  ours-fp32  ours in fp32

    pip install 'lit-instruct[bench]'          # trl, datasets
    python benchmarks/grpo.py                  # trl, trl-bf16, ours-auto: 6 steps
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from vs_trl import SEED, peak_rss_mb, trl_step_clock
from workers import run_worker

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ROOT / "examples" / "data" / "arithmetic.jsonl"
BATCH, GENERATIONS, NEW_TOKENS, TEMPERATURE, RANK, LR = 4, 8, 32, 0.7, 16, 2e-4
FORMAT = r"\\boxed\{-?\d+\}"
OURS = {  # (model dtype, precision, gradient checkpointing, checkpointed layers)
    "ours-auto": ("auto", "auto", False, None),
    "ours-gc": ("auto", "auto", True, None),
    "ours-fp32": ("float32", "32-true", False, None),
}
TRL = {"trl": {}, "trl-bf16": {"bf16": True}}


def run_ours(steps: int, dtype: str, precision: str, checkpointing: bool, layers: int | None) -> dict:
    import lightning as L

    from lit_instruct import InstructDataModule, InstructLoRAModule, LoRAConfig
    from lit_instruct.objectives import GRPO
    from lit_instruct.train.trainer import InstructTrainer

    objective = GRPO(
        rewards=["exact_answer", {"class_path": "format", "init_args": {"pattern": FORMAT}}],
        num_generations=GENERATIONS,
        max_completion_length=NEW_TOKENS,
        temperature=TEMPERATURE,
    )

    class StepClock(L.Callback):
        def __init__(self) -> None:
            self.rows: list[tuple[float, float, int, int]] = []  # (step s, sampling s, sampled, tokens)

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self.start = time.perf_counter()
            self.sampling = (objective.sampling_seconds, objective.sampled_tokens)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            sampled = objective.sampled_tokens - self.sampling[1]
            sampling = objective.sampling_seconds - self.sampling[0]
            self.rows.append((time.perf_counter() - self.start, sampling, sampled, int(batch["num_tokens"])))

    clock = StepClock()
    with tempfile.TemporaryDirectory() as tmp:
        L.seed_everything(SEED)
        module = InstructLoRAModule(
            objective=objective,
            lora=LoRAConfig(r=RANK, alpha=2 * RANK, dropout=0.0, target_modules="all-linear"),
            learning_rate=LR,
            warmup_steps=0,
            min_lr_ratio=1.0,
            dtype=dtype,
            gradient_checkpointing=checkpointing,
            checkpoint_layers=layers,
            adapter_dir=f"{tmp}/adapter",
        )
        data = InstructDataModule(
            batch_kind="prompts",
            train_files=[str(PROMPTS)],
            batch_size=BATCH,
            val_fraction=0.0,
            seed=SEED,
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
        trainer.fit(module, datamodule=data)
        bf16 = str(trainer.precision).startswith("bf16")
    return {"steps": clock.rows, "peak_rss_mb": peak_rss_mb(), "bf16": bf16}


def run_trl(steps: int, options: dict) -> dict:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from lit_instruct.model_names import prepare_smollm2
    from lit_instruct.rewards import FormatReward, exact_answer

    path = prepare_smollm2()
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines()][: steps * BATCH]
    dataset = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]} for r in rows]
    )
    torch.manual_seed(SEED)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    clock = trl_step_clock()
    with tempfile.TemporaryDirectory() as tmp:
        config = GRPOConfig(
            output_dir=tmp,
            per_device_train_batch_size=BATCH * GENERATIONS,
            num_generations=GENERATIONS,
            max_completion_length=NEW_TOKENS,
            temperature=TEMPERATURE,
            max_steps=steps,
            learning_rate=LR,
            lr_scheduler_type="constant",
            warmup_steps=0,
            max_grad_norm=1.0,
            logging_steps=1,
            save_strategy="no",
            report_to="none",
            use_cpu=True,
            shuffle_dataset=False,
            seed=SEED,
            disable_tqdm=True,
            **{"bf16": False, **options},
        )
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=[exact_answer, FormatReward(FORMAT)],
            args=config,
            train_dataset=dataset,
            processing_class=tokenizer,
            peft_config=LoraConfig(
                r=RANK, lora_alpha=2 * RANK, lora_dropout=0.0, target_modules="all-linear"
            ),
            callbacks=[clock],
        )
        sampled: list[tuple[float, int, int]] = []  # (seconds, completion tokens, all tokens)
        generate = trainer._generate

        def timed(prompts):
            start = time.perf_counter()
            out = generate(prompts)
            prompt_ids, completion_ids = out[0], out[1]
            tokens = sum(map(len, completion_ids))
            sampled.append((time.perf_counter() - start, tokens, tokens + sum(map(len, prompt_ids))))
            return out

        trainer._generate = timed
        trainer.train()
    rows = [(t, s, n, total) for t, (s, n, total) in zip(clock.times, sampled, strict=False)]
    return {"steps": rows, "peak_rss_mb": peak_rss_mb(), "bf16": bool(options.get("bf16"))}


def summarize(result: dict, warmup: int) -> dict:
    rows = result["steps"][warmup:]
    seconds = sum(r[0] for r in rows)
    sampling = sum(r[1] for r in rows)
    return {
        "step_s": seconds / len(rows),
        "generation_tokens_per_s": sum(r[2] for r in rows) / sampling,
        "training_tokens_per_s": sum(r[3] for r in rows) / (seconds - sampling),
        "mean_completion": sum(r[2] for r in rows) / (len(rows) * BATCH * GENERATIONS),
        "peak_rss_mb": result["peak_rss_mb"],
        "bf16": result["bf16"],
    }


def worker(which: str, steps: int) -> dict:
    if which in OURS:
        return run_ours(steps, *OURS[which])
    if which.startswith("ours-gc"):
        return run_ours(steps, "auto", "auto", True, int(which.removeprefix("ours-gc")))
    return run_trl(steps, TRL[which])


def print_report(best: dict[str, dict]) -> None:
    base = best.get("trl-bf16", best.get("trl"))
    heads = ("s/step", 15), ("gen tok/s", 9), ("train tok/s", 11), ("completion", 10), ("peak RSS MB", 17)
    print(f"{'':>10} " + " ".join(f"{name:>{width}}" for name, width in heads))
    for which, r in best.items():
        speed = (base or r)["step_s"] / r["step_s"]
        memory = r["peak_rss_mb"] / (base or r)["peak_rss_mb"]
        print(
            f"{which:>10} {r['step_s']:>7.2f} ({speed:.2f}x) {r['generation_tokens_per_s']:>9.1f} "
            f"{r['training_tokens_per_s']:>11.1f} {r['mean_completion']:>10.1f} "
            f"{r['peak_rss_mb']:>9.0f} ({memory:.2f}x)"
        )


def run_name(name: str) -> str:
    """A ``--runs`` entry: one of :data:`TRL`, :data:`OURS`, or ``ours-gcN``."""
    if name in TRL or name in OURS or (name.startswith("ours-gc") and name[7:].isdigit()):
        return name
    raise argparse.ArgumentTypeError(f"{name!r}: one of {', '.join([*TRL, *OURS])} or ours-gcN (N layers)")


def main() -> None:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--runs", nargs="+", type=run_name, default=["trl", "trl-bf16", "ours-auto"])
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/grpo.json"))
    parser.add_argument("--worker", nargs=2, metavar=("WHICH", "STEPS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        which, steps = args.worker
        print(json.dumps(worker(which, int(steps))))
        return
    runs = {
        which: summarize(run_worker(__file__, which, str(args.steps)), args.warmup) for which in args.runs
    }
    print_report(runs)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"runs": runs}, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
