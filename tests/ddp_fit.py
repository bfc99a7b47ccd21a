"""A 2-process CPU DDP fit (gloo) of the tiny model; each rank saves what it ended with.

    python tests/ddp_fit.py '{"model": ..., "data": ..., "out": ..., "max_steps": 3, ...}'

Optional: ``strategy`` (default ``ddp``), ``lora_vision``, ``gradient_clip_val``, ``quantization``,
``low_memory_load``, ``streaming``, ``on_bad_record`` (rejects go to ``<out>/rejects.jsonl``),
``ckpt_every`` (a ModelCheckpoint every N steps into ``out``), ``stop_after`` (end the fit after N
steps, as if killed: the schedule still spans ``max_steps``), ``ckpt_path``.

Lightning's ``ddp`` launcher starts rank 1 by running this script again. Rank 0 writes
``<out>/last.ckpt``; each rank writes ``<out>/rank<r>.pt``: its LoRA weights and logged
``train/loss`` after every step, and the SkipNonFiniteSteps counters.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lit_instruct.callbacks import GenerationPreview, SampleScores, SkipNonFiniteSteps
from lit_instruct.data.datamodule import InstructDataModule
from lit_instruct.distributed import local_tensor
from lit_instruct.models.lora import LoRAConfig
from lit_instruct.train.module import InstructLoRAModule
from lit_instruct.train.strategy import LoRAFSDPStrategy
from tests.helpers import FaultyModule, Recorder, SeenSamples, StopAfter


class KillRank(L.Callback):
    """``SIGKILL`` rank ``rank`` as step ``step`` starts (an out-of-memory kill, a failed node)."""

    def __init__(self, rank: int, step: int) -> None:
        self.rank, self.step = rank, step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def validation_setup(args: dict) -> tuple[InstructLoRAModule, InstructDataModule]:
    """The tiny model (LoRA B drawn, so that the adapters count) and data validating on ``val`` (a
    list of files), the same in every process."""
    L.seed_everything(0)
    packing = args.get("packing", False)
    module = InstructLoRAModule(model=args["model"], lora=LoRAConfig(r=4, alpha=8), packing=packing)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.05)
    data = InstructDataModule(
        tokenizer=args["model"],
        train_files=[args["data"]],
        val_files=args["val"],
        eval_batch_size=args.get("eval_batch_size", 2),
        packing=packing,
    )
    return module, data


def validate(args: dict) -> None:
    """``trainer.validate`` on 2 ranks, with 3 samples scored (2 on rank 0, 1 on rank 1); each rank
    saves the logged metrics."""
    module, data = validation_setup(args)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=args.get("strategy", "ddp"),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=args["out"],
        callbacks=[SampleScores(num_samples=3, max_new_tokens=4)],
    )
    metrics = trainer.validate(module, datamodule=data, verbose=False)[0]
    torch.save({k: float(v) for k, v in metrics.items()}, Path(args["out"]) / f"rank{trainer.global_rank}.pt")


def main(args: dict) -> None:
    if args.get("validate"):
        validate(args)
        return
    L.seed_everything(0)
    module = FaultyModule(
        model=args["model"],
        lora=LoRAConfig(r=4, alpha=8, vision=args.get("lora_vision", "none")),
        learning_rate=1e-2,
        warmup_steps=0,
        nan_loss_at=tuple(args.get("nan_loss_at", ())),
        inf_grad_at=tuple(args.get("inf_grad_at", ())),
        fault_rank=args.get("fault_rank"),
        quantization=args.get("quantization"),
        low_memory_load=args.get("low_memory_load", False),
    )
    batch_size = args.get("batch_size", 1)
    data = InstructDataModule(
        tokenizer=args["model"],
        train_files=[args["data"]],
        batch_size=batch_size,
        streaming=args.get("streaming", False),
        shuffle_buffer=3,
        on_bad_record=args.get("on_bad_record", "raise"),
        rejects_file=str(Path(args["out"]) / "rejects.jsonl"),
    )
    checkpoints = (
        [ModelCheckpoint(dirpath=args["out"], every_n_train_steps=args["ckpt_every"], save_top_k=-1)]
        if "ckpt_every" in args
        else []
    )
    stop = [StopAfter(args["stop_after"])] if "stop_after" in args else []
    stop += [KillRank(*args["kill_rank_at"])] if "kill_rank_at" in args else []
    skip, recorder, seen = SkipNonFiniteSteps(max_consecutive=3), Recorder(), SeenSamples()
    preview = [GenerationPreview(args["preview"], max_new_tokens=3)] if "preview" in args else []
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.get("devices", 2),
        num_nodes=args.get("num_nodes", 1),
        strategy=LoRAFSDPStrategy(hybrid=True) if args.get("hybrid") else args.get("strategy", "ddp"),
        max_steps=args["max_steps"],
        accumulate_grad_batches=args.get("accumulate_grad_batches", 1),
        gradient_clip_val=args.get("gradient_clip_val"),
        limit_val_batches=1 if preview else 0,
        val_check_interval=2 if preview else None,
        logger=False,
        enable_checkpointing=bool(checkpoints),
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=args["out"],
        callbacks=[skip, recorder, seen, *preview, *checkpoints, *stop],
    )
    trainer.fit(module, datamodule=data, ckpt_path=args.get("ckpt_path"))
    out = Path(args["out"])
    trainer.save_checkpoint(out / "last.ckpt")  # collective: every rank's RNG states go in
    frozen = {id(p): p for p in module.parameters() if not p.requires_grad}.values()  # tied: once
    result = {
        "built_on_meta": module.built_on_meta,
        "base_bytes": sum(local_tensor(p).nbytes for p in frozen),  # this rank's share
        "base_bytes_whole": sum(p.numel() * p.element_size() for p in frozen),
        "weights_per_step": [weights for weights, _, _ in recorder.states],
        "losses": recorder.losses,
        "samples": seen.seen,
        "skipped": skip.skipped,
        "consecutive": skip.consecutive,
        "world": [trainer.world_size, trainer.num_nodes, trainer.node_rank, trainer.local_rank],
        "environment": type(trainer.strategy.cluster_environment).__name__,
    }
    torch.save(result, out / f"rank{trainer.global_rank}.pt")


def run_ddp_fit(args: dict[str, Any]) -> list[dict[str, Any]]:
    """Run this script in a fresh process (which starts the other ranks); return every rank's results."""
    root = Path(__file__).parents[1]
    subprocess.run(
        [sys.executable, __file__, json.dumps(args)],
        check=True,
        timeout=300,
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    ranks = range(args.get("devices", 2))
    return [torch.load(Path(args["out"]) / f"rank{r}.pt", weights_only=True) for r in ranks]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def run_two_nodes(args: dict[str, Any], launcher: str, per_node: int = 1) -> list[dict[str, Any]]:
    """This script as two "nodes" of ``per_node`` processes each on this machine, started the way
    clusters do: ``torchrun --nnodes 2 --nproc-per-node N`` (static rendezvous on 127.0.0.1) or
    with the ``SLURM_*`` variables ``srun`` sets; every rank's results."""
    root, port = Path(__file__).parents[1], free_port()
    args = {**args, "devices": per_node, "num_nodes": 2}
    script = [__file__, json.dumps(args)]
    processes = []
    for node in (0, 1):
        env = {**os.environ, "PYTHONPATH": str(root)}
        if launcher == "torchrun":
            torchrun = ["-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", str(per_node)]
            torchrun += ["--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port)]
            processes.append(subprocess.Popen([sys.executable, *torchrun, *script], cwd=root, env=env))
            continue
        for local in range(per_node):  # what srun sets for --nodes 2 --ntasks-per-node N
            task = {"SLURM_PROCID": str(node * per_node + local), "SLURM_LOCALID": str(local)}
            task |= {"SLURM_NTASKS": str(2 * per_node), "SLURM_NTASKS_PER_NODE": str(per_node)}
            task |= {"SLURM_NNODES": "2", "SLURM_NODEID": str(node), "SLURM_JOB_NAME": "lit-instruct"}
            task |= {"SLURM_JOB_ID": "4242", "SLURM_NODELIST": "127.0.0.1", "MASTER_PORT": str(port)}
            processes.append(subprocess.Popen([sys.executable, *script], cwd=root, env={**env, **task}))
    codes = [process.wait(timeout=300) for process in processes]
    assert codes == [0] * len(codes), codes
    return [torch.load(Path(args["out"]) / f"rank{r}.pt", weights_only=True) for r in range(2 * per_node)]


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
