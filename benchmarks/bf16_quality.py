"""The quickstart trained in fp32 and under ``precision: auto`` (bf16 where the CPU has it): the same
60 steps, each run its own ``lit-instruct fit`` process, for each seed; the final val/loss of each
(target: bf16 within 1% of fp32), the wall time of the fit and its last tokens/s.

    python benchmarks/bf16_quality.py                  # seed 42: about 5 min on 2 cores with bf16
    python benchmarks/bf16_quality.py --seeds 42 43 44 # and the mean gap over the seeds
"""

from __future__ import annotations

import argparse
import csv
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def fit(precision: str, root: Path, steps: int, seed: int) -> dict[str, Any]:
    logger = f"{{class_path: lightning.pytorch.loggers.CSVLogger, init_args: {{save_dir: {root}, name: ''}}}}"
    command = [sys.executable, "-m", "lit_instruct", "fit", "--config", str(ROOT / "configs/quickstart.yaml")]
    command += ["--trainer.precision", precision, "--trainer.default_root_dir", str(root)]
    command += ["--trainer.logger", logger, "--trainer.max_steps", str(steps)]
    command += ["--trainer.callbacks", "[]", "--model.adapter_dir", str(root / "adapter")]
    command += ["--seed_everything", str(seed)]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    if done.returncode:
        raise SystemExit(f"{precision}: exit {done.returncode}\n{done.stderr[-3000:]}")
    seconds = time.perf_counter() - start
    rows = list(csv.DictReader((root / "version_0" / "metrics.csv").open()))
    val = [float(r["val/loss"]) for r in rows if r.get("val/loss")]
    speed = [float(r["train/tokens_per_s"]) for r in rows if r.get("train/tokens_per_s")]
    chose = next(
        (line for line in done.stdout.splitlines() + done.stderr.splitlines() if "auto:" in line), ""
    )
    return {
        "val_before": val[0],
        "val_after": val[-1],
        "wall_s": seconds,
        "tokens_per_s": speed[-1],
        "line": chose,
    }


def main() -> None:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--seeds", type=int, nargs="+", default=[42])
    args = parser.parse_args()
    gaps, speedups = [], []
    heads = f"{'seed':>4} {'precision':>10} {'val/loss before':>16} {'after':>8}"
    print(f"{heads} {'fit wall s':>11} {'tokens/s':>9}")
    for seed in args.seeds:
        results = {}
        with tempfile.TemporaryDirectory() as tmp:
            for precision in ("32-true", "auto"):
                results[precision] = fit(precision, Path(tmp) / precision, args.steps, seed)
        for precision, r in results.items():
            print(
                f"{seed:>4} {precision:>10} {r['val_before']:>16.4f} {r['val_after']:>8.4f} "
                f"{r['wall_s']:>11.1f} {r['tokens_per_s']:>9.1f}",
                flush=True,
            )
        fp32, auto = results["32-true"], results["auto"]
        gaps.append(auto["val_after"] / fp32["val_after"] - 1)
        speedups.append(fp32["wall_s"] / auto["wall_s"])
    print(results["auto"]["line"])
    print(
        f"auto vs fp32 over seeds {args.seeds}: val/loss {', '.join(f'{g:+.2%}' for g in gaps)} "
        f"(mean {sum(gaps) / len(gaps):+.2%}; target within 1%), fit wall "
        f"{sum(speedups) / len(speedups):.2f}x faster"
    )


if __name__ == "__main__":
    main()
