"""Where `make demo`'s memory peak is: resident-set peaks of `lit-instruct prepare` (into an empty
cache) and of each phase of the quickstart fit.

    python benchmarks/demo_memory.py [--dir DIR] [-- --model.gradient_checkpointing true]

Each command runs in its own process, as `make demo` runs them. The fit gets a callback that reads
the process's peak resident set (``VmHWM``) at every phase boundary and resets it
(``/proc/self/clear_refs``), so each phase reports its own peak and how far it rose above the resident
set it began with: the build (process start, model load, LoRA, data setup), validation, each training
step (the one that rose most is named by its batch shape), and the end (adapter, checkpoint). Linux.
Arguments after ``--`` go to ``lit-instruct fit``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning as L


def peak_and_reset() -> tuple[int, int]:
    """This process's resident-set peak since the last reset and its resident set now, in MiB; resets
    the peak (it restarts from the resident set now)."""
    with open("/proc/self/status") as status:
        fields = {
            k: int(v.split()[0]) // 1024
            for k, v in (line.split(":", 1) for line in status)
            if k in ("VmHWM", "VmRSS")
        }
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")
    return fields["VmHWM"], fields["VmRSS"]


class PhasePeaks(L.Callback):
    """Prints ``phase-peak|<phase>|<peak MiB>|<rise MiB>|<batch shape>`` at the end of every phase: its
    resident-set peak, and how far that is above the resident set the phase started with (memory the
    allocator kept from an earlier phase counts in the peak, not in the rise)."""

    def __init__(self) -> None:
        self.phase = "build"
        self.start_rss = 0

    def _close(self, next_phase: str, detail: str = "") -> None:
        peak, rss = peak_and_reset()
        print(f"phase-peak|{self.phase}|{peak}|{peak - self.start_rss}|{detail}", flush=True)
        self.phase, self.start_rss = next_phase, rss

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._close("validation")

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._close("between batches")

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self._close("train step")

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self._close("between batches", "x".join(map(str, args[1]["input_ids"].shape)))

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._close("end (adapter, checkpoint)")

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._close("after fit")


def run(command: list[str], env: dict[str, str]) -> tuple[str, int]:
    """Run ``command``; its output and its own peak resident set in MiB (``wait4``)."""
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = process.stdout.read() if process.stdout else ""
    _, status, usage = os.wait4(process.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"{' '.join(command)} failed:\n{output[-3000:]}")
    return output, usage.ru_maxrss // 1024


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dir", type=Path, default=Path("/tmp/lit-instruct-demo-memory"))
    parser.add_argument("fit_args", nargs="*", help="extra `lit-instruct fit` arguments (after --)")
    args = parser.parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)
    env = {
        **os.environ,
        "LIT_INSTRUCT_CACHE": str(args.dir / "cache"),  # an empty cache: prepare and tokenize from scratch
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]),
    }
    _, prepare_peak = run([sys.executable, "-m", "lit_instruct", "prepare"], env)
    fit = [sys.executable, "-m", "lit_instruct", "fit", "--config", "configs/quickstart.yaml"]
    fit += ["--trainer.callbacks+=demo_memory.PhasePeaks", *args.fit_args]
    output, _ = run(fit, env)  # its own peak: the resets lowered it (phases below)

    peaks: dict[str, int] = {}  # phase -> its highest peak
    rises: dict[str, tuple[int, str]] = {}  # phase -> its highest rise, and that step's batch shape
    for line in output.splitlines():
        if line.startswith("phase-peak|"):
            _, phase, peak, rise, shape = line.split("|")
            peaks[phase] = max(peaks.get(phase, 0), int(peak))
            rises[phase] = max(rises.get(phase, (0, "")), (int(rise), shape))
    print(f"{'phase':<36} {'peak RSS':>9} {'rise':>9}")
    print(f"{'prepare (empty cache)':<36} {prepare_peak:>5} MiB")
    for phase, peak in peaks.items():
        rise, shape = rises[phase]
        label = f"fit: {phase}" + (f" (batch {shape})" if shape else "")
        print(f"{label:<36} {peak:>5} MiB {rise:>5} MiB")
    print(f"{'fit: whole process':<36} {max(peaks.values()):>5} MiB")
    print(*(line for line in output.splitlines() if line.startswith("lit-instruct: fit done")), sep="\n")


if __name__ == "__main__":
    main()
