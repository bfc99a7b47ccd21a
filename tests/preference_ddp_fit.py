"""A preference (DPO) fit of the tiny model on 2 CPU processes (gloo), or the same fit in this process.

    python tests/preference_ddp_fit.py '{"model": ..., "train": ..., "val": ..., "out": ..., "max_steps": 2}'

Optional: ``objective`` (``dpo``, the default, or ``kto`` / ``kto-apo``: KTO, or its
``apo_zero_unpaired`` loss, on the pairs read as unpaired answers), ``strategy`` (default
``ddp_lora``), ``adapter`` (an SFT adapter to continue from; else
fresh adapters with LoRA B drawn, so that the policy is not its reference), ``batch_size`` (2),
``nan_loss_at`` (optimizer steps, 0-based) with ``fault_rank``, ``sample`` (GRPO samples from the
policy, else :class:`PromptSampler`), ``num_iterations`` (GRPO), ``validate`` (default true),
``low_memory_load``, ``ckpt_every`` (checkpoints into ``out``), ``ckpt_path``,
``precompute_reference``; ``then_precompute``: fit again in the same processes with
``precompute_reference`` (results under ``precomputed``).

:func:`start_two_processes` starts both ranks (``LOCAL_RANK`` set: Lightning launches none); each
writes ``<out>/rank<r>.pt`` (:func:`fit`'s results). :func:`fit` called in a test runs the
one-process counterpart with the same module, data and callbacks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lit_instruct.callbacks import SkipNonFiniteSteps
from lit_instruct.data.datamodule import InstructDataModule
from lit_instruct.distributed import full_tensor
from lit_instruct.models.lora import LoRAConfig
from lit_instruct.objectives import DPO, GRPO, KTO, Objective
from lit_instruct.objectives.sampler import Completion
from lit_instruct.train.module import InstructLoRAModule
from tests.ddp_fit import free_port
from tests.helpers import FaultyModule


class PreferenceFaulty(FaultyModule, InstructLoRAModule):
    """A NaN loss in the micro-batches of chosen optimizer steps (``nan_loss_at``: 0-based, across
    epochs), on ``fault_rank`` only if given. Counts the reference passes (the model switched to the
    reference): all of them, and those inside the training and validation steps."""

    grads: list[dict[str, torch.Tensor]]
    reference_passes = 0
    step_reference_passes = 0

    def reference_model(self):
        self.reference_passes += 1
        return super().reference_model()

    def objective_sums(self, batch):
        before = self.reference_passes
        try:
            return super().objective_sums(batch)
        finally:
            self.step_reference_passes += self.reference_passes - before

    def _faulty_here(self, steps: set[int]) -> bool:
        return (self.fault_rank is None or self.global_rank == self.fault_rank) and self.global_step in steps

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        """Record the gradients the optimizer is given (whole: gathered under FSDP, a collective)."""
        grads = {n: full_tensor(p.grad) for n, p in self.named_parameters() if p.grad is not None}
        self.grads = [*getattr(self, "grads", []), {n: g.clone() for n, g in grads.items()}]
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)


class StepRecorder(L.Callback):
    """After every optimizer step: the logged ``train/`` metrics and the LoRA weights (whole: gathered
    from the shards under FSDP, a collective); after every validation, the ``val/`` metrics."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []
        self.weights: list[dict[str, torch.Tensor]] = []
        self.validations: list[tuple[int, dict[str, float]]] = []
        self._step = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self._step:  # a micro-batch inside an accumulation window
            return
        self._step = trainer.global_step
        objective = pl_module.objective
        names = [
            "loss",
            objective.count_name,
            *objective.metrics(dict.fromkeys(objective.metric_names, 1.0), 1),
        ]
        logged = trainer.callback_metrics
        self.steps.append(
            {name: float(logged[f"train/{name}"]) for name in names if f"train/{name}" in logged}
        )
        trained = ((n, p) for n, p in pl_module.named_parameters() if p.requires_grad)
        self.weights.append({n: full_tensor(p.detach()).clone() for n, p in trained})

    def on_validation_end(self, trainer, pl_module) -> None:
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}
        self.validations.append((trainer.global_step, metrics))


def length_reward(prompts, completions, completion_ids, **columns) -> list[float]:
    """GRPO's test reward: a completion's tokens over 4, plus its first token modulo 3 over 3 (a
    group's completions differ: :class:`PromptSampler`'s in length, sampled ones in tokens)."""
    return [len(ids) / 4 + (ids[0] % 3) / 3 for ids in completion_ids]


class PromptSampler:
    """Completions that depend only on the prompt (its last tokens, reversed, as many as its length
    modulo 5 plus the generation's index, then the end of turn): the same on any rank and process."""

    def __init__(self, eos: int) -> None:
        self.eos = eos

    def sample(self, model, prompt_ids, num_generations, seed):
        return [
            Completion([*ids[::-1][: 1 + (len(ids) + g) % 5], self.eos], False)
            for ids in prompt_ids
            for g in range(num_generations)
        ]


def objective_of(args: dict[str, Any]) -> Objective:
    """The objective ``args`` name: DPO (precomputing its reference or not), KTO (β 1: the KL
    estimate moves the loss), KTO's ``apo_zero_unpaired`` (β 0.1) or GRPO (``dapo``, with a KL term;
    ``num_iterations`` from ``args``)."""
    name = args.get("objective", "dpo")
    if name == "grpo":
        rewards = [{"function": "tests.preference_ddp_fit:length_reward"}]
        return GRPO(
            rewards=rewards,
            num_generations=2,
            max_completion_length=8,
            beta=0.04,
            num_iterations=args.get("num_iterations", 1),
            merge_for_sampling=False,  # an FSDP shard is not merged: both sides sample through LoRA
        )
    if name == "dpo":
        return DPO(precompute_reference=args.get("precompute_reference", False))
    if name == "kto-apo":
        return KTO(loss_type="apo_zero_unpaired")  # beta 0.1: gradients of DPO's size (its tolerance)
    return KTO(beta=1.0)


def setup(args: dict[str, Any], batch_size: int) -> tuple[InstructLoRAModule, InstructDataModule]:
    """The module and data, the same in every process (``batch_size`` pairs a micro-batch)."""
    L.seed_everything(0)
    adapter = args.get("adapter")
    module = PreferenceFaulty(
        model=args["model"],
        lora=None if adapter else LoRAConfig(r=4, alpha=8),
        adapter=adapter,
        learning_rate=1e-2,
        warmup_steps=0,
        low_memory_load=args.get("low_memory_load", False),
        nan_loss_at=tuple(args.get("nan_loss_at", ())),
        fault_rank=args.get("fault_rank"),
        objective=objective_of(args),
    )
    if adapter is None:
        generator = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for name, p in module.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
    prompts = module.objective.batch_kind == "prompts"
    data = InstructDataModule(
        batch_kind=module.objective.batch_kind,
        tokenizer=args["model"],
        train_files=[args["prompts_train" if prompts else "train"]],
        val_files=[args["prompts_val" if prompts else "val"]],
        batch_size=batch_size,
        eval_batch_size=2,
    )
    if prompts and not args.get("sample"):  # completions that depend on the prompt only
        tokenizer = data.load_tokenizer()
        module.objective.bind(tokenizer, PromptSampler(tokenizer.eos_token_id))
    return module, data


def fit(args: dict[str, Any], devices: int = 2, accumulate_grad_batches: int = 1) -> dict[str, Any]:
    """Fit on ``devices`` processes (``args["strategy"]`` for several); this rank's results: the
    ``train/`` metrics, whole LoRA gradients (none for a skipped step) and weights of every step, the
    ``val/`` metrics of every validation, the skipped steps, the world."""
    module, data = setup(args, args.get("batch_size", 2))
    recorder, skip = StepRecorder(), SkipNonFiniteSteps(max_consecutive=3)
    checkpoints = []
    if "ckpt_every" in args:
        every = args["ckpt_every"]
        checkpoints.append(ModelCheckpoint(dirpath=args["out"], every_n_train_steps=every, save_top_k=-1))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=args.get("strategy", "ddp_lora") if devices > 1 else "auto",
        max_steps=args["max_steps"],
        accumulate_grad_batches=accumulate_grad_batches,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=bool(checkpoints),
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=args["out"],
        callbacks=[skip, recorder, *checkpoints],
        limit_val_batches=None if args.get("validate", True) else 0,
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the ranks' (whatever the load): the same reductions in every process
    try:
        trainer.fit(module, datamodule=data, ckpt_path=args.get("ckpt_path"))
    finally:
        torch.set_num_threads(threads)
    return {
        "steps": recorder.steps,
        "weights": recorder.weights,
        "grads": getattr(module, "grads", []),
        "validations": recorder.validations,
        "skipped": skip.skipped,
        "world": trainer.world_size,
        "rank": trainer.global_rank,
        "built_on_meta": module.built_on_meta,
        "reference_passes": module.reference_passes,
        "step_reference_passes": module.step_reference_passes,
    }


def start_two_processes(args: dict[str, Any]) -> list[subprocess.Popen]:
    """Start both ranks of this script at once (as a launcher that sets ``LOCAL_RANK`` does: they
    load in parallel, and the caller may work meanwhile); :func:`results` waits for them."""
    root, port = Path(__file__).parents[1], free_port()
    Path(args["out"]).mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(root), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    env |= {"WORLD_SIZE": "2", "NODE_RANK": "0"}
    command = [sys.executable, __file__, json.dumps(args)]
    return [subprocess.Popen(command, cwd=root, env={**env, "LOCAL_RANK": str(r)}) for r in range(2)]


def results(processes: list[subprocess.Popen], args: dict[str, Any]) -> list[dict[str, Any]]:
    """Both ranks' results once they have ended; a rank that fails ends the other (which would wait
    for it in a collective until the process group's timeout)."""
    deadline = time.monotonic() + 300
    try:
        while any(p.poll() is None for p in processes) and time.monotonic() < deadline:
            if any(p.poll() for p in processes):
                break
            time.sleep(0.2)
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
    codes = [process.wait() for process in processes]
    assert codes == [0, 0], f"the ranks exited with {codes}"
    return [torch.load(Path(args["out"]) / f"rank{r}.pt", weights_only=True) for r in range(2)]


def main(args: dict[str, Any]) -> None:
    """Fit; with ``resume_at`` (a step that ``ckpt_every`` checkpointed), fit again in these processes
    from that checkpoint (into ``<out>/resumed``): its results are under ``resumed``; with
    ``then_precompute``, fit again with ``precompute_reference`` (into ``<out>/precomputed``)."""
    result = fit(args)
    if args.get("then_precompute"):
        rest = {k: v for k, v in args.items() if k != "then_precompute"}
        into = str(Path(args["out"]) / "precomputed")
        result["precomputed"] = fit({**rest, "out": into, "precompute_reference": True})
    if "resume_at" in args:
        out = Path(args["out"])
        checkpoint = out / f"epoch=0-step={args['resume_at']}.ckpt"
        again = {k: v for k, v in args.items() if k not in ("ckpt_every", "resume_at")}
        result["resumed"] = fit({**again, "out": str(out / "resumed"), "ckpt_path": str(checkpoint)})
    torch.save(result, Path(args["out"]) / f"rank{result['rank']}.pt")


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
