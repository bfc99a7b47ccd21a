"""FSDP2 (``fsdp_lora``, Lightning's ModelParallelStrategy) on 2 CPU processes (gloo): the same
training as one process, adapter-only checkpoints, exact resume, NaN skipped on both ranks; and the
loss's refusal of a sharded lm_head weight."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lit_instruct.distributed import full_tensor, is_sharded
from lit_instruct.loss.fused import fused_linear_cross_entropy
from lit_instruct.loss.reference import reference_linear_cross_entropy
from tests.ddp_fit import run_ddp_fit
from tests.helpers import Recorder, make, trainer


@pytest.fixture
def varied_file(tmp_path: Path) -> Path:
    """Answers of 1 to ~50 tokens: token weighting over ranks matters. Eight: none is held out
    (8 x 0.05 rounds to 0) and no rank gets a padding repeat."""
    path = tmp_path / "varied.jsonl"
    rows = [{"prompt": f"Question {i}?", "completion": " ".join(["word"] * (1 + 7 * i))} for i in range(8)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.mark.slow
@pytest.mark.parametrize("low_memory_load", [False, True])
def test_fsdp_with_the_fused_loss_equals_one_process(
    tiny_model_dir, varied_file, tmp_path, low_memory_load
) -> None:
    """With ``low_memory_load`` rank 1 builds the base on the meta device and gets its shards (and the
    LoRA initialisation) from rank 0: the same training."""
    steps, accumulate = 3, 2
    args = {"model": str(tiny_model_dir), "data": str(varied_file), "out": str(tmp_path / "fsdp")}
    args.update(max_steps=steps, batch_size=1, accumulate_grad_batches=accumulate, strategy="fsdp_lora")
    ranks = run_ddp_fit({**args, "low_memory_load": low_memory_load})
    assert [rank["built_on_meta"] for rank in ranks] == [False, low_memory_load]

    module, data = make(tiny_model_dir, varied_file, batch_size=2)  # the same global batches, one process
    recorder = Recorder()
    run = trainer(tmp_path / "one", max_steps=steps, accumulate_grad_batches=accumulate, limit_val_batches=0)
    run.callbacks.append(recorder)
    run.fit(module, datamodule=data)

    for rank in ranks:  # the window's token-weighted loss, all-reduced: equal on both ranks
        torch.testing.assert_close(
            torch.tensor(rank["losses"][accumulate - 1 :: accumulate]),
            torch.tensor(recorder.losses[accumulate - 1 :: accumulate]),
            atol=1e-5,
            rtol=0,
        )
    single = module.trainable_state_dict()
    checkpoint = torch.load(tmp_path / "fsdp" / "last.ckpt", weights_only=True)
    assert checkpoint["state_dict"].keys() == single.keys()  # adapter only: the base is never gathered
    adapter = load_file(tmp_path / "fsdp" / "adapter" / "adapter_model.safetensors")
    assert len(adapter) == len(single)
    for name, value in single.items():
        torch.testing.assert_close(checkpoint["state_dict"][name], value, atol=1e-5, rtol=0)
        peft_name = name.removeprefix("model.").replace(".default.", ".")
        torch.testing.assert_close(adapter[peft_name], value, atol=1e-5, rtol=0, msg=name)


@pytest.mark.slow
def test_fsdp_resumes_exactly_and_skips_a_nan_on_both_ranks(tiny_model_dir, varied_file, tmp_path) -> None:
    common = {"model": str(tiny_model_dir), "data": str(varied_file), "strategy": "fsdp_lora"}
    common.update(batch_size=1, fault_rank=1, nan_loss_at=[1])  # rank 1's loss is NaN at step 1
    # the uninterrupted run's checkpoint at step 3 is the one a run stopped there writes
    full = run_ddp_fit({**common, "out": str(tmp_path / "full"), "max_steps": 5, "ckpt_every": 3})
    assert [rank["skipped"] for rank in full] == [1, 1]
    path = tmp_path / "full" / "epoch=0-step=3.ckpt"
    resumed = run_ddp_fit(
        {**common, "out": str(tmp_path / "resumed"), "max_steps": 5, "ckpt_path": str(path)}
    )
    for rank in (0, 1):
        torch.testing.assert_close(
            torch.tensor(resumed[rank]["losses"]), torch.tensor(full[rank]["losses"][3:]), atol=1e-6, rtol=0
        )


def test_the_loss_refuses_a_sharded_lm_head_and_full_tensor_gathers_it(tmp_path) -> None:
    """A one-process gloo group: a DTensor weight is refused by both losses, and gathered whole."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        weight = torch.randn(11, 4)
        sharded = distribute_tensor(weight, mesh, [Shard(0)])
        hidden, labels = torch.randn(3, 4), torch.tensor([1, 2, 3])
        assert is_sharded(sharded) and not is_sharded(weight)
        for loss in (reference_linear_cross_entropy, fused_linear_cross_entropy):
            with pytest.raises(TypeError, match=r"the lm_head weight is sharded \(a DTensor of local shape"):
                loss(hidden, sharded, labels)
        whole = full_tensor(sharded)
        assert whole is not None and not is_sharded(whole)
        torch.testing.assert_close(
            reference_linear_cross_entropy(hidden, whole, labels),
            reference_linear_cross_entropy(hidden, weight, labels),
        )
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_qlora_under_fsdp_shards_the_4bit_base_and_trains_like_one_process(
    tiny_model_dir, varied_file, tmp_path
) -> None:
    """NF4 packed in the compute dtype (``bnb_4bit_quant_storage``) shards like any weight: each rank
    holds about half of the base, and the losses are one process's."""
    quantization = {"method": "nf4", "compute_dtype": "float32"}
    args = {"model": str(tiny_model_dir), "data": str(varied_file), "out": str(tmp_path / "fsdp")}
    args.update(max_steps=4, batch_size=1, strategy="fsdp_lora", quantization=quantization)
    ranks = run_ddp_fit(args)

    module, data = make(tiny_model_dir, varied_file, batch_size=2, quantization=quantization)
    recorder = Recorder()
    run = trainer(tmp_path / "one", max_steps=4, limit_val_batches=0)
    run.callbacks.append(recorder)
    run.fit(module, datamodule=data)

    for rank in ranks:
        torch.testing.assert_close(
            torch.tensor(rank["losses"]), torch.tensor(recorder.losses), atol=1e-5, rtol=0
        )
        assert 0.45 < rank["base_bytes"] / rank["base_bytes_whole"] < 0.6
    assert recorder.losses[-1] < recorder.losses[0]


def test_low_memory_load_needs_the_sharding_strategy(tiny_model_dir, chat_file, tmp_path) -> None:
    module, data = make(tiny_model_dir, chat_file, low_memory_load=True)
    assert not module.built_on_meta  # rank 0 (no launcher here) always reads the weights
    with pytest.raises(ValueError, match=r"^model\.low_memory_load: true needs trainer\.strategy: fsdp_lora"):
        trainer(tmp_path).fit(module, datamodule=data)
