"""Step time of the quickstart config with LayerProfiler every step, every 10 steps, and off.

Each mode trains the same seeded steps (same batches) in its own process; the modes alternate over
``--rounds`` rounds. The first ``--warmup`` steps of each run are not counted. Overhead is the
total time of the counted steps over the same steps with the profiler off (best round of each).

    python benchmarks/profiler_overhead.py                # 20 steps per run, 2 rounds (~12 min)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import lightning as L

MODES = {"off": None, "every_10": 10, "every_1": 1}
ROOT = Path(__file__).parents[1]


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
            cmd = [sys.executable, __file__, "--worker", mode, str(args.steps)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT)
            runs[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
    best = {mode: min(sum(r[args.warmup :]) for r in rs) for mode, rs in runs.items()}
    counted = args.steps - args.warmup
    print(f"{'profiler':>9} {'s/step':>7} {'overhead':>8}   ({counted} steps counted, best of {args.rounds})")
    for mode, total in best.items():
        print(f"{mode:>9} {total / counted:>7.3f} {total / best['off'] - 1:>+8.2%}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"steps_counted": counted, "runs": runs, "best_seconds": best}, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
