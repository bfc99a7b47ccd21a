"""Step time of the quickstart config with LayerProfiler every step, every 10 steps, and off.

Each mode trains the same seeded steps (same batches) in its own process; the modes alternate over
``--rounds`` rounds. The first ``--warmup`` steps of each run are not counted. Overhead is the
total time of the counted steps (each step's fastest time over the rounds) over the same with the
profiler off.

    python benchmarks/profiler_overhead.py                # 20 steps per run, 2 rounds (~12 min)
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import lightning as L
from workers import run_worker

MODES = {"off": None, "every_10": 10, "every_1": 1}


class StepTimer(L.Callback):
    """Wall time of each training batch."""

    def __init__(self) -> None:
        self.seconds: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.seconds.append(time.perf_counter() - self._start)


def worker(every_n_steps: int | None, steps: int) -> list[float]:
    """Train ``steps`` quickstart steps in this process; return each step's seconds."""
    from lit_instruct.callbacks import LayerProfiler
    from lit_instruct.cli import InstructCLI

    timer = StepTimer()
    callbacks: list[L.Callback] = [timer]
    with tempfile.TemporaryDirectory() as tmp:
        if every_n_steps:
            callbacks.append(LayerProfiler(every_n_steps=every_n_steps, output_dir=tmp))
        args = ["fit", "--config", "configs/quickstart.yaml", "--validate_before_fit", "false"]
        args += ["--trainer.max_steps", str(steps), "--trainer.limit_val_batches", "0"]
        args += [
            "--trainer.logger",
            "false",
            "--trainer.callbacks",
            "[]",
            "--trainer.enable_checkpointing",
            "false",
        ]
        args += ["--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", tmp]
        args += ["--model.adapter_dir", f"{tmp}/adapter"]
        InstructCLI(args=args, trainer_defaults={"callbacks": callbacks})
    return timer.seconds


def main() -> None:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/profiler_overhead.json"))
    parser.add_argument("--worker", nargs=2, metavar=("MODE", "STEPS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        mode, steps = args.worker
        print(json.dumps(worker(MODES[mode], int(steps))))
        return

    runs: dict[str, list[list[float]]] = {mode: [] for mode in MODES}
    for _ in range(args.rounds):
        for mode in MODES:
            runs[mode].append(run_worker(__file__, mode, str(args.steps)))
    # Every run trains the same batches: take each step's fastest time over the rounds, which
    # filters out the machine's run-to-run drift, then compare the sums.
    fastest = {
        mode: [min(times) for times in zip(*rs, strict=True)][args.warmup :] for mode, rs in runs.items()
    }
    counted = args.steps - args.warmup
    profiled = [k for k in range(args.warmup, args.steps) if k % 10 == 9]  # every_10's profiled steps
    print(f"{'profiler':>9} {'s/step':>7} {'overhead':>8}  ({counted} steps, fastest of {args.rounds} each)")
    for mode, times in fastest.items():
        print(f"{mode:>9} {sum(times) / counted:>7.3f} {sum(times) / sum(fastest['off']) - 1:>+8.2%}")
    for k in profiled:
        i = k - args.warmup
        cost = fastest["every_10"][i] / fastest["off"][i] - 1
        print(f"step {k} (profiled in every_10): {cost:+.2%} over the same step without the profiler")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"warmup": args.warmup, "runs": runs}, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
