"""Validation on 2 processes equals 1 process, each sample counted once, when the validation samples
do not divide over the ranks (a plain DistributedSampler counted its padding repeats): DDP and FSDP,
overall and per source, padded and packed."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import lightning as L
import pytest
import torch

from lit_instruct.callbacks import SampleScores
from lit_instruct.data.datamodule import InstructDataModule
from lit_instruct.data.even_shards import EvenShards, UncountedPadding
from lit_instruct.labels import IGNORE_INDEX
from tests.ddp_fit import run_ddp_fit, validation_setup
from tests.helpers import write_chats

VAL_CHATS = [
    [("user", "Name a colour."), ("assistant", "Green, like grass.")],
    [("user", "What is 3 times 3?"), ("assistant", "Nine.")],
    [("user", "Say goodbye."), ("assistant", "Goodbye!"), ("user", "Again."), ("assistant", "Bye now!")],
    [("user", "Which planet is red?"), ("assistant", "Mars, the red planet.")],
    [("system", "Be brief."), ("user", "Capital of Italy?"), ("assistant", "Rome.")],
    [("user", "Count to three."), ("assistant", "One, two, three.")],
    [("user", "Opposite of hot?"), ("assistant", "Cold.")],
    [("user", "A word for happy?"), ("assistant", "Joyful, or glad.")],
]


def test_even_shards_take_every_sample_once_and_mark_the_padding() -> None:
    samples = list(range(9))
    shards = [list(EvenShards(samples, 4, rank)) for rank in range(4)]
    assert [len(s) for s in shards] == [3, 3, 3, 3]
    real = sorted(i for s in shards for i in s if i >= 0)
    assert real == samples
    assert sorted(i for s in shards for i in s if i < 0) == [-3, -2, -1]  # samples 0, 1, 2 again


def test_a_padding_repeat_counts_no_label(tiny_model_dir: Path) -> None:
    from lit_instruct.data.render import Sample

    samples = [Sample([1, 2, 3], [IGNORE_INDEX, 2, 3], "s")]
    assert UncountedPadding(samples)[0] == samples[0]
    assert UncountedPadding(samples)[-1].labels == [IGNORE_INDEX] * 3
    assert UncountedPadding(samples)[-1].input_ids == [1, 2, 3]


@pytest.mark.slow
# DDP unpadded rows validate in tests/test_preference_distributed.py's DDP cases
@pytest.mark.parametrize(("strategy", "packing"), [("fsdp_lora", False), ("ddp", True)])
def test_validation_on_two_processes_equals_one(
    strategy: str, packing: bool, tiny_model_dir: Path, chat_file: Path, tmp_path: Path
) -> None:
    val = []
    for name, chats in (("a", VAL_CHATS[:5]), ("b", VAL_CHATS[5:])):  # 5 and 3: odd, over 2 ranks
        val.append(str(write_chats(tmp_path / f"{name}.jsonl", chats)))
    args = {"validate": True, "model": str(tiny_model_dir), "data": str(chat_file), "val": val}
    args |= {"out": str(tmp_path), "strategy": strategy, "packing": packing}
    ranks = run_ddp_fit(args)
    module, data = validation_setup(args)
    one = L.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path / "one",  # where samples.md goes
        callbacks=[SampleScores(num_samples=3, max_new_tokens=4)],  # as the ranks: their shares, reduced
    )
    expected = {k: float(v) for k, v in one.validate(module, datamodule=data, verbose=False)[0].items()}
    assert {"val/loss", "val/tokens", "val/loss/a", "val/loss/b", "val/gen/chrf"} <= set(expected)
    for metrics in ranks:
        assert metrics.keys() == expected.keys()
        for key, value in expected.items():
            torch.testing.assert_close(metrics[key], value, rtol=1e-5, atol=0, msg=key)


def assert_trains_as_one_process(
    ranks: list[dict], model: Path, data_file: Path, global_batch: int, steps: int, out: Path
) -> None:
    """The ranks' losses and the adapter their checkpoint holds equal one process's with the global batch."""
    from tests.helpers import Recorder, make, trainer

    module, data = make(model, data_file, batch_size=global_batch)
    recorder = Recorder()
    run = trainer(out.parent / "one", max_steps=steps, limit_val_batches=0, callbacks=[recorder])
    run.fit(module, datamodule=data)
    for rank in ranks:
        torch.testing.assert_close(
            torch.tensor(rank["losses"]), torch.tensor(recorder.losses), atol=1e-5, rtol=0
        )
    saved = torch.load(out / "last.ckpt", weights_only=True)["state_dict"]
    single = module.trainable_state_dict()
    assert saved.keys() == single.keys()
    for name, value in single.items():
        torch.testing.assert_close(saved[name], value, atol=1e-5, rtol=0, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize(("launcher", "strategy"), [("torchrun", "fsdp_lora"), ("slurm", "ddp_lora")])
def test_two_nodes_train_as_one_process(
    launcher: str, strategy: str, tiny_model_dir: Path, chat_file: Path, tmp_path: Path
) -> None:
    """Two "nodes" of one process each, launched as clusters launch them: the same losses and adapter
    as one process with their global batch; the checkpoint written once, by rank 0. Each launcher and
    each strategy once: the launcher sets the ranks (its cluster environment, asserted), which both
    strategies read alike; hybrid sharding over nodes has its own test."""
    from tests.ddp_fit import run_two_nodes

    steps = 2
    args = {"model": str(tiny_model_dir), "data": str(chat_file), "out": str(tmp_path / "nodes")}
    ranks = run_two_nodes({**args, "max_steps": steps, "batch_size": 1, "strategy": strategy}, launcher)
    environment = {"torchrun": "TorchElasticEnvironment", "slurm": "SLURMEnvironment"}[launcher]
    assert [(r["world"], r["environment"]) for r in ranks] == [([2, 2, n, 0], environment) for n in (0, 1)]

    assert_trains_as_one_process(ranks, tiny_model_dir, chat_file, 2, steps, tmp_path / "nodes")


def test_a_cache_folder_another_node_put_in_place_first_is_kept(tmp_path: Path) -> None:
    """Two nodes sharing a file system prepare the same data cache at once: the second to finish
    keeps the first's folder (the same contents by its key) instead of failing on the rename."""
    from lit_instruct.io import atomic_directory

    target = tmp_path / "key"
    with atomic_directory(target, replace=False) as staging:
        (staging / "meta.json").write_text("second")
        target.mkdir()  # the other node finished in between
        (target / "meta.json").write_text("first")
    assert (target / "meta.json").read_text() == "first"
    assert [p.name for p in tmp_path.iterdir()] == ["key"]  # no staging folder left


def test_the_launching_rank_is_read_from_srun_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the first rank prepares the data before the model loads, under srun as under torchrun."""
    from lit_instruct.distributed import launched_rank

    for name in ("RANK", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    assert launched_rank() == 0
    monkeypatch.setenv("SLURM_PROCID", "3")
    assert launched_rank() == 0  # one task (an interactive allocation): not a rank of a job
    monkeypatch.setenv("SLURM_NTASKS", "4")
    assert launched_rank() == 3


@pytest.mark.slow
def test_hybrid_sharding_on_two_nodes_of_two_trains_as_one_process(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """HSDP (``fsdp_lora`` with ``hybrid: true``): 2 nodes x 2 processes, each rank holding half
    the base (its node's shard, not a quarter), the same training as one process with batch 4."""
    from tests.ddp_fit import run_two_nodes

    steps = 2
    eight = write_chats(tmp_path / "eight.jsonl", VAL_CHATS)  # 2 global batches of 4: no repeats
    args = {"model": str(tiny_model_dir), "data": str(eight), "out": str(tmp_path / "hsdp")}
    ranks = run_two_nodes(
        {**args, "max_steps": steps, "batch_size": 1, "hybrid": True}, "torchrun", per_node=2
    )
    assert [r["world"] for r in ranks] == [[4, 2, node, local] for node in (0, 1) for local in (0, 1)]
    for rank in ranks:  # the decoder's weights halved; the whole embedding and head stay in the count
        assert 0.45 < rank["base_bytes"] / rank["base_bytes_whole"] < 0.6

    assert_trains_as_one_process(ranks, tiny_model_dir, eight, 4, steps, tmp_path / "hsdp")


@pytest.mark.slow
def test_a_two_process_checkpoint_resumes_on_four(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Stopped after 1 of its 4 steps an epoch, a 2-process DDP run resumes on 4 processes: the
    epoch's other samples trained, each once (the 4 ranks' batches of 1 after the 2 ranks' one)."""
    from tests.ddp_fit import run_ddp_fit

    eight = write_chats(tmp_path / "eight.jsonl", VAL_CHATS)
    args = {"model": str(tiny_model_dir), "data": str(eight), "strategy": "ddp_lora", "batch_size": 1}
    two = run_ddp_fit(
        {**args, "out": str(tmp_path / "two"), "max_steps": 4, "stop_after": 1, "ckpt_every": 1}
    )
    checkpoint = str(tmp_path / "two" / "epoch=0-step=1.ckpt")
    four = run_ddp_fit(
        {**args, "out": str(tmp_path / "four"), "max_steps": 3, "devices": 4, "ckpt_path": checkpoint}
    )
    assert len(four) == 4
    epoch0 = [ids for rank in [*two, *four] for epoch, ids in rank["samples"] if epoch == 0]
    data = InstructDataModule(tokenizer=str(tiny_model_dir), train_files=[str(eight)])  # as ddp_fit's
    data.setup("fit")
    expected = sorted(tuple(data.train_samples[i].input_ids) for i in range(len(data.train_samples)))
    assert sorted(epoch0) == expected


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp_lora", "fsdp_lora"])
def test_a_two_process_checkpoint_resumes_on_one_training_each_sample_once(
    strategy: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Stopped after 2 of its 4 steps an epoch, a 2-process run resumes on 1 process (batch 3): the
    optimizer state and the adapter as written, the epoch's other samples trained, each once."""
    from lit_instruct.data.datamodule import InstructDataModule
    from tests.ddp_fit import run_ddp_fit
    from tests.helpers import Recorder, SeenSamples, make, trainer

    eight = write_chats(tmp_path / "eight.jsonl", VAL_CHATS)
    args = {
        "model": str(tiny_model_dir),
        "data": str(eight),
        "out": str(tmp_path / "two"),
        "strategy": strategy,
    }
    ranks = run_ddp_fit({**args, "max_steps": 6, "batch_size": 1, "stop_after": 2, "ckpt_every": 2})
    checkpoint = tmp_path / "two" / "epoch=0-step=2.ckpt"
    written = torch.load(checkpoint, weights_only=True)

    module, _ = make(tiny_model_dir, eight)
    data = InstructDataModule(
        tokenizer=str(tiny_model_dir), train_files=[str(eight)], batch_size=3
    )  # as ddp_fit's
    seen, recorder = SeenSamples(), Recorder()
    run = trainer(tmp_path / "one", max_steps=6, limit_val_batches=0, callbacks=[seen, recorder])
    resumed: list[dict] = []
    module.on_train_start = lambda: resumed.append(
        {k: v.clone() for k, v in module.trainable_state_dict().items()}
    )
    run.fit(module, datamodule=data, ckpt_path=str(checkpoint))
    for name, value in written["state_dict"].items():
        torch.testing.assert_close(resumed[0][name], value, rtol=0, atol=0, msg=name)
    assert len(run.optimizers[0].state) == len(written["optimizer_states"][0]["state"]) > 0

    epoch0 = [ids for rank in ranks for epoch, ids in rank["samples"] if epoch == 0]
    epoch0 += [ids for epoch, ids in seen.seen if epoch == 0]
    expected = sorted(tuple(data.train_samples[i].input_ids) for i in range(len(data.train_samples)))
    assert sorted(epoch0) == expected  # each training sample once (half by the two ranks)
    assert run.global_step == 6 and torch.isfinite(torch.tensor(recorder.losses)).all()


@pytest.mark.slow
@pytest.mark.parametrize(  # QLoRA+FSDP only: a plain FSDP run's adapter takes the same export path
    "quantization", [{"method": "nf4", "compute_dtype": "float32"}], ids=["qlora"]
)
def test_a_sharded_runs_adapter_merges_exports_generates_and_evaluates(
    quantization: dict | None,
    tiny_model_dir: Path,
    chat_file: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture,
) -> None:
    """What a 2-process FSDP run (and QLoRA+FSDP) wrote: merged equal to peft's own merge, exported
    as a GGUF LoRA file with every adapted layer and as a merged GGUF, taken by ``generate`` and
    ``eval``."""
    import gguf
    from peft import PeftModel
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from lit_instruct.cli import main
    from tests.ddp_fit import run_ddp_fit

    args = {"model": str(tiny_model_dir), "data": str(chat_file), "out": str(tmp_path / "fsdp")}
    args |= {"strategy": "fsdp_lora", "max_steps": 2, "batch_size": 1}
    run_ddp_fit({**args, **({"quantization": quantization} if quantization else {})})
    adapter = str(tmp_path / "fsdp" / "adapter")

    main(["export", "--adapter", adapter, "--out", str(tmp_path / "merged"), "--merge"])
    reference = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), adapter)
    ids = torch.tensor([[1, 520, 9531, 198, 4093, 30]])
    with torch.no_grad():
        expected = reference.merge_and_unload()(ids).logits
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")(ids).logits
    torch.testing.assert_close(merged, expected, rtol=1e-5, atol=1e-5)

    main(["export", "--adapter", adapter, "--out", str(tmp_path / "adapter.gguf"), "--gguf-adapter"])
    names = [t.name for t in gguf.GGUFReader(tmp_path / "adapter.gguf").tensors]
    adapted = [k for k in safe_open(f"{adapter}/adapter_model.safetensors", "pt").keys() if "lora_A" in k]  # noqa: SIM118
    assert sum(name.endswith(".lora_a") for name in names) == len(adapted) > 0

    main(["export", "--adapter", adapter, "--out", str(tmp_path / "merged.gguf"), "--gguf", "--quant", "f32"])
    merged_tensors = {t.name for t in gguf.GGUFReader(tmp_path / "merged.gguf").tensors}
    assert {"token_embd.weight", "blk.0.attn_q.weight", "blk.1.ffn_down.weight"} <= merged_tensors

    main(["generate", "--adapter", adapter, "--prompt", "Hi", "--max-new-tokens", "3"])
    main(["eval", "--adapter", adapter, "--data", str(chat_file), "--max-seq-len", "64"])
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("adapter"))
    assert all(float(value) == float(value) for value in row.split()[1:])  # finite numbers, no nan


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp_lora", "fsdp_lora"])
def test_a_killed_rank_stops_the_others_with_one_line_and_the_checkpoint_resumes(
    strategy: str, tiny_model_dir: Path, chat_file: Path, tmp_path: Path
) -> None:
    """Rank 1 SIGKILLed as step 3 starts: rank 0 stops within seconds (not the collective's timeout)
    naming what happened, and the step-2 checkpoint is whole and resumes."""
    import subprocess
    import sys
    import time

    from tests.helpers import make, trainer

    root = Path(__file__).parents[1]
    args = {
        "model": str(tiny_model_dir),
        "data": str(chat_file),
        "out": str(tmp_path / "run"),
        "strategy": strategy,
    }
    args |= {"max_steps": 6, "batch_size": 1, "ckpt_every": 2, "kill_rank_at": [1, 2]}
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, str(root / "tests" / "ddp_fit.py"), json.dumps(args)],
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode != 0 and time.monotonic() - start < 120
    assert "lit-instruct: another rank of this job was lost" in done.stderr
    module, data = make(tiny_model_dir, chat_file, batch_size=2)
    run = trainer(tmp_path / "resumed", max_steps=3, limit_val_batches=0)
    run.fit(module, datamodule=data, ckpt_path=str(tmp_path / "run" / "epoch=0-step=2.ckpt"))
    assert run.global_step == 3


def test_the_strategies_wait_minutes_not_half_an_hour_for_a_lost_rank() -> None:
    from datetime import timedelta

    from lit_instruct.train.strategy import LoRADDPStrategy, LoRAFSDPStrategy

    assert LoRADDPStrategy()._timeout == LoRAFSDPStrategy()._timeout == timedelta(minutes=10)
    assert LoRADDPStrategy(timeout_minutes=2.5)._timeout == timedelta(minutes=2.5)


def test_a_restarted_run_picks_up_its_last_checkpoint_by_itself(
    tiny_model_dir: Path, chat_file: Path, tmp_path: Path
) -> None:
    """``--ckpt_path last`` (what a ``torchrun --max-restarts`` job passes on every start): a fresh
    start where there is none yet, the last checkpoint after a restart."""
    from lit_instruct.callbacks import AdapterCheckpoint
    from tests.helpers import Recorder, StopAfter, make, trainer

    def start(stop: int | None) -> tuple[L.Trainer, int]:
        module, data = make(tiny_model_dir, chat_file)
        keep = AdapterCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_last=True)
        recorder = Recorder()
        run = trainer(tmp_path, max_steps=4, limit_val_batches=0, enable_checkpointing=True)
        run.callbacks[:0] = [keep, recorder, *([StopAfter(stop)] if stop else [])]
        with pytest.warns(UserWarning, match="no last checkpoint") if stop else contextlib.nullcontext():
            run.fit(module, datamodule=data, ckpt_path="last")
        return run, len(recorder.losses)

    first, trained = start(stop=2)  # killed after step 2, as it were
    assert (first.global_step, trained) == (2, 2)
    restarted, trained = start(stop=None)
    assert (restarted.global_step, trained) == (4, 2)  # steps 3 and 4 only
    assert (tmp_path / "ckpt" / "last.ckpt").is_file() and (tmp_path / "ckpt" / "last-adapter").is_dir()


@pytest.mark.slow
def test_an_epochs_uneven_last_batch_on_two_ranks_trains_as_one_process(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """5 samples on 2 ranks of batch 1: the third step's global batch holds one sample and one
    repeat that evens out the ranks; the repeat counts no token, so every step is one process's."""
    from lit_instruct.data.datamodule import InstructDataModule
    from tests.ddp_fit import run_ddp_fit
    from tests.helpers import make, trainer

    five = write_chats(tmp_path / "five.jsonl", VAL_CHATS[:5])
    args = {"model": str(tiny_model_dir), "data": str(five), "out": str(tmp_path / "two"), "batch_size": 1}
    ranks = run_ddp_fit({**args, "max_steps": 3, "strategy": "ddp_lora"})
    module, _ = make(tiny_model_dir, five)
    data = InstructDataModule(
        tokenizer=str(tiny_model_dir), train_files=[str(five)], batch_size=2
    )  # as ddp_fit's
    run = trainer(tmp_path / "one", max_steps=3, limit_val_batches=0)
    run.fit(module, datamodule=data)
    for rank in ranks:
        for name, value in module.trainable_state_dict().items():
            torch.testing.assert_close(rank["weights_per_step"][-1][name], value, atol=1e-5, rtol=0, msg=name)
