"""The commands that compute outside the training steps, on a machine another process keeps busy.

A busy machine is ``benchmarks/vs_trl.py --competing``'s: one busy thread at ``nice 19`` in a session
of its own. Two commands on the bundled SmolLM2-135M-Instruct, each alone and beside the busy process:

  eval   ``lit-instruct eval --adapter A --data F --answers out.jsonl`` on ``--records`` conversations
         (greedy answers of up to ``--max-new-tokens``), A a rank-8 adapter with random weights
  fit    ``lit-instruct fit --config configs/quickstart.yaml`` for ``--steps`` optimizer steps: the
         validation before the fit (with SampleScores' answers), the steps and the validation after

``--repo DIR`` runs another checkout's code (an earlier commit, as ``git worktree add DIR COMMIT``)
with this interpreter, for before/after figures measured in the same session. Wall seconds of the
whole command; the fit's report line of the validation before it where the code prints one.

    python benchmarks/busy_machine.py                   # this checkout
    python benchmarks/busy_machine.py --repo /tmp/old   # an earlier one
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPIN = "while True: pass"
"""The busy process: one thread at ``nice 19`` in a session of its own (as ``vs_trl.py --competing``)."""


def random_adapter(folder: Path) -> Path:
    """A rank-8 LoRA adapter of the bundled SmolLM2 on q/v, its B matrices random (answers differ
    from the base's), written as training writes one."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from lit_instruct.adapter_folder import save_adapter
    from lit_instruct.model_names import SMOLLM2_NAME, resolve_model_path

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(resolve_model_path(SMOLLM2_NAME))
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.01)
    return save_adapter(model, folder, base=SMOLLM2_NAME)


def conversations(path: Path, count: int) -> Path:
    """``count`` chatterbot conversations as a chat JSONL file."""
    from lit_instruct.data.chatterbot import read_chatterbot

    records = [r for r in read_chatterbot() if len(r.messages) >= 2][:count]
    rows = [{"messages": [m.for_template() for m in r.messages]} for r in records]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def code_of(repo: Path, folder: Path) -> Path:
    """``repo``'s package as it imports: ``lit_instruct/`` with ``callbacks/`` inside it, copied to
    ``folder`` (the editable install maps ``lit_instruct.callbacks`` to this checkout's folder, so a
    ``PYTHONPATH`` to another checkout alone would run its code with today's callbacks)."""
    import shutil

    skip = shutil.ignore_patterns("__pycache__")
    shutil.copytree(repo / "lit_instruct", folder / "lit_instruct", ignore=skip, symlinks=False)
    if not (folder / "lit_instruct" / "callbacks").exists():
        shutil.copytree(repo / "callbacks", folder / "lit_instruct" / "callbacks", ignore=skip)
    return folder


def timed(command: list[str], code: Path, busy: bool) -> tuple[float, str]:
    """Wall seconds of ``python -m lit_instruct COMMAND`` on ``repo``'s package copied at ``code``
    (:func:`code_of`), and its stderr."""
    env = {**os.environ, "PYTHONPATH": str(code), "WANDB_MODE": "offline"}
    spinner = None
    if busy:
        spinner = subprocess.Popen(["nice", "-n", "19", sys.executable, "-c", SPIN], start_new_session=True)
        time.sleep(1.0)  # running before the command looks at the machine
    start = time.perf_counter()
    try:
        program = [sys.executable, "-m", "lit_instruct", *command]
        # run beside the copy, not in ``repo``: ``python -m`` puts its folder first on the path
        result = subprocess.run(program, cwd=code.parent, env=env, capture_output=True, text=True)
    finally:
        if spinner is not None:
            spinner.kill()
    seconds = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command[:1])} failed:\n{result.stderr[-3000:]}")
    return seconds, result.stderr


def main() -> None:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    parser.add_argument("--repo", type=Path, default=ROOT, help="the checkout whose code runs")
    parser.add_argument("--records", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--only", choices=["eval", "fit"], help="one command only")
    args = parser.parse_args()
    repo = args.repo.resolve()
    with tempfile.TemporaryDirectory() as work:
        folder = Path(work)
        adapter = random_adapter(folder / "adapter")
        data = conversations(folder / "chats.jsonl", args.records)
        code = code_of(repo, folder / "code")
        answers, steps = str(folder / "answers.jsonl"), str(args.steps)
        commands = {
            "eval": [
                "eval", "--adapter", str(adapter), "--data", str(data), "--answers", answers,
                "--max-new-tokens", str(args.max_new_tokens),
            ],
            "fit": [
                "fit", "--config", str(repo / "configs" / "quickstart.yaml"), "--trainer.max_steps", steps,
                "--trainer.val_check_interval", steps, "--trainer.default_root_dir", str(folder / "runs"),
            ],
        }  # fmt: skip
        print(f"code: {repo}; torch threads by default: {os.cpu_count()} cores")
        for name, command in commands.items():
            if args.only not in (None, name):
                continue
            for busy in (False, True):
                seconds, err = timed(command, code, busy)
                before = re.search(r"validation before the fit: ([\d.]+) s", err)
                threads = sorted(set(re.findall(r"on (\d+) threads? \(was \d+\)", err)))
                detail = f", validation before the fit {before.group(1)} s" if before else ""
                said = f", threads chosen: {'/'.join(threads)}" if threads else ""
                where = "beside a busy process" if busy else "alone"
                print(f"{name:>4} {where:>22}: {seconds:6.1f} s{detail}{said}", flush=True)


if __name__ == "__main__":
    main()
