"""lit-instruct vs TRL's SFTTrainer on identical LoRA work: tokens/s, peak memory, loss.

Both train SmolLM2-135M-Instruct, each at its best in fp32 and in bf16 (where the CPU has native
bf16: AVX512-BF16 or AMX), with LoRA r=16 on all linear layers, completion-only loss,
batch 4, max length 512, constant LR 2e-4, AdamW, gradient clipping at 1.0, on the same instruction
data (~80-token prompts, ~100-token answers, built from the chatterbot corpus) in the same order,
for the same number of optimizer steps. Each run is its own process; the runs alternate for
``--rounds`` rounds and the best round of each is reported. Steady state: after ``--warmup`` steps
(their time, which includes ``torch.compile``'s, is reported apart). The FLOP limit of each run is
its tokens/s over what the machine's fp32 or bf16 GEMMs at the step's own shapes allow, both
measured in the same run. ``--competing`` runs each tool again beside one busy process at ``nice 19``
(a shared machine): the ratio of each tool's speed with it to without.

The runs (``--runs``; every ratio is against ``trl-bf16``, else ``trl``, else 1.00x):
  trl          TRL's fastest fp32 settings: bf16 and gradient checkpointing off
  trl-bf16     trl with ``bf16=True`` (TRL's own default; autocast over the fp32 model)
  trl-gc       TRL with its default gradient checkpointing
  ours-eager   ``configs/lora.yaml``'s choices: fused CE (``one_device``), padding-free packing
               (``data.packing``) and the fused LoRA layers (``model.fuse_lora``, the default)
  ours-peft    ours-eager on PEFT's own LoRA layers (``model.fuse_lora: false``)
  ours         ours-eager + ``model.compile_layers``
  ours-gc      ours-eager + ``model.gradient_checkpointing``
  ours-gc-half ours-gc on the first 15 of the 30 layers only (``model.checkpoint_layers: 15``)
  ours-lean    ours + ``model.gradient_checkpointing``
  ours-bf16    ours-eager under bf16 autocast (``trainer.precision: bf16-mixed``), fp32 base weights
  ours-auto    the shipped configs' default: ``precision: auto`` and ``model.dtype: auto`` (bf16
               autocast over bf16 base weights where the CPU does bf16, else ours-eager)

    pip install 'lit-instruct[bench]'          # trl, datasets
    python benchmarks/vs_trl.py                # trl, trl-bf16, ours-eager, ours-auto: 12 steps
    python benchmarks/vs_trl.py --competing    # the same, then again beside a busy process
"""

from __future__ import annotations

import argparse
import itertools
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from workers import run_worker

BATCH, MAX_LENGTH, LR, SEED, RANK = 4, 512, 2e-4, 0, 16
OURS = {  # (module options, Trainer precision)
    "ours-peft": ({"fuse_lora": False}, "32-true"),
    "ours-eager": ({}, "32-true"),
    "ours": ({"compile_layers": True}, "32-true"),
    "ours-gc": ({"gradient_checkpointing": True}, "32-true"),
    "ours-gc-half": ({"gradient_checkpointing": True, "checkpoint_layers": 15}, "32-true"),
    "ours-lean": ({"compile_layers": True, "gradient_checkpointing": True}, "32-true"),
    "ours-bf16": ({}, "bf16-mixed"),
    "ours-auto": ({"dtype": "auto"}, "auto"),
}
TRL = {
    "trl": {"gradient_checkpointing": False},
    "trl-bf16": {"gradient_checkpointing": False, "bf16": True},
    "trl-gc": {"gradient_checkpointing": True},
}
SPIN = "while True: pass"
"""The competing process: one busy thread at ``nice 19`` in a session of its own, as another login's
job would be (``nice`` orders processes within a session's scheduler group, not across groups)."""


def instruction_records(
    count: int, tokenizer, prompt_tokens: int = 80, answer_tokens: int = 100
) -> list[dict]:
    """Prompt/completion records cut from the chatterbot corpus's utterances to about the given lengths."""
    from lit_instruct.data.chatterbot import read_chatterbot

    texts = [m.content for r in read_chatterbot() for m in r.messages]
    records, at = [], 0

    def take(budget: int) -> str:
        nonlocal at
        words: list[str] = []
        while len(tokenizer(" ".join(words))["input_ids"]) < budget:
            words += texts[at % len(texts)].split()
            at += 1
        return " ".join(words)

    for _ in range(count):
        records.append({"prompt": take(prompt_tokens), "completion": take(answer_tokens)})
    return records


def write_jsonl(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def packed_datamodule(data: Path, batch: int = BATCH) -> Any:
    """Our data module on the benchmark's JSONL: packed rows of ``batch`` samples, no validation."""
    from lit_instruct import InstructDataModule

    return InstructDataModule(
        train_files=[str(data)],
        max_seq_len=MAX_LENGTH,
        batch_size=batch,
        val_fraction=0.0,
        deduplicate=False,
        packing=True,
        seed=SEED,
    )


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_ours(data: Path, steps: int, options: dict, precision: str) -> dict:
    import lightning as L

    from lit_instruct import InstructLoRAModule, LoRAConfig
    from lit_instruct.train.trainer import InstructTrainer

    class StepClock(L.Callback):
        def __init__(self) -> None:
            # (seconds, tokens, response tokens, loss, sum over samples of n(n+1)/2: causal contexts)
            self.rows: list[tuple[float, int, int, float, int]] = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self.start = time.perf_counter()
            self.tokens = batch["input_ids"].numel()
            self.response = int((batch["labels"][:, 1:] != -100).sum())
            bounds = batch["packed_segments"]
            self.contexts = sum((e - s) * (e - s + 1) // 2 for s, e in itertools.pairwise(bounds))

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            loss = float(trainer.callback_metrics["train/loss"])
            seconds = time.perf_counter() - self.start
            self.rows.append((seconds, self.tokens, self.response, loss, self.contexts))

    clock = StepClock()
    with tempfile.TemporaryDirectory() as tmp:
        L.seed_everything(SEED)
        lora = LoRAConfig(r=RANK, alpha=2 * RANK, dropout=0.0, target_modules="all-linear")
        module = InstructLoRAModule(
            lora=lora,
            learning_rate=LR,
            warmup_steps=0,
            min_lr_ratio=1.0,
            adapter_dir=f"{tmp}/adapter",
            packing=True,
            **options,
        )
        datamodule = packed_datamodule(data)
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
        trainer.fit(module, datamodule=datamodule)
        bf16 = str(trainer.precision).startswith("bf16")
    return {"steps": clock.rows, "peak_rss_mb": peak_rss_mb(), "bf16": bf16}


def in_order(trainer_class: type) -> type:
    """``trainer_class`` (a TRL trainer) taking its dataset in order: lit-instruct's order, so that
    both see the same batches."""
    from torch.utils.data import SequentialSampler

    class InOrder(trainer_class):  # type: ignore[misc, valid-type]
        def _get_train_sampler(self, train_dataset=None):
            return SequentialSampler(train_dataset or self.train_dataset)

    return InOrder


def trl_step_clock() -> Any:
    """A ``transformers`` callback keeping each optimizer step's seconds (``times``) and each logged
    loss (``losses``)."""
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.losses: list[float] = []

        def on_step_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.perf_counter() - self.start)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                self.losses.append(float(logs["loss"]))

    return StepClock()


def trl_args(output_dir: str, steps: int, options: dict) -> dict:
    """TRL's training arguments as both benchmarks run them: batch, length, constant LR, clipping,
    CPU, a log line a step, no saving; ``options`` over fp32 (gradient checkpointing: TRL's default
    is on, off is faster)."""
    return dict(
        output_dir=output_dir,
        per_device_train_batch_size=BATCH,
        max_length=MAX_LENGTH,
        max_steps=steps,
        learning_rate=LR,
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_grad_norm=1.0,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        **{"bf16": False, **options},
        seed=SEED,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )


def trl_lora() -> Any:
    """peft's LoRA as both tools train it here: r=16, alpha 32, no dropout, every linear layer."""
    from peft import LoraConfig

    return LoraConfig(
        r=RANK, lora_alpha=2 * RANK, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM"
    )


def run_trl(data: Path, steps: int, order: list[int], options: dict) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    from lit_instruct.model_names import prepare_smollm2

    path = prepare_smollm2()
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    conversations = [
        {
            "prompt": [{"role": "user", "content": rows[i]["prompt"]}],
            "completion": [{"role": "assistant", "content": rows[i]["completion"]}],
        }
        for i in order
    ]

    counted: list[tuple[int, int]] = []

    def counting(collator):
        def collate(examples):
            batch = collator(examples)
            counted.append((int(batch["attention_mask"].sum()), int((batch["labels"][:, 1:] != -100).sum())))
            return batch

        return collate

    torch.manual_seed(SEED)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    clock = trl_step_clock()
    with tempfile.TemporaryDirectory() as tmp:
        config = SFTConfig(**trl_args(tmp, steps, options))
        trainer = in_order(SFTTrainer)(
            model=model,
            args=config,
            train_dataset=Dataset.from_list(conversations),
            processing_class=tokenizer,
            peft_config=trl_lora(),
            callbacks=[clock],
        )
        trainer.data_collator = counting(trainer.data_collator)
        trainer.train()
    rows = [
        (t, *counted[k], loss) for k, (t, loss) in enumerate(zip(clock.times, clock.losses, strict=False))
    ]
    return {"steps": rows, "peak_rss_mb": peak_rss_mb(), "bf16": bool(options.get("bf16"))}


def flops_per_token(config, response_fraction: float, mean_context: float) -> float:
    """Frozen-base LoRA training, per token: forward 2P and input-gradient backward 2P over the
    frozen linear layers (no weight gradients for the base), and the lm_head over the response
    positions only (all the loss needs); forward, input- and weight-gradient 6P over the adapters;
    causal attention over ``mean_context`` keys: QK^T and AV forward (4 h FLOPs a key), twice
    that backward (dQ, dK, dV and dP)."""
    h, layers, inter = config.hidden_size, config.num_hidden_layers, config.intermediate_size
    kv = h * config.num_key_value_heads // config.num_attention_heads
    frozen = layers * (2 * h * h + 2 * h * kv + 3 * h * inter) + response_fraction * h * config.vocab_size
    adapters = layers * RANK * (2 * (h + h) + 2 * (h + kv) + 3 * (h + inter))
    attention = layers * 4 * h * mean_context
    return 4 * frozen + 6 * adapters + 3 * attention


def gemm_gflops(dtype: str, tokens: int, config, trials: int = 5) -> float:
    """The machine's matmul rate in ``dtype`` at the step's own shapes: a decoder layer's
    projections (q, k, v, o, gate, up, down) on ``tokens`` rows, best of ``trials``."""
    import torch

    h, inter = config.hidden_size, config.intermediate_size
    kv = h * config.num_key_value_heads // config.num_attention_heads
    shapes = [(h, h), (h, kv), (h, kv), (h, h), (h, inter), (h, inter), (inter, h)]
    kind = getattr(torch, dtype)
    pairs = [(torch.randn(tokens, k).to(kind), torch.randn(k, n).to(kind)) for k, n in shapes]
    flops = sum(2 * tokens * k * n for k, n in shapes) * 10
    for a, b in pairs:
        a @ b
    best = float("inf")
    for _ in range(trials):
        start = time.perf_counter()
        for _ in range(10):
            for a, b in pairs:
                a @ b
        best = min(best, time.perf_counter() - start)
    return flops / best / 1e9


def summarize(result: dict, warmup: int) -> dict:
    rows = result["steps"][warmup:]
    seconds = sum(r[0] for r in rows)
    return {
        "tokens_per_s": sum(r[1] for r in rows) / seconds,
        "response_tokens_per_s": sum(r[2] for r in rows) / seconds,
        "response_fraction": sum(r[2] for r in rows) / sum(r[1] for r in rows),
        "mean_context": sum(r[4] for r in rows) / sum(r[1] for r in rows) if len(rows[0]) > 4 else None,
        "warmup_s": sum(r[0] for r in result["steps"][:warmup]),
        "peak_rss_mb": result["peak_rss_mb"],
        "losses": [r[3] for r in result["steps"]],
        "bf16": result["bf16"],
        "tokens_per_step": sum(r[1] for r in rows) / len(rows),
    }


def worker(which: str, data: Path, steps: int) -> dict:
    if which in OURS:
        return run_ours(data, steps, *OURS[which])
    order = json.loads(data.with_suffix(".order.json").read_text())
    return run_trl(data, steps, order, TRL[which])


def print_report(best: dict[str, dict], limits: dict[bool, float]) -> None:
    trl = best.get("trl-bf16", best.get("trl"))  # without TRL (a run to compare losses): 1.00x
    heads = ("tokens/s", 15), ("resp tok/s", 15), ("peak RSS MB", 17), ("FLOP limit", 10), ("warmup s", 8)
    print(f"{'':>10} " + " ".join(f"{name:>{width}}" for name, width in heads))
    for which, r in best.items():
        ratios = [r[k] / (trl or r)[k] for k in ("tokens_per_s", "response_tokens_per_s", "peak_rss_mb")]
        print(
            f"{which:>10} {r['tokens_per_s']:>7.1f} ({ratios[0]:.2f}x) "
            f"{r['response_tokens_per_s']:>7.1f} ({ratios[1]:.2f}x) "
            f"{r['peak_rss_mb']:>9.0f} ({ratios[2]:.2f}x) "
            f"{r['tokens_per_s'] / limits[r['bf16']]:>10.1%} {r['warmup_s']:>8.1f}"
        )
    print("loss per step (" + " | ".join(best) + "):")  # bf16 runs: within bf16's rounding
    for step, losses in enumerate(zip(*(r["losses"] for r in best.values()), strict=False)):
        print(f"  {step:>3} " + " | ".join(f"{x:.4f}" for x in losses))


def main() -> None:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--competing", action="store_true", help="again beside a busy process at nice 19")
    default_runs = ["trl", "trl-bf16", "ours-eager", "ours-auto"]
    parser.add_argument("--runs", nargs="+", choices=[*TRL, *OURS], default=default_runs)
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/vs_trl.json"))
    parser.add_argument("--worker", nargs=3, metavar=("WHICH", "DATA", "STEPS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        which, data, steps = args.worker
        print(json.dumps(worker(which, Path(data), int(steps))))
        return
    if not set(args.runs) & set(OURS):
        parser.error("--runs must include a lit-instruct run: the FLOP count reads its packed batches")

    from transformers import AutoConfig, AutoTokenizer

    from lit_instruct.data.sampler import InstructSampler
    from lit_instruct.model_names import prepare_smollm2

    path = prepare_smollm2()
    tokenizer = AutoTokenizer.from_pretrained(path)
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "instructions.jsonl"
        records = instruction_records(args.steps * BATCH, tokenizer)
        write_jsonl(data, records)
        order = InstructSampler([1] * len(records), BATCH, seed=SEED).rank_order(0)
        data.with_suffix(".order.json").write_text(json.dumps(order))
        runs: dict[str, list[dict]] = {which: [] for which in args.runs}
        shared: dict[str, list[dict]] = {which: [] for which in args.runs}
        for _ in range(args.rounds):
            for which in runs:
                result = run_worker(__file__, which, str(data), str(args.steps))
                runs[which].append(summarize(result, args.warmup))
        for _ in range(args.rounds if args.competing else 0):
            for which in shared:
                spinner = subprocess.Popen(
                    ["nice", "-n", "19", sys.executable, "-c", SPIN], start_new_session=True
                )
                try:
                    result = run_worker(__file__, which, str(data), str(args.steps))
                finally:
                    spinner.kill()
                shared[which].append(summarize(result, args.warmup))

    best = {which: max(rs, key=lambda r: r["tokens_per_s"]) for which, rs in runs.items()}
    # The response share of the tokens and the causal contexts, from one of our runs (TRL's count
    # also has the newline after each answer's end-of-turn token).
    counted = next(r for which, r in best.items() if which in OURS)
    config = AutoConfig.from_pretrained(path)
    tokens = int(counted["tokens_per_step"])
    gflops = {bf16: gemm_gflops("bfloat16" if bf16 else "float32", tokens, config) for bf16 in (False, True)}
    per_token = flops_per_token(config, counted["response_fraction"], counted["mean_context"])
    limits = {bf16: rate * 1e9 / per_token for bf16, rate in gflops.items()}
    print(
        f"GEMMs at the step's shapes ({tokens} rows): fp32 {gflops[False]:.0f}, bf16 {gflops[True]:.0f} "
        f"GFLOP/s; LoRA training {per_token / 1e6:.0f} MFLOP/token (mean causal context "
        f"{counted['mean_context']:.0f}) -> FLOP limit fp32 {limits[False]:.0f}, "
        f"bf16 {limits[True]:.0f} tokens/s"
    )
    print_report(best, limits)
    if args.competing:
        print("beside one busy process at nice 19 (tokens/s, and the share of the speed alone kept):")
        for which, rs in shared.items():
            speed = max(r["tokens_per_s"] for r in rs)
            print(f"{which:>10} {speed:>7.1f} ({speed / best[which]['tokens_per_s']:.0%})")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps(
            {"runs": runs, "competing": shared, "gemm_gflops": gflops, "flops_per_token": per_token}, indent=2
        )
    )
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
